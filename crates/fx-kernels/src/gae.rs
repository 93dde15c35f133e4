//! Generalised advantage estimation on the host (the CPU reference of `kernels/env/gae.cu`).

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// GAE discounting; defaults from MODELS.md (γ = 0.99, λ = 0.95).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct GaeConfig {
    /// Discount factor γ.
    pub gamma: f64,
    /// GAE λ.
    pub lambda: f64,
}

impl Default for GaeConfig {
    fn default() -> Self {
        Self { gamma: 0.99, lambda: 0.95 }
    }
}

/// Advantages and returns for a rollout of `T` steps × `E` accounts (row-major `[T, E]`):
///
/// `δ_t = r_t + γ(1 − d_t)V_{t+1} − V_t`, `A_t = δ_t + γλ(1 − d_t)A_{t+1}`, `R_t = A_t + V_t`,
/// with `V_T = last_value` (`[E]`, V of the state after the last step) and `d_t = 1` when
/// transition `t` ended its episode (no bootstrap and no advantage across it). Accumulates
/// in f64, returns f32 `(advantages, returns)`.
pub fn gae(
    rewards: &[f32],
    values: &[f32],
    dones: &[f32],
    last_value: &[f32],
    num_envs: usize,
    cfg: GaeConfig,
) -> Result<(Vec<f32>, Vec<f32>)> {
    let ctx = "gae";
    let e = num_envs;
    if last_value.len() != e {
        return Err(Error::shape("last_value", ctx, format!("[{e}]"), format!("[{}]", last_value.len())));
    }
    if e == 0 || !rewards.len().is_multiple_of(e) {
        return Err(Error::shape("rewards", ctx, format!("[T, {e}]"), format!("{} values", rewards.len())));
    }
    let t_len = rewards.len() / e;
    for (what, x) in [("values", values), ("dones", dones)] {
        if x.len() != rewards.len() {
            return Err(Error::shape(what, ctx, format!("[{t_len}, {e}]"), format!("{} values", x.len())));
        }
    }
    for (what, x) in [("rewards", rewards), ("values", values), ("dones", dones), ("last_value", last_value)] {
        if let Some((index, v)) = x.iter().enumerate().find(|(_, v)| !v.is_finite()) {
            return Err(Error::NonFinite { what, index, value: *v as f64, context: ctx });
        }
    }
    let (g, gl) = (cfg.gamma, cfg.gamma * cfg.lambda);
    let mut adv = vec![0.0f32; rewards.len()];
    let mut ret = vec![0.0f32; rewards.len()];
    for j in 0..e {
        let mut last = 0.0f64;
        let mut next_v = last_value[j] as f64;
        for t in (0..t_len).rev() {
            let k = t * e + j;
            let nonterm = 1.0 - dones[k] as f64;
            let v = values[k] as f64;
            let delta = rewards[k] as f64 + g * next_v * nonterm - v;
            last = delta + gl * nonterm * last;
            adv[k] = last as f32;
            ret[k] = (last + v) as f32;
            next_v = v;
        }
    }
    Ok((adv, ret))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fixtures::Fixture;

    #[test]
    fn matches_fixture() {
        let fx = Fixture::load("gae.safetensors");
        let (adv, ret) = gae(
            &fx.f32s("in.rewards"),
            &fx.f32s("in.values"),
            &fx.f32s("in.dones"),
            &fx.f32s("in.last_value"),
            4,
            GaeConfig::default(),
        )
        .expect("gae");
        let want_a = fx.f32s("out.advantages");
        let want_r = fx.f32s("out.returns");
        assert_eq!(adv.len(), 64);
        for i in 0..adv.len() {
            assert!((adv[i] - want_a[i]).abs() <= 1e-6, "adv[{i}] {} vs {}", adv[i], want_a[i]);
            assert!((ret[i] - want_r[i]).abs() <= 1e-6, "ret[{i}] {} vs {}", ret[i], want_r[i]);
        }
    }

    proptest::proptest! {
        /// Against the direct truncated sum A_t = Σ_k (γλ)^k δ_{t+k}, stopped after a done.
        #[test]
        fn equals_truncated_sum(r in proptest::collection::vec(-1.0f32..1.0, 12),
                                v in proptest::collection::vec(-1.0f32..1.0, 12),
                                d in proptest::collection::vec(proptest::bool::weighted(0.2), 12),
                                lv in proptest::collection::vec(-1.0f32..1.0, 2)) {
            let e = 2;
            let t_len = 6;
            let dones: Vec<f32> = d.iter().map(|&b| if b { 1.0 } else { 0.0 }).collect();
            let cfg = GaeConfig::default();
            let (adv, ret) = gae(&r, &v, &dones, &lv, e, cfg).expect("gae");
            for j in 0..e {
                for t in 0..t_len {
                    let mut a = 0.0f64;
                    let mut w = 1.0f64;
                    for k in t..t_len {
                        let i = k * e + j;
                        let nv = if k + 1 == t_len { lv[j] as f64 } else { v[i + e] as f64 };
                        let nt = 1.0 - dones[i] as f64;
                        a += w * (r[i] as f64 + cfg.gamma * nv * nt - v[i] as f64);
                        if dones[i] == 1.0 { break; }
                        w *= cfg.gamma * cfg.lambda;
                    }
                    let i = t * e + j;
                    proptest::prop_assert!((adv[i] as f64 - a).abs() < 1e-5);
                    proptest::prop_assert!((ret[i] as f64 - (a + v[i] as f64)).abs() < 1e-5);
                }
            }
        }
    }

    #[test]
    fn rejects_bad_input() {
        let cfg = GaeConfig::default();
        assert!(gae(&[0.0; 4], &[0.0; 4], &[0.0; 4], &[0.0; 3], 2, cfg).is_err());
        assert!(gae(&[0.0; 4], &[0.0; 3], &[0.0; 4], &[0.0; 2], 2, cfg).is_err());
        assert!(gae(&[f32::NAN; 4], &[0.0; 4], &[0.0; 4], &[0.0; 2], 2, cfg).is_err());
    }
}
