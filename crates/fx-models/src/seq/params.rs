//! Named parameters of the sequence models: the spec's dot-separated names and
//! shapes on the outside, possibly stacked tensors on the inside.
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

use crate::error::{Context, Error, Result};

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
    device: Device,
    entries: Vec<Entry>,
}

/// Stream of the counter-based generator for weight initialisation (the environment
/// uses streams 0–3, the RL nets 0x1417).
const INIT_STREAM: u64 = 0x5E0;

/// `n` uniform draws in `[0, 1)` for parameter `index` of a store seeded with `seed`:
/// the same on every device and run.
pub(crate) fn init_uniform(seed: u64, index: u64, n: usize) -> Vec<f64> {
    (0..n as u64).map(|j| fx_kernels::rng::draw(seed, INIT_STREAM, index, j)).collect()
}

fn init_tensor(shape: &[usize], init: Init, seed: u64, index: u64, device: &Device) -> candle_core::Result<Tensor> {
    match init {
        Init::Uniform(b) => {
            let n = shape.iter().product();
            let v: Vec<f32> = init_uniform(seed, index, n).iter().map(|u| ((2.0 * u - 1.0) * b) as f32).collect();
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
        Self { model, seed, device: device.clone(), entries: Vec::new() }
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
        let var = Var::from_tensor(&init_tensor(shape, init, self.seed, self.entries.len() as u64, &self.device)?)?;
        self.entries.push(Entry { var: var.clone(), names: Names::One(name.into()) });
        Ok(var)
    }

    /// Registers `names.len()` parameters of shape `part_shape` held as one tensor
    /// `[names.len(), part_shape...]`.
    pub fn add_stacked(&mut self, names: Vec<String>, part_shape: &[usize], init: Init) -> candle_core::Result<Var> {
        let mut shape = vec![names.len()];
        shape.extend_from_slice(part_shape);
        let var = Var::from_tensor(&init_tensor(&shape, init, self.seed, self.entries.len() as u64, &self.device)?)?;
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

    /// Sets every parameter from `tensors` (spec names). Every parameter must be
    /// present with its exact shape and no other name may appear; `source_desc` names
    /// the origin in error messages. Values are cast to F32.
    pub fn load_map(&self, tensors: &HashMap<String, Tensor>, source_desc: &str) -> Result<()> {
        const CTX: &str = "ParamStore::load_map";
        let model = self.model;
        let get = |name: &str, shape: &[usize]| -> Result<Tensor> {
            let t = tensors.get(name).ok_or_else(|| Error::MissingTensor {
                name: name.to_string(),
                file: source_desc.to_string(),
                model,
            })?;
            if t.dims() != shape {
                return Err(Error::TensorShape {
                    name: name.to_string(),
                    file: source_desc.to_string(),
                    expected: shape.to_vec(),
                    got: t.dims().to_vec(),
                });
            }
            if !t.dtype().is_float() {
                return Err(Error::TensorDType {
                    name: name.to_string(),
                    file: source_desc.to_string(),
                    expected: "a floating-point dtype",
                    got: format!("{:?}", t.dtype()),
                });
            }
            // A fresh copy: a Var cannot be set from a tensor sharing its storage.
            t.to_dtype(DType::F32).and_then(|t| t.to_device(&self.device)).and_then(|t| t.copy()).ctx(CTX)
        };
        let known: HashSet<String> = self.names_and_shapes().into_iter().map(|(n, _)| n).collect();
        let mut unknown: Vec<&String> = tensors.keys().filter(|k| !known.contains(*k)).collect();
        unknown.sort();
        if let Some(name) = unknown.first() {
            return Err(Error::UnknownTensor { name: (*name).clone(), file: source_desc.to_string(), model });
        }
        // Check everything before touching any parameter, so a failed load leaves the
        // model as it was.
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

    /// Loads a safetensors file written by this crate or by the reference.
    pub fn load(&self, path: &Path) -> Result<()> {
        let tensors = candle_core::safetensors::load(path, &Device::Cpu)
            .map_err(|e| Error::SafeTensors { file: path.display().to_string(), message: e.to_string() })?;
        self.load_map(&tensors, &path.display().to_string())
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
        let map: HashMap<String, Tensor> = self.to_map()?.into_iter().collect();
        fx_precision::save_tensors_atomic(path, &map, &HashMap::new()).ctx("ParamStore::save")
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
