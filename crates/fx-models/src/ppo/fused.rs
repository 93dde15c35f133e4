//! The PPO minibatch update (MODELS.md: clipped surrogate, value loss, entropy bonus,
//! per-minibatch advantage normalisation) in ~40 launches instead of candle's hundreds
//! (feature `cuda`, F32): cuBLAS GEMMs for both tanh MLPs and their gradients, one kernel
//! for the advantages' statistics and one per-row kernel for the loss terms and the
//! logit/value gradients (`crate::mlp::train_cuda`); the six minibatch means come from
//! one GEMV. Gradients land in one flat buffer for [`FusedStep`]. The reference is
//! [`crate::ppo_loss`] + candle's backward, compared on the device.

use crate::mlp::train_cuda::{Act, Blas, MlpTrainKernels, PpoLossArgs, DQN_MAX_ACTIONS};
use candle_core::{DType, Tensor};
use fx_kernels::cuda::address;
use fx_precision::FusedStep;

use crate::error::{Context, Error, Result};
use crate::ppo::{ActorCritic, PpoLossConfig};

const CTX: &str = "PpoFused";

fn a(t: &Tensor) -> Result<u64> {
    address::<f32>(t, "buffer").ctx(CTX)
}

/// Buffers and kernels of the fused update at one minibatch size; see the module docs.
pub(crate) struct PpoFused {
    blas: Blas,
    k: MlpTrainKernels,
    batch: usize,
    dims: [usize; 3],
    params: Vec<Tensor>,
    /// Per network (actor, critic): the two hidden activations and the head output.
    act: [[Tensor; 3]; 2],
    dz: [[Tensor; 3]; 2],
    adv_stats: Tensor,
    rows: Tensor,
    means: Tensor,
    ones: Tensor,
    grads: Vec<Tensor>,
    _flat: Tensor,
    loss_cfg: PpoLossConfig,
}

impl PpoFused {
    /// Whether the fused update covers this network (F32 is checked by the caller).
    pub(crate) fn supports(net: &ActorCritic) -> bool {
        net.config().n_actions <= DQN_MAX_ACTIONS
    }

    /// Buffers for minibatches of `batch` rows of `model` (updated in place, so its
    /// parameters' addresses hold).
    pub(crate) fn new(model: &ActorCritic, batch: usize, loss_cfg: PpoLossConfig) -> Result<Self> {
        let c = model.config();
        if !Self::supports(model) || batch < 2 {
            return Err(Error::config(CTX, format!("unsupported network {c:?} or minibatch {batch}")));
        }
        let dev = model.params().device().clone();
        let (h, na) = (c.hidden, c.n_actions);
        let z = |shape: &[usize]| Tensor::zeros(shape, DType::F32, &dev).ctx(CTX);
        let vars = model.params().vars();
        let flat = z(&[vars.iter().map(|v| v.elem_count()).sum()])?;
        let mut grads = Vec::with_capacity(vars.len());
        let mut off = 0;
        for v in &vars {
            grads.push(flat.narrow(0, off, v.elem_count()).and_then(|g| g.reshape(v.dims())).ctx(CTX)?);
            off += v.elem_count();
        }
        let net = |out: usize| -> Result<[Tensor; 3]> { Ok([z(&[batch, h])?, z(&[batch, h])?, z(&[batch, out])?]) };
        Ok(Self {
            blas: Blas::new(&dev).ctx(CTX)?,
            k: MlpTrainKernels::load(&dev).ctx(CTX)?,
            batch,
            dims: [c.state_dim, h, na],
            params: vars.iter().map(|v| v.as_tensor().clone()).collect(),
            act: [net(na)?, net(1)?],
            dz: [net(na)?, net(1)?],
            adv_stats: z(&[2])?,
            rows: z(&[batch, 6])?,
            means: z(&[6])?,
            ones: Tensor::ones(batch, DType::F32, &dev).ctx(CTX)?,
            grads,
            _flat: flat,
            loss_cfg,
        })
    }

    /// The minibatch size the buffers were made for.
    pub(crate) fn batch(&self) -> usize {
        self.batch
    }

    /// One update on `inputs` = [obs, actions (u32), logp_old, advantages, returns]: loss,
    /// gradients, then `fused.step_with` with the five diagnostics as extras.
    pub(crate) fn step(&self, fused: &FusedStep, inputs: &[Tensor], dry: bool) -> Result<()> {
        let [s, h, na] = self.dims;
        let b = self.batch;
        if inputs.len() != 5 || inputs[0].dims() != [b, s] || inputs[1].dtype() != DType::U32 {
            return Err(Error::config(CTX, format!("needs [obs, a (u32), logp_old, adv, ret] with {b} rows of {s}")));
        }
        let p = &self.params;
        let obs = a(&inputs[0])?;
        let (blas, k) = (&self.blas, &self.k);
        // Parameter order (MODELS.md): actor.0, actor.1, actor.head, critic.0, critic.1,
        // critic.head, each weight then bias.
        let widths = |out: usize| [(s, h), (h, h), (h, out)];
        let acts = [Act::Tanh, Act::Tanh, Act::None];
        let x = [
            [a(&self.act[0][0])?, a(&self.act[0][1])?, a(&self.act[0][2])?],
            [a(&self.act[1][0])?, a(&self.act[1][1])?, a(&self.act[1][2])?],
        ];
        let dz = [
            [a(&self.dz[0][0])?, a(&self.dz[0][1])?, a(&self.dz[0][2])?],
            [a(&self.dz[1][0])?, a(&self.dz[1][1])?, a(&self.dz[1][2])?],
        ];
        let g: Vec<u64> = self.grads.iter().map(a).collect::<Result<_>>()?;
        let ones = a(&self.ones)?;
        // SAFETY (every unsafe call below): the addresses are of tensors owned by `self`,
        // `inputs` or the model, alive and of the sizes passed, on candle's stream.
        unsafe {
            for (n, out) in [(0usize, na), (1, 1)] {
                let mut input = obs;
                for (l, (i, w)) in widths(out).into_iter().enumerate() {
                    let pw = 6 * n + 2 * l;
                    blas.gemm(false, true, b, w, i, 1.0, input, i, a(&p[pw])?, i, 0.0, x[n][l], w).ctx(CTX)?;
                    k.bias_act(x[n][l], a(&p[pw + 1])?, b, w, acts[l], 0).ctx(CTX)?;
                    input = x[n][l];
                }
            }
            let lc = &self.loss_cfg;
            k.ppo_loss(&PpoLossArgs {
                logits: x[0][2],
                value: x[1][2],
                actions: address::<u32>(&inputs[1], "actions").ctx(CTX)?,
                logp_old: a(&inputs[2])?,
                advantages: a(&inputs[3])?,
                returns: a(&inputs[4])?,
                adv_stats: a(&self.adv_stats)?,
                batch: b,
                n_actions: na,
                clip: lc.clip as f32,
                vf_coef: lc.vf_coef as f32,
                ent_coef: lc.ent_coef as f32,
                adv_eps: lc.adv_eps as f32,
                rows: a(&self.rows)?,
                d_logits: dz[0][2],
                d_value: dz[1][2],
                members: 1,
                coefs_members: 0,
            })
            .ctx(CTX)?;
            blas.col_sums(b, 6, 1.0 / b as f32, a(&self.rows)?, 6, ones, a(&self.means)?).ctx(CTX)?;
            for (n, out) in [(0usize, na), (1, 1)] {
                let wd = widths(out);
                for l in (0..3).rev() {
                    let (i, w) = wd[l];
                    let pw = 6 * n + 2 * l;
                    let x_in = if l == 0 { obs } else { x[n][l - 1] };
                    blas.gemm(true, false, w, i, b, 1.0, dz[n][l], w, x_in, i, 0.0, g[pw], i).ctx(CTX)?;
                    blas.col_sums(b, w, 1.0, dz[n][l], w, ones, g[pw + 1]).ctx(CTX)?;
                    if l > 0 {
                        blas.gemm(false, false, b, i, w, 1.0, dz[n][l], w, a(&p[pw])?, i, 0.0, dz[n][l - 1], i)
                            .ctx(CTX)?;
                        k.act_bwd(dz[n][l - 1], x[n][l - 1], b, i, acts[l - 1], 0).ctx(CTX)?;
                    }
                }
            }
        }
        let m = |j: usize| self.means.narrow(0, j, 1).ctx(CTX);
        let (loss, extras) = (m(0)?, [m(1)?, m(2)?, m(3)?, m(4)?, m(5)?]);
        let grads: Vec<&Tensor> = self.grads.iter().collect();
        let extras: Vec<&Tensor> = extras.iter().collect();
        fused.step_with(&loss, &grads, &extras, dry).ctx(CTX)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dqn::fused::test_support::{fresh_seed, gpu, rel, vals};
    use crate::ppo::{ppo_loss, PpoBatch, PpoNetConfig};
    use fx_precision::{AdamConfig, GradScaler, Precision};

    /// The fused loss, diagnostics and gradients equal candle's `ppo_loss` + backward on
    /// fresh random weights and minibatches (ratios spread past the clip range both ways).
    #[test]
    fn gradients_match_candle() {
        let Some(dev) = gpu("ppo_fused::gradients_match_candle") else { return };
        let seed = fresh_seed();
        eprintln!("ppo_fused::gradients_match_candle: seed {seed}");
        for (b, hidden, na) in [(128usize, 256usize, 3usize), (45, 32, 4)] {
            let cfg = PpoNetConfig { hidden, n_actions: na, ..Default::default() };
            let model = ActorCritic::new(cfg, &dev, seed).unwrap();
            let s = cfg.state_dim;
            let actions: Vec<u32> =
                vals(b, seed, 3).iter().map(|u| ((u + 1.0) * na as f32 / 2.0) as u32 % na as u32).collect();
            let logp: Vec<f32> = vals(b, seed, 4).iter().map(|u| (1.0 / na as f32).ln() + 0.5 * u).collect();
            let inputs = vec![
                Tensor::from_vec(vals(b * s, seed, 1), (b, s), &dev).unwrap(),
                Tensor::from_vec(actions, b, &dev).unwrap(),
                Tensor::from_vec(logp, b, &dev).unwrap(),
                Tensor::from_vec(vals(b, seed, 5), b, &dev).unwrap(),
                Tensor::from_vec(vals(b, seed, 6), b, &dev).unwrap(),
            ];
            let batch = PpoBatch {
                obs: &inputs[0],
                actions: &inputs[1],
                logp_old: &inputs[2],
                advantages: &inputs[3],
                returns: &inputs[4],
            };
            let lc = PpoLossConfig::default();
            let p = ppo_loss(&model, batch, &lc).unwrap();
            let grads = p.loss.backward().unwrap();
            let engine = PpoFused::new(&model, b, lc).unwrap();
            let fused = FusedStep::new(
                model.params().named_vars(),
                &AdamConfig::default(),
                &GradScaler::for_precision(Precision::F32),
                Some(0.5),
            )
            .unwrap();
            engine.step(&fused, &inputs, true).unwrap();
            let means: Vec<f32> = engine.means.to_vec1().unwrap();
            // The diagnostics are means over the batch of terms about |A| in size (l_clip
            // is a mean of ±r·A that cancels to ~1e-3), so F32 summation in another order
            // errs relative to the terms, not to the mean: 1e-5 of the mean plus 1e-6 of
            // mean |A|. (A floor of 1e-5 × 1e-3 failed l_clip by 1.5e-8 on a fresh seed.)
            let adv: Vec<f32> = inputs[3].to_vec1().unwrap();
            let scale = adv.iter().map(|a| a.abs()).sum::<f32>() / b as f32;
            for (j, (what, want)) in [
                ("loss", &p.loss),
                ("l_clip", &p.l_clip),
                ("l_v", &p.l_v),
                ("entropy", &p.entropy_mean),
                ("approx_kl", &p.approx_kl),
                ("clip_frac", &p.clip_frac),
            ]
            .into_iter()
            .enumerate()
            {
                let want = want.to_dtype(DType::F32).unwrap().to_scalar::<f32>().unwrap();
                let tol = 1e-5 * want.abs() + 1e-6 * scale;
                assert!((means[j] - want).abs() <= tol, "b {b}: {what} {} vs {want} (tol {tol:e})", means[j]);
            }
            for (k, (spec, v)) in model.params().specs().iter().zip(model.params().vars()).enumerate() {
                let e = rel(&engine.grads[k], grads.get(v.as_tensor()).unwrap());
                assert!(e <= 1e-5, "b {b} h {hidden}: gradient of {} rel err {e}", spec.name);
            }
        }
    }
}
