//! The lifecycle every training run shares, RL agent or sequence model, written once:
//! open the folder and resolve the config (`run_start`) → load the data → build the task
//! (settling its batch for the device) → train chunk by chunk with the progress bar,
//! metrics lines, checkpoints and interruption by signal → the last checkpoint → the
//! report. What differs between the kinds of run sits behind [`RunTask`]:
//! `rl_run::RlTask` (DQN, PPO: a chunk is a DQN env step or a PPO iteration) and
//! `seq_run::SeqRun` (TFT, MAMBA-2: a chunk is an epoch).
//!
//! Out of memory at start-up: when the batch came from the hardware budget (`auto` on a
//! GPU) and building the task or training fails with the device out of memory before the
//! run's first checkpoint of trained state, the task is dropped and built again, once, at the next
//! smaller budget tier's batch (`batch::smaller_tier`), with a line saying so; config.toml
//! and the first metrics line then carry that batch. A batch the user set is never changed:
//! the error names a batch that fits instead ([`with_oom_hint`]).

use std::io::IsTerminal;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use anyhow::Result;
use indicatif::ProgressBar;
use serde_json::{json, Map, Value};

use crate::config::RunConfig;
use crate::run_dir::RunDir;
use crate::run_start::RunStart;

/// Set by the signal handler; the loop checkpoints and stops at the next chunk (a
/// sequence model's epoch stops at its next batch).
static INTERRUPTED: AtomicBool = AtomicBool::new(false);

/// Exit status of a run stopped by a signal after its checkpoint was written.
pub const EXIT_INTERRUPTED: u8 = 130;

pub struct TrainOptions {
    pub resume: bool,
    /// `--restart` (with `resume`): a run whose checkpoints all fail to verify starts over
    /// from step 0 ([`crate::run_dir::RunDir::restart_checkpoint`]) instead of failing.
    pub restart: bool,
    pub quiet: bool,
    /// `--steps` when given on the command line: on `--resume` it replaces the saved run's
    /// step count (to extend a run); otherwise the saved config is used unchanged.
    pub steps: Option<u64>,
    /// Pause once the task's progress ([`RunTask::progress`]: a forecaster's epochs) has
    /// reached this many, after their checkpoint, without the report: the run resumes from
    /// there with its schedule unchanged (a sweep's successive halving). None: run to the end.
    pub pause_at: Option<u64>,
    /// A run inside a study or a sweep: a signal's "continue with" line is the caller's to
    /// print (resuming the inner run alone would leave the study or sweep behind).
    pub inner: bool,
}

/// How a run ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    Finished,
    Interrupted,
    /// Stopped at [`TrainOptions::pause_at`]; resumable.
    Paused,
}

/// What one [`RunTask::step_chunk`] did.
pub(crate) enum Chunk {
    /// A chunk trained; whether a metrics line and a checkpoint are due after it.
    Trained { log: bool, checkpoint: bool },
    /// An interruption stopped the chunk half-way.
    Stopped,
}

/// What the loop lends a task during a chunk.
pub(crate) struct ChunkCtx<'a> {
    /// The run's progress bar (position and message are the task's).
    pub bar: &'a ProgressBar,
}

impl ChunkCtx<'_> {
    /// A signal asked the run to stop: a task whose chunk is long checks this inside it.
    pub fn stop_requested(&self) -> bool {
        INTERRUPTED.load(Ordering::SeqCst)
    }
}

/// The progress bar's extent: `len` units of `unit`, `pos` done already (a resumed run).
pub(crate) struct BarSpec {
    pub len: u64,
    pub pos: u64,
    pub unit: &'static str,
}

/// Wall-clock seconds the shared loop measured, for the task's profile in report.json.
pub(crate) struct Timings {
    /// When the run was opened (the profile's total runs from here).
    pub t_start: Instant,
    /// Loading the data.
    pub data_prep: f64,
    /// Inside [`RunTask::step_chunk`].
    pub train: f64,
    /// Writing metrics lines and checkpoints.
    pub checkpoint_and_logging: f64,
    /// GPU runs: the share of the loop's time a kernel ran (`gpu_busy`); None on the CPU.
    pub gpu_busy_fraction: Option<f64>,
    /// Why `gpu_busy_fraction` is None on a GPU run.
    pub gpu_busy_unavailable: Option<String>,
}

/// A kind of training run as the lifecycle drives it (see the module docs). The loop owns
/// the order of things; a task owns its state and what its chunks, metrics, checkpoints
/// and report contain.
pub(crate) trait RunTask: Sized {
    /// What the run trains and is evaluated on: loaded once, kept across a rebuild.
    type Data;
    /// Write a checkpoint before the first chunk of a new run (so that a long first chunk,
    /// interrupted, still leaves a run to resume).
    const CHECKPOINT_FIRST: bool;
    /// Write a checkpoint after the loop, finished or interrupted. False where state is
    /// only saveable at the chunk boundaries the loop checkpointed already.
    const CHECKPOINT_LAST: bool;

    /// Loads the data (a resumed run with the normaliser it was started with).
    fn load_data(start: &RunStart) -> Result<Self::Data>;
    /// The data's identity, checked against a resumed run's checkpoint.
    fn data_source(data: &Self::Data) -> &str;
    /// Builds the task: settles the batch (`RunStart::settle_batch`), then creates or
    /// restores the trainer at it.
    fn build(start: &mut RunStart, data: &Arc<Self::Data>) -> Result<Self>;
    fn bar(&self) -> BarSpec;
    fn is_done(&self) -> bool;
    /// Trains one chunk.
    fn step_chunk(&mut self, ctx: &ChunkCtx) -> Result<Chunk>;
    /// The metrics line of the chunk just trained; the loop adds the device's memory peak
    /// and busy fraction, the elapsed time and, on the first line, the batch.
    fn metrics(&mut self, ctx: &ChunkCtx) -> Result<Map<String, Value>>;
    /// Writes a checkpoint (`train_seconds`: the run's training time so far, resumes
    /// included; `last`: the run's final one, to be on disk before this returns).
    fn checkpoint(&mut self, dir: &RunDir, train_seconds: f64, last: bool) -> Result<()>;
    /// The line printed when a signal stopped the run: where its checkpoint is, how to go on.
    fn interrupted_line(&self, dir: &Path) -> String;
    /// Chunks done that [`TrainOptions::pause_at`] counts (none: the task cannot pause).
    fn progress(&self) -> Option<u64> {
        None
    }
    /// Evaluates the trained model, writes the report (with the profile) and prints it.
    fn report(self, dir: &RunDir, timings: Timings) -> Result<()>;
}

/// `fx-train train` and the default command.
pub fn run(cfg: RunConfig, opts: TrainOptions) -> Result<Outcome> {
    let start = RunStart::open(cfg, &opts)?;
    if start.cfg.model.is_sequence() {
        run_task::<crate::seq_run::SeqRun>(start, &opts)
    } else {
        run_task::<crate::rl_run::RlTask>(start, &opts)
    }
}

fn run_task<T: RunTask>(mut start: RunStart, opts: &TrainOptions) -> Result<Outcome> {
    let t = Instant::now();
    let data = Arc::new(T::load_data(&start)?);
    start.check_source(T::data_source(&data))?;
    let data_prep = t.elapsed().as_secs_f64();
    let mut retried = false;
    loop {
        // Building allocates the batch-sized buffers (and may capture graphs): running out
        // of memory there is start-up too.
        let built = T::build(&mut start, &data);
        #[cfg(test)]
        let built = built.and_then(|task| test_hooks::injected_build_oom(start.cfg.batch_key_value()).map(|()| task));
        let failed = match built {
            Ok(task) => {
                start.record_config(opts)?;
                match drive(task, &start, opts, data_prep)? {
                    Ended::Outcome(o) => return Ok(o),
                    // The failed task is dropped by now (its device memory freed).
                    Ended::OutOfMemoryAtStart(e) => e,
                }
            }
            Err(e) if is_out_of_memory(&e) => e,
            Err(e) => return Err(e),
        };
        let line = if retried { None } else { start.retry_at_smaller_batch()? };
        let Some(line) = line else { return Err(with_oom_hint(failed, &start.cfg)) };
        println!("{line}");
        retried = true;
    }
}

/// How [`drive`] ended without an error to report.
enum Ended {
    Outcome(Outcome),
    /// Training ran out of device memory before the first checkpoint of trained state:
    /// the caller may rebuild the task at a smaller batch.
    OutOfMemoryAtStart(anyhow::Error),
}

/// The loop: chunks until the task is done or a signal stops it, with the progress bar,
/// a metrics line and a checkpoint whenever the task says they are due, then the last
/// checkpoint and the report.
fn drive<T: RunTask>(mut task: T, start: &RunStart, opts: &TrainOptions, data_prep: f64) -> Result<Ended> {
    let (dir, cfg, device) = (&start.dir, &start.cfg, &start.device);
    let mut metrics = dir.metrics(start.checkpoint.as_ref().map(|c| c.run.env_steps))?;
    let prior_seconds = start.checkpoint.as_ref().map_or(0.0, |c| c.run.train_seconds);
    let mut times = Timings {
        t_start: start.t_start,
        data_prep,
        train: 0.0,
        checkpoint_and_logging: 0.0,
        gpu_busy_fraction: None,
        gpu_busy_unavailable: None,
    };
    if T::CHECKPOINT_FIRST && start.checkpoint.is_none() {
        let t = Instant::now();
        task.checkpoint(dir, 0.0, false)?;
        times.checkpoint_and_logging += t.elapsed().as_secs_f64();
    }

    let quiet = opts.quiet || !std::io::stdout().is_terminal();
    let spec = task.bar();
    let bar = crate::progress::bar(format!("train {}", cfg.model.as_str()), spec.len, spec.pos, spec.unit, quiet);
    install_signal_handler();
    // Peak device memory since the loop started (null on the CPU).
    let mut mem = crate::device_memory::MemProbe::for_device(device);
    mem.start(device)?;
    let mut busy = crate::gpu_busy::GpuBusy::for_device(device);
    let t_loop = Instant::now();
    let mut batch_line = start.batch.clone();
    // Until the loop checkpoints trained state, running out of memory may be retried.
    let mut checkpointed = false;
    let mut interrupted = false;
    let ctx = ChunkCtx { bar: &bar };
    let mut paused = false;
    while !task.is_done() {
        if ctx.stop_requested() {
            interrupted = true;
            break;
        }
        if opts.pause_at.is_some_and(|p| task.progress().is_some_and(|done| done >= p)) {
            paused = true;
            break;
        }
        let t = Instant::now();
        let chunk = step(&mut task, &ctx, cfg.batch_key_value());
        times.train += t.elapsed().as_secs_f64();
        let (log, checkpoint) = match chunk {
            Ok(Chunk::Trained { log, checkpoint }) => (log, checkpoint),
            Ok(Chunk::Stopped) => {
                interrupted = true;
                break;
            }
            Err(e) if is_out_of_memory(&e) && !checkpointed => {
                bar.finish_and_clear();
                return Ok(Ended::OutOfMemoryAtStart(e));
            }
            Err(e) => return Err(with_oom_hint(e, cfg)),
        };
        if log {
            let t = Instant::now();
            let mut rec = task.metrics(&ctx)?;
            rec.insert("gpu_mem_peak_mib".into(), json!(mem.peak_mib(device)?));
            rec.insert("gpu_busy_fraction".into(), json!(busy.interval()));
            rec.insert("elapsed_s".into(), json!(prior_seconds + t_loop.elapsed().as_secs_f64()));
            if let Some(b) = batch_line.take() {
                rec.insert("batch_size".into(), json!(b.value));
                rec.insert("batch_source".into(), json!(b.source.as_str()));
            }
            metrics.write(&Value::Object(rec))?;
            times.checkpoint_and_logging += t.elapsed().as_secs_f64();
        }
        if checkpoint {
            let t = Instant::now();
            task.checkpoint(dir, prior_seconds + t_loop.elapsed().as_secs_f64(), false)?;
            times.checkpoint_and_logging += t.elapsed().as_secs_f64();
            checkpointed = true;
        }
    }
    bar.finish_and_clear();
    times.gpu_busy_fraction = busy.total();
    times.gpu_busy_unavailable = busy.unavailable.take();
    if T::CHECKPOINT_LAST {
        let t = Instant::now();
        task.checkpoint(dir, prior_seconds + t_loop.elapsed().as_secs_f64(), true)?;
        times.checkpoint_and_logging += t.elapsed().as_secs_f64();
    }
    if interrupted {
        if !opts.inner {
            eprintln!("{}", task.interrupted_line(dir.root()));
        }
        return Ok(Ended::Outcome(Outcome::Interrupted));
    }
    if paused {
        return Ok(Ended::Outcome(Outcome::Paused));
    }
    task.report(dir, times)?;
    Ok(Ended::Outcome(Outcome::Finished))
}

/// One chunk of `task` (`batch`: the run's, for the unit tests' injected failures).
fn step<T: RunTask>(task: &mut T, ctx: &ChunkCtx, batch: usize) -> Result<Chunk> {
    #[cfg(test)]
    test_hooks::injected_oom(batch)?;
    #[cfg(not(test))]
    let _ = batch;
    task.step_chunk(ctx)
}

/// Whether an error is the device running out of memory (the CUDA driver's
/// `CUDA_ERROR_OUT_OF_MEMORY`, or a library's "out of memory").
fn is_out_of_memory(e: &anyhow::Error) -> bool {
    let text = format!("{e:#}");
    text.contains("OUT_OF_MEMORY") || text.to_ascii_lowercase().contains("out of memory")
}

/// A device out-of-memory error, restated with a batch to try: the hardware budget's, or
/// half the failed one where the budget's is no smaller (the budget's batch itself failed,
/// or the retry a tier down did).
pub(crate) fn with_oom_hint(e: anyhow::Error, cfg: &RunConfig) -> anyhow::Error {
    if !is_out_of_memory(&e) {
        return e;
    }
    let text = format!("{e:#}");
    let batch = cfg.batch_key_value();
    let overrides = fx_hw::Overrides::default().with_device(&cfg.device);
    let budget = fx_hw::HardwareBudget::detect_with(&overrides).batch_size(crate::batch::model_kind(cfg.model)).value;
    let (fits, why) = if budget < batch {
        (budget, format!("the hardware budget says batch {budget} fits (`fx-train hw`)"))
    } else {
        let half = (batch / 2).max(1);
        (half, format!("the hardware budget's batch ({budget}) is not smaller; try batch {half}"))
    };
    anyhow::anyhow!(
        "the device ran out of memory at batch {batch}; {why}: start the run again with --batch-size {fits} \
         (or batch = {fits} in the config) (driver said: {})",
        text.lines().next().unwrap_or_default()
    )
}

/// Whether a signal asked the process to stop (see [`install_signal_handler`]).
pub(crate) fn interrupted() -> bool {
    INTERRUPTED.load(Ordering::SeqCst)
}

pub(crate) fn install_signal_handler() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        // Ctrl-C (SIGINT), and SIGTERM / SIGHUP (what Kubernetes, Slurm and a closed
        // terminal send; ctrlc's `termination` feature): the first asks the loop to
        // checkpoint and stop; a second (e.g. during data preparation or the final
        // backtest, where nothing polls the flag) exits now. If a handler cannot be
        // installed the run still works; a signal then kills it and --resume continues
        // from the last periodic checkpoint.
        let _ = ctrlc::set_handler(|| {
            if INTERRUPTED.swap(true, Ordering::SeqCst) {
                std::process::exit(i32::from(EXIT_INTERRUPTED));
            }
        });
    });
}

/// Fault injection for the unit tests, per test thread: a GPU's budget batch on the CPU,
/// and the device running out of memory above a batch.
#[cfg(test)]
pub(crate) mod test_hooks {
    use std::cell::Cell;

    thread_local! {
        static BUDGET: Cell<Option<usize>> = const { Cell::new(None) };
        static OOM_ABOVE: Cell<Option<usize>> = const { Cell::new(None) };
        static OOM_AFTER: Cell<usize> = const { Cell::new(0) };
        static OOM_PASSED: Cell<usize> = const { Cell::new(0) };
        static OOM_RAISED: Cell<usize> = const { Cell::new(0) };
        static BUILD_OOM_ABOVE: Cell<Option<usize>> = const { Cell::new(None) };
    }

    /// Building a task at a batch above `batch` fails as CUDA's allocator does.
    pub fn set_build_oom_above(batch: Option<usize>) {
        BUILD_OOM_ABOVE.with(|b| b.set(batch));
    }

    pub(super) fn injected_build_oom(batch: usize) -> anyhow::Result<()> {
        if BUILD_OOM_ABOVE.with(Cell::get).is_some_and(|max| batch > max) {
            OOM_RAISED.with(|n| n.set(n.get() + 1));
            anyhow::bail!("DriverError(CUDA_ERROR_OUT_OF_MEMORY, \"out of memory\") allocating the replay");
        }
        Ok(())
    }

    /// `batch::budget_batch` returns `batch`, as on a GPU (None: the CPU's None).
    pub fn set_budget_batch(batch: Option<usize>) {
        BUDGET.with(|b| b.set(batch));
    }

    pub fn budget_batch() -> Option<usize> {
        BUDGET.with(Cell::get)
    }

    /// Every training chunk at a batch above `batch` fails as CUDA's allocator does, once
    /// `after` of them have trained (so a failure can come after metrics lines were written).
    pub fn set_oom_above(batch: Option<usize>, after: usize) {
        OOM_ABOVE.with(|b| b.set(batch));
        OOM_AFTER.with(|n| n.set(after));
        OOM_PASSED.with(|n| n.set(0));
        OOM_RAISED.with(|n| n.set(0));
    }

    /// How many chunks failed so.
    pub fn oom_raised() -> usize {
        OOM_RAISED.with(Cell::get)
    }

    pub(super) fn injected_oom(batch: usize) -> anyhow::Result<()> {
        if OOM_ABOVE.with(Cell::get).is_some_and(|max| batch > max) {
            if OOM_PASSED.with(Cell::get) < OOM_AFTER.with(Cell::get) {
                OOM_PASSED.with(|n| n.set(n.get() + 1));
                return Ok(());
            }
            OOM_RAISED.with(|n| n.set(n.get() + 1));
            anyhow::bail!("DriverError(CUDA_ERROR_OUT_OF_MEMORY, \"out of memory\")");
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn out_of_memory_errors_name_a_batch_that_fits() {
        let cfg = RunConfig { device: "cpu".into(), ..RunConfig::default() };
        let e = with_oom_hint(anyhow::anyhow!("DriverError(CUDA_ERROR_OUT_OF_MEMORY, \"out of memory\")"), &cfg);
        let msg = e.to_string();
        assert!(msg.contains("batch 256") && msg.contains("--batch-size ") && msg.contains("batch = "), "{msg}");
        let other = with_oom_hint(anyhow::anyhow!("shape mismatch"), &cfg);
        assert_eq!(other.to_string(), "shape mismatch");
    }

    use crate::batch::{BatchSize, BatchSource};

    /// A run small enough for a unit test (as tests/cli.rs's tiny configs), its batch
    /// `auto`, in `dir`.
    fn tiny(model: crate::config::ModelChoice, dir: &Path) -> RunConfig {
        let mut c = RunConfig {
            model,
            out: dir.join("run"),
            device: "cpu".into(),
            steps: 40,
            checkpoint_every: 10,
            log_every: 5,
            ..RunConfig::default()
        };
        c.env.num_envs = 4;
        c.env.episode_len = 16;
        c.dqn.replay_capacity = 2000;
        c.dqn.learning_starts = 128;
        c.dqn.net.hidden = 32;
        // Enough training windows that the data bound (windows / 64) leaves a batch of 15.
        c.synthetic.bars = if model.is_sequence() { 1500 } else { 500 };
        c.mamba2 =
            fx_models::Mamba2Config { d_model: 8, n_layer: 1, d_state: 4, headdim: 4, chunk_size: 4, ..c.mamba2 };
        c.mamba2_seq_len = 16;
        c.seq.epochs = 1;
        c
    }

    fn opts() -> TrainOptions {
        TrainOptions { resume: false, restart: false, quiet: true, steps: None, pause_at: None, inner: false }
    }

    fn first_metrics(run: &Path) -> Value {
        let text = std::fs::read_to_string(run.join("metrics.jsonl")).unwrap();
        serde_json::from_str(text.lines().next().expect("a metrics line")).unwrap()
    }

    /// Injections last for the test's thread only; cleared again on the way out.
    struct Hooks;
    impl Hooks {
        fn set(budget: usize, oom_above: usize) -> Self {
            Self::set_after(budget, oom_above, 0)
        }

        /// As `set`, the failures starting after `after` chunks have trained.
        fn set_after(budget: usize, oom_above: usize, after: usize) -> Self {
            test_hooks::set_budget_batch(Some(budget));
            test_hooks::set_oom_above(Some(oom_above), after);
            Hooks
        }
    }
    impl Drop for Hooks {
        fn drop(&mut self) {
            test_hooks::set_budget_batch(None);
            test_hooks::set_oom_above(None, 0);
            test_hooks::set_build_oom_above(None);
        }
    }

    #[test]
    fn out_of_memory_at_start_up_retries_once_a_budget_tier_down() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = tiny(crate::config::ModelChoice::Dqn, dir.path());
        let run_dir = cfg.out.clone();
        // A budget of 128 (as on a GPU) whose steps run out of memory above 64, from the 8th
        // step on: after the failed start's metrics line at step 5, before its first
        // checkpoint at step 10.
        let _hooks = Hooks::set_after(128, 64, 7);
        let outcome = run(cfg, opts()).expect("the run retries at batch 64 and finishes");
        assert!(matches!(outcome, Outcome::Finished));
        assert_eq!(test_hooks::oom_raised(), 1, "one failed start at 128, then none at 64");
        let saved = RunConfig::from_toml_file(&run_dir.join("config.toml")).unwrap();
        assert_eq!((saved.batch, saved.dqn.batch_size), (BatchSize::Fixed(64), 64));
        let m = first_metrics(&run_dir);
        assert_eq!((m["batch_size"].as_u64(), m["batch_source"].as_str()), (Some(64), Some("budget")));
        assert_eq!(m["env_steps"].as_u64(), Some(5), "the failed start's lines are gone");
        let text = std::fs::read_to_string(run_dir.join("metrics.jsonl")).unwrap();
        let steps: Vec<u64> =
            text.lines().map(|l| serde_json::from_str::<Value>(l).unwrap()["env_steps"].as_u64().unwrap()).collect();
        assert!(steps.windows(2).all(|w| w[0] < w[1]), "one run's lines, in order: {steps:?}");
        assert!(run_dir.join("report.json").exists());
    }

    #[test]
    fn the_retry_line_names_both_batches_and_why() {
        let dir = tempfile::tempdir().unwrap();
        let _hooks = Hooks::set(128, 64);
        let mut start = RunStart::open(tiny(crate::config::ModelChoice::Dqn, dir.path()), &opts()).unwrap();
        assert_eq!(start.settle_batch(None).unwrap().source, BatchSource::Budget);
        let line = start.retry_at_smaller_batch().unwrap().expect("a budget batch steps down");
        assert!(
            line.contains("out of memory at batch 128")
                && line.contains("source budget")
                && line.contains("next smaller budget tier, batch 64"),
            "{line}"
        );
        assert_eq!((start.cfg.dqn.batch_size, start.settle_batch(None).unwrap().value), (64, 64));
        // 64 is the RL budget's smallest batch: no tier below it.
        assert!(start.retry_at_smaller_batch().unwrap().is_none());
    }

    #[test]
    fn out_of_memory_again_after_the_retry_or_at_a_set_batch_is_the_hint_error() {
        // Still out of memory at 64: retried once only, then the error names a batch.
        let dir = tempfile::tempdir().unwrap();
        let _hooks = Hooks::set(128, 32);
        let e = run(tiny(crate::config::ModelChoice::Dqn, dir.path()), opts()).expect_err("out of memory twice");
        assert_eq!(test_hooks::oom_raised(), 2);
        let msg = e.to_string();
        assert!(msg.contains("ran out of memory at batch 64;"), "{msg}");
        // The batch it suggests is below the one that failed (never the budget's 128 again).
        let suggested: usize =
            msg.split("--batch-size ").nth(1).and_then(|r| r.split(' ').next()).unwrap().parse().unwrap();
        assert!(suggested < 64, "{msg}");
        // A batch the user set (config, FX_BATCH_SIZE, flag) is never changed.
        for source in [BatchSource::Config, BatchSource::Env, BatchSource::Flag] {
            let dir = tempfile::tempdir().unwrap();
            let _hooks = Hooks::set(128, 64);
            let cfg = RunConfig {
                batch: BatchSize::Fixed(128),
                batch_source: source,
                ..tiny(crate::config::ModelChoice::Dqn, dir.path())
            };
            let e = run(cfg, opts()).expect_err("no retry");
            assert_eq!(test_hooks::oom_raised(), 1, "{source:?}");
            let e = e.to_string();
            assert!(e.contains("ran out of memory at batch 128;") && e.contains("--batch-size"), "{source:?}: {e}");
        }
    }

    /// Out of memory while the task is built (its batch-sized buffers) is start-up too:
    /// retried a tier down; a user's batch gets the hint error, not the bare driver error.
    #[test]
    fn out_of_memory_while_building_retries_too() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = tiny(crate::config::ModelChoice::Dqn, dir.path());
        let run_dir = cfg.out.clone();
        let _hooks = Hooks::set(128, usize::MAX);
        test_hooks::set_build_oom_above(Some(64));
        assert!(matches!(run(cfg, opts()).expect("retried at batch 64"), Outcome::Finished));
        assert_eq!(test_hooks::oom_raised(), 1);
        let saved = RunConfig::from_toml_file(&run_dir.join("config.toml")).unwrap();
        assert_eq!(saved.dqn.batch_size, 64);

        let dir = tempfile::tempdir().unwrap();
        let cfg = RunConfig {
            batch: BatchSize::Fixed(128),
            batch_source: BatchSource::Flag,
            ..tiny(crate::config::ModelChoice::Dqn, dir.path())
        };
        let e = run(cfg, opts()).expect_err("no retry at a set batch").to_string();
        assert!(e.contains("ran out of memory at batch 128;") && e.contains("--batch-size"), "{e}");
    }

    #[test]
    fn a_sequence_run_retries_through_the_same_lifecycle() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = tiny(crate::config::ModelChoice::Mamba2, dir.path());
        let run_dir = cfg.out.clone();
        // Budget 64, bounded by the data to 15 windows a batch; out of memory above 8.
        let _hooks = Hooks::set(64, 8);
        assert!(matches!(run(cfg, opts()).expect("retried at batch 8"), Outcome::Finished));
        assert_eq!(test_hooks::oom_raised(), 1);
        let saved = RunConfig::from_toml_file(&run_dir.join("config.toml")).unwrap();
        assert_eq!(saved.seq.batch_size, 8);
        let m = first_metrics(&run_dir);
        assert_eq!(
            (m["batch_size"].as_u64(), m["batch_source"].as_str(), m["epoch"].as_u64()),
            (Some(8), Some("budget"), Some(1))
        );
    }
}
