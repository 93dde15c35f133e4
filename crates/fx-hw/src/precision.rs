use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// The compute precision of a training run: master weights stay F32, matmul-heavy ops run
/// in this dtype (`fx-precision` applies it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    /// Full single precision everywhere.
    #[default]
    F32,
    /// bfloat16 compute (Ampere and newer: compute capability ≥ 8.0).
    Bf16,
    /// float16 compute with loss scaling (Volta/Turing: compute capability 7.x).
    F16,
}

impl Precision {
    /// The precision the hardware runs best: BF16 on compute capability ≥ 8.0, FP16 on 7.x,
    /// F32 below and on the CPU (`None`).
    pub fn for_compute_capability(cc: Option<(u32, u32)>) -> Self {
        match cc {
            Some((major, _)) if major >= 8 => Precision::Bf16,
            Some((7, _)) => Precision::F16,
            _ => Precision::F32,
        }
    }

    /// Bytes per element of the compute dtype.
    pub fn bytes(self) -> usize {
        match self {
            Precision::F32 => 4,
            Precision::Bf16 | Precision::F16 => 2,
        }
    }

    /// The lowercase name used in configs and on the command line.
    pub fn as_str(self) -> &'static str {
        match self {
            Precision::F32 => "f32",
            Precision::Bf16 => "bf16",
            Precision::F16 => "f16",
        }
    }
}

impl fmt::Display for Precision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Precision {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "f32" | "fp32" | "float32" => Ok(Precision::F32),
            "bf16" | "bfloat16" => Ok(Precision::Bf16),
            "f16" | "fp16" | "float16" | "half" => Ok(Precision::F16),
            other => Err(format!("unknown precision {other:?} (expected f32, bf16 or f16)")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn choice_follows_compute_capability() {
        assert_eq!(Precision::for_compute_capability(None), Precision::F32);
        assert_eq!(Precision::for_compute_capability(Some((6, 1))), Precision::F32);
        assert_eq!(Precision::for_compute_capability(Some((7, 5))), Precision::F16);
        assert_eq!(Precision::for_compute_capability(Some((8, 0))), Precision::Bf16);
        assert_eq!(Precision::for_compute_capability(Some((9, 0))), Precision::Bf16);
    }

    #[test]
    fn parses_names() {
        assert_eq!("BF16".parse::<Precision>().unwrap(), Precision::Bf16);
        assert_eq!("fp16".parse::<Precision>().unwrap(), Precision::F16);
        assert!("int8".parse::<Precision>().is_err());
    }
}
