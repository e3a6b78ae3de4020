//! What the benchmark drivers share: synthetic activations and percentiles.
#![allow(dead_code)] // each driver uses part of it

/// `elems` standard-normal bf16 values (xorshift + Box–Muller), little-endian bytes; the same for the same seed.
pub fn activations(elems: usize, seed: u64) -> Vec<u8> {
    let mut s = seed | 1;
    let mut next = || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        (s >> 11) as f64 / (1u64 << 53) as f64
    };
    let mut out = Vec::with_capacity(elems * 2);
    for _ in 0..elems {
        let (u, v) = (next().max(1e-300), next());
        let z = (-2.0 * u.ln()).sqrt() * (2.0 * std::f64::consts::PI * v).cos();
        out.extend_from_slice(&(((z as f32).to_bits() >> 16) as u16).to_le_bytes());
    }
    out
}

/// A bf16 value from its little-endian bytes.
pub fn bf16(b: [u8; 2]) -> f32 {
    f32::from_bits((u16::from_le_bytes(b) as u32) << 16)
}

/// The `p` quantile (0..=1) of ascending `sorted` (nearest rank).
pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}
