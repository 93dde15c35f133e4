//! Test helpers: loading the PyTorch parity fixtures and comparing tensors.

use std::collections::HashMap;

use candle_core::{DType, Device, Tensor};

/// A fixture file from `/work/shared/fixtures`, loaded on the CPU.
pub(crate) struct Fixture {
    pub map: HashMap<String, Tensor>,
    pub path: String,
}

impl Fixture {
    pub fn load(name: &str) -> Self {
        let path = format!("{}/../../../shared/fixtures/{name}", env!("CARGO_MANIFEST_DIR"));
        let map = candle_core::safetensors::load(&path, &Device::Cpu)
            .unwrap_or_else(|e| panic!("cannot load fixture {path}: {e}"));
        Self { map, path }
    }

    pub fn get(&self, key: &str) -> &Tensor {
        self.map.get(key).unwrap_or_else(|| panic!("fixture {} lacks {key}", self.path))
    }
}

/// `‖a − b‖ / ‖b‖` in f64 (`b` the reference); NaN in `a` gives NaN, which fails any
/// `<=` bound.
pub(crate) fn rel_err(a: &Tensor, b: &Tensor) -> f64 {
    assert_eq!(a.dims(), b.dims(), "shape mismatch in rel_err");
    let a: Vec<f64> = a.to_dtype(DType::F64).unwrap().flatten_all().unwrap().to_vec1().unwrap();
    let b: Vec<f64> = b.to_dtype(DType::F64).unwrap().flatten_all().unwrap().to_vec1().unwrap();
    let num: f64 = a.iter().zip(&b).map(|(x, y)| (x - y) * (x - y)).sum::<f64>().sqrt();
    let den: f64 = b.iter().map(|y| y * y).sum::<f64>().sqrt();
    if den == 0.0 {
        num
    } else {
        num / den
    }
}

/// Asserts that two parameter stores hold the same tensors, bit for bit (`what` ends the
/// message naming the first that differs).
pub(crate) fn assert_same_params(a: &crate::params::ParamStore, b: &crate::params::ParamStore, what: &str) {
    let (ta, tb) = (a.to_tensors("").unwrap(), b.to_tensors("").unwrap());
    assert_eq!(ta.len(), tb.len(), "parameter count {what}");
    for (k, v) in ta {
        let x: Vec<f32> = v.flatten_all().unwrap().to_vec1().unwrap();
        let y: Vec<f32> = tb[&k].flatten_all().unwrap().to_vec1().unwrap();
        assert!(x.iter().zip(&y).all(|(p, q)| p.to_bits() == q.to_bits()), "{k} {what}");
    }
}
