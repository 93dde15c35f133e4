use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::overrides::DeviceRequest;
use crate::{batch_size, population_size, CostModel, ModelKind, Overrides, Precision, Source, Sourced};

/// Where tensors live for a run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase", tag = "kind", content = "ordinal")]
pub enum DeviceKind {
    Cpu,
    Cuda(usize),
}

/// What the CUDA driver reports about one GPU.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GpuInfo {
    pub ordinal: usize,
    pub name: String,
    pub total_memory_bytes: u64,
    pub free_memory_bytes: u64,
    pub sm_count: u32,
    pub compute_capability: (u32, u32),
    pub l2_cache_bytes: u64,
}

/// The host: CPU cores and RAM.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HostInfo {
    pub cpu_cores: usize,
    pub ram_total_bytes: Option<u64>,
    pub ram_available_bytes: Option<u64>,
}

impl HostInfo {
    /// Reads the host (cores from the OS scheduler, RAM from `/proc/meminfo` on Linux).
    pub fn detect() -> Self {
        let cpu_cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
        let (total, avail) = read_meminfo();
        HostInfo { cpu_cores, ram_total_bytes: total, ram_available_bytes: avail }
    }

    /// The most memory this process may use, and what bounds it: the machine's RAM, or the
    /// process's address-space limit (`RLIMIT_AS`, set by containers and `ulimit -v`) when
    /// that is smaller; `None` when neither is known. Memory checks compare against this.
    pub fn memory_limit(&self) -> Option<(u64, &'static str)> {
        match (self.ram_total_bytes, address_space_limit()) {
            (Some(r), Some(l)) if l < r => Some((l, "this process's address-space limit")),
            (Some(r), _) => Some((r, "this machine's memory")),
            (None, Some(l)) => Some((l, "this process's address-space limit")),
            (None, None) => None,
        }
    }
}

/// `RLIMIT_AS` when one is set, in bytes.
fn address_space_limit() -> Option<u64> {
    #[cfg(unix)]
    {
        let mut r = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
        // SAFETY: getrlimit writes the struct it is given.
        if unsafe { libc::getrlimit(libc::RLIMIT_AS, &mut r) } == 0 && r.rlim_cur != libc::RLIM_INFINITY {
            return Some(r.rlim_cur);
        }
    }
    None
}

fn read_meminfo() -> (Option<u64>, Option<u64>) {
    let Ok(text) = std::fs::read_to_string("/proc/meminfo") else {
        return (None, None);
    };
    let field = |name: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|rest| rest.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            .map(|kib| kib * 1024)
    };
    (field("MemTotal:"), field("MemAvailable:"))
}

/// Everything a run needs to know about the machine, and the budget derived from it.
///
/// Every derived value is a [`Sourced`]: detected, derived by a documented rule,
/// estimated, measured by a probe, or overridden (config or environment).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HardwareBudget {
    pub device: Sourced<DeviceKind>,
    pub gpu: Option<GpuInfo>,
    pub host: HostInfo,
    /// Why the budget is on the CPU although a GPU was asked for or may exist.
    pub cpu_fallback_reason: Option<String>,
    pub precision: Sourced<Precision>,
    /// Per-model memory costs (estimates until a probe replaces them).
    pub costs: BTreeMap<ModelKind, Sourced<CostModel>>,
    /// A batch size forced by config or environment, applied to every model.
    pub batch_override: Option<Sourced<usize>>,
    /// A population size forced by config or environment.
    #[serde(default)]
    pub population_override: Option<Sourced<usize>>,
}

impl HardwareBudget {
    /// Detects the hardware, applying overrides from the environment. Never panics.
    pub fn detect() -> Self {
        match Overrides::from_env() {
            Ok(o) => Self::detect_with(&o),
            Err(e) => {
                let mut b = Self::detect_with(&Overrides::default());
                b.cpu_fallback_reason = Some(format!("ignored environment overrides: {e}"));
                b
            }
        }
    }

    /// Detects the hardware with explicit overrides (callers layer config, environment and
    /// flags with [`Overrides::layered`]). Never panics: no GPU, no driver, or a failing
    /// driver call gives a CPU budget with the reason in `cpu_fallback_reason`.
    pub fn detect_with(overrides: &Overrides) -> Self {
        let request = overrides.device.as_ref().map(|d| d.value).unwrap_or(DeviceRequest::Auto);
        let (gpu, reason) = match request {
            DeviceRequest::Cpu => (None, Some(format!("CPU requested ({})", source_of(overrides)))),
            DeviceRequest::Auto => probe_gpu(0),
            DeviceRequest::Cuda(n) => probe_gpu(n),
        };
        let device = match (&gpu, request) {
            (Some(g), DeviceRequest::Cuda(_)) => Sourced::new(DeviceKind::Cuda(g.ordinal), source_of(overrides)),
            (Some(g), _) => Sourced::new(DeviceKind::Cuda(g.ordinal), Source::Detected),
            (None, DeviceRequest::Cpu) => Sourced::new(DeviceKind::Cpu, source_of(overrides)),
            (None, _) => Sourced::new(DeviceKind::Cpu, Source::Detected),
        };
        let cc = gpu.as_ref().map(|g| g.compute_capability);
        let precision = overrides
            .precision
            .clone()
            .unwrap_or_else(|| Sourced::new(Precision::for_compute_capability(cc), Source::Derived));
        let costs =
            ModelKind::ALL.iter().map(|&m| (m, Sourced::new(CostModel::estimate(m), Source::Estimate))).collect();
        HardwareBudget {
            device,
            gpu,
            host: HostInfo::detect(),
            cpu_fallback_reason: reason,
            precision,
            costs,
            batch_override: overrides.batch_size.clone(),
            population_override: overrides.population.clone(),
        }
    }

    /// Memory the budget may plan with: the GPU's free memory, or the host's available RAM.
    pub fn free_memory_bytes(&self) -> u64 {
        match &self.gpu {
            Some(g) => g.free_memory_bytes,
            None => self.host.ram_available_bytes.or(self.host.ram_total_bytes).unwrap_or(4 << 30),
        }
    }

    /// The batch size for `model`: the override if one is set, else [`batch_size`] from
    /// free memory and the model's cost (source `derived`, or `probe` once measured).
    pub fn batch_size(&self, model: ModelKind) -> Sourced<usize> {
        if let Some(b) = &self.batch_override {
            return b.clone();
        }
        let cost = &self.costs[&model];
        let source = if cost.source == Source::Probe { Source::Probe } else { Source::Derived };
        Sourced::new(batch_size(model, self.free_memory_bytes(), cost.value), source)
    }

    /// How many members of a population of `model` to train at once, out of `trials`: the
    /// override if one is set (never above `trials`), else [`population_size`] from free
    /// memory, the model's fixed overhead and `member_bytes` (one member's footprint, from
    /// the model crate; source `derived`).
    pub fn population_size(&self, model: ModelKind, member_bytes: u64, trials: usize) -> Sourced<usize> {
        if let Some(p) = &self.population_override {
            return Sourced::new(p.value.clamp(1, trials.max(1)), p.source.clone());
        }
        let overhead = self.costs[&model].value.overhead_bytes;
        Sourced::new(population_size(self.free_memory_bytes(), overhead, member_bytes, trials), Source::Derived)
    }

    /// Replaces a model's estimated cost with a measured one.
    pub fn set_measured_cost(&mut self, model: ModelKind, cost: CostModel) {
        self.costs.insert(model, Sourced::new(cost, Source::Probe));
    }
}

fn source_of(o: &Overrides) -> Source {
    o.device.as_ref().map(|d| d.source.clone()).unwrap_or(Source::Detected)
}

#[cfg(not(feature = "cuda"))]
fn probe_gpu(_ordinal: usize) -> (Option<GpuInfo>, Option<String>) {
    (None, Some("built without the `cuda` feature".to_string()))
}

#[cfg(feature = "cuda")]
fn probe_gpu(ordinal: usize) -> (Option<GpuInfo>, Option<String>) {
    // cudarc loads libcuda at run time and panics when it is missing: contain that.
    match std::panic::catch_unwind(|| cuda::gpu_info(ordinal)) {
        Ok(Ok(info)) => (Some(info), None),
        Ok(Err(e)) => (None, Some(e.to_string())),
        Err(panic) => {
            let msg = panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "unknown panic".into());
            (None, Some(format!("CUDA driver unavailable: {msg}")))
        }
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    use cudarc::driver::sys::CUdevice_attribute as Attr;
    use cudarc::driver::CudaContext;

    use super::GpuInfo;
    use crate::Error;

    fn drv(during: &'static str) -> impl Fn(cudarc::driver::DriverError) -> Error {
        move |e| Error::Driver { during, message: e.to_string() }
    }

    pub(super) fn gpu_info(ordinal: usize) -> Result<GpuInfo, Error> {
        let count = CudaContext::device_count().map_err(drv("cuDeviceGetCount"))?;
        if count <= 0 {
            return Err(Error::Driver { during: "cuDeviceGetCount", message: "no CUDA device present".into() });
        }
        if ordinal >= count as usize {
            return Err(Error::Driver {
                during: "device selection",
                message: format!("CUDA device {ordinal} requested but only {count} present"),
            });
        }
        let ctx = CudaContext::new(ordinal).map_err(drv("cuCtxCreate"))?;
        let (free, total) = ctx.mem_get_info().map_err(drv("cuMemGetInfo"))?;
        let (major, minor) = ctx.compute_capability().map_err(drv("compute capability"))?;
        let sm = ctx.attribute(Attr::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT).map_err(drv("SM count"))?;
        let l2 = ctx.attribute(Attr::CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE).map_err(drv("L2 size"))?;
        Ok(GpuInfo {
            ordinal,
            name: ctx.name().map_err(drv("device name"))?,
            total_memory_bytes: total as u64,
            free_memory_bytes: free as u64,
            sm_count: sm.max(0) as u32,
            compute_capability: (major.max(0) as u32, minor.max(0) as u32),
            l2_cache_bytes: l2.max(0) as u64,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_request_gives_a_cpu_budget_with_reason() {
        let b = HardwareBudget::detect_with(&Overrides::default().with_device("cpu"));
        assert_eq!(b.device.value, DeviceKind::Cpu);
        assert_eq!(b.device.source, Source::Config);
        assert!(b.cpu_fallback_reason.unwrap().contains("CPU requested"));
        assert_eq!(b.precision.value, Precision::F32);
        assert!(b.host.cpu_cores >= 1);
    }

    #[cfg(not(feature = "cuda"))]
    #[test]
    fn without_cuda_auto_falls_back_to_cpu() {
        let b = HardwareBudget::detect_with(&Overrides::default());
        assert_eq!(b.device.value, DeviceKind::Cpu);
        assert!(b.cpu_fallback_reason.unwrap().contains("cuda"));
    }

    #[test]
    fn overrides_carry_their_source() {
        let o = Overrides::default().with_device("cpu").with_precision(Precision::Bf16).with_batch_size(96);
        let b = HardwareBudget::detect_with(&o);
        assert_eq!(b.precision, Sourced::new(Precision::Bf16, Source::Config));
        assert_eq!(b.batch_size(ModelKind::Dqn), Sourced::new(96, Source::Config));
        // a population override never asks for more members than there are trials
        let b = HardwareBudget::detect_with(&Overrides::default().with_device("cpu").with_population(16));
        assert_eq!(b.population_size(ModelKind::Dqn, 1 << 20, 100), Sourced::new(16, Source::Config));
        assert_eq!(b.population_size(ModelKind::Dqn, 1 << 20, 5), Sourced::new(5, Source::Config));
    }

    #[test]
    fn population_is_derived_from_free_memory() {
        let b = HardwareBudget::detect_with(&Overrides::default().with_device("cpu"));
        let free = b.free_memory_bytes();
        let overhead = b.costs[&ModelKind::Dqn].value.overhead_bytes;
        let per = (free.saturating_sub(overhead) / 10).max(1);
        let n = b.population_size(ModelKind::Dqn, per, 1000);
        assert_eq!(n.source, Source::Derived);
        assert_eq!(n.value, population_size(free, overhead, per, 1000));
        assert!(free < overhead + (1 << 30) || (10..=11).contains(&n.value), "{n:?}");
    }

    #[test]
    fn measured_costs_replace_estimates() {
        let mut b = HardwareBudget::detect_with(&Overrides::default().with_device("cpu"));
        assert_eq!(b.batch_size(ModelKind::Dqn).source, Source::Derived);
        b.set_measured_cost(ModelKind::Dqn, CostModel { overhead_bytes: 0, bytes_per_sample: 10_000 });
        let s = b.batch_size(ModelKind::Dqn);
        assert_eq!(s.source, Source::Probe);
        assert!(s.value >= 64 && s.value <= 8192);
    }

    #[test]
    fn budget_serialises_to_json() {
        let b = HardwareBudget::detect_with(&Overrides::default().with_device("cpu"));
        let json = serde_json::to_string(&b).unwrap();
        let back: HardwareBudget = serde_json::from_str(&json).unwrap();
        assert_eq!(back.device, b.device);
        assert!(json.contains("\"precision\""));
    }

    #[test]
    fn the_memory_limit_is_the_smaller_of_ram_and_the_address_space() {
        let host = |ram| HostInfo { cpu_cores: 1, ram_total_bytes: ram, ram_available_bytes: None };
        let (lim, what) = host(Some(1 << 30)).memory_limit().expect("RAM known");
        match address_space_limit() {
            Some(l) if l < 1 << 30 => assert_eq!((lim, what), (l, "this process's address-space limit")),
            _ => assert_eq!((lim, what), (1 << 30, "this machine's memory")),
        }
        assert_eq!(host(None).memory_limit(), address_space_limit().map(|l| (l, "this process's address-space limit")));
    }

    #[cfg(feature = "cuda")]
    #[test]
    fn detects_a_real_gpu_when_present() {
        let b = HardwareBudget::detect_with(&Overrides::default());
        match &b.gpu {
            Some(g) => {
                assert!(g.sm_count > 0 && g.total_memory_bytes > 0 && !g.name.is_empty());
                assert!(g.free_memory_bytes <= g.total_memory_bytes);
            }
            None if std::env::var("FX_REQUIRE_GPU").is_ok_and(|v| v == "1") => {
                panic!("FX_REQUIRE_GPU=1 but no GPU: {:?}", b.cpu_fallback_reason)
            }
            None => eprintln!("no GPU here: {:?}", b.cpu_fallback_reason),
        }
    }
}
