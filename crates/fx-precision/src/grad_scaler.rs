//! Dynamic loss scaling with `torch.amp.GradScaler`'s semantics and defaults.
//!
//! The loss is multiplied by `scale` before backward so that small F16 gradients do not
//! flush to zero; before the optimiser step the gradients are checked and divided by
//! `scale`. Any non-finite gradient skips the step and halves the scale; after
//! `growth_interval` consecutive clean steps the scale doubles (unless that would
//! overflow F32). The scale is an F32 number kept on the host: the per-step finite check
//! is a single reduction over all gradients on their device followed by a single
//! device-to-host read of its one-element result, and the state machine then runs on the
//! host with no further synchronisation.

use std::collections::HashMap;

use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor, Var};
use serde::{Deserialize, Serialize};

use crate::clip::{flat_grads, scale_grads};
use crate::error::{Context, Error, Result};
use crate::optim::Optimizer;
use crate::precision::{Precision, PrecisionExt};

/// Configuration of a [`GradScaler`]; the defaults are PyTorch's.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct GradScalerConfig {
    /// Initial scale (2^16).
    pub init_scale: f64,
    /// Factor applied after `growth_interval` clean steps (2).
    pub growth_factor: f64,
    /// Factor applied on a non-finite step (0.5).
    pub backoff_factor: f64,
    /// Consecutive clean steps before growing (2000).
    pub growth_interval: u32,
    /// Whether scaling is on. The finite check runs regardless (it is the NaN guard).
    pub enabled: bool,
}

impl Default for GradScalerConfig {
    fn default() -> Self {
        GradScalerConfig {
            init_scale: 65536.0,
            growth_factor: 2.0,
            backoff_factor: 0.5,
            growth_interval: 2000,
            enabled: true,
        }
    }
}

impl GradScalerConfig {
    /// PyTorch's defaults, enabled only where the precision needs it (F16).
    pub fn for_precision(precision: Precision) -> Self {
        GradScalerConfig { enabled: precision.uses_loss_scaling(), ..Self::default() }
    }
}

/// The part of a [`GradScaler`] that checkpoints carry (JSON in the file's metadata).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct GradScalerState {
    /// The current scale.
    pub scale: f32,
    /// Consecutive clean steps since the last growth or backoff.
    pub growth_tracker: u32,
}

/// Dynamic loss scaler; see the module docs.
#[derive(Debug, Clone)]
pub struct GradScaler {
    config: GradScalerConfig,
    scale: f32,
    growth_tracker: u32,
}

/// Metadata key under which [`GradScaler::save_metadata`] stores the state.
pub const GRAD_SCALER_METADATA_KEY: &str = "fx.grad_scaler";

impl GradScaler {
    /// A scaler with `config`, validated.
    pub fn new(config: GradScalerConfig) -> Result<Self> {
        let bad = |message: String| Error::Config { what: "GradScalerConfig", message };
        let init = config.init_scale as f32;
        if !(init.is_finite() && init > 0.0) {
            return Err(bad(format!("init_scale {} must be a positive F32", config.init_scale)));
        }
        if !(config.growth_factor > 1.0 && config.growth_factor.is_finite()) {
            return Err(bad(format!("growth_factor {} must be > 1", config.growth_factor)));
        }
        if !(config.backoff_factor > 0.0 && config.backoff_factor < 1.0) {
            return Err(bad(format!("backoff_factor {} must lie in (0, 1)", config.backoff_factor)));
        }
        if config.growth_interval == 0 {
            return Err(bad("growth_interval must be >= 1".into()));
        }
        Ok(GradScaler { config, scale: init, growth_tracker: 0 })
    }

    /// PyTorch's defaults for `precision` (enabled under F16 only).
    pub fn for_precision(precision: Precision) -> Self {
        Self::new(GradScalerConfig::for_precision(precision)).expect("defaults are valid")
    }

    /// Whether the loss is being scaled.
    pub fn is_enabled(&self) -> bool {
        self.config.enabled
    }

    /// The factor the loss is multiplied by (1 when disabled).
    pub fn scale_factor(&self) -> f64 {
        if self.config.enabled {
            self.scale as f64
        } else {
            1.0
        }
    }

    /// `loss * scale` (the loss itself when disabled). Call `backward` on the result.
    pub fn scale(&self, loss: &Tensor) -> Result<Tensor> {
        if !self.config.enabled {
            return Ok(loss.clone());
        }
        loss.affine(self.scale as f64, 0.0).ctx("GradScaler::scale")
    }

    /// Checks all gradients of `vars` for non-finite values — one reduction, one read —
    /// and, when they are finite and scaling is on, divides them by the scale in place.
    /// Returns `true` when a non-finite value was found (the step must be skipped).
    pub fn unscale(&self, vars: &[Var], grads: &mut GradStore) -> Result<bool> {
        let found_inf = !all_finite(vars, grads)?;
        if !found_inf && self.config.enabled {
            // PyTorch: inv_scale = float(1 / double(scale)).
            let inv = (1.0 / self.scale as f64) as f32 as f64;
            scale_grads(vars, grads, inv)?;
        }
        Ok(found_inf)
    }

    /// Advances the state machine after a step (`_amp_update_scale_`): a non-finite step
    /// multiplies the scale by `backoff_factor` and resets the tracker; a clean one
    /// counts, and the `growth_interval`-th in a row multiplies the scale by
    /// `growth_factor` if the result is finite. No-op when disabled.
    pub fn update(&mut self, found_inf: bool) {
        if !self.config.enabled {
            return;
        }
        if found_inf {
            self.scale = (self.scale as f64 * self.config.backoff_factor) as f32;
            self.growth_tracker = 0;
        } else {
            let successful = self.growth_tracker + 1;
            if successful == self.config.growth_interval {
                let grown = (self.scale as f64 * self.config.growth_factor) as f32;
                if grown.is_finite() {
                    self.scale = grown;
                }
                self.growth_tracker = 0;
            } else {
                self.growth_tracker = successful;
            }
        }
    }

    /// `scaler.step(opt); scaler.update()` in one: unscale and check the gradients of the
    /// optimiser's parameters, step unless a non-finite value was found, update the
    /// scale. Returns whether the optimiser stepped.
    pub fn step<O: Optimizer + ?Sized>(&mut self, optimizer: &mut O, grads: &mut GradStore) -> Result<bool> {
        let vars = optimizer.vars();
        let found_inf = self.unscale(&vars, grads)?;
        if !found_inf {
            optimizer.step(grads)?;
        }
        self.update(found_inf);
        Ok(!found_inf)
    }

    /// The configuration.
    pub fn config(&self) -> GradScalerConfig {
        self.config
    }

    /// The checkpointable state.
    pub fn state(&self) -> GradScalerState {
        GradScalerState { scale: self.scale, growth_tracker: self.growth_tracker }
    }

    /// Restores a state (scale must be a positive finite F32).
    pub fn set_state(&mut self, state: GradScalerState) -> Result<()> {
        if !(state.scale.is_finite() && state.scale > 0.0) {
            return Err(Error::Metadata {
                what: "GradScaler state".into(),
                message: format!("scale {} is not a positive finite number", state.scale),
            });
        }
        self.scale = state.scale;
        self.growth_tracker = state.growth_tracker;
        Ok(())
    }

    /// Writes the state as JSON under [`GRAD_SCALER_METADATA_KEY`].
    pub fn save_metadata(&self, metadata: &mut HashMap<String, String>) -> Result<()> {
        let json = serde_json::to_string(&self.state())
            .map_err(|e| Error::Metadata { what: "GradScaler state".into(), message: e.to_string() })?;
        metadata.insert(GRAD_SCALER_METADATA_KEY.to_string(), json);
        Ok(())
    }

    /// Restores the state written by [`GradScaler::save_metadata`].
    pub fn load_metadata(&mut self, metadata: &HashMap<String, String>) -> Result<()> {
        let bad = |message: String| Error::Metadata {
            what: format!("GradScaler state ({GRAD_SCALER_METADATA_KEY})"),
            message,
        };
        let json = metadata.get(GRAD_SCALER_METADATA_KEY).ok_or_else(|| bad("key missing".into()))?;
        let state: GradScalerState = serde_json::from_str(json).map_err(|e| bad(e.to_string()))?;
        self.set_state(state)
    }
}

/// Whether every gradient of `vars` is finite: one reduction over all of them
/// (`sum(g * 0)` is 0 if all are finite and NaN otherwise) and one device-to-host read.
pub(crate) fn all_finite(vars: &[Var], grads: &GradStore) -> Result<bool> {
    let Some(flat) = flat_grads(vars, grads)? else {
        return Ok(true);
    };
    let probe = flat
        .affine(0.0, 0.0)
        .and_then(|z| z.sum_all())
        .and_then(|s| s.to_dtype(DType::F32))
        .and_then(|s| s.to_scalar::<f32>())
        .ctx("GradScaler finite check")?;
    Ok(probe == 0.0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::optim::{AdamW, AdamWConfig};
    use candle_core::Device;
    use proptest::prelude::*;

    /// PyTorch's scale sequence written from the definition: after each step, the scale
    /// is init * backoff^(#inf steps) * growth^(#completed runs of `interval` clean
    /// steps), a run being counted from the last inf step or the last growth, and growth
    /// refused when it would overflow F32.
    fn reference_scales(steps: &[bool], init: f32, interval: u32) -> Vec<f32> {
        let mut out = Vec::new();
        let mut scale = init as f64;
        let mut clean_run = 0u32;
        for &inf in steps {
            if inf {
                scale *= 0.5;
                scale = scale as f32 as f64;
                clean_run = 0;
            } else {
                clean_run += 1;
                if clean_run.is_multiple_of(interval) {
                    if ((scale * 2.0) as f32).is_finite() {
                        scale *= 2.0;
                    }
                    clean_run = 0;
                }
            }
            out.push(scale as f32);
        }
        out
    }

    fn grads_for(var: &Var, kind: u8) -> GradStore {
        let v = match kind {
            0 => vec![0.5f32, -1.0, 2.0],
            1 => vec![0.5f32, f32::NAN, 2.0],
            2 => vec![f32::INFINITY, -1.0, 2.0],
            _ => vec![0.5f32, -1.0, f32::NEG_INFINITY],
        };
        let mut g = GradStore::default();
        g.insert(var.as_tensor(), Tensor::from_vec(v, 3, &Device::Cpu).unwrap());
        g
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

        /// Any sequence of clean / non-finite (NaN, +inf, -inf) steps through the real
        /// tensor path gives PyTorch's scale sequence; skipped steps leave weights,
        /// moments and the step count alone.
        #[test]
        fn scale_sequence_matches_pytorch(
            kinds in proptest::collection::vec(prop_oneof![3 => Just(0u8), 1 => 1u8..4], 0..60),
            interval in 1u32..6,
            big in any::<bool>(),
        ) {
            // `big` starts near the top of F32 so that refused growth is exercised.
            let init = if big { 2f32.powi(126) } else { 65536.0 };
            let cfg = GradScalerConfig { init_scale: init as f64, growth_interval: interval, ..Default::default() };
            let mut scaler = GradScaler::new(cfg).unwrap();
            let var = Var::zeros(3, DType::F32, &Device::Cpu).unwrap();
            let mut opt = AdamW::new([("w".to_string(), var.clone())], AdamWConfig::default()).unwrap();
            let infs: Vec<bool> = kinds.iter().map(|&k| k != 0).collect();
            let want = reference_scales(&infs, init, interval);
            let mut clean = 0;
            for (i, &k) in kinds.iter().enumerate() {
                let before: Vec<f32> = var.as_tensor().to_vec1().unwrap();
                let mut g = grads_for(&var, k);
                let stepped = scaler.step(&mut opt, &mut g).unwrap();
                prop_assert_eq!(stepped, k == 0);
                if k == 0 { clean += 1 } else {
                    prop_assert_eq!(before, var.as_tensor().to_vec1::<f32>().unwrap());
                }
                prop_assert_eq!(scaler.state().scale, want[i], "step {}", i);
            }
            prop_assert_eq!(opt.step_count(), clean);
        }
    }

    #[test]
    fn default_growth_after_2000_clean_steps_and_backoff() {
        let mut s = GradScaler::new(GradScalerConfig::default()).unwrap();
        assert_eq!(s.scale_factor(), 65536.0);
        for _ in 0..1999 {
            s.update(false);
        }
        assert_eq!(s.scale_factor(), 65536.0);
        s.update(false);
        assert_eq!(s.scale_factor(), 131072.0);
        s.update(true);
        assert_eq!(s.state(), GradScalerState { scale: 65536.0, growth_tracker: 0 });
    }

    #[test]
    fn unscale_divides_by_scale_and_disabled_scaler_still_checks() {
        let var = Var::zeros(3, DType::F32, &Device::Cpu).unwrap();
        let s = GradScaler::new(GradScalerConfig { init_scale: 4.0, ..Default::default() }).unwrap();
        let loss = Tensor::new(1.5f32, &Device::Cpu).unwrap();
        assert_eq!(s.scale(&loss).unwrap().to_scalar::<f32>().unwrap(), 6.0);
        let mut g = grads_for(&var, 0);
        assert!(!s.unscale(std::slice::from_ref(&var), &mut g).unwrap());
        assert_eq!(g.get(var.as_tensor()).unwrap().to_vec1::<f32>().unwrap(), [0.125, -0.25, 0.5]);

        let off = GradScaler::for_precision(Precision::Bf16);
        assert!(!off.is_enabled() && GradScaler::for_precision(Precision::F16).is_enabled());
        assert_eq!(off.scale(&loss).unwrap().to_scalar::<f32>().unwrap(), 1.5);
        let mut g = grads_for(&var, 1);
        assert!(off.unscale(std::slice::from_ref(&var), &mut g).unwrap());
        let mut g = grads_for(&var, 0);
        assert!(!off.unscale(std::slice::from_ref(&var), &mut g).unwrap());
        assert_eq!(g.get(var.as_tensor()).unwrap().to_vec1::<f32>().unwrap(), [0.5, -1.0, 2.0]);
    }

    #[test]
    fn state_round_trips_through_metadata() {
        let mut s = GradScaler::new(GradScalerConfig { growth_interval: 3, ..Default::default() }).unwrap();
        s.update(false);
        s.update(true);
        s.update(false);
        let mut meta = HashMap::new();
        s.save_metadata(&mut meta).unwrap();
        let mut t = GradScaler::new(GradScalerConfig { growth_interval: 3, ..Default::default() }).unwrap();
        t.load_metadata(&meta).unwrap();
        assert_eq!(t.state(), s.state());
        for _ in 0..5 {
            s.update(false);
            t.update(false);
            assert_eq!(t.state(), s.state());
        }
        let err = t.load_metadata(&HashMap::new()).unwrap_err().to_string();
        assert!(err.contains(GRAD_SCALER_METADATA_KEY), "{err}");
        meta.insert(GRAD_SCALER_METADATA_KEY.into(), "{\"scale\":-1.0,\"growth_tracker\":0}".into());
        assert!(t.load_metadata(&meta).is_err());
        assert!(GradScaler::new(GradScalerConfig { backoff_factor: 1.0, ..Default::default() }).is_err());
    }
}
