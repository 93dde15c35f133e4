//! [`PopDqnCollect`]: DQN collection for a population in one launch per kernel. Member `k`
//! has its own [`GpuTradingEnv`], [`ReplayBuffer`] and ε ramp; a table on the device holds
//! each member's addresses and settings (`FxPopMember` in `kernels/env/fx_env.cuh`), and the
//! member-batched kernels (`fx_pop_observe`, `fx_pop_dqn_experience` in
//! `kernels/env/env_step.cu`, `fx_pop_replay_sample` in `kernels/env/replay.cu`) take member
//! `k` from `blockIdx.y`. Per account they run the solo kernels' code (the same device
//! functions), so member `k`'s states, replay rows and draws are those of
//! [`GpuTradingEnv::collect_dqn`] and [`ReplayBuffer::sample_keyed`] on its own env and
//! buffer, bit for bit (device test `pop_collection_equals_the_solo_kernels`).
//!
//! Launching per member costs N launches for each of these steps, which dominates a
//! population's iteration once its update is batched; here it is one.
//!
//! The table caches device addresses: the collector keeps clones of the replay tensors
//! (their memory stays alive) and checks on every call that it is handed the same envs
//! (their instance ids) and replays (their tensors' ids) it was built on.

use std::sync::Arc;

use candle_core::{DType, Device, Tensor, TensorId};
use cudarc::driver::{CudaFunction, CudaSlice, CudaStream, DevicePtr, LaunchConfig, PushKernelArg};

use super::{cuda_device, dev_ptr, driver, DqnLoop, GpuTradingEnv, LaunchPlan, PTX_ENV_STEP, PTX_REPLAY};
use crate::checks::expect_tensor;
use crate::env::{N_ACTIONS, OBS_DIM};
use crate::error::{CandleContext, Error, Result};
use crate::replay::{MemberClock, ReplayBatch, ReplayBuffer};
use crate::schedule::LinearSchedule;
use crate::vec_env::VecEnv;

/// Threads per block of the member-batched sampling kernel.
const SAMPLE_BLOCK: u32 = 256;

/// One member's row of the device table: `FxPopMember` in `kernels/env/fx_env.cuh`, field for
/// field (pointers as u64; 224 bytes, no padding: `Pod` refuses any, and both sides assert
/// the size).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, bytemuck::Pod, bytemuck::Zeroable)]
pub(crate) struct PopMemberArgs {
    pub market: u64,
    pub close: u64,
    pub seg: u64,
    pub norm: u64,
    pub t: u64,
    pub pos: u64,
    pub entry: u64,
    pub sip: u64,
    pub ep: u64,
    pub counter: u64,
    pub err: u64,
    pub rb_s: u64,
    pub rb_a: u64,
    pub rb_r: u64,
    pub rb_s2: u64,
    pub rb_d: u64,
    pub seed: u64,
    pub env_offset: u64,
    pub cost: f64,
    pub eps_start: f64,
    pub eps_end: f64,
    pub eps_steps: u64,
    pub sample_seed: u64,
    pub clock0: u64,
    pub ring_start: u64,
    pub key0: u64,
    pub t_len: u32,
    pub ep_len: u32,
    pub n_seg: u32,
    pub clip: f32,
}

const _: () = assert!(std::mem::size_of::<PopMemberArgs>() == 224);

/// See the module docs.
pub struct PopDqnCollect {
    rows: Vec<PopMemberArgs>,
    table: CudaSlice<u8>,
    address: u64,
    envs: Vec<u64>,
    replays: Vec<TensorId>,
    /// Keeps every replay's memory alive while the table points at it.
    _replay_tensors: Vec<[Tensor; 5]>,
    num_envs: usize,
    capacity: usize,
    device: Device,
    stream: Arc<CudaStream>,
    plan: LaunchPlan,
    k_observe: CudaFunction,
    k_experience: CudaFunction,
    k_sample: CudaFunction,
}

impl std::fmt::Debug for PopDqnCollect {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PopDqnCollect").field("members", &self.rows.len()).field("num_envs", &self.num_envs).finish()
    }
}

impl PopDqnCollect {
    /// The table for members `envs[k]`, `replays[k]`, `epsilon[k]`, `sample_seeds[k]` (one of
    /// each per member, every env with the same number of accounts, at most the replays'
    /// common capacity, all on one CUDA device). A member's sample seed is the one its solo
    /// trainer would pass to [`ReplayBuffer::sample_keyed`] (a DQN trainer's own seed, which
    /// need not be its env's).
    pub fn new(
        envs: &[&GpuTradingEnv],
        replays: &[ReplayBuffer],
        epsilon: &[LinearSchedule],
        sample_seeds: &[u64],
    ) -> Result<Self> {
        const CTX: &str = "PopDqnCollect::new";
        let n = envs.len();
        if n == 0 || replays.len() != n || epsilon.len() != n || sample_seeds.len() != n || n > u16::MAX as usize {
            return Err(Error::Config {
                context: CTX,
                message: format!(
                    "need one env, replay, ε schedule and sample seed per member (1..=65535 members), got {n}, {}, {}, {}",
                    replays.len(),
                    epsilon.len(),
                    sample_seeds.len()
                ),
            });
        }
        let device = VecEnv::device(envs[0]).clone();
        let cdev = cuda_device(&device, "envs", CTX)?;
        let stream = cdev.cuda_stream();
        let (num_envs, capacity) = (envs[0].config().num_envs, replays[0].capacity());
        let mut rows = Vec::with_capacity(n);
        for (k, (((env, replay), eps), &sample_seed)) in
            envs.iter().zip(replays).zip(epsilon).zip(sample_seeds).enumerate()
        {
            if env.config().num_envs != num_envs || replay.capacity() != capacity || num_envs > capacity {
                return Err(Error::Config {
                    context: CTX,
                    message: format!(
                        "member {k}: {} accounts and replay capacity {} (every member needs {num_envs} accounts, \
                         capacity {capacity}, accounts at most the capacity)",
                        env.config().num_envs,
                        replay.capacity()
                    ),
                });
            }
            if !VecEnv::device(*env).same_device(&device) || !replay.device().same_device(&device) {
                return Err(Error::Device {
                    what: "member env or replay",
                    expected: "the first env's device".into(),
                    context: CTX,
                });
            }
            let p = |t: &Tensor, what| dev_ptr::<f32>(t, &stream, what, CTX);
            let mut row = env.member_args();
            row.rb_s = p(&replay.states, "replay.states")?;
            row.rb_a = dev_ptr::<u32>(&replay.actions, &stream, "replay.actions", CTX)?;
            row.rb_r = p(&replay.rewards, "replay.rewards")?;
            row.rb_s2 = p(&replay.next_states, "replay.next_states")?;
            row.rb_d = p(&replay.dones, "replay.dones")?;
            (row.eps_start, row.eps_end, row.eps_steps) = (eps.start, eps.end, eps.steps);
            row.sample_seed = sample_seed;
            rows.push(row);
        }
        let table = stream.clone_htod(bytemuck::cast_slice::<_, u8>(&rows)).map_err(driver(CTX))?;
        let address = {
            let (p, _record) = table.device_ptr(&stream);
            p
        };
        let load = |name: &str, module: &str, ptx: &str| -> Result<CudaFunction> {
            Ok(cdev.get_or_load_custom_func(name, module, ptx).ctx(CTX)?.into_cuda_function())
        };
        let k_experience = load("fx_pop_dqn_experience", "fx_env_step", PTX_ENV_STEP)?;
        let plan = LaunchPlan::for_function(&k_experience, cdev, None, CTX)?;
        Ok(Self {
            envs: envs.iter().map(|e| e.instance_id()).collect(),
            replays: replays.iter().map(|r| r.states.id()).collect(),
            _replay_tensors: replays
                .iter()
                .map(|r| {
                    [r.states.clone(), r.actions.clone(), r.rewards.clone(), r.next_states.clone(), r.dones.clone()]
                })
                .collect(),
            rows,
            table,
            address,
            num_envs,
            capacity,
            k_observe: load("fx_pop_observe", "fx_env_step", PTX_ENV_STEP)?,
            k_sample: load("fx_pop_replay_sample", "fx_replay", PTX_REPLAY)?,
            k_experience,
            plan,
            device,
            stream,
        })
    }

    /// Members.
    pub fn len(&self) -> usize {
        self.rows.len()
    }

    /// Never true (a collector has at least one member).
    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    /// Whether the table was built on these envs and replays, in this order.
    pub fn fits(&self, envs: &[&GpuTradingEnv], replays: &[ReplayBuffer]) -> bool {
        envs.len() == self.envs.len()
            && envs.iter().zip(&self.envs).all(|(e, &id)| e.instance_id() == id)
            && self.same_replays(replays)
    }

    /// Whether `replays` are the ones the table was built on, in this order.
    fn same_replays(&self, replays: &[ReplayBuffer]) -> bool {
        replays.len() == self.replays.len() && replays.iter().zip(&self.replays).all(|(r, &id)| r.states.id() == id)
    }

    /// Fits the table to `envs` in place where only some members' envs are new (a trial in
    /// a freed slot takes a new env): those members' rows are rewritten (their ε ramps,
    /// clocks and sample seeds kept: [`Self::set_members`] writes those), and the table keeps
    /// its address, so a captured graph that reads it stays valid. False, and nothing
    /// changed, when the replays are not the ones the table was built on or a new env
    /// differs in accounts or device: build a new collector then.
    pub fn refit(&mut self, envs: &[&GpuTradingEnv], replays: &[ReplayBuffer]) -> Result<bool> {
        const CTX: &str = "PopDqnCollect::refit";
        if envs.len() != self.envs.len() || !self.same_replays(replays) {
            return Ok(false);
        }
        let fresh: Vec<usize> = (0..envs.len()).filter(|&k| envs[k].instance_id() != self.envs[k]).collect();
        if fresh.is_empty() {
            return Ok(true);
        }
        if fresh
            .iter()
            .any(|&k| envs[k].config().num_envs != self.num_envs || !VecEnv::device(envs[k]).same_device(&self.device))
        {
            return Ok(false);
        }
        for &k in &fresh {
            let old = self.rows[k];
            let mut row = envs[k].member_args();
            (row.rb_s, row.rb_a, row.rb_r, row.rb_s2, row.rb_d) = (old.rb_s, old.rb_a, old.rb_r, old.rb_s2, old.rb_d);
            (row.eps_start, row.eps_end, row.eps_steps) = (old.eps_start, old.eps_end, old.eps_steps);
            (row.clock0, row.ring_start, row.key0, row.sample_seed) =
                (old.clock0, old.ring_start, old.key0, old.sample_seed);
            self.rows[k] = row;
            self.envs[k] = envs[k].instance_id();
        }
        // In place: the table keeps its address (a captured graph may hold it).
        self.stream.memcpy_htod(bytemuck::cast_slice::<_, u8>(&self.rows), &mut self.table).map_err(driver(CTX))?;
        Ok(true)
    }

    fn check(&self, envs: &[&GpuTradingEnv], replays: &[ReplayBuffer], ctx: &'static str) -> Result<()> {
        if self.fits(envs, replays) {
            return Ok(());
        }
        Err(Error::Config {
            context: ctx,
            message: "envs or replays differ from those the collector was built on".into(),
        })
    }

    /// [`Self::check`], and that the members' rings move in step (one position and length:
    /// the experience kernel writes every member at one slot).
    fn check_in_step(&self, envs: &[&GpuTradingEnv], replays: &[ReplayBuffer], ctx: &'static str) -> Result<()> {
        self.check(envs, replays, ctx)?;
        let (pos, len) = (replays[0].position(), replays[0].len());
        if replays.iter().any(|r| r.position() != pos || r.len() != len) {
            return Err(Error::Config { context: ctx, message: "member replays at different ring positions".into() });
        }
        Ok(())
    }

    fn check_replays(&self, replays: &[ReplayBuffer], ctx: &'static str) -> Result<()> {
        if self.same_replays(replays) {
            return Ok(());
        }
        Err(Error::Config { context: ctx, message: "replays differ from those the collector was built on".into() })
    }

    /// Puts each member's ε ramp, clocks and sampling seed in the table where they changed
    /// (a PBT move, new settings, a trial in a freed slot, which draws with its own seed).
    pub fn set_members(
        &mut self,
        epsilon: &[LinearSchedule],
        clocks: &[MemberClock],
        sample_seeds: &[u64],
    ) -> Result<()> {
        const CTX: &str = "PopDqnCollect::set_members";
        let n = self.rows.len();
        if epsilon.len() != n || clocks.len() != n || sample_seeds.len() != n {
            return Err(Error::shape(
                "epsilon, clocks and sample seeds",
                CTX,
                format!("{n} of each"),
                format!("{}, {} and {}", epsilon.len(), clocks.len(), sample_seeds.len()),
            ));
        }
        let mut changed = false;
        for (((row, e), c), &seed) in self.rows.iter_mut().zip(epsilon).zip(clocks).zip(sample_seeds) {
            let want = (e.start, e.end, e.steps, c.env_step, c.ring_start, c.key, seed);
            let have =
                (row.eps_start, row.eps_end, row.eps_steps, row.clock0, row.ring_start, row.key0, row.sample_seed);
            if have != want {
                (row.eps_start, row.eps_end, row.eps_steps, row.clock0, row.ring_start, row.key0, row.sample_seed) =
                    want;
                changed = true;
            }
        }
        if changed {
            // In place: the table keeps its address (a captured graph may hold it).
            self.stream.memcpy_htod(bytemuck::cast_slice::<_, u8>(&self.rows), &mut self.table).map_err(driver(CTX))?;
        }
        Ok(())
    }

    /// The launch over `N` members of `n` threads' work each: the solo plan's block for
    /// `n`, and blocks in x up to the plan's grid bound shared among the members.
    fn config(&self, n: usize) -> LaunchConfig {
        let mut cfg = self.plan.config(n);
        let members = self.rows.len() as u32;
        cfg.grid_dim.0 = cfg.grid_dim.0.min((self.plan.max_grid / members).max(1));
        cfg.grid_dim.1 = members;
        cfg
    }

    fn rows_arg(&self, t: &Tensor, what: &'static str, width: usize, ctx: &'static str) -> Result<u64> {
        let (n, e) = (self.rows.len(), self.num_envs);
        let shape: Vec<usize> = if width == 1 { vec![n, e] } else { vec![n, e, width] };
        expect_tensor(t, what, ctx, &shape, DType::F32, &self.device)?;
        if !t.is_contiguous() {
            return Err(Error::shape(what, ctx, "a contiguous tensor", "a strided view"));
        }
        dev_ptr::<f32>(t, &self.stream, what, ctx)
    }

    /// Every member's current states into `obs` (`[N, E, 56]` f32, contiguous).
    pub fn observe(&self, envs: &[&GpuTradingEnv], replays: &[ReplayBuffer], obs: &Tensor) -> Result<()> {
        const CTX: &str = "PopDqnCollect::observe";
        self.check(envs, replays, CTX)?;
        let p_obs = self.rows_arg(obs, "obs", OBS_DIM, CTX)?;
        let e32 = self.num_envs as u32;
        let mut b = self.stream.launch_builder(&self.k_observe);
        b.arg(&self.address).arg(&e32).arg(&p_obs);
        // SAFETY: arguments match fx_pop_observe; the table's rows point at live env buffers
        // of E accounts (checked above), obs holds N·E·56 f32.
        unsafe { b.launch(self.config(self.num_envs)) }.map_err(driver(CTX))?;
        Ok(())
    }

    /// One ε-greedy environment step of every member from Q-values `q` (`[N, E, 3]` f32,
    /// contiguous) at environment step `env_step` (member `k`'s ε is its ramp's value
    /// there), `(s, a, r, s', done)` written into each member's replay at its ring position
    /// (the replays' host counters move on), the post-reset states into `obs` (`[N, E, 56]`)
    /// and, when given, rewards and done flags into `reward` and `done` (`[N, E]`).
    #[allow(clippy::too_many_arguments)] // the kernel's buffers, each checked here
    pub fn collect(
        &self,
        envs: &[&GpuTradingEnv],
        replays: &mut [ReplayBuffer],
        q: &Tensor,
        env_step: u64,
        obs: &Tensor,
        reward: Option<&Tensor>,
        done: Option<&Tensor>,
    ) -> Result<()> {
        const CTX: &str = "PopDqnCollect::collect";
        self.check_in_step(envs, replays, CTX)?;
        let pos = replays[0].position();
        self.launch_experience(q, env_step, pos as u64, None, obs, reward, done, CTX)?;
        for r in replays.iter_mut() {
            r.advance(self.num_envs);
        }
        Ok(())
    }

    /// The collection step of a captured population iteration: [`Self::collect`] with the
    /// environment step and ring position read from `lp` (the members' shared loop block:
    /// their rings move in step) on the device. Nothing on the host moves: the caller
    /// advances the replays' counters (and `lp`'s, with [`DqnLoop::launch_advance`]) as the
    /// graph will.
    #[allow(clippy::too_many_arguments)] // the kernel's buffers, each checked here
    pub fn collect_looped(
        &self,
        envs: &[&GpuTradingEnv],
        replays: &[ReplayBuffer],
        q: &Tensor,
        lp: &DqnLoop,
        obs: &Tensor,
        reward: Option<&Tensor>,
        done: Option<&Tensor>,
    ) -> Result<()> {
        const CTX: &str = "PopDqnCollect::collect_looped";
        self.check_in_step(envs, replays, CTX)?;
        self.launch_experience(q, 0, 0, Some(lp), obs, reward, done, CTX)
    }

    #[allow(clippy::too_many_arguments)]
    fn launch_experience(
        &self,
        q: &Tensor,
        env_step: u64,
        ring_pos: u64,
        lp: Option<&DqnLoop>,
        obs: &Tensor,
        reward: Option<&Tensor>,
        done: Option<&Tensor>,
        ctx: &'static str,
    ) -> Result<()> {
        let p_q = self.rows_arg(q, "q", N_ACTIONS, ctx)?;
        let p_obs = self.rows_arg(obs, "obs", OBS_DIM, ctx)?;
        let opt = |t: Option<&Tensor>, what| t.map_or(Ok(0u64), |t| self.rows_arg(t, what, 1, ctx));
        let (p_r, p_d) = (opt(reward, "reward")?, opt(done, "done")?);
        let (e32, cap) = (self.num_envs as u32, self.capacity as u64);
        let mut b = self.stream.launch_builder(&self.k_experience);
        b.arg(&self.address).arg(&e32).arg(&cap).arg(&p_q).arg(&env_step).arg(&ring_pos);
        let p_loop = lp.map_or(0, |l| l.address());
        b.arg(&p_obs).arg(&p_r).arg(&p_d).arg(&p_loop);
        // SAFETY: arguments match fx_pop_dqn_experience; the table's rows point at live env
        // and replay buffers (E accounts, E <= capacity, ring position < capacity: the host's,
        // or the loop block's, which DqnLoop::write and the advance kernel keep below it); q,
        // obs, reward and done hold N·E rows of their widths.
        unsafe { b.launch(self.config(self.num_envs)) }.map_err(driver(ctx))?;
        Ok(())
    }

    /// One minibatch of `B` rows per member into `out` (`N·B` rows: member `k`'s are rows
    /// `k·B..(k+1)·B`), member `k`'s drawn from its replay with its seed at `key`, as
    /// [`ReplayBuffer::sample_keyed`]`(B, seed_k, key)` draws them; a member with a clock
    /// ([`Self::set_members`]) draws at its own key `key − clock.key` from its window of its
    /// ring (the transitions written since its env step, `env_step` being the population's),
    /// as [`ReplayBuffer::sample_keyed_window`] does.
    pub fn sample(&self, replays: &[ReplayBuffer], env_step: u64, key: u64, out: &ReplayBatch) -> Result<()> {
        const CTX: &str = "PopDqnCollect::sample";
        self.check_replays(replays, CTX)?;
        let len = replays[0].len() as u64;
        if replays.iter().any(|r| r.len() as u64 != len) {
            return Err(Error::Config { context: CTX, message: "member replays of different lengths".into() });
        }
        if len == 0 {
            return Err(Error::Empty { what: "member replays", context: CTX });
        }
        if let Some(r) = self.rows.iter().find(|r| r.clock0 > env_step || r.key0 > key) {
            return Err(Error::Config {
                context: CTX,
                message: format!(
                    "a member began at env step {} and draw {}, after env step {env_step} and draw {key}",
                    r.clock0, r.key0
                ),
            });
        }
        self.launch_sample(len, env_step, key, None, out, CTX)
    }

    /// The `minibatch`-th draw of a captured population iteration: [`Self::sample`] with the
    /// ring length, the environment step and the key (the iteration's first + `minibatch`)
    /// read from `lp` on the device, after [`DqnLoop::launch_advance`]. The caller keeps the
    /// host's view of the counters (and the members' clocks before them, as `sample` checks).
    pub fn sample_looped(
        &self,
        replays: &[ReplayBuffer],
        lp: &DqnLoop,
        minibatch: u32,
        out: &ReplayBatch,
    ) -> Result<()> {
        const CTX: &str = "PopDqnCollect::sample_looped";
        self.check_replays(replays, CTX)?;
        self.launch_sample(0, 0, 0, Some((lp, u64::from(minibatch))), out, CTX)
    }

    fn launch_sample(
        &self,
        len: u64,
        env_step: u64,
        key: u64,
        looped: Option<(&DqnLoop, u64)>,
        out: &ReplayBatch,
        ctx: &'static str,
    ) -> Result<()> {
        let n = self.rows.len();
        let rows = out.actions.dims().first().copied().unwrap_or(0);
        let b = rows / n;
        if b == 0 || b * n != rows || b > u32::MAX as usize {
            return Err(Error::shape("out", ctx, format!("a multiple of {n} rows"), format!("{rows} rows")));
        }
        out.check(rows, &self.device, ctx)?;
        let s = &self.stream;
        let p = |t: &Tensor, what| dev_ptr::<f32>(t, s, what, ctx);
        let (os, or, os2, od) = (
            p(&out.states, "states")?,
            p(&out.rewards, "rewards")?,
            p(&out.next_states, "next_states")?,
            p(&out.dones, "dones")?,
        );
        let oa = dev_ptr::<u32>(&out.actions, s, "actions", ctx)?;
        let (stream_id, b32) = (crate::rng::STREAM_REPLAY, b as u32);
        let (e, cap) = (self.num_envs as u64, self.capacity as u64);
        let mut l = s.launch_builder(&self.k_sample);
        l.arg(&self.address).arg(&len).arg(&env_step).arg(&e).arg(&cap).arg(&key).arg(&stream_id).arg(&b32);
        let (p_loop, key_offset) = looped.map_or((0, 0), |(l, m)| (l.address(), m));
        l.arg(&os).arg(&oa).arg(&or).arg(&os2).arg(&od).arg(&p_loop).arg(&key_offset);
        let grid = (b * OBS_DIM).div_ceil(SAMPLE_BLOCK as usize).clamp(1, 1024) as u32;
        let cfg = LaunchConfig { grid_dim: (grid, n as u32, 1), block_dim: (SAMPLE_BLOCK, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: arguments match fx_pop_replay_sample; out was checked to hold N·B rows of
        // the replay layout; every member's indices stay below its length (≤ capacity).
        unsafe { l.launch(cfg) }.map_err(driver(ctx))?;
        Ok(())
    }
}
