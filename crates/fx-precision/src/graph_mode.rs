//! [`GraphMode`]: whether a training step on CUDA is captured as a CUDA graph.

use serde::{Deserialize, Serialize};

/// Whether CUDA training steps run as a captured graph (`graph` config key, `--graph` flag).
/// Ignored on the CPU.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum GraphMode {
    /// Capture on CUDA; if the capture fails, warn in one line saying why and run eagerly.
    #[default]
    Auto,
    /// Capture on CUDA; a failed capture is an error.
    On,
    /// Never capture: the eager step (one host read per step for the guard).
    Off,
}

impl std::str::FromStr for GraphMode {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "auto" => Ok(Self::Auto),
            "on" => Ok(Self::On),
            "off" => Ok(Self::Off),
            other => Err(format!("graph mode {other:?}: expected auto, on or off")),
        }
    }
}

impl std::fmt::Display for GraphMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Auto => "auto",
            Self::On => "on",
            Self::Off => "off",
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_prints() {
        for m in [GraphMode::Auto, GraphMode::On, GraphMode::Off] {
            assert_eq!(m.to_string().parse::<GraphMode>().unwrap(), m);
        }
        assert!("yes".parse::<GraphMode>().unwrap_err().contains("auto, on or off"));
    }
}
