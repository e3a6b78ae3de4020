//! Errors of the ring crate: one enum per operation, each saying what was wrong and what to do.

/// A record could not be decoded from bytes. Decoding never panics: every malformed input maps to one of these.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    /// Fewer bytes are available than the record needs.
    #[error("record truncated: need {need} bytes, have {have}")]
    Truncated {
        /// Bytes the record needs (header, or header plus payload).
        need: usize,
        /// Bytes available.
        have: usize,
    },
    /// The first four bytes are not the record magic.
    #[error(
        "bad record magic {found:#010x} (expected {expected:#010x}): not a ringscope record or the ring is corrupted"
    )]
    BadMagic {
        /// The magic found.
        found: u32,
        /// The magic expected.
        expected: u32,
    },
    /// The record was written by a format version this build does not read.
    #[error("record format version {found} is not supported (this build reads version {supported})")]
    UnsupportedVersion {
        /// The version in the header.
        found: u16,
        /// The version this build reads.
        supported: u16,
    },
    /// The header's checksum does not match its bytes.
    #[error(
        "record header check mismatch (stored {stored:#018x}, computed {computed:#018x}): the header is corrupted"
    )]
    HeaderChecksum {
        /// Check value stored in the header.
        stored: u64,
        /// Check value computed over the header bytes.
        computed: u64,
    },
    /// The payload checksum (written when the record carries [`crate::flags::PAYLOAD_CRC`]) does not match.
    #[error("record {seq} payload checksum mismatch (stored {stored:#010x}, computed {computed:#010x}): the payload is corrupted")]
    PayloadChecksum {
        /// Sequence number of the record.
        seq: u64,
        /// Checksum stored in the header.
        stored: u32,
        /// Checksum computed over the payload.
        computed: u32,
    },
    /// The header's fields contradict each other.
    #[error("inconsistent record header: {0}")]
    Inconsistent(String),
    /// The dtype code is not one this build knows.
    #[error("unknown dtype code {code} in record header")]
    UnknownDType {
        /// The code found.
        code: u8,
    },
    /// The record kind code is not one this build knows.
    #[error("unknown record kind code {code} in record header")]
    UnknownKind {
        /// The code found.
        code: u8,
    },
    /// The ring delivered a record whose sequence number is not the next one: records were lost or reordered.
    #[error("sequence gap: expected record {expected}, found {found}")]
    SequenceGap {
        /// The sequence number expected next.
        expected: u64,
        /// The sequence number found.
        found: u64,
    },
}

/// A ring could not be created.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RingError {
    /// The capacity is not usable.
    #[error("ring capacity {capacity} bytes is invalid: it must be a multiple of {align} and at least {min} bytes")]
    InvalidCapacity {
        /// Capacity asked for.
        capacity: usize,
        /// Required alignment.
        align: usize,
        /// Minimum capacity.
        min: usize,
    },
    /// The machine refused the ring's memory (not enough memory, or an address-space limit).
    #[error("a ring of {} could not be allocated: the allocation was refused ({source}); lower the ring capacity", in_units(*.capacity))]
    AllocationRefused {
        /// Capacity asked for.
        capacity: usize,
        /// The allocator's report.
        source: std::collections::TryReserveError,
    },
}

/// Space for a record could not be reserved.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ReserveError {
    /// The record can never fit in this ring, whatever the drain does.
    #[error("a record with a {payload_len}-byte payload can never fit: this ring takes payloads up to {max_payload_len} bytes (half its capacity minus the header); raise the ring capacity or select fewer rows")]
    TooLarge {
        /// Payload length asked for.
        payload_len: usize,
        /// Largest payload this ring accepts.
        max_payload_len: usize,
    },
    /// The ring has no room now; the drain has not released enough space yet.
    #[error("ring full: need {needed} bytes, {free} free")]
    Full {
        /// Bytes needed (record plus any wrap padding).
        needed: usize,
        /// Bytes free now.
        free: usize,
    },
    /// Waited until the deadline and the drain did not free enough space.
    #[error("ring still full after waiting {waited_ms} ms for the drain (need {needed} bytes, {free} free); the drain or its sinks are too slow for full mode: raise the deadline, the ring capacity, or use best-effort mode")]
    DeadlineExceeded {
        /// How long the producer waited.
        waited_ms: u64,
        /// Bytes needed.
        needed: usize,
        /// Bytes free when the deadline passed.
        free: usize,
    },
    /// The record's metadata is malformed (zero rows, zero-byte rows, row size not a multiple of the dtype, ...).
    #[error("invalid record: {0}")]
    InvalidRecord(DecodeError),
    /// The consumer side is gone: nothing will ever free space again.
    #[error("the ring's drain side was dropped: no record can be delivered")]
    Disconnected,
}

/// A record source (a ring's drain end) could not hand out the next record.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SourceError {
    /// The bytes at the read position are not a valid next record (corruption, or a sequence gap).
    #[error(transparent)]
    Decode(#[from] DecodeError),
    /// The device side failed (a CUDA call of the drain).
    #[error("device drain: {0}")]
    Device(String),
}

/// A hookpoint spec is not usable.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid hookpoint `{name}`: {why}")]
pub struct SpecError {
    /// Name of the hookpoint.
    pub name: String,
    /// What is wrong and how to fix it.
    pub why: String,
}

/// `bytes` in the largest binary unit that divides it exactly ("1024 GiB", "96 KiB", "1000 bytes"), the way sizes are
/// written in the configuration.
pub(crate) fn in_units(bytes: usize) -> String {
    const UNITS: [(usize, &str); 3] = [(1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")];
    match UNITS.iter().find(|(size, _)| bytes >= *size && bytes.is_multiple_of(*size)) {
        Some((size, unit)) => format!("{} {unit}", bytes / size),
        None => format!("{bytes} bytes"),
    }
}
