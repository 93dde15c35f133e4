//! Test-only access to the parity fixtures in `/work/shared/fixtures`.

use safetensors::{Dtype, SafeTensors};

/// One fixture file, read whole into memory (they are small).
pub(crate) struct Fixture {
    bytes: Vec<u8>,
}

impl Fixture {
    /// Loads `shared/fixtures/NAME`; panics (test only) when the file is missing.
    pub(crate) fn load(name: &str) -> Self {
        let path = format!("{}/../../../shared/fixtures/{name}", env!("CARGO_MANIFEST_DIR"));
        let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("reading {path}: {e}"));
        Self { bytes }
    }

    fn raw(&self, key: &str, dtype: Dtype) -> (Vec<usize>, Vec<u8>) {
        let st = SafeTensors::deserialize(&self.bytes).expect("valid safetensors");
        let t = st.tensor(key).unwrap_or_else(|e| panic!("fixture key {key}: {e}"));
        assert_eq!(t.dtype(), dtype, "fixture key {key} dtype");
        (t.shape().to_vec(), t.data().to_vec())
    }

    /// Shape of a tensor.
    pub(crate) fn shape(&self, key: &str) -> Vec<usize> {
        let st = SafeTensors::deserialize(&self.bytes).expect("valid safetensors");
        let t = st.tensor(key).unwrap_or_else(|e| panic!("fixture key {key}: {e}"));
        t.shape().to_vec()
    }

    pub(crate) fn f32s(&self, key: &str) -> Vec<f32> {
        let (_, b) = self.raw(key, Dtype::F32);
        b.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
    }

    pub(crate) fn f64s(&self, key: &str) -> Vec<f64> {
        let (_, b) = self.raw(key, Dtype::F64);
        b.chunks_exact(8).map(|c| f64::from_le_bytes(c.try_into().expect("8 bytes"))).collect()
    }

    pub(crate) fn u64s(&self, key: &str) -> Vec<u64> {
        let (_, b) = self.raw(key, Dtype::U64);
        b.chunks_exact(8).map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes"))).collect()
    }

    pub(crate) fn i64s(&self, key: &str) -> Vec<i64> {
        let (_, b) = self.raw(key, Dtype::I64);
        b.chunks_exact(8).map(|c| i64::from_le_bytes(c.try_into().expect("8 bytes"))).collect()
    }
}
