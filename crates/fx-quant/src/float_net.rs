//! The F32 greedy networks on the host, under the spec's layer names: the DQN (`trunk.0..2`
//! with ReLU, dueling `value` / `advantage` head) and the PPO actor (`actor.0..1` with
//! tanh, `actor.head` logits). [`FloatNet`] is what gets quantised; its f64 forward is the
//! accuracy reference and the calibration pass (it shows each layer its input).

use candle_core::{DType, Device, Tensor};
use fx_models::{ActorCritic, DuelingDqn};

use crate::error::{first_non_finite, Error, Result};

/// Which policy network.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PolicyKind {
    /// The dueling DQN: three ReLU layers, then `Q = value + advantage − mean(advantage)`.
    Dqn,
    /// The PPO actor: two tanh layers, then logits.
    Ppo,
}

impl PolicyKind {
    /// `dqn` / `ppo` (the checkpoint's `model` metadata).
    pub fn as_str(self) -> &'static str {
        match self {
            PolicyKind::Dqn => "dqn",
            PolicyKind::Ppo => "ppo",
        }
    }

    /// The inverse of [`PolicyKind::as_str`].
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "dqn" => Some(PolicyKind::Dqn),
            "ppo" => Some(PolicyKind::Ppo),
            _ => None,
        }
    }

    /// The Linear layers in forward order (MODELS.md names); the last one or two are the head.
    pub fn layer_names(self) -> &'static [&'static str] {
        match self {
            PolicyKind::Dqn => &["trunk.0", "trunk.1", "trunk.2", "value", "advantage"],
            PolicyKind::Ppo => &["actor.0", "actor.1", "actor.head"],
        }
    }

    /// How many of [`PolicyKind::layer_names`] are hidden (activated) layers.
    pub fn hidden_layers(self) -> usize {
        match self {
            PolicyKind::Dqn => 3,
            PolicyKind::Ppo => 2,
        }
    }

    /// The hidden layers' activation.
    pub fn activation(self) -> fx_models::mlp::reference::Activation {
        match self {
            PolicyKind::Dqn => fx_models::mlp::reference::Activation::Relu,
            PolicyKind::Ppo => fx_models::mlp::reference::Activation::Tanh,
        }
    }

    /// A dueling head (`value`, `advantage`) rather than one logits layer.
    pub fn dueling(self) -> bool {
        self == PolicyKind::Dqn
    }
}

/// One F32 Linear on the host: `weight [out, inp]` row-major, `bias [out]`.
#[derive(Debug, Clone, PartialEq)]
pub struct FloatLayer {
    /// Spec name without `.weight` (e.g. `trunk.0`).
    pub name: String,
    /// Output width.
    pub out: usize,
    /// Input width.
    pub inp: usize,
    /// `out × inp` values.
    pub weight: Vec<f32>,
    /// `out` values.
    pub bias: Vec<f32>,
}

/// A greedy policy network in F32 on the host.
#[derive(Debug, Clone, PartialEq)]
pub struct FloatNet {
    /// Which network.
    pub kind: PolicyKind,
    /// The layers in [`PolicyKind::layer_names`] order.
    pub layers: Vec<FloatLayer>,
}

fn host(t: &Tensor, name: &str) -> Result<Vec<f32>> {
    t.to_device(&Device::Cpu)
        .and_then(|t| t.to_dtype(DType::F32))
        .and_then(|t| t.flatten_all())
        .and_then(|t| t.to_vec1())
        .map_err(|source| Error::Candle { context: format!("copying {name} to the host"), source })
}

impl FloatNet {
    /// The online network of a DQN (a snapshot of its current weights).
    pub fn from_dqn(net: &DuelingDqn) -> Result<Self> {
        Self::from_params(PolicyKind::Dqn, net.params())
    }

    /// The actor of a PPO actor-critic (a snapshot of its current weights).
    pub fn from_ppo(net: &ActorCritic) -> Result<Self> {
        Self::from_params(PolicyKind::Ppo, net.params())
    }

    fn from_params(kind: PolicyKind, params: &fx_models::ParamStore) -> Result<Self> {
        let mut layers = Vec::new();
        for name in kind.layer_names() {
            let get = |suffix: &str| {
                let full = format!("{name}.{suffix}");
                let var = params.get(&full).ok_or_else(|| {
                    Error::invalid("network", format!("{} parameters lack {full}", params.model_name()))
                })?;
                Ok::<_, Error>((host(var.as_tensor(), &full)?, var.as_tensor().dims().to_vec()))
            };
            let (weight, wdims) = get("weight")?;
            let (bias, _) = get("bias")?;
            let [out, inp] = wdims[..] else {
                return Err(Error::invalid("network", format!("{name}.weight has shape {wdims:?}, not [out, in]")));
            };
            layers.push(FloatLayer { name: name.to_string(), out, inp, weight, bias });
        }
        let net = Self { kind, layers };
        net.check()?;
        Ok(net)
    }

    /// Shapes chain (each hidden layer's input is the previous output, the head layers
    /// read the last hidden output, a dueling value has one output, at least two actions)
    /// and every value is finite.
    pub fn check(&self) -> Result<()> {
        check_chain(self.kind, self.layers.iter().map(|l| (l.name.as_str(), l.out, l.inp)))?;
        self.layers.iter().try_for_each(check_layer_values)
    }

    /// Input width (`state_dim`).
    pub fn state_dim(&self) -> usize {
        self.layers[0].inp
    }

    /// Number of actions.
    pub fn n_actions(&self) -> usize {
        self.layers.last().map_or(0, |l| l.out)
    }

    /// Number of weights and biases.
    pub fn num_params(&self) -> usize {
        self.layers.iter().map(|l| l.weight.len() + l.bias.len()).sum()
    }

    /// The scores (Q values or logits) in f64 for one observation; `observe(layer, input)`
    /// sees every layer's input (both head layers see the same one).
    pub fn forward_f64(&self, obs: &[f32], mut observe: impl FnMut(usize, &[f64])) -> Vec<f64> {
        let dense = |l: &FloatLayer, x: &[f64]| -> Vec<f64> {
            l.weight
                .chunks_exact(l.inp)
                .zip(&l.bias)
                .map(|(row, b)| row.iter().zip(x).map(|(w, x)| *w as f64 * x).sum::<f64>() + *b as f64)
                .collect()
        };
        let nh = self.kind.hidden_layers();
        let mut z: Vec<f64> = obs.iter().map(|&v| v as f64).collect();
        for (i, l) in self.layers[..nh].iter().enumerate() {
            observe(i, &z);
            z = dense(l, &z);
            for v in &mut z {
                *v = match self.kind.activation() {
                    fx_models::mlp::reference::Activation::Relu => v.max(0.0),
                    fx_models::mlp::reference::Activation::Tanh => v.tanh(),
                    fx_models::mlp::reference::Activation::Identity => *v,
                };
            }
        }
        for i in nh..self.layers.len() {
            observe(i, &z);
        }
        if self.kind.dueling() {
            let v = dense(&self.layers[nh], &z)[0];
            let a = dense(&self.layers[nh + 1], &z);
            let mean = a.iter().sum::<f64>() / a.len() as f64;
            a.iter().map(|a| (a - mean) + v).collect()
        } else {
            dense(&self.layers[nh], &z)
        }
    }
}

/// One layer's lengths match its dimensions and every value is finite.
pub(crate) fn check_layer_values(l: &FloatLayer) -> Result<()> {
    if l.weight.len() != l.out * l.inp || l.bias.len() != l.out {
        return Err(Error::invalid(
            "network",
            format!("{}: {} weights and {} biases for [{}, {}]", l.name, l.weight.len(), l.bias.len(), l.out, l.inp),
        ));
    }
    for (what, v) in [("weight", &l.weight), ("bias", &l.bias)] {
        if let Some((index, value)) = first_non_finite(v) {
            return Err(Error::NonFinite {
                what: format!("{}.{what}", l.name),
                index,
                value: value as f64,
                context: "FloatNet::check",
            });
        }
    }
    Ok(())
}

/// Checks that `(name, out, inp)` layers form `kind`'s network (names, chaining, head).
pub(crate) fn check_chain<'a>(kind: PolicyKind, layers: impl Iterator<Item = (&'a str, usize, usize)>) -> Result<()> {
    let layers: Vec<_> = layers.collect();
    let names: Vec<&str> = layers.iter().map(|l| l.0).collect();
    if names != kind.layer_names() {
        return Err(Error::invalid(
            "network",
            format!("{} layers are {:?}, found {names:?}", kind.as_str(), kind.layer_names()),
        ));
    }
    let nh = kind.hidden_layers();
    let mut width = layers[0].2;
    for (i, &(name, out, inp)) in layers.iter().enumerate() {
        if out == 0 || inp == 0 || inp != width {
            return Err(Error::invalid("network", format!("{name} is [{out}, {inp}], its input must be {width} wide")));
        }
        if i < nh {
            width = out;
        }
    }
    let last = layers[layers.len() - 1];
    if kind.dueling() && layers[nh].1 != 1 {
        return Err(Error::invalid("network", format!("value has {} outputs, not 1", layers[nh].1)));
    }
    if last.1 < 2 {
        return Err(Error::invalid(
            "network",
            format!("{} has {} outputs: a policy needs at least 2 actions", last.0, last.1),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use fx_models::{DqnNetConfig, PpoNetConfig};

    /// The f64 forward equals the F32 `CpuPolicy` the models build (same weights, same
    /// architecture), so the names and activations here describe the real networks.
    #[test]
    fn f64_forward_matches_the_models_cpu_policy() {
        let dqn = DuelingDqn::new(DqnNetConfig::default(), &Device::Cpu, 3).unwrap();
        let ppo = ActorCritic::new(PpoNetConfig::default(), &Device::Cpu, 4).unwrap();
        let nets = [
            (FloatNet::from_dqn(&dqn).unwrap(), dqn.cpu_policy().unwrap()),
            (FloatNet::from_ppo(&ppo).unwrap(), ppo.cpu_policy().unwrap()),
        ];
        for (net, mut cpu) in nets {
            for r in 0..20u64 {
                let obs: Vec<f32> =
                    (0..56u64).map(|i| (fx_kernels::rng::draw(9, 1, r, i) * 4.0 - 2.0) as f32).collect();
                let mut seen = 0;
                let s = net.forward_f64(&obs, |_, x| {
                    seen += 1;
                    assert!(x.len() == 56 || x.len() >= 128);
                });
                assert_eq!(seen, net.layers.len());
                cpu.act(&obs).unwrap();
                for (a, b) in s.iter().zip(cpu.scores()) {
                    assert!((a - *b as f64).abs() < 1e-4, "{:?}: {a} vs {b}", net.kind);
                }
            }
        }
    }

    #[test]
    fn bad_chains_are_refused() {
        assert!(check_chain(PolicyKind::Ppo, [("actor.0", 8, 4), ("actor.1", 8, 8), ("actor.head", 3, 8)].into_iter())
            .is_ok());
        let e = check_chain(PolicyKind::Ppo, [("actor.0", 8, 4), ("actor.1", 8, 7), ("actor.head", 3, 8)].into_iter())
            .unwrap_err();
        assert!(e.to_string().contains("actor.1"), "{e}");
        let e = check_chain(PolicyKind::Ppo, [("actor.0", 8, 4), ("actor.head", 3, 8)].into_iter()).unwrap_err();
        assert!(e.to_string().contains("layers are"), "{e}");
        let dq = [("trunk.0", 8, 4), ("trunk.1", 8, 8), ("trunk.2", 4, 8), ("value", 2, 4), ("advantage", 3, 4)];
        assert!(check_chain(PolicyKind::Dqn, dq.into_iter()).unwrap_err().to_string().contains("value"));
    }
}
