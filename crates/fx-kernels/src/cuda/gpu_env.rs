//! `GpuTradingEnv`: the trading environment as CUDA kernels, one thread per account, with
//! its state resident on the device (structure of arrays).

use std::sync::Arc;
use std::time::Instant;

use candle_core::{CudaDevice, DType, Device, Tensor};
use cudarc::driver::{CudaFunction, CudaSlice, CudaStream, DevicePtr, LaunchArgs, PushKernelArg};
use serde::{Deserialize, Serialize};

use super::gpu_series::GpuSeries;
use super::{alloc_tensor, cuda_device, dev_ptr, driver, DqnLoop, LaunchPlan, PTX_ENV_STEP, PTX_PPO};
use crate::checks::expect_tensor;
use crate::env::{reset_start_in, EnvConfig, EnvData, EnvState, N_ACTIONS, N_MARKET, OBS_DIM};
use crate::error::{CandleContext, Error, Result};
use crate::replay::ReplayBuffer;
use crate::rollout::Rollout;
use crate::schedule::LinearSchedule;
use crate::vec_env::{Step, VecEnv};

/// Options of the GPU backend.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct GpuEnvOptions {
    /// SM count for the launch grid (e.g. `fx_hw::GpuInfo::sm_count` from the
    /// `HardwareBudget`); `None` queries the device.
    pub sm_count: Option<u32>,
    /// Grid bound in "waves" of resident blocks (SMs × blocks per SM × waves); 0 or 1 =
    /// one wave, the kernels then loop grid-stride over the remaining accounts. More waves
    /// let the block scheduler overlap memory latency across more accounts at large E.
    pub grid_waves: u32,
}

impl GpuEnvOptions {
    /// Takes the SM count from a detected hardware budget (None when it found no GPU).
    pub fn from_budget(budget: &fx_hw::HardwareBudget) -> Self {
        Self { sm_count: budget.gpu.as_ref().map(|g| g.sm_count).filter(|&n| n > 0), ..Self::default() }
    }
}

/// A loaded kernel and its launch plan.
#[derive(Clone, Debug)]
struct Kernel {
    func: CudaFunction,
    plan: LaunchPlan,
}

impl Kernel {
    fn load(
        dev: &CudaDevice,
        name: &str,
        module: &str,
        ptx: &str,
        opts: &GpuEnvOptions,
        ctx: &'static str,
    ) -> Result<Self> {
        let func = dev.get_or_load_custom_func(name, module, ptx).ctx(ctx)?.into_cuda_function();
        let mut plan = LaunchPlan::for_function(&func, dev, opts.sm_count, ctx)?;
        plan.max_grid = plan.max_grid.saturating_mul(opts.grid_waves.max(1));
        Ok(Self { func, plan })
    }
}

/// The kernels' common leading arguments (series, parameters, state pointers), matching
/// `FX_ENV_ARGS` in `kernels/env/env_step.cu` and the head of `fx_ppo_experience`. The
/// addresses are taken once at construction: asking cudarc for them on every step would
/// add a stream-wait and an event record per buffer, pointless on candle's single stream
/// and the bulk of the per-step host overhead at small E.
#[derive(Clone, Copy, Debug)]
struct EnvArgs {
    market: u64,
    close: u64,
    t_len: u32,
    ep_len: u32,
    seg: u64,
    n_seg: u32,
    norm: u64,
    clip: f32,
    cost: f64,
    seed: u64,
    offset: u64,
    e: u32,
    t: u64,
    pos: u64,
    entry: u64,
    sip: u64,
    ep: u64,
    counter: u64,
}

impl EnvArgs {
    fn push<'a>(&'a self, b: &mut LaunchArgs<'a>) {
        b.arg(&self.market).arg(&self.close).arg(&self.t_len).arg(&self.ep_len);
        b.arg(&self.seg).arg(&self.n_seg).arg(&self.norm).arg(&self.clip).arg(&self.cost);
        b.arg(&self.seed).arg(&self.offset).arg(&self.e);
        b.arg(&self.t).arg(&self.pos).arg(&self.entry).arg(&self.sip).arg(&self.ep).arg(&self.counter);
    }
}

/// Raw device address of one of the env's own buffers (all on the candle stream).
pub(super) fn raw<T>(s: &CudaSlice<T>, stream: &CudaStream) -> u64 {
    let (p, _record) = s.device_ptr(stream);
    p
}

/// Host copy of the GPU env's per-account state (for tests and diagnostics).
#[derive(Clone, Debug, PartialEq)]
pub struct GpuEnvState {
    /// Time index per account.
    pub t: Vec<u32>,
    /// Position per account (−1, 0, +1).
    pub pos: Vec<i32>,
    /// Step counter per account.
    pub counter: Vec<u64>,
}

/// The trading environment on a CUDA device (see the crate docs); same semantics and
/// draws as [`CpuTradingEnv`](crate::CpuTradingEnv).
///
/// Invalid actions (≥ 3) cannot be checked on the host without a device sync: a kernel
/// treats them as flat and raises a flag that [`check_errors`](Self::check_errors) reports.
pub struct GpuTradingEnv {
    cfg: EnvConfig,
    device: Device,
    cdev: CudaDevice,
    stream: Arc<CudaStream>,
    // The device buffers, read by the kernels through the addresses cached in `args`; the
    // fields own the memory and keep it alive. The series is shared (see `GpuSeries`).
    series: Arc<GpuSeries>,
    /// The series' segments (for [`restore`](Self::restore)'s check).
    segments: Vec<std::ops::Range<usize>>,
    t: CudaSlice<u32>,
    pos: CudaSlice<i32>,
    entry: CudaSlice<f64>,
    sip: CudaSlice<u32>,
    ep: CudaSlice<u32>,
    counter: CudaSlice<u64>,
    err: CudaSlice<i32>,
    /// Cached kernel arguments (addresses of the buffers above).
    args: EnvArgs,
    /// Cached address of `err`.
    p_err: u64,
    k_observe: Kernel,
    k_step: Kernel,
    k_eps: Kernel,
    k_probs: Kernel,
    k_dqn: Kernel,
    k_ppo: Kernel,
    /// See [`GpuTradingEnv::instance_id`].
    instance: u64,
}

/// The next [`GpuTradingEnv::instance_id`].
static NEXT_INSTANCE: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

impl GpuTradingEnv {
    /// Uploads the series, resets every account (counter 0, as the CPU env) and loads the
    /// kernels on `device` (must be `Device::Cuda`).
    pub fn new(data: Arc<EnvData>, cfg: EnvConfig, device: &Device, opts: GpuEnvOptions) -> Result<Self> {
        let ctx = "GpuTradingEnv::new";
        cfg.validate(data.shortest_segment())?;
        let cdev = cuda_device(device, "device", ctx)?.clone();
        if data.len() > u32::MAX as usize || cfg.num_envs > u32::MAX as usize || cfg.episode_len > u32::MAX as usize {
            return Err(Error::Config {
                context: ctx,
                message: "series length, num_envs and episode_len must be below 2^32 on the GPU".into(),
            });
        }
        let stream = cdev.cuda_stream();
        let e = cfg.num_envs;
        let t0: Vec<u32> = (0..e)
            .map(|i| reset_start_in(data.segments(), cfg.episode_len, cfg.seed, cfg.env_offset + i as u64, 0) as u32)
            .collect();
        let entry0: Vec<f64> = t0.iter().map(|&t| data.close()[t as usize]).collect();
        let up = "GpuTradingEnv::new (upload)";
        let o = &opts;
        let series = GpuSeries::of(&data, device, &stream)?;
        let t = stream.clone_htod(&t0).map_err(driver(up))?;
        let pos = stream.alloc_zeros::<i32>(e).map_err(driver(up))?;
        let entry = stream.clone_htod(&entry0).map_err(driver(up))?;
        let sip = stream.alloc_zeros::<u32>(e).map_err(driver(up))?;
        let ep = stream.alloc_zeros::<u32>(e).map_err(driver(up))?;
        let counter = stream.alloc_zeros::<u64>(e).map_err(driver(up))?;
        let err = stream.alloc_zeros::<i32>(1).map_err(driver(up))?;
        let args = EnvArgs {
            market: series.market,
            close: series.close,
            t_len: data.len() as u32,
            ep_len: cfg.episode_len as u32,
            seg: series.seg,
            n_seg: data.segments().len() as u32,
            norm: series.norm,
            clip: series.clip,
            cost: cfg.cost,
            seed: cfg.seed,
            offset: cfg.env_offset,
            e: e as u32,
            t: raw(&t, &stream),
            pos: raw(&pos, &stream),
            entry: raw(&entry, &stream),
            sip: raw(&sip, &stream),
            ep: raw(&ep, &stream),
            counter: raw(&counter, &stream),
        };
        let p_err = raw(&err, &stream);
        Ok(Self {
            k_observe: Kernel::load(&cdev, "fx_env_observe", "fx_env_step", PTX_ENV_STEP, o, ctx)?,
            k_step: Kernel::load(&cdev, "fx_env_step", "fx_env_step", PTX_ENV_STEP, o, ctx)?,
            k_eps: Kernel::load(&cdev, "fx_select_epsilon_greedy", "fx_env_step", PTX_ENV_STEP, o, ctx)?,
            k_probs: Kernel::load(&cdev, "fx_select_from_probs", "fx_env_step", PTX_ENV_STEP, o, ctx)?,
            k_dqn: Kernel::load(&cdev, "fx_dqn_experience", "fx_env_step", PTX_ENV_STEP, o, ctx)?,
            k_ppo: Kernel::load(&cdev, "fx_ppo_experience", "fx_ppo_experience", PTX_PPO, o, ctx)?,
            series,
            segments: data.segments().to_vec(),
            t,
            pos,
            entry,
            sip,
            ep,
            counter,
            err,
            args,
            p_err,
            instance: NEXT_INSTANCE.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            device: device.clone(),
            cdev,
            stream,
            cfg,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &EnvConfig {
        &self.cfg
    }

    /// Device address of the series' market rows. Envs built from one `Arc<EnvData>`, or
    /// from views of one `Arc<SeriesRows>`, on one device share one device copy of the rows
    /// (the kernels only read them), so their addresses are equal; envs of different rows,
    /// or on different devices, have their own.
    pub fn series_address(&self) -> u64 {
        self.series.market
    }

    /// The launch plan of the step kernel (block size, grid bound, SM count).
    pub fn launch_plan(&self) -> LaunchPlan {
        self.k_step.plan
    }

    /// One uninitialised f32 block of `n` elements for a launch's outputs (one allocation
    /// and one address lookup instead of one per output), and its address.
    fn alloc_block(&self, n: usize, ctx: &'static str) -> Result<(Tensor, u64)> {
        let block = alloc_tensor::<f32>(&self.cdev, &[n], ctx)?;
        let p = dev_ptr::<f32>(&block, &self.stream, "outputs", ctx)?;
        Ok((block, p))
    }

    /// A step's outputs as views of one block: next_obs `[E, 56]`, obs `[E, 56]`, reward
    /// `[E]`, done `[E]`, with their addresses in that order.
    fn step_outputs(&self, ctx: &'static str) -> Result<(Step, [u64; 4])> {
        let e = self.cfg.num_envs;
        let row = e * OBS_DIM;
        let (block, p) = self.alloc_block(2 * row + 2 * e, ctx)?;
        let view =
            |off: usize, len: usize, shape: &[usize]| block.narrow(0, off, len).and_then(|x| x.reshape(shape)).ctx(ctx);
        let step = Step {
            next_obs: view(0, row, &[e, OBS_DIM])?,
            obs: view(row, row, &[e, OBS_DIM])?,
            reward: view(2 * row, e, &[e])?,
            done: view(2 * row + e, e, &[e])?,
        };
        let at = |off: usize| p + (off * std::mem::size_of::<f32>()) as u64;
        Ok((step, [at(0), at(row), at(2 * row), at(2 * row + e)]))
    }

    /// Copies the per-account state to the host (syncs the stream).
    pub fn state_host(&self) -> Result<GpuEnvState> {
        let ctx = "GpuTradingEnv::state_host";
        Ok(GpuEnvState {
            t: self.stream.clone_dtoh(&self.t).map_err(driver(ctx))?,
            pos: self.stream.clone_dtoh(&self.pos).map_err(driver(ctx))?,
            counter: self.stream.clone_dtoh(&self.counter).map_err(driver(ctx))?,
        })
    }

    /// A host copy of the evolving state (for checkpoints; syncs the stream). The same
    /// [`EnvState`] restores a [`CpuTradingEnv`](crate::CpuTradingEnv) or a GPU env over
    /// the same series and config, which then continue identically.
    pub fn state(&self) -> Result<EnvState> {
        let ctx = "GpuTradingEnv::state";
        let s = &self.stream;
        let t: Vec<u32> = s.clone_dtoh(&self.t).map_err(driver(ctx))?;
        let pos: Vec<i32> = s.clone_dtoh(&self.pos).map_err(driver(ctx))?;
        let sip: Vec<u32> = s.clone_dtoh(&self.sip).map_err(driver(ctx))?;
        let ep: Vec<u32> = s.clone_dtoh(&self.ep).map_err(driver(ctx))?;
        Ok(EnvState {
            t: t.into_iter().map(|x| x as usize).collect(),
            pos: pos.into_iter().map(|x| x as i8).collect(),
            entry: s.clone_dtoh(&self.entry).map_err(driver(ctx))?,
            steps_in_pos: sip.into_iter().map(u64::from).collect(),
            ep_step: ep.into_iter().map(u64::from).collect(),
            counter: s.clone_dtoh(&self.counter).map_err(driver(ctx))?,
        })
    }

    /// Restores a state from [`state`](Self::state) or `CpuTradingEnv::state`, checked on
    /// the host first ([`EnvState::check`]: the kernels trust the state to stay inside the
    /// series).
    pub fn restore(&mut self, state: &EnvState) -> Result<()> {
        let ctx = "GpuTradingEnv::restore";
        state.check(self.cfg.num_envs, &self.segments, self.cfg.episode_len, ctx)?;
        let t: Vec<u32> = state.t.iter().map(|&x| x as u32).collect();
        let pos: Vec<i32> = state.pos.iter().map(|&x| i32::from(x)).collect();
        let sip: Vec<u32> = state.steps_in_pos.iter().map(|&x| x as u32).collect();
        let ep: Vec<u32> = state.ep_step.iter().map(|&x| x as u32).collect();
        let s = self.stream.clone();
        // In-place copies: the buffers keep their addresses, so the cached kernel arguments
        // stay valid.
        s.memcpy_htod(&t, &mut self.t).map_err(driver(ctx))?;
        s.memcpy_htod(&pos, &mut self.pos).map_err(driver(ctx))?;
        s.memcpy_htod(&state.entry, &mut self.entry).map_err(driver(ctx))?;
        s.memcpy_htod(&sip, &mut self.sip).map_err(driver(ctx))?;
        s.memcpy_htod(&ep, &mut self.ep).map_err(driver(ctx))?;
        s.memcpy_htod(&state.counter, &mut self.counter).map_err(driver(ctx))?;
        Ok(())
    }

    /// Reports (and clears) the device-side error flag: an action ≥ 3 was passed to a step
    /// since the last check (it was applied as flat). Syncs the stream.
    pub fn check_errors(&mut self) -> Result<()> {
        let ctx = "GpuTradingEnv::check_errors";
        let flag = self.stream.clone_dtoh(&self.err).map_err(driver(ctx))?;
        if flag.first().copied().unwrap_or(0) != 0 {
            self.stream.memset_zeros(&mut self.err).map_err(driver(ctx))?;
            return Err(Error::OutOfRange {
                what: "an action passed to a GPU step (applied as flat)".into(),
                value: 3,
                bound: N_ACTIONS as u64,
                context: "GpuTradingEnv kernels",
            });
        }
        Ok(())
    }

    /// Checks and converts a `[E]` u32 action tensor (contiguous, on this device).
    fn actions_arg(&self, actions: &Tensor, ctx: &'static str) -> Result<Tensor> {
        expect_tensor(actions, "actions", ctx, &[self.cfg.num_envs], DType::U32, &self.device)?;
        actions.contiguous().ctx(ctx)
    }

    /// Checks an `[E, 3]` float tensor and returns it contiguous in f32.
    fn rows_arg(&self, x: &Tensor, what: &'static str, ctx: &'static str) -> Result<Tensor> {
        let e = self.cfg.num_envs;
        if x.dims() != [e, N_ACTIONS] {
            return Err(Error::shape(what, ctx, format!("[{e}, {N_ACTIONS}]"), format!("{:?}", x.dims())));
        }
        if !x.device().same_device(&self.device) {
            return Err(Error::Device { what, expected: crate::checks::device_name(&self.device), context: ctx });
        }
        x.to_dtype(DType::F32).and_then(|x| x.contiguous()).ctx(ctx)
    }

    /// Fused DQN collection without host round trips: ε-greedy actions from `q` (`[E, 3]`),
    /// step, and `(s, a, r, s', done)` written straight into `replay` at its ring position.
    /// Returns `(actions, obs)`: the actions taken (`[E]` u32) and the post-reset states
    /// for the next Q forward (`[E, 56]`). Needs `E ≤ replay.capacity()`.
    pub fn collect_dqn(&mut self, q: &Tensor, eps: f64, replay: &mut ReplayBuffer) -> Result<(Tensor, Tensor)> {
        let ctx = "GpuTradingEnv::collect_dqn";
        let q = self.rows_arg(q, "q", ctx)?;
        let e = self.cfg.num_envs;
        let actions_out = alloc_tensor::<u32>(&self.cdev, &[e], ctx)?;
        let (obs, p_obs) = self.alloc_block(e * OBS_DIM, ctx)?;
        self.launch_dqn(None, Some((&q, eps, Some(&actions_out))), replay, None, p_obs, None, ctx)?;
        replay.advance(e);
        Ok((actions_out, obs.reshape((e, OBS_DIM)).ctx(ctx)?))
    }

    /// The collection of a captured DQN iteration: [`collect_dqn`](Self::collect_dqn) with
    /// ε and the replay ring position read on the device from `lp` (ε = `eps` at the loop's
    /// step count, computed there), the post-reset states written into `obs` (`[E, 56]` f32)
    /// and the rewards and done flags into `reward` and `done` (`[E]` f32). Nothing on the
    /// host moves: after [`DqnLoop::launch_advance`] the caller mirrors the step with
    /// [`ReplayBuffer::advance`].
    #[allow(clippy::too_many_arguments)] // the kernel's buffers, each checked here
    pub fn collect_dqn_looped(
        &self,
        q: &Tensor,
        eps: LinearSchedule,
        lp: &DqnLoop,
        replay: &ReplayBuffer,
        obs: &Tensor,
        reward: &Tensor,
        done: &Tensor,
    ) -> Result<()> {
        let ctx = "GpuTradingEnv::collect_dqn_looped";
        let q = self.rows_arg(q, "q", ctx)?;
        let e = self.cfg.num_envs;
        expect_tensor(obs, "obs", ctx, &[e, OBS_DIM], DType::F32, &self.device)?;
        expect_tensor(reward, "reward", ctx, &[e], DType::F32, &self.device)?;
        expect_tensor(done, "done", ctx, &[e], DType::F32, &self.device)?;
        let s = &self.stream;
        let p_obs = dev_ptr::<f32>(obs, s, "obs", ctx)?;
        let outs = (0, dev_ptr::<f32>(reward, s, "reward", ctx)?, dev_ptr::<f32>(done, s, "done", ctx)?);
        // The actions taken stay on the device only through the replay ring.
        self.launch_dqn(None, Some((&q, 0.0, None)), replay, Some(outs), p_obs, Some((lp.address(), eps)), ctx)
    }

    /// The collection step of a captured PPO rollout: [`VecEnv::step_into_rollout`] into
    /// rollout row `row` (`< T`), with the post-reset states written into `obs` (`[E, 56]`
    /// f32). Nothing on the host moves: the caller records the rows
    /// ([`Rollout::record_rows`]) once the graph holding these launches ran.
    pub fn collect_ppo_row(
        &self,
        logits: &Tensor,
        values: &Tensor,
        row: usize,
        rollout: &Rollout,
        obs: &Tensor,
    ) -> Result<()> {
        let ctx = "GpuTradingEnv::collect_ppo_row";
        expect_tensor(obs, "obs", ctx, &[self.cfg.num_envs, OBS_DIM], DType::F32, &self.device)?;
        if row >= rollout.horizon() {
            return Err(Error::Full { what: "rollout", capacity: rollout.horizon(), context: ctx });
        }
        let p_obs = dev_ptr::<f32>(obs, &self.stream, "obs", ctx)?;
        self.launch_ppo(logits, values, row, rollout, 0, p_obs, ctx)
    }

    /// Launches `fx_ppo_experience` for rollout row `row` after the host-side checks
    /// (`p_next`: where the pre-reset next states go, 0 for nowhere).
    #[allow(clippy::too_many_arguments)]
    fn launch_ppo(
        &self,
        logits: &Tensor,
        values: &Tensor,
        row: usize,
        rollout: &Rollout,
        p_next: u64,
        p_obs: u64,
        ctx: &'static str,
    ) -> Result<()> {
        let e = self.cfg.num_envs;
        let logits = self.rows_arg(logits, "logits", ctx)?;
        expect_tensor(values, "values", ctx, &[e], DType::F32, &self.device)?;
        let values = values.contiguous().ctx(ctx)?;
        if rollout.num_envs() != e || !rollout.device().same_device(&self.device) {
            return Err(Error::shape(
                "rollout",
                ctx,
                format!("{e} envs on this device"),
                format!("{} envs", rollout.num_envs()),
            ));
        }
        let s = self.stream.clone();
        let p_l = dev_ptr::<f32>(&logits, &s, "logits", ctx)?;
        let p_v = dev_ptr::<f32>(&values, &s, "values", ctx)?;
        let p_s = dev_ptr::<f32>(&rollout.states, &s, "rollout.states", ctx)?;
        let p_a = dev_ptr::<u32>(&rollout.actions, &s, "rollout.actions", ctx)?;
        let p_lp = dev_ptr::<f32>(&rollout.log_probs, &s, "rollout.log_probs", ctx)?;
        let p_rv = dev_ptr::<f32>(&rollout.values, &s, "rollout.values", ctx)?;
        let p_r = dev_ptr::<f32>(&rollout.rewards, &s, "rollout.rewards", ctx)?;
        let p_d = dev_ptr::<f32>(&rollout.dones, &s, "rollout.dones", ctx)?;
        let p_err = self.p_err;
        let row32 = row as u32;
        let args = self.args;
        let mut b = s.launch_builder(&self.k_ppo.func);
        args.push(&mut b);
        b.arg(&p_l).arg(&p_v).arg(&row32);
        b.arg(&p_s).arg(&p_a).arg(&p_lp).arg(&p_rv).arg(&p_r).arg(&p_d);
        b.arg(&p_next).arg(&p_obs).arg(&p_err);
        // SAFETY: arguments match fx_ppo_experience; row < T and the rollout holds T·E rows
        // of this env's width; obs (and next_obs unless 0) hold E·56 f32.
        unsafe { b.launch(self.k_ppo.plan.config(e)) }.map_err(driver(ctx))?;
        Ok(())
    }

    /// Writes the current states into `obs` (`[E, 56]` f32, contiguous, on this device):
    /// [`VecEnv::observe`] without the allocation, for buffers a captured graph reuses.
    pub fn observe_into(&self, obs: &Tensor) -> Result<()> {
        let ctx = "GpuTradingEnv::observe_into";
        expect_tensor(obs, "obs", ctx, &[self.cfg.num_envs, OBS_DIM], DType::F32, &self.device)?;
        let p_obs = dev_ptr::<f32>(obs, &self.stream, "obs", ctx)?;
        self.launch_observe(p_obs, ctx)
    }

    /// This env's part of a population table row (`FxPopMember` in
    /// `kernels/env/fx_env.cuh`): series, parameters and state addresses; the replay, ε and
    /// sample-seed fields are left zero for the caller.
    pub(crate) fn member_args(&self) -> super::pop_collect::PopMemberArgs {
        let a = &self.args;
        super::pop_collect::PopMemberArgs {
            market: a.market,
            close: a.close,
            seg: a.seg,
            norm: a.norm,
            t: a.t,
            pos: a.pos,
            entry: a.entry,
            sip: a.sip,
            ep: a.ep,
            counter: a.counter,
            err: self.p_err,
            seed: a.seed,
            env_offset: a.offset,
            cost: a.cost,
            t_len: a.t_len,
            ep_len: a.ep_len,
            n_seg: a.n_seg,
            clip: a.clip,
            ..bytemuck::Zeroable::zeroed()
        }
    }

    /// A number no other env of this process has (counted at construction): a graph
    /// captured on this env's buffers can tell another env apart, even one allocated where
    /// a dropped env's buffers were.
    pub fn instance_id(&self) -> u64 {
        self.instance
    }

    /// Launches `fx_env_observe` into the `E·56` f32 at `p_obs`.
    fn launch_observe(&self, p_obs: u64, ctx: &'static str) -> Result<()> {
        let args = self.args;
        let mut b = self.stream.launch_builder(&self.k_observe.func);
        args.push(&mut b);
        b.arg(&p_obs);
        // SAFETY: arguments match fx_env_observe; the caller's buffer holds E·56 f32.
        unsafe { b.launch(self.k_observe.plan.config(self.cfg.num_envs)) }.map_err(driver(ctx))?;
        Ok(())
    }

    /// Launches `fx_dqn_experience` after the host-side checks (the caller advances the
    /// replay buffer's host counters, unless `looped` keeps them on the device).
    #[allow(clippy::too_many_arguments)]
    fn launch_dqn(
        &self,
        actions: Option<&Tensor>,
        fused: Option<(&Tensor, f64, Option<&Tensor>)>,
        replay: &ReplayBuffer,
        step_out: Option<(u64, u64, u64)>,
        p_obs: u64,
        looped: Option<(u64, LinearSchedule)>,
        ctx: &'static str,
    ) -> Result<()> {
        let e = self.cfg.num_envs;
        if !replay.device().same_device(&self.device) {
            return Err(Error::Device {
                what: "replay",
                expected: crate::checks::device_name(&self.device),
                context: ctx,
            });
        }
        if e > replay.capacity() {
            return Err(Error::Config {
                context: ctx,
                message: format!(
                    "num_envs {e} exceeds the replay capacity {} (slots would collide)",
                    replay.capacity()
                ),
            });
        }
        let s = self.stream.clone();
        let null = 0u64;
        let p_actions = match actions {
            Some(a) => dev_ptr::<u32>(a, &s, "actions", ctx)?,
            None => null,
        };
        let (p_q, eps, p_aout) = match fused {
            Some((q, eps, aout)) => {
                let p_aout = match aout {
                    Some(a) => dev_ptr::<u32>(a, &s, "actions_out", ctx)?,
                    None => null,
                };
                (dev_ptr::<f32>(q, &s, "q", ctx)?, eps, p_aout)
            }
            None => (null, 0.0, null),
        };
        let p_rs = dev_ptr::<f32>(&replay.states, &s, "replay.states", ctx)?;
        let p_ra = dev_ptr::<u32>(&replay.actions, &s, "replay.actions", ctx)?;
        let p_rr = dev_ptr::<f32>(&replay.rewards, &s, "replay.rewards", ctx)?;
        let p_rs2 = dev_ptr::<f32>(&replay.next_states, &s, "replay.next_states", ctx)?;
        let p_rd = dev_ptr::<f32>(&replay.dones, &s, "replay.dones", ctx)?;
        let capacity = replay.capacity() as u64;
        let ring_pos = replay.position() as u64;
        // Addresses of E·56 (next_obs) and E (reward, done) f32 from step_outputs.
        let (p_next, p_rew, p_done) = step_out.unwrap_or((null, null, null));
        let p_err = self.p_err;
        let args = self.args;
        let mut b = s.launch_builder(&self.k_dqn.func);
        args.push(&mut b);
        b.arg(&p_actions).arg(&p_q).arg(&eps).arg(&p_aout);
        b.arg(&p_rs).arg(&p_ra).arg(&p_rr).arg(&p_rs2).arg(&p_rd).arg(&capacity).arg(&ring_pos);
        b.arg(&p_next).arg(&p_rew).arg(&p_done).arg(&p_obs).arg(&p_err);
        let (p_loop, ramp) = looped.unwrap_or((null, LinearSchedule { start: 0.0, end: 0.0, steps: 0 }));
        b.arg(&p_loop).arg(&ramp.start).arg(&ramp.end).arg(&ramp.steps);
        // SAFETY: arguments match fx_dqn_experience; every buffer was checked for shape,
        // dtype and device; E <= capacity keeps the ring slots distinct and in range (the
        // loop's ring position is below the capacity: DqnLoop keeps it so).
        unsafe { b.launch(self.k_dqn.plan.config(e)) }.map_err(driver(ctx))?;
        Ok(())
    }

    /// Launches one of the two selection kernels.
    fn select(&self, k: &Kernel, x: &Tensor, eps: Option<f64>, ctx: &'static str) -> Result<Tensor> {
        let e = self.cfg.num_envs;
        let s = self.stream.clone();
        let out = alloc_tensor::<u32>(&self.cdev, &[e], ctx)?;
        let p_x = dev_ptr::<f32>(x, &s, "q/probs", ctx)?;
        let p_out = dev_ptr::<u32>(&out, &s, "actions", ctx)?;
        let p_counter = self.args.counter;
        let (seed, off, e32) = (self.cfg.seed, self.cfg.env_offset, e as u32);
        let mut b = s.launch_builder(&k.func);
        b.arg(&p_x);
        // Only fx_select_epsilon_greedy takes eps (second argument).
        if let Some(eps) = eps.as_ref() {
            b.arg(eps);
        }
        b.arg(&seed).arg(&off).arg(&e32).arg(&p_counter).arg(&p_out);
        // SAFETY: arguments match fx_select_epsilon_greedy / fx_select_from_probs; x is
        // [E, 3] f32 contiguous, out [E] u32.
        unsafe { b.launch(k.plan.config(e)) }.map_err(driver(ctx))?;
        Ok(out)
    }
}

impl VecEnv for GpuTradingEnv {
    fn num_envs(&self) -> usize {
        self.cfg.num_envs
    }

    fn device(&self) -> &Device {
        &self.device
    }

    fn seed(&self) -> u64 {
        self.cfg.seed
    }

    fn env_offset(&self) -> u64 {
        self.cfg.env_offset
    }

    fn observe(&self) -> Result<Tensor> {
        let ctx = "GpuTradingEnv::observe";
        let obs = alloc_tensor::<f32>(&self.cdev, &[self.cfg.num_envs, OBS_DIM], ctx)?;
        self.launch_observe(dev_ptr::<f32>(&obs, &self.stream, "obs", ctx)?, ctx)?;
        Ok(obs)
    }

    fn step(&mut self, actions: &Tensor) -> Result<Step> {
        let ctx = "GpuTradingEnv::step";
        let e = self.cfg.num_envs;
        let actions = self.actions_arg(actions, ctx)?;
        let (step, [p_n, p_o, p_r, p_d]) = self.step_outputs(ctx)?;
        let s = self.stream.clone();
        let p_a = dev_ptr::<u32>(&actions, &s, "actions", ctx)?;
        let p_err = self.p_err;
        let args = self.args;
        let mut b = s.launch_builder(&self.k_step.func);
        args.push(&mut b);
        b.arg(&p_a).arg(&p_n).arg(&p_r).arg(&p_d).arg(&p_o).arg(&p_err);
        // SAFETY: arguments match fx_env_step; the output block holds 2·E·56 + 2·E f32,
        // actions E u32.
        unsafe { b.launch(self.k_step.plan.config(e)) }.map_err(driver(ctx))?;
        Ok(step)
    }

    fn counters(&self) -> Result<Vec<u64>> {
        self.stream.clone_dtoh(&self.counter).map_err(driver("GpuTradingEnv::counters"))
    }

    fn epsilon_greedy(&self, q: &Tensor, eps: f64) -> Result<Tensor> {
        let ctx = "GpuTradingEnv::epsilon_greedy";
        let q = self.rows_arg(q, "q", ctx)?;
        self.select(&self.k_eps, &q, Some(eps), ctx)
    }

    fn sample_from_probs(&self, probs: &Tensor) -> Result<Tensor> {
        let ctx = "GpuTradingEnv::sample_from_probs";
        let p = self.rows_arg(probs, "probs", ctx)?;
        self.select(&self.k_probs, &p, None, ctx)
    }

    fn as_gpu(&self) -> Option<&GpuTradingEnv> {
        Some(self)
    }

    fn step_into_replay(&mut self, actions: &Tensor, replay: &mut ReplayBuffer) -> Result<Step> {
        let ctx = "GpuTradingEnv::step_into_replay";
        let actions = self.actions_arg(actions, ctx)?;
        let (step, [p_n, p_o, p_r, p_d]) = self.step_outputs(ctx)?;
        self.launch_dqn(Some(&actions), None, replay, Some((p_n, p_r, p_d)), p_o, None, ctx)?;
        replay.advance(self.cfg.num_envs);
        Ok(step)
    }

    fn step_into_rollout(&mut self, logits: &Tensor, values: &Tensor, rollout: &mut Rollout) -> Result<Step> {
        let ctx = "GpuTradingEnv::step_into_rollout";
        let e = self.cfg.num_envs;
        if rollout.is_full() {
            return Err(Error::Full { what: "rollout", capacity: rollout.horizon(), context: ctx });
        }
        let row = rollout.len();
        let (block, p_n) = self.alloc_block(2 * e * OBS_DIM, ctx)?;
        let p_o = p_n + (e * OBS_DIM * std::mem::size_of::<f32>()) as u64;
        let rows =
            |i: usize| block.narrow(0, i * e * OBS_DIM, e * OBS_DIM).and_then(|x| x.reshape((e, OBS_DIM))).ctx(ctx);
        let (next_obs, obs) = (rows(0)?, rows(1)?);
        self.launch_ppo(logits, values, row, rollout, p_n, p_o, ctx)?;
        rollout.advance();
        Ok(Step { next_obs, reward: rollout.rewards.get(row).ctx(ctx)?, done: rollout.dones.get(row).ctx(ctx)?, obs })
    }
}

/// What [`bench_env_steps`] measures.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum EnvBenchMode {
    /// [`VecEnv::step`] with fixed actions: next_obs, reward, done and obs written.
    Step,
    /// [`GpuTradingEnv::collect_dqn`]: fused ε-greedy from fixed Q-values, replay write
    /// of `(s, a, r, s', done)` and the next states.
    DqnCollect,
}

/// One benchmark measurement.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct EnvBenchResult {
    /// What was measured.
    pub mode: EnvBenchMode,
    /// Accounts `E`.
    pub num_envs: usize,
    /// Timed launches.
    pub steps: usize,
    /// Wall time of the timed launches (stream synchronised before and after).
    pub seconds: f64,
    /// Host time to issue the timed launches (before the final synchronisation): close to
    /// `seconds` means the loop is bound by host-side work, not by the kernel.
    pub host_seconds: f64,
    /// `E · steps / seconds`.
    pub env_steps_per_s: f64,
    /// Estimated DRAM bytes one account-step must move (see [`bytes_per_env_step`]).
    pub bytes_per_env_step: u64,
    /// `env_steps_per_s · bytes_per_env_step` in GB/s (compare with the device's peak).
    pub achieved_gb_per_s: f64,
}

/// Minimum DRAM traffic of one account-step, in bytes: state read and written
/// (t 4, pos 4, entry 8, steps-in-position 4, episode step 4, counter 8: 32 B each way),
/// the market row of the new time index (51·4 B), close prices (3·8 B), the action (4 B);
/// [`EnvBenchMode::Step`] writes next_obs and obs (2·56·4 B), reward and done (8 B);
/// [`EnvBenchMode::DqnCollect`] reads Q (12 B) and writes s, s' (2·224 B), a, r, done
/// (12 B), the action out (4 B) and obs (224 B).
pub fn bytes_per_env_step(mode: EnvBenchMode) -> u64 {
    let common = 2 * 32 + (N_MARKET as u64) * 4 + 3 * 8;
    match mode {
        EnvBenchMode::Step => common + 4 + 2 * (OBS_DIM as u64) * 4 + 8,
        EnvBenchMode::DqnCollect => common + 12 + 2 * (OBS_DIM as u64) * 4 + 12 + 4 + (OBS_DIM as u64) * 4,
    }
}

/// Measures environment steps per second on `device` (CUDA) for `num_envs` accounts over
/// a synthetic series of `series_len` rows (episode_len 256) with launch options `opts`:
/// 10 untimed steps, then `steps` timed launches between two stream synchronisations.
pub fn bench_env_steps(
    device: &Device,
    num_envs: usize,
    series_len: usize,
    steps: usize,
    mode: EnvBenchMode,
    opts: GpuEnvOptions,
) -> Result<EnvBenchResult> {
    let ctx = "bench_env_steps";
    let cdev = cuda_device(device, "device", ctx)?.clone();
    let data = Arc::new(synthetic_series(series_len.max(258), 12345)?);
    let cfg = EnvConfig { num_envs, episode_len: 256, cost: 1e-4, seed: 7, env_offset: 0 };
    let mut env = GpuTradingEnv::new(data, cfg, device, opts)?;
    let host_actions: Vec<u32> =
        (0..num_envs as u64).map(|i| (crate::rng::draw(1, 9, i, 0) * 3.0) as u32 % 3).collect();
    let actions = Tensor::from_vec(host_actions, num_envs, device).ctx(ctx)?;
    let q = Tensor::rand(-1f32, 1f32, (num_envs, N_ACTIONS), device).ctx(ctx)?;
    let mut replay = match mode {
        EnvBenchMode::DqnCollect => Some(ReplayBuffer::new(num_envs * 4, device)?),
        EnvBenchMode::Step => None,
    };
    let mut run = |env: &mut GpuTradingEnv| -> Result<()> {
        match replay.as_mut() {
            Some(r) => env.collect_dqn(&q, 0.1, r).map(|_| ()),
            None => env.step(&actions).map(|_| ()),
        }
    };
    for _ in 0..10 {
        run(&mut env)?;
    }
    let stream = cdev.cuda_stream();
    stream.synchronize().map_err(driver(ctx))?;
    let start = Instant::now();
    for _ in 0..steps {
        run(&mut env)?;
    }
    let host_seconds = start.elapsed().as_secs_f64();
    stream.synchronize().map_err(driver(ctx))?;
    let seconds = start.elapsed().as_secs_f64();
    env.check_errors()?;
    let env_steps_per_s = (num_envs * steps) as f64 / seconds;
    let bytes = bytes_per_env_step(mode);
    Ok(EnvBenchResult {
        mode,
        num_envs,
        steps,
        seconds,
        host_seconds,
        env_steps_per_s,
        bytes_per_env_step: bytes,
        achieved_gb_per_s: env_steps_per_s * bytes as f64 / 1e9,
    })
}

/// A deterministic synthetic series (random walk prices, uniform features) from the
/// counter-based draws.
pub(crate) fn synthetic_series(t_len: usize, seed: u64) -> Result<EnvData> {
    let mut close = Vec::with_capacity(t_len);
    let mut p = 1.1f64;
    for i in 0..t_len {
        p *= 1.0 + 0.003 * (crate::rng::draw(seed, 11, 0, i as u64) - 0.5);
        close.push(p);
    }
    let market = (0..t_len * N_MARKET).map(|i| 2.0 * crate::rng::draw(seed, 12, 0, i as u64) as f32 - 1.0).collect();
    EnvData::new(market, close)
}
