//! MAMBA-2's one-bar CPU step with INT8 `in_proj` and `out_proj` ([`mamba2_int8_step`]):
//! the projections are some 90 % of the bytes a bar reads (6.9 MB in F32 for the default
//! model), and the step streams them once per bar, so four times fewer bytes is the lever.
//!
//! [`Int8Rows`] is the projection: an INT8 layer of the policies' own kind (a
//! [`QuantLinear`] quantised row by row, packed for the kernels, with dynamic input scales:
//! `max |x| / 127` per call) run through the same path as an [`crate::Int8Policy`]'s layer,
//! with a zero bias. Everything else in the step (conv, SSM recurrence, norms) stays F32.

use fx_models::mamba2::decode_cpu::{Mamba2CpuStep, Projection, ProjectionKind};

use crate::error::{Error, Result};
use crate::float_net::FloatLayer;
use crate::gemv_i8::{Gemv, Isa};
use crate::qnet::{PackedLinear, QuantLinear};

/// A projection's INT8 rows; see the module docs.
#[derive(Debug, Clone)]
pub struct Int8Rows {
    layer: PackedLinear,
    gemv: Gemv,
    /// Scratch: the quantised input (padding stays zero) and the i32 sums.
    xq: Vec<i8>,
    acc: Vec<i32>,
}

impl Int8Rows {
    /// Quantises `w` (`rows × cols`, row-major, finite) for `isa`.
    pub fn new(w: &[f32], rows: usize, cols: usize, isa: Isa) -> Result<Self> {
        const CTX: &str = "Int8Rows::new";
        if w.len() != rows * cols || cols == 0 {
            return Err(Error::Length { what: "weights", expected: rows * cols.max(1), got: w.len(), context: CTX });
        }
        if let Some(i) = w.iter().position(|v| !v.is_finite()) {
            return Err(Error::NonFinite { what: "weights".into(), index: i, value: w[i] as f64, context: CTX });
        }
        let gemv = Gemv::new(isa)
            .ok_or_else(|| Error::Invalid { what: "ISA", message: format!("this CPU lacks {}", isa.name()) })?;
        let f =
            FloatLayer { name: "projection".into(), out: rows, inp: cols, weight: w.to_vec(), bias: vec![0.0; rows] };
        let layer = PackedLinear::new(&QuantLinear::from_f32(&f, 1.0), true);
        Ok(Self { xq: vec![0; layer.stride], acc: vec![0; rows], layer, gemv })
    }
}

impl Projection for Int8Rows {
    fn apply(&mut self, x: &[f32], out: &mut [f32]) {
        crate::policy::dense_int8(&self.layer, self.gemv, x, out, &mut self.xq, &mut self.acc);
    }
    fn bytes(&self) -> usize {
        // Weights and scales (the zero bias the shared layer carries is not needed here).
        self.layer.weight.len() + self.layer.dequant.len() * 4
    }
    fn clone_box(&self) -> Box<dyn Projection> {
        Box::new(self.clone())
    }
}

/// `model`'s one-bar CPU step (`fx_models::Mamba2::cpu_step`) with every layer's `in_proj`
/// and `out_proj` as [`Int8Rows`] on this CPU's best ISA; a [`crate::Forecast`] like the F32
/// step.
pub fn mamba2_int8_step(model: &fx_models::Mamba2) -> Result<Mamba2CpuStep> {
    let isa = Isa::detect();
    let mut make = |_: ProjectionKind, _: usize, rows: usize, cols: usize, w: Vec<f32>| {
        Int8Rows::new(&w, rows, cols, isa)
            .map(|p| Box::new(p) as Box<dyn Projection>)
            .map_err(|e| fx_kernels::Error::Config { context: "mamba2_int8_step", message: e.to_string() })
    };
    model.cpu_step_with(&mut make).map_err(|source| Error::Model { context: "mamba2_int8_step", source })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::qnet::{dynamic_input_scale, quantize_input};
    use candle_core::Device;
    use fx_models::{Mamba2, Mamba2Config};

    fn seed() -> u64 {
        fx_hw::test_seed(concat!(module_path!(), ":", line!()))
    }

    fn uniform(n: usize, seed: u64, stream: u64, scale: f64) -> Vec<f32> {
        (0..n as u64).map(|i| ((fx_kernels::rng::draw(seed, stream, 0, i) * 2.0 - 1.0) * scale) as f32).collect()
    }

    /// On fresh random weights and inputs (columns that pad and that do not), every ISA's
    /// projection equals the plain integer reference to the bit (the quantised input and
    /// weights multiplied in i64, then scaled as the projection scales), and stays within
    /// 1.5 % (of the row's Σ|w·x|) of the F32 product it replaces.
    #[test]
    fn int8_rows_equal_the_integer_reference() {
        let s = seed();
        for (case, (rows, cols)) in [(37usize, 70usize), (16, 64), (5, 1), (300, 256)].into_iter().enumerate() {
            let k = s.wrapping_add(case as u64);
            let w = uniform(rows * cols, k, 1, 0.3);
            let x = uniform(cols, k, 2, 3.0);
            let xs = dynamic_input_scale(&x);
            let xq: Vec<i8> = x.iter().map(|&v| quantize_input(v, 1.0 / xs)).collect();
            for isa in Isa::available() {
                let mut p = Int8Rows::new(&w, rows, cols, isa).unwrap();
                let mut out = vec![f32::NAN; rows];
                p.apply(&x, &mut out);
                for r in 0..rows {
                    let l = &p.layer;
                    let acc: i64 = (0..cols).map(|c| i64::from(l.weight[r * l.stride + c]) * i64::from(xq[c])).sum();
                    let want = acc as i32 as f32 * (l.dequant[r] * xs);
                    assert_eq!(out[r].to_bits(), want.to_bits(), "{isa:?} {rows}x{cols} row {r} (seed {s})");
                    let exact: f64 = (0..cols).map(|c| f64::from(w[r * cols + c]) * f64::from(x[c])).sum();
                    let mag: f64 = (0..cols).map(|c| (f64::from(w[r * cols + c]) * f64::from(x[c])).abs()).sum();
                    assert!(
                        (f64::from(out[r]) - exact).abs() <= 0.015 * mag + 1e-6,
                        "{isa:?} row {r}: {} vs {exact}",
                        out[r]
                    );
                }
            }
        }
        assert!(Int8Rows::new(&[1.0, f32::NAN], 1, 2, Isa::Scalar).unwrap_err().to_string().contains("non-finite"));
        assert!(Int8Rows::new(&[1.0; 3], 2, 2, Isa::Scalar).is_err());
    }

    /// A small MAMBA-2 trained on a synthetic series (an AR(1) feature, noise features and a
    /// daily cycle; `fx_models::seq::train`), then fed every bar one at a time from a
    /// zero state by the F32 and the INT8 step: on the held-out bars, the INT8 step's forecast
    /// MSE against the targets is within 1 % of the F32 step's (issue 13's MAMBA-2 target),
    /// and the model has learned something (its MSE is under 70 % of the target's variance).
    #[test]
    fn trained_int8_step_keeps_the_forecast_mse() {
        use fx_models::seq::{train, Mamba2Task, SeqSeries, SeqTrainConfig};
        let (rows, n_obs) = (700usize, 3usize);
        let noise = |stream: u64, t: usize| (fx_kernels::rng::draw(77, stream, 0, t as u64) * 2.0 - 1.0) as f32;
        let (mut obs, mut target, mut ar) = (Vec::new(), Vec::new(), 0.0f32);
        for t in 0..rows {
            ar = 0.8 * ar + 0.6 * noise(1, t);
            let f = [ar, noise(2, t), noise(3, t)];
            let season = (2.0 * std::f32::consts::PI * (t % 24) as f32 / 24.0).sin();
            target.push(0.5 * f[0] + 0.3 * f[1] + 0.4 * season + 0.1 * noise(4, t));
            obs.extend_from_slice(&f);
        }
        let series = SeqSeries::new(obs.clone(), n_obs, Vec::new(), 0, target.clone()).unwrap();
        let cfg = Mamba2Config {
            n_in: n_obs,
            d_model: 32,
            n_layer: 2,
            d_state: 8,
            headdim: 8,
            chunk_size: 8,
            ..Default::default()
        };
        let model = Mamba2::new(cfg, &Device::Cpu, 1).unwrap();
        let task = Mamba2Task { model: &model, seq_len: 24 };
        let tc = SeqTrainConfig { epochs: 12, batch_size: 16, lr: 1e-2, patience: 4, ..Default::default() };
        train(&task, &series, 0..500, 500..600, &tc).unwrap();
        let (mut f32_step, mut q) = (model.cpu_step().unwrap(), mamba2_int8_step(&model).unwrap());
        let (mut se_f, mut se_q, mut var) = (0.0f64, 0.0f64, 0.0f64);
        let held: Vec<f64> = target[600..].iter().map(|&v| f64::from(v)).collect();
        let mean = held.iter().sum::<f64>() / held.len() as f64;
        for t in 0..rows {
            let bar = &obs[t * n_obs..(t + 1) * n_obs];
            let (pf, pq) = (f64::from(f32_step.step(bar).unwrap()), f64::from(q.step(bar).unwrap()));
            if t >= 600 {
                let y = f64::from(target[t]);
                se_f += (pf - y) * (pf - y);
                se_q += (pq - y) * (pq - y);
                var += (y - mean) * (y - mean);
            }
        }
        eprintln!(
            "trained MAMBA-2, held-out MSE: F32 {:.5}, INT8 {:.5}, target variance {:.5}",
            se_f / 100.0,
            se_q / 100.0,
            var / 100.0
        );
        assert!(se_f < 0.7 * var, "the model did not learn: MSE {se_f} against variance {var}");
        assert!((se_q - se_f).abs() <= 0.01 * se_f, "INT8 MSE {se_q} against F32 {se_f}");
    }

    /// The INT8 step against the F32 step of the same random model, fed the same 200 bars:
    /// the predictions' RMS difference stays under 6 % of the F32 predictions' RMS (2.8–3.3 % seen on the dev machine), the
    /// projections take under a third of the F32 bytes, and a bad bar is still refused.
    #[test]
    fn int8_step_tracks_the_f32_step() {
        let s = seed();
        let cfg = Mamba2Config::default();
        let model = Mamba2::new(cfg.clone(), &Device::Cpu, s % 1000).unwrap();
        let mut f32_step = model.cpu_step().unwrap();
        let mut q = mamba2_int8_step(&model).unwrap();
        assert!(
            q.projection_bytes() * 3 < f32_step.projection_bytes(),
            "{} vs {}",
            q.projection_bytes(),
            f32_step.projection_bytes()
        );
        let (mut diff, mut norm) = (0.0f64, 0.0f64);
        for t in 0..200u64 {
            let bar = uniform(cfg.n_in, s, 10 + t, 1.5);
            let (a, b) = (f64::from(f32_step.step(&bar).unwrap()), f64::from(q.step(&bar).unwrap()));
            assert!(b.is_finite(), "bar {t}");
            diff += (a - b) * (a - b);
            norm += a * a;
        }
        let rel = (diff / norm.max(1e-30)).sqrt();
        eprintln!("int8 MAMBA-2 step: relative RMS difference {rel:.4} over 200 bars (seed {s})");
        assert!(rel < 0.06, "relative RMS difference {rel} (seed {s})");
        assert!(q.step(&vec![f32::NAN; cfg.n_in]).is_err());
    }
}
