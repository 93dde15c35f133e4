//! The INT8 TFT: every weight matrix (the Linears of the variable selection networks and
//! GRNs, the LSTMs' input and recurrent matrices, the attention projections, the head) in
//! per-row INT8 with per-matrix input scales; embeddings, biases, norms, the attention
//! scores, the LSTM cell and every activation stay F32.
//!
//! It runs the model's own forecast code, `fx_models::tft::forecast::TftForecaster` (the
//! fused step's forward written once over a backend), on [`MatrixHooked`]: a backend (the
//! CPU reference, or CUDA) with some of its work taken over by a [`MatrixHook`], found by the
//! weights' addresses. Three hooks:
//! - calibration ([`quantize_tft`], CPU): runs everything in F32 and records each matrix's
//!   inputs ([`crate::calibrate`]'s statistics, per part);
//! - INT8 ([`Int8Tft`], CPU): quantises each GEMM row's input (the part's static scale, or
//!   each row's own `max |x| / 127` under `dynamic`) and runs the exact integer products of
//!   [`crate::Int8Policy`]'s layers, eight rows at a time on AVX-512 VNNI, 32 on AMX;
//! - the variable selection networks whole (`crate::tft_vsn::VsnHook`, for `CudaInt8Tft`
//!   on the GPU and its CPU reference).
//!
//! A stacked parameter (the 55 per-variable GRNs' `fc1` as `[55, d, d]`, the attention
//! heads' `q`) is quantised part by part under each part's spec name.

use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap};

use candle_core::{Device, Tensor};
use fx_kernels::gemm::{Gemm, GemmInputs};
use fx_models::tft::forecast::TftForecaster;
use fx_models::tft::ops::{
    lstm_cell_step, Addr, Attn, AttnGrads, BiasAct, CpuTft, Embed, EmbedGrads, GluLn, GluLnGrads, Lstm, LstmGrads,
    Pack, Pinball, TftBackend, TftKernels, VsnForecast, VsnMix, VsnMixGrads,
};
use fx_models::{Tft, TftConfig};

use crate::calibrate::{CalibMethod, InputStats};
use crate::error::{Error, Result};
use crate::float_net::FloatLayer;
use crate::gemv_i8::{Gemv, Isa, VerticalWeights};
use crate::policy::{dense_rows, pass_rows, Act, Packed, TILES_FROM_ROWS};
use crate::qnet::{CalibInfo, PackedLinear, QuantLinear};

/// Percentile calibration keeps at most this many `|x|` per part (1 MiB), thinned evenly.
const PERCENTILE_SAMPLE: usize = 1 << 18;

/// A quantised TFT: what the INT8 file holds.
#[derive(Debug, Clone, PartialEq)]
pub struct QuantTft {
    /// The model's dimensions.
    pub config: TftConfig,
    /// One INT8 matrix per part of every weight matrix (`Tft::weight_matrices`), named by
    /// the spec (`enc_vsn.vars.3.fc1.weight`, `lstm_enc.weight_hh_l0`), in that order. Their
    /// `bias` is empty: the model's biases are F32 parameters in `floats`.
    pub matrices: Vec<QuantLinear>,
    /// Every other parameter in F32: (spec name, shape, values).
    pub floats: Vec<(String, Vec<usize>, Vec<f32>)>,
    /// How the input scales were found (`dynamic`: each GEMM row's own).
    pub calibration: CalibInfo,
}

impl QuantTft {
    /// Whether the inputs take each row's own scale.
    pub fn dynamic_inputs(&self) -> bool {
        self.calibration.method == crate::calibrate::DYNAMIC
    }

    /// Bytes of the parameters: INT8 weights with their two scales per row and matrix, and
    /// the F32 parameters.
    pub fn bytes(&self) -> usize {
        let q: usize = self.matrices.iter().map(|m| m.weight.len() + 4 * (m.weight_scale.len() + 1)).sum();
        q + self.floats.iter().map(|(_, _, v)| 4 * v.len()).sum::<usize>()
    }

    /// Checks shapes, ranges and scales (one line naming the tensor).
    pub fn check(&self) -> Result<()> {
        for m in &self.matrices {
            let bad = |message: String| Err(Error::invalid("INT8 TFT matrix", format!("{}: {message}", m.name)));
            if m.out == 0 || m.inp == 0 || m.weight.len() != m.out * m.inp || m.weight_scale.len() != m.out {
                return bad(format!(
                    "{} weights and {} scales for [{}, {}]",
                    m.weight.len(),
                    m.weight_scale.len(),
                    m.out,
                    m.inp
                ));
            }
            if m.weight.contains(&i8::MIN) {
                return bad("a weight of -128 (range is ±127)".into());
            }
            if let Some(s) = m.weight_scale.iter().chain([&m.input_scale]).find(|s| !(s.is_finite() && **s > 0.0)) {
                return bad(format!("the scale {s} (must be finite and > 0)"));
            }
        }
        for (name, shape, v) in &self.floats {
            if shape.iter().product::<usize>() != v.len() {
                return Err(Error::invalid("F32 parameter", format!("{name}: {} values for {shape:?}", v.len())));
            }
            if let Some(i) = v.iter().position(|x| !x.is_finite()) {
                return Err(Error::invalid("F32 parameter", format!("{name}: the non-finite value {} at {i}", v[i])));
            }
        }
        Ok(())
    }

    /// The F32 model these parameters describe, its weight matrices dequantised
    /// (`w_q · w_scale`): the INT8 forecaster's own (its F32 parameters, and the weights'
    /// addresses), and a fake-quantised reference.
    pub fn dequantized(&self) -> Result<Tft> {
        self.dequantized_on(&Device::Cpu)
    }

    /// [`Self::dequantized`] on `device`.
    pub fn dequantized_on(&self, device: &Device) -> Result<Tft> {
        const CTX: &str = "QuantTft::dequantized";
        let model = Tft::new(self.config.clone(), device, 0).map_err(|source| Error::Model { context: CTX, source })?;
        let mut map = HashMap::new();
        let cand = |e: candle_core::Error| candle_err(CTX, e);
        for m in &self.matrices {
            let w: Vec<f32> = m
                .weight
                .chunks_exact(m.inp)
                .zip(&m.weight_scale)
                .flat_map(|(row, &s)| row.iter().map(move |&q| f32::from(q) * s))
                .collect();
            map.insert(m.name.clone(), Tensor::from_vec(w, (m.out, m.inp), &Device::Cpu).map_err(cand)?);
        }
        for (name, shape, v) in &self.floats {
            map.insert(name.clone(), Tensor::from_vec(v.clone(), shape.as_slice(), &Device::Cpu).map_err(cand)?);
        }
        model.params().load_map(&map, "the INT8 TFT").map_err(|source| Error::Model { context: CTX, source })?;
        Ok(model)
    }
}

/// What a backend hook takes over from its inner backend `B`: the weight GEMMs, the LSTM's
/// recurrent product, a variable selection network's whole forecast forward.
pub(crate) trait MatrixHook<B> {
    /// Runs `g` if its `B` operand is a weight this hook knows (returns true), else
    /// nothing (false: the inner backend runs it).
    ///
    /// # Safety
    /// As [`TftKernels::gemm`].
    unsafe fn gemm(&self, inner: &B, g: &Gemm) -> Result<bool>;
    /// Runs LSTM step `t` if it knows the step's recurrent matrix (true), else nothing.
    ///
    /// # Safety
    /// As [`TftKernels::lstm_fwd_step`].
    unsafe fn lstm_fwd_step(&self, inner: &B, a: &Lstm, t: usize) -> Result<bool>;
    /// Runs a variable selection network's forecast forward if it has its own (true); by
    /// default none.
    ///
    /// # Safety
    /// As [`TftKernels::vsn_forecast`].
    unsafe fn vsn_forecast(&self, inner: &B, a: &VsnForecast) -> Result<bool> {
        let _ = (inner, a);
        Ok(false)
    }
}

/// A backend (the CPU reference, or CUDA) with a [`MatrixHook`]; see the module docs.
#[derive(Debug)]
pub(crate) struct MatrixHooked<B, H> {
    pub(crate) inner: B,
    pub(crate) hook: H,
}

impl<B, H> MatrixHooked<B, H> {
    /// The hook (e.g. to read what it recorded).
    pub(crate) fn hook(&self) -> &H {
        &self.hook
    }
}

fn kerr(context: &'static str) -> impl Fn(Error) -> fx_kernels::Error {
    move |e| fx_kernels::Error::Config { context, message: e.to_string() }
}

// Everything but the hooked three delegates to the inner backend.
#[allow(clippy::missing_safety_doc)]
impl<B: TftBackend, H: MatrixHook<B>> TftKernels for MatrixHooked<B, H> {
    unsafe fn gemm(&self, g: &Gemm) -> fx_kernels::Result<()> {
        if unsafe { self.hook.gemm(&self.inner, g) }.map_err(kerr("INT8 TFT GEMM"))? {
            return Ok(());
        }
        unsafe { self.inner.gemm(g) }
    }
    unsafe fn zero(&self, a: Addr, n: usize) -> fx_kernels::Result<()> {
        unsafe { self.inner.zero(a, n) }
    }
    unsafe fn copy(&self, dst: Addr, src: Addr, n: usize) -> fx_kernels::Result<()> {
        unsafe { self.inner.copy(dst, src, n) }
    }
    unsafe fn cast_bf16(&self, src: Addr, dst: Addr, n: usize) -> fx_kernels::Result<()> {
        unsafe { self.inner.cast_bf16(src, dst, n) }
    }
    unsafe fn pack(&self, a: &Pack) -> fx_kernels::Result<()> {
        unsafe { self.inner.pack(a) }
    }
    unsafe fn embed_fwd(&self, a: &Embed) -> fx_kernels::Result<()> {
        unsafe { self.inner.embed_fwd(a) }
    }
    unsafe fn embed_bwd(&self, a: &Embed, g: &EmbedGrads) -> fx_kernels::Result<()> {
        unsafe { self.inner.embed_bwd(a, g) }
    }
    unsafe fn bias_act(&self, a: &BiasAct) -> fx_kernels::Result<()> {
        unsafe { self.inner.bias_act(a) }
    }
    unsafe fn act_bwd(&self, a: &BiasAct, grad: Addr) -> fx_kernels::Result<()> {
        unsafe { self.inner.act_bwd(a, grad) }
    }
    unsafe fn glu_ln_fwd(&self, a: &GluLn) -> fx_kernels::Result<()> {
        unsafe { self.inner.glu_ln_fwd(a) }
    }
    unsafe fn glu_ln_bwd(&self, a: &GluLn, g: &GluLnGrads) -> fx_kernels::Result<()> {
        unsafe { self.inner.glu_ln_bwd(a, g) }
    }
    unsafe fn vsn_mix_fwd(&self, a: &VsnMix) -> fx_kernels::Result<()> {
        unsafe { self.inner.vsn_mix_fwd(a) }
    }
    unsafe fn vsn_mix_bwd(&self, a: &VsnMix, g: &VsnMixGrads) -> fx_kernels::Result<()> {
        unsafe { self.inner.vsn_mix_bwd(a, g) }
    }
    unsafe fn lstm_fwd_step(&self, a: &Lstm, t: usize) -> fx_kernels::Result<()> {
        if unsafe { self.hook.lstm_fwd_step(&self.inner, a, t) }.map_err(kerr("INT8 TFT LSTM"))? {
            return Ok(());
        }
        unsafe { self.inner.lstm_fwd_step(a, t) }
    }
    unsafe fn lstm_bwd_step(&self, a: &Lstm, g: &LstmGrads, t: usize) -> fx_kernels::Result<()> {
        unsafe { self.inner.lstm_bwd_step(a, g, t) }
    }
    unsafe fn attn_fwd(&self, a: &Attn) -> fx_kernels::Result<()> {
        unsafe { self.inner.attn_fwd(a) }
    }
    unsafe fn attn_bwd(&self, a: &Attn, g: &AttnGrads) -> fx_kernels::Result<()> {
        unsafe { self.inner.attn_bwd(a, g) }
    }
    unsafe fn pinball(&self, a: &Pinball) -> fx_kernels::Result<()> {
        unsafe { self.inner.pinball(a) }
    }
    unsafe fn vsn_forecast(&self, a: &VsnForecast) -> fx_kernels::Result<bool> {
        if unsafe { self.hook.vsn_forecast(&self.inner, a) }.map_err(kerr("INT8 TFT variable selection"))? {
            return Ok(true);
        }
        unsafe { self.inner.vsn_forecast(a) }
    }
}

impl<B: TftBackend, H: MatrixHook<B>> TftBackend for MatrixHooked<B, H> {
    fn alloc(&mut self, n: usize) -> fx_kernels::Result<Addr> {
        self.inner.alloc(n)
    }
    fn addr_of(&self, t: &Tensor, what: &'static str) -> fx_kernels::Result<Addr> {
        self.inner.addr_of(t, what)
    }
    fn tensor_at(&self, a: Addr, shape: &[usize]) -> fx_kernels::Result<Tensor> {
        self.inner.tensor_at(a, shape)
    }
}

/// One weight matrix as the hooks see it: its address, parts (`parts × rows_per_part`
/// rows of `inp` values) and spec names.
#[derive(Debug, Clone)]
struct Matrix {
    var: candle_core::Var,
    names: Vec<String>,
    rows_per_part: usize,
    inp: usize,
}

/// `model`'s weight matrices, by address.
fn matrices(model: &Tft) -> Result<(Vec<Matrix>, HashMap<Addr, usize>)> {
    let cpu = CpuTft::new();
    let mut list = Vec::new();
    let mut by_addr = HashMap::new();
    for var in model.weight_matrices() {
        let names = model
            .params()
            .part_names(var)
            .ok_or_else(|| Error::invalid("TFT weight", "a matrix outside the model's parameters"))?;
        let dims = var.dims();
        let (parts, out, inp) = match *dims {
            [o, i] => (1, o, i),
            [p, o, i] => (p, o, i),
            _ => return Err(Error::invalid("TFT weight", format!("{names:?} has shape {dims:?}"))),
        };
        if parts != names.len() {
            return Err(Error::invalid("TFT weight", format!("{} names for {parts} parts", names.len())));
        }
        let addr = cpu.addr_of(var.as_tensor(), "weight").map_err(Error::Kernels)?;
        by_addr.insert(addr, list.len());
        list.push(Matrix { var: var.clone(), names, rows_per_part: out, inp });
    }
    Ok((list, by_addr))
}

/// The parts a weight GEMM's batch entry `j` covers, as (first part, number of parts): one
/// GEMM entry may span several parts (the attention heads), or be one part (a variable's GRN).
fn entry_parts(m: &Matrix, g: &Gemm, j: usize) -> Result<(usize, usize)> {
    let off = j * g.stride_b as usize;
    if !off.is_multiple_of(m.inp) || g.k != m.inp || g.ldb != m.inp {
        return Err(Error::invalid(
            "weight GEMM",
            format!("{}: entry {j} at {off}, k {} ldb {}", m.names[0], g.k, g.ldb),
        ));
    }
    let row0 = off / m.inp;
    if !row0.is_multiple_of(m.rows_per_part) || !g.n.is_multiple_of(m.rows_per_part) {
        return Err(Error::invalid("weight GEMM", format!("{}: rows {row0}.. +{} split a part", m.names[0], g.n)));
    }
    let (p0, np) = (row0 / m.rows_per_part, g.n / m.rows_per_part);
    if np == 0 || p0 + np > m.names.len() {
        return Err(Error::invalid("weight GEMM", format!("{}: parts {p0}.. +{np} of {}", m.names[0], m.names.len())));
    }
    Ok((p0, np))
}

/// Checks a GEMM is a forward `y = x · Wᵀ` the hooks can take over.
fn check_forward(g: &Gemm) -> Result<()> {
    let ok = !g.ta
        && g.tb
        && g.alpha == 1.0
        && g.beta == 0.0
        && g.inputs == GemmInputs::F32
        && g.batch >= 1
        && g.m >= 1
        && g.stride_a >= 0
        && g.stride_b >= 0
        && g.stride_c >= 0
        && g.lda >= g.k
        && g.ldc >= g.n;
    if ok {
        Ok(())
    } else {
        Err(Error::invalid("weight GEMM", format!("not a forward x · Wᵀ in F32: {g:?}")))
    }
}

/// The calibration hook: F32 products, and every matrix part's input statistics.
#[derive(Debug)]
pub(crate) struct CalibrationHook {
    list: Vec<Matrix>,
    by_addr: HashMap<Addr, usize>,
    stats: RefCell<Vec<Vec<InputStats>>>,
}

impl CalibrationHook {
    fn new(model: &Tft, method: CalibMethod) -> Result<Self> {
        let (list, by_addr) = matrices(model)?;
        let stats = list
            .iter()
            .map(|m| m.names.iter().map(|_| InputStats::new(method, Some(PERCENTILE_SAMPLE))).collect())
            .collect();
        Ok(Self { list, by_addr, stats: RefCell::new(stats) })
    }
}

impl MatrixHook<CpuTft> for CalibrationHook {
    unsafe fn gemm(&self, _cpu: &CpuTft, g: &Gemm) -> Result<bool> {
        let Some(&idx) = self.by_addr.get(&g.b) else { return Ok(false) };
        check_forward(g)?;
        let m = &self.list[idx];
        let mut stats = self.stats.borrow_mut();
        for j in 0..g.batch {
            let (p0, np) = entry_parts(m, g, j)?;
            let a = g.a as usize + 4 * j * g.stride_a as usize;
            for r in 0..g.m {
                // SAFETY: the GEMM's A operand: row r of entry j, k values.
                let row = unsafe { std::slice::from_raw_parts((a + 4 * r * g.lda) as *const f32, g.k) };
                for s in &mut stats[idx][p0..p0 + np] {
                    s.observe_row(row);
                }
            }
        }
        drop(stats);
        // The F32 product through candle's CPU matmul (threaded, vectorised, F32
        // accumulation) rather than the reference backend's scalar f64 loops, which are
        // written for clarity: the calibration pass runs the whole model over hundreds of
        // windows.
        let cand = |e| candle_err("calibration GEMM", e);
        for j in 0..g.batch {
            let a = g.a as usize + 4 * j * g.stride_a as usize;
            let w = g.b as usize + 4 * j * g.stride_b as usize;
            let c = g.c as usize + 4 * j * g.stride_c as usize;
            let mut x = Vec::with_capacity(g.m * g.k);
            for r in 0..g.m {
                // SAFETY: row r of entry j's A, and entry j's B (n rows of k), as above.
                x.extend_from_slice(unsafe { std::slice::from_raw_parts((a + 4 * r * g.lda) as *const f32, g.k) });
            }
            let wv = unsafe { std::slice::from_raw_parts(w as *const f32, g.n * g.k) };
            let x = Tensor::from_vec(x, (g.m, g.k), &Device::Cpu).map_err(cand)?;
            let wt = Tensor::from_slice(wv, (g.n, g.k), &Device::Cpu).map_err(cand)?;
            let y: Vec<f32> = x
                .matmul(&wt.t().map_err(cand)?)
                .and_then(|y| y.flatten_all())
                .and_then(|y| y.to_vec1())
                .map_err(cand)?;
            for (r, row) in y.chunks_exact(g.n).enumerate() {
                // SAFETY: row r of entry j's C (n values, ldc apart).
                let dst = unsafe { std::slice::from_raw_parts_mut((c + 4 * r * g.ldc) as *mut f32, g.n) };
                dst.copy_from_slice(row);
            }
        }
        Ok(true)
    }

    unsafe fn lstm_fwd_step(&self, cpu: &CpuTft, a: &Lstm, t: usize) -> Result<bool> {
        let seg = usize::from(t >= a.l_enc);
        let Some(&idx) = self.by_addr.get(&a.w_hh[seg]) else { return Ok(false) };
        if t > 0 {
            // SAFETY: h of step t − 1: B rows of d values.
            let h = unsafe {
                std::slice::from_raw_parts((a.h as usize + 4 * (t - 1) * a.batch * a.d) as *const f32, a.batch * a.d)
            };
            for row in h.chunks_exact(a.d) {
                self.stats.borrow_mut()[idx][0].observe_row(row);
            }
        }
        unsafe { cpu.lstm_fwd_step(a, t) }.map_err(Error::Kernels)?;
        Ok(true)
    }
}

/// Quantises `model` with input scales from its forward over `windows` (pairs of
/// `observed [B, L_enc, n_observed]`, `known [B, L_enc + H, n_known]` on the CPU, the same
/// `B` ≥ 1 for all, at least one pair): the training split's windows. The method is checked
/// (a percentile in `(0, 100]`).
pub fn quantize_tft(model: &Tft, windows: &[(Tensor, Tensor)], method: CalibMethod) -> Result<QuantTft> {
    const CTX: &str = "quantize_tft";
    if model.config().n_instruments > 0 {
        return Err(Error::invalid(
            "model",
            "a panel TFT (static context of its instruments) has no INT8 version; quantise a single-instrument model",
        ));
    }
    let Some((first, _)) = windows.first() else {
        return Err(Error::invalid("calibration windows", "none given"));
    };
    method.check()?;
    let batch = first.dims().first().copied().unwrap_or(0);
    // One batch for every window: a smaller one would be padded with zero windows, whose
    // activations would count as calibration inputs.
    if let Some((o, _)) = windows.iter().find(|(o, _)| o.dims().first() != Some(&batch)) {
        return Err(Error::invalid(
            "calibration windows",
            format!("batches of {batch} and {:?} windows (one size for all)", o.dims().first()),
        ));
    }
    let hooked = MatrixHooked { inner: CpuTft::new(), hook: CalibrationHook::new(model, method)? };
    let f = TftForecaster::new(hooked, model, batch.max(1)).map_err(|source| Error::Model { context: CTX, source })?;
    let mut rows = 0;
    for (obs, known) in windows {
        check_finite(obs, "calibration observed")?;
        check_finite(known, "calibration known")?;
        f.forecast(obs, known).map_err(|source| Error::Model { context: CTX, source })?;
        rows += obs.dims().first().copied().unwrap_or(0);
    }
    let hook = f.backend().hook();
    let mut stats = hook.stats.borrow_mut();
    let mut matrices = Vec::new();
    let mut quantised = std::collections::HashSet::new();
    for (m, st) in hook.list.iter().zip(stats.iter_mut()) {
        let w: Vec<f32> = m.var.as_tensor().flatten_all().and_then(|t| t.to_vec1()).map_err(|e| candle_err(CTX, e))?;
        let part = m.rows_per_part * m.inp;
        for ((name, s), wp) in m.names.iter().zip(st.iter_mut()).zip(w.chunks_exact(part)) {
            let f = FloatLayer {
                name: name.clone(),
                out: m.rows_per_part,
                inp: m.inp,
                weight: wp.to_vec(),
                bias: Vec::new(),
            };
            matrices.push(QuantLinear::from_f32(&f, s.scale(method)?));
            quantised.insert(name.clone());
        }
    }
    let mut floats = Vec::new();
    let map = model.params().to_map().map_err(|source| Error::Model { context: CTX, source })?;
    for (name, t) in map {
        if !quantised.contains(&name) {
            let v: Vec<f32> = t.flatten_all().and_then(|t| t.to_vec1()).map_err(|e| candle_err(CTX, e))?;
            floats.push((name, t.dims().to_vec(), v));
        }
    }
    let calibration = CalibInfo {
        method: method.name().to_string(),
        percentile: match method {
            CalibMethod::Percentile(p) => Some(p),
            _ => None,
        },
        rows,
        decision_margin: None,
    };
    let q = QuantTft { config: model.config().clone(), matrices, floats, calibration };
    q.check()?;
    Ok(q)
}

fn candle_err(context: &str, e: candle_core::Error) -> Error {
    Error::Candle { context: context.to_string(), source: e }
}

fn check_finite(t: &Tensor, what: &'static str) -> Result<()> {
    let v: Vec<f32> = t.flatten_all().and_then(|t| t.to_vec1()).map_err(|e| candle_err(what, e))?;
    match crate::error::first_non_finite(&v) {
        Some((index, value)) => {
            Err(Error::NonFinite { what: what.into(), index, value: f64::from(value), context: "INT8 TFT" })
        }
        None => Ok(()),
    }
}

/// One part packed for the kernels (zero bias: the model adds its F32 bias after the GEMM).
#[derive(Debug, Clone)]
struct PackedPart {
    layer: Packed,
}

/// The INT8 hook: every matrix part packed, and scratch for one batch pass (`pass_rows`: 8 rows, 32 on AMX).
#[derive(Debug)]
pub(crate) struct Int8Hook {
    list: Vec<Matrix>,
    by_addr: HashMap<Addr, usize>,
    parts: Vec<Vec<PackedPart>>,
    gemv: Gemv,
    scratch: RefCell<(Vec<i8>, Vec<i32>, Vec<f32>)>,
    /// Products run per matrix part (a test checks that every part runs in INT8).
    hits: RefCell<Vec<Vec<u64>>>,
    /// Row pitches of the scratch: padded inputs, outputs.
    wq: usize,
    wa: usize,
}

impl Int8Hook {
    fn new(q: &QuantTft, model: &Tft, isa: Isa) -> Result<Self> {
        let gemv = Gemv::new(isa)
            .ok_or_else(|| Error::invalid("ISA", format!("{} is not available on this CPU", isa.name())))?;
        let (list, by_addr) = matrices(model)?;
        let by_name: BTreeMap<&str, &QuantLinear> = q.matrices.iter().map(|m| (m.name.as_str(), m)).collect();
        let mut parts = Vec::new();
        let (mut wq, mut wa) = (0, 0);
        for m in &list {
            let mut v = Vec::new();
            for name in &m.names {
                let ql = by_name
                    .get(name.as_str())
                    .ok_or_else(|| Error::invalid("INT8 TFT", format!("no INT8 matrix {name}")))?;
                if (ql.out, ql.inp) != (m.rows_per_part, m.inp) {
                    return Err(Error::invalid(
                        "INT8 TFT",
                        format!("{name} is [{}, {}], the model's [{}, {}]", ql.out, ql.inp, m.rows_per_part, m.inp),
                    ));
                }
                let with_bias = QuantLinear { bias: vec![0.0; ql.out], ..(*ql).clone() };
                let p = PackedLinear::new(&with_bias, q.dynamic_inputs());
                let vert = gemv.has_vertical().then(|| VerticalWeights::new(&p.weight, p.stride, p.out)).flatten();
                wq = wq.max(p.stride);
                wa = wa.max(p.out);
                v.push(PackedPart { layer: Packed::Int8(p, vert) });
            }
            parts.push(v);
        }
        let pass = pass_rows(gemv);
        let scratch = RefCell::new((vec![0i8; pass * wq], vec![0i32; pass * wa], Vec::new()));
        let hits = RefCell::new(list.iter().map(|m| vec![0; m.names.len()]).collect());
        Ok(Self { list, by_addr, parts, gemv, scratch, hits, wq, wa })
    }

    /// `y[r, ..out] = x[r, ..inp] · Wᵀ` for `rows` rows of part `p` of matrix `idx`, `x` rows
    /// `lda` apart and `y` rows `ldc` apart.
    ///
    /// # Safety
    /// `x` and `y` address live host buffers of those shapes.
    #[allow(clippy::too_many_arguments)]
    unsafe fn part_rows(&self, idx: usize, p: usize, x: *const f32, lda: usize, y: *mut f32, ldc: usize, rows: usize) {
        self.hits.borrow_mut()[idx][p] += 1;
        let part = &self.parts[idx][p].layer;
        let (inp, out) = (self.list[idx].inp, self.list[idx].rows_per_part);
        let mut s = self.scratch.borrow_mut();
        let (xq, acc, _) = &mut *s;
        // The tiles configured only where a pass takes them (as Int8Policy::act_batch).
        let tiles = if rows >= TILES_FROM_ROWS { self.gemv.tiles() } else { None };
        let mut r = 0;
        while r < rows {
            let n = (rows - r).min(pass_rows(self.gemv));
            // SAFETY: n rows of x from row r (the last one `inp` long) and of y (`out` long).
            let xs = unsafe { std::slice::from_raw_parts(x.add(r * lda), (n - 1) * lda + inp) };
            let ys = unsafe { std::slice::from_raw_parts_mut(y.add(r * ldc), (n - 1) * ldc + out) };
            let mut amax = [None; crate::gemv_i8::TILE_ROWS];
            dense_rows(
                part,
                self.gemv,
                tiles.as_ref(),
                Act::Id,
                &mut amax,
                n,
                xs,
                lda,
                ys,
                ldc,
                xq,
                self.wq,
                acc,
                self.wa,
            );
            r += n;
        }
    }
}

impl MatrixHook<CpuTft> for Int8Hook {
    unsafe fn gemm(&self, _cpu: &CpuTft, g: &Gemm) -> Result<bool> {
        let Some(&idx) = self.by_addr.get(&g.b) else { return Ok(false) };
        check_forward(g)?;
        let m = &self.list[idx];
        for j in 0..g.batch {
            let (p0, np) = entry_parts(m, g, j)?;
            let a = (g.a as usize + 4 * j * g.stride_a as usize) as *const f32;
            let c = (g.c as usize + 4 * j * g.stride_c as usize) as *mut f32;
            for k in 0..np {
                // SAFETY: entry j's A (m rows, lda apart) and its C columns of part p0 + k.
                unsafe { self.part_rows(idx, p0 + k, a, g.lda, c.add(k * m.rows_per_part), g.ldc, g.m) };
            }
        }
        Ok(true)
    }

    unsafe fn lstm_fwd_step(&self, _cpu: &CpuTft, a: &Lstm, t: usize) -> Result<bool> {
        let seg = usize::from(t >= a.l_enc);
        let Some(&idx) = self.by_addr.get(&a.w_hh[seg]) else { return Ok(false) };
        let n = a.batch * 4 * a.d;
        let mut rec = std::mem::take(&mut self.scratch.borrow_mut().2);
        rec.resize(n, 0.0);
        if t > 0 {
            let h = (a.h as usize + 4 * (t - 1) * a.batch * a.d) as *const f32;
            // SAFETY: h of step t − 1 (B rows of d) and rec (B rows of 4d).
            unsafe { self.part_rows(idx, 0, h, a.d, rec.as_mut_ptr(), 4 * a.d, a.batch) };
        }
        // SAFETY: the step's buffers, as the CPU backend's own step uses them.
        unsafe { lstm_cell_step(a, t, &rec) };
        self.scratch.borrow_mut().2 = rec;
        Ok(true)
    }
}

/// INT8 TFT forecasts on the CPU, on the calling thread; see the module docs.
pub struct Int8Tft {
    forecaster: TftForecaster<MatrixHooked<CpuTft, Int8Hook>>,
    isa: Isa,
}

impl std::fmt::Debug for Int8Tft {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Int8Tft(batch {}, {})", self.forecaster.batch_size(), self.isa.name())
    }
}

impl Int8Tft {
    /// Forecasts of `q` for batches of up to `batch` windows on this CPU's best ISA.
    pub fn new(q: &QuantTft, batch: usize) -> Result<Self> {
        Self::with_isa(q, batch, Isa::detect())
    }

    /// The same on `isa` (tests, benchmarks); an ISA this CPU lacks is an error.
    pub fn with_isa(q: &QuantTft, batch: usize, isa: Isa) -> Result<Self> {
        q.check()?;
        let model = q.dequantized()?;
        let hooked = MatrixHooked { inner: CpuTft::new(), hook: Int8Hook::new(q, &model, isa)? };
        let forecaster = TftForecaster::new(hooked, &model, batch.max(1))
            .map_err(|source| Error::Model { context: "Int8Tft::new", source })?;
        Ok(Self { forecaster, isa })
    }

    /// The ISA of the INT8 products.
    pub fn isa(&self) -> Isa {
        self.isa
    }

    /// The largest batch a call takes.
    pub fn batch_size(&self) -> usize {
        self.forecaster.batch_size()
    }

    /// How many INT8 products each matrix part has run, by spec name.
    #[cfg(test)]
    fn hits(&self) -> Vec<(String, u64)> {
        let h = self.forecaster.backend().hook();
        let hits = h.hits.borrow();
        h.list.iter().zip(hits.iter()).flat_map(|(m, c)| m.names.iter().cloned().zip(c.iter().copied())).collect()
    }

    /// Quantile forecasts `[B, H, n_quantiles]` (F32, on the CPU) of `observed [B, L_enc,
    /// n_observed]` and `known [B, L_enc + H, n_known]` (CPU, `1 ≤ B ≤` the batch size).
    pub fn forecast(&self, observed: &Tensor, known: &Tensor) -> Result<Tensor> {
        check_finite(observed, "observed")?;
        check_finite(known, "known")?;
        self.forecaster
            .forecast(observed, known)
            .map_err(|source| Error::Model { context: "Int8Tft::forecast", source })
    }
}

/// INT8 TFT forecasts on the GPU: the variable selection networks' per-variable GRNs and
/// selection mix in INT8 as one kernel per network, the embeddings folded into the layers
/// after them (`crate::tft_vsn`); every other matrix is the file's INT8 weights dequantised
/// in the F32 forecaster's GEMMs. Inputs and forecasts stay on the device; nothing is read
/// back, so a call can be captured as a CUDA graph.
#[cfg(feature = "cuda")]
pub struct CudaInt8Tft {
    forecaster: TftForecaster<
        MatrixHooked<fx_models::tft::ops_cuda::CudaTft, crate::tft_vsn::VsnHook<fx_models::tft::int8_cuda::CudaVsnI8>>,
    >,
}

#[cfg(feature = "cuda")]
impl std::fmt::Debug for CudaInt8Tft {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CudaInt8Tft(batch {})", self.forecaster.batch_size())
    }
}

#[cfg(feature = "cuda")]
impl CudaInt8Tft {
    /// Forecasts of `q` on `device` (CUDA) for batches of up to `batch` windows; a width the
    /// INT8 kernel does not take (`d` a multiple of 4 up to 128) is a one-line error.
    pub fn new(q: &QuantTft, device: &Device, batch: usize) -> Result<Self> {
        const CTX: &str = "CudaInt8Tft::new";
        q.check()?;
        let batch = batch.max(1);
        let model = q.dequantized_on(device)?;
        let mut inner = fx_models::tft::ops_cuda::CudaTft::new(device).map_err(Error::Kernels)?;
        let hook = crate::tft_vsn::VsnHook::new(&mut inner, &model, q, batch, |w| {
            fx_models::tft::int8_cuda::CudaVsnI8::new(device, w).map_err(Error::Kernels)
        })?;
        let forecaster = TftForecaster::new(MatrixHooked { inner, hook }, &model, batch)
            .map_err(|source| Error::Model { context: CTX, source })?;
        Ok(Self { forecaster })
    }

    /// The largest batch a call takes.
    pub fn batch_size(&self) -> usize {
        self.forecaster.batch_size()
    }

    /// Quantile forecasts `[B, H, n_quantiles]` of `observed [B, L_enc, n_observed]` and
    /// `known [B, L_enc + H, n_known]` (F32 on the forecaster's device, `1 ≤ B ≤` the batch
    /// size). Not checked for non-finite values (that would read the inputs back).
    pub fn forecast(&self, observed: &Tensor, known: &Tensor) -> Result<Tensor> {
        self.forecaster
            .forecast(observed, known)
            .map_err(|source| Error::Model { context: "CudaInt8Tft::forecast", source })
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use fx_models::seq::{
        evaluate_forecasts, evaluate_forecasts_with, train, Forecasts, SeqSeries, SeqTask, SeqTrainConfig,
    };
    use fx_models::Ctx;
    use fx_precision::Precision;

    /// A fresh seed per run (printed by the tests), or `FX_TEST_SEED` to replay one.
    pub(crate) fn seed() -> u64 {
        fx_hw::test_seed(concat!(module_path!(), ":", line!()))
    }

    fn rand(shape: &[usize], seed: u64, stream: u64, scale: f64) -> Tensor {
        let n: usize = shape.iter().product();
        let v: Vec<f32> =
            (0..n as u64).map(|i| ((fx_kernels::rng::draw(seed, stream, 0, i) * 2.0 - 1.0) * scale) as f32).collect();
        Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
    }

    pub(crate) fn small() -> TftConfig {
        TftConfig { n_observed: 5, n_known: 2, d: 16, n_head: 2, l_enc: 8, h: 3, dropout: 0.1, ..TftConfig::default() }
    }

    pub(crate) fn windows(cfg: &TftConfig, b: usize, n: usize, seed: u64) -> Vec<(Tensor, Tensor)> {
        (0..n as u64)
            .map(|k| {
                (
                    rand(&[b, cfg.l_enc, cfg.n_observed], seed, 2 * k, 2.0),
                    rand(&[b, cfg.l_enc + cfg.h, cfg.n_known], seed, 2 * k + 1, 1.0),
                )
            })
            .collect()
    }

    pub(crate) fn values(t: &Tensor) -> Vec<f64> {
        t.flatten_all().unwrap().to_dtype(candle_core::DType::F64).unwrap().to_vec1().unwrap()
    }

    /// On fresh random models and inputs, for each calibration method: every ISA gives the
    /// same forecasts to the bit (the integer products are exact; the scalar ISA is the plain
    /// reference), they stay near the F32 model's (median relative RMS over five models under
    /// 25 %: a gross-error bound, see inside), every weight matrix is INT8 and the parameters
    /// are at least 2× smaller.
    #[test]
    fn int8_forecasts_agree_across_isas_and_track_f32() {
        let s = seed();
        let cfg = small();
        // The gross-error bound is on the median of five random models: an untrained random
        // TFT's sensitivity to rounding is heavy-tailed (a scan of model seeds 0..200, the test
        // window added to the calibration so nothing clipped: minmax 0.5 %–12 %; model 683 of seed
        // 1796344562424232250 lands 55 % from F32 with minmax, 56 % percentile, 29 % dynamic,
        // a 30× larger absolute difference for the same output scale), while a quantiser bug
        // (a wrong scale, part or layout) moves every model. The trained model's test below
        // holds the accuracy targets.
        let methods = [CalibMethod::MinMax, CalibMethod::Percentile(99.9), CalibMethod::Dynamic];
        let mut rels = vec![Vec::new(); methods.len()];
        for k in 0..5u64 {
            let s = s.wrapping_add(k.wrapping_mul(0x9e37_79b9_7f4a_7c15));
            let model = Tft::new(cfg.clone(), &Device::Cpu, s % 997).unwrap();
            let calib = windows(&cfg, 4, 3, s);
            let test = windows(&cfg, 3, 1, s ^ 0x55).remove(0);
            let want = values(&model.forward(&Ctx::inference(Precision::F32), &test.0, &test.1).unwrap());
            for (m, &method) in methods.iter().enumerate() {
                let q = quantize_tft(&model, &calib, method).unwrap();
                assert_eq!(q.calibration.rows, 12);
                let n_mats: usize =
                    model.weight_matrices().iter().map(|v| model.params().part_names(v).unwrap().len()).sum();
                assert_eq!(q.matrices.len(), n_mats);
                assert!(q.floats.iter().all(|(n, _, _)| !n.ends_with("fc1.weight") && !n.contains("weight_hh")));
                let f32_bytes = 4 * model.params().param_count();
                // Small models carry proportionally more F32 norms, biases and embeddings.
                assert!(q.bytes() * 2 < f32_bytes, "{} vs {f32_bytes}", q.bytes());
                let mut first: Option<Vec<f64>> = None;
                for isa in Isa::available() {
                    let f = Int8Tft::with_isa(&q, 3, isa).unwrap();
                    let got = values(&f.forecast(&test.0, &test.1).unwrap());
                    assert!(got.iter().all(|v| v.is_finite()));
                    match &first {
                        None => first = Some(got),
                        Some(v) => assert!(
                            v.iter().zip(&got).all(|(a, b)| a.to_bits() == b.to_bits()),
                            "{method} {isa:?} differs from the first ISA (seed {s})"
                        ),
                    }
                }
                let got = first.unwrap();
                let (mut d, mut n) = (0.0, 0.0);
                for (a, b) in got.iter().zip(&want) {
                    d += (a - b) * (a - b);
                    n += b * b;
                }
                let rel = (d / n).sqrt();
                assert!(rel.is_finite(), "{method}: relative RMS {rel} (seed {s})");
                eprintln!("INT8 TFT ({method}): relative RMS difference to F32 {rel:.4} (seed {s})");
                rels[m].push(rel);
            }
        }
        for (method, r) in methods.iter().zip(&mut rels) {
            r.sort_by(f64::total_cmp);
            assert!(r[2] < 0.25, "{method}: median relative RMS {} over {r:?} (seed {s})", r[2]);
        }
        let model = Tft::new(cfg.clone(), &Device::Cpu, s % 997).unwrap();
        let calib = windows(&cfg, 4, 3, s);
        let test = windows(&cfg, 3, 1, s ^ 0x55).remove(0);
        let q = quantize_tft(&model, &calib, CalibMethod::MinMax).unwrap();
        let f = Int8Tft::new(&q, 2).unwrap();
        // Every matrix part ran in INT8: each Linear once a forecast, the recurrent matrices
        // once a step after the first of their segment.
        f.forecast(&test.0.narrow(0, 0, 2).unwrap(), &test.1.narrow(0, 0, 2).unwrap()).unwrap();
        let hits = f.hits();
        assert_eq!(hits.len(), q.matrices.len());
        for (name, n) in hits {
            let want = match name.as_str() {
                "lstm_enc.weight_hh_l0" => cfg.l_enc as u64 - 1,
                "lstm_dec.weight_hh_l0" => cfg.h as u64,
                _ => 1,
            };
            assert_eq!(n, want, "{name}");
        }
        let mut bad = values(&test.0);
        bad[3] = f64::NAN;
        let bad =
            Tensor::from_vec(bad.iter().map(|&v| v as f32).collect::<Vec<_>>(), test.0.dims(), &Device::Cpu).unwrap();
        let e = f.forecast(&bad.narrow(0, 0, 2).unwrap(), &test.1.narrow(0, 0, 2).unwrap()).unwrap_err().to_string();
        assert!(e.contains("non-finite") && e.contains("observed") && !e.contains('\n'), "{e}");
        assert!(quantize_tft(&model, &[], CalibMethod::MinMax).is_err());
        let e = quantize_tft(&model, &calib, CalibMethod::Percentile(f64::NAN)).unwrap_err().to_string();
        assert!(e.contains("percentile"), "{e}");
        let mut mixed = calib.clone();
        mixed.extend(windows(&cfg, 3, 1, s ^ 9));
        let e = quantize_tft(&model, &mixed, CalibMethod::MinMax).unwrap_err().to_string();
        assert!(e.contains("one size for all") && !e.contains('\n'), "{e}");
    }

    /// At the default size the INT8 parameters are at least 3.5× smaller than F32 (issue
    /// 13's bar; the small test models carry proportionally more F32 embeddings and norms).
    #[test]
    fn default_size_int8_is_at_least_3_5_times_smaller() {
        let cfg = TftConfig::default();
        let model = Tft::new(cfg.clone(), &Device::Cpu, 5).unwrap();
        let q = quantize_tft(&model, &windows(&cfg, 1, 1, 5), CalibMethod::Dynamic).unwrap();
        let ratio = (4 * model.params().param_count()) as f64 / q.bytes() as f64;
        eprintln!("default TFT: {} parameters, INT8 {:.2}x smaller", model.params().param_count(), ratio);
        assert!(ratio >= 3.5, "{ratio}");
    }

    /// A small TFT trained on a synthetic series (an AR(1) feature with a cycle, noise
    /// features, calendar features): on held-out windows the INT8 model's mean pinball loss
    /// is within 1 % of the F32 model's and its 0.1–0.9 coverage within one point (issue
    /// 13's TFT targets), and the model learned something (rank correlation of its point
    /// forecast with the target above 0.3).
    #[test]
    fn trained_int8_tft_keeps_pinball_and_coverage() {
        let cfg = TftConfig { n_observed: 3, n_known: 2, d: 16, n_head: 2, l_enc: 12, h: 2, ..TftConfig::default() };
        let rows = 1400usize;
        let noise = |stream: u64, t: usize| (fx_kernels::rng::draw(91, stream, 0, t as u64) * 2.0 - 1.0) as f32;
        let (mut obs, mut known, mut target, mut ar) = (Vec::new(), Vec::new(), Vec::new(), 0.0f32);
        for t in 0..rows {
            ar = 0.8 * ar + 0.6 * noise(1, t);
            let phase = 2.0 * std::f32::consts::PI * (t % 16) as f32 / 16.0;
            obs.extend_from_slice(&[ar, noise(2, t), noise(3, t)]);
            known.extend_from_slice(&[phase.sin(), phase.cos()]);
        }
        for t in 0..rows {
            let next = obs[((t + 1) % rows) * 3];
            let phase = 2.0 * std::f32::consts::PI * ((t + 1) % 16) as f32 / 16.0;
            target.push(0.5 * next + 0.3 * phase.sin() + 0.1 * noise(4, t));
        }
        let series = SeqSeries::new(obs, 3, known, 2, target).unwrap();
        let model = Tft::new(cfg.clone(), &Device::Cpu, 3).unwrap();
        let tc = SeqTrainConfig { epochs: 6, batch_size: 32, lr: 3e-3, patience: 3, ..Default::default() };
        train(&model, &series, 0..800, 800..950, &tc).unwrap();
        let calib: Vec<(Tensor, Tensor)> = (0..4)
            .map(|k| {
                let starts: Vec<usize> = (0..16).map(|i| (k * 16 + i) * 8).collect();
                let b = model.batch(&series, &starts, &Device::Cpu).unwrap();
                (b.inputs[0].clone(), b.inputs[1].clone())
            })
            .collect();
        let held = 950..rows;
        let f32m = evaluate_forecasts(&model, &series, held.clone(), 16, Precision::F32).unwrap();
        for method in [CalibMethod::Percentile(CalibMethod::DEFAULT_PERCENTILE), CalibMethod::Dynamic] {
            let q = quantize_tft(&model, &calib, method).unwrap();
            let int8 = Int8Tft::new(&q, 16).unwrap();
            // The GPU forecaster's path (INT8 variable selection, the rest F32), on the CPU.
            let vsn = crate::tft_vsn::cpu_reference(&q, 16).unwrap();
            type Forecast<'a> = &'a dyn Fn(&Tensor, &Tensor) -> Result<Tensor>;
            let paths: [(&str, Forecast); 2] = [
                ("INT8", &|o, k| int8.forecast(o, k)),
                ("INT8 variable selection", &|o, k| {
                    vsn.forecast(o, k).map_err(|source| Error::Model { context: "vsn", source })
                }),
            ];
            for (path, forecast) in paths {
                let levels = cfg.quantiles.clone();
                let i8m = evaluate_forecasts_with(&model, &series, held.clone(), 16, &Device::Cpu, |b| {
                    let qs = forecast(&b.inputs[0], &b.inputs[1])
                        .map_err(|e| fx_models::Error::Config { context: "int8", message: e.to_string() })?;
                    Ok(Forecasts {
                        point: fx_models::tft::point_forecast(&levels, &qs)?,
                        quantiles: Some((levels.clone(), qs)),
                    })
                })
                .unwrap();
                let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
                let (pf, pq) = (mean(&f32m.pinball), mean(&i8m.pinball));
                let (cf, cq) = (f32m.interval_coverage.unwrap(), i8m.interval_coverage.unwrap());
                eprintln!(
                    "trained TFT ({method}, {path}): pinball F32 {pf:.5} INT8 {pq:.5}, coverage F32 {cf:.4} INT8 {cq:.4}, n {}",
                    f32m.n
                );
                assert!((pq - pf).abs() <= 0.01 * pf, "{method} {path}: pinball {pq} against {pf}");
                assert!((cq - cf).abs() <= 0.01, "{method} {path}: coverage {cq} against {cf}");
            }
        }
        assert!(f32m.rank_correlation > 0.3, "the model did not learn: rank correlation {}", f32m.rank_correlation);
    }
}
