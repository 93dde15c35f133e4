//! Sequence-model inference cases (no tape, dropout off), fx-only (bench.py has none):
//! - `tft_infer_b1` (latency): one quantile forecast from a 64-bar history, p50/p99/mean;
//! - `tft_infer_b{256,8}` (infer): forecasts per second at a batch (CPU 8);
//! - `mamba2_step_b1` (latency): [`Mamba2::step`], one new bar through the recurrent state,
//!   what a trading loop feeding one bar at a time pays.
//!
//! Modes: `eager_fp32` (candle's ops, one launch each) and, on CUDA, `graph_fp32` (the same
//! forward captured once as a CUDA graph on static input and output buffers — and, for the
//! MAMBA-2 step, a static state updated in place — replayed per call). The TFT cases have
//! `fused_fp32` / `fused_graph_fp32` / `fused_graph_bf16` on CUDA (the fused step's forward
//! alone, `TftForecaster`, eager and captured, the last with BF16 GEMM operands), `int8` on
//! the CPU (`fx_quant::Int8Tft`) and `int8` / `int8_graph` on CUDA (`fx_quant::CudaInt8Tft`,
//! eager and captured); their
//! records add `rel_err_vs_candle` (relative RMS against candle's forecast). The MAMBA-2 step has two
//! more on CUDA: `fused_fp32`, `fx_models::mamba2::decode::Mamba2Decoder::step` (the whole step as
//! one kernel launch on a thread-block cluster, Hopper+), and `fused_graph_fp32`, that launch
//! captured as a one-node CUDA graph and replayed; their records add the kernel's device time
//! (`kernel_us`) and the first prediction's relative distance to candle's step
//! (`rel_err_vs_candle`). On the CPU it has `cpu_fp32`: `Mamba2::cpu_step`, the step on the
//! calling thread with no tensor and no allocation, and `int8`: `fx_quant::mamba2_int8_step`,
//! the same step with INT8 `in_proj` / `out_proj` (its record adds the ISA). Every call is timed on the host clock up to
//! a device synchronisation, like bench.py's latency cases.

use anyhow::{ensure, Result};
use candle_core::{DType, Device, Tensor};
use fx_models::{Ctx, Mamba2, Mamba2Config, Tft, TftConfig};
use fx_precision::Precision;
use serde_json::json;

use super::data::normals;
use super::timing::{mean, pct, round};
use super::{Ctx as BenchCtx, Record};

/// Which sequence inference case.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum SeqInfer {
    /// TFT forecast at batch 1 (latency).
    TftB1,
    /// TFT forecasts at a batch (throughput).
    TftBatch(usize),
    /// MAMBA-2 one-bar recurrent step at batch 1 (latency).
    Mamba2Step,
}

impl SeqInfer {
    /// The cases for a device (bench.py's CPU batches are smaller).
    pub(crate) fn cases(tft: bool, mamba2: bool, cuda: bool) -> Vec<SeqInfer> {
        let mut v = Vec::new();
        if tft {
            v.extend([SeqInfer::TftB1, SeqInfer::TftBatch(if cuda { 256 } else { 8 })]);
        }
        if mamba2 {
            v.push(SeqInfer::Mamba2Step);
        }
        v
    }

    pub(crate) fn case(self) -> String {
        match self {
            SeqInfer::TftB1 => "tft_infer_b1".into(),
            SeqInfer::TftBatch(b) => format!("tft_infer_b{b}"),
            SeqInfer::Mamba2Step => "mamba2_step_b1".into(),
        }
    }

    pub(crate) fn kind(self) -> &'static str {
        match self {
            SeqInfer::TftBatch(_) => "infer",
            _ => "latency",
        }
    }

    pub(crate) fn model(self) -> &'static str {
        match self {
            SeqInfer::Mamba2Step => "mamba2",
            _ => "tft",
        }
    }

    pub(crate) fn batch(self) -> usize {
        match self {
            SeqInfer::TftBatch(b) => b,
            _ => 1,
        }
    }

    /// The case's modes on `device`: [`modes`]; for the MAMBA-2 step the fused ones where
    /// its kernel runs (a thread-block cluster: Hopper and later, so older cards report no
    /// failed case) and on the CPU `cpu_fp32` and `int8`; for the TFT the fused ones and
    /// `int8` / `int8_graph` on CUDA, and `int8` on the CPU.
    pub(crate) fn modes(self, device: &Device) -> &'static [&'static str] {
        match self {
            SeqInfer::Mamba2Step if fused_step_runs(device) => {
                &["eager_fp32", "graph_fp32", "fused_fp32", "fused_graph_fp32"]
            }
            SeqInfer::Mamba2Step if !device.is_cuda() => &["eager_fp32", "cpu_fp32", "int8"],
            SeqInfer::Mamba2Step => modes(true),
            _ if device.is_cuda() => &[
                "eager_fp32",
                "graph_fp32",
                "fused_fp32",
                "fused_graph_fp32",
                "fused_graph_bf16",
                "int8",
                "int8_graph",
            ],
            _ => &["eager_fp32", "int8"],
        }
    }
}

/// Whether the fused MAMBA-2 step's cluster kernel can run on `device` (compute capability 9+).
#[cfg(feature = "cuda")]
fn fused_step_runs(device: &Device) -> bool {
    match device {
        Device::Cuda(d) => d.cuda_stream().context().compute_capability().is_ok_and(|(major, _)| major >= 9),
        _ => false,
    }
}

#[cfg(not(feature = "cuda"))]
fn fused_step_runs(_device: &Device) -> bool {
    false
}

/// The modes of a device (every case has these).
pub(crate) fn modes(cuda: bool) -> &'static [&'static str] {
    if cuda {
        &["eager_fp32", "graph_fp32"]
    } else {
        &["eager_fp32"]
    }
}

/// A forward to time: `call()` queues one inference (its result stays on the device).
type Call<'a> = Box<dyn FnMut() -> Result<()> + 'a>;

/// One case in `mode`; fills `rec`.
pub(crate) fn seq_infer_case(ctx: &mut BenchCtx, what: SeqInfer, mode: &str, rec: &mut Record) -> Result<()> {
    let dev = ctx.device.clone();
    let graph = matches!(mode, "graph_fp32" | "fused_graph_fp32" | "fused_graph_bf16" | "int8_graph");
    let fused = mode.starts_with("fused");
    ensure!(!(graph || fused) || dev.is_cuda(), "graph and fused modes need CUDA");
    let cpu_step = what == SeqInfer::Mamba2Step && (mode == "cpu_fp32" || mode == "int8");
    ensure!(!cpu_step || !dev.is_cuda(), "{mode} runs on the CPU");
    ensure!(mode != "cpu_fp32" || what == SeqInfer::Mamba2Step, "cpu_fp32 is the MAMBA-2 step's");
    let c = Ctx::inference(Precision::F32);
    let (n_warm, n) = if what.kind() == "infer" {
        (5, (ctx.lat_n / 20).max(20))
    } else {
        (ctx.lat_warm.min(100), (ctx.lat_n / 4).max(50))
    };
    let ts = match what {
        SeqInfer::TftB1 | SeqInfer::TftBatch(_) => {
            let cfg = TftConfig::default();
            let b = what.batch();
            let (l, h) = (cfg.l_enc, cfg.h);
            let obs = Tensor::from_vec(normals(6, 1, b * l * cfg.n_observed), (b, l, cfg.n_observed), &dev)?;
            let known: Vec<f32> = normals(6, 2, b * (l + h) * cfg.n_known).iter().map(|v| v.clamp(-1.0, 1.0)).collect();
            let known = Tensor::from_vec(known, (b, l + h, cfg.n_known), &dev)?;
            let model = Tft::new(cfg, &dev, 0)?;
            rec.insert("params".into(), json!(model.params().param_count()));
            let want = model.forward(&c, &obs, &known)?.contiguous()?;
            let out = want.copy()?;
            let mut forecast = tft_forecast(&model, &obs, &known, mode, b, rec)?;
            let mut body = |_dry: bool| -> Result<()> {
                let q = forecast()?;
                out.slice_set(&q.contiguous()?, 0, 0)?;
                Ok(())
            };
            body(false)?;
            let first = out.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()?;
            ensure!(first.iter().all(|v| v.is_finite()), "non-finite TFT forecast");
            if mode != "eager_fp32" && mode != "graph_fp32" {
                let d = (&out - &want)?.sqr()?.sum_all()?.to_scalar::<f32>()?;
                let w = want.sqr()?.sum_all()?.to_scalar::<f32>()?;
                rec.insert("rel_err_vs_candle".into(), json!((f64::from(d) / f64::from(w).max(1e-30)).sqrt()));
            }
            time_calls(&dev, graph, &mut body, n_warm, n)?
        }
        SeqInfer::Mamba2Step if fused => mamba2_fused(&dev, graph, n_warm, n, rec)?,
        SeqInfer::Mamba2Step if cpu_step => mamba2_cpu(&dev, mode == "int8", n_warm, n, rec)?,
        SeqInfer::Mamba2Step => {
            let cfg = Mamba2Config::default();
            let model = Mamba2::new(cfg.clone(), &dev, 0)?;
            rec.insert("params".into(), json!(model.params().param_count()));
            let x = Tensor::from_vec(normals(7, 1, cfg.n_in), (1, cfg.n_in), &dev)?;
            // A state after a 64-bar history, then one bar per call from there.
            let hist = Tensor::from_vec(normals(7, 2, 64 * cfg.n_in), (1, 64, cfg.n_in), &dev)?;
            let state = model.forward_with_state(&c, &hist)?.1.to_buffers()?;
            let out = Tensor::zeros(1, DType::F32, &dev)?;
            let mut body = |_dry: bool| -> Result<()> {
                let mut next = state.clone();
                let y = model.step(&c, &x, &mut next)?;
                state.assign(&next)?;
                out.slice_set(&y.to_dtype(DType::F32)?.contiguous()?, 0, 0)?;
                Ok(())
            };
            time_calls(&dev, graph, &mut body, n_warm, n)?
        }
    };
    let p50 = pct(&ts, 50.0);
    rec.insert("status".into(), json!("ok"));
    rec.insert("n".into(), json!(ts.len()));
    rec.insert("p50_us".into(), json!(round(p50, 2)));
    rec.insert("p99_us".into(), json!(round(pct(&ts, 99.0), 2)));
    rec.insert("mean_us".into(), json!(round(mean(&ts), 2)));
    if let SeqInfer::TftBatch(b) = what {
        rec.insert("samples_per_s".into(), json!(round(b as f64 / (p50 / 1e6), 1)));
    }
    Ok(())
}

/// A TFT forecast of `obs`, `known` in `mode`: candle's forward (`eager_fp32`, and captured:
/// `graph_fp32`), the fused forward (`fx_models::tft::forecast::TftForecaster` on CUDA:
/// `fused_fp32`, captured: `fused_graph_fp32`; its GEMMs in BF16, captured: `fused_graph_bf16`)
/// or the INT8 model (`int8`; on the CPU `fx_quant::Int8Tft`, dynamic input scales,
/// quantised from this model with the timed batch as its calibration window, the record
/// adding the ISA and the parameter bytes; on CUDA `fx_quant::CudaInt8Tft`, and captured:
/// `int8_graph`).
fn tft_forecast<'a>(
    model: &'a Tft,
    obs: &'a Tensor,
    known: &'a Tensor,
    mode: &str,
    batch: usize,
    rec: &mut Record,
) -> Result<Box<dyn FnMut() -> Result<Tensor> + 'a>> {
    let c = Ctx::inference(Precision::F32);
    Ok(match mode {
        "int8" if !obs.device().is_cuda() => {
            let q = fx_quant::quantize_tft(model, &[(obs.clone(), known.clone())], fx_quant::CalibMethod::Dynamic)?;
            let f = fx_quant::Int8Tft::new(&q, batch)?;
            rec.insert("isa".into(), json!(f.isa().name()));
            rec.insert("param_bytes".into(), json!(q.bytes()));
            rec.insert("param_bytes_f32".into(), json!(4 * model.params().param_count()));
            Box::new(move || Ok(f.forecast(obs, known)?))
        }
        "int8" | "int8_graph" => tft_int8_cuda(model, obs, known, batch, rec)?,
        "fused_fp32" | "fused_graph_fp32" => tft_fused(model, obs, known, batch, Precision::F32)?,
        "fused_graph_bf16" => tft_fused(model, obs, known, batch, Precision::Bf16)?,
        _ => Box::new(move || Ok(model.forward(&c, obs, known)?)),
    })
}

#[cfg(feature = "cuda")]
fn tft_fused<'a>(
    model: &'a Tft,
    obs: &'a Tensor,
    known: &'a Tensor,
    batch: usize,
    precision: Precision,
) -> Result<Box<dyn FnMut() -> Result<Tensor> + 'a>> {
    let f = model.cuda_forecaster(batch, precision)?;
    Ok(Box::new(move || Ok(f.forecast(obs, known)?)))
}

/// The INT8 TFT on CUDA (`fx_quant::CudaInt8Tft`), quantised with dynamic input scales
/// from a CPU copy of `model`'s parameters (calibration runs on the CPU).
#[cfg(feature = "cuda")]
fn tft_int8_cuda<'a>(
    model: &'a Tft,
    obs: &'a Tensor,
    known: &'a Tensor,
    batch: usize,
    rec: &mut Record,
) -> Result<Box<dyn FnMut() -> Result<Tensor> + 'a>> {
    let cpu = Device::Cpu;
    let host = Tft::new(model.config().clone(), &cpu, 0)?;
    let params: std::collections::HashMap<String, Tensor> = model.params().to_map()?.into_iter().collect();
    host.params().load_map(&params, "the benchmark's model")?;
    let b = obs.dim(0)?.min(2);
    let window = (obs.narrow(0, 0, b)?.to_device(&cpu)?, known.narrow(0, 0, b)?.to_device(&cpu)?);
    let q = fx_quant::quantize_tft(&host, &[window], fx_quant::CalibMethod::Dynamic)?;
    rec.insert("param_bytes".into(), json!(q.bytes()));
    rec.insert("param_bytes_f32".into(), json!(4 * model.params().param_count()));
    let f = fx_quant::CudaInt8Tft::new(&q, obs.device(), batch)?;
    Ok(Box::new(move || Ok(f.forecast(obs, known)?)))
}

#[cfg(not(feature = "cuda"))]
fn tft_int8_cuda<'a>(
    _model: &'a Tft,
    _obs: &'a Tensor,
    _known: &'a Tensor,
    _batch: usize,
    _rec: &mut Record,
) -> Result<Box<dyn FnMut() -> Result<Tensor> + 'a>> {
    anyhow::bail!("the INT8 TFT on CUDA needs a build with the cuda feature")
}

#[cfg(not(feature = "cuda"))]
fn tft_fused<'a>(
    _model: &'a Tft,
    _obs: &'a Tensor,
    _known: &'a Tensor,
    _batch: usize,
    _precision: Precision,
) -> Result<Box<dyn FnMut() -> Result<Tensor> + 'a>> {
    anyhow::bail!("fused modes need a build with the cuda feature")
}

/// The MAMBA-2 step on the CPU (`Mamba2::cpu_step`: one bar on the calling thread, no
/// allocation; with `int8`, `fx_quant::mamba2_int8_step`), from the same model, bar and 64-bar prefill as the candle mode, its first
/// prediction checked against candle's; each call then advances the state by that bar, as a
/// trading loop does (restoring the state per call would time a 0.5 MB copy, not the step).
fn mamba2_cpu(dev: &Device, int8: bool, n_warm: usize, n: usize, rec: &mut Record) -> Result<Vec<f64>> {
    let c = Ctx::inference(Precision::F32);
    let cfg = Mamba2Config::default();
    let model = Mamba2::new(cfg.clone(), dev, 0)?;
    rec.insert("params".into(), json!(model.params().param_count()));
    let bar = normals(7, 1, cfg.n_in);
    let x = Tensor::from_vec(bar.clone(), (1, cfg.n_in), dev)?;
    let hist = Tensor::from_vec(normals(7, 2, 64 * cfg.n_in), (1, 64, cfg.n_in), dev)?;
    let prefill = model.forward_with_state(&c, &hist)?.1.to_buffers()?;
    let want = model.step(&c, &x, &mut prefill.clone())?.to_dtype(DType::F64)?.to_vec1::<f64>()?[0];
    let state = prefill.layer_states()?;
    let mut fast = if int8 {
        rec.insert("isa".into(), json!(fx_quant::Isa::detect().name()));
        fx_quant::mamba2_int8_step(&model)?
    } else {
        model.cpu_step()?
    };
    rec.insert("projection_bytes".into(), json!(fast.projection_bytes()));
    fast.set_state(&state)?;
    let got = f64::from(fast.step(&bar)?);
    ensure!(got.is_finite(), "non-finite CPU MAMBA-2 prediction");
    rec.insert("rel_err_vs_candle".into(), json!((got - want).abs() / want.abs().max(1e-30)));
    let mut call = || -> Result<()> {
        std::hint::black_box(fast.step(&bar)?);
        Ok(())
    };
    super::latency::time_calls(dev, n_warm, n, false, &mut call)
}

/// The MAMBA-2 step as one fused kernel launch (`Mamba2Decoder`), from the same model, bar and
/// 64-bar prefill as the candle modes; with `graph` the launch is captured and replayed.
#[cfg(feature = "cuda")]
fn mamba2_fused(dev: &Device, graph: bool, n_warm: usize, n: usize, rec: &mut Record) -> Result<Vec<f64>> {
    use fx_models::mamba2::decode::Mamba2Decoder;
    let c = Ctx::inference(Precision::F32);
    let cfg = Mamba2Config::default();
    let model = Mamba2::new(cfg.clone(), dev, 0)?;
    rec.insert("params".into(), json!(model.params().param_count()));
    let x = Tensor::from_vec(normals(7, 1, cfg.n_in), (1, cfg.n_in), dev)?;
    let hist = Tensor::from_vec(normals(7, 2, 64 * cfg.n_in), (1, 64, cfg.n_in), dev)?;
    let prefill = model.forward_with_state(&c, &hist)?.1;
    let dec = Mamba2Decoder::new(&model, 1)?;
    // The first bar after the prefill through both steps.
    let mut st = prefill.to_buffers()?;
    let want = model.step(&c, &x, &mut st)?.to_dtype(DType::F64)?.to_vec1::<f64>()?[0];
    dec.load_state(&prefill)?;
    let got = dec.step(&x)?.to_dtype(DType::F64)?.to_vec1::<f64>()?[0];
    ensure!(got.is_finite(), "non-finite fused MAMBA-2 prediction");
    rec.insert("rel_err_vs_candle".into(), json!((got - want).abs() / want.abs().max(1e-30)));
    rec.insert(
        "kernel".into(),
        json!(format!(
            "fx_m2_step_b1: one cluster of {} blocks x 512 threads{}",
            dec.cluster_blocks(),
            if dec.stages_weights() { ", weights staged in shared memory" } else { "" }
        )),
    );
    rec.insert("launches_per_call".into(), json!(1));
    // The kernel's own device time; the rest of p50 is the launch (or replay) and the sync.
    let us = super::timing::kernel_device_us(dev, || Ok(dec.step(&x).map(|_| ())?))?;
    rec.insert("kernel_us".into(), json!(round(us, 2)));
    dec.load_state(&prefill)?;
    let mut body = |_dry: bool| -> Result<()> {
        dec.step(&x)?;
        Ok(())
    };
    time_calls(dev, graph, &mut body, n_warm, n)
}

#[cfg(not(feature = "cuda"))]
fn mamba2_fused(_dev: &Device, _graph: bool, _warm: usize, _n: usize, _rec: &mut Record) -> Result<Vec<f64>> {
    anyhow::bail!("fused modes need a build with the cuda feature")
}

/// Times `n` calls of `body` (after `warm`), each up to a device synchronisation, in µs;
/// with `graph`, `body` is captured once and each call is one replay.
fn time_calls(
    dev: &Device,
    graph: bool,
    body: &mut dyn FnMut(bool) -> Result<()>,
    warm: usize,
    n: usize,
) -> Result<Vec<f64>> {
    let mut call: Call<'_> = if graph { captured(dev, body)? } else { Box::new(move || body(false)) };
    super::latency::time_calls(dev, warm, n, true, &mut call)
}

#[cfg(feature = "cuda")]
fn captured<'a>(dev: &Device, body: &'a mut dyn FnMut(bool) -> Result<()>) -> Result<Call<'a>> {
    let g = fx_precision::CapturedGraph::capture(dev, 2, |dry| {
        body(dry).map_err(|e| fx_precision::Error::Cuda { context: "seq inference capture", message: format!("{e:#}") })
    })?;
    Ok(Box::new(move || Ok(g.replay()?)))
}

#[cfg(not(feature = "cuda"))]
fn captured<'a>(_dev: &Device, _body: &'a mut dyn FnMut(bool) -> Result<()>) -> Result<Call<'a>> {
    anyhow::bail!("graph modes need a build with the cuda feature")
}
