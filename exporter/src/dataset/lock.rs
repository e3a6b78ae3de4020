//! One writer per run and rank: [`RunLock`].
//!
//! Two sessions given the same `export.dir`, `run_id` and rank would write the same file names (`part-00000.*`) and
//! the same manifest: the later one's files replace the earlier one's, and rows vanish without an error. A session
//! that writes files therefore holds an exclusive advisory lock on `<run_dir>/_ringscope.rank=<rank>.lock` until its
//! manifest is written, and refuses to start when another holds it or when this rank's part of the run is already
//! written.
//! The operating system drops the lock when its holder exits, however it exits: a crashed writer leaves no stale
//! lock behind (its files, if any, still make the rank "already written").

use std::fs::{File, OpenOptions, TryLockError};
use std::path::{Path, PathBuf};

use super::FileError;

/// The lock file's name for `rank`; the leading `_` keeps dataset readers from taking it for data.
pub fn lock_file_name(rank: u32) -> String {
    format!("_ringscope.rank={rank}.lock")
}

/// An exclusive hold on one rank of a run directory (see the module docs); released when dropped.
#[derive(Debug)]
pub struct RunLock {
    _file: File,
    path: PathBuf,
}

impl RunLock {
    /// Creates `run_dir` if needed and takes its lock for `rank`. Fails with [`FileError::RunLocked`] when another
    /// session (in this process or another) holds it, and with [`FileError::RunDirInUse`] when this rank's part of the
    /// run was already written: the manifest named by `manifest` exists, or a partition holds this rank's files.
    /// The lock file is left in place when released (removing it would let a third writer lock a new file while a
    /// second still holds the old one).
    pub fn acquire(run_dir: &Path, rank: u32, manifest: &str) -> Result<RunLock, FileError> {
        std::fs::create_dir_all(run_dir).map_err(|source| FileError::CreateDir { dir: run_dir.to_owned(), source })?;
        let path = run_dir.join(lock_file_name(rank));
        let file = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&path)
            .map_err(|source| FileError::Lock { path: path.clone(), source })?;
        match file.try_lock() {
            Ok(()) => {}
            Err(TryLockError::WouldBlock) => return Err(FileError::RunLocked { dir: run_dir.to_owned(), rank }),
            Err(TryLockError::Error(source)) => return Err(FileError::Lock { path, source }),
        }
        // Under the lock: nobody else writes this rank now, so what is on disk is a finished (or crashed) writer's.
        if run_dir.join(manifest).exists() || holds_rank_files(run_dir, rank) {
            return Err(FileError::RunDirInUse(run_dir.to_owned()));
        }
        Ok(RunLock { _file: file, path })
    }

    /// The lock file.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// Whether a partition of the run (Parquet at the top, Arrow IPC under `_arrow_ipc`) has a `rank=<rank>` directory.
fn holds_rank_files(run_dir: &Path, rank: u32) -> bool {
    [run_dir.to_owned(), run_dir.join("_arrow_ipc")].iter().any(|dir| partitions_hold_rank(dir, rank))
}

/// Whether a `hookpoint=…` partition directly under `dir` has a `rank=<rank>` directory.
pub(super) fn partitions_hold_rank(dir: &Path, rank: u32) -> bool {
    let rank_dir = format!("rank={rank}");
    std::fs::read_dir(dir).is_ok_and(|mut entries| {
        entries.any(|e| {
            e.is_ok_and(|e| {
                e.file_name().to_string_lossy().starts_with("hookpoint=") && e.path().join(&rank_dir).exists()
            })
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tempdir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("ringscope-lock-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    #[test]
    fn a_second_writer_of_a_rank_is_refused_while_the_first_holds_it() {
        let dir = tempdir("second");
        let first = RunLock::acquire(&dir, 0, "_ringscope_run.json").unwrap();
        assert!(first.path().ends_with("_ringscope.rank=0.lock"));
        let err = RunLock::acquire(&dir, 0, "_ringscope_run.json").unwrap_err();
        assert!(matches!(err, FileError::RunLocked { rank: 0, .. }), "{err}");
        assert!(err.to_string().contains("export.run_id"), "{err}");
        // Another rank of the same run is another writer's.
        let other = RunLock::acquire(&dir, 1, "_ringscope_run.rank=1.json").unwrap();
        drop((first, other));
        // Released: the rank can be taken again (nothing was written).
        RunLock::acquire(&dir, 0, "_ringscope_run.json").unwrap();
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_rank_already_written_is_refused() {
        let dir = tempdir("written");
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("_ringscope_run.json"), "{}").unwrap();
        let err = RunLock::acquire(&dir, 0, "_ringscope_run.json").unwrap_err();
        assert!(matches!(err, FileError::RunDirInUse(_)), "{err}");
        // Files of rank 2 in an Arrow IPC partition (a crashed writer left no manifest).
        std::fs::create_dir_all(dir.join("_arrow_ipc/hookpoint=h/rank=2")).unwrap();
        let err = RunLock::acquire(&dir, 2, "_ringscope_run.rank=2.json").unwrap_err();
        assert!(matches!(err, FileError::RunDirInUse(_)), "{err}");
        RunLock::acquire(&dir, 3, "_ringscope_run.rank=3.json").unwrap();
        let _ = std::fs::remove_dir_all(&dir);
    }
}
