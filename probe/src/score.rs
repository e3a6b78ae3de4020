//! Scoring rows: `s_k = w_k · x + b_k`, accumulated in f32.

use ringscope_ring::{rowscaled, DType};

use crate::spec::Probe;
use crate::ProbeError;

/// Decodes one row of `dtype` into `out` (its `d` elements as f32). `false` for a dtype probes cannot read or a
/// row of the wrong length.
pub fn row_to_f32(dtype: DType, row: &[u8], out: &mut [f32]) -> bool {
    let two = |row: &[u8]| row.len() == out.len() * 2;
    match dtype {
        DType::F32 if row.len() == out.len() * 4 => {
            for (o, c) in out.iter_mut().zip(row.chunks_exact(4)) {
                *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
        DType::BF16 if two(row) => {
            for (o, c) in out.iter_mut().zip(row.chunks_exact(2)) {
                *o = f32::from_bits((u16::from_le_bytes([c[0], c[1]]) as u32) << 16);
            }
        }
        DType::F16 if two(row) => {
            for (o, c) in out.iter_mut().zip(row.chunks_exact(2)) {
                *o = half::f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32();
            }
        }
        DType::F8E4M3RowScaled if row.len() == out.len() + rowscaled::SCALE_BYTES => rowscaled::decode_row(row, out),
        _ => return false,
    }
    true
}

/// Whether probes can score rows of `dtype`.
pub fn scorable(dtype: DType) -> bool {
    matches!(dtype, DType::F32 | DType::F16 | DType::BF16 | DType::F8E4M3RowScaled)
}

/// Scores rows for one probe. Holds a scratch row, so scoring allocates nothing.
#[derive(Debug)]
pub struct Scorer {
    weights: Vec<f32>,
    bias: Vec<f32>,
    width: usize,
    x: Vec<f32>,
    name: String,
}

/// Lanes of the dot product: independent partial sums the compiler keeps in vector registers.
const LANES: usize = 8;

impl Scorer {
    /// A scorer for `probe`.
    pub fn new(probe: &Probe) -> Scorer {
        Scorer {
            weights: probe.weights().values().to_vec(),
            bias: probe.bias().to_vec(),
            width: probe.width(),
            x: vec![0.0; probe.width()],
            name: probe.name().to_owned(),
        }
    }

    /// `K`.
    pub fn outputs(&self) -> usize {
        self.bias.len()
    }

    /// Scores one row of `dtype` into `out` (`K` values). A NaN or infinite element gives a NaN or infinite score.
    pub fn score(&mut self, dtype: DType, row: &[u8], out: &mut [f32]) -> Result<(), ProbeError> {
        if !row_to_f32(dtype, row, &mut self.x) {
            return Err(if scorable(dtype) {
                ProbeError::invalid(
                    &self.name,
                    format!("a row of {} bytes is not {} {} elements", row.len(), self.width, dtype.name()),
                )
            } else {
                ProbeError::DType { probe: self.name.clone(), dtype: dtype.name() }
            });
        }
        self.score_f32(out);
        Ok(())
    }

    /// Scores the row last decoded (or written into [`Scorer::row_mut`]) into `out`.
    pub fn score_f32(&self, out: &mut [f32]) {
        for ((o, w), b) in out.iter_mut().zip(self.weights.chunks_exact(self.width)).zip(&self.bias) {
            *o = dot(w, &self.x) + b;
        }
    }

    /// The scratch row, to score values the caller already has as f32.
    pub fn row_mut(&mut self) -> &mut [f32] {
        &mut self.x
    }
}

/// `w · x` in f32 over `LANES` partial sums (then summed pairwise).
fn dot(w: &[f32], x: &[f32]) -> f32 {
    let mut acc = [0.0f32; LANES];
    let (wc, xc) = (w.chunks_exact(LANES), x.chunks_exact(LANES));
    let (wr, xr) = (wc.remainder(), xc.remainder());
    for (a, b) in wc.zip(xc) {
        for l in 0..LANES {
            acc[l] += a[l] * b[l];
        }
    }
    for (l, (a, b)) in wr.iter().zip(xr).enumerate() {
        acc[l] += a * b;
    }
    let [a0, a1, a2, a3, a4, a5, a6, a7] = acc;
    ((a0 + a4) + (a2 + a6)) + ((a1 + a5) + (a3 + a7))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Action, Aggregation, ProbeDef, Target, Weights};

    fn probe(k: usize, d: usize) -> Probe {
        let w: Vec<f32> = (0..k * d).map(|i| ((i * 37 % 101) as f32 - 50.0) / 50.0).collect();
        let def = ProbeDef {
            name: "p".into(),
            target: Target::HookPoint("h".into()),
            weights: Weights::new(k, d, w).unwrap(),
            bias: (0..k).map(|i| i as f32 * 0.25).collect(),
            aggregation: Aggregation::Mean,
            thresholds: vec![1.0],
            action: Action::Alert,
            labels: vec![],
            min_tokens: 1,
        };
        Probe::new(def, d as u32).unwrap()
    }

    #[test]
    fn scores_match_an_f64_reference_for_every_float_dtype() {
        let (k, d) = (3, 37);
        let p = probe(k, d);
        let mut s = Scorer::new(&p);
        let x: Vec<f32> = (0..d).map(|i| (i as f32 * 0.7).sin()).collect();
        let rows: Vec<(DType, Vec<u8>)> = vec![
            (DType::F32, x.iter().flat_map(|v| v.to_le_bytes()).collect()),
            (DType::BF16, x.iter().flat_map(|v| half::bf16::from_f32(*v).to_le_bytes()).collect()),
            (DType::F16, x.iter().flat_map(|v| half::f16::from_f32(*v).to_le_bytes()).collect()),
        ];
        for (dtype, row) in rows {
            let mut xs = vec![0.0; d];
            assert!(row_to_f32(dtype, &row, &mut xs));
            let mut out = vec![0.0; k];
            s.score(dtype, &row, &mut out).unwrap();
            for (j, o) in out.iter().enumerate() {
                let r: f64 = p.weights().row(j).iter().zip(&xs).map(|(a, b)| *a as f64 * *b as f64).sum::<f64>()
                    + p.bias()[j] as f64;
                assert!((*o as f64 - r).abs() <= 1e-5 * r.abs().max(1.0), "{dtype:?} output {j}: {o} vs {r}");
            }
        }
    }

    #[test]
    fn a_nan_element_gives_a_nan_score_and_wrong_rows_are_errors() {
        let p = probe(1, 4);
        let mut s = Scorer::new(&p);
        let row: Vec<u8> = [1.0f32, f32::NAN, 0.0, 2.0].iter().flat_map(|v| v.to_le_bytes()).collect();
        let mut out = [0.0];
        s.score(DType::F32, &row, &mut out).unwrap();
        assert!(out[0].is_nan());
        let e = s.score(DType::F32, &row[..12], &mut out).unwrap_err().to_string();
        assert!(e.contains("12 bytes") && e.contains("probe `p`"), "{e}");
        let e = s.score(DType::I32, &row, &mut out).unwrap_err().to_string();
        assert!(e.contains("dtype i32"), "{e}");
    }
}
