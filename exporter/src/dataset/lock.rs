//! One writer per run and rank: [`RunLock`].
//!
//! Two sessions given the same `export.dir`, `run_id` and rank would write the same file names (`part-00000.*`) and
//! the same manifest: the later one's files replace the earlier one's, and rows vanish without an error. A session
//! that writes files therefore holds an exclusive advisory lock on `<run_dir>/_ringscope.rank=<rank>.lock` until its
//! manifest is written, and refuses to start when another holds it or when this rank's part of the run is already
//! written.
//! The operating system drops the lock when its holder exits, however it exits: a crashed writer leaves no stale
//! lock behind (its files, if any, still make the rank "already written").
//!
//! **On object storage** there is no lock to hold: a writer claims the rank by writing an object of its own,
//! `<run_dir>/_ringscope.rank=<rank>.lock/<writer>` (a name no other writer uses: host, process and clock), and then
//! lists that prefix. It goes on only if its claim is the only one there; otherwise it deletes its claim and is
//! refused. With the read-after-write listing S3, GCS and Azure give, two writers can never both go on: the one that
//! lists second sees the other's claim. (Both may be refused when they start at the same moment: nothing is written,
//! and either can start again.) A claim is removed when its holder lets go of it — at shutdown, once the manifest is
//! written, or when the session fails to start — so, as on disk, what marks a rank written is its manifest or its
//! files. A writer that crashed leaves its claim: the rank stays refused until the claim object is deleted by hand
//! (with no writer of the rank alive).

use std::fs::{File, OpenOptions, TryLockError};
use std::path::{Path, PathBuf};

use super::FileError;
use crate::storage::ObjectStorage;

/// The lock file's name for `rank`; the leading `_` keeps dataset readers from taking it for data.
pub fn lock_file_name(rank: u32) -> String {
    format!("_ringscope.rank={rank}.lock")
}

/// An exclusive hold on one rank of a run directory (see the module docs); released when dropped.
#[derive(Debug)]
pub struct RunLock {
    _file: Option<File>,
    path: PathBuf,
    /// On object storage: the store holding the claim `path`, deleted on drop.
    claim: Option<ObjectStorage>,
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
        Ok(RunLock { _file: Some(file), path, claim: None })
    }

    /// [`acquire`](Self::acquire) for a run on object storage (see the module docs): fails with
    /// [`FileError::RunLocked`] when another writer claims the rank, and with [`FileError::RunDirInUse`] when its
    /// manifest or files are there.
    pub fn acquire_object(
        storage: &ObjectStorage,
        run_dir: &Path,
        rank: u32,
        manifest: &str,
    ) -> Result<RunLock, FileError> {
        let claims = run_dir.join(lock_file_name(rank));
        let lock_error = |source| FileError::Lock { path: claims.clone(), source };
        if storage.exists(&run_dir.join(manifest)).map_err(lock_error)?
            || object_rank_written(storage, run_dir, rank).map_err(lock_error)?
        {
            return Err(FileError::RunDirInUse(run_dir.to_owned()));
        }
        if !storage.list(&claims).map_err(lock_error)?.is_empty() {
            return Err(FileError::RunLocked { dir: run_dir.to_owned(), rank });
        }
        let path = claims.join(writer_name());
        let started = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
        let claim = serde_json::json!({ "pid": std::process::id(), "started_unix_s": started.as_secs_f64() });
        // From here on the claim may be in the store (a PUT that timed out may still have landed): held by `lock`,
        // whose drop deletes it, whatever happens next.
        let lock = RunLock { _file: None, path: path.clone(), claim: Some(storage.clone()) };
        storage.put(&path, claim.to_string().into()).map_err(lock_error)?;
        let claimed = storage.list(&claims).map_err(lock_error)?;
        if claimed != [path] {
            return Err(FileError::RunLocked { dir: run_dir.to_owned(), rank });
        }
        Ok(lock)
    }

    /// The lock file.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for RunLock {
    /// Lets go of the rank: the lock file's lock goes with the file handle; a claim object is deleted (a failure is
    /// only logged by its absence of effect: the claim then stays, as a crashed writer's would).
    fn drop(&mut self) {
        if let Some(storage) = &self.claim {
            let _ = storage.delete(&self.path);
        }
    }
}

/// Whether a partition of the run (Parquet at the top, Arrow IPC under `_arrow_ipc`) has a `rank=<rank>` directory.
fn holds_rank_files(run_dir: &Path, rank: u32) -> bool {
    [run_dir.to_owned(), run_dir.join("_arrow_ipc")].iter().any(|dir| partitions_hold_rank(dir, rank))
}

/// A name for this writer no other uses: host, process, the clock's nanoseconds.
fn writer_name() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .map(|h| h.trim().chars().filter(|c| c.is_ascii_alphanumeric() || *c == '-').collect::<String>())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "host".into());
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_nanos();
    format!("{host}-{}-{nanos}", std::process::id())
}

/// [`holds_rank_files`] on object storage: whether a partition of the run (Parquet or Arrow IPC) has an object
/// under `rank=<rank>/`.
pub(super) fn object_rank_written(storage: &ObjectStorage, run_dir: &Path, rank: u32) -> std::io::Result<bool> {
    let rank_dir = format!("rank={rank}");
    for dir in [run_dir.to_owned(), run_dir.join("_arrow_ipc")] {
        for name in storage.list_names(&dir)? {
            if name.starts_with("hookpoint=") && !storage.list(&dir.join(&name).join(&rank_dir))?.is_empty() {
                return Ok(true);
            }
        }
    }
    Ok(false)
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

    #[test]
    fn on_object_storage_a_rank_has_one_writer_and_is_written_once() {
        let storage = crate::testing::memory_storage();
        let run = storage.root().join("run-1");
        let first = RunLock::acquire_object(&storage, &run, 0, "_ringscope_run.json").unwrap();
        assert!(first.path().starts_with(run.join("_ringscope.rank=0.lock")), "{}", first.path().display());
        let err = RunLock::acquire_object(&storage, &run, 0, "_ringscope_run.json").unwrap_err();
        assert!(matches!(err, FileError::RunLocked { rank: 0, .. }), "{err}");
        assert!(err.to_string().contains("memory://bucket/dumps/run-1"), "{err}");
        // Let go of (a session that failed to start, or shut down): the claim is gone, the rank free again
        // (nothing was written).
        drop(first);
        assert!(storage.list(&run.join(lock_file_name(0))).unwrap().is_empty());
        let again = RunLock::acquire_object(&storage, &run, 0, "_ringscope_run.json").unwrap();
        // Another rank of the same run is another writer's.
        let other = RunLock::acquire_object(&storage, &run, 1, "_ringscope_run.rank=1.json").unwrap();
        drop((again, other));
        // A claim left by a crashed writer (or one that raced this one): refused.
        storage.put(&run.join(lock_file_name(2)).join("crashed-writer"), "{}".into()).unwrap();
        let err = RunLock::acquire_object(&storage, &run, 2, "_ringscope_run.rank=2.json").unwrap_err();
        assert!(matches!(err, FileError::RunLocked { rank: 2, .. }), "{err}");
        // A rank whose files are there (a writer that crashed before its manifest) is written.
        storage.put(&run.join("hookpoint=h/rank=5/part-00000.parquet"), "x".into()).unwrap();
        let err = RunLock::acquire_object(&storage, &run, 5, "_ringscope_run.rank=5.json").unwrap_err();
        assert!(matches!(err, FileError::RunDirInUse(_)), "{err}");
        storage.put(&run.join("_ringscope_run.rank=6.json"), "{}".into()).unwrap();
        let err = RunLock::acquire_object(&storage, &run, 6, "_ringscope_run.rank=6.json").unwrap_err();
        assert!(matches!(err, FileError::RunDirInUse(_)), "{err}");
        RunLock::acquire_object(&storage, &run, 7, "_ringscope_run.rank=7.json").unwrap();
    }
}
