//! The CUDA backend in its smallest form (docs/cuda-backend.md's snippet): a capture recorded into a CUDA graph and replayed
//! for three steps, with the batch descriptor installed before each replay.
//!
//! ```sh
//! cargo run --release --example cuda_graph     # needs an NVIDIA GPU, its driver and NVRTC (libnvrtc.so.13)
//! ```
//!
//! Without a GPU it says why and exits cleanly.

use ringscope::cuda::{DeviceBuffer, Gpu, Graph, Stream};
use ringscope::{Config, Session};

fn main() -> Result<(), ringscope::Error> {
    let gpu = match Gpu::open(0) {
        Ok(gpu) => gpu,
        Err(e) => {
            eprintln!("the CUDA backend is not available here: {e}");
            return Ok(());
        }
    };
    let config = Config::from_toml(
        r#"
        [ring]
        backend = "cuda"
        capacity = "256 MiB"
        [policy]
        mode = "full"                 # begin_step_on waits for room; best_effort: kernels drop and count
        [[hookpoints]]
        name = "layers.0.resid"
        site = "residual"
        layer = 0
        dtype = "bf16"
        row_width = 2048
    "#,
    )?;
    let session = Session::new(config)?;
    // An engine passes its own stream and tensors: from PyTorch, `torch.cuda.current_stream().cuda_stream` and
    // `tensor.data_ptr()`. Here: a stream and an 8-row (padded) bf16 activation buffer of our own.
    let stream = Stream::new(&gpu)?;
    let hidden = DeviceBuffer::zeroed(&gpu, 8 * 2048 * 2)?;

    // Record the capture into a graph once (a step must be open: its descriptor is what the recording sees).
    session.begin_step_on(0, [(7, 16), (9, 0)], stream.handle())?;
    let graph = Graph::capture(&stream, || session.capture_device(0, hidden.ptr(), 8, stream.handle()))?;
    session.end_step()?;
    // Every step: the batch descriptor (outside the graph), then the replay. Only the batch's rows are copied.
    for step in 1..=3u32 {
        session.begin_step_on(step as u64, [(7, 16 + step), (9, step)], stream.handle())?;
        graph.launch(stream.handle())?;
        session.end_step()?;
    }
    stream.synchronize()?;
    let report = session.shutdown()?; // synchronises the device, drains, checks the accounting
    assert_eq!(report.accounting.total().exported.rows, 3 * 2);
    Ok(())
}
