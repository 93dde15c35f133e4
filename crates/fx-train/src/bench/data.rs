//! Deterministic random inputs for the cases, drawn on the host from the counter-based
//! SplitMix64 draws of `fx_kernels::rng` (so every run benchmarks the same numbers) and
//! uploaded once, before timing starts.

use anyhow::Result;
use candle_core::{Device, Tensor};
use fx_kernels::{EnvData, N_MARKET, OBS_DIM};

/// Stream offset of the bench's draws (distinct from the env's streams 0–3).
const BENCH_STREAM: u64 = 0xBE_0000;

/// `n` uniforms in [0, 1) from `(seed, stream)`.
pub(crate) fn uniforms(seed: u64, stream: u64, n: usize) -> Vec<f64> {
    (0..n as u64).map(|i| fx_kernels::rng::draw(seed, BENCH_STREAM + stream, 0, i)).collect()
}

/// `n` standard normals (Box–Muller over pairs of draws).
pub(crate) fn normals(seed: u64, stream: u64, n: usize) -> Vec<f32> {
    (0..n as u64)
        .map(|i| {
            let u1 = fx_kernels::rng::draw(seed, BENCH_STREAM + stream, 1, i).max(f64::MIN_POSITIVE);
            let u2 = fx_kernels::rng::draw(seed, BENCH_STREAM + stream, 2, i);
            ((-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()) as f32
        })
        .collect()
}

/// RL states `[b, 56]` on `device`: normals with the two padding columns zero (as
/// bench.py's `rl_batch`).
pub(crate) fn states(device: &Device, b: usize, seed: u64, stream: u64) -> Result<Tensor> {
    let mut v = normals(seed, 100 + stream, b * OBS_DIM);
    for row in v.chunks_mut(OBS_DIM) {
        row[OBS_DIM - 2..].fill(0.0);
    }
    Ok(Tensor::from_vec(v, (b, OBS_DIM), device)?)
}

/// A synthetic series of `t_len` rows: random-walk close prices from 1.1 with 5e-4
/// log-return steps and normal market features (bench.py's `make_series`).
pub(crate) fn series(t_len: usize) -> Result<EnvData> {
    let steps = normals(4, 20, t_len);
    let mut close = Vec::with_capacity(t_len);
    let mut log_p = 0.0f64;
    for z in steps {
        log_p += 0.0005 * z as f64;
        close.push(1.1 * log_p.exp());
    }
    let market = normals(4, 21, t_len * N_MARKET);
    Ok(EnvData::new(market, close)?)
}
