//! Temporal fusion transformer (MODELS.md "TFT"): quantile forecasts of the forward
//! log-return over `H` horizon steps from `L_enc` encoder steps of market features and
//! calendar features known for encoder and decoder steps.
//!
//! A model built for a panel (`n_instruments > 0`, not in the spec) also takes each
//! window's instrument as a static covariate: a learned embedding whose encoders give the
//! variable selections' context, the LSTM's initial state and the enrichment's context, as
//! in the TFT paper
//! (`blocks::StaticContext`); its fused CUDA step, fused forecaster and INT8 version are
//! not built (it trains through candle's step).
//!
//! Parameters carry the spec's names (`enc_embed.{j}`, `enc_vsn.vars.{j}.fc1`,
//! `lstm_enc.weight_ih_l0`, `attn.q.{k}`, ...); per-variable embeddings, variable GRNs
//! and attention heads are stacked internally so that each is one batched matmul
//! (see [`crate::seq::params`]).

mod blocks;
// The fused step: training on CUDA (its CPU reference backend is what the tests run) and
// forecasts on any backend (`forecast`).
pub mod forecast;
pub(crate) mod fused;
pub mod int8;
#[cfg(feature = "cuda")]
pub mod int8_cuda;
pub mod ops;
#[cfg(feature = "cuda")]
pub mod ops_cuda;
#[cfg(all(test, feature = "cuda"))]
mod ops_cuda_tests;
#[cfg(test)]
mod tests;

use std::path::Path;

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor, Var};
use fx_precision::Recomputed;
use serde::{Deserialize, Serialize};

use crate::error::{Context, Error, Result};
use crate::params::ParamStore;
use crate::seq::ops::{Ctx, DropoutMasks};
use blocks::{EmbedVsn, Glu, Grn, InterpretableMha, Lin, Ln, Lstm, StaticContext};

/// TFT dimensions and hyper-parameters; defaults are the spec's.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct TftConfig {
    /// Observed (market) variables per encoder step.
    pub n_observed: usize,
    /// Known (calendar) variables per encoder and decoder step.
    pub n_known: usize,
    /// Width `d`.
    pub d: usize,
    /// Attention heads; must divide `d`.
    pub n_head: usize,
    /// Encoder steps.
    #[serde(rename = "L_enc")]
    pub l_enc: usize,
    /// Horizon (decoder) steps.
    #[serde(rename = "H")]
    pub h: usize,
    /// Dropout probability (training only).
    pub dropout: f64,
    /// Forecast quantiles.
    pub quantiles: Vec<f64>,
    /// LayerNorm epsilon.
    pub ln_eps: f64,
    /// Instruments of the panel the model is built for, each with a learned embedding
    /// feeding the static context; 0 (the default): the spec's single-instrument model,
    /// without static covariates.
    #[serde(skip_serializing_if = "is_zero")]
    pub n_instruments: usize,
}

fn is_zero(n: &usize) -> bool {
    *n == 0
}

impl TftConfig {
    /// The rows a training window reaches: the encoder's `L_enc` and the decoder's `H`
    /// (its targets' prices stay inside them).
    pub fn window_len(&self) -> usize {
        self.l_enc + self.h
    }

    /// Refuses a configuration that cannot build or train, naming the key (as in a run
    /// config's `[tft]` section), its value and the rule.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(Error::config("tft", m));
        if self.d == 0 || self.n_head == 0 || !self.d.is_multiple_of(self.n_head) {
            return bad(format!("n_head ({}) must divide d ({}), both at least 1", self.n_head, self.d));
        }
        if self.l_enc == 0 || self.h == 0 {
            return bad(format!("L_enc ({}) and H ({}) must be at least 1", self.l_enc, self.h));
        }
        if !(0.0..1.0).contains(&self.dropout) {
            return bad(format!("dropout ({}) must be in [0, 1)", self.dropout));
        }
        if !(self.ln_eps.is_finite() && self.ln_eps > 0.0) {
            return bad(format!("ln_eps ({}) must be finite and positive", self.ln_eps));
        }
        let q = &self.quantiles;
        if q.is_empty() || q.iter().any(|x| !(*x > 0.0 && *x < 1.0)) || q.windows(2).any(|w| w[0] >= w[1]) {
            return bad(format!("quantiles {q:?} must be non-empty, inside (0, 1), sorted and distinct"));
        }
        Ok(())
    }
}

impl Default for TftConfig {
    fn default() -> Self {
        Self {
            n_observed: 51,
            n_known: 4,
            d: 128,
            n_head: 4,
            l_enc: 64,
            h: 8,
            dropout: 0.1,
            quantiles: vec![0.1, 0.5, 0.9],
            ln_eps: 1e-5,
            n_instruments: 0,
        }
    }
}

/// Intermediate activations of one forward pass (debugging aids; the fixture's
/// `mid.*` tensors).
#[derive(Debug, Clone)]
pub struct TftAux {
    /// `[B, L_enc, n_observed + n_known]` encoder variable selection weights.
    pub enc_vsn_weights: Tensor,
    /// `[B, H, n_known]` decoder variable selection weights.
    pub dec_vsn_weights: Tensor,
    /// `[B, L_enc + H, d]` VSN outputs.
    pub vsn_out: Tensor,
    /// `[B, L_enc + H, d]` LSTM outputs.
    pub lstm_out: Tensor,
    /// `[B, L_enc + H, d]` gated skip after the LSTMs.
    pub phi: Tensor,
    /// `[B, L_enc + H, d]` enrichment GRN output.
    pub enriched: Tensor,
    /// `[B, n_head, H, L_enc + H]` attention weights.
    pub attn_weights: Tensor,
    /// `[B, H, d]` attention output (after `out`).
    pub attn_out: Tensor,
}

/// The point forecast `[B, H]` of quantile forecasts `[B, H, levels]`: the quantile whose
/// level is closest to the median.
pub fn point_forecast(levels: &[f64], q: &Tensor) -> Result<Tensor> {
    let mid =
        (0..levels.len()).min_by(|&a, &b| (levels[a] - 0.5).abs().total_cmp(&(levels[b] - 0.5).abs())).unwrap_or(0);
    q.narrow(2, mid, 1).and_then(|t| t.squeeze(2)).ctx("Tft point forecast")
}

/// Encoder-step segments of the variable selection under activation recomputation.
const VSN_ENC_SEGMENTS: usize = 4;

/// The temporal fusion transformer.
#[derive(Debug, Clone)]
pub struct Tft {
    cfg: TftConfig,
    params: ParamStore,
    enc: EmbedVsn,
    dec: EmbedVsn,
    lstm_enc: Lstm,
    lstm_dec: Lstm,
    post_lstm_glu: Glu,
    post_lstm_norm: Ln,
    enrich: Grn,
    attn: InterpretableMha,
    post_attn_glu: Glu,
    post_attn_norm: Ln,
    ff: Grn,
    pre_out_glu: Glu,
    pre_out_norm: Ln,
    head: Lin,
    /// A panel model's (`n_instruments > 0`).
    static_ctx: Option<StaticContext>,
}

impl Tft {
    /// A freshly initialised model (PyTorch's default initialisation scheme,
    /// LayerNorm 1/0), drawn from the counter-based generator with `seed`.
    pub fn new(cfg: TftConfig, device: &Device, seed: u64) -> Result<Self> {
        cfg.validate()?;
        Self::build(cfg, device, seed).ctx("Tft::new")
    }

    fn build(cfg: TftConfig, device: &Device, seed: u64) -> candle_core::Result<Self> {
        let (d, e, p) = (cfg.d, cfg.ln_eps, cfg.dropout);
        let n_enc = cfg.n_observed + cfg.n_known;
        let mut ps = ParamStore::new("tft", device, seed);
        // Registration order follows the reference's state_dict order.
        let enc = EmbedVsn::new(&mut ps, "enc_embed", "enc_vsn", n_enc, d, p, e)?;
        let dec = EmbedVsn::new(&mut ps, "dec_embed", "dec_vsn", cfg.n_known, d, p, e)?;
        let lstm_enc = Lstm::new(&mut ps, "lstm_enc", d)?;
        let lstm_dec = Lstm::new(&mut ps, "lstm_dec", d)?;
        let post_lstm_glu = Glu::new(&mut ps, "post_lstm_glu", d, d)?;
        let post_lstm_norm = Ln::new(&mut ps, "post_lstm_norm", d, e)?;
        let enrich = Grn::new(&mut ps, "enrich", d, d, d, p, e)?;
        let attn = InterpretableMha::new(&mut ps, "attn", d, cfg.n_head)?;
        let post_attn_glu = Glu::new(&mut ps, "post_attn_glu", d, d)?;
        let post_attn_norm = Ln::new(&mut ps, "post_attn_norm", d, e)?;
        let ff = Grn::new(&mut ps, "ff", d, d, d, p, e)?;
        let pre_out_glu = Glu::new(&mut ps, "pre_out_glu", d, d)?;
        let pre_out_norm = Ln::new(&mut ps, "pre_out_norm", d, e)?;
        let head = Lin::new(&mut ps, "head", d, cfg.quantiles.len())?;
        // After the spec's parameters, so a single-instrument model's stay as they were.
        let static_ctx =
            if cfg.n_instruments > 0 { Some(StaticContext::new(&mut ps, cfg.n_instruments, d, p, e)?) } else { None };
        Ok(Self {
            cfg,
            params: ps,
            enc,
            dec,
            lstm_enc,
            lstm_dec,
            post_lstm_glu,
            post_lstm_norm,
            enrich,
            attn,
            post_attn_glu,
            post_attn_norm,
            ff,
            pre_out_glu,
            pre_out_norm,
            head,
            static_ctx,
        })
    }

    /// Builds the model for `cfg` and loads its weights from a safetensors file.
    pub fn load(cfg: TftConfig, path: &Path, device: &Device) -> Result<Self> {
        let m = Self::new(cfg, device, 0)?;
        m.params.load(path)?;
        Ok(m)
    }

    /// Writes the weights under their spec names.
    pub fn save(&self, path: &Path) -> Result<()> {
        self.params.save(path)
    }

    /// The configuration.
    pub fn config(&self) -> &TftConfig {
        &self.cfg
    }

    /// The named parameters (load/save, gradients by name).
    pub fn params(&self) -> &ParamStore {
        &self.params
    }

    /// The tensors an optimiser updates.
    pub fn vars(&self) -> Vec<Var> {
        self.params.vars()
    }

    /// The weight matrices of every Linear the forward multiplies by (`x · Wᵀ`; the
    /// per-variable GRNs' as one stacked tensor each), in a fixed order.
    pub(crate) fn gemm_weights(&self) -> Vec<&Var> {
        let mut w = Vec::new();
        for e in [&self.enc, &self.dec] {
            let f = &e.flat;
            w.extend([&f.fc1.w, &f.fc2.w, &f.glu.fc4.w, &f.glu.fc5.w]);
            w.extend(f.skip.as_ref().map(|s| &s.w));
            w.extend([&e.vars.fc1.w, &e.vars.fc2.w, &e.vars.fc4.w, &e.vars.fc5.w]);
        }
        w.extend([&self.lstm_enc.w_ih, &self.lstm_dec.w_ih, &self.post_lstm_glu.fc4.w, &self.post_lstm_glu.fc5.w]);
        for g in [&self.enrich, &self.ff] {
            w.extend([&g.fc1.w, &g.fc2.w, &g.glu.fc4.w, &g.glu.fc5.w]);
        }
        w.extend([&self.attn.q.w, &self.attn.k.w, &self.attn.v.w, &self.attn.out.w]);
        w.extend([&self.post_attn_glu.fc4.w, &self.post_attn_glu.fc5.w, &self.pre_out_glu.fc4.w]);
        w.extend([&self.pre_out_glu.fc5.w, &self.head.w]);
        w
    }

    /// Every weight matrix of the model, `[out, in]` each or stacked `[parts, out, in]`:
    /// the Linears' ([`Self::gemm_weights`]) and the LSTMs' recurrent `W_hh` (what INT8
    /// quantisation covers; embeddings, biases and norms are not matrices). Each is a
    /// parameter of [`Self::params`], so [`ParamStore::part_names`] names its parts.
    pub fn weight_matrices(&self) -> Vec<&Var> {
        let mut w = self.gemm_weights();
        w.extend([&self.lstm_enc.w_hh, &self.lstm_dec.w_hh]);
        w
    }

    /// `[H, L_enc + H]` additive causal mask: decoder step `i` (absolute `L_enc + i`)
    /// sees absolute steps `≤ L_enc + i`.
    fn causal_mask(&self, dtype: DType, device: &Device) -> candle_core::Result<Tensor> {
        let (l, h) = (self.cfg.l_enc, self.cfg.h);
        let mut m = vec![0f32; h * (l + h)];
        for i in 0..h {
            for j in (l + i + 1)..(l + h) {
                m[i * (l + h) + j] = f32::NEG_INFINITY;
            }
        }
        Tensor::from_vec(m, (h, l + h), device)?.to_dtype(dtype)
    }

    /// Forward pass: `observed [B, L_enc, n_observed]`, `known [B, L_enc + H, n_known]`
    /// → quantiles `[B, H, n_quantiles]` (F32) and the intermediate
    /// activations.
    pub fn forward_aux(&self, c: &Ctx, observed: &Tensor, known: &Tensor) -> Result<(Tensor, TftAux)> {
        self.forward_aux_with(c, observed, known, None)
    }

    /// [`Self::forward_aux`] of a panel model: `instrument [B, n_instruments]` one-hot
    /// rows of the windows' instruments (`None` for a single-instrument model).
    pub fn forward_aux_with(
        &self,
        c: &Ctx,
        observed: &Tensor,
        known: &Tensor,
        instrument: Option<&Tensor>,
    ) -> Result<(Tensor, TftAux)> {
        const CTX: &str = "Tft::forward";
        self.check_inputs(observed, known, CTX)?;
        self.check_instrument(observed, instrument, CTX)?;
        self.forward_impl(c, observed, known, instrument).ctx(CTX)
    }

    fn forward_impl(
        &self,
        c: &Ctx,
        observed: &Tensor,
        known: &Tensor,
        instrument: Option<&Tensor>,
    ) -> candle_core::Result<(Tensor, TftAux)> {
        let cfg = &self.cfg;
        let (b, l, h, d) = (observed.dim(0)?, cfg.l_enc, cfg.h, cfg.d);
        let packed = self.pack(observed, known, instrument)?;
        // Segment numbers as in the checkpointed path, so recorded masks replay here.
        let seg = |k: usize| c.masks.inspect(|m| m.begin_segment(k));
        let n_vsn = self.vsn_chunks().len();
        let (vsn_out, enc_w, dec_w) = self.stage_vsn(c, &packed)?;
        seg(n_vsn);
        let (phi_enriched, lstm_out) = self.stage_temporal(c, &vsn_out, self.static_of(&packed)?.as_ref())?;
        seg(n_vsn + 1);
        let (out, attn_w, attn_out) = self.stage_attention(c, &phi_enriched)?;
        let aux = TftAux {
            enc_vsn_weights: enc_w.reshape((b, l, cfg.n_observed + cfg.n_known))?,
            dec_vsn_weights: dec_w.reshape((b, h, cfg.n_known))?,
            vsn_out,
            lstm_out,
            phi: phi_enriched.narrow(2, 0, d)?,
            enriched: phi_enriched.narrow(2, d, d)?,
            attn_weights: attn_w,
            attn_out,
        };
        Ok((out, aux))
    }

    /// The inputs as one tensor `[B, L_enc + H, n_observed + n_known (+ n_instruments)]`
    /// (observed zero on the decoder steps; a panel model's instrument one-hot on every
    /// step), so that each stage has a single input and output and the stages can be
    /// checkpoint segments.
    fn pack(&self, observed: &Tensor, known: &Tensor, instrument: Option<&Tensor>) -> candle_core::Result<Tensor> {
        let observed = observed.to_dtype(DType::F32)?.pad_with_zeros(1, 0, self.cfg.h)?;
        let known = known.to_dtype(DType::F32)?;
        match instrument {
            Some(i) => {
                let (b, t) = (known.dim(0)?, known.dim(1)?);
                let i = i.to_dtype(DType::F32)?.unsqueeze(1)?.broadcast_as((b, t, self.cfg.n_instruments))?;
                Tensor::cat(&[&observed, &known, &i.contiguous()?], 2)
            }
            None => Tensor::cat(&[&observed, &known], 2),
        }
    }

    /// Columns of the packed raw inputs (the instrument's included).
    fn n_raw(&self) -> usize {
        self.cfg.n_observed + self.cfg.n_known + self.cfg.n_instruments
    }

    /// A panel model's instrument one-hot `[B, n_instruments]` from packed raw inputs
    /// (`[B, T, ≥ n_raw]`, its first step).
    fn static_of(&self, packed: &Tensor) -> candle_core::Result<Option<Tensor>> {
        if self.static_ctx.is_none() {
            return Ok(None);
        }
        let n_in = self.cfg.n_observed + self.cfg.n_known;
        Ok(Some(packed.narrow(1, 0, 1)?.narrow(2, n_in, self.cfg.n_instruments)?.squeeze(1)?.contiguous()?))
    }

    /// Stage 1, embeddings and variable selection: packed inputs → VSN outputs
    /// `[B, L_enc + H, d]` (and the selection weights).
    fn stage_vsn(&self, c: &Ctx, packed: &Tensor) -> candle_core::Result<(Tensor, Tensor, Tensor)> {
        let cfg = &self.cfg;
        let (b, l, h) = (packed.dim(0)?, cfg.l_enc, cfg.h);
        if let Some(masks) = c.masks {
            // Chunked exactly as the checkpointed path, so that recorded dropout masks
            // replay here.
            let (mut xs, mut ws) = (Vec::new(), Vec::new());
            for (k, &(t0, t1)) in self.vsn_chunks().iter().enumerate() {
                masks.begin_segment(k);
                let (x, w) = self.vsn_chunk(c, packed, t0, t1)?;
                xs.push(x);
                ws.push(w.reshape((b, t1 - t0, ()))?);
            }
            let ws_enc = Tensor::cat(&ws[..ws.len() - 1], 1)?.reshape((b * l, ()))?;
            let ws_dec = ws[ws.len() - 1].reshape((b * h, ()))?;
            return Ok((Tensor::cat(&xs, 1)?, ws_enc, ws_dec));
        }
        let (enc_x, enc_w) = self.vsn_chunk(c, packed, 0, l)?;
        let (dec_x, dec_w) = self.vsn_chunk(c, packed, l, l + h)?;
        Ok((Tensor::cat(&[&enc_x, &dec_x], 1)?, enc_w, dec_w))
    }

    /// Variable selection of steps `t0..t1`, all encoder or all decoder steps:
    /// `[B, t1 − t0, d]` and the weights `[B·(t1 − t0), n_vars]`.
    fn vsn_chunk(&self, c: &Ctx, packed: &Tensor, t0: usize, t1: usize) -> candle_core::Result<(Tensor, Tensor)> {
        let cfg = &self.cfg;
        let (b, t, d) = (packed.dim(0)?, t1 - t0, cfg.d);
        let rows = packed.narrow(1, t0, t)?;
        let decoder = t1 > cfg.l_enc;
        // A panel model's selection context, one per window, repeated over its steps.
        let context = match (&self.static_ctx, self.static_of(&rows)?) {
            (Some(s), Some(i)) => {
                let ctx = s.selection(c, &i, decoder)?;
                Some(ctx.unsqueeze(1)?.broadcast_as((b, t, d))?.contiguous()?.reshape((b * t, d))?)
            }
            _ => None,
        };
        let (x, w) = if !decoder {
            let n_in = cfg.n_observed + cfg.n_known;
            self.enc.fwd(c, &rows.narrow(2, 0, n_in)?.contiguous()?.reshape((b * t, n_in))?, context.as_ref())?
        } else {
            let known = rows.narrow(2, cfg.n_observed, cfg.n_known)?.contiguous()?;
            self.dec.fwd(c, &known.reshape((b * t, cfg.n_known))?, context.as_ref())?
        };
        Ok((x.reshape((b, t, d))?, w))
    }

    /// Step ranges of the variable-selection segments: the encoder steps in up to
    /// [`VSN_ENC_SEGMENTS`] parts, then the decoder steps. Variable selection dominates
    /// the TFT's activation memory and is independent per step, so splitting it is what
    /// makes checkpointing pay.
    fn vsn_chunks(&self) -> Vec<(usize, usize)> {
        let (l, h) = (self.cfg.l_enc, self.cfg.h);
        let n = VSN_ENC_SEGMENTS.min(l);
        let mut out: Vec<(usize, usize)> = (0..n).map(|k| (k * l / n, (k + 1) * l / n)).collect();
        out.push((l, l + h));
        out
    }

    /// Stage 2, LSTM encoder/decoder, gated skip and enrichment: VSN outputs (and a panel
    /// model's instrument one-hot) → `[φ, enriched]` concatenated on the last axis
    /// `[B, L_enc + H, 2d]` (and the LSTM outputs).
    fn stage_temporal(
        &self,
        c: &Ctx,
        vsn_out: &Tensor,
        instrument: Option<&Tensor>,
    ) -> candle_core::Result<(Tensor, Tensor)> {
        let cfg = &self.cfg;
        let (b, l, h, d) = (vsn_out.dim(0)?, cfg.l_enc, cfg.h, cfg.d);
        let (state0, enrich_ctx) = match (&self.static_ctx, instrument) {
            (Some(s), Some(i)) => {
                let (h0, c0, e) = s.fwd(c, i)?;
                ((h0, c0), Some(e))
            }
            _ => {
                let zeros = Tensor::zeros((b, d), DType::F32, vsn_out.device())?;
                ((zeros.clone(), zeros), None)
            }
        };
        let (enc_out, state) = self.lstm_enc.fwd(c, &vsn_out.narrow(1, 0, l)?, state0)?;
        let (dec_out, _) = self.lstm_dec.fwd(c, &vsn_out.narrow(1, l, h)?, state)?;
        let lstm_out = Tensor::cat(&[&enc_out, &dec_out], 1)?;
        let gated = self.post_lstm_glu.fwd(c, &c.dropout(&lstm_out, cfg.dropout)?)?;
        let phi = self.post_lstm_norm.fwd(c, &(vsn_out + gated)?)?;
        let enriched = self.enrich.fwd_with(c, &phi, enrich_ctx.as_ref())?;
        Ok((Tensor::cat(&[&phi, &enriched], 2)?, lstm_out))
    }

    /// Stage 3, attention, feed-forward and head: `[φ, enriched]` → quantiles
    /// `[B, H, Q]` (and the attention weights and output).
    fn stage_attention(&self, c: &Ctx, phi_enriched: &Tensor) -> candle_core::Result<(Tensor, Tensor, Tensor)> {
        let cfg = &self.cfg;
        let (l, h, d) = (cfg.l_enc, cfg.h, cfg.d);
        let phi = phi_enriched.narrow(2, 0, d)?;
        let enriched = phi_enriched.narrow(2, d, d)?.contiguous()?;
        let mask = self.causal_mask(DType::F32, enriched.device())?;
        let enriched_dec = enriched.narrow(1, l, h)?;
        let (attn_out, attn_w) = self.attn.fwd(c, &enriched_dec, &enriched, &mask)?;
        let gated = self.post_attn_glu.fwd(c, &c.dropout(&attn_out, cfg.dropout)?)?;
        let x = self.post_attn_norm.fwd(c, &(&enriched_dec + gated)?)?;
        let x = self.ff.fwd(c, &x)?;
        let x = self.pre_out_norm.fwd(c, &(phi.narrow(1, l, h)? + self.pre_out_glu.fwd(c, &x)?)?)?;
        Ok((self.head.fwd(c, &x)?, attn_w, attn_out))
    }

    /// Pinball loss of the forecast for `observed`, `known` against `target [B, H]`
    /// and the gradients of every parameter. With `recompute`, the stages (variable
    /// selection, split into up to 4 encoder-step chunks and the decoder steps; LSTMs +
    /// gated skip + enrichment; attention to head) are recompute segments (`fx_precision::Recomputed`): only the stage inputs are
    /// kept for the backward, each stage runs twice, and dropout masks are recorded
    /// (as U8) so that the re-run drops the same units.
    pub fn loss_and_grads(
        &self,
        c: &Ctx,
        observed: &Tensor,
        known: &Tensor,
        target: &Tensor,
        recompute: bool,
    ) -> Result<(Tensor, GradStore)> {
        self.loss_and_grads_with(c, observed, known, None, target, recompute)
    }

    /// [`Self::loss_and_grads`] of a panel model (`instrument` as in
    /// [`Self::forward_aux_with`]).
    pub fn loss_and_grads_with(
        &self,
        c: &Ctx,
        observed: &Tensor,
        known: &Tensor,
        instrument: Option<&Tensor>,
        target: &Tensor,
        recompute: bool,
    ) -> Result<(Tensor, GradStore)> {
        const CTX: &str = "Tft::loss_and_grads";
        if !recompute {
            let q = self.forward_aux_with(c, observed, known, instrument)?.0;
            let loss = self.loss(&q, target)?;
            let grads = loss.backward().ctx(CTX)?;
            return Ok((loss, grads));
        }
        // Shape checks as in the plain forward.
        self.check_inputs(observed, known, CTX)?;
        self.check_instrument(observed, instrument, CTX)?;
        // Dropout must replay in the re-run: record masks unless the caller already does.
        let own = DropoutMasks::new();
        let masks = c.masks.unwrap_or(&own);
        let c = c.with_masks(masks);
        let c = &c;
        // Segments: one per VSN chunk over a carried state [raw inputs | VSN outputs so
        // far], then the temporal stage, then attention to head.
        let n_in = self.n_raw();
        let d = self.cfg.d;
        let chunks = self.vsn_chunks();
        let mut stack = Recomputed::new();
        for (k, &(t0, t1)) in chunks.iter().enumerate() {
            stack = stack.push(move |s: &Tensor| {
                masks.begin_segment(k);
                let raw = s.narrow(2, 0, n_in)?;
                let (new, _) = self.vsn_chunk(c, &raw, t0, t1)?;
                let done = s.narrow(2, n_in, d)?;
                let total = s.dim(1)?;
                let mut parts = Vec::with_capacity(3);
                if t0 > 0 {
                    parts.push(done.narrow(1, 0, t0)?);
                }
                parts.push(new);
                if t1 < total {
                    parts.push(done.narrow(1, t1, total - t1)?);
                }
                Tensor::cat(&[&raw, &Tensor::cat(&parts, 1)?], 2)
            });
        }
        let k = chunks.len();
        let stack = stack
            .push(move |s: &Tensor| {
                masks.begin_segment(k);
                let instrument = self.static_of(s)?;
                self.stage_temporal(c, &s.narrow(2, n_in, d)?.contiguous()?, instrument.as_ref()).map(|r| r.0)
            })
            .push(move |x: &Tensor| {
                masks.begin_segment(k + 1);
                self.stage_attention(c, x).map(|r| r.0)
            });
        let packed = self.pack(observed, known, instrument).and_then(|p| p.pad_with_zeros(2, 0, d)).ctx(CTX)?;
        let tape = stack.forward(&packed).ctx(CTX)?;
        let loss = self.loss(tape.output(), target)?;
        let grads = stack.backward(tape, &loss).ctx(CTX)?;
        Ok((loss, grads))
    }

    fn check_inputs(&self, observed: &Tensor, known: &Tensor, context: &'static str) -> Result<()> {
        let cfg = &self.cfg;
        let (l, h) = (cfg.l_enc, cfg.h);
        let b = observed.dims().first().copied().unwrap_or(0);
        if b == 0 || observed.dims() != [b, l, cfg.n_observed] {
            let want = format!("[B, {l}, {}]", cfg.n_observed);
            return Err(Error::shape("observed", context, want, format!("{:?}", observed.dims())));
        }
        if known.dims() != [b, l + h, cfg.n_known] {
            let want = format!("[{b}, {}, {}]", l + h, cfg.n_known);
            return Err(Error::shape("known", context, want, format!("{:?}", known.dims())));
        }
        Ok(())
    }

    /// A panel model needs each window's instrument `[B, n_instruments]`; a
    /// single-instrument model takes none.
    fn check_instrument(&self, observed: &Tensor, instrument: Option<&Tensor>, context: &'static str) -> Result<()> {
        let (b, n) = (observed.dims()[0], self.cfg.n_instruments);
        match instrument {
            None if n == 0 => Ok(()),
            None => Err(Error::config(
                context,
                format!("this TFT is built for a panel of {n} instruments: each window's instrument is needed"),
            )),
            Some(_) if n == 0 => Err(Error::config(
                context,
                "an instrument was given to a single-instrument TFT (build it with n_instruments)",
            )),
            Some(i) if i.dims() != [b, n] => {
                Err(Error::shape("instrument", context, format!("[{b}, {n}]"), format!("{:?}", i.dims())))
            }
            Some(_) => Ok(()),
        }
    }

    /// Forward pass returning only the quantiles `[B, H, n_quantiles]`.
    pub fn forward(&self, c: &Ctx, observed: &Tensor, known: &Tensor) -> Result<Tensor> {
        Ok(self.forward_aux(c, observed, known)?.0)
    }

    /// [`Self::forward`] of a panel model (`instrument` as in [`Self::forward_aux_with`]).
    pub fn forward_with(
        &self,
        c: &Ctx,
        observed: &Tensor,
        known: &Tensor,
        instrument: Option<&Tensor>,
    ) -> Result<Tensor> {
        Ok(self.forward_aux_with(c, observed, known, instrument)?.0)
    }

    /// Mean pinball loss of `pred [B, H, Q]` against `target [B, H]` (F32 scalar).
    pub fn loss(&self, pred: &Tensor, target: &Tensor) -> Result<Tensor> {
        quantile_loss(pred, target, &self.cfg.quantiles)
    }
}

/// Mean pinball loss over batch, horizons and quantiles: per element
/// `max(q e, (q − 1) e)` with `e = y − ŷ_q`; computed in F32 (F64 stays F64).
pub fn quantile_loss(pred: &Tensor, target: &Tensor, quantiles: &[f64]) -> Result<Tensor> {
    const CTX: &str = "quantile_loss";
    let dt = if pred.dtype() == DType::F64 { DType::F64 } else { DType::F32 };
    let pd = pred.dims();
    if pd.len() != 3 || pd[2] != quantiles.len() || target.dims() != &pd[..2] {
        return Err(Error::shape(
            "pred/target",
            CTX,
            format!("pred [B, H, {}] and target [B, H]", quantiles.len()),
            format!("{:?} and {:?}", pd, target.dims()),
        ));
    }
    let run = || -> candle_core::Result<Tensor> {
        let q = Tensor::new(quantiles, pred.device())?.to_dtype(dt)?;
        let e = target.to_dtype(dt)?.unsqueeze(2)?.broadcast_sub(&pred.to_dtype(dt)?)?;
        let a = e.broadcast_mul(&q)?;
        let bb = e.broadcast_mul(&(q - 1.0)?)?;
        a.maximum(&bb)?.mean_all()
    };
    run().ctx(CTX)
}
