//! [`RolloutGraph`]: a PPO rollout of `T` steps on the GPU environment as one replayed CUDA
//! graph (feature `cuda`): the env's states, then per step the fused actor-critic forward
//! and the env's sampling + step + rollout-row write, `T` times.
//!
//! Nothing in it changes between rollouts except device state (the env's accounts and
//! counters, the weights), and every rollout starts at row 0, so the graph needs no
//! counters of its own; the host records the `T` rows after each replay. The kernels are
//! those of the stepwise path (`PpoTrainer::collect_step`), so both collect the same
//! rollout (device test `ppo_rollout_graph_equals_stepwise`).

use candle_core::Tensor;
use fx_kernels::{GpuTradingEnv, Rollout, VecEnv};
use fx_precision::CapturedGraph;

use crate::error::{Context, Result};
use crate::mlp::PpoForward;
use crate::ppo::ActorCritic;

/// See the module docs.
pub(crate) struct RolloutGraph {
    env_instance: u64,
    /// The states the next forward reads (the post-reset states the step writes).
    _obs: Tensor,
    graph: CapturedGraph,
}

impl RolloutGraph {
    /// Captures a full rollout into `rollout` (whose buffers, like the forward's and the
    /// env's, keep their addresses for the graph's life). The warm-up runs only the forward.
    pub(crate) fn capture(
        env: &GpuTradingEnv,
        forward: &PpoForward,
        model: &ActorCritic,
        rollout: &Rollout,
    ) -> Result<Self> {
        const CTX: &str = "RolloutGraph::capture";
        let e = env.num_envs();
        let obs = Tensor::zeros((e, fx_kernels::OBS_DIM), candle_core::DType::F32, env.device()).ctx(CTX)?;
        let graph = CapturedGraph::capture(env.device(), 1, |dry| {
            let run = || -> Result<()> {
                env.observe_into(&obs).ctx(CTX)?;
                if dry {
                    forward.forward(model, &obs)?;
                    return Ok(());
                }
                for row in 0..rollout.horizon() {
                    let (logits, values) = forward.forward(model, &obs)?;
                    env.collect_ppo_row(&logits, &values, row, rollout, &obs).ctx(CTX)?;
                }
                Ok(())
            };
            run().map_err(crate::graph_update::capture_error(CTX))
        })
        .ctx(CTX)?;
        Ok(Self { env_instance: env.instance_id(), _obs: obs, graph })
    }

    /// Whether the graph was captured on this env.
    pub(crate) fn fits(&self, env: &GpuTradingEnv) -> bool {
        env.instance_id() == self.env_instance
    }

    /// Queues one whole rollout (the caller records its rows).
    pub(crate) fn replay(&self) -> Result<()> {
        self.graph.replay().ctx("RolloutGraph::replay")
    }
}
