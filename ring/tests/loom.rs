//! Model-checks the ring's index protocol with loom: every interleaving of one producer and one consumer (within
//! loom's preemption bound) delivers each record exactly once, in order, with the bytes the producer wrote, and no
//! byte is read while it may be written (the shadow cells in `sync.rs` make loom see the ring's slots).
//!
//! Run with: `RUSTFLAGS="--cfg loom" cargo test -p ringscope-ring --release --test loom`
#![cfg(loom)]

use ringscope_ring::record::RowMeta;
use ringscope_ring::{channel, DType, RecordMeta, ReserveError};

fn meta(step: u64, row_bytes: u32) -> RecordMeta {
    RecordMeta { step, hookpoint: 0, rows: 1, row_bytes, dtype: DType::U8, flags: 0 }
}

fn run(records: u64, capacity: usize) {
    loom::model(move || {
        let (mut producer, mut consumer) = channel(capacity).unwrap();
        let t = loom::thread::spawn(move || {
            for i in 0..records {
                // Vary the size so that records wrap at different offsets.
                let row_bytes = if i % 2 == 0 { 8 } else { 56 };
                let data = vec![i as u8 + 1; row_bytes as usize];
                let row = [RowMeta { request_id: i, position: i as u32, batch_row: 0 }];
                loop {
                    match producer.try_push(meta(i, row_bytes), &row, &data) {
                        Ok(seq) => {
                            assert_eq!(seq, i);
                            break;
                        }
                        Err(ReserveError::Full { .. }) => loom::thread::yield_now(),
                        Err(e) => panic!("{e}"),
                    }
                }
            }
        });
        let mut next = 0;
        while next < records {
            let got = consumer
                .pop_with(|v| {
                    assert_eq!(v.header.seq, next);
                    assert_eq!(v.row_meta(0).request_id, next);
                    assert!(v.data().iter().all(|&b| b == next as u8 + 1));
                })
                .unwrap();
            match got {
                Some(()) => next += 1,
                None => loom::thread::yield_now(),
            }
        }
        t.join().unwrap();
        assert!(consumer.is_finished());
    });
}

#[test]
fn three_records_through_a_ring_that_holds_two() {
    // 192-byte records in 512 bytes: the third one finds 128 bytes before the end, pads and wraps to offset 0.
    run(3, 512);
}

#[test]
fn records_that_end_exactly_at_the_buffer_end() {
    // 192-byte records in 384 bytes: the third one lands exactly at the end and wraps without a pad.
    run(3, 384);
}
