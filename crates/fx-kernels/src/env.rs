//! The CPU reference trading environment (MODELS.md "Trading environment").
//!
//! Per account `e` (global index `env_offset + e`) the state is the time index `t`, the
//! position `p ∈ {-1, 0, +1}`, the entry price, the steps in position, the episode step
//! and the step counter (the RNG `step`). The semantics follow the reference
//! `fx_reference/env.py` exactly, including its readings listed under NOTES
//! "Environment and RNG":
//!
//! - reset (at creation with counter 0, and automatically when an episode ends, with the
//!   counter already incremented): `t = floor(u · (T − episode_len))`,
//!   `u = draw(seed, 0, env, counter)`, `p = 0`, `entry = close[t]`, counters 0;
//! - step with action `a`: `p' = a − 1`,
//!   `reward = p'·ln(close[t+1]/close[t]) − cost·|p' − p|` (f64, then f32);
//!   if `p' ≠ p` the entry becomes `close[t]` (before `t` advances) and the time in
//!   position restarts at 0, else it counts up (also while flat); `t += 1`;
//! - `done` when the episode step reaches `episode_len`; `next_obs` is the pre-reset
//!   state, `obs` the post-reset state the agent acts on next;
//! - observation `[market[t] (51), p, p·ln(close[t]/entry) (0 when flat),
//!   steps_in_pos / episode_len, 0, 0]`, portfolio values computed in f64, stored f32.

use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use serde::{Deserialize, Serialize};

use crate::error::{CandleContext, Error, Result};
use crate::rng;
use crate::vec_env::{Step, VecEnv};

/// Market features per time step (DATA.md).
pub const N_MARKET: usize = 51;
/// Width of the padded RL state: 51 market values, 3 portfolio values, 2 zeros.
pub const OBS_DIM: usize = 56;
/// Actions: 0 short, 1 flat, 2 long (target position `a − 1`).
pub const N_ACTIONS: usize = 3;

/// Environment parameters; defaults follow MODELS.md (`episode_len` 256, cost 1 bp).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct EnvConfig {
    /// Number of accounts `E` stepped together.
    pub num_envs: usize,
    /// Steps per episode; an account auto-resets after this many steps.
    pub episode_len: usize,
    /// Cost per unit of position change (1e-4 = 1 basis point).
    pub cost: f64,
    /// Seed of the counter-based draws.
    pub seed: u64,
    /// Global index of this instance's first account (for sharding: the draws use
    /// `env_offset + e`, so shards draw as one big batch would).
    pub env_offset: u64,
}

impl Default for EnvConfig {
    fn default() -> Self {
        Self { num_envs: 4096, episode_len: 256, cost: 1e-4, seed: 0, env_offset: 0 }
    }
}

impl EnvConfig {
    /// Checks the configuration against a series of `t_len` rows.
    pub fn validate(&self, t_len: usize) -> Result<()> {
        let ctx = "EnvConfig::validate";
        let fail = |message: String| Err(Error::Config { context: ctx, message });
        if self.num_envs == 0 {
            return fail("num_envs must be at least 1".into());
        }
        if self.episode_len == 0 {
            return fail("episode_len must be at least 1".into());
        }
        if t_len < self.episode_len + 1 {
            return fail(format!(
                "series of {t_len} rows is too short for episode_len {} (needs at least episode_len + 1)",
                self.episode_len
            ));
        }
        if !(self.cost.is_finite() && self.cost >= 0.0) {
            return fail(format!("cost must be finite and >= 0, got {}", self.cost));
        }
        if self.env_offset.checked_add(self.num_envs as u64).is_none() {
            return fail("env_offset + num_envs overflows u64".into());
        }
        Ok(())
    }
}

/// Raw rows of one or more instruments: market features row-major `[R, 51]` and close
/// prices `[R]` (f64), checked finite (prices positive). Several [`EnvData`] views share one
/// `Arc<SeriesRows>` (a walk-forward study's folds: each fold's training spans and
/// normalisers over the same rows), and the GPU holds one copy of it for all of them.
#[derive(Clone, Debug)]
pub struct SeriesRows {
    market: Vec<f32>,
    close: Vec<f64>,
}

impl SeriesRows {
    /// Checks `market.len() == 51 · close.len()`, at least 2 rows, finite market values and
    /// finite positive prices.
    pub fn new(market: Vec<f32>, close: Vec<f64>) -> Result<Self> {
        let ctx = "EnvData::new";
        if market.len() != close.len() * N_MARKET {
            return Err(Error::shape(
                "market",
                ctx,
                format!("[{}, {N_MARKET}] (from close's length)", close.len()),
                format!("{} values", market.len()),
            ));
        }
        if close.len() < 2 {
            return Err(Error::Config {
                context: ctx,
                message: format!("series needs at least 2 rows, got {}", close.len()),
            });
        }
        if let Some((index, v)) = market.iter().enumerate().find(|(_, v)| !v.is_finite()) {
            return Err(Error::NonFinite { what: "market", index, value: *v as f64, context: ctx });
        }
        if let Some((index, v)) = close.iter().enumerate().find(|(_, v)| !(v.is_finite() && **v > 0.0)) {
            return Err(Error::NonFinite { what: "close (must be finite and > 0)", index, value: *v, context: ctx });
        }
        Ok(Self { market, close })
    }

    /// Number of rows `R`.
    pub fn len(&self) -> usize {
        self.close.len()
    }

    /// Always false (at least two rows).
    pub fn is_empty(&self) -> bool {
        self.close.is_empty()
    }

    /// The raw market features, row-major `[R, 51]`.
    pub fn market(&self) -> &[f32] {
        &self.market
    }

    /// The close prices `[R]`.
    pub fn close(&self) -> &[f64] {
        &self.close
    }
}

/// Per-segment normalisation applied as a row is observed:
/// `((x − mean[k][c]) / std[k][c]).clamp(−clip, clip)` for a row of segment `k`, in F32,
/// the arithmetic of [`fx_data::Normalizer::apply_in_place`] (so a view observes the bits a
/// host-normalised copy would hold).
#[derive(Clone, Debug, PartialEq)]
pub struct SegmentNorms {
    /// `[S, 2, 51]`: segment k's means, then its standard deviations.
    table: Vec<f32>,
    clip: f32,
}

impl SegmentNorms {
    /// The table `[S, 2, 51]` (means then standard deviations of each segment).
    pub fn table(&self) -> &[f32] {
        &self.table
    }

    /// The clip bound (±).
    pub fn clip(&self) -> f32 {
        self.clip
    }
}

/// The series the accounts trade: rows of [`SeriesRows`] (market features `[T, 51]`,
/// prices `[T]`) made of one or more **segments** (a panel's instruments). An episode never
/// leaves the segment its reset chose: with one segment the reset is `segment.start +
/// floor(u · (len − L))` (the reference's `floor(u · (T − L))` when the segment is the whole
/// series); with several it first draws the segment, `k = floor(u_k · S)` from
/// [`rng::STREAM_INSTRUMENT`], then the start inside it, `segment.start + floor(u · (len_k −
/// L))` from the reset stream. Validated on construction: finite values, positive prices,
/// every segment at least 2 rows.
///
/// Built by [`new`](Self::new) / [`from_segments`](Self::from_segments) the rows are the
/// observed features and the segments cover them. A [`view`](Self::view) takes sorted,
/// disjoint segments of shared raw rows with a normaliser per segment, applied as rows are
/// observed (CPU and GPU alike), so views of one `Arc<SeriesRows>` share its memory.
#[derive(Clone, Debug)]
pub struct EnvData {
    rows: Arc<SeriesRows>,
    segments: Vec<std::ops::Range<usize>>,
    norms: Option<SegmentNorms>,
}

impl EnvData {
    /// Builds the series, checking `market.len() == 51 · close.len()`, finite market
    /// values and finite positive prices.
    pub fn new(market: Vec<f32>, close: Vec<f64>) -> Result<Self> {
        let n = close.len();
        Self::from_segments(market, close, &[n])
    }

    /// Segments of `lens` rows one after another (an instrument each; their sum is `T`),
    /// checked as [`new`](Self::new) checks one series.
    pub fn from_segments(market: Vec<f32>, close: Vec<f64>, lens: &[usize]) -> Result<Self> {
        let ctx = "EnvData::new";
        if lens.is_empty() || lens.iter().sum::<usize>() != close.len() {
            return Err(Error::Config {
                context: ctx,
                message: format!("segments of {lens:?} rows do not add up to the {} rows of the series", close.len()),
            });
        }
        let rows = Arc::new(SeriesRows::new(market, close)?);
        let mut start = 0;
        let segments = lens
            .iter()
            .map(|&n| {
                start += n;
                start - n..start
            })
            .collect();
        Self::checked(rows, segments, None)
    }

    /// Segments `segments` of the shared `rows` (sorted, disjoint, each at least 2 rows),
    /// each observed through its own normaliser (`norms[k]` for segment k, 51 features; all
    /// with one clip bound).
    pub fn view(
        rows: Arc<SeriesRows>,
        segments: Vec<std::ops::Range<usize>>,
        norms: &[fx_data::Normalizer],
    ) -> Result<Self> {
        let ctx = "EnvData::view";
        if norms.len() != segments.len() {
            return Err(Error::Config {
                context: ctx,
                message: format!("{} normalisers for {} segments", norms.len(), segments.len()),
            });
        }
        let clip = norms.first().map_or(fx_data::normalize::CLIP, |n| n.clip);
        let mut table = Vec::with_capacity(norms.len() * 2 * N_MARKET);
        for (k, n) in norms.iter().enumerate() {
            // `Normalizer::check`: finite means, finite positive stds, a positive clip.
            if n.width() != N_MARKET || n.clip != clip || n.check().is_err() {
                return Err(Error::Config {
                    context: ctx,
                    message: format!(
                        "normaliser {k}: needs {N_MARKET} finite means, finite positive stds and the clip {clip}"
                    ),
                });
            }
            table.extend_from_slice(&n.mean);
            table.extend_from_slice(&n.std);
        }
        Self::checked(rows, segments, Some(SegmentNorms { table, clip }))
    }

    fn checked(
        rows: Arc<SeriesRows>,
        segments: Vec<std::ops::Range<usize>>,
        norms: Option<SegmentNorms>,
    ) -> Result<Self> {
        let ctx = "EnvData::new";
        if segments.is_empty() {
            return Err(Error::Config { context: ctx, message: "a series needs at least one segment".into() });
        }
        for (k, s) in segments.iter().enumerate() {
            if s.len() < 2 {
                return Err(Error::Config {
                    context: ctx,
                    message: format!("segment {k} has {} rows; a series needs at least 2", s.len()),
                });
            }
            if s.end > rows.len() || (k > 0 && s.start < segments[k - 1].end) {
                return Err(Error::Config {
                    context: ctx,
                    message: format!(
                        "segment {k} ({s:?}) must lie within the {} rows, after segment {}",
                        rows.len(),
                        k.saturating_sub(1)
                    ),
                });
            }
        }
        Ok(Self { rows, segments, norms })
    }

    /// The segments (row ranges, in order; from [`new`](Self::new) and
    /// [`from_segments`](Self::from_segments) they cover `0..T`).
    pub fn segments(&self) -> &[std::ops::Range<usize>] {
        &self.segments
    }

    /// Rows of the shortest segment (what an episode must fit in).
    pub fn shortest_segment(&self) -> usize {
        self.segments.iter().map(|s| s.len()).min().unwrap_or(0)
    }

    /// Number of rows `T` (of the shared rows, for a view).
    pub fn len(&self) -> usize {
        self.rows.len()
    }

    /// Always false (a series has at least two rows).
    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    /// The rows the segments index (shared between views).
    pub fn rows(&self) -> &Arc<SeriesRows> {
        &self.rows
    }

    /// The per-segment normalisers of a [`view`](Self::view) (`None`: rows observed as
    /// they are).
    pub fn norms(&self) -> Option<&SegmentNorms> {
        self.norms.as_ref()
    }

    /// The close prices `[T]`.
    pub fn close(&self) -> &[f64] {
        self.rows.close()
    }

    /// The segment holding row `t` (`t` inside some segment).
    fn segment_of(&self, t: usize) -> usize {
        self.segments.partition_point(|s| s.start <= t).saturating_sub(1)
    }

    /// The 51 market values observed at row `t` (normalised for a view) into `out`.
    #[inline]
    pub fn market_row(&self, t: usize, out: &mut [f32]) {
        let raw = &self.rows.market[t * N_MARKET..(t + 1) * N_MARKET];
        match &self.norms {
            None => out[..N_MARKET].copy_from_slice(raw),
            Some(n) => {
                let k = self.segment_of(t);
                let (mean, std) = n.table[k * 2 * N_MARKET..(k + 1) * 2 * N_MARKET].split_at(N_MARKET);
                for (((o, &x), &m), &s) in out[..N_MARKET].iter_mut().zip(raw).zip(mean).zip(std) {
                    *o = ((x - m) / s).clamp(-n.clip, n.clip);
                }
            }
        }
    }
}

/// The result of one CPU step as host vectors (row-major, `E` rows).
#[derive(Clone, Debug, PartialEq)]
pub struct HostStep {
    /// `[E, 56]` state after the step, before any auto-reset.
    pub next_obs: Vec<f32>,
    /// `[E]` rewards.
    pub reward: Vec<f32>,
    /// `[E]` 1.0 where the episode ended at this step.
    pub done: Vec<f32>,
    /// `[E, 56]` state the agent acts on next (after auto-reset).
    pub obs: Vec<f32>,
}

/// The CPU reference environment: `E` accounts over one [`EnvData`].
#[derive(Clone, Debug)]
pub struct CpuTradingEnv {
    data: Arc<EnvData>,
    cfg: EnvConfig,
    device: Device,
    t: Vec<usize>,
    pos: Vec<i8>,
    entry: Vec<f64>,
    steps_in_pos: Vec<u64>,
    ep_step: Vec<u64>,
    counter: Vec<u64>,
}

/// Start index of a reset: `floor(u · (T − episode_len))` with `u` from stream 0.
#[inline]
pub(crate) fn reset_start(t_len: usize, episode_len: usize, seed: u64, env: u64, counter: u64) -> usize {
    let u = rng::draw(seed, rng::STREAM_RESET, env, counter);
    (u * (t_len - episode_len) as f64).floor() as usize
}

/// Start index of a reset in a series of `segments` (see [`EnvData`]): one segment is the
/// reference's reset; several draw the segment first.
#[inline]
pub(crate) fn reset_start_in(
    segments: &[std::ops::Range<usize>],
    episode_len: usize,
    seed: u64,
    env: u64,
    counter: u64,
) -> usize {
    let seg = match segments {
        [only] => only,
        _ => {
            let u = rng::draw(seed, rng::STREAM_INSTRUMENT, env, counter);
            &segments[((u * segments.len() as f64).floor() as usize).min(segments.len() - 1)]
        }
    };
    seg.start + reset_start(seg.len(), episode_len, seed, env, counter)
}

/// Writes one observation row.
#[inline]
fn write_obs(data: &EnvData, episode_len: usize, t: usize, pos: i8, entry: f64, sip: u64, out: &mut [f32]) {
    data.market_row(t, out);
    let upnl = if pos != 0 { pos as f64 * (data.close()[t] / entry).ln() } else { 0.0 };
    out[N_MARKET] = pos as f32;
    out[N_MARKET + 1] = upnl as f32;
    out[N_MARKET + 2] = (sip as f64 / episode_len as f64) as f32;
    out[N_MARKET + 3] = 0.0;
    out[N_MARKET + 4] = 0.0;
}

impl CpuTradingEnv {
    /// Creates the environment and resets every account with counter 0.
    pub fn new(data: Arc<EnvData>, cfg: EnvConfig) -> Result<Self> {
        cfg.validate(data.shortest_segment())?;
        let e = cfg.num_envs;
        let mut env = Self {
            data,
            device: Device::Cpu,
            t: vec![0; e],
            pos: vec![0; e],
            entry: vec![0.0; e],
            steps_in_pos: vec![0; e],
            ep_step: vec![0; e],
            counter: vec![0; e],
            cfg,
        };
        for i in 0..e {
            env.reset_one(i);
        }
        Ok(env)
    }

    fn reset_one(&mut self, i: usize) {
        let env_id = self.cfg.env_offset + i as u64;
        let t0 = reset_start_in(self.data.segments(), self.cfg.episode_len, self.cfg.seed, env_id, self.counter[i]);
        self.t[i] = t0;
        self.pos[i] = 0;
        self.entry[i] = self.data.close()[t0];
        self.steps_in_pos[i] = 0;
        self.ep_step[i] = 0;
    }

    /// The configuration.
    pub fn config(&self) -> &EnvConfig {
        &self.cfg
    }

    /// The series.
    pub fn data(&self) -> &Arc<EnvData> {
        &self.data
    }

    /// Time index of each account.
    pub fn times(&self) -> &[usize] {
        &self.t
    }

    /// Position of each account (−1, 0, +1).
    pub fn positions(&self) -> &[i8] {
        &self.pos
    }

    /// Step counter of each account (the RNG `step` of the next action draw).
    pub fn step_counters(&self) -> &[u64] {
        &self.counter
    }

    /// Global account indices `env_offset .. env_offset + E` (the RNG `env`).
    pub fn env_ids(&self) -> Vec<u64> {
        (0..self.cfg.num_envs as u64).map(|i| self.cfg.env_offset + i).collect()
    }

    /// The current observations, row-major `[E, 56]`.
    pub fn observe_host(&self) -> Vec<f32> {
        let mut out = vec![0.0f32; self.cfg.num_envs * OBS_DIM];
        for (i, row) in out.chunks_exact_mut(OBS_DIM).enumerate() {
            write_obs(
                &self.data,
                self.cfg.episode_len,
                self.t[i],
                self.pos[i],
                self.entry[i],
                self.steps_in_pos[i],
                row,
            );
        }
        out
    }

    /// Steps every account with `actions[e] ∈ {0, 1, 2}`; errors (and changes nothing)
    /// when an action is out of range or the length is not `E`.
    pub fn step_host(&mut self, actions: &[u32]) -> Result<HostStep> {
        let ctx = "CpuTradingEnv::step";
        let e = self.cfg.num_envs;
        if actions.len() != e {
            return Err(Error::shape("actions", ctx, format!("[{e}]"), format!("[{}]", actions.len())));
        }
        if let Some((i, &a)) = actions.iter().enumerate().find(|(_, &a)| a as usize >= N_ACTIONS) {
            return Err(Error::OutOfRange {
                what: format!("actions[{i}]"),
                value: a as u64,
                bound: N_ACTIONS as u64,
                context: ctx,
            });
        }
        let l = self.cfg.episode_len;
        let mut out = HostStep {
            next_obs: vec![0.0; e * OBS_DIM],
            reward: vec![0.0; e],
            done: vec![0.0; e],
            obs: vec![0.0; e * OBS_DIM],
        };
        for i in 0..e {
            let t = self.t[i];
            let p_old = self.pos[i];
            let p_new = actions[i] as i8 - 1;
            let c_t = self.data.close()[t];
            let c_t1 = self.data.close()[t + 1];
            let reward = p_new as f64 * (c_t1 / c_t).ln() - self.cfg.cost * (p_new - p_old).unsigned_abs() as f64;
            if p_new != p_old {
                self.entry[i] = c_t;
                self.steps_in_pos[i] = 0;
            } else {
                self.steps_in_pos[i] += 1;
            }
            self.t[i] = t + 1;
            self.pos[i] = p_new;
            self.ep_step[i] += 1;
            self.counter[i] += 1;
            write_obs(
                &self.data,
                l,
                t + 1,
                p_new,
                self.entry[i],
                self.steps_in_pos[i],
                &mut out.next_obs[i * OBS_DIM..(i + 1) * OBS_DIM],
            );
            out.reward[i] = reward as f32;
            if self.ep_step[i] >= l as u64 {
                out.done[i] = 1.0;
                self.reset_one(i);
            }
            write_obs(
                &self.data,
                l,
                self.t[i],
                self.pos[i],
                self.entry[i],
                self.steps_in_pos[i],
                &mut out.obs[i * OBS_DIM..(i + 1) * OBS_DIM],
            );
        }
        Ok(out)
    }
}

/// Checks that `t` is a rank-1 `[n]` tensor on the CPU-compatible path and copies it out.
fn actions_to_host(actions: &Tensor, n: usize, ctx: &'static str) -> Result<Vec<u32>> {
    if actions.dims() != [n] {
        return Err(Error::shape("actions", ctx, format!("[{n}]"), format!("{:?}", actions.dims())));
    }
    if actions.dtype() != DType::U32 {
        return Err(Error::DType { what: "actions", expected: DType::U32, got: actions.dtype(), context: ctx });
    }
    actions.to_vec1::<u32>().ctx(ctx)
}

impl VecEnv for CpuTradingEnv {
    fn num_envs(&self) -> usize {
        self.cfg.num_envs
    }

    fn device(&self) -> &Device {
        &self.device
    }

    fn seed(&self) -> u64 {
        self.cfg.seed
    }

    fn env_offset(&self) -> u64 {
        self.cfg.env_offset
    }

    fn observe(&self) -> Result<Tensor> {
        Tensor::from_vec(self.observe_host(), (self.cfg.num_envs, OBS_DIM), &self.device).ctx("CpuTradingEnv::observe")
    }

    fn step(&mut self, actions: &Tensor) -> Result<Step> {
        let ctx = "CpuTradingEnv::step";
        let a = actions_to_host(actions, self.cfg.num_envs, ctx)?;
        let s = self.step_host(&a)?;
        let e = self.cfg.num_envs;
        Ok(Step {
            next_obs: Tensor::from_vec(s.next_obs, (e, OBS_DIM), &self.device).ctx(ctx)?,
            reward: Tensor::from_vec(s.reward, e, &self.device).ctx(ctx)?,
            done: Tensor::from_vec(s.done, e, &self.device).ctx(ctx)?,
            obs: Tensor::from_vec(s.obs, (e, OBS_DIM), &self.device).ctx(ctx)?,
        })
    }

    fn counters(&self) -> Result<Vec<u64>> {
        Ok(self.counter.clone())
    }

    fn epsilon_greedy(&self, q: &Tensor, eps: f64) -> Result<Tensor> {
        let ctx = "CpuTradingEnv::epsilon_greedy";
        let e = self.cfg.num_envs;
        let qv = host_matrix(q, e, "q", ctx)?;
        let a = crate::select::epsilon_greedy(&qv, N_ACTIONS, eps, self.cfg.seed, &self.env_ids(), &self.counter)?;
        Tensor::from_vec(a, e, &self.device).ctx(ctx)
    }

    fn sample_from_probs(&self, probs: &Tensor) -> Result<Tensor> {
        let ctx = "CpuTradingEnv::sample_from_probs";
        let e = self.cfg.num_envs;
        let pv = host_matrix(probs, e, "probs", ctx)?;
        let a = crate::select::sample_from_probs(&pv, N_ACTIONS, self.cfg.seed, &self.env_ids(), &self.counter)?;
        Tensor::from_vec(a, e, &self.device).ctx(ctx)
    }
}

/// Copies an `[e, 3]` float tensor to the host as f32.
fn host_matrix(x: &Tensor, e: usize, what: &'static str, ctx: &'static str) -> Result<Vec<f32>> {
    if x.dims() != [e, N_ACTIONS] {
        return Err(Error::shape(what, ctx, format!("[{e}, {N_ACTIONS}]"), format!("{:?}", x.dims())));
    }
    x.to_dtype(DType::F32).and_then(|x| x.flatten_all()).and_then(|x| x.to_vec1::<f32>()).ctx(ctx)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::fixtures::Fixture;

    fn fixture_env() -> (Fixture, CpuTradingEnv) {
        let fx = Fixture::load("env.safetensors");
        let data = EnvData::new(fx.f32s("in.market"), fx.f64s("in.close")).expect("fixture data");
        let cfg = EnvConfig { num_envs: 8, episode_len: 32, cost: 1e-4, seed: 20240601, env_offset: 0 };
        let env = CpuTradingEnv::new(Arc::new(data), cfg).expect("env");
        (fx, env)
    }

    fn assert_bits_eq(got: &[f32], want: &[f32], what: &str) {
        assert_eq!(got.len(), want.len(), "{what} length");
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            assert!(g.to_bits() == w.to_bits(), "{what}[{i}]: got {g}, want {w}");
        }
    }

    #[test]
    fn reproduces_fixture_trajectory_exactly() {
        let (fx, mut env) = fixture_env();
        let (e, d) = (8, OBS_DIM);
        let steps = fx.shape("in.actions")[0];
        assert_eq!(steps, 100);
        let actions = fx.i64s("in.actions");
        let obs = fx.f32s("out.obs");
        let next_obs = fx.f32s("out.next_obs");
        let rewards = fx.f32s("out.rewards");
        let dones = fx.f32s("out.dones");
        let positions = fx.i64s("out.positions");
        let t_after = fx.i64s("out.t");
        let t_before = fx.i64s("out.t_before");
        let counter_before = fx.i64s("out.counter_before");
        let mut n_done = 0;
        for k in 0..steps {
            let tb: Vec<i64> = env.times().iter().map(|&t| t as i64).collect();
            assert_eq!(tb, &t_before[k * e..(k + 1) * e], "t_before step {k}");
            let cb: Vec<i64> = env.step_counters().iter().map(|&c| c as i64).collect();
            assert_eq!(cb, &counter_before[k * e..(k + 1) * e], "counter_before step {k}");
            assert_bits_eq(&env.observe_host(), &obs[k * e * d..(k + 1) * e * d], &format!("obs step {k}"));
            let a: Vec<u32> = actions[k * e..(k + 1) * e].iter().map(|&a| a as u32).collect();
            let s = env.step_host(&a).expect("step");
            assert_bits_eq(&s.next_obs, &next_obs[k * e * d..(k + 1) * e * d], &format!("next_obs step {k}"));
            assert_bits_eq(&s.reward, &rewards[k * e..(k + 1) * e], &format!("rewards step {k}"));
            assert_bits_eq(&s.done, &dones[k * e..(k + 1) * e], &format!("dones step {k}"));
            assert_bits_eq(&s.obs, &env.observe_host(), "step's obs equals observe()");
            let p: Vec<i64> = env.positions().iter().map(|&p| p as i64).collect();
            assert_eq!(p, &positions[k * e..(k + 1) * e], "positions step {k}");
            let t: Vec<i64> = env.times().iter().map(|&t| t as i64).collect();
            assert_eq!(t, &t_after[k * e..(k + 1) * e], "t step {k}");
            n_done += s.done.iter().filter(|&&x| x == 1.0).count();
        }
        assert_eq!(n_done, 24);
        assert_bits_eq(&env.observe_host(), &fx.f32s("out.final_obs"), "final_obs");
    }

    #[test]
    fn vec_env_step_matches_host_step() {
        let (fx, mut env) = fixture_env();
        let mut twin = env.clone();
        let actions = fx.i64s("in.actions");
        for k in 0..40 {
            let a: Vec<u32> = actions[k * 8..(k + 1) * 8].iter().map(|&a| a as u32).collect();
            let at = Tensor::from_vec(a.clone(), 8, &Device::Cpu).expect("tensor");
            let s = VecEnv::step(&mut env, &at).expect("step");
            let h = twin.step_host(&a).expect("step");
            assert_eq!(s.reward.to_vec1::<f32>().expect("r"), h.reward);
            assert_eq!(s.done.to_vec1::<f32>().expect("d"), h.done);
            assert_eq!(s.obs.flatten_all().and_then(|x| x.to_vec1::<f32>()).expect("o"), h.obs);
            assert_eq!(s.next_obs.flatten_all().and_then(|x| x.to_vec1::<f32>()).expect("o"), h.next_obs);
        }
    }

    #[test]
    fn rejects_bad_actions_without_changing_state() {
        let (_, mut env) = fixture_env();
        let before = env.observe_host();
        let err = env.step_host(&[0, 1, 2, 3, 0, 0, 0, 0]).unwrap_err();
        assert!(err.to_string().contains("actions[3]"), "{err}");
        assert!(env.step_host(&[0, 1]).is_err());
        let wrong_dtype = Tensor::zeros(8, DType::I64, &Device::Cpu).expect("t");
        assert!(VecEnv::step(&mut env, &wrong_dtype).is_err());
        assert_eq!(env.observe_host(), before);
        assert_eq!(env.step_counters(), &[0; 8]);
    }

    #[test]
    fn rejects_bad_data_and_config() {
        assert!(EnvData::new(vec![0.0; 51 * 3], vec![1.0; 2]).is_err());
        assert!(EnvData::new(vec![0.0; 51 * 2], vec![1.0, -1.0]).is_err());
        assert!(EnvData::new(vec![f32::NAN; 51 * 2], vec![1.0, 1.0]).is_err());
        let data = Arc::new(EnvData::new(vec![0.0; 51 * 10], vec![1.0; 10]).expect("data"));
        let cfg = EnvConfig { num_envs: 2, episode_len: 10, ..EnvConfig::default() };
        assert!(CpuTradingEnv::new(data.clone(), cfg).is_err());
        let cfg = EnvConfig { num_envs: 2, episode_len: 9, ..EnvConfig::default() };
        assert!(CpuTradingEnv::new(data, cfg).is_ok());
    }

    fn random_walk(t_len: usize, seed: u64) -> Arc<EnvData> {
        let mut close = Vec::with_capacity(t_len);
        let mut p = 1.1f64;
        for i in 0..t_len {
            p *= 1.0 + 0.002 * (rng::draw(seed, 9, 0, i as u64) - 0.5);
            close.push(p);
        }
        let market = (0..t_len * N_MARKET).map(|i| rng::draw(seed, 10, 0, i as u64) as f32 - 0.5).collect();
        Arc::new(EnvData::new(market, close).expect("data"))
    }

    fn segment_of(data: &EnvData, t: usize) -> usize {
        data.segments().iter().position(|s| s.contains(&t)).expect("t inside a segment")
    }

    #[test]
    fn one_segment_is_the_reference_reset() {
        // `new` is one segment, and a segmented series of one segment resets as it does.
        let data = random_walk(40, 3);
        let one = Arc::new(
            EnvData::from_segments(data.rows().market().to_vec(), data.close().to_vec(), &[40]).expect("data"),
        );
        let cfg = EnvConfig { num_envs: 64, episode_len: 7, seed: 11, ..EnvConfig::default() };
        let a = CpuTradingEnv::new(data, cfg.clone()).expect("env");
        let b = CpuTradingEnv::new(one, cfg).expect("env");
        assert_eq!(a.times(), b.times());
    }

    #[test]
    fn resets_draw_every_segment() {
        let parts: Vec<Arc<EnvData>> = [30, 50, 20].iter().map(|&n| random_walk(n, n as u64)).collect();
        let market = parts.iter().flat_map(|p| p.rows().market().to_vec()).collect();
        let close = parts.iter().flat_map(|p| p.close().to_vec()).collect();
        let data = Arc::new(EnvData::from_segments(market, close, &[30, 50, 20]).expect("data"));
        let cfg = EnvConfig { num_envs: 300, episode_len: 8, seed: 5, ..EnvConfig::default() };
        let env = CpuTradingEnv::new(data.clone(), cfg).expect("env");
        let mut counts = [0usize; 3];
        for &t in env.times() {
            counts[segment_of(&data, t)] += 1;
        }
        // Uniform over segments, whatever their lengths: 100 expected each.
        assert!(counts.iter().all(|&c| (70..=130).contains(&c)), "{counts:?}");
        // A state whose episode would cross into the next segment is refused.
        let mut state = env.state();
        state.t[0] = 29 - 3;
        state.ep_step[0] = 2;
        let mut twin = env.clone();
        assert!(twin.restore(&state).is_err());
        state.t[0] = 30 - 1 - 6;
        assert!(twin.restore(&state).is_ok());
    }

    #[test]
    fn rejects_bad_segments() {
        let close = vec![1.0; 10];
        assert!(EnvData::from_segments(vec![0.0; 510], close.clone(), &[4, 5]).is_err());
        assert!(EnvData::from_segments(vec![0.0; 510], close.clone(), &[9, 1]).is_err());
        assert!(EnvData::from_segments(vec![0.0; 510], close.clone(), &[]).is_err());
        let data = Arc::new(EnvData::from_segments(vec![0.0; 510], close, &[7, 3]).expect("data"));
        // The shortest segment bounds the episode.
        let cfg = EnvConfig { num_envs: 2, episode_len: 3, ..EnvConfig::default() };
        assert!(CpuTradingEnv::new(data.clone(), cfg).is_err());
        let cfg = EnvConfig { num_envs: 2, episode_len: 2, ..EnvConfig::default() };
        assert!(CpuTradingEnv::new(data, cfg).is_ok());
    }

    /// Raw rows of `lens` instruments one after another (market features on a wide scale,
    /// so normalising changes them and some values clip), and per instrument a sub-range of
    /// its rows with a normaliser fitted on that sub-range's first half.
    pub(crate) fn shared_rows(
        lens: &[usize],
        seed: u64,
    ) -> (Arc<SeriesRows>, Vec<std::ops::Range<usize>>, Vec<fx_data::Normalizer>) {
        let (mut market, mut close, mut segments, mut norms) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let mut start = 0;
        for (k, &n) in lens.iter().enumerate() {
            let part = random_walk(n, seed ^ (k as u64 + 1));
            let scale = 1.0 + 40.0 * rng::draw(seed, 12, k as u64, 0) as f32;
            let raw: Vec<f32> =
                part.rows().market().iter().enumerate().map(|(i, &v)| v * scale + (i % 7) as f32).collect();
            // Every instrument's view skips a few of its first and last rows.
            let (a, b) = (n / 8, n - n / 8);
            norms.push(fx_data::Normalizer::fit_rows(&raw, N_MARKET, a..a + (b - a) / 2).expect("fit"));
            segments.push(start + a..start + b);
            market.extend(raw);
            close.extend_from_slice(part.close());
            start += n;
        }
        (Arc::new(SeriesRows::new(market, close).expect("rows")), segments, norms)
    }

    /// The host-normalised copy of a view: each segment's rows normalised and laid one
    /// after another, as runs built their series before views.
    fn normalised_copy(
        rows: &SeriesRows,
        segments: &[std::ops::Range<usize>],
        norms: &[fx_data::Normalizer],
    ) -> EnvData {
        let (mut market, mut close) = (Vec::new(), Vec::new());
        for (s, n) in segments.iter().zip(norms) {
            let mut m = rows.market()[s.start * N_MARKET..s.end * N_MARKET].to_vec();
            n.apply_in_place(&mut m);
            market.extend(m);
            close.extend_from_slice(&rows.close()[s.clone()]);
        }
        let lens: Vec<usize> = segments.iter().map(|s| s.len()).collect();
        EnvData::from_segments(market, close, &lens).expect("copy")
    }

    #[test]
    fn rejects_bad_views() {
        let (rows, segments, norms) = shared_rows(&[20, 30], 4);
        assert!(EnvData::view(rows.clone(), segments.clone(), &norms).is_ok());
        let err = |segs: Vec<std::ops::Range<usize>>, norms: &[fx_data::Normalizer]| {
            EnvData::view(rows.clone(), segs, norms).expect_err("refused").to_string()
        };
        assert!(err(segments.clone(), &norms[..1]).contains("1 normalisers for 2 segments"));
        assert!(err(vec![25..40, 3..18], &norms).contains("segment 1"));
        assert!(err(vec![3..18, 10..40], &norms).contains("segment 1"));
        assert!(err(vec![3..18, 40..51], &norms).contains("within the 50 rows"));
        assert!(err(vec![3..4, 20..40], &norms).contains("segment 0 has 1 rows"));
        assert!(err(vec![], &[]).contains("at least one segment"));
        let mut zero_std = norms.clone();
        zero_std[1].std[7] = 0.0;
        assert!(err(segments.clone(), &zero_std).contains("normaliser 1"));
        let mut other_clip = norms.clone();
        other_clip[1].clip = 3.0;
        assert!(err(segments, &other_clip).contains("normaliser 1"));
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(16))]
        /// A view of shared raw rows, normalised as rows are observed, runs exactly as the
        /// host-normalised copy of its segments: the same observations, rewards and dones
        /// bit for bit, and the same times up to each segment's offset.
        #[test]
        fn a_view_runs_as_its_normalised_copy(seed: u64, e in 1usize..9, ep_len in 1usize..12,
                                              lens in proptest::collection::vec(0usize..40, 1..4)) {
            let lens: Vec<usize> = lens.iter().map(|n| n + 2 * ep_len + 8).collect();
            let (rows, segments, norms) = shared_rows(&lens, seed);
            let view = Arc::new(EnvData::view(rows.clone(), segments.clone(), &norms).expect("view"));
            let copy = Arc::new(normalised_copy(&rows, &segments, &norms));
            let cfg = EnvConfig { num_envs: e, episode_len: ep_len, cost: 1e-4, seed, env_offset: 3 };
            let mut a = CpuTradingEnv::new(view, cfg.clone()).expect("view env");
            let mut b = CpuTradingEnv::new(copy.clone(), cfg).expect("copy env");
            let shift = |t: usize| {
                let k = copy.segments().iter().position(|s| s.contains(&t)).expect("segment");
                t - copy.segments()[k].start + segments[k].start
            };
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            proptest::prop_assert_eq!(bits(&a.observe_host()), bits(&b.observe_host()));
            for k in 0..3 * ep_len as u32 {
                proptest::prop_assert_eq!(a.times().to_vec(), b.times().iter().map(|&t| shift(t)).collect::<Vec<_>>());
                let acts: Vec<u32> = (0..e as u32).map(|i| (k * 7 + i * 5 + seed as u32) % 3).collect();
                let (sa, sb) = (a.step_host(&acts).expect("step"), b.step_host(&acts).expect("step"));
                proptest::prop_assert_eq!(bits(&sa.next_obs), bits(&sb.next_obs));
                proptest::prop_assert_eq!(bits(&sa.obs), bits(&sb.obs));
                proptest::prop_assert_eq!(bits(&sa.reward), bits(&sb.reward));
                proptest::prop_assert_eq!(&sa.done, &sb.done);
            }
        }
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(24))]
        /// Invariants of the state machine on random series, seeds and actions: times stay
        /// in range, dones come exactly every episode_len steps, the padding stays zero,
        /// the portfolio slots hold the position and counters, everything finite.
        #[test]
        fn state_machine_invariants(seed: u64, offset in 0u64..1_000_000, e in 1usize..6,
                                    ep_len in 1usize..12, t_len in 13usize..60,
                                    acts in proptest::collection::vec(0u32..3, 60)) {
            let data = random_walk(t_len, seed ^ 0x55);
            let cfg = EnvConfig { num_envs: e, episode_len: ep_len, cost: 1e-4, seed, env_offset: offset };
            let mut env = CpuTradingEnv::new(data.clone(), cfg).expect("env");
            for (k, chunk) in acts.chunks(1).enumerate().take(40) {
                let a: Vec<u32> = (0..e).map(|i| (chunk[0] + i as u32) % 3).collect();
                let s = env.step_host(&a).expect("step");
                for i in 0..e {
                    let done = s.done[i] == 1.0;
                    proptest::prop_assert_eq!(done, (k + 1) % ep_len == 0);
                    proptest::prop_assert!(env.times()[i] + 1 < t_len);
                    for row in [&s.next_obs[i * OBS_DIM..(i + 1) * OBS_DIM], &s.obs[i * OBS_DIM..(i + 1) * OBS_DIM]] {
                        proptest::prop_assert!(row.iter().all(|v| v.is_finite()));
                        proptest::prop_assert_eq!(row[54], 0.0);
                        proptest::prop_assert_eq!(row[55], 0.0);
                        proptest::prop_assert!((0.0..=1.0).contains(&row[53]));
                    }
                    proptest::prop_assert_eq!(s.next_obs[i * OBS_DIM + 51], a[i] as f32 - 1.0);
                    if done {
                        proptest::prop_assert_eq!(env.positions()[i], 0);
                        proptest::prop_assert_eq!(s.obs[i * OBS_DIM + 52], 0.0);
                    }
                    // reward bound: |ln ratio| <= 0.0011 per step here plus cost <= 2e-4
                    proptest::prop_assert!(s.reward[i].abs() < 0.0015);
                    proptest::prop_assert_eq!(env.step_counters()[i], k as u64 + 1);
                }
            }
        }

        /// On a series of several segments an episode starts and ends inside one segment:
        /// every step's `t` and `t + 1` lie in the segment of the episode's reset.
        #[test]
        fn episodes_stay_in_their_segment(seed: u64, e in 1usize..6, ep_len in 1usize..10,
                                          lens in proptest::collection::vec(0usize..30, 1..5)) {
            let lens: Vec<usize> = lens.iter().map(|n| n + ep_len + 1).collect();
            let parts: Vec<Arc<EnvData>> = lens.iter().enumerate().map(|(k, &n)| random_walk(n, seed ^ k as u64)).collect();
            let market = parts.iter().flat_map(|p| p.rows().market().to_vec()).collect();
            let close = parts.iter().flat_map(|p| p.close().to_vec()).collect();
            let data = Arc::new(EnvData::from_segments(market, close, &lens).expect("data"));
            let cfg = EnvConfig { num_envs: e, episode_len: ep_len, cost: 1e-4, seed, env_offset: 0 };
            let mut env = CpuTradingEnv::new(data.clone(), cfg).expect("env");
            let mut seg: Vec<usize> = env.times().iter().map(|&t| segment_of(&data, t)).collect();
            for k in 0..30u32 {
                let before = env.times().to_vec();
                let a: Vec<u32> = (0..e as u32).map(|i| (k + i) % 3).collect();
                let s = env.step_host(&a).expect("step");
                for i in 0..e {
                    let range = &data.segments()[seg[i]];
                    proptest::prop_assert!(range.contains(&before[i]) && range.contains(&(before[i] + 1)));
                    let t_next = before[i] + 1;
                    proptest::prop_assert_eq!(&s.next_obs[i * OBS_DIM..i * OBS_DIM + N_MARKET],
                        &data.rows().market()[t_next * N_MARKET..(t_next + 1) * N_MARKET]);
                    if s.done[i] == 1.0 {
                        seg[i] = segment_of(&data, env.times()[i]);
                    }
                }
            }
        }
    }
}

/// Everything that evolves in a [`CpuTradingEnv`] (the series and config aside), so a
/// training run can checkpoint the environment and resume bit for bit.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct EnvState {
    /// Time index per account.
    pub t: Vec<usize>,
    /// Position per account (−1, 0, +1).
    pub pos: Vec<i8>,
    /// Entry price per account.
    pub entry: Vec<f64>,
    /// Steps since the last position change per account.
    pub steps_in_pos: Vec<u64>,
    /// Step within the current episode per account.
    pub ep_step: Vec<u64>,
    /// RNG step counter per account.
    pub counter: Vec<u64>,
}

impl EnvState {
    /// Checks that the state fits `num_envs` accounts over a series of `t_len` rows with
    /// `episode_len`: equal lengths, positions in {−1, 0, 1}, episode steps below
    /// `episode_len`, finite positive entry prices, and times that leave room for the rest
    /// of the episode (`t + episode_len − ep_step ≤ T − 1`, so no step reads past the
    /// series; the GPU env relies on this, as its kernels do not re-check).
    pub fn check(
        &self,
        num_envs: usize,
        segments: &[std::ops::Range<usize>],
        episode_len: usize,
        context: &'static str,
    ) -> Result<()> {
        let e = num_envs;
        let lens = [self.t.len(), self.pos.len(), self.entry.len(), self.steps_in_pos.len(), self.ep_step.len()];
        if lens.iter().chain([&self.counter.len()]).any(|&n| n != e) {
            return Err(Error::Config {
                context,
                message: format!("state is for a different number of accounts (expected {e})"),
            });
        }
        // The rest of the episode must fit inside the segment the account is in.
        let bad_t = self.t.iter().zip(&self.ep_step).any(|(&t, &s)| {
            (s as usize) < episode_len
                && !segments.iter().any(|seg| seg.start <= t && t.saturating_add(episode_len - s as usize) < seg.end)
        });
        let bad_pos = self.pos.iter().any(|p| !(-1..=1).contains(p));
        let bad_ep = self.ep_step.iter().any(|&s| s as usize >= episode_len);
        let bad_sip = self.steps_in_pos.iter().any(|&s| s > u32::MAX as u64);
        if bad_t || bad_pos || bad_ep || bad_sip || self.entry.iter().any(|x| !(x.is_finite() && *x > 0.0)) {
            return Err(Error::Config {
                context,
                message: "state does not fit this series/config (time, position, episode step, steps in position \
                          or entry out of range)"
                    .into(),
            });
        }
        Ok(())
    }
}

impl CpuTradingEnv {
    /// A copy of the evolving state (for checkpoints).
    pub fn state(&self) -> EnvState {
        EnvState {
            t: self.t.clone(),
            pos: self.pos.clone(),
            entry: self.entry.clone(),
            steps_in_pos: self.steps_in_pos.clone(),
            ep_step: self.ep_step.clone(),
            counter: self.counter.clone(),
        }
    }

    /// Restores a state taken with [`CpuTradingEnv::state`] from an env over the same
    /// series and config; a state of another size or out of the series is refused.
    pub fn restore(&mut self, state: &EnvState) -> Result<()> {
        state.check(self.cfg.num_envs, self.data.segments(), self.cfg.episode_len, "CpuTradingEnv::restore")?;
        self.t.clone_from(&state.t);
        self.pos.clone_from(&state.pos);
        self.entry.clone_from(&state.entry);
        self.steps_in_pos.clone_from(&state.steps_in_pos);
        self.ep_step.clone_from(&state.ep_step);
        self.counter.clone_from(&state.counter);
        Ok(())
    }
}

/// One observation row (`[market[t] (51), p, unrealised PnL, steps_in_pos / episode_len, 0, 0]`)
/// exactly as the environment builds it, for code that replays a policy over a series
/// outside an env (backtests).
pub fn write_observation(
    data: &EnvData,
    episode_len: usize,
    t: usize,
    pos: i8,
    entry: f64,
    steps_in_pos: u64,
    out: &mut [f32],
) {
    write_obs(data, episode_len, t, pos, entry, steps_in_pos, out)
}

#[cfg(test)]
mod state_tests {
    use super::*;

    fn env() -> CpuTradingEnv {
        let t_len = 200;
        let close: Vec<f64> = (0..t_len).map(|i| 100.0 * (1.0 + 0.01 * (i as f64 * 0.37).sin())).collect();
        let market: Vec<f32> = (0..t_len * N_MARKET).map(|i| ((i * 7919) % 101) as f32 / 50.0 - 1.0).collect();
        let data = Arc::new(EnvData::new(market, close).unwrap());
        CpuTradingEnv::new(data, EnvConfig { num_envs: 5, episode_len: 16, seed: 99, ..Default::default() }).unwrap()
    }

    /// Found by the checkpoint-sidecar fuzzer: a time index near `usize::MAX` overflowed
    /// the range check (a panic in debug builds, a wrapped sum that passed in release); it
    /// is refused.
    #[test]
    fn a_time_index_at_the_top_of_its_range_is_refused() {
        let mut a = env();
        let mut s = a.state();
        s.t[2] = usize::MAX - 3;
        let e = a.restore(&s).unwrap_err().to_string();
        assert!(e.contains("does not fit this series"), "{e}");
    }

    #[test]
    fn restored_env_continues_identically() {
        let mut a = env();
        let actions = |k: usize| (0..5).map(|e| ((k * 3 + e * 5) % 3) as u32).collect::<Vec<_>>();
        for k in 0..23 {
            a.step_host(&actions(k)).unwrap();
        }
        let saved = a.state();
        let mut b = env();
        b.restore(&saved).unwrap();
        for k in 23..60 {
            let sa = a.step_host(&actions(k)).unwrap();
            let sb = b.step_host(&actions(k)).unwrap();
            assert_eq!(sa.obs, sb.obs);
            assert_eq!(sa.reward, sb.reward);
        }
        assert_eq!(a.state(), b.state());
    }

    #[test]
    fn mismatched_state_is_refused() {
        let mut a = env();
        let mut s = a.state();
        s.t.pop();
        assert!(a.restore(&s).is_err());
        let mut s = a.state();
        s.t[0] = 10_000;
        assert!(a.restore(&s).is_err());
        // in range, but the episode would run past the end of the series (T = 200, L = 16)
        let mut s = a.state();
        (s.t[0], s.ep_step[0]) = (200 - 2, 0);
        assert!(a.restore(&s).is_err());
        (s.t[0], s.ep_step[0]) = (200 - 1 - 16, 0);
        assert!(a.restore(&s).is_ok());
        (s.t[0], s.ep_step[0]) = (200 - 2, 15);
        assert!(a.restore(&s).is_ok());
    }
}
