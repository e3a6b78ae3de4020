//! Errors of the dataset: what went wrong with which file or directory, keeping the error behind it.

use std::path::PathBuf;

/// A file format could not encode or write a batch (the error of a [`FileFormat`](super::FileFormat) call).
#[derive(Debug, thiserror::Error)]
pub enum FormatError {
    /// The Parquet writer failed.
    #[error(transparent)]
    Parquet(#[from] parquet::errors::ParquetError),
    /// The Arrow IPC writer failed.
    #[error(transparent)]
    Arrow(#[from] arrow::error::ArrowError),
    /// Writing the bytes failed.
    #[error(transparent)]
    Io(#[from] std::io::Error),
    /// A record's rows do not have the size its hookpoint's schema says.
    #[error("record {seq} of hookpoint `{hookpoint}` has rows of {found} bytes, its schema {schema}")]
    RowSize {
        /// The record's sequence number.
        seq: u64,
        /// The hookpoint.
        hookpoint: String,
        /// Row size in the record.
        found: u32,
        /// Row size in the schema.
        schema: u32,
    },
}

/// A file sink could not set up its directories or write, finish or commit a file. Each variant names the path.
#[derive(Debug, thiserror::Error)]
pub enum FileError {
    /// The dataset options are unusable.
    #[error("{0}")]
    Options(#[from] OptionsError),
    /// The run directory already holds a dump.
    #[error("run directory {} already holds a dump; choose another run id or remove it", .0.display())]
    RunDirInUse(PathBuf),
    /// Another session holds this rank of the run directory (see [`RunLock`](super::RunLock)).
    #[error(
        "run directory {} is being written by another session (rank {rank}): two writers of one run and rank would \
         overwrite each other's files; give this session another export.run_id (or export.rank). (On object storage \
         a writer that crashed leaves its claim, `_ringscope.rank={rank}.lock/<writer>`: delete it once no writer of \
         the rank is alive.)",
        .dir.display()
    )]
    RunLocked {
        /// The run directory.
        dir: PathBuf,
        /// The rank.
        rank: u32,
    },
    /// The run's lock file could not be created or locked.
    #[error("cannot lock {}: {source}", .path.display())]
    Lock {
        /// The lock file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// A directory could not be created.
    #[error("cannot create directory {}: {source}", .dir.display())]
    CreateDir {
        /// The directory.
        dir: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// A file could not be created.
    #[error("cannot create {}: {source}", .path.display())]
    Create {
        /// The (in-progress) file.
        path: PathBuf,
        /// Why.
        #[source]
        source: FormatError,
    },
    /// A batch could not be written into a file.
    #[error("writing {}: {source}", .path.display())]
    Write {
        /// The (in-progress) file.
        path: PathBuf,
        /// Why.
        #[source]
        source: FormatError,
    },
    /// A file's footer could not be written.
    #[error("closing {}: {source}", .path.display())]
    Finish {
        /// The (in-progress) file.
        path: PathBuf,
        /// Why.
        #[source]
        source: FormatError,
    },
    /// A committed file could not be read.
    #[error("reading {}: {source}", .path.display())]
    Read {
        /// The file (or directory).
        path: PathBuf,
        /// Why.
        #[source]
        source: FormatError,
    },
    /// A finished file could not be synced or renamed to its final name.
    #[error("committing {}: {source}", .path.display())]
    Commit {
        /// The final name.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
}

/// [`DatasetOptions`](super::DatasetOptions) that cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum OptionsError {
    /// The run id is not a plain directory name.
    #[error(
        "run id {0:?} must be a directory name: 1 to 255 bytes, not starting with `.`, without `/`, `\\` or control \
         characters"
    )]
    RunId(String),
    /// The output root is empty.
    #[error("export.dir is empty: give the directory dumps go to (\".\" for the working directory)")]
    EmptyRoot,
    /// A size is zero.
    #[error("max_file_bytes and batch_bytes must be positive")]
    ZeroSize,
    /// An unknown `direct_io` value.
    #[error("direct_io `{0}`: expected auto, on or off")]
    DirectIo(String),
    /// An unusable zstd level.
    #[error("zstd level {level}: {why}")]
    ZstdLevel {
        /// The level asked for.
        level: i32,
        /// Why it is unusable.
        why: String,
    },
}
