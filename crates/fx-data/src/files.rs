//! Durable file writes and content hashes, for every crate that saves something a run
//! depends on (tensor files, INT8 files, run checkpoints and manifests).
//!
//! [`write_atomic`] never leaves a half-written file under the final name: the bytes go to
//! a temporary sibling, are synced, renamed over the target, and the folder is synced so
//! the rename survives a power cut (where the platform lets a folder be opened; elsewhere
//! the rename is still atomic). [`sha256_file`] streams a file through SHA-256.
//!
//! Reading goes through [`open_regular`] / [`read_regular`]: every file fx reads (bars,
//! feature files, configs, checkpoints, sidecars, INT8 files) must be a regular file
//! (symlinks followed). A directory, FIFO, device or socket is refused with an error saying
//! which, a symlink loop as a loop, and the open itself never blocks (a FIFO without a
//! writer would otherwise wait forever, `/dev/zero` read until memory runs out).

use std::fs::File;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

/// Writes `bytes` to `path` atomically (see the module docs). On error the temporary file
/// is removed and the error is the operation's own (the caller names the path).
pub fn write_atomic(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    write_atomic_with(path, |tmp| {
        let mut f = File::create(tmp)?;
        f.write_all(bytes)?;
        f.sync_all()
    })
}

/// [`write_atomic`] for a writer that streams into a file itself: `write` gets the
/// temporary sibling's path, creates it (with `File::create`, so the umask's usual
/// permissions) and syncs it; then it is renamed over `path` and the folder synced. A
/// missing folder is an error naming the folder, never the temporary file.
pub fn write_atomic_with(path: &Path, write: impl FnOnce(&Path) -> std::io::Result<()>) -> std::io::Result<()> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        if !dir.is_dir() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::NotFound,
                format!("folder {} does not exist", dir.display()),
            ));
        }
    }
    let tmp = temporary_sibling(path)?;
    let result = write(&tmp).and_then(|()| std::fs::rename(&tmp, path));
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

/// Gives `path` the permissions `File::create` would (0666 less the process's umask, read
/// from `/proc/self/status` on Linux, else 022), for files a library created privately.
pub fn set_default_permissions(path: &Path) -> std::io::Result<()> {
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let umask = std::fs::read_to_string("/proc/self/status")
            .ok()
            .and_then(|s| {
                s.lines().find_map(|l| l.strip_prefix("Umask:").and_then(|v| u32::from_str_radix(v.trim(), 8).ok()))
            })
            .unwrap_or(0o022);
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o666 & !umask))?;
    }
    #[cfg(not(unix))]
    let _ = path;
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

/// Opens `path` for reading if it is a regular file (see the module docs). The type is
/// checked on the opened handle, opened without blocking, so a file swapped for a FIFO
/// between a check and the open is refused too. Errors are the operation's own kind with a
/// message saying what the path is (the caller names the path).
pub fn open_regular(path: &Path) -> std::io::Result<File> {
    open_checked(std::fs::OpenOptions::new().read(true), path)
}

/// Opens `path` for appending (created if missing, with the umask's permissions) if it is
/// a regular file, as [`open_regular`] opens for reading: a FIFO (with a reader or not), a
/// device, a directory or a loop is refused at once, never waited on.
pub fn append_regular(path: &Path) -> std::io::Result<File> {
    open_checked(std::fs::OpenOptions::new().create(true).append(true), path)
}

/// `opts` without blocking, then the handle's type checked: the one way fx opens a file.
fn open_checked(opts: &mut std::fs::OpenOptions, path: &Path) -> std::io::Result<File> {
    use std::io::{Error, ErrorKind};
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        opts.custom_flags(libc::O_NONBLOCK);
    }
    let f = opts.open(path).map_err(|e| {
        #[cfg(unix)]
        match e.raw_os_error() {
            Some(libc::ELOOP) => return Error::new(ErrorKind::InvalidInput, "is a symbolic link loop"),
            // A directory opened for writing, or a FIFO without a reader opened for writing
            // without blocking: what the path is, from its metadata (no open, no wait).
            Some(libc::EISDIR | libc::ENXIO) => {
                if let Some(what) = std::fs::metadata(path).ok().and_then(|m| not_regular(m.file_type())) {
                    return Error::new(ErrorKind::InvalidInput, what);
                }
            }
            _ => {}
        }
        e
    })?;
    match not_regular(f.metadata()?.file_type()) {
        None => Ok(f),
        Some(what) => Err(Error::new(ErrorKind::InvalidInput, what)),
    }
}

/// What a file of type `ft` is, when it is not a regular file.
fn not_regular(ft: std::fs::FileType) -> Option<&'static str> {
    if ft.is_file() {
        return None;
    }
    Some(if ft.is_dir() {
        "is a directory, not a file"
    } else {
        #[cfg(unix)]
        {
            use std::os::unix::fs::FileTypeExt;
            if ft.is_fifo() {
                "is a FIFO (named pipe), not a regular file"
            } else if ft.is_char_device() || ft.is_block_device() {
                "is a device, not a regular file"
            } else if ft.is_socket() {
                "is a socket, not a regular file"
            } else {
                "is not a regular file"
            }
        }
        #[cfg(not(unix))]
        "is not a regular file"
    })
}

/// The whole of the regular file at `path` ([`open_regular`]), refused unread when it is
/// larger than `max` bytes (the caller's sane maximum for its kind of file).
pub fn read_regular(path: &Path, max: u64) -> std::io::Result<Vec<u8>> {
    let f = open_regular(path)?;
    let len = f.metadata()?.len();
    if len > max {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("holds {len} bytes, more than the {max} a file of its kind may"),
        ));
    }
    let mut out = Vec::new();
    out.try_reserve_exact(len as usize).map_err(|_| {
        std::io::Error::new(std::io::ErrorKind::OutOfMemory, format!("{len} bytes do not fit in memory"))
    })?;
    // Bounded by the size seen: a file growing meanwhile is read as it was.
    f.take(len).read_to_end(&mut out)?;
    Ok(out)
}

/// [`read_regular`] as UTF-8 text.
pub fn read_regular_to_string(path: &Path, max: u64) -> std::io::Result<String> {
    String::from_utf8(read_regular(path, max)?)
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, format!("is not UTF-8 text: {e}")))
}

/// Largest config or sidecar text fx reads (TOML, JSON manifests): 64 MiB.
pub const MAX_TEXT_BYTES: u64 = 64 << 20;

/// SHA-256 of the file at `path`, as lower-case hex, read in 1 MiB pieces.
pub fn sha256_file(path: &Path) -> std::io::Result<String> {
    use sha2::{Digest, Sha256};
    let mut f = open_regular(path)?;
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

/// Asserts that `path` has the permissions of a file `File::create` makes beside it (the
/// umask's), as every file fx writes must, not a private temporary's 0600.
#[cfg(test)]
pub(crate) fn assert_default_permissions(path: &Path) {
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let plain = path.with_extension("plain-permissions");
        File::create(&plain).unwrap();
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        let (got, want) = (mode(path), mode(&plain));
        std::fs::remove_file(&plain).unwrap();
        assert_eq!(got, want, "{} has mode {got:o}, not File::create's {want:o}", path.display());
    }
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

    /// A FIFO (no writer) and a symbolic link loop in `dir`.
    #[cfg(unix)]
    fn fifo_and_loop(dir: &Path) -> (PathBuf, PathBuf) {
        let fifo = dir.join("fifo");
        let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
        // SAFETY: a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        let loop_a = dir.join("a");
        std::os::unix::fs::symlink(dir.join("b"), &loop_a).unwrap();
        std::os::unix::fs::symlink(&loop_a, dir.join("b")).unwrap();
        (fifo, loop_a)
    }

    /// Each kind of path that is not a regular file is refused at once, saying what it is.
    #[cfg(unix)]
    #[test]
    fn only_regular_files_are_read() {
        let dir = tempfile::tempdir().unwrap();
        let (fifo, loop_a) = fifo_and_loop(dir.path());
        let to_zero = dir.path().join("zero");
        std::os::unix::fs::symlink("/dev/zero", &to_zero).unwrap();
        let t = std::time::Instant::now();
        for (p, want) in [
            (fifo.as_path(), "is a FIFO"),
            (Path::new("/dev/zero"), "is a device"),
            (to_zero.as_path(), "is a device"),
            (loop_a.as_path(), "symbolic link loop"),
            (dir.path(), "is a directory"),
        ] {
            let e = read_regular(p, 1 << 20).unwrap_err().to_string();
            assert!(e.contains(want), "{}: {e}", p.display());
        }
        assert!(t.elapsed() < std::time::Duration::from_secs(5), "something blocked");
        let f = dir.path().join("f");
        std::fs::write(&f, b"0123456789").unwrap();
        assert_eq!(read_regular(&f, 10).unwrap(), b"0123456789");
        let e = read_regular(&f, 9).unwrap_err().to_string();
        assert!(e.contains("holds 10 bytes, more than the 9"), "{e}");
        assert!(read_regular(&dir.path().join("missing"), 9).unwrap_err().kind() == std::io::ErrorKind::NotFound);
    }

    /// The log a run appends to: a FIFO with or without a reader, a device, a directory or
    /// a symlink loop is refused at once; a regular file (new or existing) is appended to.
    #[cfg(unix)]
    #[test]
    fn only_regular_files_are_appended_to() {
        use std::os::unix::fs::OpenOptionsExt;
        let dir = tempfile::tempdir().unwrap();
        let (fifo, loop_a) = fifo_and_loop(dir.path());
        let t = std::time::Instant::now();
        let cases = [
            (fifo.clone(), "is a FIFO"),
            (PathBuf::from("/dev/null"), "is a device"),
            (loop_a, "symbolic link loop"),
            (dir.path().to_path_buf(), "is a directory"),
        ];
        for (p, want) in &cases {
            let e = append_regular(p).unwrap_err().to_string();
            assert!(e.contains(want), "{}: {e}", p.display());
        }
        // With a reader holding the FIFO open the open itself succeeds: the type refuses it.
        let _reader = std::fs::OpenOptions::new().read(true).custom_flags(libc::O_NONBLOCK).open(&fifo).unwrap();
        let e = append_regular(&fifo).unwrap_err().to_string();
        assert!(e.contains("is a FIFO"), "{e}");
        assert!(t.elapsed() < std::time::Duration::from_secs(5), "something blocked");
        let f = dir.path().join("log");
        append_regular(&f).unwrap().write_all(b"one\n").unwrap();
        append_regular(&f).unwrap().write_all(b"two\n").unwrap();
        assert_eq!(std::fs::read(&f).unwrap(), b"one\ntwo\n");
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
