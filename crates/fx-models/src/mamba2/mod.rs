//! MAMBA-2 (SSD) regressor (MODELS.md "MAMBA-2"): per-step predictions of the next
//! step's log-return from market features, trained with MSE.
//!
//! `embed → n_layer × (x + mixer(rmsnorm(x))) → norm_f → head`. The mixer's scan is
//! the chunked SSD ([`ssd::ssd_chunked`]) for whole sequences and the recurrence
//! ([`Mamba2::step`]) for one new bar at a time with constant memory.

pub mod decode;
pub mod decode_cpu;
#[cfg(feature = "cuda")]
pub mod decode_cuda;
pub mod decode_ref;
#[cfg(feature = "cuda")]
pub mod fused;
#[cfg(feature = "cuda")]
pub mod ops_cuda;
#[cfg(all(test, feature = "cuda"))]
mod ops_cuda_tests;
pub mod ops_ref;
pub mod ssd;
#[cfg(feature = "cuda")]
pub mod ssd_cuda;
pub mod ssd_ref;
#[cfg(any(test, feature = "cuda"))]
mod step;
#[cfg(test)]
mod tests;

use std::path::Path;

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor, Var};
use fx_precision::Recomputed;
use serde::{Deserialize, Serialize};

use crate::error::{Context, Error, Result};
use crate::params::{init_uniform, Init, ParamStore};
use crate::seq::ops::{rms_norm, rms_normalize, softplus, Ctx};

/// MAMBA-2 dimensions; defaults are the spec's.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Mamba2Config {
    /// Input features per step.
    pub n_in: usize,
    /// Residual width.
    pub d_model: usize,
    /// Number of layers.
    pub n_layer: usize,
    /// `d_inner = expand · d_model`.
    pub expand: usize,
    /// SSM state size `N` per head.
    pub d_state: usize,
    /// Channels per head `P`.
    pub headdim: usize,
    /// B/C groups (heads share B and C within a group).
    pub ngroups: usize,
    /// Causal depthwise convolution width.
    pub d_conv: usize,
    /// SSD chunk length.
    pub chunk_size: usize,
    /// RMSNorm epsilon.
    pub norm_eps: f64,
}

impl Default for Mamba2Config {
    fn default() -> Self {
        Self {
            n_in: 51,
            d_model: 256,
            n_layer: 4,
            expand: 2,
            d_state: 64,
            headdim: 64,
            ngroups: 1,
            d_conv: 4,
            chunk_size: 64,
            norm_eps: 1e-5,
        }
    }
}

impl Mamba2Config {
    /// `expand · d_model`.
    pub fn d_inner(&self) -> usize {
        self.expand * self.d_model
    }
    /// `d_inner / headdim`.
    pub fn nheads(&self) -> usize {
        self.d_inner() / self.headdim
    }
    /// `d_inner + 2 · ngroups · d_state`.
    pub fn conv_dim(&self) -> usize {
        self.d_inner() + 2 * self.ngroups * self.d_state
    }

    /// Refuses dimensions that cannot build, naming the key (as in a run config's
    /// `[mamba2]` section), its value and the rule.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(Error::config("mamba2", m));
        let sizes = [
            ("n_in", self.n_in),
            ("d_model", self.d_model),
            ("n_layer", self.n_layer),
            ("expand", self.expand),
            ("d_state", self.d_state),
            ("headdim", self.headdim),
            ("ngroups", self.ngroups),
            ("d_conv", self.d_conv),
            ("chunk_size", self.chunk_size),
        ];
        if let Some((key, v)) = sizes.iter().find(|(_, v)| *v == 0) {
            return bad(format!("{key} ({v}) must be at least 1"));
        }
        let (di, hd) = (self.d_inner(), self.headdim);
        if !di.is_multiple_of(hd) {
            return bad(format!("headdim ({hd}) must divide expand x d_model ({di})"));
        }
        if !self.nheads().is_multiple_of(self.ngroups) || !di.is_multiple_of(self.ngroups) {
            return bad(format!("ngroups ({}) must divide the {} heads", self.ngroups, self.nheads()));
        }
        if !(self.norm_eps.is_finite() && self.norm_eps > 0.0) {
            return bad(format!("norm_eps ({}) must be finite and positive", self.norm_eps));
        }
        Ok(())
    }
}

/// Intermediate activations of one layer (the fixture's `mid.layers.{i}.*`).
#[derive(Debug, Clone)]
pub struct Mamba2LayerAux {
    /// `[B, L, conv_dim]` conv + SiLU output.
    pub xbc: Tensor,
    /// `[B, L, nheads]` `softplus(dt + dt_bias)`.
    pub dt: Tensor,
    /// `[B, L, d_inner]` SSD output before the `D` skip.
    pub y_ssd: Tensor,
    /// `[B, L, d_inner]` after the gated RMSNorm.
    pub y_gated: Tensor,
    /// `[B, L, d_model]` residual stream after the layer.
    pub out: Tensor,
    /// `[B, d_conv − 1, conv_dim]` the last conv inputs (recurrent conv state after
    /// the last step).
    pub conv_state: Tensor,
    /// `[B, nheads, headdim, d_state]` the SSM state after the last step.
    pub ssm_state: Tensor,
}

#[derive(Debug, Clone)]
struct Mixer {
    in_proj: Var,
    conv_w: Var,
    conv_b: Var,
    dt_bias: Var,
    a_log: Var,
    d: Var,
    norm_w: Var,
    out_proj: Var,
}

#[derive(Debug, Clone)]
struct Layer {
    norm_w: Var,
    mixer: Mixer,
}

/// Recurrent state of every layer for [`Mamba2::step`]: the last `d_conv − 1` conv
/// inputs and the SSM state. Its size does not depend on how many bars were seen.
#[derive(Debug, Clone)]
pub struct Mamba2State {
    /// Per layer `[B, d_conv − 1, conv_dim]`.
    conv: Vec<Tensor>,
    /// Per layer `[B, nheads, headdim, d_state]`.
    ssm: Vec<Tensor>,
}

impl Mamba2State {
    /// A copy in fresh contiguous buffers of its own (a state from
    /// [`Mamba2::forward_with_state`] holds views into the forward's tensors), which
    /// [`Mamba2State::assign`] can then overwrite in place.
    pub fn to_buffers(&self) -> Result<Mamba2State> {
        let own = |t: &Tensor| t.contiguous().and_then(|t| t.copy()).ctx("Mamba2State::to_buffers");
        Ok(Mamba2State {
            conv: self.conv.iter().map(own).collect::<Result<_>>()?,
            ssm: self.ssm.iter().map(own).collect::<Result<_>>()?,
        })
    }

    /// Overwrites this state's buffers in place with `other`'s values (same model and
    /// batch), e.g. so that a captured CUDA graph of [`Mamba2::step`] keeps reading and
    /// writing the same memory. The buffers must be contiguous (see
    /// [`Mamba2State::to_buffers`]).
    pub fn assign(&self, other: &Mamba2State) -> Result<()> {
        if self.conv.iter().chain(&self.ssm).any(|t| !t.is_contiguous()) {
            return Err(Error::shape(
                "state",
                "Mamba2State::assign",
                "contiguous buffers (Mamba2State::to_buffers)",
                "views",
            ));
        }
        let same = self.conv.len() == other.conv.len()
            && self.ssm.len() == other.ssm.len()
            && self
                .conv
                .iter()
                .chain(&self.ssm)
                .zip(other.conv.iter().chain(&other.ssm))
                .all(|(a, b)| a.dims() == b.dims());
        if !same {
            return Err(Error::shape(
                "state",
                "Mamba2State::assign",
                "a state of the same model and batch",
                "another shape",
            ));
        }
        for (dst, src) in self.conv.iter().chain(&self.ssm).zip(other.conv.iter().chain(&other.ssm)) {
            dst.slice_set(&src.to_dtype(dst.dtype()).and_then(|t| t.contiguous()).ctx("Mamba2State::assign")?, 0, 0)
                .ctx("Mamba2State::assign")?;
        }
        Ok(())
    }
}

/// The MAMBA-2 regressor.
#[derive(Debug, Clone)]
pub struct Mamba2 {
    cfg: Mamba2Config,
    params: ParamStore,
    embed_w: Var,
    embed_b: Var,
    layers: Vec<Layer>,
    norm_f: Var,
    head_w: Var,
    head_b: Var,
}

/// Values for the SSM parameters (Mamba-2's usual init, not normative): dt
/// log-uniform in [1e-3, 1e-1] stored as softplus⁻¹, `A_log = ln U(1, 16)`.
fn ssm_init(nh: usize, seed: u64, index: u64, device: &Device) -> candle_core::Result<(Tensor, Tensor)> {
    let draws = init_uniform(seed, index, 2 * nh);
    let u = Tensor::new(&draws[..nh], &Device::Cpu)?;
    let (lo, hi) = (1e-3f64.ln(), 1e-1f64.ln());
    let dt = ((u * (hi - lo))? + lo)?.exp()?.clamp(1e-4, f64::INFINITY)?;
    // softplus⁻¹(dt) = dt + ln(1 − e^{−dt})
    let dt_bias = (&dt + (1.0 - dt.neg()?.exp()?)?.log()?)?;
    let a = ((Tensor::new(&draws[nh..], &Device::Cpu)? * 15.0)? + 1.0)?.log()?;
    Ok((dt_bias.to_dtype(DType::F32)?.to_device(device)?, a.to_dtype(DType::F32)?.to_device(device)?))
}

impl Mamba2 {
    /// A freshly initialised model, drawn from the counter-based generator with `seed`.
    pub fn new(cfg: Mamba2Config, device: &Device, seed: u64) -> Result<Self> {
        cfg.validate()?;
        Self::build(cfg, device, seed).ctx("Mamba2::new")
    }

    fn build(cfg: Mamba2Config, device: &Device, seed: u64) -> candle_core::Result<Self> {
        let (dm, di, nh) = (cfg.d_model, cfg.d_inner(), cfg.nheads());
        let gn = cfg.ngroups * cfg.d_state;
        let mut ps = ParamStore::new("mamba2", device, seed);
        let u = |i: usize| Init::Uniform(1.0 / (i as f64).sqrt());
        let embed_w = ps.add("embed.weight", &[dm, cfg.n_in], u(cfg.n_in))?;
        let embed_b = ps.add("embed.bias", &[dm], u(cfg.n_in))?;
        let mut layers = Vec::with_capacity(cfg.n_layer);
        for i in 0..cfg.n_layer {
            let p = format!("layers.{i}");
            let m = format!("{p}.mixer");
            let norm_w = ps.add(format!("{p}.norm.weight"), &[dm], Init::Const(1.0))?;
            let in_proj = ps.add(format!("{m}.in_proj.weight"), &[2 * di + 2 * gn + nh, dm], u(dm))?;
            let conv_w = ps.add(format!("{m}.conv1d.weight"), &[cfg.conv_dim(), 1, cfg.d_conv], u(cfg.d_conv))?;
            let conv_b = ps.add(format!("{m}.conv1d.bias"), &[cfg.conv_dim()], u(cfg.d_conv))?;
            let dt_bias = ps.add(format!("{m}.dt_bias"), &[nh], Init::Const(0.0))?;
            let a_log = ps.add(format!("{m}.A_log"), &[nh], Init::Const(0.0))?;
            let (dtb, al) = ssm_init(nh, seed, ps.len() as u64, device)?;
            dt_bias.set(&dtb)?;
            a_log.set(&al)?;
            let d = ps.add(format!("{m}.D"), &[nh], Init::Const(1.0))?;
            let mnorm = ps.add(format!("{m}.norm.weight"), &[di], Init::Const(1.0))?;
            let out_proj = ps.add(format!("{m}.out_proj.weight"), &[dm, di], u(di))?;
            layers.push(Layer {
                norm_w,
                mixer: Mixer { in_proj, conv_w, conv_b, dt_bias, a_log, d, norm_w: mnorm, out_proj },
            });
        }
        let norm_f = ps.add("norm_f.weight", &[dm], Init::Const(1.0))?;
        let head_w = ps.add("head.weight", &[1, dm], u(dm))?;
        let head_b = ps.add("head.bias", &[1], u(dm))?;
        Ok(Self { cfg, params: ps, embed_w, embed_b, layers, norm_f, head_w, head_b })
    }

    /// Builds the model for `cfg` and loads its weights from a safetensors file.
    pub fn load(cfg: Mamba2Config, path: &Path, device: &Device) -> Result<Self> {
        let m = Self::new(cfg, device, 0)?;
        m.params.load(path)?;
        Ok(m)
    }

    /// Writes the weights under their spec names.
    pub fn save(&self, path: &Path) -> Result<()> {
        self.params.save(path)
    }

    /// The configuration.
    pub fn config(&self) -> &Mamba2Config {
        &self.cfg
    }

    /// The named parameters.
    pub fn params(&self) -> &ParamStore {
        &self.params
    }

    /// The tensors an optimiser updates.
    pub fn vars(&self) -> Vec<Var> {
        self.params.vars()
    }

    /// Forward pass `x [B, L, n_in] → [B, L]` (F32) with the per-layer activations.
    pub fn forward_aux(&self, c: &Ctx, x: &Tensor) -> Result<(Tensor, Vec<Mamba2LayerAux>)> {
        let ok = matches!(x.dims(), &[b, l, n] if b > 0 && l > 0 && n == self.cfg.n_in);
        if !ok {
            return Err(self.input_err(x, "Mamba2::forward", "[B, L, n_in] with B, L > 0"));
        }
        self.forward_impl(c, x).ctx("Mamba2::forward")
    }

    fn forward_impl(&self, c: &Ctx, x: &Tensor) -> candle_core::Result<(Tensor, Vec<Mamba2LayerAux>)> {
        let mut h = self.embed(c, x)?;
        let mut aux = Vec::with_capacity(self.layers.len());
        for layer in &self.layers {
            let (out, a) = self.layer_fwd(c, layer, &h)?;
            h = out;
            aux.push(a);
        }
        let out = self.head(c, &h)?.squeeze(2)?;
        Ok((out, aux))
    }

    fn embed(&self, c: &Ctx, x: &Tensor) -> candle_core::Result<Tensor> {
        c.linear(&x.to_dtype(DType::F32)?, &c.p(&self.embed_w)?, Some(&c.p(&self.embed_b)?))
    }

    /// One residual layer `h + mixer(rmsnorm(h))`.
    fn layer_fwd(&self, c: &Ctx, layer: &Layer, h: &Tensor) -> candle_core::Result<(Tensor, Mamba2LayerAux)> {
        let normed = rms_norm(h, &c.p(&layer.norm_w)?, self.cfg.norm_eps)?;
        let (m, mut a) = self.mixer_fwd(c, &layer.mixer, &normed)?;
        let out = (h + m)?;
        a.out = out.clone();
        Ok((out, a))
    }

    /// MSE loss of `x [B, L, n_in]` against `target [B, L]` and the gradients of every
    /// parameter. With `recompute`, each layer is a recompute segment
    /// (`fx_precision::Recomputed`): only the layer inputs are kept between the
    /// forward and the backward, and every layer runs twice.
    pub fn loss_and_grads(&self, c: &Ctx, x: &Tensor, target: &Tensor, recompute: bool) -> Result<(Tensor, GradStore)> {
        const CTX: &str = "Mamba2::loss_and_grads";
        if !recompute {
            let pred = self.forward(c, x)?;
            let loss = self.loss(&pred, target)?;
            let grads = loss.backward().ctx(CTX)?;
            return Ok((loss, grads));
        }
        let ok = matches!(x.dims(), &[b, l, n] if b > 0 && l > 0 && n == self.cfg.n_in);
        if !ok {
            return Err(self.input_err(x, CTX, "[B, L, n_in] with B, L > 0"));
        }
        let h0 = self.embed(c, x).ctx(CTX)?;
        let mut stack = Recomputed::new();
        for layer in &self.layers {
            stack = stack.push(move |h: &Tensor| self.layer_fwd(c, layer, h).map(|(o, _)| o));
        }
        let tape = stack.forward(&h0).ctx(CTX)?;
        let pred = self.head(c, tape.output()).and_then(|t| t.squeeze(2)).ctx(CTX)?;
        let loss = self.loss(&pred, target)?;
        let grads = stack.backward(tape, &loss).ctx(CTX)?;
        Ok((loss, grads))
    }

    /// Forward pass `x [B, L, n_in] → [B, L]`.
    pub fn forward(&self, c: &Ctx, x: &Tensor) -> Result<Tensor> {
        Ok(self.forward_aux(c, x)?.0)
    }

    /// Mean squared error over all steps (F32 scalar).
    pub fn loss(&self, pred: &Tensor, target: &Tensor) -> Result<Tensor> {
        mse_loss(pred, target)
    }

    fn input_err(&self, x: &Tensor, context: &'static str, what: &str) -> Error {
        Error::shape("x", context, format!("{what}, n_in = {}", self.cfg.n_in), format!("{:?}", x.dims()))
    }

    fn head(&self, c: &Ctx, h: &Tensor) -> candle_core::Result<Tensor> {
        let h = rms_norm(h, &c.p(&self.norm_f)?, self.cfg.norm_eps)?;
        c.linear(&h, &c.p(&self.head_w)?, Some(&c.p(&self.head_b)?))
    }

    /// Splits `in_proj`'s output `[.., 2·d_inner + 2·G·N + nheads]` into `z`, `xBC`, `dt`.
    fn split_in_proj(&self, zxbcdt: &Tensor) -> candle_core::Result<(Tensor, Tensor, Tensor)> {
        let di = self.cfg.d_inner();
        let cd = self.cfg.conv_dim();
        let last = zxbcdt.rank() - 1;
        Ok((
            zxbcdt.narrow(last, 0, di)?,
            zxbcdt.narrow(last, di, cd)?,
            zxbcdt.narrow(last, di + cd, self.cfg.nheads())?,
        ))
    }

    /// `B` or `C` `[.., G·N]` → per head `[.., nheads, N]` (head `k` uses group
    /// `k / (nheads/G)`).
    fn expand_groups(&self, t: &Tensor) -> candle_core::Result<Tensor> {
        let (g, n, nh) = (self.cfg.ngroups, self.cfg.d_state, self.cfg.nheads());
        let lead = &t.dims()[..t.rank() - 1];
        let mut s1 = lead.to_vec();
        s1.extend_from_slice(&[g, 1, n]);
        let mut s2 = lead.to_vec();
        s2.extend_from_slice(&[g, nh / g, n]);
        let mut s3 = lead.to_vec();
        s3.extend_from_slice(&[nh, n]);
        t.reshape(s1)?.broadcast_as(s2)?.contiguous()?.reshape(s3)
    }

    /// Gated RMSNorm `rmsnorm(y ⊙ silu(z)) · w`, normalised within each group.
    fn gated_norm(&self, c: &Ctx, mx: &Mixer, y: &Tensor, z: &Tensor) -> candle_core::Result<Tensor> {
        let g = self.cfg.ngroups;
        let di = self.cfg.d_inner();
        let yz = (y * z.silu()?)?;
        let dims = yz.dims().to_vec();
        let mut grouped = dims[..dims.len() - 1].to_vec();
        grouped.extend_from_slice(&[g, di / g]);
        let normed = rms_normalize(&yz.reshape(grouped)?, self.cfg.norm_eps)?.reshape(dims)?;
        normed.broadcast_mul(&c.p(&mx.norm_w)?)
    }

    fn mixer_fwd(&self, c: &Ctx, mx: &Mixer, u: &Tensor) -> candle_core::Result<(Tensor, Mamba2LayerAux)> {
        let cfg = &self.cfg;
        let (b, l, _) = u.dims3()?;
        let (di, nh, hp, gn, k) = (cfg.d_inner(), cfg.nheads(), cfg.headdim, cfg.ngroups * cfg.d_state, cfg.d_conv);
        let zxbcdt = c.linear(u, &c.p(&mx.in_proj)?, None)?;
        let (z, xbc, dt) = self.split_in_proj(&zxbcdt)?;

        // Depthwise causal conv: out_t = bias + Σ_k w[k] · x_{t−(K−1)+k}, zeros before
        // the start. K is small (4), so K shifted multiply-adds beat a conv kernel
        // and are trivially differentiable.
        let w = c.p(&mx.conv_w)?.squeeze(1)?; // [cd, K]
        let xpad = xbc.pad_with_zeros(1, k - 1, 0)?;
        let mut conv = c.p(&mx.conv_b)?.reshape((1, 1, cfg.conv_dim()))?.broadcast_as(xbc.shape())?.contiguous()?;
        for j in 0..k {
            let wj = w.narrow(1, j, 1)?.squeeze(1)?;
            conv = (conv + xpad.narrow(1, j, l)?.broadcast_mul(&wj)?)?;
        }
        let xbc = conv.silu()?;
        let x = xbc.narrow(2, 0, di)?;
        let bm = self.expand_groups(&xbc.narrow(2, di, gn)?)?;
        let cm = self.expand_groups(&xbc.narrow(2, di + gn, gn)?)?;

        let dt = softplus(&dt.broadcast_add(&c.p(&mx.dt_bias)?)?)?; // [b, l, nh]
        let a = c.p(&mx.a_log)?.exp()?.neg()?; // [nh]
        let xh = x.reshape((b, l, nh, hp))?;
        let xs = xh.broadcast_mul(&dt.unsqueeze(3)?)?;
        let as_ = dt.broadcast_mul(&a)?;
        // As under PyTorch autocast: decays (dt, A·dt, segment sums, exponentials) are
        // F32 and only the scan's matmuls use the compute dtype.
        let (y, ssm_state) = ssd::ssd_chunked(c, &xs, &as_, &bm, &cm, cfg.chunk_size)?;
        let y_ssd = y.reshape((b, l, di))?;
        let y = (y + xh.broadcast_mul(&c.p(&mx.d)?.reshape((nh, 1))?)?)?.reshape((b, l, di))?;
        let y_gated = self.gated_norm(c, mx, &y, &z)?;
        let out = c.linear(&y_gated, &c.p(&mx.out_proj)?, None)?;
        let conv_state = xpad.narrow(1, l, k - 1)?;
        let aux = Mamba2LayerAux { xbc, dt, y_ssd, y_gated, out: out.clone(), conv_state, ssm_state };
        Ok((out, aux))
    }

    /// Inference over a whole history `x [B, L, n_in]` with the chunked scan
    /// ("prefill"): the predictions `[B, L]` and the recurrent state after the last
    /// step, from which [`Mamba2::step`] continues bar by bar.
    pub fn forward_with_state(&self, c: &Ctx, x: &Tensor) -> Result<(Tensor, Mamba2State)> {
        let c = Ctx { grad: false, train: false, ..*c };
        let (pred, aux) = self.forward_aux(&c, x)?;
        let ctx = "Mamba2::forward_with_state";
        let conv = aux.iter().map(|a| a.conv_state.contiguous()).collect::<candle_core::Result<_>>().ctx(ctx)?;
        let ssm = aux.iter().map(|a| a.ssm_state.to_dtype(DType::F32)).collect::<candle_core::Result<_>>().ctx(ctx)?;
        Ok((pred, Mamba2State { conv, ssm }))
    }

    /// A zero recurrent state for `batch` sequences (the state before the first bar).
    pub fn init_state(&self, batch: usize) -> Result<Mamba2State> {
        self.init_state_impl(batch).ctx("Mamba2::init_state")
    }

    fn init_state_impl(&self, batch: usize) -> candle_core::Result<Mamba2State> {
        let cfg = &self.cfg;
        let dev = self.params.device();
        let n = cfg.n_layer;
        Ok(Mamba2State {
            conv: (0..n)
                .map(|_| Tensor::zeros((batch, cfg.d_conv - 1, cfg.conv_dim()), DType::F32, dev))
                .collect::<candle_core::Result<_>>()?,
            ssm: (0..n)
                .map(|_| Tensor::zeros((batch, cfg.nheads(), cfg.headdim, cfg.d_state), DType::F32, dev))
                .collect::<candle_core::Result<_>>()?,
        })
    }

    /// Consumes one new bar `x [B, n_in]` and returns the prediction `[B]` for it,
    /// updating `state` in place. Constant memory per bar; no gradient tape; equal to
    /// the last output of [`Mamba2::forward`] over the whole sequence so far.
    pub fn step(&self, c: &Ctx, x: &Tensor, state: &mut Mamba2State) -> Result<Tensor> {
        let ok = matches!(x.dims(), &[b, n] if b > 0 && n == self.cfg.n_in);
        if !ok {
            return Err(self.input_err(x, "Mamba2::step", "[B, n_in]"));
        }
        let fits =
            state.ssm.len() == self.layers.len() && state.ssm.first().and_then(|t| t.dim(0).ok()) == Some(x.dims()[0]);
        if !fits {
            return Err(Error::shape(
                "state",
                "Mamba2::step",
                "a state from init_state(B) of this model",
                "another batch size or layer count",
            ));
        }
        self.step_impl(c, x, state).ctx("Mamba2::step")
    }

    fn step_impl(&self, c: &Ctx, x: &Tensor, state: &mut Mamba2State) -> candle_core::Result<Tensor> {
        let c = Ctx { grad: false, train: false, ..*c };
        let cfg = &self.cfg;
        let b = x.dim(0)?;
        let (di, nh, hp, gn, k) = (cfg.d_inner(), cfg.nheads(), cfg.headdim, cfg.ngroups * cfg.d_state, cfg.d_conv);
        let x = x.to_dtype(DType::F32)?;
        let mut h = c.linear(&x, &c.p(&self.embed_w)?, Some(&c.p(&self.embed_b)?))?; // [b, dm]
        for (i, layer) in self.layers.iter().enumerate() {
            let mx = &layer.mixer;
            let u = rms_norm(&h, &c.p(&layer.norm_w)?, cfg.norm_eps)?;
            let zxbcdt = c.linear(&u, &c.p(&mx.in_proj)?, None)?;
            let (z, xbc, dt) = self.split_in_proj(&zxbcdt)?;
            let window = Tensor::cat(&[&state.conv[i], &xbc.unsqueeze(1)?], 1)?; // [b, K, cd]
            state.conv[i] = window.narrow(1, 1, k - 1)?.contiguous()?;
            let w = c.p(&mx.conv_w)?.squeeze(1)?.t()?; // [K, cd]
            let xbc = window.broadcast_mul(&w)?.sum(1)?.broadcast_add(&c.p(&mx.conv_b)?)?.silu()?;
            let xt = xbc.narrow(1, 0, di)?;
            let bm = self.expand_groups(&xbc.narrow(1, di, gn)?)?; // [b, nh, N]
            let cm = self.expand_groups(&xbc.narrow(1, di + gn, gn)?)?;
            let dt = softplus(&dt.broadcast_add(&c.p(&mx.dt_bias)?)?)?; // [b, nh]
            let a = c.p(&mx.a_log)?.exp()?.neg()?;
            let xh = xt.reshape((b, nh, hp))?;
            let xs = xh.broadcast_mul(&dt.unsqueeze(2)?)?;
            let (y, s) = ssd::ssd_step(&state.ssm[i], &xs, &dt.broadcast_mul(&a)?, &bm, &cm)?;
            state.ssm[i] = s;
            let y = (y + xh.broadcast_mul(&c.p(&mx.d)?.reshape((nh, 1))?)?)?.reshape((b, di))?;
            let y = self.gated_norm(&c, mx, &y, &z)?;
            h = (h + c.linear(&y, &c.p(&mx.out_proj)?, None)?)?;
        }
        self.head(&c, &h)?.squeeze(1)
    }
}

/// Mean squared error of `pred` against `target` (same shape), in F32 (F64 stays F64).
pub fn mse_loss(pred: &Tensor, target: &Tensor) -> Result<Tensor> {
    if pred.dims() != target.dims() {
        return Err(Error::shape(
            "target",
            "mse_loss",
            format!("{:?} (the prediction's shape)", pred.dims()),
            format!("{:?}", target.dims()),
        ));
    }
    let dt = if pred.dtype() == DType::F64 { DType::F64 } else { DType::F32 };
    let run = || (pred.to_dtype(dt)? - target.to_dtype(dt)?)?.sqr()?.mean_all();
    run().ctx("mse_loss")
}
