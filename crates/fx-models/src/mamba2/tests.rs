use candle_core::{DType, Device, Tensor};

use super::*;
use crate::seq_testing::{max_abs, rel_err, Fixture};
use fx_precision::Precision;

fn fixture_model() -> (Fixture, Mamba2) {
    let fx = Fixture::load("mamba2.safetensors");
    let cfg: Mamba2Config = serde_json::from_str(&fx.metadata["config"]).expect("config json");
    let m = Mamba2::new(cfg, &Device::Cpu, 1).unwrap();
    m.params().load_map(&fx.params(), "mamba2.safetensors").unwrap();
    (fx, m)
}

#[test]
fn names_and_shapes_match_fixture() {
    let (fx, m) = fixture_model();
    let params = fx.params();
    let ours = m.params().names_and_shapes();
    assert_eq!(ours.len(), params.len());
    for (n, s) in &ours {
        assert_eq!(params[n].dims(), s.as_slice(), "{n}");
    }
    assert_eq!(m.params().param_count().to_string(), fx.metadata["param_count"]);
    let d = Mamba2::new(Mamba2Config::default(), &Device::Cpu, 1).unwrap();
    assert_eq!(d.params().param_count(), 1_741_921);
}

#[test]
fn f32_parity_outputs_mid_loss_and_gradients() {
    let (fx, m) = fixture_model();
    let c = Ctx::eval_with_grad(Precision::F32);
    let (out, aux) = m.forward_aux(&c, fx.get("in.x")).unwrap();
    let tol = 1e-4;
    let e = rel_err(&out, fx.get("out.pred"));
    assert!(e <= tol, "out.pred rel err {e}");
    for (i, a) in aux.iter().enumerate() {
        for (k, t) in [("xBC", &a.xbc), ("dt", &a.dt), ("y_ssd", &a.y_ssd), ("y_gated", &a.y_gated), ("out", &a.out)] {
            let e = rel_err(t, fx.get(&format!("mid.layers.{i}.{k}")));
            assert!(e <= tol, "mid.layers.{i}.{k} rel err {e}");
        }
    }
    let loss = m.loss(&out, fx.get("in.target")).unwrap();
    let e = rel_err(&loss, fx.get("loss"));
    assert!(e <= tol, "loss rel err {e}");
    let grads = m.params().named_grads(&loss.backward().unwrap()).unwrap();
    for (name, _) in m.params().names_and_shapes() {
        let g = grads.get(&name).unwrap_or_else(|| panic!("no gradient for {name}"));
        let e = rel_err(g, fx.get(&format!("grad.{name}")));
        assert!(e <= tol, "grad.{name} rel err {e}");
    }
}

#[test]
fn bf16_parity() {
    let (fx, m) = fixture_model();
    let c = Ctx::eval_with_grad(Precision::Bf16);
    let out = m.forward(&c, fx.get("in.x")).unwrap();
    let e = rel_err(&out, fx.get("out.pred"));
    assert!(e <= 2e-2, "bf16 out rel err {e}");
    let loss = m.loss(&out, fx.get("in.target")).unwrap();
    let e = rel_err(&loss, fx.get("loss"));
    assert!(e <= 2e-2, "bf16 loss rel err {e}");
    let grads = m.params().named_grads(&loss.backward().unwrap()).unwrap();
    // A_log and dt_bias gradients are sums over every (batch, step, head) with heavy
    // cancellation, so BF16 matmul rounding upstream moves them by several percent:
    // the PyTorch reference itself under autocast BF16 (H200, torch 2.11, this
    // fixture) is 5.5% off on layers.1.mixer.A_log and 4.3% on layers.0.mixer.dt_bias.
    // Those get a 1e-1 bound; every other tensor and the whole gradient vector 2e-2.
    let loose = |n: &str| n.ends_with("A_log") || n.ends_with("dt_bias");
    let (mut all_ours, mut all_ref) = (Vec::new(), Vec::new());
    for (name, g) in &grads {
        let want = fx.get(&format!("grad.{name}"));
        let e = rel_err(g, want);
        let bound = if loose(name) { 1e-1 } else { 2e-2 };
        assert!(e <= bound, "bf16 grad.{name} rel err {e} > {bound}");
        all_ours.push(g.flatten_all().unwrap());
        all_ref.push(want.flatten_all().unwrap());
    }
    let e = rel_err(&Tensor::cat(&all_ours, 0).unwrap(), &Tensor::cat(&all_ref, 0).unwrap());
    assert!(e <= 2e-2, "bf16 whole-gradient rel err {e}");
}

/// A small model with two groups, a chunk that does not divide the test sequences and a
/// conv shorter than the default (shared by the step's tests).
pub(crate) fn small_cfg() -> Mamba2Config {
    Mamba2Config {
        n_in: 5,
        d_model: 8,
        n_layer: 2,
        expand: 2,
        d_state: 4,
        headdim: 4,
        ngroups: 2,
        d_conv: 3,
        chunk_size: 5,
        norm_eps: 1e-5,
    }
}

#[test]
fn every_parameter_receives_a_gradient() {
    let dev = Device::Cpu;
    let m = Mamba2::new(small_cfg(), &dev, 1).unwrap();
    let x = Tensor::randn(0f32, 1.0, (2, 13, 5), &dev).unwrap();
    let y = Tensor::randn(0f32, 1.0, (2, 13), &dev).unwrap();
    let out = m.forward(&Ctx::train(Precision::F32), &x).unwrap();
    let grads = m.params().named_grads(&m.loss(&out, &y).unwrap().backward().unwrap()).unwrap();
    for (name, _) in m.params().names_and_shapes() {
        let g = grads.get(&name).unwrap_or_else(|| panic!("{name} receives no gradient"));
        let a = max_abs(g);
        assert!(a > 0.0 && a.is_finite(), "{name}: zero/non-finite gradient");
    }
}

#[test]
fn recurrent_step_equals_chunked_forward() {
    // ngroups 2, chunk 5 not dividing L = 13: every step's output equals the chunked
    // forward's output at that position, in particular the last.
    let dev = Device::Cpu;
    let m = Mamba2::new(small_cfg(), &dev, 1).unwrap();
    let x = Tensor::randn(0f32, 1.0, (2, 13, 5), &dev).unwrap();
    let c = Ctx::inference(Precision::F32);
    let full = m.forward(&c, &x).unwrap();
    let mut st = m.init_state(2).unwrap();
    let mut outs = Vec::new();
    for t in 0..13 {
        outs.push(m.step(&c, &x.narrow(1, t, 1).unwrap().squeeze(1).unwrap(), &mut st).unwrap());
    }
    let stepped = Tensor::stack(&outs, 1).unwrap();
    let e = rel_err(&stepped, &full);
    assert!(e < 1e-5, "step vs chunked rel err {e}");
    let e = rel_err(&outs[12], &full.narrow(1, 12, 1).unwrap().squeeze(1).unwrap());
    assert!(e < 1e-5, "last output rel err {e}");
}

#[test]
fn causal_and_chunk_size_invariant() {
    let dev = Device::Cpu;
    let m = Mamba2::new(small_cfg(), &dev, 1).unwrap();
    let x = Tensor::randn(0f32, 1.0, (1, 11, 5), &dev).unwrap();
    let c = Ctx::inference(Precision::F32);
    let a = m.forward(&c, &x).unwrap();
    let mut m2 = m.clone();
    m2.cfg.chunk_size = 3;
    let b = m2.forward(&c, &x).unwrap();
    assert!(rel_err(&a, &b) < 1e-5);
    // changing the last step moves only the last output
    let x2 = Tensor::cat(&[&x.narrow(1, 0, 10).unwrap(), &(x.narrow(1, 10, 1).unwrap() + 1.0).unwrap()], 1).unwrap();
    let b = m.forward(&c, &x2).unwrap();
    assert_eq!(max_abs(&(a.narrow(1, 0, 10).unwrap() - b.narrow(1, 0, 10).unwrap()).unwrap()), 0.0);
    assert!(max_abs(&(a.narrow(1, 10, 1).unwrap() - b.narrow(1, 10, 1).unwrap()).unwrap()) > 0.0);
}

#[test]
fn inference_without_tape_and_save_load() {
    let (fx, m) = fixture_model();
    let out = m.forward(&Ctx::inference(Precision::F32), fx.get("in.x")).unwrap();
    assert!(rel_err(&out, fx.get("out.pred")) <= 1e-4);
    let g = out.sum_all().unwrap().backward().unwrap();
    assert!(m.params().named_grads(&g).unwrap().is_empty());

    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("m.safetensors");
    m.save(&p).unwrap();
    let m2 = Mamba2::load(m.config().clone(), &p, &Device::Cpu).unwrap();
    let out2 = m2.forward(&Ctx::inference(Precision::F32), fx.get("in.x")).unwrap();
    assert_eq!(rel_err(&out2, &out), 0.0);
    let mut bad = fx.params();
    bad.insert("layers.0.mixer.in_proj.bias".into(), Tensor::zeros(164, DType::F32, &Device::Cpu).unwrap());
    let err = m.params().load_map(&bad, "x").unwrap_err().to_string();
    assert!(err.contains("in_proj.bias"), "{err}");
}

#[test]
fn checkpointed_gradients_equal_plain() {
    let (fx, m) = fixture_model();
    let c = Ctx::eval_with_grad(Precision::F32);
    let (l1, g1) = m.loss_and_grads(&c, fx.get("in.x"), fx.get("in.target"), false).unwrap();
    let (l2, g2) = m.loss_and_grads(&c, fx.get("in.x"), fx.get("in.target"), true).unwrap();
    assert!(rel_err(&l2, &l1) <= 1e-6);
    let (g1, g2) = (m.params().named_grads(&g1).unwrap(), m.params().named_grads(&g2).unwrap());
    assert_eq!(g1.len(), g2.len());
    for (name, a) in &g1 {
        let e = rel_err(&g2[name], a);
        assert!(e <= 1e-5, "{name}: checkpointed vs plain rel err {e}");
        assert!(rel_err(&g2[name], fx.get(&format!("grad.{name}"))) <= 1e-4, "{name}");
    }
}

#[test]
fn prefill_then_step_continues_the_sequence() {
    // History of 9 bars through the chunked scan (chunk 5: a partial chunk at the
    // end), then 4 bars one at a time: equal to the chunked forward over all 13.
    let dev = Device::Cpu;
    let m = Mamba2::new(small_cfg(), &dev, 3).unwrap();
    let x = Tensor::randn(0f32, 1.0, (2, 13, 5), &dev).unwrap();
    let c = Ctx::inference(Precision::F32);
    let full = m.forward(&c, &x).unwrap();
    let (pre, mut st) = m.forward_with_state(&c, &x.narrow(1, 0, 9).unwrap()).unwrap();
    assert!(rel_err(&pre, &full.narrow(1, 0, 9).unwrap()) < 1e-5);
    for t in 9..13 {
        let y = m.step(&c, &x.narrow(1, t, 1).unwrap().squeeze(1).unwrap(), &mut st).unwrap();
        let e = rel_err(&y, &full.narrow(1, t, 1).unwrap().squeeze(1).unwrap());
        assert!(e < 1e-5, "step {t}: rel err {e}");
    }
    // a history shorter than the conv window (1 bar) also hands over correctly
    let (_, mut st) = m.forward_with_state(&c, &x.narrow(1, 0, 1).unwrap()).unwrap();
    let y = m.step(&c, &x.narrow(1, 1, 1).unwrap().squeeze(1).unwrap(), &mut st).unwrap();
    assert!(rel_err(&y, &full.narrow(1, 1, 1).unwrap().squeeze(1).unwrap()) < 1e-5);
}

/// Stepping through a state kept in its own buffers (`to_buffers` + `assign`, as a captured
/// step does) continues the sequence as stepping the state itself does; a state of views
/// is refused by `assign` in one line.
#[test]
fn state_buffers_assign_in_place() {
    let dev = Device::Cpu;
    let m = Mamba2::new(small_cfg(), &dev, 4).unwrap();
    let x = Tensor::randn(0f32, 1.0, (2, 12, 5), &dev).unwrap();
    let c = Ctx::inference(Precision::F32);
    let full = m.forward(&c, &x).unwrap();
    let (_, views) = m.forward_with_state(&c, &x.narrow(1, 0, 8).unwrap()).unwrap();
    let st = views.to_buffers().unwrap();
    for t in 8..12 {
        let mut next = st.clone();
        let y = m.step(&c, &x.narrow(1, t, 1).unwrap().squeeze(1).unwrap(), &mut next).unwrap();
        st.assign(&next).unwrap();
        let e = rel_err(&y, &full.narrow(1, t, 1).unwrap().squeeze(1).unwrap());
        assert!(e < 1e-5, "step {t}: rel err {e}");
    }
    let other = m.init_state(1).unwrap();
    assert!(st.assign(&other).is_err(), "another batch size must be refused");
    if views.assign(&st).is_err() {
        let e = views.assign(&st).unwrap_err().to_string();
        assert!(e.contains("to_buffers") && !e.contains('\n'), "{e}");
    }
}

/// Where a MAMBA-2 training step spends its time on the GPU: one layer forward +
/// backward, and the chunked SSD alone, at the benchmark size. Run on the device with
/// `--ignored --nocapture`.
#[cfg(feature = "cuda")]
#[test]
#[ignore]
fn gpu_layer_timings() {
    use candle_core::Var;
    use std::time::Instant;
    let dev = fx_hw::open_cuda(0).unwrap();
    let cfg = Mamba2Config::default();
    let (b, l) = (32, 256);
    let m = Mamba2::new(cfg.clone(), &dev, 0).unwrap();
    let c = Ctx::train(Precision::F32);
    let time = |name: &str, f: &dyn Fn() -> Tensor| {
        let mut v = Vec::new();
        for i in 0..8 {
            dev.synchronize().unwrap();
            let t0 = Instant::now();
            let out = f();
            dev.synchronize().unwrap();
            let t1 = Instant::now();
            let g = out.sqr().unwrap().mean_all().unwrap().backward().unwrap();
            dev.synchronize().unwrap();
            drop(g);
            if i >= 3 {
                v.push(((t1 - t0).as_secs_f64() * 1e3, t1.elapsed().as_secs_f64() * 1e3));
            }
        }
        v.sort_by(|a, b| a.1.total_cmp(&b.1));
        let (f, bw) = v[v.len() / 2];
        eprintln!("STAGE {name}: forward {f:.1} ms, backward {bw:.1} ms");
    };
    let h = Var::from_tensor(&Tensor::randn(0f32, 1.0, (b, l, cfg.d_model), &dev).unwrap()).unwrap();
    time("one layer", &|| m.layer_fwd(&c, &m.layers[0], h.as_tensor()).unwrap().0);
    let (nh, p, n) = (cfg.nheads(), cfg.headdim, cfg.d_state);
    let v = |s: &[usize], scale: f32| {
        Var::from_tensor(&(Tensor::randn(0f32, 1.0, s, &dev).unwrap() * scale as f64).unwrap()).unwrap()
    };
    let x = v(&[b, l, nh, p], 1.0);
    let a = Var::from_tensor(&Tensor::rand(-0.5f32, -0.01, (b, l, nh), &dev).unwrap()).unwrap();
    let bm = v(&[b, l, nh, n], 1.0);
    let cm = v(&[b, l, nh, n], 1.0);
    time("ssd_chunked (chunk 64)", &|| {
        ssd::ssd_chunked(&c, x.as_tensor(), a.as_tensor(), bm.as_tensor(), cm.as_tensor(), 64).unwrap().0
    });
    time("in_proj matmul", &|| c.linear(h.as_tensor(), &c.p(&m.layers[0].mixer.in_proj).unwrap(), None).unwrap());
}
