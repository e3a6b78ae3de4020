//! Row-scaled FP8 E4M3: how a downcast row is encoded (dtype [`DType::F8E4M3RowScaled`], docs/format.md).
//!
//! A row of `w` elements becomes `w + 4` bytes: the row's scale as a little-endian `f32`, then one OCP FP8 E4M3
//! byte per element. Element `i` reads back as `e4m3_to_f32(byte[i]) × scale`.
//!
//! * `amax` is the largest magnitude over the row's *finite* elements; `scale = amax / 448` (448 is E4M3's largest
//!   finite value), or `1` when that is not positive (an all-zero row, or one whose `amax / 448` underflows to 0).
//! * Each element is `x / scale` (an IEEE `f32` division) rounded to the nearest E4M3 value, ties to even, and
//!   saturated to ±448: ±∞ becomes ±448; NaN becomes `0x7F` (E4M3's NaN); −0 stays −0 (`0x80`).
//!
//! For an element whose quotient is an E4M3 normal (|x / scale| ≥ 2⁻⁶, i.e. |x| ≥ amax / 28672) the relative error
//! is at most 2⁻⁴ (half a unit in the last place of a 3-bit mantissa), plus the two `f32` roundings of the division
//! and the dequantizing product. Smaller elements (E4M3 subnormals) have an absolute error of at most
//! `scale × 2⁻¹⁰`.
//!
//! The CUDA capture kernels (`hookpoint/kernels/capture.cu`, `rs_e4m3`) do the same arithmetic step for step, so a row
//! downcast on the device has exactly the bytes [`encode_row`] writes on the host.

use crate::DType;

/// Bytes of the scale at the start of each row.
pub const SCALE_BYTES: usize = 4;

/// The largest finite E4M3 value.
pub const E4M3_MAX: f32 = 448.0;

/// E4M3's NaN (with the sign bit clear; `0xFF` is NaN too).
pub const E4M3_NAN: u8 = 0x7F;

/// The value of an E4M3 byte (OCP FP8 E4M3, "fn": no infinities, NaN is `S.1111.111`).
pub fn e4m3_to_f32(b: u8) -> f32 {
    let sign = if b & 0x80 != 0 { -1.0f32 } else { 1.0 };
    let e = (b >> 3) & 0xF;
    let m = (b & 7) as f32;
    let magnitude = match (e, b & 7) {
        (15, 7) => return f32::NAN,
        (0, _) => m * (2.0f32).powi(-9),
        _ => (1.0 + m / 8.0) * (2.0f32).powi(e as i32 - 7),
    };
    sign * magnitude
}

/// `x` rounded to the nearest E4M3 value (ties to even), saturated to ±448; NaN → [`E4M3_NAN`].
pub fn f32_to_e4m3(x: f32) -> u8 {
    if x.is_nan() {
        return E4M3_NAN;
    }
    let sign = ((x.to_bits() >> 24) & 0x80) as u8;
    let a = x.abs();
    if a >= E4M3_MAX {
        return sign | 0x7E;
    }
    if a < 1.0 / 64.0 {
        // Subnormals (and zero): multiples of 2⁻⁹. `a × 512` is exact; 8 × 2⁻⁹ rounds up to the smallest normal,
        // whose code is 8 too.
        return sign | (a * 512.0).round_ties_even() as u8;
    }
    // Normals: keep the f32's exponent and top 3 mantissa bits, round the other 20 to nearest even. A carry out of
    // the mantissa moves to the next exponent, which is the right value; it never reaches 0x7F (a < 448 here, and
    // the midpoint 464 between 448 and 480 is above it).
    let bits = a.to_bits();
    let exp = (bits >> 23) as i32 - 127;
    let mant = bits & 0x7F_FFFF;
    let mut code = (((exp + 7) as u32) << 3) | (mant >> 20);
    let rest = mant & 0xF_FFFF;
    if rest > 0x8_0000 || (rest == 0x8_0000 && code & 1 == 1) {
        code += 1;
    }
    sign | code as u8
}

/// The scale of a row whose largest finite magnitude is `amax`.
pub fn row_scale(amax: f32) -> f32 {
    let scale = amax / E4M3_MAX;
    if scale > 0.0 && scale.is_finite() {
        scale
    } else {
        1.0
    }
}

/// Element `i` of a row of `dtype` (F32, F16 or BF16), as `f32` (exact).
fn element(dtype: DType, src: &[u8], i: usize) -> f32 {
    match dtype {
        DType::F32 => f32::from_le_bytes(src[4 * i..4 * i + 4].try_into().expect("4 bytes")),
        DType::F16 => half::f16::from_bits(u16::from_le_bytes([src[2 * i], src[2 * i + 1]])).to_f32(),
        DType::BF16 => f32::from_bits((u16::from_le_bytes([src[2 * i], src[2 * i + 1]]) as u32) << 16),
        other => unreachable!("{other} rows are not downcast"),
    }
}

/// Encodes one row of `dtype` (F32, F16 or BF16; `src` holds `w` little-endian elements) into `dst` (`w + 4`
/// bytes: scale, then E4M3 bytes).
///
/// # Panics
/// If `dtype` is not F32, F16 or BF16, or the lengths do not match (callers check both before).
pub fn encode_row(dtype: DType, src: &[u8], dst: &mut [u8]) {
    assert!(dtype.downcast().is_some(), "{dtype} rows are not downcast");
    let w = src.len() / dtype.size();
    assert_eq!(src.len() % dtype.size(), 0, "a row of {dtype} elements");
    assert_eq!(dst.len(), w + SCALE_BYTES, "a downcast row of {w} elements is {} bytes", w + SCALE_BYTES);
    let amax = (0..w).map(|i| element(dtype, src, i).abs()).filter(|a| a.is_finite()).fold(0.0f32, f32::max);
    let scale = row_scale(amax);
    dst[..SCALE_BYTES].copy_from_slice(&scale.to_le_bytes());
    for (i, out) in dst[SCALE_BYTES..].iter_mut().enumerate() {
        *out = f32_to_e4m3(element(dtype, src, i) / scale);
    }
}

/// The scale of an encoded row.
///
/// # Panics
/// If `row` is shorter than the scale.
pub fn scale_of(row: &[u8]) -> f32 {
    f32::from_le_bytes(row[..SCALE_BYTES].try_into().expect("a row starts with its scale"))
}

/// Decodes an encoded row (`w + 4` bytes) into `out` (`w` values): `e4m3 × scale`.
///
/// # Panics
/// If the lengths do not match.
pub fn decode_row(row: &[u8], out: &mut [f32]) {
    let scale = scale_of(row);
    assert_eq!(row.len(), out.len() + SCALE_BYTES, "a downcast row of {} elements", out.len());
    for (o, &b) in out.iter_mut().zip(&row[SCALE_BYTES..]) {
        *o = e4m3_to_f32(b) * scale;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The reference: the nearest finite E4M3 value by exhaustive search, ties to the even code, saturating.
    fn nearest(x: f32) -> u8 {
        if x.is_nan() {
            return E4M3_NAN;
        }
        let sign = if x.is_sign_negative() { 0x80 } else { 0 };
        let a = x.abs() as f64;
        let mut best = 0u8;
        for code in 0u8..=0x7E {
            let (d, db) = ((e4m3_to_f32(code) as f64 - a).abs(), (e4m3_to_f32(best) as f64 - a).abs());
            if d < db || (d == db && code % 2 == 0) {
                best = code;
            }
        }
        sign | best
    }

    #[test]
    fn every_code_decodes_as_the_ocp_table_says() {
        assert_eq!(e4m3_to_f32(0x00), 0.0);
        assert!(e4m3_to_f32(0x80).is_sign_negative() && e4m3_to_f32(0x80) == 0.0);
        assert_eq!(e4m3_to_f32(0x01), 2f32.powi(-9));
        assert_eq!(e4m3_to_f32(0x07), 7.0 * 2f32.powi(-9));
        assert_eq!(e4m3_to_f32(0x08), 2f32.powi(-6));
        assert_eq!(e4m3_to_f32(0x38), 1.0);
        assert_eq!(e4m3_to_f32(0x3C), 1.5);
        assert_eq!(e4m3_to_f32(0x7E), 448.0);
        assert_eq!(e4m3_to_f32(0xFE), -448.0);
        assert!(e4m3_to_f32(0x7F).is_nan() && e4m3_to_f32(0xFF).is_nan());
        // Strictly increasing over the positive finite codes.
        for c in 0u8..0x7E {
            assert!(e4m3_to_f32(c) < e4m3_to_f32(c + 1), "{c:#x}");
        }
    }

    #[test]
    fn all_256_codes_round_trip() {
        for c in 0..=255u8 {
            let v = e4m3_to_f32(c);
            if v.is_nan() {
                assert_eq!(f32_to_e4m3(v), E4M3_NAN);
            } else {
                assert_eq!(f32_to_e4m3(v), c, "{c:#04x} = {v}");
            }
        }
    }

    #[test]
    fn ties_go_to_the_even_code_and_just_off_a_tie_to_the_nearer() {
        for c in 0u8..0x7E {
            let (lo, hi) = (e4m3_to_f32(c) as f64, e4m3_to_f32(c + 1) as f64);
            let mid = ((lo + hi) / 2.0) as f32;
            assert_eq!(mid as f64, (lo + hi) / 2.0, "midpoints are exact in f32");
            let even = if c % 2 == 0 { c } else { c + 1 };
            assert_eq!(f32_to_e4m3(mid), even, "tie between {c:#x} and {:#x}", c + 1);
            assert_eq!(f32_to_e4m3(-mid), 0x80 | even);
            assert_eq!(f32_to_e4m3(f32::from_bits(mid.to_bits() - 1)), c);
            assert_eq!(f32_to_e4m3(f32::from_bits(mid.to_bits() + 1)), c + 1);
        }
    }

    #[test]
    fn out_of_range_saturates_and_nan_is_nan() {
        for x in [448.0f32, 449.0, 463.9, 464.0, 480.0, 1e30, f32::INFINITY] {
            assert_eq!(f32_to_e4m3(x), 0x7E, "{x}");
            assert_eq!(f32_to_e4m3(-x), 0xFE, "{x}");
        }
        assert_eq!(f32_to_e4m3(f32::NAN), E4M3_NAN);
        assert_eq!(f32_to_e4m3(-f32::NAN), E4M3_NAN);
        assert_eq!(f32_to_e4m3(-0.0), 0x80);
        assert_eq!(f32_to_e4m3(2f32.powi(-11)), 0, "a quarter of the smallest subnormal rounds to 0");
        assert_eq!(f32_to_e4m3(3.0 * 2f32.powi(-11)), 1);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(20_000))]
        #[test]
        fn encoding_matches_the_exhaustive_reference(bits in any::<u32>()) {
            let x = f32::from_bits(bits);
            prop_assert_eq!(f32_to_e4m3(x), nearest(x), "{}", x);
        }

        #[test]
        fn encoding_matches_the_reference_in_range(x in -500.0f32..500.0) {
            prop_assert_eq!(f32_to_e4m3(x), nearest(x), "{}", x);
        }

        #[test]
        fn rows_read_back_within_the_e4m3_bound(
            values in prop::collection::vec(-1e4f32..1e4, 1..64),
            which in 0usize..3,
        ) {
            let dtype = [DType::F32, DType::F16, DType::BF16][which];
            let (src, exact): (Vec<u8>, Vec<f32>) = encode_source(dtype, &values);
            let mut row = vec![0u8; values.len() + SCALE_BYTES];
            encode_row(dtype, &src, &mut row);
            let mut back = vec![0f32; values.len()];
            decode_row(&row, &mut back);
            let amax = exact.iter().fold(0f32, |a, x| a.max(x.abs()));
            prop_assert_eq!(scale_of(&row), row_scale(amax));
            for (x, y) in exact.iter().zip(&back) {
                if x.abs() >= amax / 28672.0 {
                    prop_assert!((x - y).abs() <= x.abs() / 16.0 * (1.0 + 1e-6), "{} read back as {}", x, y);
                } else {
                    prop_assert!((x - y).abs() <= scale_of(&row) * 2f32.powi(-10) * (1.0 + 1e-6), "{} read back as {}", x, y);
                }
            }
        }
    }

    /// `values` as a row of `dtype`, and the exact values that row holds.
    fn encode_source(dtype: DType, values: &[f32]) -> (Vec<u8>, Vec<f32>) {
        let mut src = Vec::new();
        let mut exact = Vec::new();
        for &v in values {
            match dtype {
                DType::F32 => src.extend(v.to_le_bytes()),
                DType::F16 => src.extend(half::f16::from_f32(v).to_bits().to_le_bytes()),
                _ => src.extend(half::bf16::from_f32(v).to_bits().to_le_bytes()),
            }
            exact.push(element(dtype, &src[src.len() - dtype.size()..], 0));
        }
        (src, exact)
    }

    #[test]
    fn special_rows() {
        // All zeros: scale 1, zero bytes (signs kept).
        let mut row = [0u8; 6];
        encode_row(DType::F32, &[0.0f32, -0.0].iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<_>>(), &mut row);
        assert_eq!(row, [0, 0, 0x80, 0x3F, 0x00, 0x80]);
        // NaN and infinities do not enter the scale: amax over finite values is 2 → scale 2/448.
        let src: Vec<u8> =
            [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, 2.0, -1.0].iter().flat_map(|v| v.to_le_bytes()).collect();
        let mut row = [0u8; 9];
        encode_row(DType::F32, &src, &mut row);
        assert_eq!(scale_of(&row), 2.0 / 448.0);
        assert_eq!(&row[4..], &[E4M3_NAN, 0x7E, 0xFE, 0x7E, f32_to_e4m3(-224.0)]);
        let mut back = [0f32; 5];
        decode_row(&row, &mut back);
        assert!(back[0].is_nan());
        assert_eq!(&back[1..], &[2.0, -2.0, 2.0, -1.0]);
        // Only non-finite values: scale 1.
        let src: Vec<u8> = [f32::NAN, f32::INFINITY].iter().flat_map(|v| v.to_le_bytes()).collect();
        let mut row = [0u8; 6];
        encode_row(DType::F32, &src, &mut row);
        assert_eq!((scale_of(&row), row[4], row[5]), (1.0, E4M3_NAN, 0x7E));
        // A row whose amax / 448 underflows: scale 1, the tiny values become 0.
        let tiny = f32::from_bits(1);
        let mut row = [0u8; 5];
        encode_row(DType::F32, &tiny.to_le_bytes(), &mut row);
        assert_eq!((scale_of(&row), row[4]), (1.0, 0));
        // bf16 and f16 sources: the largest element is exactly ±448 × scale.
        let src: Vec<u8> =
            [1.5f32, -3.0].iter().flat_map(|v| half::bf16::from_f32(*v).to_bits().to_le_bytes()).collect();
        let mut row = [0u8; 6];
        encode_row(DType::BF16, &src, &mut row);
        assert_eq!((scale_of(&row), row[4], row[5]), (3.0 / 448.0, f32_to_e4m3(1.5 / (3.0 / 448.0)), 0xFE));
    }
}
