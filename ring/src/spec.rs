//! What a hookpoint id in a record stands for: the hookpoint's name, where in the model it sits, and the shape of
//! one row. The capture side registers specs; the export side reads them from the catalog the session hands it. Both
//! depend on this crate and on nothing of each other.

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::dtype::DType;
use crate::error::SpecError;

/// Where in a decoder the hookpoint reads.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SiteKind {
    /// The residual stream after a decoder layer (HF `output_hidden_states[layer + 1]`).
    Residual,
    /// The attention block's output, before it is added to the residual stream.
    AttentionOutput,
    /// The MLP block's output, before it is added to the residual stream.
    MlpOutput,
    /// The final logits.
    Logits,
    /// Anything else; the string says what.
    Custom(String),
}

impl SiteKind {
    /// Short name: `residual`, `attention_output`, `mlp_output`, `logits`, or the custom label.
    pub fn name(&self) -> &str {
        match self {
            SiteKind::Residual => "residual",
            SiteKind::AttentionOutput => "attention_output",
            SiteKind::MlpOutput => "mlp_output",
            SiteKind::Logits => "logits",
            SiteKind::Custom(s) => s,
        }
    }
}

impl fmt::Display for SiteKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The static description of a hookpoint. Fixed once registered: records refer to it by id.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct HookPointSpec {
    /// Unique name within a session, e.g. `layers.3.resid`.
    pub name: String,
    /// Where it reads.
    pub site: SiteKind,
    /// Decoder layer, when the site belongs to one.
    pub layer: Option<u32>,
    /// Element type of the captured tensor.
    pub dtype: DType,
    /// Elements per row (the hidden size for residual sites, the vocabulary size for logits).
    pub row_width: u32,
}

/// The largest row accepted, in bytes (1 GiB); rows are addressed with 32-bit sizes in the record format.
pub const MAX_ROW_BYTES: u64 = 1 << 30;

impl HookPointSpec {
    /// Bytes per row: `row_width × dtype size` (plus the scale of a row-scaled dtype).
    pub fn row_bytes(&self) -> u32 {
        self.dtype.row_bytes(self.row_width as u64) as u32
    }

    /// Checks the spec: a non-empty printable name, a non-zero row width, a row size the format can carry.
    pub fn validate(&self) -> Result<(), SpecError> {
        let bad = |why: String| SpecError { name: self.name.clone(), why };
        if self.name.is_empty() {
            return Err(bad("the name is empty".into()));
        }
        if self.name.len() > 256 || self.name.chars().any(|c| c.is_control() || c == '/' || c == '=') {
            return Err(bad("names must be at most 256 characters, without control characters, `/` or `=` (they become directory names)".into()));
        }
        if self.layer.is_some_and(|l| l > i32::MAX as u32) {
            return Err(bad(format!(
                "layer {} is past {} (datasets store the layer as a 32-bit signed integer)",
                self.layer.unwrap_or_default(),
                i32::MAX
            )));
        }
        if self.row_width == 0 {
            return Err(bad("row_width is 0; it must be the number of elements per row (e.g. the hidden size)".into()));
        }
        let row_bytes = self.dtype.row_bytes(self.row_width as u64);
        if row_bytes > MAX_ROW_BYTES {
            return Err(bad(format!("a row of {row_bytes} bytes exceeds the {MAX_ROW_BYTES}-byte limit")));
        }
        if let SiteKind::Custom(label) = &self.site {
            if label.is_empty() {
                return Err(bad("a custom site needs a non-empty label".into()));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(name: &str, width: u32) -> HookPointSpec {
        HookPointSpec {
            name: name.into(),
            site: SiteKind::Residual,
            layer: Some(0),
            dtype: DType::BF16,
            row_width: width,
        }
    }

    #[test]
    fn validation() {
        assert!(spec("layers.0.resid", 2048).validate().is_ok());
        assert_eq!(spec("x", 2048).row_bytes(), 4096);
        for (name, width, needle) in
            [("", 8, "empty"), ("a/b", 8, "`/`"), ("ok", 0, "row_width is 0"), ("huge", u32::MAX, "exceeds")]
        {
            let err = spec(name, width).validate().unwrap_err().to_string();
            assert!(err.contains(needle), "{err}");
        }
        let far = HookPointSpec { layer: Some(i32::MAX as u32 + 1), ..spec("far", 8) };
        assert!(far.validate().unwrap_err().to_string().contains("32-bit signed"));
        assert!(HookPointSpec { layer: Some(i32::MAX as u32), ..spec("edge", 8) }.validate().is_ok());
    }
}
