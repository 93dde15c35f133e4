//! Gradient accumulation over micro-batches.
//!
//! Each micro-batch loss is scaled by `1/N` before backward and its gradients are added
//! into F32 sums, so after `N` micro-batches of size `B` the sums equal the gradients of
//! the mean loss over one batch of size `N·B` (for losses that are means over the batch).
//! The optimiser then steps once on [`GradAccumulator::take`]'s result, e.g. through
//! [`crate::TrainStep::apply`]. With loss scaling use
//! [`GradAccumulator::backward_scaled`]; non-finite values survive the summation, so the
//! check on the summed gradients still catches them.

use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor, Var};

use crate::error::{Context, Error, Result};

/// Sums gradients of `vars` over `N` micro-batches; see the module docs.
pub struct GradAccumulator {
    vars: Vec<Var>,
    micro_batches: usize,
    seen: usize,
    sums: Vec<Option<Tensor>>,
    loss_sum: Option<Tensor>,
}

/// The result of a full accumulation: gradients to step on and the mean loss.
pub struct Accumulated {
    /// Summed (F32) gradients of the `1/N`-scaled losses.
    pub grads: GradStore,
    /// `sum(loss_i) / N` (unscaled) as an F32 scalar on the device (detached), for
    /// reporting and for the step guard.
    pub mean_loss: Tensor,
    /// How many micro-batches went in (may be < N for a final partial group).
    pub micro_batches: usize,
}

impl GradAccumulator {
    /// An accumulator over `micro_batches` (≥ 1) micro-batches for the gradients of `vars`.
    pub fn new(vars: Vec<Var>, micro_batches: usize) -> Result<Self> {
        if micro_batches == 0 {
            return Err(Error::Config { what: "GradAccumulator", message: "micro_batches must be >= 1".into() });
        }
        let n = vars.len();
        Ok(GradAccumulator { vars, micro_batches, seen: 0, sums: vec![None; n], loss_sum: None })
    }

    /// `N`, the number of micro-batches per optimiser step.
    pub fn micro_batches(&self) -> usize {
        self.micro_batches
    }

    /// Micro-batches accumulated since the last [`GradAccumulator::take`].
    pub fn seen(&self) -> usize {
        self.seen
    }

    /// Whether `N` micro-batches have been accumulated.
    pub fn is_ready(&self) -> bool {
        self.seen >= self.micro_batches
    }

    /// Backward of `loss / N` (loss: a scalar, ideally F32) and accumulation of the
    /// gradients. The graph of `loss` is freed when this returns.
    pub fn backward(&mut self, loss: &Tensor) -> Result<()> {
        self.backward_scaled(loss, 1.0)
    }

    /// As [`GradAccumulator::backward`] for `loss * loss_scale` (loss scaling; pass
    /// [`crate::TrainStep::loss_scale`]), while the recorded mean loss stays unscaled.
    pub fn backward_scaled(&mut self, loss: &Tensor, loss_scale: f64) -> Result<()> {
        let ctx = "GradAccumulator::backward";
        if self.is_ready() {
            return Err(Error::Config {
                what: "GradAccumulator",
                message: format!("already holds {} micro-batches; call take() first", self.seen),
            });
        }
        let inv_n = 1.0 / self.micro_batches as f64;
        let grads = loss.affine(loss_scale * inv_n, 0.0).and_then(|l| l.backward()).ctx(ctx)?;
        for (var, sum) in self.vars.iter().zip(self.sums.iter_mut()) {
            let Some(g) = grads.get(var.as_tensor()) else {
                continue;
            };
            // Detached: a gradient from candle's backward may still pin the forward graph
            // (see `recompute::detach_all`), and sums outlive many micro-batches.
            let g = g.detach().to_dtype(DType::F32).ctx(ctx)?;
            *sum = Some(match sum.take() {
                None => g,
                Some(s) => (s + g).ctx(ctx)?,
            });
        }
        let l = loss.detach().to_dtype(DType::F32).and_then(|l| l.sum_all()).ctx(ctx)?;
        self.loss_sum = Some(match self.loss_sum.take() {
            None => l,
            Some(s) => (s + l).ctx(ctx)?,
        });
        self.seen += 1;
        Ok(())
    }

    /// Hands out the accumulated gradients and mean loss and starts a new group. Fails if
    /// nothing was accumulated.
    pub fn take(&mut self) -> Result<Accumulated> {
        let loss_sum = self
            .loss_sum
            .take()
            .ok_or_else(|| Error::Config { what: "GradAccumulator", message: "take() before any backward()".into() })?;
        let mut grads = GradStore::default();
        for (var, sum) in self.vars.iter().zip(self.sums.iter_mut()) {
            if let Some(s) = sum.take() {
                grads.insert(var.as_tensor(), s);
            }
        }
        let mean_loss = loss_sum.affine(1.0 / self.micro_batches as f64, 0.0).ctx("GradAccumulator::take")?;
        let micro_batches = std::mem::take(&mut self.seen);
        Ok(Accumulated { grads, mean_loss, micro_batches })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::tests::Rng;
    use candle_core::{Device, Module};
    use proptest::prelude::*;

    struct Mlp {
        vars: Vec<Var>,
        l1: crate::Linear,
        l2: crate::Linear,
    }

    fn mlp(rng: &mut Rng, i: usize, h: usize) -> Mlp {
        let dev = Device::Cpu;
        let mut t = |s: &[usize]| {
            let n = s.iter().product();
            Var::from_tensor(
                &Tensor::from_vec(rng.vec(n, -0.7, 0.7).iter().map(|&x| x as f32).collect::<Vec<_>>(), s, &dev)
                    .unwrap(),
            )
            .unwrap()
        };
        let vars = vec![t(&[h, i]), t(&[h]), t(&[1, h]), t(&[1])];
        let p = crate::Precision::F32;
        let l1 = crate::Linear::from_parts(vars[0].as_tensor().clone(), Some(vars[1].as_tensor().clone()), p).unwrap();
        let l2 = crate::Linear::from_parts(vars[2].as_tensor().clone(), Some(vars[3].as_tensor().clone()), p).unwrap();
        Mlp { vars, l1, l2 }
    }

    impl Mlp {
        /// Mean squared error over the batch.
        fn loss(&self, x: &Tensor, y: &Tensor) -> Tensor {
            let h = self.l1.forward(x).unwrap().tanh().unwrap();
            let p = self.l2.forward(&h).unwrap();
            (p - y).unwrap().sqr().unwrap().mean_all().unwrap()
        }
    }

    fn check(seed: u64, micro: usize, n: usize) -> std::result::Result<(), String> {
        let mut rng = Rng::new(seed);
        let (i, h) = (5, 7);
        let m = mlp(&mut rng, i, h);
        let dev = Device::Cpu;
        let total = micro * n;
        let xs = Tensor::from_vec(
            rng.vec(total * i, -2.0, 2.0).iter().map(|&x| x as f32).collect::<Vec<_>>(),
            (total, i),
            &dev,
        )
        .unwrap();
        let ys =
            Tensor::from_vec(rng.vec(total, -1.0, 1.0).iter().map(|&x| x as f32).collect::<Vec<_>>(), (total, 1), &dev)
                .unwrap();
        let full_loss = m.loss(&xs, &ys);
        let full = full_loss.backward().unwrap();
        let mut acc = GradAccumulator::new(m.vars.clone(), n).unwrap();
        for k in 0..n {
            let x = xs.narrow(0, k * micro, micro).unwrap();
            let y = ys.narrow(0, k * micro, micro).unwrap();
            acc.backward(&m.loss(&x, &y)).unwrap();
        }
        if !acc.is_ready() {
            return Err("not ready after N micro-batches".into());
        }
        let out = acc.take().unwrap();
        let l_full: f32 = full_loss.to_scalar().unwrap();
        let l_acc: f32 = out.mean_loss.to_scalar().unwrap();
        if (l_full - l_acc).abs() > 1e-5 * (1.0 + l_full.abs()) {
            return Err(format!("loss {l_acc} vs {l_full}"));
        }
        for (k, v) in m.vars.iter().enumerate() {
            let a: Vec<f32> =
                out.grads.get(v.as_tensor()).ok_or("missing grad")?.flatten_all().unwrap().to_vec1().unwrap();
            let b: Vec<f32> = full.get(v.as_tensor()).unwrap().flatten_all().unwrap().to_vec1().unwrap();
            for (x, y) in a.iter().zip(&b) {
                if (x - y).abs() > 1e-5 {
                    return Err(format!("param {k}: {x} vs {y}"));
                }
            }
        }
        Ok(())
    }

    /// The case: 4 micro-batches of B against one batch of 4B, within 1e-5.
    #[test]
    fn four_micro_batches_equal_one_big_batch() {
        check(42, 8, 4).unwrap();
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

        #[test]
        fn accumulation_equals_full_batch(seed in any::<u64>(), micro in 1usize..9, n in 1usize..6) {
            prop_assert_eq!(check(seed, micro, n), Ok(()));
        }
    }

    #[test]
    fn misuse_is_an_error() {
        let v = Var::zeros(2, DType::F32, &Device::Cpu).unwrap();
        assert!(GradAccumulator::new(vec![v.clone()], 0).is_err());
        let mut acc = GradAccumulator::new(vec![v.clone()], 1).unwrap();
        assert!(acc.take().is_err());
        let loss = v.as_tensor().sum_all().unwrap();
        acc.backward(&loss).unwrap();
        assert!(acc.backward(&loss).is_err());
        let out = acc.take().unwrap();
        assert_eq!(out.micro_batches, 1);
        assert_eq!(acc.seen(), 0);
    }
}
