//! INT8 post-training quantisation of the DQN and PPO greedy policies and of the TFT, and
//! INT8 decisions and forecasts on the CPU without a thread pool.
//!
//! The pipeline (what `fx-train quantize` runs; `docs/QUANT.md` explains the choices):
//! 1. [`FloatNet`]: the F32 policy network on the host under the spec's layer names
//!    (`FloatNet::from_dqn` / `from_ppo`), with an f64 forward that is both the accuracy
//!    reference and the calibration pass;
//! 2. [`calibrate::input_scales`]: one symmetric input scale per layer from observations
//!    (`minmax` or `percentile`);
//! 3. [`QuantNet::quantize`]: per-output-channel symmetric INT8 weights; chosen layers may
//!    stay F32;
//! 4. [`int8_file::save`] / [`int8_file::load`]: the `fx-int8/1` safetensors file beside
//!    the F32 checkpoint, checked on load;
//! 5. [`Int8Policy`]: decisions, one observation at a time, with INT8 products on the best
//!    ISA this CPU has ([`Isa`]: AVX-512 VNNI, AVX-VNNI, AVX2, scalar), tested bit for bit
//!    against the plain [`reference::reference_scores`];
//! 6. [`Decide`]: the small trait a service holds (INT8 or F32 `CpuPolicy`), and
//!    [`GuardedPolicy`]: INT8 decisions that ask the F32 policy on near-ties (the file's
//!    [`decision_margin`]).
//!
//! The sequence models: [`tft`] quantises every weight matrix of a TFT and forecasts with
//! them ([`quantize_tft`], [`QuantTft`], [`Int8Tft`]; the file through
//! [`int8_file::save_tft`]); [`mamba2`] gives MAMBA-2's one-bar CPU step INT8 projections.
//! On the GPU (feature `cuda`), `CudaInt8Tft` forecasts with the variable selection
//! networks' per-variable GRNs in INT8, one kernel per network (`tft_vsn`); a policy's
//! `QuantNet::cuda_policy` runs it as one fused INT8 kernel (`gpu_policy`), with the scalar
//! reference's scores to the bit, and `fx_models::mlp::cuda::MlpDecider` implements
//! [`Decide`].

pub mod activation;
pub mod calibrate;
mod decide;
mod error;
pub mod float_net;
mod gemv_i8;
pub mod guard;
pub mod int8_file;
// INT8 policies on the GPU (`QuantNet::cuda_policy`) and `Decide` for the GPU decider.
#[cfg(feature = "cuda")]
mod gpu_policy;
pub mod mamba2;
mod policy;
pub mod qnet;
pub mod reference;
pub mod tft;
// The GPU forecaster's variable selection (and, in tests, its CPU reference).
#[cfg(any(test, feature = "cuda"))]
mod tft_vsn;

pub use calibrate::CalibMethod;
pub use decide::{Decide, Forecast};
pub use error::{Error, Result};
pub use float_net::{FloatLayer, FloatNet, PolicyKind};
pub use gemv_i8::Isa;
pub use guard::{decision_margin, GuardedPolicy};
pub use mamba2::{mamba2_int8_step, Int8Rows};
pub use policy::Int8Policy;
pub use qnet::{CalibInfo, QuantLayer, QuantLinear, QuantNet};
#[cfg(feature = "cuda")]
pub use tft::CudaInt8Tft;
pub use tft::{quantize_tft, Int8Tft, QuantTft};

/// Calibrates and quantises `net` on `calib_obs` (`rows × state_dim`), keeping the layers
/// named in `keep_f32` in F32.
pub fn quantize(net: &FloatNet, calib_obs: &[f32], method: CalibMethod, keep_f32: &[&str]) -> Result<QuantNet> {
    let scales = calibrate::input_scales(net, calib_obs, method)?;
    let info = CalibInfo {
        method: method.name().to_string(),
        percentile: match method {
            CalibMethod::Percentile(p) => Some(p),
            CalibMethod::MinMax | CalibMethod::Dynamic => None,
        },
        rows: calib_obs.len() / net.state_dim().max(1),
        decision_margin: None,
    };
    QuantNet::quantize(net, &scales, keep_f32, info)
}

/// Random networks and observations for this crate's tests.
#[cfg(test)]
pub(crate) mod testing {
    use crate::float_net::{FloatLayer, FloatNet, PolicyKind};

    /// A deterministic stream of uniforms in `[-1, 1)`.
    pub fn uniforms(seed: u64, stream: u64, n: usize) -> Vec<f32> {
        (0..n as u64).map(|i| (fx_kernels::rng::draw(seed, stream, 0, i) * 2.0 - 1.0) as f32).collect()
    }

    /// A random `kind` network `state_dim → hidden… → n_actions` with PyTorch-like init.
    pub fn random_net(kind: PolicyKind, state_dim: usize, hidden: &[usize], n_actions: usize, seed: u64) -> FloatNet {
        let names = kind.layer_names();
        let mut dims = Vec::new();
        let mut w = state_dim;
        for &h in hidden {
            dims.push((h, w));
            w = h;
        }
        if kind.dueling() {
            dims.push((1, w));
        }
        dims.push((n_actions, w));
        assert_eq!(dims.len(), names.len());
        let layers = names
            .iter()
            .zip(dims)
            .enumerate()
            .map(|(k, (name, (out, inp)))| {
                let bound = 1.0 / (inp as f32).sqrt();
                FloatLayer {
                    name: name.to_string(),
                    out,
                    inp,
                    weight: uniforms(seed, 2 * k as u64, out * inp).iter().map(|v| v * bound).collect(),
                    bias: uniforms(seed, 2 * k as u64 + 1, out).iter().map(|v| v * bound).collect(),
                }
            })
            .collect();
        FloatNet { kind, layers }
    }
}
