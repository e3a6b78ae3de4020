//! The batch descriptor of one engine step: which request and token position each batch row belongs to.
//!
//! The engine hands it over once per step; every capture of that step copies the descriptor entries of the rows
//! it keeps into its record, next to the rows. That is how row ownership travels through the ring in stream order.

use std::collections::HashSet;
use std::hash::{BuildHasherDefault, Hasher};

use ringscope_ring::RowMeta;

use crate::error::HookPointError;

/// Hashes request ids for the per-step "last row of each request" pass: one multiply, not SipHash (the pass runs
/// on the engine's thread every step; request ids are not attacker-chosen keys).
#[derive(Default)]
struct RequestIdHasher(u64);

impl Hasher for RequestIdHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 = (self.0 ^ *b as u64).wrapping_mul(0x100_0000_01B3);
        }
    }
    fn write_u64(&mut self, v: u64) {
        self.0 = (v ^ (v >> 32)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
}

/// One step's batch: row `i` of every captured tensor belongs to `rows[i]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StepBatch {
    step: u64,
    rows: Vec<RowMeta>,
    last_per_request: Vec<RowMeta>,
}

impl StepBatch {
    /// Builds the descriptor from `(request_id, token_position)` per batch row, in batch order.
    ///
    /// A request's rows need not be contiguous; its *last* row (for [`crate::RowSelection::LastPerRequest`]) is
    /// the one with the highest batch index. Rows of [`RowMeta::NO_REQUEST`] have no last row (they are no
    /// request's). An empty batch is an error: there is nothing to capture.
    pub fn new(step: u64, rows: impl IntoIterator<Item = (u64, u32)>) -> Result<Self, HookPointError> {
        let rows = rows.into_iter();
        // The row count comes from the engine (through the C ABI, any number): every allocation sized by it is
        // fallible, so a batch the machine has no memory for is an error, not an abort of the engine.
        let refused = |what: &'static str, count: usize, size: usize| HookPointError::BatchAllocation {
            step,
            what,
            bytes: count.saturating_mul(size),
        };
        let mut metas: Vec<RowMeta> = Vec::new();
        metas.try_reserve_exact(rows.size_hint().0).map_err(|_| refused("row metadata", rows.size_hint().0, 16))?;
        for (i, (request_id, position)) in rows.enumerate() {
            if i >= u32::MAX as usize {
                return Err(HookPointError::InvalidBatch { step, why: "more than 2^32 rows".into() });
            }
            if metas.len() == metas.capacity() {
                metas.try_reserve(1).map_err(|_| refused("row metadata", i + 1, 16))?;
            }
            metas.push(RowMeta { request_id, position, batch_row: i as u32 });
        }
        let rows = metas;
        if rows.is_empty() {
            return Err(HookPointError::InvalidBatch { step, why: "the batch has no rows".into() });
        }
        let mut seen: HashSet<u64, BuildHasherDefault<RequestIdHasher>> = HashSet::default();
        seen.try_reserve(rows.len()).map_err(|_| refused("the request-id set", rows.len(), 16))?;
        let mut last_per_request: Vec<RowMeta> = Vec::new();
        for r in rows.iter().rev().filter(|r| !r.is_no_request() && seen.insert(r.request_id)) {
            if last_per_request.len() == last_per_request.capacity() {
                // Grows as a Vec does (doubling), fallibly; at most one entry per row.
                let more = last_per_request.len().max(4).min(rows.len() - last_per_request.len());
                last_per_request.try_reserve(more).map_err(|_| refused("last rows per request", rows.len(), 16))?;
            }
            last_per_request.push(*r);
        }
        last_per_request.reverse();
        Ok(StepBatch { step, rows, last_per_request })
    }

    /// The step number.
    pub fn step(&self) -> u64 {
        self.step
    }

    /// Rows in the batch.
    pub fn len(&self) -> usize {
        self.rows.len()
    }

    /// Always false: an empty batch cannot be built.
    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    /// Every row's descriptor, in batch order.
    pub fn rows(&self) -> &[RowMeta] {
        &self.rows
    }

    /// The last row of each request, in batch order.
    pub fn last_per_request(&self) -> &[RowMeta] {
        &self.last_per_request
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn last_per_request_keeps_batch_order() {
        // Request 7 prefills 3 tokens, request 3 decodes one, request 9 prefills 2.
        let b = StepBatch::new(5, [(7, 0), (7, 1), (7, 2), (3, 40), (9, 0), (9, 1)]).unwrap();
        let last: Vec<_> = b.last_per_request().iter().map(|m| (m.request_id, m.position, m.batch_row)).collect();
        assert_eq!(last, vec![(7, 2, 2), (3, 40, 3), (9, 1, 5)]);
        assert_eq!(b.rows()[4], RowMeta { request_id: 9, position: 0, batch_row: 4 });
    }

    #[test]
    fn rows_of_no_request_have_no_last_row() {
        let no = RowMeta::NO_REQUEST;
        let b = StepBatch::new(1, [(4, 9), (no, 3), (5, 7), (no, 0)]).unwrap();
        let last: Vec<_> = b.last_per_request().iter().map(|m| m.request_id).collect();
        assert_eq!(last, vec![4, 5]);
        assert_eq!(b.len(), 4, "the rows themselves stay in the batch (a graph step's shape is fixed)");
    }

    /// Claims more rows than any memory holds, as a C caller's `rows` argument may.
    struct Claims(usize);

    impl Iterator for Claims {
        type Item = (u64, u32);
        fn next(&mut self) -> Option<(u64, u32)> {
            None
        }
        fn size_hint(&self) -> (usize, Option<usize>) {
            (self.0, Some(self.0))
        }
    }

    #[test]
    fn a_batch_too_large_for_memory_is_an_error_not_an_abort() {
        let err = StepBatch::new(4, Claims(usize::MAX / 8)).unwrap_err();
        assert!(matches!(err, HookPointError::BatchAllocation { step: 4, what: "row metadata", .. }), "{err}");
        assert!(err.to_string().contains("was refused; pass fewer rows"), "{err}");
    }

    #[test]
    fn empty_batch_is_an_error() {
        let err = StepBatch::new(1, std::iter::empty()).unwrap_err().to_string();
        assert!(err.contains("step 1") && err.contains("no rows"), "{err}");
    }
}
