//! Population members as what a backtest replays: member `k`'s weights loaded into a solo
//! network on the CPU and its greedy [`CpuPolicy`] (a sweep scores its trials with them, a
//! population study backtests its runs with them); how many members a wave holds; and a
//! wave's checkpoint file ([`write_wave`], [`read_wave`]), which a sweep's and a study's
//! waves resume from.

use anyhow::Result;
use candle_core::Device;
use fx_models::mlp::cpu::CpuPolicy;
use fx_models::{ActorCritic, DqnPopulation, DuelingDqn, PpoPopulation};

/// DQN member `k`'s online network on the CPU.
pub fn dqn_member_net(pop: &DqnPopulation, k: usize) -> Result<DuelingDqn> {
    let cfg = &pop.members()[k];
    let net = DuelingDqn::new(cfg.net, &Device::Cpu, cfg.seed)?;
    net.params().load_map(&on_cpu(pop.online().member(k)?)?, &format!("population member {k}"))?;
    Ok(net)
}

/// PPO member `k`'s actor-critic on the CPU.
pub fn ppo_member_net(pop: &PpoPopulation, k: usize) -> Result<ActorCritic> {
    let cfg = &pop.members()[k];
    let net = ActorCritic::new(cfg.net, &Device::Cpu, cfg.seed)?;
    net.params().load_map(&on_cpu(pop.params().member(k)?)?, &format!("population member {k}"))?;
    Ok(net)
}

/// The greedy policy of DQN member `k`'s online weights on the CPU.
pub fn dqn_member_policy(pop: &DqnPopulation, k: usize) -> Result<CpuPolicy> {
    Ok(dqn_member_net(pop, k)?.cpu_policy()?)
}

/// The actor's greedy policy of PPO member `k`'s weights on the CPU.
pub fn ppo_member_policy(pop: &PpoPopulation, k: usize) -> Result<CpuPolicy> {
    Ok(ppo_member_net(pop, k)?.cpu_policy()?)
}

/// A member's greedy action of an observation.
pub type Greedy = dyn Fn(&[f32]) -> Result<u32>;

/// The greedy action of one observation through `actions` (a CPU network's batch of one),
/// as a run's `Agent::greedy_action` takes it.
pub fn greedy(obs: &[f32], actions: impl Fn(&candle_core::Tensor) -> Result<candle_core::Tensor>) -> Result<u32> {
    let x = candle_core::Tensor::from_slice(obs, (1, obs.len()), &Device::Cpu)?;
    Ok(actions(&x)?.flatten_all()?.to_dtype(candle_core::DType::U32)?.to_vec1::<u32>()?[0])
}

/// The greedy action function of a population member's saved network (`weights`, spec
/// names) for `cfg`'s model.
pub fn saved_member_greedy(cfg: &crate::config::RunConfig, weights: &std::path::Path) -> Result<Box<Greedy>> {
    Ok(match cfg.model {
        crate::config::ModelChoice::Ppo => {
            let net = ActorCritic::new(cfg.ppo.net, &Device::Cpu, cfg.ppo.seed)?;
            net.params().load(weights)?;
            Box::new(move |obs: &[f32]| greedy(obs, |x| Ok(net.greedy_actions(x)?)))
        }
        _ => {
            let net = DuelingDqn::new(cfg.dqn.net, &Device::Cpu, cfg.dqn.seed)?;
            net.params().load(weights)?;
            Box::new(move |obs: &[f32]| greedy(obs, |x| Ok(net.greedy_actions(x)?)))
        }
    })
}

/// How many members like `member` (a DQN or PPO run config) one population holds on its
/// device, at most `runs`: `fx_hw`'s budget from the device's free memory and the member's
/// estimated memory (`DqnPopulation::member_bytes`, `PpoPopulation::member_bytes`), capped
/// by `members` (a sweep file's key) or `FX_POPULATION`. A sweep's and a population study's
/// waves are cut by it.
pub fn wave_size(
    member: &crate::config::RunConfig,
    members: Option<usize>,
    runs: usize,
) -> Result<fx_hw::Sourced<usize>> {
    let (kind, bytes) = match member.model {
        crate::config::ModelChoice::Ppo => {
            (fx_hw::ModelKind::Ppo, PpoPopulation::member_bytes(&member.ppo, member.env.num_envs))
        }
        _ => (fx_hw::ModelKind::Dqn, DqnPopulation::member_bytes(&member.dqn)),
    };
    let mut overrides = fx_hw::Overrides::default().try_with_device(&member.device)?;
    if let Some(m) = members {
        overrides = overrides.with_population(m);
    }
    let env = fx_hw::Overrides::from_env()?;
    overrides = overrides.layered(fx_hw::Overrides { population: env.population, ..Default::default() });
    Ok(fx_hw::HardwareBudget::detect_with(&overrides).population_size(kind, bytes, runs))
}

/// A member's parameters by spec name, on the CPU.
fn on_cpu(store: fx_models::ParamStore) -> Result<std::collections::HashMap<String, candle_core::Tensor>> {
    let mut map = std::collections::HashMap::new();
    for (name, t) in store.to_tensors("")? {
        map.insert(name, t.to_device(&Device::Cpu)?);
    }
    Ok(map)
}

/// Metadata keys of a wave's checkpoint: the caller's progress and the members' envs.
const WAVE_PROGRESS_KEY: &str = "fx.wave_progress";
const WAVE_ENVS_KEY: &str = "fx.wave_envs";

/// Writes a population wave's checkpoint to `path` atomically, as one file: the
/// population's state (`snapshot`, e.g. `DqnPopulation::snapshot`), each member's
/// environment state (`envs[k]` is member `k`'s) and the caller's `progress` (its loop's
/// counters and whatever identifies the wave) in the metadata. The device's queued work is
/// waited for first. Returns what was written, as a line's end: the path, MiB and seconds
/// (from `started`, before the snapshot was taken).
pub(crate) fn write_wave<P: serde::Serialize>(
    path: &std::path::Path,
    device: &Device,
    snapshot: fx_models::StateSnapshot,
    envs: &[crate::train_env::TrainEnv],
    progress: &P,
    started: std::time::Instant,
) -> Result<String> {
    use anyhow::Context;
    device.synchronize()?;
    let states = envs.iter().map(|e| e.state()).collect::<Result<Vec<_>>>()?;
    let dir = path.parent().context("a wave checkpoint's path has a folder")?;
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    snapshot
        .with_metadata(WAVE_ENVS_KEY, serde_json::to_string(&states)?)?
        .with_metadata(WAVE_PROGRESS_KEY, serde_json::to_string(progress)?)?
        .write(path)?;
    let mib = std::fs::metadata(path).map_or(0.0, |m| m.len() as f64 / (1u64 << 20) as f64);
    Ok(format!("{}, {mib:.1} MiB in {:.2} s", path.display(), started.elapsed().as_secs_f64()))
}

/// When and where a population wave checkpoints ([`write_wave`]): before a step, if the
/// caller is stopping or `every` has passed since the last checkpoint (or the wave's start).
/// A checkpoint on stopping that fails is the caller's error (the wave's progress would be
/// lost unsaid); a periodic one that fails (a full disk) is a warning and training goes on.
pub(crate) struct WaveCheckpoint {
    pub path: std::path::PathBuf,
    every: Option<std::time::Duration>,
    saved: std::time::Instant,
    /// The printed lines' start, e.g. `sweep: trials [0, 1]`.
    who: String,
}

impl WaveCheckpoint {
    pub(crate) fn new(path: std::path::PathBuf, every: Option<std::time::Duration>, who: String) -> Self {
        Self { path, every, saved: std::time::Instant::now(), who }
    }

    /// Checkpoints the wave at `env_steps` when `stopping` or due (the population's state
    /// from `snapshot`, `envs`, `progress`); returns `stopping`.
    pub(crate) fn before_step<P: serde::Serialize>(
        &mut self,
        stopping: bool,
        env_steps: u64,
        device: &Device,
        snapshot: impl FnOnce() -> fx_models::Result<fx_models::StateSnapshot>,
        envs: &[crate::train_env::TrainEnv],
        progress: &P,
    ) -> Result<bool> {
        let due = self.every.is_some_and(|e| self.saved.elapsed() >= e);
        if !stopping && !due {
            return Ok(false);
        }
        let t = std::time::Instant::now();
        let written =
            snapshot().map_err(anyhow::Error::from).and_then(|s| write_wave(&self.path, device, s, envs, progress, t));
        match written {
            Ok(line) => println!("{}: checkpointed at env step {env_steps} ({line})", self.who),
            Err(e) if !stopping => eprintln!(
                "warning: {}: the checkpoint at env step {env_steps} failed, training goes on: {e:#}",
                self.who
            ),
            Err(e) => return Err(e.context(format!("{}: checkpointing the wave", self.who))),
        }
        self.saved = std::time::Instant::now();
        Ok(stopping)
    }
}

/// A wave checkpoint's progress and environment states, read from its header alone (None:
/// no file at `path`). A file without them is refused, naming it.
pub(crate) fn read_wave<P: serde::de::DeserializeOwned>(
    path: &std::path::Path,
) -> Result<Option<(P, Vec<fx_kernels::EnvState>)>> {
    use anyhow::Context;
    if !path.exists() {
        return Ok(None);
    }
    let meta = fx_precision::read_metadata(path)?;
    let field = |key: &str| {
        meta.get(key).with_context(|| {
            format!(
                "{}: not a population wave's checkpoint (no `{key}` metadata); move it away to go on",
                path.display()
            )
        })
    };
    let progress = serde_json::from_str(field(WAVE_PROGRESS_KEY)?)
        .with_context(|| format!("{}: the wave's progress does not parse", path.display()))?;
    let envs = serde_json::from_str(field(WAVE_ENVS_KEY)?)
        .with_context(|| format!("{}: the wave's environment states do not parse", path.display()))?;
    Ok(Some((progress, envs)))
}

/// The environments of a resumed wave: `envs` (one per member the wave started with) cut
/// down to the members `keep` (indices into them, in member order) and set to `states`.
pub(crate) fn restore_wave_envs(
    envs: Vec<crate::train_env::TrainEnv>,
    keep: &[usize],
    states: &[fx_kernels::EnvState],
) -> Result<Vec<crate::train_env::TrainEnv>> {
    use anyhow::Context;
    if keep.len() != states.len() {
        anyhow::bail!("a wave checkpoint of {} environment states for {} members", states.len(), keep.len());
    }
    let mut all: Vec<Option<crate::train_env::TrainEnv>> = envs.into_iter().map(Some).collect();
    let mut kept = Vec::with_capacity(keep.len());
    for (k, (&i, state)) in keep.iter().zip(states).enumerate() {
        let mut env = all.get_mut(i).and_then(Option::take).context("a wave member without its environment")?;
        env.restore(state).with_context(|| format!("restoring member {k}'s environment"))?;
        kept.push(env);
    }
    Ok(kept)
}

/// Removes a finished wave's checkpoint, if there is one.
pub(crate) fn remove_wave(path: &std::path::Path) -> Result<()> {
    use anyhow::Context;
    match std::fs::remove_file(path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            Err(e).with_context(|| format!("removing {}", path.display()))
        }
        _ => Ok(()),
    }
}

/// Removes `folder`'s `waves/` once nothing in it is left to train (a wave's checkpoint
/// whose rows or runs were written just before a kill would otherwise stay).
pub(crate) fn remove_waves(folder: &std::path::Path) -> Result<()> {
    use anyhow::Context;
    let dir = folder.join("waves");
    match std::fs::remove_dir_all(&dir) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            Err(e).with_context(|| format!("removing {}", dir.display()))
        }
        _ => Ok(()),
    }
}
