//! Activation (gradient) checkpointing for models built from segments.
//!
//! candle records the autograd graph inside the tensors themselves and has no hooks, so
//! checkpointing is done explicitly:
//!
//! - **forward**: each segment runs on a *detached* copy of its input and its output is
//!   detached in turn, so no segment's inner activations outlive it; only each segment's
//!   input is kept (the [`RecomputeTape`]). The stack's output is handed out as a fresh
//!   leaf (a `Var`) for the rest of the model (head, loss).
//! - **backward** ([`Recomputed::backward`]): `loss.backward()` yields the head's
//!   parameter gradients and `dL/d(output)`. Then, for each segment in reverse, its saved
//!   input becomes a leaf, the segment is re-run (with its graph this time), and the
//!   surrogate `sum(out * grad_out)` — whose gradient with respect to `out` is exactly
//!   `grad_out` — is back-propagated: that gives the segment's parameter gradients and
//!   `dL/d(input)` for the segment before it. Parameter gradients are summed into one
//!   `GradStore` (parameters shared between segments add up, as in a plain backward).
//!   The first segment is re-run on the caller's original input, so gradients continue
//!   into whatever produced it (an embedding, or the input itself if it is a `Var`).
//!
//! Peak activation memory is then the saved segment inputs plus one segment's inner
//! activations, at the price of a second forward of every segment. Segments must be
//! deterministic (re-running one must give the same output): seed any dropout from a
//! counter rather than a running RNG.

use candle_core::backprop::GradStore;
use candle_core::{Tensor, Var};

use crate::error::{Context, Error, Result};

/// One segment: a function of its input over parameters it captures.
pub type Segment<'a> = Box<dyn Fn(&Tensor) -> candle_core::Result<Tensor> + 'a>;

/// A stack of segments run with checkpointing; see the module docs.
#[derive(Default)]
pub struct Recomputed<'a> {
    segments: Vec<Segment<'a>>,
}

/// What the checkpointed forward keeps for the backward: the inputs of the segments and
/// the output leaf.
pub struct RecomputeTape {
    input: Tensor,
    saved: Vec<Tensor>,
    output: Var,
}

impl RecomputeTape {
    /// The stack's output: continue the model from here.
    pub fn output(&self) -> &Tensor {
        self.output.as_tensor()
    }
}

impl<'a> Recomputed<'a> {
    /// An empty stack.
    pub fn new() -> Self {
        Recomputed { segments: Vec::new() }
    }

    /// Appends a segment.
    pub fn push(mut self, segment: impl Fn(&Tensor) -> candle_core::Result<Tensor> + 'a) -> Self {
        self.segments.push(Box::new(segment));
        self
    }

    /// Number of segments.
    pub fn len(&self) -> usize {
        self.segments.len()
    }

    /// Whether there are no segments.
    pub fn is_empty(&self) -> bool {
        self.segments.is_empty()
    }

    /// The ordinary forward (full graph kept): evaluation, or the reference to compare with.
    pub fn forward_plain(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let mut h = x.clone();
        for s in &self.segments {
            h = s(&h)?;
        }
        Ok(h)
    }

    /// The checkpointed forward: keeps only the segment inputs.
    pub fn forward(&self, x: &Tensor) -> Result<RecomputeTape> {
        let mut saved = Vec::with_capacity(self.segments.len());
        let mut h = x.detach();
        for (i, s) in self.segments.iter().enumerate() {
            if i > 0 {
                saved.push(h.clone());
            }
            // Detaching the output drops the segment's graph (and with it every inner
            // activation) as soon as this statement ends.
            h = s(&h).map(|t| t.detach()).ctx(&format!("checkpointed forward, segment {i}"))?;
        }
        let output = Var::from_tensor(&h).ctx("checkpointed forward, output leaf")?;
        Ok(RecomputeTape { input: x.clone(), saved, output })
    }

    /// Gradients of `loss` (computed from `tape.output()`) for every variable involved:
    /// those after the stack, those inside it, and those before it.
    pub fn backward(&self, tape: RecomputeTape, loss: &Tensor) -> Result<GradStore> {
        let RecomputeTape { input, mut saved, output } = tape;
        if saved.len() + 1 != self.segments.len().max(1) {
            return Err(Error::Config {
                what: "RecomputeTape",
                message: format!(
                    "tape holds {} segment inputs, stack has {} segments",
                    saved.len() + 1,
                    self.segments.len()
                ),
            });
        }
        let mut grads = loss.backward().ctx("checkpointed backward, loss")?;
        detach_all(&mut grads);
        let Some(mut grad_out) = grads.remove(output.as_tensor()) else {
            // The loss does not depend on the stack's output.
            return Ok(grads);
        };
        drop(output);
        if self.segments.is_empty() {
            // An empty stack is the identity: hand the gradient to the input directly.
            let ctx = "checkpointed backward, empty stack";
            let surrogate = input.mul(&grad_out).and_then(|t| t.sum_all()).ctx(ctx)?;
            let mut g = surrogate.backward().ctx(ctx)?;
            g.remove(&grad_out);
            detach_all(&mut g);
            grads.extend(g).ctx(ctx)?;
            return Ok(grads);
        }
        for (i, seg) in self.segments.iter().enumerate().rev() {
            let ctx = format!("checkpointed backward, segment {i}");
            let (inp, leaf) = if i > 0 {
                let s = saved.pop().expect("length checked above");
                let leaf = Var::from_tensor(&s).ctx(&ctx)?;
                (leaf.as_tensor().clone(), Some(leaf))
            } else {
                (input.clone(), None)
            };
            let out = seg(&inp).ctx(&ctx)?;
            let grad_out_leaf = grad_out.detach();
            let surrogate = out.mul(&grad_out_leaf).and_then(|t| t.sum_all()).ctx(&ctx)?;
            let mut seg_grads = surrogate.backward().ctx(&ctx)?;
            // candle also stores a gradient for the untracked `grad_out` operand; drop it.
            seg_grads.remove(&grad_out_leaf);
            detach_all(&mut seg_grads);
            drop((out, surrogate));
            if let Some(leaf) = leaf {
                match seg_grads.remove(leaf.as_tensor()) {
                    Some(g) => grad_out = g,
                    None => {
                        // The segment ignores its input: nothing flows further back.
                        grads.extend(seg_grads).ctx(&ctx)?;
                        return Ok(grads);
                    }
                }
            }
            grads.extend(seg_grads).ctx(&ctx)?;
        }
        Ok(grads)
    }
}

/// Cuts every gradient in `grads` loose from the autograd graph.
///
/// candle's `backward` can return gradients that still carry graph nodes: the gradient
/// of a leaf computed as, e.g., `grad * activation` keeps `activation` — and through it
/// the whole forward graph — alive for as long as the gradient lives. Checkpointing
/// (and accumulation) keep gradients across many graphs, so they must not pin them.
pub(crate) fn detach_all(grads: &mut GradStore) {
    let ids: Vec<_> = grads.get_ids().copied().collect();
    for id in ids {
        if let Some(g) = grads.get_id(id) {
            let g = g.detach();
            grads.insert_id(id, g);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::tests::Rng;
    use crate::{Linear, Precision};
    use candle_core::{DType, Device, Module};
    use proptest::prelude::*;

    fn var(rng: &mut Rng, s: &[usize]) -> Var {
        let n = s.iter().product();
        let v: Vec<f32> = rng.vec(n, -0.6, 0.6).iter().map(|&x| x as f32).collect();
        Var::from_tensor(&Tensor::from_vec(v, s, &Device::Cpu).unwrap()).unwrap()
    }

    fn lin(w: &Var, b: &Var) -> Linear {
        Linear::from_parts(w.as_tensor().clone(), Some(b.as_tensor().clone()), Precision::F32).unwrap()
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 12, ..ProptestConfig::default() })]

        /// An embedding before the stack, a Var input, segments with a shared layer and a
        /// layer norm, a head after: every gradient equals the plain backward's within 1e-6.
        #[test]
        fn gradients_equal_plain_backward(seed in any::<u64>(), depth in 1usize..6, batch in 1usize..5) {
            let mut rng = Rng::new(seed);
            let d = 6;
            let x = var(&mut rng, &[batch, 3]);
            let (we, be) = (var(&mut rng, &[d, 3]), var(&mut rng, &[d]));
            let (ws, bs) = (var(&mut rng, &[d, d]), var(&mut rng, &[d]));
            let (wh, bh) = (var(&mut rng, &[1, d]), var(&mut rng, &[1]));
            let (g, b) = (var(&mut rng, &[d]), var(&mut rng, &[d]));
            let mut own = Vec::new();
            for _ in 0..depth {
                own.push((var(&mut rng, &[d, d]), var(&mut rng, &[d])));
            }
            let shared = lin(&ws, &bs);
            let mut stack = Recomputed::new();
            for (k, (w, bb)) in own.iter().enumerate() {
                let l = lin(w, bb);
                let shared = shared.clone();
                let (g, b) = (g.as_tensor().clone(), b.as_tensor().clone());
                stack = stack.push(move |h: &Tensor| {
                    let y = l.forward(h)?.tanh()?;
                    let y = if k % 2 == 0 { shared.forward(&y)?.relu()? } else { y };
                    crate::ops::layer_norm(&(y + h)?, &g, &b, 1e-5)
                });
            }
            let embed = lin(&we, &be);
            let head = lin(&wh, &bh);
            let loss_of = |out: &Tensor| head.forward(out).unwrap().sqr().unwrap().mean_all().unwrap();

            let e = embed.forward(x.as_tensor()).unwrap();
            let plain_loss = loss_of(&stack.forward_plain(&e).unwrap());
            let plain = plain_loss.backward().unwrap();

            let e = embed.forward(x.as_tensor()).unwrap();
            let tape = stack.forward(&e).unwrap();
            let ck_loss = loss_of(tape.output());
            prop_assert_eq!(ck_loss.to_scalar::<f32>().unwrap(), plain_loss.to_scalar::<f32>().unwrap());
            let ck = stack.backward(tape, &ck_loss).unwrap();

            let mut all = vec![&x, &we, &be, &ws, &bs, &wh, &bh, &g, &b];
            for (w, bb) in &own { all.push(w); all.push(bb); }
            for (k, v) in all.iter().enumerate() {
                let a: Vec<f32> = plain.get(v.as_tensor()).unwrap().flatten_all().unwrap().to_vec1().unwrap();
                let c = ck.get(v.as_tensor());
                prop_assert!(c.is_some(), "tensor {} lost its gradient", k);
                let c: Vec<f32> = c.unwrap().flatten_all().unwrap().to_vec1().unwrap();
                for (p, q) in a.iter().zip(&c) {
                    prop_assert!((p - q).abs() <= 1e-6, "tensor {}: {} vs {}", k, p, q);
                }
            }
        }
    }

    #[test]
    fn output_not_used_and_empty_stack() {
        let mut rng = Rng::new(1);
        let w = var(&mut rng, &[2]);
        let wc = w.as_tensor().clone();
        let stack = Recomputed::new().push(move |h: &Tensor| h.broadcast_mul(&wc));
        let x = Tensor::ones((3, 2), DType::F32, &Device::Cpu).unwrap();
        let tape = stack.forward(&x).unwrap();
        let other = var(&mut rng, &[1]);
        let loss = other.as_tensor().sum_all().unwrap();
        let g = stack.backward(tape, &loss).unwrap();
        assert!(g.get(w.as_tensor()).is_none() && g.get(other.as_tensor()).is_some());
        let empty = Recomputed::new();
        assert!(empty.is_empty());
        let xv = Var::from_tensor(&x).unwrap();
        let tape = empty.forward(xv.as_tensor()).unwrap();
        let l = tape.output().sqr().unwrap().sum_all().unwrap();
        let g = empty.backward(tape, &l).unwrap();
        let gx: Vec<f32> = g.get(xv.as_tensor()).unwrap().flatten_all().unwrap().to_vec1().unwrap();
        assert_eq!(gx, vec![2.0; 6]);
    }
}
