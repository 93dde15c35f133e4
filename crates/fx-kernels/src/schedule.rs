//! Scalar schedules for training hyper-parameters: the DQN exploration rate, which the
//! collection kernel of a captured DQN iteration also computes on the device
//! (`fx_linear_ramp` in `kernels/env/fx_env.cuh`, the same operations in the same order).

use serde::{Deserialize, Serialize};

/// Linear interpolation from `start` to `end` over `steps` steps, then constant `end`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LinearSchedule {
    /// Value at step 0.
    pub start: f64,
    /// Value from step `steps` on.
    pub end: f64,
    /// Length of the ramp (0: `end` from the start).
    pub steps: u64,
}

impl Default for LinearSchedule {
    /// The usual DQN exploration ramp: 1.0 → 0.05 over 100k environment steps.
    fn default() -> Self {
        Self { start: 1.0, end: 0.05, steps: 100_000 }
    }
}

impl LinearSchedule {
    /// The value at `step`.
    pub fn value(&self, step: u64) -> f64 {
        if step >= self.steps {
            return self.end;
        }
        let frac = step as f64 / self.steps as f64;
        self.start + (self.end - self.start) * frac
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn stays_between_endpoints_and_is_monotone(start in 0.0f64..1.0, end in 0.0f64..1.0, steps in 0u64..1000, a in 0u64..2000, b in 0u64..2000) {
            let s = LinearSchedule { start, end, steps };
            let (lo, hi) = (start.min(end), start.max(end));
            let (va, vb) = (s.value(a.min(b)), s.value(a.max(b)));
            prop_assert!(va >= lo - 1e-12 && va <= hi + 1e-12);
            // Monotone in the direction of end - start.
            prop_assert!((vb - va) * (end - start) >= -1e-12);
            prop_assert_eq!(s.value(steps + a), end);
        }
    }

    #[test]
    fn endpoints() {
        let s = LinearSchedule { start: 1.0, end: 0.1, steps: 10 };
        assert_eq!(s.value(0), 1.0);
        assert!((s.value(5) - 0.55).abs() < 1e-12);
        assert_eq!(s.value(10), 0.1);
    }
}
