//! The quantised checkpoint: one safetensors file (format `fx-int8/1`) beside the F32
//! checkpoint it came from. Layout (`docs/QUANT.md` has the full description):
//! - per INT8 layer `NAME` (the spec's names, e.g. `trunk.0`): `NAME.weight` I8 `[out, in]`,
//!   `NAME.weight_scale` F32 `[out]`, `NAME.input_scale` F32 `[1]`, `NAME.bias` F32 `[out]`;
//! - per layer kept in F32: `NAME.weight` F32 `[out, in]`, `NAME.bias` F32 `[out]`;
//! - metadata: `format` = `fx-int8/1`, `model` (`dqn` / `ppo`), `source_sha256` (of the
//!   F32 checkpoint file), `source` (its file name), `calibration_method`,
//!   `calibration_rows`, `calibration_percentile` (percentile only), `f32_layers`.
//!
//! Writing goes through a temporary file in the same folder and a rename. Loading checks
//! every tensor's presence, dtype and shape, the weights' range, the scales (finite, > 0),
//! the metadata, and (when asked) the source checkpoint's hash; each failure is one line
//! naming the file and the tensor or key.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::path::Path;

use safetensors::{Dtype, SafeTensors};

use crate::error::{Error, Result};
use crate::float_net::{FloatLayer, PolicyKind};
use crate::qnet::{CalibInfo, QuantLayer, QuantLinear, QuantNet};

/// The `format` metadata value this crate writes and reads.
pub const FORMAT: &str = "fx-int8/1";

/// What a quantised checkpoint holds besides the network.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Provenance {
    /// SHA-256 (lower-case hex) of the F32 checkpoint file the network was quantised from.
    pub source_sha256: String,
    /// That file's name.
    pub source: String,
}

/// SHA-256 (lower-case hex) of a file, streamed.
pub fn sha256_file(path: &Path) -> Result<String> {
    use sha2::{Digest, Sha256};
    let mut f = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf).map_err(|e| Error::io(path, e))?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(h.finalize().iter().map(|b| format!("{b:02x}")).collect())
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// Writes `net` to `path` (atomically: a temporary file in the same folder, then a rename).
pub fn save(net: &QuantNet, provenance: &Provenance, path: &Path) -> Result<()> {
    net.check()?;
    let mut owned: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = Vec::new();
    for layer in &net.layers {
        match layer {
            QuantLayer::Int8(l) => {
                owned.push((
                    format!("{}.weight", l.name),
                    Dtype::I8,
                    vec![l.out, l.inp],
                    l.weight.iter().map(|&v| v as u8).collect(),
                ));
                owned.push((format!("{}.weight_scale", l.name), Dtype::F32, vec![l.out], f32_bytes(&l.weight_scale)));
                owned.push((format!("{}.input_scale", l.name), Dtype::F32, vec![1], f32_bytes(&[l.input_scale])));
                owned.push((format!("{}.bias", l.name), Dtype::F32, vec![l.out], f32_bytes(&l.bias)));
            }
            QuantLayer::F32(l) => {
                owned.push((format!("{}.weight", l.name), Dtype::F32, vec![l.out, l.inp], f32_bytes(&l.weight)));
                owned.push((format!("{}.bias", l.name), Dtype::F32, vec![l.out], f32_bytes(&l.bias)));
            }
        }
    }
    let mut views = Vec::with_capacity(owned.len());
    for (name, dtype, shape, bytes) in &owned {
        let v = safetensors::tensor::TensorView::new(*dtype, shape.clone(), bytes)
            .map_err(|e| Error::file(path, format!("tensor {name}: {e}")))?;
        views.push((name.clone(), v));
    }
    let mut meta = HashMap::from([
        ("format".to_string(), FORMAT.to_string()),
        ("model".to_string(), net.kind.as_str().to_string()),
        ("source_sha256".to_string(), provenance.source_sha256.clone()),
        ("source".to_string(), provenance.source.clone()),
        ("calibration_method".to_string(), net.calibration.method.clone()),
        ("calibration_rows".to_string(), net.calibration.rows.to_string()),
        ("f32_layers".to_string(), net.f32_layers().join(",")),
    ]);
    if let Some(p) = net.calibration.percentile {
        meta.insert("calibration_percentile".into(), p.to_string());
    }
    let bytes = safetensors::tensor::serialize(views, Some(meta)).map_err(|e| Error::file(path, e.to_string()))?;
    write_atomic(path, &bytes)
}

fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let mut name = path.file_name().map(|n| n.to_os_string()).unwrap_or_default();
    name.push(format!(".tmp{}", std::process::id()));
    let tmp = path.with_file_name(name);
    let result = (|| -> std::io::Result<()> {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)?;
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            if let Ok(d) = std::fs::File::open(dir) {
                let _ = d.sync_all();
            }
        }
        Ok(())
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result.map_err(|e| Error::io(path, e))
}

/// Reads a quantised checkpoint. With `source_sha256`, the file must say it was quantised
/// from the F32 checkpoint with that hash (a quantised file left over from an earlier
/// checkpoint is refused rather than silently used).
pub fn load(path: &Path, source_sha256: Option<&str>) -> Result<(QuantNet, Provenance)> {
    let bytes = std::fs::read(path).map_err(|e| Error::io(path, e))?;
    let one_line = |e: &dyn std::fmt::Display| e.to_string().split_whitespace().collect::<Vec<_>>().join(" ");
    let (_, header) = SafeTensors::read_metadata(&bytes)
        .map_err(|e| Error::file(path, format!("not a safetensors file: {}", one_line(&e))))?;
    let st = SafeTensors::deserialize(&bytes)
        .map_err(|e| Error::file(path, format!("not a safetensors file: {}", one_line(&e))))?;
    let meta = header.metadata().clone().unwrap_or_default();
    let key =
        |k: &str| meta.get(k).map(String::as_str).ok_or_else(|| Error::file(path, format!("metadata lacks `{k}`")));
    let format = key("format")?;
    if format != FORMAT {
        return Err(Error::file(path, format!("metadata format is {format:?}, expected {FORMAT:?}")));
    }
    let model = key("model")?;
    let kind = PolicyKind::parse(model)
        .ok_or_else(|| Error::file(path, format!("metadata model is {model:?}, expected \"dqn\" or \"ppo\"")))?;
    let provenance =
        Provenance { source_sha256: key("source_sha256")?.to_string(), source: key("source")?.to_string() };
    if let Some(want) = source_sha256 {
        if provenance.source_sha256 != want {
            return Err(Error::file(
                path,
                format!(
                    "quantised from a checkpoint with SHA-256 {}, but the F32 checkpoint now has {want} \
                     (re-run `fx-train quantize`)",
                    provenance.source_sha256
                ),
            ));
        }
    }
    let rows = key("calibration_rows")?;
    let rows = rows
        .parse::<usize>()
        .map_err(|_| Error::file(path, format!("metadata calibration_rows is {rows:?}, not a count")))?;
    let method = key("calibration_method")?.to_string();
    let percentile = match meta.get("calibration_percentile") {
        Some(p) => Some(
            p.parse::<f64>()
                .map_err(|_| Error::file(path, format!("metadata calibration_percentile is {p:?}, not a number")))?,
        ),
        None => None,
    };

    let tensor = |name: &str, dtype: Dtype, shape: Option<&[usize]>| -> Result<Vec<u8>> {
        let t = st.tensor(name).map_err(|_| Error::file(path, format!("tensor {name} is missing")))?;
        if t.dtype() != dtype {
            return Err(Error::file(path, format!("tensor {name} is {:?}, expected {dtype:?}", t.dtype())));
        }
        if let Some(s) = shape {
            if t.shape() != s {
                return Err(Error::file(path, format!("tensor {name} has shape {:?}, expected {s:?}", t.shape())));
            }
        }
        Ok(t.data().to_vec())
    };
    let floats = |name: &str, shape: &[usize]| -> Result<Vec<f32>> {
        let v: Vec<f32> = tensor(name, Dtype::F32, Some(shape))?
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        if let Some(i) = v.iter().position(|x| !x.is_finite()) {
            return Err(Error::file(path, format!("tensor {name} holds the non-finite value {} at index {i}", v[i])));
        }
        Ok(v)
    };
    let scales = |name: &str, shape: &[usize]| -> Result<Vec<f32>> {
        let v = floats(name, shape)?;
        if let Some(i) = v.iter().position(|x| *x <= 0.0) {
            return Err(Error::file(
                path,
                format!("tensor {name} holds the scale {} at index {i} (must be > 0)", v[i]),
            ));
        }
        Ok(v)
    };

    let mut layers = Vec::new();
    let mut expected_names = Vec::new();
    for name in kind.layer_names() {
        let wname = format!("{name}.weight");
        let t = st.tensor(&wname).map_err(|_| Error::file(path, format!("tensor {wname} is missing")))?;
        let [out, inp] = *t.shape() else {
            return Err(Error::file(path, format!("tensor {wname} has shape {:?}, expected [out, in]", t.shape())));
        };
        let bias = floats(&format!("{name}.bias"), &[out])?;
        expected_names.extend([wname.clone(), format!("{name}.bias")]);
        match t.dtype() {
            Dtype::I8 => {
                let weight: Vec<i8> = tensor(&wname, Dtype::I8, None)?.into_iter().map(|b| b as i8).collect();
                if let Some(i) = weight.iter().position(|&w| w == i8::MIN) {
                    return Err(Error::file(path, format!("tensor {wname} holds -128 at index {i} (range is ±127)")));
                }
                let weight_scale = scales(&format!("{name}.weight_scale"), &[out])?;
                let input_scale = scales(&format!("{name}.input_scale"), &[1])?[0];
                expected_names.extend([format!("{name}.weight_scale"), format!("{name}.input_scale")]);
                layers.push(QuantLayer::Int8(QuantLinear {
                    name: name.to_string(),
                    out,
                    inp,
                    weight,
                    weight_scale,
                    input_scale,
                    bias,
                }));
            }
            Dtype::F32 => {
                let weight = floats(&wname, &[out, inp])?;
                layers.push(QuantLayer::F32(FloatLayer { name: name.to_string(), out, inp, weight, bias }));
            }
            other => return Err(Error::file(path, format!("tensor {wname} is {other:?}, expected I8 or F32"))),
        }
    }
    if let Some(extra) = st.names().into_iter().find(|n| !expected_names.iter().any(|e| e == n)) {
        return Err(Error::file(path, format!("unexpected tensor {extra} for a {} network", kind.as_str())));
    }
    let net = QuantNet { kind, layers, calibration: CalibInfo { method, percentile, rows } };
    net.check().map_err(|e| Error::file(path, e.to_string()))?;
    Ok((net, provenance))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{random_net, uniforms};
    use crate::CalibMethod;

    fn quantised(keep_f32: &[&str]) -> QuantNet {
        let net = random_net(PolicyKind::Dqn, 56, &[32, 32, 16], 3, 5);
        crate::quantize(&net, &uniforms(5, 9, 200 * 56), CalibMethod::Percentile(99.9), keep_f32).unwrap()
    }

    fn prov() -> Provenance {
        Provenance { source_sha256: "ab".repeat(32), source: "checkpoint-0000000040.safetensors".into() }
    }

    #[test]
    fn round_trip_keeps_everything() {
        let dir = tempfile::tempdir().unwrap();
        for keep in [&[][..], &["value", "advantage"][..]] {
            let q = quantised(keep);
            let path = dir.path().join("q.safetensors");
            save(&q, &prov(), &path).unwrap();
            let (back, p) = load(&path, Some(&"ab".repeat(32))).unwrap();
            assert_eq!(back, q);
            assert_eq!(p, prov());
            assert_eq!(back.calibration.percentile, Some(99.9));
            // Only the final file is left.
            assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
            let st_bytes = std::fs::read(&path).unwrap();
            let st = SafeTensors::deserialize(&st_bytes).unwrap();
            assert_eq!(st.tensor("trunk.0.weight").unwrap().dtype(), Dtype::I8);
            let want = if keep.is_empty() { Dtype::I8 } else { Dtype::F32 };
            assert_eq!(st.tensor("advantage.weight").unwrap().dtype(), want);
        }
    }

    /// A dynamic-scale network keeps that choice through the file.
    #[test]
    fn dynamic_scales_round_trip() {
        let dir = tempfile::tempdir().unwrap();
        let net = random_net(PolicyKind::Ppo, 56, &[32, 32], 3, 6);
        let q = crate::quantize(&net, &uniforms(6, 9, 100 * 56), CalibMethod::Dynamic, &[]).unwrap();
        assert!(q.dynamic_inputs());
        let path = dir.path().join("q.safetensors");
        save(&q, &prov(), &path).unwrap();
        let (back, _) = load(&path, None).unwrap();
        assert!(back.dynamic_inputs() && back == q);
        assert!(!quantised(&[]).dynamic_inputs());
    }

    /// Rewrites the saved file with `edit` applied to its tensors / metadata.
    fn damaged(
        dir: &Path,
        edit: impl FnOnce(&mut Vec<(String, Dtype, Vec<usize>, Vec<u8>)>, &mut HashMap<String, String>),
    ) -> std::path::PathBuf {
        let path = dir.join("good.safetensors");
        save(&quantised(&[]), &prov(), &path).unwrap();
        let bytes = std::fs::read(&path).unwrap();
        let st = SafeTensors::deserialize(&bytes).unwrap();
        let (_, header) = SafeTensors::read_metadata(&bytes).unwrap();
        let mut meta = header.metadata().clone().unwrap();
        let mut t: Vec<_> =
            st.tensors().into_iter().map(|(n, v)| (n, v.dtype(), v.shape().to_vec(), v.data().to_vec())).collect();
        edit(&mut t, &mut meta);
        let views: Vec<_> = t
            .iter()
            .map(|(n, d, s, b)| (n.clone(), safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap()))
            .collect();
        let out = dir.join("bad.safetensors");
        std::fs::write(&out, safetensors::tensor::serialize(views, Some(meta)).unwrap()).unwrap();
        out
    }

    fn set(
        t: &mut [(String, Dtype, Vec<usize>, Vec<u8>)],
        name: &str,
        f: impl FnOnce(&mut (String, Dtype, Vec<usize>, Vec<u8>)),
    ) {
        f(t.iter_mut().find(|x| x.0 == name).unwrap());
    }

    #[test]
    fn damaged_files_are_one_line_errors_naming_the_tensor() {
        let dir = tempfile::tempdir().unwrap();
        type Edit = Box<dyn FnOnce(&mut Vec<(String, Dtype, Vec<usize>, Vec<u8>)>, &mut HashMap<String, String>)>;
        let cases: Vec<(Edit, &str)> = vec![
            (Box::new(|_, m| drop(m.insert("format".into(), "fx-int4/1".into()))), "metadata format"),
            (Box::new(|_, m| drop(m.remove("source_sha256"))), "source_sha256"),
            (Box::new(|_, m| drop(m.insert("model".into(), "tft".into()))), "metadata model"),
            (Box::new(|_, m| drop(m.insert("calibration_rows".into(), "many".into()))), "calibration_rows"),
            (Box::new(|t, _| t.retain(|x| x.0 != "trunk.1.weight_scale")), "trunk.1.weight_scale is missing"),
            (
                Box::new(|t, _| set(t, "trunk.2.input_scale", |x| x.3 = 0f32.to_le_bytes().to_vec())),
                "trunk.2.input_scale holds the scale 0",
            ),
            (
                Box::new(|t, _| set(t, "trunk.0.weight_scale", |x| x.3[0..4].copy_from_slice(&f32::NAN.to_le_bytes()))),
                "trunk.0.weight_scale holds the non-finite value NaN",
            ),
            (
                Box::new(|t, _| set(t, "trunk.0.weight_scale", |x| x.3[4..8].copy_from_slice(&(-1f32).to_le_bytes()))),
                "trunk.0.weight_scale holds the scale -1 at index 1",
            ),
            (Box::new(|t, _| set(t, "value.weight", |x| x.1 = Dtype::U8)), "value.weight is U8"),
            (Box::new(|t, _| set(t, "advantage.weight", |x| x.3[3] = 0x80)), "advantage.weight holds -128"),
            (
                Box::new(|t, _| {
                    set(t, "trunk.1.bias", |x| {
                        x.2 = vec![31];
                        x.3.truncate(31 * 4)
                    })
                }),
                "trunk.1.bias has shape [31], expected [32]",
            ),
            (
                Box::new(|t, _| {
                    set(t, "trunk.1.weight", |x| {
                        x.2 = vec![32, 31];
                        x.3.truncate(32 * 31)
                    })
                }),
                "trunk.1",
            ),
            (Box::new(|t, _| t.push(("extra".into(), Dtype::F32, vec![1], vec![0; 4]))), "unexpected tensor extra"),
        ];
        for (edit, want) in cases {
            let path = damaged(dir.path(), edit);
            let e = load(&path, None).unwrap_err().to_string();
            assert!(e.contains(want) && e.contains("bad.safetensors") && !e.contains('\n'), "want {want:?}: {e}");
        }
        let good = dir.path().join("good.safetensors");
        let e = load(&good, Some(&"cd".repeat(32))).unwrap_err().to_string();
        assert!(e.contains("SHA-256") && e.contains("fx-train quantize"), "{e}");
        std::fs::write(dir.path().join("junk"), b"not a file at all").unwrap();
        let e = load(&dir.path().join("junk"), None).unwrap_err().to_string();
        assert!(e.contains("not a safetensors file") && !e.contains('\n'), "{e}");
        assert!(load(&dir.path().join("absent"), None).unwrap_err().to_string().contains("absent"));
    }
}
