//! The file under a sink's writer: buffered by us, written through the page cache or with `O_DIRECT`.
//!
//! With `O_DIRECT` the kernel moves the bytes from our buffer to the device without copying them into the page
//! cache first: the copy (and the page-cache pages a dump would otherwise fill, pushing out the engine's) was the
//! largest cost of the Parquet sink after zstd itself (`docs/benchmarks.md`). Direct writes must start at aligned
//! file offsets, come from aligned memory and have aligned lengths, so buffers start on [`ALIGN`] boundaries, only
//! whole aligned blocks are written before the end, and the last block is padded with zeros and the file truncated
//! to its length afterwards. A direct write waits for the device, so direct writes run on a thread of the file's
//! own while the sink fills the next buffer.
//!
//! The Parquet sink compresses its activation column straight into one of these buffers
//! ([`Output::take_buffer`]), which then becomes part of the stream ([`Output::adopt`]) without being copied.
//!
//! Through the page cache, the kernel copies every byte into its own pages anyway, so a file written that way can
//! take large pieces of memory it is lent ([`Output::lend`]: an Arrow IPC batch's activation column, which is a
//! record's memory in the ring) from where they lie: the I/O thread writes them, holding the lent bytes until it
//! has, and the sink thread copies nothing. On a memory-backed file system (tmpfs) `direct_io = "auto"` chooses
//! the page cache for that reason: there, `O_DIRECT` still copies (into the file's pages), only from our buffer.

use std::fs::{File, OpenOptions};
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

use bytes::Bytes;
use crossbeam::channel::{bounded, unbounded, Receiver, Sender};
use parking_lot::Mutex;

use crate::dataset::{DirectIo, Stored};
use crate::storage::Upload;

/// Alignment of direct writes: file offsets, lengths and memory. 4096 covers devices with 512-byte and 4 KiB logical
/// blocks.
pub const ALIGN: usize = 4096;

/// Buffers a file uses at most: the one being filled, one being written, and one for the Parquet sink to compress
/// its next column chunk into meanwhile. Also the most writes queued for a file's I/O thread.
const DIRECT_BUFFERS: usize = 3;

/// Writes of lent memory ([`Output::lend`]) at least this long go to the file from where they lie; shorter ones are
/// copied into the buffer like any other.
const LENT_WRITE_MIN: usize = 16 * ALIGN;

/// Empty buffers of files already finished, for the next ones: a dump rotates files, and fresh buffers of a few MiB
/// each cost page faults (a few percent of the Parquet sink's time when every file got new ones).
static SPARE: Mutex<Vec<Buffer>> = Mutex::new(Vec::new());

/// Most bytes of buffers kept in [`SPARE`].
const SPARE_MAX_BYTES: usize = 64 << 20;

/// A spare buffer of at least `capacity` bytes, or a new one.
fn spare_buffer(capacity: usize) -> io::Result<Buffer> {
    let mut spare = SPARE.lock();
    match spare.iter().position(|b| b.capacity() >= capacity) {
        Some(i) => Ok(spare.swap_remove(i)),
        None => Buffer::with_capacity(capacity),
    }
}

/// Keeps `buffers` for later files, as many as fit in [`SPARE_MAX_BYTES`].
fn keep_spare(buffers: impl IntoIterator<Item = Buffer>) {
    let mut spare = SPARE.lock();
    let mut bytes: usize = spare.iter().map(Buffer::capacity).sum();
    for mut b in buffers {
        if b.capacity() > 0 && bytes + b.capacity() <= SPARE_MAX_BYTES {
            bytes += b.capacity();
            b.clear();
            spare.push(b);
        }
    }
}

/// A buffer in its own anonymous memory mapping: page-aligned (so direct writes can come straight from it), and
/// advised to use transparent huge pages where the kernel offers them (fewer page faults when first touched, and
/// cheaper for the kernel to pin for a direct write). Growing maps a bigger one and copies. [`Buffer::NONE`] maps
/// nothing (it stands in for a buffer moved out).
pub(crate) struct Buffer {
    map: Option<memmap2::MmapMut>,
    len: usize,
}

#[allow(clippy::len_without_is_empty)]
impl Buffer {
    /// A buffer of no memory at all.
    const NONE: Buffer = Buffer { map: None, len: 0 };

    /// Maps a buffer of at least `capacity` bytes. Its size follows the configuration and the records (a batch, a
    /// compressed column chunk), so a mapping the kernel refuses is an error the sink reports (its records counted as
    /// `sink_error`), never a panic or an abort.
    fn with_capacity(capacity: usize) -> io::Result<Self> {
        let capacity = capacity.max(1).checked_next_multiple_of(ALIGN).ok_or_else(|| refused(capacity, None))?;
        let map = memmap2::MmapMut::map_anon(capacity).map_err(|e| refused(capacity, Some(e)))?;
        #[cfg(target_os = "linux")]
        let _ = map.advise(memmap2::Advice::HugePage); // only advice: without huge pages it works as well
        Ok(Buffer { map: Some(map), len: 0 })
    }

    /// Bytes in the buffer.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    fn capacity(&self) -> usize {
        self.map.as_ref().map_or(0, |m| m.len())
    }

    /// All of the memory, filled or not.
    fn memory(&mut self) -> &mut [u8] {
        self.map.as_deref_mut().unwrap_or_default()
    }

    /// The bytes.
    pub(crate) fn bytes(&self) -> &[u8] {
        self.map.as_deref().map_or(&[], |m| &m[..self.len])
    }

    pub(crate) fn bytes_mut(&mut self) -> &mut [u8] {
        let len = self.len;
        &mut self.memory()[..len]
    }

    pub(crate) fn clear(&mut self) {
        self.len = 0;
    }

    pub(crate) fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
    }

    /// Makes room for `n` more bytes (moving to a larger buffer if needed); fails, leaving the buffer as it was,
    /// when the larger buffer cannot be mapped.
    pub(crate) fn reserve(&mut self, n: usize) -> io::Result<()> {
        let need = self.len.checked_add(n).ok_or_else(|| refused(usize::MAX, None))?;
        if need > self.capacity() {
            let mut bigger = Buffer::with_capacity(need.max(self.capacity() + self.capacity() / 4))?;
            bigger.extend(self.bytes())?;
            *self = bigger;
        }
        Ok(())
    }

    pub(crate) fn extend(&mut self, data: &[u8]) -> io::Result<()> {
        self.reserve(data.len())?;
        let len = self.len;
        self.memory()[len..len + data.len()].copy_from_slice(data);
        self.len += data.len();
        Ok(())
    }

    /// The free space after the bytes, to write into and then [`advance`](Self::advance) over.
    pub(crate) fn spare(&mut self) -> &mut [u8] {
        let len = self.len;
        &mut self.memory()[len..]
    }

    /// Counts `n` more bytes written into [`spare`](Self::spare).
    pub(crate) fn advance(&mut self, n: usize) {
        assert!(self.len + n <= self.capacity(), "advanced past the buffer");
        self.len += n;
    }
}

/// The error of an output buffer the kernel would not map.
fn refused(capacity: usize, cause: Option<io::Error>) -> io::Error {
    let cause = cause.map_or_else(|| "the size overflows".to_owned(), |e| e.to_string());
    io::Error::new(
        io::ErrorKind::OutOfMemory,
        format!(
            "cannot map a {capacity}-byte output buffer ({cause}): the sink's batches (`batch_bytes`) or single \
             records are too large for the memory left; free memory or capture smaller records"
        ),
    )
}

/// What the I/O thread writes next.
enum Job {
    /// The first `n` bytes of a buffer, which then goes back to the output.
    Buffer(Buffer, usize),
    /// Lent bytes (page-cache files only), released once written.
    Lent(Bytes),
    /// Every byte was sent: the file is finished (an upload is completed). A thread whose jobs end without this
    /// was abandoned (its file failed): an upload is then aborted.
    End,
}

/// Where an I/O thread puts the bytes.
enum Target {
    /// A local file, opened with `O_DIRECT` if `direct`; `offset` bytes written so far. With `fallback`
    /// (`DirectIo::Auto` on a file opened with `O_DIRECT`: the output's [`Output::is_direct`] flag), a file system that
    /// opened the file with `O_DIRECT` but rejects a direct write as invalid gets the file reopened without it (the
    /// flag cleared), and the write is retried from where it stopped.
    File { file: File, direct: bool, fallback: Option<Arc<AtomicBool>>, offset: u64 },
    /// A multipart upload: parts go out as they fill.
    Object(Upload),
}

/// Where the bytes go: the file's I/O thread, or nowhere after a failure.
enum Writer {
    Thread {
        jobs: Sender<Job>,
        done: Receiver<Buffer>,
        thread: JoinHandle<io::Result<Stored>>,
    },
    /// A write failed; every later call reports this.
    Failed(String),
}

/// A file being written (see the module docs). Bytes written through [`Write`] are buffered and reach the file in
/// large writes; [`finish`](Self::finish) writes the rest and returns the file.
pub struct Output {
    path: PathBuf,
    /// Opened with `O_DIRECT`: writes are aligned and the last block padded.
    direct: bool,
    /// Takes lent memory ([`lend`](Self::lend)): a file written through the page cache.
    lendable: bool,
    /// Still written with `O_DIRECT`: cleared by the I/O thread when `auto` falls back to the page cache.
    direct_writes: Arc<AtomicBool>,
    buffer_bytes: usize,
    current: Buffer,
    /// Stream bytes before `current`'s first byte (always a multiple of [`ALIGN`]).
    shipped: u64,
    /// Empty buffers for reuse.
    pool: Vec<Buffer>,
    /// Buffers this file made (direct I/O: at most [`DIRECT_BUFFERS`], unless none was being written when more
    /// were needed).
    made: usize,
    /// Buffers handed to the I/O thread and not back yet.
    in_flight: usize,
    /// Memory whose bytes may be written from where they lie ([`lend`](Self::lend)).
    lent: Option<Bytes>,
    /// Bytes written from lent memory so far.
    lent_written: u64,
    writer: Writer,
}

impl std::fmt::Debug for Output {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Output").field("path", &self.path).field("direct", &self.direct).finish_non_exhaustive()
    }
}

impl Output {
    /// Creates (or truncates) `path`, buffering writes in buffers of `buffer_bytes`.
    pub fn create(path: &Path, direct_io: DirectIo, buffer_bytes: usize) -> io::Result<Output> {
        let plain = || OpenOptions::new().write(true).create(true).truncate(true).open(path);
        let (file, direct) = match direct_io {
            DirectIo::Off => (plain()?, false),
            DirectIo::On => (open_direct(path)?, true),
            DirectIo::Auto if memory_backed(path) => (plain()?, false),
            DirectIo::Auto => match open_direct(path) {
                Ok(file) => (file, true),
                Err(e) if e.kind() == io::ErrorKind::InvalidInput || e.kind() == io::ErrorKind::Unsupported => {
                    (plain()?, false)
                }
                Err(e) => return Err(e),
            },
        };
        let direct_writes = Arc::new(AtomicBool::new(direct));
        let fallback = (direct && direct_io == DirectIo::Auto).then(|| direct_writes.clone());
        Self::start(path, Target::File { file, direct, fallback, offset: 0 }, direct_writes, buffer_bytes)
    }

    /// An output whose bytes go to `upload` (shown as `path`): through our buffers like a page-cache file (lent
    /// memory is uploaded from where it lies), the upload completed by [`finish`](Self::finish) and aborted when
    /// the output is dropped unfinished.
    pub fn upload(upload: Upload, path: &Path, buffer_bytes: usize) -> io::Result<Output> {
        Self::start(path, Target::Object(upload), Arc::new(AtomicBool::new(false)), buffer_bytes)
    }

    fn start(path: &Path, target: Target, direct_writes: Arc<AtomicBool>, buffer_bytes: usize) -> io::Result<Output> {
        let direct = matches!(target, Target::File { direct: true, .. });
        let lendable = matches!(target, Target::File { direct: false, .. });
        let buffer_bytes = buffer_bytes.max(ALIGN).next_multiple_of(ALIGN);
        // Writes wait for the device (direct I/O), copy into the page cache or wait for the network: on a thread of
        // the file's own, while the sink fills the next buffer.
        let (jobs, job_rx) = bounded::<Job>(DIRECT_BUFFERS);
        let (done_tx, done) = unbounded(); // never blocks the I/O thread: buffers are few anyway
        let thread = {
            let path = path.to_owned();
            std::thread::Builder::new()
                .name("ringscope-io".into())
                .spawn(move || write_jobs(target, &path, &job_rx, &done_tx))?
        };
        Ok(Output {
            path: path.to_owned(),
            direct,
            lendable,
            direct_writes,
            buffer_bytes,
            current: spare_buffer(buffer_bytes)?,
            shipped: 0,
            pool: Vec::new(),
            made: 1,
            in_flight: 0,
            lent: None,
            lent_written: 0,
            writer: Writer::Thread { jobs, done, thread },
        })
    }

    /// Whether writes bypass the page cache (so far: with `auto`, a file system that rejects a direct write makes
    /// the rest go through the page cache).
    pub fn is_direct(&self) -> bool {
        self.direct_writes.load(Ordering::Relaxed)
    }

    /// A handle on [`is_direct`](Self::is_direct) that outlives the output: final once the file is finished.
    pub(crate) fn direct_writes(&self) -> Arc<AtomicBool> {
        self.direct_writes.clone()
    }

    /// Bytes of the stream so far.
    pub fn position(&self) -> u64 {
        self.shipped + self.current.len() as u64
    }

    /// Bytes of the stream written from lent memory ([`lend`](Self::lend)), not copied.
    #[cfg(test)]
    pub(crate) fn lent_written(&self) -> u64 {
        self.lent_written
    }

    /// An empty buffer (of at least the buffer size) to fill and [`adopt`](Self::adopt), or give back with
    /// [`recycle`](Self::recycle). This may wait for the I/O thread to finish a write.
    pub(crate) fn take_buffer(&mut self) -> io::Result<Buffer> {
        self.collect_done();
        if let Some(b) = self.pool.pop() {
            return Ok(b);
        }
        if let Writer::Thread { done, .. } = &self.writer {
            // Wait for one to come back only if one is on its way.
            if self.made >= DIRECT_BUFFERS && self.in_flight > 0 {
                match done.recv() {
                    Ok(mut b) => {
                        self.in_flight -= 1;
                        b.clear();
                        return Ok(b);
                    }
                    Err(_) => return Err(self.fail()),
                }
            }
        }
        let buffer = spare_buffer(self.buffer_bytes)?;
        self.made += 1;
        Ok(buffer)
    }

    /// Takes back a buffer from [`take_buffer`](Self::take_buffer) that was not adopted.
    pub(crate) fn recycle(&mut self, mut buffer: Buffer) {
        buffer.clear();
        self.pool.push(buffer);
    }

    /// Makes `chunk` the rest of the stream: its first `lead` bytes stand for the last `lead` bytes already in the
    /// stream (which must be `position() % ALIGN`; they are copied in), the bytes after them follow the stream.
    /// Everything before goes to the file; `chunk` is then written from its first, aligned byte — no copy.
    pub(crate) fn adopt(&mut self, mut chunk: Buffer, lead: usize) -> io::Result<()> {
        let tail = self.current.len() % ALIGN;
        if lead != tail || chunk.len() < lead {
            return Err(io::Error::other(format!(
                "{}: a buffer adopted at byte {} must lead with its last {tail} bytes (it leads with {lead} of {})",
                self.path.display(),
                self.position(),
                chunk.len()
            )));
        }
        let whole = self.current.len() - tail;
        chunk.bytes_mut()[..lead].copy_from_slice(&self.current.bytes()[whole..]);
        self.current.truncate(whole);
        let full = std::mem::replace(&mut self.current, chunk);
        self.send(full, whole)
    }

    /// Lets the next writes of `bytes`' memory (any part of it, [`LENT_WRITE_MIN`] bytes or more) go to the file from
    /// where they lie, until the next call (`None`: none). Only a file written through the page cache takes them so
    /// (a direct write needs aligned memory; an upload would hold them — ring memory — until a whole part is
    /// uploaded, which may need more of the ring than there is); the I/O thread holds a clone of `bytes` until it
    /// has written them.
    pub(crate) fn lend(&mut self, bytes: Option<Bytes>) {
        self.lent = bytes.filter(|_| self.lendable);
    }

    /// Writes everything and returns the file, truncated to the stream's length (a direct write pads its last
    /// block; the caller syncs it), or the completed upload's object.
    pub fn finish(mut self) -> io::Result<Stored> {
        let len = self.position();
        let filled = self.current.len();
        let total = if self.direct { filled.next_multiple_of(ALIGN) } else { filled };
        self.current.extend(&[0; ALIGN][..total - filled])?;
        let last = std::mem::replace(&mut self.current, Buffer::NONE);
        self.send(last, total)?;
        self.queue(Job::End)?;
        let stored = match std::mem::replace(&mut self.writer, Writer::Failed("finished".into())) {
            Writer::Thread { jobs, thread, done } => {
                drop(jobs); // the thread ends after the last job
                let stored = join(thread, &self.path)?;
                self.pool.extend(done.try_iter());
                stored
            }
            Writer::Failed(message) => return Err(io::Error::other(message)),
        };
        if let Stored::File(file) = &stored {
            if total != filled {
                file.set_len(len)?;
            }
        }
        Ok(stored)
    }

    /// Sends the first `n` bytes of `buffer` (a multiple of [`ALIGN`] unless it is the last) to the file; `shipped`
    /// advances by `n`.
    fn send(&mut self, buffer: Buffer, n: usize) -> io::Result<()> {
        if n == 0 {
            self.recycle(buffer);
            return Ok(());
        }
        self.queue(Job::Buffer(buffer, n))?;
        self.in_flight += 1;
        Ok(())
    }

    /// Hands `job` to the I/O thread (waiting while it has [`DIRECT_BUFFERS`] queued); `shipped` advances by its
    /// length.
    fn queue(&mut self, job: Job) -> io::Result<()> {
        let n = match &job {
            Job::Buffer(_, n) => *n,
            Job::Lent(bytes) => bytes.len(),
            Job::End => 0,
        };
        let sent = match &self.writer {
            Writer::Thread { jobs, .. } => jobs.send(job).is_ok(),
            Writer::Failed(message) => return Err(io::Error::other(message.clone())),
        };
        if !sent {
            return Err(self.fail());
        }
        self.shipped += n as u64;
        Ok(())
    }

    /// Writes `data`, which lies in `lent`, from where it lies: its first bytes are copied into the buffer up to a
    /// block boundary of the stream, whole blocks go to the I/O thread as they are, and the last partial block is
    /// copied into the next buffer (so that what is shipped stays whole blocks, which [`adopt`](Self::adopt) counts
    /// on).
    fn write_lent(&mut self, data: &[u8], lent: &Bytes) -> io::Result<()> {
        let head = (ALIGN - (self.position() % ALIGN as u64) as usize) % ALIGN;
        self.write_all(&data[..head])?;
        let whole = (data.len() - head) / ALIGN * ALIGN;
        if self.current.len() > 0 {
            let next = self.take_buffer()?;
            let full = std::mem::replace(&mut self.current, next);
            let n = full.len();
            self.send(full, n)?;
        }
        self.queue(Job::Lent(lent.slice_ref(&data[head..head + whole])))?;
        self.lent_written += whole as u64;
        self.current.extend(&data[head + whole..])
    }

    /// Buffers the I/O thread is done with, back to the pool.
    fn collect_done(&mut self) {
        if let Writer::Thread { done, .. } = &self.writer {
            for mut b in done.try_iter() {
                self.in_flight -= 1;
                b.clear();
                self.pool.push(b);
            }
        }
    }

    /// The I/O thread stopped: its error, remembered for every later call.
    fn fail(&mut self) -> io::Error {
        let message = match std::mem::replace(&mut self.writer, Writer::Failed(String::new())) {
            Writer::Thread { jobs, thread, .. } => {
                drop(jobs);
                match join(thread, &self.path) {
                    Err(e) => e.to_string(),
                    Ok(_) => format!("{}: the I/O thread stopped", self.path.display()),
                }
            }
            Writer::Failed(message) => message,
        };
        self.writer = Writer::Failed(message.clone());
        io::Error::other(message)
    }
}

impl Drop for Output {
    fn drop(&mut self) {
        let current = std::mem::replace(&mut self.current, Buffer::NONE);
        keep_spare(self.pool.drain(..).chain([current]));
    }
}

impl Write for Output {
    fn write(&mut self, data: &[u8]) -> io::Result<usize> {
        if data.len() >= LENT_WRITE_MIN {
            if let Some(lent) = self.lent.take() {
                let within = lent.as_ptr_range();
                let inside = within.start <= data.as_ptr() && data.as_ptr_range().end <= within.end;
                let written = if inside { Some(self.write_lent(data, &lent)) } else { None };
                self.lent = Some(lent);
                if let Some(written) = written {
                    return written.map(|()| data.len());
                }
            }
        }
        let room = self.buffer_bytes.max(self.current.capacity()) - self.current.len();
        if room >= ALIGN || room >= data.len() {
            let n = data.len().min(room);
            self.current.extend(&data[..n])?;
            return Ok(n);
        }
        // Full: send its whole blocks, carry the rest (less than a block) over to an empty buffer.
        let mut next = self.take_buffer()?;
        let whole = self.current.len() - self.current.len() % ALIGN;
        next.extend(&self.current.bytes()[whole..])?;
        let full = std::mem::replace(&mut self.current, next);
        self.send(full, whole)?;
        let n = data.len().min(self.buffer_bytes - self.current.len());
        self.current.extend(&data[..n])?;
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(()) // bytes reach the file in whole buffers, and all of them in `finish`
    }
}

#[cfg(target_os = "linux")]
fn open_direct(path: &Path) -> io::Result<File> {
    use std::os::unix::fs::OpenOptionsExt;
    OpenOptions::new().write(true).create(true).truncate(true).custom_flags(libc::O_DIRECT).open(path).map_err(|e| {
        io::Error::new(e.kind(), format!("cannot open {} with O_DIRECT: {e} (set direct_io to off)", path.display()))
    })
}

#[cfg(not(target_os = "linux"))]
fn open_direct(path: &Path) -> io::Result<File> {
    Err(io::Error::new(
        io::ErrorKind::Unsupported,
        format!("cannot open {} with O_DIRECT: only supported on Linux (set direct_io to off)", path.display()),
    ))
}

/// The I/O thread: writes each job's bytes in order to `target` and hands buffers back; stops at the first error.
/// Returns the file, or the object of the upload it completed at [`Job::End`] (an upload whose jobs end without it
/// is aborted, and is an error).
fn write_jobs(mut target: Target, path: &Path, jobs: &Receiver<Job>, done: &Sender<Buffer>) -> io::Result<Stored> {
    let mut ended = false;
    for job in jobs {
        match job {
            Job::Buffer(buffer, n) => {
                target.write(&buffer.bytes()[..n], path)?;
                let _ = done.send(buffer); // the file may be finishing and no longer take buffers back
            }
            Job::Lent(bytes) => target.write(&bytes, path)?,
            Job::End => ended = true,
        }
    }
    match target {
        Target::File { file, .. } => Ok(Stored::File(file)),
        Target::Object(upload) if ended => Ok(Stored::Object { bytes: upload.complete()? }),
        Target::Object(upload) => {
            drop(upload); // aborted: no object appears
            Err(io::Error::other(format!("{}: the upload was abandoned (its file failed)", path.display())))
        }
    }
}

impl Target {
    /// Writes all of `bytes`.
    fn write(&mut self, mut bytes: &[u8], path: &Path) -> io::Result<()> {
        let (file, direct, fallback, offset) = match self {
            Target::Object(upload) => return upload.write(bytes),
            Target::File { file, direct, fallback, offset } => (file, direct, fallback, offset),
        };
        while !bytes.is_empty() {
            match file.write(bytes) {
                Ok(0) => return Err(io::Error::new(io::ErrorKind::WriteZero, format!("writing {}", path.display()))),
                Ok(k) => {
                    bytes = &bytes[k..];
                    *offset += k as u64;
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == io::ErrorKind::InvalidInput && fallback.is_some() => {
                    fallback.take().into_iter().for_each(|direct| direct.store(false, Ordering::Relaxed));
                    *direct = false;
                    *file = OpenOptions::new().write(true).open(path)?;
                    io::Seek::seek(file, io::SeekFrom::Start(*offset))?;
                }
                Err(e) => {
                    let how = if *direct { " (O_DIRECT)" } else { "" };
                    return Err(io::Error::new(e.kind(), format!("writing {}{how}: {e}", path.display())));
                }
            }
        }
        Ok(())
    }
}

/// Whether the file system that would hold `path` keeps files in memory (tmpfs, ramfs): there the kernel copies a
/// direct write into the file's pages like any other, so `O_DIRECT` saves nothing and costs the lent writes.
#[cfg(target_os = "linux")]
fn memory_backed(path: &Path) -> bool {
    let dir = path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
    /// ramfs's `f_type` (`RAMFS_MAGIC` in linux/magic.h; not in the libc crate).
    const RAMFS_MAGIC: i64 = 0x8584_58f6;
    // `f_type`'s integer type differs between architectures (a signed long, or u32); all convert to i64.
    #[allow(clippy::useless_conversion)] // i64 already on x86_64 and aarch64
    rustix::fs::statfs(dir).is_ok_and(|fs| {
        let kind = i64::from(fs.f_type);
        kind == i64::from(libc::TMPFS_MAGIC) || kind == RAMFS_MAGIC
    })
}

#[cfg(not(target_os = "linux"))]
fn memory_backed(_: &Path) -> bool {
    false
}

fn join(thread: JoinHandle<io::Result<Stored>>, path: &Path) -> io::Result<Stored> {
    thread.join().unwrap_or_else(|_| Err(io::Error::other(format!("{}: the I/O thread panicked", path.display()))))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> PathBuf {
        std::env::temp_dir().join(format!("ringscope-output-{name}-{}", std::process::id()))
    }

    #[test]
    fn a_buffer_the_kernel_refuses_is_an_error_not_a_panic() {
        let overflow = Buffer::with_capacity(usize::MAX - 1).err().expect("a size that overflows is refused");
        assert!(overflow.to_string().contains("the size overflows"), "{overflow}");
        // More than the address space: the kernel refuses the mapping whatever the overcommit setting.
        let dir = scratch("refused");
        std::fs::create_dir_all(&dir).unwrap();
        let err = Output::create(&dir.join("f"), DirectIo::Off, 1 << 62).expect_err("a 4 EiB buffer is refused");
        assert_eq!(err.kind(), io::ErrorKind::OutOfMemory, "{err}");
        assert!(err.to_string().contains("cannot map a 4611686018427387904-byte output buffer"), "{err}");
        let mut out = Output::create(&dir.join("g"), DirectIo::Off, ALIGN).unwrap();
        let mut chunk = out.take_buffer().unwrap();
        assert!(chunk.reserve(1 << 62).is_err(), "growing past the address space is refused");
        chunk.extend(b"still usable").unwrap();
        assert_eq!(chunk.bytes(), b"still usable");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn every_byte_reaches_the_file_in_order_and_the_padding_is_cut() {
        let path = scratch("bytes");
        let data: Vec<u8> = (0..100_003u32).map(|i| (i * 7 % 253) as u8).collect();
        for direct_io in [DirectIo::Off, DirectIo::Auto] {
            for piece in [1, 1000, 4096, 4097, 100_003] {
                let mut out = Output::create(&path, direct_io, 3 * ALIGN).unwrap();
                for p in data.chunks(piece) {
                    out.write_all(p).unwrap();
                }
                assert_eq!(out.position(), data.len() as u64);
                out.finish().unwrap();
                assert_eq!(std::fs::read(&path).unwrap(), data, "{direct_io:?}, writes of {piece}");
            }
            // An adopted buffer joins the stream where it stands, however big.
            let mut out = Output::create(&path, direct_io, ALIGN).unwrap();
            out.write_all(&data[..5000]).unwrap();
            let mut chunk = out.take_buffer().unwrap();
            chunk.extend(&[0; 5000 % ALIGN]).unwrap();
            chunk.extend(&data[5000..90_000]).unwrap();
            let short = out.take_buffer().unwrap();
            let e = out.adopt(short, 0).unwrap_err().to_string();
            assert!(e.contains("must lead with its last 904 bytes"), "{e}");
            out.adopt(chunk, 5000 % ALIGN).unwrap();
            assert_eq!(out.position(), 90_000);
            // Buffers taken and kept, more than a direct file uses: none is on its way back, so none is waited for.
            let kept: Vec<Buffer> = (0..2 * DIRECT_BUFFERS).map(|_| out.take_buffer().unwrap()).collect();
            kept.into_iter().for_each(|b| out.recycle(b));
            out.write_all(&data[90_000..]).unwrap();
            out.finish().unwrap();
            assert_eq!(std::fs::read(&path).unwrap(), data, "{direct_io:?}, adopted");
        }
        let _ = std::fs::remove_file(&path);
    }

    #[test]
    fn lent_memory_goes_to_a_page_cache_file_as_it_lies_and_is_released_once_written() {
        let path = scratch("lent");
        let data: Vec<u8> = (0..300_007u32).map(|i| (i * 13 % 251) as u8).collect();
        let lent = Bytes::from(data[1000..250_000].to_vec());
        let outside = data[250_000..].to_vec(); // long enough, but not lent memory: copied
        for head in [0, 1000] {
            for direct_io in [DirectIo::Off, DirectIo::Auto] {
                let mut out = Output::create(&path, direct_io, 3 * ALIGN).unwrap();
                out.write_all(&data[..1000 - head]).unwrap();
                out.lend(Some(lent.clone()));
                // A write of a part of the lent memory, then the rest of it, each at an unaligned stream offset.
                out.write_all(&data[1000 - head..1000]).unwrap();
                out.write_all(&lent[..100_001]).unwrap();
                out.write_all(&lent[100_001..]).unwrap();
                out.write_all(&outside).unwrap();
                out.lend(None);
                assert_eq!(out.position(), data.len() as u64);
                let direct = out.is_direct();
                let lent_written = out.lent_written();
                out.finish().unwrap();
                assert_eq!(std::fs::read(&path).unwrap(), data, "{direct_io:?}, head {head}");
                if direct {
                    assert_eq!(lent_written, 0, "a direct write needs aligned memory: lent memory is copied");
                } else {
                    // All of the lent memory but the partial blocks at each write's two ends went as it lies.
                    assert!(
                        lent_written > 249_000 - 4 * ALIGN as u64 && lent_written.is_multiple_of(ALIGN as u64),
                        "{lent_written}"
                    );
                }
                assert!(lent.is_unique(), "the I/O thread let go of the lent memory once written");
            }
        }
        // A write the file system refuses: the error names the file, however the bytes came.
        #[cfg(target_os = "linux")]
        {
            let mut out = Output::create(Path::new("/dev/full"), DirectIo::Off, ALIGN).unwrap();
            out.lend(Some(lent.clone()));
            let e = (0..8).find_map(|_| out.write_all(&lent).err()).or_else(|| out.finish().err()).unwrap();
            assert!(e.to_string().contains("/dev/full"), "{e}");
        }
        let _ = std::fs::remove_file(&path);
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn auto_writes_through_the_page_cache_on_tmpfs() {
        let mounts = std::fs::read_to_string("/proc/mounts").unwrap_or_default();
        let shm_is_tmpfs = mounts.lines().any(|l| l.split(' ').skip(1).take(2).eq(["/dev/shm", "tmpfs"]));
        if !shm_is_tmpfs {
            return; // nothing memory-backed known here
        }
        let path = Path::new("/dev/shm").join(format!("ringscope-output-auto-{}", std::process::id()));
        assert!(memory_backed(&path));
        let out = Output::create(&path, DirectIo::Auto, ALIGN).unwrap();
        assert!(!out.is_direct(), "tmpfs: auto chose the page cache");
        drop(out);
        let _ = std::fs::remove_file(&path);
        assert!(!memory_backed(Path::new("/proc/self/status")), "procfs is not tmpfs");
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn a_direct_write_the_file_system_rejects_falls_back_to_the_page_cache_in_auto_mode() {
        // A write of an unaligned length is what a file system that opened a file with O_DIRECT rejects.
        let path = scratch("fallback");
        let Ok(mut probe) = open_direct(&path) else { return }; // no O_DIRECT here: nothing to fall back from
        if probe.write_all(&Buffer::with_capacity(ALIGN).unwrap().memory()[..100]).is_ok() {
            return; // this file system (tmpfs) takes unaligned direct writes: nothing is rejected
        }
        for fallback in [true, false] {
            let direct = Arc::new(AtomicBool::new(true));
            let file = open_direct(&path).unwrap();
            let (jobs, job_rx) = bounded(2);
            let (done_tx, done) = bounded(2);
            let mut aligned = Buffer::with_capacity(ALIGN).unwrap();
            aligned.extend(&[7; ALIGN]).unwrap();
            let mut odd = Buffer::with_capacity(ALIGN).unwrap();
            odd.extend(&[9; 100]).unwrap();
            jobs.send(Job::Buffer(aligned, ALIGN)).unwrap();
            jobs.send(Job::Buffer(odd, 100)).unwrap();
            drop(jobs);
            let target = Target::File { file, direct: true, fallback: fallback.then(|| direct.clone()), offset: 0 };
            match write_jobs(target, &path, &job_rx, &done_tx) {
                Ok(_) => {
                    assert!(fallback, "the unaligned direct write was accepted only through the fallback");
                    assert!(!direct.load(Ordering::Relaxed), "the file says it fell back");
                    let mut want = vec![7; ALIGN];
                    want.extend([9; 100]);
                    assert_eq!(std::fs::read(&path).unwrap(), want);
                    assert_eq!(done.try_iter().count(), 2, "both buffers come back");
                }
                Err(e) => {
                    assert!(!fallback, "{e}");
                    assert!(e.to_string().contains("O_DIRECT"), "{e}");
                }
            }
        }
        let _ = std::fs::remove_file(&path);
    }

    #[test]
    fn bad_settings_and_failed_writes_are_errors_naming_the_file() {
        assert_eq!("on".parse(), Ok(DirectIo::On));
        assert!("yes".parse::<DirectIo>().unwrap_err().to_string().contains("expected auto, on or off"));
        // A directory that does not exist.
        let e = Output::create(&scratch("missing").join("f"), DirectIo::Auto, ALIGN).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::NotFound);
        // With `on`, what failed is named: the file and O_DIRECT, and what to do about it.
        let missing = scratch("missing").join("f");
        let e = Output::create(&missing, DirectIo::On, ALIGN).unwrap_err().to_string();
        assert!(e.contains(&missing.display().to_string()) && e.contains("O_DIRECT") && e.contains("direct_io"), "{e}");
        // A device that is always full: the error names it, and every later call fails too (the I/O thread's error,
        // through the page cache or with O_DIRECT where the device takes it).
        #[cfg(target_os = "linux")]
        for direct_io in [DirectIo::Off, DirectIo::On] {
            let Ok(mut out) = Output::create(Path::new("/dev/full"), direct_io, ALIGN) else { continue };
            let mut failed = None;
            for _ in 0..64 {
                if let Err(e) = out.write_all(&[1; 1000]) {
                    failed = Some(e.to_string());
                    break;
                }
            }
            let e = failed.or_else(|| out.finish().err().map(|e| e.to_string())).expect("writing to /dev/full fails");
            assert!(e.contains("/dev/full"), "{direct_io:?}: {e}");
        }
    }
}
