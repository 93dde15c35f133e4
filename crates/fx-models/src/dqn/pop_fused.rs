//! A population's DQN loss and gradients (feature `cuda`): the solo fused update
//! ([`crate::dqn::fused`]) batched over members, in the same ~30 launches whatever the member
//! count. Every GEMM is one cuBLAS strided-batched call over the member axis of the stacked
//! `[N, ...]` weights; the bias + ReLU, ReLU backward and dueling-head kernels take the member
//! as their grid's y index (`kernels/mlp/mlp_train.cu`), each member with its own γ read from
//! device memory. Gradients land in `[N, ...]` tensors in parameter order, which the
//! population's member-batched optimiser kernels read. Nothing reads to the host, so the
//! population captures it in its update graph. F32, or BF16 compute as the solo update: BF16
//! GEMM inputs with F32 accumulation, F32 activations, gradients and master weights.
//!
//! Under BF16 the trunk's forward is the solo update's epilogue GEMMs
//! ([`Bf16Shadows::trunk_gemms`]) batched over members.
//!
//! The reference is the population's candle loss on the CPU ([`super::population`]'s
//! `loss_and_grads`), which the device test compares member by member.

use candle_core::{DType, Device, Tensor};
use fx_kernels::cuda::address;
use fx_kernels::cuda::blas::Gemm;
use fx_precision::Precision;

use crate::dqn::fused::Bf16Shadows;
use crate::dqn::population::PopBatch;
use crate::dqn::DqnNetConfig;
use crate::error::{Context, Error, Result};
use crate::mlp::train_cuda::{Act, Blas, DqnHeadArgs, MlpTrainKernels, DQN_MAX_ACTIONS};

const CTX: &str = "DqnPopFused";

fn a(t: &Tensor) -> Result<u64> {
    address::<f32>(t, "buffer").ctx(CTX)
}

fn a16(t: &Tensor) -> Result<u64> {
    address::<half::bf16>(t, "buffer").ctx(CTX)
}

/// Buffers and kernels of the member-batched update at one member count and batch size.
pub(crate) struct DqnPopFused {
    blas: Blas,
    k: MlpTrainKernels,
    members: usize,
    batch: usize,
    dims: [usize; 4],
    /// Per member `[s; s']` as 2B rows: `[N, 2B, S]`.
    x2: Tensor,
    /// Online trunk outputs on `[s; s']` `[N, 2B, w]`, target ones on s' `[N, B, w]`.
    h: [Tensor; 3],
    t: [Tensor; 3],
    loss_rows: Tensor,
    loss: Tensor,
    d_out: Tensor,
    dz: [Tensor; 3],
    ones: Tensor,
    grads: Vec<Tensor>,
    delta: f32,
    bf16: Option<Bf16Shadows>,
}

impl DqnPopFused {
    /// Whether the fused kernels cover this network.
    pub(crate) fn supports(net: &DqnNetConfig) -> bool {
        net.n_actions <= DQN_MAX_ACTIONS && net.hidden >= 2
    }

    /// Buffers for `members` members of `net` at `batch` transitions each.
    pub(crate) fn new(
        net: &DqnNetConfig,
        members: usize,
        batch: usize,
        huber_delta: f64,
        precision: Precision,
        dev: &Device,
    ) -> Result<Self> {
        if !Self::supports(net) || batch == 0 || members == 0 || precision == Precision::F16 {
            return Err(Error::config(
                CTX,
                format!("unsupported network {net:?}, {members} members, batch {batch} or {precision}"),
            ));
        }
        let (n, b) = (members, batch);
        let (s, h, h2, na) = (net.state_dim, net.hidden, net.hidden / 2, net.n_actions);
        let z = |shape: &[usize]| Tensor::zeros(shape, DType::F32, dev).ctx(CTX);
        let z16 = |shape: &[usize]| Tensor::zeros(shape, DType::BF16, dev).ctx(CTX);
        let grads = net.param_specs().iter().map(|p| z(&[&[n][..], &p.shape].concat())).collect::<Result<Vec<_>>>()?;
        let widths = [(s, h), (h, h), (h, h2)];
        let bf16 = match precision {
            Precision::Bf16 => {
                let w = |l: usize| z16(&[n, widths[l].1, widths[l].0]);
                Some(Bf16Shadows {
                    x2: z16(&[n, 2 * b, s])?,
                    h: [z16(&[n, 2 * b, h])?, z16(&[n, 2 * b, h])?, z16(&[n, 2 * b, h2])?],
                    t: [z16(&[n, b, h])?, z16(&[n, b, h])?, z16(&[n, b, h2])?],
                    dz: [z16(&[n, b, h])?, z16(&[n, b, h])?, z16(&[n, b, h2])?],
                    w: [w(0)?, w(1)?, w(2)?, w(0)?, w(1)?, w(2)?],
                    epilogue: false,
                    split: false,
                })
            }
            _ => None,
        };
        let mut me = Self {
            blas: Blas::new(dev).ctx(CTX)?,
            k: MlpTrainKernels::load(dev).ctx(CTX)?,
            members: n,
            batch: b,
            dims: [s, h, h2, na],
            x2: z(&[n, 2 * b, s])?,
            h: [z(&[n, 2 * b, h])?, z(&[n, 2 * b, h])?, z(&[n, 2 * b, h2])?],
            t: [z(&[n, b, h])?, z(&[n, b, h])?, z(&[n, b, h2])?],
            loss_rows: z(&[n, b])?,
            loss: z(&[n])?,
            d_out: z(&[n, b, 1 + na])?,
            dz: [z(&[n, b, h])?, z(&[n, b, h])?, z(&[n, b, h2])?],
            ones: Tensor::ones(2 * b, DType::F32, dev).ctx(CTX)?,
            grads,
            delta: huber_delta as f32,
            bf16,
        };
        // The bias addresses only matter by their alignment here: the weights' own are
        // allocations of their own (256-byte aligned), as the loss buffer is.
        let fake = [a(&me.loss)?; 3];
        if let Some(b16) = me.bf16.as_mut() {
            let gemms = b16.trunk_gemms(me.dims, n, b, &me.h, &me.t, fake, fake)?;
            b16.probe_epilogue(&me.blas, &gemms)?;
        }
        Ok(me)
    }

    /// Each member's mean Huber loss `[N]` of the last [`Self::run`].
    pub(crate) fn loss(&self) -> &Tensor {
        &self.loss
    }

    /// Each parameter's gradients `[N, ...]` of the last [`Self::run`], in parameter order.
    pub(crate) fn grads(&self) -> &[Tensor] {
        &self.grads
    }

    /// Loss and gradients of every member on `batch` under the stacked weights `online` and
    /// `target` (parameter order, `[N, ...]` contiguous F32) and per-member γ `gamma`
    /// (`[N]` F32 contiguous, any shape of N elements).
    pub(crate) fn run(&self, online: &[Tensor], target: &[Tensor], gamma: &Tensor, batch: &PopBatch) -> Result<()> {
        let [s, h, h2, na] = self.dims;
        let (n, b) = (self.members, self.batch);
        if batch.obs.dims() != [n, b, s] || batch.next_obs.dims() != [n, b, s] || batch.actions.dims() != [n, b] {
            return Err(Error::config(CTX, format!("needs {n} members' batches of {b} rows of {s}")));
        }
        if batch.actions.dtype() != DType::U32 || online.len() != 10 || target.len() != 10 || gamma.elem_count() != n {
            return Err(Error::config(CTX, "U32 actions, 10 online and 10 target tensors and N gammas"));
        }
        self.x2.slice_set(&batch.obs.contiguous().ctx(CTX)?, 1, 0).ctx(CTX)?;
        self.x2.slice_set(&batch.next_obs.contiguous().ctx(CTX)?, 1, b).ctx(CTX)?;
        let actions = batch.actions.contiguous().ctx(CTX)?;
        let rewards = batch.rewards.to_dtype(DType::F32).and_then(|t| t.contiguous()).ctx(CTX)?;
        let dones = batch.dones.to_dtype(DType::F32).and_then(|t| t.contiguous()).ctx(CTX)?;
        let gamma = gamma.contiguous().ctx(CTX)?;
        let o: Vec<u64> = online.iter().map(a).collect::<Result<_>>()?;
        let t: Vec<u64> = target.iter().map(a).collect::<Result<_>>()?;
        let x2 = a(&self.x2)?;
        let hs = [a(&self.h[0])?, a(&self.h[1])?, a(&self.h[2])?];
        let ts = [a(&self.t[0])?, a(&self.t[1])?, a(&self.t[2])?];
        let dz = [a(&self.dz[0])?, a(&self.dz[1])?, a(&self.dz[2])?];
        let widths = [(s, h), (h, h), (h, h2)];
        // BF16 shadows (0 under F32): x2, h[3], t[3], dz[3], trunk weights (online, target).
        let sh = match &self.bf16 {
            Some(b16) => Some((
                a16(&b16.x2)?,
                [a16(&b16.h[0])?, a16(&b16.h[1])?, a16(&b16.h[2])?],
                [a16(&b16.t[0])?, a16(&b16.t[1])?, a16(&b16.t[2])?],
                [a16(&b16.dz[0])?, a16(&b16.dz[1])?, a16(&b16.dz[2])?],
                [a16(&b16.w[0])?, a16(&b16.w[1])?, a16(&b16.w[2])?, a16(&b16.w[3])?, a16(&b16.w[4])?, a16(&b16.w[5])?],
            )),
            None => None,
        };
        let h16 = |l: usize| sh.map_or(0, |s| s.1[l]);
        let t16 = |l: usize| sh.map_or(0, |s| s.2[l]);
        let dz16 = |l: usize| sh.map_or(0, |s| s.3[l]);
        let w16 = |l: usize| sh.map_or(0, |s| s.4[l]);
        let x16 = sh.map_or(0, |s| s.0);
        let (blas, k) = (&self.blas, &self.k);
        // A GEMM over the members (F32, or BF16 reading the shadows when they exist).
        let gemm = |g: Gemm, a16: u64, b16: u64| -> Result<()> {
            let g = if sh.is_some() && a16 != 0 { g.bf16(a16, b16) } else { g };
            // SAFETY: see the block below.
            unsafe { blas.run(&g) }.ctx(CTX)
        };
        // SAFETY (every unsafe call here): the addresses are of contiguous tensors owned by
        // `self` or borrowed for this call (weights, batch, γ), of the sizes the shapes above
        // give, on candle's stream, where the launches run in order before any is freed.
        unsafe {
            if let Some((x16, _, _, _, w)) = sh {
                let mut items = vec![(x2, x16, n * 2 * b * s)];
                for l in 0..3 {
                    items.push((o[2 * l], w[l], online[2 * l].elem_count()));
                    items.push((t[2 * l], w[3 + l], target[2 * l].elem_count()));
                }
                k.cast_bf16(&items).ctx(CTX)?;
            }
            // Online trunk on [s; s'] (2B rows a member), target trunk on s' (B rows).
            let epilogue = self.bf16.as_ref().filter(|b16| b16.epilogue);
            if let Some(b16) = epilogue {
                for g in b16.trunk_gemms(self.dims, n, b, &self.h, &self.t, [o[1], o[3], o[5]], [t[1], t[3], t[5]])? {
                    if b16.split {
                        k.split_epilogue(blas, &g).ctx(CTX)?;
                    } else {
                        blas.run(&g).ctx(CTX)?;
                    }
                }
            } else {
                for l in 0..3 {
                    let (i, w) = widths[l];
                    let (x_on, x_on16) = if l == 0 { (x2, x16) } else { (hs[l - 1], h16(l - 1)) };
                    let g = Gemm::new(false, true, 2 * b, w, i, x_on, o[2 * l], hs[l]).batched(
                        n,
                        2 * b * i,
                        w * i,
                        2 * b * w,
                    );
                    gemm(g, x_on16, w16(l))?;
                    k.bias_act_members(hs[l], o[2 * l + 1], n, 2 * b, w, Act::Relu, h16(l)).ctx(CTX)?;
                    let (x_tg, x_tg16, stride) = if l == 0 {
                        (x2 + (b * s * 4) as u64, if x16 == 0 { 0 } else { x16 + (b * s * 2) as u64 }, 2 * b * s)
                    } else {
                        (ts[l - 1], t16(l - 1), b * i)
                    };
                    let g = Gemm::new(false, true, b, w, i, x_tg, t[2 * l], ts[l]).batched(n, stride, w * i, b * w);
                    gemm(g, x_tg16, w16(3 + l))?;
                    k.bias_act_members(ts[l], t[2 * l + 1], n, b, w, Act::Relu, t16(l)).ctx(CTX)?;
                }
            }
            let d_out = a(&self.d_out)?;
            k.dqn_head_loss(&DqnHeadArgs {
                z_online: hs[2],
                z_target: ts[2],
                online_heads: [o[6], o[7], o[8], o[9]],
                target_heads: [t[6], t[7], t[8], t[9]],
                actions: address::<u32>(&actions, "actions").ctx(CTX)?,
                rewards: a(&rewards)?,
                dones: a(&dones)?,
                batch: b,
                k: h2,
                n_actions: na,
                gamma: 0.0,
                huber_delta: self.delta,
                loss_rows: a(&self.loss_rows)?,
                d_out,
                dz: dz[2],
                dz16: dz16(2),
                members: n,
                gamma_members: a(&gamma)?,
            })
            .ctx(CTX)?;
            let ones = a(&self.ones)?;
            let g: Vec<u64> = self.grads.iter().map(a).collect::<Result<_>>()?;
            // Column sums as GEMMs `ones[1, B] · X[B, c]` (the member's bias gradients).
            let col_sums = |x: u64, ld: usize, stride: usize, cols: usize, alpha: f32, y: u64| -> Result<()> {
                let g = Gemm { alpha, ldb: ld, ..Gemm::new(false, false, 1, cols, b, ones, x, y) };
                gemm(g.batched(n, 0, stride, cols), 0, 0)
            };
            col_sums(a(&self.loss_rows)?, 1, b, 1, 1.0 / b as f32, a(&self.loss)?)?;
            // Heads: value = column 0 of d_out, advantage = columns 1..=na.
            let ld = 1 + na;
            let head = |col: u64, rows: usize, out: u64| -> Result<()> {
                let g = Gemm { lda: ld, ..Gemm::new(true, false, rows, h2, b, col, hs[2], out) };
                gemm(g.batched(n, b * ld, 2 * b * h2, rows * h2), 0, 0)
            };
            head(d_out, 1, g[6])?;
            col_sums(d_out, ld, b * ld, 1, 1.0, g[7])?;
            head(d_out + 4, na, g[8])?;
            col_sums(d_out + 4, ld, b * ld, na, 1.0, g[9])?;
            // Trunk, last layer first; dz[l] is dL/d(pre-activation) of layer l (B rows a member).
            for l in (0..3).rev() {
                let (i, w) = widths[l];
                let (x_in, x_in16) = if l == 0 { (x2, x16) } else { (hs[l - 1], h16(l - 1)) };
                let gw = Gemm::new(true, false, w, i, b, dz[l], x_in, g[2 * l]).batched(n, b * w, 2 * b * i, w * i);
                gemm(gw, dz16(l), x_in16)?;
                col_sums(dz[l], w, b * w, w, 1.0, g[2 * l + 1])?;
                if l > 0 {
                    let gx =
                        Gemm::new(false, false, b, i, w, dz[l], o[2 * l], dz[l - 1]).batched(n, b * w, w * i, b * i);
                    gemm(gx, dz16(l), w16(l))?;
                    // Under the epilogue the mask comes from the BF16 activations (no F32 ones).
                    let h_mask16 = if epilogue.is_some() { h16(l - 1) } else { 0 };
                    let stride = (2 * b * i) as u64;
                    k.act_bwd_members(dz[l - 1], hs[l - 1], n, stride, b, i, Act::Relu, dz16(l - 1), h_mask16)
                        .ctx(CTX)?;
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dqn::fused::test_support::{fresh_seed, gpu, rel};
    use crate::dqn::population::{loss_and_grads, DqnPopulation};
    use crate::dqn::trainer::DqnConfig;

    /// Every member's fused loss and gradients equal the population's candle loss and
    /// gradients computed on the CPU (the reference), member by member so that a wrong
    /// member stride cannot hide in a whole-tensor norm, on fresh random weights and
    /// transitions, members with different γ, at two widths, batch sizes and member counts.
    #[test]
    fn member_gradients_match_the_cpu_reference() {
        let Some(dev) = gpu("dqn_pop_fused::member_gradients_match_the_cpu_reference") else { return };
        let seed = fresh_seed();
        eprintln!("dqn_pop_fused::member_gradients_match_the_cpu_reference: seed {seed}");
        for (n, b, hidden, na) in [(5usize, 64usize, 256usize, 3usize), (3, 37, 64, 5)] {
            let members: Vec<DqnConfig> = (0..n)
                .map(|k| DqnConfig {
                    net: DqnNetConfig { hidden, n_actions: na, ..Default::default() },
                    batch_size: b,
                    seed: seed.wrapping_add(k as u64),
                    gamma: 0.9 + 0.02 * k as f64,
                    ..Default::default()
                })
                .collect();
            let cpu = DqnPopulation::new(members.clone(), &Device::Cpu).unwrap();
            // The target differs from the online net (fresh seeds), as after training.
            let other: Vec<DqnConfig> =
                members.iter().map(|m| DqnConfig { seed: m.seed ^ 0x5eed, ..m.clone() }).collect();
            let cpu_target = DqnPopulation::new(other, &Device::Cpu).unwrap();
            let w: Vec<Tensor> = cpu.online().vars().iter().map(|v| v.as_tensor().clone()).collect();
            let tw: Vec<Tensor> = cpu_target.online().vars().iter().map(|v| v.as_tensor().clone()).collect();
            let batch = crate::dqn::population::tests::random_batch_of(n, b, na, seed ^ 7);
            let gammas: Vec<f32> = members.iter().map(|m| m.gamma as f32).collect();
            let gamma_cpu = Tensor::from_vec(gammas.clone(), (n, 1), &Device::Cpu).unwrap();
            let (loss, grads) = loss_and_grads(&w, &tw, &batch, &gamma_cpu, 1.0, Precision::F32).unwrap();
            let to = |t: &Tensor| t.to_device(&dev).unwrap();
            let gw: Vec<Tensor> = w.iter().map(to).collect();
            let gtw: Vec<Tensor> = tw.iter().map(to).collect();
            let gbatch = PopBatch {
                obs: to(&batch.obs),
                actions: to(&batch.actions),
                rewards: to(&batch.rewards),
                next_obs: to(&batch.next_obs),
                dones: to(&batch.dones),
            };
            let gamma = Tensor::from_vec(gammas, n, &dev).unwrap();
            // F32 to 1e-5; BF16 against the F32 reference within the solo fused update's 2e-1
            // (the same kernels; see dqn::fused's test for why BF16 trunk gradients land there).
            for (precision, tol) in [(Precision::F32, 1e-5), (Precision::Bf16, 2e-1)] {
                let net = members[0].net;
                let engine = DqnPopFused::new(&net, n, b, 1.0, precision, &dev).unwrap();
                engine.run(&gw, &gtw, &gamma, &gbatch).unwrap();
                for m in 0..n {
                    let e = rel(&engine.loss().get(m).unwrap(), &loss.get(m).unwrap());
                    assert!(e <= tol, "{precision} n {n} b {b} h {hidden}: member {m} loss rel err {e}");
                    for (p, (fused, want)) in engine.grads().iter().zip(&grads).enumerate() {
                        let e = rel(&fused.get(m).unwrap(), &want.get(m).unwrap());
                        assert!(e <= tol, "{precision} n {n} b {b} h {hidden}: member {m} gradient {p} rel err {e}");
                    }
                }
                eprintln!("dqn_pop_fused {precision} n {n} b {b} h {hidden}: every member within {tol:.0e}");
                if precision == Precision::Bf16
                    && matches!(std::env::var("FX_GEMM_EPILOGUE").as_deref(), Ok("1" | "split"))
                {
                    // The epilogue forward against the unfused one on the same BF16 inputs:
                    // the activations differ by at most a BF16 rounding where the two GEMMs'
                    // F32 sums straddle one, so a wrong member's bias or stride (a change of
                    // several per cent) fails here though the F32 reference's BF16 bound
                    // above would miss it.
                    assert!(
                        engine.bf16.as_ref().unwrap().epilogue,
                        "n {n} b {b} h {hidden}: cuBLASLt took no epilogue GEMM"
                    );
                    let mut plain = DqnPopFused::new(&net, n, b, 1.0, precision, &dev).unwrap();
                    plain.bf16.as_mut().unwrap().epilogue = false;
                    plain.run(&gw, &gtw, &gamma, &gbatch).unwrap();
                    let mut worst = 0f64;
                    for m in 0..n {
                        worst = worst.max(rel(&engine.loss().get(m).unwrap(), &plain.loss().get(m).unwrap()));
                        for (fused, unfused) in engine.grads().iter().zip(plain.grads()) {
                            worst = worst.max(rel(&fused.get(m).unwrap(), &unfused.get(m).unwrap()));
                        }
                    }
                    assert!(worst <= 2e-2, "n {n} b {b} h {hidden}: epilogue vs unfused rel err {worst}");
                    eprintln!(
                        "dqn_pop_fused epilogue vs unfused n {n} b {b} h {hidden}: worst member rel err {worst:.2e}"
                    );
                }
            }
        }
    }
}
