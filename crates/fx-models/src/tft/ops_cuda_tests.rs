//! Device tests of [`super::ops_cuda::CudaTft`]: every operation against the CPU reference
//! ([`crate::tft::ops::CpuTft`]) on fresh random inputs, outputs poisoned with NaN first so an
//! element a kernel fails to write shows. Each test returns early without a CUDA device.

use candle_core::{Device, Tensor};

use super::ops_cuda::CudaTft;
use crate::tft::ops::*;
use fx_hw::test_gpu as gpu;
use fx_kernels::gemm::Gemm;

/// The same buffers on both backends.
struct Pair {
    cpu: CpuTft,
    gpu: CudaTft,
    dev: Device,
    /// Uploads kept alive until the device has copied them.
    keep: Vec<Tensor>,
    seed: u64,
}

#[derive(Clone, Copy)]
struct B2 {
    c: Addr,
    g: Addr,
    n: usize,
}

impl Pair {
    fn new(dev: Device, seed: u64) -> Self {
        eprintln!("seed {seed}");
        Self { cpu: CpuTft::new(), gpu: CudaTft::new(&dev).unwrap(), dev, keep: Vec::new(), seed }
    }

    fn put(&mut self, v: &[f32]) -> B2 {
        let n = v.len();
        let c = self.cpu.alloc(n).unwrap();
        unsafe { std::ptr::copy_nonoverlapping(v.as_ptr(), c as *mut f32, n) };
        let g = self.gpu.alloc(n).unwrap();
        let t = Tensor::from_slice(v, n, &self.dev).unwrap();
        let src = self.gpu.addr_of(&t, "upload").unwrap();
        unsafe { self.gpu.copy(g, src, n).unwrap() };
        self.keep.push(t);
        B2 { c, g, n }
    }

    /// `n` uniform values in [lo, hi).
    fn rand(&mut self, n: usize, lo: f32, hi: f32) -> B2 {
        self.seed = self.seed.wrapping_add(1);
        let s = self.seed;
        let v: Vec<f32> = (0..n as u64).map(|i| lo + (hi - lo) * fx_kernels::rng::draw(s, 91, i, 0) as f32).collect();
        self.put(&v)
    }

    fn nan(&mut self, n: usize) -> B2 {
        self.put(&vec![f32::NAN; n])
    }

    fn u32(&mut self, v: u32) -> B2 {
        let c = Box::leak(Box::new(v)) as *mut u32 as Addr;
        let t = Tensor::new(&[v], &self.dev).unwrap();
        let g = self.gpu.addr_of(&t, "u32").unwrap();
        self.keep.push(t);
        B2 { c, g, n: 1 }
    }

    fn read(&self, b: B2) -> (Vec<f32>, Vec<f32>) {
        let c = unsafe { std::slice::from_raw_parts(b.c as *const f32, b.n) }.to_vec();
        let g = self.gpu.tensor_at(b.g, &[b.n]).unwrap().to_vec1::<f32>().unwrap();
        (c, g)
    }

    fn check(&self, b: B2, tol: f64, what: &str) {
        let (c, g) = self.read(b);
        let (mut num, mut den) = (0f64, 0f64);
        for (i, (x, y)) in c.iter().zip(&g).enumerate() {
            assert!(y.is_finite() && x.is_finite(), "{what}[{i}]: gpu {y}, cpu {x} (seed {})", self.seed);
            num += (*x as f64 - *y as f64).powi(2);
            den += (*x as f64).powi(2);
        }
        let rel = (num / den.max(1e-30)).sqrt();
        assert!(rel <= tol, "{what}: rel err {rel:e} > {tol:e} (seed {})", self.seed);
    }
}

impl Pair {
    /// The first `n` BF16 values at `b` on both backends: equal within a BF16 step of the
    /// F32 values they round (the F32 inputs may differ in their last bits).
    fn check_bf16(&self, b: B2, n: usize, what: &str) {
        let c = unsafe { std::slice::from_raw_parts(b.c as *const u16, n) }.to_vec();
        let g: Vec<u16> = {
            let t = self.gpu.tensor_at(b.g, &[b.n]).unwrap().to_vec1::<f32>().unwrap();
            t.iter()
                .flat_map(|v| {
                    let u = v.to_bits();
                    [(u & 0xffff) as u16, (u >> 16) as u16]
                })
                .take(n)
                .collect()
        };
        for (i, (x, y)) in c.iter().zip(&g).enumerate() {
            let (x, y) = (half::bf16::from_bits(*x).to_f32(), half::bf16::from_bits(*y).to_f32());
            assert!(x.is_finite() && y.is_finite(), "{what}[{i}]: cpu {x} gpu {y} (seed {})", self.seed);
            assert!((x - y).abs() <= 1e-2 * x.abs().max(1e-3), "{what}[{i}]: cpu {x} gpu {y} (seed {})", self.seed);
        }
    }
}

/// Runs `f` on both backends with each buffer's own address.
macro_rules! both {
    ($p:expr, |$k:ident, $s:ident| $body:expr) => {{
        {
            let $k = &$p.cpu;
            let $s = |b: B2| b.c;
            unsafe { $body }.unwrap();
        }
        {
            let $k = &$p.gpu;
            let $s = |b: B2| b.g;
            unsafe { $body }.unwrap();
        }
    }};
}

#[test]
fn bf16_casts_round_like_the_reference() {
    let Some(dev) = gpu("tft bf16 cast") else { return };
    let mut p = Pair::new(dev, seed());
    let mut v: Vec<f32> = (0..4093u32).map(|i| ((i as f32) * 0.37).sin() * 10f32.powi((i % 11) as i32 - 5)).collect();
    v.extend([f32::NAN, f32::INFINITY, -0.0, 1.0 + f32::EPSILON, f32::MAX, 3.3895e38]);
    let n = v.len();
    let src = p.put(&v);
    let dst = p.nan(n / 2 + 1);
    both!(p, |k, s| k.cast_bf16(s(src), s(dst), n));
    let c = unsafe { std::slice::from_raw_parts(dst.c as *const u16, n) }.to_vec();
    let g: Vec<u16> = p
        .gpu
        .tensor_at(dst.g, &[dst.n])
        .unwrap()
        .to_vec1::<f32>()
        .unwrap()
        .iter()
        .flat_map(|v| [(v.to_bits() & 0xffff) as u16, (v.to_bits() >> 16) as u16])
        .take(n)
        .collect();
    assert_eq!(c, g, "bf16 bits (seed {})", p.seed);
}

fn seed() -> u64 {
    fx_hw::test_seed(concat!(module_path!(), ":", line!()))
}

#[test]
fn gemms_match_the_reference() {
    let Some(dev) = gpu("tft gemms") else { return };
    let mut p = Pair::new(dev, seed());
    // Batched, transposed B, a strided A (lda wider than k), accumulate into C.
    let (n_b, m, k, n) = (3, 37, 20, 29);
    let a = p.rand(n_b * m * 33, -1.0, 1.0);
    let b = p.rand(n_b * n * k, -1.0, 1.0);
    let c = p.rand(n_b * m * n, -1.0, 1.0);
    both!(p, |kk, s| {
        let g = Gemm { lda: 33, ..Gemm::new(false, true, m, n, k, s(a), s(b), s(c)) };
        kk.gemm(&g.batched(n_b, m * 33, n * k, m * n).accumulate())
    });
    p.check(c, 1e-5, "batched gemm");
    // Column sums through a row of ones, transposed A.
    let ones = p.put(&[1.0; 50]);
    let x = p.rand(50 * 7, -1.0, 1.0);
    let y = p.nan(7);
    both!(p, |kk, s| kk.gemm(&Gemm::new(false, false, 1, 7, 50, s(ones), s(x), s(y))));
    p.check(y, 1e-6, "column sums");
}

#[test]
fn pack_embed_and_epilogues_match_the_reference() {
    let Some(dev) = gpu("tft pack/embed/epilogues") else { return };
    let mut p = Pair::new(dev, seed());
    let (bs, l, h, n_obs, n_known, d) = (5, 7, 3, 6, 2, 40);
    let (ne, steps) = (n_obs + n_known, l + h);
    let obs = p.rand(bs * l * n_obs, -2.0, 2.0);
    let known = p.rand(bs * steps * n_known, -1.0, 1.0);
    let (re, rd) = (p.nan(l * bs * ne), p.nan(h * bs * n_known));
    both!(p, |k, s| k.pack(&Pack {
        batch: bs,
        l_enc: l,
        h,
        n_obs,
        n_known,
        observed: s(obs),
        known: s(known),
        raw_enc: s(re),
        raw_dec: s(rd)
    }));
    p.check(re, 0.0, "raw_enc");
    p.check(rd, 0.0, "raw_dec");
    let rows = l * bs;
    let (w, b) = (p.rand(ne * d, -1.0, 1.0), p.rand(ne * d, -1.0, 1.0));
    let emb = p.nan(rows * ne * d);
    let emb16 = p.nan(rows * ne * d / 2 + 1);
    let a =
        |s: &dyn Fn(B2) -> Addr| Embed { rows, n: ne, d, raw: s(re), w: s(w), b: s(b), emb: s(emb), emb16: s(emb16) };
    both!(p, |k, s| k.embed_fwd(&a(&s)));
    p.check(emb, 1e-6, "emb");
    p.check_bf16(emb16, rows * ne * d, "emb16");
    let demb = p.rand(rows * ne * d, -1.0, 1.0);
    let part = p.nan(partials_len(ne, rows, d));
    let (dw, db) = (p.nan(ne * d), p.nan(ne * d));
    both!(p, |k, s| k.embed_bwd(&a(&s), &EmbedGrads { demb: s(demb), partials: s(part), dw: s(dw), db: s(db) }));
    p.check(dw, 1e-5, "embed dw");
    p.check(db, 1e-5, "embed db");
    // Bias + ELU over grouped rows; bias + dropout; their backward.
    let (groups, per) = (3, 2 * bs);
    let y = p.rand(groups * per * d, -3.0, 3.0);
    let bias = p.rand(groups * d, -1.0, 1.0);
    let step = p.u32(17);
    let drop = |s: &dyn Fn(B2) -> Addr| DropoutSite {
        seed: 99,
        call: 3,
        step: s(step),
        p: 0.3,
        scale: fx_precision::dropout::keep_scale(0.3),
        batch: bs,
        steps: 2,
    };
    for (act, with_drop) in [(Act::Elu, false), (Act::None, true)] {
        let ba = |s: &dyn Fn(B2) -> Addr| BiasAct {
            y: s(y),
            bias: s(bias),
            rows: groups * per,
            cols: d,
            rows_per_group: per,
            act,
            dropout: with_drop.then(|| drop(s)),
            out16: 0,
        };
        both!(p, |k, s| k.bias_act(&ba(&s)));
        p.check(y, 1e-6, "bias_act");
        let g = p.rand(groups * per * d, -1.0, 1.0);
        both!(p, |k, s| k.act_bwd(&ba(&s), s(g)));
        p.check(g, 1e-6, "act_bwd");
    }
}

#[test]
fn glu_layer_norm_matches_the_reference() {
    let Some(dev) = gpu("tft glu_ln") else { return };
    let mut p = Pair::new(dev, seed());
    for (rows, o, softmax, with_res_bias, acc) in
        [(130, 55, true, true, false), (70, 128, false, false, true), (3, 200, false, true, false)]
    {
        let (g4, g5, res) = (p.rand(rows * o, -2.0, 2.0), p.rand(rows * o, -2.0, 2.0), p.rand(rows * o, -2.0, 2.0));
        let (b4, b5, rb) = (p.rand(o, -1.0, 1.0), p.rand(o, -1.0, 1.0), p.rand(o, -1.0, 1.0));
        let (lw, lb) = (p.rand(o, 0.5, 1.5), p.rand(o, -0.5, 0.5));
        let (out, stats) = (p.nan(rows * o), p.nan(rows * 2));
        let a = |s: &dyn Fn(B2) -> Addr| GluLn {
            rows,
            o,
            g4: s(g4),
            b4: s(b4),
            g5: s(g5),
            b5: s(b5),
            res: s(res),
            res_bias: if with_res_bias { s(rb) } else { 0 },
            ln_w: s(lw),
            ln_b: s(lb),
            eps: 1e-5,
            softmax,
            out: s(out),
            stats: s(stats),
            out16: 0,
        };
        both!(p, |k, s| k.glu_ln_fwd(&a(&s)));
        p.check(out, 2e-6, "glu_ln out");
        p.check(stats, 2e-6, "glu_ln stats");
        let dout = p.rand(rows * o, -1.0, 1.0);
        let dres = if acc { p.rand(rows * o, -1.0, 1.0) } else { p.nan(rows * o) };
        let (dg4, dg5, part) = (p.nan(rows * o), p.nan(rows * o), p.nan(partials_len(1, rows, o)));
        let (dw, db) = (p.nan(o), p.nan(o));
        let g = |s: &dyn Fn(B2) -> Addr| GluLnGrads {
            dout: s(dout),
            dres: s(dres),
            res_acc: acc,
            dg4: s(dg4),
            dg5: s(dg5),
            partials: s(part),
            dln_w: s(dw),
            dln_b: s(db),
            dg4_16: 0,
            dg5_16: 0,
        };
        both!(p, |k, s| k.glu_ln_bwd(&a(&s), &g(&s)));
        for (b, what) in [(dres, "dres"), (dg4, "dg4"), (dg5, "dg5"), (dw, "dln_w"), (db, "dln_b")] {
            p.check(b, 1e-5, what);
        }
    }
}

#[test]
fn variable_selection_mix_matches_the_reference() {
    let Some(dev) = gpu("tft vsn mix") else { return };
    let mut p = Pair::new(dev, seed());
    for (rows, n, d) in [(130, 55, 128), (9, 4, 40), (70, 3, 200)] {
        let emb = p.rand(rows * n * d, -2.0, 2.0);
        let (g4, g5) = (p.rand(n * rows * d, -2.0, 2.0), p.rand(n * rows * d, -2.0, 2.0));
        let (b4, b5, lw, lb) =
            (p.rand(n * d, -1.0, 1.0), p.rand(n * d, -1.0, 1.0), p.rand(n * d, 0.5, 1.5), p.rand(n * d, -0.5, 0.5));
        let wsel = p.rand(rows * n, 0.0, 0.2);
        let (out, stats) = (p.nan(rows * d), p.nan(n * rows * 2));
        let a = |s: &dyn Fn(B2) -> Addr| VsnMix {
            rows,
            n,
            d,
            emb: s(emb),
            g4: s(g4),
            b4: s(b4),
            g5: s(g5),
            b5: s(b5),
            ln_w: s(lw),
            ln_b: s(lb),
            eps: 1e-5,
            wsel: s(wsel),
            out: s(out),
            stats: s(stats),
            out16: 0,
        };
        both!(p, |k, s| k.vsn_mix_fwd(&a(&s)));
        p.check(out, 2e-6, "mix out");
        p.check(stats, 2e-6, "mix stats");
        let dout = p.rand(rows * d, -1.0, 1.0);
        let (dwsel, demb, dg4, dg5) = (p.nan(rows * n), p.nan(rows * n * d), p.nan(n * rows * d), p.nan(n * rows * d));
        let (part, dw, db) = (p.nan(partials_len(n, rows, d)), p.nan(n * d), p.nan(n * d));
        let g = |s: &dyn Fn(B2) -> Addr| VsnMixGrads {
            dout: s(dout),
            dwsel: s(dwsel),
            demb: s(demb),
            dg4: s(dg4),
            dg5: s(dg5),
            partials: s(part),
            dln_w: s(dw),
            dln_b: s(db),
            dg4_16: 0,
            dg5_16: 0,
        };
        both!(p, |k, s| k.vsn_mix_bwd(&a(&s), &g(&s)));
        for (b, what) in [(dwsel, "dwsel"), (demb, "demb"), (dg4, "dg4"), (dg5, "dg5"), (dw, "dln_w"), (db, "dln_b")] {
            p.check(b, 1e-5, what);
        }
    }
}

#[test]
fn lstm_steps_match_the_reference() {
    let Some(dev) = gpu("tft lstm") else { return };
    let mut p = Pair::new(dev, seed());
    for (bs, d, l, steps) in [(13, 40, 5, 8), (256, 128, 3, 5)] {
        let rows = steps * bs;
        let xg = p.rand(rows * 4 * d, -1.0, 1.0);
        let sc = 1.0 / (d as f32).sqrt();
        let w = [p.rand(4 * d * d, -sc, sc), p.rand(4 * d * d, -sc, sc)];
        let bi = [p.rand(4 * d, -sc, sc), p.rand(4 * d, -sc, sc)];
        let bh = [p.rand(4 * d, -sc, sc), p.rand(4 * d, -sc, sc)];
        let (h, c, gates) = (p.nan(rows * d), p.nan(rows * d), p.nan(rows * 4 * d));
        let a = |s: &dyn Fn(B2) -> Addr| Lstm {
            batch: bs,
            d,
            l_enc: l,
            steps,
            xg: s(xg),
            w_hh: [s(w[0]), s(w[1])],
            b_ih: [s(bi[0]), s(bi[1])],
            b_hh: [s(bh[0]), s(bh[1])],
            h: s(h),
            c: s(c),
            gates: s(gates),
        };
        for t in 0..steps {
            both!(p, |k, s| k.lstm_fwd_step(&a(&s), t));
        }
        p.check(h, 1e-5, "lstm h");
        p.check(c, 1e-5, "lstm c");
        p.check(gates, 1e-5, "lstm gates");
        let dh = p.rand(rows * d, -1.0, 1.0);
        let (dg, dc) = (p.nan(rows * 4 * d), p.nan(bs * d));
        let g = |s: &dyn Fn(B2) -> Addr| LstmGrads { dh_out: s(dh), dgates: s(dg), dc: s(dc) };
        for t in (0..steps).rev() {
            both!(p, |k, s| k.lstm_bwd_step(&a(&s), &g(&s), t));
        }
        p.check(dg, 2e-5, "lstm dgates");
        p.check(dc, 2e-5, "lstm dc");
    }
}

#[test]
fn attention_and_pinball_match_the_reference() {
    let Some(dev) = gpu("tft attention/pinball") else { return };
    let mut p = Pair::new(dev, seed());
    for (bs, l, h, nh, dk) in [(5, 10, 3, 4, 32), (3, 64, 8, 2, 64), (2, 4, 2, 3, 5)] {
        let (steps, w) = (l + h, nh * dk);
        let q = p.rand(h * bs * w, -1.0, 1.0);
        let k = p.rand(steps * bs * w, -1.0, 1.0);
        let v = p.rand(steps * bs * dk, -1.0, 1.0);
        let (bq, bk, bv) = (p.rand(w, -0.5, 0.5), p.rand(w, -0.5, 0.5), p.rand(dk, -0.5, 0.5));
        let (attn, avg) = (p.nan(bs * nh * h * steps), p.nan(h * bs * dk));
        let a = |s: &dyn Fn(B2) -> Addr| Attn {
            batch: bs,
            l_enc: l,
            h,
            n_head: nh,
            dk,
            scale: (1.0 / (dk as f64).sqrt()) as f32,
            q: s(q),
            bq: s(bq),
            k: s(k),
            bk: s(bk),
            v: s(v),
            bv: s(bv),
            attn: s(attn),
            avg: s(avg),
        };
        both!(p, |kk, s| kk.attn_fwd(&a(&s)));
        p.check(attn, 2e-6, "attn weights");
        p.check(avg, 2e-6, "attn avg");
        let davg = p.rand(h * bs * dk, -1.0, 1.0);
        let (dq, dkk, dv) = (p.nan(h * bs * w), p.nan(steps * bs * w), p.nan(steps * bs * dk));
        let g = |s: &dyn Fn(B2) -> Addr| AttnGrads { davg: s(davg), dq: s(dq), dk: s(dkk), dv: s(dv) };
        both!(p, |kk, s| kk.attn_bwd(&a(&s), &g(&s)));
        p.check(dq, 1e-5, "dq");
        p.check(dkk, 1e-5, "dk");
        p.check(dv, 1e-5, "dv");
    }
    let (bs, h, nq) = (300, 8, 3);
    let out = p.rand(h * bs * nq, -0.1, 0.1);
    let bias = p.rand(nq, -0.01, 0.01);
    let target = p.rand(bs * h, -0.1, 0.1);
    let qs = p.put(&[0.1, 0.5, 0.9]);
    let (loss, dout) = (p.nan(1), p.nan(h * bs * nq));
    both!(p, |k, s| k.pinball(&Pinball {
        batch: bs,
        h,
        nq,
        out: s(out),
        bias: s(bias),
        target: s(target),
        quantiles: s(qs),
        loss: s(loss),
        dout: s(dout)
    }));
    p.check(loss, 1e-5, "pinball loss");
    p.check(dout, 1e-7, "pinball dout");
}
