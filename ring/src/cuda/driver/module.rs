//! Kernels: NVRTC compilation ([`compile_ptx`]), loaded PTX ([`Module`]) and its kernels ([`Function`]).

use std::ffi::{c_void, CString};
use std::sync::Arc;

use cudarc::driver::{result, sys};

use super::{CudaError, DriverResult, Gpu, StreamRef};

/// Compiles CUDA C++ `source` to PTX for `arch` (e.g. `sm_90`) with NVRTC, with extra NVRTC `options`. Needs only
/// NVRTC (loaded at run time), not a GPU.
pub fn compile_ptx(source: &str, arch: &str, options: &[&str]) -> Result<String, CudaError> {
    // SAFETY: only probes whether the library can be loaded.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Err(CudaError::NoNvrtc);
    }
    let opts = cudarc::nvrtc::CompileOptions {
        // NVRTC wants a `&'static str`: one small string per architecture per process.
        arch: Some(Box::leak(arch.to_owned().into_boxed_str())),
        options: options.iter().map(|o| o.to_string()).collect(),
        ..Default::default()
    };
    let ptx = cudarc::nvrtc::compile_ptx_with_opts(source, opts).map_err(|e| CudaError::Compile(format!("{e:?}")))?;
    Ok(ptx.to_src())
}

/// PTX loaded into a device's context (`cuModuleLoadData`), unloaded when it and its [`Function`]s are gone.
#[derive(Debug)]
pub struct Module {
    gpu: Arc<Gpu>,
    raw: sys::CUmodule,
}

// SAFETY: a module handle is a plain identifier, valid in its context from any thread.
unsafe impl Send for Module {}
// SAFETY: as above; the handle is only read.
unsafe impl Sync for Module {}

impl Module {
    /// Loads `ptx` into `gpu`'s context.
    pub fn load_ptx(gpu: &Arc<Gpu>, ptx: &str) -> Result<Arc<Module>, CudaError> {
        let image = CString::new(ptx).map_err(|e| CudaError::Compile(e.to_string()))?;
        gpu.bind()?;
        // SAFETY: `image` is a NUL-terminated PTX string that outlives the call.
        let raw = unsafe { result::module::load_data(image.as_ptr().cast()) }.call("cuModuleLoadData")?;
        Ok(Arc::new(Module { gpu: gpu.clone(), raw }))
    }

    /// The kernel `name` (an `extern "C"` `__global__` function of the module).
    pub fn function(self: &Arc<Self>, name: &str) -> Result<Function, CudaError> {
        let c_name = CString::new(name).map_err(|e| CudaError::Invalid(format!("kernel name {name:?}: {e}")))?;
        // SAFETY: our loaded module, alive as long as the `Function` (which holds it).
        let raw = unsafe { result::module::get_function(self.raw, c_name) }.call("cuModuleGetFunction")?;
        // The launch's error names the kernel; a few bytes per kernel per process.
        let launch_call = Box::leak(format!("cuLaunchKernel({name})").into_boxed_str());
        Ok(Function { _module: self.clone(), raw, launch_call })
    }
}

impl Drop for Module {
    fn drop(&mut self) {
        if self.gpu.bind().is_ok() {
            // SAFETY: ours; no `Function` of it is left (each holds the module).
            let _ = unsafe { result::module::unload(self.raw) };
        }
    }
}

/// A kernel of a loaded [`Module`].
#[derive(Debug)]
pub struct Function {
    _module: Arc<Module>,
    raw: sys::CUfunction,
    launch_call: &'static str,
}

// SAFETY: a function handle is a plain identifier, valid in its context from any thread.
unsafe impl Send for Function {}
// SAFETY: as above; the handle is only read.
unsafe impl Sync for Function {}

impl Function {
    /// Launches the kernel on `stream` with `grid` blocks of `block` threads and no dynamic shared memory. While
    /// the stream records a graph, the launch becomes a node of the graph. The module's context must be current on
    /// the calling thread ([`Gpu::bind`]; the launch fails otherwise) — callers bind once per operation, not per
    /// launch.
    ///
    /// # Safety
    /// `args` holds one pointer per kernel parameter, in order, each to a value of exactly the parameter's type
    /// and size (the driver copies the values during the call, so they need only outlive it). Every device address
    /// among the values stays valid — allocated, and free of conflicting accesses — until the kernel has run, and
    /// for a recorded launch until every replay of the graph has run.
    pub unsafe fn launch(
        &self,
        grid: u32,
        block: u32,
        stream: &StreamRef,
        args: &mut [*mut c_void],
    ) -> Result<(), CudaError> {
        // SAFETY: per the caller's promise; the function belongs to a loaded module we hold; the stream is live per
        // `StreamRef`'s contract.
        unsafe { result::launch_kernel(self.raw, (grid, 1, 1), (block, 1, 1), 0, stream.raw(), args) }
            .call(self.launch_call)
    }
}
