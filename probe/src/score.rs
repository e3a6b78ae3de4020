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

/// Scores rows for one probe. Holds scratch rows, so scoring allocates nothing.
#[derive(Debug)]
pub struct Scorer {
    weights: Vec<f32>,
    bias: Vec<f32>,
    width: usize,
    x: Vec<f32>,
    /// `BLOCK` decoded rows, scored together so that each weight loaded serves `BLOCK` rows.
    block: Vec<f32>,
    name: String,
}

/// Rows scored per pass over the weights (`BLOCK × LANES` accumulators stay in registers).
const BLOCK: usize = 4;

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
            block: vec![0.0; BLOCK * probe.width()],
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

    /// Scores `rows` (whole rows of `dtype`, back to back) into `out` (`K` values per row, row after row): the same
    /// values as [`Scorer::score`] row by row, faster.
    pub fn score_rows(&mut self, dtype: DType, rows: &[u8], out: &mut [f32]) -> Result<(), ProbeError> {
        let k = self.bias.len();
        let d = self.width;
        let row_bytes = if dtype == DType::F8E4M3RowScaled { d + rowscaled::SCALE_BYTES } else { d * dtype.size() };
        if !scorable(dtype) {
            return Err(ProbeError::DType { probe: self.name.clone(), dtype: dtype.name() });
        }
        if !rows.len().is_multiple_of(row_bytes) || out.len() != rows.len() / row_bytes * k {
            return Err(ProbeError::invalid(
                &self.name,
                format!("{} bytes are not whole rows of {d} {} elements", rows.len(), dtype.name()),
            ));
        }
        for (chunk, out) in rows.chunks(BLOCK * row_bytes).zip(out.chunks_mut(BLOCK * k)) {
            let n = chunk.len() / row_bytes;
            for (row, x) in chunk.chunks_exact(row_bytes).zip(self.block.chunks_exact_mut(d)) {
                row_to_f32(dtype, row, x);
            }
            if n < BLOCK {
                self.block[n * d..].fill(0.0);
            }
            for (j, (w, b)) in self.weights.chunks_exact(d).zip(&self.bias).enumerate() {
                let sums = dot_block(w, &self.block, d);
                for r in 0..n {
                    out[r * k + j] = sums[r] + b;
                }
            }
        }
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
    reduce(acc)
}

/// The sum of the lanes, in one fixed order (so a row's score does not depend on how it was batched).
fn reduce(acc: [f32; LANES]) -> f32 {
    let [a0, a1, a2, a3, a4, a5, a6, a7] = acc;
    ((a0 + a4) + (a2 + a6)) + ((a1 + a5) + (a3 + a7))
}

/// `w · x_r` for the `BLOCK` rows of `xs` (`d` each), lane for lane as [`dot`] does.
fn dot_block(w: &[f32], xs: &[f32], d: usize) -> [f32; BLOCK] {
    let (x0, rest) = xs.split_at(d);
    let (x1, rest) = rest.split_at(d);
    let (x2, x3) = rest.split_at(d);
    let (mut a0, mut a1, mut a2, mut a3) = ([0.0f32; LANES], [0.0f32; LANES], [0.0f32; LANES], [0.0f32; LANES]);
    let chunks = w
        .chunks_exact(LANES)
        .zip(x0.chunks_exact(LANES))
        .zip(x1.chunks_exact(LANES))
        .zip(x2.chunks_exact(LANES))
        .zip(x3.chunks_exact(LANES));
    for ((((w, x0), x1), x2), x3) in chunks {
        for l in 0..LANES {
            a0[l] += w[l] * x0[l];
            a1[l] += w[l] * x1[l];
            a2[l] += w[l] * x2[l];
            a3[l] += w[l] * x3[l];
        }
    }
    let full = d / LANES * LANES;
    for l in 0..d - full {
        let wl = w[full + l];
        a0[l] += wl * x0[full + l];
        a1[l] += wl * x1[full + l];
        a2[l] += wl * x2[full + l];
        a3[l] += wl * x3[full + l];
    }
    [reduce(a0), reduce(a1), reduce(a2), reduce(a3)]
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
    fn scoring_rows_in_blocks_gives_exactly_the_row_by_row_scores() {
        let (k, d) = (5, 37);
        let p = probe(k, d);
        let mut s = Scorer::new(&p);
        for n in [1usize, 3, 4, 9] {
            let rows: Vec<u8> =
                (0..n * d).flat_map(|i| half::bf16::from_f32((i as f32 * 0.37).cos()).to_le_bytes()).collect();
            let mut block = vec![0.0; n * k];
            s.score_rows(DType::BF16, &rows, &mut block).unwrap();
            for r in 0..n {
                let mut one = vec![0.0; k];
                s.score(DType::BF16, &rows[r * d * 2..(r + 1) * d * 2], &mut one).unwrap();
                assert_eq!(&block[r * k..(r + 1) * k], &one[..], "{n} rows, row {r}");
            }
        }
        let mut out = vec![0.0; k];
        assert!(s.score_rows(DType::BF16, &[0u8; 10], &mut out).is_err(), "not whole rows");
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
