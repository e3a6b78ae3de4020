//! Element types of captured tensors.

use std::fmt;
use std::str::FromStr;

use crate::error::DecodeError;

/// The element type of a captured row, as stored in a record header.
///
/// The numeric codes are part of the on-ring format (see `docs/format.md`): never renumber a variant.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum DType {
    /// IEEE 754 binary32.
    F32 = 1,
    /// IEEE 754 binary16.
    F16 = 2,
    /// bfloat16 (the top half of a binary32). Neither Arrow nor Parquet has this type: it travels as raw bytes.
    BF16 = 3,
    /// IEEE 754 binary64.
    F64 = 4,
    /// Signed 8-bit integer.
    I8 = 5,
    /// Unsigned 8-bit integer.
    U8 = 6,
    /// Signed 16-bit integer.
    I16 = 7,
    /// Signed 32-bit integer.
    I32 = 8,
    /// Signed 64-bit integer.
    I64 = 9,
    /// 8-bit float, 4 exponent bits, 3 mantissa bits (OCP FP8 E4M3).
    F8E4M3 = 10,
    /// 8-bit float, 5 exponent bits, 2 mantissa bits (OCP FP8 E5M2).
    F8E5M2 = 11,
    /// A row downcast to OCP FP8 E4M3 with one scale per row: a little-endian `f32` scale, then `row_width` E4M3
    /// bytes; element `i` is `e4m3[i] × scale` (see [`crate::rowscaled`]). Rows are `row_width + 4` bytes.
    F8E4M3RowScaled = 12,
}

impl DType {
    /// Every dtype, in code order.
    pub const ALL: [DType; 12] = [
        DType::F32,
        DType::F16,
        DType::BF16,
        DType::F64,
        DType::I8,
        DType::U8,
        DType::I16,
        DType::I32,
        DType::I64,
        DType::F8E4M3,
        DType::F8E5M2,
        DType::F8E4M3RowScaled,
    ];

    /// Size of one element in bytes (for a row-scaled dtype, of one element's value, without the row's scale).
    pub const fn size(self) -> usize {
        match self {
            DType::F64 | DType::I64 => 8,
            DType::F32 | DType::I32 => 4,
            DType::F16 | DType::BF16 | DType::I16 => 2,
            DType::I8 | DType::U8 | DType::F8E4M3 | DType::F8E5M2 | DType::F8E4M3RowScaled => 1,
        }
    }

    /// Bytes a row of a row-scaled dtype carries besides its elements (its scale), 0 for every other dtype.
    pub const fn row_overhead(self) -> usize {
        match self {
            DType::F8E4M3RowScaled => crate::rowscaled::SCALE_BYTES,
            _ => 0,
        }
    }

    /// Bytes of a row of `row_width` elements: `row_width × size`, plus the scale of a row-scaled dtype.
    pub const fn row_bytes(self, row_width: u64) -> u64 {
        row_width * self.size() as u64 + self.row_overhead() as u64
    }

    /// Elements in a row of `row_bytes` bytes; `None` when no row of this dtype has that size.
    pub const fn row_width(self, row_bytes: u64) -> Option<u64> {
        let overhead = self.row_overhead() as u64;
        if row_bytes <= overhead || !(row_bytes - overhead).is_multiple_of(self.size() as u64) {
            return None;
        }
        Some((row_bytes - overhead) / self.size() as u64)
    }

    /// The dtype a row of this dtype becomes when it is downcast on capture (issue 14's "on-device downcast"
    /// rung), `None` for dtypes that are not downcast (only 16- and 32-bit floats are).
    pub const fn downcast(self) -> Option<DType> {
        match self {
            DType::BF16 | DType::F16 | DType::F32 => Some(DType::F8E4M3RowScaled),
            _ => None,
        }
    }

    /// The canonical lower-case name (`"bf16"`, `"f32"`, ...), as used in configs and exported metadata.
    pub const fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::F64 => "f64",
            DType::I8 => "i8",
            DType::U8 => "u8",
            DType::I16 => "i16",
            DType::I32 => "i32",
            DType::I64 => "i64",
            DType::F8E4M3 => "f8e4m3",
            DType::F8E5M2 => "f8e5m2",
            DType::F8E4M3RowScaled => "f8e4m3_rowscaled",
        }
    }

    /// The on-ring code of this dtype.
    pub const fn code(self) -> u8 {
        self as u8
    }

    /// Decodes an on-ring dtype code.
    pub fn from_code(code: u8) -> Result<DType, DecodeError> {
        DType::ALL.into_iter().find(|d| d.code() == code).ok_or(DecodeError::UnknownDType { code })
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Error for a dtype name that ringscope does not know.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "unknown dtype `{0}`; expected one of f32, f16, bf16, f64, i8, u8, i16, i32, i64, f8e4m3, f8e5m2, f8e4m3_rowscaled"
)]
pub struct UnknownDTypeName(pub String);

impl FromStr for DType {
    type Err = UnknownDTypeName;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let lower = s.to_ascii_lowercase();
        let canonical = match lower.as_str() {
            "float32" | "float" => "f32",
            "float16" | "half" => "f16",
            "bfloat16" => "bf16",
            "float64" | "double" => "f64",
            "int8" => "i8",
            "uint8" => "u8",
            "int16" => "i16",
            "int32" => "i32",
            "int64" => "i64",
            "float8_e4m3fn" | "fp8_e4m3" => "f8e4m3",
            "float8_e5m2" | "fp8_e5m2" => "f8e5m2",
            other => other,
        };
        DType::ALL.into_iter().find(|d| d.name() == canonical).ok_or_else(|| UnknownDTypeName(s.to_owned()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_round_trip_and_are_unique() {
        for d in DType::ALL {
            assert_eq!(DType::from_code(d.code()).unwrap(), d);
            assert_eq!(d.name().parse::<DType>().unwrap(), d);
        }
        assert_eq!(DType::F8E4M3RowScaled.code(), 12, "codes are part of the format: never renumbered");
        assert!(DType::from_code(0).is_err());
        assert!(DType::from_code(13).is_err());
        assert!(DType::from_code(200).is_err());
    }

    #[test]
    fn row_sizes_include_the_scale_of_row_scaled_rows() {
        assert_eq!(DType::BF16.row_bytes(4096), 8192);
        assert_eq!(DType::F8E4M3RowScaled.row_bytes(4096), 4100);
        assert_eq!(DType::F8E4M3RowScaled.row_width(4100), Some(4096));
        assert_eq!(DType::F8E4M3RowScaled.row_width(4), None);
        assert_eq!(DType::F32.row_width(10), None);
        assert_eq!(DType::F32.row_width(12), Some(3));
        for d in [DType::BF16, DType::F16, DType::F32] {
            assert_eq!(d.downcast(), Some(DType::F8E4M3RowScaled));
        }
        assert_eq!(DType::F8E4M3.downcast(), None);
        assert_eq!(DType::F8E4M3RowScaled.downcast(), None);
    }

    #[test]
    fn torch_names_parse() {
        assert_eq!("bfloat16".parse::<DType>().unwrap(), DType::BF16);
        assert_eq!("Float16".parse::<DType>().unwrap(), DType::F16);
        let err = "complex64".parse::<DType>().unwrap_err();
        assert!(err.to_string().contains("complex64"));
    }
}
