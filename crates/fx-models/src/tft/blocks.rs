//! TFT building blocks: Linear, GLU, GRN (single and stacked per variable), variable
//! selection, LSTM with PyTorch's layout, interpretable multi-head attention, and a
//! panel's static context.

use candle_core::{Tensor, Var};

use crate::params::{Init, ParamStore};
use crate::seq::ops::{layer_norm, sigmoid, softmax_last_dim, Ctx};
use candle_core::Result;

/// `Linear(i→o)` with bias, PyTorch layout.
#[derive(Debug, Clone)]
pub(crate) struct Lin {
    pub(super) w: Var,
    pub(super) b: Var,
}

impl Lin {
    pub(crate) fn new(ps: &mut ParamStore, name: &str, i: usize, o: usize) -> Result<Self> {
        let bound = 1.0 / (i as f64).sqrt();
        Ok(Self {
            w: ps.add(format!("{name}.weight"), &[o, i], Init::Uniform(bound))?,
            b: ps.add(format!("{name}.bias"), &[o], Init::Uniform(bound))?,
        })
    }

    pub(crate) fn fwd(&self, c: &Ctx, x: &Tensor) -> Result<Tensor> {
        c.linear(x, &c.p(&self.w)?, Some(&c.p(&self.b)?))
    }
}

/// `n` Linear(i→o) layers, one per variable, held as `w [n, o, i]`, `b [n, o]`.
#[derive(Debug, Clone)]
pub(crate) struct StackedLin {
    pub(super) w: Var,
    pub(super) b: Var,
}

impl StackedLin {
    pub(crate) fn new(ps: &mut ParamStore, prefixes: &[String], i: usize, o: usize) -> Result<Self> {
        let bound = 1.0 / (i as f64).sqrt();
        let names = |s: &str| prefixes.iter().map(|p| format!("{p}.{s}")).collect::<Vec<_>>();
        Ok(Self {
            w: ps.add_stacked(names("weight"), &[o, i], Init::Uniform(bound))?,
            b: ps.add_stacked(names("bias"), &[o], Init::Uniform(bound))?,
        })
    }

    /// `x [n, M, i] → [n, M, o]`, variable `j` through its own layer.
    fn fwd(&self, c: &Ctx, x: &Tensor) -> Result<Tensor> {
        let w = c.p(&self.w)?; // [n, o, i]
        let b = c.p(&self.b)?.unsqueeze(1)?; // [n, 1, o]
        c.mm(x, &w.transpose(1, 2)?)?.broadcast_add(&b)
    }

    /// Per-variable scalar embedding (i = 1): `x [M, n] → [n, M, o]`.
    pub(crate) fn embed(&self, c: &Ctx, x: &Tensor) -> Result<Tensor> {
        let w = c.p(&self.w)?.squeeze(2)?.unsqueeze(1)?; // [n, 1, o]
        let b = c.p(&self.b)?.unsqueeze(1)?;
        let xt = x.t()?.unsqueeze(2)?; // [n, M, 1]
        xt.broadcast_mul(&w)?.broadcast_add(&b)
    }

    /// Concatenated along the output axis: `[n·o, i]` weight and `[n·o]` bias (the
    /// attention heads as one matmul).
    fn concat(&self, c: &Ctx) -> Result<(Tensor, Tensor)> {
        let w = c.p(&self.w)?;
        let (n, o, i) = w.dims3()?;
        Ok((w.reshape((n * o, i))?, c.p(&self.b)?.reshape(n * o)?))
    }
}

/// LayerNorm(o) with weight and bias.
#[derive(Debug, Clone)]
pub(crate) struct Ln {
    pub(super) w: Var,
    pub(super) b: Var,
    pub(super) eps: f64,
}

impl Ln {
    pub(crate) fn new(ps: &mut ParamStore, name: &str, o: usize, eps: f64) -> Result<Self> {
        Ok(Self {
            w: ps.add(format!("{name}.weight"), &[o], Init::Const(1.0))?,
            b: ps.add(format!("{name}.bias"), &[o], Init::Const(0.0))?,
            eps,
        })
    }

    pub(crate) fn fwd(&self, c: &Ctx, x: &Tensor) -> Result<Tensor> {
        layer_norm(x, &c.p(&self.w)?, &c.p(&self.b)?, self.eps)
    }
}

/// `GLU(i→o)`: `sigmoid(fc4(x)) ⊙ fc5(x)`.
#[derive(Debug, Clone)]
pub(crate) struct Glu {
    pub(super) fc4: Lin,
    pub(super) fc5: Lin,
}

impl Glu {
    pub(crate) fn new(ps: &mut ParamStore, name: &str, i: usize, o: usize) -> Result<Self> {
        Ok(Self { fc4: Lin::new(ps, &format!("{name}.fc4"), i, o)?, fc5: Lin::new(ps, &format!("{name}.fc5"), i, o)? })
    }

    pub(crate) fn fwd(&self, c: &Ctx, x: &Tensor) -> Result<Tensor> {
        sigmoid(&self.fc4.fwd(c, x)?)? * self.fc5.fwd(c, x)?
    }
}

/// `GRN(i→o, hidden d)`: `out = norm(skip(x) + glu(dropout(fc2(ELU(fc1(x))))))`.
#[derive(Debug, Clone)]
pub(crate) struct Grn {
    pub(super) fc1: Lin,
    pub(super) fc2: Lin,
    pub(super) glu: Glu,
    pub(super) norm: Ln,
    pub(super) skip: Option<Lin>,
    pub(super) dropout: f64,
}

impl Grn {
    pub(crate) fn new(
        ps: &mut ParamStore,
        name: &str,
        i: usize,
        o: usize,
        d: usize,
        dropout: f64,
        eps: f64,
    ) -> Result<Self> {
        Ok(Self {
            fc1: Lin::new(ps, &format!("{name}.fc1"), i, d)?,
            fc2: Lin::new(ps, &format!("{name}.fc2"), d, d)?,
            glu: Glu::new(ps, &format!("{name}.glu"), d, o)?,
            norm: Ln::new(ps, &format!("{name}.norm"), o, eps)?,
            skip: if i != o { Some(Lin::new(ps, &format!("{name}.skip"), i, o)?) } else { None },
            dropout,
        })
    }

    pub(crate) fn fwd(&self, c: &Ctx, x: &Tensor) -> Result<Tensor> {
        self.fwd_with(c, x, None)
    }

    /// With the TFT paper's context: `η2 = ELU(fc1(x) + context)`, `context` broadcast
    /// over `x`'s leading axes.
    pub(crate) fn fwd_with(&self, c: &Ctx, x: &Tensor, context: Option<&Tensor>) -> Result<Tensor> {
        let pre = self.fc1.fwd(c, x)?;
        let pre = match context {
            Some(ctx) => pre.broadcast_add(ctx)?,
            None => pre,
        };
        let eta2 = pre.elu(1.0)?;
        let eta1 = c.dropout(&self.fc2.fwd(c, &eta2)?, self.dropout)?;
        let res = match &self.skip {
            Some(s) => s.fwd(c, x)?,
            None => x.clone(),
        };
        self.norm.fwd(c, &(res + self.glu.fwd(c, &eta1)?)?)
    }
}

/// `n` GRN(d→d), one per variable, evaluated as batched matmuls on `[n, M, d]`.
#[derive(Debug, Clone)]
pub(crate) struct StackedGrn {
    pub(super) fc1: StackedLin,
    pub(super) fc2: StackedLin,
    pub(super) fc4: StackedLin,
    pub(super) fc5: StackedLin,
    pub(super) norm_w: Var,
    pub(super) norm_b: Var,
    pub(super) eps: f64,
    pub(super) dropout: f64,
}

impl StackedGrn {
    pub(crate) fn new(ps: &mut ParamStore, prefixes: &[String], d: usize, dropout: f64, eps: f64) -> Result<Self> {
        let sub = |s: &str| prefixes.iter().map(|p| format!("{p}.{s}")).collect::<Vec<_>>();
        Ok(Self {
            fc1: StackedLin::new(ps, &sub("fc1"), d, d)?,
            fc2: StackedLin::new(ps, &sub("fc2"), d, d)?,
            fc4: StackedLin::new(ps, &sub("glu.fc4"), d, d)?,
            fc5: StackedLin::new(ps, &sub("glu.fc5"), d, d)?,
            norm_w: ps.add_stacked(sub("norm.weight"), &[d], Init::Const(1.0))?,
            norm_b: ps.add_stacked(sub("norm.bias"), &[d], Init::Const(0.0))?,
            eps,
            dropout,
        })
    }

    /// `x [n, M, d] → [n, M, d]`.
    fn fwd(&self, c: &Ctx, x: &Tensor) -> Result<Tensor> {
        let eta2 = self.fc1.fwd(c, x)?.elu(1.0)?;
        let eta1 = c.dropout(&self.fc2.fwd(c, &eta2)?, self.dropout)?;
        let gate = sigmoid(&self.fc4.fwd(c, &eta1)?)?;
        let y = (x + (gate * self.fc5.fwd(c, &eta1)?)?)?;
        let w = c.p(&self.norm_w)?.unsqueeze(1)?;
        let b = c.p(&self.norm_b)?.unsqueeze(1)?;
        layer_norm(&y, &w, &b, self.eps)
    }
}

/// Per-variable embeddings followed by a variable selection network.
#[derive(Debug, Clone)]
pub(crate) struct EmbedVsn {
    pub(super) embed: StackedLin,
    pub(super) flat: Grn,
    pub(super) vars: StackedGrn,
    pub(super) n: usize,
    pub(super) d: usize,
}

impl EmbedVsn {
    pub(crate) fn new(
        ps: &mut ParamStore,
        embed_name: &str,
        vsn_name: &str,
        n: usize,
        d: usize,
        dropout: f64,
        eps: f64,
    ) -> Result<Self> {
        let embeds: Vec<String> = (0..n).map(|j| format!("{embed_name}.{j}")).collect();
        let embed = StackedLin::new(ps, &embeds, 1, d)?;
        let flat = Grn::new(ps, &format!("{vsn_name}.flat"), n * d, n, d, dropout, eps)?;
        let vars: Vec<String> = (0..n).map(|j| format!("{vsn_name}.vars.{j}")).collect();
        let vars = StackedGrn::new(ps, &vars, d, dropout, eps)?;
        Ok(Self { embed, flat, vars, n, d })
    }

    /// `x [M, n]` raw variables → (`[M, d]` selected mix, `[M, n]` selection weights); with
    /// a panel model's static context `[M, d]` added inside the selection GRN.
    pub(crate) fn fwd(&self, c: &Ctx, x: &Tensor, context: Option<&Tensor>) -> Result<(Tensor, Tensor)> {
        let m = x.dim(0)?;
        let emb = self.embed.embed(c, x)?; // [n, M, d]
                                           // The flat GRN sees the embeddings variable-major: flat[j·d + k] = emb_j[k].
        let flat_in = emb.transpose(0, 1)?.reshape((m, self.n * self.d))?;
        let w = softmax_last_dim(&self.flat.fwd_with(c, &flat_in, context)?)?; // [M, n]
        let outs = self.vars.fwd(c, &emb)?; // [n, M, d]
        let mix = outs.broadcast_mul(&w.t()?.unsqueeze(2)?)?.sum(0)?;
        Ok((mix, w))
    }
}

/// Single-layer batch-first LSTM with PyTorch's parameter layout, gate order i, f, g, o.
#[derive(Debug, Clone)]
pub(crate) struct Lstm {
    pub(super) w_ih: Var,
    pub(super) w_hh: Var,
    pub(super) b_ih: Var,
    pub(super) b_hh: Var,
    pub(super) d: usize,
}

impl Lstm {
    pub(crate) fn new(ps: &mut ParamStore, name: &str, d: usize) -> Result<Self> {
        let bound = 1.0 / (d as f64).sqrt();
        Ok(Self {
            w_ih: ps.add(format!("{name}.weight_ih_l0"), &[4 * d, d], Init::Uniform(bound))?,
            w_hh: ps.add(format!("{name}.weight_hh_l0"), &[4 * d, d], Init::Uniform(bound))?,
            b_ih: ps.add(format!("{name}.bias_ih_l0"), &[4 * d], Init::Uniform(bound))?,
            b_hh: ps.add(format!("{name}.bias_hh_l0"), &[4 * d], Init::Uniform(bound))?,
            d,
        })
    }

    /// `x [B, T, d]`, state `(h, c)` each `[B, d]` → (`[B, T, d]`, final `(h, c)`).
    pub(crate) fn fwd(&self, c: &Ctx, x: &Tensor, state: (Tensor, Tensor)) -> Result<(Tensor, (Tensor, Tensor))> {
        let d = self.d;
        let t_len = x.dim(1)?;
        // The input projection of every step is one matmul; only the recurrent part loops.
        let bias = (c.p(&self.b_ih)? + c.p(&self.b_hh)?)?;
        let xg = c.linear(x, &c.p(&self.w_ih)?, Some(&bias))?; // [B, T, 4d]
        let w_hh_t = c.p(&self.w_hh)?.t()?;
        let (mut h, mut cell) = state;
        let mut outs = Vec::with_capacity(t_len);
        for t in 0..t_len {
            let g = (xg.narrow(1, t, 1)?.squeeze(1)? + c.mm(&h, &w_hh_t)?)?;
            let sg = sigmoid(&g)?;
            let i = sg.narrow(1, 0, d)?;
            let f = sg.narrow(1, d, d)?;
            let o = sg.narrow(1, 3 * d, d)?;
            let gg = g.narrow(1, 2 * d, d)?.tanh()?;
            cell = ((f * &cell)? + (i * gg)?)?;
            h = (o * cell.tanh()?)?;
            outs.push(h.clone());
        }
        Ok((Tensor::stack(&outs, 1)?, (h, cell)))
    }
}

/// Interpretable multi-head attention: per-head queries and keys, one shared value
/// projection, heads averaged before `out`.
#[derive(Debug, Clone)]
pub(crate) struct InterpretableMha {
    pub(super) q: StackedLin,
    pub(super) k: StackedLin,
    pub(super) v: Lin,
    pub(super) out: Lin,
    pub(super) n_head: usize,
    pub(super) dk: usize,
}

impl InterpretableMha {
    pub(crate) fn new(ps: &mut ParamStore, name: &str, d: usize, n_head: usize) -> Result<Self> {
        let dk = d / n_head;
        let heads = |s: &str| (0..n_head).map(|k| format!("{name}.{s}.{k}")).collect::<Vec<_>>();
        Ok(Self {
            q: StackedLin::new(ps, &heads("q"), d, dk)?,
            k: StackedLin::new(ps, &heads("k"), d, dk)?,
            v: Lin::new(ps, &format!("{name}.v"), d, dk)?,
            out: Lin::new(ps, &format!("{name}.out"), dk, d)?,
            n_head,
            dk,
        })
    }

    /// `xq [B, Q, d]`, `xkv [B, K, d]`, additive mask `[Q, K]` → (`[B, Q, d]`,
    /// attention weights `[B, n_head, Q, K]`).
    pub(crate) fn fwd(&self, c: &Ctx, xq: &Tensor, xkv: &Tensor, mask: &Tensor) -> Result<(Tensor, Tensor)> {
        let (b, nq, _) = xq.dims3()?;
        let nk = xkv.dim(1)?;
        let (h, dk) = (self.n_head, self.dk);
        let (wq, bq) = self.q.concat(c)?;
        let (wk, bk) = self.k.concat(c)?;
        let q = c.linear(xq, &wq, Some(&bq))?.reshape((b, nq, h, dk))?.transpose(1, 2)?.contiguous()?;
        let k = c.linear(xkv, &wk, Some(&bk))?.reshape((b, nk, h, dk))?.transpose(1, 2)?.contiguous()?;
        let v = self.v.fwd(c, xkv)?; // [B, K, dk]
        let scores = (c.mm(&q, &k.transpose(2, 3)?.contiguous()?)? / (dk as f64).sqrt())?;
        let attn = softmax_last_dim(&scores.broadcast_add(mask)?)?; // [B, h, Q, K]
        let heads = c.mm(&attn, &v.unsqueeze(1)?.broadcast_as((b, h, nk, dk))?.contiguous()?)?;
        let avg = heads.mean(1)?; // [B, Q, dk]
        Ok((self.out.fwd(c, &avg)?, attn))
    }
}

/// A panel model's static context (not in the spec's single-instrument TFT): the
/// instrument is the one static covariate, a learned embedding `static_embed` (a
/// Linear(n_instruments→d) without bias of its one-hot row), and as in the TFT paper GRN
/// encoders of it give the LSTM encoder's initial hidden (`static_h`) and cell
/// (`static_c`) state and the enrichment's context (`static_e`, entering the `enrich` GRN
/// through `enrich.context`, a Linear(d→d) without bias) and of the variable selection
/// (`static_s`, entering both selection GRNs through `enc_vsn.flat.context` and
/// `dec_vsn.flat.context`).
#[derive(Debug, Clone)]
pub(crate) struct StaticContext {
    pub(super) embed: Var,
    pub(super) h: Grn,
    pub(super) c: Grn,
    pub(super) e: Grn,
    pub(super) enrich_ctx: Var,
    pub(super) s: Grn,
    pub(super) enc_vsn_ctx: Var,
    pub(super) dec_vsn_ctx: Var,
}

impl StaticContext {
    pub(crate) fn new(ps: &mut ParamStore, n: usize, d: usize, dropout: f64, eps: f64) -> Result<Self> {
        Ok(Self {
            // Unit variance, as PyTorch's nn.Embedding draws.
            embed: ps.add("static_embed.weight".to_string(), &[d, n], Init::Uniform(3f64.sqrt()))?,
            h: Grn::new(ps, "static_h", d, d, d, dropout, eps)?,
            c: Grn::new(ps, "static_c", d, d, d, dropout, eps)?,
            e: Grn::new(ps, "static_e", d, d, d, dropout, eps)?,
            enrich_ctx: ps.add("enrich.context.weight".to_string(), &[d, d], Init::Uniform(1.0 / (d as f64).sqrt()))?,
            s: Grn::new(ps, "static_s", d, d, d, dropout, eps)?,
            enc_vsn_ctx: ps.add(
                "enc_vsn.flat.context.weight".to_string(),
                &[d, d],
                Init::Uniform(1.0 / (d as f64).sqrt()),
            )?,
            dec_vsn_ctx: ps.add(
                "dec_vsn.flat.context.weight".to_string(),
                &[d, d],
                Init::Uniform(1.0 / (d as f64).sqrt()),
            )?,
        })
    }

    /// `one_hot [B, n]` → the selection context `[B, d]` of the encoder's (or decoder's)
    /// variable selection.
    pub(crate) fn selection(&self, c: &Ctx, one_hot: &Tensor, decoder: bool) -> Result<Tensor> {
        let e = c.linear(one_hot, &c.p(&self.embed)?, None)?;
        let w = if decoder { &self.dec_vsn_ctx } else { &self.enc_vsn_ctx };
        c.linear(&self.s.fwd(c, &e)?, &c.p(w)?, None)
    }

    /// `one_hot [B, n]` → the LSTM's initial `(h, c)` `[B, d]` each and the enrichment
    /// context `[B, 1, d]`.
    pub(crate) fn fwd(&self, c: &Ctx, one_hot: &Tensor) -> Result<(Tensor, Tensor, Tensor)> {
        let e = c.linear(one_hot, &c.p(&self.embed)?, None)?;
        let ctx_e = c.linear(&self.e.fwd(c, &e)?, &c.p(&self.enrich_ctx)?, None)?.unsqueeze(1)?;
        Ok((self.h.fwd(c, &e)?, self.c.fwd(c, &e)?, ctx_e))
    }
}
