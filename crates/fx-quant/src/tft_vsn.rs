//! The INT8 TFT's variable selection networks run whole, for the GPU forecaster
//! ([`crate::CudaInt8Tft`]) and its CPU reference: a [`MatrixHook`] that takes over
//! `TftKernels::vsn_forecast`.
//!
//! Why: op by op, the encoder's 55 per-variable GRNs move `[55, B·L_enc, d]` F32 activations
//! through device memory between every GEMM and element-wise kernel; that was most of an
//! F32 forecast on the H200. Here
//! - the per-variable GRNs and the selection mix are one kernel (`fx_models::tft::int8`):
//!   fc2, fc4 and fc5 in INT8 from the file (per-row weight steps; the file's calibrated
//!   input steps, or each row's own under `dynamic`), activations INT8 between them;
//! - every embedding is folded into the Linear after it (`fold_embedding`, f64): the
//!   per-variable fc1 becomes `ELU(raw · u1 + c1)` and the flat GRN's `fc1` and `skip`
//!   (`[d, n·d]`, `[n, n·d]`) become products with `raw [rows, n]`; those and the flat GRN's
//!   small fc2, fc4, fc5 run in F32 GEMMs on the file's weights dequantised, so the
//!   selection weights carry no activation quantisation.
//!
//! The rest of the model runs as the F32 forecaster does, on the file's weights
//! dequantised (see `docs/QUANT.md` for why those stay F32 GEMMs on the GPU).

use std::collections::HashMap;

use candle_core::Tensor;
use fx_kernels::gemm::Gemm;
use fx_models::tft::int8::{fold_embedding, vsn_vars_i8_ref, VsnI8Weights};
use fx_models::tft::ops::{Act, Addr, BiasAct, GluLn, Lstm, TftBackend, VsnForecast};
use fx_models::Tft;

use crate::error::{Error, Result};
use crate::qnet::QuantLinear;
use crate::tft::{MatrixHook, QuantTft};

/// Runs the per-variable GRNs and the mix of one network ([`VsnI8Weights`]'s reference on
/// the host, `CudaVsnI8` on the GPU).
pub(crate) trait VarsRunner {
    /// `out [rows, d]` from `raw`, `wsel [rows, n]`.
    ///
    /// # Safety
    /// The addresses are the runner's device's buffers of those sizes.
    unsafe fn run(&self, rows: usize, raw: Addr, wsel: Addr, out: Addr) -> Result<()>;
}

impl VarsRunner for VsnI8Weights {
    unsafe fn run(&self, rows: usize, raw: Addr, wsel: Addr, out: Addr) -> Result<()> {
        // SAFETY: the weights are this struct's checked vectors; the rows' buffers are the
        // caller's (the trait's contract).
        unsafe { vsn_vars_i8_ref(&self.host_args(rows, raw, wsel, out)) }.map_err(Error::Kernels)
    }
}

#[cfg(feature = "cuda")]
impl VarsRunner for fx_models::tft::int8_cuda::CudaVsnI8 {
    unsafe fn run(&self, rows: usize, raw: Addr, wsel: Addr, out: Addr) -> Result<()> {
        // SAFETY: forwarded (the trait's contract).
        unsafe { fx_models::tft::int8_cuda::CudaVsnI8::run(self, rows, raw, wsel, out) }.map_err(Error::Kernels)
    }
}

/// The file's parameters by spec name.
struct Params<'a> {
    floats: HashMap<&'a str, &'a [f32]>,
    matrices: HashMap<&'a str, &'a QuantLinear>,
}

impl<'a> Params<'a> {
    fn new(q: &'a QuantTft) -> Self {
        Self {
            floats: q.floats.iter().map(|(n, _, v)| (n.as_str(), v.as_slice())).collect(),
            matrices: q.matrices.iter().map(|m| (m.name.as_str(), m)).collect(),
        }
    }

    fn float(&self, name: &str, len: usize) -> Result<&'a [f32]> {
        match self.floats.get(name) {
            Some(v) if v.len() == len => Ok(v),
            Some(v) => Err(Error::invalid("INT8 TFT", format!("{name} has {} values, not {len}", v.len()))),
            None => Err(Error::invalid("INT8 TFT", format!("no F32 parameter {name}"))),
        }
    }

    fn matrix(&self, name: &str, out: usize, inp: usize) -> Result<&'a QuantLinear> {
        match self.matrices.get(name) {
            Some(m) if (m.out, m.inp) == (out, inp) => Ok(m),
            Some(m) => Err(Error::invalid("INT8 TFT", format!("{name} is [{}, {}], not [{out}, {inp}]", m.out, m.inp))),
            None => Err(Error::invalid("INT8 TFT", format!("no INT8 matrix {name}"))),
        }
    }

    /// `w_q · w_scale`, row by row.
    fn dequantized(&self, name: &str, out: usize, inp: usize) -> Result<Vec<f32>> {
        let m = self.matrix(name, out, inp)?;
        Ok(m.weight
            .chunks_exact(inp)
            .zip(&m.weight_scale)
            .flat_map(|(r, &s)| r.iter().map(move |&q| f32::from(q) * s))
            .collect())
    }

    /// Every variable's `{embed}.{j}.{what}` (`[d]` each) in one `[n, d]`.
    fn per_var(&self, prefix: &str, what: &str, n: usize, d: usize) -> Result<Vec<f32>> {
        let mut v = Vec::with_capacity(n * d);
        for j in 0..n {
            v.extend_from_slice(self.float(&format!("{prefix}.{j}.{what}"), d)?);
        }
        Ok(v)
    }
}

/// A network's flat GRN with its embeddings folded in: host vectors (`[out, in]`), or on
/// the backend, their addresses.
struct FlatGrn<T> {
    u1: T,
    c1: T,
    w2: T,
    b2: T,
    w4: T,
    b4: T,
    w5: T,
    b5: T,
    us: T,
    cs: T,
    ln_w: T,
    ln_b: T,
}

impl FlatGrn<Vec<f32>> {
    /// Every tensor through `put(values, shape)` (`n` variables of width `d`).
    fn try_map<U>(&self, d: usize, n: usize, mut put: impl FnMut(&[f32], &[usize]) -> Result<U>) -> Result<FlatGrn<U>> {
        Ok(FlatGrn {
            u1: put(&self.u1, &[d, n])?,
            c1: put(&self.c1, &[d])?,
            w2: put(&self.w2, &[d, d])?,
            b2: put(&self.b2, &[d])?,
            w4: put(&self.w4, &[n, d])?,
            b4: put(&self.b4, &[n])?,
            w5: put(&self.w5, &[n, d])?,
            b5: put(&self.b5, &[n])?,
            us: put(&self.us, &[n, n])?,
            cs: put(&self.cs, &[n])?,
            ln_w: put(&self.ln_w, &[n])?,
            ln_b: put(&self.ln_b, &[n])?,
        })
    }
}

/// One network of the file, host side: its flat GRN folded and its variables' INT8 form.
struct VsnHost {
    vsn: &'static str,
    flat: FlatGrn<Vec<f32>>,
    vars: VsnI8Weights,
}

fn vsn_host(q: &QuantTft, embed: &str, vsn: &'static str, n: usize) -> Result<VsnHost> {
    let p = Params::new(q);
    let d = q.config.d;
    let emb_w = p.per_var(embed, "weight", n, d)?;
    let emb_b = p.per_var(embed, "bias", n, d)?;
    let kerr = Error::Kernels;
    let flat = |s: &str| format!("{vsn}.flat.{s}");
    let (u1, c1) = fold_embedding(
        &p.dequantized(&flat("fc1.weight"), d, n * d)?,
        d,
        n,
        d,
        &emb_w,
        &emb_b,
        p.float(&flat("fc1.bias"), d)?,
    )
    .map_err(kerr)?;
    let (us, cs) = fold_embedding(
        &p.dequantized(&flat("skip.weight"), n, n * d)?,
        n,
        n,
        d,
        &emb_w,
        &emb_b,
        p.float(&flat("skip.bias"), n)?,
    )
    .map_err(kerr)?;
    let flat_host = FlatGrn {
        u1,
        c1,
        w2: p.dequantized(&flat("fc2.weight"), d, d)?,
        b2: p.float(&flat("fc2.bias"), d)?.to_vec(),
        w4: p.dequantized(&flat("glu.fc4.weight"), n, d)?,
        b4: p.float(&flat("glu.fc4.bias"), n)?.to_vec(),
        w5: p.dequantized(&flat("glu.fc5.weight"), n, d)?,
        b5: p.float(&flat("glu.fc5.bias"), n)?.to_vec(),
        us,
        cs,
        ln_w: p.float(&flat("norm.weight"), n)?.to_vec(),
        ln_b: p.float(&flat("norm.bias"), n)?.to_vec(),
    };
    let var = |j: usize, s: &str| format!("{vsn}.vars.{j}.{s}");
    let (mut u1, mut c1) = (Vec::with_capacity(n * d), Vec::with_capacity(n * d));
    let mut w: [Vec<i8>; 3] = Default::default();
    let mut ws: [Vec<f32>; 3] = Default::default();
    let mut b: [Vec<f32>; 3] = Default::default();
    let (mut in2, mut in45) = (Vec::with_capacity(n), Vec::with_capacity(n));
    for j in 0..n {
        let ew = &emb_w[j * d..(j + 1) * d];
        let eb = &emb_b[j * d..(j + 1) * d];
        let w1 = p.dequantized(&var(j, "fc1.weight"), d, d)?;
        let (u, c) = fold_embedding(&w1, d, 1, d, ew, eb, p.float(&var(j, "fc1.bias"), d)?).map_err(kerr)?;
        u1.extend(u);
        c1.extend(c);
        let names = ["fc2", "glu.fc4", "glu.fc5"];
        let mut steps = [0f32; 3];
        for (k, name) in names.iter().enumerate() {
            let m = p.matrix(&var(j, &format!("{name}.weight")), d, d)?;
            w[k].extend_from_slice(&m.weight);
            ws[k].extend_from_slice(&m.weight_scale);
            b[k].extend_from_slice(p.float(&var(j, &format!("{name}.bias")), d)?);
            steps[k] = m.input_scale;
        }
        // fc4 and fc5 read the same input, so calibration gives them the same step; the
        // kernel quantises that input once.
        if !q.dynamic_inputs() && steps[1] != steps[2] {
            return Err(Error::invalid(
                "INT8 TFT",
                format!("{}: input steps {} and {} of fc4 and fc5 (one input)", var(j, "glu"), steps[1], steps[2]),
            ));
        }
        in2.push(steps[0]);
        in45.push(steps[1]);
    }
    let vars = VsnI8Weights {
        n,
        d,
        eps: q.config.ln_eps as f32,
        emb_w,
        emb_b,
        u1,
        c1,
        w,
        ws,
        b,
        input_steps: (!q.dynamic_inputs()).then_some((in2, in45)),
        ln_w: p.per_var(&format!("{vsn}.vars"), "norm.weight", n, d)?,
        ln_b: p.per_var(&format!("{vsn}.vars"), "norm.bias", n, d)?,
    };
    vars.check("INT8 TFT variable selection").map_err(kerr)?;
    Ok(VsnHost { vsn, flat: flat_host, vars })
}

/// One network on the backend: the folded flat GRN's tensors and scratch, and its runner.
struct Plan<R> {
    key: Addr,
    rows: usize,
    n: usize,
    /// The folded flat GRN's tensors (kept alive: their addresses are `flat`).
    _tensors: Vec<Tensor>,
    flat: FlatGrn<Addr>,
    /// a1, a2 `[rows, d]`; g4, g5, sf `[rows, n]`; stats `[rows, 2]`.
    scratch: [Addr; 6],
    vars: R,
}

/// The hook: the two variable selection networks; every other op falls through to the
/// inner backend.
pub(crate) struct VsnHook<R> {
    plans: Vec<Plan<R>>,
    d: usize,
    eps: f32,
}

impl<R> std::fmt::Debug for VsnHook<R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "VsnHook({} networks)", self.plans.len())
    }
}

impl<R> VsnHook<R> {
    /// The hook for `q` with `model` (its dequantised form, on `inner`'s device) at up to
    /// `batch` windows; `runner` puts a network's INT8 variables on the device.
    pub(crate) fn new<B: TftBackend>(
        inner: &mut B,
        model: &Tft,
        q: &QuantTft,
        batch: usize,
        runner: impl Fn(&VsnI8Weights) -> Result<R>,
    ) -> Result<Self> {
        let c = &q.config;
        let d = c.d;
        let device = model.params().device().clone();
        let mut plans = Vec::new();
        let nets = [
            ("enc_embed", "enc_vsn", c.n_observed + c.n_known, c.l_enc * batch),
            ("dec_embed", "dec_vsn", c.n_known, c.h * batch),
        ];
        for (embed, vsn, n, rows) in nets {
            let h = vsn_host(q, embed, vsn, n)?;
            let key_name = format!("{}.vars.0.fc2.weight", h.vsn);
            let var = model
                .weight_matrices()
                .into_iter()
                .find(|v| model.params().part_names(v).is_some_and(|names| names.first() == Some(&key_name)))
                .ok_or_else(|| Error::invalid("INT8 TFT", format!("the model has no {key_name}")))?;
            let key = inner.addr_of(var.as_tensor(), "weight").map_err(Error::Kernels)?;
            let mut tensors = Vec::new();
            let flat = h.flat.try_map(d, n, |v, shape| {
                let t = Tensor::from_slice(v, shape, &device)
                    .map_err(|e| Error::Candle { context: "VsnHook".into(), source: e })?;
                let at = inner.addr_of(&t, "folded flat GRN").map_err(Error::Kernels)?;
                tensors.push(t);
                Ok(at)
            })?;
            let mut alloc = |len: usize| inner.alloc(len).map_err(Error::Kernels);
            let scratch = [
                alloc(rows * d)?,
                alloc(rows * d)?,
                alloc(rows * n)?,
                alloc(rows * n)?,
                alloc(rows * n)?,
                alloc(rows * 2)?,
            ];
            plans.push(Plan { key, rows, n, _tensors: tensors, flat, scratch, vars: runner(&h.vars)? });
        }
        Ok(Self { plans, d, eps: c.ln_eps as f32 })
    }
}

/// `y[rows, o] = x[rows, i] · wᵀ`.
fn lin(x: Addr, w: Addr, y: Addr, rows: usize, i: usize, o: usize) -> Gemm {
    Gemm::new(false, true, rows, o, i, x, w, y)
}

impl<B: TftBackend, R: VarsRunner> MatrixHook<B> for VsnHook<R> {
    unsafe fn gemm(&self, _inner: &B, _g: &Gemm) -> Result<bool> {
        Ok(false)
    }

    unsafe fn lstm_fwd_step(&self, _inner: &B, _a: &Lstm, _t: usize) -> Result<bool> {
        Ok(false)
    }

    unsafe fn vsn_forecast(&self, k: &B, a: &VsnForecast) -> Result<bool> {
        let Some(p) = self.plans.iter().find(|p| p.key == a.key) else { return Ok(false) };
        let (m, n, d) = (a.rows, p.n, self.d);
        if a.n != n || a.d != d || m > p.rows {
            return Err(Error::invalid(
                "INT8 TFT variable selection",
                format!("{m} rows of {} × {} for a plan of {} rows of {n} × {d}", a.n, a.d, p.rows),
            ));
        }
        let FlatGrn { u1, c1, w2, b2, w4, b4, w5, b5, us, cs, ln_w, ln_b } = p.flat;
        let [a1, a2, g4, g5, sf, stats] = p.scratch;
        let kerr = Error::Kernels;
        let bias_act = |y: Addr, bias: Addr, act: Act| BiasAct {
            y,
            bias,
            rows: m,
            cols: d,
            rows_per_group: m,
            act,
            dropout: None,
            out16: 0,
        };
        // SAFETY: the plan's tensors and scratch (sized for p.rows ≥ m rows) and the
        // caller's buffers of `a` (the trait's contract), all on this backend.
        unsafe {
            k.gemm(&lin(a.raw, u1, a1, m, n, d)).map_err(kerr)?;
            k.bias_act(&bias_act(a1, c1, Act::Elu)).map_err(kerr)?;
            k.gemm(&lin(a1, w2, a2, m, d, d)).map_err(kerr)?;
            k.bias_act(&bias_act(a2, b2, Act::None)).map_err(kerr)?;
            k.gemm(&lin(a2, w4, g4, m, d, n)).map_err(kerr)?;
            k.gemm(&lin(a2, w5, g5, m, d, n)).map_err(kerr)?;
            k.gemm(&lin(a.raw, us, sf, m, n, n)).map_err(kerr)?;
            let glu = GluLn {
                rows: m,
                o: n,
                g4,
                b4,
                g5,
                b5,
                res: sf,
                res_bias: cs,
                ln_w,
                ln_b,
                eps: self.eps,
                softmax: true,
                out: a.wsel,
                stats,
                out16: 0,
            };
            k.glu_ln_fwd(&glu).map_err(kerr)?;
            p.vars.run(m, a.raw, a.wsel, a.out)?;
            if a.out16 != 0 {
                k.cast_bf16(a.out, a.out16, m * d).map_err(kerr)?;
            }
        }
        Ok(true)
    }
}

/// Forecasts through the INT8 variable selection on the CPU: the GPU forecaster's
/// reference (tests).
#[cfg(test)]
pub(crate) fn cpu_reference(
    q: &QuantTft,
    batch: usize,
) -> Result<
    fx_models::tft::forecast::TftForecaster<
        crate::tft::MatrixHooked<fx_models::tft::ops::CpuTft, VsnHook<VsnI8Weights>>,
    >,
> {
    let model = q.dequantized()?;
    let mut inner = fx_models::tft::ops::CpuTft::new();
    let hook = VsnHook::new(&mut inner, &model, q, batch, |w| Ok(w.clone()))?;
    fx_models::tft::forecast::TftForecaster::new(crate::tft::MatrixHooked { inner, hook }, &model, batch)
        .map_err(|source| Error::Model { context: "cpu_reference", source })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tft::tests::{seed, small, values, windows};
    use crate::{quantize_tft, CalibMethod};
    use candle_core::Device;
    use fx_models::{Ctx, TftConfig};
    use fx_precision::Precision;

    /// On a fresh random model and inputs, for each calibration method, forecasts through
    /// the INT8 variable selection stay near the F32 model's (a gross-error bound: small
    /// random models are sensitive, see below),
    /// at a full and a partial batch; a width the kernel does not take is refused in one line.
    #[test]
    fn int8_variable_selection_forecasts_track_f32() {
        let s = seed();
        let cfg = small();
        let model = Tft::new(cfg.clone(), &Device::Cpu, s % 991).unwrap();
        let calib = windows(&cfg, 4, 3, s);
        let test = windows(&cfg, 3, 1, s ^ 0x77).remove(0);
        let want = values(&model.forward(&Ctx::inference(Precision::F32), &test.0, &test.1).unwrap());
        for method in [CalibMethod::MinMax, CalibMethod::Dynamic] {
            let q = quantize_tft(&model, &calib, method).unwrap();
            let f = cpu_reference(&q, 4).unwrap();
            let got = values(&f.forecast(&test.0, &test.1).unwrap());
            assert!(got.iter().all(|v| v.is_finite()), "{method}: non-finite (seed {s})");
            let (mut d, mut n) = (0.0, 0.0);
            for (a, b) in got.iter().zip(&want) {
                d += (a - b) * (a - b);
                n += b * b;
            }
            let rel = (d / n).sqrt();
            eprintln!("INT8 variable selection ({method}): relative RMS difference to F32 {rel:.4} (seed {s})");
            // A gross-error bound: over 400 seeds, 12 small random models landed 4–13 % from
            // F32, with both methods alike (seed 1796240305308587342: 4.8 % min-max), so the
            // spread is the random model's sensitivity, not a method's; the rest within 3 %.
            // Trained models are held to issue 13's targets by the trained-TFT test and
            // `tests/quant.rs`; the kernel against its reference by the exact tests.
            assert!(rel < 0.25, "{method}: relative RMS {rel} (seed {s})");
        }
        let odd = TftConfig { d: 18, n_head: 2, ..cfg };
        let model = Tft::new(odd.clone(), &Device::Cpu, 1).unwrap();
        let q = quantize_tft(&model, &windows(&odd, 2, 1, s), CalibMethod::Dynamic).unwrap();
        let e = cpu_reference(&q, 2).unwrap_err().to_string();
        assert!(e.contains("d = 18") && !e.contains('\n'), "{e}");
    }
}

#[cfg(all(test, feature = "cuda"))]
mod gpu_tests {
    use super::*;
    use crate::tft::tests::{seed, values, windows};
    use crate::{quantize_tft, CalibMethod, CudaInt8Tft};
    use candle_core::Device;
    use fx_models::TftConfig;
    use fx_precision::Precision;

    fn gpu() -> Option<Device> {
        fx_hw::test_gpu("tft_vsn")
    }

    fn rel(got: &[f64], want: &[f64]) -> f64 {
        let (mut d, mut n) = (0.0, 0.0);
        for (a, b) in got.iter().zip(want) {
            d += (a - b) * (a - b);
            n += b * b;
        }
        (d / n.max(1e-30)).sqrt()
    }

    fn on(t: &Tensor, dev: &Device) -> Tensor {
        t.to_device(dev).unwrap()
    }

    /// The GPU forecaster against its CPU reference (the same INT8 variable selection and
    /// folds, the rest in F32) on a fresh random model, full and partial batches, calibrated
    /// and dynamic steps; and against the F32 model.
    #[test]
    fn cuda_int8_forecasts_match_the_cpu_reference() {
        let Some(dev) = gpu() else { return };
        let s = seed();
        let cfg = TftConfig { n_observed: 11, n_known: 4, d: 64, n_head: 4, l_enc: 16, h: 4, ..TftConfig::default() };
        let model = Tft::new(cfg.clone(), &Device::Cpu, s % 983).unwrap();
        let calib = windows(&cfg, 8, 2, s);
        let test = windows(&cfg, 32, 1, s ^ 0x99).remove(0);
        let f32_cpu = model.cpu_forecaster(32).unwrap();
        let want32 = values(&f32_cpu.forecast(&test.0, &test.1).unwrap());
        for method in [CalibMethod::MinMax, CalibMethod::Dynamic] {
            let q = quantize_tft(&model, &calib, method).unwrap();
            let cpu = cpu_reference(&q, 32).unwrap();
            let gpu = CudaInt8Tft::new(&q, &dev, 32).unwrap();
            for b in [32, 5] {
                let (o, k) = (test.0.narrow(0, 0, b).unwrap(), test.1.narrow(0, 0, b).unwrap());
                let want = values(&cpu.forecast(&o, &k).unwrap());
                let got = values(&gpu.forecast(&on(&o, &dev), &on(&k, &dev)).unwrap());
                assert!(got.iter().all(|v| v.is_finite()), "{method}: non-finite (seed {s})");
                let e = rel(&got, &want);
                let e32 = rel(&got, &want32[..got.len()]);
                eprintln!("{method} batch {b}: GPU vs CPU reference {e:.2e}, vs F32 {e32:.4} (seed {s})");
                assert!(e < 2e-3, "{method} batch {b}: GPU vs its CPU reference {e} (seed {s})");
                assert!(e32 < 0.03, "{method} batch {b}: GPU INT8 vs F32 {e32} (seed {s})");
            }
        }
    }

    /// At the spec's default size and batch 256 (the benchmark's case) the GPU INT8
    /// forecasts stay within 3 % (relative RMS) of the F32 fused forecaster's.
    #[test]
    fn cuda_int8_forecasts_at_the_default_size_track_f32() {
        let Some(dev) = gpu() else { return };
        let s = seed();
        let cfg = TftConfig::default();
        let model = Tft::new(cfg.clone(), &Device::Cpu, s % 977).unwrap();
        let q = quantize_tft(&model, &windows(&cfg, 2, 1, s), CalibMethod::Dynamic).unwrap();
        let test = windows(&cfg, 256, 1, s ^ 0x3).remove(0);
        let (o, k) = (on(&test.0, &dev), on(&test.1, &dev));
        let model_gpu = Tft::new(cfg, &dev, s % 977).unwrap();
        let want = values(&model_gpu.cuda_forecaster(256, Precision::F32).unwrap().forecast(&o, &k).unwrap());
        let got = values(&CudaInt8Tft::new(&q, &dev, 256).unwrap().forecast(&o, &k).unwrap());
        let e = rel(&got, &want);
        eprintln!("default TFT batch 256: GPU INT8 vs F32 {e:.4} (seed {s})");
        assert!(got.iter().all(|v| v.is_finite()) && e < 0.03, "relative RMS {e} (seed {s})");
    }
}
