//! Fused linear probes (issue 15): a [`DeviceProbe`] turns each row `x` of a captured activation (`width` elements of
//! bf16 / f16 / f32) into `outputs` scores `s_k = W_k · x + b_k`, accumulated in f32, on the GPU, inside the capture
//! path — so that `outputs` f32 per row reach the ring instead of `width` elements. The probe kernel
//! (`kernels/probe.cu`) writes the step's scores into the probe's own buffer, and an ordinary capture of an f32
//! hookpoint of width `outputs` copies that buffer into the ring
//! ([`DeviceCapture::capture_probe`](super::DeviceCapture::capture_probe)): row selection, sampling, counters,
//! deferral and graph replays are those of any capture.
//!
//! With thresholds and a [`DeviceFlags`] table, the kernel also raises a flag for every request one of whose rows
//! scores `s_k >= threshold_k` for some `k` (a NaN score never does), in pinned host memory mapped into the device:
//! an engine can test it from a kernel, or the host from memory, without synchronising with the GPU. The probe
//! computes scores and flags at every step, whatever the scores hookpoint's sampling: its controls decide what is
//! exported, not what is watched.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use ringscope_ring::cuda::{DeviceBuffer, DevicePtr, Gpu, PinnedBuffer};
use ringscope_ring::{DType, HookPointSpec};

use super::DeviceCaptureError;

/// Most outputs (`K`) of one probe.
pub const MAX_PROBE_OUTPUTS: u32 = 64;

/// Most elements per source row (`d`) of one probe.
pub const MAX_PROBE_WIDTH: u32 = 65536;

/// Outputs the kernel accumulates per pass over a row (registers per thread); more take further passes.
pub(super) const PROBE_CHUNK: u32 = 16;

/// Elements each thread of the probe kernel loads per pass over a row before using any (so that their loads are in
/// flight together).
pub(super) const PROBE_UNROLL: u32 = 4;

/// A linear probe's tables on the device: weights (`f32[outputs × width]`, row-major), bias (`f32[outputs]`),
/// optional thresholds (`f32[outputs]`) with the flag table they raise flags in, and the buffer its kernel writes the
/// scores into (`f32[max_rows × outputs]`, row `r` at element `r × outputs`).
///
/// A CUDA graph recorded with a probe bakes in these addresses: it must not be replayed after the probe (or its
/// flag table) is gone.
pub struct DeviceProbe {
    gpu: Arc<Gpu>,
    outputs: u32,
    width: u32,
    max_rows: u32,
    weights: DeviceBuffer,
    bias: DeviceBuffer,
    thresholds: Option<DeviceBuffer>,
    flags: Option<Arc<DeviceFlags>>,
    scores: DeviceBuffer,
}

impl std::fmt::Debug for DeviceProbe {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceProbe")
            .field("outputs", &self.outputs)
            .field("width", &self.width)
            .field("max_rows", &self.max_rows)
            .field("thresholds", &self.thresholds.is_some())
            .field("flags", &self.flags.as_ref().map(|f| f.slots()))
            .finish()
    }
}

impl DeviceProbe {
    /// Uploads a probe of `outputs` (1 to [`MAX_PROBE_OUTPUTS`]) scores over rows of `width` (1 to
    /// [`MAX_PROBE_WIDTH`]) elements: `weights` holds `outputs × width` values (row `k` is `W_k`), `bias` `outputs`,
    /// `thresholds` (if any) `outputs`; its scores buffer takes up to `max_rows` rows per step. Returns once the
    /// tables are on the device (on a private stream, waited for): create probes before recording graphs.
    pub fn new(
        gpu: &Arc<Gpu>,
        weights: &[f32],
        bias: &[f32],
        outputs: u32,
        width: u32,
        thresholds: Option<&[f32]>,
        max_rows: u32,
    ) -> Result<DeviceProbe, DeviceCaptureError> {
        check_shape(weights.len(), bias.len(), outputs, width, thresholds.map(<[f32]>::len), max_rows)
            .map_err(DeviceCaptureError::Usage)?;
        // Each table is on the device when `from_host` returns, whatever stream the engine later scores on.
        let upload = |values: &[f32]| -> Result<DeviceBuffer, DeviceCaptureError> {
            let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
            Ok(DeviceBuffer::from_host(gpu, &bytes)?)
        };
        let probe = DeviceProbe {
            gpu: gpu.clone(),
            outputs,
            width,
            max_rows,
            weights: upload(weights)?,
            bias: upload(bias)?,
            thresholds: thresholds.map(upload).transpose()?,
            flags: None,
            scores: DeviceBuffer::zeroed(gpu, max_rows as usize * outputs as usize * 4)?,
        };
        Ok(probe)
    }

    /// Raises flags in `flags` (for rows whose scores reach the thresholds). Needs thresholds. Graphs recorded
    /// before this call keep the table they were recorded with.
    pub fn with_flags(mut self, flags: Arc<DeviceFlags>) -> Result<DeviceProbe, DeviceCaptureError> {
        if self.thresholds.is_none() {
            return Err(DeviceCaptureError::Usage(
                "a probe raises flags only where a score reaches its threshold: create it with thresholds (one per \
                 output) to give it a flag table"
                    .into(),
            ));
        }
        if flags.gpu_ordinal != self.gpu.ordinal() {
            return Err(DeviceCaptureError::Usage(format!(
                "the flag table is mapped into device {}, the probe lives on device {}",
                flags.gpu_ordinal,
                self.gpu.ordinal()
            )));
        }
        self.flags = Some(flags);
        Ok(self)
    }

    /// Scores per row (`K`).
    pub fn outputs(&self) -> u32 {
        self.outputs
    }

    /// Elements per source row (`d`).
    pub fn width(&self) -> u32 {
        self.width
    }

    /// Most rows per step.
    pub fn max_rows(&self) -> u32 {
        self.max_rows
    }

    /// Whether the probe has thresholds.
    pub fn has_thresholds(&self) -> bool {
        self.thresholds.is_some()
    }

    /// The flag table, if any.
    pub fn flags(&self) -> Option<&Arc<DeviceFlags>> {
        self.flags.as_ref()
    }

    /// Device address of the scores buffer (`f32[max_rows × outputs]`), which the probe kernel writes and the
    /// capture of the scores hookpoint reads.
    pub fn scores_ptr(&self) -> DevicePtr {
        self.scores.ptr()
    }

    pub(super) fn gpu_ordinal(&self) -> usize {
        self.gpu.ordinal()
    }

    pub(super) fn weights_addr(&self) -> u64 {
        self.weights.ptr().addr()
    }

    pub(super) fn bias_addr(&self) -> u64 {
        self.bias.ptr().addr()
    }

    /// The thresholds and the flag table, when the probe raises flags (0s otherwise).
    pub(super) fn flag_args(&self) -> (u64, u64, u32) {
        match (&self.thresholds, &self.flags) {
            (Some(t), Some(f)) => (t.ptr().addr(), f.device_ptr().addr(), f.slots()),
            _ => (0, 0, 0),
        }
    }

    /// Checks one use of the probe: `src_rows` rows of `src_dtype` into the scores hookpoint `scores`.
    pub(super) fn check_use(
        &self,
        scores: &HookPointSpec,
        src_dtype: DType,
        src_rows: u32,
        max_batch_rows: u32,
    ) -> Result<(), DeviceCaptureError> {
        check_use(self.outputs, self.max_rows, scores, src_dtype, src_rows, max_batch_rows)
            .map_err(DeviceCaptureError::Usage)
    }
}

/// Checks a probe's dimensions (lengths of the slices it is made from).
fn check_shape(
    weights: usize,
    bias: usize,
    outputs: u32,
    width: u32,
    thresholds: Option<usize>,
    max_rows: u32,
) -> Result<(), String> {
    if outputs == 0 || outputs > MAX_PROBE_OUTPUTS {
        return Err(format!(
            "a probe of {outputs} outputs: use 1 to {MAX_PROBE_OUTPUTS} (split a larger probe into several)"
        ));
    }
    if width == 0 || width > MAX_PROBE_WIDTH {
        return Err(format!("a probe over rows of {width} elements: use 1 to {MAX_PROBE_WIDTH}"));
    }
    if weights as u64 != outputs as u64 * width as u64 {
        return Err(format!(
            "probe weights: {weights} values, expected outputs × width = {outputs} × {width} = {} (row-major, one row \
             per output)",
            outputs as u64 * width as u64
        ));
    }
    if bias != outputs as usize {
        return Err(format!("probe bias: {bias} values, expected one per output ({outputs})"));
    }
    if let Some(t) = thresholds.filter(|&t| t != outputs as usize) {
        return Err(format!("probe thresholds: {t} values, expected one per output ({outputs})"));
    }
    if max_rows == 0 {
        return Err("a probe's max_rows must be at least 1 (the most rows one step scores)".into());
    }
    Ok(())
}

/// Checks one use of a probe of `outputs` scores and `max_rows` rows.
fn check_use(
    outputs: u32,
    max_rows: u32,
    scores: &HookPointSpec,
    src_dtype: DType,
    src_rows: u32,
    max_batch_rows: u32,
) -> Result<(), String> {
    let name = &scores.name;
    if !matches!(src_dtype, DType::F32 | DType::F16 | DType::BF16) {
        return Err(format!("probe into `{name}`: the source is {src_dtype}; a probe reads f32, f16 or bf16 rows"));
    }
    if scores.dtype != DType::F32 || scores.row_width != outputs {
        return Err(format!(
            "probe into `{name}`: its scores are f32 × {outputs} per row, but `{name}` is {} × {}; register the scores \
             hookpoint as f32 with row_width {outputs}",
            scores.dtype, scores.row_width
        ));
    }
    let most = max_rows.min(max_batch_rows);
    if src_rows == 0 || src_rows > most {
        return Err(format!(
            "probe into `{name}`: {src_rows} rows; use 1 to {most} (the probe's max_rows {max_rows}, max_batch_rows \
             {max_batch_rows})"
        ));
    }
    Ok(())
}

/// A per-request flag table in pinned host memory mapped into the device: slot `request % slots` holds
/// `request + 1` (wrapping) once a probe raised the flag of `request`, 0 when empty. An engine tests request `R` with
/// `flags[R % slots] == R + 1` — from a kernel through [`device_ptr`](Self::device_ptr), or on the host through
/// [`is_raised`](Self::is_raised) — without synchronising with the GPU. Requests that share a slot overwrite each
/// other (the newest raise wins): size the table for the requests in flight.
pub struct DeviceFlags {
    table: PinnedBuffer,
    slots: u32,
    gpu_ordinal: usize,
}

impl std::fmt::Debug for DeviceFlags {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceFlags").field("slots", &self.slots).finish()
    }
}

impl DeviceFlags {
    /// A table of `slots` (at least 1) empty flags, mapped into `gpu`'s address space.
    pub fn new(gpu: &Arc<Gpu>, slots: u32) -> Result<Arc<DeviceFlags>, DeviceCaptureError> {
        if slots == 0 {
            return Err(DeviceCaptureError::Usage("a flag table needs at least 1 slot".into()));
        }
        let table = PinnedBuffer::zeroed(gpu, slots as usize * 8, true)?;
        Ok(Arc::new(DeviceFlags { table, slots, gpu_ordinal: gpu.ordinal() }))
    }

    /// Number of slots.
    pub fn slots(&self) -> u32 {
        self.slots
    }

    /// The table's device address (`u64[slots]`), for kernels that test flags.
    pub fn device_ptr(&self) -> DevicePtr {
        self.table.mapped_ptr().expect("the flag table is mapped")
    }

    /// The table as the host sees it, one atomic per slot. The device writes it at any time.
    pub fn words(&self) -> &[AtomicU64] {
        &self.table.u64_words()[..self.slots as usize]
    }

    fn slot(&self, request: u64) -> &AtomicU64 {
        &self.words()[(request % self.slots as u64) as usize]
    }

    /// Raises the flag of `request` (as the probe kernel does).
    pub fn raise(&self, request: u64) {
        self.slot(request).store(request.wrapping_add(1), Ordering::Release);
    }

    /// Whether the flag of `request` is raised.
    pub fn is_raised(&self, request: u64) -> bool {
        self.slot(request).load(Ordering::Acquire) == request.wrapping_add(1)
    }

    /// Lowers the flag of `request`, leaving a slot that holds another request's flag as it is. Returns whether it
    /// was raised.
    pub fn clear(&self, request: u64) -> bool {
        self.slot(request).compare_exchange(request.wrapping_add(1), 0, Ordering::AcqRel, Ordering::Acquire).is_ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ringscope_ring::SiteKind;

    fn scores_spec(dtype: DType, width: u32) -> HookPointSpec {
        HookPointSpec { name: "probe.scores".into(), site: SiteKind::Residual, layer: None, dtype, row_width: width }
    }

    #[test]
    fn probe_shapes_are_checked_with_clear_errors() {
        assert_eq!(check_shape(16 * 2048, 16, 16, 2048, Some(16), 64), Ok(()));
        assert_eq!(check_shape(64 * 65536, 64, 64, 65536, None, 1), Ok(()));
        let err = |r: Result<(), String>| r.unwrap_err();
        let k = err(check_shape(65 * 8, 65, 65, 8, None, 1));
        assert!(k.contains("65 outputs") && k.contains("1 to 64"), "{k}");
        assert!(err(check_shape(0, 0, 0, 8, None, 1)).contains("0 outputs"));
        let d = err(check_shape(65537, 1, 1, 65537, None, 1));
        assert!(d.contains("65537 elements") && d.contains("1 to 65536"), "{d}");
        let w = err(check_shape(100, 2, 2, 64, None, 1));
        assert!(w.contains("100 values") && w.contains("2 × 64 = 128"), "{w}");
        assert!(err(check_shape(128, 3, 2, 64, None, 1)).contains("bias: 3 values"));
        assert!(err(check_shape(128, 2, 2, 64, Some(1), 1)).contains("thresholds: 1 values"));
        assert!(err(check_shape(128, 2, 2, 64, None, 0)).contains("max_rows"));
    }

    #[test]
    fn probe_uses_are_checked_with_clear_errors() {
        let spec = scores_spec(DType::F32, 16);
        for dtype in [DType::F32, DType::F16, DType::BF16] {
            assert_eq!(check_use(16, 64, &spec, dtype, 64, 8192), Ok(()));
        }
        let err = |r: Result<(), String>| r.unwrap_err();
        let src = err(check_use(16, 64, &spec, DType::I32, 1, 8192));
        assert!(src.contains("i32") && src.contains("f32, f16 or bf16"), "{src}");
        let width = err(check_use(16, 64, &scores_spec(DType::F32, 8), DType::BF16, 1, 8192));
        assert!(width.contains("f32 × 8") && width.contains("row_width 16"), "{width}");
        let dtype = err(check_use(16, 64, &scores_spec(DType::BF16, 16), DType::BF16, 1, 8192));
        assert!(dtype.contains("bf16 × 16"), "{dtype}");
        let rows = err(check_use(16, 64, &spec, DType::BF16, 65, 8192));
        assert!(rows.contains("65 rows") && rows.contains("1 to 64"), "{rows}");
        let batch = err(check_use(16, 64, &spec, DType::BF16, 33, 32));
        assert!(batch.contains("1 to 32") && batch.contains("max_batch_rows 32"), "{batch}");
        assert!(err(check_use(16, 64, &spec, DType::BF16, 0, 8192)).contains("0 rows"));
    }
}
