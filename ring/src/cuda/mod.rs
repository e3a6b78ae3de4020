//! The CUDA backend, in two layers:
//!
//! * [`driver`] — the CUDA driver layer: every raw driver and NVRTC call, the error mapping ([`CudaError`]), and
//!   the RAII owners ([`Gpu`], [`Stream`], [`Event`], [`DeviceBuffer`], [`PinnedBuffer`], [`Graph`], [`Module`]).
//!   Raw handles and device addresses from an engine enter only through [`StreamRef::from_raw`] and
//!   [`DevicePtr::from_raw`].
//! * [`ring`] — the ring protocol on device memory ([`DeviceRing`], [`DeviceConsumer`], the [`state`] / [`host`]
//!   / [`errors`] layouts the capture kernels share), written against the driver layer only.
//!
//! Always compiled; the CUDA driver is loaded at run time. Without a driver or a device, [`Gpu::open`] returns
//! [`CudaError::NoDriver`] / [`CudaError::NoDevice`] — never a panic.

pub mod driver;
pub mod ring;

pub use driver::{
    compile_ptx, CudaError, DeviceBuffer, DevicePtr, Event, ForeignStream, Function, Gpu, Graph, Module, PinnedBuffer,
    Stream, StreamRef,
};
pub use ring::{
    errors, host, state, DeviceConsumer, DeviceDrainStats, DeviceRing, DrainTuning, RingAddrs, GRAPH_FLAG_VALUES,
};
