//! The run folder: `config.toml`, `metrics.jsonl`, `checkpoint-<step>.{safetensors,json}`,
//! `report.json` and plots. Every file is written to a temporary name in the same folder
//! and renamed, so a crash never leaves a half-written file behind.
//!
//! A folder belongs to one training process at a time: `train` holds an exclusive OS file
//! lock on `run.lock` (which names its process id) for its whole life, so a second `train`
//! or `--resume` on the same folder is refused at once, and a holder killed even with
//! SIGKILL leaves no stale lock (the OS releases it with the process). `eval` reads without
//! the lock: checkpoints are replaced atomically. [`CheckpointWriter`] writes a run's
//! checkpoints from a thread of its own, one at a time.

use std::fs::{File, OpenOptions, TryLockError};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use fx_kernels::EnvState;
use serde::{Deserialize, Serialize};

use crate::config::ModelChoice;

/// SHA-256 (hex) of a file, streamed, with the path in the error.
fn sha256_file(path: &Path) -> Result<String> {
    fx_data::files::sha256_file(path).with_context(|| format!("hashing {}", path.display()))
}

/// Takes the exclusive lock of `root/run.lock` and records this process's id in it, or
/// refuses in one line naming the folder and the holder's id.
pub(crate) fn lock_folder(root: &Path) -> Result<File> {
    let path = root.join(LOCK_FILE);
    let mut file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&path)
        .with_context(|| format!("opening {}", path.display()))?;
    match file.try_lock() {
        Ok(()) => {
            file.set_len(0)
                .and_then(|_| writeln!(file, "{}", std::process::id()))
                .and_then(|_| file.sync_data())
                .with_context(|| format!("writing {}", path.display()))?;
            Ok(file)
        }
        Err(TryLockError::WouldBlock) => {
            let mut holder = String::new();
            let _ = file.read_to_string(&mut holder);
            let holder = holder.trim();
            let who = if holder.is_empty() { String::new() } else { format!(" (process {holder})") };
            bail!(
                "{} is in use by another fx-train process{who}; wait for it to end or stop it (nothing was changed)",
                root.display()
            )
        }
        Err(TryLockError::Error(e)) => Err(e).with_context(|| format!("locking {}", path.display())),
    }
}

impl Drop for RunDir {
    fn drop(&mut self) {
        if self.provisional && self.lock.is_some() {
            // A new run that failed before it started: leave no folder behind (remove_dir
            // only succeeds on the then-empty folder, so nothing else can be lost).
            let _ = std::fs::remove_file(self.root.join(LOCK_FILE));
            let _ = std::fs::remove_dir(&self.root);
        }
    }
}

/// A checkpoint a lookup passed over: its step and why (with where a resume moved it).
type Skipped = (u64, String);

/// The part of a checkpoint that is not the trainer's own state file.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RunState {
    /// Layout version of this file.
    pub version: u32,
    pub model: ModelChoice,
    /// Environment steps done when the checkpoint was taken (RL agents), or epochs done
    /// (sequence models); the checkpoint files are numbered by it.
    pub env_steps: u64,
    /// The training environment's state (RL agents only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub env: Option<EnvState>,
    /// Normaliser mean and standard deviation (fitted on the training rows): a panel's
    /// instruments' one after another, `N_MARKET` values each.
    pub norm_mean: Vec<f32>,
    pub norm_std: Vec<f32>,
    /// Where the data came from.
    pub data_source: String,
    /// Seconds of training before this checkpoint (for samples/s across resumes).
    pub train_seconds: f64,
    /// SHA-256 (hex) of the checkpoint's state file, verified on load (absent in
    /// checkpoints written before it existed: those load unverified).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trainer_sha256: Option<String>,
}

const RUN_STATE_VERSION: u32 = 1;

impl RunState {
    pub fn new(
        model: ModelChoice,
        env_steps: u64,
        env: EnvState,
        norms: &[fx_data::Normalizer],
        data_source: String,
        train_seconds: f64,
    ) -> Self {
        let (mut norm_mean, mut norm_std) = (Vec::new(), Vec::new());
        for n in norms {
            let (m, s) = n.to_pair();
            norm_mean.extend(m);
            norm_std.extend(s);
        }
        RunState {
            version: RUN_STATE_VERSION,
            model,
            env_steps,
            env: Some(env),
            norm_mean,
            norm_std,
            data_source,
            train_seconds,
            trainer_sha256: None,
        }
    }

    /// The run state of a sequence model after `epochs` epochs (no environment).
    pub fn new_seq(
        model: ModelChoice,
        epochs: u64,
        norms: &[fx_data::Normalizer],
        data_source: String,
        train_seconds: f64,
    ) -> Self {
        let (mut norm_mean, mut norm_std) = (Vec::new(), Vec::new());
        for n in norms {
            let (m, s) = n.to_pair();
            norm_mean.extend(m);
            norm_std.extend(s);
        }
        RunState {
            version: RUN_STATE_VERSION,
            model,
            env_steps: epochs,
            env: None,
            norm_mean,
            norm_std,
            data_source,
            train_seconds,
            trainer_sha256: None,
        }
    }

    /// The one normaliser of a single-instrument run.
    pub fn normalizer(&self) -> Result<fx_data::Normalizer> {
        Ok(fx_data::Normalizer::from_pair(&self.norm_mean, &self.norm_std)?)
    }

    /// The normalisers, one per instrument (`N_MARKET` values each).
    pub fn normalizers(&self) -> Result<Vec<fx_data::Normalizer>> {
        let w = fx_kernels::N_MARKET;
        if self.norm_mean.is_empty()
            || !self.norm_mean.len().is_multiple_of(w)
            || self.norm_std.len() != self.norm_mean.len()
        {
            bail!(
                "normaliser of {} means and {} deviations is not a whole number of {w}-feature instruments",
                self.norm_mean.len(),
                self.norm_std.len()
            );
        }
        self.norm_mean
            .chunks(w)
            .zip(self.norm_std.chunks(w))
            .map(|(m, s)| Ok(fx_data::Normalizer::from_pair(m, s)?))
            .collect()
    }
}

/// A checkpoint on disk.
pub struct Checkpoint {
    /// The trainer's state (weights, optimiser, scaler, replay/rollout, counters).
    pub trainer: PathBuf,
    pub run: RunState,
}

impl Checkpoint {
    /// Refuses a checkpoint of another model; `what` says where the expected model came
    /// from ("the config asks for", "config.toml says").
    pub fn check_model(&self, model: ModelChoice, what: &str) -> Result<()> {
        if self.run.model != model {
            bail!(
                "{}: checkpoint is a {} run, {what} {}",
                self.trainer.display(),
                self.run.model.as_str(),
                model.as_str()
            );
        }
        Ok(())
    }

    /// Refuses data other than what the checkpoint was trained on (its normaliser and
    /// weights belong to that data); `what` as in [`Checkpoint::check_model`].
    pub fn check_source(&self, source: &str, what: &str) -> Result<()> {
        if self.run.data_source != source {
            bail!("{}: checkpoint was trained on {}, {what} {source}", self.trainer.display(), self.run.data_source);
        }
        Ok(())
    }
}

/// Writes `bytes` to `path` atomically (`fx_data::files::write_atomic`: temporary file,
/// sync, rename, folder sync), with the path in the error.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    fx_data::files::write_atomic(path, bytes).with_context(|| format!("writing {}", path.display()))
}

/// The lock file of a run folder.
pub const LOCK_FILE: &str = "run.lock";

/// A run folder.
#[derive(Debug)]
pub struct RunDir {
    root: PathBuf,
    /// The exclusive lock of a training process (None for readers such as `eval`).
    lock: Option<File>,
    /// This process created the folder and has not yet written the run's config: on drop
    /// (an error before the run started) the folder is removed again.
    provisional: bool,
}

/// A run folder's checkpoint writing, detached from the [`RunDir`] that holds its lock (see
/// [`RunDir::checkpoint_files`]): what a background writer thread takes along.
pub struct CheckpointFiles {
    dir: RunDir,
}

impl CheckpointFiles {
    /// [`RunDir::write_checkpoint`].
    pub fn write(&self, run: &RunState, keep: usize, save: impl FnOnce(&Path) -> Result<()>) -> Result<PathBuf> {
        self.dir.write_checkpoint_here(run, keep, save)
    }
}

/// Writes checkpoints on a thread of its own, one at a time: [`CheckpointWriter::submit`]
/// first waits for the previous write, so a failed write stops the run at the next
/// checkpoint (or at [`CheckpointWriter::wait`]) with its one-line error, and the files
/// stay as atomic as `RunDir::write_checkpoint` makes them. Dropping it waits too, so an
/// error elsewhere does not cut a write short.
#[derive(Default)]
pub(crate) struct CheckpointWriter {
    pending: Option<std::thread::JoinHandle<Result<std::path::PathBuf>>>,
}

impl CheckpointWriter {
    pub(crate) fn submit(
        &mut self,
        files: CheckpointFiles,
        run: RunState,
        keep: usize,
        snapshot: fx_models::StateSnapshot,
    ) -> Result<()> {
        self.wait()?;
        self.pending = Some(std::thread::spawn(move || files.write(&run, keep, |p| Ok(snapshot.write(p)?))));
        Ok(())
    }

    pub(crate) fn wait(&mut self) -> Result<()> {
        if let Some(h) = self.pending.take() {
            h.join().map_err(|_| anyhow::anyhow!("the checkpoint writer thread panicked"))??;
        }
        Ok(())
    }
}

impl Drop for CheckpointWriter {
    fn drop(&mut self) {
        if let Some(h) = self.pending.take() {
            let _ = h.join();
        }
    }
}

/// A folder's checkpoints exist and none verifies (their steps oldest first); what
/// `--restart` acts on.
#[derive(Debug)]
struct NoneVerifies {
    steps: Vec<u64>,
    message: String,
}

impl std::fmt::Display for NoneVerifies {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for NoneVerifies {}

/// `--resume`'s error when no checkpoint verifies, with the way to start over (only a
/// resume has `--restart`; `eval` and the rest get the plain error).
pub(crate) fn with_restart_hint(e: anyhow::Error) -> anyhow::Error {
    if e.is::<NoneVerifies>() {
        anyhow::anyhow!("{e}, or add --restart to --resume to start over here (moving them into damaged/)")
    } else {
        e
    }
}

impl RunDir {
    /// Opens `root` for a new run (refusing to touch a folder that already holds a run)
    /// or for `--resume` (requiring one), taking the folder's lock; see the module docs.
    pub fn open(root: &Path, resume: bool) -> Result<Self> {
        let has_run = |root: &Path| root.join("config.toml").exists();
        if resume && !has_run(root) {
            bail!("cannot resume: {} holds no run (no config.toml)", root.display());
        }
        let refuse_existing = || {
            anyhow::anyhow!(
                "{} already holds a run; pass --resume to continue it, or choose another --out (nothing was overwritten)",
                root.display()
            )
        };
        if !resume && has_run(root) {
            return Err(refuse_existing());
        }
        let created = !root.exists();
        std::fs::create_dir_all(root).with_context(|| format!("creating run folder {}", root.display()))?;
        let lock = lock_folder(root)?;
        let dir = RunDir { root: root.to_path_buf(), lock: Some(lock), provisional: created };
        // Checked again under the lock: another new run may have started in between.
        if !resume && has_run(root) {
            return Err(refuse_existing());
        }
        Ok(dir)
    }

    /// The run has started (its config is written): keep the folder whatever happens next.
    pub fn mark_started(&mut self) {
        self.provisional = false;
    }

    /// An existing run folder, for `eval`.
    pub fn existing(root: &Path) -> Result<Self> {
        if !root.join("config.toml").exists() {
            bail!("{} is not a run folder (no config.toml)", root.display());
        }
        Ok(RunDir { root: root.to_path_buf(), lock: None, provisional: false })
    }

    /// A reader of `root` for tests (no config.toml needed).
    #[cfg(test)]
    fn existing_unchecked(root: &Path) -> Self {
        RunDir { root: root.to_path_buf(), lock: None, provisional: false }
    }

    pub fn path(&self, name: &str) -> PathBuf {
        self.root.join(name)
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Every checkpoint step present (both files), oldest first.
    fn checkpoint_steps(&self) -> Result<Vec<u64>> {
        let mut steps = Vec::new();
        for entry in std::fs::read_dir(&self.root).with_context(|| format!("listing {}", self.root.display()))? {
            let name = entry?.file_name().to_string_lossy().into_owned();
            if let Some(n) = name.strip_prefix("checkpoint-").and_then(|r| r.strip_suffix(".json")) {
                if let Ok(step) = n.parse::<u64>() {
                    if self.trainer_path(step).exists() {
                        steps.push(step);
                    }
                }
            }
        }
        steps.sort_unstable();
        Ok(steps)
    }

    fn trainer_path(&self, step: u64) -> PathBuf {
        self.root.join(format!("checkpoint-{step:010}.safetensors"))
    }

    fn run_state_path(&self, step: u64) -> PathBuf {
        self.root.join(format!("checkpoint-{step:010}.json"))
    }

    /// The newest checkpoint that verifies: its sidecar parses and records the SHA-256 its
    /// state file has (a truncated or changed state file, a missing half, or a sidecar
    /// copied from another checkpoint does not). Each newer one that does not is skipped
    /// with a one-line warning naming the file, and left in place. When the folder holds
    /// checkpoints and none verifies, that is an error naming them, never `None` (which
    /// would start a resumed run over in silence). (A checkpoint of another model is not
    /// damage: callers refuse it with [`Checkpoint::check_model`].)
    pub fn latest_checkpoint(&self) -> Result<Option<Checkpoint>> {
        self.newest_verified(false)
    }

    /// [`Self::latest_checkpoint`] for a run about to continue here (under the folder's
    /// lock): each damaged checkpoint newer than the one it continues from is moved into
    /// `damaged/`, so the run neither overwrites it when it reaches that step again nor
    /// prunes it.
    pub fn resume_checkpoint(&self) -> Result<Option<Checkpoint>> {
        self.newest_verified(true)
    }

    fn newest_verified(&self, move_damaged: bool) -> Result<Option<Checkpoint>> {
        let (found, skipped) = self.newest_verified_quiet(move_damaged)?;
        for (s, why) in &skipped {
            eprintln!("warning: skipping checkpoint {s}: {why}");
        }
        Ok(found)
    }

    /// `--resume --restart`: as [`Self::resume_checkpoint`], except that a folder whose
    /// checkpoints all fail to verify starts over instead of failing: they are moved into
    /// `damaged/` (kept, named in a warning) and `None` is returned, so the run trains from
    /// step 0 under its saved config. A folder with a checkpoint that verifies resumes from it.
    pub fn restart_checkpoint(&self) -> Result<Option<Checkpoint>> {
        match self.newest_verified(true) {
            Err(e) => match e.downcast::<NoneVerifies>() {
                Ok(none) => {
                    let mut moved = String::new();
                    for &s in &none.steps {
                        moved = self.set_aside(s)?;
                    }
                    // A finished run's report describes the run being started over: kept
                    // beside its checkpoints, not left as if it were the new run's.
                    self.set_aside_files(&[self.path("report.json")])?;
                    let listed: Vec<String> = none.steps.iter().map(u64::to_string).collect();
                    eprintln!(
                        "warning: no checkpoint in {} verifies (steps {}); --restart starts the run over from step 0, \
                         the damaged files{moved}",
                        self.root.display(),
                        listed.join(", ")
                    );
                    Ok(None)
                }
                Err(e) => Err(e),
            },
            found => found,
        }
    }

    /// [`Self::newest_verified`] without printing: the checkpoint and the newer ones it
    /// skipped (step, why, and where it was moved for a resume).
    ///
    /// A writer beside the reader (an `eval` next to a running `train`) prunes and adds
    /// checkpoints while they are read: what looks damaged may have been pruned between
    /// the listing and the read, or not be finished (its state file written, its sidecar
    /// not yet: a checkpoint counts only once both exist). So a lookup that met damage
    /// looks again while the folder's files keep changing (a few times at most), giving a
    /// newest state file without its sidecar up to two seconds to get it, and a checkpoint
    /// whose files are all gone is pruned, not damaged; damage that stays is reported as
    /// before.
    fn newest_verified_quiet(&self, move_damaged: bool) -> Result<(Option<Checkpoint>, Vec<Skipped>)> {
        let mut files = self.checkpoint_file_names()?;
        let mut attempt = 0;
        loop {
            let steps = self.checkpoint_candidates()?;
            let mut damaged: Vec<(u64, String)> = Vec::new();
            let mut found = None;
            for &step in steps.iter().rev() {
                match self.verified(step) {
                    Ok(c) => {
                        found = Some(c);
                        break;
                    }
                    Err(e) => damaged.push((step, format!("{e:#}"))),
                }
            }
            if !damaged.is_empty() && attempt < 5 {
                let mut now = self.checkpoint_file_names()?;
                // The newest state file without its sidecar may be a write in progress: give
                // its sidecar a moment (not under a resume's lock, where no one writes).
                let newest = steps.last().copied();
                let half_written = newest.is_some_and(|n| {
                    damaged[0].0 == n && self.trainer_path(n).exists() && !self.run_state_path(n).exists()
                });
                // The writer hashes the whole state file (a DQN's holds its replay buffer)
                // before it writes the sidecar: wait up to two seconds for the folder to change.
                let mut waited = 0;
                while now == files && half_written && !move_damaged && waited < 40 {
                    std::thread::sleep(std::time::Duration::from_millis(50));
                    now = self.checkpoint_file_names()?;
                    waited += 1;
                }
                if now != files {
                    files = now;
                    attempt += 1;
                    continue;
                }
            }
            // A checkpoint whose files are all gone by now was pruned by a writer, not damaged.
            // The writer removes a checkpoint's two files one by one: beside a live writer (a
            // lookup, not a resume) give an older one that has lost just one file a moment to
            // lose the other before calling it damaged.
            let newest = steps.last().copied();
            let half_gone = |st: u64| self.trainer_path(st).exists() != self.run_state_path(st).exists();
            let mut waited = 0;
            while !move_damaged && waited < 20 && damaged.iter().any(|(st, _)| Some(*st) != newest && half_gone(*st)) {
                std::thread::sleep(std::time::Duration::from_millis(10));
                waited += 1;
            }
            damaged.retain(|(st, _)| self.run_state_path(*st).exists() || self.trainer_path(*st).exists());
            // A writer that keeps the folder changing can outlast the retries above: a lookup
            // that saw it change and still meets the newest state file without its sidecar
            // met a write in progress, not damage (a resume holds the lock: no one writes).
            if !move_damaged && attempt > 0 {
                if let Some(n) = newest {
                    damaged.retain(|(st, _)| {
                        !(*st == n && self.trainer_path(n).exists() && !self.run_state_path(n).exists())
                    });
                }
            }
            // And one whose write finished since it was read verifies now: it was in progress.
            if !move_damaged {
                damaged.retain(|(st, _)| self.verified(*st).is_err());
            }
            if let Some(c) = found {
                // Only now, with a checkpoint to continue from, are the newer damaged ones
                // reported (and set aside for a resume).
                let mut skipped = Vec::with_capacity(damaged.len());
                for (s, why) in damaged {
                    let moved = if move_damaged { self.set_aside(s)? } else { String::new() };
                    skipped.push((s, format!("{why}{moved}")));
                }
                return Ok((Some(c), skipped));
            }
            let Some((_, why)) = damaged.first() else { return Ok((None, Vec::new())) };
            let steps: Vec<u64> = damaged.iter().rev().map(|(s, _)| *s).collect();
            let listed: Vec<String> = steps.iter().map(u64::to_string).collect();
            let message = format!(
                "none of the {} checkpoint(s) in {} verifies (steps {}; the newest: {why}); nothing was changed: \
                 move them away or train into another --out",
                damaged.len(),
                self.root.display(),
                listed.join(", ")
            );
            return Err(NoneVerifies { steps, message }.into());
        }
    }

    /// The names of the folder's checkpoint files (both halves), to tell a folder that a
    /// writer is changing from one that stays as it is.
    fn checkpoint_file_names(&self) -> Result<std::collections::BTreeSet<String>> {
        let mut names = std::collections::BTreeSet::new();
        for entry in std::fs::read_dir(&self.root).with_context(|| format!("listing {}", self.root.display()))? {
            let name = entry?.file_name().to_string_lossy().into_owned();
            if name.starts_with("checkpoint-") {
                names.insert(name);
            }
        }
        Ok(names)
    }

    /// Moves checkpoint `step`'s files (whichever exist) into `damaged/`; the warning's tail.
    fn set_aside(&self, step: u64) -> Result<String> {
        self.set_aside_files(&[self.run_state_path(step), self.trainer_path(step)])
    }

    /// Moves whichever of `files` exist into `damaged/`, never over an earlier file there (a
    /// restarted run passes its steps again): all under the first suffix free for every one
    /// of them (`NAME`, `NAME.1`, ...), so the halves of a checkpoint keep matching names.
    fn set_aside_files(&self, files: &[PathBuf]) -> Result<String> {
        let to = self.root.join("damaged");
        let present: Vec<&PathBuf> = files.iter().filter(|p| p.exists()).collect();
        if present.is_empty() {
            return Ok(String::new());
        }
        std::fs::create_dir_all(&to).with_context(|| format!("creating {}", to.display()))?;
        let dest = |p: &Path, i: usize| {
            let name = p.file_name().expect("a file name").to_string_lossy().into_owned();
            to.join(if i == 0 { name } else { format!("{name}.{i}") })
        };
        let i = (0..).find(|&i| files.iter().all(|p| !dest(p, i).exists())).expect("an unused suffix");
        for p in present {
            let d = dest(p, i);
            std::fs::rename(p, &d).with_context(|| format!("moving {} to {}", p.display(), d.display()))?;
        }
        Ok(format!(" (moved to {})", to.display()))
    }

    /// Steps with a state file or a sidecar (either may be the damaged half), oldest first.
    fn checkpoint_candidates(&self) -> Result<Vec<u64>> {
        let mut steps = Vec::new();
        for entry in std::fs::read_dir(&self.root).with_context(|| format!("listing {}", self.root.display()))? {
            let name = entry?.file_name().to_string_lossy().into_owned();
            let stem = name
                .strip_prefix("checkpoint-")
                .and_then(|r| r.strip_suffix(".json").or_else(|| r.strip_suffix(".safetensors")));
            if let Some(step) = stem.and_then(|n| n.parse::<u64>().ok()) {
                steps.push(step);
            }
        }
        steps.sort_unstable();
        steps.dedup();
        Ok(steps)
    }

    fn verified(&self, step: u64) -> Result<Checkpoint> {
        let (path, trainer) = (self.run_state_path(step), self.trainer_path(step));
        if !trainer.exists() {
            bail!("{} is missing", trainer.display());
        }
        let text = fx_data::files::read_regular_to_string(&path, fx_data::files::MAX_TEXT_BYTES)
            .with_context(|| format!("reading {}", path.display()))?;
        // serde quotes what it met, control characters included: escaped, the error stays one line.
        let run: RunState = serde_json::from_str(&text)
            .map_err(|e| anyhow::anyhow!("parsing {}: {}", path.display(), fx_data::error::one_line(&e.to_string())))?;
        if run.version != RUN_STATE_VERSION {
            bail!(
                "{}: checkpoint layout version {} is not supported (expected {RUN_STATE_VERSION})",
                path.display(),
                run.version
            );
        }
        // The sidecar's normaliser is part of what verifies: a bad one names this file here,
        // not later without a path.
        run.normalizer().with_context(|| format!("{}: its normaliser", path.display()))?;
        if let Some(want) = &run.trainer_sha256 {
            let got = sha256_file(&trainer)?;
            if &got != want {
                bail!("{} does not match the SHA-256 its sidecar records (truncated or changed)", trainer.display());
            }
        }
        Ok(Checkpoint { trainer, run })
    }

    /// Writes a checkpoint: the trainer's state file (through `save`, itself atomic), then
    /// the run state; a checkpoint counts only once both exist. Older checkpoints beyond
    /// `keep` are removed.
    pub fn write_checkpoint(
        &self,
        run: &RunState,
        keep: usize,
        save: impl FnOnce(&Path) -> Result<()>,
    ) -> Result<PathBuf> {
        self.checkpoint_files().write(run, keep, save)
    }

    /// What writing a checkpoint needs of this folder, detached from it (`Send`, for a
    /// writer thread; the folder's lock stays with the `RunDir`).
    pub fn checkpoint_files(&self) -> CheckpointFiles {
        CheckpointFiles { dir: RunDir { root: self.root.clone(), lock: None, provisional: false } }
    }

    fn write_checkpoint_here(
        &self,
        run: &RunState,
        keep: usize,
        save: impl FnOnce(&Path) -> Result<()>,
    ) -> Result<PathBuf> {
        let trainer = self.trainer_path(run.env_steps);
        save(&trainer)?;
        let run = RunState { trainer_sha256: Some(sha256_file(&trainer)?), ..run.clone() };
        write_atomic(&self.run_state_path(run.env_steps), serde_json::to_string_pretty(&run)?.as_bytes())?;
        let steps = self.checkpoint_steps()?;
        for &old in steps.iter().take(steps.len().saturating_sub(keep)) {
            // Only a checkpoint that verifies is deleted: one that does not (changed on disk
            // since it was written, or an older run's that a resume kept) is evidence a user
            // may want, so it is set aside in damaged/ instead.
            match self.verified(old) {
                Ok(_) => {
                    let _ = std::fs::remove_file(self.run_state_path(old));
                    let _ = std::fs::remove_file(self.trainer_path(old));
                }
                Err(why) => {
                    // The new checkpoint is written; failing to move an old one must not
                    // fail it: the damaged files then stay where they are.
                    let moved = self.set_aside(old).unwrap_or_else(|e| format!(" (left in place: {e:#})"));
                    eprintln!("warning: not pruning checkpoint {old}, which does not verify ({why:#}){moved}");
                }
            }
        }
        self.remove_orphans(run.env_steps)?;
        Ok(trainer)
    }

    /// Trainer files older than `newest` without their run-state file: left by a crash
    /// between a checkpoint's two writes, never loadable, possibly large (a DQN state holds
    /// the replay buffer).
    fn remove_orphans(&self, newest: u64) -> Result<()> {
        for entry in std::fs::read_dir(&self.root).with_context(|| format!("listing {}", self.root.display()))? {
            let name = entry.with_context(|| format!("listing {}", self.root.display()))?.file_name();
            let name = name.to_string_lossy();
            let step = name.strip_prefix("checkpoint-").and_then(|r| r.strip_suffix(".safetensors"));
            if let Some(step) = step.and_then(|s| s.parse::<u64>().ok()) {
                if step < newest && !self.run_state_path(step).exists() {
                    let _ = std::fs::remove_file(self.trainer_path(step));
                }
            }
        }
        Ok(())
    }

    /// `metrics.jsonl` for appending; on resume, lines after the checkpoint's step are
    /// dropped first (they were logged after the state the run continues from). A line's
    /// step is its `env_steps` (RL) or `epoch` (sequence models).
    pub fn metrics(&self, resume_from: Option<u64>) -> Result<MetricsLog> {
        let path = self.path("metrics.jsonl");
        if let Some(step) = resume_from {
            if path.exists() {
                let text = fx_data::files::read_regular_to_string(&path, u64::MAX)
                    .with_context(|| format!("reading {}", path.display()))?;
                let kept: Vec<&str> = text
                    .lines()
                    .filter(|l| {
                        serde_json::from_str::<serde_json::Value>(l)
                            .ok()
                            .and_then(|v| v["env_steps"].as_u64().or_else(|| v["epoch"].as_u64()))
                            .is_some_and(|s| s <= step)
                    })
                    .collect();
                let mut text = kept.join("\n");
                if !text.is_empty() {
                    text.push('\n');
                }
                write_atomic(&path, text.as_bytes())?;
            }
        } else if path.exists() {
            std::fs::remove_file(&path)?;
        }
        let file = fx_data::files::append_regular(&path).with_context(|| format!("opening {}", path.display()))?;
        Ok(MetricsLog { file, path })
    }
}

/// Appends one JSON object per line.
pub struct MetricsLog {
    file: File,
    path: PathBuf,
}

impl MetricsLog {
    pub fn write(&mut self, record: &serde_json::Value) -> Result<()> {
        writeln!(self.file, "{record}").with_context(|| format!("writing {}", self.path.display()))
    }
}

#[cfg(test)]
mod fuzz_tests;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refuses_to_overwrite_and_to_resume_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("run");
        assert!(RunDir::open(&root, true).unwrap_err().to_string().contains("no config.toml"));
        // A new run that ends before it started leaves no folder behind.
        drop(RunDir::open(&root, false).unwrap());
        assert!(!root.exists());
        let mut first = RunDir::open(&root, false).unwrap();
        write_atomic(&root.join("config.toml"), b"x").unwrap();
        first.mark_started();
        // While the first holds the folder, a resume is refused naming it and this process.
        let err = RunDir::open(&root, true).unwrap_err().to_string();
        assert!(err.contains("in use") && err.contains(&format!("process {}", std::process::id())), "{err}");
        drop(first);
        assert!(root.join("config.toml").exists(), "a started run keeps its folder");
        assert!(RunDir::open(&root, false).unwrap_err().to_string().contains("--resume"));
        RunDir::open(&root, true).unwrap();
        // Readers (eval) take no lock.
        let _writer = RunDir::open(&root, true).unwrap();
        RunDir::existing(&root).unwrap();
    }

    /// The metrics log a resume trims and appends to: kept lines up to the step, and a log
    /// that is a FIFO (no writer ever comes) refused at once, naming it, on resume and new.
    #[test]
    fn the_metrics_log_is_trimmed_on_resume_and_never_a_fifo() {
        let dir = tempfile::tempdir().unwrap();
        let run = RunDir::open(dir.path(), false).unwrap();
        let path = dir.path().join("metrics.jsonl");
        std::fs::write(&path, "{\"env_steps\":10}\n{\"env_steps\":20}\nnot json\n{\"epoch\":30}\n").unwrap();
        run.metrics(Some(20)).unwrap().write(&serde_json::json!({"env_steps": 21})).unwrap();
        assert_eq!(
            std::fs::read_to_string(&path).unwrap(),
            "{\"env_steps\":10}\n{\"env_steps\":20}\n{\"env_steps\":21}\n"
        );
        std::fs::remove_file(&path).unwrap();
        let c = std::ffi::CString::new(path.to_str().unwrap()).unwrap();
        // SAFETY: a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        let t = std::time::Instant::now();
        let e = format!("{:#}", run.metrics(Some(20)).err().expect("a FIFO log is refused"));
        assert!(e.contains("metrics.jsonl") && e.contains("is a FIFO") && !e.contains('\n'), "{e}");
        assert!(t.elapsed() < std::time::Duration::from_secs(5), "the log blocked");
    }

    /// A DQN run's state at `step` (the trainer's hash filled in when it is written).
    fn state(step: u64) -> RunState {
        RunState {
            version: RUN_STATE_VERSION,
            model: ModelChoice::Dqn,
            env_steps: step,
            env: None,
            norm_mean: vec![0.0],
            norm_std: vec![1.0],
            data_source: "test".into(),
            train_seconds: 0.0,
            trainer_sha256: None,
        }
    }

    #[test]
    fn checkpoints_keep_the_newest_and_drop_orphans() {
        let dir = tempfile::tempdir().unwrap();
        let run = RunDir::open(dir.path(), false).unwrap();
        // A trainer file whose run state was never written (a crash between the writes).
        write_atomic(&run.trainer_path(5), b"orphan").unwrap();
        for step in [10, 20, 30] {
            run.write_checkpoint(&state(step), 2, |p| write_atomic(p, b"weights")).unwrap();
        }
        assert!(!run.trainer_path(5).exists(), "orphaned trainer file kept");
        assert!(!run.trainer_path(10).exists() && !run.run_state_path(10).exists());
        assert_eq!(run.checkpoint_steps().unwrap(), vec![20, 30]);
        assert_eq!(run.latest_checkpoint().unwrap().unwrap().run.env_steps, 30);
    }

    /// Pruning deletes only checkpoints that verify: one changed on disk since it was
    /// written is moved into `damaged/` (twice over the same step: both kept), and a later
    /// `--restart` of a folder with none that verifies sets them all aside and starts at 0.
    #[test]
    fn pruning_keeps_what_does_not_verify_and_restart_sets_it_aside() {
        let dir = tempfile::tempdir().unwrap();
        let run = RunDir::open(dir.path(), false).unwrap();
        let weights = |step: u64| format!("weights {step}").into_bytes();
        for step in [10, 20] {
            run.write_checkpoint(&state(step), 2, |p| write_atomic(p, &weights(step))).unwrap();
        }
        std::fs::write(run.trainer_path(10), b"changed").unwrap();
        run.write_checkpoint(&state(30), 2, |p| write_atomic(p, &weights(30))).unwrap();
        let aside = dir.path().join("damaged");
        assert_eq!(std::fs::read(aside.join("checkpoint-0000000010.safetensors")).unwrap(), b"changed");
        assert!(aside.join("checkpoint-0000000010.json").exists());
        // A healthy one is pruned as before.
        run.write_checkpoint(&state(40), 2, |p| write_atomic(p, &weights(40))).unwrap();
        assert!(!run.trainer_path(20).exists() && !aside.join("checkpoint-0000000020.safetensors").exists());
        assert_eq!(run.checkpoint_steps().unwrap(), vec![30, 40]);

        // Every checkpoint damaged: --resume refuses and changes nothing; --restart sets
        // them aside (beside the earlier damaged files, none overwritten) and starts over.
        for step in [30, 40] {
            std::fs::write(run.trainer_path(step), b"broken").unwrap();
        }
        let e = run.resume_checkpoint().err().expect("none verifies");
        let plain = format!("{e:#}");
        assert!(plain.contains("steps 30, 40") && !plain.contains("--restart") && !plain.contains('\n'), "{plain}");
        let hinted = format!("{:#}", with_restart_hint(e));
        assert!(hinted.starts_with(&plain) && hinted.contains("add --restart to --resume"), "{hinted}");
        let other = format!("{:#}", with_restart_hint(anyhow::anyhow!("disk on fire")));
        assert_eq!(other, "disk on fire");
        assert_eq!(run.checkpoint_steps().unwrap(), vec![30, 40]);
        assert!(run.restart_checkpoint().unwrap().is_none());
        assert!(run.checkpoint_candidates().unwrap().is_empty());
        for step in [30, 40] {
            let f = aside.join(format!("checkpoint-{step:010}.safetensors"));
            assert_eq!(std::fs::read(&f).unwrap(), b"broken", "{}", f.display());
        }
        // The same step damaged again later: the first file stays, the second gets `.1`.
        run.write_checkpoint(&state(10), 2, |p| write_atomic(p, b"again")).unwrap();
        std::fs::write(run.trainer_path(10), b"broken again").unwrap();
        assert!(run.restart_checkpoint().unwrap().is_none());
        assert_eq!(std::fs::read(aside.join("checkpoint-0000000010.safetensors")).unwrap(), b"changed");
        assert_eq!(std::fs::read(aside.join("checkpoint-0000000010.safetensors.1")).unwrap(), b"broken again");
        assert!(aside.join("checkpoint-0000000010.json.1").exists(), "the halves' names no longer match");
        // A folder with one that verifies resumes from it, --restart or not.
        run.write_checkpoint(&state(50), 2, |p| write_atomic(p, &weights(50))).unwrap();
        assert_eq!(run.restart_checkpoint().unwrap().unwrap().run.env_steps, 50);
    }

    /// `eval` beside a running `train`: a writer keeps one checkpoint (pruning the previous
    /// one after each write) while a reader looks up the newest over and over; every lookup
    /// finds a checkpoint that verifies and reports nothing as damaged (a pruned or
    /// half-written checkpoint is not damage).
    #[test]
    fn lookups_beside_a_pruning_writer_find_a_checkpoint_and_report_no_damage() {
        let dir = tempfile::tempdir().unwrap();
        let run = RunDir::open(dir.path(), false).unwrap();
        let payload = vec![7u8; 256 * 1024];
        run.write_checkpoint(&state(1), 1, |p| write_atomic(p, &payload)).unwrap();
        let files = run.checkpoint_files();
        let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let writer = {
            let done = done.clone();
            std::thread::spawn(move || {
                for step in 2..=150u64 {
                    let mut bytes = payload.clone();
                    bytes[0] = step as u8;
                    files.write(&state(step), 1, |p| write_atomic(p, &bytes)).unwrap();
                    std::thread::sleep(std::time::Duration::from_millis(1));
                }
                done.store(true, std::sync::atomic::Ordering::SeqCst);
            })
        };
        let reader = RunDir::existing_unchecked(dir.path());
        let (mut lookups, mut last) = (0u64, 0u64);
        while !done.load(std::sync::atomic::Ordering::SeqCst) {
            let (found, skipped) = reader.newest_verified_quiet(false).unwrap();
            let c = found.expect("a checkpoint");
            assert!(skipped.is_empty(), "lookup {lookups} reported damage: {skipped:?}");
            assert!(c.run.env_steps >= last, "went back from {last} to {}", c.run.env_steps);
            last = c.run.env_steps;
            lookups += 1;
        }
        writer.join().unwrap();
        assert!(lookups > 10, "only {lookups} lookups ran beside the writer");
        assert_eq!(reader.latest_checkpoint().unwrap().unwrap().run.env_steps, 150);
    }

    #[test]
    fn atomic_write_leaves_no_temporary() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("a.txt");
        write_atomic(&p, b"hello").unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), b"hello");
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
        assert!(write_atomic(&dir.path().join("missing/b.txt"), b"x").is_err());
    }
}
