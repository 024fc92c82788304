//! Counter-based random numbers shared by the CPU and the GPU kernels: the same
//! (seed, counters) give the same number on both, with no state to carry.

/// One round of the PCG hash (O'Neill); a good 32-bit mixer that WGSL can run too.
pub fn pcg_hash(input: u32) -> u32 {
    let state = input.wrapping_mul(747796405).wrapping_add(2891336453);
    let word = ((state >> ((state >> 28).wrapping_add(4))) ^ state).wrapping_mul(277803737);
    (word >> 22) ^ word
}

/// Hash of a seed and three counters (for example step, position, token).
pub fn hash4(seed_lo: u32, seed_hi: u32, a: u32, b: u32, c: u32) -> u32 {
    let mut h = pcg_hash(seed_lo ^ pcg_hash(seed_hi));
    h = pcg_hash(h ^ a);
    h = pcg_hash(h ^ b);
    pcg_hash(h ^ c)
}

/// Uniform in the open interval (0, 1) from 23 random bits, exactly representable in f32.
/// (24 bits plus the half would need 25 significant bits: the top value rounds to 1.0.)
pub fn uniform_open(bits: u32) -> f32 {
    ((bits >> 9) as f32 + 0.5) * (1.0 / 8_388_608.0)
}

/// SplitMix64: a small sequential generator for host-side randomness (random remasking).
#[derive(Clone, Debug)]
pub struct SplitMix64(pub u64);

const SPLITMIX_GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;

fn splitmix_mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl SplitMix64 {
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(SPLITMIX_GAMMA);
        splitmix_mix(self.0)
    }

    /// The `n`-th output (from 0) of `SplitMix64(seed)` without drawing the ones before:
    /// the state only advances by a constant, so any element of a stream can be made alone
    /// (counter-based use, e.g. synthetic weights written in any chunking).
    pub fn nth(seed: u64, n: u64) -> u64 {
        splitmix_mix(seed.wrapping_add(n.wrapping_add(1).wrapping_mul(SPLITMIX_GAMMA)))
    }

    /// Uniform in [0, 1) with 53 random bits.
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / 9_007_199_254_740_992.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uniform_is_open_and_spread() {
        let mut lo = 1.0f32;
        let mut hi = 0.0f32;
        for i in 0..100_000u32 {
            let u = uniform_open(hash4(1, 2, 3, 4, i));
            assert!(u > 0.0 && u < 1.0);
            lo = lo.min(u);
            hi = hi.max(u);
        }
        assert!(lo < 0.001 && hi > 0.999, "lo={lo} hi={hi}");
        assert!(uniform_open(u32::MAX) < 1.0 && uniform_open(0) > 0.0);
    }

    #[test]
    fn splitmix_is_deterministic() {
        let mut a = SplitMix64(42);
        let mut b = SplitMix64(42);
        assert_eq!(a.next_u64(), b.next_u64());
        assert_ne!(a.next_u64(), SplitMix64(43).next_u64());
    }

    #[test]
    fn splitmix_nth_matches_the_sequence() {
        let mut s = SplitMix64(7);
        for n in 0..100 {
            assert_eq!(s.next_u64(), SplitMix64::nth(7, n));
        }
        let mut s = SplitMix64(u64::MAX - 3);
        let seq: Vec<u64> = (0..10).map(|_| s.next_u64()).collect();
        assert_eq!(SplitMix64::nth(u64::MAX - 3, 9), seq[9]);
    }
}
