//! Action selection with the counter-based draws (ε-greedy for DQN, categorical sampling
//! for PPO), on host slices. The env's [`VecEnv`](crate::VecEnv) methods wrap these for
//! tensors; the CUDA kernels compute the same functions per thread.
//!
//! For the action applied at an account's step `n + 1` the draws use `step = n`, the
//! account's counter before that step (NOTES "Environment and RNG").

use crate::error::{Error, Result};
use crate::rng;

/// Checks the common arguments and returns the number of rows.
fn check_rows(
    x: &[f32],
    n_actions: usize,
    env_ids: &[u64],
    counters: &[u64],
    what: &'static str,
    ctx: &'static str,
) -> Result<usize> {
    let n = env_ids.len();
    if n_actions == 0 {
        return Err(Error::Config { context: ctx, message: "n_actions must be at least 1".into() });
    }
    if counters.len() != n {
        return Err(Error::shape("counters", ctx, format!("[{n}] (as env_ids)"), format!("[{}]", counters.len())));
    }
    if x.len() != n * n_actions {
        return Err(Error::shape(what, ctx, format!("[{n}, {n_actions}]"), format!("{} values", x.len())));
    }
    if let Some((index, v)) = x.iter().enumerate().find(|(_, v)| !v.is_finite()) {
        return Err(Error::NonFinite { what, index, value: *v as f64, context: ctx });
    }
    Ok(n)
}

/// Index of the largest value, the lowest index on ties.
#[inline]
pub(crate) fn argmax_lowest(row: &[f32]) -> usize {
    let mut best = 0;
    for (j, &v) in row.iter().enumerate().skip(1) {
        if v > row[best] {
            best = j;
        }
    }
    best
}

/// ε-greedy actions for `n` accounts: explore when `draw(seed, 1, env, counter) < eps`,
/// then take `floor(n_actions · draw(seed, 2, env, counter))`; otherwise the argmax of the
/// row of `q` (row-major `[n, n_actions]`), ties to the lowest index.
pub fn epsilon_greedy(
    q: &[f32],
    n_actions: usize,
    eps: f64,
    seed: u64,
    env_ids: &[u64],
    counters: &[u64],
) -> Result<Vec<u32>> {
    let n = check_rows(q, n_actions, env_ids, counters, "q", "epsilon_greedy")?;
    Ok((0..n)
        .map(|i| {
            let u1 = rng::draw(seed, rng::STREAM_EXPLORE, env_ids[i], counters[i]);
            if u1 < eps {
                let u2 = rng::draw(seed, rng::STREAM_RANDOM_ACTION, env_ids[i], counters[i]);
                ((u2 * n_actions as f64).floor() as usize).min(n_actions - 1) as u32
            } else {
                argmax_lowest(&q[i * n_actions..(i + 1) * n_actions]) as u32
            }
        })
        .collect())
}

/// The sampled action for one row of probabilities and a draw `u`: the first action whose
/// f64 cumulative probability exceeds `u`, the last one if rounding leaves none.
#[inline]
pub(crate) fn categorical(probs: &[f32], u: f64) -> usize {
    // Counting cdf <= u is the reference's formula; for non-negative probs it is the
    // first index with cdf > u.
    let mut cdf = 0.0f64;
    let mut count = 0;
    for &p in probs {
        cdf += p as f64;
        if cdf <= u {
            count += 1;
        }
    }
    count.min(probs.len() - 1)
}

/// Policy sampling for `n` accounts from row-major `[n, n_actions]` probabilities with
/// `u = draw(seed, 3, env, counter)`.
pub fn sample_from_probs(
    probs: &[f32],
    n_actions: usize,
    seed: u64,
    env_ids: &[u64],
    counters: &[u64],
) -> Result<Vec<u32>> {
    let n = check_rows(probs, n_actions, env_ids, counters, "probs", "sample_from_probs")?;
    Ok((0..n)
        .map(|i| {
            let u = rng::draw(seed, rng::STREAM_POLICY, env_ids[i], counters[i]);
            categorical(&probs[i * n_actions..(i + 1) * n_actions], u) as u32
        })
        .collect())
}

/// Softmax of one row of logits in f64 (max-shifted), and the sampled action's log-prob.
/// Shared by the CPU rollout path and mirrored by `kernels/env/ppo_experience.cu`.
pub(crate) fn sample_from_logits(logits: &[f32], u: f64) -> (usize, f64) {
    let m = logits.iter().fold(f64::NEG_INFINITY, |m, &l| m.max(l as f64));
    let z: f64 = logits.iter().map(|&l| (l as f64 - m).exp()).sum();
    let mut cdf = 0.0f64;
    let mut count = 0;
    for &l in logits {
        cdf += (l as f64 - m).exp() / z;
        if cdf <= u {
            count += 1;
        }
    }
    let a = count.min(logits.len() - 1);
    (a, logits[a] as f64 - m - z.ln())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fixtures::Fixture;

    #[test]
    fn matches_fixture_selection_table() {
        let fx = Fixture::load("env.safetensors");
        let q = fx.f32s("sel.q");
        let probs = fx.f32s("sel.probs");
        let envs: Vec<u64> = fx.i64s("sel.env").iter().map(|&e| e as u64).collect();
        let steps: Vec<u64> = fx.i64s("sel.step").iter().map(|&s| s as u64).collect();
        let seed = 20240601;
        let eg = epsilon_greedy(&q, 3, 0.3, seed, &envs, &steps).expect("eg");
        let want: Vec<u32> = fx.i64s("sel.eps_greedy").iter().map(|&a| a as u32).collect();
        assert_eq!(eg, want);
        let sp = sample_from_probs(&probs, 3, seed, &envs, &steps).expect("sp");
        let want: Vec<u32> = fx.i64s("sel.sampled").iter().map(|&a| a as u32).collect();
        assert_eq!(sp, want);
        // the table exercises both branches and the tie rows
        let explored = (0..64).filter(|&i| rng::draw(seed, 1, envs[i], steps[i]) < 0.3).count();
        assert!(explored > 5 && explored < 59, "{explored}");
    }

    #[test]
    fn ties_go_to_lowest_index_and_eps_limits() {
        let q = [0.5f32, 0.25, 0.5, 0.125, 0.75, 0.75, 0.375, 0.375, 0.375];
        let a = epsilon_greedy(&q, 3, 0.0, 7, &[0, 1, 2], &[0, 0, 0]).expect("eg");
        assert_eq!(a, vec![0, 1, 0]);
        // eps = 1 always explores: the action is floor(3 u2)
        let a = epsilon_greedy(&q, 3, 1.0, 7, &[0, 1, 2], &[5, 6, 7]).expect("eg");
        for (i, &ai) in a.iter().enumerate() {
            let u2 = rng::draw(7, 2, i as u64, 5 + i as u64);
            assert_eq!(ai, (u2 * 3.0).floor() as u32);
        }
    }

    #[test]
    fn rejects_nan_and_bad_shapes() {
        assert!(epsilon_greedy(&[0.0, f32::NAN, 1.0], 3, 0.1, 0, &[0], &[0]).is_err());
        assert!(sample_from_probs(&[0.5, 0.5], 3, 0, &[0], &[0]).is_err());
        assert!(sample_from_probs(&[0.2, 0.3, 0.5], 3, 0, &[0], &[0, 1]).is_err());
    }

    #[test]
    fn categorical_edges() {
        assert_eq!(categorical(&[0.2, 0.3, 0.5], 0.0), 0);
        assert_eq!(categorical(&[0.2, 0.3, 0.5], 0.25), 1);
        assert_eq!(categorical(&[0.25, 0.5, 0.25], 0.25), 1); // cdf == u is not > u
        assert_eq!(categorical(&[0.2, 0.3, 0.5], 0.999_999), 2);
        // rounding leaves no cdf > u: the last action
        assert_eq!(categorical(&[0.25, 0.25, 0.25], 0.9), 2);
        assert_eq!(categorical(&[0.0, 0.0, 1.0], 0.5), 2);
    }

    proptest::proptest! {
        /// Sampling from logits equals sampling from their f64 softmax, and the log-prob
        /// is the log-softmax entry of the chosen action.
        #[test]
        fn logits_sampling_matches_probs(l in proptest::collection::vec(-8.0f32..8.0, 3), u in 0.0f64..1.0) {
            let (a, lp) = sample_from_logits(&l, u);
            let m = l.iter().fold(f64::NEG_INFINITY, |m, &x| m.max(x as f64));
            let z: f64 = l.iter().map(|&x| (x as f64 - m).exp()).sum();
            let p: Vec<f64> = l.iter().map(|&x| (x as f64 - m).exp() / z).collect();
            let mut cdf = 0.0;
            let mut want = 2;
            for (j, pj) in p.iter().enumerate() {
                cdf += pj;
                if cdf > u { want = j; break; }
            }
            proptest::prop_assert_eq!(a, want);
            proptest::prop_assert!((lp - p[a].ln()).abs() < 1e-12);
        }
    }
}
