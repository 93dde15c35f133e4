//! The networks' forwards for collection on CUDA (F32, no tape) at a fixed number of rows:
//! per dense layer one cuBLAS GEMM and one bias + activation kernel, into buffers allocated
//! once ([`DenseChain`]); [`DqnQForward`] ends in the dueling-head kernel, [`PpoForward`]
//! runs the actor and the critic. Both read the network's weights where they are at each
//! call, so in-place updates (eager or captured) are seen. Their references are the models'
//! `forward_inference`, which the device tests compare them with.

use crate::mlp::train_cuda::{Act, Blas, MlpTrainKernels};
use candle_core::{DType, Device, Tensor};
use fx_kernels::cuda::address;

use crate::dqn::fused::DqnFused;
use crate::dqn::DuelingDqn;
use crate::error::{Context, Error, Result};
use crate::ppo::fused::PpoFused;
use crate::ppo::ActorCritic;

/// A chain of dense layers `y = act(x Wᵀ + b)` at `rows` rows: the shared part of the two
/// forwards.
struct DenseChain {
    blas: Blas,
    k: MlpTrainKernels,
    rows: usize,
    input: usize,
}

/// One layer of a [`DenseChain::run`]: weight `[out, in]`, bias `[out]`, activation, and
/// the output buffer `[rows, out]`.
type Layer<'a> = (&'a Tensor, &'a Tensor, Act, &'a Tensor);

impl DenseChain {
    fn new(dev: &Device, rows: usize, input: usize, ctx: &'static str) -> Result<Self> {
        if rows == 0 || !dev.is_cuda() {
            return Err(Error::config(ctx, format!("{rows} rows or a CPU device")));
        }
        Ok(Self { blas: Blas::new(dev).ctx(ctx)?, k: MlpTrainKernels::load(dev).ctx(ctx)?, rows, input })
    }

    /// `obs` checked to be `[rows, input]` F32, contiguous.
    fn input(&self, obs: &Tensor, ctx: &'static str) -> Result<Tensor> {
        if obs.dims() != [self.rows, self.input] || obs.dtype() != DType::F32 {
            return Err(Error::config(
                ctx,
                format!("obs must be [{}, {}] F32, got {:?} {:?}", self.rows, self.input, obs.dims(), obs.dtype()),
            ));
        }
        obs.contiguous().ctx(ctx)
    }

    /// Runs `layers` from `x` (`[rows, in]`), each into its own buffer, after checking every
    /// shape against the one before.
    fn run(&self, x: &Tensor, layers: &[Layer<'_>], ctx: &'static str) -> Result<()> {
        let a = |t: &Tensor| address::<f32>(t, "buffer").ctx(ctx);
        let (rows, mut width, mut xa) = (self.rows, x.dim(1).ctx(ctx)?, a(x)?);
        for &(w, b, act, y) in layers {
            let o = w.dim(0).ctx(ctx)?;
            if w.dims() != [o, width] || b.dims() != [o] || y.dims() != [rows, o] {
                return Err(Error::config(ctx, format!("layer {:?} after width {width}", w.dims())));
            }
            let ya = a(y)?;
            // SAFETY: the shapes were checked above; the tensors are alive for this call and
            // on candle's stream, where both launches queue.
            unsafe {
                self.blas.gemm(false, true, rows, o, width, 1.0, xa, width, a(w)?, width, 0.0, ya, o).ctx(ctx)?;
                self.k.bias_act(ya, a(b)?, rows, o, act, 0).ctx(ctx)?;
            }
            (width, xa) = (o, ya);
        }
        Ok(())
    }
}

/// The DQN's Q forward for collection: three dense layers with ReLU, then the dueling-head
/// kernel (7 launches); see the module docs.
pub struct DqnQForward {
    chain: DenseChain,
    dims: [usize; 4],
    h: [Tensor; 3],
    q: Tensor,
}

impl std::fmt::Debug for DqnQForward {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DqnQForward").field("rows", &self.chain.rows).field("dims", &self.dims).finish()
    }
}

impl DqnQForward {
    /// Buffers for `rows` observations of `net` (a CUDA network the fused kernels cover:
    /// two or more hidden units, at most 8 actions).
    pub fn new(net: &DuelingDqn, rows: usize) -> Result<Self> {
        const CTX: &str = "DqnQForward::new";
        let c = net.config();
        if !DqnFused::supports(net) {
            return Err(Error::config(CTX, format!("unsupported network {c:?}")));
        }
        let dev = net.params().device().clone();
        let chain = DenseChain::new(&dev, rows, c.state_dim, CTX)?;
        let (h, h2, na) = (c.hidden, c.hidden / 2, c.n_actions);
        let z = |shape: &[usize]| Tensor::zeros(shape, DType::F32, &dev).ctx(CTX);
        Ok(Self {
            chain,
            dims: [c.state_dim, h, h2, na],
            h: [z(&[rows, h])?, z(&[rows, h])?, z(&[rows, h2])?],
            q: z(&[rows, na])?,
        })
    }

    /// The number of rows the buffers hold.
    pub fn rows(&self) -> usize {
        self.chain.rows
    }

    /// `Q(obs)` (`[rows, n_actions]` F32) of `net` (the network this was made for, or one of
    /// the same shape) on `obs` (`[rows, state_dim]`). The result is this forward's own
    /// buffer: the next call overwrites it (on the same stream, so work queued before that
    /// call still reads this one's values).
    pub fn forward(&self, net: &DuelingDqn, obs: &Tensor) -> Result<Tensor> {
        const CTX: &str = "DqnQForward::forward";
        let c = net.config();
        if [c.state_dim, c.hidden, c.hidden / 2, c.n_actions] != self.dims {
            return Err(Error::config(CTX, format!("network {c:?} differs from the one the buffers were made for")));
        }
        let x = self.chain.input(obs, CTX)?;
        let v = net.params().vars();
        let t = |i: usize| v[i].as_tensor();
        let layers: Vec<Layer<'_>> = (0..3).map(|l| (t(2 * l), t(2 * l + 1), Act::Relu, &self.h[l])).collect();
        self.chain.run(&x, &layers, CTX)?;
        let a = |t: &Tensor| address::<f32>(t, "buffer").ctx(CTX);
        let [_, _, h2, na] = self.dims;
        let heads = [a(t(6))?, a(t(7))?, a(t(8))?, a(t(9))?];
        // SAFETY: the heads are the network's (value [1, h2], advantage [na, h2] and their
        // biases, shapes fixed by the config checked above), h[2] is [rows, h2], q [rows, na].
        unsafe { self.chain.k.dqn_q(a(&self.h[2])?, heads, self.chain.rows, h2, na, a(&self.q)?) }.ctx(CTX)?;
        Ok(self.q.clone())
    }
}

/// The actor-critic's forward for rollouts: per network three dense layers (tanh, tanh,
/// identity), 12 launches; see the module docs.
pub struct PpoForward {
    chain: DenseChain,
    dims: [usize; 3],
    /// Per network (actor, critic): the two hidden activations and the head output.
    act: [[Tensor; 3]; 2],
}

impl std::fmt::Debug for PpoForward {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PpoForward").field("rows", &self.chain.rows).field("dims", &self.dims).finish()
    }
}

impl PpoForward {
    /// Buffers for `rows` observations of `net` (a CUDA network with at most 8 actions).
    pub fn new(net: &ActorCritic, rows: usize) -> Result<Self> {
        const CTX: &str = "PpoForward::new";
        let c = net.config();
        if !PpoFused::supports(net) {
            return Err(Error::config(CTX, format!("unsupported network {c:?}")));
        }
        let dev = net.params().device().clone();
        let chain = DenseChain::new(&dev, rows, c.state_dim, CTX)?;
        let z = |shape: &[usize]| Tensor::zeros(shape, DType::F32, &dev).ctx(CTX);
        let net_bufs = |out: usize| -> Result<[Tensor; 3]> {
            Ok([z(&[rows, c.hidden])?, z(&[rows, c.hidden])?, z(&[rows, out])?])
        };
        Ok(Self { chain, dims: [c.state_dim, c.hidden, c.n_actions], act: [net_bufs(c.n_actions)?, net_bufs(1)?] })
    }

    /// The number of rows the buffers hold.
    pub fn rows(&self) -> usize {
        self.chain.rows
    }

    /// `(logits [rows, n_actions], value [rows])` of `net` (the network this was made for,
    /// or one of the same shape) on `obs` (`[rows, state_dim]`, F32). The results are this
    /// forward's own buffers: the next call overwrites them (on the same stream, so work
    /// queued before that call still reads these values).
    pub fn forward(&self, net: &ActorCritic, obs: &Tensor) -> Result<(Tensor, Tensor)> {
        const CTX: &str = "PpoForward::forward";
        let c = net.config();
        if [c.state_dim, c.hidden, c.n_actions] != self.dims {
            return Err(Error::config(CTX, format!("network {c:?} differs from the one the buffers were made for")));
        }
        let x = self.chain.input(obs, CTX)?;
        let v = net.params().vars();
        for (n, bufs) in self.act.iter().enumerate() {
            let t = |l: usize, k: usize| v[6 * n + 2 * l + k].as_tensor();
            let acts = [Act::Tanh, Act::Tanh, Act::None];
            let layers: Vec<Layer<'_>> = (0..3).map(|l| (t(l, 0), t(l, 1), acts[l], &bufs[l])).collect();
            self.chain.run(&x, &layers, CTX)?;
        }
        let value = self.act[1][2].reshape(self.chain.rows).ctx(CTX)?;
        Ok((self.act[0][2].clone(), value))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dqn::fused::test_support::{fresh_seed, gpu, rel, vals};
    use crate::dqn::DqnNetConfig;
    use crate::ppo::PpoNetConfig;

    /// The collection forward equals candle's tape-free forward (the reference) on fresh
    /// random weights and observations, at two widths and row counts, and sees in-place
    /// weight updates.
    #[test]
    fn q_forward_matches_candle() {
        let Some(dev) = gpu("fused_forward::q_forward_matches_candle") else { return };
        let seed = fresh_seed();
        eprintln!("fused_forward::q_forward_matches_candle: seed {seed}");
        for (rows, hidden, na) in [(4096usize, 256usize, 3usize), (37, 64, 5)] {
            let cfg = DqnNetConfig { hidden, n_actions: na, ..Default::default() };
            let net = DuelingDqn::new(cfg, &dev, seed).unwrap();
            let fwd = DqnQForward::new(&net, rows).unwrap();
            let obs = Tensor::from_vec(vals(rows * cfg.state_dim, seed, 7), (rows, cfg.state_dim), &dev).unwrap();
            for round in 0..2 {
                let want = net.forward_inference(&obs).unwrap();
                let got = fwd.forward(&net, &obs).unwrap();
                let e = rel(&got, &want);
                eprintln!("dqn_fused q forward rows {rows} h {hidden} round {round}: rel err {e:.2e}");
                assert!(e <= 1e-5, "rows {rows} h {hidden} round {round}: Q rel err {e}");
                // Same greedy actions (ties aside: random weights give none in practice).
                let (ga, wa) = (got.argmax(1).unwrap(), want.argmax(1).unwrap());
                let same = ga.eq(&wa).unwrap().to_dtype(DType::F32).unwrap().mean_all().unwrap();
                assert!(same.to_scalar::<f32>().unwrap() >= 0.999, "greedy actions differ");
                // An in-place update of every weight must show in the next forward.
                for v in net.params().vars() {
                    v.set(&v.as_tensor().affine(0.5, 0.01).unwrap()).unwrap();
                }
            }
            let bad = Tensor::zeros((rows + 1, cfg.state_dim), DType::F32, &dev).unwrap();
            assert!(fwd.forward(&net, &bad).is_err(), "a wrong row count must be refused");
        }
    }

    /// The rollout forward equals candle's tape-free forward (the reference) on fresh
    /// random weights and observations, at two sizes, and sees in-place weight updates.
    #[test]
    fn rollout_forward_matches_candle() {
        let Some(dev) = gpu("fused_forward::rollout_forward_matches_candle") else { return };
        let seed = fresh_seed();
        eprintln!("fused_forward::rollout_forward_matches_candle: seed {seed}");
        for (rows, hidden, na) in [(2048usize, 256usize, 3usize), (37, 64, 5)] {
            let cfg = PpoNetConfig { hidden, n_actions: na, ..Default::default() };
            let net = ActorCritic::new(cfg, &dev, seed).unwrap();
            let fwd = PpoForward::new(&net, rows).unwrap();
            let obs = Tensor::from_vec(vals(rows * cfg.state_dim, seed, 8), (rows, cfg.state_dim), &dev).unwrap();
            for round in 0..2 {
                let (wl, wv) = net.forward_inference(&obs).unwrap();
                let (gl, gv) = fwd.forward(&net, &obs).unwrap();
                let (el, ev) = (rel(&gl, &wl), rel(&gv, &wv));
                eprintln!("ppo rollout forward rows {rows} h {hidden} round {round}: logits {el:.2e}, value {ev:.2e}");
                assert!(el <= 1e-5 && ev <= 1e-5, "rows {rows} round {round}: logits {el}, value {ev}");
                assert_eq!(gv.dims(), wv.dims());
                for v in net.params().vars() {
                    v.set(&v.as_tensor().affine(0.5, 0.01).unwrap()).unwrap();
                }
            }
        }
    }
}
