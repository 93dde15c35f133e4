//! [`PopIteration`]: one whole DQN population iteration on GPU environments as one replayed
//! CUDA graph (feature `cuda`): every member's states, the member-batched Q forward, ε-greedy
//! collection into every member's ring, the loop counters' advance and, on steps with an
//! update round, each minibatch's draw for all members followed by the population update.
//!
//! The members' rings move in step (one position, one length) and their draws share one key
//! (each member's clock in the collector's table makes them its own), so one
//! [`DqnLoop`] block on the device serves every member. As in the solo `dqn::iteration`, the
//! host mirrors the counters (they move deterministically) and uploads them only when the two
//! could differ, and the graph holds the kernels the stepwise path launches one by one, so
//! both train identically (device test
//! `dqn::population::tests::the_iteration_graph_trains_as_the_stepwise_population`).

use candle_core::Device;
use fx_kernels::cuda::{DqnLoop, DqnLoopCounters};
use fx_kernels::ReplayBuffer;
use fx_precision::CapturedGraph;

use crate::error::{Context, Error, Result};

/// See the module docs.
pub(crate) struct PopIteration {
    pub(crate) lp: DqnLoop,
    /// The counters the device block holds after everything queued, when the host knows.
    synced: Option<DqnLoopCounters>,
    collect: Option<CapturedGraph>,
    train: Option<CapturedGraph>,
}

impl PopIteration {
    /// A zeroed loop block on `dev`; nothing captured yet.
    pub(crate) fn new(dev: &Device) -> Result<Self> {
        let lp = DqnLoop::new(dev).ctx("PopIteration::new")?;
        Ok(Self { lp, synced: None, collect: None, train: None })
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

    /// Puts the host's counters on the device unless it holds them already (`replay`: any
    /// member's ring, for its capacity).
    pub(crate) fn sync(&mut self, now: DqnLoopCounters, replay: &ReplayBuffer) -> Result<()> {
        if self.synced != Some(now) {
            self.lp.write(now, replay).ctx("PopIteration::sync")?;
            self.synced = Some(now);
        }
        Ok(())
    }

    /// Queues one iteration (with its update round when `train`) and records the host's
    /// counters after it, `after`, as the device's.
    pub(crate) fn replay(&mut self, train: bool, after: DqnLoopCounters) -> Result<()> {
        const CTX: &str = "PopIteration::replay";
        let g = if train { &self.train } else { &self.collect };
        let g = g.as_ref().ok_or_else(|| Error::config(CTX, "iteration not captured"))?;
        // Until the replay is queued the device holds the old counters; if it fails, nothing
        // is known.
        self.synced = None;
        g.replay().ctx(CTX)?;
        self.synced = Some(after);
        Ok(())
    }
}
