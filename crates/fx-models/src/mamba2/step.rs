//! One MAMBA-2 training step (forward, MSE loss, backward) as a fixed list of operations on
//! preallocated buffers ([`StepPlan::record`]), written once against the [`Backend`] trait: the
//! GPU backend (`fused::Mamba2Fused`) turns each operation into a cuBLAS call or a kernel of
//! `fx_kernels::cuda::{mamba2, ssd}`, and the CPU backend of the tests runs the same list on
//! the f64 references (`fx_kernels::{mamba2_ref, ssd_ref}`), so the buffer layouts, offsets,
//! transposes and the order of the step are checked against candle's autograd without a GPU.
//!
//! Layout: rows are batch-major, `r = b·L + t`. Per layer `l` the plan keeps what the backward
//! reads: the layer input `h_l` (the embedding output with its bias for `l = 0`), the RMSNorm
//! `rstd` and output `u`, the in_proj output `zxbcdt [BL, 2·di + 2·G·N + nh]`, the conv output
//! `xbc [BL, conv_dim]`, `dt [BL, nh]`, the scan's `y_ssd` and `y` (after the `D` skip), the
//! chunk states, the gated norm's `rstd [BL, G]` and output. `out_proj` accumulates onto a copy
//! of `h_l` (written by the layer's RMSNorm) to form `h_{l+1}`. Gradients land in one flat
//! buffer in `Mamba2::params().vars()` order; every slice is overwritten (never accumulated)
//! on each call. Weight-gradient reductions are per-block partial sums followed by column
//! sums, so a step is deterministic.

use crate::mamba2::ops_ref::{conv_tiles, row_blocks, MixerDims, MAX_CONV, MAX_NORM_COLS};
use crate::mamba2::ssd_ref::{SsdDims, SSD_MAX_DIM};

use super::{Mamba2, Mamba2Config};
use crate::error::{Error, Result};

/// A buffer of the step (an index into [`StepPlan::bufs`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Buf(pub(crate) usize);

/// An element position in a buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct At {
    pub(crate) buf: Buf,
    pub(crate) off: usize,
}

impl Buf {
    fn at(self, off: usize) -> At {
        At { buf: self, off }
    }
    fn start(self) -> At {
        self.at(0)
    }
}

/// What a buffer holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum BufKind {
    /// The model's parameter of this index in `params().vars()` (the backend's own tensor).
    Param(usize),
    /// The input `x [B, L, n_in]` (the caller's tensor).
    Input,
    /// The target `[B, L]` (the caller's tensor).
    Target,
    /// Owned scratch or activations.
    Act,
    /// The flat gradient buffer.
    Grad,
    /// The scalar loss.
    Loss,
}

/// One buffer: F32 of `len` elements, with a BF16 shadow when `bf16` (a GEMM input under BF16
/// compute; every write of it also writes the shadow).
#[derive(Debug, Clone, Copy)]
pub(crate) struct BufSpec {
    pub(crate) kind: BufKind,
    pub(crate) len: usize,
    pub(crate) bf16: bool,
}

/// A row-major GEMM `C (+)= op(A) op(B)` (`Blas::run`'s conventions, alpha 1). In BF16 mode it
/// reads the BF16 shadows when both `A` and `B` have one.
#[derive(Debug, Clone, Copy)]
pub(crate) struct GemmOp {
    pub(crate) ta: bool,
    pub(crate) tb: bool,
    pub(crate) m: usize,
    pub(crate) n: usize,
    pub(crate) k: usize,
    pub(crate) a: At,
    pub(crate) lda: usize,
    pub(crate) b: At,
    pub(crate) ldb: usize,
    pub(crate) c: At,
    pub(crate) ldc: usize,
    pub(crate) accumulate: bool,
}

impl GemmOp {
    /// Dense row strides, overwriting `C`.
    #[allow(clippy::too_many_arguments)]
    fn new(ta: bool, tb: bool, m: usize, n: usize, k: usize, a: At, b: At, c: At) -> Self {
        let (lda, ldb) = (if ta { m } else { k }, if tb { k } else { n });
        Self { ta, tb, m, n, k, a, lda, b, ldb, c, ldc: n, accumulate: false }
    }
}

/// `y[c] = Σ_r a[r·lda + c]` over `rows` rows.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ColSumsOp {
    pub(crate) rows: usize,
    pub(crate) cols: usize,
    pub(crate) a: At,
    pub(crate) lda: usize,
    pub(crate) y: At,
}

/// See `mamba2_ref::rmsnorm_fwd` (the `bias` is added to `h` in place).
#[derive(Debug, Clone, Copy)]
pub(crate) struct RmsFwdOp {
    pub(crate) h: At,
    pub(crate) bias: Option<At>,
    pub(crate) w: At,
    pub(crate) copy: Option<At>,
    pub(crate) u: At,
    pub(crate) rstd: At,
    pub(crate) rows: usize,
    pub(crate) cols: usize,
    pub(crate) eps: f64,
}

/// The upstream gradient of an RMSNorm backward.
#[derive(Debug, Clone, Copy)]
pub(crate) enum RowGradAt {
    Full(At),
    Outer { scale: At, vec: At },
}

/// See `mamba2_ref::rmsnorm_bwd`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RmsBwdOp {
    pub(crate) du: RowGradAt,
    pub(crate) h: At,
    pub(crate) rstd: At,
    pub(crate) w: At,
    pub(crate) dh: At,
    pub(crate) accumulate: bool,
    pub(crate) partials: At,
    pub(crate) rows: usize,
    pub(crate) cols: usize,
}

/// See `mamba2_ref::conv_fwd`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ConvFwdOp {
    pub(crate) zx: At,
    pub(crate) ld: usize,
    pub(crate) xoff: usize,
    pub(crate) w: At,
    pub(crate) b: At,
    pub(crate) dt_bias: At,
    pub(crate) xbc: At,
    pub(crate) dt: At,
    pub(crate) dims: MixerDims,
}

/// See `mamba2_ref::conv_bwd` (`dzx` is the start of a buffer laid out as `zx`).
#[derive(Debug, Clone, Copy)]
pub(crate) struct ConvBwdOp {
    pub(crate) zx: At,
    pub(crate) ld: usize,
    pub(crate) xoff: usize,
    pub(crate) w: At,
    pub(crate) b: At,
    pub(crate) dx: At,
    pub(crate) dbc: At,
    pub(crate) dzx: At,
    pub(crate) ldo: usize,
    pub(crate) partials: At,
    pub(crate) dims: MixerDims,
}

/// See `ssd_ref::ssd_fwd_chunked`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct SsdFwdOp {
    pub(crate) xbc: At,
    pub(crate) ld: usize,
    pub(crate) dt: At,
    pub(crate) a_log: At,
    pub(crate) d: At,
    pub(crate) y_ssd: At,
    pub(crate) y_out: At,
    pub(crate) states: At,
    pub(crate) dims: SsdDims,
}

/// See `ssd_ref::ssd_bwd_chunked` (`fwd.y_out` is not read).
#[derive(Debug, Clone, Copy)]
pub(crate) struct SsdBwdOp {
    pub(crate) fwd: SsdFwdOp,
    pub(crate) dy: At,
    pub(crate) dx: At,
    pub(crate) dbc: At,
    pub(crate) ddt_raw: At,
    pub(crate) ld_ddt: usize,
    pub(crate) partials: At,
}

/// See `mamba2_ref::gated_fwd`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct GatedFwdOp {
    pub(crate) y: At,
    pub(crate) z: At,
    pub(crate) ldz: usize,
    pub(crate) w: At,
    pub(crate) out: At,
    pub(crate) rstd: At,
    pub(crate) rows: usize,
    pub(crate) di: usize,
    pub(crate) groups: usize,
    pub(crate) eps: f64,
}

/// See `mamba2_ref::gated_bwd`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct GatedBwdOp {
    pub(crate) dout: At,
    pub(crate) y: At,
    pub(crate) z: At,
    pub(crate) ldz: usize,
    pub(crate) w: At,
    pub(crate) rstd: At,
    pub(crate) dy: At,
    pub(crate) dz: At,
    pub(crate) lddz: usize,
    pub(crate) partials: At,
    pub(crate) rows: usize,
    pub(crate) di: usize,
    pub(crate) groups: usize,
}

/// See `mamba2_ref::head_fwd`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct HeadFwdOp {
    pub(crate) h: At,
    pub(crate) w_norm: At,
    pub(crate) head_w: At,
    pub(crate) head_b: At,
    pub(crate) target: At,
    pub(crate) u_f: At,
    pub(crate) rstd: At,
    pub(crate) sq: At,
    pub(crate) dpred: At,
    pub(crate) rows: usize,
    pub(crate) cols: usize,
    pub(crate) eps: f64,
}

/// `loss = mean(sq)`, `dhead_b = Σ dpred`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct LossOp {
    pub(crate) sq: At,
    pub(crate) dpred: At,
    pub(crate) rows: usize,
    pub(crate) loss: At,
    pub(crate) dhead_b: At,
}

/// What runs a [`StepPlan`]'s operations: each method queues (GPU) or performs (CPU) one.
pub(crate) trait Backend {
    fn gemm(&mut self, g: &GemmOp) -> Result<()>;
    fn col_sums(&mut self, o: &ColSumsOp) -> Result<()>;
    /// Refreshes the BF16 shadows of `bufs` from their F32 values (BF16 mode only).
    fn cast_bf16(&mut self, bufs: &[Buf]) -> Result<()>;
    fn rmsnorm_fwd(&mut self, o: &RmsFwdOp) -> Result<()>;
    fn rmsnorm_bwd(&mut self, o: &RmsBwdOp) -> Result<()>;
    fn conv_fwd(&mut self, o: &ConvFwdOp) -> Result<()>;
    fn conv_bwd(&mut self, o: &ConvBwdOp) -> Result<()>;
    fn ssd_fwd(&mut self, o: &SsdFwdOp) -> Result<()>;
    fn ssd_bwd(&mut self, o: &SsdBwdOp) -> Result<()>;
    fn gated_fwd(&mut self, o: &GatedFwdOp) -> Result<()>;
    fn gated_bwd(&mut self, o: &GatedBwdOp) -> Result<()>;
    fn head_fwd(&mut self, o: &HeadFwdOp) -> Result<()>;
    fn loss_reduce(&mut self, o: &LossOp) -> Result<()>;
}

/// Sizes of the step.
#[derive(Debug, Clone, Copy)]
pub(crate) struct StepDims {
    pub(crate) batch: usize,
    pub(crate) len: usize,
    pub(crate) n_in: usize,
    pub(crate) dm: usize,
    pub(crate) di: usize,
    pub(crate) nh: usize,
    pub(crate) p: usize,
    pub(crate) n: usize,
    pub(crate) g: usize,
    pub(crate) k: usize,
    pub(crate) nl: usize,
    pub(crate) eps: f64,
    /// The scan's chunk: `min(chunk_size, 64)` (the chunk length changes nothing in the result).
    pub(crate) chunk: usize,
}

impl StepDims {
    pub(crate) fn rows(&self) -> usize {
        self.batch * self.len
    }
    /// in_proj width `2·di + 2·G·N + nh`.
    pub(crate) fn w(&self) -> usize {
        2 * self.di + 2 * self.g * self.n + self.nh
    }
    /// `di + 2·G·N`.
    pub(crate) fn cd(&self) -> usize {
        self.di + 2 * self.g * self.n
    }
    pub(crate) fn mixer(&self) -> MixerDims {
        MixerDims {
            batch: self.batch,
            len: self.len,
            d_inner: self.di,
            d_state: self.n,
            ngroups: self.g,
            nheads: self.nh,
            d_conv: self.k,
        }
    }
    pub(crate) fn ssd(&self) -> SsdDims {
        SsdDims {
            batch: self.batch,
            len: self.len,
            nheads: self.nh,
            headdim: self.p,
            d_state: self.n,
            ngroups: self.g,
            chunk: self.chunk,
        }
    }
}

/// The buffers of one layer.
#[derive(Debug, Clone, Copy)]
struct LayerBufs {
    h: Buf,
    rstd: Buf,
    u: Buf,
    zx: Buf,
    xbc: Buf,
    dt: Buf,
    y_ssd: Buf,
    y_out: Buf,
    grstd: Buf,
    yg: Buf,
    states: Buf,
}

/// Parameters per layer, in `params().vars()` order.
const PER_LAYER: usize = 9;

/// The buffers and the operation list of one training step; see the module docs.
#[derive(Debug, Clone)]
pub(crate) struct StepPlan {
    pub(crate) dims: StepDims,
    pub(crate) bufs: Vec<BufSpec>,
    pub(crate) x: Buf,
    pub(crate) target: Buf,
    pub(crate) grad: Buf,
    pub(crate) loss: Buf,
    /// Per parameter: its buffer, and its offset in the flat gradient.
    params: Vec<Buf>,
    pub(crate) grad_offsets: Vec<usize>,
    layers: Vec<LayerBufs>,
    h_last: Buf,
    rstd_f: Buf,
    u_f: Buf,
    sq: Buf,
    dpred: Buf,
    dh: Buf,
    dyg: Buf,
    dy: Buf,
    dzx: Buf,
    dbc: Buf,
    du: Buf,
    part: Buf,
    /// Buffers whose BF16 shadows come from a cast at the start (the input and the GEMM weights).
    cast: Vec<Buf>,
}

/// The parameter names and shapes a [`Mamba2`] of `cfg` registers, in order.
fn expected_params(cfg: &Mamba2Config) -> Vec<(String, Vec<usize>)> {
    let (dm, di, nh) = (cfg.d_model, cfg.d_inner(), cfg.nheads());
    let gn = cfg.ngroups * cfg.d_state;
    let mut v = vec![("embed.weight".to_string(), vec![dm, cfg.n_in]), ("embed.bias".to_string(), vec![dm])];
    for i in 0..cfg.n_layer {
        let m = format!("layers.{i}.mixer");
        v.push((format!("layers.{i}.norm.weight"), vec![dm]));
        v.push((format!("{m}.in_proj.weight"), vec![2 * di + 2 * gn + nh, dm]));
        v.push((format!("{m}.conv1d.weight"), vec![cfg.conv_dim(), 1, cfg.d_conv]));
        v.push((format!("{m}.conv1d.bias"), vec![cfg.conv_dim()]));
        v.push((format!("{m}.dt_bias"), vec![nh]));
        v.push((format!("{m}.A_log"), vec![nh]));
        v.push((format!("{m}.D"), vec![nh]));
        v.push((format!("{m}.norm.weight"), vec![di]));
        v.push((format!("{m}.out_proj.weight"), vec![dm, di]));
    }
    v.push(("norm_f.weight".to_string(), vec![dm]));
    v.push(("head.weight".to_string(), vec![1, dm]));
    v.push(("head.bias".to_string(), vec![1]));
    v
}

impl StepPlan {
    /// The plan for `batch` windows of `len` steps of `model`; `bf16` gives the GEMM inputs
    /// BF16 shadows. An error for sizes beyond the kernels' limits.
    pub(crate) fn new(model: &Mamba2, batch: usize, len: usize, bf16: bool) -> Result<Self> {
        const CTX: &str = "Mamba2Fused::new";
        let cfg = model.config();
        let dims = StepDims {
            batch,
            len,
            n_in: cfg.n_in,
            dm: cfg.d_model,
            di: cfg.d_inner(),
            nh: cfg.nheads(),
            p: cfg.headdim,
            n: cfg.d_state,
            g: cfg.ngroups,
            k: cfg.d_conv,
            nl: cfg.n_layer,
            eps: cfg.norm_eps,
            chunk: cfg.chunk_size.min(SSD_MAX_DIM),
        };
        let fits = batch > 0
            && len > 0
            && batch <= 65535
            && cfg.n_in > 0
            && cfg.headdim <= SSD_MAX_DIM
            && cfg.d_state <= SSD_MAX_DIM
            && cfg.d_conv <= MAX_CONV
            && cfg.d_model <= MAX_NORM_COLS
            && cfg.d_inner() <= MAX_NORM_COLS
            && dims.rows() < (1 << 31)
            && (dims.rows() as u64) * (dims.w().max(dims.nh * 2 * dims.n) as u64) < (1 << 40);
        if !fits {
            return Err(Error::config(
                CTX,
                format!(
                    "batch {batch} (1..=65535) × len {len} with {cfg:?}: the fused step needs headdim, d_state <= \
                     {SSD_MAX_DIM}, d_conv <= {MAX_CONV}, d_model and d_inner <= {MAX_NORM_COLS}"
                ),
            ));
        }
        dims.ssd().check(CTX).map_err(|e| Error::config(CTX, e.to_string()))?;
        let ours = model.params().names_and_shapes();
        if ours != expected_params(cfg) {
            return Err(Error::config(CTX, "the model's parameters are not in the order the fused step expects"));
        }
        let vars = model.params().vars();
        let mut bufs = Vec::new();
        let mut add = |kind: BufKind, len: usize, half: bool| {
            bufs.push(BufSpec { kind, len, bf16: half && bf16 });
            Buf(bufs.len() - 1)
        };
        let np = vars.len();
        let params: Vec<Buf> = (0..np)
            .map(|i| {
                // GEMM weights: embed, in_proj and out_proj of every layer.
                let gemm_w = i == 0 || (i >= 2 && i < 2 + PER_LAYER * dims.nl && matches!((i - 2) % PER_LAYER, 1 | 8));
                add(BufKind::Param(i), vars[i].elem_count(), gemm_w)
            })
            .collect();
        let mut grad_offsets = Vec::with_capacity(np);
        let mut total = 0;
        for v in &vars {
            grad_offsets.push(total);
            total += v.elem_count();
        }
        let (rows, dm, di, nh, w, cd) = (dims.rows(), dims.dm, dims.di, dims.nh, dims.w(), dims.cd());
        let x = add(BufKind::Input, rows * dims.n_in, true);
        let target = add(BufKind::Target, rows, false);
        let grad = add(BufKind::Grad, total, false);
        let loss = add(BufKind::Loss, 1, false);
        let mut layers = Vec::with_capacity(dims.nl);
        let mut h = add(BufKind::Act, rows * dm, false);
        for _ in 0..dims.nl {
            let l = LayerBufs {
                h,
                rstd: add(BufKind::Act, rows, false),
                u: add(BufKind::Act, rows * dm, true),
                zx: add(BufKind::Act, rows * w, false),
                xbc: add(BufKind::Act, rows * cd, false),
                dt: add(BufKind::Act, rows * nh, false),
                y_ssd: add(BufKind::Act, rows * di, false),
                y_out: add(BufKind::Act, rows * di, false),
                grstd: add(BufKind::Act, rows * dims.g, false),
                yg: add(BufKind::Act, rows * di, true),
                states: add(BufKind::Act, dims.ssd().states_len(), false),
            };
            layers.push(l);
            h = add(BufKind::Act, rows * dm, false);
        }
        let h_last = h;
        let mix = dims.mixer();
        let part_len = (row_blocks(rows) * dm.max(di)).max(mix.conv_partials_len()).max(dims.ssd().partials_len());
        let mut cast = vec![x, params[0]];
        for l in 0..dims.nl {
            cast.push(params[2 + PER_LAYER * l + 1]);
            cast.push(params[2 + PER_LAYER * l + 8]);
        }
        let plan = StepPlan {
            dims,
            x,
            target,
            grad,
            loss,
            params,
            grad_offsets,
            layers,
            h_last,
            rstd_f: add(BufKind::Act, rows, false),
            u_f: add(BufKind::Act, rows * dm, false),
            sq: add(BufKind::Act, rows, false),
            dpred: add(BufKind::Act, rows, false),
            dh: add(BufKind::Act, rows * dm, true),
            dyg: add(BufKind::Act, rows * di, false),
            dy: add(BufKind::Act, rows * di, false),
            dzx: add(BufKind::Act, rows * w, true),
            dbc: add(BufKind::Act, dims.ssd().dbc_len(), false),
            du: add(BufKind::Act, rows * dm, false),
            part: add(BufKind::Act, part_len, false),
            cast,
            bufs,
        };
        Ok(plan)
    }

    /// Parameter `i`'s buffer.
    fn p(&self, i: usize) -> At {
        self.params[i].start()
    }

    /// Layer `l`'s parameter `k` (0 norm, 1 in_proj, 2 conv weight, 3 conv bias, 4 dt_bias,
    /// 5 A_log, 6 D, 7 gated norm weight, 8 out_proj).
    fn lp(&self, l: usize, k: usize) -> usize {
        2 + PER_LAYER * l + k
    }

    /// Where parameter `i`'s gradient goes.
    fn g(&self, i: usize) -> At {
        self.grad.at(self.grad_offsets[i])
    }

    /// Queues the whole step on `be`.
    pub(crate) fn record<B: Backend>(&self, be: &mut B) -> Result<()> {
        let d = &self.dims;
        let (rows, dm, di, nh, w, cd) = (d.rows(), d.dm, d.di, d.nh, d.w(), d.cd());
        let nl = d.nl;
        let (norm_f, head_w, head_b) = (2 + PER_LAYER * nl, 3 + PER_LAYER * nl, 4 + PER_LAYER * nl);
        be.cast_bf16(&self.cast)?;
        // Embedding (its bias is added by the first layer's norm).
        be.gemm(&GemmOp::new(false, true, rows, dm, d.n_in, self.x.start(), self.p(0), self.layers[0].h.start()))?;
        for (l, lb) in self.layers.iter().enumerate() {
            let next = self.layers.get(l + 1).map_or(self.h_last, |n| n.h);
            be.rmsnorm_fwd(&RmsFwdOp {
                h: lb.h.start(),
                bias: (l == 0).then(|| self.p(1)),
                w: self.p(self.lp(l, 0)),
                copy: Some(next.start()),
                u: lb.u.start(),
                rstd: lb.rstd.start(),
                rows,
                cols: dm,
                eps: d.eps,
            })?;
            be.gemm(&GemmOp::new(false, true, rows, w, dm, lb.u.start(), self.p(self.lp(l, 1)), lb.zx.start()))?;
            be.conv_fwd(&ConvFwdOp {
                zx: lb.zx.start(),
                ld: w,
                xoff: di,
                w: self.p(self.lp(l, 2)),
                b: self.p(self.lp(l, 3)),
                dt_bias: self.p(self.lp(l, 4)),
                xbc: lb.xbc.start(),
                dt: lb.dt.start(),
                dims: d.mixer(),
            })?;
            be.ssd_fwd(&self.ssd_fwd_op(l))?;
            be.gated_fwd(&GatedFwdOp {
                y: lb.y_out.start(),
                z: lb.zx.start(),
                ldz: w,
                w: self.p(self.lp(l, 7)),
                out: lb.yg.start(),
                rstd: lb.grstd.start(),
                rows,
                di,
                groups: d.g,
                eps: d.eps,
            })?;
            let out = GemmOp::new(false, true, rows, dm, di, lb.yg.start(), self.p(self.lp(l, 8)), next.start());
            be.gemm(&GemmOp { accumulate: true, ..out })?;
        }
        be.head_fwd(&HeadFwdOp {
            h: self.h_last.start(),
            w_norm: self.p(norm_f),
            head_w: self.p(head_w),
            head_b: self.p(head_b),
            target: self.target.start(),
            u_f: self.u_f.start(),
            rstd: self.rstd_f.start(),
            sq: self.sq.start(),
            dpred: self.dpred.start(),
            rows,
            cols: dm,
            eps: d.eps,
        })?;
        be.loss_reduce(&LossOp {
            sq: self.sq.start(),
            dpred: self.dpred.start(),
            rows,
            loss: self.loss.start(),
            dhead_b: self.g(head_b),
        })?;

        // Backward: the head and norm_f.
        let nb = row_blocks(rows);
        be.rmsnorm_bwd(&RmsBwdOp {
            du: RowGradAt::Outer { scale: self.dpred.start(), vec: self.p(head_w) },
            h: self.h_last.start(),
            rstd: self.rstd_f.start(),
            w: self.p(norm_f),
            dh: self.dh.start(),
            accumulate: false,
            partials: self.part.start(),
            rows,
            cols: dm,
        })?;
        be.col_sums(&ColSumsOp { rows: nb, cols: dm, a: self.part.start(), lda: dm, y: self.g(norm_f) })?;
        be.gemm(&GemmOp::new(true, false, 1, dm, rows, self.dpred.start(), self.u_f.start(), self.g(head_w)))?;
        for (l, lb) in self.layers.iter().enumerate().rev() {
            // out_proj: dh is the gradient of the layer's output h_{l+1}.
            let out_proj = self.lp(l, 8);
            be.gemm(&GemmOp::new(false, false, rows, di, dm, self.dh.start(), self.p(out_proj), self.dyg.start()))?;
            be.gemm(&GemmOp::new(true, false, dm, di, rows, self.dh.start(), lb.yg.start(), self.g(out_proj)))?;
            be.gated_bwd(&GatedBwdOp {
                dout: self.dyg.start(),
                y: lb.y_out.start(),
                z: lb.zx.start(),
                ldz: w,
                w: self.p(self.lp(l, 7)),
                rstd: lb.grstd.start(),
                dy: self.dy.start(),
                dz: self.dzx.start(),
                lddz: w,
                partials: self.part.start(),
                rows,
                di,
                groups: d.g,
            })?;
            be.col_sums(&ColSumsOp { rows: nb, cols: di, a: self.part.start(), lda: di, y: self.g(self.lp(l, 7)) })?;
            // The scan: its x gradient overwrites dyg (consumed above).
            be.ssd_bwd(&SsdBwdOp {
                fwd: self.ssd_fwd_op(l),
                dy: self.dy.start(),
                dx: self.dyg.start(),
                dbc: self.dbc.start(),
                ddt_raw: self.dzx.at(di + cd),
                ld_ddt: w,
                partials: self.part.start(),
            })?;
            // dt_bias, A_log and D are adjacent in the parameter order: one reduction.
            be.col_sums(&ColSumsOp {
                rows: d.batch,
                cols: 3 * nh,
                a: self.part.start(),
                lda: 3 * nh,
                y: self.g(self.lp(l, 4)),
            })?;
            be.conv_bwd(&ConvBwdOp {
                zx: lb.zx.start(),
                ld: w,
                xoff: di,
                w: self.p(self.lp(l, 2)),
                b: self.p(self.lp(l, 3)),
                dx: self.dyg.start(),
                dbc: self.dbc.start(),
                dzx: self.dzx.start(),
                ldo: w,
                partials: self.part.start(),
                dims: d.mixer(),
            })?;
            // conv1d.weight [cd, 1, K] then conv1d.bias [cd]: adjacent, one reduction.
            let width = cd * (d.k + 1);
            be.col_sums(&ColSumsOp {
                rows: d.batch * conv_tiles(d.len),
                cols: width,
                a: self.part.start(),
                lda: width,
                y: self.g(self.lp(l, 2)),
            })?;
            let in_proj = self.lp(l, 1);
            be.gemm(&GemmOp::new(true, false, w, dm, rows, self.dzx.start(), lb.u.start(), self.g(in_proj)))?;
            be.gemm(&GemmOp::new(false, false, rows, dm, w, self.dzx.start(), self.p(in_proj), self.du.start()))?;
            be.rmsnorm_bwd(&RmsBwdOp {
                du: RowGradAt::Full(self.du.start()),
                h: lb.h.start(),
                rstd: lb.rstd.start(),
                w: self.p(self.lp(l, 0)),
                dh: self.dh.start(),
                accumulate: true,
                partials: self.part.start(),
                rows,
                cols: dm,
            })?;
            be.col_sums(&ColSumsOp { rows: nb, cols: dm, a: self.part.start(), lda: dm, y: self.g(self.lp(l, 0)) })?;
        }
        be.gemm(&GemmOp::new(true, false, dm, d.n_in, rows, self.dh.start(), self.x.start(), self.g(0)))?;
        be.col_sums(&ColSumsOp { rows, cols: dm, a: self.dh.start(), lda: dm, y: self.g(1) })
    }

    fn ssd_fwd_op(&self, l: usize) -> SsdFwdOp {
        let lb = &self.layers[l];
        SsdFwdOp {
            xbc: lb.xbc.start(),
            ld: self.dims.cd(),
            dt: lb.dt.start(),
            a_log: self.p(self.lp(l, 5)),
            d: self.p(self.lp(l, 6)),
            y_ssd: lb.y_ssd.start(),
            y_out: lb.y_out.start(),
            states: lb.states.start(),
            dims: self.dims.ssd(),
        }
    }

    /// Rows of the largest column-sum reduction (the `ones` vector the GPU backend needs).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn max_sum_rows(&self) -> usize {
        let d = &self.dims;
        d.rows().max(d.batch * conv_tiles(d.len)).max(row_blocks(d.rows()))
    }
}

#[cfg(test)]
pub(crate) mod cpu;
