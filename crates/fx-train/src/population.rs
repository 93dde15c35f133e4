//! Population members as what a backtest replays: member `k`'s weights loaded into a solo
//! network on the CPU and its greedy [`CpuPolicy`] (a sweep scores its trials with them, a
//! population study backtests its runs with them).

use anyhow::Result;
use candle_core::Device;
use fx_models::mlp::cpu::CpuPolicy;
use fx_models::{ActorCritic, DqnPopulation, DuelingDqn, PpoPopulation};

/// DQN member `k`'s online network on the CPU.
pub fn dqn_member_net(pop: &DqnPopulation, k: usize) -> Result<DuelingDqn> {
    let cfg = &pop.members()[k];
    let net = DuelingDqn::new(cfg.net, &Device::Cpu, cfg.seed)?;
    net.params().load_map(&on_cpu(pop.online().member(k)?)?, &format!("population member {k}"))?;
    Ok(net)
}

/// PPO member `k`'s actor-critic on the CPU.
pub fn ppo_member_net(pop: &PpoPopulation, k: usize) -> Result<ActorCritic> {
    let cfg = &pop.members()[k];
    let net = ActorCritic::new(cfg.net, &Device::Cpu, cfg.seed)?;
    net.params().load_map(&on_cpu(pop.params().member(k)?)?, &format!("population member {k}"))?;
    Ok(net)
}

/// The greedy policy of DQN member `k`'s online weights on the CPU.
pub fn dqn_member_policy(pop: &DqnPopulation, k: usize) -> Result<CpuPolicy> {
    Ok(dqn_member_net(pop, k)?.cpu_policy()?)
}

/// The actor's greedy policy of PPO member `k`'s weights on the CPU.
pub fn ppo_member_policy(pop: &PpoPopulation, k: usize) -> Result<CpuPolicy> {
    Ok(ppo_member_net(pop, k)?.cpu_policy()?)
}

/// A member's parameters by spec name, on the CPU.
fn on_cpu(store: fx_models::ParamStore) -> Result<std::collections::HashMap<String, candle_core::Tensor>> {
    let mut map = std::collections::HashMap::new();
    for (name, t) in store.to_tensors("")? {
        map.insert(name, t.to_device(&Device::Cpu)?);
    }
    Ok(map)
}
