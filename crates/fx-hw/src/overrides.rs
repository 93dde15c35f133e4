use std::fmt;

use serde::{Deserialize, Serialize};

use crate::{Error, Precision};

/// Where a value of the budget came from, so a user can see why it is what it is.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind", content = "name")]
pub enum Source {
    /// Read from the hardware.
    Detected,
    /// Derived from the detected hardware by a documented rule.
    Derived,
    /// A documented planning estimate (CPU, tests, or before a probe ran).
    Estimate,
    /// Measured on the device by a probe.
    Probe,
    /// Set in the run's config (file or command-line flag).
    Config,
    /// Set by an environment variable (its name).
    Env(String),
}

impl fmt::Display for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Source::Detected => f.write_str("detected"),
            Source::Derived => f.write_str("derived"),
            Source::Estimate => f.write_str("estimate"),
            Source::Probe => f.write_str("probe"),
            Source::Config => f.write_str("config"),
            Source::Env(name) => write!(f, "env {name}"),
        }
    }
}

/// A value together with its [`Source`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Sourced<T> {
    pub value: T,
    pub source: Source,
}

impl<T> Sourced<T> {
    pub fn new(value: T, source: Source) -> Self {
        Self { value, source }
    }
}

/// The device a run asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum DeviceRequest {
    /// The first CUDA device when one is usable, else the CPU.
    Auto,
    /// The CPU, even when a GPU is present.
    Cpu,
    /// A CUDA device by ordinal.
    Cuda(usize),
}

impl DeviceRequest {
    fn parse(s: &str) -> Option<Self> {
        let s = s.trim().to_ascii_lowercase();
        match s.as_str() {
            "auto" | "" => Some(Self::Auto),
            "cpu" => Some(Self::Cpu),
            "cuda" | "gpu" => Some(Self::Cuda(0)),
            _ => {
                s.strip_prefix("cuda:").or_else(|| s.strip_prefix("gpu:")).and_then(|n| n.parse().ok()).map(Self::Cuda)
            }
        }
    }
}

/// User overrides of the detected budget, from a config and from the environment.
///
/// Precedence: the environment (`FX_DEVICE`, `FX_PRECISION`, `FX_BATCH_SIZE`,
/// `FX_POPULATION`) overrides the
/// config; command-line flags are config values applied last by the caller
/// (see [`Overrides::layered`]).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Overrides {
    pub device: Option<Sourced<DeviceRequest>>,
    pub precision: Option<Sourced<Precision>>,
    pub batch_size: Option<Sourced<usize>>,
    /// The most members a population may hold (`FX_POPULATION`); a sweep with more trials
    /// runs in waves of this size.
    pub population: Option<Sourced<usize>>,
}

impl Overrides {
    /// Overrides read from the process environment.
    pub fn from_env() -> Result<Self, Error> {
        Self::from_vars(|name| std::env::var(name).ok())
    }

    /// Overrides read through `get` (testable without touching the process environment).
    pub fn from_vars(get: impl Fn(&str) -> Option<String>) -> Result<Self, Error> {
        let mut out = Self::default();
        if let Some(v) = get("FX_DEVICE") {
            let req = DeviceRequest::parse(&v)
                .ok_or_else(|| invalid("device", "FX_DEVICE", &v, "cpu, cuda, cuda:N or auto"))?;
            out.device = Some(Sourced::new(req, Source::Env("FX_DEVICE".into())));
        }
        if let Some(v) = get("FX_PRECISION") {
            let p = v.parse().map_err(|_| invalid("precision", "FX_PRECISION", &v, "f32, bf16 or f16"))?;
            out.precision = Some(Sourced::new(p, Source::Env("FX_PRECISION".into())));
        }
        if let Some(v) = get("FX_BATCH_SIZE") {
            let n = v
                .trim()
                .parse::<usize>()
                .ok()
                .filter(|n| *n > 0)
                .ok_or_else(|| invalid("batch size", "FX_BATCH_SIZE", &v, "a positive integer"))?;
            out.batch_size = Some(Sourced::new(n, Source::Env("FX_BATCH_SIZE".into())));
        }
        if let Some(v) = get("FX_POPULATION") {
            let n = v
                .trim()
                .parse::<usize>()
                .ok()
                .filter(|n| *n > 0)
                .ok_or_else(|| invalid("population size", "FX_POPULATION", &v, "a positive integer"))?;
            out.population = Some(Sourced::new(n, Source::Env("FX_POPULATION".into())));
        }
        Ok(out)
    }

    /// `self` with every value that `over` sets replaced by `over`'s.
    pub fn layered(mut self, over: Overrides) -> Self {
        self.device = over.device.or(self.device);
        self.precision = over.precision.or(self.precision);
        self.batch_size = over.batch_size.or(self.batch_size);
        self.population = over.population.or(self.population);
        self
    }

    /// A device override from the config (`"cpu"`, `"cuda"`, `"cuda:1"`, `"auto"`).
    ///
    /// Unparseable names fall back to `auto`; use [`Overrides::try_with_device`] to get an error.
    pub fn with_device(self, device: &str) -> Self {
        match self.clone().try_with_device(device) {
            Ok(o) => o,
            Err(_) => Self { device: None, ..self },
        }
    }

    /// A device override from the config, or an error naming the bad value.
    pub fn try_with_device(mut self, device: &str) -> Result<Self, Error> {
        let req = DeviceRequest::parse(device)
            .ok_or_else(|| invalid("device", "config", device, "cpu, cuda, cuda:N or auto"))?;
        self.device = Some(Sourced::new(req, Source::Config));
        Ok(self)
    }

    /// A precision override from the config.
    pub fn with_precision(mut self, precision: Precision) -> Self {
        self.precision = Some(Sourced::new(precision, Source::Config));
        self
    }

    /// A population-size override from the config (a sweep's `members`).
    pub fn with_population(mut self, members: usize) -> Self {
        self.population = Some(Sourced::new(members, Source::Config));
        self
    }

    /// A batch-size override from the config.
    pub fn with_batch_size(mut self, batch: usize) -> Self {
        self.batch_size = Some(Sourced::new(batch, Source::Config));
        self
    }
}

fn invalid(what: &'static str, source_name: &str, value: &str, expected: &'static str) -> Error {
    Error::InvalidOverride { what, source_name: source_name.to_string(), value: value.to_string(), expected }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vars<'a>(pairs: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |k| pairs.iter().find(|(n, _)| *n == k).map(|(_, v)| v.to_string())
    }

    #[test]
    fn reads_environment_with_sources() {
        let o =
            Overrides::from_vars(vars(&[("FX_DEVICE", "cuda:1"), ("FX_PRECISION", "F16"), ("FX_BATCH_SIZE", "512")]))
                .unwrap();
        assert_eq!(o.device.unwrap().value, DeviceRequest::Cuda(1));
        let p = o.precision.unwrap();
        assert_eq!(p.value, Precision::F16);
        assert_eq!(p.source, Source::Env("FX_PRECISION".into()));
        assert_eq!(o.batch_size.unwrap().value, 512);
        let o = Overrides::from_vars(vars(&[("FX_POPULATION", " 64 ")])).unwrap();
        assert_eq!(o.population, Some(Sourced::new(64, Source::Env("FX_POPULATION".into()))));
        // the environment wins over the config, as for the batch
        let o = Overrides::default().with_population(8).layered(o);
        assert_eq!(o.population.unwrap().value, 64);
    }

    #[test]
    fn bad_values_name_the_variable() {
        let err = Overrides::from_vars(vars(&[("FX_BATCH_SIZE", "lots")])).unwrap_err().to_string();
        assert!(err.contains("FX_BATCH_SIZE") && err.contains("lots"), "{err}");
        let err = Overrides::from_vars(vars(&[("FX_BATCH_SIZE", "0")])).unwrap_err().to_string();
        assert!(err.contains("positive"), "{err}");
        let err = Overrides::from_vars(vars(&[("FX_DEVICE", "tpu")])).unwrap_err().to_string();
        assert!(err.contains("FX_DEVICE"), "{err}");
        let err = Overrides::from_vars(vars(&[("FX_POPULATION", "-3")])).unwrap_err().to_string();
        assert!(err.contains("FX_POPULATION") && err.contains("-3"), "{err}");
    }

    #[test]
    fn later_layers_win() {
        let config = Overrides::default().with_batch_size(128).with_precision(Precision::Bf16);
        let env = Overrides::from_vars(vars(&[("FX_BATCH_SIZE", "256")])).unwrap();
        let merged = config.layered(env);
        assert_eq!(merged.batch_size.unwrap().value, 256);
        assert_eq!(merged.precision.unwrap().value, Precision::Bf16);
    }
}
