//! Named parameter sets with the spec's names and shapes, and their strict
//! safetensors load/save.
//!
//! A [`ParamSet`] owns the trainable variables of one network in a candle [`VarMap`]
//! (so candle's `VarBuilder` machinery can see them) plus the canonical order of the
//! names, which fixes the order the optimiser, gradient clipping and soft updates walk
//! the parameters in. Loading is strict in both directions: a tensor the model needs
//! and the file lacks, a tensor the file has and the model does not know, and a tensor
//! whose shape differs are all errors that name the tensor and the file, so a file
//! from the PyTorch reference either loads exactly or not at all.

use std::collections::HashMap;
use std::path::Path;

use candle_core::{DType, Device, Tensor, Var};
use candle_nn::VarMap;

use crate::error::{Context, Error, Result};

/// The stream of the counter-based generator used for weight initialisation (the env
/// uses streams 0–3; keeping init apart makes a model's weights independent of them).
const INIT_STREAM: u64 = 0x1417;

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

/// The trainable F32 variables of one network, under their spec names.
pub struct ParamSet {
    model: &'static str,
    specs: Vec<ParamSpec>,
    vars: Vec<Var>,
    varmap: VarMap,
    device: Device,
}

impl std::fmt::Debug for ParamSet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ParamSet")
            .field("model", &self.model)
            .field("params", &self.specs.len())
            .field("elements", &self.num_elements())
            .finish()
    }
}

impl ParamSet {
    /// Creates the variables of `specs` on `device`, initialised as PyTorch's `Linear`
    /// does (uniform in ±1/√fan_in for weight and bias, `fan_in` = the weight's second
    /// dimension), drawn from the counter-based generator so the same `seed` gives the
    /// same weights on every device.
    pub(crate) fn new_linear_init(
        model: &'static str,
        specs: Vec<ParamSpec>,
        device: &Device,
        seed: u64,
    ) -> Result<Self> {
        const CTX: &str = "ParamSet::new_linear_init";
        let varmap = VarMap::new();
        let mut vars = Vec::with_capacity(specs.len());
        // fan_in of a bias is that of the weight of the same layer, which precedes it.
        let mut fan_in = 1usize;
        for (k, spec) in specs.iter().enumerate() {
            if spec.shape.len() == 2 {
                fan_in = spec.shape[1];
            }
            let bound = 1.0 / (fan_in as f64).sqrt();
            let n: usize = spec.shape.iter().product();
            let data: Vec<f32> = (0..n as u64)
                .map(|j| {
                    let u = fx_kernels::rng::draw(seed, INIT_STREAM, k as u64, j);
                    ((2.0 * u - 1.0) * bound) as f32
                })
                .collect();
            let t = Tensor::from_vec(data, spec.shape.as_slice(), device).ctx(CTX)?;
            let var = Var::from_tensor(&t).ctx(CTX)?;
            varmap
                .data()
                .lock()
                .map_err(|_| Error::config(CTX, "VarMap lock poisoned"))?
                .insert(spec.name.clone(), var.clone());
            vars.push(var);
        }
        Ok(Self { model, specs, vars, varmap, device: device.clone() })
    }

    /// The model name used in error messages (`dqn`, `ppo`).
    pub fn model(&self) -> &'static str {
        self.model
    }

    /// Parameter specs in canonical (spec) order.
    pub fn specs(&self) -> &[ParamSpec] {
        &self.specs
    }

    /// The variables, in the order of [`ParamSet::specs`].
    pub fn vars(&self) -> &[Var] {
        &self.vars
    }

    /// The candle `VarMap` holding the same variables.
    pub fn varmap(&self) -> &VarMap {
        &self.varmap
    }

    /// The device the variables live on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The variable called `name`.
    pub fn get(&self, name: &str) -> Option<&Var> {
        self.specs.iter().position(|s| s.name == name).map(|i| &self.vars[i])
    }

    /// The variable at canonical index `i` as a tensor (with gradient tracking).
    pub(crate) fn t(&self, i: usize) -> &Tensor {
        self.vars[i].as_tensor()
    }

    /// Total number of scalar parameters.
    pub fn num_elements(&self) -> usize {
        self.specs.iter().map(|s| s.shape.iter().product::<usize>()).sum()
    }

    /// The parameters as name → tensor (copies of the current values, so later
    /// updates do not show through), each name prefixed with `prefix` (e.g.
    /// `"target."`, or `""`).
    pub fn to_tensors(&self, prefix: &str) -> Result<HashMap<String, Tensor>> {
        self.specs
            .iter()
            .zip(&self.vars)
            .map(|(s, v)| {
                let t = v.as_tensor().detach().copy().ctx("ParamSet::to_tensors")?;
                Ok((format!("{prefix}{}", s.name), t))
            })
            .collect()
    }

    /// Overwrites every variable from `tensors[prefix + name]`.
    ///
    /// Missing names and wrong shapes are errors naming the tensor and `source`. When
    /// `strict`, a name under `prefix` that is not a parameter is an error too
    /// (`UnknownTensor`); otherwise such names are ignored (a fixture file holds inputs
    /// and gradients beside the weights). Floating dtypes other than F32 are converted;
    /// integer tensors are refused. Nothing is written unless every check passes.
    pub fn assign_from(
        &self,
        tensors: &HashMap<String, Tensor>,
        source: &str,
        prefix: &str,
        strict: bool,
    ) -> Result<()> {
        const CTX: &str = "ParamSet::assign_from";
        if strict {
            let mut unknown: Vec<&String> = tensors
                .keys()
                .filter(|k| k.strip_prefix(prefix).is_some_and(|n| !self.specs.iter().any(|s| s.name == n)))
                .collect();
            unknown.sort();
            if let Some(name) = unknown.first() {
                return Err(Error::UnknownTensor {
                    name: (*name).clone(),
                    file: source.to_string(),
                    model: self.model,
                });
            }
        }
        let mut values = Vec::with_capacity(self.specs.len());
        for spec in &self.specs {
            let key = format!("{prefix}{}", spec.name);
            let t = tensors.get(&key).ok_or_else(|| Error::MissingTensor {
                name: key.clone(),
                file: source.to_string(),
                model: self.model,
            })?;
            if t.dims() != spec.shape.as_slice() {
                return Err(Error::TensorShape {
                    name: key,
                    file: source.to_string(),
                    expected: spec.shape.clone(),
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
            values.push(t.to_dtype(DType::F32).and_then(|t| t.to_device(&self.device)).ctx(CTX)?);
        }
        for (var, value) in self.vars.iter().zip(values) {
            var.set(&value).ctx(CTX)?;
        }
        Ok(())
    }

    /// Copies every value of `other` (same model, same shapes) into `self`.
    pub fn copy_from(&self, other: &ParamSet) -> Result<()> {
        self.assign_from(&other.to_tensors("")?, other.model, "", true)
    }

    /// Loads a safetensors file written by this crate or by the PyTorch reference
    /// (`torch`'s `state_dict()` saved with `safetensors`); strict (see
    /// [`ParamSet::assign_from`]).
    pub fn load(&self, path: &Path) -> Result<()> {
        let tensors = read_safetensors(path, &self.device)?;
        self.assign_from(&tensors, &path.display().to_string(), "", true)
    }

    /// Saves the parameters as F32 under their spec names (atomically: a temporary
    /// file synced and renamed into place, so a crash never leaves a truncated file).
    pub fn save(&self, path: &Path) -> Result<()> {
        write_safetensors(&self.to_tensors("")?, path)
    }
}

/// Reads every tensor of a safetensors file onto `device`.
pub fn read_safetensors(path: &Path, device: &Device) -> Result<HashMap<String, Tensor>> {
    if !path.exists() {
        return Err(Error::Io {
            path: path.to_path_buf(),
            source: std::io::Error::new(std::io::ErrorKind::NotFound, "file not found"),
        });
    }
    candle_core::safetensors::load(path, device)
        .map_err(|e| Error::SafeTensors { file: path.display().to_string(), message: e.to_string() })
}

/// Writes tensors to a safetensors file atomically (fx-precision's temporary file,
/// fsync and rename), names sorted, no metadata.
pub fn write_safetensors(tensors: &HashMap<String, Tensor>, path: &Path) -> Result<()> {
    fx_precision::save_tensors_atomic(path, tensors, &HashMap::new()).ctx("write_safetensors")
}
