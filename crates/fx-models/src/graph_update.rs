//! [`GraphUpdate`]: an RL trainer's optimiser step as one replayed CUDA graph (feature
//! `cuda`), shared by the DQN and PPO trainers.
//!
//! The trainer hands over its `TrainStep` state to a [`FusedStep`] (the device-side guard,
//! clip and Adam/AdamW, plus DQN's soft target update) and a body that builds the loss from
//! input tensors, differentiates it and queues the fused step. The body is captured once
//! on static input buffers; each update copies its minibatch into them and replays the
//! graph. A minibatch of another shape (PPO's short last chunk) runs the same body eagerly
//! on the same `FusedStep`, so the state stays in one place either way.

use std::collections::HashMap;

use candle_core::Tensor;
use fx_precision::{CapturedGraph, FusedStats, FusedStep, GraphMode};

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
        let graph = CapturedGraph::capture(&device, 2, |dry| body(&fused, &inputs, dry).map_err(capture_error(CTX)))
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

    /// The fused step the graph replays (learning rate, statistics).
    pub(crate) fn fused(&self) -> &FusedStep {
        &self.fused
    }

    /// Nodes of the captured graph (see [`CapturedGraph::node_count`]).
    pub(crate) fn node_count(&self) -> Result<usize> {
        self.graph.node_count().ctx("GraphUpdate::node_count")
    }
}

/// A capture attempt under `mode`: the captured value, or under `auto` None after a
/// one-line warning naming `what` graph and the `fallback` taken from now on; under `on`
/// the error. Every captured graph of the RL trainers (update, DQN iteration, PPO rollout)
/// settles through here.
pub(crate) fn settle_capture<T>(mode: GraphMode, what: &str, fallback: &str, captured: Result<T>) -> Result<Option<T>> {
    match captured {
        Ok(g) => Ok(Some(g)),
        Err(e) if mode != GraphMode::On => {
            eprintln!("warning: {what} graph not captured, {fallback}: {e}");
            Ok(None)
        }
        Err(e) => Err(e),
    }
}

/// A capture failure inside a capture body, as fx-precision's error (the body's own error
/// type is this crate's).
pub(crate) fn capture_error(context: &'static str) -> impl Fn(Error) -> fx_precision::Error {
    move |e| fx_precision::Error::Cuda { context, message: e.to_string() }
}

/// A trainer's captured update over its life: none yet, captured, or given up (`auto` after
/// a failed capture). The DQN and PPO trainers keep one each and ask it the same questions.
#[derive(Default)]
pub(crate) struct GraphSlot {
    update: Option<GraphUpdate>,
    failed: bool,
}

impl GraphSlot {
    /// `Some(answer)` when whether to use a graph is already settled (captured: true; off,
    /// not on CUDA, or an earlier `auto` failure: false); `None` when a capture should be tried.
    pub(crate) fn decided(&self, mode: GraphMode, on_cuda: bool) -> Option<bool> {
        if self.update.is_some() {
            return Some(true);
        }
        (self.failed || mode == GraphMode::Off || !on_cuda).then_some(false)
    }

    /// Records a capture attempt: the graph, or under `auto` a one-line warning naming
    /// `what` and eager updates from now on (`on` returns the error).
    pub(crate) fn settle(&mut self, mode: GraphMode, what: &str, captured: Result<GraphUpdate>) -> Result<bool> {
        match settle_capture(mode, &format!("{what} update"), "running eagerly", captured)? {
            Some(g) => {
                self.update = Some(g);
                Ok(true)
            }
            None => {
                self.failed = true;
                Ok(false)
            }
        }
    }

    /// The captured update, or an error naming `context` when there is none.
    pub(crate) fn get(&self, context: &'static str) -> Result<&GraphUpdate> {
        self.update.as_ref().ok_or_else(|| Error::config(context, "no captured graph (see graph_ready)"))
    }

    /// Drops the captured graph (its state is stale, e.g. after loading a checkpoint into
    /// the eager optimiser): the next update captures again.
    pub(crate) fn reset(&mut self) {
        self.update = None;
    }

    /// The device-side statistics (one read), if captured.
    pub(crate) fn stats(&self) -> Result<Option<FusedStats>> {
        self.update.as_ref().map(|g| g.fused.stats()).transpose().ctx("GraphSlot::stats")
    }

    /// Zeroes the captured update's loss, norm and extra sums (nothing if not captured).
    pub(crate) fn reset_sums(&self) -> Result<()> {
        match &self.update {
            Some(g) => g.fused.reset_sums().ctx("GraphSlot::reset_sums"),
            None => Ok(()),
        }
    }

    /// Nodes of the captured graph, if captured.
    pub(crate) fn node_count(&self) -> Result<Option<usize>> {
        self.update.as_ref().map(|g| g.node_count()).transpose()
    }

    /// Writes the captured update's optimiser state (as `TrainStep::save_state` names it);
    /// false when there is none and the caller's `TrainStep` holds the state.
    pub(crate) fn save_state(
        &self,
        tensors: &mut HashMap<String, Tensor>,
        metadata: &mut HashMap<String, String>,
        prefix: &str,
    ) -> Result<bool> {
        let Some(g) = &self.update else { return Ok(false) };
        g.fused.save_state(tensors, metadata, prefix).ctx("GraphSlot::save_state")?;
        Ok(true)
    }
}
