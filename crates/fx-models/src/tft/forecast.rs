//! TFT quantile forecasts without candle's per-op dispatch: the fused training step's
//! forward alone ([`TftForecaster`]), written once over [`TftBackend`], so the same code
//! runs on the CPU reference backend ([`CpuTft`]), on CUDA, and on a backend that changes
//! how the matrices are multiplied (`fx-quant`'s INT8 TFT intercepts the weight GEMMs and
//! the LSTM's recurrent product by their weights' addresses: [`Tft::weight_matrices`]).
//!
//! Dropout is off; a forecast is the candle forward's in inference mode, to F32 rounding
//! (tested against it).

use crate::tft::ops::{CpuTft, TftBackend};
use candle_core::Tensor;
use fx_precision::Precision;

use super::fused::TftFused;
use super::Tft;
use crate::error::{Context, Error, Result};

const CTX: &str = "TftForecaster";

/// Forecasts of one model at up to a fixed batch of windows on backend `K`; see the
/// module docs. Buffers are allocated once, at construction.
pub struct TftForecaster<K: TftBackend> {
    fused: TftFused<K>,
}

impl<K: TftBackend> std::fmt::Debug for TftForecaster<K> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "TftForecaster({:?})", self.fused)
    }
}

impl<K: TftBackend> TftForecaster<K> {
    /// A forecaster of `model` on backend `k` for batches of up to `batch` windows, in
    /// F32; shapes beyond the fused kernels' limits are a one-line error.
    pub fn new(k: K, model: &Tft, batch: usize) -> Result<Self> {
        Self::with_precision(k, model, batch, Precision::F32)
    }

    /// The same with the GEMMs at `precision`: F32, or BF16 (BF16 copies of the GEMM
    /// operands, F32 accumulation, everything else F32; on CUDA).
    pub fn with_precision(k: K, model: &Tft, batch: usize, precision: Precision) -> Result<Self> {
        Ok(Self { fused: TftFused::new(k, model, batch, precision)? })
    }

    /// The largest batch a call takes.
    pub fn batch_size(&self) -> usize {
        self.fused.batch_size()
    }

    /// The backend (e.g. to read what an instrumented backend recorded).
    pub fn backend(&self) -> &K {
        self.fused.backend()
    }

    /// Quantile forecasts `[B, H, n_quantiles]` of `observed [B, L_enc, n_observed]` and
    /// `known [B, L_enc + H, n_known]` (F32, on the backend's device) for `1 ≤ B ≤`
    /// [`Self::batch_size`]; a smaller batch is padded with zero windows, whose forecasts
    /// are dropped.
    pub fn forecast(&self, observed: &Tensor, known: &Tensor) -> Result<Tensor> {
        let cap = self.batch_size();
        let b = observed.dims().first().copied().unwrap_or(0);
        if b == 0 || b > cap || known.dims().first() != Some(&b) {
            return Err(Error::shape(
                "observed / known",
                CTX,
                format!("the same batch of 1..={cap} windows"),
                format!("{:?} and {:?}", observed.dims(), known.dims()),
            ));
        }
        if b == cap {
            return self.fused.forecast(observed, known);
        }
        let pad = |t: &Tensor| -> Result<Tensor> {
            let mut dims = t.dims().to_vec();
            dims[0] = cap - b;
            let z = Tensor::zeros(dims, t.dtype(), t.device()).ctx(CTX)?;
            Tensor::cat(&[t, &z], 0).ctx(CTX)
        };
        let q = self.fused.forecast(&pad(observed)?, &pad(known)?)?;
        q.narrow(0, 0, b).and_then(|t| t.contiguous()).ctx(CTX)
    }
}

impl Tft {
    /// A forecaster of this model on the CPU reference backend (plain loops, F32) for
    /// batches of up to `batch` windows; see [`TftForecaster`].
    pub fn cpu_forecaster(&self, batch: usize) -> Result<TftForecaster<CpuTft>> {
        TftForecaster::new(CpuTft::new(), self, batch)
    }

    /// A forecaster of this model on its CUDA device (the fused step's kernels: a forecast
    /// is some 70 GEMMs, one launch per LSTM step and a few dozen fused kernels, and
    /// captures as one CUDA graph) for batches of up to `batch` windows, its GEMMs at
    /// `precision` (F32 or BF16).
    #[cfg(feature = "cuda")]
    pub fn cuda_forecaster(
        &self,
        batch: usize,
        precision: Precision,
    ) -> Result<TftForecaster<crate::tft::ops_cuda::CudaTft>> {
        let k = crate::tft::ops_cuda::CudaTft::new(self.params().device()).ctx(CTX)?;
        TftForecaster::with_precision(k, self, batch, precision)
    }
}

#[cfg(test)]
mod tests {
    use candle_core::Device;

    use super::*;
    use crate::seq::ops::Ctx;
    use crate::seq_testing::rel_err;
    use crate::tft::TftConfig;

    fn fresh_seed() -> u64 {
        fx_hw::test_seed(concat!(module_path!(), ":", line!()))
    }

    fn rand(shape: &[usize], seed: u64, stream: u64, scale: f64) -> Tensor {
        let n: usize = shape.iter().product();
        let v: Vec<f32> =
            (0..n as u64).map(|i| ((fx_kernels::rng::draw(seed, stream, i, 0) * 2.0 - 1.0) * scale) as f32).collect();
        Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
    }

    /// The CPU forecaster against candle's forward in inference mode (dropout configured but
    /// off), on fresh random models and inputs, at the full batch and a padded smaller one.
    #[test]
    fn cpu_forecasts_match_candle_inference() {
        let cfg = TftConfig {
            n_observed: 6,
            n_known: 3,
            d: 16,
            n_head: 4,
            l_enc: 7,
            h: 3,
            dropout: 0.2,
            quantiles: vec![0.1, 0.5, 0.9],
            ln_eps: 1e-5,
            n_instruments: 0,
        };
        let seed = fresh_seed();
        let m = Tft::new(cfg.clone(), &Device::Cpu, seed).unwrap();
        let f = m.cpu_forecaster(4).unwrap();
        assert_eq!(f.batch_size(), 4);
        let c = Ctx::inference(Precision::F32);
        for b in [4, 3, 1] {
            let obs = rand(&[b, cfg.l_enc, cfg.n_observed], seed, 1 + b as u64, 2.0);
            let known = rand(&[b, cfg.l_enc + cfg.h, cfg.n_known], seed, 10 + b as u64, 1.0);
            let want = m.forward(&c, &obs, &known).unwrap();
            for _ in 0..2 {
                let got = f.forecast(&obs, &known).unwrap();
                assert_eq!(got.dims(), want.dims());
                let v = got.flatten_all().unwrap().to_vec1::<f32>().unwrap();
                assert!(v.iter().all(|x| x.is_finite()));
                let e = rel_err(&got, &want);
                assert!(e < 1e-5, "seed {seed}, batch {b}: rel err {e}");
            }
        }
        let too_big = rand(&[5, cfg.l_enc, cfg.n_observed], seed, 99, 1.0);
        let known = rand(&[5, cfg.l_enc + cfg.h, cfg.n_known], seed, 98, 1.0);
        let e = f.forecast(&too_big, &known).unwrap_err().to_string();
        assert!(e.contains("1..=4") && !e.contains('\n'), "{e}");
    }

    /// The weight matrices are parameters of the store, each with spec names for its parts.
    #[test]
    fn weight_matrices_are_named_parameters() {
        let m =
            Tft::new(TftConfig { d: 8, n_head: 2, l_enc: 4, h: 2, ..TftConfig::default() }, &Device::Cpu, 1).unwrap();
        let mats = m.weight_matrices();
        let mut names = Vec::new();
        for v in &mats {
            let parts = m.params().part_names(v).unwrap();
            assert!(v.rank() == 2 || (v.rank() == 3 && v.dims()[0] == parts.len()));
            names.extend(parts);
        }
        assert!(names.contains(&"lstm_enc.weight_hh_l0".to_string()), "{names:?}");
        assert!(names.contains(&"enc_vsn.vars.54.glu.fc5.weight".to_string()), "{names:?}");
        assert!(names.iter().all(|n| n.contains("weight")), "{names:?}");
        let other = Tft::new(TftConfig { d: 8, n_head: 2, ..TftConfig::default() }, &Device::Cpu, 1).unwrap();
        assert!(m.params().part_names(other.weight_matrices()[0]).is_none());
    }
}

#[cfg(all(test, feature = "cuda"))]
mod gpu_tests {
    use super::*;
    use crate::seq::ops::Ctx;
    use crate::seq_testing::rel_err;
    use crate::tft::TftConfig;

    /// The CUDA forecaster against candle's forward on the same GPU, at the default size
    /// (fresh random model and inputs), full and padded batches; skipped without a GPU.
    #[test]
    fn cuda_forecasts_match_candle_inference() {
        let Some(dev) = fx_hw::test_gpu("cuda_forecasts_match_candle_inference") else { return };
        let cfg = TftConfig::default();
        let seed = fx_hw::test_seed(concat!(module_path!(), ":", line!()));
        let m = Tft::new(cfg.clone(), &dev, seed % 1000).unwrap();
        let f = m.cuda_forecaster(16, Precision::F32).unwrap();
        let c = Ctx::inference(Precision::F32);
        for b in [16, 5] {
            let n = |len: usize, stream: u64, scale: f64| -> Vec<f32> {
                (0..len as u64)
                    .map(|i| ((fx_kernels::rng::draw(seed, stream, i, 0) * 2.0 - 1.0) * scale) as f32)
                    .collect()
            };
            let obs = Tensor::from_vec(n(b * cfg.l_enc * cfg.n_observed, 1, 2.0), (b, cfg.l_enc, cfg.n_observed), &dev)
                .unwrap();
            let kn = cfg.l_enc + cfg.h;
            let known = Tensor::from_vec(n(b * kn * cfg.n_known, 2, 1.0), (b, kn, cfg.n_known), &dev).unwrap();
            let want = m.forward(&c, &obs, &known).unwrap();
            let got = f.forecast(&obs, &known).unwrap();
            let v = got.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            assert!(v.iter().all(|x| x.is_finite()));
            let e = rel_err(&got, &want);
            eprintln!("CUDA TFT forecaster, batch {b}: rel err {e:.2e} against candle (seed {seed})");
            assert!(e < 1e-4, "batch {b}: rel err {e} (seed {seed})");
        }
    }
}
