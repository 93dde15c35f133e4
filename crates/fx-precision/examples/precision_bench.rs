//! DQN-shaped training step under each precision policy: step time, device memory and
//! the loss reached after a fixed number of steps (F32 vs BF16 vs F16 + GradScaler).
//!
//! The step mirrors `shared/reference/bench.py`'s DQN case so the numbers compare with
//! PyTorch's: dueling DQN 56→256→256→128→(1 + 3), online forward on s and s', target
//! forward on s', double-DQN Huber loss (F32), backward, clip at global norm 10, AdamW
//! (lr 1e-4, wd 0.01), soft target update (tau 0.005); one fixed random batch.
//!
//! ```text
//! cargo run --release -p fx-precision --example precision_bench -- --device cpu --batch 256 --steps 5 --train-steps 20
//! precision_bench --device cuda --batch 8192            # on the GPU (feature `cuda`)
//! precision_bench --mode checkpoint --device cuda --batch 4096   # checkpointing memory
//! ```
//! Output: one JSON line per precision, then a table.

use std::time::Instant;

use candle_core::{DType, Device, Module, Tensor, Var, D};
use candle_nn::VarMap;
use fx_precision::{to_f32, AdamW, AdamWConfig, GradScaler, Linear, Optimizer, Precision, PrecisionExt, TrainStep};

type Res<T> = Result<T, Box<dyn std::error::Error>>;

/// SplitMix64 draws, so every precision starts from identical weights and data.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> f64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        ((z ^ (z >> 31)) >> 11) as f64 / (1u64 << 53) as f64
    }
    fn normal(&mut self) -> f64 {
        let (u, v) = (self.next().max(1e-300), self.next());
        (-2.0 * u.ln()).sqrt() * (2.0 * std::f64::consts::PI * v).cos()
    }
    fn tensor(&mut self, dims: &[usize], f: impl Fn(&mut Self) -> f64, dev: &Device) -> Res<Tensor> {
        let n: usize = dims.iter().product();
        let v: Vec<f32> = (0..n).map(|_| f(self) as f32).collect();
        Ok(Tensor::from_vec(v, dims, &Device::Cpu)?.to_device(dev)?)
    }
}

const LAYERS: [(&str, usize, usize); 5] =
    [("trunk.0", 56, 256), ("trunk.1", 256, 256), ("trunk.2", 256, 128), ("value", 128, 1), ("advantage", 128, 3)];

struct Dqn {
    layers: Vec<Linear>,
}

impl Dqn {
    /// Builds the net in `varmap` from `init` (name → tensor) under `precision`.
    fn new(varmap: &VarMap, init: &[(String, Tensor)], dev: &Device, p: Precision) -> Res<Self> {
        let mut data = varmap.data().lock().map_err(|_| "varmap lock")?;
        let mut layers = Vec::new();
        for (name, _, _) in LAYERS {
            let get = |k: &str| -> Res<Tensor> {
                let t = init.iter().find(|(n, _)| n == &format!("{name}.{k}")).ok_or("init")?;
                Ok(t.1.to_device(dev)?.copy()?)
            };
            let w = Var::from_tensor(&get("weight")?)?;
            let b = Var::from_tensor(&get("bias")?)?;
            layers.push(Linear::from_parts(w.as_tensor().clone(), Some(b.as_tensor().clone()), p)?);
            data.insert(format!("{name}.weight"), w);
            data.insert(format!("{name}.bias"), b);
        }
        Ok(Dqn { layers })
    }

    /// Q-values in F32: value + advantage - mean(advantage).
    fn q(&self, s: &Tensor) -> candle_core::Result<Tensor> {
        let mut z = s.clone();
        for l in &self.layers[..3] {
            z = l.forward(&z)?.relu()?;
        }
        let v = to_f32(&self.layers[3].forward(&z)?)?;
        let a = to_f32(&self.layers[4].forward(&z)?)?;
        a.broadcast_sub(&a.mean_keepdim(D::Minus1)?)?.broadcast_add(&v)
    }
}

struct Batch {
    s: Tensor,
    a: Tensor,
    r: Tensor,
    s2: Tensor,
    d: Tensor,
}

fn dqn_loss(online: &Dqn, target: &Dqn, b: &Batch) -> candle_core::Result<Tensor> {
    let q = online.q(&b.s)?;
    let q_sa = q.gather(&b.a.unsqueeze(1)?, 1)?.squeeze(1)?;
    let a_star = online.q(&b.s2)?.detach().argmax_keepdim(1)?;
    let q_t = target.q(&b.s2)?.detach().gather(&a_star, 1)?.squeeze(1)?;
    let y = (&b.r + ((1.0 - &b.d)? * 0.99)?.mul(&q_t)?)?.detach();
    let diff = (q_sa - y)?.abs()?;
    let quad = diff.clamp(0.0, 1.0)?;
    let huber = ((quad.sqr()? * 0.5)? + (diff - &quad)?)?;
    huber.mean_all()
}

fn soft_update(target: &VarMap, online: &VarMap, tau: f64) -> Res<()> {
    let t = target.data().lock().map_err(|_| "lock")?;
    let o = online.data().lock().map_err(|_| "lock")?;
    for (name, tv) in t.iter() {
        let ov = o.get(name).ok_or("param")?;
        let next = (tv.as_tensor() + ((ov.as_tensor() - tv.as_tensor())? * tau)?)?;
        tv.set(&next)?;
    }
    Ok(())
}

fn device_used_bytes(dev: &Device) -> Option<u64> {
    #[cfg(feature = "cuda")]
    {
        if let Ok(cd) = dev.as_cuda_device() {
            let stream = cd.cuda_stream();
            stream.synchronize().ok()?;
            let (free, total) = stream.context().mem_get_info().ok()?;
            return Some((total - free) as u64);
        }
    }
    let _ = dev;
    None
}

struct Args {
    mode: String,
    device: String,
    batch: usize,
    steps: usize,
    train_steps: usize,
    precisions: Vec<Precision>,
}

fn parse_args() -> Res<Args> {
    let mut a = Args {
        mode: "dqn".into(),
        device: "cpu".into(),
        batch: 8192,
        steps: 100,
        train_steps: 300,
        precisions: vec![Precision::F32, Precision::Bf16, Precision::F16],
    };
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let mut i = 0;
    while i < argv.len() {
        let val = argv.get(i + 1).cloned().ok_or_else(|| format!("{} needs a value", argv[i]))?;
        match argv[i].as_str() {
            "--mode" => a.mode = val,
            "--device" => a.device = val,
            "--batch" => a.batch = val.parse()?,
            "--steps" => a.steps = val.parse()?,
            "--train-steps" => a.train_steps = val.parse()?,
            "--precisions" => a.precisions = val.split(',').map(|p| p.parse()).collect::<Result<_, _>>()?,
            other => return Err(format!("unknown argument {other}").into()),
        }
        i += 2;
    }
    Ok(a)
}

fn main() -> Res<()> {
    let args = parse_args()?;
    let dev = match args.device.as_str() {
        "cpu" => Device::Cpu,
        #[cfg(feature = "cuda")]
        "cuda" => fx_hw::open_cuda(0)?,
        #[cfg(not(feature = "cuda"))]
        "cuda" => return Err("built without the `cuda` feature".into()),
        other => return Err(format!("unknown device {other}").into()),
    };
    // Warm the device (context, cuBLAS handle) before the memory baseline.
    let w = Tensor::ones((64, 64), DType::F32, &dev)?;
    let _ = w
        .matmul(&w)?
        .to_dtype(DType::BF16)?
        .matmul(&w.to_dtype(DType::BF16)?)?
        .sum_all()?
        .to_dtype(DType::F32)?
        .to_scalar::<f32>()?;
    if args.mode == "checkpoint" {
        return checkpoint_memory(&dev, &args);
    }
    let mut rng = Rng(20261129);
    let mut init = Vec::new();
    for (name, i, o) in LAYERS {
        let bound = 1.0 / (i as f64).sqrt();
        let u = move |r: &mut Rng| (2.0 * r.next() - 1.0) * bound;
        init.push((format!("{name}.weight"), rng.tensor(&[o, i], u, &Device::Cpu)?));
        init.push((format!("{name}.bias"), rng.tensor(&[o], u, &Device::Cpu)?));
    }
    let n = args.batch;
    let obs = |r: &mut Rng| -> Res<Tensor> {
        let s = r.tensor(&[n, 56], |r| r.normal(), &dev)?;
        // Like bench.py's rl_batch: the last two features (position one-hot tail) are 0.
        let mask =
            Tensor::cat(&[Tensor::ones((1, 54), DType::F32, &dev)?, Tensor::zeros((1, 2), DType::F32, &dev)?], 1)?;
        Ok(s.broadcast_mul(&mask)?)
    };
    let batch = Batch {
        s: obs(&mut rng)?,
        s2: obs(&mut rng)?,
        a: Tensor::from_vec((0..n).map(|_| (rng.next() * 3.0) as u32).collect::<Vec<_>>(), n, &Device::Cpu)?
            .to_device(&dev)?,
        r: rng.tensor(&[n], |r| r.normal(), &dev)?,
        d: rng.tensor(&[n], |r| if r.next() < 0.05 { 1.0 } else { 0.0 }, &dev)?,
    };
    let base = device_used_bytes(&dev);
    let mut rows = Vec::new();
    for &p in &args.precisions {
        let (online_vm, target_vm) = (VarMap::new(), VarMap::new());
        let online = Dqn::new(&online_vm, &init, &dev, p)?;
        let target = Dqn::new(&target_vm, &init, &dev, p)?;
        let opt = AdamW::from_varmap(
            &online_vm,
            AdamWConfig { lr: 1e-4, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.01 },
        )?;
        let mut ts = TrainStep::new(opt, GradScaler::for_precision(p), Some(10.0))?;
        let step = |ts: &mut TrainStep<AdamW>| -> Res<f64> {
            let loss = dqn_loss(&online, &target, &batch)?;
            let r = ts.step(&loss)?;
            soft_update(&target_vm, &online_vm, 0.005)?;
            Ok(r.loss)
        };
        let mut times = Vec::new();
        let mut last = f64::NAN;
        let mut losses = Vec::new();
        let total = args.train_steps.max(args.steps + 5);
        for k in 0..total {
            let t0 = Instant::now();
            last = step(&mut ts)?; // each step reads its loss back: a full device sync
            losses.push(last);
            if k >= 5 && times.len() < args.steps {
                times.push(t0.elapsed().as_secs_f64() * 1e3);
            }
            if k + 1 == args.train_steps {
                break;
            }
        }
        let train_loss = last;
        let tail = &losses[losses.len().saturating_sub(50)..];
        let tail_mean = tail.iter().sum::<f64>() / tail.len().max(1) as f64;
        // Working set of a step: device memory in use at the end of a backward (the
        // graph's activations and the gradients alive) minus in use with the model and
        // optimiser idle. Kernel modules and cuBLAS workspaces are loaded by then, so
        // they fall out of the difference. The driver counts in 2 MiB pages.
        let idle = device_used_bytes(&dev);
        let held = {
            let loss = dqn_loss(&online, &target, &batch)?;
            let grads = ts.scale_loss(&loss)?.backward()?;
            let used = device_used_bytes(&dev);
            drop((grads, loss));
            used
        };
        times.sort_by(|a, b| a.partial_cmp(b).unwrap_or(std::cmp::Ordering::Equal));
        let med = times.get(times.len() / 2).copied().unwrap_or(f64::NAN);
        let mib = |b: u64| b as f64 / (1 << 20) as f64;
        let mem_mib = match (held, idle) {
            (Some(h), Some(i)) => Some(mib(h.saturating_sub(i))),
            _ => None,
        };
        let idle_mib = match (idle, base) {
            (Some(i), Some(b)) => Some(mib(i.saturating_sub(b))),
            _ => None,
        };
        let stats = ts.stats();
        let line = serde_json::json!({
            "case": format!("fx_dqn_train_b{n}"), "precision": p.as_str(), "device": args.device,
            "compute_dtype": format!("{:?}", p.compute_dtype()),
            "steps_timed": times.len(), "step_ms_median": med, "samples_per_s": n as f64 / (med / 1e3),
            "train_steps": args.train_steps, "final_loss": train_loss,
            "step_working_set_mib": mem_mib, "idle_above_start_mib": idle_mib,
            "mean_loss_last_50": tail_mean,
            "loss_scale": ts.scaler().scale_factor(),
            "skipped_steps": stats.nonfinite_loss + stats.nonfinite_grad,
            "optimizer_steps": ts.optimizer().step_count(),
        });
        println!("{line}");
        rows.push((p, med, train_loss, mem_mib, stats, tail_mean));
    }
    let f32_loss = rows.iter().find(|r| r.0 == Precision::F32).map(|r| (r.2, r.5));
    println!(
        "\n| precision | step ms (median) | samples/s | step working set MiB | loss after {} steps (vs F32) | mean of last 50 (vs F32) | skipped |",
        args.train_steps
    );
    println!("| --- | --- | --- | --- | --- | --- | --- |");
    for (p, med, loss, mem, st, tail) in &rows {
        let rel = |x: f64, f: f64| format!("{:+.2}%", (x - f) / f * 100.0);
        let (r1, r2) = f32_loss.map(|(f, ft)| (rel(*loss, f), rel(*tail, ft))).unwrap_or_default();
        let mem = mem.map(|m| format!("{m:.1}")).unwrap_or_else(|| "n/a".into());
        println!(
            "| {p} | {med:.3} | {:.3e} | {mem} | {loss:.6} ({r1}) | {tail:.6} ({r2}) | {} |",
            n as f64 / (med / 1e3),
            st.nonfinite_grad + st.nonfinite_loss
        );
    }
    Ok(())
}

/// Activation checkpointing on the device: a deep MLP stack (16 segments of two
/// 1024-wide Linear+tanh layers), plain vs checkpointed: device memory in use after the
/// forward (what the backward needs kept) and the step time (recompute costs a forward).
fn checkpoint_memory(dev: &Device, args: &Args) -> Res<()> {
    use fx_precision::Recomputed;
    let (segments, width, n) = (16usize, 1024usize, args.batch);
    let p = args.precisions.first().copied().unwrap_or(Precision::F32);
    let mut rng = Rng(7);
    let mut layers = Vec::new();
    for _ in 0..segments * 2 {
        let bound = 1.0 / (width as f64).sqrt();
        let w = Var::from_tensor(&rng.tensor(&[width, width], |r| (2.0 * r.next() - 1.0) * bound, dev)?)?;
        let b = Var::from_tensor(&rng.tensor(&[width], |_| 0.0, dev)?)?;
        layers.push(Linear::from_parts(w.as_tensor().clone(), Some(b.as_tensor().clone()), p)?);
    }
    let mut stack = Recomputed::new();
    for pair in layers.chunks(2) {
        let pair = pair.to_vec();
        stack = stack.push(move |h: &Tensor| {
            let mut y = h.clone();
            for l in &pair {
                y = l.forward(&y)?.tanh()?;
            }
            Ok(y)
        });
    }
    let x = rng.tensor(&[n, width], |r| r.normal(), dev)?;
    let mut rows = Vec::new();
    for checkpointed in [false, true] {
        let (mut held, mut idle) = (None, None);
        let mut times = Vec::new();
        for k in 0..(args.steps.clamp(1, 20) + 2) {
            // Measured on the second pass, once kernels and workspaces are loaded.
            if k == 1 {
                idle = device_used_bytes(dev);
            }
            let t0 = Instant::now();
            let grads = if checkpointed {
                let tape = stack.forward(&x)?;
                let loss = to_f32(tape.output())?.sqr()?.mean_all()?;
                if k == 1 {
                    held = device_used_bytes(dev);
                }
                stack.backward(tape, &loss)?
            } else {
                let loss = to_f32(&stack.forward_plain(&x)?)?.sqr()?.mean_all()?;
                if k == 1 {
                    held = device_used_bytes(dev);
                }
                loss.backward()?
            };
            drop(grads);
            dev.synchronize()?;
            if k >= 2 {
                times.push(t0.elapsed().as_secs_f64() * 1e3);
            }
        }
        times.sort_by(|a, b| a.partial_cmp(b).unwrap_or(std::cmp::Ordering::Equal));
        let med = times.get(times.len() / 2).copied().unwrap_or(f64::NAN);
        let mib = match (held, idle) {
            (Some(h), Some(b)) => Some(h.saturating_sub(b) as f64 / (1 << 20) as f64),
            _ => None,
        };
        println!(
            "{}",
            serde_json::json!({"case": "checkpoint_mlp", "precision": p.as_str(), "checkpointed": checkpointed,
                "segments": segments, "width": width, "batch": n, "device_mib_after_forward": mib,
                "step_ms_median": med})
        );
        rows.push((checkpointed, mib, med));
    }
    println!("\n| stack | device MiB held after forward | fwd+bwd ms (median) |");
    println!("| --- | --- | --- |");
    for (c, mib, med) in rows {
        let mib = mib.map(|m| format!("{m:.1}")).unwrap_or_else(|| "n/a".into());
        println!("| {} | {mib} | {med:.2} |", if c { "checkpointed" } else { "plain" });
    }
    Ok(())
}
