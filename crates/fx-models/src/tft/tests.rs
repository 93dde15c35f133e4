use std::collections::HashMap;

use candle_core::{DType, Device, Tensor};

use super::*;
use crate::seq_testing::{max_abs, rel_err, Fixture};
use fx_precision::Precision;

fn fixture_model() -> (Fixture, Tft) {
    let fx = Fixture::load("tft.safetensors");
    let cfg: TftConfig = serde_json::from_str(&fx.metadata["config"]).expect("config json");
    assert_eq!(cfg.dropout, 0.0);
    let m = Tft::new(cfg, &Device::Cpu, 1).unwrap();
    m.params().load_map(&fx.params(), "tft.safetensors").unwrap();
    (fx, m)
}

fn zero_grad_names(fx: &Fixture) -> Vec<String> {
    serde_json::from_str(&fx.metadata["analytic_zero_grads"]).unwrap()
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
}

#[test]
fn default_param_count_matches_reference() {
    let m = Tft::new(TftConfig::default(), &Device::Cpu, 1).unwrap();
    assert_eq!(m.params().param_count(), 5_870_026);
}

#[test]
fn f32_parity_outputs_mid_loss_and_gradients() {
    let (fx, m) = fixture_model();
    let c = Ctx::eval_with_grad(Precision::F32);
    let (out, aux) = m.forward_aux(&c, fx.get("in.observed"), fx.get("in.known")).unwrap();
    let tol = 1e-4;
    let e = rel_err(&out, fx.get("out.quantiles"));
    assert!(e <= tol, "out.quantiles rel err {e}");
    let mids = [
        ("enc_vsn_weights", &aux.enc_vsn_weights),
        ("dec_vsn_weights", &aux.dec_vsn_weights),
        ("vsn_out", &aux.vsn_out),
        ("lstm_out", &aux.lstm_out),
        ("phi", &aux.phi),
        ("enriched", &aux.enriched),
        ("attn_weights", &aux.attn_weights),
        ("attn_out", &aux.attn_out),
    ];
    for (k, t) in mids {
        let e = rel_err(t, fx.get(&format!("mid.{k}")));
        assert!(e <= tol, "mid.{k} rel err {e}");
    }
    let loss = m.loss(&out, fx.get("in.target")).unwrap();
    let e = rel_err(&loss, fx.get("loss"));
    assert!(e <= tol, "loss rel err {e}");

    let grads = m.params().named_grads(&loss.backward().unwrap()).unwrap();
    let zeros = zero_grad_names(&fx);
    assert_eq!(zeros.len(), 4);
    for (name, _) in m.params().names_and_shapes() {
        let g = grads.get(&name).unwrap_or_else(|| panic!("no gradient for {name}"));
        let want = fx.get(&format!("grad.{name}"));
        if zeros.contains(&name) {
            assert_eq!(max_abs(want), 0.0);
            let a = max_abs(g);
            assert!(a <= 1e-6, "grad.{name}: max |g| {a}");
        } else {
            let e = rel_err(g, want);
            assert!(e <= tol, "grad.{name} rel err {e}");
        }
    }
}

#[test]
fn every_parameter_receives_a_gradient() {
    // Fresh random weights and inputs, dropout active: every parameter except the
    // analytically-zero key biases must get a non-zero gradient.
    let cfg = TftConfig { d: 8, n_head: 2, l_enc: 6, h: 3, n_observed: 5, ..TftConfig::default() };
    let dev = Device::Cpu;
    let m = Tft::new(cfg.clone(), &dev, 1).unwrap();
    let obs = Tensor::randn(0f32, 1.0, (3, 6, 5), &dev).unwrap();
    let known = Tensor::randn(0f32, 1.0, (3, 9, 4), &dev).unwrap();
    let y = Tensor::randn(0f32, 1.0, (3, 3), &dev).unwrap();
    let out = m.forward(&Ctx::train(Precision::F32), &obs, &known).unwrap();
    let grads = m.params().named_grads(&m.loss(&out, &y).unwrap().backward().unwrap()).unwrap();
    for (name, _) in m.params().names_and_shapes() {
        let g = grads.get(&name).unwrap_or_else(|| panic!("{name} receives no gradient"));
        if name.starts_with("attn.k.") && name.ends_with(".bias") {
            continue;
        }
        assert!(max_abs(g) > 0.0 && max_abs(g).is_finite(), "{name}: zero/non-finite gradient");
    }
}

#[test]
fn bf16_parity() {
    let (fx, m) = fixture_model();
    let c = Ctx::eval_with_grad(Precision::Bf16);
    let out = m.forward(&c, fx.get("in.observed"), fx.get("in.known")).unwrap();
    assert_eq!(out.dtype(), DType::F32);
    let e = rel_err(&out, fx.get("out.quantiles"));
    assert!(e <= 2e-2, "bf16 out rel err {e}");
    let loss = m.loss(&out, fx.get("in.target")).unwrap();
    let e = rel_err(&loss, fx.get("loss"));
    assert!(e <= 2e-2, "bf16 loss rel err {e}");
    let grads = m.params().named_grads(&loss.backward().unwrap()).unwrap();
    let zeros = zero_grad_names(&fx);
    let mut worst = (0.0, String::new());
    for (name, g) in &grads {
        if zeros.contains(name) {
            continue;
        }
        let e = rel_err(g, fx.get(&format!("grad.{name}")));
        if e > worst.0 {
            worst = (e, name.clone());
        }
    }
    assert!(worst.0 <= 2e-2, "bf16 worst grad rel err {worst:?}");
}

#[test]
fn inference_without_tape_matches_and_builds_no_graph() {
    let (fx, m) = fixture_model();
    let out = m.forward(&Ctx::inference(Precision::F32), fx.get("in.observed"), fx.get("in.known")).unwrap();
    assert!(rel_err(&out, fx.get("out.quantiles")) <= 1e-4);
    // No tape: backward finds no parameter.
    let g = out.sum_all().unwrap().backward().unwrap();
    assert!(m.params().named_grads(&g).unwrap().is_empty());
}

#[test]
fn decoder_causality() {
    // Changing the known inputs of the last decoder step must not move earlier horizons.
    let (fx, m) = fixture_model();
    let c = Ctx::inference(Precision::F32);
    let known = fx.get("in.known");
    let out = m.forward(&c, fx.get("in.observed"), known).unwrap();
    let l = m.config().l_enc + m.config().h;
    let bumped =
        Tensor::cat(&[&known.narrow(1, 0, l - 1).unwrap(), &(known.narrow(1, l - 1, 1).unwrap() + 0.7).unwrap()], 1)
            .unwrap();
    let out2 = m.forward(&c, fx.get("in.observed"), &bumped).unwrap();
    let h = m.config().h;
    let d_early = max_abs(&(out.narrow(1, 0, h - 1).unwrap() - out2.narrow(1, 0, h - 1).unwrap()).unwrap());
    let d_last = max_abs(&(out.narrow(1, h - 1, 1).unwrap() - out2.narrow(1, h - 1, 1).unwrap()).unwrap());
    assert_eq!(d_early, 0.0);
    assert!(d_last > 0.0);
}

#[test]
fn save_load_round_trip_and_errors() {
    let (fx, m) = fixture_model();
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("tft.safetensors");
    m.save(&p).unwrap();
    let m2 = Tft::load(m.config().clone(), &p, &Device::Cpu).unwrap();
    let c = Ctx::inference(Precision::F32);
    let a = m.forward(&c, fx.get("in.observed"), fx.get("in.known")).unwrap();
    let b = m2.forward(&c, fx.get("in.observed"), fx.get("in.known")).unwrap();
    assert_eq!(rel_err(&a, &b), 0.0);
    // the saved file has exactly the fixture's parameter names
    let saved = candle_core::safetensors::load(&p, &Device::Cpu).unwrap();
    let mut k1: Vec<_> = saved.keys().cloned().collect();
    let mut k2: Vec<_> = fx.params().keys().cloned().collect();
    k1.sort();
    k2.sort();
    assert_eq!(k1, k2);

    let mut bad: HashMap<String, Tensor> = fx.params();
    bad.insert("enc_vsn.vars.3.fc1.weight".into(), Tensor::zeros((16, 15), DType::F32, &Device::Cpu).unwrap());
    let err = m.params().load_map(&bad, "x").unwrap_err().to_string();
    assert!(err.contains("enc_vsn.vars.3.fc1.weight"), "{err}");
    let mut bad = fx.params();
    bad.remove("lstm_dec.bias_hh_l0");
    assert!(matches!(m.params().load_map(&bad, "x"), Err(Error::MissingTensor { .. })));
    let mut bad = fx.params();
    bad.insert("lstm_dec.bias_hh_l1".into(), Tensor::zeros(64, DType::F32, &Device::Cpu).unwrap());
    assert!(matches!(m.params().load_map(&bad, "x"), Err(Error::UnknownTensor { .. })));
}

#[test]
fn checkpointed_gradients_equal_plain() {
    let (fx, m) = fixture_model();
    let (obs, known, y) = (fx.get("in.observed"), fx.get("in.known"), fx.get("in.target"));
    let c = Ctx::eval_with_grad(Precision::F32);
    let (l1, g1) = m.loss_and_grads(&c, obs, known, y, false).unwrap();
    let (l2, g2) = m.loss_and_grads(&c, obs, known, y, true).unwrap();
    assert!(rel_err(&l2, &l1) <= 1e-6);
    assert!(rel_err(&l1, fx.get("loss")) <= 1e-4);
    let (g1, g2) = (m.params().named_grads(&g1).unwrap(), m.params().named_grads(&g2).unwrap());
    assert_eq!(g1.len(), g2.len());
    for (name, a) in &g1 {
        let b = &g2[name];
        if name.starts_with("attn.k.") && name.ends_with(".bias") {
            assert!(max_abs(b) <= 1e-6, "{name}");
        } else {
            let e = rel_err(b, a);
            assert!(e <= 1e-5, "{name}: checkpointed vs plain rel err {e}");
        }
    }
}

#[test]
fn checkpointed_dropout_replays_masks() {
    // With dropout on, the checkpointed backward must use the forward's masks: the same
    // recorded masks replayed through the plain path give the same loss and gradients.
    let cfg = TftConfig { d: 8, n_head: 2, l_enc: 5, h: 2, n_observed: 3, dropout: 0.3, ..TftConfig::default() };
    let dev = Device::Cpu;
    let m = Tft::new(cfg, &dev, 1).unwrap();
    let obs = Tensor::randn(0f32, 1.0, (4, 5, 3), &dev).unwrap();
    let known = Tensor::randn(0f32, 1.0, (4, 7, 4), &dev).unwrap();
    let y = Tensor::randn(0f32, 1.0, (4, 2), &dev).unwrap();
    let masks = crate::seq::ops::DropoutMasks::new();
    let c = Ctx::train(Precision::F32).with_masks(&masks);
    let (l1, g1) = m.loss_and_grads(&c, &obs, &known, &y, true).unwrap();
    let (l2, g2) = m.loss_and_grads(&c, &obs, &known, &y, false).unwrap();
    assert!(rel_err(&l1, &l2) <= 1e-6);
    let (g1, g2) = (m.params().named_grads(&g1).unwrap(), m.params().named_grads(&g2).unwrap());
    for (name, a) in &g2 {
        if !(name.starts_with("attn.k.") && name.ends_with(".bias")) {
            let e = rel_err(&g1[name], a);
            assert!(e <= 1e-5, "{name}: {e}");
        }
    }
    // and dropout really was active: a fresh-mask forward differs
    let (l3, _) = m.loss_and_grads(&Ctx::train(Precision::F32), &obs, &known, &y, false).unwrap();
    assert!(rel_err(&l3, &l1) > 0.0);
}

#[test]
fn initialisation_is_seeded() {
    let cfg = TftConfig { d: 8, n_head: 2, l_enc: 4, h: 2, n_observed: 3, ..TftConfig::default() };
    let a = Tft::new(cfg.clone(), &Device::Cpu, 5).unwrap().params().to_map().unwrap();
    let b = Tft::new(cfg.clone(), &Device::Cpu, 5).unwrap().params().to_map().unwrap();
    let c = Tft::new(cfg, &Device::Cpu, 6).unwrap().params().to_map().unwrap();
    let w = "enc_vsn.vars.2.fc1.weight";
    assert_eq!(rel_err(&a[w], &b[w]), 0.0);
    assert!(rel_err(&a[w], &c[w]) > 0.1);
    // PyTorch's Linear scheme: |w| ≤ 1/sqrt(fan_in)
    assert!(max_abs(&a[w]) <= 1.0 / 8f64.sqrt());
    assert!(max_abs(&a["lstm_enc.weight_hh_l0"]) <= 1.0 / 8f64.sqrt());
}

/// Where a TFT training step spends its time on the GPU: forward + backward of each
/// stage on its own (inputs as leaves), at the benchmark size. Run on the device with
/// `--ignored --nocapture`.
#[cfg(feature = "cuda")]
#[test]
#[ignore]
fn gpu_stage_timings() {
    use candle_core::Var;
    use std::time::Instant;
    let dev = fx_hw::open_cuda(0).unwrap();
    let cfg = TftConfig::default();
    let (b, l, h, d) = (256, cfg.l_enc, cfg.h, cfg.d);
    let m = Tft::new(cfg, &dev, 0).unwrap();
    let c = Ctx::train(Precision::F32);
    let packed = m
        .pack(
            &Tensor::randn(0f32, 1.0, (b, l, 51), &dev).unwrap(),
            &Tensor::randn(0f32, 1.0, (b, l + h, 4), &dev).unwrap(),
            None,
        )
        .unwrap();
    let vsn_in = Var::from_tensor(&Tensor::randn(0f32, 1.0, (b, l + h, d), &dev).unwrap()).unwrap();
    let pe_in = Var::from_tensor(&Tensor::randn(0f32, 1.0, (b, l + h, 2 * d), &dev).unwrap()).unwrap();
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
    time("vsn (embeddings + enc/dec VSN)", &|| m.stage_vsn(&c, &packed).unwrap().0);
    time("temporal (LSTMs + gated skip + enrich)", &|| m.stage_temporal(&c, vsn_in.as_tensor(), None).unwrap().0);
    time("lstm_enc only", &|| {
        let z = Tensor::zeros((b, d), DType::F32, &dev).unwrap();
        m.lstm_enc.fwd(&c, &vsn_in.as_tensor().narrow(1, 0, l).unwrap(), (z.clone(), z)).unwrap().0
    });
    time("attention..head", &|| m.stage_attention(&c, pe_in.as_tensor()).unwrap().0);
}

#[test]
fn quantiles_outside_the_unit_interval_or_unsorted_are_refused() {
    for q in [vec![0.5, 0.1], vec![0.0, 0.5], vec![0.1, 0.1, 0.9], vec![0.5, 1.0], vec![f64::NAN]] {
        let cfg = TftConfig { d: 8, n_head: 2, l_enc: 4, h: 2, quantiles: q.clone(), ..TftConfig::default() };
        let Err(e) = Tft::new(cfg, &Device::Cpu, 1) else { panic!("{q:?} was accepted") };
        let e = e.to_string();
        assert!(e.contains("sorted and distinct"), "{q:?}: {e}");
    }
    let cfg = TftConfig { d: 8, n_head: 2, l_enc: 4, h: 2, quantiles: vec![0.05, 0.5, 0.95], ..TftConfig::default() };
    assert!(Tft::new(cfg, &Device::Cpu, 1).is_ok());
}

/// A panel model (`n_instruments > 0`), on a fresh random model and inputs: the static
/// context's autograd gradients match central differences along them; the checkpointed
/// backward equals the plain one; an instrument's embedding column gets no gradient from
/// a batch without its windows; windows that differ only in their instrument get
/// different forecasts; and a missing or misshapen instrument input is refused.
#[test]
fn panel_static_context_has_true_gradients_and_separates_instruments() {
    let seed = fx_hw::test_seed(concat!(module_path!(), ":", line!()));
    let n = 3;
    let cfg = TftConfig {
        d: 8,
        n_head: 2,
        l_enc: 5,
        h: 2,
        n_observed: 3,
        dropout: 0.0,
        n_instruments: n,
        ..TftConfig::default()
    };
    let dev = Device::Cpu;
    let m = Tft::new(cfg, &dev, seed).unwrap();
    let rand = |shape: &[usize], stream: u64| {
        let k: usize = shape.iter().product();
        let v: Vec<f32> =
            (0..k as u64).map(|i| (fx_kernels::rng::draw(seed, stream, i, 0) * 2.0 - 1.0) as f32).collect();
        Tensor::from_vec(v, shape, &dev).unwrap()
    };
    let (obs, known, y) = (rand(&[4, 5, 3], 1), rand(&[4, 7, 4], 2), rand(&[4, 2], 3));
    // Windows of instruments 0, 2, 0, 2: instrument 1 is not in the batch.
    let hot = |ids: &[usize]| {
        let mut v = vec![0f32; ids.len() * n];
        for (b, &i) in ids.iter().enumerate() {
            v[b * n + i] = 1.0;
        }
        Tensor::from_vec(v, (ids.len(), n), &dev).unwrap()
    };
    let inst = hot(&[0, 2, 0, 2]);
    let c = Ctx::eval_with_grad(Precision::F32);
    let (loss, g) = m.loss_and_grads_with(&c, &obs, &known, Some(&inst), &y, false).unwrap();
    let (loss2, g2) = m.loss_and_grads_with(&c, &obs, &known, Some(&inst), &y, true).unwrap();
    assert!(rel_err(&loss2, &loss) <= 1e-6);
    let (g, g2) = (m.params().named_grads(&g).unwrap(), m.params().named_grads(&g2).unwrap());
    for (name, a) in &g {
        if !(name.starts_with("attn.k.") && name.ends_with(".bias")) {
            assert!(rel_err(&g2[name], a) <= 1e-5, "{name}: checkpointed vs plain");
        }
    }
    let embed = g["static_embed.weight"].to_vec2::<f32>().unwrap();
    assert!(embed.iter().all(|row| row[1] == 0.0), "instrument 1's column moved without its windows");
    assert!(embed.iter().any(|row| row[0] != 0.0) && embed.iter().any(|row| row[2] != 0.0));
    // Central differences along the gradient of the static parameters.
    let statics: Vec<(String, candle_core::Var)> = m
        .params()
        .named_vars()
        .into_iter()
        .filter(|(k, _)| k.starts_with("static_") || k.ends_with(".context.weight"))
        .collect();
    assert_eq!(statics.len(), 1 + 4 * 10 + 3, "{:?}", statics.iter().map(|s| &s.0).collect::<Vec<_>>());
    let norm2: f64 =
        statics.iter().map(|(k, _)| g[k].sqr().unwrap().sum_all().unwrap().to_scalar::<f32>().unwrap() as f64).sum();
    assert!(norm2 > 0.0);
    let loss_at = |t: f64| -> f64 {
        let orig: Vec<Tensor> = statics.iter().map(|(_, v)| v.as_tensor().copy().unwrap()).collect();
        for ((k, v), o) in statics.iter().zip(&orig) {
            v.set(&(o + (&g[k] * (t / norm2.sqrt())).unwrap()).unwrap()).unwrap();
        }
        let q = m.forward_with(&Ctx::inference(Precision::F32), &obs, &known, Some(&inst)).unwrap();
        let l = m.loss(&q, &y).unwrap().to_scalar::<f32>().unwrap() as f64;
        for ((_, v), o) in statics.iter().zip(&orig) {
            v.set(o).unwrap();
        }
        l
    };
    // The quantile loss is piecewise linear: a central difference whose step crosses a kink
    // differs from the gradient (at 1e-2, 4 of 150 seeds were off by more than 5 %, e.g.
    // seed 1796651545068725781 by 13 %; at 1e-3 none of them). F32 rounding of the loss
    // stays near 1e-3 of the derivative at this step.
    let eps = 1e-3;
    let fd = (loss_at(eps) - loss_at(-eps)) / (2.0 * eps);
    let analytic = norm2.sqrt();
    assert!((fd - analytic).abs() <= 0.05 * analytic, "directional derivative {fd} vs |g| {analytic} (seed {seed})");
    // Only the instrument differs: the forecasts differ; the same instrument: the same.
    let first = |t: &Tensor| t.narrow(0, 0, 1).unwrap().repeat((3, 1, 1)).unwrap();
    let (same, same_known) = (first(&obs), first(&known));
    let q = m.forward_with(&Ctx::inference(Precision::F32), &same, &same_known, Some(&hot(&[0, 1, 0]))).unwrap();
    let q = q.flatten_from(1).unwrap().to_vec2::<f32>().unwrap();
    assert_eq!(q[0], q[2]);
    assert_ne!(q[0], q[1]);
    // Refusals.
    let e = m.forward(&Ctx::inference(Precision::F32), &obs, &known).unwrap_err().to_string();
    assert!(e.contains("panel of 3 instruments"), "{e}");
    let e = m.forward_with(&Ctx::inference(Precision::F32), &obs, &known, Some(&hot(&[0, 1]))).unwrap_err();
    assert!(e.to_string().contains("instrument"), "{e}");
    let single = Tft::new(TftConfig { n_instruments: 0, ..m.config().clone() }, &dev, 1).unwrap();
    let e = single.forward_with(&Ctx::inference(Precision::F32), &obs, &known, Some(&inst)).unwrap_err();
    assert!(e.to_string().contains("single-instrument"), "{e}");
}
