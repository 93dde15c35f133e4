//! Test support for the sequence models: reading the reference fixtures and comparing
//! tensors the way MODELS.md "Parity" does.

use std::collections::HashMap;

use candle_core::{DType, Device, Tensor};

/// A parity fixture: every tensor by name plus the metadata strings.
pub(crate) struct Fixture {
    pub tensors: HashMap<String, Tensor>,
    pub metadata: HashMap<String, String>,
}

impl Fixture {
    /// Loads `/work/shared/fixtures/<name>` (relative to this crate).
    pub fn load(name: &str) -> Fixture {
        let path = format!("{}/../../../shared/fixtures/{name}", env!("CARGO_MANIFEST_DIR"));
        let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("reading {path}: {e}"));
        let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes).expect("fixture header");
        let metadata = meta.metadata().clone().unwrap_or_default();
        let tensors = candle_core::safetensors::load_buffer(&bytes, &Device::Cpu).expect("fixture tensors");
        Fixture { tensors, metadata }
    }

    /// The tensor `key` (panics with the name when absent).
    pub fn get(&self, key: &str) -> &Tensor {
        self.tensors.get(key).unwrap_or_else(|| panic!("fixture has no `{key}`"))
    }

    /// Only the model parameters (no `in.`, `out.`, `mid.`, `grad.`, `train.`, `loss`).
    pub fn params(&self) -> HashMap<String, Tensor> {
        self.tensors
            .iter()
            .filter(|(k, _)| {
                !["in.", "out.", "mid.", "grad.", "train."].iter().any(|p| k.starts_with(p)) && k.as_str() != "loss"
            })
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect()
    }
}

/// `‖a − b‖ / ‖b‖` in f64; NaN anywhere gives infinity so that it never passes.
pub(crate) fn rel_err(a: &Tensor, b: &Tensor) -> f64 {
    assert_eq!(a.dims(), b.dims(), "shape mismatch");
    let a = a.to_dtype(DType::F64).unwrap().flatten_all().unwrap().to_vec1::<f64>().unwrap();
    let b = b.to_dtype(DType::F64).unwrap().flatten_all().unwrap().to_vec1::<f64>().unwrap();
    let mut num = 0.0;
    let mut den = 0.0;
    for (x, y) in a.iter().zip(&b) {
        if !x.is_finite() || !y.is_finite() {
            return f64::INFINITY;
        }
        num += (x - y) * (x - y);
        den += y * y;
    }
    (num / den.max(f64::MIN_POSITIVE)).sqrt()
}

/// `max |a|` in f64 (infinity on NaN).
pub(crate) fn max_abs(a: &Tensor) -> f64 {
    let v = a.to_dtype(DType::F64).unwrap().flatten_all().unwrap().to_vec1::<f64>().unwrap();
    v.iter().fold(0.0, |m, x| if x.is_nan() { f64::INFINITY } else { m.max(x.abs()) })
}
