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

fn read_file(probe: &str, path: &Path) -> Result<Vec<u8>, ProbeError> {
    let meta = std::fs::metadata(path).map_err(|e| file_error(probe, path, e.to_string()))?;
    if meta.len() > MAX_FILE_BYTES {
        return Err(file_error(
            probe,
            path,
            format!("{} bytes; probe files are read whole, at most 1 GiB", meta.len()),
        ));
    }
    std::fs::read(path).map_err(|e| file_error(probe, path, e.to_string()))
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
    let npy = npyz::NpyFile::new(bytes).map_err(|e| file_error(probe, path, format!("not a .npy file: {e}")))?;
    let shape: Vec<usize> = npy.shape().iter().map(|&n| n as usize).collect();
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
}
