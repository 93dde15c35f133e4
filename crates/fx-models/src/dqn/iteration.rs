//! [`DqnIteration`]: one whole DQN training iteration on the GPU environment as one
//! replayed CUDA graph (feature `cuda`): the env's states, the Q forward, ε-greedy
//! collection into the replay ring, the loop counters' advance and, on steps with an
//! update round, each of the round's minibatch draws followed by the captured update.
//!
//! What changes between iterations lives on the device ([`fx_kernels::cuda::DqnLoop`]: the
//! step count that gives ε, the ring position and length, the minibatch key), so a replay
//! needs no argument from the host; the trainer mirrors the same counters on the host,
//! where they move deterministically, and uploads them only when the two could differ
//! (first use, or after steps or updates that ran outside the graph). The kernels are the
//! ones the trainer's other path launches one by one (same forward, same ε-greedy draws,
//! same keyed sampling, same update body), so both paths train identically (device test
//! `dqn_iteration_graph_equals_stepwise`).

use candle_core::Tensor;
use fx_kernels::cuda::{DqnLoop, DqnLoopCounters};
use fx_kernels::{GpuTradingEnv, LinearSchedule, ReplayBatch, ReplayBuffer, VecEnv};
use fx_precision::{CapturedGraph, FusedStep};

use crate::dqn::DuelingDqn;
use crate::error::{Context, Result};
use crate::graph_update::Body;
use crate::mlp::DqnQForward;

/// What one iteration is captured over (borrowed from the trainer for the capture only;
/// the graph keeps their device addresses, so the trainer keeps them alive and in place).
pub(crate) struct IterationParts<'a, 'b> {
    pub env: &'a GpuTradingEnv,
    pub q_forward: &'a DqnQForward,
    pub online: &'a DuelingDqn,
    pub replay: &'a ReplayBuffer,
    pub epsilon: LinearSchedule,
    pub seed: u64,
    /// The update round: minibatches, the captured update's fused step and body. None: a
    /// collection-only iteration (steps between rounds, `train_every > 1`).
    pub update: Option<(u32, &'a FusedStep, &'a mut Body<'b>)>,
}

/// A DQN loop's counters on the device and the two iteration graphs over them (collection
/// only, and with an update round), with the host's knowledge of what the device holds:
/// what a solo [`DqnIteration`] and a population's iteration (`dqn::population`, whose
/// members' rings move in step, so one block serves them all) both keep.
pub(crate) struct LoopGraphs {
    pub(crate) lp: DqnLoop,
    /// The counters the device block holds after everything queued, when the host knows.
    synced: Option<DqnLoopCounters>,
    collect: Option<CapturedGraph>,
    train: Option<CapturedGraph>,
}

impl LoopGraphs {
    /// A zeroed loop block on `dev`; nothing captured yet.
    pub(crate) fn new(dev: &candle_core::Device) -> Result<Self> {
        Ok(Self { lp: DqnLoop::new(dev).ctx("LoopGraphs::new")?, synced: None, collect: None, train: None })
    }

    /// Whether the iteration of this kind (with an update round or not) is captured.
    pub(crate) fn has(&self, train: bool) -> bool {
        if train {
            self.train.is_some()
        } else {
            self.collect.is_some()
        }
    }

    /// Keeps `graph` as the iteration of its kind.
    pub(crate) fn set(&mut self, train: bool, graph: CapturedGraph) {
        if train {
            self.train = Some(graph);
        } else {
            self.collect = Some(graph);
        }
    }

    /// Puts the host's counters on the device unless it holds them already (`replay`: the
    /// loop's ring, any member's for a population, for its capacity).
    pub(crate) fn sync(&mut self, now: DqnLoopCounters, replay: &ReplayBuffer) -> Result<()> {
        if self.synced != Some(now) {
            self.lp.write(now, replay).ctx("LoopGraphs::sync")?;
            self.synced = Some(now);
        }
        Ok(())
    }

    /// Queues one iteration (with its update round when `train`) and records the host's
    /// counters after it, `after`, as the device's.
    pub(crate) fn replay(&mut self, train: bool, after: DqnLoopCounters) -> Result<()> {
        const CTX: &str = "LoopGraphs::replay";
        let g = if train { &self.train } else { &self.collect };
        let g = g.as_ref().ok_or_else(|| crate::error::Error::config(CTX, "iteration not captured"))?;
        // Until the replay is queued the device holds the old counters; if it fails, nothing
        // is known.
        self.synced = None;
        g.replay().ctx(CTX)?;
        self.synced = Some(after);
        Ok(())
    }
}

/// See the module docs.
pub(crate) struct DqnIteration {
    env_instance: u64,
    pub(crate) graphs: LoopGraphs,
    obs: Tensor,
    reward: Tensor,
    done: Tensor,
    batch: ReplayBatch,
}

impl DqnIteration {
    /// Buffers for `env` and minibatches of `batch` rows; nothing captured yet.
    pub(crate) fn new(env: &GpuTradingEnv, batch: usize) -> Result<Self> {
        const CTX: &str = "DqnIteration::new";
        let dev = env.device();
        let e = env.num_envs();
        let z = |shape: &[usize]| Tensor::zeros(shape, candle_core::DType::F32, dev).ctx(CTX);
        Ok(Self {
            env_instance: env.instance_id(),
            graphs: LoopGraphs::new(dev)?,
            obs: z(&[e, fx_kernels::OBS_DIM])?,
            reward: z(&[e])?,
            done: z(&[e])?,
            batch: ReplayBatch::alloc(batch, dev, CTX).ctx(CTX)?,
        })
    }

    /// Whether the graphs were (or will be) captured on this env.
    pub(crate) fn fits(&self, env: &GpuTradingEnv) -> bool {
        env.instance_id() == self.env_instance
    }

    /// Captures the iteration `parts` describe (with an update round when it has one).
    /// The warm-up runs only what changes no state (the forward, the update body dry).
    pub(crate) fn capture(&mut self, parts: IterationParts<'_, '_>) -> Result<()> {
        const CTX: &str = "DqnIteration::capture";
        let IterationParts { env, q_forward, online, replay, epsilon, seed, mut update } = parts;
        let train = update.is_some();
        let minibatches = update.as_ref().map_or(0, |u| u.0);
        let (lp, obs, reward, done) = (&self.graphs.lp, &self.obs, &self.reward, &self.done);
        let b = &self.batch;
        let inputs = [b.states.clone(), b.actions.clone(), b.rewards.clone(), b.next_states.clone(), b.dones.clone()];
        let graph = CapturedGraph::capture(env.device(), 1, |dry| {
            let mut run = || -> Result<()> {
                env.observe_into(obs).ctx(CTX)?;
                let q = q_forward.forward(online, obs)?;
                if !dry {
                    env.collect_dqn_looped(&q, epsilon, lp, replay, obs, reward, done).ctx(CTX)?;
                    lp.launch_advance(env.num_envs(), replay, minibatches).ctx(CTX)?;
                }
                if let Some((n, fused, body)) = update.as_mut() {
                    for m in 0..*n {
                        if !dry {
                            lp.launch_sample(replay, seed, m, b).ctx(CTX)?;
                        }
                        body(fused, &inputs, dry)?;
                    }
                }
                Ok(())
            };
            run().map_err(crate::graph_update::capture_error(CTX))
        })
        .ctx(CTX)?;
        self.graphs.set(train, graph);
        Ok(())
    }

    /// The last iteration's rewards and done flags (`[E]` f32, device).
    pub(crate) fn rewards_and_dones(&self) -> (&Tensor, &Tensor) {
        (&self.reward, &self.done)
    }
}
