//! Per-step timing: CUDA event pairs on candle's stream (device time, no host sync inside
//! the timed loop, as `bench.py` does with `torch.cuda.Event`) or the host clock on the
//! CPU; and bench.py's percentile definition.

use std::time::Instant;

use anyhow::Result;
use candle_core::Device;

/// How steps are timed.
pub(crate) enum StepTimer {
    /// `Instant` around each step (CPU: the work is done when the call returns).
    Host,
    /// A pair of timing events recorded on candle's stream around each step.
    #[cfg(feature = "cuda")]
    Events(std::sync::Arc<cudarc::driver::CudaStream>),
}

impl StepTimer {
    /// Events on a CUDA device, the host clock otherwise.
    pub(crate) fn for_device(device: &Device) -> Result<Self> {
        #[cfg(feature = "cuda")]
        if let Device::Cuda(cd) = device {
            return Ok(StepTimer::Events(cd.cuda_stream()));
        }
        let _ = device;
        Ok(StepTimer::Host)
    }

    /// The method's name for the records (`timing`).
    pub(crate) fn method(&self) -> &'static str {
        match self {
            StepTimer::Host => "host_clock",
            #[cfg(feature = "cuda")]
            StepTimer::Events(_) => "cuda_events",
        }
    }

    /// Runs `step` `n` times; returns each step's time in ms and the wall time of the
    /// whole loop in s (device synchronised before and after).
    pub(crate) fn time_steps(
        &self,
        device: &Device,
        n: usize,
        mut step: impl FnMut() -> Result<()>,
    ) -> Result<(Vec<f64>, f64)> {
        device.synchronize()?;
        match self {
            StepTimer::Host => {
                let t0 = Instant::now();
                let mut ts = Vec::with_capacity(n);
                for _ in 0..n {
                    let a = Instant::now();
                    step()?;
                    ts.push(a.elapsed().as_secs_f64() * 1e3);
                }
                Ok((ts, t0.elapsed().as_secs_f64()))
            }
            #[cfg(feature = "cuda")]
            StepTimer::Events(stream) => {
                use cudarc::driver::sys::CUevent_flags;
                let ctx = stream.context();
                // Created up front so event creation is not inside the timed loop;
                // CU_EVENT_DEFAULT: cudarc's default (None) disables timing.
                let mut pairs = Vec::with_capacity(n);
                for _ in 0..n {
                    pairs.push((
                        ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?,
                        ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?,
                    ));
                }
                let t0 = Instant::now();
                for (s, e) in &pairs {
                    s.record(stream)?;
                    step()?;
                    e.record(stream)?;
                }
                stream.synchronize()?;
                let wall = t0.elapsed().as_secs_f64();
                let ts = pairs.iter().map(|(s, e)| s.elapsed_ms(e).map(f64::from)).collect::<Result<Vec<_>, _>>()?;
                Ok((ts, wall))
            }
        }
    }
}

/// Device time of one `call` (a kernel launch, nothing synchronous): 64 calls captured in
/// one CUDA graph, whose replays run them back to back with no host in between, timed by an
/// event pair per replay; the median of 20 replays over 64, in microseconds.
#[cfg(feature = "cuda")]
pub(crate) fn kernel_device_us(dev: &Device, mut call: impl FnMut() -> Result<()>) -> Result<f64> {
    const CALLS: usize = 64;
    let graph = fx_precision::CapturedGraph::capture(dev, 1, |_dry| {
        for _ in 0..CALLS {
            call().map_err(|e| fx_precision::Error::Cuda { context: "kernel_device_us", message: format!("{e:#}") })?;
        }
        Ok(())
    })?;
    let timer = StepTimer::for_device(dev)?;
    let (ts, _) = timer.time_steps(dev, 20, || Ok(graph.replay()?))?;
    Ok(pct(&ts, 50.0) * 1e3 / CALLS as f64)
}

/// The `p`-th percentile with linear interpolation between order statistics (bench.py's
/// `pct`, NumPy's default). `xs` must not be empty.
pub(crate) fn pct(xs: &[f64], p: f64) -> f64 {
    let mut v = xs.to_vec();
    v.sort_by(f64::total_cmp);
    let k = (v.len() - 1) as f64 * p / 100.0;
    let (lo, hi) = (k.floor() as usize, k.ceil() as usize);
    v[lo] + (v[hi] - v[lo]) * (k - lo as f64)
}

/// Arithmetic mean (`xs` not empty).
pub(crate) fn mean(xs: &[f64]) -> f64 {
    xs.iter().sum::<f64>() / xs.len() as f64
}

/// `x` rounded to `nd` decimals (bench.py rounds its records the same way).
pub(crate) fn round(x: f64, nd: i32) -> f64 {
    let f = 10f64.powi(nd);
    (x * f).round() / f
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_interpolate_like_numpy() {
        let xs = [4.0, 1.0, 3.0, 2.0, 10.0];
        assert_eq!(pct(&xs, 50.0), 3.0);
        assert_eq!(pct(&xs, 0.0), 1.0);
        assert_eq!(pct(&xs, 100.0), 10.0);
        // k = 4 * 0.9 = 3.6 -> 4 + 0.6 * (10 - 4)
        assert!((pct(&xs, 90.0) - 7.6).abs() < 1e-12);
        // statistics.median of an even count is the mean of the middle two
        assert_eq!(pct(&[1.0, 2.0, 3.0, 4.0], 50.0), 2.5);
        assert_eq!(mean(&xs), 4.0);
    }
}
