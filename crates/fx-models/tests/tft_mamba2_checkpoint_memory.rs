//! Peak memory of one training step (forward + loss + backward) of the TFT and the
//! MAMBA-2, plain vs activation-checkpointed, on the CPU.
//!
//! Counting method as in fx-precision's `activation_memory` test: this binary installs a
//! global allocator that tracks live heap bytes and their peak; candle's CPU tensors own
//! their buffers on the heap, so the peak above the pre-step baseline is the step's
//! activation + gradient memory (parameters exist before the baseline). One test
//! function, so no concurrent test allocates; a warm-up step first lets thread pools and
//! gemm scratch buffers reach their steady state.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

use candle_core::{Device, Tensor};
use fx_models::mamba2::{Mamba2, Mamba2Config};
use fx_models::tft::{Tft, TftConfig};
use fx_models::Ctx;
use fx_precision::Precision;

struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            let now = LIVE.fetch_add(layout.size(), Ordering::SeqCst) + layout.size();
            PEAK.fetch_max(now, Ordering::SeqCst);
        }
        p
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) };
        LIVE.fetch_sub(layout.size(), Ordering::SeqCst);
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            if new_size >= layout.size() {
                let now = LIVE.fetch_add(new_size - layout.size(), Ordering::SeqCst) + new_size - layout.size();
                PEAK.fetch_max(now, Ordering::SeqCst);
            } else {
                LIVE.fetch_sub(layout.size() - new_size, Ordering::SeqCst);
            }
        }
        p
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// Peak bytes above the baseline while `step` runs (its results dropped inside).
fn peak_of(step: impl FnOnce()) -> usize {
    let base = LIVE.load(Ordering::SeqCst);
    PEAK.store(base, Ordering::SeqCst);
    step();
    PEAK.load(Ordering::SeqCst) - base
}

#[test]
fn checkpointing_lowers_peak_step_memory() {
    let dev = Device::Cpu;
    let c = Ctx::train(Precision::F32);

    let cfg = TftConfig { d: 32, n_head: 4, l_enc: 32, h: 8, ..TftConfig::default() };
    let tft = Tft::new(cfg, &dev, 1).unwrap();
    let obs = Tensor::randn(0f32, 1.0, (8, 32, 51), &dev).unwrap();
    let known = Tensor::randn(0f32, 1.0, (8, 40, 4), &dev).unwrap();
    let y = Tensor::randn(0f32, 0.01, (8, 8), &dev).unwrap();
    let tft_step = |ck: bool| drop(tft.loss_and_grads(&c, &obs, &known, &y, ck).unwrap());
    tft_step(false);
    tft_step(true);
    let tft_plain = peak_of(|| tft_step(false));
    let tft_ck = peak_of(|| tft_step(true));

    let cfg =
        Mamba2Config { d_model: 64, n_layer: 6, d_state: 16, headdim: 16, chunk_size: 16, ..Mamba2Config::default() };
    let m = Mamba2::new(cfg, &dev, 1).unwrap();
    let x = Tensor::randn(0f32, 1.0, (4, 64, 51), &dev).unwrap();
    let t = Tensor::randn(0f32, 0.01, (4, 64), &dev).unwrap();
    let m_step = |ck: bool| drop(m.loss_and_grads(&c, &x, &t, ck).unwrap());
    m_step(false);
    m_step(true);
    let m_plain = peak_of(|| m_step(false));
    let m_ck = peak_of(|| m_step(true));

    let mib = |b: usize| b as f64 / (1 << 20) as f64;
    eprintln!(
        "peak step memory above parameters: TFT plain {:.2} MiB, checkpointed {:.2} MiB ({:.0}%); \
         MAMBA-2 plain {:.2} MiB, checkpointed {:.2} MiB ({:.0}%)",
        mib(tft_plain),
        mib(tft_ck),
        100.0 * tft_ck as f64 / tft_plain as f64,
        mib(m_plain),
        mib(m_ck),
        100.0 * m_ck as f64 / m_plain as f64
    );
    assert!((tft_ck as f64) < 0.6 * tft_plain as f64, "TFT: checkpointed {tft_ck} B vs plain {tft_plain} B");
    assert!((m_ck as f64) < 0.7 * m_plain as f64, "MAMBA-2: checkpointed {m_ck} B vs plain {m_plain} B");
}
