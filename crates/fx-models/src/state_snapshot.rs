//! [`StateSnapshot`]: a trainer's whole state copied to host memory, written later — on
//! another thread if the caller wants, so that a training loop does not wait for the
//! serialisation, the non-finite check and the disk.

use std::collections::HashMap;
use std::path::Path;

use candle_core::Tensor;

use crate::error::{Context, Result};

/// Named host tensors and the metadata of one state file (see
/// `DqnTrainer::snapshot` / `PpoTrainer::snapshot`); `Send`, so it can be written from
/// another thread while training goes on.
#[derive(Debug, Clone)]
pub struct StateSnapshot {
    tensors: HashMap<String, Tensor>,
    metadata: HashMap<String, String>,
}

impl StateSnapshot {
    /// Copies every tensor to the host (the device work queued before is waited for). On
    /// a GPU the small tensors cross together with one stream synchronisation
    /// (`fx_kernels::readback`), so a checkpoint does not keep the GPU idle while the
    /// host waits on each of some 70 copies in turn.
    pub(crate) fn new(
        tensors: HashMap<String, Tensor>,
        metadata: HashMap<String, String>,
        context: &'static str,
    ) -> Result<Self> {
        let (names, device): (Vec<String>, Vec<Tensor>) = tensors.into_iter().unzip();
        let host = fx_kernels::readback::to_host(&device).ctx(context)?;
        Ok(Self { tensors: names.into_iter().zip(host).collect(), metadata })
    }

    /// Adds a caller's metadata entry (e.g. a sweep's progress beside a population's
    /// state), read back with `fx_precision::read_metadata`; a trainer's own keys are not
    /// to be replaced (an error says so).
    pub fn with_metadata(mut self, key: &str, value: String) -> Result<Self> {
        if self.metadata.contains_key(key) {
            return Err(crate::error::Error::config("StateSnapshot::with_metadata", format!("key `{key}` is taken")));
        }
        self.metadata.insert(key.to_string(), value);
        Ok(self)
    }

    /// Writes the state file atomically (temporary file, then rename); refuses a state
    /// holding a NaN or infinity, naming the tensor.
    pub fn write(&self, path: &Path) -> Result<()> {
        fx_precision::save_tensors_atomic(path, &self.tensors, &self.metadata).ctx("StateSnapshot::write")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn assert_send<T: Send + 'static>() {}

    /// The snapshot can move to a writer thread, and what it writes reads back equal.
    #[test]
    fn is_send_and_round_trips() {
        assert_send::<StateSnapshot>();
        let t = Tensor::new(&[1.0f32, 2.0, 3.0], &Device::Cpu).unwrap();
        let s = StateSnapshot::new(
            HashMap::from([("x".to_string(), t)]),
            HashMap::from([("k".to_string(), "v".to_string())]),
            "test",
        )
        .unwrap();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.safetensors");
        std::thread::spawn({
            let (s, path) = (s.clone(), path.clone());
            move || s.write(&path).unwrap()
        })
        .join()
        .unwrap();
        let back = candle_core::safetensors::load(&path, &Device::Cpu).unwrap();
        assert_eq!(back["x"].to_vec1::<f32>().unwrap(), [1.0, 2.0, 3.0]);
    }
}
