//! The decision API for services: load a policy once, then `act(&observation) -> action`
//! on the calling thread, with no allocation and no thread pool per call.
//!
//! ```no_run
//! use fx_quant::{Decide, Int8Policy};
//! # fn main() -> fx_quant::Result<()> {
//! // INT8 (written by `fx-train quantize`); the F32 alternative is a model's
//! // `cpu_policy()` (e.g. `DqnTrainer::load_state(..)?.online().cpu_policy()?`).
//! let mut policy = Int8Policy::load(std::path::Path::new("runs/default/checkpoint-0000002000.int8.safetensors"))?;
//! let obs = vec![0.0f32; policy.state_dim()];
//! let action = policy.act(&obs)?; // 0 short, 1 flat, 2 long
//! # let _ = action; Ok(()) }
//! ```

use crate::error::Result;
use crate::policy::Int8Policy;

/// A greedy policy that decides one observation at a time: [`Int8Policy`] (INT8) and
/// `fx_kernels::mlp_cpu::CpuPolicy` (F32) implement it, so a service can hold either as
/// `Box<dyn Decide>`.
pub trait Decide: Send {
    /// Observation width.
    fn state_dim(&self) -> usize;
    /// Number of actions.
    fn n_actions(&self) -> usize;
    /// The greedy action for `obs` (`state_dim` finite values); a wrong length or a
    /// non-finite value is a one-line error, never a panic.
    fn act(&mut self, obs: &[f32]) -> Result<usize>;
    /// The last call's scores (Q values or logits).
    fn scores(&self) -> &[f32];
}

impl Decide for Int8Policy {
    fn state_dim(&self) -> usize {
        Int8Policy::state_dim(self)
    }
    fn n_actions(&self) -> usize {
        Int8Policy::n_actions(self)
    }
    fn act(&mut self, obs: &[f32]) -> Result<usize> {
        Int8Policy::act(self, obs)
    }
    fn scores(&self) -> &[f32] {
        Int8Policy::scores(self)
    }
}

impl Decide for fx_kernels::mlp_cpu::CpuPolicy {
    fn state_dim(&self) -> usize {
        self.dims().input
    }
    fn n_actions(&self) -> usize {
        self.dims().n_actions
    }
    fn act(&mut self, obs: &[f32]) -> Result<usize> {
        Ok(fx_kernels::mlp_cpu::CpuPolicy::act(self, obs)? as usize)
    }
    fn scores(&self) -> &[f32] {
        fx_kernels::mlp_cpu::CpuPolicy::scores(self)
    }
}

impl Int8Policy {
    /// Loads a quantised checkpoint (see [`crate::checkpoint`]) for decisions on this
    /// CPU's best ISA. The source checkpoint's hash is not checked here (a service may
    /// deploy the INT8 file alone); [`crate::checkpoint::load`] checks it when asked.
    pub fn load(path: &std::path::Path) -> Result<Self> {
        let (net, _) = crate::checkpoint::load(path, None)?;
        Int8Policy::new(&net)
    }
}
