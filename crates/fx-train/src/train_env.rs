//! The training environment on the run's device: the CPU reference env, or (built with
//! `cuda`, on a CUDA device) the GPU env whose experience kernels keep collection on the GPU.
//! Both checkpoint through the same `EnvState`.

use std::sync::Arc;

use anyhow::Result;
use candle_core::Device;
use fx_kernels::{CpuTradingEnv, EnvConfig, EnvData, EnvState, VecEnv};

#[allow(clippy::large_enum_variant)] // one per run, never moved in a loop
pub enum TrainEnv {
    Cpu(CpuTradingEnv),
    #[cfg(feature = "cuda")]
    Gpu(Box<fx_kernels::GpuTradingEnv>),
}

impl TrainEnv {
    pub fn new(data: Arc<EnvData>, cfg: EnvConfig, device: &Device) -> Result<Self> {
        match device {
            Device::Cpu => Ok(TrainEnv::Cpu(CpuTradingEnv::new(data, cfg)?)),
            #[cfg(feature = "cuda")]
            Device::Cuda(cuda) => {
                // The budget of the GPU the run is on (its SM count sizes the kernel grids).
                let ordinal = cuda.cuda_stream().context().ordinal();
                let overrides = fx_hw::Overrides::default().with_device(&format!("cuda:{ordinal}"));
                let budget = fx_hw::HardwareBudget::detect_with(&overrides);
                let opts = fx_kernels::GpuEnvOptions::from_budget(&budget);
                Ok(TrainEnv::Gpu(Box::new(fx_kernels::GpuTradingEnv::new(data, cfg, device, opts)?)))
            }
            #[allow(unreachable_patterns)]
            other => anyhow::bail!("no training environment for device {other:?} in this build"),
        }
    }

    pub fn as_vec_env(&mut self) -> &mut dyn VecEnv {
        match self {
            TrainEnv::Cpu(e) => e,
            #[cfg(feature = "cuda")]
            TrainEnv::Gpu(e) => e.as_mut(),
        }
    }

    pub fn num_envs(&self) -> usize {
        match self {
            TrainEnv::Cpu(e) => e.num_envs(),
            #[cfg(feature = "cuda")]
            TrainEnv::Gpu(e) => e.num_envs(),
        }
    }

    pub fn state(&self) -> Result<EnvState> {
        match self {
            TrainEnv::Cpu(e) => Ok(e.state()),
            #[cfg(feature = "cuda")]
            TrainEnv::Gpu(e) => Ok(e.state()?),
        }
    }

    pub fn restore(&mut self, state: &EnvState) -> Result<()> {
        match self {
            TrainEnv::Cpu(e) => e.restore(state)?,
            #[cfg(feature = "cuda")]
            TrainEnv::Gpu(e) => e.restore(state)?,
        }
        Ok(())
    }
}
