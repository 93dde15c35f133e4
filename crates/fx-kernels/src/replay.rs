//! The DQN replay buffer: a fixed-capacity ring of transitions stored as candle tensors on
//! one device. On a CUDA device the whole buffer is device-resident: pushes are device
//! copies (or direct kernel writes by `GpuTradingEnv`) and sampling draws its indices on
//! the device from the same counter-based draws as the CPU, so nothing crosses to the host
//! and both devices sample the same rows.

use candle_core::{DType, Device, Tensor};

use crate::checks::expect_tensor;
use crate::env::OBS_DIM;
use crate::error::{CandleContext, Error, Result};

/// A sampled minibatch, all on the buffer's device.
#[derive(Clone, Debug)]
pub struct ReplayBatch {
    /// `[B, 56]` f32 states `s`.
    pub states: Tensor,
    /// `[B]` u32 actions.
    pub actions: Tensor,
    /// `[B]` f32 rewards.
    pub rewards: Tensor,
    /// `[B, 56]` f32 next states `s'` (pre-reset).
    pub next_states: Tensor,
    /// `[B]` f32 done flags (0/1).
    pub dones: Tensor,
}

impl ReplayBatch {
    /// Zeroed storage for `b` transitions on `device` (buffers a captured graph refills).
    pub fn alloc(b: usize, device: &Device, ctx: &'static str) -> Result<Self> {
        let z = |shape: &[usize], dt| Tensor::zeros(shape, dt, device).ctx(ctx);
        Ok(Self {
            states: z(&[b, OBS_DIM], DType::F32)?,
            actions: z(&[b], DType::U32)?,
            rewards: z(&[b], DType::F32)?,
            next_states: z(&[b, OBS_DIM], DType::F32)?,
            dones: z(&[b], DType::F32)?,
        })
    }

    /// Checks that every tensor holds `b` transitions in the buffer's layout on `device`.
    pub fn check(&self, b: usize, device: &Device, ctx: &'static str) -> Result<()> {
        expect_tensor(&self.states, "states", ctx, &[b, OBS_DIM], DType::F32, device)?;
        expect_tensor(&self.actions, "actions", ctx, &[b], DType::U32, device)?;
        expect_tensor(&self.rewards, "rewards", ctx, &[b], DType::F32, device)?;
        expect_tensor(&self.next_states, "next_states", ctx, &[b, OBS_DIM], DType::F32, device)?;
        expect_tensor(&self.dones, "dones", ctx, &[b], DType::F32, device)
    }
}

/// The part of a [`ReplayBuffer`] one run owns: its `len` transitions from slot `start` on,
/// wrapping at the capacity ([`ReplayBuffer::sample_keyed_window`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct RingWindow {
    /// Slot of the run's first transition (while it has not wrapped).
    pub start: usize,
    /// Transitions the run has written, at most the capacity.
    pub len: usize,
}

/// A member's own clocks in a population whose other members began earlier (a trial that
/// took a freed slot mid-run; all zero for a member from the start): the env step it began
/// at (its ε ramp and its share of the ring count from there), the ring slot of its first
/// transition and the draws taken before its first. The population collector's kernels
/// read them (`cuda::PopDqnCollect::set_members`), and its CPU path the same way.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct MemberClock {
    /// Environment steps the population had taken when the member began.
    pub env_step: u64,
    /// Ring slot of the member's first transition.
    pub ring_start: u64,
    /// Minibatch draws taken before the member's first.
    pub key: u64,
}

/// Ring buffer of `(s, a, r, s', done)` with uniform sampling with replacement.
#[derive(Debug)]
pub struct ReplayBuffer {
    capacity: usize,
    len: usize,
    pos: usize,
    device: Device,
    pub(crate) states: Tensor,
    pub(crate) actions: Tensor,
    pub(crate) rewards: Tensor,
    pub(crate) next_states: Tensor,
    pub(crate) dones: Tensor,
}

impl ReplayBuffer {
    /// An empty buffer of `capacity` transitions on `device` (allocated up front:
    /// `capacity · 460` bytes).
    pub fn new(capacity: usize, device: &Device) -> Result<Self> {
        let ctx = "ReplayBuffer::new";
        if capacity == 0 || capacity > u32::MAX as usize {
            return Err(Error::Config {
                context: ctx,
                message: format!("capacity must be in 1..=2^32-1, got {capacity}"),
            });
        }
        let z = |shape: &[usize], dt| Tensor::zeros(shape, dt, device).ctx(ctx);
        Ok(Self {
            capacity,
            len: 0,
            pos: 0,
            device: device.clone(),
            states: z(&[capacity, OBS_DIM], DType::F32)?,
            actions: z(&[capacity], DType::U32)?,
            rewards: z(&[capacity], DType::F32)?,
            next_states: z(&[capacity, OBS_DIM], DType::F32)?,
            dones: z(&[capacity], DType::F32)?,
        })
    }

    /// Maximum number of transitions held.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Number of transitions held (at most `capacity`).
    pub fn len(&self) -> usize {
        self.len
    }

    /// True before the first push.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The ring position the next push writes to.
    pub fn position(&self) -> usize {
        self.pos
    }

    /// The device the buffer lives on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Appends `n` transitions at the ring position, wrapping around and overwriting the
    /// oldest ones; exactly as `n` single pushes would (if `n > capacity`, only the last
    /// `capacity` rows stay). `s`, `s2`: `[n, 56]` f32; `a`: `[n]` u32; `r`, `done`:
    /// `[n]` f32; all on the buffer's device.
    pub fn push_batch(&mut self, s: &Tensor, a: &Tensor, r: &Tensor, s2: &Tensor, done: &Tensor) -> Result<()> {
        let ctx = "ReplayBuffer::push_batch";
        let n = a.dims().first().copied().unwrap_or(0);
        let dev = &self.device;
        expect_tensor(s, "s", ctx, &[n, OBS_DIM], DType::F32, dev)?;
        expect_tensor(a, "a", ctx, &[n], DType::U32, dev)?;
        expect_tensor(r, "r", ctx, &[n], DType::F32, dev)?;
        expect_tensor(s2, "s2", ctx, &[n, OBS_DIM], DType::F32, dev)?;
        expect_tensor(done, "done", ctx, &[n], DType::F32, dev)?;
        if n == 0 {
            return Ok(());
        }
        let skip = n.saturating_sub(self.capacity);
        let kept = n - skip;
        let start = (self.pos + skip) % self.capacity;
        let first = kept.min(self.capacity - start);
        let pairs =
            [(&self.states, s), (&self.actions, a), (&self.rewards, r), (&self.next_states, s2), (&self.dones, done)];
        for (dst, src) in pairs {
            let src = src.contiguous().ctx(ctx)?;
            dst.slice_set(&src.narrow(0, skip, first).ctx(ctx)?.contiguous().ctx(ctx)?, 0, start).ctx(ctx)?;
            if kept > first {
                dst.slice_set(&src.narrow(0, skip + first, kept - first).ctx(ctx)?.contiguous().ctx(ctx)?, 0, 0)
                    .ctx(ctx)?;
            }
        }
        self.advance(n);
        Ok(())
    }

    /// Moves the ring position and length as a push of `n` rows would, after a device
    /// kernel wrote them at [`position`](Self::position) itself (the GPU env's experience
    /// kernel; a replayed CUDA graph's collection, `cuda::DqnLoop`).
    pub fn advance(&mut self, n: usize) {
        self.pos = (self.pos + n) % self.capacity;
        self.len = (self.len + n).min(self.capacity);
    }

    /// `batch` transitions drawn uniformly with replacement from the `len` held ones by the
    /// counter-based draws: row `i` is `floor(u · len)` (at most `len - 1`) with
    /// `u = rng::draw(seed, STREAM_REPLAY, key, i)`. The same rows on every device (on CUDA
    /// one kernel, `kernels/env/replay.cu`, with nothing copied to the host), so a run keyed by
    /// its minibatch count samples the same after a resume.
    pub fn sample_keyed(&self, batch: usize, seed: u64, key: u64) -> Result<ReplayBatch> {
        let ctx = "ReplayBuffer::sample_keyed";
        if self.len == 0 {
            return Err(Error::Empty { what: "replay buffer", context: ctx });
        }
        #[cfg(feature = "cuda")]
        if self.device.is_cuda() {
            return crate::cuda::dqn_loop::sample_keyed(self, batch, seed, key);
        }
        let idx = keyed_indices(self.len, batch, seed, key);
        let idx = Tensor::from_vec(idx, batch, &self.device).ctx(ctx)?;
        self.select(&idx, ctx)
    }

    /// [`Self::sample_keyed`] of the window `w` of the ring, one run's part of it: the run's
    /// transition `i < w.len` sits in slot `(w.start + i) % capacity`, so draw `i` is its
    /// `floor(u · w.len)`-th transition, the row its own buffer would give at the same draw.
    /// (A population member that took a freed slot mid-run owns the transitions written
    /// since, from the ring position it began at.) The whole buffer's window draws as
    /// [`Self::sample_keyed`]; others draw their indices on the host. A window of no
    /// transition or past what the ring holds is refused.
    pub fn sample_keyed_window(&self, batch: usize, seed: u64, key: u64, w: RingWindow) -> Result<ReplayBatch> {
        let ctx = "ReplayBuffer::sample_keyed_window";
        if w.len == 0 {
            return Err(Error::Empty { what: "replay window", context: ctx });
        }
        if w.len > self.len || w.start >= self.capacity {
            return Err(Error::Config {
                context: ctx,
                message: format!(
                    "window of {} transitions from slot {} in a ring of {} holding {}",
                    w.len, w.start, self.capacity, self.len
                ),
            });
        }
        if w == self.window() {
            return self.sample_keyed(batch, seed, key);
        }
        let idx: Vec<u32> = keyed_indices(w.len, batch, seed, key)
            .into_iter()
            .map(|j| ((w.start + j as usize) % self.capacity) as u32)
            .collect();
        let idx = Tensor::from_vec(idx, batch, &self.device).ctx(ctx)?;
        self.select(&idx, ctx)
    }

    /// The window of everything the ring holds (`start` 0, `len` [`Self::len`]).
    pub fn window(&self) -> RingWindow {
        RingWindow { start: 0, len: self.len }
    }

    /// [`Self::sample_keyed`] written into `out` (tensors of `batch` transitions in the
    /// buffer's layout; views into larger tensors, such as one member's rows of a
    /// population's stacked minibatch, are written in place, so nothing is stacked after). On
    /// CUDA one kernel writes `out` directly; on the CPU the drawn rows are copied in.
    pub fn sample_keyed_into(&self, batch: usize, seed: u64, key: u64, out: &ReplayBatch) -> Result<()> {
        let ctx = "ReplayBuffer::sample_keyed_into";
        if self.len == 0 {
            return Err(Error::Empty { what: "replay buffer", context: ctx });
        }
        out.check(batch, &self.device, ctx)?;
        #[cfg(feature = "cuda")]
        if self.device.is_cuda() {
            return crate::cuda::dqn_loop::sample_keyed_into(self, seed, key, out);
        }
        let s = self.sample_keyed(batch, seed, key)?;
        let pairs = [
            (&out.states, &s.states),
            (&out.actions, &s.actions),
            (&out.rewards, &s.rewards),
            (&out.next_states, &s.next_states),
            (&out.dones, &s.dones),
        ];
        for (dst, src) in pairs {
            dst.slice_set(src, 0, 0).ctx(ctx)?;
        }
        Ok(())
    }

    /// The `len` stored transitions in physical (slot) order, as views of the buffer's own
    /// tensors (no copy: they change with the next write, so copy them off first, as a
    /// checkpoint's snapshot does).
    pub fn stored(&self) -> Result<ReplayBatch> {
        let ctx = "ReplayBuffer::stored";
        let head = |t: &Tensor| t.narrow(0, 0, self.len).ctx(ctx);
        Ok(ReplayBatch {
            states: head(&self.states)?,
            actions: head(&self.actions)?,
            rewards: head(&self.rewards)?,
            next_states: head(&self.next_states)?,
            dones: head(&self.dones)?,
        })
    }

    /// The transitions at `indices` (`[B]` u32, each < `len`), checked on the host (this
    /// copies the indices; use [`sample_keyed`](Self::sample_keyed) in training loops).
    pub fn gather(&self, indices: &Tensor) -> Result<ReplayBatch> {
        let ctx = "ReplayBuffer::gather";
        let b = indices.dims().first().copied().unwrap_or(0);
        expect_tensor(indices, "indices", ctx, &[b], DType::U32, &self.device)?;
        let host = indices.to_vec1::<u32>().ctx(ctx)?;
        if let Some((i, &v)) = host.iter().enumerate().find(|(_, &v)| v as usize >= self.len) {
            return Err(Error::OutOfRange {
                what: format!("indices[{i}]"),
                value: v as u64,
                bound: self.len as u64,
                context: ctx,
            });
        }
        self.select(indices, ctx)
    }

    fn select(&self, idx: &Tensor, ctx: &'static str) -> Result<ReplayBatch> {
        Ok(ReplayBatch {
            states: self.states.index_select(idx, 0).ctx(ctx)?,
            actions: self.actions.index_select(idx, 0).ctx(ctx)?,
            rewards: self.rewards.index_select(idx, 0).ctx(ctx)?,
            next_states: self.next_states.index_select(idx, 0).ctx(ctx)?,
            dones: self.dones.index_select(idx, 0).ctx(ctx)?,
        })
    }
}

/// The indices [`ReplayBuffer::sample_keyed`] draws (the CPU reference of the kernel's).
pub fn keyed_indices(len: usize, batch: usize, seed: u64, key: u64) -> Vec<u32> {
    (0..batch as u64)
        .map(|i| {
            let u = crate::rng::draw(seed, crate::rng::STREAM_REPLAY, key, i);
            ((u * len as f64) as usize).min(len.saturating_sub(1)) as u32
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Rows whose every value encodes the row's global id `k`, so any stored row can be
    /// traced back to the push it came from.
    fn rows(k0: usize, n: usize) -> [Tensor; 5] {
        let dev = Device::Cpu;
        let s: Vec<f32> = (0..n * OBS_DIM).map(|i| (k0 + i / OBS_DIM) as f32).collect();
        let s2: Vec<f32> = s.iter().map(|v| v + 0.5).collect();
        let a: Vec<u32> = (0..n).map(|i| ((k0 + i) % 3) as u32).collect();
        let r: Vec<f32> = (0..n).map(|i| -((k0 + i) as f32)).collect();
        let d: Vec<f32> = (0..n).map(|i| ((k0 + i) % 2) as f32).collect();
        [
            Tensor::from_vec(s, (n, OBS_DIM), &dev).expect("s"),
            Tensor::from_vec(a, n, &dev).expect("a"),
            Tensor::from_vec(r, n, &dev).expect("r"),
            Tensor::from_vec(s2, (n, OBS_DIM), &dev).expect("s2"),
            Tensor::from_vec(d, n, &dev).expect("d"),
        ]
    }

    fn push(buf: &mut ReplayBuffer, k0: usize, n: usize) {
        let [s, a, r, s2, d] = rows(k0, n);
        buf.push_batch(&s, &a, &r, &s2, &d).expect("push");
    }

    /// Checks that every row of the batch is one consistent pushed transition and returns
    /// the ids.
    fn ids(b: &ReplayBatch) -> Vec<usize> {
        let s = b.states.to_vec2::<f32>().expect("s");
        let s2 = b.next_states.to_vec2::<f32>().expect("s2");
        let a = b.actions.to_vec1::<u32>().expect("a");
        let r = b.rewards.to_vec1::<f32>().expect("r");
        let d = b.dones.to_vec1::<f32>().expect("d");
        (0..a.len())
            .map(|i| {
                let k = s[i][0] as usize;
                assert!(s[i].iter().all(|&v| v == k as f32 && v.is_finite()), "row {i} mixed");
                assert!(s2[i].iter().all(|&v| v == k as f32 + 0.5));
                assert_eq!(a[i] as usize, k % 3);
                assert_eq!(r[i], -(k as f32));
                assert_eq!(d[i], (k % 2) as f32);
                k
            })
            .collect()
    }

    #[test]
    fn wraps_around_like_single_pushes() {
        let mut buf = ReplayBuffer::new(10, &Device::Cpu).expect("buf");
        assert!(buf.sample_keyed(4, 1, 0).is_err());
        push(&mut buf, 0, 7);
        assert_eq!((buf.len(), buf.position()), (7, 7));
        push(&mut buf, 7, 6); // rows 7..13: 7,8,9 at 7..10, then 10,11,12 at 0..3
        assert_eq!((buf.len(), buf.position()), (10, 3));
        let all = buf.gather(&Tensor::arange(0u32, 10, &Device::Cpu).expect("idx")).expect("gather");
        assert_eq!(ids(&all), vec![10, 11, 12, 3, 4, 5, 6, 7, 8, 9]);
        assert_eq!(ids(&buf.stored().expect("stored")), ids(&all));
        // a batch larger than the capacity keeps its last rows, at the same places as
        // one-by-one pushes would put them
        push(&mut buf, 100, 23); // ids 100..123 starting at 3 -> final pos (3+23)%10 = 6
        assert_eq!(buf.position(), 6);
        let all = buf.gather(&Tensor::arange(0u32, 10, &Device::Cpu).expect("idx")).expect("gather");
        let mut want = [0usize; 10];
        for k in 0..23 {
            want[(3 + k) % 10] = 100 + k;
        }
        assert_eq!(ids(&all), want.to_vec());
    }

    #[test]
    fn samples_only_pushed_rows() {
        let mut buf = ReplayBuffer::new(64, &Device::Cpu).expect("buf");
        push(&mut buf, 0, 5);
        let got = ids(&buf.sample_keyed(200, 9, 0).expect("sample"));
        assert!(got.iter().all(|&k| k < 5), "{got:?}");
        // all five rows show up in 200 draws (fails with probability 5·0.8^200)
        for k in 0..5 {
            assert!(got.contains(&k));
        }
        push(&mut buf, 5, 100);
        let got = ids(&buf.sample_keyed(300, 9, 1).expect("sample"));
        assert!(got.iter().all(|&k| (41..105).contains(&k)), "{got:?}");
    }

    /// The keyed draws are a pure function of (seed, key, row): the same key repeats its
    /// rows, another key or seed draws others, and every index stays below the length.
    #[test]
    fn keyed_draws_repeat_by_key_and_stay_in_range() {
        let mut buf = ReplayBuffer::new(64, &Device::Cpu).expect("buf");
        push(&mut buf, 0, 37);
        let a = ids(&buf.sample_keyed(50, 3, 11).expect("a"));
        assert_eq!(a, ids(&buf.sample_keyed(50, 3, 11).expect("again")));
        assert_ne!(a, ids(&buf.sample_keyed(50, 3, 12).expect("next key")));
        assert_ne!(a, ids(&buf.sample_keyed(50, 4, 11).expect("other seed")));
        let want: Vec<usize> = keyed_indices(37, 50, 3, 11).into_iter().map(|i| i as usize).collect();
        assert_eq!(a, want);
        for len in [1usize, 2, 37, 1 << 20, u32::MAX as usize] {
            assert!(keyed_indices(len, 200, 5, len as u64).iter().all(|&i| (i as usize) < len), "len {len}");
        }
    }

    /// A run that began at slot 7 of a shared ring (after 7 rows of another run) draws from
    /// its window the transitions its own buffer would give at the same draws, before the
    /// ring wraps and after (its window then covers every slot); bad windows are refused.
    #[test]
    fn a_window_draws_what_the_runs_own_buffer_draws() {
        let (cap, start) = (16usize, 7usize);
        let mut shared = ReplayBuffer::new(cap, &Device::Cpu).expect("shared");
        push(&mut shared, 500, start);
        let mut own = ReplayBuffer::new(cap, &Device::Cpu).expect("own");
        let mut written = 0;
        for (key, n) in [(0u64, 3usize), (1, 4), (2, 6), (3, 9), (4, 1), (5, 20)] {
            push(&mut shared, written, n);
            push(&mut own, written, n);
            written += n;
            let w = RingWindow { start, len: written.min(cap) };
            let got = ids(&shared.sample_keyed_window(40, 9, key, w).expect("window"));
            assert_eq!(got, ids(&own.sample_keyed(40, 9, key).expect("own")), "after {written} rows");
        }
        assert_eq!(
            ids(&shared.sample_keyed_window(40, 9, 3, shared.window()).expect("whole")),
            ids(&shared.sample_keyed(40, 9, 3).expect("plain"))
        );
        for bad in [RingWindow { start, len: 0 }, RingWindow { start, len: cap + 1 }, RingWindow { start: cap, len: 1 }]
        {
            assert!(shared.sample_keyed_window(4, 9, 0, bad).is_err(), "{bad:?}");
        }
    }

    /// Sampling into member k's rows of a stacked minibatch writes what `sample_keyed`
    /// returns there and leaves the other rows alone; a view of the wrong size is refused.
    #[test]
    fn samples_into_rows_of_a_stacked_batch() {
        let mut buf = ReplayBuffer::new(64, &Device::Cpu).expect("buf");
        push(&mut buf, 0, 37);
        let z = |shape: &[usize], dt| Tensor::zeros(shape, dt, &Device::Cpu).expect("zeros");
        let (s, a, r, s2, d) = (
            z(&[3, 8, OBS_DIM], DType::F32),
            z(&[3, 8], DType::U32),
            z(&[3, 8], DType::F32),
            z(&[3, 8, OBS_DIM], DType::F32),
            z(&[3, 8], DType::F32),
        );
        let row = |t: &Tensor, k: usize| t.get(k).expect("row");
        let view = |k| ReplayBatch {
            states: row(&s, k),
            actions: row(&a, k),
            rewards: row(&r, k),
            next_states: row(&s2, k),
            dones: row(&d, k),
        };
        buf.sample_keyed_into(8, 5, 11, &view(1)).expect("into");
        let want = buf.sample_keyed(8, 5, 11).expect("sample");
        let got = view(1);
        assert_eq!(got.states.to_vec2::<f32>().unwrap(), want.states.to_vec2::<f32>().unwrap());
        assert_eq!(got.next_states.to_vec2::<f32>().unwrap(), want.next_states.to_vec2::<f32>().unwrap());
        assert_eq!(got.actions.to_vec1::<u32>().unwrap(), want.actions.to_vec1::<u32>().unwrap());
        assert_eq!(got.rewards.to_vec1::<f32>().unwrap(), want.rewards.to_vec1::<f32>().unwrap());
        assert_eq!(got.dones.to_vec1::<f32>().unwrap(), want.dones.to_vec1::<f32>().unwrap());
        ids(&got);
        for k in [0, 2] {
            assert!(view(k).states.flatten_all().unwrap().to_vec1::<f32>().unwrap().iter().all(|&v| v == 0.0));
        }
        assert!(buf.sample_keyed_into(4, 5, 11, &view(0)).is_err(), "a view of 8 rows for a batch of 4");
    }

    #[test]
    fn rejects_bad_input() {
        let mut buf = ReplayBuffer::new(8, &Device::Cpu).expect("buf");
        let [s, a, r, s2, d] = rows(0, 3);
        assert!(buf.push_batch(&s, &a, &r, &s2, &d.narrow(0, 0, 2).expect("n")).is_err());
        assert!(buf.push_batch(&s, &a.to_dtype(DType::I64).expect("c"), &r, &s2, &d).is_err());
        assert!(buf.push_batch(&s.narrow(1, 0, 54).expect("n"), &a, &r, &s2, &d).is_err());
        assert!(buf.is_empty());
        buf.push_batch(&s, &a, &r, &s2, &d).expect("push");
        let bad = Tensor::new(&[0u32, 3], &Device::Cpu).expect("idx");
        assert!(buf.gather(&bad).is_err());
        assert!(ReplayBuffer::new(0, &Device::Cpu).is_err());
    }
}
