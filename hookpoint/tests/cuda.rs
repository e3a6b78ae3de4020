//! GPU tests of the CUDA backend: capture hookpoints into a CUDA graph, replay it while the sources change, drain
//! through pinned memory, and check every byte, every sequence number and every counter.
//!
//! They need an NVIDIA GPU, its driver and NVRTC, so they are `#[ignore]`d: a machine without a GPU reports them as
//! ignored, not passed. On a GPU machine: `LD_LIBRARY_PATH=<dir of libnvrtc.so.13> cargo test --release -p
//! ringscope-hookpoint --test cuda -- --include-ignored` (asked to run without a GPU, each fails, saying why). They
//! take the GPU one at a time ([`gpu`]), whatever `--test-threads` says.

use std::sync::Arc;
use std::time::Duration;

use ringscope_hookpoint::cuda::{
    pattern_word, DeviceCapture, DeviceCaptureError, DeviceCaptureOptions, DeviceFlags, DeviceProbe, EndedRows,
    GraphBatch,
};
use ringscope_hookpoint::{HookPoint, HookPointSpec, Registry, RowSelection, SiteKind, StepBatch};
use ringscope_ring::cuda::{
    errors, CudaError, DeviceBuffer, DeviceConsumer, DevicePtr, DeviceRing, DrainTuning, ForeignStream, Gpu, Graph,
    Stream,
};
use ringscope_ring::{rowscaled, DType, RowMeta};

/// The GPU, held by one test at a time for as long as the test keeps this.
///
/// The tests record CUDA graphs in global capture mode (as PyTorch does), in which another thread's CUDA call during
/// the capture invalidates it; the harness runs tests on several threads of one process, so each holds the GPU alone.
struct TestGpu {
    gpu: Arc<Gpu>,
    _alone: parking_lot::MutexGuard<'static, ()>,
}

impl std::ops::Deref for TestGpu {
    type Target = Arc<Gpu>;

    fn deref(&self) -> &Arc<Gpu> {
        &self.gpu
    }
}

fn gpu() -> TestGpu {
    static ALONE: parking_lot::Mutex<()> = parking_lot::Mutex::new(());
    let alone = ALONE.lock();
    match Gpu::open(0) {
        Ok(gpu) => TestGpu { gpu, _alone: alone },
        Err(e) => {
            panic!("this test needs an NVIDIA GPU, its driver and NVRTC (it is ignored without --include-ignored): {e}")
        }
    }
}

/// What a drained record held.
#[derive(Debug, Clone)]
struct Got {
    seq: u64,
    step: u64,
    hookpoint: u32,
    dtype: DType,
    metas: Vec<RowMeta>,
    rows: Vec<Vec<u8>>,
}

/// Drains until the producer is closed and everything is out.
fn drain_all(consumer: &mut DeviceConsumer) -> Vec<Got> {
    let mut out = Vec::new();
    loop {
        let got = consumer.peek_record().expect("a valid next record").map(|v| Got {
            seq: v.header.seq,
            step: v.header.meta.step,
            hookpoint: v.header.meta.hookpoint,
            dtype: v.header.meta.dtype,
            metas: (0..v.header.meta.rows as usize).map(|i| v.row_meta(i)).collect(),
            rows: (0..v.header.meta.rows as usize).map(|i| v.row(i).to_vec()).collect(),
        });
        match got {
            Some(g) => {
                out.push(g);
                consumer.advance_record();
            }
            None if consumer.finished() => return out,
            None => std::thread::sleep(Duration::from_micros(50)),
        }
    }
}

fn spawn_drain(mut consumer: DeviceConsumer, pause: Duration) -> std::thread::JoinHandle<Vec<Got>> {
    std::thread::spawn(move || {
        std::thread::sleep(pause);
        drain_all(&mut consumer)
    })
}

fn pattern_bytes(seed: u64, bytes: usize) -> Vec<u8> {
    (0..bytes.div_ceil(4) as u64).flat_map(|i| pattern_word(seed, i).to_le_bytes()).take(bytes).collect()
}

fn seed(step: u64, hp: u32) -> u64 {
    step.wrapping_mul(1_000_003) ^ ((hp as u64) << 40) ^ 0xA5A5
}

/// Batch of step `s`: `1 + s % max_rows` rows; requests of two tokens each (prefill-like), positions counting up.
fn batch(step: u64, max_rows: u32) -> StepBatch {
    let n = 1 + (step % max_rows as u64) as u32;
    StepBatch::new(step, (0..n).map(|i| (1000 + step + (i / 2) as u64, (step as u32) * 10 + i))).unwrap()
}

struct Source {
    hp: Arc<HookPoint>,
    buf: DeviceBuffer,
    /// Byte offset of the tensor in `buf` (2 for the misaligned-path hookpoint).
    offset: u64,
    rows: u32,
}

impl Source {
    fn ptr(&self) -> DevicePtr {
        self.buf.ptr_at(self.offset as usize)
    }
    fn bytes(&self) -> usize {
        self.rows as usize * self.hp.spec().row_bytes() as usize
    }
}

/// A graph-begun step's batch from the device tensors `req` (request ids) and `pos` (positions, `seq` per batch row).
fn graph_batch(req: &DeviceBuffer, pos: &DeviceBuffer, batch: u32, seq: u32) -> GraphBatch {
    GraphBatch {
        batch,
        seq,
        request_ids: req.ptr(),
        positions: pos.ptr(),
        positions_batch_stride: seq,
        ended: None,
        kept: None,
    }
}

fn register(reg: &Registry, name: &str, dtype: DType, width: u32) -> Arc<HookPoint> {
    reg.register(HookPointSpec { name: name.into(), site: SiteKind::Residual, layer: Some(0), dtype, row_width: width })
        .unwrap()
}

/// The rows a capture keeps, by batch row, as the kernel must choose them.
fn expected_rows(sel: &RowSelection, b: &StepBatch, valid: Option<u32>, src_rows: u32) -> Vec<u32> {
    let bound = (b.len() as u32).min(src_rows).min(valid.unwrap_or(u32::MAX));
    match sel {
        RowSelection::All => (0..bound).collect(),
        RowSelection::LastPerRequest => {
            b.last_per_request().iter().map(|m| m.batch_row).take_while(|&r| r < bound).collect()
        }
        RowSelection::Rows(list) => list.iter().copied().take_while(|&r| r < bound).collect(),
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: run with --include-ignored on one"]
fn graph_replays_capture_every_row_bit_exact() {
    let gpu = gpu();
    const MAX_ROWS: u32 = 8;
    const STEPS: u64 = 60;
    let ring = DeviceRing::new(&gpu, 8 << 20).unwrap();
    let mut cap = DeviceCapture::new(&ring, DeviceCaptureOptions { max_batch_rows: 64, ..Default::default() }).unwrap();
    let consumer = DeviceConsumer::new(&ring, DrainTuning { chunk_bytes: 64 << 10, max_in_flight: 4 }).unwrap();
    let reg = Registry::new();
    let stream = Stream::new(&gpu).unwrap();
    let valid_rows = DeviceBuffer::zeroed(&gpu, 4).unwrap();

    // Six hookpoints: fast path, a 4000-byte f32 row, a 14-byte f16 row read from a 2-byte-misaligned address
    // (byte path), last row per request, an explicit list out of order, and a padded batch with a valid-rows scalar.
    let specs: [(&str, DType, u32, RowSelection, u64); 6] = [
        ("resid", DType::BF16, 2048, RowSelection::All, 0),
        ("attn", DType::F32, 1000, RowSelection::All, 0),
        ("odd", DType::F16, 7, RowSelection::All, 2),
        ("last", DType::BF16, 2048, RowSelection::LastPerRequest, 0),
        ("list", DType::BF16, 64, RowSelection::Rows(vec![3, 0, 5]), 0),
        ("valid", DType::F16, 512, RowSelection::All, 0),
    ];
    let mut sources = Vec::new();
    for (name, dtype, width, sel, offset) in specs.iter().cloned() {
        let hp = register(&reg, name, dtype, width);
        hp.control().set_selection(sel).unwrap();
        let bytes = MAX_ROWS as usize * hp.spec().row_bytes() as usize + 16;
        sources.push(Source { hp, buf: DeviceBuffer::zeroed(&gpu, bytes).unwrap(), offset, rows: MAX_ROWS });
    }
    cap.set_valid_rows_ptr(5, Some(valid_rows.ptr())).unwrap();

    let drain = spawn_drain(consumer, Duration::ZERO);
    // Record the captures into a graph (the first begin_step makes the descriptor and controls ready).
    cap.begin_step(&reg, &batch(0, MAX_ROWS), stream.handle()).unwrap();
    let graph = Graph::capture(&stream, || -> Result<(), DeviceCaptureError> {
        for s in &sources {
            cap.capture(&s.hp, s.ptr(), s.rows, stream.handle())?;
        }
        Ok(())
    })
    .unwrap();

    let mut expected = Vec::new();
    for step in 0..STEPS {
        for s in &sources {
            let data = pattern_bytes(seed(step, s.hp.id()), s.bytes());
            s.buf.copy_from_host_async(s.offset as usize, &data, stream.handle()).unwrap();
        }
        let b = batch(step, MAX_ROWS);
        let valid = (b.len() as u32).saturating_sub(1).max(1);
        valid_rows.copy_from_host_async(0, &valid.to_le_bytes(), stream.handle()).unwrap();
        cap.begin_step(&reg, &b, stream.handle()).unwrap();
        graph.launch(stream.handle()).unwrap();
        for s in &sources {
            let v = (s.hp.id() == 5).then_some(valid);
            let rows = expected_rows(&s.hp.control().selection(), &b, v, s.rows);
            expected.push((step, s.hp.id(), rows, b.clone()));
        }
    }
    stream.synchronize().unwrap();
    ring.close_producer();
    let got = drain.join().unwrap();

    assert_eq!(ring.error_bits(), 0, "{}", errors::describe(ring.error_bits()));
    let expected: Vec<_> = expected.into_iter().filter(|(_, _, rows, _)| !rows.is_empty()).collect();
    assert_eq!(got.len(), expected.len());
    for (i, (g, (step, hp, rows, b))) in got.iter().zip(&expected).enumerate() {
        assert_eq!(g.seq, i as u64, "sequence numbers are contiguous");
        assert_eq!((g.step, g.hookpoint), (*step, *hp), "record {i}");
        let metas: Vec<RowMeta> = rows.iter().map(|&r| b.rows()[r as usize]).collect();
        assert_eq!(g.metas, metas, "row metadata of record {i} (step {step}, hookpoint {hp})");
        let s = &sources[*hp as usize];
        let rb = s.hp.spec().row_bytes() as usize;
        let src = pattern_bytes(seed(*step, *hp), s.bytes());
        for (k, &r) in rows.iter().enumerate() {
            assert!(g.rows[k] == src[r as usize * rb..(r as usize + 1) * rb], "row {k} of record {i} differs");
        }
    }
    // Device counters: every capture produced, every record published, nothing dropped.
    cap.fold_counters(&reg).unwrap();
    let acc = reg.accounting();
    let total = acc.total();
    assert_eq!(total.published.records, got.len() as u64);
    assert_eq!(total.produced, total.published);
    assert_eq!(total.dropped_total().records, 0);
}

/// Two 4-row bf16 hookpoints (16,512-byte records) into a 64 KiB ring, the drain not running: the kernels must
/// publish exactly what fits and count exactly what did not.
#[test]
#[ignore = "needs an NVIDIA GPU: run with --include-ignored on one"]
fn best_effort_drops_are_counted_exactly_while_the_drain_is_paused() {
    best_effort_drops_are_counted_exactly_while_the_drain_is_paused_with(false);
    best_effort_drops_are_counted_exactly_while_the_drain_is_paused_with(true);
}

fn best_effort_drops_are_counted_exactly_while_the_drain_is_paused_with(defer: bool) {
    let gpu = gpu();
    let capacity = 64 << 10;
    let ring = DeviceRing::new(&gpu, capacity).unwrap();
    let mut cap = DeviceCapture::new(&ring, DeviceCaptureOptions { defer, ..Default::default() }).unwrap();
    let consumer = DeviceConsumer::new(&ring, DrainTuning::default()).unwrap();
    let reg = Registry::new();
    let stream = Stream::new(&gpu).unwrap();
    let hps: Vec<_> = (0..2).map(|i| register(&reg, &format!("h{i}"), DType::BF16, 2048)).collect();
    let src = DeviceBuffer::zeroed(&gpu, 4 * 4096).unwrap();
    cap.fill_pattern(src.ptr(), 4 * 4096, 7, stream.handle()).unwrap();
    cap.begin_step(&reg, &StepBatch::new(0, (0..4).map(|i| (1, i))).unwrap(), stream.handle()).unwrap();
    let graph = Graph::capture(&stream, || -> Result<(), DeviceCaptureError> {
        for hp in &hps {
            cap.capture(hp, src.ptr(), 4, stream.handle())?;
        }
        cap.end_step()
    })
    .unwrap();
    const STEPS: u64 = 10;
    for step in 0..STEPS {
        cap.begin_step(&reg, &StepBatch::new(step, (0..4).map(|i| (1, i))).unwrap(), stream.handle()).unwrap();
        graph.launch(stream.handle()).unwrap();
    }
    stream.synchronize().unwrap();

    // The host model of the ring with nothing released.
    let footprint = 64 + 64 + 4 * 4096u64;
    let (mut head, mut published) = (0u64, 0u64);
    for _ in 0..STEPS * 2 {
        let offset = head % capacity as u64;
        let pad = if footprint <= capacity as u64 - offset { 0 } else { capacity as u64 - offset };
        if pad + footprint <= capacity as u64 - head {
            head += pad + footprint;
            published += 1;
        }
    }
    assert_eq!(ring.published(), head);
    cap.fold_counters(&reg).unwrap();
    let total = reg.accounting().total();
    assert_eq!(total.published.records, published);
    let full = total.dropped_for(ringscope_policy::DropReason::RingFull);
    assert_eq!((full.records, full.rows), (STEPS * 2 - published, (STEPS * 2 - published) * 4));

    ring.close_producer();
    let got = spawn_drain(consumer, Duration::ZERO).join().unwrap();
    assert_eq!(got.len() as u64, published);
    assert!(got.iter().enumerate().all(|(i, g)| g.seq == i as u64));
    assert_eq!(ring.error_bits(), 0);
}

/// Full mode with a drain that starts late: `begin_step` waits for room, nothing is lost.
#[test]
#[ignore = "needs an NVIDIA GPU: run with --include-ignored on one"]
fn full_mode_loses_nothing_when_the_drain_starts_late() {
    full_mode_loses_nothing_when_the_drain_starts_late_with(false);
    full_mode_loses_nothing_when_the_drain_starts_late_with(true);
}

fn full_mode_loses_nothing_when_the_drain_starts_late_with(defer: bool) {
    let gpu = gpu();
    let ring = DeviceRing::new(&gpu, 64 << 10).unwrap();
    let options =
        DeviceCaptureOptions { full_mode_deadline: Some(Duration::from_secs(30)), defer, ..Default::default() };
    let mut cap = DeviceCapture::new(&ring, options).unwrap();
    let consumer = DeviceConsumer::new(&ring, DrainTuning { chunk_bytes: 16 << 10, max_in_flight: 2 }).unwrap();
    let reg = Registry::new();
    let stream = Stream::new(&gpu).unwrap();
    let hps: Vec<_> = (0..2).map(|i| register(&reg, &format!("h{i}"), DType::BF16, 2048)).collect();
    let src = DeviceBuffer::zeroed(&gpu, 4 * 4096).unwrap();
    let b = |step| StepBatch::new(step, (0..4).map(|i| (9, i))).unwrap();
    cap.begin_step(&reg, &b(0), stream.handle()).unwrap();
    let graph = Graph::capture(&stream, || -> Result<(), DeviceCaptureError> {
        for hp in &hps {
            cap.capture(hp, src.ptr(), 4, stream.handle())?;
        }
        cap.end_step()
    })
    .unwrap();
    let drain = spawn_drain(consumer, Duration::from_millis(300));
    const STEPS: u64 = 40;
    for step in 0..STEPS {
        cap.fill_pattern(src.ptr(), 4 * 4096, step, stream.handle()).unwrap();
        cap.begin_step(&reg, &b(step), stream.handle()).unwrap();
        graph.launch(stream.handle()).unwrap();
    }
    stream.synchronize().unwrap();
    ring.close_producer();
    let got = drain.join().unwrap();
    assert_eq!(got.len() as u64, STEPS * 2);
    for (i, g) in got.iter().enumerate() {
        assert_eq!(g.seq, i as u64);
        let expect = pattern_bytes(g.step, 4 * 4096);
        assert!(g.rows.concat() == expect, "record {i} (step {}) differs", g.step);
    }
    cap.fold_counters(&reg).unwrap();
    let total = reg.accounting().total();
    assert_eq!(total.dropped_total().records, 0);
    assert_eq!(total.published.records, STEPS * 2);
    assert_eq!(ring.error_bits(), 0, "{}", errors::describe(ring.error_bits()));
}

/// Full mode with no drain at all: `begin_step` gives up at the deadline, and the step's captures are dropped and
/// counted as `deadline` on the device — never written over unread data.
#[test]
#[ignore = "needs an NVIDIA GPU: run with --include-ignored on one"]
fn full_mode_deadline_drops_whole_steps_and_counts_them() {
    full_mode_deadline_drops_whole_steps_and_counts_them_with(false);
    full_mode_deadline_drops_whole_steps_and_counts_them_with(true);
}

fn full_mode_deadline_drops_whole_steps_and_counts_them_with(defer: bool) {
    let gpu = gpu();
    let ring = DeviceRing::new(&gpu, 64 << 10).unwrap();
    let options =
        DeviceCaptureOptions { full_mode_deadline: Some(Duration::from_millis(50)), defer, ..Default::default() };
    let mut cap = DeviceCapture::new(&ring, options).unwrap();
    let consumer = DeviceConsumer::new(&ring, DrainTuning::default()).unwrap();
    let reg = Registry::new();
    let stream = Stream::new(&gpu).unwrap();
    let hp = register(&reg, "h", DType::BF16, 2048);
    let src = DeviceBuffer::zeroed(&gpu, 4 * 4096).unwrap();
    let b = |step| StepBatch::new(step, (0..4).map(|i| (9, i))).unwrap();
    let (mut ok, mut late) = (0u64, 0u64);
    for step in 0..8 {
        match cap.begin_step(&reg, &b(step), stream.handle()) {
            Ok(()) => ok += 1,
            Err(DeviceCaptureError::Deadline { step: s, .. }) => {
                assert_eq!(s, format!("step {step}"));
                late += 1;
            }
            Err(e) => panic!("{e}"),
        }
        cap.capture(&hp, src.ptr(), 4, stream.handle()).unwrap();
    }
    cap.end_step().unwrap();
    stream.synchronize().unwrap();
    // 64 KiB holds three 16.5 KiB records, but begin_step reserves a worst case (one wrap) of two per step.
    assert!(ok >= 1 && late >= 4, "ok {ok}, late {late}");
    cap.fold_counters(&reg).unwrap();
    let total = reg.accounting().total();
    assert_eq!(total.dropped_for(ringscope_policy::DropReason::Deadline).records, late);
    assert_eq!(total.published.records, ok);
    assert_eq!(ring.error_bits(), 0, "{}", errors::describe(ring.error_bits()));
    ring.close_producer();
    assert_eq!(spawn_drain(consumer, Duration::ZERO).join().unwrap().len() as u64, ok);
}

#[test]
#[ignore = "needs an NVIDIA GPU: run with --include-ignored on one"]
fn bad_arguments_are_clear_errors() {
    let gpu = gpu();
    let ring = DeviceRing::new(&gpu, 1 << 20).unwrap();
    let mut cap = DeviceCapture::new(&ring, DeviceCaptureOptions::default()).unwrap();
    let reg = Registry::new();
    let stream = Stream::new(&gpu).unwrap();
    let hp = register(&reg, "h", DType::BF16, 2048);
    let src = DeviceBuffer::zeroed(&gpu, 64 * 4096).unwrap();
    let msg = |r: Result<(), DeviceCaptureError>| r.unwrap_err().to_string();

    let early = msg(cap.capture(&hp, src.ptr(), 1, stream.handle()));
    assert!(early.contains("before the first begin_step"), "{early}");
    cap.begin_step(&reg, &StepBatch::new(0, [(1, 0)]).unwrap(), stream.handle()).unwrap();

    let null = msg(cap.capture(&hp, DevicePtr::NULL, 1, stream.handle()));
    assert!(null.contains("null device pointer"), "{null}");
    let misaligned = msg(cap.capture(&hp, src.ptr_at(1), 1, stream.handle()));
    assert!(misaligned.contains("not aligned"), "{misaligned}");
    let host = vec![0u8; 4096];
    // SAFETY: host memory, which the runtime check must reject before anything is launched.
    let host_ptr = unsafe { DevicePtr::from_raw(host.as_ptr() as u64) };
    let not_device = msg(cap.capture(&hp, host_ptr, 1, stream.handle()));
    assert!(not_device.contains("not CUDA device memory"), "{not_device}");
    let past_end = msg(cap.capture(&hp, src.ptr_at(4096), 64, stream.handle()));
    assert!(past_end.contains("past the end of its allocation"), "{past_end}");
    let too_large = msg(cap.capture(&hp, src.ptr(), 64 + 64, stream.handle()));
    assert!(too_large.contains("max_batch_rows") || too_large.contains("past the end"), "{too_large}");
    let big = DeviceBuffer::zeroed(&gpu, 200 * 4096).unwrap();
    let over_ring = msg(cap.capture(&hp, big.ptr(), 200, stream.handle()));
    assert!(over_ring.contains("raise ring.capacity"), "{over_ring}");

    // A stream of another context.
    let foreign = ForeignStream::new(0).unwrap();
    gpu.bind().unwrap();
    let wrong_stream = msg(cap.capture(&hp, src.ptr(), 1, foreign.handle()));
    assert!(wrong_stream.contains("another CUDA context"), "{wrong_stream}");

    // begin_step inside a graph capture.
    let during = Graph::capture(&stream, || -> Result<(), DeviceCaptureError> {
        cap.begin_step(&reg, &StepBatch::new(1, [(1, 0)]).unwrap(), stream.handle())
    });
    let during = during.unwrap_err().to_string();
    assert!(during.contains("outside the graph"), "{during}");

    // A hookpoint registered after the last begin_step.
    let late = register(&reg, "late", DType::BF16, 2048);
    let late_msg = msg(cap.capture(&late, src.ptr(), 1, stream.handle()));
    assert!(late_msg.contains("next begin_step"), "{late_msg}");

    // Nothing bad reached the ring.
    stream.synchronize().unwrap();
    assert_eq!(ring.published(), 0);
    assert!(matches!(DeviceRing::new(&gpu, 1000), Err(CudaError::Invalid(_))));
}

/// Bad input to graph-begun steps, deferred captures and `apply_controls`: each a clear error naming what was wrong,
/// and nothing reaches the ring.
#[test]
#[ignore = "needs an NVIDIA GPU: run with --include-ignored on one"]
fn graph_steps_and_deferred_captures_reject_bad_input() {
    let gpu = gpu();
    let ring = DeviceRing::new(&gpu, 1 << 20).unwrap();
    let options = DeviceCaptureOptions { defer: true, max_batch_rows: 16, ..Default::default() };
    let mut cap = DeviceCapture::new(&ring, options).unwrap();
    let reg = Registry::new();
    let stream = Stream::new(&gpu).unwrap();
    let other_stream = Stream::new(&gpu).unwrap();
    let hp = register(&reg, "h", DType::BF16, 64);
    let req = DeviceBuffer::zeroed(&gpu, 8 * 8).unwrap(); // room for 8 batch rows' ids
    let pos = DeviceBuffer::zeroed(&gpu, 4 * 8).unwrap(); // 4 positions
    let src = DeviceBuffer::zeroed(&gpu, 16 * 128).unwrap();
    let good = graph_batch(&req, &pos, 4, 1);
    let msg = |r: Result<(), DeviceCaptureError>| r.unwrap_err().to_string();
    cap.apply_controls(&reg, stream.handle()).unwrap();

    let empty = msg(cap.begin_step_graph(&reg, &GraphBatch { batch: 0, ..good }, stream.handle()));
    assert!(empty.contains("max_batch_rows (16)"), "{empty}");
    let too_many = msg(cap.begin_step_graph(&reg, &GraphBatch { batch: 4, seq: 5, ..good }, stream.handle()));
    assert!(too_many.contains("4 × 5 rows") && too_many.contains("max_batch_rows (16)"), "{too_many}");
    let null_ids =
        msg(cap.begin_step_graph(&reg, &GraphBatch { request_ids: DevicePtr::NULL, ..good }, stream.handle()));
    assert!(null_ids.contains("request ids") && null_ids.contains("null device pointer"), "{null_ids}");
    let host = [0i64; 4];
    // SAFETY: host memory, which the runtime check must reject before anything is launched.
    let host_ptr = unsafe { DevicePtr::from_raw(host.as_ptr() as u64) };
    let host_pos = msg(cap.begin_step_graph(&reg, &GraphBatch { positions: host_ptr, ..good }, stream.handle()));
    assert!(host_pos.contains("positions") && host_pos.contains("not CUDA device memory"), "{host_pos}");
    // Positions of 8 batch rows read past the end of a 4-element tensor.
    let short = msg(cap.begin_step_graph(&reg, &GraphBatch { batch: 8, ..good }, stream.handle()));
    assert!(short.contains("positions") && short.contains("past the end"), "{short}");
    // Kept rows: one token per batch row, and room for the count and a row per batch row (4 + 1 words here).
    let kept = DeviceBuffer::zeroed(&gpu, 4 * 4).unwrap();
    let kept_seq = GraphBatch { seq: 2, kept: Some(kept.ptr()), ..graph_batch(&req, &pos, 2, 2) };
    let kept_seq = msg(cap.begin_step_graph(&reg, &kept_seq, stream.handle()));
    assert!(kept_seq.contains("kept rows with 2 tokens per batch row"), "{kept_seq}");
    let kept_null =
        msg(cap.begin_step_graph(&reg, &GraphBatch { kept: Some(DevicePtr::NULL), ..good }, stream.handle()));
    assert!(kept_null.contains("kept rows") && kept_null.contains("null device pointer"), "{kept_null}");
    let kept_short = msg(cap.begin_step_graph(&reg, &GraphBatch { kept: Some(kept.ptr()), ..good }, stream.handle()));
    assert!(kept_short.contains("kept rows") && kept_short.contains("past the end"), "{kept_short}");
    let foreign = ForeignStream::new(0).unwrap();
    gpu.bind().unwrap();
    let wrong_ctx = msg(cap.begin_step_graph(&reg, &good, foreign.handle()));
    assert!(wrong_ctx.contains("another CUDA context"), "{wrong_ctx}");

    // A deferred capture must be issued on its step's stream (the step's one kernel runs there).
    cap.begin_step_graph(&reg, &good, stream.handle()).unwrap();
    let elsewhere = msg(cap.capture(&hp, src.ptr(), 4, other_stream.handle()));
    assert!(elsewhere.contains("deferred captures must be issued on the stream their step began on"), "{elsewhere}");
    cap.end_step().unwrap();

    // apply_controls while the stream records a graph.
    let during = Graph::capture(&stream, || cap.apply_controls(&reg, stream.handle()));
    let during = during.unwrap_err().to_string();
    assert!(during.contains("while the stream is capturing a CUDA graph"), "{during}");

    stream.synchronize().unwrap();
    assert_eq!(ring.published(), 0, "nothing bad may reach the ring");
}

/// Steps begun inside the graph (batch descriptor from device tensors, step numbers from the device), captures
/// deferred (two copied early on a side stream with `submit`, the third at the step's end): every record bit-exact, steps numbered by the device, control changes
/// applied between replays, and host-begun and graph-begun steps numbered in one sequence.
#[test]
#[ignore = "needs an NVIDIA GPU: run with --include-ignored on one"]
fn graph_begun_steps_with_deferred_captures_are_bit_exact() {
    graph_begun_steps(true);
}

/// The same with one capture kernel per hookpoint (and the descriptor kernel recorded at the step's start).
#[test]
#[ignore = "needs an NVIDIA GPU: run with --include-ignored on one"]
fn graph_begun_steps_with_immediate_captures_are_bit_exact() {
    graph_begun_steps(false);
}

fn graph_begun_steps(defer: bool) {
    let gpu = gpu();
    const BATCH: u32 = 3;
    const SEQ: u32 = 2;
    const STEPS: u64 = 30;
    let ring = DeviceRing::new(&gpu, 8 << 20).unwrap();
    let options = DeviceCaptureOptions { max_batch_rows: 64, defer, ..Default::default() };
    let mut cap = DeviceCapture::new(&ring, options).unwrap();
    let consumer = DeviceConsumer::new(&ring, DrainTuning { chunk_bytes: 64 << 10, max_in_flight: 4 }).unwrap();
    let reg = Registry::new();
    let stream = Stream::new(&gpu).unwrap();
    let rows = BATCH * SEQ;
    let specs: [(&str, DType, u32, RowSelection); 3] = [
        ("resid", DType::BF16, 2048, RowSelection::All),
        ("last", DType::F32, 256, RowSelection::LastPerRequest),
        ("list", DType::BF16, 64, RowSelection::Rows(vec![4, 0])),
    ];
    let mut sources = Vec::new();
    for (name, dtype, width, sel) in specs.iter().cloned() {
        let hp = register(&reg, name, dtype, width);
        hp.control().set_selection(sel).unwrap();
        let bytes = rows as usize * hp.spec().row_bytes() as usize;
        sources.push(Source { hp, buf: DeviceBuffer::zeroed(&gpu, bytes).unwrap(), offset: 0, rows });
    }
    cap.apply_controls(&reg, stream.handle()).unwrap();
    let req = DeviceBuffer::zeroed(&gpu, BATCH as usize * 8).unwrap();
    let pos = DeviceBuffer::zeroed(&gpu, rows as usize * 8).unwrap();
    let gb = graph_batch(&req, &pos, BATCH, SEQ);

    // Misuse first: a stride shorter than a row, full mode, controls changed since they were applied.
    let bad = GraphBatch { positions_batch_stride: 1, ..gb };
    assert!(cap.begin_step_graph(&reg, &bad, stream.handle()).unwrap_err().to_string().contains("stride"));
    let full_ring = DeviceRing::new(&gpu, 1 << 20).unwrap();
    let full = DeviceCaptureOptions { full_mode_deadline: Some(Duration::from_millis(10)), ..Default::default() };
    let mut full_cap = DeviceCapture::new(&full_ring, full).unwrap();
    let err = full_cap.admit_graph_step(&reg, None, stream.handle()).unwrap_err();
    assert!(err.to_string().contains("no step begun inside a graph has been recorded"), "{err}");
    let err = full_cap.admit_graph_step(&reg, Some(0), stream.handle()).unwrap_err();
    assert!(err.to_string().contains("at least 1"), "{err}");
    let err = full_cap.admit_graph_step(&reg, Some(1 << 20), stream.handle()).unwrap_err();
    assert!(err.to_string().contains("max_batch_rows"), "{err}");
    let err = Graph::capture(&stream, || full_cap.admit_graph_step(&reg, Some(4), stream.handle())).unwrap_err();
    assert!(err.to_string().contains("capturing"), "{err}");
    drop(full_cap);
    // Best-effort: nothing to admit.
    cap.admit_graph_step(&reg, None, stream.handle()).unwrap();
    sources[0].hp.control().set_enabled(true);
    let err = Graph::capture(&stream, || cap.begin_step_graph(&reg, &gb, stream.handle())).unwrap_err();
    assert!(err.to_string().contains("apply_controls"), "{err}");
    cap.apply_controls(&reg, stream.handle()).unwrap();

    let drain = spawn_drain(consumer, Duration::ZERO);
    let graph = Graph::capture(&stream, || -> Result<(), DeviceCaptureError> {
        cap.begin_step_graph(&reg, &gb, stream.handle())?;
        for (k, s) in sources.iter().enumerate() {
            cap.capture(&s.hp, s.ptr(), s.rows, stream.handle())?;
            if k == 1 {
                // Deferred: the first two are copied now on the side stream, the third when the step ends.
                cap.submit()?;
            }
        }
        cap.end_step()
    })
    .unwrap();

    let batch_of = |step: u64| {
        let ids: Vec<u64> = (0..BATCH as u64).map(|b| 500 + step * 10 + b).collect();
        let positions: Vec<u32> = (0..rows).map(|r| step as u32 * 100 + r).collect();
        (ids, positions)
    };
    let mut expected = Vec::new();
    let run_step = |step: u64, expected: &mut Vec<(u64, u32, Vec<u32>, Vec<RowMeta>)>| {
        for s in &sources {
            let data = pattern_bytes(seed(step, s.hp.id()), s.bytes());
            s.buf.copy_from_host_async(0, &data, stream.handle()).unwrap();
        }
        let (ids, positions) = batch_of(step);
        let ids_bytes: Vec<u8> = ids.iter().flat_map(|v| v.to_le_bytes()).collect();
        let pos_bytes: Vec<u8> = positions.iter().flat_map(|&v| (v as i64).to_le_bytes()).collect();
        req.copy_from_host_async(0, &ids_bytes, stream.handle()).unwrap();
        pos.copy_from_host_async(0, &pos_bytes, stream.handle()).unwrap();
        graph.launch(stream.handle()).unwrap();
        let metas: Vec<RowMeta> = (0..rows)
            .map(|r| RowMeta { request_id: ids[(r / SEQ) as usize], position: positions[r as usize], batch_row: r })
            .collect();
        for s in &sources {
            if !s.hp.control().enabled() {
                continue;
            }
            let keep: Vec<u32> = match &*s.hp.control().selection() {
                RowSelection::All => (0..rows).collect(),
                RowSelection::LastPerRequest => (0..BATCH).map(|b| b * SEQ + SEQ - 1).collect(),
                RowSelection::Rows(l) => l.clone(),
            };
            let m = keep.iter().map(|&r| metas[r as usize]).collect();
            expected.push((step, s.hp.id(), keep, m));
        }
    };
    for step in 0..STEPS {
        if step == 10 || step == 20 {
            // Control changes between replays reach the graph through the control image.
            stream.synchronize().unwrap();
            sources[2].hp.control().set_enabled(step == 20);
            sources[0]
                .hp
                .control()
                .set_selection(if step == 10 { RowSelection::Rows(vec![5, 1]) } else { RowSelection::All })
                .unwrap();
            cap.apply_controls(&reg, stream.handle()).unwrap();
        }
        run_step(step, &mut expected);
    }
    // A step begun on the host numbers the graph's next steps after it.
    stream.synchronize().unwrap();
    let host_step = StepBatch::new(1000, (0..rows).map(|r| (7, r))).unwrap();
    cap.begin_step(&reg, &host_step, stream.handle()).unwrap();
    cap.end_step().unwrap();
    run_step(1001, &mut expected);
    stream.synchronize().unwrap();
    ring.close_producer();
    let got = drain.join().unwrap();

    assert_eq!(ring.error_bits(), 0, "{}", errors::describe(ring.error_bits()));
    assert_eq!(got.len(), expected.len());
    for (i, (g, (step, hp, keep, metas))) in got.iter().zip(&expected).enumerate() {
        assert_eq!(g.seq, i as u64, "sequence numbers are contiguous");
        assert_eq!((g.step, g.hookpoint), (*step, *hp), "record {i}");
        assert_eq!(&g.metas, metas, "row metadata of record {i} (step {step}, hookpoint {hp})");
        let s = &sources[*hp as usize];
        let rb = s.hp.spec().row_bytes() as usize;
        let src = pattern_bytes(seed(*step, *hp), s.bytes());
        for (k, &r) in keep.iter().enumerate() {
            assert!(g.rows[k] == src[r as usize * rb..(r as usize + 1) * rb], "row {k} of record {i} differs");
        }
    }
    cap.fold_counters(&reg).unwrap();
    let total = reg.accounting().total();
    assert_eq!(total.published.records, got.len() as u64);
    assert_eq!(total.dropped_total().records, 0);
}

/// Full mode with steps begun inside a graph: `admit_graph_step` before every replay makes each replay wait for ring
/// space on the host (the replay itself cannot), so a ring of one step and a drain that starts 300 ms late lose
/// nothing: every record arrives bit-exact, in order, with device-numbered steps; two eager `begin_step_graph` steps
/// first (each admits itself), then replays.
#[test]
#[ignore = "needs an NVIDIA GPU: run with --include-ignored on one"]
fn full_mode_graph_begun_steps_lose_nothing_when_the_drain_starts_late() {
    full_mode_graph_begun_steps_lose_nothing_with(true);
    full_mode_graph_begun_steps_lose_nothing_with(false);
}

fn full_mode_graph_begun_steps_lose_nothing_with(defer: bool) {
    let gpu = gpu();
    const BATCH: u32 = 4;
    const STEPS: u64 = 40;
    const EAGER: u64 = 2;
    let ring = DeviceRing::new(&gpu, 64 << 10).unwrap();
    let options = DeviceCaptureOptions {
        max_batch_rows: 64,
        full_mode_deadline: Some(Duration::from_secs(30)),
        defer,
        ..Default::default()
    };
    let mut cap = DeviceCapture::new(&ring, options).unwrap();
    let consumer = DeviceConsumer::new(&ring, DrainTuning { chunk_bytes: 16 << 10, max_in_flight: 2 }).unwrap();
    let reg = Registry::new();
    let stream = Stream::new(&gpu).unwrap();
    // Two hookpoints of 4 rows x 4 KiB: 16.5 KiB records; a step's worst case (with a wrap) is 49.5 KiB of 64.
    let hps: Vec<_> = (0..2).map(|i| register(&reg, &format!("h{i}"), DType::BF16, 2048)).collect();
    cap.apply_controls(&reg, stream.handle()).unwrap();
    let src = DeviceBuffer::zeroed(&gpu, 2 * 4 * 4096).unwrap();
    let req = DeviceBuffer::zeroed(&gpu, BATCH as usize * 8).unwrap();
    let pos = DeviceBuffer::zeroed(&gpu, BATCH as usize * 8).unwrap();
    let gb = graph_batch(&req, &pos, BATCH, 1);
    let step_body = |cap: &mut DeviceCapture| -> Result<(), DeviceCaptureError> {
        cap.begin_step_graph(&reg, &gb, stream.handle())?;
        for (k, hp) in hps.iter().enumerate() {
            cap.capture(hp, src.ptr_at(k * 4 * 4096), 4, stream.handle())?;
        }
        cap.end_step()
    };
    let set_batch = |step: u64| {
        let ids: Vec<u8> = (0..BATCH as u64).flat_map(|b| (700 + step * 10 + b).to_le_bytes()).collect();
        let p: Vec<u8> = (0..BATCH as i64).flat_map(|b| (step as i64 * 100 + b).to_le_bytes()).collect();
        req.copy_from_host_async(0, &ids, stream.handle()).unwrap();
        pos.copy_from_host_async(0, &p, stream.handle()).unwrap();
    };
    let drain = spawn_drain(consumer, Duration::from_millis(300));
    for step in 0..EAGER {
        cap.fill_pattern(src.ptr(), 2 * 4 * 4096, step, stream.handle()).unwrap();
        set_batch(step);
        step_body(&mut cap).unwrap();
    }
    let graph = Graph::capture(&stream, || step_body(&mut cap)).unwrap();
    for step in EAGER..STEPS {
        cap.fill_pattern(src.ptr(), 2 * 4 * 4096, step, stream.handle()).unwrap();
        set_batch(step);
        cap.admit_graph_step(&reg, None, stream.handle()).unwrap();
        graph.launch(stream.handle()).unwrap();
    }
    stream.synchronize().unwrap();
    assert_eq!(ring.graph_begun(), STEPS, "the device counted every graph-begun step");
    ring.close_producer();
    let got = drain.join().unwrap();
    assert_eq!(ring.error_bits(), 0, "{}", errors::describe(ring.error_bits()));
    assert_eq!(got.len() as u64, STEPS * 2);
    for (i, g) in got.iter().enumerate() {
        let step = i as u64 / 2;
        assert_eq!((g.seq, g.step, g.hookpoint), (i as u64, step, hps[i % 2].id()), "record {i}");
        let all = pattern_bytes(step, 2 * 4 * 4096);
        let expect = &all[(i % 2) * 4 * 4096..(i % 2 + 1) * 4 * 4096];
        assert!(g.rows.concat() == expect, "record {i} (step {step}) differs");
        let metas: Vec<RowMeta> = (0..BATCH)
            .map(|b| RowMeta { request_id: 700 + step * 10 + b as u64, position: step as u32 * 100 + b, batch_row: b })
            .collect();
        assert_eq!(g.metas, metas, "record {i}");
    }
    cap.fold_counters(&reg).unwrap();
    let total = reg.accounting().total();
    assert_eq!(total.dropped_total().records, 0);
    assert_eq!(total.published.records, STEPS * 2);
}

/// Rows of ended sequences in graph-begun steps ([`EndedRows`]): at every replay, a batch row whose token (read
/// through a row stride) is one of the ended ids is captured with request id `NO_REQUEST`, the others keep theirs —
/// decided by the begin kernel (immediate captures) or the deferred captures' one kernel, as the tokens change
/// between replays; also for a step of two tokens per row (each of its rows follows its batch row's token).
#[test]
#[ignore = "needs an NVIDIA GPU: run with --include-ignored on one"]
fn graph_begun_steps_mark_rows_of_ended_sequences_as_no_request() {
    for defer in [false, true] {
        for seq in [1u32, 2] {
            graph_begun_ended_rows_with(defer, seq);
        }
    }
}

fn graph_begun_ended_rows_with(defer: bool, seq: u32) {
    let gpu = gpu();
    const BATCH: u32 = 4;
    const ENDED: [i64; 3] = [2, 128_009, -5];
    let ring = DeviceRing::new(&gpu, 1 << 20).unwrap();
    let options = DeviceCaptureOptions { max_batch_rows: 64, defer, ..Default::default() };
    let mut cap = DeviceCapture::new(&ring, options).unwrap();
    let consumer = DeviceConsumer::new(&ring, DrainTuning::default()).unwrap();
    let reg = Registry::new();
    let stream = Stream::new(&gpu).unwrap();
    let hp = register(&reg, "h", DType::BF16, 8);
    cap.apply_controls(&reg, stream.handle()).unwrap();
    let rows = (BATCH * seq) as usize;
    let src = DeviceBuffer::zeroed(&gpu, rows * 16).unwrap();
    let req = DeviceBuffer::zeroed(&gpu, BATCH as usize * 8).unwrap();
    let pos = DeviceBuffer::zeroed(&gpu, rows * 8).unwrap();
    // The tokens as a [BATCH, 3] tensor whose column 1 is the step's token: a row stride of 3, an offset of 1.
    let tok = DeviceBuffer::zeroed(&gpu, BATCH as usize * 3 * 8).unwrap();
    let ended = EndedRows::new(tok.ptr_at(8), 3, &ENDED).unwrap();
    let gb = GraphBatch { ended: Some(ended), ..graph_batch(&req, &pos, BATCH, seq) };
    let drain = spawn_drain(consumer, Duration::ZERO);
    let graph = Graph::capture(&stream, || -> Result<(), DeviceCaptureError> {
        cap.begin_step_graph(&reg, &gb, stream.handle())?;
        cap.capture(&hp, src.ptr(), BATCH * seq, stream.handle())?;
        cap.end_step()
    })
    .unwrap();
    // Per replay, the token of each batch row (column 1; columns 0 and 2 hold ended ids, never read).
    let tokens: [[i64; BATCH as usize]; 4] = [[7, 8, 9, 10], [2, 8, 9, 10], [2, 128_009, 9, -5], [11, 12, 13, 14]];
    for (step, t) in tokens.iter().enumerate() {
        let ids: Vec<u8> = (0..BATCH as u64).flat_map(|b| (500 + b).to_le_bytes()).collect();
        let p: Vec<u8> = (0..rows as i64).flat_map(|r| (step as i64 * 10 + r).to_le_bytes()).collect();
        let tk: Vec<u8> = t.iter().flat_map(|&x| [2i64, x, 128_009].into_iter().flat_map(i64::to_le_bytes)).collect();
        req.copy_from_host_async(0, &ids, stream.handle()).unwrap();
        pos.copy_from_host_async(0, &p, stream.handle()).unwrap();
        tok.copy_from_host_async(0, &tk, stream.handle()).unwrap();
        graph.launch(stream.handle()).unwrap();
    }
    stream.synchronize().unwrap();
    ring.close_producer();
    let got = drain.join().unwrap();
    assert_eq!(ring.error_bits(), 0, "{}", errors::describe(ring.error_bits()));
    assert_eq!(got.len(), tokens.len(), "defer {defer}, seq {seq}");
    for (step, (g, t)) in got.iter().zip(&tokens).enumerate() {
        let metas: Vec<RowMeta> = (0..rows as u32)
            .map(|r| {
                let b = r / seq;
                let request_id = if ENDED.contains(&t[b as usize]) { RowMeta::NO_REQUEST } else { 500 + b as u64 };
                RowMeta { request_id, position: step as u32 * 10 + r, batch_row: r }
            })
            .collect();
        assert_eq!(g.metas, metas, "defer {defer}, seq {seq}, replay {step}");
    }
}

/// Full mode, graph-begun steps, no drain for a while: admissions past the deadline return `Deadline`, and exactly
/// those replays' captures are dropped and counted as `deadline` on the device; once the drain runs, admissions find
/// room again and the replays after them are captured whole (the device's graph step flags follow each admission).
#[test]
#[ignore = "needs an NVIDIA GPU: run with --include-ignored on one"]
fn full_mode_graph_begun_deadline_drops_exactly_the_late_replays() {
    full_mode_graph_begun_deadline_with(true);
    full_mode_graph_begun_deadline_with(false);
}

fn full_mode_graph_begun_deadline_with(defer: bool) {
    let gpu = gpu();
    let ring = DeviceRing::new(&gpu, 64 << 10).unwrap();
    let options = DeviceCaptureOptions {
        max_batch_rows: 64,
        full_mode_deadline: Some(Duration::from_millis(50)),
        defer,
        ..Default::default()
    };
    let mut cap = DeviceCapture::new(&ring, options).unwrap();
    let consumer = DeviceConsumer::new(&ring, DrainTuning::default()).unwrap();
    let reg = Registry::new();
    let stream = Stream::new(&gpu).unwrap();
    let hp = register(&reg, "h", DType::BF16, 2048);
    cap.apply_controls(&reg, stream.handle()).unwrap();
    let src = DeviceBuffer::zeroed(&gpu, 4 * 4096).unwrap();
    let req = DeviceBuffer::zeroed(&gpu, 4 * 8).unwrap();
    let pos = DeviceBuffer::zeroed(&gpu, 4 * 8).unwrap();
    let gb = graph_batch(&req, &pos, 4, 1);
    let graph = Graph::capture(&stream, || -> Result<(), DeviceCaptureError> {
        cap.begin_step_graph(&reg, &gb, stream.handle())?;
        cap.capture(&hp, src.ptr(), 4, stream.handle())?;
        cap.end_step()
    })
    .unwrap();
    // Replay i is device step i; which replays were admitted in time.
    let mut admitted = Vec::new();
    let replay = |cap: &mut DeviceCapture, i: u64, admitted: &mut Vec<bool>| {
        cap.fill_pattern(src.ptr(), 4 * 4096, i, stream.handle()).unwrap();
        match cap.admit_graph_step(&reg, None, stream.handle()) {
            Ok(()) => admitted.push(true),
            Err(DeviceCaptureError::Deadline { step, .. }) => {
                assert!(step.contains("graph-begun step"), "{step}");
                admitted.push(false);
            }
            Err(e) => panic!("{e}"),
        }
        graph.launch(stream.handle()).unwrap();
    };
    for i in 0..8 {
        replay(&mut cap, i, &mut admitted);
    }
    stream.synchronize().unwrap();
    let late = admitted.iter().filter(|a| !**a).count() as u64;
    // 64 KiB holds three 16.5 KiB records, but a step reserves a worst case (one wrap) of two.
    assert!(late >= 4, "{admitted:?}");
    let drain = spawn_drain(consumer, Duration::ZERO);
    cap.set_full_mode_deadline(Duration::from_secs(10));
    for i in 8..16 {
        replay(&mut cap, i, &mut admitted);
    }
    stream.synchronize().unwrap();
    assert!(admitted[8..].iter().all(|a| *a), "with the drain running every admission finds room: {admitted:?}");
    ring.close_producer();
    let got = drain.join().unwrap();
    assert_eq!(ring.error_bits(), 0, "{}", errors::describe(ring.error_bits()));
    let kept: Vec<u64> = (0..16u64).filter(|&i| admitted[i as usize]).collect();
    assert_eq!(got.iter().map(|g| g.step).collect::<Vec<_>>(), kept, "exactly the admitted replays are captured");
    for g in &got {
        assert!(g.rows.concat() == pattern_bytes(g.step, 4 * 4096), "step {} differs", g.step);
    }
    cap.fold_counters(&reg).unwrap();
    let total = reg.accounting().total();
    assert_eq!(total.dropped_for(ringscope_policy::DropReason::Deadline).records, late);
    assert_eq!(total.published.records, kept.len() as u64);
    assert_eq!(total.dropped_total().records, late);
}

/// Source rows for the downcast tests: on even steps the pattern's raw bits (NaN, infinities, subnormals, huge and
/// tiny magnitudes in one row), on odd steps activation-like values (a smooth signal with a few outliers, some
/// zeros and a negative zero), in the hookpoint's dtype.
fn downcast_source(step: u64, hp: &HookPoint, rows: u32) -> Vec<u8> {
    let spec = hp.spec();
    let bytes = rows as usize * spec.row_bytes() as usize;
    if step.is_multiple_of(2) {
        return pattern_bytes(seed(step, hp.id()), bytes);
    }
    let n = rows as usize * spec.row_width as usize;
    let value = |i: usize| -> f32 {
        match i % 97 {
            0 => 0.0,
            1 => -0.0,
            2 => 300.0 * (1.0 + step as f32),
            _ => ((i as f32) * 0.37 + step as f32).sin() * (1.0 + (i % 13) as f32) * 0.01,
        }
    };
    (0..n)
        .flat_map(|i| match spec.dtype {
            DType::F32 | DType::F16 | DType::BF16 => encode_float(spec.dtype, value(i)),
            _ => (i as u32 * 2_654_435_761).to_le_bytes()[..spec.dtype.size()].to_vec(),
        })
        .collect()
}

/// `v` as the bytes of one element of the float dtype `dtype` (round to nearest).
fn encode_float(dtype: DType, v: f32) -> Vec<u8> {
    match dtype {
        DType::F32 => v.to_le_bytes().to_vec(),
        DType::F16 => half::f16::from_f32(v).to_bits().to_le_bytes().to_vec(),
        DType::BF16 => half::bf16::from_f32(v).to_bits().to_le_bytes().to_vec(),
        _ => panic!("{dtype} is not a float dtype"),
    }
}

/// The elements of a row of the float dtype `dtype`, exactly, as f64.
fn decode_floats(dtype: DType, bytes: &[u8]) -> Vec<f64> {
    bytes
        .chunks_exact(dtype.size())
        .map(|b| match dtype {
            DType::F32 => f32::from_le_bytes(b.try_into().unwrap()) as f64,
            DType::F16 => half::f16::from_bits(u16::from_le_bytes(b.try_into().unwrap())).to_f64(),
            DType::BF16 => half::bf16::from_bits(u16::from_le_bytes(b.try_into().unwrap())).to_f64(),
            _ => panic!("{dtype} is not a float dtype"),
        })
        .collect()
}

/// Downcast on the device: a recorded graph of captures replayed while the downcast control is turned on and off
/// between replays (no re-recording). Every downcast row must be byte for byte what the host converter
/// (`ringscope_ring::rowscaled::encode_row`) makes of the source row — bf16, f16 and f32 sources, every row
/// selection — and every other row the source's bytes; the records say which in their dtype.
#[test]
#[ignore = "needs an NVIDIA GPU: run with --include-ignored on one"]
fn downcast_rows_match_the_host_converter_and_follow_the_control_between_replays() {
    downcast_rows_on_the_device(false);
}

/// The same through the deferred capture kernel (`ringscope_capture_many`), in full mode (admission sizes steps
/// by the rows the kernels write: downcast rows are `row_width + 4` bytes).
#[test]
#[ignore = "needs an NVIDIA GPU: run with --include-ignored on one"]
fn deferred_downcast_rows_match_the_host_converter_in_full_mode() {
    downcast_rows_on_the_device(true);
}

fn downcast_rows_on_the_device(defer: bool) {
    let gpu = gpu();
    const MAX_ROWS: u32 = 8;
    const STEPS: u64 = 40;
    let ring = DeviceRing::new(&gpu, 16 << 20).unwrap();
    let full_mode_deadline = defer.then_some(Duration::from_secs(10));
    let options = DeviceCaptureOptions { max_batch_rows: 64, defer, full_mode_deadline, ..Default::default() };
    let mut cap = DeviceCapture::new(&ring, options).unwrap();
    let consumer = DeviceConsumer::new(&ring, DrainTuning { chunk_bytes: 64 << 10, max_in_flight: 4 }).unwrap();
    let reg = Registry::new();
    let stream = Stream::new(&gpu).unwrap();
    let specs: [(&str, DType, u32, RowSelection, u64); 5] = [
        ("resid", DType::BF16, 2048, RowSelection::All, 0),
        ("attn", DType::F32, 1000, RowSelection::LastPerRequest, 0),
        ("odd", DType::F16, 7, RowSelection::All, 2),
        ("list", DType::BF16, 33, RowSelection::Rows(vec![3, 0, 5]), 0),
        ("ids", DType::I32, 16, RowSelection::All, 0),
    ];
    let mut sources = Vec::new();
    for (name, dtype, width, sel, offset) in specs.iter().cloned() {
        let hp = register(&reg, name, dtype, width);
        hp.control().set_selection(sel).unwrap();
        let bytes = MAX_ROWS as usize * hp.spec().row_bytes() as usize + 16;
        sources.push(Source { hp, buf: DeviceBuffer::zeroed(&gpu, bytes).unwrap(), offset, rows: MAX_ROWS });
    }
    let err = sources[4].hp.control().set_downcast(true).unwrap_err().to_string();
    assert!(err.contains("`ids`") && err.contains("i32"), "{err}");

    let drain = spawn_drain(consumer, Duration::ZERO);
    cap.begin_step(&reg, &batch(0, MAX_ROWS), stream.handle()).unwrap();
    let graph = Graph::capture(&stream, || -> Result<(), DeviceCaptureError> {
        for s in &sources {
            cap.capture(&s.hp, s.ptr(), s.rows, stream.handle())?;
        }
        cap.end_step()
    })
    .unwrap();

    // Which hookpoints downcast, by step: none, then all floats, then all but `attn`, then none again.
    let downcast_at = |step: u64, hp: u32| match step {
        10..20 => hp < 4,
        20..30 => hp < 4 && hp != 1,
        _ => false,
    };
    let mut expected = Vec::new();
    for step in 0..STEPS {
        if step % 10 == 0 {
            // Between replays, as a policy manager would: only the control changes, the graph stays as recorded.
            for s in &sources[..4] {
                s.hp.control().set_downcast(downcast_at(step, s.hp.id())).unwrap();
            }
        }
        for s in &sources {
            s.buf
                .copy_from_host_async(s.offset as usize, &downcast_source(step, &s.hp, s.rows), stream.handle())
                .unwrap();
        }
        let b = batch(step, MAX_ROWS);
        cap.begin_step(&reg, &b, stream.handle()).unwrap();
        graph.launch(stream.handle()).unwrap();
        for s in &sources {
            let rows = expected_rows(&s.hp.control().selection(), &b, None, s.rows);
            expected.push((step, s.hp.id(), rows, b.clone()));
        }
    }
    stream.synchronize().unwrap();
    ring.close_producer();
    let got = drain.join().unwrap();

    assert_eq!(ring.error_bits(), 0, "{}", errors::describe(ring.error_bits()));
    let expected: Vec<_> = expected.into_iter().filter(|(_, _, rows, _)| !rows.is_empty()).collect();
    assert_eq!(got.len(), expected.len());
    let mut downcast_records = 0;
    for (i, (g, (step, hp, rows, b))) in got.iter().zip(&expected).enumerate() {
        assert_eq!(g.seq, i as u64, "sequence numbers are contiguous");
        assert_eq!((g.step, g.hookpoint), (*step, *hp), "record {i}");
        let metas: Vec<RowMeta> = rows.iter().map(|&r| b.rows()[r as usize]).collect();
        assert_eq!(g.metas, metas, "row metadata of record {i} (step {step}, hookpoint {hp})");
        let s = &sources[*hp as usize];
        let spec = s.hp.spec();
        let rb = spec.row_bytes() as usize;
        let src = downcast_source(*step, &s.hp, s.rows);
        let dc = downcast_at(*step, *hp);
        assert_eq!(g.dtype, if dc { DType::F8E4M3RowScaled } else { spec.dtype }, "record {i}'s dtype");
        downcast_records += dc as usize;
        for (k, &r) in rows.iter().enumerate() {
            let source = &src[r as usize * rb..(r as usize + 1) * rb];
            if dc {
                let mut want = vec![0u8; spec.row_width as usize + rowscaled::SCALE_BYTES];
                rowscaled::encode_row(spec.dtype, source, &mut want);
                if g.rows[k] != want {
                    let at = g.rows[k].iter().zip(&want).position(|(a, b)| a != b);
                    panic!(
                        "downcast row {k} of record {i} (step {step}, {} {}) differs from the host converter's at byte \
                         {at:?}: scale {} vs {}",
                        spec.name,
                        spec.dtype,
                        rowscaled::scale_of(&g.rows[k]),
                        rowscaled::scale_of(&want)
                    );
                }
            } else {
                assert!(g.rows[k] == source, "row {k} of record {i} differs");
            }
        }
    }
    assert!(downcast_records >= 40, "{downcast_records} downcast records");
    cap.fold_counters(&reg).unwrap();
    let total = reg.accounting().total();
    assert_eq!(total.published.records, got.len() as u64);
    assert_eq!(total.produced, total.published);
    assert_eq!(total.dropped_total().records, 0);
}

// --- Fused linear probes (issue 15) ----------------------------------------------------------------------------------

/// What every probe test starts from: a ring, its capture side and drain end, a registry, a stream.
struct Rig {
    ring: Arc<DeviceRing>,
    cap: DeviceCapture,
    consumer: DeviceConsumer,
    reg: Registry,
    stream: Stream,
}

fn rig(gpu: &Arc<Gpu>, ring_bytes: usize, options: DeviceCaptureOptions) -> Rig {
    let ring = DeviceRing::new(gpu, ring_bytes).unwrap();
    let cap = DeviceCapture::new(&ring, options).unwrap();
    let consumer = DeviceConsumer::new(&ring, DrainTuning { chunk_bytes: 64 << 10, max_in_flight: 4 }).unwrap();
    Rig { ring, cap, consumer, reg: Registry::new(), stream: Stream::new(gpu).unwrap() }
}

/// `n` values in [-1, 1) from the test pattern.
fn uniform(seed: u64, n: usize) -> Vec<f32> {
    (0..n as u64).map(|i| pattern_word(seed, i) as f32 / 2_147_483_648.0 - 1.0).collect()
}

/// The probe's scores of one row, in f64: `W_k · x + b_k`.
fn probe_reference(weights: &[f32], bias: &[f32], x: &[f64]) -> Vec<f64> {
    let d = x.len();
    bias.iter()
        .enumerate()
        .map(|(k, &b)| weights[k * d..(k + 1) * d].iter().zip(x).map(|(&w, &v)| w as f64 * v).sum::<f64>() + b as f64)
        .collect()
}

/// A device score against the f64 reference: within 1e-3 relative (absolute below 1); NaN and infinities exactly.
fn score_matches(got: f32, want: f64) -> bool {
    if want.is_nan() {
        return got.is_nan();
    }
    if want.is_infinite() {
        return got as f64 == want;
    }
    (got as f64 - want).abs() <= 1e-3 * want.abs().max(1.0)
}

const PROBE_WIDTH: u32 = 2048;
const PROBE_THRESHOLD: f32 = 3.0;
const PROBE_STEPS: u64 = 5;

/// The request of row `r` of step `step` (every row its own request; all distinct modulo the flag table's size).
fn probe_request(step: u64, r: u32) -> u64 {
    10_000 + step * 100 + r as u64
}

/// Source rows of one step of a probe test (bytes of `dtype`) and their reference scores. Rows are random with score
/// spread ~1; every third row is pushed far over the threshold on one output; rows whose reference lands near a
/// threshold are drawn again, so that rounding never decides a flag. Step 1's first row is such a hot row with a
/// NaN element (NaN scores, no flag), step 2's has a +inf element (±inf scores).
fn probe_step_rows(dtype: DType, weights: &[f32], bias: &[f32], step: u64, rows: u32) -> (Vec<u8>, Vec<Vec<f64>>) {
    let d = PROBE_WIDTH as usize;
    let k = bias.len();
    let scale = 3.0 / (d as f32).sqrt();
    let (mut bytes, mut refs) = (Vec::new(), Vec::new());
    for r in 0..rows {
        let hot = (r as u64 + step).is_multiple_of(3);
        let target = (r as usize + step as usize) % k;
        let mut attempt = 0u64;
        let (row, reference) = loop {
            let base = uniform(seed(step, r) ^ (attempt << 56), d);
            let values: Vec<f32> = (0..d)
                .map(|i| {
                    let push = if hot { 0.1 * (weights[target * d + i] / scale).signum() } else { 0.0 };
                    base[i] + push
                })
                .collect();
            let mut row: Vec<u8> = values.iter().flat_map(|&v| encode_float(dtype, v)).collect();
            let special = match (step, r) {
                (1, 0) => Some((5, f32::NAN)),
                (2, 0) => Some((7, f32::INFINITY)),
                _ => None,
            };
            if let Some((i, v)) = special {
                let size = dtype.size();
                row[i * size..(i + 1) * size].copy_from_slice(&encode_float(dtype, v));
            }
            let reference = probe_reference(weights, bias, &decode_floats(dtype, &row));
            let near = reference.iter().any(|s| s.is_finite() && (s - PROBE_THRESHOLD as f64).abs() < 0.05);
            if !near || attempt > 100 {
                break (row, reference);
            }
            attempt += 1;
        };
        bytes.extend(row);
        refs.push(reference);
    }
    (bytes, refs)
}

/// A probe's scores reach the ring as records of its f32 hookpoint and its flags are raised: bf16, f16 and f32
/// sources, 1 and 16 outputs, batches of 1, 8 and 64 rows of 2048 elements, recorded once into a CUDA graph and
/// replayed with new values in the same source buffer. Steps begun on the host, one capture kernel per capture.
#[test]
#[ignore = "needs an NVIDIA GPU: run with --include-ignored on one"]
fn probe_scores_and_flags_follow_graph_replays_in_host_begun_steps() {
    probe_scores_and_flags(false);
}

/// The same with the whole step in the graph (`begin_step_graph`: requests from device tensors) and deferred
/// captures (the scores are copied when the step ends).
#[test]
#[ignore = "needs an NVIDIA GPU: run with --include-ignored on one"]
fn probe_scores_and_flags_follow_graph_replays_in_graph_begun_deferred_steps() {
    probe_scores_and_flags(true);
}

fn probe_scores_and_flags(graph_steps: bool) {
    let gpu = gpu();
    for dtype in [DType::BF16, DType::F16, DType::F32] {
        for k in [1u32, 16] {
            for rows in [1u32, 8, 64] {
                probe_case(&gpu, graph_steps, dtype, k, rows);
            }
        }
    }
}

fn probe_case(gpu: &Arc<Gpu>, graph_steps: bool, dtype: DType, k: u32, rows: u32) {
    let case = format!("{dtype} source, K = {k}, {rows} rows, graph-begun steps: {graph_steps}");
    let d = PROBE_WIDTH as usize;
    let options = DeviceCaptureOptions { max_batch_rows: 64, defer: graph_steps, ..Default::default() };
    let Rig { ring, mut cap, consumer, reg, stream } = rig(gpu, 8 << 20, options);
    let scores_hp = register(&reg, "probe.scores", DType::F32, k);
    let scale = 3.0 / (d as f32).sqrt();
    let weights: Vec<f32> = uniform(77 + k as u64, k as usize * d).iter().map(|w| w * scale).collect();
    let bias: Vec<f32> = uniform(78, k as usize).iter().map(|b| b * 0.5).collect();
    let thresholds = vec![PROBE_THRESHOLD; k as usize];
    let flags = cap.new_flags(4096).unwrap();
    let probe = cap.new_probe(&weights, &bias, k, PROBE_WIDTH, Some(&thresholds), 64).unwrap();
    let probe = probe.with_flags(flags.clone()).unwrap();
    let src = DeviceBuffer::zeroed(gpu, rows as usize * d * dtype.size()).unwrap();
    let req = DeviceBuffer::zeroed(gpu, rows as usize * 8).unwrap();
    let pos = DeviceBuffer::zeroed(gpu, rows as usize * 8).unwrap();
    let gb = graph_batch(&req, &pos, rows, 1);
    let host_batch =
        |step: u64| StepBatch::new(step, (0..rows).map(|r| (probe_request(step, r), step as u32 * 10 + r))).unwrap();

    // Record the step (graph-begun) or its captures (host-begun) once.
    if graph_steps {
        cap.apply_controls(&reg, stream.handle()).unwrap();
    } else {
        cap.begin_step(&reg, &host_batch(0), stream.handle()).unwrap();
    }
    let graph = Graph::capture(&stream, || -> Result<(), DeviceCaptureError> {
        if graph_steps {
            cap.begin_step_graph(&reg, &gb, stream.handle())?;
        }
        cap.capture_probe(&probe, &scores_hp, src.ptr(), dtype, rows, stream.handle())?;
        cap.end_step()
    })
    .unwrap();

    let drain = spawn_drain(consumer, Duration::ZERO);
    let mut expected = Vec::new();
    for step in 0..PROBE_STEPS {
        let (bytes, refs) = probe_step_rows(dtype, &weights, &bias, step, rows);
        src.copy_from_host_async(0, &bytes, stream.handle()).unwrap();
        if graph_steps {
            let ids: Vec<u8> = (0..rows).flat_map(|r| (probe_request(step, r) as i64).to_le_bytes()).collect();
            let positions: Vec<u8> = (0..rows).flat_map(|r| (step as i64 * 10 + r as i64).to_le_bytes()).collect();
            req.copy_from_host_async(0, &ids, stream.handle()).unwrap();
            pos.copy_from_host_async(0, &positions, stream.handle()).unwrap();
        } else {
            cap.begin_step(&reg, &host_batch(step), stream.handle()).unwrap();
        }
        graph.launch(stream.handle()).unwrap();
        expected.push(refs);
    }
    stream.synchronize().unwrap();
    ring.close_producer();
    let got = drain.join().unwrap();

    assert_eq!(ring.error_bits(), 0, "{case}: {}", errors::describe(ring.error_bits()));
    assert_eq!(got.len() as u64, PROBE_STEPS, "{case}: one record per step");
    let mut raised = 0;
    for (step, (g, refs)) in got.iter().zip(&expected).enumerate() {
        let step = step as u64;
        assert_eq!((g.hookpoint, g.dtype, g.metas.len()), (scores_hp.id(), DType::F32, rows as usize), "{case}");
        for (r, reference) in refs.iter().enumerate() {
            let request = probe_request(step, r as u32);
            assert_eq!((g.metas[r].request_id, g.metas[r].batch_row), (request, r as u32), "{case}, step {step}");
            let scores = decode_floats(DType::F32, &g.rows[r]);
            for (kk, (&s, &want)) in scores.iter().zip(reference).enumerate() {
                assert!(
                    score_matches(s as f32, want),
                    "{case}: step {step}, row {r}, score {kk}: {s} on the GPU, {want} on the CPU"
                );
            }
            let crosses = reference.iter().any(|&s| s >= PROBE_THRESHOLD as f64);
            assert_eq!(flags.is_raised(request), crosses, "{case}: flag of request {request} (step {step}, row {r})");
            raised += crosses as usize;
            if (step, r) == (1, 0) {
                assert!(scores.iter().all(|s| s.is_nan()), "{case}: a NaN element gives NaN scores: {scores:?}");
                assert!(!crosses && !flags.is_raised(request), "{case}: a NaN row raises no flag");
            }
            if (step, r) == (2, 0) {
                assert!(scores.iter().all(|s| s.is_infinite()), "{case}: an inf element gives inf scores");
            }
        }
    }
    // Hot rows (every third) always cross: flags were raised, and none anywhere else.
    assert!(raised as u64 >= PROBE_STEPS.div_ceil(3), "{case}: {raised} flags");
    let nonzero = flags.words().iter().filter(|w| w.load(std::sync::atomic::Ordering::Relaxed) != 0).count();
    assert_eq!(nonzero, raised, "{case}: flags raised for requests whose rows do not cross");
    // The host side of the table: clear and raise by request.
    let some = probe_request(0, 0);
    assert_eq!(flags.clear(some), expected[0][0].iter().any(|&s| s >= PROBE_THRESHOLD as f64));
    assert!(!flags.is_raised(some));
    flags.raise(some);
    assert!(flags.is_raised(some) && !flags.is_raised(some + 4096), "{case}: a slot holds one request");

    cap.fold_counters(&reg).unwrap();
    let total = reg.accounting().total();
    assert_eq!(total.published.records, PROBE_STEPS, "{case}");
    assert_eq!(total.published.rows, PROBE_STEPS * rows as u64, "{case}");
    assert_eq!(total.dropped_total().records, 0, "{case}");
}

/// Bad probes and bad uses of one: each a clear error naming what was wrong, and nothing reaches the ring.
#[test]
#[ignore = "needs an NVIDIA GPU: run with --include-ignored on one"]
fn probes_reject_bad_input() {
    let gpu = gpu();
    let options = DeviceCaptureOptions { max_batch_rows: 16, ..Default::default() };
    let Rig { ring, mut cap, reg, stream, .. } = rig(&gpu, 1 << 20, options);
    let msg = |r: Result<(), DeviceCaptureError>| r.unwrap_err().to_string();
    let (k, d) = (4u32, 256u32);
    let w = vec![0.5f32; (k * d) as usize];
    let b = vec![0.0f32; k as usize];

    let too_many = DeviceProbe::new(&gpu, &[0.0; 65 * 8], &[0.0; 65], 65, 8, None, 8).unwrap_err().to_string();
    assert!(too_many.contains("65 outputs") && too_many.contains("1 to 64"), "{too_many}");
    let short = cap.new_probe(&w[1..], &b, k, d, None, 8).unwrap_err().to_string();
    assert!(short.contains("expected outputs × width"), "{short}");
    let no_thresholds = cap.new_probe(&w, &b, k, d, None, 8).unwrap().with_flags(cap.new_flags(8).unwrap());
    assert!(no_thresholds.unwrap_err().to_string().contains("create it with thresholds"));
    assert!(DeviceFlags::new(&gpu, 0).unwrap_err().to_string().contains("at least 1 slot"));

    let probe = cap.new_probe(&w, &b, k, d, None, 8).unwrap();
    let scores = register(&reg, "scores", DType::F32, k);
    let narrow = register(&reg, "narrow", DType::F32, k - 1);
    let src = DeviceBuffer::zeroed(&gpu, 8 * d as usize * 2).unwrap();
    let early = msg(cap.capture_probe(&probe, &scores, src.ptr(), DType::BF16, 8, stream.handle()));
    assert!(early.contains("before the first begin_step"), "{early}");
    cap.begin_step(&reg, &StepBatch::new(0, (0..8).map(|i| (1, i))).unwrap(), stream.handle()).unwrap();
    let width = msg(cap.capture_probe(&probe, &narrow, src.ptr(), DType::BF16, 8, stream.handle()));
    assert!(width.contains("row_width 4"), "{width}");
    let ints = msg(cap.capture_probe(&probe, &scores, src.ptr(), DType::I16, 8, stream.handle()));
    assert!(ints.contains("f32, f16 or bf16"), "{ints}");
    let rows = msg(cap.capture_probe(&probe, &scores, src.ptr(), DType::BF16, 9, stream.handle()));
    assert!(rows.contains("max_rows 8"), "{rows}");
    // 8 f32 rows need twice the bytes of 8 bf16 rows.
    let past_end = msg(cap.capture_probe(&probe, &scores, src.ptr(), DType::F32, 8, stream.handle()));
    assert!(past_end.contains("probe source") && past_end.contains("past the end"), "{past_end}");
    let null = msg(cap.capture_probe(&probe, &scores, DevicePtr::NULL, DType::BF16, 8, stream.handle()));
    assert!(null.contains("null device pointer"), "{null}");
    stream.synchronize().unwrap();
    assert_eq!(ring.published(), 0, "nothing bad may reach the ring");

    // Deferred: one probe, one use per step (its scores buffer is copied when the step ends).
    let options = DeviceCaptureOptions { max_batch_rows: 16, defer: true, ..Default::default() };
    let Rig { mut cap, reg, stream, .. } = rig(&gpu, 1 << 20, options);
    let scores = register(&reg, "scores", DType::F32, k);
    let again = register(&reg, "again", DType::F32, k);
    cap.begin_step(&reg, &StepBatch::new(0, (0..8).map(|i| (1, i))).unwrap(), stream.handle()).unwrap();
    cap.capture_probe(&probe, &scores, src.ptr(), DType::BF16, 8, stream.handle()).unwrap();
    let twice = msg(cap.capture_probe(&probe, &again, src.ptr(), DType::BF16, 8, stream.handle()));
    assert!(twice.contains("used twice in one step"), "{twice}");
    cap.end_step().unwrap();
    cap.begin_step(&reg, &StepBatch::new(1, (0..8).map(|i| (1, i))).unwrap(), stream.handle()).unwrap();
    cap.capture_probe(&probe, &again, src.ptr(), DType::BF16, 8, stream.handle()).unwrap();
    cap.end_step().unwrap();
    stream.synchronize().unwrap();
}
