//! Intel AMX tiles for [`super::Tiles::run`] (Sapphire Rapids and later Xeons).
//!
//! One `tdpbusd` multiplies a 16 × 64 tile of unsigned activation bytes by a 64 × 16 tile
//! of signed weight bytes into 16 × 16 i32 sums: 16,384 multiply-adds, against 64 for an
//! AVX-512 `vpdpbusd`. The weight tile is exactly a 1 KB slice of [`VerticalWeights`]
//! (sixteen groups of four inputs, each sixteen output lanes × four bytes), so the
//! interleaved layout serves both kernels. Activations take the VNNI paths' `x + 128`
//! (`x ^ 0x80`) and `128 · row_sum` comes off afterwards: the sums are exact integers, the
//! same as [`super::gemv_scalar`]'s.
//!
//! Linux hands the tile registers to a process only on request (`arch_prctl`,
//! `ARCH_REQ_XCOMP_PERM`); [`available`] asks once. The instructions are written as inline
//! assembly: Rust's AMX intrinsics are not stable.

// The tile types and the kernel exist for x86_64 only.
#![cfg_attr(not(target_arch = "x86_64"), allow(dead_code, unused_imports))]

use super::{VerticalWeights, MAX_VERTICAL_INPUTS, TILE_ROWS};

/// Whether this CPU has AMX-TILE and AMX-INT8 and the kernel granted this process the
/// tile data (asked once; the grant holds for every thread of the process).
pub(super) fn available() -> bool {
    static OK: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *OK.get_or_init(|| {
        #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
        {
            use std::arch::x86_64::{__cpuid, __cpuid_count};
            // SAFETY: CPUID exists on every x86_64 CPU.
            #[allow(unused_unsafe)]
            let (max_leaf, leaf7) = unsafe { (__cpuid(0).eax, __cpuid_count(7, 0)) };
            // CPUID.(7, 0):EDX bit 24 AMX-TILE, bit 25 AMX-INT8.
            if max_leaf < 7 || leaf7.edx & (1 << 24) == 0 || leaf7.edx & (1 << 25) == 0 {
                return false;
            }
            const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
            const XFEATURE_XTILEDATA: libc::c_long = 18;
            // SAFETY: a plain system call with integer arguments; it fails (EINVAL) where the
            // kernel or the CPU lacks the feature, and changes nothing else.
            unsafe { libc::syscall(libc::SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 }
        }
        #[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
        false
    })
}

/// The 64-byte tile configuration `ldtilecfg` reads.
#[repr(C, align(64))]
struct TileConfig([u8; 64]);

/// Palette 1, all eight tiles 16 rows × 64 bytes: activations (16 rows × 64 inputs), weights
/// (16 groups of 4 inputs × 16 outputs × 4 bytes) and sums (16 rows × 16 i32) alike.
const CONFIG: TileConfig = {
    let mut c = [0u8; 64];
    c[0] = 1;
    let mut t = 0;
    while t < 8 {
        c[16 + 2 * t] = 64; // bytes per row, u16 little-endian
        c[48 + t] = 16; // rows
        t += 1;
    }
    TileConfig(c)
};

/// The activations of one pass, `x ^ 0x80`, `w.stride` bytes a row.
#[repr(C, align(64))]
struct Stage([u8; TILE_ROWS * MAX_VERTICAL_INPUTS]);

/// Four 16 × 16 sum tiles, one after the other: (rows 0–15, block b), (0–15, b + 1),
/// (16–31, b), (16–31, b + 1).
#[repr(C, align(64))]
struct Sums([i32; 4 * 256]);

/// Loads the tile configuration on this thread.
///
/// # Safety
/// [`available`] returned true.
#[cfg(target_arch = "x86_64")]
pub(super) unsafe fn configure() {
    // SAFETY: CONFIG is a valid palette-1 configuration; the process holds the tile grant.
    unsafe { std::arch::asm!("ldtilecfg [{}]", in(reg) &CONFIG as *const TileConfig, options(nostack, readonly)) };
}

/// Returns the tiles to their initial state (unconfigured).
///
/// # Safety
/// [`available`] returned true.
#[cfg(target_arch = "x86_64")]
pub(super) unsafe fn release() {
    unsafe { std::arch::asm!("tilerelease", options(nostack, nomem)) };
}

/// `outs[r][o] = Σ_i w[o, i] · xs[r][i]` for the `xs.len()` (1 ..= [`TILE_ROWS`]) vectors.
///
/// # Safety
/// [`configure`] ran on this thread (and no other configuration since), AVX-512 F/BW are
/// present, and the lengths are as [`super::Tiles::run`] checks them (`xs[r]` at least
/// `w.stride` bytes, `outs[r]` at least `w.rows` values).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
pub(super) unsafe fn gemv_tiles(w: &VerticalWeights, xs: &[&[i8]], outs: &mut [&mut [i32]]) {
    use std::arch::asm;
    use std::arch::x86_64::*;
    const L: usize = 16;
    let (n, stride) = (xs.len(), w.stride);
    debug_assert!((1..=TILE_ROWS).contains(&n) && stride <= MAX_VERTICAL_INPUTS && stride.is_multiple_of(64));
    let mut stage = std::mem::MaybeUninit::<Stage>::uninit();
    let sp = stage.as_mut_ptr() as *mut u8;
    let bias = _mm512_set1_epi8(0x80u8 as i8);
    for r in 0..TILE_ROWS {
        let x = xs.get(r);
        let mut c = 0;
        while c < stride {
            // SAFETY: row r of the stage holds `stride` <= MAX_VERTICAL_INPUTS bytes; `xs[r]`
            // at least `stride` (checked by Tiles::run). Rows past `n` are zeroed: their sums
            // are dropped, but the tile loads read them.
            unsafe {
                let v = match x {
                    Some(x) => _mm512_xor_si512(_mm512_loadu_si512(x.as_ptr().add(c) as *const __m512i), bias),
                    None => _mm512_setzero_si512(),
                };
                _mm512_store_si512(sp.add(r * stride + c) as *mut __m512i, v);
            }
            c += 64;
        }
    }
    let mut sums = Sums([0; 4 * 256]);
    let cp = sums.0.as_mut_ptr();
    let (wp, groups, ksteps) = (w.data.as_ptr(), stride / 4, stride / 64);
    let blocks = w.row_sum.len() / L;
    let mut b = 0;
    while b < blocks {
        let pair = b + 1 < blocks;
        // Block b's weights start at b · groups · 64 bytes; each step of 64 inputs is the
        // next 1 KB (16 groups × 64 bytes, a row stride of 64). A last, unpaired block is
        // multiplied twice (its second sums are not read): one instruction sequence for both.
        let b0 = unsafe { wp.add(b * groups * 64) };
        let (b1, a0) = (if pair { unsafe { b0.add(groups * 64) } } else { b0 }, sp as *const u8);
        // SAFETY: every tile load stays inside the stage (32 rows × stride) or block b's (and
        // b + 1's where paired) weights (ksteps KB each); the stores fill `sums` (4 KB).
        unsafe {
            asm!(
                "tilezero tmm0",
                "tilezero tmm1",
                "tilezero tmm2",
                "tilezero tmm3",
                "2:",
                "tileloadd tmm4, [{a0} + {sa}]",
                "tileloadd tmm5, [{a1} + {sa}]",
                "tileloadd tmm6, [{b0} + {sb}]",
                "tileloadd tmm7, [{b1} + {sb}]",
                "tdpbusd tmm0, tmm4, tmm6",
                "tdpbusd tmm1, tmm4, tmm7",
                "tdpbusd tmm2, tmm5, tmm6",
                "tdpbusd tmm3, tmm5, tmm7",
                "add {a0}, 64",
                "add {a1}, 64",
                "add {b0}, 1024",
                "add {b1}, 1024",
                "dec {k}",
                "jnz 2b",
                "tilestored [{c} + {sb}], tmm0",
                "add {c}, 1024",
                "tilestored [{c} + {sb}], tmm1",
                "add {c}, 1024",
                "tilestored [{c} + {sb}], tmm2",
                "add {c}, 1024",
                "tilestored [{c} + {sb}], tmm3",
                a0 = inout(reg) a0 => _,
                a1 = inout(reg) a0.add(L * stride) => _,
                b0 = inout(reg) b0 => _,
                b1 = inout(reg) b1 => _,
                k = inout(reg) ksteps => _,
                c = inout(reg) cp => _,
                sa = in(reg) stride,
                sb = in(reg) 64usize,
                options(nostack),
            );
        }
        // Sums − 128 · row_sum into the valid outputs of each row.
        for half in 0..(1 + usize::from(pair)) {
            let lo = (b + half) * L;
            // SAFETY: row_sum holds whole blocks of 16.
            let corr =
                _mm512_slli_epi32::<7>(unsafe { _mm512_loadu_si512(w.row_sum.as_ptr().add(lo) as *const __m512i) });
            let valid = w.rows.saturating_sub(lo).min(L);
            let mask: __mmask16 = if valid == L { 0xffff } else { (1u16 << valid) - 1 };
            for (r, out) in outs.iter_mut().enumerate().take(n) {
                let tile = half + if r < L { 0 } else { 2 };
                // SAFETY: tile < 4, r % 16 < 16: inside `sums`; lanes past `valid` are masked
                // off and out holds w.rows values.
                unsafe {
                    let s = _mm512_load_si512(cp.add(tile * 256 + (r % L) * L) as *const __m512i);
                    _mm512_mask_storeu_epi32(out.as_mut_ptr().add(lo), mask, _mm512_sub_epi32(s, corr));
                }
            }
        }
        b += 1 + usize::from(pair);
    }
}
