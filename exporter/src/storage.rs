//! Object storage: a run written to S3 (and S3-compatible stores), Google Cloud Storage or Azure Blob Storage
//! instead of a local directory, through Apache Arrow's [`object_store`] crate.
//!
//! A run on object storage has the layout it has on disk (`<prefix>/<run_id>/hookpoint=…/rank=…/part-NNNNN.parquet`,
//! the events table, the manifests), so every reader that opens a run directory opens the same prefix. What differs
//! is how a file becomes visible: on disk it is written under a hidden name and renamed; here it is a **multipart
//! upload** to its final name, streamed part by part while the file is written and completed once its footer is
//! written — an object store shows an upload only when it is completed, so a reader never sees half a file, and an
//! upload that fails is aborted and leaves nothing a reader lists. Small files (the events table, the manifest) are
//! one `PUT` each.
//!
//! **Memory per open file**: the file's own buffers (as on disk: up to three of about `batch_bytes`), plus the part
//! being filled and at most `concurrency` parts in flight, each `part_bytes` ([`ObjectStorage::memory_per_file`]).
//!
//! **Faults**: each request is retried with exponential backoff ([`StorageOptions::max_retries`] times, for at most
//! [`StorageOptions::retry_timeout`]); a request that still fails fails its file, whose records are counted as
//! `sink_error` drops like those of a disk that fails. Errors name the object's URL, never a credential.
//!
//! **Credentials** come the way the crate's builders take them: the standard environment variables (`AWS_*`,
//! `GOOGLE_*`, `AZURE_*`, including `AWS_ENDPOINT_URL` and `AWS_ALLOW_HTTP` for an S3-compatible server), then the
//! [`StorageOptions::options`] given explicitly (the builders' configuration keys: `aws_endpoint`,
//! `aws_virtual_hosted_style_request`, `aws_access_key_id`, …), then the cloud's instance or web-identity
//! credentials. For S3, a shared-credentials profile (`AWS_PROFILE`, `~/.aws/credentials` and `~/.aws/config`) is
//! read too when no key is given otherwise.

use std::collections::BTreeMap;
use std::io;
use std::path::{Component, Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures::StreamExt;
use object_store::path::Path as ObjectPath;
use object_store::{ObjectStore, ObjectStoreExt, PutPayload, RetryConfig, WriteMultipart};

/// The smallest part S3 accepts (every part of a multipart upload but the last).
pub const MIN_PART_BYTES: usize = 5 << 20;

/// How a run reaches object storage (`[export]` keys `storage_options`, `upload_part_size`,
/// `upload_concurrency`, `upload_retries`, `upload_retry_timeout` in a session config).
#[derive(Clone, PartialEq, Eq)]
pub struct StorageOptions {
    /// Builder configuration keys and values (`aws_endpoint`, `aws_region`, `google_service_account`, …), applied
    /// after the environment's. Values are never shown (`Debug` prints the keys only).
    pub options: BTreeMap<String, String>,
    /// Size of each uploaded part but the last: at least [`MIN_PART_BYTES`].
    pub part_bytes: usize,
    /// Parts of one file uploaded at once (at least 1).
    pub concurrency: usize,
    /// Retries of a failed request (with exponential backoff from 100 ms).
    pub max_retries: usize,
    /// No retry starts later than this after a request's first attempt.
    pub retry_timeout: Duration,
}

impl Default for StorageOptions {
    fn default() -> Self {
        StorageOptions {
            options: BTreeMap::new(),
            part_bytes: 8 << 20,
            concurrency: 2,
            max_retries: 5,
            retry_timeout: Duration::from_secs(30),
        }
    }
}

impl std::fmt::Debug for StorageOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StorageOptions")
            .field("options", &self.options.keys().collect::<Vec<_>>())
            .field("part_bytes", &self.part_bytes)
            .field("concurrency", &self.concurrency)
            .field("max_retries", &self.max_retries)
            .field("retry_timeout", &self.retry_timeout)
            .finish()
    }
}

/// What went wrong opening or using object storage. Messages name the URL without credentials.
#[derive(Debug, thiserror::Error)]
pub enum StorageError {
    /// The URL is not one this build can write to.
    #[error("export.url {url:?}: {why}")]
    Url {
        /// The URL, shown without credentials or query.
        url: String,
        /// What is wrong with it.
        why: String,
    },
    /// An option is not valid.
    #[error("object storage for {url}: {why}")]
    Options {
        /// The URL, shown without credentials or query.
        url: String,
        /// What is wrong.
        why: String,
    },
    /// The store could not be reached or refused the request (missing bucket, wrong credentials, no network).
    #[error("object storage {url}: {what}: {source}")]
    Store {
        /// The URL, shown without credentials or query.
        url: String,
        /// What was being done.
        what: String,
        /// The store's error.
        #[source]
        source: object_store::Error,
    },
}

/// A bucket (or container) and a prefix in it that runs are written under. Cheap to clone.
#[derive(Clone)]
pub struct ObjectStorage {
    inner: Arc<Inner>,
}

struct Inner {
    store: Arc<dyn ObjectStore>,
    /// `scheme://bucket/prefix`, without credentials, query or trailing `/`: the root of every path this storage is
    /// given ([`ObjectStorage::root`]).
    url: String,
    /// The prefix in the bucket (no leading or trailing `/`), empty for the bucket's root.
    prefix: String,
    options: StorageOptions,
}

impl PartialEq for ObjectStorage {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }
}

impl Eq for ObjectStorage {}

impl std::fmt::Debug for ObjectStorage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ObjectStorage").field("url", &self.inner.url).field("options", &self.inner.options).finish()
    }
}

/// The runtime every upload of the process runs on: two threads, named `ringscope-object`, started on first use — and
/// again in a child process that a fork made after (the parent's threads are not in the child).
fn runtime() -> &'static tokio::runtime::Runtime {
    static RUNTIME: parking_lot::Mutex<Option<(u32, &'static tokio::runtime::Runtime)>> = parking_lot::Mutex::new(None);
    let pid = std::process::id();
    let mut current = RUNTIME.lock();
    match *current {
        Some((owner, runtime)) if owner == pid => runtime,
        _ => {
            let runtime = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .thread_name("ringscope-object")
                .enable_all()
                .build()
                .expect("a tokio runtime of two threads (the process is out of threads or memory)");
            // Kept for the life of the process (a forked parent's, unusable here, is left alone).
            let runtime: &'static tokio::runtime::Runtime = Box::leak(Box::new(runtime));
            *current = Some((pid, runtime));
            runtime
        }
    }
}

/// `options`' settings as the keys of one store's builder (`K`: its config key type), each an error naming it when
/// that builder has no such setting (`what` says what it should have been).
fn config_keys<'a, K: std::str::FromStr>(
    options: &'a StorageOptions,
    url: &str,
    what: &str,
) -> Result<Vec<(K, &'a String)>, StorageError> {
    let parse = |(key, value): (&String, &'a String)| match key.parse() {
        Ok(key) => Ok((key, value)),
        Err(_) => {
            Err(StorageError::Options { url: url.to_owned(), why: format!("storage_options: {key:?} is not {what}") })
        }
    };
    options.options.iter().map(parse).collect()
}

/// Runs `future` to completion on the storage runtime. From a thread inside some tokio runtime (an async program
/// calling a session's `shutdown`, say), where blocking on another runtime would panic, it runs on a thread of its own
/// meanwhile.
fn block_on<F>(future: F) -> F::Output
where
    F: std::future::Future + Send,
    F::Output: Send,
{
    if tokio::runtime::Handle::try_current().is_err() {
        return runtime().block_on(future);
    }
    std::thread::scope(|scope| {
        scope.spawn(|| runtime().block_on(future)).join().unwrap_or_else(|panic| std::panic::resume_unwind(panic))
    })
}

/// Whether S3 requests go with `UNSIGNED-PAYLOAD` when nothing says otherwise: over HTTPS (AWS's own endpoints, or an
/// `https://` endpoint), as the AWS SDKs send uploads — TLS protects the bytes in transit, and every page and batch of
/// our files carries its own CRC — which spares the client a SHA-256 pass over every byte it uploads; over plain
/// HTTP the payload is signed. `aws_unsigned_payload` (in the options or `AWS_UNSIGNED_PAYLOAD`) decides otherwise.
fn unsigned_payload_by_default(options: &BTreeMap<String, String>) -> bool {
    let given = |names: &[&str]| -> Option<String> {
        options.iter().find(|(k, _)| names.iter().any(|n| k.eq_ignore_ascii_case(n))).map(|(_, v)| v.clone()).or_else(
            || {
                let env = names.iter().filter(|n| n.starts_with("aws_"));
                env.into_iter().find_map(|n| std::env::var(n.to_ascii_uppercase()).ok())
            },
        )
    };
    if given(&["aws_unsigned_payload", "unsigned_payload"]).is_some() {
        return false; // the builder takes the given value
    }
    let endpoint = given(&["aws_endpoint_url", "aws_endpoint", "endpoint_url", "endpoint"]);
    endpoint.is_none_or(|e| !e.trim().to_ascii_lowercase().starts_with("http://"))
}

/// `url` as it may be shown: without user information (all before the last `@`, which may hide a secret holding
/// `/`), query or fragment. `abfs[s]://container@account…` keeps its container: it names the container, not a user.
pub fn redact_url(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.split(['?', '#']).next().unwrap_or_default().to_owned();
    };
    let rest = rest.split(['?', '#']).next().unwrap_or_default();
    let rest = match rest.rfind('@') {
        Some(at) if !names_container(scheme) => &rest[at + 1..],
        _ => rest,
    };
    format!("{scheme}://{rest}")
}

/// Whether `scheme`'s URLs put the container before an `@` (`abfs[s]://container@account.dfs.core.windows.net/…`).
fn names_container(scheme: &str) -> bool {
    scheme.eq_ignore_ascii_case("abfs") || scheme.eq_ignore_ascii_case("abfss")
}

/// Whether `dir` names object storage (`scheme://…` with a scheme other than `file`) rather than a local directory.
pub fn is_object_url(dir: &str) -> bool {
    dir.split_once("://").is_some_and(|(scheme, _)| {
        !scheme.is_empty() && scheme != "file" && scheme.chars().all(|c| c.is_ascii_alphanumeric() || "+-.".contains(c))
    })
}

impl ObjectStorage {
    /// Opens the store `url` names (`s3://bucket/prefix`, `s3a://`, `gs://`, `az://container/prefix`,
    /// `abfs[s]://`) with `options`, and checks that it can be listed: a missing
    /// bucket or wrong credentials is an error here, naming the URL, not a failed file later.
    pub fn open(url: &str, options: StorageOptions) -> Result<ObjectStorage, StorageError> {
        let storage = Self::connect(url, options)?;
        storage.check()?;
        Ok(storage)
    }

    /// [`open`](Self::open) without the check (nothing is sent to the store).
    pub fn connect(url: &str, options: StorageOptions) -> Result<ObjectStorage, StorageError> {
        let shown = redact_url(url).trim_end_matches('/').to_owned();
        let bad = |why: String| StorageError::Url { url: shown.clone(), why };
        if options.part_bytes < MIN_PART_BYTES {
            return Err(StorageError::Options {
                url: shown,
                why: format!(
                    "upload_part_size = {} bytes: S3 needs parts of at least {MIN_PART_BYTES} bytes (5 MiB)",
                    options.part_bytes
                ),
            });
        }
        if options.concurrency == 0 {
            return Err(StorageError::Options { url: shown, why: "upload_concurrency = 0: use 1 or more".into() });
        }
        if url.contains('?') || url.contains('#') {
            return Err(bad("a query or fragment is not taken: give settings in export.storage_options".into()));
        }
        let scheme_of = url.split_once("://").map_or("", |(scheme, _)| scheme);
        if url.split_once("://").is_some_and(|(_, rest)| rest.contains('@')) && !names_container(scheme_of) {
            return Err(bad(
                "credentials in the URL are not taken (a URL is shown and logged): give them in the environment \
                 (AWS_ACCESS_KEY_ID, ...) or export.storage_options"
                    .into(),
            ));
        }
        let Some((scheme, rest)) = url.split_once("://") else {
            return Err(bad("not a URL (scheme://bucket/prefix)".into()));
        };
        let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
        if bucket.is_empty() {
            return Err(bad("no bucket (scheme://bucket/prefix)".into()));
        }
        let (scheme, prefix) = (scheme.to_ascii_lowercase(), prefix.trim_matches('/').to_owned());
        let retry = RetryConfig {
            max_retries: options.max_retries,
            retry_timeout: options.retry_timeout,
            ..RetryConfig::default()
        };
        let store_error = |source: object_store::Error| StorageError::Store {
            url: shown.clone(),
            what: "cannot set up".into(),
            source,
        };
        let store: Arc<dyn ObjectStore> = match scheme.as_str() {
            "s3" | "s3a" => {
                let mut builder = object_store::aws::AmazonS3Builder::from_env().with_url(url).with_retry(retry);
                for (key, value) in crate::storage::profile::s3_settings(&options.options) {
                    builder = builder.with_config(key, value);
                }
                if unsigned_payload_by_default(&options.options) {
                    builder = builder.with_unsigned_payload(true);
                }
                for (key, value) in config_keys(&options, &shown, "an S3 setting (aws_endpoint, aws_region, …)")? {
                    builder = builder.with_config(key, value);
                }
                Arc::new(builder.build().map_err(store_error)?)
            }
            "gs" => {
                let mut builder =
                    object_store::gcp::GoogleCloudStorageBuilder::from_env().with_url(url).with_retry(retry);
                for (key, value) in config_keys(&options, &shown, "a Google Cloud Storage setting")? {
                    builder = builder.with_config(key, value);
                }
                Arc::new(builder.build().map_err(store_error)?)
            }
            "az" | "adl" | "azure" | "abfs" | "abfss" => {
                let mut builder =
                    object_store::azure::MicrosoftAzureBuilder::from_env().with_url(url).with_retry(retry);
                for (key, value) in config_keys(&options, &shown, "an Azure setting")? {
                    builder = builder.with_config(key, value);
                }
                Arc::new(builder.build().map_err(store_error)?)
            }
            other => {
                return Err(bad(format!(
                    "the scheme {other:?} is not written to (use s3://, gs://, az://, or a local directory)"
                )))
            }
        };
        Ok(Self::with_store(store, &shown, &prefix, options))
    }

    /// Storage on `store` (any [`ObjectStore`]: an in-memory one in tests, one with custom settings), shown as
    /// `url`, with objects under `prefix`.
    pub fn with_store(store: Arc<dyn ObjectStore>, url: &str, prefix: &str, options: StorageOptions) -> Self {
        let inner = Inner {
            store,
            url: url.trim_end_matches('/').to_owned(),
            prefix: prefix.trim_matches('/').to_owned(),
            options,
        };
        ObjectStorage { inner: Arc::new(inner) }
    }

    /// The root of the paths this storage takes: its URL (`s3://bucket/prefix`) as a path. A run's directory is
    /// `root().join(run_id)`, and every file of it a path under that, shown as the object's URL.
    pub fn root(&self) -> PathBuf {
        PathBuf::from(&self.inner.url)
    }

    /// The URL of the storage's root (without credentials).
    pub fn url(&self) -> &str {
        &self.inner.url
    }

    /// The options it was opened with.
    pub fn options(&self) -> &StorageOptions {
        &self.inner.options
    }

    /// Memory one open file uses for its upload beyond its own buffers: the part being filled and the parts in
    /// flight.
    pub fn memory_per_file(&self) -> usize {
        self.inner.options.part_bytes * (self.inner.options.concurrency + 1)
    }

    /// The object key of `path` (a path under [`root`](Self::root)).
    fn key(&self, path: &Path) -> io::Result<ObjectPath> {
        let rel = path.strip_prefix(self.root()).map_err(|_| {
            io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("{} is not under the object storage root {}", path.display(), self.inner.url),
            )
        })?;
        let mut key = self.inner.prefix.clone();
        for c in rel.components() {
            let Component::Normal(part) = c else {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!("{}: not a plain path", path.display()),
                ));
            };
            if !key.is_empty() {
                key.push('/');
            }
            key.push_str(&part.to_string_lossy());
        }
        ObjectPath::parse(&key)
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, format!("{}: {e}", path.display())))
    }

    /// The path (under [`root`](Self::root)) of the object `key`.
    fn path_of(&self, key: &ObjectPath) -> PathBuf {
        let key = key.as_ref();
        let rel = key.strip_prefix(self.inner.prefix.as_str()).unwrap_or(key).trim_start_matches('/');
        self.root().join(rel)
    }

    /// An error of the store as an I/O error naming `path` (a URL; the store's own messages carry no secrets).
    fn io_error(path: &Path, what: &str, e: object_store::Error) -> io::Error {
        let kind = match &e {
            object_store::Error::NotFound { .. } => io::ErrorKind::NotFound,
            object_store::Error::AlreadyExists { .. } | object_store::Error::Precondition { .. } => {
                io::ErrorKind::AlreadyExists
            }
            object_store::Error::PermissionDenied { .. } | object_store::Error::Unauthenticated { .. } => {
                io::ErrorKind::PermissionDenied
            }
            _ => io::ErrorKind::Other,
        };
        io::Error::new(kind, format!("{what} {}: {e}", path.display()))
    }

    /// Lists the storage's root (one page): fails when the bucket is missing or the credentials are refused.
    pub fn check(&self) -> Result<(), StorageError> {
        let prefix = (!self.inner.prefix.is_empty()).then(|| ObjectPath::from(self.inner.prefix.as_str()));
        let store = self.inner.store.clone();
        let listed = block_on(async move { store.list_with_delimiter(prefix.as_ref()).await });
        listed.map(drop).map_err(|source| StorageError::Store {
            url: self.inner.url.clone(),
            what: "cannot list the bucket (does it exist, and do the credentials allow listing and writing it?)".into(),
            source,
        })
    }

    /// Writes `bytes` as the object at `path` (one request; it replaces an object of that name). Returns its size.
    pub fn put(&self, path: &Path, bytes: Bytes) -> io::Result<u64> {
        let key = self.key(path)?;
        let len = bytes.len() as u64;
        let store = self.inner.store.clone();
        block_on(async move { store.put(&key, PutPayload::from(bytes)).await })
            .map(|_| len)
            .map_err(|e| Self::io_error(path, "cannot write", e))
    }

    /// Reads the whole object at `path`.
    pub fn get(&self, path: &Path) -> io::Result<Bytes> {
        let key = self.key(path)?;
        let store = self.inner.store.clone();
        block_on(async move { store.get(&key).await?.bytes().await })
            .map_err(|e| Self::io_error(path, "cannot read", e))
    }

    /// Copies the object at `path` into the local file `dst` (created, or truncated, once the object is found),
    /// chunk by chunk as the store sends it: memory holds one chunk, never the whole object (a run's part files are up
    /// to `export.max_file_size` each). Returns the bytes written. On an error while copying `dst` may hold part of
    /// the object; the error names the object (reading) or `dst` (writing).
    pub fn download(&self, path: &Path, dst: &Path) -> io::Result<u64> {
        use std::io::Write;

        let key = self.key(path)?;
        let store = self.inner.store.clone();
        let read = |e| Self::io_error(path, "cannot read", e);
        let write = |e: io::Error| io::Error::new(e.kind(), format!("cannot write {}: {e}", dst.display()));
        block_on(async move {
            let mut chunks = store.get(&key).await.map_err(read)?.into_stream();
            let mut file = io::BufWriter::new(std::fs::File::create(dst).map_err(write)?);
            let mut n = 0u64;
            while let Some(chunk) = chunks.next().await {
                let chunk = chunk.map_err(read)?;
                file.write_all(&chunk).map_err(write)?;
                n += chunk.len() as u64;
            }
            file.flush().map_err(write)?;
            Ok(n)
        })
    }

    /// Whether an object `path` exists.
    pub fn exists(&self, path: &Path) -> io::Result<bool> {
        let key = self.key(path)?;
        let store = self.inner.store.clone();
        match block_on(async move { store.head(&key).await }) {
            Ok(_) => Ok(true),
            Err(object_store::Error::NotFound { .. }) => Ok(false),
            Err(e) => Err(Self::io_error(path, "cannot look up", e)),
        }
    }

    /// Removes the object at `path` (no error when there is none).
    pub fn delete(&self, path: &Path) -> io::Result<()> {
        let key = self.key(path)?;
        let store = self.inner.store.clone();
        match block_on(async move { store.delete(&key).await }) {
            Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
            Err(e) => Err(Self::io_error(path, "cannot delete", e)),
        }
    }

    /// Every object under the directory `dir` (at any depth), as paths under [`root`](Self::root).
    pub fn list(&self, dir: &Path) -> io::Result<Vec<PathBuf>> {
        let key = self.key(dir)?;
        let store = self.inner.store.clone();
        let metas: Result<Vec<_>, _> =
            block_on(async move { store.list(Some(&key)).collect::<Vec<_>>().await.into_iter().collect() });
        let metas = metas.map_err(|e| Self::io_error(dir, "cannot list", e))?;
        Ok(metas.iter().map(|m| self.path_of(&m.location)).collect())
    }

    /// The names directly under the directory `dir`: its objects' and its subdirectories' (common prefixes).
    pub fn list_names(&self, dir: &Path) -> io::Result<Vec<String>> {
        let key = self.key(dir)?;
        let store = self.inner.store.clone();
        let listed = block_on(async move { store.list_with_delimiter(Some(&key)).await });
        let listed = listed.map_err(|e| Self::io_error(dir, "cannot list", e))?;
        let names = listed.common_prefixes.iter().chain(listed.objects.iter().map(|m| &m.location));
        Ok(names.filter_map(|p| p.filename().map(str::to_owned)).collect())
    }

    /// Starts a multipart upload to `path`: the object appears there when the upload is completed
    /// ([`Upload::complete`]), and never when it is aborted or dropped.
    pub fn upload(&self, path: &Path) -> io::Result<Upload> {
        let key = self.key(path)?;
        let store = self.inner.store.clone();
        let started = block_on(async move { store.put_multipart(&key).await });
        let upload = started.map_err(|e| Self::io_error(path, "cannot start the upload of", e))?;
        Ok(Upload {
            writer: Some(WriteMultipart::new_with_chunk_size(upload, self.inner.options.part_bytes)),
            concurrency: self.inner.options.concurrency,
            part_bytes: self.inner.options.part_bytes,
            path: path.to_owned(),
            bytes: 0,
        })
    }
}

/// A multipart upload in progress ([`ObjectStorage::upload`]): bytes go out in parts as they come; the object is
/// there once [`complete`](Self::complete) returns, and is never made when the upload is dropped (it is aborted).
pub struct Upload {
    writer: Option<WriteMultipart>,
    concurrency: usize,
    part_bytes: usize,
    path: PathBuf,
    bytes: u64,
}

impl std::fmt::Debug for Upload {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Upload").field("path", &self.path).field("bytes", &self.bytes).finish_non_exhaustive()
    }
}

impl Upload {
    /// Waits until fewer than `concurrency` parts are in flight (so that memory stays bounded), then hands `data` to
    /// the upload (which starts a part on the runtime once one is full); the first error of a part that failed
    /// (after its retries) is returned here.
    fn append(&mut self, data: Data<'_>) -> io::Result<()> {
        // In pieces of at most a part: each can start at most one part, so no more than `concurrency` are ever in
        // flight, whatever the size of what is appended (the memory bound of the module docs).
        let part = self.part_bytes;
        match data {
            Data::Copied(bytes) => bytes.chunks(part).try_for_each(|piece| self.append_piece(Data::Copied(piece))),
            Data::Owned(mut bytes) => {
                while !bytes.is_empty() {
                    let piece = bytes.split_to(part.min(bytes.len()));
                    self.append_piece(Data::Owned(piece))?;
                }
                Ok(())
            }
        }
    }

    fn append_piece(&mut self, data: Data<'_>) -> io::Result<()> {
        let concurrency = self.concurrency;
        let writer = self.writer.as_mut().ok_or_else(|| io::Error::other("the upload has ended"))?;
        let n = data.len() as u64;
        let appended = block_on(async move {
            writer.wait_for_capacity(concurrency).await?;
            match data {
                Data::Copied(bytes) => writer.write(bytes),
                Data::Owned(bytes) => writer.put(bytes),
            }
            Ok::<(), object_store::Error>(())
        });
        appended.map_err(|e| ObjectStorage::io_error(&self.path, "cannot upload a part of", e))?;
        self.bytes += n;
        Ok(())
    }

    /// Appends a copy of `data`.
    pub fn write(&mut self, data: &[u8]) -> io::Result<()> {
        self.append(Data::Copied(data))
    }

    /// Appends `data` without copying it (it is held until its part is uploaded).
    pub fn put(&mut self, data: Bytes) -> io::Result<()> {
        self.append(Data::Owned(data))
    }

    /// Uploads what is left and completes the upload: the object is there, whole. Returns its size.
    pub fn complete(mut self) -> io::Result<u64> {
        let writer = self.writer.take().ok_or_else(|| io::Error::other("the upload has ended"))?;
        match block_on(writer.finish()) {
            Ok(_) => Ok(self.bytes),
            Err(e) => Err(ObjectStorage::io_error(&self.path, "cannot complete the upload of", e)),
        }
    }
}

/// Bytes appended to an [`Upload`].
enum Data<'a> {
    /// Copied into the part being filled.
    Copied(&'a [u8]),
    /// Held as they are until their part is uploaded.
    Owned(Bytes),
}

impl Data<'_> {
    fn len(&self) -> usize {
        match self {
            Data::Copied(bytes) => bytes.len(),
            Data::Owned(bytes) => bytes.len(),
        }
    }
}

impl Drop for Upload {
    /// An upload not completed is aborted: its parts are deleted where the store allows, and no object appears.
    fn drop(&mut self) {
        if let Some(writer) = self.writer.take() {
            let _ = block_on(writer.abort());
        }
    }
}

/// S3 settings from a shared-credentials profile (the AWS CLI's files), for what neither the environment nor the
/// explicit options give.
mod profile {
    use super::BTreeMap;
    use object_store::aws::AmazonS3ConfigKey;

    /// Key, region and endpoint from profile `AWS_PROFILE` (or `default`) of `AWS_SHARED_CREDENTIALS_FILE`
    /// (`~/.aws/credentials`) and `AWS_CONFIG_FILE` (`~/.aws/config`), when the environment has no access key and
    /// `options` none either. Files that are missing or unreadable give nothing.
    pub(super) fn s3_settings(options: &BTreeMap<String, String>) -> Vec<(AmazonS3ConfigKey, String)> {
        let env = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
        let explicit = |k: &str| options.keys().any(|o| o.eq_ignore_ascii_case(k));
        if env("AWS_ACCESS_KEY_ID").is_some() || explicit("aws_access_key_id") || explicit("access_key_id") {
            return Vec::new();
        }
        let home = env("HOME").map(std::path::PathBuf::from);
        let file = |var: &str, name: &str| {
            env(var).map(Into::into).or_else(|| home.as_ref().map(|h| h.join(".aws").join(name)))
        };
        let profile = env("AWS_PROFILE").unwrap_or_else(|| "default".into());
        let read = |path: Option<std::path::PathBuf>, section: &str| -> BTreeMap<String, String> {
            let Some(text) = path.and_then(|p| std::fs::read_to_string(p).ok()) else { return BTreeMap::new() };
            section_of(&text, section)
        };
        let credentials = read(file("AWS_SHARED_CREDENTIALS_FILE", "credentials"), &profile);
        let config_section = if profile == "default" { profile.clone() } else { format!("profile {profile}") };
        let config = read(file("AWS_CONFIG_FILE", "config"), &config_section);
        let mut out = Vec::new();
        let mut take = |key: AmazonS3ConfigKey, name: &str, from: &BTreeMap<String, String>| {
            if let Some(v) = from.get(name) {
                out.push((key, v.clone()));
            }
        };
        take(AmazonS3ConfigKey::AccessKeyId, "aws_access_key_id", &credentials);
        take(AmazonS3ConfigKey::SecretAccessKey, "aws_secret_access_key", &credentials);
        take(AmazonS3ConfigKey::Token, "aws_session_token", &credentials);
        if env("AWS_REGION").is_none() && env("AWS_DEFAULT_REGION").is_none() && !explicit("aws_region") {
            take(AmazonS3ConfigKey::Region, "region", &config);
        }
        if env("AWS_ENDPOINT_URL").is_none() && env("AWS_ENDPOINT").is_none() && !explicit("aws_endpoint") {
            take(AmazonS3ConfigKey::Endpoint, "endpoint_url", &config);
        }
        out
    }

    /// The `key = value` lines of `[section]` in an INI text (`#` and `;` start comments).
    pub(super) fn section_of(text: &str, section: &str) -> BTreeMap<String, String> {
        let mut inside = false;
        let mut values = BTreeMap::new();
        for line in text.lines().map(str::trim) {
            if line.is_empty() || line.starts_with(['#', ';']) {
                continue;
            }
            if let Some(name) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
                inside = name.trim() == section;
            } else if inside {
                if let Some((k, v)) = line.split_once('=') {
                    values.insert(k.trim().to_owned(), v.trim().to_owned());
                }
            }
        }
        values
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use object_store::memory::InMemory;

    fn memory() -> ObjectStorage {
        ObjectStorage::with_store(
            Arc::new(InMemory::new()),
            "memory://bucket/dumps",
            "dumps",
            StorageOptions::default(),
        )
    }

    #[test]
    fn urls_are_shown_without_secrets() {
        assert_eq!(redact_url("s3://KEY:SECRET@bucket/p?X-Amz-Signature=abc"), "s3://bucket/p");
        assert_eq!(redact_url("s3://bucket/prefix/"), "s3://bucket/prefix/");
        assert_eq!(redact_url("https://u:p@acct.blob.core.windows.net/c"), "https://acct.blob.core.windows.net/c");
        // A secret holding `/` (AWS's often do) is still cut; an abfs container is kept.
        assert_eq!(redact_url("s3://AKIA:ab/cd@bucket/p"), "s3://bucket/p");
        assert_eq!(redact_url("abfss://box@acct.dfs.core.windows.net/p"), "abfss://box@acct.dfs.core.windows.net/p");
        let e = ObjectStorage::connect("s3://AKIA:se/cret@bucket/p", StorageOptions::default()).unwrap_err();
        let e = e.to_string();
        assert!(e.contains("s3://bucket/p") && e.contains("credentials in the URL") && !e.contains("cret"), "{e}");
        assert!(is_object_url("s3://b/p") && is_object_url("gs://b") && is_object_url("az://c/p"));
        assert!(!is_object_url("file:///tmp/x") && !is_object_url("/tmp/x") && !is_object_url("ringscope-out"));
        let opts = StorageOptions {
            options: BTreeMap::from([("aws_secret_access_key".into(), "hunter2".into())]),
            ..StorageOptions::default()
        };
        assert!(!format!("{opts:?}").contains("hunter2"), "{opts:?}");
        let e = ObjectStorage::connect("s3://ke:sec@bucket/p", StorageOptions { part_bytes: 1, ..opts.clone() })
            .unwrap_err()
            .to_string();
        assert!(e.contains("s3://bucket/p") && !e.contains("sec@") && e.contains("5 MiB"), "{e}");
    }

    #[test]
    fn bad_urls_and_options_are_errors_naming_them() {
        let o = StorageOptions::default;
        let e = ObjectStorage::connect("ftp://host/x", o()).unwrap_err().to_string();
        assert!(e.contains("ftp://host/x"), "{e}");
        let e = ObjectStorage::connect("s3://bucket/p?versionId=1", o()).unwrap_err().to_string();
        assert!(e.contains("storage_options"), "{e}");
        let bad = StorageOptions { options: BTreeMap::from([("aws_colour".into(), "blue".into())]), ..o() };
        let e = ObjectStorage::connect("s3://bucket/p", bad).unwrap_err().to_string();
        assert!(e.contains("aws_colour") && e.contains("s3://bucket/p"), "{e}");
        let e =
            ObjectStorage::connect("s3://bucket", StorageOptions { concurrency: 0, ..o() }).unwrap_err().to_string();
        assert!(e.contains("upload_concurrency"), "{e}");
        let s = ObjectStorage::connect("s3://bucket/a/b/", o()).unwrap();
        assert_eq!(s.url(), "s3://bucket/a/b");
        assert_eq!(s.key(&s.root().join("run/x.parquet")).unwrap().as_ref(), "a/b/run/x.parquet");
        assert!(s.key(Path::new("/tmp/elsewhere")).is_err());
    }

    #[test]
    fn objects_appear_only_when_an_upload_completes() {
        let s = memory();
        let run = s.root().join("run-1");
        let path = run.join("hookpoint=a/rank=0/part-00000.parquet");
        let mut up = s.upload(&path).unwrap();
        let data: Vec<u8> = (0..12_000_000u32).map(|i| (i % 251) as u8).collect();
        up.write(&data[..5_000_000]).unwrap();
        up.put(Bytes::copy_from_slice(&data[5_000_000..])).unwrap();
        assert!(!s.exists(&path).unwrap(), "not before it completes");
        assert_eq!(up.complete().unwrap(), data.len() as u64);
        assert_eq!(s.get(&path).unwrap(), data);
        let dir = tempfile::tempdir().unwrap();
        let local = dir.path().join("copy.parquet");
        assert_eq!(s.download(&path, &local).unwrap(), data.len() as u64);
        assert_eq!(std::fs::read(&local).unwrap(), data);
        let missing = s.download(&run.join("nothing.parquet"), &dir.path().join("nothing")).unwrap_err();
        assert_eq!(missing.kind(), io::ErrorKind::NotFound, "{missing}");
        assert!(missing.to_string().contains("nothing.parquet"), "{missing}");
        assert!(!dir.path().join("nothing").exists(), "no file is made for an object that is not there");
        let unwritable = s.download(&path, &dir.path().join("no-such-dir/copy")).unwrap_err();
        assert!(unwritable.to_string().contains("cannot write") && unwritable.to_string().contains("no-such-dir"));
        assert_eq!(s.list(&run).unwrap(), vec![path.clone()]);
        assert_eq!(s.list_names(&run).unwrap(), vec!["hookpoint=a".to_owned()]);
        // Dropped: aborted, nothing appears.
        let other = run.join("hookpoint=a/rank=0/part-00001.parquet");
        let mut up = s.upload(&other).unwrap();
        up.write(&data).unwrap();
        drop(up);
        assert!(!s.exists(&other).unwrap());
        s.put(&run.join("_m.json"), Bytes::from_static(b"{}")).unwrap();
        assert!(s.exists(&run.join("_m.json")).unwrap());
        s.delete(&run.join("_m.json")).unwrap();
        s.delete(&run.join("_m.json")).unwrap();
        assert!(!s.exists(&run.join("_m.json")).unwrap());
    }

    #[test]
    fn storage_calls_work_from_inside_another_tokio_runtime() {
        let s = memory();
        let path = s.root().join("run/_m.json");
        let other = tokio::runtime::Builder::new_current_thread().build().unwrap();
        // An async program calling in (shutdown writes the manifest, say): no "runtime within a runtime" panic.
        other.block_on(async {
            s.put(&path, Bytes::from_static(b"{}")).unwrap();
            assert!(s.exists(&path).unwrap());
            let mut up = s.upload(&s.root().join("run/x")).unwrap();
            up.write(&[1; 100]).unwrap();
            assert_eq!(up.complete().unwrap(), 100);
        });
    }

    #[test]
    fn payloads_are_unsigned_by_default_only_over_https() {
        let opts = |kv: &[(&str, &str)]| kv.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        if std::env::var_os("AWS_ENDPOINT_URL").is_none()
            && std::env::var_os("AWS_ENDPOINT").is_none()
            && std::env::var_os("AWS_UNSIGNED_PAYLOAD").is_none()
        {
            assert!(unsigned_payload_by_default(&opts(&[])), "AWS's own (https) endpoints");
        }
        assert!(unsigned_payload_by_default(&opts(&[("aws_endpoint", "https://minio.internal:9000")])));
        assert!(!unsigned_payload_by_default(&opts(&[("aws_endpoint", "http://127.0.0.1:9000")])));
        assert!(!unsigned_payload_by_default(&opts(&[("aws_unsigned_payload", "false")])), "given: the builder's");
    }

    #[test]
    fn profiles_are_read_from_the_aws_files() {
        let text = "[default]\naws_access_key_id = A\n# c\n[profile dev]\nregion = eu-west-1\nendpoint_url=http://x\n";
        assert_eq!(profile::section_of(text, "default").get("aws_access_key_id").map(String::as_str), Some("A"));
        let dev = profile::section_of(text, "profile dev");
        assert_eq!(dev.get("region").map(String::as_str), Some("eu-west-1"));
        assert_eq!(dev.get("endpoint_url").map(String::as_str), Some("http://x"));
        assert!(profile::section_of(text, "nope").is_empty());
    }
}
