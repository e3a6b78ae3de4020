//! Multi-threaded stress test of the host ring: one producer thread, one drain thread, a million records of random
//! sizes through a small ring (so it wraps and fills constantly). Every byte is verified by checksum and by
//! regenerating it; sequence numbers must be contiguous.
#![cfg(not(loom))]

use std::time::{Duration, Instant};

use ringscope_ring::record::RowMeta;
use ringscope_ring::{channel, DType, RecordMeta, ReserveError};

/// splitmix64: a tiny deterministic generator so both threads can regenerate record `i` independently.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Shape and bytes of record `i`.
fn record(i: u64, buf: &mut Vec<u8>) -> (u32, u32) {
    let r = mix(i);
    let rows = 1 + (r % 4) as u32;
    let row_bytes = 1 + ((r >> 8) % 700) as u32;
    buf.clear();
    let len = (rows * row_bytes) as usize;
    let mut w = 0u64;
    while buf.len() < len {
        let word = mix(i ^ (w << 32)).to_le_bytes();
        let take = (len - buf.len()).min(8);
        buf.extend_from_slice(&word[..take]);
        w += 1;
    }
    (rows, row_bytes)
}

#[test]
fn million_records_random_sizes_every_byte_checked() {
    const RECORDS: u64 = 1_000_000;
    let (mut producer, mut consumer) = channel(64 * 1024).unwrap();

    let producer_thread = std::thread::spawn(move || {
        let mut data = Vec::new();
        let mut metas = Vec::new();
        let mut waits = 0u64;
        for i in 0..RECORDS {
            let (rows, row_bytes) = record(i, &mut data);
            let crc = crc32fast::hash(&data);
            metas.clear();
            metas.extend((0..rows).map(|r| RowMeta { request_id: crc as u64, position: r, batch_row: r }));
            let meta = RecordMeta { step: i, hookpoint: (i % 7) as u32, rows, row_bytes, dtype: DType::U8, flags: 0 };
            // Alternate the non-waiting and the waiting reservation paths.
            let mut reservation = loop {
                if i % 2 == 0 {
                    match producer.try_reserve(meta) {
                        Ok(r) => break r,
                        Err(ReserveError::Full { .. }) => {
                            waits += 1;
                            std::thread::yield_now();
                        }
                        Err(e) => panic!("record {i}: {e}"),
                    }
                } else {
                    let deadline = Instant::now() + Duration::from_secs(60);
                    break producer.reserve_until(meta, deadline).unwrap_or_else(|e| panic!("record {i}: {e}"));
                }
            };
            reservation.write_rows(&metas, &data);
            assert_eq!(reservation.publish(), i);
        }
        waits
    });

    let mut expected = Vec::new();
    let mut received = 0u64;
    let mut bytes = 0u64;
    while received < RECORDS {
        let mut batch = 0;
        while let Some(view) = consumer.peek().unwrap() {
            let h = view.header;
            assert_eq!(h.seq, received, "sequence numbers must be contiguous");
            assert_eq!(h.meta.step, received);
            let (rows, row_bytes) = record(received, &mut expected);
            assert_eq!((h.meta.rows, h.meta.row_bytes), (rows, row_bytes), "record {received} shape");
            let crc = crc32fast::hash(view.data());
            for (r, m) in view.row_metas().enumerate() {
                assert_eq!(m.request_id, crc as u64, "record {received} row {r}: checksum mismatch");
                assert_eq!((m.position, m.batch_row), (r as u32, r as u32));
            }
            assert!(view.data() == &expected[..], "record {received}: bytes differ");
            bytes += view.data().len() as u64;
            consumer.advance();
            received += 1;
            batch += 1;
            // Release in batches, as the exporter's drain does.
            if batch == 16 {
                consumer.release();
                batch = 0;
            }
        }
        consumer.release();
        if received < RECORDS {
            std::thread::yield_now();
        }
    }
    let waits = producer_thread.join().unwrap();
    assert!(consumer.is_finished());
    assert!(consumer.peek().unwrap().is_none());
    eprintln!("{RECORDS} records, {bytes} payload bytes, producer found the ring full {waits} times");
}
