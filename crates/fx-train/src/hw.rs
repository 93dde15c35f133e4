//! `fx-train hw`: the hardware budget as a table or JSON.

use anyhow::Result;
use fx_hw::{DeviceKind, HardwareBudget, ModelKind, Overrides, Sourced};

use crate::cli::HwArgs;

pub fn run(args: &HwArgs) -> Result<()> {
    let mut flags = Overrides::default();
    if let Some(d) = &args.device {
        flags = flags.try_with_device(d)?;
    }
    if let Some(p) = args.precision {
        flags = flags.with_precision(p);
    }
    if let Some(b) = args.batch_size {
        flags = flags.with_batch_size(b);
    }
    let overrides = Overrides::from_env()?.layered(flags);
    #[allow(unused_mut)]
    let mut budget = HardwareBudget::detect_with(&overrides);
    #[allow(unused_mut)]
    let mut probe_note: Option<String> = None;
    #[cfg(feature = "cuda")]
    if !args.no_probe {
        if let DeviceKind::Cuda(ordinal) = budget.device.value {
            match probe::mlp_cost(ordinal, budget.precision.value) {
                Ok(cost) => budget.set_measured_cost(ModelKind::Dqn, cost),
                Err(e) => probe_note = Some(format!("probe failed: {e}")),
            }
        }
    }
    // CPU threads a training run would use (after FX_THREADS): one for the RL agents'
    // small networks, every CPU this process may use (affinity, cgroup quota) otherwise.
    let (rl, seq) = (fx_hw::cpu_threads(None, true)?, fx_hw::cpu_threads(None, false)?);
    if args.json {
        let mut v = serde_json::to_value(&budget)?;
        v["cpu_threads"] =
            serde_json::json!({ "usable_cpus": fx_hw::usable_cpus(), "rl_agents": rl, "sequence_models": seq });
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        let mut out = table(&budget, probe_note.as_deref());
        row(&mut out, "cpu threads dqn/ppo", rl.value, &rl.source.to_string());
        row(&mut out, "cpu threads tft/mamba2", seq.value, &seq.source.to_string());
        print!("{out}");
    }
    Ok(())
}

fn gib(bytes: u64) -> String {
    format!("{:.1} GiB", bytes as f64 / (1u64 << 30) as f64)
}

fn row(out: &mut String, key: &str, value: impl std::fmt::Display, source: &str) {
    out.push_str(&format!("{key:<22} {:<40} {source}\n", value.to_string()));
}

fn sourced<T: std::fmt::Display>(out: &mut String, key: &str, s: &Sourced<T>) {
    row(out, key, &s.value, &s.source.to_string());
}

fn table(b: &HardwareBudget, probe_note: Option<&str>) -> String {
    let mut out = String::new();
    row(&mut out, "item", "value", "source");
    let device = match b.device.value {
        DeviceKind::Cpu => "cpu".to_string(),
        DeviceKind::Cuda(n) => format!("cuda:{n}"),
    };
    row(&mut out, "device", device, &b.device.source.to_string());
    if let Some(reason) = &b.cpu_fallback_reason {
        row(&mut out, "cpu because", reason, "detected");
    }
    if let Some(g) = &b.gpu {
        row(&mut out, "gpu", &g.name, "detected");
        row(&mut out, "gpu memory total", gib(g.total_memory_bytes), "detected");
        row(&mut out, "gpu memory free", gib(g.free_memory_bytes), "detected");
        row(&mut out, "SMs", g.sm_count, "detected");
        row(
            &mut out,
            "compute capability",
            format!("{}.{}", g.compute_capability.0, g.compute_capability.1),
            "detected",
        );
        row(&mut out, "L2 cache", format!("{} MiB", g.l2_cache_bytes >> 20), "detected");
    }
    row(&mut out, "cpu cores", b.host.cpu_cores, "detected");
    if let Some(ram) = b.host.ram_total_bytes {
        row(&mut out, "ram total", gib(ram), "detected");
    }
    sourced(&mut out, "precision", &b.precision);
    for m in ModelKind::ALL {
        let cost = &b.costs[&m];
        row(
            &mut out,
            &format!("{} bytes/sample", m.as_str()),
            format!("{} B (+{} MiB fixed)", cost.value.bytes_per_sample, cost.value.overhead_bytes >> 20),
            &cost.source.to_string(),
        );
        sourced(&mut out, &format!("{} batch", m.as_str()), &b.batch_size(m));
    }
    if let Some(note) = probe_note {
        row(&mut out, "probe", note, "");
    }
    out
}

#[cfg(feature = "cuda")]
mod probe {
    //! The memory probe's workload: one training step of a DQN-shaped MLP
    //! (56→256→256→128→3) on the GPU, forward, MSE loss and backward.

    use candle_core::{DType, Tensor};
    use fx_hw::{CostModel, Precision};

    pub fn mlp_cost(ordinal: usize, precision: Precision) -> anyhow::Result<CostModel> {
        let device = fx_hw::open_cuda(ordinal)?;
        let dtype = match precision {
            Precision::F32 => DType::F32,
            Precision::Bf16 => DType::BF16,
            Precision::F16 => DType::F16,
        };
        let dims = [56usize, 256, 256, 128, 3];
        let weights = dims
            .windows(2)
            .map(|w| candle_core::Var::randn(0f32, 0.05, (w[1], w[0]), &device))
            .collect::<candle_core::Result<Vec<_>>>()?;
        let step = |batch: usize| -> Result<Box<dyn std::any::Any>, String> {
            let run = || -> candle_core::Result<(Tensor, candle_core::backprop::GradStore)> {
                let mut x = Tensor::randn(0f32, 1.0, (batch, 56), &device)?.to_dtype(dtype)?;
                for (i, w) in weights.iter().enumerate() {
                    x = x.matmul(&w.as_tensor().to_dtype(dtype)?.t()?)?;
                    if i + 1 < weights.len() {
                        x = x.relu()?;
                    }
                }
                let loss = x.to_dtype(DType::F32)?.sqr()?.mean_all()?;
                let grads = loss.backward()?;
                Ok((loss, grads))
            };
            run().map(|g| Box::new(g) as Box<dyn std::any::Any>).map_err(|e| e.to_string())
        };
        Ok(fx_hw::probe_bytes_per_sample(ordinal, 1024, 8192, step)?)
    }
}
