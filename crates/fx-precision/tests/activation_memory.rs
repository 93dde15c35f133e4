//! Activation memory of a deep MLP stack, plain vs checkpointed, on the CPU.
//!
//! Counting method: this test binary installs a global allocator that wraps the system
//! allocator and keeps the number of live heap bytes (and their peak). candle's CPU
//! tensors own their buffers on the heap, so "bytes live after the forward minus bytes
//! live before it" is exactly what the forward left alive for the backward: the
//! activations held by the autograd graph (plain) or the saved segment inputs (checkpointed),
//! plus the output and loss in both cases. Parameters exist before the baseline and do not
//! count. The measurement lives in its own test binary (one test, no concurrent tests
//! allocating), and a warm-up pass first lets thread pools and gemm's per-thread scratch
//! buffers reach their steady state.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

use candle_core::{DType, Device, Module, Tensor, Var};
use fx_precision::{Linear, Precision, Recomputed};

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

struct Measure {
    held_after_forward: usize,
    peak_above_baseline: usize,
}

/// Forward + loss, reading the live bytes, then backward; everything is dropped before
/// returning so the next run starts from the same baseline.
fn run(stack: &Recomputed<'_>, x: &Tensor, checkpointed: bool) -> Measure {
    let base = LIVE.load(Ordering::SeqCst);
    PEAK.store(base, Ordering::SeqCst);
    let held_after_forward;
    if checkpointed {
        let tape = stack.forward(x).unwrap();
        let loss = tape.output().sqr().unwrap().mean_all().unwrap();
        held_after_forward = LIVE.load(Ordering::SeqCst) - base;
        let g = stack.backward(tape, &loss).unwrap();
        drop((loss, g));
    } else {
        let loss = stack.forward_plain(x).unwrap().sqr().unwrap().mean_all().unwrap();
        held_after_forward = LIVE.load(Ordering::SeqCst) - base;
        let g = loss.backward().unwrap();
        drop((loss, g));
    }
    Measure { held_after_forward, peak_above_baseline: PEAK.load(Ordering::SeqCst) - base }
}

#[test]
fn checkpointing_halves_activation_memory_of_a_deep_mlp() {
    let dev = Device::Cpu;
    let (depth, layers_per_segment, batch, width) = (12, 2, 128, 64);
    let mut layers = Vec::new();
    for i in 0..depth * layers_per_segment {
        let w = Var::randn(0f32, 0.1, (width, width), &dev).unwrap();
        let b = Var::zeros(width, DType::F32, &dev).unwrap();
        layers.push((w, b, i));
    }
    let mut stack = Recomputed::new();
    for seg in layers.chunks(layers_per_segment) {
        let ls: Vec<Linear> = seg
            .iter()
            .map(|(w, b, _)| {
                Linear::from_parts(w.as_tensor().clone(), Some(b.as_tensor().clone()), Precision::F32).unwrap()
            })
            .collect();
        stack = stack.push(move |h: &Tensor| {
            let mut y = h.clone();
            for l in &ls {
                y = l.forward(&y)?.tanh()?;
            }
            Ok(y)
        });
    }
    let x = Tensor::randn(0f32, 1.0, (batch, width), &dev).unwrap();

    // Warm-up (thread pools, per-thread scratch), then the measured runs.
    let _ = run(&stack, &x, false);
    let _ = run(&stack, &x, true);
    let p = run(&stack, &x, false);
    let c = run(&stack, &x, true);
    let act_bytes = batch * width * 4;
    println!(
        "plain: held {} B ({:.1} activations), peak {} B; checkpointed: held {} B ({:.1} activations), peak {} B",
        p.held_after_forward,
        p.held_after_forward as f64 / act_bytes as f64,
        p.peak_above_baseline,
        c.held_after_forward,
        c.held_after_forward as f64 / act_bytes as f64,
        c.peak_above_baseline
    );
    // The plain graph holds ~3 tensors per layer (matmul, bias add, tanh) over 24 layers;
    // the checkpointed forward holds one input per segment (12) plus the output.
    assert!(
        p.held_after_forward >= 2 * depth * layers_per_segment * act_bytes,
        "plain held less than expected: {}",
        p.held_after_forward
    );
    assert!(
        (c.held_after_forward as f64) <= 0.5 * p.held_after_forward as f64,
        "checkpointed forward holds {} B, plain {} B",
        c.held_after_forward,
        p.held_after_forward
    );
    // Backward recomputes one segment at a time, so the peak falls too.
    assert!(
        (c.peak_above_baseline as f64) <= 0.5 * p.peak_above_baseline as f64,
        "checkpointed peak {} B, plain {} B",
        c.peak_above_baseline,
        p.peak_above_baseline
    );

    // Gradient accumulation must not pin the micro-batches' graphs either: after N
    // backward passes (losses dropped) only the F32 gradient sums remain.
    // The loss multiplies a Var straight into the last activation: candle's gradient for
    // that Var is `grad * activation`, which on its own would pin the whole graph.
    let gate = Var::ones((batch, width), DType::F32, &dev).unwrap();
    let mut vars: Vec<Var> = layers.iter().flat_map(|(w, b, _)| [w.clone(), b.clone()]).collect();
    vars.push(gate.clone());
    let param_bytes: usize = vars.iter().map(|v| v.elem_count() * 4).sum();
    let mut acc = fx_precision::GradAccumulator::new(vars, 4).unwrap();
    let base = LIVE.load(Ordering::SeqCst);
    for _ in 0..4 {
        let out = stack.forward_plain(&x).unwrap();
        let loss = (out * gate.as_tensor()).unwrap().sqr().unwrap().mean_all().unwrap();
        acc.backward(&loss).unwrap();
    }
    let held = LIVE.load(Ordering::SeqCst) - base;
    println!("accumulation: {held} B held for {param_bytes} B of parameters");
    assert!(held < param_bytes + param_bytes / 4, "accumulator holds {held} B");
    drop(acc.take().unwrap());
}
