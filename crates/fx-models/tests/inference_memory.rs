//! Measures what `forward_inference` saves: the bytes a forward output keeps alive.
//!
//! A counting global allocator tracks live heap bytes (this file is its own test binary,
//! with one test, so nothing else allocates concurrently). The training forward's output
//! holds the autograd graph and with it every intermediate activation; the inference
//! forward's output holds only itself.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicIsize, Ordering};

use candle_core::{DType, Device, Tensor};
use fx_models::{ActorCritic, DqnNetConfig, DuelingDqn, PpoNetConfig};

struct Counting;

static LIVE: AtomicIsize = AtomicIsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        LIVE.fetch_add(l.size() as isize, Ordering::SeqCst);
        unsafe { System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        LIVE.fetch_sub(l.size() as isize, Ordering::SeqCst);
        unsafe { System.dealloc(p, l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        LIVE.fetch_add(new as isize - l.size() as isize, Ordering::SeqCst);
        unsafe { System.realloc(p, l, new) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// Live bytes held by what `f` returns (measured while it is alive).
fn retained<T>(f: impl FnOnce() -> T) -> isize {
    let before = LIVE.load(Ordering::SeqCst);
    let out = f();
    let held = LIVE.load(Ordering::SeqCst) - before;
    drop(out);
    held
}

#[test]
fn inference_forward_retains_no_activations() {
    let dev = Device::Cpu;
    let b = 2048;
    let s = Tensor::randn(0f32, 1.0, (b, 56), &dev).unwrap().to_dtype(DType::F32).unwrap();

    let dqn = DuelingDqn::new(DqnNetConfig::default(), &dev, 0).unwrap();
    let train = retained(|| dqn.forward(&s).unwrap());
    let infer = retained(|| dqn.forward_inference(&s).unwrap());
    // Activations of h = 256: 3 trunk layers (pre- and post-ReLU) and the heads, ~12 MB.
    let out_bytes = (b * 3 * 4) as isize;
    eprintln!("DQN  batch {b}: training forward keeps {train} B, inference {infer} B (output {out_bytes} B)");
    assert!(train > 20 * out_bytes, "training forward should keep its activations ({train} B)");
    assert!(infer <= out_bytes + 4096, "inference forward kept {infer} B beyond its output");

    let ac = ActorCritic::new(PpoNetConfig::default(), &dev, 0).unwrap();
    let train = retained(|| ac.forward(&s).unwrap());
    let infer = retained(|| ac.forward_inference(&s).unwrap());
    let out_bytes = (b * 4 * 4) as isize;
    eprintln!("PPO  batch {b}: training forward keeps {train} B, inference {infer} B (outputs {out_bytes} B)");
    assert!(train > 20 * out_bytes);
    assert!(infer <= out_bytes + 4096, "inference forward kept {infer} B beyond its outputs");
}
