//! Ring-space arithmetic shared by the host ring ([`crate::host`]), the device ring's full-mode admission
//! (`ringscope_hookpoint::cuda`) and — in CUDA C, with the same formulas — the capture kernels.
//!
//! Positions are monotonically increasing byte counts: the producer's `head`, the consumer's `tail`; `head - tail`
//! bytes are in use. Records never wrap, so a record that does not fit before the end of the buffer is preceded by
//! a pad record up to the end ([`wrap_pad`]).

/// Bytes of padding a record of `footprint` bytes needs when the write position is at ring offset `offset`: 0 when
/// it fits before the end of the buffer, else the rest of the buffer (the record then starts at offset 0).
pub const fn wrap_pad(offset: u64, footprint: u64, capacity: u64) -> u64 {
    if footprint <= capacity - offset {
        0
    } else {
        capacity - offset
    }
}

/// Whether `needed` more bytes fit in a ring of `capacity` bytes whose producer is at `head` and whose consumer has
/// released everything below `tail`: `capacity - (head - tail) >= needed`, written without a subtraction so that
/// it holds for a worst-case `head` past `tail + capacity` (reservations not yet written) and for a `tail` read
/// after `head` that has overtaken it.
pub const fn fits(head: u64, tail: u64, needed: u64, capacity: u64) -> bool {
    head + needed <= tail + capacity
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pads_only_what_does_not_fit_before_the_end() {
        assert_eq!(wrap_pad(0, 256, 256), 0);
        assert_eq!(wrap_pad(128, 128, 256), 0);
        assert_eq!(wrap_pad(192, 128, 256), 64);
    }

    #[test]
    fn fits_counts_bytes_in_use_and_tolerates_worst_case_heads() {
        assert!(fits(100, 0, 156, 256));
        assert!(!fits(100, 0, 157, 256));
        assert!(fits(1000, 900, 156, 256));
        // A worst-case head past tail + capacity: nothing fits, and nothing underflows.
        assert!(!fits(600, 0, 1, 256));
        // A tail loaded after the head, past it.
        assert!(fits(100, 200, 256, 256));
    }
}
