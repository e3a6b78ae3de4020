//! # ringscope-ffi
//!
//! The C ABI through which engines link ringscope. This crate is where the `cdylib`/`staticlib`, the cbindgen
//! header and the Python package will live; so far it exports only what identifies the library, so that a binding
//! can check it loaded a compatible build. Sessions, hookpoints, steps and captures through C arrive with the C ABI
//! work.
#![deny(unsafe_op_in_unsafe_fn)]
#![warn(missing_docs, clippy::undocumented_unsafe_blocks)]

/// The version of the record format this build writes and reads (see `docs/format.md`).
#[no_mangle]
pub extern "C" fn ringscope_format_version() -> u16 {
    ringscope::ring::record::FORMAT_VERSION
}

#[cfg(test)]
mod tests {
    #[test]
    fn format_version_matches_the_ring() {
        assert_eq!(super::ringscope_format_version(), 1);
    }
}
