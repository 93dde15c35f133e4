//! [`CapturedGraph`]: a candle computation recorded once as a CUDA graph and replayed with
//! one launch, for training steps (forward, loss, backward and [`crate::FusedStep`]) and
//! batch inference.
//!
//! How it stays correct:
//! - The body is first run eagerly with `dry = true` (kernels load, cuBLAS warms up and
//!   candle's host-to-device parameter cache fills: a capture may not upload host data),
//!   then captured once with `dry = false`. A dry body must not change any state, so
//!   capturing does not advance training: the first replay is the first real step.
//! - Inputs are device tensors allocated before the capture; callers refill them in place
//!   before each replay. Weights and optimiser state are updated in place, so their
//!   addresses never change. Everything allocated inside the body belongs to the graph
//!   (freed automatically at the next launch).
//! - Nothing inside may read to the host: candle refuses such reads while capturing, and
//!   the capture then fails with that error instead of producing a wrong graph.
//! - cudarc's per-tensor event tracking is switched off on the device's context (fx uses
//!   candle's single stream, where it only adds work), since a capture may not wait on
//!   events recorded outside it.
//! - Warm-up and capture hold [`fx_hw::device_wide_lock`]: another thread's device-wide
//!   synchronisation (making a device, another warm-up) invalidates a capture in progress,
//!   even in thread-local capture mode, so captures on concurrent threads take turns; replays
//!   do not. Code that runs beside captures must not synchronise the device either: that is
//!   why every fused step shares its device's one cuBLAS handle
//!   (`fx_kernels::cuda::blas::Blas`) instead of creating and destroying its own
//!   (`cublasDestroy` synchronises the device), which made captures on parallel test threads
//!   fail with `CUDA_ERROR_STREAM_CAPTURE_INVALIDATED`. Open devices with [`fx_hw::open_cuda`] (which takes the same lock), not candle's
//!   `Device::new_cuda`: its per-thread stream dies with the thread, before candle's
//!   thread-local capture buffers are freed on it.
//! - candle's upload cache is thread-local and the graph reads its buffers: a graph must not
//!   outlive the thread that captured it.

use std::sync::Arc;

use candle_core::Device;
use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::{CudaGraph, CudaStream};

use crate::error::{Error, Result};

/// A replayable CUDA graph of a candle computation; see the module docs.
pub struct CapturedGraph {
    graph: CudaGraph,
    stream: Arc<CudaStream>,
}

impl std::fmt::Debug for CapturedGraph {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("CapturedGraph")
    }
}

fn cuda(context: &'static str) -> impl Fn(cudarc::driver::DriverError) -> Error {
    move |e| Error::Cuda { context, message: format!("{e:?}") }
}

impl CapturedGraph {
    /// Runs `body(true)` `warmups` times (at least once), then captures `body(false)`.
    /// Fails, leaving the stream usable, when the body errs or the capture is refused.
    pub fn capture<F>(device: &Device, warmups: usize, mut body: F) -> Result<Self>
    where
        F: FnMut(bool) -> Result<()>,
    {
        const CTX: &str = "CapturedGraph::capture";
        let Device::Cuda(dev) = device else {
            return Err(Error::Config { what: "CapturedGraph", message: "CUDA graphs need a CUDA device".into() });
        };
        // SAFETY: fx runs all device work on candle's one stream (see the module docs).
        unsafe { dev.disable_event_tracking() };
        let stream = dev.cuda_stream();
        let _turn = fx_hw::device_wide_lock();
        // Held through warm-up and capture on this thread: candle's small host uploads
        // (layouts, parameters) are then served from device copies made during warm-up.
        let _cache = dev.enable_cuda_graph_htod_cache();
        for _ in 0..warmups.max(1) {
            body(true)?;
        }
        stream.synchronize().map_err(cuda(CTX))?;
        stream.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL).map_err(cuda(CTX))?;
        let result = body(false);
        // Always end the capture, so a failed body leaves the stream out of capture mode.
        let ended = stream.end_capture(CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH);
        result?;
        let graph = ended
            .map_err(cuda(CTX))?
            .ok_or_else(|| Error::Cuda { context: CTX, message: "the capture recorded no work".into() })?;
        graph.upload().map_err(cuda(CTX))?;
        Ok(Self { graph, stream })
    }

    /// Nodes of the captured graph (kernels, copies, memsets, allocations): the launches a
    /// replay makes, for profiles.
    pub fn node_count(&self) -> Result<usize> {
        let mut n: usize = 0;
        // SAFETY: a null node array asks only for the count; the graph is alive.
        let r = unsafe { cudarc::driver::sys::cuGraphGetNodes(self.graph.cu_graph(), std::ptr::null_mut(), &mut n) };
        if r != cudarc::driver::sys::CUresult::CUDA_SUCCESS {
            return Err(Error::Cuda { context: "CapturedGraph::node_count", message: format!("{r:?}") });
        }
        Ok(n)
    }

    /// Queues one replay on the stream (asynchronous, like any launch).
    pub fn replay(&self) -> Result<()> {
        self.graph.launch().map_err(cuda("CapturedGraph::replay"))
    }

    /// Waits until everything queued on the stream has run.
    pub fn synchronize(&self) -> Result<()> {
        self.stream.synchronize().map_err(cuda("CapturedGraph::synchronize"))
    }
}
