//! [`ParamStore`]: the named F32 parameters of every model (DQN, PPO, TFT, MAMBA-2), the
//! spec's dot-separated names and shapes on the outside, possibly stacked tensors on the
//! inside, with strict loading and atomic saving.
//!
//! Loading is strict in both directions: a tensor the model needs and the file lacks, a
//! tensor the file has and the model does not know, and a tensor whose shape differs are
//! all errors that name the tensor and the file, so a file from the PyTorch reference
//! either loads exactly or not at all; nothing is written unless every check passes.
//! Registration order is the canonical order the optimiser, gradient clipping and soft
//! updates walk the parameters in.
//!
//! Per-variable blocks (the TFT's 55 embeddings and variable GRNs, its attention
//! heads) are held as one tensor stacked on a leading axis so that the forward pass is
//! one batched matmul instead of dozens of small ones, and the optimiser sees a few
//! large tensors. Loading, saving and gradient export split and join them under the
//! per-variable names, so files stay interchangeable with the PyTorch reference.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::Path;

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor, Var};
use candle_nn::VarMap;

use crate::error::{Context, Error, Result};

/// One parameter: its MODELS.md name and shape.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParamSpec {
    /// Dot-separated name, e.g. `trunk.0.weight`.
    pub name: String,
    /// Shape in PyTorch layout (`[out, in]` for a Linear weight).
    pub shape: Vec<usize>,
}

/// The `weight [o, i]` and `bias [o]` specs of a PyTorch `Linear(i→o)` named `prefix`.
pub(crate) fn linear_specs(prefix: &str, i: usize, o: usize) -> [ParamSpec; 2] {
    [
        ParamSpec { name: format!("{prefix}.weight"), shape: vec![o, i] },
        ParamSpec { name: format!("{prefix}.bias"), shape: vec![o] },
    ]
}

/// How a parameter is initialised when a model is built from scratch.
#[derive(Debug, Clone, Copy)]
pub enum Init {
    /// Uniform in `[-bound, bound]` (PyTorch's Linear / LSTM default with
    /// `bound = 1/sqrt(fan_in)`).
    Uniform(f64),
    /// Every element equal to the value (norm weights 1, biases 0, ...).
    Const(f64),
}

#[derive(Debug, Clone)]
enum Names {
    /// One spec name for the whole tensor.
    One(String),
    /// `names[i]` is slice `i` of the leading axis, of shape `part_shape`.
    Stacked { names: Vec<String>, part_shape: Vec<usize> },
}

#[derive(Debug, Clone)]
struct Entry {
    var: Var,
    names: Names,
}

/// The parameters of one model, in registration order.
#[derive(Debug, Clone)]
pub struct ParamStore {
    model: &'static str,
    seed: u64,
    /// The counter-based generator's stream of this store's initial values.
    init_stream: u64,
    device: Device,
    entries: Vec<Entry>,
}

/// Streams of the counter-based generator for weight initialisation, apart from the
/// environment's (0–3): the sequence models' and the RL agents' (kept distinct so each
/// model's initial weights stay what they have always been).
const INIT_STREAM: u64 = 0x5E0;
const AGENT_INIT_STREAM: u64 = 0x1417;

/// `n` uniform draws in `[0, 1)` for parameter `index` of a sequence-model store seeded
/// with `seed`: the same on every device and run.
pub(crate) fn init_uniform(seed: u64, index: u64, n: usize) -> Vec<f64> {
    uniform_draws(seed, INIT_STREAM, index, n)
}

fn uniform_draws(seed: u64, stream: u64, index: u64, n: usize) -> Vec<f64> {
    (0..n as u64).map(|j| fx_kernels::rng::draw(seed, stream, index, j)).collect()
}

fn init_tensor(
    shape: &[usize],
    init: Init,
    (seed, stream, index): (u64, u64, u64),
    device: &Device,
) -> candle_core::Result<Tensor> {
    match init {
        Init::Uniform(b) => {
            let n = shape.iter().product();
            let v: Vec<f32> =
                uniform_draws(seed, stream, index, n).iter().map(|u| ((2.0 * u - 1.0) * b) as f32).collect();
            Tensor::from_vec(v, shape, device)
        }
        Init::Const(v) => Tensor::ones(shape, DType::F32, device)? * v,
    }
}

impl ParamStore {
    /// An empty store for `model` (named in error messages) whose parameters will live
    /// on `device` (always F32: master weights; lower precision is a compute-time cast),
    /// initialised from the counter-based generator with `seed`.
    pub fn new(model: &'static str, device: &Device, seed: u64) -> Self {
        Self { model, seed, init_stream: INIT_STREAM, device: device.clone(), entries: Vec::new() }
    }

    /// The parameters of `specs` (PyTorch `Linear` weights and biases, in order), initialised
    /// as PyTorch's `Linear` does (uniform in ±1/√fan_in for weight and bias, `fan_in` = the
    /// weight's second dimension), drawn from the counter-based generator so the same `seed`
    /// gives the same weights on every device: the RL agents' networks.
    pub(crate) fn linear_init(model: &'static str, specs: Vec<ParamSpec>, device: &Device, seed: u64) -> Result<Self> {
        let mut store =
            Self { model, seed, init_stream: AGENT_INIT_STREAM, device: device.clone(), entries: Vec::new() };
        // fan_in of a bias is that of the weight of the same layer, which precedes it.
        let mut fan_in = 1usize;
        for spec in specs {
            if spec.shape.len() == 2 {
                fan_in = spec.shape[1];
            }
            let bound = 1.0 / (fan_in as f64).sqrt();
            store.add(spec.name, &spec.shape, Init::Uniform(bound)).ctx("ParamStore::linear_init")?;
        }
        Ok(store)
    }

    /// A population's parameters: every spec stacked over `seeds.len()` members as one tensor
    /// `[N, shape...]` whose slice `k` holds exactly what [`ParamStore::linear_init`] draws for
    /// seed `seeds[k]` (so member `k` starts where a solo run with that seed starts), its parts
    /// named `members.{k}.{spec name}`. [`ParamStore::member`] takes one member out.
    pub(crate) fn linear_init_population(
        model: &'static str,
        specs: Vec<ParamSpec>,
        device: &Device,
        seeds: &[u64],
    ) -> Result<Self> {
        const CTX: &str = "ParamStore::linear_init_population";
        if seeds.is_empty() {
            return Err(Error::config(CTX, "a population needs at least one member"));
        }
        let seed = seeds[0];
        let mut store =
            Self { model, seed, init_stream: AGENT_INIT_STREAM, device: device.clone(), entries: Vec::new() };
        let mut fan_in = 1usize;
        for (index, spec) in specs.into_iter().enumerate() {
            if spec.shape.len() == 2 {
                fan_in = spec.shape[1];
            }
            let bound = 1.0 / (fan_in as f64).sqrt();
            let n: usize = spec.shape.iter().product();
            let mut values = Vec::with_capacity(n * seeds.len());
            for &s in seeds {
                values.extend(
                    uniform_draws(s, AGENT_INIT_STREAM, index as u64, n)
                        .iter()
                        .map(|u| ((2.0 * u - 1.0) * bound) as f32),
                );
            }
            let mut shape = vec![seeds.len()];
            shape.extend_from_slice(&spec.shape);
            let var = Tensor::from_vec(values, shape, device).and_then(|t| Var::from_tensor(&t)).ctx(CTX)?;
            let names = (0..seeds.len()).map(|k| format!("{}{}", member_prefix(k), spec.name)).collect();
            store.entries.push(Entry { var, names: Names::Stacked { names, part_shape: spec.shape } });
        }
        Ok(store)
    }

    /// Member `k` of a population store ([`ParamStore::linear_init_population`]) as a solo
    /// store under the plain spec names: a copy of its current values with that member's seed,
    /// what a solo run of that member would hold (for its run folder, `eval`, resuming).
    pub fn member(&self, k: usize) -> Result<ParamStore> {
        const CTX: &str = "ParamStore::member";
        let prefix = member_prefix(k);
        let mut out = Self {
            model: self.model,
            seed: self.seed,
            init_stream: self.init_stream,
            device: self.device.clone(),
            entries: Vec::new(),
        };
        for e in &self.entries {
            let Names::Stacked { names, .. } = &e.names else {
                return Err(Error::config(CTX, format!("{} holds a parameter that is not a population's", self.model)));
            };
            let Some(name) = names.get(k).and_then(|n| n.strip_prefix(&prefix)) else {
                return Err(Error::config(CTX, format!("{} has no member {k} ({} members)", self.model, names.len())));
            };
            let var = e.var.as_tensor().get(k).and_then(|t| t.copy()).and_then(|t| Var::from_tensor(&t)).ctx(CTX)?;
            out.entries.push(Entry { var, names: Names::One(name.to_string()) });
        }
        Ok(out)
    }

    /// Overwrites member `k` of a population store with the values of the solo store `from`
    /// (same spec names and shapes): a member's start from a file, or a PBT exploit.
    pub fn set_member(&self, k: usize, from: &ParamStore) -> Result<()> {
        const CTX: &str = "ParamStore::set_member";
        let prefix = member_prefix(k);
        let values = from.to_tensors(&prefix)?;
        for e in &self.entries {
            let Names::Stacked { names, part_shape } = &e.names else {
                return Err(Error::config(CTX, format!("{} holds a parameter that is not a population's", self.model)));
            };
            let name = names.get(k).ok_or_else(|| Error::config(CTX, format!("no member {k} in {}", self.model)))?;
            let v = values.get(name).ok_or_else(|| Error::config(CTX, format!("{} lacks {name}", from.model)))?;
            if v.dims() != part_shape.as_slice() {
                return Err(Error::config(
                    CTX,
                    format!("{name}: shape {:?}, the population holds {part_shape:?}", v.dims()),
                ));
            }
            let all = e.var.as_tensor().detach();
            let slot = v.to_dtype(DType::F32).and_then(|v| v.unsqueeze(0)).ctx(CTX)?;
            let mut parts = Vec::with_capacity(3);
            if k > 0 {
                parts.push(all.narrow(0, 0, k).ctx(CTX)?);
            }
            parts.push(slot);
            if k + 1 < names.len() {
                parts.push(all.narrow(0, k + 1, names.len() - k - 1).ctx(CTX)?);
            }
            e.var.set(&Tensor::cat(&parts, 0).ctx(CTX)?).ctx(CTX)?;
        }
        Ok(())
    }

    /// Member `src`'s values of a population store written over member `dst`'s, in place on
    /// the device (a PBT exploit; the variables keep their addresses, so a captured step
    /// sees the copy).
    pub fn copy_member(&self, dst: usize, src: usize) -> Result<()> {
        const CTX: &str = "ParamStore::copy_member";
        for e in &self.entries {
            let Names::Stacked { names, .. } = &e.names else {
                return Err(Error::config(CTX, format!("{} holds a parameter that is not a population's", self.model)));
            };
            if dst >= names.len() || src >= names.len() {
                return Err(Error::config(CTX, format!("members {src} -> {dst} of {}", names.len())));
            }
            if dst != src {
                let t = e.var.as_tensor();
                t.slice_set(&t.narrow(0, src, 1).and_then(|r| r.copy()).ctx(CTX)?, 0, dst).ctx(CTX)?;
            }
        }
        Ok(())
    }

    /// A population store cut down to the members `keep` (strictly increasing indices), in
    /// that order: member `i` of the result is member `keep[i]` of this one, values copied
    /// exactly (successive halving drops the stopped members). The variables are new
    /// tensors, so a step captured over the old ones must be captured again.
    pub fn retain_members(&mut self, keep: &[usize]) -> Result<()> {
        const CTX: &str = "ParamStore::retain_members";
        let n = match self.entries.first().map(|e| &e.names) {
            Some(Names::Stacked { names, .. }) => names.len(),
            _ => return Err(Error::config(CTX, format!("{} is not a population's store", self.model))),
        };
        fx_precision::check_kept_members(keep, n).map_err(|m| Error::config(CTX, m))?;
        let idx = Tensor::from_vec(keep.iter().map(|&k| k as u32).collect(), keep.len(), &self.device).ctx(CTX)?;
        let mut entries = Vec::with_capacity(self.entries.len());
        for e in &self.entries {
            let Names::Stacked { names, part_shape } = &e.names else {
                return Err(Error::config(CTX, format!("{} holds a parameter that is not a population's", self.model)));
            };
            let names = keep
                .iter()
                .enumerate()
                .map(|(i, &k)| {
                    let plain = names[k].strip_prefix(&member_prefix(k)).unwrap_or(&names[k]);
                    format!("{}{plain}", member_prefix(i))
                })
                .collect();
            let var = e.var.as_tensor().index_select(&idx, 0).and_then(|t| Var::from_tensor(&t)).ctx(CTX)?;
            entries.push(Entry { var, names: Names::Stacked { names, part_shape: part_shape.clone() } });
        }
        self.entries = entries;
        Ok(())
    }

    /// The model's name (`"tft"`, `"mamba2"`), as error messages give it.
    pub fn model_name(&self) -> &'static str {
        self.model
    }

    /// The initialisation seed.
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// The number of internal tensors registered so far.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether no parameter is registered.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The device of the parameters.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Registers one parameter under `name`.
    pub fn add(&mut self, name: impl Into<String>, shape: &[usize], init: Init) -> candle_core::Result<Var> {
        let at = (self.seed, self.init_stream, self.entries.len() as u64);
        let var = Var::from_tensor(&init_tensor(shape, init, at, &self.device)?)?;
        self.entries.push(Entry { var: var.clone(), names: Names::One(name.into()) });
        Ok(var)
    }

    /// Registers `names.len()` parameters of shape `part_shape` held as one tensor
    /// `[names.len(), part_shape...]`.
    pub fn add_stacked(&mut self, names: Vec<String>, part_shape: &[usize], init: Init) -> candle_core::Result<Var> {
        let mut shape = vec![names.len()];
        shape.extend_from_slice(part_shape);
        let at = (self.seed, self.init_stream, self.entries.len() as u64);
        let var = Var::from_tensor(&init_tensor(&shape, init, at, &self.device)?)?;
        self.entries.push(Entry { var: var.clone(), names: Names::Stacked { names, part_shape: part_shape.to_vec() } });
        Ok(var)
    }

    /// The internal tensors (what an optimiser updates).
    pub fn vars(&self) -> Vec<Var> {
        self.entries.iter().map(|e| e.var.clone()).collect()
    }

    /// The internal tensors with a name each, for optimisers (state keys): a plain
    /// parameter under its spec name, a stacked one under its names' common pattern
    /// with the varying segment as `*` (`enc_vsn.vars.*.fc1.weight`).
    pub fn named_vars(&self) -> Vec<(String, Var)> {
        self.entries
            .iter()
            .map(|e| {
                let name = match &e.names {
                    Names::One(n) => n.clone(),
                    Names::Stacked { names, .. } => stacked_pattern(names),
                };
                (name, e.var.clone())
            })
            .collect()
    }

    /// The spec names of `var`'s parts: one name for a plain parameter, one per slice of
    /// the leading axis for a stacked one; None for a tensor of another store.
    pub fn part_names(&self, var: &Var) -> Option<Vec<String>> {
        self.entries.iter().find(|e| e.var.id() == var.id()).map(|e| match &e.names {
            Names::One(n) => vec![n.clone()],
            Names::Stacked { names, .. } => names.clone(),
        })
    }

    /// Spec names and shapes, in registration order.
    pub fn names_and_shapes(&self) -> Vec<(String, Vec<usize>)> {
        let mut out = Vec::new();
        for e in &self.entries {
            match &e.names {
                Names::One(n) => out.push((n.clone(), e.var.dims().to_vec())),
                Names::Stacked { names, part_shape } => {
                    out.extend(names.iter().map(|n| (n.clone(), part_shape.clone())))
                }
            }
        }
        out
    }

    /// Number of scalar parameters.
    pub fn param_count(&self) -> usize {
        self.entries.iter().map(|e| e.var.elem_count()).sum()
    }

    /// Sets every parameter from `tensors` (spec names), strictly: [`ParamStore::assign_from`]
    /// with no prefix.
    pub fn load_map(&self, tensors: &HashMap<String, Tensor>, source_desc: &str) -> Result<()> {
        self.assign_from(tensors, source_desc, "", true)
    }

    /// Overwrites every parameter from `tensors[prefix + name]` (spec names; a stacked
    /// parameter from its parts). A missing name, a wrong shape or an integer dtype is an
    /// error naming the tensor and `source`; when `strict`, so is a name under `prefix`
    /// that is not a parameter (otherwise such names are ignored: a fixture file holds
    /// inputs and gradients beside the weights). Values are cast to F32. Nothing is
    /// written unless every check passes, so a failed load leaves the model as it was.
    pub fn assign_from(
        &self,
        tensors: &HashMap<String, Tensor>,
        source: &str,
        prefix: &str,
        strict: bool,
    ) -> Result<()> {
        const CTX: &str = "ParamStore::assign_from";
        let model = self.model;
        let get = |name: &str, shape: &[usize]| -> Result<Tensor> {
            let key = format!("{prefix}{name}");
            let t = tensors.get(&key).ok_or_else(|| Error::MissingTensor {
                name: key.clone(),
                file: source.to_string(),
                model,
            })?;
            if t.dims() != shape {
                return Err(Error::TensorShape {
                    name: key,
                    file: source.to_string(),
                    expected: shape.to_vec(),
                    got: t.dims().to_vec(),
                });
            }
            if !t.dtype().is_float() {
                return Err(Error::TensorDType {
                    name: key,
                    file: source.to_string(),
                    expected: "a floating-point dtype",
                    got: format!("{:?}", t.dtype()),
                });
            }
            // A fresh copy: a Var cannot be set from a tensor sharing its storage.
            t.to_dtype(DType::F32).and_then(|t| t.to_device(&self.device)).and_then(|t| t.copy()).ctx(CTX)
        };
        if strict {
            let known: HashSet<String> = self.names_and_shapes().into_iter().map(|(n, _)| n).collect();
            let mut unknown: Vec<&String> =
                tensors.keys().filter(|k| k.strip_prefix(prefix).is_some_and(|n| !known.contains(n))).collect();
            unknown.sort();
            if let Some(name) = unknown.first() {
                return Err(Error::UnknownTensor { name: (*name).clone(), file: source.to_string(), model });
            }
        }
        let mut values = Vec::with_capacity(self.entries.len());
        for e in &self.entries {
            let v = match &e.names {
                Names::One(n) => get(n, e.var.dims())?,
                Names::Stacked { names, part_shape } => {
                    let parts = names.iter().map(|n| get(n, part_shape)).collect::<Result<Vec<_>>>()?;
                    Tensor::stack(&parts, 0).ctx(CTX)?
                }
            };
            values.push(v);
        }
        for (e, v) in self.entries.iter().zip(values) {
            e.var.set(&v).ctx(CTX)?;
        }
        Ok(())
    }

    /// Copies every value of `other` (same model, same names and shapes) into `self`.
    pub fn copy_from(&self, other: &ParamStore) -> Result<()> {
        self.assign_from(&other.to_tensors("")?, other.model, "", true)
    }

    /// Loads a safetensors file written by this crate or by the PyTorch reference
    /// (`torch`'s `state_dict()` saved with `safetensors`); strict (see
    /// [`ParamStore::assign_from`]).
    pub fn load(&self, path: &Path) -> Result<()> {
        let tensors = read_safetensors(path, &self.device)?;
        self.load_map(&tensors, &path.display().to_string())
    }

    /// The parameters as name → tensor under their spec names (stacked tensors split;
    /// copies of the current values, so later updates do not show through), each name
    /// prefixed with `prefix` (e.g. `"target."`, or `""`).
    pub fn to_tensors(&self, prefix: &str) -> Result<HashMap<String, Tensor>> {
        Ok(self.to_map()?.into_iter().map(|(n, t)| (format!("{prefix}{n}"), t)).collect())
    }

    /// Spec names and shapes of the parameters' parts, in registration order.
    pub fn specs(&self) -> Vec<ParamSpec> {
        self.names_and_shapes().into_iter().map(|(name, shape)| ParamSpec { name, shape }).collect()
    }

    /// The plain (unstacked) parameter called `name`.
    pub fn get(&self, name: &str) -> Option<&Var> {
        self.entries.iter().find(|e| matches!(&e.names, Names::One(n) if n == name)).map(|e| &e.var)
    }

    /// The internal tensor at registration index `i` (with gradient tracking).
    pub(crate) fn t(&self, i: usize) -> &Tensor {
        self.entries[i].var.as_tensor()
    }

    /// A candle `VarMap` over the same variables (shared storage) under the
    /// [`ParamStore::named_vars`] names, for candle's and fx-precision's VarMap-based APIs.
    pub fn varmap(&self) -> Result<VarMap> {
        let vm = VarMap::new();
        {
            let mut data = vm.data().lock().map_err(|_| Error::config("ParamStore::varmap", "VarMap lock poisoned"))?;
            for (name, var) in self.named_vars() {
                data.insert(name, var);
            }
        }
        Ok(vm)
    }

    /// The parameters under their spec names (stacked tensors split).
    pub fn to_map(&self) -> Result<BTreeMap<String, Tensor>> {
        let mut out = BTreeMap::new();
        for e in &self.entries {
            split_into(&mut out, &e.names, &e.var.as_tensor().detach().copy().ctx("ParamStore::to_map")?)
                .ctx("ParamStore::to_map")?;
        }
        Ok(out)
    }

    /// Writes the parameters to a safetensors file under their spec names.
    pub fn save(&self, path: &Path) -> Result<()> {
        write_safetensors(&self.to_tensors("")?, path)
    }

    /// Gradients under the spec names; a parameter the loss does not reach is absent.
    pub fn named_grads(&self, grads: &GradStore) -> Result<BTreeMap<String, Tensor>> {
        let mut out = BTreeMap::new();
        for e in &self.entries {
            if let Some(g) = grads.get(e.var.as_tensor()) {
                split_into(&mut out, &e.names, g).ctx("ParamStore::named_grads")?;
            }
        }
        Ok(out)
    }

    /// Gradients given in [`ParamStore::vars`] order (a fused step's), under the spec names.
    pub fn named_grads_in_order(&self, grads: &[Tensor]) -> Result<BTreeMap<String, Tensor>> {
        if grads.len() != self.entries.len() {
            let (want, got) = (self.entries.len(), grads.len());
            return Err(Error::shape("grads", "ParamStore::named_grads_in_order", want, got));
        }
        let mut out = BTreeMap::new();
        for (e, g) in self.entries.iter().zip(grads) {
            split_into(&mut out, &e.names, g).ctx("ParamStore::named_grads_in_order")?;
        }
        Ok(out)
    }
}

/// The name prefix of member `k`'s parameters in a population store.
fn member_prefix(k: usize) -> String {
    format!("members.{k}.")
}

fn stacked_pattern(names: &[String]) -> String {
    let first: Vec<&str> = names[0].split('.').collect();
    let mut pattern: Vec<String> = first.iter().map(|s| s.to_string()).collect();
    for n in &names[1..] {
        for (k, seg) in n.split('.').enumerate() {
            if k < pattern.len() && pattern[k] != seg {
                pattern[k] = "*".into();
            }
        }
    }
    pattern.join(".")
}

fn split_into(out: &mut BTreeMap<String, Tensor>, names: &Names, t: &Tensor) -> candle_core::Result<()> {
    match names {
        Names::One(n) => {
            out.insert(n.clone(), t.clone());
        }
        Names::Stacked { names, .. } => {
            for (i, n) in names.iter().enumerate() {
                out.insert(n.clone(), t.get(i)?);
            }
        }
    }
    Ok(())
}

/// Reads every tensor of a safetensors file onto `device`.
pub fn read_safetensors(path: &Path, device: &Device) -> Result<HashMap<String, Tensor>> {
    let io = |source| Error::Io { path: path.to_path_buf(), source };
    let file = fx_data::files::open_regular(path).map_err(io)?;
    // Mapped, as candle's own `safetensors::load` does, not read into a second copy first.
    // SAFETY: read-only; fx writes these files by rename, never in place.
    let bytes = unsafe { memmap2::Mmap::map(&file) }.map_err(io)?;
    candle_core::safetensors::load_buffer(&bytes, device)
        .map_err(|e| Error::SafeTensors { file: path.display().to_string(), message: e.to_string() })
}

/// Writes tensors to a safetensors file atomically (fx-precision's temporary file,
/// fsync and rename), names sorted, no metadata.
pub fn write_safetensors(tensors: &HashMap<String, Tensor>, path: &Path) -> Result<()> {
    fx_precision::save_tensors_atomic(path, tensors, &HashMap::new()).ctx("write_safetensors")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn store() -> ParamStore {
        let mut ps = ParamStore::new("test", &Device::Cpu, 7);
        ps.add("a.weight", &[2, 3], Init::Uniform(0.5)).unwrap();
        ps.add_stacked(vec!["e.0.w".into(), "e.1.w".into()], &[3, 1], Init::Const(0.0)).unwrap();
        ps
    }

    #[test]
    fn round_trip_and_errors() {
        let ps = store();
        let mut m: HashMap<String, Tensor> = ps.to_map().unwrap().into_iter().collect();
        let e1 = Tensor::new(&[[1f32], [2.], [3.]], &Device::Cpu).unwrap();
        m.insert("e.1.w".into(), e1.clone());
        ps.load_map(&m, "test").unwrap();
        let back = ps.to_map().unwrap();
        let d = (back["e.1.w"].clone() - e1).unwrap().abs().unwrap().sum_all().unwrap();
        assert_eq!(d.to_scalar::<f32>().unwrap(), 0.0);
        assert_eq!(ps.param_count(), 12);
        let names: Vec<String> = ps.named_vars().into_iter().map(|(n, _)| n).collect();
        assert_eq!(names, ["a.weight", "e.*.w"]);

        let mut bad = m.clone();
        bad.insert("zzz".into(), Tensor::zeros(1, DType::F32, &Device::Cpu).unwrap());
        assert!(matches!(ps.load_map(&bad, "t"), Err(Error::UnknownTensor { .. })));
        let mut bad = m.clone();
        bad.remove("e.0.w");
        assert!(matches!(ps.load_map(&bad, "t"), Err(Error::MissingTensor { .. })));
        let mut bad = m.clone();
        bad.insert("a.weight".into(), Tensor::zeros((3, 2), DType::F32, &Device::Cpu).unwrap());
        let err = ps.load_map(&bad, "t").unwrap_err();
        assert!(matches!(err, Error::TensorShape { .. }));
        assert!(err.to_string().contains("a.weight"));
    }

    #[test]
    fn prefixed_assignment_strictness_and_shared_views() {
        let ps = store();
        let mut m = ps.to_tensors("online.").unwrap();
        assert!(m.contains_key("online.a.weight") && m.contains_key("online.e.1.w"));
        let w = Tensor::new(&[[1f32, 2., 3.], [4., 5., 6.]], &Device::Cpu).unwrap();
        m.insert("online.a.weight".into(), w.clone());
        // Names outside the prefix are never this store's business, strict or not.
        m.insert("target.a.weight".into(), Tensor::zeros(1, DType::F32, &Device::Cpu).unwrap());
        ps.assign_from(&m, "t", "online.", true).unwrap();
        let got: Vec<Vec<f32>> = ps.get("a.weight").unwrap().as_tensor().to_vec2().unwrap();
        assert_eq!(got, vec![vec![1., 2., 3.], vec![4., 5., 6.]]);
        m.insert("online.extra".into(), Tensor::zeros(1, DType::F32, &Device::Cpu).unwrap());
        assert!(matches!(ps.assign_from(&m, "t", "online.", true), Err(Error::UnknownTensor { .. })));
        ps.assign_from(&m, "t", "online.", false).unwrap();
        // A stacked part is not a plain parameter; the VarMap view shares the storage.
        assert!(ps.get("e.0.w").is_none());
        let vm = ps.varmap().unwrap();
        let var = vm.data().lock().unwrap()["a.weight"].clone();
        var.set(&Tensor::zeros((2, 3), DType::F32, &Device::Cpu).unwrap()).unwrap();
        let sum = ps.get("a.weight").unwrap().as_tensor().sum_all().unwrap().to_scalar::<f32>().unwrap();
        assert_eq!(sum, 0.0);
        let other = store();
        other.copy_from(&ps).unwrap();
        assert_eq!(other.to_tensors("").unwrap()["e.1.w"].to_vec2::<f32>().unwrap(), vec![vec![0.0f32]; 3]);
    }

    #[test]
    fn save_load_file() {
        let ps = store();
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("x.safetensors");
        ps.save(&p).unwrap();
        let ps2 = store();
        ps2.load(&p).unwrap();
        let a = ps.to_map().unwrap();
        let b = ps2.to_map().unwrap();
        for (k, v) in &a {
            let d = (v - &b[k]).unwrap().abs().unwrap().sum_all().unwrap();
            assert_eq!(d.to_scalar::<f32>().unwrap(), 0.0, "{k}");
        }
    }
}
