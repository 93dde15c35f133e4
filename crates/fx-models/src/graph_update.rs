//! [`GraphUpdate`]: an RL trainer's optimiser step as one replayed CUDA graph (feature
//! `cuda`), shared by the DQN and PPO trainers.
//!
//! The trainer hands over its `TrainStep` state to a [`FusedStep`] (the device-side guard,
//! clip and Adam/AdamW, plus DQN's soft target update) and a body that builds the loss from
//! input tensors, differentiates it and queues the fused step. The body is captured once
//! on static input buffers; each update copies its minibatch into them and replays the
//! graph. A minibatch of another shape (PPO's short last chunk) runs the same body eagerly
//! on the same `FusedStep`, so the state stays in one place either way.

use candle_core::Tensor;
use fx_precision::{CapturedGraph, FusedStep};

use crate::error::{Context, Error, Result};

/// Builds the loss from the inputs, backpropagates and queues `fused.step` (`dry` passed on).
pub(crate) type Body<'a> = dyn FnMut(&FusedStep, &[Tensor], bool) -> Result<()> + 'a;

/// See the module docs.
pub(crate) struct GraphUpdate {
    fused: FusedStep,
    graph: CapturedGraph,
    inputs: Vec<Tensor>,
}

impl GraphUpdate {
    /// Captures `body` on static copies of `example` (graph warm-up runs it dry twice).
    pub(crate) fn capture(fused: FusedStep, example: &[&Tensor], body: &mut Body<'_>) -> Result<Self> {
        const CTX: &str = "GraphUpdate::capture";
        let inputs: Vec<Tensor> = example
            .iter()
            .map(|t| t.contiguous().and_then(|t| t.copy()))
            .collect::<candle_core::Result<_>>()
            .ctx(CTX)?;
        let device = fused.device().clone();
        let graph = CapturedGraph::capture(&device, 2, |dry| {
            body(&fused, &inputs, dry).map_err(|e| fx_precision::Error::Cuda { context: CTX, message: e.to_string() })
        })
        .ctx(CTX)?;
        Ok(Self { fused, graph, inputs })
    }

    /// One real update on `inputs`: copied into the static buffers and replayed, or run
    /// eagerly through the same fused step when their shapes differ from the captured ones.
    pub(crate) fn run(&self, inputs: &[&Tensor], body: &mut Body<'_>) -> Result<()> {
        const CTX: &str = "GraphUpdate::run";
        if inputs.len() != self.inputs.len() {
            return Err(Error::config(
                CTX,
                format!("{} inputs, the graph was captured with {}", inputs.len(), self.inputs.len()),
            ));
        }
        let same = inputs.iter().zip(&self.inputs).all(|(a, b)| a.dims() == b.dims() && a.dtype() == b.dtype());
        if !same {
            let owned: Vec<Tensor> = inputs.iter().map(|t| (*t).clone()).collect();
            return body(&self.fused, &owned, false);
        }
        for (src, dst) in inputs.iter().zip(&self.inputs) {
            dst.slice_set(&src.contiguous().ctx(CTX)?, 0, 0).ctx(CTX)?;
        }
        self.graph.replay().ctx(CTX)
    }

    /// One real update running the body directly, without the graph (same kernels, same
    /// state): what a replay must reproduce, for tests and debugging.
    pub(crate) fn run_uncaptured(&self, inputs: &[&Tensor], body: &mut Body<'_>) -> Result<()> {
        let owned: Vec<Tensor> = inputs.iter().map(|t| (*t).clone()).collect();
        body(&self.fused, &owned, false)
    }

    /// Nodes of the captured graph (see [`CapturedGraph::node_count`]).
    pub(crate) fn node_count(&self) -> Result<usize> {
        self.graph.node_count().ctx("GraphUpdate::node_count")
    }

    /// The device-side step (stats, learning rate, state).
    pub(crate) fn fused(&self) -> &FusedStep {
        &self.fused
    }
}
