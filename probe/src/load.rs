//! Reading probe weights and biases from safetensors and `.npy` files.

use std::path::Path;

use crate::spec::MAX_OUTPUTS;
use crate::ProbeError;

/// Files larger than this are refused before they are read (a probe's weights are at most 64 × 65536 f64 = 32 MiB;
/// a safetensors file holding other tensors too may be larger).
const MAX_FILE_BYTES: u64 = 1 << 30;

/// A probe's `K × d` weight matrix, row-major, as f32.
#[derive(Debug, Clone, PartialEq)]
pub struct Weights {
    outputs: usize,
    width: usize,
    values: Vec<f32>,
}

impl Weights {
    /// `K × d` weights from `values` (row-major); `None` when the length is not `K × d`.
    pub fn new(outputs: usize, width: usize, values: Vec<f32>) -> Option<Weights> {
        (outputs.checked_mul(width) == Some(values.len())).then_some(Weights { outputs, width, values })
    }
    /// `K`.
    pub fn outputs(&self) -> usize {
        self.outputs
    }
    /// `d`.
    pub fn width(&self) -> usize {
        self.width
    }
    /// All `K × d` values, row-major.
    pub fn values(&self) -> &[f32] {
        &self.values
    }
    /// Output `k`'s weight vector.
    pub fn row(&self, k: usize) -> &[f32] {
        &self.values[k * self.width..(k + 1) * self.width]
    }
}

fn file_error(probe: &str, path: &Path, message: impl Into<String>) -> ProbeError {
    ProbeError::File { probe: probe.into(), path: path.display().to_string(), message: message.into() }
}

/// Reads a whole probe file: a regular file only, at most [`MAX_FILE_BYTES`], every allocation fallible. A FIFO, a
/// socket or a device (`/dev/zero` reads without end; opening a FIFO waits for a writer) is refused, never waited on.
fn read_file(probe: &str, path: &Path) -> Result<Vec<u8>, ProbeError> {
    use std::io::Read;
    let fail = |message: String| file_error(probe, path, message);
    if path.as_os_str().is_empty() {
        return Err(fail("an empty path: give the file's path".into()));
    }
    let regular = |meta: std::fs::Metadata| match meta.is_file() {
        true => Ok(meta),
        false => Err(fail(format!("not a regular file ({}); give a .safetensors or .npy file", file_kind(&meta)))),
    };
    // Refused before it is opened: opening a FIFO for reading would wait for a writer.
    regular(std::fs::metadata(path).map_err(|e| fail(e.to_string()))?)?;
    let mut options = std::fs::OpenOptions::new();
    options.read(true);
    #[cfg(unix)]
    {
        // Non-blocking: should the path have become a FIFO since the check above, opening it does not wait.
        use std::os::unix::fs::OpenOptionsExt;
        options.custom_flags(libc::O_NONBLOCK);
    }
    let file = options.open(path).map_err(|e| fail(e.to_string()))?;
    // What was opened is checked again: the path may have changed since.
    let meta = regular(file.metadata().map_err(|e| fail(e.to_string()))?)?;
    if meta.len() > MAX_FILE_BYTES {
        return Err(fail(format!("{} bytes; probe files are read whole, at most 1 GiB", meta.len())));
    }
    let mut bytes = Vec::new();
    bytes
        .try_reserve_exact(meta.len() as usize)
        .map_err(|_| fail(format!("cannot allocate {} bytes to read it", meta.len())))?;
    // Bounded even if the file grows while it is read.
    file.take(MAX_FILE_BYTES + 1).read_to_end(&mut bytes).map_err(|e| fail(e.to_string()))?;
    if bytes.len() as u64 > MAX_FILE_BYTES {
        return Err(fail("grew past 1 GiB while it was read; probe files are read whole, at most 1 GiB".into()));
    }
    Ok(bytes)
}

fn file_kind(meta: &std::fs::Metadata) -> &'static str {
    #[cfg(unix)]
    {
        use std::os::unix::fs::FileTypeExt;
        let t = meta.file_type();
        if t.is_fifo() {
            return "a FIFO";
        }
        if t.is_char_device() || t.is_block_device() {
            return "a device";
        }
        if t.is_socket() {
            return "a socket";
        }
    }
    if meta.is_dir() {
        "a directory"
    } else {
        "not a regular file"
    }
}

/// Checks a `.npy` file's header length and data size against the file before npyz parses it: npyz allocates the
/// header length it reads (a length field of 0xFFFFFFF0 aborted the process) and the shape's element count.
/// Returns the bytes of data after the header.
fn check_npy_layout(bytes: &[u8]) -> Result<u64, String> {
    const MAGIC: &[u8] = b"\x93NUMPY";
    if bytes.len() < 10 || &bytes[..6] != MAGIC {
        return Err("not a .npy file (no \\x93NUMPY magic)".into());
    }
    let (header_len, start) = match bytes[6] {
        1 => (u16::from_le_bytes([bytes[8], bytes[9]]) as u64, 10u64),
        2 | 3 if bytes.len() >= 12 => (u32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]) as u64, 12),
        v => return Err(format!("a .npy file of format version {v}, or truncated; save it with numpy (version 1-3)")),
    };
    if start + header_len > bytes.len() as u64 {
        return Err(format!(
            "its header claims {header_len} bytes, but the file has {} bytes after the preamble: a damaged file",
            bytes.len() as u64 - start
        ));
    }
    Ok(bytes.len() as u64 - start - header_len)
}

/// Reads a probe's weights from `path`: a `.safetensors` file (the tensor named `tensor`, default `weight`; its
/// `bias` tensor too, when there is one) or a `.npy` file. Shapes `[K, d]` or `[d]` (one output); f32, f16, bf16
/// (safetensors) or f64 elements, converted to f32. Returns the weights and the file's bias, if it has one.
pub fn load_weights(probe: &str, path: &Path, tensor: Option<&str>) -> Result<(Weights, Option<Vec<f32>>), ProbeError> {
    let bytes = read_file(probe, path)?;
    match extension(path).as_deref() {
        Some("safetensors") => {
            let st = safetensors::SafeTensors::deserialize(&bytes)
                .map_err(|e| file_error(probe, path, format!("not a safetensors file: {e}")))?;
            let name = tensor.unwrap_or("weight");
            let view = st.tensor(name).map_err(|_| {
                let mut names = st.names();
                names.sort();
                file_error(
                    probe,
                    path,
                    format!("no tensor `{name}` (it has {}); name the weights with `tensor`", names.join(", ")),
                )
            })?;
            let weights = matrix(probe, path, name, view.shape(), st_values(probe, path, name, &view)?)?;
            let bias = match st.tensor("bias") {
                Ok(view) if tensor.is_none_or(|t| t != "bias") => {
                    Some(vector(probe, path, "bias", view.shape(), st_values(probe, path, "bias", &view)?)?)
                }
                _ => None,
            };
            Ok((weights, bias))
        }
        Some("npy") => {
            let (shape, values) = npy_values(probe, path, &bytes)?;
            Ok((matrix(probe, path, "the array", &shape, values)?, None))
        }
        _ => Err(file_error(probe, path, "unknown file type: use a .safetensors or a .npy file")),
    }
}

/// Writes `values` (f32, C order, `shape`) as a `.npy` file — e.g. the weights of a probe trained in Rust, `[K, d]`.
pub fn save_npy(path: &Path, shape: &[usize], values: &[f32]) -> std::io::Result<()> {
    use npyz::WriterBuilder;
    if shape.iter().product::<usize>() != values.len() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!("{} values do not fill shape {shape:?}", values.len()),
        ));
    }
    let dims: Vec<u64> = shape.iter().map(|&n| n as u64).collect();
    let file = std::io::BufWriter::new(std::fs::File::create(path)?);
    let mut writer = npyz::WriteOptions::<f32>::new().default_dtype().shape(&dims).writer(file).begin_nd()?;
    writer.extend(values.iter().copied())?;
    writer.finish()
}

/// Reads `K` biases from a `.npy` file (shape `[K]`, or `[]` for one).
pub fn load_bias(probe: &str, path: &Path) -> Result<Vec<f32>, ProbeError> {
    if extension(path).as_deref() != Some("npy") {
        return Err(file_error(
            probe,
            path,
            "a bias file must be a .npy file (safetensors weights carry a `bias` tensor)",
        ));
    }
    let bytes = read_file(probe, path)?;
    let (shape, values) = npy_values(probe, path, &bytes)?;
    vector(probe, path, "the array", &shape, values)
}

fn extension(path: &Path) -> Option<String> {
    path.extension().and_then(|e| e.to_str()).map(|e| e.to_ascii_lowercase())
}

fn matrix(probe: &str, path: &Path, what: &str, shape: &[usize], values: Vec<f32>) -> Result<Weights, ProbeError> {
    let (k, d) = match *shape {
        [d] => (1, d),
        [k, d] => (k, d),
        _ => {
            return Err(file_error(probe, path, format!("{what} has shape {shape:?}; weights are [K, d] or [d]")));
        }
    };
    if k == 0 || k > MAX_OUTPUTS || d == 0 {
        return Err(file_error(
            probe,
            path,
            format!("{what} has shape {shape:?}; weights are [K, d] with K from 1 to {MAX_OUTPUTS} and d ≥ 1"),
        ));
    }
    Weights::new(k, d, values).ok_or_else(|| file_error(probe, path, format!("{what}: data does not match {shape:?}")))
}

fn vector(probe: &str, path: &Path, what: &str, shape: &[usize], values: Vec<f32>) -> Result<Vec<f32>, ProbeError> {
    if shape.len() > 1 {
        return Err(file_error(probe, path, format!("{what} has shape {shape:?}; a bias is [K] (or a scalar)")));
    }
    Ok(values)
}

fn st_values(
    probe: &str,
    path: &Path,
    name: &str,
    view: &safetensors::tensor::TensorView<'_>,
) -> Result<Vec<f32>, ProbeError> {
    use safetensors::Dtype;
    let data = view.data();
    let two = || data.chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]]));
    Ok(match view.dtype() {
        Dtype::F32 => data.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes"))).collect(),
        Dtype::F64 => data.chunks_exact(8).map(|c| f64::from_le_bytes(c.try_into().expect("8 bytes")) as f32).collect(),
        Dtype::F16 => two().map(|b| half::f16::from_bits(b).to_f32()).collect(),
        Dtype::BF16 => two().map(|b| half::bf16::from_bits(b).to_f32()).collect(),
        other => {
            return Err(file_error(probe, path, format!("tensor `{name}` is {other:?}; use f32, f16, bf16 or f64")));
        }
    })
}

fn npy_values(probe: &str, path: &Path, bytes: &[u8]) -> Result<(Vec<usize>, Vec<f32>), ProbeError> {
    let data = check_npy_layout(bytes).map_err(|e| file_error(probe, path, e))?;
    let npy = npyz::NpyFile::new(bytes).map_err(|e| file_error(probe, path, format!("not a .npy file: {e}")))?;
    let shape: Vec<usize> = npy.shape().iter().map(|&n| n as usize).collect();
    // The shape's element count must be what the file holds, before anything of that size is allocated.
    let elements = npy.shape().iter().try_fold(1u64, |n, &d| n.checked_mul(d));
    let item = match npy.dtype() {
        npyz::DType::Plain(ts) => ts.num_bytes().unwrap_or(0) as u64,
        _ => 0,
    };
    if item > 0 && elements.and_then(|n| n.checked_mul(item)).is_none_or(|need| need > data) {
        return Err(file_error(
            probe,
            path,
            format!(
                "its header declares shape {:?} of {item}-byte elements, but it holds {data} bytes of data",
                npy.shape()
            ),
        ));
    }
    if npy.order() == npyz::Order::Fortran && shape.len() > 1 {
        return Err(file_error(probe, path, "a Fortran-ordered array: save it C-ordered (np.ascontiguousarray)"));
    }
    let npyz::DType::Plain(ts) = npy.dtype() else {
        return Err(file_error(probe, path, "a structured array; use a plain float array"));
    };
    let ts = ts.to_string();
    let bad = |e: std::io::Error| file_error(probe, path, e.to_string());
    let values = match &ts[1..] {
        "f4" => npy.into_vec::<f32>().map_err(bad)?,
        "f8" => npy.into_vec::<f64>().map_err(bad)?.into_iter().map(|v| v as f32).collect(),
        "f2" => npy.into_vec::<half::f16>().map_err(bad)?.into_iter().map(|v| v.to_f32()).collect(),
        _ => return Err(file_error(probe, path, format!("elements of type {ts}; use float32, float16 or float64"))),
    };
    Ok((shape, values))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn saved_weights_load_back_and_a_short_array_is_refused() {
        let dir = std::env::temp_dir().join(format!("ringscope-probe-npy-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("w.npy");
        let values: Vec<f32> = (0..6).map(|i| i as f32 * 0.5 - 1.0).collect();
        save_npy(&path, &[2, 3], &values).unwrap();
        let (w, bias) = load_weights("p", &path, None).unwrap();
        assert_eq!((w.outputs(), w.width(), w.values()), (2, 3, &values[..]));
        assert!(bias.is_none());
        assert!(save_npy(&path, &[2, 4], &values).is_err(), "6 values do not fill [2, 4]");
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// Issue 28: a header length of 0xFFFFFFF0 aborted the process (npyz allocated it); a shape larger than the data
    /// must not be allocated either.
    #[test]
    fn npy_files_whose_header_or_shape_exceed_the_file_are_refused() {
        let dir = std::env::temp_dir().join(format!("ringscope-probe-npy-bad-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("w.npy");
        let mut huge = b"\x93NUMPY\x02\x00".to_vec();
        huge.extend_from_slice(&0xFFFF_FFF0u32.to_le_bytes());
        huge.extend_from_slice(&[b' '; 64]);
        std::fs::write(&path, &huge).unwrap();
        let e = load_weights("p", &path, None).unwrap_err().to_string();
        assert!(e.contains("4294967280 bytes") && e.contains("damaged"), "{e}");
        let header = "{'descr': '<f4', 'fortran_order': False, 'shape': (1099511627776, 4), }";
        let mut big = b"\x93NUMPY\x01\x00".to_vec();
        let padded = format!("{header:<118}\n");
        big.extend_from_slice(&(padded.len() as u16).to_le_bytes());
        big.extend_from_slice(padded.as_bytes());
        big.extend_from_slice(&[0u8; 16]);
        std::fs::write(&path, &big).unwrap();
        let e = load_weights("p", &path, None).unwrap_err().to_string();
        assert!(e.contains("holds 16 bytes of data"), "{e}");
        std::fs::write(&path, b"\x93NUMPY").unwrap();
        assert!(load_weights("p", &path, None).unwrap_err().to_string().contains("not a .npy file"));
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// Issue 28: a FIFO hung session open (opening it waits for a writer) and `/dev/zero` read without end.
    #[cfg(unix)]
    #[test]
    fn weights_that_are_not_regular_files_are_refused_without_waiting() {
        let dir = std::env::temp_dir().join(format!("ringscope-probe-fifo-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let fifo = dir.join("w.npy");
        let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
        // SAFETY: a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        let e = load_weights("p", &fifo, None).unwrap_err().to_string();
        assert!(e.contains("a FIFO") && e.contains("w.npy"), "{e}");
        let e = load_bias("p", Path::new("/dev/zero.npy")).unwrap_err().to_string();
        assert!(e.contains("/dev/zero.npy"), "{e}");
        let zero = dir.join("zero.npy");
        std::os::unix::fs::symlink("/dev/zero", &zero).unwrap();
        let e = load_weights("p", &zero, None).unwrap_err().to_string();
        assert!(e.contains("a device"), "{e}");
        let e = load_weights("p", Path::new(""), None).unwrap_err().to_string();
        assert!(e.contains("empty path"), "{e}");
        let e = load_weights("p", &dir, None).unwrap_err().to_string();
        assert!(e.contains("a directory"), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
