//! The counters a trainer saves beside its tensors: one JSON document under one metadata
//! key of its safetensors state file, with a layout version checked on load.

use std::collections::HashMap;
use std::path::Path;

use fx_data::error::one_line;
use fx_precision::NamedTensors;
use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::error::{Error, Result};
use crate::params::ParamSpec;

/// Counters with a layout version.
pub(crate) trait Versioned {
    fn version(&self) -> u32;
}

/// Stores `counters` as JSON under `key` in `meta`.
pub(crate) fn write<T: Serialize>(
    meta: &mut HashMap<String, String>,
    key: &str,
    counters: &T,
    context: &'static str,
) -> Result<()> {
    let json = serde_json::to_string(counters).map_err(|source| Error::Json { context, source })?;
    meta.insert(key.to_string(), json);
    Ok(())
}

/// Reads the counters under `key` from a state file's metadata, refusing a file without
/// them (`what` names the expected kind, e.g. "a DQN trainer state") or of another version.
pub(crate) fn read<T: DeserializeOwned + Versioned>(
    nt: &NamedTensors,
    path: &Path,
    key: &str,
    what: &str,
    expected_version: u32,
    context: &'static str,
) -> Result<T> {
    let json = nt
        .metadata()
        .get(key)
        .ok_or_else(|| Error::config(context, format!("{} has no `{key}` metadata (not {what})", path.display())))?;
    // serde's messages quote the file's text (an unknown field's name): kept to one line.
    let counters: T = serde_json::from_str(json).map_err(|e| {
        Error::config(
            context,
            format!("{}: `{key}` metadata is not {what}: {}", path.display(), one_line(&e.to_string())),
        )
    })?;
    if counters.version() != expected_version {
        return Err(Error::config(
            context,
            format!("{}: state version {} (expected {expected_version})", path.display(), counters.version()),
        ));
    }
    Ok(counters)
}

/// Refuses, before anything is allocated, a saved network config that does not match the
/// file's weights: every parameter `{prefix}{name}` of `specs` must be in the file with its
/// shape. (A damaged config could otherwise ask for a network of any size.)
pub(crate) fn check_network(
    nt: &NamedTensors,
    path: &Path,
    prefix: &str,
    specs: &[ParamSpec],
    context: &'static str,
) -> Result<()> {
    for spec in specs {
        let name = format!("{prefix}{}", spec.name);
        match nt.dims(&name) {
            Some(d) if d == spec.shape.as_slice() => {}
            found => {
                let found = found.map_or("none".to_string(), |d| format!("shape {d:?}"));
                return Err(Error::config(
                    context,
                    format!(
                        "{}: the saved config's network needs tensor `{name}` of shape {:?}, the file holds {found}",
                        path.display(),
                        spec.shape
                    ),
                ));
            }
        }
    }
    Ok(())
}

/// Refuses, before anything is allocated, a buffer of `dims` elements of `bytes_per`
/// bytes (`what`, e.g. `replay buffer (replay_capacity 100000)`) that overflows or needs
/// more than this machine's memory. A damaged config could otherwise abort the process on
/// a failed allocation.
pub(crate) fn check_buffer(
    path: &Path,
    what: &str,
    dims: &[usize],
    bytes_per: u64,
    context: &'static str,
) -> Result<()> {
    let bytes = dims.iter().try_fold(bytes_per, |acc, &d| acc.checked_mul(d as u64));
    let ram = fx_hw::HostInfo::detect().ram_total_bytes;
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    match (bytes, ram) {
        (None, _) => {
            Err(Error::config(context, format!("{}: the saved {what} overflows the address space", path.display())))
        }
        (Some(b), Some(ram)) if b > ram => Err(Error::config(
            context,
            format!(
                "{}: the saved {what} needs {:.1} GiB, more than this machine's {:.1} GiB",
                path.display(),
                gib(b),
                gib(ram)
            ),
        )),
        _ => Ok(()),
    }
}

#[cfg(test)]
pub(crate) mod fuzz_tests;
