//! The counters a trainer saves beside its tensors: one JSON document under one metadata
//! key of its safetensors state file, with a layout version checked on load.

use std::collections::HashMap;
use std::path::Path;

use fx_precision::NamedTensors;
use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::error::{Error, Result};

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
    let counters: T = serde_json::from_str(json).map_err(|source| Error::Json { context, source })?;
    if counters.version() != expected_version {
        return Err(Error::config(
            context,
            format!("{}: state version {} (expected {expected_version})", path.display(), counters.version()),
        ));
    }
    Ok(counters)
}
