//! The INT8 file: one safetensors file (format `fx-int8/1`) beside the F32
//! checkpoint it came from; a TFT's ([`save_tft`], [`load_tft`]) holds every weight matrix
//! part in I8 under its spec name with its [`scale_names`], and every other parameter in F32.
//! A policy's layout (`docs/QUANT.md` has the full description of both):
//! - per INT8 layer `NAME` (the spec's names, e.g. `trunk.0`): `NAME.weight` I8 `[out, in]`,
//!   `NAME.weight_scale` F32 `[out]`, `NAME.input_scale` F32 `[1]`, `NAME.bias` F32 `[out]`;
//! - per layer kept in F32: `NAME.weight` F32 `[out, in]`, `NAME.bias` F32 `[out]`;
//! - metadata: `format` = `fx-int8/1`, `model` (`dqn` / `ppo`), `source_sha256` (of the
//!   F32 checkpoint file), `source` (its file name), `calibration_method`,
//!   `calibration_rows`, `calibration_percentile` (percentile only), `f32_layers`,
//!   `tensors_sha256` ([`tensors_sha256`] of the file's own tensors, so a changed weight
//!   byte that stays inside ±127 is caught).
//!
//! Writing goes through a temporary file in the same folder and a rename. Loading checks
//! every tensor's presence, dtype and shape, the weights' range, the scales (finite, > 0),
//! the metadata, and (when asked) the source checkpoint's hash; each failure is one line
//! naming the file and the tensor or key.

use std::collections::{HashMap, HashSet};
use std::path::Path;

use safetensors::{Dtype, SafeTensors};

use crate::error::{Error, Result};
use crate::float_net::{FloatLayer, PolicyKind};
use crate::qnet::{CalibInfo, QuantLayer, QuantLinear, QuantNet};
use crate::tft::QuantTft;
use fx_models::{Tft, TftConfig};

/// The `format` metadata value this crate writes and reads.
pub const FORMAT: &str = "fx-int8/1";

/// What an INT8 file holds besides the network.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Provenance {
    /// SHA-256 (lower-case hex) of the F32 checkpoint file the network was quantised from.
    pub source_sha256: String,
    /// That file's name.
    pub source: String,
}

/// SHA-256 (lower-case hex) of a file, streamed (`fx_data::files::sha256_file`, with the
/// path in the error).
pub fn sha256_file(path: &Path) -> Result<String> {
    fx_data::files::sha256_file(path).map_err(|e| Error::io(path, e))
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// Writes `net` to `path` (atomically: a temporary file in the same folder, then a rename).
pub fn save(net: &QuantNet, provenance: &Provenance, path: &Path) -> Result<()> {
    net.check()?;
    let mut owned: Vec<Owned> = Vec::new();
    for layer in &net.layers {
        match layer {
            QuantLayer::Int8(l) => {
                let wname = format!("{}.weight", l.name);
                let (ws, is) = scale_names(&wname);
                owned.push((wname, Dtype::I8, vec![l.out, l.inp], i8_bytes(&l.weight)));
                owned.push((ws, Dtype::F32, vec![l.out], f32_bytes(&l.weight_scale)));
                owned.push((is, Dtype::F32, vec![1], f32_bytes(&[l.input_scale])));
                owned.push((format!("{}.bias", l.name), Dtype::F32, vec![l.out], f32_bytes(&l.bias)));
            }
            QuantLayer::F32(l) => {
                owned.push((format!("{}.weight", l.name), Dtype::F32, vec![l.out, l.inp], f32_bytes(&l.weight)));
                owned.push((format!("{}.bias", l.name), Dtype::F32, vec![l.out], f32_bytes(&l.bias)));
            }
        }
    }
    let mut meta = common_meta(net.kind.as_str(), provenance, &net.calibration);
    meta.insert("f32_layers".to_string(), net.f32_layers().join(","));
    write_tensors(path, &owned, meta)
}

/// A tensor to write: name, dtype, shape, little-endian bytes.
type Owned = (String, Dtype, Vec<usize>, Vec<u8>);

/// The metadata every quantised file carries.
fn common_meta(model: &str, provenance: &Provenance, calibration: &CalibInfo) -> HashMap<String, String> {
    let mut meta = HashMap::from([
        ("format".to_string(), FORMAT.to_string()),
        ("model".to_string(), model.to_string()),
        ("source_sha256".to_string(), provenance.source_sha256.clone()),
        ("source".to_string(), provenance.source.clone()),
        ("calibration_method".to_string(), calibration.method.clone()),
        ("calibration_rows".to_string(), calibration.rows.to_string()),
    ]);
    if let Some(p) = calibration.percentile {
        meta.insert("calibration_percentile".into(), p.to_string());
    }
    if let Some(m) = calibration.decision_margin {
        meta.insert("decision_margin".into(), m.to_string());
    }
    meta
}

/// SHA-256 (lower-case hex) of a file's tensors in name order: for each, its name, a 0
/// byte, its dtype's name, its shape (u64 little-endian each, after their count) and its
/// bytes (after their length). The metadata is not covered (it is checked key by key).
pub fn tensors_sha256<'t>(tensors: impl IntoIterator<Item = (&'t str, Dtype, &'t [usize], &'t [u8])>) -> String {
    use sha2::{Digest, Sha256};
    let mut all: Vec<_> = tensors.into_iter().collect();
    all.sort_by(|a, b| a.0.cmp(b.0));
    let mut h = Sha256::new();
    for (name, dtype, shape, bytes) in all {
        h.update(name.as_bytes());
        h.update([0u8]);
        h.update(format!("{dtype:?}").as_bytes());
        h.update((shape.len() as u64).to_le_bytes());
        for &d in shape {
            h.update((d as u64).to_le_bytes());
        }
        h.update((bytes.len() as u64).to_le_bytes());
        h.update(bytes);
    }
    h.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

/// Serialises `tensors` with `meta` (plus their `tensors_sha256`) to `path` atomically.
fn write_tensors(path: &Path, tensors: &[Owned], mut meta: HashMap<String, String>) -> Result<()> {
    let digest = tensors_sha256(tensors.iter().map(|(n, d, s, b)| (n.as_str(), *d, s.as_slice(), b.as_slice())));
    meta.insert("tensors_sha256".into(), digest);
    let mut views = Vec::with_capacity(tensors.len());
    for (name, dtype, shape, bytes) in tensors {
        let v = safetensors::tensor::TensorView::new(*dtype, shape.clone(), bytes)
            .map_err(|e| Error::file(path, format!("tensor {name}: {e}")))?;
        views.push((name.clone(), v));
    }
    let bytes = safetensors::tensor::serialize(views, Some(meta)).map_err(|e| Error::file(path, e.to_string()))?;
    fx_data::files::write_atomic(path, &bytes).map_err(|e| Error::io(path, e))
}

/// An INT8 weight tensor's bytes.
fn i8_bytes(v: &[i8]) -> Vec<u8> {
    v.iter().map(|&x| x as u8).collect()
}

/// Reads an INT8 file. With `source_sha256`, the file must say it was quantised
/// from the F32 checkpoint with that hash (a quantised file left over from an earlier
/// checkpoint is refused rather than silently used).
pub fn load(path: &Path, source_sha256: Option<&str>) -> Result<(QuantNet, Provenance)> {
    let bytes = fx_data::files::read_regular(path, u64::MAX).map_err(|e| Error::io(path, e))?;
    let r = Reader::new(path, &bytes)?;
    let model = r.key("model")?;
    let kind = PolicyKind::parse(model)
        .ok_or_else(|| Error::file(path, format!("metadata model is {model:?}, expected \"dqn\" or \"ppo\"")))?;
    let provenance = r.provenance(source_sha256)?;
    let calibration = r.calibration()?;
    let mut layers = Vec::new();
    let mut expected = HashSet::new();
    for name in kind.layer_names() {
        let wname = format!("{name}.weight");
        let t = r.st.tensor(&wname).map_err(|_| Error::file(path, format!("tensor {wname} is missing")))?;
        let [out, inp] = *t.shape() else {
            return Err(Error::file(path, format!("tensor {wname} has shape {:?}, expected [out, in]", t.shape())));
        };
        let bias = r.floats(&format!("{name}.bias"), &[out])?;
        expected.extend([wname.clone(), format!("{name}.bias")]);
        match t.dtype() {
            Dtype::I8 => {
                let weight = r.int8(&wname, &[out, inp])?;
                let (ws, is) = scale_names(&wname);
                let weight_scale = r.scales(&ws, &[out])?;
                let input_scale = r.scales(&is, &[1])?[0];
                expected.extend([ws, is]);
                let name = name.to_string();
                layers.push(QuantLayer::Int8(QuantLinear { name, out, inp, weight, weight_scale, input_scale, bias }));
            }
            Dtype::F32 => {
                let weight = r.floats(&wname, &[out, inp])?;
                layers.push(QuantLayer::F32(FloatLayer { name: name.to_string(), out, inp, weight, bias }));
            }
            other => return Err(Error::file(path, format!("tensor {wname} is {other:?}, expected I8 or F32"))),
        }
    }
    if let Some(extra) = r.unexpected(&expected) {
        return Err(Error::file(path, format!("unexpected tensor {extra} for a {} network", kind.as_str())));
    }
    let net = QuantNet { kind, layers, calibration };
    net.check().map_err(|e| Error::file(path, e.to_string()))?;
    Ok((net, provenance))
}

/// The names of an INT8 weight tensor's scales: `P.weightS` (any suffix `S`, e.g. `_hh_l0`)
/// has `P.weightS_scale` (per row) and `P.inputS_scale` (its input's).
pub fn scale_names(weight: &str) -> (String, String) {
    let (prefix, last) = weight.rsplit_once('.').map_or(("", weight), |(p, l)| (p, l));
    let suffix = last.strip_prefix("weight").unwrap_or(last);
    let dot = if prefix.is_empty() { "" } else { "." };
    (format!("{weight}_scale"), format!("{prefix}{dot}input{suffix}_scale"))
}

/// Writes a quantised TFT to `path` (atomically): per matrix part (spec name `W`) `W` I8
/// `[out, in]` with its [`scale_names`] (`[out]` and `[1]`), every other parameter F32 under
/// its name; metadata as the policies' files, `model` = `tft` and `tft_config` (JSON).
pub fn save_tft(q: &QuantTft, provenance: &Provenance, path: &Path) -> Result<()> {
    q.check()?;
    let mut owned: Vec<Owned> = Vec::new();
    for m in &q.matrices {
        let (ws, is) = scale_names(&m.name);
        owned.push((m.name.clone(), Dtype::I8, vec![m.out, m.inp], i8_bytes(&m.weight)));
        owned.push((ws, Dtype::F32, vec![m.out], f32_bytes(&m.weight_scale)));
        owned.push((is, Dtype::F32, vec![1], f32_bytes(&[m.input_scale])));
    }
    for (name, shape, v) in &q.floats {
        owned.push((name.clone(), Dtype::F32, shape.clone(), f32_bytes(v)));
    }
    let mut meta = common_meta("tft", provenance, &q.calibration);
    let cfg = serde_json::to_string(&q.config).map_err(|e| Error::file(path, format!("tft_config: {e}")))?;
    meta.insert("tft_config".into(), cfg);
    write_tensors(path, &owned, meta)
}

/// Reads a quantised TFT written by [`save_tft`], checking every tensor the model's
/// configuration implies (and no other), as [`load`] checks a policy's.
pub fn load_tft(path: &Path, source_sha256: Option<&str>) -> Result<(QuantTft, Provenance)> {
    let bytes = fx_data::files::read_regular(path, u64::MAX).map_err(|e| Error::io(path, e))?;
    let r = Reader::new(path, &bytes)?;
    let model = r.key("model")?;
    if model != "tft" {
        return Err(Error::file(path, format!("metadata model is {model:?}, expected \"tft\"")));
    }
    let provenance = r.provenance(source_sha256)?;
    let calibration = r.calibration()?;
    let config: TftConfig = serde_json::from_str(r.key("tft_config")?)
        .map_err(|e| Error::file(path, format!("metadata tft_config: {e}")))?;
    // The file's tensors bound the model built from its config (a config naming a huge
    // model beside small tensors is refused before anything is allocated).
    // Saturating: the config's numbers are the file's, and a huge one must be refused by the
    // shape check below, not overflow (found by fuzzing).
    let (d, ne) = (config.d, config.n_observed.saturating_add(config.n_known));
    for (name, shape) in [
        ("head.weight".to_string(), vec![config.quantiles.len(), d]),
        ("lstm_enc.weight_hh_l0".to_string(), vec![d.saturating_mul(4), d]),
        ("enc_vsn.flat.skip.weight".to_string(), vec![ne, ne.saturating_mul(d)]),
        (format!("enc_vsn.vars.{}.fc1.weight", ne.max(1) - 1), vec![d, d]),
    ] {
        let t = r.st.tensor(&name).map_err(|_| Error::file(path, format!("tensor {name} is missing")))?;
        if t.shape() != shape.as_slice() {
            return Err(Error::file(
                path,
                format!("tensor {name} has shape {:?}, but tft_config implies {shape:?}", t.shape()),
            ));
        }
    }
    let shape_of = Tft::new(config.clone(), &candle_core::Device::Cpu, 0)
        .map_err(|e| Error::file(path, format!("metadata tft_config: {e}")))?;
    let mut expected = HashSet::new();
    let mut matrices = Vec::new();
    let mut int8_names = HashSet::new();
    for var in shape_of.weight_matrices() {
        let names = shape_of.params().part_names(var).unwrap_or_default();
        let dims = var.dims();
        let (out, inp) = (dims[dims.len() - 2], dims[dims.len() - 1]);
        for name in names {
            let (ws, is) = scale_names(&name);
            let weight = r.int8(&name, &[out, inp])?;
            let weight_scale = r.scales(&ws, &[out])?;
            let input_scale = r.scales(&is, &[1])?[0];
            expected.extend([name.clone(), ws, is]);
            int8_names.insert(name.clone());
            matrices.push(QuantLinear { name, out, inp, weight, weight_scale, input_scale, bias: Vec::new() });
        }
    }
    let mut floats = Vec::new();
    for (name, shape) in shape_of.params().names_and_shapes() {
        if !int8_names.contains(&name) {
            floats.push((name.clone(), shape.clone(), r.floats(&name, &shape)?));
            expected.insert(name);
        }
    }
    if let Some(extra) = r.unexpected(&expected) {
        return Err(Error::file(path, format!("unexpected tensor {extra} for a tft model")));
    }
    let q = QuantTft { config, matrices, floats, calibration };
    q.check().map_err(|e| Error::file(path, e.to_string()))?;
    Ok((q, provenance))
}

/// A quantised file opened for reading: its tensors and metadata, every read checked and
/// every failure one line naming the file and the tensor or key.
struct Reader<'a> {
    path: &'a Path,
    st: SafeTensors<'a>,
    meta: HashMap<String, String>,
}

impl<'a> Reader<'a> {
    /// Parses `bytes` and checks the format.
    fn new(path: &'a Path, bytes: &'a [u8]) -> Result<Self> {
        let one_line = |e: &dyn std::fmt::Display| e.to_string().split_whitespace().collect::<Vec<_>>().join(" ");
        let (_, header) = SafeTensors::read_metadata(bytes)
            .map_err(|e| Error::file(path, format!("not a safetensors file: {}", one_line(&e))))?;
        let st = SafeTensors::deserialize(bytes)
            .map_err(|e| Error::file(path, format!("not a safetensors file: {}", one_line(&e))))?;
        let r = Self { path, st, meta: header.metadata().clone().unwrap_or_default() };
        let format = r.key("format")?;
        if format != FORMAT {
            return Err(Error::file(path, format!("metadata format is {format:?}, expected {FORMAT:?}")));
        }
        let want = r.meta.get("tensors_sha256").ok_or_else(|| {
            Error::file(path, "metadata lacks `tensors_sha256` (written by an older fx-train: quantise again)")
        })?;
        let tensors = r.st.tensors();
        let got = tensors_sha256(tensors.iter().map(|(n, v)| (n.as_str(), v.dtype(), v.shape(), v.data())));
        if &got != want {
            return Err(Error::file(
                path,
                "its tensors do not match the SHA-256 its metadata records (changed after quantisation)",
            ));
        }
        Ok(r)
    }

    fn key(&self, k: &str) -> Result<&str> {
        self.meta.get(k).map(String::as_str).ok_or_else(|| Error::file(self.path, format!("metadata lacks `{k}`")))
    }

    /// The provenance; with `want`, it must name the F32 checkpoint with that hash.
    fn provenance(&self, want: Option<&str>) -> Result<Provenance> {
        let p = Provenance {
            source_sha256: self.key("source_sha256")?.to_string(),
            source: self.key("source")?.to_string(),
        };
        if let Some(want) = want {
            if p.source_sha256 != want {
                return Err(Error::file(
                    self.path,
                    format!(
                        "quantised from a checkpoint with SHA-256 {}, but the F32 checkpoint now has {want} \
                         (re-run `fx-train quantize`)",
                        p.source_sha256
                    ),
                ));
            }
        }
        Ok(p)
    }

    fn calibration(&self) -> Result<CalibInfo> {
        let rows = self.key("calibration_rows")?;
        let rows = rows
            .parse::<usize>()
            .map_err(|_| Error::file(self.path, format!("metadata calibration_rows is {rows:?}, not a count")))?;
        let percentile = match self.meta.get("calibration_percentile") {
            Some(p) => Some(p.parse::<f64>().map_err(|_| {
                Error::file(self.path, format!("metadata calibration_percentile is {p:?}, not a number"))
            })?),
            None => None,
        };
        let decision_margin = match self.meta.get("decision_margin") {
            Some(m) => Some(m.parse::<f32>().ok().filter(|v| v.is_finite() && *v >= 0.0).ok_or_else(|| {
                Error::file(self.path, format!("metadata decision_margin is {m:?}, not a finite number >= 0"))
            })?),
            None => None,
        };
        Ok(CalibInfo { method: self.key("calibration_method")?.to_string(), percentile, rows, decision_margin })
    }

    fn tensor(&self, name: &str, dtype: Dtype, shape: Option<&[usize]>) -> Result<Vec<u8>> {
        let t = self.st.tensor(name).map_err(|_| Error::file(self.path, format!("tensor {name} is missing")))?;
        if t.dtype() != dtype {
            return Err(Error::file(self.path, format!("tensor {name} is {:?}, expected {dtype:?}", t.dtype())));
        }
        if let Some(s) = shape {
            if t.shape() != s {
                return Err(Error::file(self.path, format!("tensor {name} has shape {:?}, expected {s:?}", t.shape())));
            }
        }
        Ok(t.data().to_vec())
    }

    /// F32 values, all finite.
    fn floats(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        let v: Vec<f32> = self
            .tensor(name, Dtype::F32, Some(shape))?
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        if let Some(i) = v.iter().position(|x| !x.is_finite()) {
            return Err(Error::file(
                self.path,
                format!("tensor {name} holds the non-finite value {} at index {i}", v[i]),
            ));
        }
        Ok(v)
    }

    /// Scales: finite and > 0.
    fn scales(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        let v = self.floats(name, shape)?;
        if let Some(i) = v.iter().position(|x| *x <= 0.0) {
            return Err(Error::file(
                self.path,
                format!("tensor {name} holds the scale {} at index {i} (must be > 0)", v[i]),
            ));
        }
        Ok(v)
    }

    /// INT8 weights in ±127.
    fn int8(&self, name: &str, shape: &[usize]) -> Result<Vec<i8>> {
        let w: Vec<i8> = self.tensor(name, Dtype::I8, Some(shape))?.into_iter().map(|b| b as i8).collect();
        if let Some(i) = w.iter().position(|&x| x == i8::MIN) {
            return Err(Error::file(self.path, format!("tensor {name} holds -128 at index {i} (range is ±127)")));
        }
        Ok(w)
    }

    /// The first tensor not in `expected`.
    fn unexpected(&self, expected: &std::collections::HashSet<String>) -> Option<String> {
        self.st.names().into_iter().find(|n| !expected.contains(*n)).map(str::to_string)
    }
}

#[cfg(test)]
mod fuzz_tests;

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
            let mut q = quantised(keep);
            // A decision margin travels too (metadata `decision_margin`).
            q.calibration.decision_margin = (!keep.is_empty()).then_some(1.25e-3);
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
        // Consistent but wrong files (what a bug could write): the hash matches the edit,
        // so each check below is reached. A file changed behind the hash is the next test's.
        if meta.contains_key("tensors_sha256") {
            let d = tensors_sha256(t.iter().map(|(n, d, s, b)| (n.as_str(), *d, s.as_slice(), b.as_slice())));
            meta.insert("tensors_sha256".into(), d);
        }
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

    /// One weight byte changed inside ±127 (every range check passes) is caught by the
    /// file's own hash; so is a file without it.
    #[test]
    fn a_changed_weight_byte_fails_the_files_own_hash() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("q.safetensors");
        save(&quantised(&[]), &prov(), &path).unwrap();
        let bytes = std::fs::read(&path).unwrap();
        let st = SafeTensors::deserialize(&bytes).unwrap();
        let w = st.tensor("trunk.0.weight").unwrap();
        // The byte's offset in the file: the tensor's data lies inside `bytes`.
        let at = w.data().as_ptr() as usize - bytes.as_ptr() as usize + 5;
        let mut flipped = bytes.clone();
        flipped[at] = if flipped[at] == 3 { 4 } else { 3 };
        std::fs::write(&path, &flipped).unwrap();
        let e = load(&path, None).unwrap_err().to_string();
        assert!(e.contains("do not match the SHA-256") && e.contains("q.safetensors"), "{e}");
        let stripped = damaged(dir.path(), |_, m| drop(m.remove("tensors_sha256")));
        let e = load(&stripped, None).unwrap_err().to_string();
        assert!(e.contains("tensors_sha256"), "{e}");
    }

    #[test]
    fn damaged_files_are_one_line_errors_naming_the_tensor() {
        let dir = tempfile::tempdir().unwrap();
        type Edit = Box<dyn FnOnce(&mut Vec<(String, Dtype, Vec<usize>, Vec<u8>)>, &mut HashMap<String, String>)>;
        let cases: Vec<(Edit, &str)> = vec![
            (Box::new(|_, m| drop(m.insert("format".into(), "fx-int4/1".into()))), "metadata format"),
            (Box::new(|_, m| drop(m.remove("source_sha256"))), "source_sha256"),
            (Box::new(|_, m| drop(m.insert("model".into(), "tft".into()))), "metadata model"),
            (Box::new(|_, m| drop(m.insert("decision_margin".into(), "NaN".into()))), "decision_margin"),
            (Box::new(|_, m| drop(m.insert("decision_margin".into(), "-1".into()))), "decision_margin"),
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

    fn quantised_tft() -> QuantTft {
        use candle_core::{Device, Tensor};
        let cfg = TftConfig { n_observed: 3, n_known: 2, d: 8, n_head: 2, l_enc: 4, h: 2, ..TftConfig::default() };
        let model = Tft::new(cfg.clone(), &Device::Cpu, 4).unwrap();
        let t = |shape: &[usize], stream: u64| {
            let n: usize = shape.iter().product();
            Tensor::from_vec(uniforms(4, stream, n), shape, &Device::Cpu).unwrap()
        };
        let w = vec![(t(&[2, 4, 3], 1), t(&[2, 6, 2], 2))];
        crate::quantize_tft(&model, &w, CalibMethod::Percentile(99.0)).unwrap()
    }

    #[test]
    fn tft_round_trip_keeps_everything_and_names_scales_by_the_spec() {
        assert_eq!(
            scale_names("enc_vsn.vars.3.fc1.weight"),
            ("enc_vsn.vars.3.fc1.weight_scale".into(), "enc_vsn.vars.3.fc1.input_scale".into())
        );
        assert_eq!(
            scale_names("lstm_enc.weight_hh_l0"),
            ("lstm_enc.weight_hh_l0_scale".into(), "lstm_enc.input_hh_l0_scale".into())
        );
        let dir = tempfile::tempdir().unwrap();
        let q = quantised_tft();
        let path = dir.path().join("tft.int8.safetensors");
        save_tft(&q, &prov(), &path).unwrap();
        let (back, p) = load_tft(&path, Some(&"ab".repeat(32))).unwrap();
        // The file orders floats by name; compare as sets.
        let sorted = |q: &QuantTft| {
            let mut f = q.floats.clone();
            f.sort_by(|a, b| a.0.cmp(&b.0));
            f
        };
        assert_eq!(
            (back.config.clone(), back.matrices.clone(), back.calibration.clone()),
            (q.config.clone(), q.matrices.clone(), q.calibration.clone())
        );
        assert_eq!(sorted(&back), sorted(&q));
        assert_eq!(p, prov());
        let bytes = std::fs::read(&path).unwrap();
        let st = SafeTensors::deserialize(&bytes).unwrap();
        assert_eq!(st.tensor("lstm_dec.weight_hh_l0").unwrap().dtype(), Dtype::I8);
        assert_eq!(st.tensor("attn.q.1.weight").unwrap().shape(), &[4, 8]);
        assert_eq!(st.tensor("lstm_dec.input_hh_l0_scale").unwrap().dtype(), Dtype::F32);
        assert_eq!(st.tensor("enc_embed.0.weight").unwrap().dtype(), Dtype::F32);
        // A policy file is not a TFT file, nor the reverse.
        let pol = dir.path().join("dqn.safetensors");
        save(&quantised(&[]), &prov(), &pol).unwrap();
        assert!(load_tft(&pol, None).unwrap_err().to_string().contains("expected \"tft\""));
        assert!(load(&path, None).unwrap_err().to_string().contains("metadata model"));
    }

    #[test]
    fn damaged_tft_files_are_one_line_errors_naming_the_tensor() {
        let dir = tempfile::tempdir().unwrap();
        let good = dir.path().join("good.safetensors");
        save_tft(&quantised_tft(), &prov(), &good).unwrap();
        let bytes = std::fs::read(&good).unwrap();
        let st = SafeTensors::deserialize(&bytes).unwrap();
        let (_, header) = SafeTensors::read_metadata(&bytes).unwrap();
        let meta0 = header.metadata().clone().unwrap();
        let t0: Vec<Owned> =
            st.tensors().into_iter().map(|(n, v)| (n, v.dtype(), v.shape().to_vec(), v.data().to_vec())).collect();
        type Edit = Box<dyn Fn(&mut Vec<Owned>, &mut HashMap<String, String>)>;
        let cases: Vec<(Edit, &str)> = vec![
            (Box::new(|_, m| drop(m.insert("tft_config".into(), "{\"d\": \"wide\"}".into()))), "tft_config"),
            (
                Box::new(|_, m| drop(m.insert("tft_config".into(), "{\"d\": 4096, \"n_head\": 2}".into()))),
                "but tft_config implies",
            ),
            (Box::new(|t, _| t.retain(|x| x.0 != "ff.fc2.input_scale")), "ff.fc2.input_scale is missing"),
            (Box::new(|t, _| t.retain(|x| x.0 != "post_attn_norm.bias")), "post_attn_norm.bias is missing"),
            (
                Box::new(|t, _| set(t, "head.weight_scale", |x| x.3[0..4].copy_from_slice(&(-2f32).to_le_bytes()))),
                "head.weight_scale holds the scale -2",
            ),
            (Box::new(|t, _| set(t, "lstm_enc.weight_hh_l0", |x| x.3[5] = 0x80)), "lstm_enc.weight_hh_l0 holds -128"),
            (
                Box::new(|t, _| {
                    set(t, "enc_embed.2.bias", |x| x.3[0..4].copy_from_slice(&f32::INFINITY.to_le_bytes()))
                }),
                "enc_embed.2.bias holds the non-finite",
            ),
            (Box::new(|t, _| t.push(("extra".into(), Dtype::F32, vec![1], vec![0; 4]))), "unexpected tensor extra"),
        ];
        for (edit, want) in cases {
            let (mut t, mut m) = (t0.clone(), meta0.clone());
            edit(&mut t, &mut m);
            let path = dir.path().join("bad.safetensors");
            write_tensors(&path, &t, m).unwrap();
            let e = load_tft(&path, None).unwrap_err().to_string();
            assert!(e.contains(want) && e.contains("bad.safetensors") && !e.contains('\n'), "want {want:?}: {e}");
        }
        let e = load_tft(&good, Some(&"cd".repeat(32))).unwrap_err().to_string();
        assert!(e.contains("SHA-256"), "{e}");
    }
}
