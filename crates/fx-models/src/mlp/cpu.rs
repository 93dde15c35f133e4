//! [`CpuPolicy`]: a greedy policy MLP ([`GreedyMlp`]) for decisions on the CPU, one bar at a
//! time inside a trading loop: the weights are copied once into plain `Vec<f32>`s, and a
//! decision is a few dot products on the calling thread — no thread pool (candle's CPU
//! matmul sizes its pool by the machine: 100× slower at batch 1 on a 16-core box), no
//! allocation, no tensor. Hidden layers are stored input-major and computed eight vectors of
//! outputs at a time in registers (one broadcast and eight fused vector multiply-adds per
//! input, no horizontal sums; AVX-512 where the CPU has it; a batch takes six rows a pass,
//! twelve vectors); the small heads are F32 dot products in 32 independent lanes (the
//! compiler vectorises both; AVX2 + FMA when the CPU has them, chosen at run time);
//! [`crate::mlp::reference::reference_greedy`] (f64) is what it is tested against.

use candle_core::{DType, Device, Tensor};

#[cfg(target_arch = "x86_64")]
use crate::cpu_dot::avx2_fma;
use crate::cpu_dot::pick_dot;
use crate::mlp::reference::{Activation, GreedyMlp, Head, MlpDims};
use fx_kernels::{CandleContext, Error, Result};

/// One dense layer's weights on the host (`[out, in]` row-major).
#[derive(Debug, Clone)]
struct Dense {
    w: Vec<f32>,
    b: Vec<f32>,
    inputs: usize,
}

impl Dense {
    fn from(weight: &Tensor, bias: &Tensor) -> Result<Self> {
        const CTX: &str = "CpuPolicy::new";
        let host = |t: &Tensor| -> Result<Vec<f32>> {
            t.to_device(&Device::Cpu)
                .and_then(|t| t.to_dtype(DType::F32))
                .and_then(|t| t.flatten_all())
                .and_then(|t| t.to_vec1())
                .ctx(CTX)
        };
        let (w, b) = (host(weight)?, host(bias)?);
        let inputs = weight.dims().get(1).copied().unwrap_or(0);
        if w.iter().chain(&b).any(|v| !v.is_finite()) {
            return Err(Error::Config { context: CTX, message: "the policy's weights hold a non-finite value".into() });
        }
        Ok(Self { w, b, inputs })
    }

    /// `out = W x + b` (the heads: no activation).
    fn apply(&self, dot: fn(&[f32], &[f32]) -> f32, x: &[f32], out: &mut [f32]) {
        for (o, (row, b)) in out.iter_mut().zip(self.w.chunks_exact(self.inputs.max(1)).zip(&self.b)) {
            *o = dot(row, x) + b;
        }
    }
}

/// A hidden layer stored input-major for [`column_layer`]: `wt[i · padded + o] = W[o][i]`,
/// the outputs padded with zero columns to a multiple of [`COL_TAIL`].
#[derive(Debug, Clone)]
struct ColumnDense {
    wt: Vec<f32>,
    b: Vec<f32>,
    outputs: usize,
    padded: usize,
}

/// Outputs per pass of the portable [`column_layer`], and the pass before the tail.
const COL_BLOCK: usize = 32;
/// The pass width for the outputs left over after the full blocks (one vector).
const COL_TAIL: usize = 8;

impl ColumnDense {
    fn from(d: &Dense) -> Self {
        let (inputs, outputs) = (d.inputs, d.b.len());
        let padded = outputs.div_ceil(COL_TAIL) * COL_TAIL;
        let mut wt = vec![0.0f32; inputs * padded];
        for o in 0..outputs {
            for i in 0..inputs {
                wt[i * padded + o] = d.w[o * inputs + i];
            }
        }
        Self { wt, b: d.b.clone(), outputs, padded }
    }
}

/// `w · x + acc`, rounded once. Every layer kernel sums this way, so they all give the same
/// bits: the AVX2 and AVX-512 ones are compiled with FMA (one instruction, half the
/// operations and latency of a multiply then an add); the portable one, on an x86 CPU
/// without FMA, calls libm's correctly rounded `fmaf`.
#[inline(always)]
fn madd(acc: f32, w: f32, x: f32) -> f32 {
    w.mul_add(x, acc)
}

/// `out = act(W x + b)` for a [`ColumnDense`] layer: blocks of `B` outputs, then
/// [`COL_TAIL`]. Each weight is read once per decision, as in the row-major form, but
/// without a horizontal sum per output. `B` is chosen per instruction set so that a block
/// is eight vector accumulators: eight independent multiply-add chains keep two FMA units
/// busy through their four-cycle latency (four chains, the old 32-wide block under AVX2,
/// left half of that idle). Every output still sums its inputs in order, so the result does
/// not depend on `B`.
#[inline(always)]
fn column_layer<const B: usize>(l: &ColumnDense, x: &[f32], out: &mut [f32], act: Activation) {
    // `finish_block` is called directly, not through a closure: a closure is not inlined
    // into the `target_feature` callers, and outside them `fast_tanh`'s `floor` is a libm
    // call per element (profiled: a quarter of a PPO batch's time).
    let mut o0 = 0;
    while o0 + B <= l.padded {
        finish_block(l, o0, &column_block_rows::<B, 1>(&l.wt, l.padded, o0, x)[0], out, act);
        o0 += B;
    }
    while o0 + COL_BLOCK <= l.padded {
        finish_block(l, o0, &column_block_rows::<COL_BLOCK, 1>(&l.wt, l.padded, o0, x)[0], out, act);
        o0 += COL_BLOCK;
    }
    while o0 < l.padded {
        finish_block(l, o0, &column_block_rows::<COL_TAIL, 1>(&l.wt, l.padded, o0, x)[0], out, act);
        o0 += COL_TAIL;
    }
}

/// [`column_layer`] compiled for AVX2 + FMA, 64 outputs (eight vectors) per block.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn column_layer_avx2(l: &ColumnDense, x: &[f32], out: &mut [f32], act: Activation) {
    column_layer::<64>(l, x, out, act)
}

/// [`column_layer`] compiled for AVX-512 F, 128 outputs (eight vectors) per block.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn column_layer_avx512(l: &ColumnDense, x: &[f32], out: &mut [f32], act: Activation) {
    column_layer::<128>(l, x, out, act)
}

fn column_layer_portable(l: &ColumnDense, x: &[f32], out: &mut [f32], act: Activation) {
    column_layer::<COL_BLOCK>(l, x, out, act)
}

/// `out[o0 + k] = act(acc[k] + b[o0 + k])` for the block's real outputs (none past
/// `l.outputs`): bias first, then the activation in a loop of its own (no branch inside, so
/// the compiler vectorises it, `fast_tanh` included).
#[inline(always)]
fn finish_block(l: &ColumnDense, o0: usize, acc: &[f32], out: &mut [f32], act: Activation) {
    let end = (o0 + acc.len()).min(l.outputs);
    if end <= o0 {
        return;
    }
    let ys = &mut out[o0..end];
    for ((y, &a), &b) in ys.iter_mut().zip(acc).zip(&l.b[o0..end]) {
        *y = a + b;
    }
    match act {
        Activation::Identity => {}
        Activation::Relu => ys.iter_mut().for_each(|v| *v = v.max(0.0)),
        Activation::Tanh => ys.iter_mut().for_each(|v| *v = fast_tanh(*v)),
    }
}

/// Observations per pass of a batch ([`CpuPolicy::act_batch`]): each weight vector loaded
/// serves this many rows. Six rows of two vectors are twelve accumulators: with the two
/// weight vectors and a broadcast, AVX2's sixteen registers (BLIS's 6 × 16 F32 kernel).
/// Batches of a multiple of it leave no row to decide alone.
pub const ROWS: usize = 6;

/// Copies [`ROWS`] rows of `x` (`pitch` apart, `inputs` wide) input-major into `xp`:
/// `xp[i · ROWS + r] = x[r · pitch + i]`, so that a pass reads one input's [`ROWS`] values
/// from one address (one pointer instead of six, no bounds check per row).
#[inline(always)]
fn pack_rows(x: &[f32], pitch: usize, inputs: usize, xp: &mut [f32]) {
    for (i, p) in xp[..inputs * ROWS].chunks_exact_mut(ROWS).enumerate() {
        for (r, v) in p.iter_mut().enumerate() {
            *v = x[r * pitch + i];
        }
    }
}

/// `acc[r][k] = Σ_i wt[i · padded + o0 + k] · xp[i · R + r]`, `k < W`, for `R` rows whose
/// inputs are packed input-major ([`pack_rows`]; one row's input is its own packing): per
/// input, `W/8` weight vectors loaded once, one broadcast per row, `R · W/8` multiply-adds
/// into accumulators held in registers. Each output of each row sums its inputs in order
/// with the same operations whatever `R` and `W`, so a batch row gets its single decision's
/// bits.
#[inline(always)]
fn column_block_rows<const W: usize, const R: usize>(
    wt: &[f32],
    padded: usize,
    o0: usize,
    xp: &[f32],
) -> [[f32; W]; R] {
    let mut acc = [[0.0f32; W]; R];
    for (wrow, xr) in wt.chunks_exact(padded.max(1)).zip(xp.chunks_exact(R)) {
        let w: &[f32; W] = wrow[o0..o0 + W].try_into().expect("a block inside the padded row");
        for (a, &xi) in acc.iter_mut().zip(xr) {
            for k in 0..W {
                a[k] = madd(a[k], w[k], xi);
            }
        }
    }
    acc
}

/// [`column_layer`] for [`ROWS`] rows (the rows of `x` and of `out` `pitch` apart; `xp` at
/// least `ROWS × inputs` floats of scratch): blocks of `B` outputs (`ROWS · B` lanes of
/// accumulators, as many vectors as the registers hold: 12 on AVX2, 24 on AVX-512), then
/// [`COL_TAIL`].
#[inline(always)]
fn column_layer_rows<const B: usize>(
    l: &ColumnDense,
    x: &[f32],
    out: &mut [f32],
    pitch: usize,
    act: Activation,
    xp: &mut [f32],
) {
    let inputs = l.wt.len() / l.padded.max(1);
    pack_rows(x, pitch, inputs, xp);
    let xp = &xp[..inputs * ROWS];
    // No closure around `finish_block`: see `column_layer`.
    let mut o0 = 0;
    while o0 + B <= l.padded {
        for (r, a) in column_block_rows::<B, ROWS>(&l.wt, l.padded, o0, xp).iter().enumerate() {
            finish_block(l, o0, a, &mut out[r * pitch..], act);
        }
        o0 += B;
    }
    while o0 < l.padded {
        for (r, a) in column_block_rows::<COL_TAIL, ROWS>(&l.wt, l.padded, o0, xp).iter().enumerate() {
            finish_block(l, o0, a, &mut out[r * pitch..], act);
        }
        o0 += COL_TAIL;
    }
}

/// [`column_layer_rows`] compiled for AVX2 + FMA: 16 outputs × 6 rows, twelve accumulators.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn column_layer_rows_avx2(
    l: &ColumnDense,
    x: &[f32],
    out: &mut [f32],
    pitch: usize,
    act: Activation,
    xp: &mut [f32],
) {
    column_layer_rows::<16>(l, x, out, pitch, act, xp)
}

/// [`column_layer_rows`] compiled for AVX-512 F: 64 outputs × 6 rows, 24 accumulators of
/// AVX-512's 32 registers (with four weight vectors and a broadcast).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn column_layer_rows_avx512(
    l: &ColumnDense,
    x: &[f32],
    out: &mut [f32],
    pitch: usize,
    act: Activation,
    xp: &mut [f32],
) {
    column_layer_rows::<64>(l, x, out, pitch, act, xp)
}

fn column_layer_rows_portable(
    l: &ColumnDense,
    x: &[f32],
    out: &mut [f32],
    pitch: usize,
    act: Activation,
    xp: &mut [f32],
) {
    column_layer_rows::<COL_TAIL>(l, x, out, pitch, act, xp)
}

/// A hidden layer's evaluation for [`ROWS`] rows (rows `pitch` apart in and out), with
/// packing scratch.
type RowsFn = fn(&ColumnDense, &[f32], &mut [f32], usize, Activation, &mut [f32]);

/// A hidden layer's evaluation for one decision.
type LayerFn = fn(&ColumnDense, &[f32], &mut [f32], Activation);

/// The layer kernels this CPU runs, fastest first (the portable one last): one decision's
/// and a batch's ([`ROWS`] rows) of the same ISA.
fn layer_kernels() -> Vec<(&'static str, LayerFn, RowsFn)> {
    let mut v: Vec<(&'static str, LayerFn, RowsFn)> = Vec::new();
    #[cfg(target_arch = "x86_64")]
    {
        if avx2_fma() && is_x86_feature_detected!("avx512f") {
            // SAFETY (both): the features the `_avx512` kernels are compiled for were detected here.
            v.push((
                "avx512",
                |l, x, o, a| unsafe { column_layer_avx512(l, x, o, a) },
                |l, x, o, w, a, p| unsafe { column_layer_rows_avx512(l, x, o, w, a, p) },
            ));
        }
        if avx2_fma() {
            // SAFETY (both): the features the `_avx2` kernels are compiled for were detected here.
            v.push((
                "avx2",
                |l, x, o, a| unsafe { column_layer_avx2(l, x, o, a) },
                |l, x, o, w, a, p| unsafe { column_layer_rows_avx2(l, x, o, w, a, p) },
            ));
        }
    }
    v.push(("portable", column_layer_portable, column_layer_rows_portable));
    v
}

/// The fastest kernels of this CPU: one decision's and a batch's.
fn pick_layer() -> (LayerFn, RowsFn) {
    let (_, one, rows) = layer_kernels()[0];
    (one, rows)
}

/// `tanh` through one `exp` (libm's `tanhf` is a call per element, which does not vectorise; within 2e-7 absolute of
/// `tanh`, tested, where `1 − 2/(e+1)` cancels just above 1/16, far inside the 1e-5 the
/// reference test allows). Branch-free, with
/// [`exp_f32`] instead of libm's `expf` (a call per element), so that a layer's loop of it
/// is vectorised.
#[inline(always)]
fn fast_tanh(x: f32) -> f32 {
    // Odd Taylor terms below 1/16: exact to f32 rounding there, and no cancellation near 0.
    let x2 = x * x;
    let small = x * (1.0 - x2 * (1.0 / 3.0 - x2 * (2.0 / 15.0)));
    // Beyond ±9.1, 1 − tanh(x) < 2.5e-8 rounds to 1 in f32: the clamp changes nothing.
    let e = exp_f32(2.0 * x.clamp(-9.1, 9.1));
    let big = 1.0 - 2.0 / (e + 1.0);
    if x.abs() < 0.0625 {
        small
    } else {
        big
    }
}

/// `e^x` for `x` in `[-18.2, 18.2]` (Cephes' `expf`: `x = n ln 2 + r` with `ln 2` in two
/// parts, a degree-7 polynomial of `r`, then `2^n` through the exponent bits); within 3e-7
/// relative of `exp` (tested), and plain arithmetic, so it vectorises.
#[inline(always)]
#[allow(clippy::excessive_precision)]
fn exp_f32(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const C1: f32 = 0.693_359_375;
    const C2: f32 = -2.121_944_4e-4;
    let n = (x * LOG2E + 0.5).floor();
    let r = (x - n * C1) - n * C2;
    let p = ((((1.987_569_15e-4 * r + 1.398_199_95e-3) * r + 8.333_451_9e-3) * r + 4.166_579_6e-2) * r
        + 1.666_666_55e-1)
        * r
        + 5.000_000_1e-1;
    let y = p * (r * r) + r + 1.0;
    y * f32::from_bits(((n as i32 + 127) << 23) as u32)
}

/// A greedy policy on the CPU; see the module docs.
#[derive(Debug, Clone)]
pub struct CpuPolicy {
    hidden: Vec<(ColumnDense, Activation)>,
    head: Vec<Dense>,
    dueling: bool,
    dims: MlpDims,
    /// Two activation buffers of the widest layer, reused by every call.
    buf: [Vec<f32>; 2],
    scores: Vec<f32>,
    dot: fn(&[f32], &[f32]) -> f32,
    layer: LayerFn,
    rows: RowsFn,
    /// Two activation buffers of [`ROWS`] rows of the widest layer (`widest` apart), for
    /// batches.
    batch_buf: [Vec<f32>; 2],
    /// A batch pass's inputs packed input-major ([`pack_rows`]), [`ROWS`] × the widest layer.
    pack: Vec<f32>,
    widest: usize,
}

impl CpuPolicy {
    /// Copies the network's weights to the host (from any device). Later changes to the
    /// tensors are not seen: build a new policy (e.g. after loading a checkpoint).
    pub fn new(net: &GreedyMlp<'_>) -> Result<Self> {
        let dims = net.dims()?;
        let hidden = net
            .hidden
            .iter()
            .map(|(l, a)| Ok((ColumnDense::from(&Dense::from(l.weight, l.bias)?), *a)))
            .collect::<Result<Vec<_>>>()?;
        let (head, dueling) = match net.head {
            Head::Logits(l) => (vec![Dense::from(l.weight, l.bias)?], false),
            Head::Dueling { value, advantage } => {
                (vec![Dense::from(value.weight, value.bias)?, Dense::from(advantage.weight, advantage.bias)?], true)
            }
        };
        let widest = dims.hidden.iter().copied().chain([dims.input, dims.n_actions + 1]).max().unwrap_or(1);
        Ok(Self {
            hidden,
            head,
            dueling,
            buf: [vec![0.0; widest], vec![0.0; widest]],
            scores: vec![0.0; dims.n_actions],
            dot: pick_dot(),
            layer: pick_layer().0,
            rows: pick_layer().1,
            batch_buf: [vec![0.0; ROWS * widest], vec![0.0; ROWS * widest]],
            pack: vec![0.0; ROWS * widest],
            widest,
            dims,
        })
    }

    /// The network's dimensions.
    pub fn dims(&self) -> &MlpDims {
        &self.dims
    }

    /// The greedy action for one observation (`state_dim` values); the scores (Q values or
    /// logits) stay readable through [`CpuPolicy::scores`] until the next call.
    pub fn act(&mut self, obs: &[f32]) -> Result<u32> {
        const CTX: &str = "CpuPolicy::act";
        if obs.len() != self.dims.input {
            return Err(Error::shape("obs", CTX, self.dims.input, obs.len()));
        }
        if let Some(i) = obs.iter().position(|v| !v.is_finite()) {
            return Err(Error::NonFinite { what: "obs", index: i, value: obs[i] as f64, context: CTX });
        }
        let [a, b] = &mut self.buf;
        let (mut cur, mut next) = (a, b);
        cur[..obs.len()].copy_from_slice(obs);
        let mut width = obs.len();
        for (layer, act) in &self.hidden {
            let out = layer.outputs;
            (self.layer)(layer, &cur[..width], &mut next[..out], *act);
            std::mem::swap(&mut cur, &mut next);
            width = out;
        }
        Ok(head_action(&self.head, self.dueling, self.dot, &cur[..width], &mut self.scores))
    }

    /// The last call's scores (`n_actions`).
    pub fn scores(&self) -> &[f32] {
        &self.scores
    }

    /// Greedy actions for `obs` rows (`rows × state_dim` values) into `actions` (`rows`),
    /// each row's the same (and its scores the same bits) as [`CpuPolicy::act`] gives; the
    /// hidden layers take six rows per pass over their weights.
    pub fn act_batch(&mut self, obs: &[f32], actions: &mut [u32]) -> Result<()> {
        self.act_batch_scores(obs, actions, None)
    }

    /// [`CpuPolicy::act_batch`], also writing each row's scores into `scores`
    /// (`rows × n_actions`) when given.
    pub fn act_batch_scores(&mut self, obs: &[f32], actions: &mut [u32], mut scores: Option<&mut [f32]>) -> Result<()> {
        const CTX: &str = "CpuPolicy::act_batch";
        let (d, na) = (self.dims.input.max(1), self.dims.n_actions);
        if obs.len() != actions.len() * d {
            return Err(Error::shape("obs", CTX, actions.len() * d, obs.len()));
        }
        if let Some(sc) = scores.as_deref() {
            if sc.len() != actions.len() * na {
                return Err(Error::shape("scores", CTX, actions.len() * na, sc.len()));
            }
        }
        if let Some(i) = obs.iter().position(|v| !v.is_finite()) {
            return Err(Error::NonFinite { what: "obs", index: i, value: obs[i] as f64, context: CTX });
        }
        let (full, w) = (actions.len() / ROWS * ROWS, self.widest);
        for (g, (rows, acts)) in obs[..full * d].chunks_exact(ROWS * d).zip(actions.chunks_exact_mut(ROWS)).enumerate()
        {
            let [a, b] = &mut self.batch_buf;
            let (mut cur, mut next) = (a, b);
            for (r, x) in rows.chunks_exact(d).enumerate() {
                cur[r * w..r * w + d].copy_from_slice(x);
            }
            for (layer, act) in &self.hidden {
                (self.rows)(layer, cur, next, w, *act, &mut self.pack);
                std::mem::swap(&mut cur, &mut next);
            }
            let width = self.hidden.last().map_or(d, |(l, _)| l.outputs);
            for (r, a) in acts.iter_mut().enumerate() {
                *a = head_action(&self.head, self.dueling, self.dot, &cur[r * w..r * w + width], &mut self.scores);
                if let Some(sc) = scores.as_deref_mut() {
                    let at = (g * ROWS + r) * na;
                    sc[at..at + na].copy_from_slice(&self.scores);
                }
            }
        }
        // The last rows (fewer than ROWS) one at a time.
        for (i, (row, a)) in obs[full * d..].chunks_exact(d).zip(actions[full..].iter_mut()).enumerate() {
            *a = self.act(row)?;
            if let Some(sc) = scores.as_deref_mut() {
                let at = (full + i) * na;
                sc[at..at + na].copy_from_slice(&self.scores);
            }
        }
        Ok(())
    }
}

/// The head on the last hidden layer's output `z` into `scores`, and the greedy action (the
/// first maximum wins, as `mlp_ref::first_argmax`: candle's and torch's argmax).
fn head_action(head: &[Dense], dueling: bool, dot: fn(&[f32], &[f32]) -> f32, z: &[f32], scores: &mut [f32]) -> u32 {
    if dueling {
        let mut v = [0.0f32];
        head[0].apply(dot, z, &mut v);
        head[1].apply(dot, z, scores);
        let mean = scores.iter().sum::<f32>() / scores.len() as f32;
        for s in scores.iter_mut() {
            *s = (*s - mean) + v[0];
        }
    } else {
        head[0].apply(dot, z, scores);
    }
    let mut best = 0;
    for (j, &s) in scores.iter().enumerate().skip(1) {
        if s > scores[best] {
            best = j;
        }
    }
    best as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::cpu_dot::dot_portable;
    use crate::mlp::reference::{reference_greedy, Linear};

    fn t(shape: &[usize], seed: u64, scale: f64) -> Tensor {
        let n: usize = shape.iter().product();
        let v: Vec<f32> =
            (0..n as u64).map(|i| ((fx_kernels::rng::draw(seed, 9, 0, i) * 2.0 - 1.0) * scale) as f32).collect();
        Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
    }

    /// A random policy network's tensors (`t`'s draws from seed `s`): hidden layers of
    /// `widths` with `act`, then a dueling head of 3 actions or a logits head of 4.
    struct Case {
        layers: Vec<(Tensor, Tensor)>,
        value: (Tensor, Tensor),
        advantage: (Tensor, Tensor),
        act: Activation,
        dueling: bool,
        na: usize,
    }

    impl Case {
        fn new(widths: &[usize], dueling: bool, act: Activation, s: u64) -> Self {
            let na = if dueling { 3 } else { 4 };
            let layers = widths
                .windows(2)
                .enumerate()
                .map(|(i, w)| (t(&[w[1], w[0]], s + 2 * i as u64, 0.2), t(&[w[1]], s + 2 * i as u64 + 1, 0.1)))
                .collect();
            let last = *widths.last().unwrap();
            let value = (t(&[1, last], s + 50, 0.2), t(&[1], s + 51, 0.1));
            let advantage = (t(&[na, last], s + 52, 0.2), t(&[na], s + 53, 0.1));
            Self { layers, value, advantage, act, dueling, na }
        }

        fn hidden(&self) -> Vec<(Linear<'_>, Activation)> {
            self.layers.iter().map(|(w, b)| (Linear { weight: w, bias: b }, self.act)).collect()
        }

        fn head(&self) -> Head<Linear<'_>> {
            let (v, a) = (&self.value, &self.advantage);
            if self.dueling {
                Head::Dueling {
                    value: Linear { weight: &v.0, bias: &v.1 },
                    advantage: Linear { weight: &a.0, bias: &a.1 },
                }
            } else {
                Head::Logits(Linear { weight: &a.0, bias: &a.1 })
            }
        }
    }

    /// Batches (whole groups of six rows and remainders, every layer kernel this CPU runs)
    /// give each row exactly its single decision's action and scores, on fresh random networks
    /// of both heads and odd widths.
    #[test]
    fn batches_give_the_single_decisions_bits() {
        let seed = fx_hw::test_seed(concat!(module_path!(), ":", line!()));
        for (case, (widths, dueling, act)) in [
            (vec![56usize, 256, 256, 128], true, Activation::Relu),
            (vec![56, 256, 256], false, Activation::Tanh),
            (vec![13, 7, 33], true, Activation::Relu),
            (vec![9, 45], false, Activation::Tanh),
            (vec![5], false, Activation::Identity),
        ]
        .into_iter()
        .enumerate()
        {
            let s = seed.wrapping_add(100 * case as u64);
            let c = Case::new(&widths, dueling, act, s);
            let hidden = c.hidden();
            let net = GreedyMlp { hidden: &hidden, head: c.head() };
            let (rows, d, na) = (23, widths[0], c.na);
            let obs: Vec<f32> = t(&[rows, d], s + 99, 2.0).flatten_all().unwrap().to_vec1().unwrap();
            let mut p = CpuPolicy::new(&net).unwrap();
            // The portable batch kernel and this CPU's.
            for k in [column_layer_rows_portable as RowsFn, pick_layer().1] {
                p.rows = k;
                let (mut acts, mut scores) = (vec![u32::MAX; rows], vec![f32::NAN; rows * na]);
                p.act_batch_scores(&obs, &mut acts, Some(&mut scores)).unwrap();
                for (r, x) in obs.chunks_exact(d).enumerate() {
                    let a = p.act(x).unwrap();
                    assert_eq!(acts[r], a, "case {case} row {r} (seed {s})");
                    let got = &scores[r * na..(r + 1) * na];
                    let same = p.scores().iter().zip(got).all(|(x, y)| x.to_bits() == y.to_bits());
                    assert!(same, "case {case} row {r}: {:?} vs {got:?} (seed {s})", p.scores());
                }
            }
            let mut acts = vec![0u32; 2];
            assert!(p.act_batch_scores(&obs[..2 * d], &mut acts, Some(&mut [0.0; 5])).is_err());
            let mut bad = obs[..2 * d].to_vec();
            bad[d - 1] = f32::NAN;
            assert!(p.act_batch(&bad, &mut acts).unwrap_err().to_string().contains("non-finite"));
        }
    }

    /// Fresh random networks (both heads, default and odd widths) and observations: the
    /// scores equal the f64 reference within 1e-5 relative, and the actions equal its
    /// actions except where the two best scores are closer than that.
    #[test]
    fn matches_the_f64_reference() {
        let seed = fx_hw::test_seed(concat!(module_path!(), ":", line!()));
        for (case, (widths, dueling, act)) in [
            (vec![56usize, 256, 256, 128], true, Activation::Relu),
            (vec![56, 256, 256], false, Activation::Tanh),
            (vec![13, 7, 33], true, Activation::Relu),
            (vec![5], false, Activation::Identity),
        ]
        .into_iter()
        .enumerate()
        {
            let s = seed.wrapping_add(100 * case as u64);
            let c = Case::new(&widths, dueling, act, s);
            let (hidden, na) = (c.hidden(), c.na);
            let net = GreedyMlp { hidden: &hidden, head: c.head() };
            let rows = 64;
            let obs = t(&[rows, widths[0]], s + 99, 2.0);
            let (want_scores, want_actions) = reference_greedy(&net, &obs).unwrap();
            let mut p = CpuPolicy::new(&net).unwrap();
            let host: Vec<f32> = obs.flatten_all().unwrap().to_vec1().unwrap();
            for r in 0..rows {
                let a = p.act(&host[r * widths[0]..(r + 1) * widths[0]]).unwrap();
                let want = &want_scores[r * na..(r + 1) * na];
                for (g, w) in p.scores().iter().zip(want) {
                    assert!((*g as f64 - w).abs() <= 1e-5 * (1.0 + w.abs()), "case {case} row {r}: {g} vs {w}");
                }
                let w = want_actions[r] as usize;
                let gap = (want[a as usize] - want[w]).abs();
                assert!(a as usize == w || gap <= 1e-5 * (1.0 + want[w].abs()), "case {case} row {r}: {a} vs {w}");
            }
            let mut batch = vec![u32::MAX; rows];
            p.act_batch(&host, &mut batch).unwrap();
            assert!(batch.iter().all(|&a| (a as usize) < na));
        }
    }

    /// Every layer kernel this CPU runs (AVX-512, AVX2, portable) gives the portable
    /// kernel's outputs bit for bit, on fresh random layers whose widths exercise every
    /// block size (128, 64, 32 and the 8-wide tail), for each activation.
    #[test]
    fn every_layer_kernel_equals_the_portable_one() {
        let seed = fx_hw::test_seed(concat!(module_path!(), ":", line!()));
        for (case, (inputs, outputs)) in
            [(56usize, 256usize), (256, 128), (17, 300), (3, 8), (64, 45)].into_iter().enumerate()
        {
            let s = seed.wrapping_add(10 * case as u64);
            let w: Vec<f32> = t(&[outputs, inputs], s, 0.3).flatten_all().unwrap().to_vec1().unwrap();
            let b: Vec<f32> = t(&[outputs], s + 1, 0.1).flatten_all().unwrap().to_vec1().unwrap();
            let x: Vec<f32> = t(&[inputs], s + 2, 2.0).flatten_all().unwrap().to_vec1().unwrap();
            let l = ColumnDense::from(&Dense { w, b, inputs });
            for act in [Activation::Identity, Activation::Relu, Activation::Tanh] {
                let mut want = vec![f32::NAN; outputs];
                column_layer_portable(&l, &x, &mut want, act);
                assert!(want.iter().all(|v| v.is_finite()));
                for (name, k, _) in layer_kernels() {
                    let mut got = vec![f32::NAN; outputs];
                    k(&l, &x, &mut got, act);
                    let (g, w): (Vec<u32>, Vec<u32>) =
                        (got.iter().map(|v| v.to_bits()).collect(), want.iter().map(|v| v.to_bits()).collect());
                    assert_eq!(g, w, "{name}, {inputs}x{outputs}, {act:?} (seed {s})");
                }
            }
        }
    }

    /// The run-time-chosen dot product (AVX2 + FMA here when present) and the portable one
    /// agree with an f64 sum on random vectors of every length class; `fast_tanh` stays
    /// within 2e-7 of `tanh` (absolute) over the range that matters.
    #[test]
    fn dot_paths_and_tanh_match_f64() {
        let dot = pick_dot();
        for n in [1usize, 7, 8, 31, 32, 56, 57, 256, 1000] {
            let a: Vec<f32> =
                (0..n as u64).map(|i| (fx_kernels::rng::draw(5, 1, n as u64, i) * 2.0 - 1.0) as f32).collect();
            let b: Vec<f32> =
                (0..n as u64).map(|i| (fx_kernels::rng::draw(5, 2, n as u64, i) * 2.0 - 1.0) as f32).collect();
            let want: f64 = a.iter().zip(&b).map(|(x, y)| *x as f64 * *y as f64).sum();
            let scale: f64 = a.iter().zip(&b).map(|(x, y)| (*x as f64 * *y as f64).abs()).sum::<f64>().max(1e-30);
            for got in [dot(&a, &b), dot_portable(&a, &b)] {
                assert!((got as f64 - want).abs() <= 1e-6 * scale, "n {n}: {got} vs {want}");
            }
        }
        for k in -4000..=4000 {
            let x = k as f32 * 0.005;
            let e = (fast_tanh(x) as f64 - (x as f64).tanh()).abs();
            assert!(e <= 2e-7, "tanh({x}): error {e}");
        }
        assert_eq!((fast_tanh(100.0), fast_tanh(-100.0), fast_tanh(0.0)), (1.0, -1.0, 0.0));
        assert_eq!((fast_tanh(f32::MAX), fast_tanh(f32::MIN)), (1.0, -1.0));
        // The exponential over the range the clamp allows: within 3e-7 relative of f64's.
        for k in -18_200..=18_200 {
            let x = k as f32 * 0.001;
            let e = (exp_f32(x) as f64 / (x as f64).exp() - 1.0).abs();
            assert!(e <= 3e-7, "exp({x}): relative error {e}");
        }
    }

    #[test]
    fn bad_observations_are_errors() {
        let (w, b) = (t(&[3, 4], 1, 1.0), t(&[3], 2, 1.0));
        let mut p =
            CpuPolicy::new(&GreedyMlp { hidden: &[], head: Head::Logits(Linear { weight: &w, bias: &b }) }).unwrap();
        assert!(p.act(&[0.0; 3]).unwrap_err().to_string().contains("obs"));
        assert!(p.act(&[0.0, f32::NAN, 0.0, 0.0]).unwrap_err().to_string().contains("non-finite"));
        let mut out = [0u32; 2];
        assert!(p.act_batch(&[0.0; 7], &mut out).is_err());
        let nan = Tensor::new(&[f32::NAN, 0.0, 0.0, 0.0], &Device::Cpu).unwrap().reshape((1, 4)).unwrap();
        let b1 = t(&[1], 3, 1.0);
        assert!(
            CpuPolicy::new(&GreedyMlp { hidden: &[], head: Head::Logits(Linear { weight: &nan, bias: &b1 }) }).is_err()
        );
    }
}

#[cfg(test)]
mod timing {
    use super::*;
    use crate::mlp::reference::Linear;

    /// Prints µs per DQN-sized decision (not a timed assertion: `--ignored --nocapture`).
    #[test]
    #[ignore = "timing printout; run with --ignored --nocapture in release"]
    fn dqn_sized_decision_time() {
        let t = |shape: &[usize]| Tensor::ones(shape, DType::F32, &Device::Cpu).unwrap().affine(0.01, 0.0).unwrap();
        let l: Vec<(Tensor, Tensor)> =
            [(56, 256), (256, 256), (256, 128)].iter().map(|&(i, o)| (t(&[o, i]), t(&[o]))).collect();
        let (v, a) = ((t(&[1, 128]), t(&[1])), (t(&[3, 128]), t(&[3])));
        let hidden: Vec<_> = l.iter().map(|(w, b)| (Linear { weight: w, bias: b }, Activation::Relu)).collect();
        let net = GreedyMlp {
            hidden: &hidden,
            head: Head::Dueling {
                value: Linear { weight: &v.0, bias: &v.1 },
                advantage: Linear { weight: &a.0, bias: &a.1 },
            },
        };
        let mut p = CpuPolicy::new(&net).unwrap();
        let obs = vec![0.5f32; 56];
        for _ in 0..2000 {
            p.act(&obs).unwrap();
        }
        let t0 = std::time::Instant::now();
        let n = 20000;
        for _ in 0..n {
            std::hint::black_box(p.act(std::hint::black_box(&obs)).unwrap());
        }
        eprintln!("dqn-sized decision: {:.2} us", t0.elapsed().as_secs_f64() * 1e6 / n as f64);
    }
}
