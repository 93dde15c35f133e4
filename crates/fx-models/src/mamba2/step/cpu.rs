//! The CPU backend of [`super::StepPlan`] (tests only): every operation runs on the f64
//! references of `fx_kernels::{mamba2_ref, ssd_ref}` over `Vec<f64>` buffers, BF16 compute
//! emulated by rounding the GEMM inputs that have a BF16 shadow. Unwritten scratch starts as
//! NaN, so an operation that reads a buffer nothing wrote poisons the result. The tests compare
//! the plan run here with candle's autograd (`Mamba2::loss_and_grads`) and the PyTorch fixture,
//! and the scan's reference backward with candle's autograd of `ssd::ssd_recurrent`.

use crate::mamba2::ops_ref::{self as r, GemmShape, RowGrad};
use crate::mamba2::ssd_ref::{self, SsdGrads, SsdInputs};
use candle_core::{DType, Tensor};

use super::*;
use crate::error::Context;

const CTX: &str = "step::cpu";

/// f64 buffers of a [`StepPlan`].
pub(crate) struct CpuBackend {
    specs: Vec<BufSpec>,
    bufs: Vec<Vec<f64>>,
    bf16: bool,
}

fn host(t: &Tensor) -> Vec<f64> {
    t.to_dtype(DType::F64).and_then(|t| t.flatten_all()).and_then(|t| t.to_vec1()).expect("tensor to host")
}

impl CpuBackend {
    /// Buffers for `plan` with `model`'s weights and the batch `x`, `target`.
    pub(crate) fn new(plan: &StepPlan, model: &Mamba2, x: &Tensor, target: &Tensor, bf16: bool) -> Self {
        let vars = model.params().vars();
        let bufs = plan
            .bufs
            .iter()
            .map(|s| match s.kind {
                BufKind::Param(i) => host(vars[i].as_tensor()),
                BufKind::Input => host(x),
                BufKind::Target => host(target),
                _ => vec![f64::NAN; s.len],
            })
            .collect();
        Self { specs: plan.bufs.clone(), bufs, bf16 }
    }

    /// The contents of buffer `b`.
    pub(crate) fn buf(&self, b: Buf) -> &[f64] {
        &self.bufs[b.0]
    }

    fn s(&self, at: At) -> &[f64] {
        &self.bufs[at.buf.0][at.off..]
    }

    fn take(&mut self, b: Buf) -> Vec<f64> {
        std::mem::take(&mut self.bufs[b.0])
    }

    /// A's or B's values from `at` on, rounded to BF16 when the GEMM runs in BF16.
    fn operand(&self, at: At, round: bool) -> Vec<f64> {
        let v = self.s(at);
        if round {
            v.iter().map(|&x| half::bf16::from_f64(x).to_f64()).collect()
        } else {
            v.to_vec()
        }
    }
}

impl Backend for CpuBackend {
    fn gemm(&mut self, g: &GemmOp) -> Result<()> {
        let round = self.bf16 && self.specs[g.a.buf.0].bf16 && self.specs[g.b.buf.0].bf16;
        let (a, b) = (self.operand(g.a, round), self.operand(g.b, round));
        let mut c = self.take(g.c.buf);
        let shape = GemmShape {
            ta: g.ta,
            tb: g.tb,
            m: g.m,
            n: g.n,
            k: g.k,
            lda: g.lda,
            ldb: g.ldb,
            ldc: g.ldc,
            beta: if g.accumulate { 1.0 } else { 0.0 },
        };
        let res = r::gemm(&shape, &a, &b, &mut c[g.c.off..]).ctx(CTX);
        self.bufs[g.c.buf.0] = c;
        res
    }

    fn col_sums(&mut self, o: &ColSumsOp) -> Result<()> {
        let mut y = self.take(o.y.buf);
        let res = r::col_sums(o.rows, o.cols, self.s(o.a), o.lda, &mut y[o.y.off..]).ctx(CTX);
        self.bufs[o.y.buf.0] = y;
        res
    }

    fn cast_bf16(&mut self, _bufs: &[Buf]) -> Result<()> {
        Ok(())
    }

    fn rmsnorm_fwd(&mut self, o: &RmsFwdOp) -> Result<()> {
        let (mut h, mut u, mut rs) = (self.take(o.h.buf), self.take(o.u.buf), self.take(o.rstd.buf));
        let mut copy = o.copy.map(|c| (c, self.take(c.buf)));
        let res = r::rmsnorm_fwd(
            &mut h[o.h.off..],
            o.bias.map(|b| self.s(b)),
            self.s(o.w),
            copy.as_mut().map(|(c, v)| &mut v[c.off..]),
            &mut u[o.u.off..],
            &mut rs[o.rstd.off..],
            o.rows,
            o.cols,
            o.eps,
        )
        .ctx(CTX);
        self.bufs[o.h.buf.0] = h;
        self.bufs[o.u.buf.0] = u;
        self.bufs[o.rstd.buf.0] = rs;
        if let Some((c, v)) = copy {
            self.bufs[c.buf.0] = v;
        }
        res
    }

    fn rmsnorm_bwd(&mut self, o: &RmsBwdOp) -> Result<()> {
        let (mut dh, mut part) = (self.take(o.dh.buf), self.take(o.partials.buf));
        let du = match o.du {
            RowGradAt::Full(a) => RowGrad::Full(self.s(a)),
            RowGradAt::Outer { scale, vec } => RowGrad::Outer { scale: self.s(scale), vec: self.s(vec) },
        };
        let res = r::rmsnorm_bwd(
            du,
            self.s(o.h),
            self.s(o.rstd),
            self.s(o.w),
            o.rows,
            o.cols,
            o.accumulate,
            &mut dh[o.dh.off..],
            &mut part[o.partials.off..],
        )
        .ctx(CTX);
        self.bufs[o.dh.buf.0] = dh;
        self.bufs[o.partials.buf.0] = part;
        res
    }

    fn conv_fwd(&mut self, o: &ConvFwdOp) -> Result<()> {
        let (mut xbc, mut dt) = (self.take(o.xbc.buf), self.take(o.dt.buf));
        let res = r::conv_fwd(
            &o.dims,
            self.s(o.zx),
            o.ld,
            o.xoff,
            self.s(o.w),
            self.s(o.b),
            self.s(o.dt_bias),
            &mut xbc[o.xbc.off..],
            &mut dt[o.dt.off..],
        )
        .ctx(CTX);
        self.bufs[o.xbc.buf.0] = xbc;
        self.bufs[o.dt.buf.0] = dt;
        res
    }

    fn conv_bwd(&mut self, o: &ConvBwdOp) -> Result<()> {
        let (mut dzx, mut part) = (self.take(o.dzx.buf), self.take(o.partials.buf));
        let res = r::conv_bwd(
            &o.dims,
            self.s(o.zx),
            o.ld,
            o.xoff,
            self.s(o.w),
            self.s(o.b),
            self.s(o.dx),
            self.s(o.dbc),
            &mut dzx[o.dzx.off..],
            o.ldo,
            &mut part[o.partials.off..],
        )
        .ctx(CTX);
        self.bufs[o.dzx.buf.0] = dzx;
        self.bufs[o.partials.buf.0] = part;
        res
    }

    fn ssd_fwd(&mut self, o: &SsdFwdOp) -> Result<()> {
        let (mut ys, mut yo, mut st) = (self.take(o.y_ssd.buf), self.take(o.y_out.buf), self.take(o.states.buf));
        let inp =
            SsdInputs { xbc: self.s(o.xbc), ld_xbc: o.ld, dt: self.s(o.dt), a_log: self.s(o.a_log), d: self.s(o.d) };
        let res = ssd_ref::ssd_fwd_chunked(
            &o.dims,
            &inp,
            &mut ys[o.y_ssd.off..],
            &mut yo[o.y_out.off..],
            &mut st[o.states.off..],
        )
        .ctx(CTX);
        self.bufs[o.y_ssd.buf.0] = ys;
        self.bufs[o.y_out.buf.0] = yo;
        self.bufs[o.states.buf.0] = st;
        res
    }

    fn ssd_bwd(&mut self, o: &SsdBwdOp) -> Result<()> {
        let (mut dx, mut dbc) = (self.take(o.dx.buf), self.take(o.dbc.buf));
        let (mut ddt, mut part) = (self.take(o.ddt_raw.buf), self.take(o.partials.buf));
        let f = &o.fwd;
        let inp =
            SsdInputs { xbc: self.s(f.xbc), ld_xbc: f.ld, dt: self.s(f.dt), a_log: self.s(f.a_log), d: self.s(f.d) };
        let mut g = SsdGrads {
            dx: &mut dx[o.dx.off..],
            dbc: &mut dbc[o.dbc.off..],
            ddt_raw: &mut ddt[o.ddt_raw.off..],
            ld_ddt: o.ld_ddt,
            partials: &mut part[o.partials.off..],
        };
        let res =
            ssd_ref::ssd_bwd_chunked(&f.dims, &inp, self.s(f.y_ssd), self.s(f.states), self.s(o.dy), &mut g).ctx(CTX);
        self.bufs[o.dx.buf.0] = dx;
        self.bufs[o.dbc.buf.0] = dbc;
        self.bufs[o.ddt_raw.buf.0] = ddt;
        self.bufs[o.partials.buf.0] = part;
        res
    }

    fn gated_fwd(&mut self, o: &GatedFwdOp) -> Result<()> {
        let (mut out, mut rs) = (self.take(o.out.buf), self.take(o.rstd.buf));
        let res = r::gated_fwd(
            self.s(o.y),
            self.s(o.z),
            o.ldz,
            self.s(o.w),
            o.rows,
            o.di,
            o.groups,
            o.eps,
            &mut out[o.out.off..],
            &mut rs[o.rstd.off..],
        )
        .ctx(CTX);
        self.bufs[o.out.buf.0] = out;
        self.bufs[o.rstd.buf.0] = rs;
        res
    }

    fn gated_bwd(&mut self, o: &GatedBwdOp) -> Result<()> {
        let (mut dy, mut dz, mut part) = (self.take(o.dy.buf), self.take(o.dz.buf), self.take(o.partials.buf));
        let res = r::gated_bwd(
            self.s(o.dout),
            self.s(o.y),
            self.s(o.z),
            o.ldz,
            self.s(o.w),
            self.s(o.rstd),
            o.rows,
            o.di,
            o.groups,
            &mut dy[o.dy.off..],
            &mut dz[o.dz.off..],
            o.lddz,
            &mut part[o.partials.off..],
        )
        .ctx(CTX);
        self.bufs[o.dy.buf.0] = dy;
        self.bufs[o.dz.buf.0] = dz;
        self.bufs[o.partials.buf.0] = part;
        res
    }

    fn head_fwd(&mut self, o: &HeadFwdOp) -> Result<()> {
        let (mut uf, mut rs) = (self.take(o.u_f.buf), self.take(o.rstd.buf));
        let (mut sq, mut dp) = (self.take(o.sq.buf), self.take(o.dpred.buf));
        let res = r::head_fwd(
            self.s(o.h),
            self.s(o.w_norm),
            self.s(o.head_w),
            self.s(o.head_b)[0],
            self.s(o.target),
            o.rows,
            o.cols,
            o.eps,
            &mut uf[o.u_f.off..],
            &mut rs[o.rstd.off..],
            &mut sq[o.sq.off..],
            &mut dp[o.dpred.off..],
        )
        .ctx(CTX);
        self.bufs[o.u_f.buf.0] = uf;
        self.bufs[o.rstd.buf.0] = rs;
        self.bufs[o.sq.buf.0] = sq;
        self.bufs[o.dpred.buf.0] = dp;
        res
    }

    fn loss_reduce(&mut self, o: &LossOp) -> Result<()> {
        let (loss, dhb) = r::loss_reduce(self.s(o.sq), self.s(o.dpred), o.rows).ctx(CTX)?;
        self.bufs[o.loss.buf.0][o.loss.off] = loss;
        self.bufs[o.dhead_b.buf.0][o.dhead_b.off] = dhb;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use crate::mamba2::tests::small_cfg;
    use candle_core::{Device, Var};

    use super::*;
    use crate::mamba2::ssd::ssd_recurrent;
    use crate::seq::ops::{softplus, Ctx};
    use crate::seq_testing::Fixture;
    use fx_precision::Precision;

    fn rel(a: &[f64], b: &[f64]) -> f64 {
        assert_eq!(a.len(), b.len());
        if a.iter().any(|v| !v.is_finite()) {
            return f64::INFINITY;
        }
        let n: f64 = a.iter().zip(b).map(|(x, y)| (x - y) * (x - y)).sum::<f64>().sqrt();
        let d: f64 = b.iter().map(|y| y * y).sum::<f64>().sqrt();
        n / d.max(1e-300)
    }

    /// The plan on the CPU backend: loss and the gradients, one per parameter.
    fn run_plan(m: &Mamba2, x: &Tensor, t: &Tensor, bf16: bool) -> (f64, Vec<Vec<f64>>) {
        let (b, l, _) = x.dims3().unwrap();
        let plan = StepPlan::new(m, b, l, bf16).unwrap();
        let mut be = CpuBackend::new(&plan, m, x, t, bf16);
        plan.record(&mut be).unwrap();
        let g = be.buf(plan.grad);
        let grads =
            m.params().vars().iter().zip(&plan.grad_offsets).map(|(v, &o)| g[o..o + v.elem_count()].to_vec()).collect();
        (be.buf(plan.loss)[0], grads)
    }

    /// Compares the plan's loss and every gradient with `want` (name → values); `bound(name)`.
    fn compare(
        m: &Mamba2,
        got: &(f64, Vec<Vec<f64>>),
        loss: f64,
        want: &dyn Fn(usize) -> Vec<f64>,
        bound: &dyn Fn(&str) -> f64,
        tag: &str,
    ) {
        let e = ((got.0 - loss) / loss).abs();
        eprintln!("{tag}: loss rel err {e:.2e}");
        assert!(e <= bound("loss"), "{tag}: loss {} vs {loss}", got.0);
        for (i, (name, _)) in m.params().names_and_shapes().iter().enumerate() {
            let e = rel(&got.1[i], &want(i));
            eprintln!("{tag}: {name} rel err {e:.2e}");
            assert!(e <= bound(name), "{tag}: gradient of {name} rel err {e}");
        }
    }

    fn candle_reference(m: &Mamba2, x: &Tensor, t: &Tensor) -> (f64, Vec<Vec<f64>>) {
        let (loss, g) = m.loss_and_grads(&Ctx::train(Precision::F32), x, t, false).unwrap();
        let grads = m.params().vars().iter().map(|v| host(g.get(v.as_tensor()).unwrap())).collect();
        (host(&loss)[0], grads)
    }

    fn batch(m: &Mamba2, b: usize, l: usize, seed: u64) -> (Tensor, Tensor) {
        let n = m.config().n_in;
        let v = |k: usize, s: u64| -> Vec<f32> {
            (0..k as u64).map(|i| (fx_kernels::rng::draw(seed, s, 0, i) * 2.0 - 1.0) as f32).collect()
        };
        let x = Tensor::from_vec(v(b * l * n, 1), (b, l, n), &Device::Cpu).unwrap();
        let t = (Tensor::from_vec(v(b * l, 2), (b, l), &Device::Cpu).unwrap() * 0.01).unwrap();
        (x, t)
    }

    /// The plan (f64 references) equals candle's autograd on a small model with two groups, a
    /// chunk that does not divide the sequence and a conv shorter than the default.
    #[test]
    fn plan_matches_candle_small_config() {
        let m = Mamba2::new(small_cfg(), &Device::Cpu, 3).unwrap();
        let (x, t) = batch(&m, 2, 13, 7);
        let want = candle_reference(&m, &x, &t);
        let got = run_plan(&m, &x, &t, false);
        compare(&m, &got, want.0, &|i| want.1[i].clone(), &|_| 1e-4, "small");
    }

    /// The default widths (d_model 256, N = P = 64, chunk 64; two of the four layers, to keep
    /// the f64 reference quick) at a length that is not a multiple of the chunk; F32 within
    /// 1e-4, BF16 GEMM inputs within the GPU test's bounds.
    #[test]
    fn plan_matches_candle_default_config() {
        let m = Mamba2::new(Mamba2Config { n_layer: 2, ..Mamba2Config::default() }, &Device::Cpu, 5).unwrap();
        let (x, t) = batch(&m, 1, 66, 9);
        let want = candle_reference(&m, &x, &t);
        let got = run_plan(&m, &x, &t, false);
        compare(&m, &got, want.0, &|i| want.1[i].clone(), &|_| 1e-4, "default");
        let got = run_plan(&m, &x, &t, true);
        let loose = |n: &str| if n.ends_with("A_log") || n.ends_with("dt_bias") { 1e-1 } else { 2e-2 };
        compare(&m, &got, want.0, &|i| want.1[i].clone(), &loose, "default bf16");
    }

    /// The plan against the PyTorch fixture's loss and gradients (F32 within 1e-4); with BF16
    /// GEMM inputs within 2e-2 (1e-1 for A_log and dt_bias, as the candle BF16 parity test).
    #[test]
    fn plan_matches_fixture_f32_and_bf16() {
        let fx = Fixture::load("mamba2.safetensors");
        let cfg: Mamba2Config = serde_json::from_str(&fx.metadata["config"]).unwrap();
        let m = Mamba2::new(cfg, &Device::Cpu, 1).unwrap();
        m.params().load_map(&fx.params(), "mamba2.safetensors").unwrap();
        let (x, t) = (fx.get("in.x"), fx.get("in.target"));
        let loss = host(fx.get("loss"))[0];
        let names: Vec<String> = m.params().names_and_shapes().into_iter().map(|(n, _)| n).collect();
        let want = |i: usize| host(fx.get(&format!("grad.{}", names[i])));
        let got = run_plan(&m, x, t, false);
        compare(&m, &got, loss, &want, &|_| 1e-4, "fixture f32");
        let got = run_plan(&m, x, t, true);
        let loose = |n: &str| if n.ends_with("A_log") || n.ends_with("dt_bias") { 1e-1 } else { 2e-2 };
        compare(&m, &got, loss, &want, &loose, "fixture bf16");
    }

    /// Two runs of the plan give identical buffers (nothing depends on stale contents).
    #[test]
    fn plan_is_repeatable() {
        let m = Mamba2::new(small_cfg(), &Device::Cpu, 4).unwrap();
        let (x, t) = batch(&m, 2, 11, 3);
        let plan = StepPlan::new(&m, 2, 11, false).unwrap();
        let mut be = CpuBackend::new(&plan, &m, &x, &t, false);
        plan.record(&mut be).unwrap();
        let first = be.buf(plan.grad).to_vec();
        plan.record(&mut be).unwrap();
        assert_eq!(be.buf(plan.grad), &first[..]);
    }

    #[test]
    fn limits_are_config_errors() {
        let dev = Device::Cpu;
        for cfg in [
            Mamba2Config { headdim: 128, d_model: 64, ngroups: 1, ..small_cfg() },
            Mamba2Config { d_state: 65, ..small_cfg() },
            Mamba2Config { d_conv: 9, ..small_cfg() },
        ] {
            let m = Mamba2::new(cfg, &dev, 1).unwrap();
            let e = StepPlan::new(&m, 2, 8, false).unwrap_err();
            assert!(matches!(e, Error::Config { .. }), "{e}");
        }
        let m = Mamba2::new(small_cfg(), &dev, 1).unwrap();
        assert!(StepPlan::new(&m, 0, 8, false).is_err());
        // a chunk longer than the kernels' tiles is fine: the scan's chunk is capped.
        let m = Mamba2::new(Mamba2Config { chunk_size: 256, ..small_cfg() }, &dev, 1).unwrap();
        assert_eq!(StepPlan::new(&m, 1, 300, false).unwrap().dims.chunk, 64);
    }

    /// The scan's reference backward (chunked and recurrent) against candle's autograd of
    /// `ssd_recurrent` with `dt = softplus(dt_raw + dt_bias)`, `A = −exp(A_log)` and the `D`
    /// skip, in f64: every input's gradient within 1e-10, at lengths that are and are not
    /// multiples of the chunk, one and two groups.
    #[test]
    fn ssd_reference_backward_matches_candle_autograd() {
        let dev = Device::Cpu;
        for &(b, l, nh, p, n, g, q) in
            &[(2usize, 12usize, 2usize, 3usize, 4usize, 1usize, 4usize), (1, 11, 4, 2, 3, 2, 4), (2, 7, 2, 4, 2, 2, 8)]
        {
            let dims = SsdDims { batch: b, len: l, nheads: nh, headdim: p, d_state: n, ngroups: g, chunk: q };
            let u = |shape: &[usize], lo: f64, hi: f64| {
                Var::from_tensor(&Tensor::rand(lo, hi, shape, &dev).unwrap()).unwrap()
            };
            let xv = u(&[b, l, nh, p], -1.0, 1.0);
            let dt_raw = u(&[b, l, nh], -3.0, 0.5);
            let dt_bias = u(&[nh], -1.0, 0.5);
            let a_log = Var::from_tensor(&(Tensor::rand(1.0f64, 16.0, nh, &dev).unwrap().log().unwrap())).unwrap();
            let dv = u(&[nh], 0.5, 1.5);
            let bv = u(&[b, l, g, n], -1.0, 1.0);
            let cv = u(&[b, l, g, n], -1.0, 1.0);
            let wv = Tensor::rand(-1.0f64, 1.0, (b, l, nh, p), &dev).unwrap();
            let expand = |t: &Tensor| {
                t.unsqueeze(3)
                    .unwrap()
                    .broadcast_as((b, l, g, nh / g, n))
                    .unwrap()
                    .contiguous()
                    .unwrap()
                    .reshape((b, l, nh, n))
                    .unwrap()
            };
            let dt = softplus(&dt_raw.as_tensor().broadcast_add(dt_bias.as_tensor()).unwrap()).unwrap();
            let a = a_log.as_tensor().exp().unwrap().neg().unwrap();
            let xs = xv.as_tensor().broadcast_mul(&dt.unsqueeze(3).unwrap()).unwrap();
            let (y, _) =
                ssd_recurrent(&xs, &dt.broadcast_mul(&a).unwrap(), &expand(bv.as_tensor()), &expand(cv.as_tensor()))
                    .unwrap();
            let y = (y + xv.as_tensor().broadcast_mul(&dv.as_tensor().reshape((nh, 1)).unwrap()).unwrap()).unwrap();
            let grads = (&y * &wv).unwrap().sum_all().unwrap().backward().unwrap();
            let gr = |v: &Var| host(grads.get(v.as_tensor()).unwrap());

            // The same inputs in the fused step's layouts.
            let (rows, di, w) = (dims.rows(), dims.d_inner(), dims.xbc_width());
            let (xh, bh, ch) = (host(xv.as_tensor()), host(bv.as_tensor()), host(cv.as_tensor()));
            let mut xbc = vec![0.0; rows * w];
            for r in 0..rows {
                xbc[r * w..r * w + di].copy_from_slice(&xh[r * di..(r + 1) * di]);
                xbc[r * w + di..r * w + di + g * n].copy_from_slice(&bh[r * g * n..(r + 1) * g * n]);
                xbc[r * w + di + g * n..(r + 1) * w].copy_from_slice(&ch[r * g * n..(r + 1) * g * n]);
            }
            let dth = host(&dt);
            let (alh, dh) = (host(a_log.as_tensor()), host(dv.as_tensor()));
            let inp = SsdInputs { xbc: &xbc, ld_xbc: w, dt: &dth, a_log: &alh, d: &dh };
            let dy = host(&wv);
            let sz = rows * di;
            let (mut ys, mut yo, mut st) = (vec![0.0; sz], vec![0.0; sz], vec![0.0; dims.states_len()]);
            ssd_ref::ssd_fwd_chunked(&dims, &inp, &mut ys, &mut yo, &mut st).unwrap();
            assert!(rel(&yo, &host(&y)) < 1e-12, "forward");
            for chunked in [true, false] {
                let (mut dx, mut dbc, mut ddt, mut part) =
                    (vec![0.0; sz], vec![0.0; dims.dbc_len()], vec![0.0; rows * nh], vec![0.0; dims.partials_len()]);
                let mut gg =
                    SsdGrads { dx: &mut dx, dbc: &mut dbc, ddt_raw: &mut ddt, ld_ddt: nh, partials: &mut part };
                if chunked {
                    ssd_ref::ssd_bwd_chunked(&dims, &inp, &ys, &st, &dy, &mut gg).unwrap();
                } else {
                    ssd_ref::ssd_bwd_recurrent(&dims, &inp, &ys, &dy, &mut gg).unwrap();
                }
                let total = |k: usize| -> Vec<f64> {
                    (0..nh).map(|h| (0..b).map(|bb| part[bb * 3 * nh + k * nh + h]).sum()).collect()
                };
                let hpg = nh / g;
                let grouped = |off: usize| -> Vec<f64> {
                    (0..rows * g * n)
                        .map(|e| {
                            let (r, gi, k) = (e / (g * n), (e / n) % g, e % n);
                            (gi * hpg..(gi + 1) * hpg).map(|h| dbc[(h * rows + r) * 2 * n + off + k]).sum()
                        })
                        .collect()
                };
                let tag = format!("{dims:?} chunked {chunked}");
                for (what, got, want) in [
                    ("x", dx.clone(), gr(&xv)),
                    ("dt_raw", ddt.clone(), gr(&dt_raw)),
                    ("dt_bias", total(0), gr(&dt_bias)),
                    ("A_log", total(1), gr(&a_log)),
                    ("D", total(2), gr(&dv)),
                    ("B", grouped(0), gr(&bv)),
                    ("C", grouped(n), gr(&cv)),
                ] {
                    let e = rel(&got, &want);
                    assert!(e <= 1e-10, "{tag}: d{what} rel err {e}");
                }
            }
        }
    }
}
