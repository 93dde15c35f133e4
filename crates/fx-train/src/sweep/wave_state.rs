//! A DQN / PPO wave's checkpoint, so a sweep stopped inside a wave goes on from where it
//! stopped, not from the wave's start: `waves/wave-{first trial}.safetensors` is the
//! population's state file (`DqnPopulation::snapshot` / `PpoPopulation::snapshot`) with
//! every member's environment state and the wave's own progress ([`WaveProgress`]: its
//! trials, env steps, throughput counters, PBT points and events, successive halving's rungs
//! and stopped rows) in its metadata (`crate::population::write_wave`). One file, written
//! atomically, so a kill at any moment leaves the previous checkpoint or the new one.
//!
//! Written when the sweep is stopped (SIGTERM / SIGINT: the exact point it stopped) and
//! every `checkpoint_minutes` of a wave's training (a kill loses at most that much; a
//! periodic checkpoint that fails is a warning, not the sweep's end); removed once the
//! wave's rows are in `trials.jsonl` (and `waves/` once every trial is done). A checkpoint
//! of other trials or of the same trials at other points (another `--members` or a device
//! with room for another wave size where waves are cut by it, `--trials` under TPE) is not
//! resumed: the wave trains from its start, and says so (another `--steps` is refused
//! earlier, as another sweep). Under `[halving]` a group's wave holds all its trials, so its
//! checkpoint resumes with the slots it was saved with.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use fx_kernels::EnvState;
use serde::{Deserialize, Serialize};

use super::{space, HalvingConfig, PbtEvent, PbtPlan, PopHalving, PopMembers};
use crate::config::RunConfig;
use crate::population::WaveCheckpoint;
use crate::train_env::TrainEnv;

/// Where a wave stands (everything of a wave's loop that is not the population's state).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(super) struct WaveProgress {
    /// The wave's trials (member `k` started as trial `trials[k]`).
    pub trials: Vec<usize>,
    /// The run length every member trains to (`run.steps`).
    pub steps: u64,
    /// Env steps the population has taken (each member's own count starts at its start
    /// under `[halving]`).
    pub env_steps: u64,
    /// Update samples so far (the wave's throughput).
    pub samples: u64,
    /// Training seconds before this start (a resumed wave's time adds up).
    pub train_seconds: f64,
    /// PBT: seconds in rounds, rounds taken, the last round's index (PPO rounds at
    /// iteration boundaries), each member's current point and its copies so far.
    pub pbt_seconds: f64,
    pub rounds: u64,
    pub last_round: u64,
    pub points: Vec<space::Point>,
    pub events: Vec<Vec<PbtEvent>>,
    /// Successive halving's state: rungs taken, trials still in, stopped rows and scores.
    pub halving: Option<PopHalving>,
    /// Each trial's starting point (a checkpoint resumes only the same trials at the same
    /// points: a TPE sweep's later proposals depend on `--trials`).
    pub start: Vec<BTreeMap<String, serde_json::Value>>,
}

impl WaveProgress {
    /// A wave at its start.
    pub fn start(
        trials: &[usize],
        steps: u64,
        points: Vec<space::Point>,
        halving: Option<PopHalving>,
        params: &dyn Fn(usize) -> BTreeMap<String, serde_json::Value>,
    ) -> Self {
        Self {
            start: trials.iter().map(|&t| params(t)).collect(),
            trials: trials.to_vec(),
            steps,
            env_steps: 0,
            samples: 0,
            train_seconds: 0.0,
            pbt_seconds: 0.0,
            rounds: 0,
            last_round: 0,
            points,
            events: vec![Vec::new(); trials.len()],
            halving,
        }
    }

    /// The trials whose members are still in the population (all but those halving
    /// stopped), in member order.
    pub fn alive(&self) -> &[usize] {
        self.halving.as_ref().map_or(&self.trials[..], |h| &h.alive[..])
    }
}

/// The checkpoint file of the wave that starts with trial `trials[0]` (waves' trials are
/// disjoint, so the first names the wave across a sweep's waves and TPE rounds).
pub(super) fn path(out: &Path, trials: &[usize]) -> PathBuf {
    out.join("waves").join(format!("wave-{}.safetensors", trials.first().copied().unwrap_or(0)))
}

/// The saved progress of this wave (`trials` training to `steps`) and its members'
/// environment states, if its checkpoint is there and is this wave's; None when there is
/// none or it is another wave's (printed).
pub(super) fn read(
    path: &Path,
    trials: &[usize],
    steps: u64,
    params: &dyn Fn(usize) -> BTreeMap<String, serde_json::Value>,
) -> Result<Option<(WaveProgress, Vec<EnvState>)>> {
    let Some((p, envs)) = crate::population::read_wave::<WaveProgress>(path)? else { return Ok(None) };
    let start: Vec<_> = trials.iter().map(|&t| params(t)).collect();
    if p.trials != trials || p.steps != steps || p.start != start {
        println!(
            "sweep: {} holds trials {:?} of {} env steps, not this wave's {:?} of {steps} at their points: the wave trains from its start",
            path.display(),
            p.trials,
            p.steps,
            trials
        );
        return Ok(None);
    }
    let n = trials.len();
    // Under halving a freed slot's new trial starts at 0, so the population's own step may
    // pass the run's.
    let consistent = envs.len() == p.alive().len()
        && (p.env_steps < steps || p.halving.is_some())
        && p.events.len() == n
        && (p.points.is_empty() || p.points.len() == n)
        && p.alive().iter().all(|t| trials.contains(t));
    if !consistent {
        bail!(
            "{}: {} environment states, {} members in, {} event lists and {} points for {n} trials at env step {} of {steps}: a damaged checkpoint; move it away to go on",
            path.display(),
            envs.len(),
            p.alive().len(),
            p.events.len(),
            p.points.len(),
            p.env_steps
        );
    }
    println!("sweep: trials {trials:?} go on from env step {} ({})", p.env_steps, path.display());
    Ok(Some((p, envs)))
}

/// The wave's population, environments and progress: resumed from its checkpoint
/// (`load`) when that is this wave's ([`read`]), otherwise `fresh()` at the wave's start.
/// The population starts with the first `slots` trials (the others wait for a freed slot);
/// `make_envs` builds the training environments of the trials it is given.
#[allow(clippy::too_many_arguments)]
pub(super) fn open<P: PopMembers>(
    ck: &WaveCheckpoint,
    trials: &[usize],
    slots: usize,
    base: &RunConfig,
    params: &dyn Fn(usize) -> BTreeMap<String, serde_json::Value>,
    pbt: Option<&PbtPlan<'_>>,
    halving: Option<&HalvingConfig>,
    make_envs: &dyn Fn(&[usize]) -> Result<Vec<TrainEnv>>,
    load: impl FnOnce(&Path) -> fx_models::Result<P>,
    fresh: impl FnOnce() -> Result<P>,
) -> Result<(P, Vec<TrainEnv>, WaveProgress)> {
    let path = &ck.path;
    let Some((mut w, states)) = read(path, trials, base.steps, params)? else {
        let points = pbt.map(|p| trials.iter().map(|&t| p.points[t].clone()).collect()).unwrap_or_default();
        let halve = halving.map(|h| PopHalving::new(h, base.steps, trials, slots)).transpose()?;
        let first = slots.clamp(1, trials.len().max(1)).min(trials.len());
        let envs = make_envs(&trials[..first])?;
        return Ok((fresh()?, envs, WaveProgress::start(trials, base.steps, points, halve, params)));
    };
    if let Some(h) = w.halving.as_mut() {
        h.upgrade();
    }
    let pop = load(path).with_context(|| {
        format!("resuming the sweep's population from {} (move it away to train the wave again)", path.display())
    })?;
    if pop.len() != w.alive().len() {
        bail!(
            "{}: a population of {} for {} trials still in: a damaged checkpoint; move it away to go on",
            path.display(),
            pop.len(),
            w.alive().len()
        );
    }
    let envs = make_envs(w.alive())?;
    let keep: Vec<usize> = (0..envs.len()).collect();
    let envs = crate::population::restore_wave_envs(envs, &keep, &states)?;
    Ok((pop, envs, w))
}

/// Removes a finished wave's checkpoint (its rows are in `trials.jsonl`).
pub(super) fn remove(out: &Path, trials: &[usize]) -> Result<()> {
    crate::population::remove_wave(&path(out, trials))
}
