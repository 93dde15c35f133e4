//! The DQN update (MODELS.md: double-DQN Huber loss, backward) in ~30 launches instead of
//! candle's ~700 (feature `cuda`, F32): cuBLAS GEMMs for the trunk layers and their
//! gradients, one kernel per bias + ReLU and per ReLU backward, one warp-per-row kernel for
//! the dueling heads, the TD target, the Huber loss and the head gradients
//! (`fx_kernels::cuda::mlp_train`). Gradients land in one flat buffer, read by
//! [`FusedStep`] in parameter order. Everything is device-only, so the trainer captures it
//! as one CUDA graph. The reference is the candle update ([`crate::dqn_loss`] + backward),
//! which the device tests compare it with.

use candle_core::{DType, Tensor};
use fx_kernels::cuda::mlp_train::{Act, Blas, DqnHeadArgs, MlpTrainKernels, DQN_MAX_ACTIONS};
use fx_kernels::cuda::optim::{f32_address, u32_address};
use fx_precision::FusedStep;

use crate::dqn::DuelingDqn;
use crate::error::{Context, Error, Result};

const CTX: &str = "DqnFused";

/// Buffers and kernels of the fused update at one batch size; see the module docs.
pub(crate) struct DqnFused {
    blas: Blas,
    k: MlpTrainKernels,
    batch: usize,
    dims: [usize; 4],
    online: Vec<Tensor>,
    target: Vec<Tensor>,
    x2: Tensor,
    h: [Tensor; 3],
    t: [Tensor; 3],
    loss_rows: Tensor,
    loss: Tensor,
    d_out: Tensor,
    dz: [Tensor; 3],
    ones: Tensor,
    grads: Vec<Tensor>,
    _flat: Tensor,
    gamma: f32,
    delta: f32,
}

fn a(t: &Tensor) -> Result<u64> {
    f32_address(t, "buffer").ctx(CTX)
}

impl DqnFused {
    /// Whether the fused update covers this network (F32 is checked by the caller).
    pub(crate) fn supports(net: &DuelingDqn) -> bool {
        let c = net.config();
        c.n_actions <= DQN_MAX_ACTIONS && c.hidden >= 2
    }

    /// Buffers for `batch` transitions of `online`/`target` (the trainer's networks, whose
    /// parameters are updated in place, so their addresses hold).
    pub(crate) fn new(online: &DuelingDqn, target: &DuelingDqn, batch: usize, gamma: f64, delta: f64) -> Result<Self> {
        let c = online.config();
        if !Self::supports(online) || batch == 0 {
            return Err(Error::config(CTX, format!("unsupported network {c:?} or batch {batch}")));
        }
        let dev = online.params().device().clone();
        let (s, h, h2, na) = (c.state_dim, c.hidden, c.hidden / 2, c.n_actions);
        let z = |shape: &[usize]| Tensor::zeros(shape, DType::F32, &dev).ctx(CTX);
        let sizes: Vec<usize> = online.params().vars().iter().map(|v| v.elem_count()).collect();
        let flat = z(&[sizes.iter().sum()])?;
        let mut grads = Vec::with_capacity(sizes.len());
        let mut off = 0;
        for v in online.params().vars() {
            grads.push(flat.narrow(0, off, v.elem_count()).and_then(|g| g.reshape(v.dims())).ctx(CTX)?);
            off += v.elem_count();
        }
        Ok(Self {
            blas: Blas::new(&dev).ctx(CTX)?,
            k: MlpTrainKernels::load(&dev).ctx(CTX)?,
            batch,
            dims: [s, h, h2, na],
            online: online.params().vars().iter().map(|v| v.as_tensor().clone()).collect(),
            target: target.params().vars().iter().map(|v| v.as_tensor().clone()).collect(),
            x2: z(&[2 * batch, s])?,
            h: [z(&[2 * batch, h])?, z(&[2 * batch, h])?, z(&[2 * batch, h2])?],
            t: [z(&[batch, h])?, z(&[batch, h])?, z(&[batch, h2])?],
            loss_rows: z(&[batch])?,
            loss: z(&[1])?,
            d_out: z(&[batch, 1 + na])?,
            dz: [z(&[batch, h])?, z(&[batch, h])?, z(&[batch, h2])?],
            ones: Tensor::ones(2 * batch, DType::F32, &dev).ctx(CTX)?,
            grads,
            _flat: flat,
            gamma: gamma as f32,
            delta: delta as f32,
        })
    }

    /// The batch size the buffers were made for.
    pub(crate) fn batch(&self) -> usize {
        self.batch
    }

    /// One update on `inputs` = [s, actions (u32), rewards, s', dones] (device tensors of
    /// the buffers' batch size): loss and gradients, then `fused.step_with` (`dry` passed on).
    pub(crate) fn step(&self, fused: &FusedStep, inputs: &[Tensor], dry: bool) -> Result<()> {
        let [s, h, h2, na] = self.dims;
        let b = self.batch;
        if inputs.len() != 5 || inputs[0].dims() != [b, s] || inputs[3].dims() != [b, s] {
            return Err(Error::config(CTX, format!("needs [s, a, r, s', done] with {b} rows of {s}")));
        }
        if inputs[1].dtype() != DType::U32 {
            return Err(Error::config(CTX, "actions must be U32"));
        }
        // Online forward on s and s' together: [s; s'] as 2B rows.
        self.x2.slice_set(&inputs[0].contiguous().ctx(CTX)?, 0, 0).ctx(CTX)?;
        self.x2.slice_set(&inputs[3].contiguous().ctx(CTX)?, 0, b).ctx(CTX)?;
        let (o, t) = (&self.online, &self.target);
        let x2 = a(&self.x2)?;
        let x_next = x2 + (b * s * 4) as u64;
        let hs = [a(&self.h[0])?, a(&self.h[1])?, a(&self.h[2])?];
        let ts = [a(&self.t[0])?, a(&self.t[1])?, a(&self.t[2])?];
        let widths = [(s, h), (h, h), (h, h2)];
        let (blas, k) = (&self.blas, &self.k);
        // SAFETY (every unsafe call below): the addresses are of tensors owned by `self`,
        // `inputs` or the networks, alive and of the sizes passed, on candle's stream.
        unsafe {
            let mut x_on = x2;
            let mut x_tg = x_next;
            for l in 0..3 {
                let (i, w) = widths[l];
                blas.gemm(false, true, 2 * b, w, i, 1.0, x_on, i, a(&o[2 * l])?, i, 0.0, hs[l], w).ctx(CTX)?;
                k.bias_act(hs[l], a(&o[2 * l + 1])?, 2 * b, w, Act::Relu).ctx(CTX)?;
                blas.gemm(false, true, b, w, i, 1.0, x_tg, i, a(&t[2 * l])?, i, 0.0, ts[l], w).ctx(CTX)?;
                k.bias_act(ts[l], a(&t[2 * l + 1])?, b, w, Act::Relu).ctx(CTX)?;
                x_on = hs[l];
                x_tg = ts[l];
            }
            let (d_out, dz) = (a(&self.d_out)?, [a(&self.dz[0])?, a(&self.dz[1])?, a(&self.dz[2])?]);
            k.dqn_head_loss(&DqnHeadArgs {
                z_online: hs[2],
                z_target: ts[2],
                online_heads: [a(&o[6])?, a(&o[7])?, a(&o[8])?, a(&o[9])?],
                target_heads: [a(&t[6])?, a(&t[7])?, a(&t[8])?, a(&t[9])?],
                actions: u32_address(&inputs[1], "actions").ctx(CTX)?,
                rewards: a(&inputs[2])?,
                dones: a(&inputs[4])?,
                batch: b,
                k: h2,
                n_actions: na,
                gamma: self.gamma,
                huber_delta: self.delta,
                loss_rows: a(&self.loss_rows)?,
                d_out,
                dz: dz[2],
            })
            .ctx(CTX)?;
            let ones = a(&self.ones)?;
            let g: Vec<u64> = self.grads.iter().map(a).collect::<Result<_>>()?;
            blas.col_sums(b, 1, 1.0 / b as f32, a(&self.loss_rows)?, 1, ones, a(&self.loss)?).ctx(CTX)?;
            // Heads: value = column 0 of d_out, advantage = columns 1..=na.
            let ld = 1 + na;
            blas.gemm(true, false, 1, h2, b, 1.0, d_out, ld, hs[2], h2, 0.0, g[6], h2).ctx(CTX)?;
            blas.col_sums(b, 1, 1.0, d_out, ld, ones, g[7]).ctx(CTX)?;
            blas.gemm(true, false, na, h2, b, 1.0, d_out + 4, ld, hs[2], h2, 0.0, g[8], h2).ctx(CTX)?;
            blas.col_sums(b, na, 1.0, d_out + 4, ld, ones, g[9]).ctx(CTX)?;
            // Trunk, last layer first; dz[l] is dL/d(pre-activation) of layer l (rows 0..B).
            for l in (0..3).rev() {
                let (i, w) = widths[l];
                let x_in = if l == 0 { x2 } else { hs[l - 1] };
                blas.gemm(true, false, w, i, b, 1.0, dz[l], w, x_in, i, 0.0, g[2 * l], i).ctx(CTX)?;
                blas.col_sums(b, w, 1.0, dz[l], w, ones, g[2 * l + 1]).ctx(CTX)?;
                if l > 0 {
                    blas.gemm(false, false, b, i, w, 1.0, dz[l], w, a(&o[2 * l])?, i, 0.0, dz[l - 1], i).ctx(CTX)?;
                    k.act_bwd(dz[l - 1], hs[l - 1], b, i, Act::Relu).ctx(CTX)?;
                }
            }
        }
        let grads: Vec<&Tensor> = self.grads.iter().collect();
        fused.step_with(&self.loss, &grads, &[], dry).ctx(CTX)
    }
}
