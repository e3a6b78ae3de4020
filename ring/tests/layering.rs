//! The CUDA layering holds: one driver layer (`ring/src/cuda/driver/`) names cudarc and calls the driver; every
//! other source file of the repository — the device-ring protocol, the capture kernels' host side, the facade, the
//! C ABI, tests, benchmarks, examples — uses that layer and nothing else, and only the ring crate depends on cudarc.

use std::path::{Path, PathBuf};

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("ring/ sits in the repository root").to_path_buf()
}

/// Every file under `dir` whose name ends with `suffix`, skipping build output and hidden directories.
fn files(dir: &Path, suffix: &str, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        if path.is_dir() {
            if name != "target" && !name.starts_with('.') {
                files(&path, suffix, out);
            }
        } else if name.ends_with(suffix) {
            out.push(path);
        }
    }
}

#[test]
fn only_the_driver_layer_names_cudarc_or_calls_the_driver() {
    let root = repo_root();
    let driver = root.join("ring/src/cuda/driver");
    let this_file = root.join("ring/tests/layering.rs");
    let mut sources = Vec::new();
    files(&root, ".rs", &mut sources);
    assert!(sources.len() > 20, "found only {} .rs files under {}", sources.len(), root.display());
    let mut offences = Vec::new();
    for path in sources.iter().filter(|p| !p.starts_with(&driver) && **p != this_file) {
        let text = std::fs::read_to_string(path).unwrap();
        for (i, line) in text.lines().enumerate() {
            let code = line.trim_start();
            if code.starts_with("//") {
                continue; // prose may name cudarc; code may not
            }
            for banned in ["cudarc", "sys::cu", "CUstream", "CUdeviceptr", "CUevent", "CUcontext", "CUfunction"] {
                if code.contains(banned) {
                    offences.push(format!(
                        "{}:{}: `{banned}`: {}",
                        path.strip_prefix(&root).unwrap().display(),
                        i + 1,
                        code
                    ));
                }
            }
        }
    }
    assert!(
        offences.is_empty(),
        "raw CUDA outside ring/src/cuda/driver/ (use the driver layer's types; add what is missing there):\n{}",
        offences.join("\n")
    );
}

#[test]
fn the_driver_layer_does_not_hand_out_cudarc() {
    let mut sources = Vec::new();
    files(&repo_root().join("ring/src/cuda/driver"), ".rs", &mut sources);
    assert!(!sources.is_empty());
    for path in sources {
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(!text.contains("pub use cudarc"), "{} re-exports cudarc", path.display());
    }
}

#[test]
fn only_the_ring_crate_depends_on_cudarc() {
    let root = repo_root();
    let mut manifests = Vec::new();
    files(&root, "Cargo.toml", &mut manifests);
    for path in manifests {
        let text = std::fs::read_to_string(&path).unwrap();
        let rel = path.strip_prefix(&root).unwrap().to_string_lossy().into_owned();
        let mut section = String::new();
        for line in text.lines() {
            let line = line.trim();
            if line.starts_with('[') {
                section = line.to_string();
                continue;
            }
            if !line.starts_with("cudarc") {
                continue;
            }
            let allowed = (rel == "Cargo.toml" && section == "[workspace.dependencies]")
                || (rel == "ring/Cargo.toml" && section == "[dependencies]");
            assert!(allowed, "{rel} {section}: `{line}`: only the ring crate (its driver layer) may depend on cudarc");
        }
    }
}
