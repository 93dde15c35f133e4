//! The plain scalar reference of a quantised network: unpadded weights, i32 multiply-adds
//! in a loop, the same F32 rounding rules as [`crate::Int8Policy`] (so the two agree to
//! the bit), and a fresh allocation per call. Also the accuracy reference: how a quantised
//! network's greedy actions and scores differ from its F32 original's ([`agreement`]).

use crate::activation::{relu, tanh_rational};
use crate::error::{first_non_finite, Error, Result};
use crate::float_net::{FloatNet, PolicyKind};
use crate::policy::{dot_f32, first_argmax};
use crate::qnet::{dynamic_input_scale, quantize_input, QuantLayer, QuantNet};

fn dense(layer: &QuantLayer, x: &[f32], dynamic: bool) -> Vec<f32> {
    match layer {
        QuantLayer::Int8(l) => {
            // Dynamic scales: this input's own step (see `calibrate`), else the stored one.
            let step = if dynamic { dynamic_input_scale(x) } else { l.input_scale };
            let inv = 1.0 / step;
            let xq: Vec<i32> = x.iter().map(|&v| i32::from(quantize_input(v, inv))).collect();
            (0..l.out)
                .map(|o| {
                    let row = &l.weight[o * l.inp..(o + 1) * l.inp];
                    let acc: i32 = row.iter().zip(&xq).map(|(&w, &q)| i32::from(w) * q).sum();
                    acc as f32 * (l.weight_scale[o] * step) + l.bias[o]
                })
                .collect()
        }
        QuantLayer::F32(l) => {
            (0..l.out).map(|o| dot_f32(&l.weight[o * l.inp..(o + 1) * l.inp], x) + l.bias[o]).collect()
        }
    }
}

/// The scores and greedy action of `net` for one observation.
pub fn reference_scores(net: &QuantNet, obs: &[f32]) -> Result<(Vec<f32>, usize)> {
    const CTX: &str = "reference_scores";
    if obs.len() != net.state_dim() {
        return Err(Error::Length { what: "obs", expected: net.state_dim(), got: obs.len(), context: CTX });
    }
    if let Some((index, value)) = first_non_finite(obs) {
        return Err(Error::NonFinite { what: "obs".into(), index, value: value as f64, context: CTX });
    }
    let nh = net.kind.hidden_layers();
    let dynamic = net.dynamic_inputs();
    let mut z = obs.to_vec();
    for layer in &net.layers[..nh] {
        z = dense(layer, &z, dynamic);
        for v in &mut z {
            *v = match net.kind {
                PolicyKind::Dqn => relu(*v),
                PolicyKind::Ppo => tanh_rational(*v),
            };
        }
    }
    let scores = if net.kind.dueling() {
        let v = dense(&net.layers[nh], &z, dynamic)[0];
        let a = dense(&net.layers[nh + 1], &z, dynamic);
        let mean = a.iter().sum::<f32>() / a.len() as f32;
        a.iter().map(|a| (a - mean) + v).collect()
    } else {
        dense(&net.layers[nh], &z, dynamic)
    };
    let best = first_argmax(&scores);
    Ok((scores, best))
}

/// Differences between a quantised network and its F32 original over observations.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Agreement {
    /// Observations compared.
    pub rows: usize,
    /// Rows whose greedy actions are equal.
    pub same_action: usize,
    /// Largest `|score_int8 − score_f32|` over rows and actions (Q values or logits).
    pub max_abs_score_diff: f64,
    /// Mean of the same over rows and actions.
    pub mean_abs_score_diff: f64,
    /// Largest `|score_f32|`, for scale.
    pub max_abs_score: f64,
}

impl Agreement {
    /// `same_action / rows` (1 for no rows).
    pub fn fraction(&self) -> f64 {
        if self.rows == 0 {
            1.0
        } else {
            self.same_action as f64 / self.rows as f64
        }
    }
}

/// Compares `quant` (through the plain reference) with `float` (in f64) on `obs` rows.
pub fn agreement(float: &FloatNet, quant: &QuantNet, obs: &[f32]) -> Result<Agreement> {
    let d = float.state_dim();
    if d != quant.state_dim() || float.n_actions() != quant.n_actions() || !obs.len().is_multiple_of(d) {
        return Err(Error::invalid(
            "agreement inputs",
            format!(
                "F32 net {}→{}, INT8 net {}→{}, {} observation values",
                d,
                float.n_actions(),
                quant.state_dim(),
                quant.n_actions(),
                obs.len()
            ),
        ));
    }
    let mut a = Agreement::default();
    let mut sum = 0.0;
    for row in obs.chunks_exact(d) {
        let want = float.forward_f64(row, |_, _| {});
        let (got, act) = reference_scores(quant, row)?;
        let want32: Vec<f32> = want.iter().map(|&v| v as f32).collect();
        a.rows += 1;
        a.same_action += usize::from(act == first_argmax(&want32));
        for (g, w) in got.iter().zip(&want) {
            let e = (*g as f64 - w).abs();
            a.max_abs_score_diff = a.max_abs_score_diff.max(e);
            a.max_abs_score = a.max_abs_score.max(w.abs());
            sum += e;
        }
    }
    a.mean_abs_score_diff = sum / (a.rows * quant.n_actions()).max(1) as f64;
    Ok(a)
}
