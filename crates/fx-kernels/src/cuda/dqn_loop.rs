//! [`DqnLoop`]: a DQN collection loop's counters in device memory, and the replay sampling
//! kernel (`kernels/env/replay.cu`), so that a whole DQN iteration — ε-greedy collection into
//! the replay ring, minibatch sampling, the update — can be one replayed CUDA graph.
//!
//! A graph freezes its kernels' arguments, so everything that changes from one iteration
//! to the next is read on the device instead: the environment step count (for ε), the
//! replay ring's position and length, and the key of the next minibatch draw. The caller
//! mirrors every counter on the host (they move deterministically), so no replay ever
//! reads anything back; [`DqnLoop::write`] puts the host's values on the device whenever
//! the two could differ (first use, or after steps taken outside the graph).

use std::sync::Arc;

use candle_core::{CudaDevice, Device, Tensor};
use cudarc::driver::{CudaFunction, CudaSlice, CudaStream, DevicePtr, LaunchConfig, PushKernelArg};

use super::{alloc_tensor, cuda_device, dev_ptr, driver, PTX_REPLAY};
use crate::env::OBS_DIM;
use crate::error::{CandleContext, Error, Result};
use crate::replay::{ReplayBatch, ReplayBuffer};

/// The loop block's six u64 (`FX_LOOP_*` in `kernels/env/replay.cu`).
const LOOP_WORDS: usize = 6;
/// Threads per block of the sampling kernel (one per copied state element).
const SAMPLE_BLOCK: u32 = 256;
/// Grid bound of the sampling kernel (it loops grid-stride beyond).
const SAMPLE_MAX_GRID: usize = 4096;

/// The host's view of a loop's counters (what [`DqnLoop::write`] uploads and
/// [`DqnLoop::read`] returns).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DqnLoopCounters {
    /// Environment steps taken (ε is the schedule's value here).
    pub env_steps: u64,
    /// The replay ring position the next step writes to.
    pub replay_position: u64,
    /// Transitions the replay buffer holds.
    pub replay_len: u64,
    /// Key of the next minibatch draw (minibatches drawn so far).
    pub sample_key: u64,
}

/// See the module docs. Lives on one CUDA device; all its work queues on candle's stream.
pub struct DqnLoop {
    buf: CudaSlice<u64>,
    address: u64,
    stream: Arc<CudaStream>,
    k_advance: CudaFunction,
    k_sample: CudaFunction,
}

impl std::fmt::Debug for DqnLoop {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DqnLoop").field("address", &self.address).finish()
    }
}

impl DqnLoop {
    /// A zeroed block on `device` (must be CUDA) with the two kernels loaded.
    pub fn new(device: &Device) -> Result<Self> {
        const CTX: &str = "DqnLoop::new";
        let dev = cuda_device(device, "device", CTX)?;
        let stream = dev.cuda_stream();
        let buf = stream.alloc_zeros::<u64>(LOOP_WORDS).map_err(driver(CTX))?;
        let address = {
            let (p, _record) = buf.device_ptr(&stream);
            p
        };
        Ok(Self {
            buf,
            address,
            k_advance: load(dev, "fx_dqn_loop_advance", CTX)?,
            k_sample: load(dev, "fx_replay_sample", CTX)?,
            stream,
        })
    }

    /// The block's device address (the experience kernel's `loop` argument).
    pub(crate) fn address(&self) -> u64 {
        self.address
    }

    /// Uploads `c` for a loop over `replay` (queued on the stream, ordered before the next
    /// replay). The ring position must be below the capacity and the length at most it:
    /// the kernels index the ring with them unchecked.
    pub fn write(&mut self, c: DqnLoopCounters, replay: &ReplayBuffer) -> Result<()> {
        const CTX: &str = "DqnLoop::write";
        let cap = replay.capacity() as u64;
        if c.replay_position >= cap || c.replay_len > cap {
            return Err(Error::OutOfRange {
                what: format!("replay position {} / length {}", c.replay_position, c.replay_len),
                value: c.replay_position.max(c.replay_len),
                bound: cap,
                context: CTX,
            });
        }
        let words = [c.env_steps, c.replay_position, c.replay_len, c.sample_key, c.sample_key, 0];
        self.stream.memcpy_htod(&words, &mut self.buf).map_err(driver(CTX))
    }

    /// The device's counters (syncs the stream).
    pub fn read(&self) -> Result<DqnLoopCounters> {
        const CTX: &str = "DqnLoop::read";
        let w: Vec<u64> = self.stream.clone_dtoh(&self.buf).map_err(driver(CTX))?;
        Ok(DqnLoopCounters { env_steps: w[0], replay_position: w[1], replay_len: w[2], sample_key: w[3] })
    }

    /// Queues the counters' move after an environment step of `num_envs` accounts into
    /// `replay`, ahead of `minibatches` draws ([`Self::launch_sample`] `0..minibatches`):
    /// step + 1, ring position and length as [`ReplayBuffer::advance`] moves them,
    /// sample key + `minibatches`.
    pub fn launch_advance(&self, num_envs: usize, replay: &ReplayBuffer, minibatches: u32) -> Result<()> {
        const CTX: &str = "DqnLoop::launch_advance";
        let (e, cap, m) = (num_envs as u64, replay.capacity() as u64, u64::from(minibatches));
        let mut b = self.stream.launch_builder(&self.k_advance);
        b.arg(&self.address).arg(&e).arg(&cap).arg(&m);
        let one = LaunchConfig { grid_dim: (1, 1, 1), block_dim: (1, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: arguments match fx_dqn_loop_advance; the block holds LOOP_WORDS u64 and
        // the capacity is positive (ReplayBuffer::new refuses 0).
        unsafe { b.launch(one) }.map_err(driver(CTX))?;
        Ok(())
    }

    /// Queues the `minibatch`-th draw of this iteration (key: the iteration's first key +
    /// `minibatch`, length: the device's) from `replay` into `out`'s buffers.
    pub fn launch_sample(&self, replay: &ReplayBuffer, seed: u64, minibatch: u32, out: &ReplayBatch) -> Result<()> {
        launch_sample(&self.k_sample, replay, Some((self.address, u64::from(minibatch))), 0, 0, seed, out)
    }
}

fn load(dev: &CudaDevice, name: &str, ctx: &'static str) -> Result<CudaFunction> {
    Ok(dev.get_or_load_custom_func(name, "fx_replay", PTX_REPLAY).ctx(ctx)?.into_cuda_function())
}

/// `batch` rows drawn from `replay` with the host's length and `key` into new tensors:
/// [`ReplayBuffer::sample_keyed`] on CUDA.
pub(crate) fn sample_keyed(replay: &ReplayBuffer, batch: usize, seed: u64, key: u64) -> Result<ReplayBatch> {
    const CTX: &str = "ReplayBuffer::sample_keyed";
    let dev = cuda_device(replay.device(), "replay", CTX)?;
    // Uninitialised: the kernel writes every element.
    let out = ReplayBatch {
        states: alloc_tensor::<f32>(dev, &[batch, OBS_DIM], CTX)?,
        actions: alloc_tensor::<u32>(dev, &[batch], CTX)?,
        rewards: alloc_tensor::<f32>(dev, &[batch], CTX)?,
        next_states: alloc_tensor::<f32>(dev, &[batch, OBS_DIM], CTX)?,
        dones: alloc_tensor::<f32>(dev, &[batch], CTX)?,
    };
    let func = load(dev, "fx_replay_sample", CTX)?;
    launch_sample(&func, replay, None, replay.len() as u64, key, seed, &out)?;
    Ok(out)
}

/// [`ReplayBuffer::sample_keyed_into`] on CUDA: the sampling kernel writes `out` (contiguous,
/// views allowed) directly.
pub(crate) fn sample_keyed_into(replay: &ReplayBuffer, seed: u64, key: u64, out: &ReplayBatch) -> Result<()> {
    const CTX: &str = "ReplayBuffer::sample_keyed_into";
    let dev = cuda_device(replay.device(), "replay", CTX)?;
    let func = load(dev, "fx_replay_sample", CTX)?;
    launch_sample(&func, replay, None, replay.len() as u64, key, seed, out)
}

/// Launches `fx_replay_sample` into `out` after checking its buffers: with `looped`
/// (block address, minibatch) the length and key come from the device, else `len`, `key`.
fn launch_sample(
    func: &CudaFunction,
    replay: &ReplayBuffer,
    looped: Option<(u64, u64)>,
    len: u64,
    key: u64,
    seed: u64,
    out: &ReplayBatch,
) -> Result<()> {
    const CTX: &str = "DqnLoop::launch_sample";
    let b = out.actions.dims().first().copied().unwrap_or(0);
    out.check(b, replay.device(), CTX)?;
    if b == 0 || b > u32::MAX as usize {
        return Err(Error::shape("out", CTX, "1..2^32 rows", format!("{b} rows")));
    }
    let s = cuda_device(replay.device(), "replay", CTX)?.cuda_stream();
    let p = |t: &Tensor, what| dev_ptr::<f32>(t, &s, what, CTX);
    let (rs, rr, rs2, rd) = (
        p(&replay.states, "replay.states")?,
        p(&replay.rewards, "replay.rewards")?,
        p(&replay.next_states, "replay.next_states")?,
        p(&replay.dones, "replay.dones")?,
    );
    let ra = dev_ptr::<u32>(&replay.actions, &s, "replay.actions", CTX)?;
    let (os, or, os2, od) = (
        p(&out.states, "states")?,
        p(&out.rewards, "rewards")?,
        p(&out.next_states, "next_states")?,
        p(&out.dones, "dones")?,
    );
    let oa = dev_ptr::<u32>(&out.actions, &s, "actions", CTX)?;
    let (p_loop, key_offset) = looped.unwrap_or((0, 0));
    let (stream_id, b32) = (crate::rng::STREAM_REPLAY, b as u32);
    let mut l = s.launch_builder(func);
    l.arg(&p_loop).arg(&len).arg(&key).arg(&key_offset).arg(&seed).arg(&stream_id).arg(&b32);
    l.arg(&rs).arg(&ra).arg(&rr).arg(&rs2).arg(&rd).arg(&os).arg(&oa).arg(&or).arg(&os2).arg(&od);
    let total = b * OBS_DIM;
    let grid = total.div_ceil(SAMPLE_BLOCK as usize).clamp(1, SAMPLE_MAX_GRID) as u32;
    let cfg = LaunchConfig { grid_dim: (grid, 1, 1), block_dim: (SAMPLE_BLOCK, 1, 1), shared_mem_bytes: 0 };
    // SAFETY: arguments match fx_replay_sample; `out` was checked to hold b rows of the
    // replay's layout on its device; indices stay below the replay's length (≤ capacity).
    unsafe { l.launch(cfg) }.map_err(driver(CTX))?;
    Ok(())
}
