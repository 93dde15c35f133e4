//! PPO rollout storage: `T` steps × `E` accounts of `(state, action, log-prob, value,
//! reward, done)` as candle tensors on one device, filled row by row (one row per env
//! step) and read whole for GAE and the minibatch updates.

use candle_core::{DType, Device, Tensor};

use crate::checks::expect_tensor;
use crate::env::OBS_DIM;
use crate::error::{CandleContext, Error, Result};
use crate::gae::{gae, GaeConfig};

/// Rollout storage of `horizon` steps for `num_envs` accounts (row `t` = env step `t`).
///
/// The accessors return the full `[T, E, ..]` tensors; they share storage with the
/// rollout, so call [`clear`](Self::clear) and refill only after the update has consumed
/// them (or `.copy()` what must survive).
#[derive(Debug)]
pub struct Rollout {
    horizon: usize,
    num_envs: usize,
    len: usize,
    device: Device,
    pub(crate) states: Tensor,
    pub(crate) actions: Tensor,
    pub(crate) log_probs: Tensor,
    pub(crate) values: Tensor,
    pub(crate) rewards: Tensor,
    pub(crate) dones: Tensor,
}

impl Rollout {
    /// Empty storage for `horizon` steps of `num_envs` accounts on `device`.
    pub fn new(horizon: usize, num_envs: usize, device: &Device) -> Result<Self> {
        let ctx = "Rollout::new";
        if horizon == 0 || num_envs == 0 {
            return Err(Error::Config {
                context: ctx,
                message: format!("horizon and num_envs must be at least 1, got {horizon} x {num_envs}"),
            });
        }
        let z = |shape: &[usize], dt| Tensor::zeros(shape, dt, device).ctx(ctx);
        Ok(Self {
            horizon,
            num_envs,
            len: 0,
            device: device.clone(),
            states: z(&[horizon, num_envs, OBS_DIM], DType::F32)?,
            actions: z(&[horizon, num_envs], DType::U32)?,
            log_probs: z(&[horizon, num_envs], DType::F32)?,
            values: z(&[horizon, num_envs], DType::F32)?,
            rewards: z(&[horizon, num_envs], DType::F32)?,
            dones: z(&[horizon, num_envs], DType::F32)?,
        })
    }

    /// Steps per rollout `T`.
    pub fn horizon(&self) -> usize {
        self.horizon
    }

    /// Accounts per step `E`.
    pub fn num_envs(&self) -> usize {
        self.num_envs
    }

    /// Steps written so far.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when no step is written.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// True when all `T` steps are written.
    pub fn is_full(&self) -> bool {
        self.len == self.horizon
    }

    /// The device the storage lives on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Starts a new rollout (the old values stay until overwritten).
    pub fn clear(&mut self) {
        self.len = 0;
    }

    /// Writes step `len()`: `state` `[E, 56]` f32, `action` `[E]` u32, `log_prob`,
    /// `value`, `reward`, `done` `[E]` f32, all on the rollout's device.
    pub fn push(
        &mut self,
        state: &Tensor,
        action: &Tensor,
        log_prob: &Tensor,
        value: &Tensor,
        reward: &Tensor,
        done: &Tensor,
    ) -> Result<()> {
        let ctx = "Rollout::push";
        let (e, dev) = (self.num_envs, &self.device);
        if self.is_full() {
            return Err(Error::Full { what: "rollout", capacity: self.horizon, context: ctx });
        }
        expect_tensor(state, "state", ctx, &[e, OBS_DIM], DType::F32, dev)?;
        expect_tensor(action, "action", ctx, &[e], DType::U32, dev)?;
        expect_tensor(log_prob, "log_prob", ctx, &[e], DType::F32, dev)?;
        expect_tensor(value, "value", ctx, &[e], DType::F32, dev)?;
        expect_tensor(reward, "reward", ctx, &[e], DType::F32, dev)?;
        expect_tensor(done, "done", ctx, &[e], DType::F32, dev)?;
        let pairs = [
            (&self.states, state),
            (&self.actions, action),
            (&self.log_probs, log_prob),
            (&self.values, value),
            (&self.rewards, reward),
            (&self.dones, done),
        ];
        for (dst, src) in pairs {
            let row = src.contiguous().and_then(|x| x.unsqueeze(0)).ctx(ctx)?;
            dst.slice_set(&row, 0, self.len).ctx(ctx)?;
        }
        self.len += 1;
        Ok(())
    }

    /// Marks one more row as written by a kernel (GPU env).
    #[cfg(feature = "cuda")]
    pub(crate) fn advance(&mut self) {
        self.len += 1;
    }

    /// Records that device kernels wrote the next `n` rows (a replayed CUDA graph's
    /// collection, `GpuTradingEnv::collect_ppo_row`); at most up to the horizon.
    pub fn record_rows(&mut self, n: usize) {
        self.len = (self.len + n).min(self.horizon);
    }

    /// `[T, E, 56]` f32 states.
    pub fn states(&self) -> &Tensor {
        &self.states
    }

    /// `[T, E]` u32 actions.
    pub fn actions(&self) -> &Tensor {
        &self.actions
    }

    /// `[T, E]` f32 log-probabilities of the actions under the collecting policy.
    pub fn log_probs(&self) -> &Tensor {
        &self.log_probs
    }

    /// `[T, E]` f32 critic values of the states.
    pub fn values(&self) -> &Tensor {
        &self.values
    }

    /// `[T, E]` f32 rewards.
    pub fn rewards(&self) -> &Tensor {
        &self.rewards
    }

    /// `[T, E]` f32 done flags.
    pub fn dones(&self) -> &Tensor {
        &self.dones
    }

    /// Advantages and returns (`[T, E]` f32 each) of a full rollout by GAE, with
    /// `last_value` (`[E]` f32) the critic's value of the state after the last step. On a
    /// CUDA device this runs `kernels/env/gae.cu`; on the CPU [`gae`].
    pub fn advantages(&self, last_value: &Tensor, cfg: GaeConfig) -> Result<(Tensor, Tensor)> {
        let ctx = "Rollout::advantages";
        if !self.is_full() {
            return Err(Error::Config {
                context: ctx,
                message: format!("rollout holds {} of {} steps", self.len, self.horizon),
            });
        }
        expect_tensor(last_value, "last_value", ctx, &[self.num_envs], DType::F32, &self.device)?;
        #[cfg(feature = "cuda")]
        if self.device.is_cuda() {
            return crate::cuda::gae_device(&self.rewards, &self.values, &self.dones, last_value, cfg);
        }
        let host = |t: &Tensor| t.flatten_all().and_then(|x| x.to_vec1::<f32>()).ctx(ctx);
        let (adv, ret) = gae(
            &host(&self.rewards)?,
            &host(&self.values)?,
            &host(&self.dones)?,
            &host(last_value)?,
            self.num_envs,
            cfg,
        )?;
        let shape = (self.horizon, self.num_envs);
        Ok((Tensor::from_vec(adv, shape, &self.device).ctx(ctx)?, Tensor::from_vec(ret, shape, &self.device).ctx(ctx)?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    use crate::env::{CpuTradingEnv, EnvConfig, EnvData, N_ACTIONS};
    use crate::fixtures::Fixture;
    use crate::vec_env::VecEnv;

    #[test]
    fn collects_a_rollout_and_matches_host_gae() {
        let fx = Fixture::load("env.safetensors");
        let data = Arc::new(EnvData::new(fx.f32s("in.market"), fx.f64s("in.close")).expect("data"));
        let e = 8;
        let cfg = EnvConfig { num_envs: e, episode_len: 5, cost: 1e-4, seed: 3, env_offset: 11 };
        let mut env = CpuTradingEnv::new(data.clone(), cfg.clone()).expect("env");
        let mut twin = CpuTradingEnv::new(data, cfg).expect("env");
        let t_len = 12;
        let mut ro = Rollout::new(t_len, e, &Device::Cpu).expect("rollout");
        let mut host_r = Vec::new();
        let mut host_d = Vec::new();
        for t in 0..t_len {
            let logits: Vec<f32> = (0..e * N_ACTIONS).map(|i| ((i * 7 + t * 3) % 11) as f32 * 0.3 - 1.5).collect();
            let logits = Tensor::from_vec(logits, (e, N_ACTIONS), &Device::Cpu).expect("l");
            let values = Tensor::from_vec((0..e).map(|i| (i + t) as f32 * 0.01).collect::<Vec<_>>(), e, &Device::Cpu)
                .expect("v");
            let obs_before = env.observe().expect("obs").to_vec2::<f32>().expect("o");
            env.step_into_rollout(&logits, &values, &mut ro).expect("step");
            // the rollout's actions are what stream-3 sampling from softmax(logits) gives
            let probs = candle_core::Tensor::exp(&logits).expect("e");
            let probs = probs.broadcast_div(&probs.sum_keepdim(1).expect("s")).expect("p");
            let want = twin.sample_from_probs(&probs).expect("sample");
            let got = ro.actions().get(t).expect("row");
            assert_eq!(got.to_vec1::<u32>().expect("a"), want.to_vec1::<u32>().expect("a"));
            let s = twin.step_host(&want.to_vec1::<u32>().expect("a")).expect("step");
            host_r.extend(s.reward);
            host_d.extend(s.done);
            assert_eq!(ro.states().get(t).expect("row").to_vec2::<f32>().expect("s"), obs_before);
            // log-probs are log-softmax of the chosen action
            let lp = ro.log_probs().get(t).expect("row").to_vec1::<f32>().expect("lp");
            let ls = logits.to_vec2::<f32>().expect("l");
            for i in 0..e {
                let a = got.to_vec1::<u32>().expect("a")[i] as usize;
                let z: f64 = ls[i].iter().map(|&x| (x as f64).exp()).sum();
                assert!((lp[i] as f64 - ((ls[i][a] as f64) - z.ln())).abs() < 1e-6);
            }
        }
        assert!(ro.is_full());
        let dummy = Tensor::zeros(e, DType::F32, &Device::Cpu).expect("z");
        let ones = Tensor::ones(e, DType::F32, &Device::Cpu).expect("z");
        assert!(ro
            .push(
                &Tensor::zeros((e, OBS_DIM), DType::F32, &Device::Cpu).expect("z"),
                &Tensor::zeros(e, DType::U32, &Device::Cpu).expect("z"),
                &dummy,
                &dummy,
                &dummy,
                &dummy
            )
            .is_err());
        assert_eq!(ro.rewards().flatten_all().and_then(|x| x.to_vec1::<f32>()).expect("r"), host_r);
        assert_eq!(ro.dones().flatten_all().and_then(|x| x.to_vec1::<f32>()).expect("d"), host_d);
        let (adv, ret) = ro.advantages(&ones, GaeConfig::default()).expect("gae");
        let vals = ro.values().flatten_all().and_then(|x| x.to_vec1::<f32>()).expect("v");
        let (ha, hr) = gae(&host_r, &vals, &host_d, &[1.0; 8], e, GaeConfig::default()).expect("gae");
        assert_eq!(adv.flatten_all().and_then(|x| x.to_vec1::<f32>()).expect("a"), ha);
        assert_eq!(ret.flatten_all().and_then(|x| x.to_vec1::<f32>()).expect("r"), hr);
        assert!(ha.iter().all(|v| v.is_finite()));
        ro.clear();
        assert!(ro.is_empty());
        assert!(ro.advantages(&ones, GaeConfig::default()).is_err());
    }
}
