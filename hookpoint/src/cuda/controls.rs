//! Per-hookpoint controls on the device: the 64-byte [`DeviceControl`] entry each capture kernel reads at run time
//! (so that graph replays see enable / every-N / row-selection changes), the host mirror of what was uploaded, and
//! the upload itself — stream-ordered on the engine's stream, before the step's captures.

use std::sync::Arc;

use ringscope_ring::cuda::{DeviceBuffer, DevicePtr, Gpu, StreamRef};
use ringscope_ring::DType;

use super::DeviceCaptureError;
use crate::registry::{HookPoint, Registry, RowSelection};

/// Size of one hookpoint's control entry in device memory (`sizeof(Control)` in `capture.cu`).
pub(super) const CONTROL_BYTES: usize = 64;

/// Which rows of a captured tensor a record keeps (`Control::mode`; `ROW_*` in the kernels).
#[repr(u32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(super) enum RowMode {
    /// Every batch row.
    #[default]
    All = 0,
    /// The rows of an explicit list, in list order (`Control::list_ptr`, `list_len`).
    List = 1,
    /// The last row of each request, in batch order (from the step descriptor).
    LastPerRequest = 2,
}

/// The device control entry of one hookpoint (`struct Control` in `capture.cu`; the generated layout checks hold
/// the two to the same field offsets).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(super) struct DeviceControl {
    pub enabled: u32,
    pub every_n: u32,
    pub mode: RowMode,
    pub list_len: u32,
    /// Device `u32[list_len]` for [`RowMode::List`].
    pub list_ptr: u64,
    /// Device `u32` scalar: rows past it are padding (0 = none).
    pub valid_rows_ptr: u64,
    /// 1: rows of a bf16 / f16 / f32 hookpoint are written as row-scaled FP8 E4M3 (`DType::F8E4M3RowScaled`).
    pub downcast: u32,
    pub reserved0: u32,
    pub reserved: [u64; 3],
}

impl DeviceControl {
    /// The entry as the kernels read it (little-endian, `repr(C)` offsets).
    fn to_bytes(self) -> [u8; CONTROL_BYTES] {
        use std::mem::offset_of;
        let mut b = [0u8; CONTROL_BYTES];
        let mut put = |offset: usize, bytes: &[u8]| b[offset..offset + bytes.len()].copy_from_slice(bytes);
        put(offset_of!(DeviceControl, enabled), &self.enabled.to_le_bytes());
        put(offset_of!(DeviceControl, every_n), &self.every_n.to_le_bytes());
        put(offset_of!(DeviceControl, mode), &(self.mode as u32).to_le_bytes());
        put(offset_of!(DeviceControl, list_len), &self.list_len.to_le_bytes());
        put(offset_of!(DeviceControl, list_ptr), &self.list_ptr.to_le_bytes());
        put(offset_of!(DeviceControl, valid_rows_ptr), &self.valid_rows_ptr.to_le_bytes());
        put(offset_of!(DeviceControl, downcast), &self.downcast.to_le_bytes());
        b
    }
}

/// What the device holds for one hookpoint, as last uploaded.
#[derive(Debug, Clone, Default)]
pub(super) struct HostMirror {
    pub generation: u64,
    pub control: DeviceControl,
    pub row_bytes: u32,
    pub uploaded: bool,
}

/// The device control table (one [`DeviceControl`] per hookpoint, at a fixed address graphs bake in), the row lists
/// it points to, and the host mirrors.
pub(super) struct Controls {
    gpu: Arc<Gpu>,
    max_batch_rows: u32,
    max_hookpoints: u32,
    table: DeviceBuffer,
    lists: Vec<Option<DeviceBuffer>>,
    valid_rows: Vec<DevicePtr>,
    mirrors: Vec<HostMirror>,
    /// `registry.changes()` when the controls were last uploaded (`None`: upload at the next step).
    synced_changes: Option<u64>,
}

impl Controls {
    /// An all-zero (disabled) table for `max_hookpoints` hookpoints.
    pub(super) fn new(
        gpu: &Arc<Gpu>,
        max_batch_rows: u32,
        max_hookpoints: u32,
    ) -> Result<Controls, DeviceCaptureError> {
        Ok(Controls {
            gpu: gpu.clone(),
            max_batch_rows,
            max_hookpoints,
            table: DeviceBuffer::zeroed(gpu, max_hookpoints as usize * CONTROL_BYTES)?,
            lists: Vec::new(),
            valid_rows: Vec::new(),
            mirrors: Vec::new(),
            synced_changes: None,
        })
    }

    /// Device address of the table.
    pub(super) fn table_addr(&self) -> u64 {
        self.table.ptr().addr()
    }

    /// The mirrors, by hookpoint id (hookpoints registered since the last upload are missing).
    pub(super) fn mirrors(&self) -> &[HostMirror] {
        &self.mirrors
    }

    /// Whether hookpoint `id`'s controls are on the device.
    pub(super) fn uploaded(&self, id: u32) -> bool {
        self.mirrors.get(id as usize).is_some_and(|m| m.uploaded)
    }

    /// Whether the device has the registry's controls as they are now.
    pub(super) fn in_sync(&self, registry: &Registry) -> bool {
        Some(registry.changes()) == self.synced_changes
    }

    /// Makes rows at or past the value of the device `u32` at `ptr` padding for hookpoint `id`; `None` removes it.
    /// Uploaded with the next [`sync`](Self::sync).
    pub(super) fn set_valid_rows(&mut self, id: u32, ptr: Option<DevicePtr>) -> Result<(), DeviceCaptureError> {
        if let Some(ptr) = ptr {
            self.gpu.check_device_range("valid-rows scalar", ptr, 4, 4)?;
        }
        let i = id as usize;
        if i >= self.max_hookpoints as usize {
            return Err(DeviceCaptureError::Usage(format!("hookpoint id {id} is past max_hookpoints")));
        }
        if self.valid_rows.len() <= i {
            self.valid_rows.resize(i + 1, DevicePtr::NULL);
        }
        self.valid_rows[i] = ptr.unwrap_or(DevicePtr::NULL);
        if let Some(m) = self.mirrors.get_mut(i) {
            m.uploaded = false;
        }
        self.synced_changes = None;
        Ok(())
    }

    /// The device control entry of `hp` now, and its row list (explicit selections).
    fn control_of(&self, hp: &HookPoint) -> Result<(DeviceControl, Option<Vec<u32>>), DeviceCaptureError> {
        let (mode, list): (RowMode, Option<Vec<u32>>) = match &*hp.control().effective_selection() {
            RowSelection::All => (RowMode::All, None),
            RowSelection::Rows(r) => (RowMode::List, Some(r.clone())),
            RowSelection::LastPerRequest => (RowMode::LastPerRequest, None),
        };
        if let Some(list) = &list {
            if list.len() > self.max_batch_rows as usize {
                return Err(DeviceCaptureError::Usage(format!(
                    "row selection of `{}` has {} rows, more than max_batch_rows {}",
                    hp.spec().name,
                    list.len(),
                    self.max_batch_rows
                )));
            }
        }
        let control = DeviceControl {
            enabled: hp.control().effective_enabled() as u32,
            every_n: hp.control().effective_every_n(),
            mode,
            list_len: list.as_ref().map_or(0, |l| l.len() as u32),
            valid_rows_ptr: self.valid_rows.get(hp.id() as usize).copied().unwrap_or(DevicePtr::NULL).addr(),
            downcast: hp.control().effective_downcast() as u32,
            ..DeviceControl::default()
        };
        Ok((control, list))
    }

    fn check_count(&self, registered: usize) -> Result<(), DeviceCaptureError> {
        if registered > self.max_hookpoints as usize {
            return Err(DeviceCaptureError::Usage(format!(
                "{registered} hookpoints registered, the CUDA session was created for at most {} (max_hookpoints)",
                self.max_hookpoints
            )));
        }
        Ok(())
    }

    /// Uploads changed controls on `stream` (stream-ordered before the step's captures).
    pub(super) fn sync(&mut self, registry: &Registry, stream: &StreamRef) -> Result<(), DeviceCaptureError> {
        let changes = registry.changes();
        if Some(changes) == self.synced_changes {
            return Ok(());
        }
        let all = registry.all();
        self.check_count(all.len())?;
        self.mirrors.resize(all.len(), HostMirror::default());
        self.lists.resize_with(all.len(), || None);
        for hp in &all {
            let i = hp.id() as usize;
            let generation = hp.control().generation();
            let m = &self.mirrors[i];
            if m.uploaded && m.generation == generation {
                continue;
            }
            let (mut control, list) = self.control_of(hp)?;
            if let Some(list) = list {
                if self.lists[i].is_none() {
                    self.lists[i] = Some(DeviceBuffer::zeroed(&self.gpu, self.max_batch_rows as usize * 4)?);
                }
                let dst = self.lists[i].as_ref().expect("allocated above");
                // Pageable source: the driver stages it before returning, so it may be dropped right after. The
                // buffer holds max_batch_rows u32s, at least `list.len()` (checked by `control_of`).
                let bytes: Vec<u8> = list.iter().flat_map(|r| r.to_le_bytes()).collect();
                dst.copy_from_host_async(0, &bytes, stream.clone())?;
                control.list_ptr = dst.ptr().addr();
            }
            // Entry `i` of the control table (i < max_hookpoints); pageable source, staged by the driver.
            self.table.copy_from_host_async(i * CONTROL_BYTES, &control.to_bytes(), stream.clone())?;
            // The rows the kernels write under the uploaded controls (downcast rows are `row_width + 4` bytes).
            let row_bytes = match control.downcast {
                0 => hp.spec().row_bytes(),
                _ => DType::F8E4M3RowScaled.row_bytes(hp.spec().row_width as u64) as u32,
            };
            self.mirrors[i] = HostMirror { generation, control, row_bytes, uploaded: true };
        }
        self.synced_changes = Some(changes);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_control_entry_is_laid_out_as_the_kernels_read_it() {
        let c = DeviceControl {
            enabled: 1,
            every_n: 3,
            mode: RowMode::LastPerRequest,
            list_len: 5,
            list_ptr: 0x1000,
            valid_rows_ptr: 0x2000,
            downcast: 1,
            reserved0: 0,
            reserved: [0; 3],
        };
        let b = c.to_bytes();
        let word = |k: usize| u64::from_le_bytes(b[k * 8..k * 8 + 8].try_into().unwrap());
        assert_eq!(word(0), 1 | 3 << 32);
        assert_eq!(word(1), 2 | 5 << 32);
        assert_eq!((word(2), word(3)), (0x1000, 0x2000));
        assert_eq!(word(4), 1);
        assert!(b[40..].iter().all(|&x| x == 0));
        assert_eq!((RowMode::All as u32, RowMode::List as u32, RowMode::LastPerRequest as u32), (0, 1, 2));
    }
}
