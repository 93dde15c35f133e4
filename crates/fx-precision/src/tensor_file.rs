//! Tensor files: atomic saving and strict loading of named tensors (run checkpoints, trainer
//! states and model weights are made of them).
//!
//! A tensor file is one safetensors file: named tensors plus string metadata (JSON for
//! structured state such as the GradScaler's). Saving writes a temporary file in the same
//! directory, syncs it and renames it over the target, so a crash leaves either the old
//! or the new file, never a torn one. Loading hands back a [`NamedTensors`], from
//! which the caller *takes* what it expects; missing, mis-shaped and left-over (unknown)
//! tensors are errors that name the file and the tensor.

use std::collections::HashMap;
use std::path::Path;

use candle_core::{DType, Device, Tensor};
use candle_nn::VarMap;

use crate::error::{Context, Error, Result};
use crate::optim::sorted_vars;

/// A bag of named tensors with the name of where they came from, consumed by `take`.
#[derive(Debug)]
pub struct NamedTensors {
    source: String,
    tensors: HashMap<String, Tensor>,
    metadata: HashMap<String, String>,
}

impl NamedTensors {
    /// Wraps `tensors`; `source` names them in error messages (e.g. a file path).
    pub fn new(source: impl Into<String>, tensors: HashMap<String, Tensor>) -> Self {
        NamedTensors { source: source.into(), tensors, metadata: HashMap::new() }
    }

    /// As [`NamedTensors::new`], with string metadata.
    pub fn with_metadata(
        source: impl Into<String>,
        tensors: HashMap<String, Tensor>,
        metadata: HashMap<String, String>,
    ) -> Self {
        NamedTensors { source: source.into(), tensors, metadata }
    }

    /// The tensors not yet taken.
    pub fn into_tensors(self) -> HashMap<String, Tensor> {
        self.tensors
    }

    /// The string metadata stored with the tensors.
    pub fn metadata(&self) -> &HashMap<String, String> {
        &self.metadata
    }

    /// The names not yet taken, sorted.
    pub fn remaining(&self) -> Vec<String> {
        let mut names: Vec<String> = self.tensors.keys().cloned().collect();
        names.sort();
        names
    }

    /// The shape of tensor `name` if it is present and not yet taken (nothing is taken):
    /// lets a loader check a file against a config before allocating anything.
    pub fn dims(&self, name: &str) -> Option<&[usize]> {
        self.tensors.get(name).map(|t| t.dims())
    }

    /// Removes and returns tensor `name`, which must have shape `dims`.
    pub fn take(&mut self, name: &str, dims: &[usize]) -> Result<Tensor> {
        let t = self
            .tensors
            .get(name)
            .ok_or_else(|| Error::MissingTensor { source_name: self.source.clone(), name: name.to_string() })?;
        if t.dims() != dims {
            return Err(Error::ShapeMismatch {
                source_name: self.source.clone(),
                name: name.to_string(),
                got: t.dims().to_vec(),
                expected: dims.to_vec(),
            });
        }
        Ok(self.tensors.remove(name).expect("checked above"))
    }

    /// Sets every variable of `varmap` from tensor `{prefix}{name}` (shape-checked, cast
    /// to the variable's dtype and device). Nothing is changed unless all are present.
    pub fn restore_varmap(&mut self, varmap: &VarMap, prefix: &str) -> Result<()> {
        let vars = sorted_vars(varmap);
        let mut staged = Vec::with_capacity(vars.len());
        for (name, var) in &vars {
            let t = self.take(&format!("{prefix}{name}"), var.dims())?;
            let t = t
                .to_dtype(var.dtype())
                .and_then(|t| t.to_device(var.device()))
                .ctx(&format!("restoring {prefix}{name} from {}", self.source))?;
            staged.push((var, t));
        }
        for (var, t) in staged {
            var.set(&t).ctx("restore_varmap")?;
        }
        Ok(())
    }

    /// Succeeds only if every tensor was taken; otherwise names the leftovers.
    pub fn finish(self) -> Result<()> {
        if self.tensors.is_empty() {
            Ok(())
        } else {
            Err(Error::UnknownTensors { names: self.remaining(), source_name: self.source })
        }
    }
}

/// The variables of `varmap` as `{prefix}{name}` → tensor, ready for
/// [`save_tensors_atomic`].
pub fn varmap_tensors(varmap: &VarMap, prefix: &str) -> HashMap<String, Tensor> {
    sorted_vars(varmap).into_iter().map(|(n, v)| (format!("{prefix}{n}"), v.as_tensor().detach())).collect()
}

/// Writes `tensors` and `metadata` to `path` as safetensors, atomically (temp file in the
/// same directory, fsync, rename, fsync of the directory where supported).
pub fn save_tensors_atomic(
    path: impl AsRef<Path>,
    tensors: &HashMap<String, Tensor>,
    metadata: &HashMap<String, String>,
) -> Result<()> {
    let path = path.as_ref();
    let mut host = Vec::with_capacity(tensors.len());
    for (name, t) in tensors {
        // safetensors' View copies to the host and unwraps; do it here with errors.
        let t = t
            .to_device(&Device::Cpu)
            .and_then(|t| t.contiguous())
            .ctx(&format!("saving tensor {name:?} to {}", path.display()))?;
        // A checkpoint never holds a NaN or inf: resuming from one would train on poison.
        if t.dtype().is_float() {
            let v: Vec<f32> = t
                .flatten_all()
                .and_then(|t| t.to_dtype(DType::F32))
                .and_then(|t| t.to_vec1())
                .ctx(&format!("checking tensor {name:?} for {}", path.display()))?;
            if let Some(i) = v.iter().position(|x| !x.is_finite()) {
                return Err(Error::NonFinite { path: path.to_path_buf(), name: name.clone(), index: i });
            }
        }
        host.push((name.clone(), t));
    }
    host.sort_by(|a, b| a.0.cmp(&b.0));
    let bytes = safetensors::tensor::serialize(host, Some(metadata.clone()))
        .map_err(|e| Error::Safetensors { path: path.to_path_buf(), message: e.to_string() })?;
    fx_data::files::write_atomic(path, &bytes).map_err(|source| Error::Io {
        op: "writing",
        path: path.to_path_buf(),
        source,
    })
}

/// Reads a safetensors file onto `device`; take its tensors with [`NamedTensors::take`].
pub fn load_tensors(path: impl AsRef<Path>, device: &Device) -> Result<NamedTensors> {
    let path = path.as_ref();
    let bytes = fx_data::files::read_regular(path, u64::MAX).map_err(|source| Error::Io {
        op: "reading",
        path: path.to_path_buf(),
        source,
    })?;
    // The parsers' messages quote the file's own strings (tensor names, dtypes): escape
    // control characters so a damaged file still gives a one-line error.
    let st_err = |message: String| Error::Safetensors { path: path.to_path_buf(), message: one_line(&message) };
    let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes).map_err(|e| st_err(e.to_string()))?;
    let metadata = meta.metadata().clone().unwrap_or_default();
    let tensors = candle_core::safetensors::load_buffer(&bytes, device).map_err(|e| st_err(e.to_string()))?;
    Ok(NamedTensors { source: path.display().to_string(), tensors, metadata })
}

/// The metadata of a safetensors file, read from its header alone (the tensors are not
/// read: a large state file's identity can be checked cheaply before it is loaded).
pub fn read_metadata(path: impl AsRef<Path>) -> Result<HashMap<String, String>> {
    use std::io::Read;
    let path = path.as_ref();
    let io = |source| Error::Io { op: "reading", path: path.to_path_buf(), source };
    let st_err = |message: String| Error::Safetensors { path: path.to_path_buf(), message };
    let mut f = std::fs::File::open(path).map_err(io)?;
    let mut len = [0u8; 8];
    f.read_exact(&mut len).map_err(io)?;
    // safetensors' own bound on a header.
    let n = u64::from_le_bytes(len);
    if n > 100_000_000 {
        return Err(st_err(format!("a header of {n} bytes (at most 100000000)")));
    }
    let mut header = vec![0u8; n as usize];
    f.read_exact(&mut header).map_err(io)?;
    let doc: serde_json::Value =
        serde_json::from_slice(&header).map_err(|e| st_err(one_line(&format!("header: {e}"))))?;
    let Some(meta) = doc.get("__metadata__") else { return Ok(HashMap::new()) };
    serde_json::from_value(meta.clone()).map_err(|e| st_err(one_line(&format!("header metadata: {e}"))))
}

/// `text` with its control characters (line ends, tabs, NUL, ...) escaped as `\n`, `\r`,
/// `\u{0}`.
fn one_line(text: &str) -> String {
    text.chars().map(|c| if c.is_control() { c.escape_default().to_string() } else { c.to_string() }).collect()
}

#[cfg(test)]
mod fuzz_tests;

#[cfg(test)]
mod tests {
    use super::*;

    /// The header's metadata reads back without the tensors; a file that is not
    /// safetensors is refused naming it.
    #[test]
    fn metadata_reads_from_the_header() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m.safetensors");
        let t = Tensor::new(&[1f32, 2.0], &Device::Cpu).unwrap();
        let meta = HashMap::from([("k".to_string(), "{\"a\": 1}".to_string())]);
        save_tensors_atomic(&path, &HashMap::from([("w".to_string(), t)]), &meta).unwrap();
        assert_eq!(read_metadata(&path).unwrap(), meta);
        std::fs::write(&path, b"\xff\xff\xff\xff\xff\xff\xff\xffjunk").unwrap();
        let e = read_metadata(&path).unwrap_err().to_string();
        assert!(e.contains("m.safetensors") && !e.contains('\n'), "{e}");
        std::fs::write(&path, b"\x04\x00\x00\x00\x00\x00\x00\x00{no}").unwrap();
        assert!(read_metadata(&path).unwrap_err().to_string().contains("header"));
    }

    #[test]
    fn a_non_finite_tensor_is_never_written() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.safetensors");
        let good = Tensor::new(&[1f32, 2.0], &Device::Cpu).unwrap();
        save_tensors_atomic(&path, &HashMap::from([("w".to_string(), good.clone())]), &HashMap::new()).unwrap();
        let before = std::fs::read(&path).unwrap();
        for bad in [f32::NAN, f32::INFINITY] {
            let t = Tensor::new(&[1f32, bad], &Device::Cpu).unwrap().to_dtype(DType::BF16).unwrap();
            let e = save_tensors_atomic(&path, &HashMap::from([("m.exp_avg".to_string(), t)]), &HashMap::new())
                .unwrap_err();
            assert!(e.to_string().contains("\"m.exp_avg\"") && e.to_string().contains("index 1"), "{e}");
            assert_eq!(std::fs::read(&path).unwrap(), before, "the earlier file was changed");
        }
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1, "a temporary file was left");
    }
    use candle_core::DType;

    #[test]
    fn round_trip_with_metadata_and_strict_errors() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ck.safetensors");
        let dev = Device::Cpu;
        let mut map = HashMap::new();
        let w = Tensor::arange(0f32, 6.0, &dev).unwrap().reshape((2, 3)).unwrap();
        map.insert("w".to_string(), w.t().unwrap()); // non-contiguous on purpose
        map.insert("step".to_string(), Tensor::new(7i64, &dev).unwrap());
        let meta = HashMap::from([("scaler".to_string(), "{\"scale\":2.0}".to_string())]);
        save_tensors_atomic(&path, &map, &meta).unwrap();
        // Overwrite is atomic and leaves no temp file behind.
        save_tensors_atomic(&path, &map, &meta).unwrap();
        let names: Vec<_> = std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(names.len(), 1, "{names:?}");

        let mut ck = load_tensors(&path, &dev).unwrap();
        assert_eq!(ck.metadata()["scaler"], "{\"scale\":2.0}");
        let err = ck.take("w", &[2, 3]).unwrap_err().to_string();
        assert!(err.contains("\"w\" has shape [3, 2], expected [2, 3]") && err.contains("ck.safetensors"), "{err}");
        let w2 = ck.take("w", &[3, 2]).unwrap();
        assert_eq!(w2.to_vec2::<f32>().unwrap(), w.t().unwrap().to_vec2::<f32>().unwrap());
        let err = ck.take("w", &[3, 2]).unwrap_err().to_string();
        assert!(err.contains("missing tensor \"w\""), "{err}");
        let err = ck.finish().unwrap_err().to_string();
        assert!(err.contains("unknown tensor(s) [\"step\"]"), "{err}");

        let err = load_tensors(dir.path().join("nope"), &dev).unwrap_err().to_string();
        assert!(err.contains("reading") && err.contains("nope"), "{err}");
        std::fs::write(dir.path().join("junk"), b"not a safetensors file").unwrap();
        assert!(load_tensors(dir.path().join("junk"), &dev).is_err());
    }

    #[test]
    fn varmap_round_trip() {
        let dev = Device::Cpu;
        let vm = VarMap::new();
        let vb = candle_nn::VarBuilder::from_varmap(&vm, DType::F32, &dev);
        let _ = vb.pp("l").get_with_hints((2, 2), "weight", candle_nn::Init::Randn { mean: 0., stdev: 1. }).unwrap();
        let saved = varmap_tensors(&vm, "model.");
        let vm2 = VarMap::new();
        let vb2 = candle_nn::VarBuilder::from_varmap(&vm2, DType::F32, &dev);
        let w2 = vb2.pp("l").get_with_hints((2, 2), "weight", candle_nn::Init::Const(0.)).unwrap();
        let mut src = NamedTensors::new("mem", saved.clone());
        src.restore_varmap(&vm2, "model.").unwrap();
        src.finish().unwrap();
        assert_eq!(w2.to_vec2::<f32>().unwrap(), saved["model.l.weight"].to_vec2::<f32>().unwrap());
    }
}
