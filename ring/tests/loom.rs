//! Model-checks the ring's index protocol with loom: every interleaving of one producer and one consumer (within
//! loom's preemption bound) delivers each record exactly once, in order, with the bytes the producer wrote, and no
//! byte is read while it may be written (the shadow cells in `sync.rs` make loom see the ring's slots).
//!
//! The full-mode path is checked too: a producer asleep in `reserve_until` on a full ring is woken by every release
//! that makes room and by the consumer's drop. Under loom the sleep has no timeout and the clock stands still
//! (`sync.rs`), so a lost wake-up is not a 10 ms stall but a failure: loom reports a deadlock, or "Model exceeded
//! maximum number of branches" when the consumer spins forever for a record of the sleeping producer.
//!
//! Run with: `RUSTFLAGS="--cfg loom" cargo test -p ringscope-ring --release --test loom`
#![cfg(loom)]

use std::time::{Duration, Instant};

use ringscope_ring::record::RowMeta;
use ringscope_ring::{channel, Consumer, DType, Producer, RecordMeta, ReserveError};

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

/// Record `i` of the full-mode models: one 8-byte row (a 192-byte footprint), every byte `i + 1`.
fn push_full(producer: &mut Producer, i: u64, deadline: Instant) -> Result<u64, ReserveError> {
    let mut r = producer.reserve_until(meta(i, 8), deadline)?;
    r.write_rows(&[RowMeta { request_id: i, position: i as u32, batch_row: 0 }], &[i as u8 + 1; 8]);
    Ok(r.publish())
}

/// Reads every record published so far, checking that they continue the stream at `next` with their bytes, then
/// releases them all with one store (as a batching drain does). Returns how many it read.
fn drain_visible(consumer: &mut Consumer, next: u64) -> u64 {
    let mut read = 0;
    while let Some(v) = consumer.peek().unwrap() {
        let i = next + read;
        assert_eq!(v.header.seq, i);
        assert_eq!(v.header.meta.step, i);
        assert_eq!(v.row_meta(0).request_id, i);
        assert_eq!(v.data(), &[i as u8 + 1; 8]);
        consumer.advance();
        read += 1;
    }
    // Only after reading something: a spinning consumer that kept notifying would make up for a lost wake-up.
    if read > 0 {
        consumer.release();
    }
    read
}

/// Far enough that the model's frozen clock never reaches it: only a wake-up can end a wait.
fn far_deadline() -> Instant {
    Instant::now() + Duration::from_secs(24 * 3600)
}

#[test]
fn a_producer_waiting_for_space_is_woken_by_each_release() {
    // Two 192-byte records fill 384 bytes. The producer starts on a full ring and waits in `reserve_until` whenever
    // the consumer has not released enough; the consumer releases everything it has read with one store, so the
    // release that makes room is often the last one before the consumer itself needs the waiting producer's record:
    // a wake-up lost there is never made up by a later release.
    const RECORDS: u64 = 5;
    let deadline = far_deadline();
    loom::model(move || {
        let (mut producer, mut consumer) = channel(384).unwrap();
        for i in 0..2 {
            assert_eq!(push_full(&mut producer, i, deadline), Ok(i));
        }
        let t = loom::thread::spawn(move || {
            for i in 2..RECORDS {
                assert_eq!(push_full(&mut producer, i, deadline), Ok(i));
            }
        });
        let mut next = 0;
        while next < RECORDS {
            match drain_visible(&mut consumer, next) {
                0 => loom::thread::yield_now(),
                read => next += read,
            }
        }
        t.join().unwrap();
        assert!(consumer.is_finished());
    });
}

#[test]
fn a_producer_waiting_for_space_is_woken_by_the_consumer_drop() {
    // The consumer reads one record without releasing it, then goes away: the waiting producer must return
    // `Disconnected` whether it was asleep, about to sleep, or not yet waiting when the consumer dropped.
    let deadline = far_deadline();
    loom::model(move || {
        let (mut producer, mut consumer) = channel(384).unwrap();
        for i in 0..2 {
            assert_eq!(push_full(&mut producer, i, deadline), Ok(i));
        }
        let t = loom::thread::spawn(move || {
            assert_eq!(push_full(&mut producer, 2, deadline), Err(ReserveError::Disconnected));
        });
        assert!(consumer.peek().unwrap().is_some());
        drop(consumer);
        t.join().unwrap();
    });
}
