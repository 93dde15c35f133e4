//! Recurrent decoding of a [`Mamba2`], one new bar at a time, for a trading loop.
//!
//! On the CPU, [`Mamba2::cpu_step`] gives an `crate::mamba2::decode_cpu::Mamba2CpuStep`: the
//! model's weights copied once, the step on the calling thread with no thread pool and no
//! allocation; [`Mamba2State::layer_states`] hands it the state after a history.
//!
//! On CUDA, the fused decode-step kernel (`crate::mamba2::decode_cuda`, feature `cuda`):
//! [`Mamba2Decoder::step`] is one kernel
//! launch on a thread-block cluster of 16 SMs, or 8 (Hopper+) where [`Mamba2::step`] is ~60 candle
//! launches, with the same math to F32 rounding (the kernel's f64 reference is
//! `crate::mamba2::decode_ref`, tested here against [`Mamba2::step`] on the CPU).
//!
//! The decoder owns the recurrent state (a [`Mamba2State`] of its own buffers, which the kernel
//! updates in place) and the prediction buffer; it reads the model's parameters where they are, so
//! in-place updates of them (`Var::set`, the optimisers, `ParamStore::load`) are seen, while a model
//! built anew needs a new decoder. Start from a prefill with [`Mamba2Decoder::load_state`] (the
//! state of [`Mamba2::forward_with_state`]) and read the state back with [`Mamba2Decoder::state`].
//! A step reads nothing to the host and uses fixed addresses, so a CUDA graph can capture it
//! (`fx_precision::CapturedGraph`) on an input buffer refilled in place.

use crate::mamba2::decode_cpu::Mamba2CpuStep;
use crate::mamba2::decode_ref::{HostStepParams, LayerState, StepDims};
use candle_core::{DType, Tensor};

use super::{Mamba2, Mamba2Config, Mamba2State};
use crate::error::{Context, Error, Result};

fn host(t: &Tensor, ctx: &'static str) -> Result<Vec<f64>> {
    t.to_dtype(DType::F64).and_then(|t| t.flatten_all()).and_then(|t| t.to_vec1()).ctx(ctx)
}

/// f64 host copies of a model's parameters, in the reference's order.
pub(crate) fn host_params(m: &Mamba2) -> Result<HostStepParams> {
    const CTX: &str = "mamba2::decode::host_params";
    let g = [&m.embed_w, &m.embed_b, &m.norm_f, &m.head_w, &m.head_b];
    let layers = m
        .layers
        .iter()
        .map(|l| {
            let x = &l.mixer;
            [&l.norm_w, &x.in_proj, &x.conv_w, &x.conv_b, &x.dt_bias, &x.a_log, &x.d, &x.norm_w, &x.out_proj]
                .iter()
                .map(|v| host(v.as_tensor(), CTX))
                .collect::<Result<Vec<_>>>()
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(HostStepParams { globals: g.iter().map(|v| host(v.as_tensor(), CTX)).collect::<Result<_>>()?, layers })
}

impl Mamba2 {
    /// The model's recurrent step on the CPU, one bar at a time (batch 1), from a zero state:
    /// its weights copied into an `crate::mamba2::decode_cpu::Mamba2CpuStep`, which then computes
    /// on the calling thread with no allocation. A model trained further needs a new one.
    pub fn cpu_step(&self) -> Result<Mamba2CpuStep> {
        const CTX: &str = "Mamba2::cpu_step";
        let params = host_params(self)?;
        Mamba2CpuStep::new(&step_dims(self.config(), 1), &params.view()).ctx(CTX)
    }

    /// [`Mamba2::cpu_step`] with the layers' projections built by `make` (INT8 rows:
    /// `fx_quant::mamba2_int8_step`).
    pub fn cpu_step_with(&self, make: &mut crate::mamba2::decode_cpu::MakeProjection<'_>) -> Result<Mamba2CpuStep> {
        const CTX: &str = "Mamba2::cpu_step_with";
        let params = host_params(self)?;
        Mamba2CpuStep::with_projections(&step_dims(self.config(), 1), &params.view(), make).ctx(CTX)
    }
}

impl Mamba2State {
    /// Every layer's state as f64 host copies in the kernels' reference layout (a batch-1
    /// state starts a [`Mamba2CpuStep`] after a history: `Mamba2CpuStep::set_state`).
    pub fn layer_states(&self) -> Result<Vec<LayerState>> {
        const CTX: &str = "Mamba2State::layer_states";
        if self.conv.len() != self.ssm.len() {
            return Err(Error::config(CTX, "conv and SSM states of different layer counts"));
        }
        self.conv
            .iter()
            .zip(&self.ssm)
            .map(|(c, m)| Ok(LayerState { conv: host(c, CTX)?, ssm: host(m, CTX)? }))
            .collect()
    }
}
#[cfg(feature = "cuda")]
pub use gpu::Mamba2Decoder;

/// The decode step's sizes for `cfg` at `batch` rows.
fn step_dims(cfg: &Mamba2Config, batch: usize) -> StepDims {
    StepDims {
        batch,
        n_in: cfg.n_in,
        d_model: cfg.d_model,
        n_layer: cfg.n_layer,
        d_inner: cfg.d_inner(),
        d_state: cfg.d_state,
        headdim: cfg.headdim,
        ngroups: cfg.ngroups,
        d_conv: cfg.d_conv,
        eps: cfg.norm_eps,
    }
}

#[cfg(feature = "cuda")]
mod gpu {
    use crate::mamba2::decode_cuda::{Mamba2StepKernel, StepLayerTensors, StepTensors};
    use candle_core::{DType, Device, Tensor};

    use super::step_dims;
    use crate::error::{Context, Error, Result};
    use crate::mamba2::{Mamba2, Mamba2State};

    /// A [`Mamba2`]'s fused decode step at a fixed batch (see the module docs).
    #[derive(Debug)]
    pub struct Mamba2Decoder {
        kernel: Mamba2StepKernel,
        /// The recurrent state the kernel reads and writes in place (contiguous buffers of its own).
        state: Mamba2State,
        /// `[batch]` F32, rewritten by every step.
        pred: Tensor,
        n_in: usize,
    }

    impl Mamba2Decoder {
        /// A decoder for `batch` sequences of `model` (parameters on a CUDA device), its state zero
        /// (before the first bar). Errors: an `Error::Config` off CUDA or for batch 0; the kernel's
        /// `fx_kernels::Error::Unsupported` (inside [`Error::Kernels`]) for batch > 8, sizes beyond
        /// its limits, or a device below compute capability 9.0 — [`Mamba2::step`] still runs there.
        pub fn new(model: &Mamba2, batch: usize) -> Result<Self> {
            const CTX: &str = "Mamba2Decoder::new";
            let device = model.params().device();
            if !device.is_cuda() {
                return Err(Error::config(CTX, "the model's parameters must live on a CUDA device"));
            }
            if batch == 0 {
                return Err(Error::config(CTX, "batch 0"));
            }
            let cfg = model.config();
            let state = model.init_state(batch)?;
            let pred = Tensor::zeros(batch, DType::F32, device).ctx(CTX)?;
            let layers = model
                .layers
                .iter()
                .zip(state.conv.iter().zip(&state.ssm))
                .map(|(l, (conv, ssm))| {
                    let m = &l.mixer;
                    StepLayerTensors {
                        norm_w: l.norm_w.as_tensor(),
                        in_proj: m.in_proj.as_tensor(),
                        conv_w: m.conv_w.as_tensor(),
                        conv_b: m.conv_b.as_tensor(),
                        dt_bias: m.dt_bias.as_tensor(),
                        a_log: m.a_log.as_tensor(),
                        d: m.d.as_tensor(),
                        gnorm_w: m.norm_w.as_tensor(),
                        out_proj: m.out_proj.as_tensor(),
                        conv_state: conv,
                        ssm_state: ssm,
                    }
                })
                .collect();
            let tensors = StepTensors {
                embed_w: model.embed_w.as_tensor(),
                embed_b: model.embed_b.as_tensor(),
                layers,
                norm_f: model.norm_f.as_tensor(),
                head_w: model.head_w.as_tensor(),
                head_b: model.head_b.as_tensor(),
            };
            let kernel = Mamba2StepKernel::new(&step_dims(cfg, batch), &tensors).ctx(CTX)?;
            Ok(Self { kernel, state, pred, n_in: cfg.n_in })
        }

        /// The batch it decodes.
        pub fn batch(&self) -> usize {
            self.kernel.dims().batch
        }

        /// The CUDA device of the model, the state and the prediction.
        pub fn device(&self) -> &Device {
            self.kernel.device()
        }

        /// Overwrites the decoder's state in place with `state` (same model and batch), e.g. the
        /// state after a prefill ([`Mamba2::forward_with_state`]); views are fine.
        pub fn load_state(&self, state: &Mamba2State) -> Result<()> {
            self.state.assign(state)
        }

        /// Zeroes the state in place (the state before the first bar).
        pub fn reset(&self) -> Result<()> {
            const CTX: &str = "Mamba2Decoder::reset";
            for t in self.state.conv.iter().chain(&self.state.ssm).filter(|t| t.elem_count() > 0) {
                t.slice_set(&t.zeros_like().ctx(CTX)?, 0, 0).ctx(CTX)?;
            }
            Ok(())
        }

        /// A copy of the current state in fresh buffers (queued after every step so far).
        pub fn state(&self) -> Result<Mamba2State> {
            self.state.to_buffers()
        }

        /// Consumes one bar `x [B, n_in]` (converted to contiguous F32 when it is not: no copy for
        /// a contiguous F32 buffer) and queues the step on candle's stream: the state advances in
        /// place and the predictions `[B]` (F32) land in the decoder's prediction buffer, which is
        /// returned (a handle to it: the next step overwrites it; copy it to keep it). Nothing is
        /// read to the host.
        pub fn step(&self, x: &Tensor) -> Result<Tensor> {
            const CTX: &str = "Mamba2Decoder::step";
            if x.dims() != [self.batch(), self.n_in] {
                return Err(Error::shape(
                    "x",
                    CTX,
                    format!("[{}, {}] (batch, n_in)", self.batch(), self.n_in),
                    format!("{:?}", x.dims()),
                ));
            }
            let x = x.to_dtype(DType::F32).and_then(|t| t.contiguous()).ctx(CTX)?;
            self.kernel.launch(&x, &self.pred).ctx(CTX)?;
            Ok(self.pred.clone())
        }

        /// The prediction buffer `[B]` (F32) every step writes, e.g. to read after a replay of a
        /// captured step.
        pub fn prediction(&self) -> &Tensor {
            &self.pred
        }

        /// Blocks of the kernel's thread-block cluster (16 where the device allows, else 8).
        pub fn cluster_blocks(&self) -> usize {
            self.kernel.cluster_blocks()
        }

        /// Whether the kernel stages its weight slices in shared memory (batch 1, where they fit).
        pub fn stages_weights(&self) -> bool {
            self.kernel.stages_weights()
        }
    }
}

#[cfg(test)]
mod tests {
    //! CPU: the kernel's f64 reference against [`Mamba2::step`] (candle, F32) for a few bars from a
    //! prefilled state, predictions and state. CUDA (feature `cuda`; each test returns early without
    //! a GPU, or, where the kernel needs one, without compute capability 9.0): the decoder against
    //! [`Mamba2::step`] on the GPU over 10 bars from a prefill, state included; a captured graph's
    //! replays against eager steps, bit for bit; refusals.
    use crate::mamba2::decode_ref::step;
    use candle_core::{DType, Device, Tensor};
    use fx_precision::Precision;

    use super::*;
    use crate::seq::ops::Ctx;

    fn host(t: &Tensor) -> Vec<f64> {
        t.to_dtype(DType::F64).unwrap().flatten_all().unwrap().to_vec1().unwrap()
    }

    /// ‖got − want‖ / ‖want‖, every element finite.
    fn rel(got: &[f64], want: &[f64]) -> f64 {
        assert_eq!(got.len(), want.len());
        if got.iter().any(|v| !v.is_finite()) {
            return f64::INFINITY;
        }
        let n = got.iter().zip(want).map(|(a, b)| (a - b) * (a - b)).sum::<f64>().sqrt();
        n / want.iter().map(|b| b * b).sum::<f64>().sqrt().max(1e-30)
    }

    fn ref_state(s: &Mamba2State) -> Vec<LayerState> {
        s.layer_states().unwrap()
    }

    fn small(ngroups: usize) -> Mamba2Config {
        Mamba2Config {
            n_in: 5,
            d_model: 12,
            n_layer: 2,
            expand: 2,
            d_state: 6,
            headdim: 4,
            ngroups,
            d_conv: 3,
            chunk_size: 5,
            norm_eps: 1e-5,
        }
    }

    /// Every layer's conv and SSM state within `tol`.
    fn check_state(tag: &str, got: &[LayerState], want: &[LayerState], tol: f64) {
        for (l, (g, w)) in got.iter().zip(want).enumerate() {
            let (ec, es) = (rel(&g.conv, &w.conv), rel(&g.ssm, &w.ssm));
            eprintln!("{tag}: layer {l} conv state rel err {ec:.2e}, ssm {es:.2e}");
            assert!(ec <= tol && es <= tol, "{tag}: layer {l} state rel err conv {ec}, ssm {es}");
        }
    }

    #[test]
    fn reference_matches_candle_step_on_cpu() {
        let dev = Device::Cpu;
        let c = Ctx::inference(Precision::F32);
        for (cfg, batch, hist, seed) in [(Mamba2Config::default(), 2, 12, 1), (small(2), 3, 9, 2), (small(1), 1, 1, 3)]
        {
            let tag = format!("{cfg:?} batch {batch}");
            let m = Mamba2::new(cfg.clone(), &dev, seed).unwrap();
            let x = Tensor::randn(0f32, 1.0, (batch, hist + 3, cfg.n_in), &dev).unwrap();
            let (_, views) = m.forward_with_state(&c, &x.narrow(1, 0, hist).unwrap()).unwrap();
            let mut st = views.to_buffers().unwrap();
            let mut rs = ref_state(&st);
            let (rp, dims) = (host_params(&m).unwrap(), step_dims(&cfg, batch));
            let p = rp.view();
            let (mut got, mut want) = (Vec::new(), Vec::new());
            for t in hist..hist + 3 {
                let xt = x.narrow(1, t, 1).unwrap().squeeze(1).unwrap();
                got.extend(host(&m.step(&c, &xt, &mut st).unwrap()));
                want.extend(step(&dims, &p, &mut rs, &host(&xt)).unwrap());
            }
            let e = rel(&got, &want);
            eprintln!("{tag}: predictions rel err {e:.2e}");
            assert!(e <= 1e-5, "{tag}: predictions rel err {e}");
            check_state(&tag, &ref_state(&st), &rs, 1e-5);
        }
    }

    /// The CPU one-bar step against candle's [`Mamba2::step`] over 6 bars after a history,
    /// predictions and state (F32 both, different summation orders).
    #[test]
    fn cpu_step_matches_candle_step() {
        let dev = Device::Cpu;
        let c = Ctx::inference(Precision::F32);
        for (cfg, hist, seed) in [(Mamba2Config::default(), 10, 4), (small(2), 7, 5)] {
            let tag = format!("{cfg:?}");
            let m = Mamba2::new(cfg.clone(), &dev, seed).unwrap();
            let x = Tensor::randn(0f32, 1.0, (1, hist + 6, cfg.n_in), &dev).unwrap();
            let (_, views) = m.forward_with_state(&c, &x.narrow(1, 0, hist).unwrap()).unwrap();
            let mut st = views.to_buffers().unwrap();
            let mut fast = m.cpu_step().unwrap();
            fast.set_state(&st.layer_states().unwrap()).unwrap();
            let (mut got, mut want) = (Vec::new(), Vec::new());
            for t in hist..hist + 6 {
                let xt = x.narrow(1, t, 1).unwrap().squeeze(1).unwrap();
                want.extend(host(&m.step(&c, &xt, &mut st).unwrap()));
                let bar: Vec<f32> = xt.flatten_all().unwrap().to_vec1().unwrap();
                got.push(f64::from(fast.step(&bar).unwrap()));
            }
            let e = rel(&got, &want);
            eprintln!("{tag}: CPU step predictions rel err {e:.2e}");
            assert!(e <= 1e-5, "{tag}: CPU step predictions rel err {e}");
            check_state(&tag, &fast.state(), &ref_state(&st), 1e-5);
        }
    }

    #[cfg(feature = "cuda")]
    mod gpu {
        use fx_precision::CapturedGraph;

        use super::*;
        use crate::error::Error;
        use crate::mamba2::decode::Mamba2Decoder;

        use fx_hw::test_gpu as gpu;

        /// The decoder, or None when the device cannot run the kernel (below compute capability 9.0).
        fn decoder(test: &str, m: &Mamba2, batch: usize) -> Option<Mamba2Decoder> {
            match Mamba2Decoder::new(m, batch) {
                Ok(d) => Some(d),
                Err(Error::Kernels { source, .. }) if matches!(*source, fx_kernels::Error::Unsupported { .. }) => {
                    eprintln!("{test}: skipped, {source}");
                    None
                }
                Err(e) => panic!("{test}: {e}"),
            }
        }

        /// 10 bars from a prefill: every prediction and the final state against candle's step on
        /// the same GPU (≤ 1e-5 relative).
        #[test]
        fn decoder_matches_candle_step_on_gpu() {
            const T: &str = "decoder_matches_candle_step_on_gpu";
            let Some(dev) = gpu(T) else { return };
            let c = Ctx::inference(Precision::F32);
            for (cfg, batch, hist, seed) in [
                (Mamba2Config::default(), 1, 64, 1),
                (Mamba2Config::default(), 3, 20, 2),
                (small(2), 8, 9, 3),
                (small(1), 2, 2, 4),
            ] {
                let tag = format!("{cfg:?} batch {batch}");
                let m = Mamba2::new(cfg.clone(), &dev, seed).unwrap();
                let Some(dec) = decoder(T, &m, batch) else { return };
                let x = Tensor::randn(0f32, 1.0, (batch, hist + 10, cfg.n_in), &dev).unwrap();
                let (_, views) = m.forward_with_state(&c, &x.narrow(1, 0, hist).unwrap()).unwrap();
                let mut st = views.to_buffers().unwrap();
                dec.load_state(&views).unwrap();
                let (mut got, mut want) = (Vec::new(), Vec::new());
                for t in hist..hist + 10 {
                    let xt = x.narrow(1, t, 1).unwrap().squeeze(1).unwrap();
                    want.extend(host(&m.step(&c, &xt, &mut st).unwrap()));
                    got.extend(host(&dec.step(&xt).unwrap()));
                }
                let e = rel(&got, &want);
                eprintln!("{tag}: predictions rel err {e:.2e}");
                assert!(e <= 1e-5, "{tag}: predictions rel err {e}");
                check_state(&tag, &ref_state(&dec.state().unwrap()), &ref_state(&st), 1e-5);
            }
        }

        /// A captured step replayed on an input buffer refilled in place equals the eager step bit
        /// for bit, predictions and state, bar after bar.
        #[test]
        fn captured_step_replays_equal_eager() {
            const T: &str = "captured_step_replays_equal_eager";
            let Some(dev) = gpu(T) else { return };
            let c = Ctx::inference(Precision::F32);
            let cfg = Mamba2Config::default();
            let m = Mamba2::new(cfg.clone(), &dev, 5).unwrap();
            let (Some(eager), Some(graphed)) = (decoder(T, &m, 1), decoder(T, &m, 1)) else { return };
            let x = Tensor::randn(0f32, 1.0, (1, 40, cfg.n_in), &dev).unwrap();
            let (_, prefill) = m.forward_with_state(&c, &x.narrow(1, 0, 32).unwrap()).unwrap();
            let xbuf = Tensor::zeros((1, cfg.n_in), DType::F32, &dev).unwrap();
            let g = CapturedGraph::capture(&dev, 2, |_dry| {
                graphed.step(&xbuf).map(|_| ()).map_err(|e| fx_precision::Error::Cuda {
                    context: "captured_step_replays_equal_eager",
                    message: e.to_string(),
                })
            })
            .unwrap();
            // The warm-up steps advanced the state: both start again from the prefill.
            eager.load_state(&prefill).unwrap();
            graphed.load_state(&prefill).unwrap();
            for t in 32..40 {
                let xt = x.narrow(1, t, 1).unwrap().squeeze(1).unwrap().contiguous().unwrap();
                xbuf.slice_set(&xt, 0, 0).unwrap();
                let want = host(&eager.step(&xbuf).unwrap());
                g.replay().unwrap();
                let got = host(graphed.prediction());
                assert!(want.iter().all(|v| v.is_finite()));
                assert_eq!(got, want, "bar {t}: replay differs from the eager step");
            }
            let (a, b) = (eager.state().unwrap(), graphed.state().unwrap());
            for (x, y) in a.conv.iter().chain(&a.ssm).zip(b.conv.iter().chain(&b.ssm)) {
                assert_eq!(host(x), host(y), "state after the replays differs");
            }
        }

        #[test]
        fn decoder_refuses_what_it_cannot_run() {
            const T: &str = "decoder_refuses_what_it_cannot_run";
            let Some(dev) = gpu(T) else { return };
            let m = Mamba2::new(small(1), &dev, 6).unwrap();
            assert!(Mamba2Decoder::new(&m, 9).is_err(), "batch 9");
            assert!(Mamba2Decoder::new(&m, 0).is_err(), "batch 0");
            let cpu = Mamba2::new(small(1), &Device::Cpu, 6).unwrap();
            assert!(Mamba2Decoder::new(&cpu, 1).is_err(), "a CPU model");
            let Some(dec) = decoder(T, &m, 2) else { return };
            assert!(
                dec.step(&Tensor::zeros((1, 5), DType::F32, &dev).unwrap()).is_err(),
                "batch 1 into a batch-2 decoder"
            );
            assert!(dec.load_state(&m.init_state(1).unwrap()).is_err(), "a batch-1 state");
            // F64 input is converted, the zero state gives finite predictions.
            dec.reset().unwrap();
            let y = dec.step(&Tensor::ones((2, 5), DType::F64, &dev).unwrap()).unwrap();
            assert!(host(&y).iter().all(|v| v.is_finite()));
        }
    }
}
