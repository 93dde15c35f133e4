//! Test helpers: a trading env over a synthetic AR(1) return series (an exploitable
//! signal) and policy evaluation on it.

use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use fx_kernels::{rng, CpuTradingEnv, EnvConfig, EnvData, VecEnv, N_MARKET};

use crate::dqn::DuelingDqn;
use crate::ppo::ActorCritic;
use crate::Result;

/// AR coefficient of the returns.
pub(crate) const PHI: f64 = 0.8;
/// Stationary standard deviation of the returns.
pub(crate) const SIGMA_R: f64 = 0.01;

/// [`ar1_env`]'s series and config as a GPU env on `dev` (default options).
#[cfg(all(test, feature = "cuda"))]
pub(crate) fn ar1_gpu_env(
    num_envs: usize,
    episode_len: usize,
    t_len: usize,
    seed: u64,
    dev: &candle_core::Device,
) -> fx_kernels::GpuTradingEnv {
    let c = ar1_env(num_envs, episode_len, t_len, seed);
    let opts = fx_kernels::GpuEnvOptions::default();
    fx_kernels::GpuTradingEnv::new(c.data().clone(), c.config().clone(), dev, opts).unwrap()
}

/// `E` accounts over `t_len` bars whose log-returns follow `r_t = φ r_{t−1} + σ ε_t`; the
/// only non-zero market feature is the last return, normalised (`r_t / σ_r`). The
/// oracle (position = sign of the last return) earns ≈ φ·E|r| ≈ 6.4e-3 per step.
pub(crate) fn ar1_env(num_envs: usize, episode_len: usize, t_len: usize, seed: u64) -> CpuTradingEnv {
    let sigma = SIGMA_R * (1.0 - PHI * PHI).sqrt();
    let mut r = 0.0f64;
    let mut close = Vec::with_capacity(t_len);
    let mut market = vec![0.0f32; t_len * N_MARKET];
    let mut c = 1.0f64;
    for t in 0..t_len {
        // Box–Muller from two counter-based draws.
        let u1 = rng::draw(seed, 100, 0, t as u64).max(1e-300);
        let u2 = rng::draw(seed, 101, 0, t as u64);
        let z = (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos();
        r = PHI * r + sigma * z;
        c *= r.exp();
        close.push(c);
        market[t * N_MARKET] = (r / SIGMA_R) as f32;
    }
    let data = Arc::new(EnvData::new(market, close).expect("valid synthetic data"));
    let cfg = EnvConfig { num_envs, episode_len, cost: 1e-4, seed, env_offset: 0 };
    CpuTradingEnv::new(data, cfg).expect("valid env config")
}

/// The policies compared by the learning tests.
pub(crate) enum Policy<'a> {
    /// argmax Q.
    Dqn(&'a DuelingDqn),
    /// argmax of the actor's logits.
    Ppo(&'a ActorCritic),
    /// Always flat (action 1).
    Flat,
    /// Uniform random actions (the env's counter-based draws with ε = 1).
    Random,
}

/// Mean reward per account and step of `policy` over `steps` steps of `env`.
pub(crate) fn evaluate(env: &mut CpuTradingEnv, steps: usize, policy: Policy<'_>) -> Result<f64> {
    let e = env.num_envs();
    let mut total = 0.0f64;
    for _ in 0..steps {
        let obs = env.observe().unwrap();
        let actions = match &policy {
            Policy::Dqn(net) => net.greedy_actions(&obs)?,
            Policy::Ppo(m) => m.greedy_actions(&obs)?,
            Policy::Flat => Tensor::ones(e, DType::U32, &Device::Cpu).unwrap(),
            Policy::Random => {
                env.epsilon_greedy(&Tensor::zeros((e, 3), DType::F32, &Device::Cpu).unwrap(), 1.0).unwrap()
            }
        };
        let step = env.step(&actions).unwrap();
        total += step.reward.to_dtype(DType::F64).unwrap().sum_all().unwrap().to_scalar::<f64>().unwrap();
    }
    Ok(total / (steps * e) as f64)
}
