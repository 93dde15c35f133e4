//! [`Skewed`]: a fixed-length buffer whose first element sits at a chosen byte offset
//! modulo 4 KiB.
//!
//! A batch pass streams through several buffers at once: the i32 sums in and the F32
//! activations out, then those activations in and the INT8 bytes out. Intel cores compare
//! only the low 12 address bits when deciding whether a load must wait for an earlier
//! store ("4K aliasing"), so two buffers that start at the same offset modulo 4 KiB make
//! every load of one wait on the stores to the other just before it. Consecutive
//! allocations of whole multiples of 4 KiB (32 rows × 256 values) start exactly so. Each
//! buffer of a pass gets its own offset instead.

use std::ops::{Deref, DerefMut};

/// The period of the aliasing.
const PAGE: usize = 4096;

/// `len` values of `T`, the first at `skew` bytes past a 4 KiB boundary.
pub(crate) struct Skewed<T> {
    buf: Vec<T>,
    start: usize,
    len: usize,
    skew: usize,
}

impl<T: Copy + Default> Skewed<T> {
    /// `len` default values at `skew` (< 4096, a multiple of `T`'s size) bytes past a 4 KiB
    /// boundary; 4 KiB more are allocated to find that place. For types aligned to their
    /// size (the numbers it holds here).
    pub(crate) fn new(len: usize, skew: usize) -> Self {
        let size = std::mem::size_of::<T>().max(1);
        assert!(std::mem::align_of::<T>() == size, "Skewed::new: a type aligned to its size");
        assert!(skew < PAGE && skew.is_multiple_of(size), "Skewed::new: skew {skew}");
        let buf = vec![T::default(); len + PAGE / size];
        // The allocation is aligned to `size`, and so is `skew`: a whole number of values.
        let start = (skew + PAGE - buf.as_ptr() as usize % PAGE) % PAGE / size;
        Self { buf, start, len, skew }
    }
}

impl<T: Copy + Default> Clone for Skewed<T> {
    /// A fresh buffer at the same skew (a cloned `Vec` would land anywhere).
    fn clone(&self) -> Self {
        let mut c = Self::new(self.len, self.skew);
        c.copy_from_slice(self);
        c
    }
}

/// The values, not the padding around them.
impl<T: std::fmt::Debug> std::fmt::Debug for Skewed<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Skewed").field("skew", &self.skew).field("values", &&self[..]).finish()
    }
}

impl<T> Deref for Skewed<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        &self.buf[self.start..self.start + self.len]
    }
}

impl<T> DerefMut for Skewed<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        &mut self.buf[self.start..self.start + self.len]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_start_at_their_skew_and_hold_their_length() {
        for (len, skew) in [(0usize, 0usize), (1, 64), (8192, 1024), (300, 3072), (5, 4092)] {
            let mut b = Skewed::<f32>::new(len, skew);
            assert_eq!(b.len(), len);
            if len > 0 {
                assert_eq!(b.as_ptr() as usize % PAGE, skew, "len {len}");
            }
            b.iter_mut().enumerate().for_each(|(i, v)| *v = i as f32);
            let c = b.clone();
            assert_eq!(&c[..], &b[..]);
            if len > 0 {
                assert_eq!(c.as_ptr() as usize % PAGE, skew);
            }
        }
        let q = Skewed::<i8>::new(100, 2049);
        assert_eq!(q.as_ptr() as usize % PAGE, 2049);
    }
}
