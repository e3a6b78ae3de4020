//! Capture from host memory: select rows, apply sampling, reserve ring space as the policy says, write, publish.
//!
//! Every accepted capture ends in exactly one counted outcome (published-then-exported, sampled out, or dropped
//! with a reason); bad input is rejected *before* anything is counted.

use std::borrow::Cow;
use std::time::Instant;

use ringscope_policy::{DropReason, LossPolicy, OnFull};
use ringscope_ring::{rowscaled, Producer, RecordMeta, ReserveError, RowMeta};

use crate::batch::StepBatch;
use crate::error::HookPointError;
use crate::registry::{HookPoint, RowSelection};

/// What happened to one capture.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CaptureOutcome {
    /// The record is in the ring with this sequence number.
    Published {
        /// Sequence number of the record.
        seq: u64,
        /// Rows in the record.
        rows: u32,
    },
    /// Skipped: the hookpoint is disabled or this step is not sampled.
    SampledOut,
    /// Best-effort: dropped and counted.
    Dropped(DropReason),
}

/// Captures `data` — the hookpoint's tensor for the whole batch, `batch.len() × row_bytes` contiguous bytes, or just
/// the rows its selection keeps, in selection order — into the ring through `producer`.
///
/// Rows are chosen by the hookpoint's [`RowSelection`], and each kept row's request id and position from `batch`
/// travel in the same record. In full mode a full ring makes this wait up to the policy's deadline; in best-effort
/// mode it drops and counts instead. Errors for bad input leave the counters untouched; errors after acceptance
/// (deadline, too large, drain gone) are counted as drops before they are returned.
pub fn capture_host(
    producer: &mut Producer,
    policy: &LossPolicy,
    hp: &HookPoint,
    batch: &StepBatch,
    data: &[u8],
) -> Result<CaptureOutcome, HookPointError> {
    let row_bytes = hp.spec().row_bytes();
    let rb = row_bytes as usize;
    let expected = batch.len().saturating_mul(rb);
    let metas: Cow<'_, [RowMeta]> = match &*hp.control().effective_selection() {
        RowSelection::All => Cow::Borrowed(batch.rows()),
        RowSelection::LastPerRequest => Cow::Borrowed(batch.last_per_request()),
        RowSelection::Rows(idx) => {
            // Sized by the selection the user set: a refused allocation is an error, not an abort.
            let mut metas = Vec::new();
            metas.try_reserve_exact(idx.len()).map_err(|_| HookPointError::SelectionAllocation {
                hookpoint: hp.spec().name.clone(),
                rows: idx.len(),
                bytes: idx.len().saturating_mul(std::mem::size_of::<RowMeta>()),
            })?;
            for &i in idx.iter() {
                metas.push(batch.rows().get(i as usize).copied().ok_or_else(|| HookPointError::RowIndex {
                    hookpoint: hp.spec().name.clone(),
                    index: i,
                    batch_rows: batch.len(),
                })?);
            }
            Cow::Owned(metas)
        }
    };
    // The tensor holds either the whole batch, or exactly the selected rows in selection order (e.g. logits that
    // an engine computed for each request's last token only).
    let preselected = data.len() != expected && data.len() == metas.len().saturating_mul(rb);
    if data.len() != expected && !preselected {
        return Err(HookPointError::DataLength {
            hookpoint: hp.spec().name.clone(),
            expected,
            got: data.len(),
            rows: batch.len(),
            row_bytes,
        });
    }
    let rows = metas.len() as u32;
    // Read once: the record's dtype and its rows' conversion must agree even if the control changes meanwhile.
    let (dtype, record_row_bytes) = hp.control().record_format(hp.spec());
    let record = RecordMeta {
        step: batch.step(),
        hookpoint: hp.id(),
        rows,
        row_bytes: record_row_bytes,
        dtype,
        flags: if matches!(metas, Cow::Owned(_)) || rows as usize != batch.len() {
            ringscope_ring::record::flags::ROW_SELECTION
        } else {
            0
        },
    };

    let counters = &hp.counters();
    counters.produced(rows as u64);
    if !hp.control().samples(batch.step()) {
        counters.sampled_out(rows as u64);
        return Ok(CaptureOutcome::SampledOut);
    }

    let reserved = match policy.on_ring_full() {
        OnFull::Drop => producer.try_reserve(record),
        OnFull::Wait(deadline) => match producer.try_reserve(record) {
            Err(ReserveError::Full { .. }) => {
                // Only a real wait is a stall: time it.
                let started = Instant::now();
                let r = producer.reserve_until(record, started + deadline);
                hp.stall().waited(started.elapsed());
                r
            }
            other => other,
        },
    };
    let mut reservation = match reserved {
        Ok(r) => r,
        Err(e) => {
            let (reason, error) = match e {
                ReserveError::Full { .. } => (DropReason::RingFull, None),
                ReserveError::DeadlineExceeded { .. } => (
                    DropReason::Deadline,
                    Some(HookPointError::Deadline { hookpoint: hp.spec().name.clone(), step: batch.step(), source: e }),
                ),
                ReserveError::TooLarge { payload_len, max_payload_len } => (
                    DropReason::TooLarge,
                    Some(HookPointError::TooLarge { hookpoint: hp.spec().name.clone(), payload_len, max_payload_len }),
                ),
                ReserveError::Disconnected => {
                    (DropReason::Disconnected, Some(HookPointError::Disconnected { hookpoint: hp.spec().name.clone() }))
                }
                ReserveError::InvalidRecord(e) => {
                    // Unreachable: a validated spec and a non-empty selection always make a valid record.
                    unreachable!("capture of `{}` built an invalid record: {e}", hp.spec().name)
                }
            };
            hp.dropped(reason, batch.step(), rows as u64);
            return match error {
                Some(err) => Err(err),
                None => Ok(CaptureOutcome::Dropped(reason)),
            };
        }
    };
    reservation.write_rows_with(&metas, |i, dst| {
        let src = if preselected { i * rb } else { metas[i].batch_row as usize * rb };
        if dtype == hp.spec().dtype {
            dst.copy_from_slice(&data[src..src + rb]);
        } else {
            rowscaled::encode_row(hp.spec().dtype, &data[src..src + rb], dst);
        }
    });
    let seq = reservation.publish();
    counters.published(rows as u64);
    Ok(CaptureOutcome::Published { seq, rows })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::registry::Registry;
    use ringscope_policy::Mode;
    use ringscope_ring::{channel, DType};
    use ringscope_ring::{HookPointSpec, SiteKind};
    use std::time::Duration;

    fn setup(capacity: usize, width: u32) -> (Producer, ringscope_ring::Consumer, Registry) {
        let (p, c) = channel(capacity).unwrap();
        let reg = Registry::new();
        reg.register(HookPointSpec {
            name: "layers.0.resid".into(),
            site: SiteKind::Residual,
            layer: Some(0),
            dtype: DType::F32,
            row_width: width,
        })
        .unwrap();
        (p, c, reg)
    }

    fn tensor(rows: usize, width: usize) -> Vec<u8> {
        (0..rows * width).flat_map(|i| (i as f32).to_le_bytes()).collect()
    }

    const BEST: LossPolicy = LossPolicy { mode: Mode::BestEffort, full_deadline: Duration::ZERO };
    const FULL: LossPolicy = LossPolicy { mode: Mode::Full, full_deadline: Duration::from_millis(20) };

    #[test]
    fn a_tensor_of_just_the_selected_rows_is_taken_in_selection_order() {
        // Logits computed for each request's last token only: 2 rows for a 3-row batch.
        let (mut p, mut c, reg) = setup(1 << 16, 4);
        let hp = reg.get(0).unwrap();
        hp.control().set_selection(RowSelection::LastPerRequest).unwrap();
        let batch = StepBatch::new(0, [(10, 0), (10, 1), (11, 7)]).unwrap();
        let data = tensor(2, 4);
        capture_host(&mut p, &FULL, &hp, &batch, &data).unwrap();
        let (metas, rows) = c
            .pop_with(|v| (v.row_metas().map(|m| (m.request_id, m.position)).collect::<Vec<_>>(), v.data().to_vec()))
            .unwrap()
            .unwrap();
        assert_eq!(metas, vec![(10, 1), (11, 7)]);
        assert_eq!(rows, data);
        // Neither the batch nor the selection: an error naming both sizes' source.
        let err = capture_host(&mut p, &FULL, &hp, &batch, &tensor(1, 4)).unwrap_err().to_string();
        assert!(err.contains("expected 48"), "{err}");
    }

    #[test]
    fn selections_carry_their_row_metadata() {
        let (mut p, mut c, reg) = setup(1 << 16, 4);
        let hp = reg.get(0).unwrap();
        let batch = StepBatch::new(3, [(10, 0), (10, 1), (11, 7)]).unwrap();
        let data = tensor(3, 4);
        for sel in [RowSelection::All, RowSelection::LastPerRequest, RowSelection::Rows(vec![2, 0])] {
            hp.control().set_selection(sel.clone()).unwrap();
            capture_host(&mut p, &FULL, &hp, &batch, &data).unwrap();
            let (metas, rows): (Vec<_>, Vec<_>) = c
                .pop_with(|v| {
                    let m: Vec<_> = v.row_metas().map(|m| (m.request_id, m.position, m.batch_row)).collect();
                    (m, v.data().to_vec())
                })
                .unwrap()
                .unwrap();
            let want: Vec<u32> = match sel {
                RowSelection::All => vec![0, 1, 2],
                RowSelection::LastPerRequest => vec![1, 2],
                RowSelection::Rows(r) => r,
            };
            let want_metas: Vec<_> = want
                .iter()
                .map(|&i| batch.rows()[i as usize])
                .map(|m| (m.request_id, m.position, m.batch_row))
                .collect();
            assert_eq!(metas, want_metas);
            let want_rows: Vec<u8> =
                want.iter().flat_map(|&i| data[i as usize * 16..(i as usize + 1) * 16].to_vec()).collect();
            assert_eq!(rows, want_rows);
        }
    }

    #[test]
    fn bad_input_is_rejected_and_not_counted() {
        let (mut p, _c, reg) = setup(1 << 16, 4);
        let hp = reg.get(0).unwrap();
        let batch = StepBatch::new(0, [(1, 0), (2, 0)]).unwrap();
        let err = capture_host(&mut p, &FULL, &hp, &batch, &[0; 31]).unwrap_err();
        assert!(matches!(err, HookPointError::DataLength { expected: 32, got: 31, .. }), "{err}");
        hp.control().set_selection(RowSelection::Rows(vec![0, 5])).unwrap();
        let err = capture_host(&mut p, &FULL, &hp, &batch, &tensor(2, 4)).unwrap_err();
        assert!(err.to_string().contains("batch row 5"), "{err}");
        assert_eq!(hp.counters().snapshot().produced.records, 0);
    }

    #[test]
    fn sampling_counts_sampled_out() {
        let (mut p, mut c, reg) = setup(1 << 16, 4);
        let hp = reg.get(0).unwrap();
        hp.control().set_every_n_steps(2).unwrap();
        for step in 0..6 {
            let batch = StepBatch::new(step, [(1, step as u32)]).unwrap();
            capture_host(&mut p, &BEST, &hp, &batch, &tensor(1, 4)).unwrap();
        }
        let mut steps = vec![];
        while let Some(s) = c.pop_with(|v| v.header.meta.step).unwrap() {
            steps.push(s);
        }
        assert_eq!(steps, vec![0, 2, 4]);
        let s = hp.counters().snapshot();
        assert_eq!((s.produced.records, s.sampled_out.records, s.published.records), (6, 3, 3));
    }

    #[test]
    fn best_effort_drops_and_counts_full_mode_errors_after_deadline() {
        // 1024-byte ring; one 1-row record of 64 floats is 64 + 64 + 256 = 384 bytes: two fit.
        let (mut p, _c, reg) = setup(1024, 64);
        let hp = reg.get(0).unwrap();
        let batch = StepBatch::new(0, [(1, 0)]).unwrap();
        let data = tensor(1, 64);
        let outcomes: Vec<_> = (0..4).map(|_| capture_host(&mut p, &BEST, &hp, &batch, &data).unwrap()).collect();
        assert!(matches!(outcomes[1], CaptureOutcome::Published { seq: 1, .. }));
        assert_eq!(outcomes[3], CaptureOutcome::Dropped(DropReason::RingFull));
        let err = capture_host(&mut p, &FULL, &hp, &batch, &data).unwrap_err();
        assert!(err.to_string().contains("after waiting"), "{err}");
        let s = hp.counters().snapshot();
        assert_eq!(s.dropped_for(DropReason::RingFull).records, 2);
        assert_eq!(s.dropped_for(DropReason::Deadline).records, 1);
        assert_eq!(s.produced.records, 5);
        // Each drop is in the registry's log too, with its step and rows.
        let mut spans: Vec<_> = reg
            .events()
            .take()
            .into_iter()
            .map(|e| (e.hookpoint, e.reason, e.first_step, e.last_step, e.records_lost, e.rows_lost))
            .collect();
        spans.sort();
        let hp_name = || "layers.0.resid".to_owned();
        assert_eq!(
            spans,
            vec![(hp_name(), "deadline".into(), 0, 0, 1, 1), (hp_name(), "ring_full".into(), 0, 0, 2, 2)]
        );
    }

    #[test]
    fn too_large_is_counted_and_explained() {
        let (mut p, _c, reg) = setup(1024, 4096);
        let hp = reg.get(0).unwrap();
        let batch = StepBatch::new(0, [(1, 0)]).unwrap();
        let err = capture_host(&mut p, &BEST, &hp, &batch, &tensor(1, 4096)).unwrap_err();
        assert!(err.to_string().contains("raise ring.capacity"), "{err}");
        assert_eq!(hp.counters().snapshot().dropped_for(DropReason::TooLarge).records, 1);
        let events = reg.events().take();
        assert_eq!((events.len(), events[0].reason.as_str(), events[0].rows_lost), (1, "too_large", 1));
    }

    #[test]
    fn downcast_rows_are_converted_on_capture_and_say_so_in_their_dtype() {
        let (mut p, mut c, reg) = setup(1 << 16, 4);
        let hp = reg.get(0).unwrap();
        let batch = StepBatch::new(0, [(1, 0), (2, 0)]).unwrap();
        let data: Vec<u8> =
            [1.0f32, -2.0, 0.5, 448.0, 3.0, 0.0, -0.25, 7.0].iter().flat_map(|v| v.to_le_bytes()).collect();
        hp.control().set_selection(RowSelection::Rows(vec![1, 0])).unwrap();
        hp.control().set_downcast(true).unwrap();
        capture_host(&mut p, &FULL, &hp, &batch, &data).unwrap();
        hp.control().set_downcast(false).unwrap();
        capture_host(&mut p, &FULL, &hp, &batch, &data).unwrap();
        let read = |c: &mut ringscope_ring::Consumer| {
            c.pop_with(|v| (v.header.meta.dtype, v.header.meta.row_bytes, v.data().to_vec())).unwrap().unwrap()
        };
        let (dtype, row_bytes, rows) = read(&mut c);
        assert_eq!((dtype, row_bytes), (DType::F8E4M3RowScaled, 8));
        let mut want = vec![0u8; 16];
        rowscaled::encode_row(DType::F32, &data[16..32], &mut want[..8]);
        rowscaled::encode_row(DType::F32, &data[..16], &mut want[8..]);
        assert_eq!(rows, want, "selected rows, in selection order, each with its own scale");
        assert_eq!(rowscaled::scale_of(&rows[8..]), 1.0, "row 0's amax is 448");
        let (dtype, row_bytes, rows) = read(&mut c);
        assert_eq!((dtype, row_bytes), (DType::F32, 16));
        assert_eq!(rows, [&data[16..], &data[..16]].concat());
    }
}
