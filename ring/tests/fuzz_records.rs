//! Fuzzing the record decoder and the host ring's consumer with proptest (stable Rust, runs in `cargo test`).
//!
//! Decoding is the one place ringscope reads bytes it did not just write: a corrupted ring, a dump written by
//! another build, a forged record. Whatever the bytes, decoding returns a [`DecodeError`] or a view whose every
//! accessor stays inside the bytes it was given — never a panic, never an out-of-bounds read.
//!
//! Inputs are unstructured (random bytes) and structured: valid records mutated (bit flips, truncation, a field set
//! to an extreme value, with and without a recomputed header check, so that the consistency checks behind the check
//! are reached). The default run is `PROPTEST_CASES` (256) cases per property; see docs/testing.md ("Fuzzing") to
//! run longer.

use proptest::prelude::*;
use ringscope_ring::record::{
    encode_record, flags, header_check, RecordHeader, RecordKind, RecordMeta, RecordView, RowMeta, FORMAT_VERSION,
    HEADER_LEN, MAGIC, RECORD_ALIGN,
};
use ringscope_ring::{channel, DType, DecodeError, ReserveError};

fn arb_meta() -> impl Strategy<Value = RecordMeta> {
    (any::<u64>(), any::<u32>(), 1u32..9, 1u32..65, prop::sample::select(DType::ALL.to_vec()), 0u16..4).prop_map(
        |(step, hookpoint, rows, elems, dtype, flag_bits)| RecordMeta {
            step,
            hookpoint,
            rows,
            // A row-scaled dtype's row leads with its scale: valid rows have at least one element after it.
            row_bytes: dtype.row_overhead() as u32 + elems * dtype.size() as u32,
            dtype,
            flags: flag_bits & flags::KNOWN,
        },
    )
}

fn arb_row_meta() -> impl Strategy<Value = RowMeta> {
    (any::<u64>(), any::<u32>(), any::<u32>()).prop_map(|(request_id, position, batch_row)| RowMeta {
        request_id,
        position,
        batch_row,
    })
}

/// A valid record: sequence number, fields, row metadata and rows.
fn arb_record() -> impl Strategy<Value = (u64, RecordMeta, Vec<RowMeta>, Vec<u8>)> {
    (any::<u64>(), arb_meta()).prop_flat_map(|(seq, meta)| {
        let n = meta.rows as usize;
        let metas = prop::collection::vec(arb_row_meta(), n);
        let data = prop::collection::vec(any::<u8>(), n * meta.row_bytes as usize);
        (Just(seq), Just(meta), metas, data)
    })
}

/// Values at the edges of a field of `bytes` bytes (1, 2, 4 or 8): zero, one, the maximum and its neighbours, the
/// sign bit, and a random value.
fn extreme(bytes: usize) -> impl Strategy<Value = u64> {
    let max = if bytes == 8 { u64::MAX } else { (1u64 << (8 * bytes)) - 1 };
    prop_oneof![
        Just(0u64),
        Just(1),
        Just(max),
        Just(max - 1),
        Just(max - 63),
        Just(max / 2),
        Just(max / 2 + 1),
        Just(64),
        Just(4096),
        any::<u64>().prop_map(move |v| v & max),
    ]
}

/// The header fields, as (offset, width in bytes).
const FIELDS: [(usize, usize); 13] = [
    (0, 4),  // magic
    (4, 2),  // version
    (6, 2),  // header_len
    (8, 8),  // seq
    (16, 8), // step
    (24, 4), // hookpoint
    (28, 4), // rows
    (32, 4), // row_bytes
    (36, 1), // kind
    (37, 1), // dtype
    (38, 2), // flags
    (40, 8), // payload_len
    (48, 4), // payload_crc
];

fn set_field(bytes: &mut [u8], (offset, width): (usize, usize), value: u64) {
    bytes[offset..offset + width].copy_from_slice(&value.to_le_bytes()[..width]);
}

fn reseal(bytes: &mut [u8]) {
    let h: &[u8; HEADER_LEN] = bytes[..HEADER_LEN].try_into().unwrap();
    let check = header_check(h);
    bytes[56..64].copy_from_slice(&check.to_le_bytes());
}

/// One way of damaging a valid record.
#[derive(Debug, Clone)]
enum Mutation {
    /// Flip one bit anywhere in the record.
    FlipBit { pos: usize, bit: u8 },
    /// Keep only the first `len` bytes.
    Truncate { len: usize },
    /// Set one header field to `value`; `reseal` recomputes the header check so the field checks are reached.
    SetField { field: usize, value: u64, reseal: bool },
    /// Overwrite a run of bytes with random ones.
    Scribble { pos: usize, bytes: Vec<u8> },
    /// Append random bytes (what follows a record in a ring).
    Extend { bytes: Vec<u8> },
}

fn arb_mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        (any::<usize>(), 0u8..8).prop_map(|(pos, bit)| Mutation::FlipBit { pos, bit }),
        any::<usize>().prop_map(|len| Mutation::Truncate { len }),
        (0..FIELDS.len())
            .prop_flat_map(|field| (Just(field), extreme(FIELDS[field].1), any::<bool>()))
            .prop_map(|(field, value, reseal)| Mutation::SetField { field, value, reseal }),
        (any::<usize>(), prop::collection::vec(any::<u8>(), 1..32))
            .prop_map(|(pos, bytes)| Mutation::Scribble { pos, bytes }),
        prop::collection::vec(any::<u8>(), 0..256).prop_map(|bytes| Mutation::Extend { bytes }),
    ]
}

fn apply(bytes: &mut Vec<u8>, m: &Mutation) {
    match m {
        Mutation::FlipBit { pos, bit } => {
            if !bytes.is_empty() {
                let pos = pos % bytes.len();
                bytes[pos] ^= 1 << bit;
            }
        }
        Mutation::Truncate { len } => bytes.truncate(len % (bytes.len() + 1)),
        Mutation::SetField { field, value, reseal: again } => {
            if bytes.len() >= HEADER_LEN {
                set_field(bytes, FIELDS[*field], *value);
                if *again {
                    reseal(bytes);
                }
            }
        }
        Mutation::Scribble { pos, bytes: new } => {
            if !bytes.is_empty() {
                let pos = pos % bytes.len();
                let end = (pos + new.len()).min(bytes.len());
                bytes[pos..end].copy_from_slice(&new[..end - pos]);
            }
        }
        Mutation::Extend { bytes: more } => bytes.extend_from_slice(more),
    }
}

/// Decodes `bytes` every way there is and reads everything a successful decode hands out. Whatever decoded must be
/// consistent: the footprint covers the header and the payload, the payload lies inside `bytes`, and every row and
/// row metadata entry can be read.
fn decode_everything(bytes: &[u8]) -> Result<(), TestCaseError> {
    let header = RecordHeader::decode(bytes);
    let view = RecordView::decode(bytes);
    match (&header, &view) {
        (Err(a), Err(b)) => prop_assert!(!a.to_string().is_empty() && !b.to_string().is_empty()),
        (Err(e), Ok(_)) => prop_assert!(false, "the header did not decode ({e}) but the record did"),
        (Ok(_), _) => {}
    }
    if let Ok(header) = header {
        let footprint = header.footprint();
        prop_assert_eq!(footprint % RECORD_ALIGN, 0);
        prop_assert!(footprint as u64 >= HEADER_LEN as u64 + header.payload_len);
        if header.kind == RecordKind::Data {
            // The payload as the drain hands it on: from_parts checks only the length.
            let start = HEADER_LEN.min(bytes.len());
            let rest = &bytes[start..];
            let cut = rest.len().min(header.payload_len as usize);
            match RecordView::from_parts(header, &rest[..cut]) {
                Ok(v) => read_all(&v)?,
                Err(e) => prop_assert!(matches!(e, DecodeError::Truncated { .. }), "{e}"),
            }
        }
    }
    if let Ok((view, footprint)) = view {
        prop_assert_eq!(footprint, view.header.footprint());
        if view.header.kind == RecordKind::Data {
            prop_assert!(HEADER_LEN + view.payload().len() <= bytes.len());
            read_all(&view)?;
        }
    }
    Ok(())
}

fn read_all(view: &RecordView<'_>) -> Result<(), TestCaseError> {
    let rows = view.rows();
    prop_assert_eq!(view.row_metas().len(), rows);
    prop_assert_eq!(view.data().len(), rows * view.header.meta.row_bytes as usize);
    for i in 0..rows {
        let _ = view.row_meta(i);
        prop_assert_eq!(view.row(i).len(), view.header.meta.row_bytes as usize);
    }
    prop_assert_eq!(view.row_metas().count(), rows);
    Ok(())
}

/// A header with a correct check over arbitrary field values, each drawn from the edges of its range.
fn arb_forged_header() -> impl Strategy<Value = [u8; HEADER_LEN]> {
    let fields = (
        (extreme(8), extreme(8), extreme(4), extreme(4), extreme(4)),
        (prop_oneof![Just(0u64), Just(1), extreme(1)], prop_oneof![(0u64..13), extreme(1)]),
        (prop_oneof![(0u64..4), extreme(2)], extreme(8), extreme(4), prop_oneof![Just(0u64), extreme(4)]),
    );
    fields.prop_map(
        |((seq, step, hookpoint, rows, row_bytes), (kind, dtype), (flag_bits, payload_len, crc, reserved))| {
            let mut h = [0u8; HEADER_LEN];
            set_field(&mut h, (0, 4), MAGIC as u64);
            set_field(&mut h, (4, 2), FORMAT_VERSION as u64);
            set_field(&mut h, (6, 2), HEADER_LEN as u64);
            set_field(&mut h, (8, 8), seq);
            set_field(&mut h, (16, 8), step);
            set_field(&mut h, (24, 4), hookpoint);
            set_field(&mut h, (28, 4), rows);
            set_field(&mut h, (32, 4), row_bytes);
            set_field(&mut h, (36, 1), kind);
            set_field(&mut h, (37, 1), dtype);
            set_field(&mut h, (38, 2), flag_bits);
            set_field(&mut h, (40, 8), payload_len);
            set_field(&mut h, (48, 4), crc);
            set_field(&mut h, (52, 4), reserved);
            let check = header_check(&h);
            h[56..64].copy_from_slice(&check.to_le_bytes());
            h
        },
    )
}

proptest! {
    /// Unstructured: random bytes, with and without a valid magic and version in front.
    #[test]
    fn arbitrary_bytes_never_panic(mut bytes in prop::collection::vec(any::<u8>(), 0..1024), prefix in 0u8..3) {
        if prefix >= 1 && bytes.len() >= 4 {
            bytes[0..4].copy_from_slice(&MAGIC.to_le_bytes());
        }
        if prefix >= 2 && bytes.len() >= 6 {
            bytes[4..6].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
        }
        decode_everything(&bytes)?;
    }

    /// Headers with a *correct* check but fields at the edges of their ranges (rows × row_bytes overflowing, pad
    /// lengths near `u64::MAX`, unknown kinds, dtypes and flags) reach every consistency check behind the check.
    #[test]
    fn forged_headers_with_valid_check_never_panic(
        header in arb_forged_header(), tail in prop::collection::vec(any::<u8>(), 0..512),
    ) {
        let mut bytes = header.to_vec();
        bytes.extend_from_slice(&tail);
        decode_everything(&bytes)?;
        // Short inputs too: every prefix length class (none, part of the header, header, part of the payload).
        for cut in [0, 1, HEADER_LEN - 1, HEADER_LEN, HEADER_LEN + tail.len() / 2] {
            decode_everything(&bytes[..cut.min(bytes.len())])?;
        }
    }

    /// Structured: a valid record, damaged by one to four mutations. A record no mutation changed still decodes to
    /// what was encoded.
    #[test]
    fn mutated_records_never_panic(
        (seq, meta, metas, data) in arb_record(), mutations in prop::collection::vec(arb_mutation(), 1..5),
    ) {
        let original = encode_record(seq, &meta, &metas, &data);
        let mut bytes = original.clone();
        for m in &mutations {
            apply(&mut bytes, m);
        }
        decode_everything(&bytes)?;
        if bytes.get(..original.len()) == Some(&original[..]) {
            let (view, footprint) = RecordView::decode(&bytes).map_err(|e| TestCaseError::fail(e.to_string()))?;
            prop_assert_eq!(footprint, original.len());
            prop_assert_eq!(view.header.seq, seq);
            prop_assert_eq!(view.row_metas().collect::<Vec<_>>(), metas);
            prop_assert_eq!(view.data(), &data[..]);
        }
    }

    /// One header bit flipped anywhere in the first 56 bytes is always caught (the check is a bijection per word),
    /// and a bit flipped in the check itself too.
    #[test]
    fn any_single_header_bit_flip_is_an_error((seq, meta, metas, data) in arb_record(), pos in 0..HEADER_LEN, bit in 0u8..8) {
        let mut bytes = encode_record(seq, &meta, &metas, &data);
        bytes[pos] ^= 1 << bit;
        prop_assert!(RecordHeader::decode(&bytes).is_err());
        prop_assert!(RecordView::decode(&bytes).is_err());
    }

    /// `from_parts` with any header that decoded and a payload of any length: a view only when the length is
    /// exactly the header's, and then every row can be read.
    #[test]
    fn from_parts_never_panics(header in arb_forged_header(), payload in prop::collection::vec(any::<u8>(), 0..1024)) {
        if let Ok(header) = RecordHeader::decode(&header) {
            match RecordView::from_parts(header, &payload) {
                Ok(view) => {
                    prop_assert_eq!(view.payload().len() as u64, header.payload_len);
                    read_all(&view)?;
                }
                Err(e) => prop_assert!(matches!(e, DecodeError::Truncated { .. } | DecodeError::Inconsistent(_)), "{e}"),
            }
        }
    }

    /// The host ring's consumer, fed by random pushes and pops on a small ring (wrapping many times): every record
    /// comes out once, in order, with its bytes; a record is refused as too large exactly when its payload exceeds
    /// half the ring minus the header, and as full only while records are waiting.
    #[test]
    fn host_ring_delivers_random_records_in_order(
        capacity_slots in 4usize..24,
        ops in prop::collection::vec((any::<bool>(), 1u32..6, 1u32..200, any::<u8>()), 1..120),
    ) {
        let capacity = capacity_slots * 2 * RECORD_ALIGN;
        let (mut producer, mut consumer) = channel(capacity).unwrap();
        let max_payload = producer.max_payload_len();
        let mut waiting = std::collections::VecDeque::new();
        let mut next_seq = 0u64;
        for (step, (push, rows, row_bytes, fill)) in ops.into_iter().enumerate() {
            if push {
                let meta = RecordMeta { step: step as u64, hookpoint: fill as u32, rows, row_bytes, dtype: DType::U8, flags: flags::PAYLOAD_CRC };
                let metas: Vec<RowMeta> = (0..rows).map(|i| RowMeta { request_id: step as u64, position: i, batch_row: i }).collect();
                let data = vec![fill; (rows * row_bytes) as usize];
                match producer.try_push(meta, &metas, &data) {
                    Ok(seq) => {
                        prop_assert_eq!(seq, next_seq);
                        next_seq += 1;
                        waiting.push_back((meta, data));
                    }
                    Err(ReserveError::TooLarge { payload_len, .. }) => {
                        prop_assert!(payload_len > max_payload);
                        prop_assert_eq!(payload_len, meta.payload_len());
                    }
                    Err(ReserveError::Full { .. }) => {
                        prop_assert!(meta.payload_len() <= max_payload);
                        prop_assert!(!waiting.is_empty(), "full with nothing waiting");
                    }
                    Err(e) => prop_assert!(false, "unexpected {e}"),
                }
            } else {
                let got = consumer.pop_with(|v| (v.header.meta, v.data().to_vec())).map_err(|e| TestCaseError::fail(e.to_string()))?;
                prop_assert_eq!(got, waiting.pop_front());
            }
        }
        while let Some(expected) = waiting.pop_front() {
            let got = consumer.pop_with(|v| (v.header.meta, v.data().to_vec())).map_err(|e| TestCaseError::fail(e.to_string()))?;
            prop_assert_eq!(got, Some(expected));
        }
        prop_assert_eq!(consumer.pop_with(|_| ()).map_err(|e| TestCaseError::fail(e.to_string()))?, None);
        prop_assert_eq!(consumer.used_bytes(), 0);
    }
}

/// Found by `forged_headers_with_valid_check_never_panic`: a pad whose length is near `u64::MAX` (aligned, with a
/// correct check) overflowed the footprint arithmetic — a panic in debug builds, a wrapped footprint in release.
#[test]
fn a_pad_of_absurd_length_is_an_error() {
    for payload_len in [u64::MAX - 63, u64::MAX - 127, 1 << 63] {
        let mut h = [0u8; HEADER_LEN];
        set_field(&mut h, (0, 4), MAGIC as u64);
        set_field(&mut h, (4, 2), FORMAT_VERSION as u64);
        set_field(&mut h, (6, 2), HEADER_LEN as u64);
        set_field(&mut h, (36, 1), RecordKind::Pad as u64);
        set_field(&mut h, (40, 8), payload_len);
        reseal(&mut h);
        let result = RecordView::decode(&h);
        assert!(matches!(result, Err(DecodeError::Inconsistent(_))), "{:?}", result.map(|r| r.1));
    }
}

/// Found by `forged_headers_with_valid_check_never_panic`: `rows × row_bytes` plus the row metadata overflowed
/// `usize` when computing a data record's payload length (a panic in debug builds; in release the wrapped length
/// could match a forged `payload_len`).
#[test]
fn a_data_record_whose_payload_length_overflows_is_an_error() {
    let meta = RecordMeta { step: 0, hookpoint: 0, rows: u32::MAX, row_bytes: u32::MAX, dtype: DType::U8, flags: 0 };
    assert!(matches!(meta.validate(), Err(DecodeError::Inconsistent(_))));
    let wrapped = (meta.rows as u64 * 16).next_multiple_of(64).wrapping_add(meta.rows as u64 * meta.row_bytes as u64);
    for payload_len in [u64::MAX, wrapped] {
        let mut h = [0u8; HEADER_LEN];
        set_field(&mut h, (0, 4), MAGIC as u64);
        set_field(&mut h, (4, 2), FORMAT_VERSION as u64);
        set_field(&mut h, (6, 2), HEADER_LEN as u64);
        set_field(&mut h, (28, 4), meta.rows as u64);
        set_field(&mut h, (32, 4), meta.row_bytes as u64);
        set_field(&mut h, (36, 1), RecordKind::Data as u64);
        set_field(&mut h, (37, 1), DType::U8.code() as u64);
        set_field(&mut h, (40, 8), payload_len);
        reseal(&mut h);
        let result = RecordView::decode(&h);
        assert!(matches!(result, Err(DecodeError::Inconsistent(_))), "{:?}", result.map(|r| r.1));
    }
}
