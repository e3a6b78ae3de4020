//! Calibration retention (ProbeX): does a frozen probe direction still separate two calibration groups?
//!
//! For probe output `k` with weights `w`, and two calibration groups `a` and `b` of activations captured at the
//! probe's hookpoint, the **alignment** is `cos(w, μ_a − μ_b)` — the cosine between the probe's direction and a fresh
//! difference of the groups' means. The **retention** is the alignment in a run (a quantized model, a new engine, a
//! new build) divided by the alignment in a reference run (e.g. the bf16 model) on the same calibration inputs.
//! Needing no labels at serving time, it is ≈ 1 while the probe still reads the concept it was trained on and
//! collapses towards 0 where quantization (or anything else) broke the representation.

use ringscope_ring::DType;

use crate::score::row_to_f32;
use crate::Weights;

/// The mean of rows, accumulated in f64.
#[derive(Debug, Clone)]
pub struct MeanAccumulator {
    sum: Vec<f64>,
    scratch: Vec<f32>,
    rows: u64,
    skipped: u64,
}

impl MeanAccumulator {
    /// An empty accumulator of `width`-element rows.
    pub fn new(width: usize) -> MeanAccumulator {
        MeanAccumulator { sum: vec![0.0; width], scratch: vec![0.0; width], rows: 0, skipped: 0 }
    }

    /// Adds one row. Rows with a non-finite element are skipped (and counted).
    pub fn add(&mut self, row: &[f32]) {
        assert_eq!(row.len(), self.sum.len(), "row width");
        if row.iter().any(|x| !x.is_finite()) {
            self.skipped += 1;
            return;
        }
        for (s, x) in self.sum.iter_mut().zip(row) {
            *s += *x as f64;
        }
        self.rows += 1;
    }

    /// Adds one row of `dtype` as a record holds it; `false` when it is not a float row of this width.
    pub fn add_bytes(&mut self, dtype: DType, row: &[u8]) -> bool {
        let mut x = std::mem::take(&mut self.scratch);
        let ok = row_to_f32(dtype, row, &mut x);
        if ok {
            self.add(&x);
        }
        self.scratch = x;
        ok
    }

    /// Rows added.
    pub fn rows(&self) -> u64 {
        self.rows
    }

    /// Rows skipped for a non-finite element.
    pub fn skipped(&self) -> u64 {
        self.skipped
    }

    /// The mean, or `None` before the first row.
    pub fn mean(&self) -> Option<Vec<f64>> {
        (self.rows > 0).then(|| self.sum.iter().map(|s| s / self.rows as f64).collect())
    }
}

/// `cos(w, v)`; NaN when either is zero.
pub fn cosine(w: &[f32], v: &[f64]) -> f64 {
    let (mut dot, mut ww, mut vv) = (0.0f64, 0.0f64, 0.0f64);
    for (a, b) in w.iter().zip(v) {
        let a = *a as f64;
        dot += a * b;
        ww += a * a;
        vv += b * b;
    }
    if ww == 0.0 || vv == 0.0 {
        return f64::NAN;
    }
    dot / (ww.sqrt() * vv.sqrt())
}

/// One calibration run's two groups at one hookpoint.
#[derive(Debug, Clone)]
pub struct Groups {
    /// Group `a` (e.g. the concept present).
    pub a: MeanAccumulator,
    /// Group `b` (e.g. the concept absent).
    pub b: MeanAccumulator,
}

impl Groups {
    /// Two empty groups of `width`-element rows.
    pub fn new(width: usize) -> Groups {
        Groups { a: MeanAccumulator::new(width), b: MeanAccumulator::new(width) }
    }

    /// `μ_a − μ_b`, or `None` while a group is empty.
    pub fn difference(&self) -> Option<Vec<f64>> {
        let (a, b) = (self.a.mean()?, self.b.mean()?);
        Some(a.iter().zip(&b).map(|(x, y)| x - y).collect())
    }
}

/// One probe output's retention.
#[derive(Debug, Clone, PartialEq)]
pub struct Retention {
    /// The output.
    pub output: usize,
    /// `cos(w, μ_a − μ_b)` in the run (NaN when a group is empty or the means are equal).
    pub alignment: f64,
    /// The same in the reference run, when one was given.
    pub reference_alignment: Option<f64>,
    /// `alignment / reference_alignment` (None without a reference, NaN when the reference alignment is 0 or
    /// NaN).
    pub retention: Option<f64>,
}

impl Retention {
    /// Whether this output should be flagged: its retention (or, without a reference, its alignment) is below
    /// `threshold` or not a number.
    pub fn below(&self, threshold: f64) -> bool {
        let v = self.retention.unwrap_or(self.alignment);
        // Below, or not a number (NaN compares as neither greater nor equal).
        !matches!(v.partial_cmp(&threshold), Some(std::cmp::Ordering::Greater | std::cmp::Ordering::Equal))
    }
}

/// The retention of every output of `weights` in `run`, normalised by `reference` when given.
pub fn retention(weights: &Weights, run: &Groups, reference: Option<&Groups>) -> Vec<Retention> {
    let diff = run.difference();
    let ref_diff = reference.map(|r| r.difference());
    (0..weights.outputs())
        .map(|k| {
            let w = weights.row(k);
            let alignment = diff.as_ref().map_or(f64::NAN, |d| cosine(w, d));
            let reference_alignment = ref_diff.as_ref().map(|d| d.as_ref().map_or(f64::NAN, |d| cosine(w, d)));
            let retention = reference_alignment.map(|r| if r == 0.0 { f64::NAN } else { alignment / r });
            Retention { output: k, alignment, reference_alignment, retention }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Rows `base + s · direction + noise`: group a at s = +1, group b at s = −1.
    fn groups(direction: &[f32], scale: f32, n: usize, seed: u64) -> Groups {
        let d = direction.len();
        let mut g = Groups::new(d);
        let mut x = seed;
        let mut noise = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            ((x >> 11) as f64 / (1u64 << 53) as f64 - 0.5) as f32 * 0.01
        };
        for i in 0..n {
            for (acc, s) in [(&mut g.a, 1.0f32), (&mut g.b, -1.0)] {
                let row: Vec<f32> =
                    (0..d).map(|j| (i + j) as f32 * 0.001 + s * scale * direction[j] + noise()).collect();
                acc.add(&row);
            }
        }
        g
    }

    #[test]
    fn retention_is_one_when_the_direction_survives_and_the_cosine_when_it_rotates() {
        let d = 16;
        let w: Vec<f32> = (0..d).map(|j| if j == 0 { 1.0 } else { 0.0 }).collect();
        let weights = Weights::new(1, d, w.clone()).unwrap();
        let reference = groups(&w, 1.0, 200, 1);
        let same = groups(&w, 0.5, 200, 2);
        let r = &retention(&weights, &same, Some(&reference))[0];
        assert!((r.retention.unwrap() - 1.0).abs() < 1e-3, "{r:?}");
        assert!(!r.below(0.9));
        // The concept rotated by 60°: the alignment is cos 60° = 0.5, the reference's 1.
        let rotated: Vec<f32> = (0..d).map(|j| [0.5, 0.75f32.sqrt()].get(j).copied().unwrap_or(0.0)).collect();
        let r = &retention(&weights, &groups(&rotated, 1.0, 200, 3), Some(&reference))[0];
        assert!((r.alignment - 0.5).abs() < 1e-2, "{r:?}");
        assert!((r.retention.unwrap() - 0.5).abs() < 1e-2, "{r:?}");
        assert!(r.below(0.9));
        // Broken: the concept is gone (orthogonal); an empty group is NaN and flagged.
        let gone: Vec<f32> = (0..d).map(|j| if j == 1 { 1.0 } else { 0.0 }).collect();
        let r = &retention(&weights, &groups(&gone, 1.0, 200, 4), Some(&reference))[0];
        assert!(r.retention.unwrap().abs() < 1e-2, "{r:?}");
        let r = &retention(&weights, &Groups::new(d), None)[0];
        assert!(r.alignment.is_nan() && r.below(0.5));
    }
}
