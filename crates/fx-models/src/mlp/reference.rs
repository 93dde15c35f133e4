//! The greedy policy MLPs that `cuda::mlp` runs as one kernel (`kernels/mlp/mlp_forward.cu`):
//! their description ([`GreedyMlp`]: dense layers in PyTorch `Linear` layout, an activation
//! per hidden layer, a logits or dueling head), the kernel's limits, the shape checks, and
//! the f64 reference [`reference_greedy`] the device tests compare against. Everything here
//! runs on the CPU, so the checks and the reference are tested without a GPU.

use candle_core::{DType, Device, Tensor};

use fx_kernels::{CandleContext, Error, Result};

/// Widest layer (input or hidden) the kernel takes: one row's activations live in two
/// shared-memory buffers of this many floats.
pub const MAX_WIDTH: usize = 1024;
/// Most hidden (activated) layers before the head.
pub const MAX_HIDDEN: usize = 4;
/// Most actions (head outputs).
pub const MAX_ACTIONS: usize = 16;

/// The squashing after a hidden layer (the kernel's `FX_ACT_*` codes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    /// No activation.
    Identity = 0,
    /// `max(x, 0)` (NaN passes through, as `torch.relu`).
    Relu = 1,
    /// `tanh(x)`.
    Tanh = 2,
}

/// A dense layer in PyTorch `Linear` layout: `weight [out, in]`, `bias [out]`, both F32.
#[derive(Debug, Clone, Copy)]
pub struct Linear<'a> {
    /// `[out, in]`, row-major.
    pub weight: &'a Tensor,
    /// `[out]`.
    pub bias: &'a Tensor,
}

/// How the last hidden activations become one score per action, over layers `L` ([`Linear`]
/// for the F32 kernels, `mlp_i8::I8Linear` for the INT8 one).
#[derive(Debug, Clone, Copy)]
pub enum Head<L> {
    /// `scores = head(z)` (the PPO actor's logits).
    Logits(L),
    /// `Q = (A − mean_a A) + V` with `V = value(z)` (`[1, h]`) and `A = advantage(z)`
    /// (the dueling DQN).
    Dueling {
        /// `[1, h]`.
        value: L,
        /// `[n_actions, h]`.
        advantage: L,
    },
}

/// A greedy policy network: `hidden` layers in order, then `head`; the action is the first
/// index of the largest score (candle's and torch's argmax).
#[derive(Debug, Clone, Copy)]
pub struct GreedyMlp<'a> {
    /// The activated layers, input first.
    pub hidden: &'a [(Linear<'a>, Activation)],
    /// The output layer(s).
    pub head: Head<Linear<'a>>,
}

/// The dimensions of a checked [`GreedyMlp`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MlpDims {
    /// Input width (`state_dim`).
    pub input: usize,
    /// Output width of each hidden layer.
    pub hidden: Vec<usize>,
    /// Number of actions (scores per row).
    pub n_actions: usize,
}

impl<'a> GreedyMlp<'a> {
    /// Every tensor in the kernel's order: hidden weights and biases, then the head's
    /// (logits; or value then advantage).
    pub fn tensors(&self) -> Vec<&'a Tensor> {
        let mut v: Vec<&'a Tensor> = self.hidden.iter().flat_map(|(l, _)| [l.weight, l.bias]).collect();
        match self.head {
            Head::Logits(l) => v.extend([l.weight, l.bias]),
            Head::Dueling { value, advantage } => {
                v.extend([value.weight, value.bias, advantage.weight, advantage.bias])
            }
        }
        v
    }

    /// Checks dtypes (F32), devices (all on the first weight's), shapes (each layer's input
    /// is the previous layer's output, biases match, a dueling value has one output) and the
    /// kernel's limits. Beyond a limit the error is [`Error::Unsupported`] (the caller can
    /// fall back to the general path); anything else malformed is a shape/dtype/device error.
    pub fn dims(&self) -> Result<MlpDims> {
        const CTX: &str = "GreedyMlp::dims";
        let first = self.tensors()[0];
        let input = match *first.dims() {
            [_, i] if i > 0 => i,
            ref d => return Err(Error::shape("first weight", CTX, "[out, in] with in >= 1", format!("{d:?}"))),
        };
        let device = first.device();
        for t in self.tensors() {
            if t.dtype() != DType::F32 {
                return Err(Error::DType { what: "weight/bias", expected: DType::F32, got: t.dtype(), context: CTX });
            }
            if !t.device().same_device(device) {
                return Err(Error::Device {
                    what: "weight/bias",
                    expected: format!("{:?} (the first weight's)", device.location()),
                    context: CTX,
                });
            }
        }
        let mut width = input;
        let mut hidden = Vec::with_capacity(self.hidden.len());
        for (l, _) in self.hidden {
            width = chain(l, width, "hidden layer")?;
            hidden.push(width);
        }
        let n_actions = match self.head {
            Head::Logits(l) => chain(&l, width, "logits head")?,
            Head::Dueling { value, advantage } => {
                if chain(&value, width, "dueling value head")? != 1 {
                    return Err(Error::shape("value.weight", CTX, "[1, h]", format!("{:?}", value.weight.dims())));
                }
                chain(&advantage, width, "dueling advantage head")?
            }
        };
        let dims = MlpDims { input, hidden, n_actions };
        dims.check_limits("fused greedy MLP")?;
        Ok(dims)
    }
}

impl MlpDims {
    /// Refuses dimensions beyond the policy kernels' limits with [`Error::Unsupported`]
    /// naming `kernel` (the caller can fall back to the general path).
    pub(crate) fn check_limits(&self, kernel: &'static str) -> Result<()> {
        let unsupported = |message: String| Err(Error::Unsupported { context: kernel, message });
        if self.hidden.len() > MAX_HIDDEN {
            return unsupported(format!("{} hidden layers (at most {MAX_HIDDEN})", self.hidden.len()));
        }
        for (what, w) in std::iter::once(("input", self.input)).chain(self.hidden.iter().map(|&w| ("hidden", w))) {
            if w > MAX_WIDTH {
                return unsupported(format!("{what} width {w} (at most {MAX_WIDTH})"));
            }
        }
        if self.n_actions > MAX_ACTIONS {
            return unsupported(format!("{} actions (at most {MAX_ACTIONS})", self.n_actions));
        }
        Ok(())
    }
}

/// The output width of `l`, checking `weight [out, width]` (out >= 1) and `bias [out]`.
fn chain(l: &Linear<'_>, width: usize, what: &'static str) -> Result<usize> {
    const CTX: &str = "GreedyMlp::dims";
    let out = match *l.weight.dims() {
        [o, i] if o > 0 && i == width => o,
        ref d => return Err(Error::shape(what, CTX, format!("[out >= 1, {width}]"), format!("{d:?}"))),
    };
    if l.bias.dims() != [out] {
        return Err(Error::shape("bias", CTX, format!("[{out}]"), format!("{:?}", l.bias.dims())));
    }
    Ok(out)
}

/// A layer's weight and bias on the host in f64, row-major.
fn host_f64(t: &Tensor, ctx: &'static str) -> Result<Vec<f64>> {
    t.to_device(&Device::Cpu).and_then(|t| t.to_dtype(DType::F64)).and_then(|t| t.flatten_all()?.to_vec1()).ctx(ctx)
}

/// `x W^T + b` for one row in f64.
fn dense(w: &[f64], b: &[f64], x: &[f64]) -> Vec<f64> {
    w.chunks(x.len()).zip(b).map(|(row, bias)| row.iter().zip(x).map(|(a, c)| a * c).sum::<f64>() + bias).collect()
}

/// The first index of the largest value (strict `>`, so ties and a NaN after the first
/// element keep the earlier index, as candle's argmax).
pub fn first_argmax(scores: &[f64]) -> u32 {
    let mut best = 0;
    for (j, &s) in scores.iter().enumerate().skip(1) {
        if s > scores[best] {
            best = j;
        }
    }
    best as u32
}

/// The network in f64 on the host: scores `[B, n_actions]` row-major (Q values or
/// logits) and the greedy actions `[B]`, for `obs [B, input]` (any float dtype, any device).
pub fn reference_greedy(net: &GreedyMlp<'_>, obs: &Tensor) -> Result<(Vec<f64>, Vec<u32>)> {
    const CTX: &str = "mlp_ref::reference_greedy";
    let dims = net.dims()?;
    let rows = match *obs.dims() {
        [b, s] if s == dims.input => b,
        ref d => return Err(Error::shape("obs", CTX, format!("[B, {}]", dims.input), format!("{d:?}"))),
    };
    let host: Vec<Vec<f64>> = net.tensors().into_iter().map(|t| host_f64(t, CTX)).collect::<Result<_>>()?;
    let x_all = host_f64(obs, CTX)?;
    let nh = net.hidden.len();
    let mut scores = Vec::with_capacity(rows * dims.n_actions);
    let mut actions = Vec::with_capacity(rows);
    for x in x_all.chunks(dims.input.max(1)).take(rows) {
        let mut z = x.to_vec();
        for (l, (_, act)) in net.hidden.iter().enumerate() {
            z = dense(&host[2 * l], &host[2 * l + 1], &z);
            for v in &mut z {
                *v = match act {
                    Activation::Identity => *v,
                    Activation::Relu => v.max(0.0),
                    Activation::Tanh => v.tanh(),
                };
            }
        }
        let s = match net.head {
            Head::Logits(_) => dense(&host[2 * nh], &host[2 * nh + 1], &z),
            Head::Dueling { .. } => {
                let v = dense(&host[2 * nh], &host[2 * nh + 1], &z)[0];
                let a = dense(&host[2 * nh + 2], &host[2 * nh + 3], &z);
                let mean = a.iter().sum::<f64>() / a.len() as f64;
                a.iter().map(|a| (a - mean) + v).collect()
            }
        };
        actions.push(first_argmax(&s));
        scores.extend(s);
    }
    Ok((scores, actions))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(shape: &[usize], seed: u64) -> Tensor {
        let n: usize = shape.iter().product();
        let v: Vec<f32> = (0..n as u64).map(|i| (fx_kernels::rng::draw(seed, 7, 0, i) * 2.0 - 1.0) as f32).collect();
        Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
    }

    /// `(w, b)` pairs for widths `w[0] → w[1] → ...`.
    fn layers(widths: &[usize], seed: u64) -> Vec<(Tensor, Tensor)> {
        widths
            .windows(2)
            .enumerate()
            .map(|(i, w)| (t(&[w[1], w[0]], seed + 2 * i as u64), t(&[w[1]], seed + 2 * i as u64 + 1)))
            .collect()
    }

    fn lin(p: &(Tensor, Tensor)) -> Linear<'_> {
        Linear { weight: &p.0, bias: &p.1 }
    }

    /// The candle F32 forward of the same network, for comparison.
    fn candle_scores(net: &GreedyMlp<'_>, obs: &Tensor) -> Tensor {
        let lin = |x: &Tensor, l: &Linear<'_>| x.matmul(&l.weight.t().unwrap()).unwrap().broadcast_add(l.bias).unwrap();
        let mut z = obs.clone();
        for (l, a) in net.hidden {
            z = lin(&z, l);
            z = match a {
                Activation::Identity => z,
                Activation::Relu => z.relu().unwrap(),
                Activation::Tanh => z.tanh().unwrap(),
            };
        }
        match net.head {
            Head::Logits(l) => lin(&z, &l),
            Head::Dueling { value, advantage } => {
                let a = lin(&z, &advantage);
                let m = a.mean_keepdim(1).unwrap();
                a.broadcast_sub(&m).unwrap().broadcast_add(&lin(&z, &value)).unwrap()
            }
        }
    }

    #[test]
    fn reference_matches_candle_for_both_heads() {
        let obs = t(&[5, 12], 100);
        let p = layers(&[12, 16, 16, 8], 1);
        let (v, a) = (layers(&[8, 1], 20).remove(0), layers(&[8, 4], 30).remove(0));
        let hidden =
            [(lin(&p[0]), Activation::Relu), (lin(&p[1]), Activation::Tanh), (lin(&p[2]), Activation::Identity)];
        for head in [Head::Dueling { value: lin(&v), advantage: lin(&a) }, Head::Logits(lin(&a))] {
            let net = GreedyMlp { hidden: &hidden, head };
            let (scores, actions) = reference_greedy(&net, &obs).unwrap();
            let want: Vec<f32> = candle_scores(&net, &obs).flatten_all().unwrap().to_vec1().unwrap();
            assert_eq!(scores.len(), 20);
            for (g, w) in scores.iter().zip(&want) {
                assert!((g - *w as f64).abs() < 1e-5, "{g} vs {w}");
            }
            for (r, &act) in actions.iter().enumerate() {
                assert_eq!(act, first_argmax(&scores[4 * r..4 * r + 4]));
            }
        }
    }

    #[test]
    fn argmax_keeps_the_first_maximum() {
        assert_eq!(first_argmax(&[1.0, 3.0, 3.0]), 1);
        assert_eq!(first_argmax(&[2.0, 2.0]), 0);
        assert_eq!(first_argmax(&[0.0, f64::NAN, 1.0]), 2);
        assert_eq!(first_argmax(&[f64::NAN, 5.0]), 0);
    }

    #[test]
    fn limits_are_refused_as_unsupported() {
        let wide = layers(&[8, MAX_WIDTH + 1], 1);
        let out = layers(&[MAX_WIDTH + 1, 3], 2);
        let hidden = [(lin(&wide[0]), Activation::Relu)];
        let err = GreedyMlp { hidden: &hidden, head: Head::Logits(lin(&out[0])) }.dims().unwrap_err();
        assert!(matches!(err, Error::Unsupported { .. }) && err.to_string().contains("1025"), "{err}");

        let many = layers(&[8, 4], 3);
        let head = layers(&[8, MAX_ACTIONS + 1], 4);
        let err = GreedyMlp { hidden: &[], head: Head::Logits(lin(&head[0])) }.dims().unwrap_err();
        assert!(matches!(err, Error::Unsupported { .. }) && err.to_string().contains("17 actions"), "{err}");

        let deep = layers(&[8, 8, 8, 8, 8, 8], 5);
        let hidden: Vec<_> = deep.iter().map(|p| (lin(p), Activation::Tanh)).collect();
        let err = GreedyMlp { hidden: &hidden, head: Head::Logits(lin(&many[0])) }.dims().unwrap_err();
        assert!(matches!(err, Error::Unsupported { .. }) && err.to_string().contains("5 hidden"), "{err}");
    }

    #[test]
    fn malformed_networks_are_shape_errors() {
        let p = layers(&[8, 6], 1);
        let wrong_in = layers(&[5, 3], 2);
        let hidden = [(lin(&p[0]), Activation::Relu)];
        let err = GreedyMlp { hidden: &hidden, head: Head::Logits(lin(&wrong_in[0])) }.dims().unwrap_err();
        assert!(matches!(err, Error::Shape { .. }) && err.to_string().contains("[out >= 1, 6]"), "{err}");

        let two = layers(&[6, 2], 3);
        let err = GreedyMlp { hidden: &hidden, head: Head::Dueling { value: lin(&two[0]), advantage: lin(&two[0]) } }
            .dims()
            .unwrap_err();
        assert!(err.to_string().contains("value.weight"), "{err}");

        let bad_bias = (p[0].0.clone(), t(&[5], 9));
        let hidden = [(lin(&bad_bias), Activation::Relu)];
        let head = layers(&[6, 3], 4);
        assert!(GreedyMlp { hidden: &hidden, head: Head::Logits(lin(&head[0])) }.dims().is_err());

        let f64_head = (head[0].0.to_dtype(DType::F64).unwrap(), head[0].1.clone());
        let hidden = [(lin(&p[0]), Activation::Relu)];
        let err = GreedyMlp { hidden: &hidden, head: Head::Logits(lin(&f64_head)) }.dims().unwrap_err();
        assert!(matches!(err, Error::DType { .. }), "{err}");

        let ok = GreedyMlp { hidden: &hidden, head: Head::Logits(lin(&head[0])) };
        assert_eq!(ok.dims().unwrap(), MlpDims { input: 8, hidden: vec![6], n_actions: 3 });
        assert!(reference_greedy(&ok, &t(&[2, 7], 5)).is_err());
    }
}
