//! TFT and MAMBA-2 on a CUDA device: fixture parity (F32 and BF16) and training-step
//! throughput at the reference benchmark's sizes (TFT batch 256, L_enc 64, H 8;
//! MAMBA-2 batch 32, L 256; AdamW + clip at norm 1 as `bench.py`). Built only with the
//! `cuda` feature; the throughput part is `#[ignore]`d (run it with `--ignored`).
#![cfg(feature = "cuda")]

use std::collections::HashMap;
use std::time::Instant;

use candle_core::{DType, Device, Tensor};
use fx_models::mamba2::{Mamba2, Mamba2Config};
use fx_models::seq::{Mamba2Task, SeqBatch, SeqTask};
use fx_models::tft::{Tft, TftConfig};
use fx_models::Ctx;
use fx_precision::{clip_grad_norm, AdamW, AdamWConfig, Optimizer, Precision};

fn fixture(name: &str) -> (HashMap<String, Tensor>, HashMap<String, String>) {
    let path = format!("{}/../../../shared/fixtures/{name}", env!("CARGO_MANIFEST_DIR"));
    let bytes = std::fs::read(&path).unwrap();
    let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    let t = candle_core::safetensors::load_buffer(&bytes, &Device::Cpu).unwrap();
    (t, meta.metadata().clone().unwrap_or_default())
}

fn params(t: &HashMap<String, Tensor>) -> HashMap<String, Tensor> {
    t.iter()
        .filter(|(k, _)| !["in.", "out.", "mid.", "grad."].iter().any(|p| k.starts_with(p)) && k.as_str() != "loss")
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect()
}

fn rel(a: &Tensor, b: &Tensor) -> f64 {
    let a = a.to_device(&Device::Cpu).unwrap().to_dtype(DType::F64).unwrap().flatten_all().unwrap();
    let b = b.to_dtype(DType::F64).unwrap().flatten_all().unwrap();
    let n = (&a - &b).unwrap().sqr().unwrap().sum_all().unwrap().to_scalar::<f64>().unwrap().sqrt();
    let d = b.sqr().unwrap().sum_all().unwrap().to_scalar::<f64>().unwrap().sqrt();
    if n.is_finite() {
        n / d
    } else {
        f64::INFINITY
    }
}

#[test]
fn gpu_fixture_parity() {
    let dev = fx_hw::open_cuda(0).unwrap();
    let (t, meta) = fixture("tft.safetensors");
    let cfg: TftConfig = serde_json::from_str(&meta["config"]).unwrap();
    let m = Tft::new(cfg, &dev, 0).unwrap();
    m.params().load_map(&params(&t), "tft").unwrap();
    let obs = t["in.observed"].to_device(&dev).unwrap();
    let known = t["in.known"].to_device(&dev).unwrap();
    let y = t["in.target"].to_device(&dev).unwrap();
    for (p, tol) in [(Precision::F32, 1e-4), (Precision::Bf16, 2e-2)] {
        let (loss, g) = m.loss_and_grads(&Ctx::eval_with_grad(p), &obs, &known, &y, false).unwrap();
        let out = m.forward(&Ctx::inference(p), &obs, &known).unwrap();
        let e_out = rel(&out, &t["out.quantiles"]);
        let e_loss = rel(&loss, &t["loss"]);
        let g = m.params().named_grads(&g).unwrap();
        let mut all = (Vec::new(), Vec::new());
        for (n, v) in &g {
            all.0.push(v.to_device(&Device::Cpu).unwrap().flatten_all().unwrap());
            all.1.push(t[&format!("grad.{n}")].flatten_all().unwrap());
        }
        let e_g = rel(&Tensor::cat(&all.0, 0).unwrap(), &Tensor::cat(&all.1, 0).unwrap());
        eprintln!("GPU TFT {p:?}: out {e_out:.2e} loss {e_loss:.2e} all-grads {e_g:.2e}");
        assert!(e_out <= tol && e_loss <= tol && e_g <= tol);
    }
    let (t, meta) = fixture("mamba2.safetensors");
    let cfg: Mamba2Config = serde_json::from_str(&meta["config"]).unwrap();
    let m = Mamba2::new(cfg, &dev, 0).unwrap();
    m.params().load_map(&params(&t), "mamba2").unwrap();
    let x = t["in.x"].to_device(&dev).unwrap();
    let y = t["in.target"].to_device(&dev).unwrap();
    for (p, tol) in [(Precision::F32, 1e-4), (Precision::Bf16, 2e-2)] {
        let (loss, g) = m.loss_and_grads(&Ctx::eval_with_grad(p), &x, &y, false).unwrap();
        let out = m.forward(&Ctx::inference(p), &x).unwrap();
        let e_out = rel(&out, &t["out.pred"]);
        let e_loss = rel(&loss, &t["loss"]);
        let g = m.params().named_grads(&g).unwrap();
        let mut all = (Vec::new(), Vec::new());
        for (n, v) in &g {
            all.0.push(v.to_device(&Device::Cpu).unwrap().flatten_all().unwrap());
            all.1.push(t[&format!("grad.{n}")].flatten_all().unwrap());
        }
        let e_g = rel(&Tensor::cat(&all.0, 0).unwrap(), &Tensor::cat(&all.1, 0).unwrap());
        eprintln!("GPU MAMBA-2 {p:?}: out {e_out:.2e} loss {e_loss:.2e} all-grads {e_g:.2e}");
        assert!(e_out <= tol && e_loss <= tol && e_g <= tol);
    }
}

/// Median times (s) of the forward + loss alone, forward + backward, and the full step
/// (with clipping and AdamW) over `steps` repetitions after 3 warm-up steps.
fn time_steps(
    task: &impl SeqTask,
    batch: &SeqBatch,
    p: Precision,
    ck: bool,
    steps: usize,
    dev: &Device,
) -> (f64, f64, f64) {
    let med = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let c = Ctx::train(p);
    let (mut tf, mut tb) = (Vec::new(), Vec::new());
    for i in 0..steps + 3 {
        dev.synchronize().unwrap();
        let t0 = Instant::now();
        let loss = task.loss(&c, batch).unwrap();
        dev.synchronize().unwrap();
        let t1 = Instant::now();
        drop(loss);
        let (loss, g) = task.loss_and_grads(&c, batch, ck).unwrap();
        drop((loss, g));
        dev.synchronize().unwrap();
        if i >= 3 {
            tf.push((t1 - t0).as_secs_f64());
            tb.push(t1.elapsed().as_secs_f64());
        }
    }
    let mut opt = AdamW::new(task.params().named_vars(), AdamWConfig { lr: 1e-3, ..AdamWConfig::default() }).unwrap();
    let vars = task.params().vars();
    let mut times = Vec::new();
    for i in 0..steps + 3 {
        dev.synchronize().unwrap();
        let t0 = Instant::now();
        let (loss, mut g) = task.loss_and_grads(&c, batch, ck).unwrap();
        clip_grad_norm(&vars, &mut g, 1.0).unwrap();
        opt.step(&g).unwrap();
        drop((loss, g));
        dev.synchronize().unwrap();
        if i >= 3 {
            times.push(t0.elapsed().as_secs_f64());
        }
    }
    (med(tf), med(tb), med(times))
}

#[test]
#[ignore]
fn gpu_training_throughput() {
    let dev = fx_hw::open_cuda(0).unwrap();
    let cfg = TftConfig::default();
    let (l, h) = (cfg.l_enc, cfg.h);
    let tft = Tft::new(cfg, &dev, 0).unwrap();
    // batch 16 first: if its step takes about as long as batch 256's, the step is bound
    // by the host (kernel launches), not by the GPU's arithmetic.
    for b in [16usize, 256] {
        let batch = SeqBatch {
            inputs: vec![
                Tensor::randn(0f32, 1.0, (b, l, 51), &dev).unwrap(),
                Tensor::randn(0f32, 1.0, (b, l + h, 4), &dev).unwrap(),
            ],
            target: Tensor::randn(0f32, 0.01, (b, h), &dev).unwrap(),
            last_value: Tensor::zeros((b, h), DType::F32, &dev).unwrap(),
        };
        let runs: &[(Precision, bool)] = if b == 256 {
            &[(Precision::F32, false), (Precision::Bf16, false), (Precision::Bf16, true)]
        } else {
            &[(Precision::F32, false)]
        };
        for &(p, ck) in runs {
            let (f, fb, s) = time_steps(&tft, &batch, p, ck, 10, &dev);
            eprintln!(
            "BENCH tft batch {b} L_enc {l} H {h} {p:?} checkpoint={ck}: {:.1} ms/step ({:.1} forward, {:.1} forward+backward), {:.0} samples/s",
            s * 1e3,
            f * 1e3,
            fb * 1e3,
            b as f64 / s
        );
        }
    }
    drop(tft);
    let m = Mamba2::new(Mamba2Config::default(), &dev, 0).unwrap();
    let l = 256;
    let task = Mamba2Task { model: &m, seq_len: l };
    for b in [4usize, 32] {
        let batch = SeqBatch {
            inputs: vec![Tensor::randn(0f32, 1.0, (b, l, 51), &dev).unwrap()],
            target: Tensor::randn(0f32, 0.01, (b, l), &dev).unwrap(),
            last_value: Tensor::zeros((b, l), DType::F32, &dev).unwrap(),
        };
        let runs: &[(Precision, bool)] = if b == 32 {
            &[(Precision::F32, false), (Precision::Bf16, false), (Precision::Bf16, true)]
        } else {
            &[(Precision::F32, false)]
        };
        for &(p, ck) in runs {
            let (f, fb, s) = time_steps(&task, &batch, p, ck, 10, &dev);
            eprintln!(
            "BENCH mamba2 batch {b} L {l} {p:?} checkpoint={ck}: {:.1} ms/step ({:.1} forward, {:.1} forward+backward), {:.0} samples/s, {:.0} tokens/s",
            s * 1e3,
            f * 1e3,
            fb * 1e3,
            b as f64 / s,
            (b * l) as f64 / s
        );
        }
    }
}

/// Median ms of `n` replays of `body` captured as a CUDA graph (each replay synchronised),
/// and the graph's node count.
fn graph_ms(dev: &Device, n: usize, mut body: impl FnMut(bool)) -> (f64, usize) {
    let g = fx_precision::CapturedGraph::capture(dev, 2, |dry| {
        body(dry);
        Ok(())
    })
    .unwrap();
    let mut ts = Vec::new();
    for i in 0..n + 3 {
        dev.synchronize().unwrap();
        let t0 = Instant::now();
        g.replay().unwrap();
        dev.synchronize().unwrap();
        if i >= 3 {
            ts.push(t0.elapsed().as_secs_f64() * 1e3);
        }
    }
    ts.sort_by(f64::total_cmp);
    (ts[ts.len() / 2], g.node_count().unwrap())
}

/// Where a captured step's time goes: the forward + loss, forward + backward, and the
/// whole step (the trainer's captured graph: fused clip + AdamW) each captured and
/// replayed on their own, with their node counts, at bench.py's sizes (dropout off in
/// the partial graphs; the step's dropout masks are counter-based).
#[test]
#[ignore]
fn gpu_graph_profile() {
    use fx_models::seq::{SeqTrainConfig, SeqTrainer};
    let dev = fx_hw::open_cuda(0).unwrap();
    let cfg = TftConfig::default();
    let (l, h) = (cfg.l_enc, cfg.h);
    let tft = Tft::new(cfg, &dev, 0).unwrap();
    let b = 256;
    let tft_batch = SeqBatch {
        inputs: vec![
            Tensor::randn(0f32, 1.0, (b, l, 51), &dev).unwrap(),
            Tensor::randn(0f32, 1.0, (b, l + h, 4), &dev).unwrap(),
        ],
        target: Tensor::randn(0f32, 0.01, (b, h), &dev).unwrap(),
        last_value: Tensor::zeros((b, h), DType::F32, &dev).unwrap(),
    };
    let m = Mamba2::new(Mamba2Config::default(), &dev, 0).unwrap();
    let mt = Mamba2Task { model: &m, seq_len: 256 };
    let mb = 32;
    let m_batch = SeqBatch {
        inputs: vec![Tensor::randn(0f32, 1.0, (mb, 256, 51), &dev).unwrap()],
        target: Tensor::randn(0f32, 0.01, (mb, 256), &dev).unwrap(),
        last_value: Tensor::zeros((mb, 256), DType::F32, &dev).unwrap(),
    };
    fn profile(name: &str, task: &impl SeqTask, batch: &SeqBatch, b: usize, dev: &Device) {
        for p in [Precision::F32, Precision::Bf16] {
            let c = Ctx::eval_with_grad(p);
            let (f, nf) = graph_ms(dev, 10, |_| drop(task.loss(&c, batch).unwrap()));
            let (fb, nfb) = graph_ms(dev, 10, |_| drop(task.loss_and_grads(&c, batch, false).unwrap()));
            let cfg = SeqTrainConfig {
                batch_size: b,
                precision: p,
                graph: fx_precision::GraphMode::On,
                ..Default::default()
            };
            let mut t = SeqTrainer::new(task, 0..task.window_len() * 4 + b, &cfg).unwrap();
            t.train_step(task, batch, false).unwrap();
            let nodes = t.graph_nodes().unwrap().unwrap();
            let mut ts = Vec::new();
            for i in 0..13 {
                dev.synchronize().unwrap();
                let t0 = Instant::now();
                t.train_step(task, batch, false).unwrap();
                dev.synchronize().unwrap();
                if i >= 3 {
                    ts.push(t0.elapsed().as_secs_f64() * 1e3);
                }
            }
            ts.sort_by(f64::total_cmp);
            let s = ts[ts.len() / 2];
            eprintln!(
                "PROFILE {name} b{b} {p:?} graph: forward+loss {f:.2} ms ({nf} nodes), +backward {fb:.2} ms ({nfb} nodes), \
                 whole step {s:.2} ms ({nodes} nodes) = {:.0} samples/s; backward {:.2} ms, clip+AdamW+dropout {:.2} ms",
                b as f64 / (s / 1e3),
                fb - f,
                s - fb
            );
        }
    }
    profile("tft", &tft, &tft_batch, b, &dev);
    profile("mamba2", &mt, &m_batch, mb, &dev);
}
