//! The self-describing record format.
//!
//! Every record in a ring — host or GPU — is a 64-byte header followed by a payload, and the whole record is padded
//! to a multiple of [`RECORD_ALIGN`] bytes. The layout is little-endian and documented field by field in
//! `docs/format.md`; the GPU kernels write exactly the same bytes.
//!
//! A data record's payload carries the per-row metadata *before* the rows themselves:
//!
//! ```text
//! | header (64 B) | RowMeta × rows (16 B each) | zero pad to 64 B | row 0 | row 1 | ... | zero pad to 64 B |
//! ```
//!
//! so the request id and token position of every row travel through the ring in stream order, inside the same
//! record as the activations. The host never pairs rows with requests by position or by guessing.

use crate::dtype::DType;
use crate::error::DecodeError;

/// Every record starts at, and is padded to, a multiple of this many bytes.
pub const RECORD_ALIGN: usize = 64;
/// Size of the fixed record header.
pub const HEADER_LEN: usize = 64;
/// Size of one [`RowMeta`] entry in a payload.
pub const ROW_META_LEN: usize = 16;
/// The record magic: the bytes `RSR1` read as a little-endian `u32`.
pub const MAGIC: u32 = u32::from_le_bytes(*b"RSR1");
/// The record format version this build writes and reads.
pub const FORMAT_VERSION: u16 = 1;

/// Header flag bits.
pub mod flags {
    /// The header's `payload_crc` holds the CRC-32 of the payload, and readers verify it.
    pub const PAYLOAD_CRC: u16 = 1 << 0;
    /// The rows are a selection of the batch (not every batch row, in order).
    pub const ROW_SELECTION: u16 = 1 << 1;
    /// All flags this build understands.
    pub const KNOWN: u16 = PAYLOAD_CRC | ROW_SELECTION;
}

/// The header check: a 64-bit fold of header bytes `0..56` (seven little-endian words), stored in bytes `56..64`.
///
/// Each step `h = mix(h ^ word)` is a bijection of `h` (xor, multiply by an odd constant, xorshift), so any change
/// confined to one word — every single-bit flip — always changes the result; wider corruption slips through with
/// probability 2^-64. It costs seven multiplies (a CRC of the same 56 bytes took a quarter of the host ring's
/// per-record time) and is a few lines in the CUDA kernels, which write the same headers.
pub fn header_check(h: &[u8; HEADER_LEN]) -> u64 {
    let mut acc: u64 = HEADER_CHECK_SEED;
    for w in h[..56].chunks_exact(8) {
        acc ^= u64::from_le_bytes(w.try_into().expect("8 bytes"));
        acc = acc.wrapping_mul(HEADER_CHECK_MUL);
        acc ^= acc >> HEADER_CHECK_SHIFT;
    }
    acc
}

/// [`header_check`]'s starting value: the bytes `RSR1head` read as a big-endian `u64`.
pub const HEADER_CHECK_SEED: u64 = 0x5253_5231_6865_6164;
/// [`header_check`]'s odd multiplier.
pub const HEADER_CHECK_MUL: u64 = 0x9E37_79B9_7F4A_7C15;
/// [`header_check`]'s xorshift.
pub const HEADER_CHECK_SHIFT: u32 = 29;

/// Rounds `n` up to the next multiple of [`RECORD_ALIGN`].
pub const fn align_up(n: usize) -> usize {
    (n + RECORD_ALIGN - 1) & !(RECORD_ALIGN - 1)
}

/// The footprint of a record with a `payload_len`-byte payload ([`RecordHeader::footprint`]), or `None` when it is
/// larger than any buffer can be (`isize::MAX` bytes). A header's lengths come from bytes that may be corrupted: the
/// decoder checks them with this before any arithmetic on them, so that the footprint arithmetic after it cannot
/// overflow.
fn checked_footprint(payload_len: u64) -> Option<usize> {
    let end = usize::try_from(payload_len).ok()?.checked_add(HEADER_LEN)?;
    let footprint = end.checked_add(RECORD_ALIGN - 1)? & !(RECORD_ALIGN - 1);
    (footprint <= isize::MAX as usize).then_some(footprint)
}

/// What a record holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum RecordKind {
    /// Filler from here to the end of the ring: the next record starts at offset 0. Not sequence-numbered.
    Pad = 0,
    /// Captured rows of one hookpoint at one step, with their per-row metadata.
    Data = 1,
}

impl RecordKind {
    fn from_code(code: u8) -> Result<Self, DecodeError> {
        match code {
            0 => Ok(RecordKind::Pad),
            1 => Ok(RecordKind::Data),
            code => Err(DecodeError::UnknownKind { code }),
        }
    }
}

/// Who a captured row belongs to. Written into the payload next to the row, in the same order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct RowMeta {
    /// The engine's request (sequence) id.
    pub request_id: u64,
    /// Position of the token in its request (0 = first prompt token).
    pub position: u32,
    /// Index of the row in the step's batch (the engine's token index).
    pub batch_row: u32,
}

impl RowMeta {
    /// The request id of a row that belongs to no request: a row a fixed-shape step (a CUDA graph replay) computes
    /// for a sequence that has ended, or an engine's padding row it cannot leave out. Such rows are exported with
    /// this id (`2^64 - 1`; `-1` read as a signed 64-bit integer) so that they are never read as a request's tokens,
    /// and probes never score them into a request, raise a flag or alert for them.
    pub const NO_REQUEST: u64 = u64::MAX;

    /// Whether this row belongs to no request ([`RowMeta::NO_REQUEST`]).
    pub fn is_no_request(&self) -> bool {
        self.request_id == Self::NO_REQUEST
    }

    /// Writes this entry as 16 little-endian bytes.
    pub fn write_to(&self, out: &mut [u8; ROW_META_LEN]) {
        out[0..8].copy_from_slice(&self.request_id.to_le_bytes());
        out[8..12].copy_from_slice(&self.position.to_le_bytes());
        out[12..16].copy_from_slice(&self.batch_row.to_le_bytes());
    }

    /// Reads an entry from 16 little-endian bytes.
    pub fn read_from(b: &[u8; ROW_META_LEN]) -> Self {
        RowMeta {
            request_id: u64::from_le_bytes(b[0..8].try_into().expect("8 bytes")),
            position: u32::from_le_bytes(b[8..12].try_into().expect("4 bytes")),
            batch_row: u32::from_le_bytes(b[12..16].try_into().expect("4 bytes")),
        }
    }
}

/// The fields of a data record that the producer chooses. The ring adds the sequence number and checksums.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecordMeta {
    /// Engine step (forward pass) the rows were captured at.
    pub step: u64,
    /// Id of the hookpoint in the session's registry.
    pub hookpoint: u32,
    /// Number of rows in the payload (at least 1).
    pub rows: u32,
    /// Bytes per row (at least 1, a multiple of the dtype size).
    pub row_bytes: u32,
    /// Element type of the rows.
    pub dtype: DType,
    /// Flag bits from [`flags`].
    pub flags: u16,
}

impl RecordMeta {
    /// Offset of the first row inside the payload: the row metadata, padded to [`RECORD_ALIGN`].
    pub fn data_offset(&self) -> usize {
        align_up(self.rows as usize * ROW_META_LEN)
    }

    /// Exact payload length of a record with these fields.
    ///
    /// # Panics
    /// In debug builds, if the length overflows `usize`; [`validate`](Self::validate) rules that out, and decoding
    /// validates before it asks.
    pub fn payload_len(&self) -> usize {
        self.data_offset() + self.rows as usize * self.row_bytes as usize
    }

    /// [`payload_len`](Self::payload_len), or `None` when the record's footprint (header, payload, alignment) would be
    /// larger than any buffer can be: only forged or corrupted headers get there (`u32::MAX` rows of `u32::MAX`
    /// bytes).
    pub fn checked_payload_len(&self) -> Option<usize> {
        let rows = self.rows as usize;
        let metas = rows.checked_mul(ROW_META_LEN)?.checked_add(RECORD_ALIGN - 1)? & !(RECORD_ALIGN - 1);
        let payload = rows.checked_mul(self.row_bytes as usize)?.checked_add(metas)?;
        checked_footprint(payload as u64)?;
        Some(payload)
    }

    /// Checks the fields a producer controls; the same rules the decoder enforces.
    pub fn validate(&self) -> Result<(), DecodeError> {
        if self.rows == 0 {
            return Err(DecodeError::Inconsistent("a data record needs at least one row".into()));
        }
        if self.row_bytes == 0 {
            return Err(DecodeError::Inconsistent("row_bytes is 0".into()));
        }
        if self.dtype.row_width(self.row_bytes as u64).is_none() {
            return Err(DecodeError::Inconsistent(match self.dtype.row_overhead() {
                0 => format!(
                    "row_bytes {} is not a multiple of the {} element size {}",
                    self.row_bytes,
                    self.dtype,
                    self.dtype.size()
                ),
                scale => format!(
                    "row_bytes {} leaves no element after the {scale}-byte scale of a {} row",
                    self.row_bytes, self.dtype
                ),
            }));
        }
        if self.flags & !flags::KNOWN != 0 {
            return Err(DecodeError::Inconsistent(format!("unknown flag bits {:#06x}", self.flags & !flags::KNOWN)));
        }
        if self.checked_payload_len().is_none() {
            return Err(DecodeError::Inconsistent(format!(
                "{} rows of {} bytes: the payload length overflows",
                self.rows, self.row_bytes
            )));
        }
        Ok(())
    }
}

/// A decoded record header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecordHeader {
    /// What the record holds.
    pub kind: RecordKind,
    /// Sequence number: contiguous over the data records of one ring, starting at 0. Zero for pads.
    pub seq: u64,
    /// Producer-chosen fields (meaningless for pads).
    pub meta: RecordMeta,
    /// Payload bytes after the header, excluding the trailing alignment padding.
    pub payload_len: u64,
    /// CRC-32 of the payload when [`flags::PAYLOAD_CRC`] is set, else 0.
    pub payload_crc: u32,
}

impl RecordHeader {
    /// Bytes this record occupies in the ring: header plus payload, rounded up to [`RECORD_ALIGN`].
    pub fn footprint(&self) -> usize {
        align_up(HEADER_LEN + self.payload_len as usize)
    }

    /// A pad header covering `footprint` bytes (header included).
    pub fn pad(footprint: usize) -> Self {
        RecordHeader {
            kind: RecordKind::Pad,
            seq: 0,
            meta: RecordMeta { step: 0, hookpoint: 0, rows: 0, row_bytes: 0, dtype: DType::U8, flags: 0 },
            payload_len: (footprint - HEADER_LEN) as u64,
            payload_crc: 0,
        }
    }

    /// Encodes the header (with its checksum) into 64 bytes.
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut h = [0u8; HEADER_LEN];
        h[0..4].copy_from_slice(&MAGIC.to_le_bytes());
        h[4..6].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
        h[6..8].copy_from_slice(&(HEADER_LEN as u16).to_le_bytes());
        h[8..16].copy_from_slice(&self.seq.to_le_bytes());
        h[16..24].copy_from_slice(&self.meta.step.to_le_bytes());
        h[24..28].copy_from_slice(&self.meta.hookpoint.to_le_bytes());
        h[28..32].copy_from_slice(&self.meta.rows.to_le_bytes());
        h[32..36].copy_from_slice(&self.meta.row_bytes.to_le_bytes());
        h[36] = self.kind as u8;
        h[37] = self.meta.dtype.code();
        h[38..40].copy_from_slice(&self.meta.flags.to_le_bytes());
        h[40..48].copy_from_slice(&self.payload_len.to_le_bytes());
        h[48..52].copy_from_slice(&self.payload_crc.to_le_bytes());
        // 52..56 reserved, zero.
        let check = header_check(&h);
        h[56..64].copy_from_slice(&check.to_le_bytes());
        h
    }

    /// Decodes and checks a header from the first [`HEADER_LEN`] bytes of `bytes`.
    pub fn decode(bytes: &[u8]) -> Result<Self, DecodeError> {
        let h: &[u8; HEADER_LEN] = bytes
            .get(..HEADER_LEN)
            .and_then(|s| s.try_into().ok())
            .ok_or(DecodeError::Truncated { need: HEADER_LEN, have: bytes.len() })?;
        let u16_at = |o: usize| u16::from_le_bytes([h[o], h[o + 1]]);
        let u32_at = |o: usize| u32::from_le_bytes(h[o..o + 4].try_into().expect("4 bytes"));
        let u64_at = |o: usize| u64::from_le_bytes(h[o..o + 8].try_into().expect("8 bytes"));

        let magic = u32_at(0);
        if magic != MAGIC {
            return Err(DecodeError::BadMagic { found: magic, expected: MAGIC });
        }
        let version = u16_at(4);
        if version != FORMAT_VERSION {
            return Err(DecodeError::UnsupportedVersion { found: version, supported: FORMAT_VERSION });
        }
        let stored = u64_at(56);
        let computed = header_check(h);
        if stored != computed {
            return Err(DecodeError::HeaderChecksum { stored, computed });
        }
        if u16_at(6) as usize != HEADER_LEN {
            return Err(DecodeError::Inconsistent(format!("header_len {} (expected {HEADER_LEN})", u16_at(6))));
        }
        if u32_at(52) != 0 {
            return Err(DecodeError::Inconsistent("reserved header bytes are not zero".into()));
        }
        let kind = RecordKind::from_code(h[36])?;
        let payload_len = u64_at(40);
        let header = match kind {
            RecordKind::Pad => {
                if payload_len % RECORD_ALIGN as u64 != 0 {
                    return Err(DecodeError::Inconsistent(format!("pad length {payload_len} is not aligned")));
                }
                if checked_footprint(payload_len).is_none() {
                    return Err(DecodeError::Inconsistent(format!("pad length {payload_len} is larger than any ring")));
                }
                RecordHeader::pad(HEADER_LEN + payload_len as usize)
            }
            RecordKind::Data => {
                let meta = RecordMeta {
                    step: u64_at(16),
                    hookpoint: u32_at(24),
                    rows: u32_at(28),
                    row_bytes: u32_at(32),
                    dtype: DType::from_code(h[37])?,
                    flags: u16_at(38),
                };
                meta.validate()?;
                if meta.payload_len() as u64 != payload_len {
                    return Err(DecodeError::Inconsistent(format!(
                        "payload_len {payload_len} does not match {} rows of {} bytes (expected {})",
                        meta.rows,
                        meta.row_bytes,
                        meta.payload_len()
                    )));
                }
                let payload_crc = u32_at(48);
                if meta.flags & flags::PAYLOAD_CRC == 0 && payload_crc != 0 {
                    return Err(DecodeError::Inconsistent("payload_crc set without the PAYLOAD_CRC flag".into()));
                }
                RecordHeader { kind, seq: u64_at(8), meta, payload_len, payload_crc }
            }
        };
        Ok(header)
    }
}

/// A borrowed, checked data record: header, row metadata and rows.
#[derive(Debug, Clone, Copy)]
pub struct RecordView<'a> {
    /// The decoded header.
    pub header: RecordHeader,
    payload: &'a [u8],
}

impl<'a> RecordView<'a> {
    /// Decodes the record at the start of `bytes`. Pads decode too (with an empty payload view).
    ///
    /// Returns the view and the record's footprint in bytes. Never panics on malformed input.
    pub fn decode(bytes: &'a [u8]) -> Result<(RecordView<'a>, usize), DecodeError> {
        let header = RecordHeader::decode(bytes)?;
        let footprint = header.footprint();
        if header.kind == RecordKind::Pad {
            return Ok((RecordView { header, payload: &[] }, footprint));
        }
        let end = HEADER_LEN + header.payload_len as usize;
        let payload = bytes.get(HEADER_LEN..end).ok_or(DecodeError::Truncated { need: end, have: bytes.len() })?;
        if header.meta.flags & flags::PAYLOAD_CRC != 0 {
            let computed = crc32fast::hash(payload);
            if computed != header.payload_crc {
                return Err(DecodeError::PayloadChecksum { seq: header.seq, stored: header.payload_crc, computed });
            }
        }
        Ok((RecordView { header, payload }, footprint))
    }

    /// A view of a data record whose header was already decoded (and checked) from the ring: the way a record is
    /// handed on after the drain decoded it once, without decoding its header again. Checks only that `payload` is
    /// as long as the header says.
    pub fn from_parts(header: RecordHeader, payload: &'a [u8]) -> Result<RecordView<'a>, DecodeError> {
        if header.kind != RecordKind::Data {
            return Err(DecodeError::Inconsistent(format!("record {} is a pad, not a data record", header.seq)));
        }
        let need = header.payload_len as usize;
        if payload.len() != need {
            return Err(DecodeError::Truncated { need, have: payload.len() });
        }
        Ok(RecordView { header, payload })
    }

    /// Number of rows.
    pub fn rows(&self) -> usize {
        self.header.meta.rows as usize
    }

    /// Metadata of row `i`.
    ///
    /// # Panics
    /// If `i >= self.rows()`.
    pub fn row_meta(&self, i: usize) -> RowMeta {
        assert!(i < self.rows(), "row {i} out of range for a record of {} rows", self.rows());
        let off = i * ROW_META_LEN;
        RowMeta::read_from(self.payload[off..off + ROW_META_LEN].try_into().expect("16 bytes"))
    }

    /// Metadata of every row, in row order.
    pub fn row_metas(&self) -> impl ExactSizeIterator<Item = RowMeta> + 'a {
        let payload = self.payload;
        (0..self.rows()).map(move |i| {
            let off = i * ROW_META_LEN;
            RowMeta::read_from(payload[off..off + ROW_META_LEN].try_into().expect("16 bytes"))
        })
    }

    /// All rows, back to back (`rows × row_bytes` bytes).
    pub fn data(&self) -> &'a [u8] {
        &self.payload[self.header.meta.data_offset()..]
    }

    /// Row `i`'s bytes.
    ///
    /// # Panics
    /// If `i >= self.rows()`.
    pub fn row(&self, i: usize) -> &'a [u8] {
        let rb = self.header.meta.row_bytes as usize;
        &self.data()[i * rb..(i + 1) * rb]
    }

    /// The whole payload (row metadata, padding and rows).
    pub fn payload(&self) -> &'a [u8] {
        self.payload
    }
}

/// Writes a data record's payload (row metadata, then rows) into `payload`, which must be exactly
/// `meta.payload_len()` bytes. `row` is called once per row with the row's index and its destination.
///
/// This is the one place the payload layout is produced on the host; the GPU kernels mirror it.
pub fn write_payload(
    payload: &mut [u8],
    meta: &RecordMeta,
    row_metas: &[RowMeta],
    mut row: impl FnMut(usize, &mut [u8]),
) {
    debug_assert_eq!(payload.len(), meta.payload_len());
    debug_assert_eq!(row_metas.len(), meta.rows as usize);
    let (meta_part, data_part) = payload.split_at_mut(meta.data_offset());
    let (entries, pad) = meta_part.split_at_mut(row_metas.len() * ROW_META_LEN);
    for (m, out) in row_metas.iter().zip(entries.chunks_exact_mut(ROW_META_LEN)) {
        m.write_to(out.try_into().expect("16 bytes"));
    }
    pad.fill(0);
    for (i, out) in data_part.chunks_exact_mut(meta.row_bytes as usize).enumerate() {
        row(i, out);
    }
}

/// Encodes a complete data record into a fresh buffer (header, payload, alignment padding). Used by tests and by
/// tools that build records outside a ring; producers write in place through [`crate::Producer`].
pub fn encode_record(seq: u64, meta: &RecordMeta, row_metas: &[RowMeta], rows: &[u8]) -> Vec<u8> {
    let payload_len = meta.payload_len();
    let mut out = vec![0u8; align_up(HEADER_LEN + payload_len)];
    let rb = meta.row_bytes as usize;
    write_payload(&mut out[HEADER_LEN..HEADER_LEN + payload_len], meta, row_metas, |i, dst| {
        dst.copy_from_slice(&rows[i * rb..(i + 1) * rb])
    });
    let payload_crc = if meta.flags & flags::PAYLOAD_CRC != 0 {
        crc32fast::hash(&out[HEADER_LEN..HEADER_LEN + payload_len])
    } else {
        0
    };
    let header =
        RecordHeader { kind: RecordKind::Data, seq, meta: *meta, payload_len: payload_len as u64, payload_crc };
    out[..HEADER_LEN].copy_from_slice(&header.encode());
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn arb_meta() -> impl Strategy<Value = RecordMeta> {
        (any::<u64>(), any::<u32>(), 1u32..9, 1u32..65, prop::sample::select(DType::ALL.to_vec()), any::<bool>())
            .prop_map(|(step, hookpoint, rows, elems, dtype, crc)| RecordMeta {
                step,
                hookpoint,
                rows,
                row_bytes: dtype.row_bytes(elems as u64) as u32,
                dtype,
                flags: if crc { flags::PAYLOAD_CRC } else { 0 },
            })
    }

    fn arb_record() -> impl Strategy<Value = (u64, RecordMeta, Vec<RowMeta>, Vec<u8>)> {
        (any::<u64>(), arb_meta()).prop_flat_map(|(seq, meta)| {
            let n = meta.rows as usize;
            let metas = prop::collection::vec(
                (any::<u64>(), any::<u32>(), any::<u32>()).prop_map(|(request_id, position, batch_row)| RowMeta {
                    request_id,
                    position,
                    batch_row,
                }),
                n,
            );
            let data = prop::collection::vec(any::<u8>(), n * meta.row_bytes as usize);
            (Just(seq), Just(meta), metas, data)
        })
    }

    proptest! {
        #[test]
        fn round_trip((seq, meta, metas, data) in arb_record()) {
            let bytes = encode_record(seq, &meta, &metas, &data);
            prop_assert_eq!(bytes.len() % RECORD_ALIGN, 0);
            let (view, footprint) = RecordView::decode(&bytes).unwrap();
            prop_assert_eq!(footprint, bytes.len());
            prop_assert_eq!(view.header.seq, seq);
            prop_assert_eq!(view.header.meta, meta);
            prop_assert_eq!(view.row_metas().collect::<Vec<_>>(), metas);
            prop_assert_eq!(view.data(), &data[..]);
            for i in 0..view.rows() {
                prop_assert_eq!(view.row(i), &data[i * meta.row_bytes as usize..(i + 1) * meta.row_bytes as usize]);
            }
        }

        /// A record handed on with its decoded header: the same view as decoding it, and a payload of another
        /// length, or a pad's header, is an error.
        #[test]
        fn from_parts_matches_decode_and_checks_the_payload((seq, meta, metas, data) in arb_record(), cut in 1usize..64) {
            let bytes = encode_record(seq, &meta, &metas, &data);
            let (decoded, _) = RecordView::decode(&bytes).unwrap();
            let payload = decoded.payload();
            let view = RecordView::from_parts(decoded.header, payload).unwrap();
            prop_assert_eq!(view.row_metas().collect::<Vec<_>>(), metas);
            prop_assert_eq!(view.data(), &data[..]);
            let short = &payload[..payload.len().saturating_sub(cut)];
            let truncated = RecordView::from_parts(decoded.header, short);
            assert!(matches!(truncated, Err(DecodeError::Truncated { .. })), "{truncated:?}");
            let pad = RecordHeader::pad(HEADER_LEN + 64);
            let not_data = RecordView::from_parts(pad, &[0; 64]);
            assert!(matches!(not_data, Err(DecodeError::Inconsistent(_))), "{not_data:?}");
        }

        #[test]
        fn truncation_is_an_error_not_a_panic((seq, meta, metas, data) in arb_record(), cut in 0usize..4096) {
            let bytes = encode_record(seq, &meta, &metas, &data);
            let payload_end = HEADER_LEN + meta.payload_len();
            let cut = cut % payload_end;
            let result = RecordView::decode(&bytes[..cut]);
            prop_assert!(matches!(result, Err(DecodeError::Truncated { .. })), "{:?}", result.map(|r| r.1));
        }

        #[test]
        fn header_corruption_is_rejected((seq, meta, metas, data) in arb_record(), byte in 0usize..HEADER_LEN, bit in 0u8..8) {
            let mut bytes = encode_record(seq, &meta, &metas, &data);
            bytes[byte] ^= 1 << bit;
            prop_assert!(RecordView::decode(&bytes).is_err());
        }

        #[test]
        fn payload_corruption_is_rejected_when_checksummed(
            (seq, mut meta, metas, data) in arb_record(), pos in any::<usize>(), bit in 0u8..8,
        ) {
            meta.flags |= flags::PAYLOAD_CRC;
            let mut bytes = encode_record(seq, &meta, &metas, &data);
            let pos = HEADER_LEN + pos % meta.payload_len();
            bytes[pos] ^= 1 << bit;
            let result = RecordView::decode(&bytes);
            prop_assert!(matches!(result, Err(DecodeError::PayloadChecksum { .. })), "{:?}", result.map(|r| r.1));
        }

        // Malformed input (random bytes, forged headers, mutated records) is fuzzed in `tests/fuzz_records.rs`.
    }

    #[test]
    fn layout_is_stable() {
        let meta = RecordMeta { step: 7, hookpoint: 3, rows: 2, row_bytes: 8, dtype: DType::BF16, flags: 0 };
        let metas = [
            RowMeta { request_id: 11, position: 5, batch_row: 0 },
            RowMeta { request_id: 12, position: 9, batch_row: 1 },
        ];
        let rows: Vec<u8> = (0..16).collect();
        let bytes = encode_record(42, &meta, &metas, &rows);
        assert_eq!(&bytes[0..4], b"RSR1");
        assert_eq!(u64::from_le_bytes(bytes[8..16].try_into().unwrap()), 42);
        assert_eq!(bytes[37], DType::BF16.code());
        // Row metadata directly after the header, rows at the next 64-byte boundary.
        assert_eq!(u64::from_le_bytes(bytes[64..72].try_into().unwrap()), 11);
        assert_eq!(u32::from_le_bytes(bytes[88..92].try_into().unwrap()), 9);
        assert_eq!(&bytes[128..144], &rows[..]);
        assert_eq!(bytes.len(), 192);
    }
}
