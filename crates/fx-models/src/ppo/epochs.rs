//! [`EpochsGraph`]: a PPO iteration's `K` epochs of shuffled minibatch updates as one
//! replayed CUDA graph (feature `cuda`).
//!
//! Replaying the captured minibatch update once per minibatch cost the host ~180 launches
//! an iteration (five row gathers, five copies into the graph's inputs and a replay per
//! minibatch), during which the GPU waited between small updates. Here the gathers read the
//! epoch's permutation from device memory, so the whole update phase is one launch: the
//! host uploads the `K` permutations (the same counter-based Fisher–Yates ones as the
//! stepwise path, so both train identically and a resumed run continues the same shuffles)
//! and the advantages and returns into static buffers, then replays. Each minibatch runs the
//! trainer's own update body (the fused update, or candle's for a short last chunk) on the
//! trainer's `FusedStep`, whose device-side sums give the iteration's statistics.

use candle_core::{DType, Tensor};
use fx_precision::{CapturedGraph, FusedStep};

use crate::error::{Context, Error, Result};
use crate::graph_update::Body;

/// See the module docs.
pub(crate) struct EpochsGraph {
    /// `[K · n]` U32: epoch `e`'s permutation of the `n` rollout rows at `e · n`.
    perms: Tensor,
    /// `[n]` F32 static copies of the iteration's advantages and returns.
    adv: Tensor,
    ret: Tensor,
    /// The rollout views the graph reads (held so their storage outlives the graph; `run`
    /// refuses views of other storage).
    sources: [Tensor; 3],
    n: usize,
    epochs: usize,
    graph: CapturedGraph,
}

/// The device address of a contiguous F32 or U32 CUDA tensor (what a captured graph reads).
fn address(t: &Tensor) -> Result<u64> {
    const CTX: &str = "EpochsGraph";
    match t.dtype() {
        DType::U32 => fx_kernels::cuda::address::<u32>(t, "rollout").ctx(CTX),
        _ => fx_kernels::cuda::address::<f32>(t, "rollout").ctx(CTX),
    }
}

impl EpochsGraph {
    /// Captures `epochs` epochs of minibatches of `mb` rows over the rollout's flattened
    /// `obs [n, S]`, `actions [n]`, `log_probs [n]` (views of the rollout's storage, which
    /// keeps its addresses), each minibatch through `body` on `fused`. Chunks of fewer than
    /// two rows are skipped, as in the stepwise path.
    pub(crate) fn capture(
        fused: &FusedStep,
        body: &mut Body<'_>,
        obs: &Tensor,
        actions: &Tensor,
        log_probs: &Tensor,
        epochs: usize,
        mb: usize,
    ) -> Result<Self> {
        const CTX: &str = "EpochsGraph::capture";
        let n = obs.dim(0).ctx(CTX)?;
        if n == 0 || mb == 0 || epochs == 0 || actions.dims() != [n] || log_probs.dims() != [n] {
            return Err(Error::config(CTX, format!("{n} rows, minibatch {mb}, {epochs} epochs")));
        }
        let dev = obs.device();
        let perms = Tensor::zeros(epochs * n, DType::U32, dev).ctx(CTX)?;
        let adv = Tensor::zeros(n, DType::F32, dev).ctx(CTX)?;
        let ret = Tensor::zeros(n, DType::F32, dev).ctx(CTX)?;
        let graph = CapturedGraph::capture(dev, 1, |dry| {
            let mut run = || -> Result<()> {
                // The dry warm-up runs one epoch (every chunk shape, so candle's host
                // uploads are cached before the capture); it changes nothing.
                for e in 0..if dry { 1 } else { epochs } {
                    for start in (0..n).step_by(mb) {
                        let len = mb.min(n - start);
                        if len < 2 {
                            continue;
                        }
                        let idx = perms.narrow(0, e * n + start, len).ctx(CTX)?;
                        let pick = |t: &Tensor| t.index_select(&idx, 0).ctx(CTX);
                        let t = [pick(obs)?, pick(actions)?, pick(log_probs)?, pick(&adv)?, pick(&ret)?];
                        body(fused, &t, dry)?;
                    }
                }
                Ok(())
            };
            run().map_err(crate::graph_update::capture_error(CTX))
        })
        .ctx(CTX)?;
        let sources = [obs.clone(), actions.clone(), log_probs.clone()];
        Ok(Self { perms, adv, ret, sources, n, epochs, graph })
    }

    /// Queues the iteration's updates: `perms` (`K · n` rows, epoch by epoch), `adv` and
    /// `ret` (`[n]`) are copied into the graph's buffers (stream-ordered), then the graph
    /// replays, reading `sources` (the same rollout views as at capture). Nothing is read
    /// back.
    pub(crate) fn run(&self, perms: &[u32], adv: &Tensor, ret: &Tensor, sources: [&Tensor; 3]) -> Result<()> {
        const CTX: &str = "EpochsGraph::run";
        if perms.len() != self.epochs * self.n || adv.dims() != [self.n] || ret.dims() != [self.n] {
            return Err(Error::config(CTX, format!("inputs for {} epochs of {} rows expected", self.epochs, self.n)));
        }
        for (held, given) in self.sources.iter().zip(sources) {
            if held.dims() != given.dims() || address(held)? != address(given)? {
                return Err(Error::config(CTX, "the rollout's storage is not the one the graph was captured on"));
            }
        }
        let p = Tensor::from_slice(perms, perms.len(), self.perms.device()).ctx(CTX)?;
        self.perms.slice_set(&p, 0, 0).ctx(CTX)?;
        self.adv.slice_set(&adv.contiguous().ctx(CTX)?, 0, 0).ctx(CTX)?;
        self.ret.slice_set(&ret.contiguous().ctx(CTX)?, 0, 0).ctx(CTX)?;
        self.graph.replay().ctx(CTX)
    }
}
