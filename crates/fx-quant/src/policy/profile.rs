//! Where a batch pass's time goes (ignored; `--ignored --nocapture int8_batch_phases`, in
//! release, on a CPU with AVX-512): one pass of [`TILE_ROWS`] rows (AMX) or [`MAX_ROWS`]
//! rows (VNNI) through each layer of the default DQN and PPO, its three phases timed apart
//! (quantising the inputs, the products, dequantising with bias, activation and `max |y|`)
//! and the whole pass (`act_batch`), in ns per row. The device machine has no profiler.

use std::hint::black_box;

use super::*;
use crate::testing::{random_net, uniforms};
use crate::CalibMethod;

/// Median ns per row of `reps` runs of `f` over `n` rows.
fn ns_per_row(n: usize, reps: usize, mut f: impl FnMut()) -> f64 {
    let mut t = Vec::with_capacity(reps);
    for _ in 0..reps {
        let s = std::time::Instant::now();
        f();
        t.push(s.elapsed().as_secs_f64());
    }
    t.sort_by(f64::total_cmp);
    t[reps / 2] * 1e9 / n as f64
}

/// One layer's phases.
#[target_feature(enable = "avx512f,avx512bw,avx2,fma")]
fn layer_phases(
    l: &PackedLinear,
    v: &VerticalWeights,
    tiles: Option<&Tiles>,
    gemv: Gemv,
    act: Act,
    n: usize,
) -> String {
    let (wx, wq, wa) = (l.inp, l.stride, l.out);
    let xs: Vec<f32> = uniforms(5, 6, n * wx).iter().map(|u| u.abs()).collect();
    let mut xq = vec![0i8; n * wq];
    let mut acc = vec![0i32; n * wa];
    let mut ys = vec![0.0f32; n * l.out];
    let mut steps = [None; TILE_ROWS];
    let amax: Vec<f32> = xs.chunks_exact(wx).map(abs_max).collect();
    let q = ns_per_row(n, 2000, || {
        for r in 0..n {
            steps[r] = quantize_row(l, &xs[r * wx..], Some(amax[r]), &mut xq[r * wq..]);
        }
        black_box(&xq);
    });
    let p = ns_per_row(n, 2000, || {
        let xr: Vec<&[i8]> = (0..n).map(|r| &xq[r * wq..r * wq + l.stride]).collect();
        let mut or: Vec<&mut [i32]> = acc.chunks_mut(wa).take(n).collect();
        match tiles {
            Some(t) => t.run(v, &xr, &mut or),
            None => {
                gemv.run_vertical(v, &xr, &mut or);
            }
        }
        black_box(&or);
    });
    let d = ns_per_row(n, 2000, || {
        for r in 0..n {
            let y = &mut ys[r * l.out..(r + 1) * l.out];
            dequantize_row(l, &acc[r * wa..(r + 1) * wa], steps[r], act, y);
            black_box(act.gathers().then(|| abs_max(y)));
        }
    });
    format!("{}x{}: quantise {q:.0}, products {p:.0}, dequantise {d:.0} ns/row", l.out, l.inp)
}

#[test]
#[ignore = "timing printout; run with --ignored --nocapture in release"]
fn int8_batch_phases() {
    if !(Isa::available().contains(&Isa::Avx512Vnni) && has_avx2_fma()) {
        println!("no AVX-512 VNNI (with AVX2 + FMA) on this CPU: nothing to time");
        return;
    }
    for (kind, hidden) in [(PolicyKind::Dqn, vec![256, 256, 128]), (PolicyKind::Ppo, vec![256, 256])] {
        let net = random_net(kind, 56, &hidden, 3, 5);
        let q = crate::quantize(&net, &uniforms(1, 2, 512 * 56), CalibMethod::Dynamic, &[]).unwrap();
        let isas: Vec<Isa> = [Isa::Amx, Isa::Avx512Vnni].into_iter().filter(|i| Isa::available().contains(i)).collect();
        for isa in isas {
            let mut p = Int8Policy::with_isa(&q, isa).unwrap();
            let n = pass_rows(p.model.gemv);
            let tiles = p.model.gemv.tiles();
            let nh = kind.hidden_layers();
            for (i, layer) in p.model.layers.iter().chain(p.model.head.iter()).enumerate() {
                if let Packed::Int8(l, Some(v)) = layer {
                    let act = if i < nh { Act::hidden(kind) } else { Act::Id };
                    // SAFETY: AVX-512 VNNI (so F, BW) and AVX2 + FMA were detected above.
                    let line = unsafe { layer_phases(l, v, tiles.as_ref(), p.model.gemv, act, n) };
                    println!("{kind:?} {isa:?} {n} rows, layer {i}: {line}");
                }
            }
            let obs = uniforms(3, 4, 256 * 56);
            let mut acts = vec![0usize; 256];
            for rows in [n, 256] {
                let held = ns_per_row(rows, 500, || p.act_batch(&obs[..rows * 56], &mut acts[..rows]).unwrap());
                println!("{kind:?} {isa:?}: act_batch of {rows} rows {held:.0} ns/row (tile configuration held)");
            }
            drop(tiles);
            for rows in [n, 256] {
                let own = ns_per_row(rows, 500, || p.act_batch(&obs[..rows * 56], &mut acts[..rows]).unwrap());
                println!("{kind:?} {isa:?}: act_batch of {rows} rows {own:.0} ns/row (configured per call)");
            }
        }
    }
}
