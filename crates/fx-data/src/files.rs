//! Durable file writes and content hashes, for every crate that saves something a run
//! depends on (tensor files, INT8 files, run checkpoints and manifests).
//!
//! [`write_atomic`] never leaves a half-written file under the final name: the bytes go to
//! a temporary sibling, are synced, renamed over the target, and the folder is synced so
//! the rename survives a power cut (where the platform lets a folder be opened; elsewhere
//! the rename is still atomic). [`sha256_file`] streams a file through SHA-256.

use std::fs::File;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

/// Writes `bytes` to `path` atomically (see the module docs). On error the temporary file
/// is removed and the error is the operation's own (the caller names the path).
pub fn write_atomic(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let tmp = temporary_sibling(path)?;
    let result = (|| {
        let mut f = File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
        return result;
    }
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        if let Ok(d) = File::open(dir) {
            let _ = d.sync_all();
        }
    }
    Ok(())
}

/// `.<name>.tmp.<pid>` beside `path`: hidden, and one per process, so two processes
/// writing the same file never share a temporary.
fn temporary_sibling(path: &Path) -> std::io::Result<PathBuf> {
    let name = path
        .file_name()
        .ok_or_else(|| std::io::Error::new(std::io::ErrorKind::InvalidInput, "the path has no file name"))?;
    Ok(path.with_file_name(format!(".{}.tmp.{}", name.to_string_lossy(), std::process::id())))
}

/// SHA-256 of the file at `path`, as lower-case hex, read in 1 MiB pieces.
pub fn sha256_file(path: &Path) -> std::io::Result<String> {
    use sha2::{Digest, Sha256};
    let mut f = File::open(path)?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(h.finalize().iter().map(|b| format!("{b:02x}")).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_replace_the_file_and_leave_no_temporary() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("a.bin");
        write_atomic(&p, b"first").unwrap();
        write_atomic(&p, b"second").unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), b"second");
        let names: Vec<_> = std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(names, vec![std::ffi::OsString::from("a.bin")]);
    }

    #[test]
    fn a_failed_write_keeps_the_old_file() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("a.bin");
        write_atomic(&p, b"kept").unwrap();
        // A folder where the file should go: the rename fails, nothing is lost.
        let blocked = dir.path().join("sub");
        std::fs::create_dir(&blocked).unwrap();
        assert!(write_atomic(&blocked, b"x").is_err());
        assert_eq!(std::fs::read(&p).unwrap(), b"kept");
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 2);
        assert!(write_atomic(Path::new("/"), b"x").is_err());
    }

    #[test]
    fn sha256_matches_the_published_vector() {
        // FIPS 180-2's "abc" example.
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("abc");
        std::fs::write(&p, b"abc").unwrap();
        assert_eq!(sha256_file(&p).unwrap(), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
        assert!(sha256_file(&dir.path().join("missing")).is_err());
    }
}
