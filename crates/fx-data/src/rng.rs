//! A small seeded PRNG (SplitMix64) so the synthetic market and the samplers
//! are reproducible from a `u64` seed without pulling in `rand`, and the SplitMix64
//! finaliser itself, which the environment's counter-based draws (`fx-kernels`) build on.

/// SplitMix64's additive constant (the golden ratio in 64 bits).
pub const GOLDEN: u64 = 0x9E37_79B9_7F4A_7C15;
/// First multiplier of the SplitMix64 finaliser.
pub const MUL1: u64 = 0xBF58_476D_1CE4_E5B9;
/// Second multiplier of the SplitMix64 finaliser.
pub const MUL2: u64 = 0x94D0_49BB_1331_11EB;

/// The SplitMix64 finaliser of MODELS.md, `mix(z)`: `z += GOLDEN`, two xor-shift-multiply
/// rounds and a final xor-shift (all wrapping in u64).
#[inline]
pub fn mix(z: u64) -> u64 {
    let z = z.wrapping_add(GOLDEN);
    let z = (z ^ (z >> 30)).wrapping_mul(MUL1);
    let z = (z ^ (z >> 27)).wrapping_mul(MUL2);
    z ^ (z >> 31)
}

/// SplitMix64: 64-bit state, passes BigCrush, trivially seedable.
#[derive(Debug, Clone)]
pub struct Rng {
    state: u64,
}

impl Rng {
    /// A generator from `seed` (any value, including 0).
    pub fn new(seed: u64) -> Self {
        Rng { state: seed }
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        let out = mix(self.state);
        self.state = self.state.wrapping_add(GOLDEN);
        out
    }

    /// Uniform in `[0, 1)` with 53 random bits.
    pub fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// Uniform integer in `[0, n)` (`n > 0`), without modulo bias worth noting
    /// (Lemire's multiply-shift).
    pub fn below(&mut self, n: u64) -> u64 {
        ((self.next_u64() as u128 * n as u128) >> 64) as u64
    }

    /// Standard normal (Box–Muller; one value per call keeps the stream simple).
    pub fn normal(&mut self) -> f64 {
        let u1 = 1.0 - self.uniform(); // (0, 1]: ln is finite
        let u2 = self.uniform();
        (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
    }

    /// Fisher–Yates shuffle.
    pub fn shuffle<T>(&mut self, xs: &mut [T]) {
        for i in (1..xs.len()).rev() {
            let j = self.below(i as u64 + 1) as usize;
            xs.swap(i, j);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn moments_and_determinism() {
        let mut a = Rng::new(42);
        let mut b = Rng::new(42);
        let n = 20_000;
        let xs: Vec<f64> = (0..n).map(|_| a.normal()).collect();
        let ys: Vec<f64> = (0..n).map(|_| b.normal()).collect();
        assert_eq!(xs, ys);
        let m = xs.iter().sum::<f64>() / n as f64;
        let v = xs.iter().map(|x| (x - m).powi(2)).sum::<f64>() / n as f64;
        assert!(m.abs() < 0.03 && (v - 1.0).abs() < 0.05, "{m} {v}");
        let mut c = Rng::new(1);
        let counts = (0..7000).fold([0usize; 7], |mut acc, _| {
            acc[c.below(7) as usize] += 1;
            acc
        });
        assert!(counts.iter().all(|&k| (850..1150).contains(&k)), "{counts:?}");
    }

    #[test]
    fn shuffle_is_a_permutation() {
        let mut r = Rng::new(3);
        let mut v: Vec<usize> = (0..100).collect();
        r.shuffle(&mut v);
        assert_ne!(v, (0..100).collect::<Vec<_>>());
        v.sort();
        assert_eq!(v, (0..100).collect::<Vec<_>>());
    }
}
