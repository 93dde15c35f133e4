//! Building blocks of a fused MLP training step on raw device buffers (row-major F32):
//! the element-wise and loss kernels of `kernels/mlp/mlp_train.cu` ([`MlpTrainKernels`]), used
//! with the cuBLAS GEMMs of [`fx_kernels::cuda::blas::Blas`] (re-exported here). They never read to the
//! host, so a CUDA graph can capture them. fx-models composes them into the DQN update
//! (`fx_models::dqn::fused`), tested there against the candle update it replaces.

use std::sync::Arc;

use candle_core::Device;
use cudarc::driver::{CudaFunction, CudaStream, LaunchConfig, PushKernelArg};

pub use fx_kernels::cuda::blas::Blas;
use fx_kernels::cuda::{cuda_device, driver};
use fx_kernels::{CandleContext, Error, Result};

/// PTX of `kernels/mlp/mlp_train.cu` (bias + activation, its backward, DQN heads + loss).
const PTX_MLP_TRAIN: &str = include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/ptx/mlp_train.ptx"));

/// Activation of a layer (the kernels' `ACT_*`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Act {
    None = 0,
    Relu = 1,
    Tanh = 2,
}

/// The kernels of `kernels/mlp/mlp_train.cu`.
#[derive(Debug, Clone)]
pub struct MlpTrainKernels {
    bias_act: CudaFunction,
    act_bwd: CudaFunction,
    dqn_head_loss: CudaFunction,
    dqn_q: CudaFunction,
    cast_bf16: CudaFunction,
    ppo_adv_stats: CudaFunction,
    ppo_loss: CudaFunction,
    stream: Arc<CudaStream>,
    sm_count: u32,
}

/// Addresses and sizes for [`MlpTrainKernels::dqn_head_loss`].
#[derive(Debug, Clone, Copy)]
pub struct DqnHeadArgs {
    /// Online trunk outputs `[2B, k]`: rows `0..B` on s, `B..2B` on s'.
    pub z_online: u64,
    /// Target trunk outputs on s' `[B, k]`.
    pub z_target: u64,
    /// Online heads: value weight `[1, k]`, bias `[1]`, advantage weight `[na, k]`, bias `[na]`.
    pub online_heads: [u64; 4],
    /// The target network's heads, same layout.
    pub target_heads: [u64; 4],
    /// Actions `[B]` u32, rewards `[B]`, dones `[B]`.
    pub actions: u64,
    pub rewards: u64,
    pub dones: u64,
    pub batch: usize,
    pub k: usize,
    pub n_actions: usize,
    pub gamma: f32,
    pub huber_delta: f32,
    /// Outputs: Huber loss per row `[B]`, head gradients `[B, 1 + na]`, masked trunk gradient `[B, k]`.
    pub loss_rows: u64,
    pub d_out: u64,
    pub dz: u64,
    /// BF16 copy of `dz` (0: none).
    pub dz16: u64,
    /// Members (1 for a solo step): every buffer above holds `members` consecutive blocks,
    /// one per member, each of the size described.
    pub members: usize,
    /// Each member's γ, F32 `[members]` (0: every member uses `gamma`).
    pub gamma_members: u64,
}

/// Addresses and sizes for [`MlpTrainKernels::ppo_loss`].
#[derive(Debug, Clone, Copy)]
pub struct PpoLossArgs {
    /// Actor logits `[B, A]` and critic values `[B]`.
    pub logits: u64,
    pub value: u64,
    /// Minibatch: actions `[B]` u32, old log-probabilities, advantages, returns `[B]`.
    pub actions: u64,
    pub logp_old: u64,
    pub advantages: u64,
    pub returns: u64,
    /// `[2]` F32 scratch for the advantages' mean and std.
    pub adv_stats: u64,
    pub batch: usize,
    pub n_actions: usize,
    pub clip: f32,
    pub vf_coef: f32,
    pub ent_coef: f32,
    pub adv_eps: f32,
    /// Outputs: per-row terms `[B, 6]` (loss, l_clip, l_v, entropy, approx_kl, clip_frac),
    /// gradients of the mean loss w.r.t. logits `[B, A]` and values `[B]`.
    pub rows: u64,
    pub d_logits: u64,
    pub d_value: u64,
    /// Members (1 for a solo step): every buffer above holds `members` consecutive blocks,
    /// one per member, each of the size described (`adv_stats` `[members, 2]`).
    pub members: usize,
    /// Each member's clip, vf_coef and ent_coef, F32 `[members, 3]` (0: the scalars above).
    pub coefs_members: u64,
}

/// `struct CastTable` of mlp_train.cu.
#[repr(C)]
#[derive(Clone, Copy)]
struct CastTable {
    src: [u64; 8],
    dst: [u64; 8],
    len: [u32; 8],
    n: u32,
}

// SAFETY: plain old data with the C layout of `CastTable` in kernels/mlp/mlp_train.cu.
unsafe impl cudarc::driver::DeviceRepr for CastTable {}

/// Most actions the DQN head kernel handles.
pub const DQN_MAX_ACTIONS: usize = 8;

impl MlpTrainKernels {
    /// Loads the kernels on `device` (CUDA).
    pub fn load(device: &Device) -> Result<Self> {
        const CTX: &str = "MlpTrainKernels::load";
        let dev = cuda_device(device, "device", CTX)?;
        let get = |name: &str| -> Result<CudaFunction> {
            Ok(dev.get_or_load_custom_func(name, "fx_mlp_train", PTX_MLP_TRAIN).ctx(CTX)?.into_cuda_function())
        };
        let stream = dev.cuda_stream();
        let sm_count = fx_kernels::cuda::sm_count(&stream, CTX)?;
        Ok(Self {
            bias_act: get("fx_bias_act")?,
            act_bwd: get("fx_act_bwd")?,
            dqn_head_loss: get("fx_dqn_head_loss")?,
            dqn_q: get("fx_dqn_q")?,
            cast_bf16: get("fx_cast_bf16")?,
            ppo_adv_stats: get("fx_ppo_adv_stats")?,
            ppo_loss: get("fx_ppo_loss")?,
            stream,
            sm_count,
        })
    }

    fn elementwise_cfg(&self, n: usize) -> LaunchConfig {
        let blocks = n.div_ceil(256).min(self.sm_count as usize * 8).max(1) as u32;
        LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 }
    }

    /// Launch shape of an element-wise kernel over `members` blocks of `per` elements each
    /// (grid y = member).
    fn members_cfg(&self, members: usize, per: usize) -> Result<LaunchConfig> {
        if members == 0 || members > 65_535 {
            return Err(Error::Config {
                context: "MlpTrainKernels",
                message: format!("{members} members (1..=65535)"),
            });
        }
        let per_member = (self.sm_count as usize * 8).div_ceil(members).max(1);
        let blocks = per.div_ceil(256).min(per_member).max(1) as u32;
        Ok(LaunchConfig { grid_dim: (blocks, members as u32, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 })
    }

    /// `h = act(h + b)` in place on row-major `h[rows, cols]`; `h16` (0: none) receives a
    /// BF16 copy. With `h` 0, `h16` is the input and the output: `act(x + b)` in F32 of its
    /// BF16 values, rounded back.
    ///
    /// # Safety
    /// `h` holds `rows·cols` and `b` `cols` F32 values (`h16` `rows·cols` BF16) on this
    /// device until the launch ran.
    pub unsafe fn bias_act(&self, h: u64, b: u64, rows: usize, cols: usize, act: Act, h16: u64) -> Result<()> {
        self.bias_act_members(h, b, 1, rows, cols, act, h16)
    }

    /// [`Self::bias_act`] for `members` members in one launch: member `m`'s `h` (and `h16`)
    /// is block `m` of `rows·cols` values, its bias block `m` of `cols`.
    ///
    /// # Safety
    /// As [`Self::bias_act`], for `members` consecutive blocks.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn bias_act_members(
        &self,
        h: u64,
        b: u64,
        members: usize,
        rows: usize,
        cols: usize,
        act: Act,
        h16: u64,
    ) -> Result<()> {
        if h == 0 && h16 == 0 {
            return Err(Error::Config {
                context: "MlpTrainKernels::bias_act",
                message: "neither an F32 nor a BF16 activation buffer".into(),
            });
        }
        let (r, c, a) = (rows as u32, cols as u32, act as u32);
        let cfg = self.members_cfg(members, rows * cols)?;
        let mut l = self.stream.launch_builder(&self.bias_act);
        l.arg(&h).arg(&b).arg(&r).arg(&c).arg(&a).arg(&h16);
        l.launch(cfg).map_err(driver("MlpTrainKernels::bias_act"))?;
        Ok(())
    }

    /// The plain GEMM `g` (cuBLAS; no epilogue) followed by `act(C + bias)` as
    /// [`Self::bias_act_members`] over what it wrote, in place (a BF16 output read and
    /// written as BF16): an epilogue GEMM without cuBLASLt's epilogue. `bias` holds `n` F32
    /// values a batch entry; the entries must be packed (`ldc` = n, `stride_c` = m·n), as the
    /// trunks' are.
    ///
    /// # Safety
    /// As [`Blas::run`] for `g`, and `bias` as [`Self::bias_act_members`].
    pub unsafe fn gemm_then_bias_act(
        &self,
        blas: &Blas,
        g: &fx_kernels::gemm::Gemm,
        bias: u64,
        act: Act,
    ) -> Result<()> {
        use fx_kernels::gemm::GemmOutput;
        let members = g.batch.max(1);
        let packed = g.ldc == g.n && (members == 1 || g.stride_c == (g.m * g.n) as i64);
        if g.has_epilogue() || bias == 0 || !packed {
            return Err(Error::Config {
                context: "MlpTrainKernels::gemm_then_bias_act",
                message: format!("a packed GEMM without an epilogue and a bias, got {g:?}"),
            });
        }
        blas.run(g)?;
        match g.output {
            GemmOutput::Bf16 => self.bias_act_members(0, bias, members, g.m, g.n, act, g.c),
            GemmOutput::F32 => self.bias_act_members(g.c, bias, members, g.m, g.n, act, 0),
        }
    }

    /// [`Self::gemm_then_bias_act`] of a bias + ReLU epilogue GEMM ([`Gemm::bias_relu`]'s
    /// bias, `stride_bias` = n): what cuBLASLt's epilogue computes, in two launches.
    ///
    /// # Safety
    /// As [`Blas::run`] for `g`.
    ///
    /// [`Gemm::bias_relu`]: fx_kernels::gemm::Gemm::bias_relu
    pub unsafe fn split_epilogue(&self, blas: &Blas, g: &fx_kernels::gemm::Gemm) -> Result<()> {
        if g.batch > 1 && g.stride_bias != g.n as i64 {
            return Err(Error::Config {
                context: "MlpTrainKernels::split_epilogue",
                message: format!("biases {} apart for {} columns", g.stride_bias, g.n),
            });
        }
        let act = if g.relu { Act::Relu } else { Act::None };
        self.gemm_then_bias_act(blas, &fx_kernels::gemm::Gemm { bias: 0, relu: false, ..*g }, g.bias, act)
    }

    /// `dh *= act'(h)` in place, `h` the activation's output; `dh16` (0: none) receives a
    /// BF16 copy.
    ///
    /// # Safety
    /// As [`MlpTrainKernels::bias_act`].
    pub unsafe fn act_bwd(&self, dh: u64, h: u64, rows: usize, cols: usize, act: Act, dh16: u64) -> Result<()> {
        self.act_bwd_members(dh, h, 1, (rows * cols) as u64, rows, cols, act, dh16, 0)
    }

    /// [`Self::act_bwd`] for `members` members in one launch: member `m`'s `dh` (and `dh16`)
    /// is block `m` of `rows·cols` values, its `h` starts `m·h_stride` values in (a member's
    /// `h` may hold more rows than its gradient). With `h16` set, `h` is read from that BF16
    /// copy instead, at the same offsets, and `h` is not read: ReLU's mask is exact on it;
    /// tanh's `1 − y²` from BF16 values is the split forward's trade (it has no F32 `y`):
    /// coarse near saturation, 0 once |y| rounds to 1 (|y| > 0.998), where it is below 0.004.
    ///
    /// # Safety
    /// As [`Self::act_bwd`], for `members` blocks.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn act_bwd_members(
        &self,
        dh: u64,
        h: u64,
        members: usize,
        h_stride: u64,
        rows: usize,
        cols: usize,
        act: Act,
        dh16: u64,
        h16: u64,
    ) -> Result<()> {
        if h16 != 0 && act == Act::None {
            return Err(Error::Config {
                context: "MlpTrainKernels::act_bwd",
                message: "a BF16 activation given for a layer without one".into(),
            });
        }
        let (r, c, a) = (rows as u32, cols as u32, act as u32);
        let cfg = self.members_cfg(members, rows * cols)?;
        let mut l = self.stream.launch_builder(&self.act_bwd);
        l.arg(&dh).arg(&h).arg(&r).arg(&c).arg(&a).arg(&dh16).arg(&h_stride).arg(&h16);
        l.launch(cfg).map_err(driver("MlpTrainKernels::act_bwd"))?;
        Ok(())
    }

    /// The double-DQN dueling heads, Huber loss and their gradients, one warp per row (of
    /// every member).
    ///
    /// # Safety
    /// Every address holds what [`DqnHeadArgs`] describes until the launch ran.
    pub unsafe fn dqn_head_loss(&self, a: &DqnHeadArgs) -> Result<()> {
        if a.n_actions == 0 || a.n_actions > DQN_MAX_ACTIONS || a.batch == 0 || a.k == 0 {
            return Err(Error::Config {
                context: "MlpTrainKernels::dqn_head_loss",
                message: format!("batch {}, width {}, {} actions (1..={DQN_MAX_ACTIONS})", a.batch, a.k, a.n_actions),
            });
        }
        if a.members == 0 || a.members > 65_535 {
            return Err(Error::Config {
                context: "MlpTrainKernels::dqn_head_loss",
                message: format!("{} members (1..=65535)", a.members),
            });
        }
        let (b, k, na) = (a.batch as u32, a.k as u32, a.n_actions as u32);
        let mut l = self.stream.launch_builder(&self.dqn_head_loss);
        l.arg(&a.z_online).arg(&a.z_target);
        for p in &a.online_heads {
            l.arg(p);
        }
        for p in &a.target_heads {
            l.arg(p);
        }
        l.arg(&a.actions).arg(&a.rewards).arg(&a.dones).arg(&b).arg(&k).arg(&na).arg(&a.gamma).arg(&a.huber_delta);
        l.arg(&a.loss_rows).arg(&a.d_out).arg(&a.dz).arg(&a.dz16).arg(&a.gamma_members);
        let warps_per_block = 8usize;
        let blocks = a.batch.div_ceil(warps_per_block).max(1) as u32;
        let cfg = LaunchConfig {
            grid_dim: (blocks, a.members as u32, 1),
            block_dim: (32 * warps_per_block as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        l.launch(cfg).map_err(driver("MlpTrainKernels::dqn_head_loss"))?;
        Ok(())
    }

    /// The dueling heads' Q values `q[batch, n_actions]` of trunk outputs `z[batch, k]`
    /// (`heads` = value weight, value bias, advantage weight, advantage bias), one warp per
    /// row: the forward half of [`MlpTrainKernels::dqn_head_loss`].
    ///
    /// # Safety
    /// `z` holds `batch·k`, the heads `k`, 1, `n_actions·k` and `n_actions`, and `q`
    /// `batch·n_actions` F32 values on this device until the launch ran.
    pub unsafe fn dqn_q(
        &self,
        z: u64,
        heads: [u64; 4],
        batch: usize,
        k: usize,
        n_actions: usize,
        q: u64,
    ) -> Result<()> {
        const CTX: &str = "MlpTrainKernels::dqn_q";
        if n_actions == 0 || n_actions > DQN_MAX_ACTIONS || batch == 0 || k == 0 || batch > u32::MAX as usize {
            return Err(Error::Config {
                context: CTX,
                message: format!("batch {batch}, width {k}, {n_actions} actions (1..={DQN_MAX_ACTIONS})"),
            });
        }
        let (b, k, na) = (batch as u32, k as u32, n_actions as u32);
        let mut l = self.stream.launch_builder(&self.dqn_q);
        l.arg(&z);
        for p in &heads {
            l.arg(p);
        }
        l.arg(&b).arg(&k).arg(&na).arg(&q);
        let warps_per_block = 8u32;
        let cfg = LaunchConfig {
            grid_dim: (b.div_ceil(warps_per_block), 1, 1),
            block_dim: (32 * warps_per_block, 1, 1),
            shared_mem_bytes: 0,
        };
        l.launch(cfg).map_err(driver(CTX))?;
        Ok(())
    }

    /// Converts up to 8 F32 buffers `(src, dst, len)` to BF16 in one launch.
    ///
    /// # Safety
    /// Each `src` holds `len` F32 and each `dst` `len` BF16 values until the launch ran.
    pub unsafe fn cast_bf16(&self, items: &[(u64, u64, usize)]) -> Result<()> {
        const CTX: &str = "MlpTrainKernels::cast_bf16";
        if items.is_empty() || items.len() > 8 || items.iter().any(|i| i.2 > u32::MAX as usize) {
            return Err(Error::Config {
                context: CTX,
                message: format!("{} buffers (1..=8, < 2^32 elements)", items.len()),
            });
        }
        let mut t = CastTable { src: [0; 8], dst: [0; 8], len: [0; 8], n: items.len() as u32 };
        for (k, &(s, d, n)) in items.iter().enumerate() {
            (t.src[k], t.dst[k], t.len[k]) = (s, d, n as u32);
        }
        let most = items.iter().map(|i| i.2).max().unwrap_or(1);
        let mut l = self.stream.launch_builder(&self.cast_bf16);
        l.arg(&t);
        l.launch(self.elementwise_cfg(most)).map_err(driver(CTX))?;
        Ok(())
    }

    /// PPO: the advantages' statistics, then the per-row loss terms and gradients (of every
    /// member).
    ///
    /// # Safety
    /// Every address holds what [`PpoLossArgs`] describes until the launches ran.
    pub unsafe fn ppo_loss(&self, a: &PpoLossArgs) -> Result<()> {
        const CTX: &str = "MlpTrainKernels::ppo_loss";
        if a.n_actions == 0 || a.n_actions > DQN_MAX_ACTIONS || a.batch < 2 {
            return Err(Error::Config {
                context: CTX,
                message: format!("batch {} (>= 2), {} actions (1..={DQN_MAX_ACTIONS})", a.batch, a.n_actions),
            });
        }
        if a.members == 0 || a.members > 65_535 {
            return Err(Error::Config { context: CTX, message: format!("{} members (1..=65535)", a.members) });
        }
        let (b, na, members) = (a.batch as u32, a.n_actions as u32, a.members as u32);
        let mut l = self.stream.launch_builder(&self.ppo_adv_stats);
        l.arg(&a.advantages).arg(&b).arg(&a.adv_stats);
        l.launch(LaunchConfig { grid_dim: (members, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 })
            .map_err(driver(CTX))?;
        let mut l = self.stream.launch_builder(&self.ppo_loss);
        l.arg(&a.logits).arg(&a.value).arg(&a.actions).arg(&a.logp_old).arg(&a.advantages).arg(&a.returns);
        l.arg(&a.adv_stats).arg(&b).arg(&na).arg(&a.clip).arg(&a.vf_coef).arg(&a.ent_coef).arg(&a.adv_eps);
        l.arg(&a.rows).arg(&a.d_logits).arg(&a.d_value).arg(&a.coefs_members);
        let cfg = LaunchConfig { grid_dim: (b.div_ceil(128), members, 1), block_dim: (128, 1, 1), shared_mem_bytes: 0 };
        l.launch(cfg).map_err(driver(CTX))?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Tensor};
    use fx_kernels::cuda::address;
    use fx_kernels::gemm::{gemm_ref, Gemm};

    use super::{Act, Blas, MlpTrainKernels};

    fn random(len: usize, seed: u64, salt: u64) -> Vec<f32> {
        (0..len as u64).map(|i| (fx_kernels::rng::draw(seed, salt, 0, i) * 2.0 - 1.0) as f32).collect()
    }

    /// The split epilogue ([`MlpTrainKernels::split_epilogue`] for ReLU,
    /// [`MlpTrainKernels::gemm_then_bias_act`] for tanh and none: a plain GEMM, then the
    /// bias + activation kernel over its output, in place) of strided batches whose members
    /// have their own biases and of one matrix, BF16 in, BF16 or F32 out, equals the host
    /// reference on fresh random inputs: the f64 product rounded to C's type, then the bias
    /// and ReLU in F32, rounded again for a BF16 C. Each rounding may land an ulp (at most
    /// 2^-7 relative) away where the GPU's F32 sum straddles a BF16 boundary, so a BF16
    /// element is held to 2^-6 of its terms (|result| + |bias|); a wrong bias, member stride
    /// or a missing ReLU is off by far more.
    #[test]
    fn split_epilogue_matches_the_reference() {
        let Some(dev) = fx_hw::test_gpu("mlp::train_cuda::split_epilogue_matches_the_reference") else { return };
        let seed = fx_hw::test_seed("mlp::train_cuda::split_epilogue_matches_the_reference");
        let (blas, k) = (Blas::new(&dev).unwrap(), MlpTrainKernels::load(&dev).unwrap());
        let cases = [
            (3usize, 37usize, 48usize, 24usize, true, Act::Relu),
            (4, 64, 32, 56, false, Act::Relu),
            (2, 20, 16, 8, true, Act::None),
            (3, 33, 40, 32, true, Act::Tanh),
            (1, 45, 24, 16, true, Act::Tanh),
        ];
        for (ci, &(nb, m, n, kk, bf_out, act)) in cases.iter().enumerate() {
            let salt = 10 * ci as u64;
            let round = |v: Vec<f32>| -> Vec<half::bf16> { v.into_iter().map(half::bf16::from_f32).collect() };
            let (a16, b16) = (round(random(nb * m * kk, seed, salt)), round(random(nb * n * kk, seed, salt + 1)));
            let bias = random(nb * n, seed, salt + 2);
            // Host: the plain GEMM into C's type, then bias + ReLU in F32 as the kernel does.
            let plain = |a: u64, b: u64, c: u64| {
                let g = Gemm::new(false, true, m, n, kk, a, b, c).batched(nb, m * kk, n * kk, m * n).bf16(a, b);
                if bf_out {
                    g.bf16_out(c)
                } else {
                    g
                }
            };
            let mut c32 = vec![f32::NAN; nb * m * n];
            let mut c16 = vec![half::bf16::NAN; nb * m * n];
            let hc = if bf_out { c16.as_mut_ptr() as u64 } else { c32.as_mut_ptr() as u64 };
            // SAFETY: host buffers of the sizes the GEMM describes.
            unsafe { gemm_ref(&plain(a16.as_ptr() as u64, b16.as_ptr() as u64, hc)) };
            let want: Vec<f32> = (0..nb * m * n)
                .map(|i| {
                    let x = if bf_out { c16[i].to_f32() } else { c32[i] } + bias[(i / (m * n)) * n + i % n];
                    let x = match act {
                        Act::Relu => x.max(0.0),
                        Act::Tanh => x.tanh(),
                        Act::None => x,
                    };
                    if bf_out {
                        half::bf16::from_f32(x).to_f32()
                    } else {
                        x
                    }
                })
                .collect();
            let up16 = |v: &[half::bf16]| Tensor::from_vec(v.to_vec(), v.len(), &dev).unwrap();
            let (da, db) = (up16(&a16), up16(&b16));
            let dbias = Tensor::from_vec(bias.clone(), bias.len(), &dev).unwrap();
            let nan = Tensor::full(f32::NAN, nb * m * n, &dev).unwrap();
            let dc = if bf_out { nan.to_dtype(DType::BF16).unwrap() } else { nan };
            let p16 = |t: &Tensor| address::<half::bf16>(t, "t").unwrap();
            let c = if bf_out { p16(&dc) } else { address::<f32>(&dc, "c").unwrap() };
            let (g, pb) = (plain(p16(&da), p16(&db), c), address::<f32>(&dbias, "bias").unwrap());
            // SAFETY: device tensors of the sizes the GEMM describes, alive past the sync.
            unsafe {
                if act == Act::Relu {
                    k.split_epilogue(&blas, &g.bias_relu(pb, n, true)).unwrap()
                } else {
                    k.gemm_then_bias_act(&blas, &g, pb, act).unwrap()
                }
            };
            dev.synchronize().unwrap();
            let got: Vec<f32> = dc.to_dtype(DType::F32).unwrap().to_vec1().unwrap();
            for (i, (&x, &w)) in got.iter().zip(&want).enumerate() {
                assert!(x.is_finite() && w.is_finite(), "case {ci} [{i}]: gpu {x}, reference {w}");
                let terms = w.abs() + bias[(i / (m * n)) * n + i % n].abs();
                let tol = if bf_out { terms / 64.0 } else { 1e-5 * (1.0 + terms) * (kk as f32).sqrt() };
                assert!((x - w).abs() <= tol, "case {ci} [{i}]: gpu {x} vs reference {w}");
            }
            match act {
                Act::Relu => {
                    assert!(got.contains(&0.0) && got.iter().all(|&x| x >= 0.0), "case {ci}: ReLU not exercised")
                }
                Act::Tanh => assert!(got.iter().all(|&x| x.abs() <= 1.0), "case {ci}: tanh out of range"),
                Act::None => {}
            }
            if act != Act::Relu {
                assert!(got.iter().any(|&x| x < 0.0), "case {ci}: no negative output without ReLU");
            }
        }
    }
}
