//! [`CudaVsnI8`]: one variable selection network's INT8 weights on the GPU and the launch of
//! `kernels/tft/tft_int8.cu` over them ([`crate::tft::int8`] is the reference). Queued on candle's
//! stream, nothing read back: a CUDA graph can capture it.
//!
//! Blocks take 64 rows each; when the row tiles alone do not fill the device (small
//! batches, the decoder's few rows) the variables split into groups, one block per (tile,
//! group), and a second launch sums the groups' partial mixes in group order. The mix's
//! float sums then run in another order than the reference's single pass over the
//! variables (within F32 rounding; the tests' tolerance covers it).

use candle_core::Device;
use cudarc::driver::{CudaFunction, CudaSlice, CudaStream, DevicePtr, LaunchConfig, PushKernelArg};

use crate::tft::int8::{VsnI8Weights, VsnVarsI8};
use crate::tft::ops::Addr;
use fx_kernels::cuda::{cuda_device, driver, sm_count};
use fx_kernels::{CandleContext, Result};

/// PTX of `kernels/tft/tft_int8.cu` (the INT8 variable selection of a TFT forecast).
const PTX_TFT_INT8: &str = include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/ptx/tft_int8.ptx"));

/// Rows one block takes (the kernel's `FX_VI8_ROWS`).
const TILE_ROWS: usize = 64;
/// Resident blocks per SM the kernel is built for (`__launch_bounds__(256, 2)`).
const BLOCKS_PER_SM: usize = 2;

/// The weights of [`VsnI8Weights`] in device memory, with the kernel loaded.
pub struct CudaVsnI8 {
    stream: std::sync::Arc<CudaStream>,
    func: CudaFunction,
    reduce: CudaFunction,
    /// Blocks the device holds at once (SMs × [`BLOCKS_PER_SM`]).
    slots: usize,
    /// The variable groups' partial mixes (`groups · rows · d ≤` its length; see `groups`).
    partials: CudaSlice<f32>,
    n: usize,
    d: usize,
    eps: f32,
    /// emb_w, emb_b, u1, c1, ws ×3, b ×3, ln_w, ln_b (`n · d` each), then the input steps
    /// (kept alive: `at` points into it).
    _floats: CudaSlice<f32>,
    /// w2, w4, w5 (`n · d · d` each; kept alive for `at`).
    _weights: CudaSlice<i8>,
    /// Device addresses of `floats`, `weights` and `partials`, taken once: a forecast's
    /// launches need no pointer lookups (the slices live as long as `self`).
    at: [Addr; 3],
    dynamic: bool,
}

impl std::fmt::Debug for CudaVsnI8 {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CudaVsnI8(n {}, d {}, {})", self.n, self.d, if self.dynamic { "dynamic" } else { "calibrated" })
    }
}

impl CudaVsnI8 {
    /// Checks `w` and copies it to `device` (CUDA).
    pub fn new(device: &Device, w: &VsnI8Weights) -> Result<Self> {
        const CTX: &str = "CudaVsnI8::new";
        w.check(CTX)?;
        let dev = cuda_device(device, "device", CTX)?;
        let stream = dev.cuda_stream();
        let load = |name: &str| -> Result<CudaFunction> {
            Ok(dev.get_or_load_custom_func(name, "fx_tft_int8", PTX_TFT_INT8).ctx(CTX)?.into_cuda_function())
        };
        let (func, reduce) = (load("fx_tft_vsn_vars_i8")?, load("fx_tft_vsn_reduce")?);
        let slots = sm_count(&stream, CTX)? as usize * BLOCKS_PER_SM;
        // groups · rows ≤ (slots / tiles) · tiles · TILE_ROWS (see `groups`).
        let partials = stream.alloc_zeros::<f32>(slots * TILE_ROWS * w.d).map_err(driver(CTX))?;
        let mut f: Vec<f32> = Vec::with_capacity(12 * w.n * w.d + 2 * w.n);
        for v in [
            &w.emb_w, &w.emb_b, &w.u1, &w.c1, &w.ws[0], &w.ws[1], &w.ws[2], &w.b[0], &w.b[1], &w.b[2], &w.ln_w, &w.ln_b,
        ] {
            f.extend_from_slice(v);
        }
        if let Some((a, b)) = &w.input_steps {
            f.extend_from_slice(a);
            f.extend_from_slice(b);
        }
        let q: Vec<i8> = w.w.iter().flatten().copied().collect();
        let floats = stream.clone_htod(&f).map_err(driver(CTX))?;
        let weights = stream.clone_htod(&q).map_err(driver(CTX))?;
        let at = [floats.device_ptr(&stream).0, weights.device_ptr(&stream).0, partials.device_ptr(&stream).0];
        Ok(Self {
            stream,
            func,
            reduce,
            slots,
            partials,
            n: w.n,
            d: w.d,
            eps: w.eps,
            _floats: floats,
            _weights: weights,
            at,
            dynamic: w.input_steps.is_none(),
        })
    }

    /// Variables and width.
    pub fn dims(&self) -> (usize, usize) {
        (self.n, self.d)
    }

    /// The arguments for `rows` rows: `raw`, `wsel [rows, n]`, `out [rows, d]` on the device.
    pub fn args(&self, rows: usize, raw: Addr, wsel: Addr, out: Addr) -> VsnVarsI8 {
        let [f, q, _] = self.at;
        args_at(f, q, rows, self.n, self.d, self.eps, raw, wsel, out, self.dynamic)
    }

    /// How many groups of variables the blocks of `rows` rows split into: enough blocks to
    /// fill the device (a batch-1 forecast has one row tile: 55 groups of one variable),
    /// never more groups than variables; 1 when the row tiles alone fill it.
    fn groups(&self, rows: usize) -> usize {
        let tiles = rows.div_ceil(TILE_ROWS).max(1);
        (self.slots / tiles).clamp(1, self.n)
    }

    /// Queues the variable selection of `rows` rows on candle's stream.
    ///
    /// # Safety
    /// `raw` and `wsel` hold `rows × n` F32 and `out` `rows × d` F32 on this device, alive
    /// until the kernel ran.
    pub unsafe fn run(&self, rows: usize, raw: Addr, wsel: Addr, out: Addr) -> Result<()> {
        const CTX: &str = "CudaVsnI8::run";
        let a = self.args(rows, raw, wsel, out);
        a.check(CTX)?;
        let groups = self.groups(rows);
        let (rows32, n32, d32, groups32) = (a.rows as u32, a.n as u32, a.d as u32, groups as u32);
        let blocks = u32::try_from(a.rows.div_ceil(TILE_ROWS)).unwrap_or(u32::MAX);
        let cfg = LaunchConfig { grid_dim: (blocks, groups32, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        let len = rows * self.d;
        let part = self.at[2];
        if groups > 1 && groups * len > self.partials.len() {
            return Err(fx_kernels::Error::Unsupported {
                context: CTX,
                message: format!("{groups} groups of {rows} rows beyond the partial sums' {}", self.partials.len()),
            });
        }
        let dst = if groups > 1 { part } else { a.out };
        let mut l = self.stream.launch_builder(&self.func);
        l.arg(&rows32).arg(&n32).arg(&d32).arg(&groups32);
        l.arg(&a.raw).arg(&a.emb_w).arg(&a.emb_b).arg(&a.u1).arg(&a.c1);
        l.arg(&a.w2).arg(&a.w4).arg(&a.w5).arg(&a.ws2).arg(&a.ws4).arg(&a.ws5);
        l.arg(&a.b2).arg(&a.b4).arg(&a.b5).arg(&a.in2).arg(&a.in45).arg(&a.ln_w).arg(&a.ln_b).arg(&a.eps);
        l.arg(&a.wsel).arg(&dst);
        // SAFETY: the weights and partial sums are this struct's own device buffers of the
        // checked sizes; the rows' buffers are the caller's (this function's contract).
        unsafe { l.launch(cfg) }.map_err(driver(CTX))?;
        if groups > 1 {
            let len64 = len as u64;
            let blocks = len.div_ceil(256).min(4096) as u32;
            let mut r = self.stream.launch_builder(&self.reduce);
            r.arg(&part).arg(&groups32).arg(&len64).arg(&a.out);
            let cfg = LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
            // SAFETY: `part` holds groups × len F32 (checked above), `out` len (the contract).
            unsafe { r.launch(cfg) }.map_err(driver(CTX))?;
        }
        Ok(())
    }
}

/// The arguments with the floats at `f` and the weights at `q` laid out as
/// [`CudaVsnI8::new`] copies them.
#[allow(clippy::too_many_arguments)]
fn args_at(
    f: Addr,
    q: Addr,
    rows: usize,
    n: usize,
    d: usize,
    eps: f32,
    raw: Addr,
    wsel: Addr,
    out: Addr,
    dynamic: bool,
) -> VsnVarsI8 {
    let nd = (n * d * 4) as Addr;
    let at = |k: u64| f + k * nd;
    let (in2, in45) = if dynamic { (0, 0) } else { (at(12), at(12) + (n * 4) as Addr) };
    let mat = (n * d * d) as Addr;
    VsnVarsI8 {
        rows,
        n,
        d,
        raw,
        emb_w: at(0),
        emb_b: at(1),
        u1: at(2),
        c1: at(3),
        ws2: at(4),
        ws4: at(5),
        ws5: at(6),
        b2: at(7),
        b4: at(8),
        b5: at(9),
        ln_w: at(10),
        ln_b: at(11),
        in2,
        in45,
        w2: q,
        w4: q + mat,
        w5: q + 2 * mat,
        eps,
        wsel,
        out,
    }
}

#[cfg(test)]
mod gpu_tests {
    use super::*;
    use crate::tft::int8::testing::{rel_rms, selection, uniform, VsnF32};
    use candle_core::Tensor;

    fn gpu() -> Option<Device> {
        fx_hw::test_gpu("cuda::tft_int8")
    }

    fn seed() -> u64 {
        fx_hw::test_seed(concat!(module_path!(), ":", line!()))
    }

    /// The kernel against the reference on fresh random inputs: the encoder's shape (55
    /// variables of 128, rows not a multiple of the tile) and smaller ones, a width whose K
    /// is zero-padded (36), dynamic and calibrated steps, variables split into groups (all
    /// but the last case) and not (the last: more row tiles than the device holds).
    #[test]
    fn int8_variable_selection_on_the_gpu_matches_the_reference() {
        let Some(dev) = gpu() else { return };
        let s = seed();
        let cases = [
            (55, 128, 1000, false),
            (4, 128, 77, true),
            (7, 64, 200, false),
            (3, 36, 31, true),
            (2, 32, 40_000, false),
        ];
        for (n, d, rows, steps) in cases {
            let p = VsnF32::random(n, d, s);
            let w = p.int8(steps.then(|| (vec![0.04; n], vec![0.04; n])));
            let raw = uniform(rows * n, s + 100, 2.0);
            let wsel = selection(rows, n, s + 200);
            let want = w.forward_ref(&raw, &wsel).expect("reference");
            let k = CudaVsnI8::new(&dev, &w).expect("upload");
            let raw_t = Tensor::from_slice(&raw, (rows * n,), &dev).expect("raw");
            let wsel_t = Tensor::from_slice(&wsel, (rows * n,), &dev).expect("wsel");
            let out_t = Tensor::zeros((rows * d,), candle_core::DType::F32, &dev).expect("out");
            let cdev = cuda_device(&dev, "device", "test").expect("cuda");
            let st = cdev.cuda_stream();
            let ptr = |t: &Tensor| fx_kernels::cuda::dev_ptr::<f32>(t, &st, "buffer", "test").expect("ptr");
            // SAFETY: the three tensors hold rows × n, rows × n and rows × d F32 and live
            // past the read below (which synchronises).
            unsafe { k.run(rows, ptr(&raw_t), ptr(&wsel_t), ptr(&out_t)) }.expect("launch");
            let got: Vec<f32> = out_t.to_vec1().expect("read");
            assert!(got.iter().all(|v| v.is_finite()), "seed {s}: non-finite output");
            let want64: Vec<f64> = want.iter().map(|&v| f64::from(v)).collect();
            let worst = got.iter().zip(&want).map(|(g, w)| (g - w).abs()).fold(0f32, f32::max);
            let e = rel_rms(&got, &want64);
            eprintln!(
                "n {n} d {d} rows {rows} calibrated {steps} ({} groups): rel RMS {e:.2e}, max |diff| {worst:.2e}",
                k.groups(rows)
            );
            // An ulp apart in expf can move an activation across a rounding boundary, one
            // INT8 step in one input of one product: tiny against the output's scale.
            assert!(e < 1e-3 && worst < 2e-2, "seed {s}, n {n} d {d}: rel RMS {e:.2e}, max {worst:.2e}");
            let f32_ref = p.forward_f64(&raw, &wsel, 1e-5);
            let e32 = rel_rms(&got, &f32_ref);
            assert!(e32 < 0.05, "seed {s}, n {n} d {d}: {e32:.4} from F32");
        }
    }

    /// Device time of one launch at the encoder's shape at batch 256 (55 variables × 16,384
    /// rows of 128): printed for the profile of an INT8 forecast, not asserted (speed is
    /// the benchmark's job).
    #[test]
    fn int8_variable_selection_device_time_at_batch_256() {
        let Some(dev) = gpu() else { return };
        let (n, d, rows) = (55, 128, 64 * 256);
        let p = VsnF32::random(n, d, 5);
        let k = CudaVsnI8::new(&dev, &p.int8(None)).expect("upload");
        let raw = Tensor::from_slice(&uniform(rows * n, 6, 2.0), (rows * n,), &dev).expect("raw");
        let wsel = Tensor::from_slice(&selection(rows, n, 7), (rows * n,), &dev).expect("wsel");
        let out = Tensor::zeros((rows * d,), candle_core::DType::F32, &dev).expect("out");
        let cdev = cuda_device(&dev, "device", "test").expect("cuda");
        let st = cdev.cuda_stream();
        let ptr = |t: &Tensor| fx_kernels::cuda::dev_ptr::<f32>(t, &st, "buffer", "test").expect("ptr");
        let (r, w, o) = (ptr(&raw), ptr(&wsel), ptr(&out));
        let reps = 20;
        for _ in 0..3 {
            // SAFETY: the tensors above hold rows × n, rows × n, rows × d F32 until the end.
            unsafe { k.run(rows, r, w, o) }.expect("launch");
        }
        dev.synchronize().expect("sync");
        let t0 = std::time::Instant::now();
        for _ in 0..reps {
            // SAFETY: as above.
            unsafe { k.run(rows, r, w, o) }.expect("launch");
        }
        dev.synchronize().expect("sync");
        let us = t0.elapsed().as_secs_f64() * 1e6 / f64::from(reps);
        let macs = (3 * rows * n * d * d) as f64;
        eprintln!(
            "INT8 variable selection, {n} variables x {rows} rows x {d}: {us:.0} us a launch, {:.1} T int8 MAC/s",
            macs / us / 1e6
        );
    }
}
