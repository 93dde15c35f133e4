//! The decision API for services: load a policy once, then `act(&observation) -> action`
//! on the calling thread, with no allocation and no thread pool per call; and its forecaster
//! equivalent, [`Forecast`]: a model fed one bar at a time, `forecast(&bar) -> prediction`.
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

use crate::error::{first_non_finite, Error, Result};
use crate::policy::Int8Policy;

/// A greedy policy that decides one observation at a time, or a batch of them:
/// [`Int8Policy`] (INT8),
/// `fx_models::mlp::cpu::CpuPolicy` (F32), [`crate::GuardedPolicy`] (INT8, F32 on near-ties)
/// and, with the `cuda` feature, the GPU's `MlpDecider` implement it, so a service can hold
/// any of them as `Box<dyn Decide>`.
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
    /// Greedy actions for `actions.len()` rows of `obs` (row-major, `rows × state_dim`),
    /// each row's the one [`Decide::act`] gives it; afterwards [`Decide::scores`] is
    /// unspecified. A wrong length or a non-finite value anywhere in `obs` is a one-line
    /// error (its index counted over the whole batch) and no action is written. This
    /// default decides row by row; policies with a batch path (INT8, F32 on the CPU and the
    /// GPU) override it.
    fn act_batch(&mut self, obs: &[f32], actions: &mut [usize]) -> Result<()> {
        let d = self.state_dim();
        check_batch(obs, actions.len(), d, "Decide::act_batch")?;
        for (r, a) in actions.iter_mut().enumerate() {
            *a = self.act(&obs[r * d..(r + 1) * d])?;
        }
        Ok(())
    }
}

/// `obs` holds `rows` finite observations of width `d`.
pub(crate) fn check_batch(obs: &[f32], rows: usize, d: usize, context: &'static str) -> Result<()> {
    if obs.len() != rows * d {
        return Err(Error::Length { what: "obs", expected: rows * d, got: obs.len(), context });
    }
    if let Some((index, value)) = first_non_finite(obs) {
        return Err(Error::NonFinite { what: "obs".into(), index, value: value as f64, context });
    }
    Ok(())
}

/// `act_batch` for a policy whose batch call takes `u32` actions and at most `chunk` rows
/// (`chunk` ≤ 256): calls of `chunk` rows through a stack buffer, no allocation. `obs` is
/// checked whole first, so a bad value is reported at its index in the batch and no action
/// is written.
pub(crate) fn act_batch_u32(
    obs: &[f32],
    actions: &mut [usize],
    d: usize,
    chunk: usize,
    context: &'static str,
    mut batch: impl FnMut(&[f32], &mut [u32]) -> Result<()>,
) -> Result<()> {
    check_batch(obs, actions.len(), d, context)?;
    let chunk = chunk.clamp(1, 256);
    let mut buf = [0u32; 256];
    for (rows, out) in obs.chunks(chunk * d.max(1)).zip(actions.chunks_mut(chunk)) {
        let buf = &mut buf[..out.len()];
        batch(rows, buf)?;
        for (a, &b) in out.iter_mut().zip(buf.iter()) {
            *a = b as usize;
        }
    }
    Ok(())
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
    fn act_batch(&mut self, obs: &[f32], actions: &mut [usize]) -> Result<()> {
        Int8Policy::act_batch(self, obs, actions)
    }
}

impl Decide for fx_models::mlp::cpu::CpuPolicy {
    fn state_dim(&self) -> usize {
        self.dims().input
    }
    fn n_actions(&self) -> usize {
        self.dims().n_actions
    }
    fn act(&mut self, obs: &[f32]) -> Result<usize> {
        Ok(fx_models::mlp::cpu::CpuPolicy::act(self, obs)? as usize)
    }
    fn scores(&self) -> &[f32] {
        fx_models::mlp::cpu::CpuPolicy::scores(self)
    }
    /// [`fx_models::mlp::cpu::CpuPolicy::act_batch`] ([`fx_models::mlp::cpu::ROWS`] rows a
    /// pass) in calls of 40 passes.
    fn act_batch(&mut self, obs: &[f32], actions: &mut [usize]) -> Result<()> {
        let (d, chunk) = (self.dims().input, 40 * fx_models::mlp::cpu::ROWS);
        act_batch_u32(obs, actions, d, chunk, "CpuPolicy (Decide::act_batch)", |rows, out| {
            Ok(fx_models::mlp::cpu::CpuPolicy::act_batch(self, rows, out)?)
        })
    }
}

/// A forecaster fed one bar at a time through its recurrent state: MAMBA-2's CPU step
/// (`fx_models::mamba2::decode_cpu::Mamba2CpuStep`, from `fx_models::Mamba2::cpu_step`, F32)
/// implements it, so a service can hold a forecaster as `Box<dyn Forecast>`.
///
/// ```no_run
/// use fx_quant::Forecast;
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let dev = candle_core::Device::Cpu;
/// let model = fx_models::Mamba2::load(fx_models::Mamba2Config::default(), "model.safetensors".as_ref(), &dev)?;
/// let mut f: Box<dyn Forecast> = Box::new(model.cpu_step()?);
/// let bar = vec![0.0f32; f.n_in()];
/// let next = f.forecast(&bar)?; // the model's next-bar prediction
/// # let _ = next; Ok(()) }
/// ```
pub trait Forecast: Send {
    /// Features per bar.
    fn n_in(&self) -> usize;
    /// Feeds one bar (`n_in` finite values) and returns the prediction after it; a wrong
    /// length or a non-finite value is a one-line error that leaves the state as it was.
    fn forecast(&mut self, bar: &[f32]) -> Result<f32>;
    /// Forgets every bar seen (the state before the first).
    fn reset(&mut self);
}

impl Forecast for fx_models::mamba2::decode_cpu::Mamba2CpuStep {
    fn n_in(&self) -> usize {
        self.dims().n_in
    }
    fn forecast(&mut self, bar: &[f32]) -> Result<f32> {
        Ok(self.step(bar)?)
    }
    fn reset(&mut self) {
        fx_models::mamba2::decode_cpu::Mamba2CpuStep::reset(self)
    }
}

impl Int8Policy {
    /// Loads a quantised checkpoint (see [`crate::int8_file`]) for decisions on this
    /// CPU's best ISA. The source checkpoint's hash is not checked here (a service may
    /// deploy the INT8 file alone); [`crate::int8_file::load`] checks it when asked.
    pub fn load(path: &std::path::Path) -> Result<Self> {
        let (net, _) = crate::int8_file::load(path, None)?;
        Int8Policy::new(&net)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::float_net::PolicyKind;
    use crate::testing::{random_net, uniforms};
    use candle_core::{Device, Tensor};
    use fx_models::mlp::cpu::CpuPolicy;
    use fx_models::mlp::reference::{GreedyMlp, Head, Linear};

    /// Each batch path through the trait gives every row its single decision's action, across
    /// `CpuPolicy`'s chunks, and a wrong length or a NaN is an error that writes nothing.
    #[test]
    fn batches_through_the_trait_decide_like_single_rows() {
        for kind in [PolicyKind::Dqn, PolicyKind::Ppo] {
            let hidden: &[usize] = if kind.dueling() { &[24, 20, 12] } else { &[24, 20] };
            let net = random_net(kind, 9, hidden, 3, 5);
            let t = |v: &[f32], shape: (usize, usize)| Tensor::from_slice(v, shape, &Device::Cpu).unwrap();
            let tensors: Vec<(Tensor, Tensor)> = net
                .layers
                .iter()
                .map(|l| (t(&l.weight, (l.out, l.inp)), t(&l.bias, (l.out, 1)).flatten_all().unwrap()))
                .collect();
            let lin = |i: usize| Linear { weight: &tensors[i].0, bias: &tensors[i].1 };
            let nh = kind.hidden_layers();
            let hidden: Vec<_> = (0..nh).map(|i| (lin(i), kind.activation())).collect();
            let head = if kind.dueling() {
                Head::Dueling { value: lin(nh), advantage: lin(nh + 1) }
            } else {
                Head::Logits(lin(nh))
            };
            let f32_policy = CpuPolicy::new(&GreedyMlp { hidden: &hidden, head }).unwrap();
            let q = crate::quantize(&net, &uniforms(1, 2, 64 * 9), crate::CalibMethod::Dynamic, &[]).unwrap();
            let obs: Vec<f32> = uniforms(7, 8, 300 * 9).iter().map(|v| 3.0 * v).collect();
            let policies: Vec<Box<dyn Decide>> = vec![Box::new(f32_policy), Box::new(Int8Policy::new(&q).unwrap())];
            for mut p in policies {
                let mut acts = vec![usize::MAX; 300];
                p.act_batch(&obs, &mut acts).unwrap();
                for (r, row) in obs.chunks_exact(9).enumerate() {
                    assert_eq!(acts[r], p.act(row).unwrap(), "{kind:?} row {r}");
                }
                let e = p.act_batch(&obs[..10], &mut acts[..1]).unwrap_err().to_string();
                assert!(e.contains("obs") && !e.contains('\n'), "{e}");
                // A NaN in the second chunk: its index in the whole batch, no action written.
                let mut bad = obs.clone();
                bad[270 * 9 + 3] = f32::NAN;
                let mut untouched = vec![usize::MAX; 300];
                let e = p.act_batch(&bad, &mut untouched).unwrap_err().to_string();
                assert!(e.contains(&format!("index {}", 270 * 9 + 3)) && !e.contains('\n'), "{e}");
                assert!(untouched.iter().all(|&a| a == usize::MAX));
            }
        }
    }

    /// A MAMBA-2 as a `Box<dyn Forecast>`: bars in, predictions out; reset replays the same
    /// predictions; a bad bar is an error.
    #[test]
    fn a_mamba2_forecasts_through_the_trait() {
        let cfg = fx_models::Mamba2Config {
            n_in: 6,
            d_model: 16,
            n_layer: 2,
            d_state: 8,
            headdim: 8,
            ..fx_models::Mamba2Config::default()
        };
        let model = fx_models::Mamba2::new(cfg, &candle_core::Device::Cpu, 3).unwrap();
        let mut f: Box<dyn Forecast> = Box::new(model.cpu_step().unwrap());
        assert_eq!(f.n_in(), 6);
        let bars: Vec<Vec<f32>> = (0..4).map(|t| (0..6).map(|i| ((t * 6 + i) as f32 * 0.37).sin()).collect()).collect();
        let first: Vec<f32> = bars.iter().map(|b| f.forecast(b).unwrap()).collect();
        assert!(first.iter().all(|v| v.is_finite()));
        f.reset();
        let again: Vec<f32> = bars.iter().map(|b| f.forecast(b).unwrap()).collect();
        assert_eq!(first, again);
        let e = f.forecast(&bars[0][..5]).unwrap_err().to_string();
        assert!(e.contains("x") && e.contains('6'), "{e}");
    }
}
