//! INT8 matrix–vector products with i32 accumulation: `out[o] = Σ_i w[o, i] · x[i]` for
//! weights and activations in `[-127, 127]`, chosen at run time for the CPU's ISA.
//!
//! Every path gives the exact integer result (no saturation anywhere), so the fast paths
//! are tested for equality with [`gemv_scalar`]:
//! - AVX2: `_mm256_maddubs_epi16` multiplies unsigned by signed bytes and adds pairs into
//!   i16 with saturation. Feeding it `|x|` and `w · sign(x)` (`_mm256_sign_epi8`, the
//!   trick llama.cpp uses) keeps both factors within 127, so a pair sum is at most
//!   2 · 127² = 32,258 < 32,767: never saturated. `_mm256_madd_epi16` by ones then widens
//!   pairs into i32.
//! - AVX-VNNI / AVX-512 VNNI: `vpdpbusd` multiplies unsigned by signed bytes and adds
//!   groups of four straight into i32 (no intermediate saturation). Activations are made
//!   unsigned by adding 128 (`x ^ 0x80`), and `128 · Σ_i w[o, i]` (`row_sum`, computed
//!   once per layer) is subtracted afterwards.
//!
//! Rows are padded to a multiple of [`PAD`] bytes with zero weights, so no path has a tail:
//! whatever the activation buffer holds in the padding multiplies a zero.
//!
//! [`VerticalWeights`] is a second layout for AVX-512 VNNI ([`Gemv::run_vertical`]): sixteen
//! output rows interleaved four bytes at a time, so one `vpdpbusd` adds four inputs into
//! sixteen outputs at once (the four activation bytes broadcast to every lane) and no
//! horizontal sum is needed (the row-major kernel ends every output row with one). It also
//! takes several activation vectors per pass over the weights (a batch of decisions reads
//! each weight vector once for up to [`MAX_ROWS`] observations).
//!
//! [`Tiles::run`] multiplies up to [`TILE_ROWS`] vectors by the same interleaved weights on
//! Intel AMX tiles where the CPU has them ([`Isa::Amx`]; `amx.rs`).

mod amx;

/// Row padding (bytes): one AVX-512 register, two AVX2 registers.
pub const PAD: usize = 64;

/// `n` rounded up to a multiple of [`PAD`].
pub fn padded(n: usize) -> usize {
    n.div_ceil(PAD) * PAD
}

/// The instruction set a [`Gemv`] runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Isa {
    /// Plain Rust, any CPU.
    Scalar,
    /// AVX2 `maddubs` / `madd` with the sign trick.
    Avx2,
    /// 256-bit VEX `vpdpbusd` (Alder Lake and later clients, Sapphire Rapids).
    AvxVnni,
    /// 512-bit `vpdpbusd` (Ice Lake server, Sapphire Rapids, Zen 4).
    Avx512Vnni,
    /// AVX-512 VNNI for single vectors, and AMX-INT8 tiles for batches
    /// ([`Tiles::run`]; Sapphire Rapids and later Xeons, on Linux).
    Amx,
}

impl Isa {
    /// The name reported in benchmarks and `quant_report.json`.
    pub fn name(self) -> &'static str {
        match self {
            Isa::Scalar => "scalar",
            Isa::Avx2 => "avx2",
            Isa::AvxVnni => "avx_vnni",
            Isa::Avx512Vnni => "avx512_vnni",
            Isa::Amx => "amx_int8",
        }
    }

    /// Every ISA this CPU runs, best first (the scalar path is always last).
    pub fn available() -> Vec<Isa> {
        let mut v = Vec::new();
        #[cfg(target_arch = "x86_64")]
        {
            if is_x86_feature_detected!("avx512f")
                && is_x86_feature_detected!("avx512bw")
                && is_x86_feature_detected!("avx512vnni")
            {
                if amx::available() {
                    v.push(Isa::Amx);
                }
                v.push(Isa::Avx512Vnni);
            }
            if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("avxvnni") {
                v.push(Isa::AvxVnni);
            }
            if is_x86_feature_detected!("avx2") {
                v.push(Isa::Avx2);
            }
        }
        v.push(Isa::Scalar);
        v
    }

    /// The best ISA this CPU runs.
    pub fn detect() -> Isa {
        Isa::available()[0]
    }
}

/// A checked matrix–vector product on one ISA (the ISA is known to be present).
#[derive(Debug, Clone, Copy)]
pub struct Gemv {
    isa: Isa,
}

impl Gemv {
    /// The product on `isa`, or `None` when this CPU lacks it.
    pub fn new(isa: Isa) -> Option<Self> {
        Isa::available().contains(&isa).then_some(Self { isa })
    }

    /// Its instruction set.
    pub fn isa(self) -> Isa {
        self.isa
    }

    /// `out[o] = Σ_i w[o·stride + i] · x[i]` for `o < out.len()`, `i < stride`.
    ///
    /// Requirements (checked; a violation is a bug in the caller, so it panics rather than
    /// read out of bounds): `stride` a multiple of [`PAD`], `w.len() >= out.len() · stride`,
    /// `x.len() >= stride`, `row_sum.len() >= out.len()` with `row_sum[o] = Σ_i w[o, i]`,
    /// and every weight in `[-127, 127]` (activations may be any i8 other than -128 in the
    /// AVX2 path; the layers only produce `[-127, 127]`).
    #[inline]
    pub fn run(self, w: &[i8], stride: usize, x: &[i8], row_sum: &[i32], out: &mut [i32]) {
        assert!(
            stride.is_multiple_of(PAD)
                && w.len() >= out.len() * stride
                && x.len() >= stride
                && row_sum.len() >= out.len(),
            "Gemv::run: stride {stride}, w {}, x {}, row_sum {}, out {}",
            w.len(),
            x.len(),
            row_sum.len(),
            out.len()
        );
        match self.isa {
            Isa::Scalar => gemv_scalar(w, stride, x, out),
            // SAFETY: the ISA was detected on this CPU when `self` was built, and the
            // lengths were checked above.
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => unsafe { x86::gemv_avx2(w, stride, x, out) },
            #[cfg(target_arch = "x86_64")]
            Isa::AvxVnni => unsafe { x86::gemv_avx_vnni(w, stride, x, row_sum, out) },
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512Vnni | Isa::Amx => unsafe { x86::gemv_avx512_vnni(w, stride, x, row_sum, out) },
            #[cfg(not(target_arch = "x86_64"))]
            _ => gemv_scalar(w, stride, x, out),
        }
    }
}

/// Most activation vectors one [`Gemv::run_vertical`] pass takes.
pub const MAX_ROWS: usize = 8;

/// Most activation vectors one [`Tiles::run`] pass takes: two AMX tiles of 16 rows.
pub const TILE_ROWS: usize = 32;

/// Widest (padded) input of an interleaved layer: the kernel keeps the inputs' byte groups
/// on the stack (1024 covers every network here; wider layers stay row-major).
pub const MAX_VERTICAL_INPUTS: usize = 1024;

/// Output rows per interleaved block of [`VerticalWeights`] (one AVX-512 register of i32).
const LANES: usize = 16;

/// A weight matrix in the interleaved layout of [`Gemv::run_vertical`]: for each block of 16
/// output rows (zero rows past the last), for each group of 4 inputs, 16 lanes × 4 bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VerticalWeights {
    data: Vec<i8>,
    /// Output rows (before padding to 16).
    rows: usize,
    /// Inputs per row, padded (a multiple of [`PAD`], as the row-major layout's).
    stride: usize,
    /// `Σ_i w[o, i]` per row, zero-padded to whole blocks.
    row_sum: Vec<i32>,
}

impl VerticalWeights {
    /// Interleaves row-major `w` (`rows × stride`, `stride` a multiple of [`PAD`]); None for
    /// rows wider than [`MAX_VERTICAL_INPUTS`] or of no inputs (those keep the row-major
    /// kernel; the batch kernels' loops assume at least one step of inputs).
    pub fn new(w: &[i8], stride: usize, rows: usize) -> Option<Self> {
        assert!(stride.is_multiple_of(PAD) && w.len() >= rows * stride, "VerticalWeights::new: shapes");
        if stride == 0 || stride > MAX_VERTICAL_INPUTS {
            return None;
        }
        let blocks = rows.div_ceil(LANES);
        let groups = stride / 4;
        let mut data = vec![0i8; blocks * LANES * stride];
        for o in 0..rows {
            let (b, lane) = (o / LANES, o % LANES);
            for g in 0..groups {
                let dst = ((b * groups + g) * LANES + lane) * 4;
                data[dst..dst + 4].copy_from_slice(&w[o * stride + 4 * g..o * stride + 4 * g + 4]);
            }
        }
        let mut row_sum = row_sums(w, stride, rows);
        row_sum.resize(blocks * LANES, 0);
        Some(Self { data, rows, stride, row_sum })
    }

    /// The batch kernels' requirements (a violation is a bug in the caller, so it panics
    /// rather than read out of bounds): 1 ..= `max` activation vectors, each at least `stride`
    /// bytes, and as many outputs, each at least `rows` long.
    fn check_batch(&self, xs: &[&[i8]], outs: &[&mut [i32]], max: usize, what: &str) {
        assert!(
            (1..=max).contains(&xs.len())
                && outs.len() == xs.len()
                && xs.iter().all(|x| x.len() >= self.stride)
                && outs.iter().all(|o| o.len() >= self.rows),
            "{what}: {} activation vectors, {} outputs",
            xs.len(),
            outs.len()
        );
    }
}

impl Gemv {
    /// Whether [`Gemv::run_vertical`] runs here (the AVX-512 VNNI product).
    pub fn has_vertical(self) -> bool {
        matches!(self.isa, Isa::Avx512Vnni | Isa::Amx)
    }

    /// `out[r][o] = Σ_i w[o, i] · x[r][i]` for each of the `xs.len()` (1 ..= [`MAX_ROWS`])
    /// activation vectors (each at least `stride` long) into `outs[r]` (each at least
    /// `w.rows()` long), with the interleaved AVX-512 VNNI kernel; `false` (nothing written)
    /// unless [`Gemv::has_vertical`]. The same exact integers as [`gemv_scalar`].
    #[inline]
    pub fn run_vertical(self, w: &VerticalWeights, xs: &[&[i8]], outs: &mut [&mut [i32]]) -> bool {
        w.check_batch(xs, outs, MAX_ROWS, "Gemv::run_vertical");
        if !self.has_vertical() {
            return false;
        }
        #[cfg(target_arch = "x86_64")]
        {
            // SAFETY: AVX-512 F/BW/VNNI were detected when `self` was built; lengths checked.
            unsafe { x86::gemv_vertical_avx512(w, xs, outs) };
            true
        }
        #[cfg(not(target_arch = "x86_64"))]
        false
    }

    /// Whether [`Tiles`] run here (AMX).
    pub fn has_tiles(self) -> bool {
        self.isa == Isa::Amx
    }

    /// The AMX tiles configured on this thread for [`Tiles::run`], until the value is
    /// dropped; `None` unless [`Gemv::has_tiles`]. Several may be alive on one thread (a
    /// batch inside a batch): the first configures, the last dropped releases.
    pub fn tiles(self) -> Option<Tiles> {
        if !self.has_tiles() {
            return None;
        }
        #[cfg(target_arch = "x86_64")]
        {
            if TILES_ALIVE.get() == 0 {
                // SAFETY: AMX, with the process's tile grant, was detected when `self` was
                // built.
                unsafe { amx::configure() };
            }
            TILES_ALIVE.set(TILES_ALIVE.get() + 1);
            Some(Tiles { _thread: std::marker::PhantomData })
        }
        #[cfg(not(target_arch = "x86_64"))]
        None
    }
}

thread_local! {
    /// Live [`Tiles`] on this thread: the tile configuration is loaded while it is above 0.
    static TILES_ALIVE: std::cell::Cell<u32> = const { std::cell::Cell::new(0) };
}

/// AMX tiles configured on the current thread (`ldtilecfg`), released (`tilerelease`) when
/// the thread's last one is dropped. A batch configures them once for all its products: the
/// configuration is thread state, so the value cannot leave the thread. (Code outside fx
/// that loads another tile configuration on this thread while one is alive is not seen.)
#[derive(Debug)]
pub struct Tiles {
    _thread: std::marker::PhantomData<*const ()>,
}

impl Tiles {
    /// `outs[r][o] = Σ_i w[o, i] · xs[r][i]` for 1 ..= [`TILE_ROWS`] activation vectors
    /// (each at least `w`'s padded width; `outs[r]` at least its rows), the same exact
    /// integers as [`gemv_scalar`].
    #[inline]
    pub fn run(&self, w: &VerticalWeights, xs: &[&[i8]], outs: &mut [&mut [i32]]) {
        w.check_batch(xs, outs, TILE_ROWS, "Tiles::run");
        // SAFETY: a `Tiles` exists only where AMX and AVX-512 F/BW were detected, and its
        // configuration is loaded on this thread (it cannot move to another); lengths checked.
        #[cfg(target_arch = "x86_64")]
        unsafe {
            amx::gemv_tiles(w, xs, outs)
        };
    }
}

impl Drop for Tiles {
    fn drop(&mut self) {
        let left = TILES_ALIVE.get() - 1;
        TILES_ALIVE.set(left);
        // SAFETY: releases the configuration `Gemv::tiles` loaded on this thread, once no
        // `Tiles` of the thread is left.
        #[cfg(target_arch = "x86_64")]
        if left == 0 {
            unsafe { amx::release() };
        }
    }
}

/// The reference: plain i32 multiply-adds, row by row.
pub fn gemv_scalar(w: &[i8], stride: usize, x: &[i8], out: &mut [i32]) {
    for (o, acc) in out.iter_mut().enumerate() {
        let row = &w[o * stride..(o + 1) * stride];
        *acc = row.iter().zip(&x[..stride]).map(|(&a, &b)| i32::from(a) * i32::from(b)).sum();
    }
}

/// `Σ_i w[o, i]` per row (the VNNI paths' offset correction).
pub fn row_sums(w: &[i8], stride: usize, rows: usize) -> Vec<i32> {
    (0..rows).map(|o| w[o * stride..(o + 1) * stride].iter().map(|&v| i32::from(v)).sum()).collect()
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    /// # Safety
    /// AVX-512 F/BW/VNNI present; lengths as [`super::Gemv::run_vertical`] checks.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    pub(super) unsafe fn gemv_vertical_avx512(w: &super::VerticalWeights, xs: &[&[i8]], outs: &mut [&mut [i32]]) {
        const R: usize = super::MAX_ROWS;
        debug_assert!((1..=R).contains(&xs.len()) && xs.iter().all(|x| x.len() >= w.stride));
        // Each vector's bytes + 128 (unsigned for vpdpbusd) on the stack, 64 at a time; a
        // group of four is then one little-endian u32. Only the `stride` bytes of the `n`
        // rows are written, and only those are read (no 8 KB clear per call; VerticalWeights
        // holds at most MAX_VERTICAL_INPUTS inputs: no allocation).
        let mut stack = std::mem::MaybeUninit::<[[u32; super::MAX_VERTICAL_INPUTS / 4]; R]>::uninit();
        let base = stack.as_mut_ptr() as *mut u32;
        let bias = _mm512_set1_epi8(0x80u8 as i8);
        let mut s: [*const u32; R] = [std::ptr::null(); R];
        for (r, x) in xs.iter().enumerate() {
            // SAFETY: row r of the stack holds MAX_VERTICAL_INPUTS bytes >= stride; `x` holds
            // at least stride bytes (checked by run_vertical); stride is a multiple of 64.
            let dst = unsafe { base.add(r * super::MAX_VERTICAL_INPUTS / 4) };
            let mut c = 0;
            while c < w.stride {
                unsafe {
                    let v = _mm512_loadu_si512(x.as_ptr().add(c) as *const __m512i);
                    _mm512_storeu_si512((dst as *mut u8).add(c) as *mut __m512i, _mm512_xor_si512(v, bias));
                }
                c += 64;
            }
            s[r] = dst;
        }
        // One instantiation per row count keeps every accumulator in a register.
        let s = &s;
        unsafe {
            match xs.len() {
                1 => vertical_rows::<1>(w, s, outs),
                2 => vertical_rows::<2>(w, s, outs),
                3 => vertical_rows::<3>(w, s, outs),
                4 => vertical_rows::<4>(w, s, outs),
                5 => vertical_rows::<5>(w, s, outs),
                6 => vertical_rows::<6>(w, s, outs),
                7 => vertical_rows::<7>(w, s, outs),
                _ => vertical_rows::<8>(w, s, outs),
            }
        }
    }

    /// `N` rows through the interleaved weights, two blocks of 16 outputs per pass: 2·N
    /// independent accumulators (16 at N = 8, of the 32 registers) hide `vpdpbusd`'s
    /// latency, and each activation broadcast feeds two blocks.
    ///
    /// # Safety
    /// AVX-512 F/BW/VNNI present; `xp[..N]` point at `w.stride / 4` written groups of N
    /// vectors each, `outs[..N]` are at least `w.rows` long.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    unsafe fn vertical_rows<const N: usize>(
        w: &super::VerticalWeights,
        xp: &[*const u32; super::MAX_ROWS],
        outs: &mut [&mut [i32]],
    ) {
        const L: usize = super::LANES;
        let groups = w.stride / 4;
        let wp = w.data.as_ptr();
        let blocks = w.row_sum.len() / L;
        let load = |p: *const i8| unsafe { _mm512_loadu_si512(p as *const __m512i) };
        // acc − 128 · row_sum, stored to the valid lanes of block `b` of every row.
        let mut store = |b: usize, acc: &[__m512i; N]| {
            let corr =
                _mm512_slli_epi32::<7>(unsafe { _mm512_loadu_si512(w.row_sum.as_ptr().add(b * L) as *const __m512i) });
            let lo = b * L;
            let valid = (w.rows.saturating_sub(lo)).min(L);
            let mask: __mmask16 = if valid == L { 0xffff } else { (1u16 << valid) - 1 };
            for (r, a) in acc.iter().enumerate() {
                // SAFETY: lanes past `valid` are masked off; outs[r] holds w.rows values.
                unsafe { _mm512_mask_storeu_epi32(outs[r].as_mut_ptr().add(lo), mask, _mm512_sub_epi32(*a, corr)) };
            }
        };
        let mut b = 0;
        while b + 2 <= blocks {
            let (mut a0, mut a1) = ([_mm512_setzero_si512(); N], [_mm512_setzero_si512(); N]);
            let (p0, p1) = unsafe { (wp.add(b * groups * 64), wp.add((b + 1) * groups * 64)) };
            for g in 0..groups {
                let (w0, w1) = unsafe { (load(p0.add(g * 64)), load(p1.add(g * 64))) };
                for r in 0..N {
                    // SAFETY: g < groups <= MAX_VERTICAL_INPUTS / 4.
                    let xb = _mm512_set1_epi32(unsafe { *xp[r].add(g) } as i32);
                    a0[r] = _mm512_dpbusd_epi32(a0[r], xb, w0);
                    a1[r] = _mm512_dpbusd_epi32(a1[r], xb, w1);
                }
            }
            store(b, &a0);
            store(b + 1, &a1);
            b += 2;
        }
        if b < blocks {
            let mut a0 = [_mm512_setzero_si512(); N];
            let p0 = unsafe { wp.add(b * groups * 64) };
            for g in 0..groups {
                let w0 = unsafe { load(p0.add(g * 64)) };
                for r in 0..N {
                    let xb = _mm512_set1_epi32(unsafe { *xp[r].add(g) } as i32);
                    a0[r] = _mm512_dpbusd_epi32(a0[r], xb, w0);
                }
            }
            store(b, &a0);
        }
    }

    /// Adds the eight i32 lanes of each of four accumulators: `[Σa, Σb, Σc, Σd]`.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn hsum4(a: __m256i, b: __m256i, c: __m256i, d: __m256i) -> __m128i {
        let ab = _mm256_hadd_epi32(a, b);
        let cd = _mm256_hadd_epi32(c, d);
        let s = _mm256_hadd_epi32(ab, cd);
        _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256::<1>(s))
    }

    #[inline]
    #[target_feature(enable = "avx2")]
    fn hsum1(a: __m256i) -> i32 {
        let s = _mm_add_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256::<1>(a));
        let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b01_00_11_10>(s));
        let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b10_11_00_01>(s));
        _mm_cvtsi128_si32(s)
    }

    /// One 32-byte step of the sign trick: `acc += madd(maddubs(|x|, w·sign(x)), 1)`.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn step_avx2(acc: __m256i, ax: __m256i, xv: __m256i, wv: __m256i) -> __m256i {
        let p = _mm256_maddubs_epi16(ax, _mm256_sign_epi8(wv, xv));
        _mm256_add_epi32(acc, _mm256_madd_epi16(p, _mm256_set1_epi16(1)))
    }

    /// # Safety
    /// AVX2 present; lengths as [`super::Gemv::run`] checks.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn gemv_avx2(w: &[i8], stride: usize, x: &[i8], out: &mut [i32]) {
        let (wp, xp) = (w.as_ptr(), x.as_ptr());
        let load = |p: *const i8| unsafe { _mm256_loadu_si256(p as *const __m256i) };
        let rows = out.len();
        let mut o = 0;
        // Four rows per pass: each activation chunk is loaded (and its |x| taken) once.
        while o + 4 <= rows {
            let mut acc = [_mm256_setzero_si256(); 4];
            let mut c = 0;
            while c < stride {
                let xv = load(unsafe { xp.add(c) });
                let ax = _mm256_abs_epi8(xv);
                for (k, a) in acc.iter_mut().enumerate() {
                    *a = step_avx2(*a, ax, xv, load(unsafe { wp.add((o + k) * stride + c) }));
                }
                c += 32;
            }
            let s = hsum4(acc[0], acc[1], acc[2], acc[3]);
            unsafe { _mm_storeu_si128(out.as_mut_ptr().add(o) as *mut __m128i, s) };
            o += 4;
        }
        while o < rows {
            let mut acc = _mm256_setzero_si256();
            let mut c = 0;
            while c < stride {
                let xv = load(unsafe { xp.add(c) });
                acc = step_avx2(acc, _mm256_abs_epi8(xv), xv, load(unsafe { wp.add(o * stride + c) }));
                c += 32;
            }
            out[o] = hsum1(acc);
            o += 1;
        }
    }

    /// # Safety
    /// AVX2 and AVX-VNNI present; lengths as [`super::Gemv::run`] checks.
    #[target_feature(enable = "avx2,avxvnni")]
    pub(super) unsafe fn gemv_avx_vnni(w: &[i8], stride: usize, x: &[i8], row_sum: &[i32], out: &mut [i32]) {
        let (wp, xp) = (w.as_ptr(), x.as_ptr());
        let load = |p: *const i8| unsafe { _mm256_loadu_si256(p as *const __m256i) };
        let bias = _mm256_set1_epi8(0x80u8 as i8);
        let rows = out.len();
        let mut o = 0;
        while o + 4 <= rows {
            let mut acc = [_mm256_setzero_si256(); 4];
            let mut c = 0;
            while c < stride {
                // x + 128 as an unsigned byte.
                let xu = _mm256_xor_si256(load(unsafe { xp.add(c) }), bias);
                for (k, a) in acc.iter_mut().enumerate() {
                    *a = _mm256_dpbusd_avx_epi32(*a, xu, load(unsafe { wp.add((o + k) * stride + c) }));
                }
                c += 32;
            }
            let s = hsum4(acc[0], acc[1], acc[2], acc[3]);
            let corr = _mm_slli_epi32::<7>(unsafe { _mm_loadu_si128(row_sum.as_ptr().add(o) as *const __m128i) });
            unsafe { _mm_storeu_si128(out.as_mut_ptr().add(o) as *mut __m128i, _mm_sub_epi32(s, corr)) };
            o += 4;
        }
        while o < rows {
            let mut acc = _mm256_setzero_si256();
            let mut c = 0;
            while c < stride {
                let xu = _mm256_xor_si256(load(unsafe { xp.add(c) }), bias);
                acc = _mm256_dpbusd_avx_epi32(acc, xu, load(unsafe { wp.add(o * stride + c) }));
                c += 32;
            }
            out[o] = hsum1(acc) - 128 * row_sum[o];
            o += 1;
        }
    }

    /// # Safety
    /// AVX-512 F/BW/VNNI present; lengths as [`super::Gemv::run`] checks.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    pub(super) unsafe fn gemv_avx512_vnni(w: &[i8], stride: usize, x: &[i8], row_sum: &[i32], out: &mut [i32]) {
        let (wp, xp) = (w.as_ptr(), x.as_ptr());
        let load = |p: *const i8| unsafe { _mm512_loadu_si512(p as *const __m512i) };
        let bias = _mm512_set1_epi8(0x80u8 as i8);
        let rows = out.len();
        let mut o = 0;
        while o + 4 <= rows {
            let mut acc = [_mm512_setzero_si512(); 4];
            let mut c = 0;
            while c < stride {
                let xu = _mm512_xor_si512(load(unsafe { xp.add(c) }), bias);
                for (k, a) in acc.iter_mut().enumerate() {
                    *a = _mm512_dpbusd_epi32(*a, xu, load(unsafe { wp.add((o + k) * stride + c) }));
                }
                c += 64;
            }
            for (k, a) in acc.iter().enumerate() {
                out[o + k] = _mm512_reduce_add_epi32(*a) - 128 * row_sum[o + k];
            }
            o += 4;
        }
        while o < rows {
            let mut acc = _mm512_setzero_si512();
            let mut c = 0;
            while c < stride {
                let xu = _mm512_xor_si512(load(unsafe { xp.add(c) }), bias);
                acc = _mm512_dpbusd_epi32(acc, xu, load(unsafe { wp.add(o * stride + c) }));
                c += 64;
            }
            out[o] = _mm512_reduce_add_epi32(acc) - 128 * row_sum[o];
            o += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn matrix(rows: usize, stride: usize, vals: &[i8]) -> Vec<i8> {
        (0..rows * stride).map(|i| vals[i % vals.len()]).collect()
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]
        /// Every ISA this CPU has gives exactly the scalar sums, on fresh random matrices
        /// of every row-count class (multiples of 4 and remainders) and widths.
        #[test]
        fn every_isa_equals_the_scalar_reference(
            rows in 1usize..19,
            chunks in 1usize..6,
            w in proptest::collection::vec(-127i8..=127, 1..600),
            x in proptest::collection::vec(-127i8..=127, 1..400),
        ) {
            let stride = chunks * PAD;
            let wm = matrix(rows, stride, &w);
            let xv: Vec<i8> = (0..stride).map(|i| x[i % x.len()]).collect();
            let rs = row_sums(&wm, stride, rows);
            let mut want = vec![0i32; rows];
            gemv_scalar(&wm, stride, &xv, &mut want);
            for isa in Isa::available() {
                let mut got = vec![i32::MIN; rows];
                Gemv::new(isa).unwrap().run(&wm, stride, &xv, &rs, &mut got);
                prop_assert_eq!(&got, &want, "{:?}", isa);
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]
        /// The interleaved AVX-512 VNNI kernel gives the scalar sums for 1..=4 activation
        /// vectors at once, for every row count (whole and partial blocks of 16) and width
        /// (where the CPU has it; otherwise it must say so and write nothing).
        #[test]
        fn vertical_kernel_equals_the_scalar_reference(
            rows in 1usize..40,
            chunks in 1usize..6,
            n in 1usize..=MAX_ROWS,
            w in proptest::collection::vec(-127i8..=127, 1..600),
            x in proptest::collection::vec(-127i8..=127, 4..400),
        ) {
            let stride = chunks * PAD;
            let wm = matrix(rows, stride, &w);
            let vw = VerticalWeights::new(&wm, stride, rows).expect("stride within the vertical bound");
            let xs: Vec<Vec<i8>> = (0..n).map(|r| (0..stride).map(|i| x[(i * (r + 1) + r) % x.len()]).collect()).collect();
            let mut got: Vec<Vec<i32>> = vec![vec![i32::MIN; rows]; n];
            let ran = {
                let xr: Vec<&[i8]> = xs.iter().map(|v| &v[..]).collect();
                let mut or: Vec<&mut [i32]> = got.iter_mut().map(|v| &mut v[..]).collect();
                Gemv::new(Isa::detect()).unwrap().run_vertical(&vw, &xr, &mut or)
            };
            if !ran {
                prop_assert!(!Isa::available().contains(&Isa::Avx512Vnni));
                prop_assert!(got.iter().all(|g| g.iter().all(|&v| v == i32::MIN)));
            } else {
                for (r, xv) in xs.iter().enumerate() {
                    let mut want = vec![0i32; rows];
                    gemv_scalar(&wm, stride, xv, &mut want);
                    prop_assert_eq!(&got[r], &want, "vector {}", r);
                }
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]
        /// The AMX kernel gives the scalar sums for 1..=32 activation vectors at once (one or
        /// two row tiles, partly filled), for every row count (single and paired blocks of 16,
        /// partial blocks) and width (where the CPU has it; otherwise it must say so and write
        /// nothing).
        #[test]
        fn tile_kernel_equals_the_scalar_reference(
            rows in 1usize..70,
            chunks in 1usize..=16,
            n in 1usize..=TILE_ROWS,
            w in proptest::collection::vec(-127i8..=127, 1..600),
            x in proptest::collection::vec(-127i8..=127, 4..400),
        ) {
            let stride = chunks * PAD;
            let wm = matrix(rows, stride, &w);
            let vw = VerticalWeights::new(&wm, stride, rows).expect("stride within the vertical bound");
            let xs: Vec<Vec<i8>> = (0..n).map(|r| (0..stride).map(|i| x[(i * (r + 1) + r) % x.len()]).collect()).collect();
            let mut got: Vec<Vec<i32>> = vec![vec![i32::MIN; rows + 3]; n];
            let ran = Gemv::new(Isa::detect()).unwrap().tiles().map(|tiles| {
                let xr: Vec<&[i8]> = xs.iter().map(|v| &v[..]).collect();
                let mut or: Vec<&mut [i32]> = got.iter_mut().map(|v| &mut v[..]).collect();
                tiles.run(&vw, &xr, &mut or);
            }).is_some();
            if !ran {
                prop_assert!(!Isa::available().contains(&Isa::Amx));
                prop_assert!(got.iter().all(|g| g.iter().all(|&v| v == i32::MIN)));
            } else {
                for (r, xv) in xs.iter().enumerate() {
                    let mut want = vec![0i32; rows];
                    gemv_scalar(&wm, stride, xv, &mut want);
                    prop_assert_eq!(&got[r][..rows], &want[..], "vector {}", r);
                    // Nothing past the matrix's rows is written.
                    prop_assert!(got[r][rows..].iter().all(|&v| v == i32::MIN), "vector {} wrote past its rows", r);
                }
            }
        }
    }

    /// Timing printout (run with `--ignored --nocapture` in release where the CPU has AMX):
    /// the products alone for 32 rows of each default DQN layer, on the interleaved AVX-512
    /// VNNI kernel (4 passes of 8 rows) and on AMX tiles (configured once, or for every
    /// product): where a batch's time goes besides the per-row quantise / dequantise work.
    #[test]
    #[ignore = "timing printout; run with --ignored --nocapture in release"]
    fn timing_products_of_32_rows() {
        let gemv = Gemv::new(Isa::detect()).unwrap();
        if !gemv.has_tiles() {
            println!("no AMX on this CPU: nothing to compare");
            return;
        }
        let xs_all: Vec<Vec<i8>> =
            (0..TILE_ROWS).map(|r| (0..1024).map(|i| ((i * 7 + r * 13) % 255) as i8 - 127 + 1).collect()).collect();
        for (inp, out) in [(56usize, 256usize), (256, 256), (256, 128), (128, 1), (128, 3)] {
            let stride = padded(inp);
            let wm: Vec<i8> = (0..out * stride).map(|i| ((i * 31) % 255) as i8 - 127 + 1).collect();
            let vw = VerticalWeights::new(&wm, stride, out).unwrap();
            let xr: Vec<&[i8]> = xs_all.iter().map(|v| &v[..stride]).collect();
            let mut outs = vec![vec![0i32; out]; TILE_ROWS];
            let reps = 20_000;
            let mut time = |f: &mut dyn FnMut(&mut [&mut [i32]])| {
                let mut or: Vec<&mut [i32]> = outs.iter_mut().map(|v| &mut v[..]).collect();
                for _ in 0..200 {
                    f(&mut or);
                }
                let t = std::time::Instant::now();
                for _ in 0..reps {
                    f(&mut or);
                }
                t.elapsed().as_secs_f64() * 1e9 / reps as f64
            };
            let vertical = time(&mut |or| {
                for (x8, o8) in xr.chunks(MAX_ROWS).zip(or.chunks_mut(MAX_ROWS)) {
                    gemv.run_vertical(&vw, x8, o8);
                }
            });
            let each = time(&mut |or| gemv.tiles().unwrap().run(&vw, &xr, or));
            let tiles = gemv.tiles().unwrap();
            let once = time(&mut |or| tiles.run(&vw, &xr, or));
            println!(
                "{inp:>4} -> {out:>3}, 32 rows: vertical {vertical:.0} ns, AMX configured per product {each:.0} ns, configured once {once:.0} ns"
            );
        }
    }

    /// The extremes: every product ±127², the sums the AVX2 path must not saturate.
    #[test]
    fn extreme_values_do_not_saturate() {
        let stride = 4 * PAD;
        for (wv, xv) in [(127i8, 127i8), (-127, 127), (127, -127), (-127, -127)] {
            let w = vec![wv; 5 * stride];
            let x = vec![xv; stride];
            let rs = row_sums(&w, stride, 5);
            let want = i32::from(wv) * i32::from(xv) * stride as i32;
            for isa in Isa::available() {
                let mut got = vec![0; 5];
                Gemv::new(isa).unwrap().run(&w, stride, &x, &rs, &mut got);
                assert!(got.iter().all(|&g| g == want), "{isa:?}: {got:?} vs {want}");
                if isa == Isa::Amx {
                    // The tiles too, with every row of both row tiles at the extreme.
                    let vw = VerticalWeights::new(&w, stride, 5).unwrap();
                    let xs = vec![&x[..]; TILE_ROWS];
                    let mut outs = vec![vec![0i32; 5]; TILE_ROWS];
                    let mut or: Vec<&mut [i32]> = outs.iter_mut().map(|v| &mut v[..]).collect();
                    Gemv::new(isa).unwrap().tiles().unwrap().run(&vw, &xs, &mut or);
                    assert!(outs.iter().flatten().all(|&g| g == want), "AMX tiles: {outs:?} vs {want}");
                }
            }
        }
        assert_eq!(padded(56), 64);
        assert_eq!(padded(256), 256);
        assert_eq!(padded(1), 64);
    }
}
