"""Streaming batches of activations out of a dump: what training a sparse autoencoder or a probe on a dump wants.

:func:`iter_batches` reads a run directory file by file — Arrow IPC files where the run has them
(``export.arrow_ipc``), else Parquet — and yields fixed-size batches of one hookpoint's rows, optionally shuffled
within a buffer, without loading the run into memory. Activations keep their dtype: bf16 rows come out as their
``uint16`` bit patterns (numpy has no bfloat16; ``ringscope.torch.ActivationDataset`` turns them into
``torch.bfloat16`` tensors without a copy of the values). Rows downcast on capture (``Session.set_downcast``) live
in a file series of their own per partition (``rank=*/_f8e4m3_rowscaled/``): they come in batches of their own,
dequantized to float32 (E4M3 × the row's scale), with ``downcast`` True. Needs pyarrow.

Arrow IPC files are read with plain reads, a record batch at a time, never memory-mapped: a mapped file that
another process truncates kills the reading process with SIGBUS, while a read past a file's new end is a
:class:`RingscopeError` naming the file.

A run on object storage (``s3://bucket/prefix/run``, ``gs://``, ``az://``: pyarrow's file systems, credentials and
endpoint from the environment) is read the same way, each file downloaded into a temporary directory just before it
is read and deleted once read: local disk holds one file at a time.
"""
import json
import os
import pathlib
import struct
import tempfile
import zlib
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from ._args import _int, _path, _text
from .dtypes import _NUMPY_FOR_DTYPE, ROWSCALED, dequantize_rowscaled
from .errors import RingscopeError

META_COLUMNS = ("step", "request_id", "position")
FORMATS = ("auto", "arrow", "parquet")
_I64_MAX = 2**63 - 1
_NO_REQUEST = 2**64 - 1  # the request id of rows of no request (ringscope.torch.NO_REQUEST)


class Batch(dict):
    """One batch: ``hookpoint`` (name), ``dtype`` (ringscope dtype name of the rows as stored), ``activation``
    (rows, row_width), ``downcast`` (the rows were downcast on capture: ``dtype`` is ``f8e4m3_rowscaled`` and
    ``activation`` holds their float32 values, dequantized) and, with ``with_meta``, ``step``, ``request_id``,
    ``position`` (numpy arrays, one value per row)."""


def _object_url(path) -> Optional[str]:
    """``path`` when it names object storage (``s3://bucket/prefix/run``, ``gs://``, ``abfss://``, ...) — without a
    trailing ``/``, and ``s3a://`` (which the writer takes) as ``s3://`` (which pyarrow takes) — else None."""
    if not isinstance(path, str) or "://" not in path:
        return None
    scheme, rest = path.split("://", 1)
    if not scheme or scheme == "file" or not all(c.isalnum() or c in "+-." for c in scheme):
        return None
    if scheme.lower() == "s3a":
        scheme = "s3"
    return f"{scheme}://{rest}".rstrip("/")


class _Remote:
    """A run on object storage, read file by file: a local tree of empty placeholders with the run's layout (its
    partitions' files), each filled just before it is read (:meth:`fetch`) and emptied after (:meth:`release`)."""

    def __init__(self, url: str):
        import pyarrow.fs as pafs

        self.url = url.rstrip("/")
        try:
            self.fs, self.base = pafs.FileSystem.from_uri(self.url)
            infos = self.fs.get_file_info(pafs.FileSelector(self.base, recursive=True, allow_not_found=True))
        except (OSError, ValueError) as e:
            raise RingscopeError("RS_ERR_IO", f"cannot read {self.url}: {e}") from e
        if not infos:
            raise RingscopeError("RS_ERR_IO", f"{self.url} does not exist (no object under it): give the run's URL "
                                              "(<export.url>/<run_id>)")
        self._tmp = tempfile.TemporaryDirectory(prefix="ringscope-stream-")
        try:
            self.root = pathlib.Path(self._tmp.name) / pathlib.PurePosixPath(self.base).name
            self.root.mkdir()
            for info in infos:
                rel = info.path[len(self.base):].lstrip("/")
                if rel.startswith(("hookpoint=", "_arrow_ipc/hookpoint=")):
                    local = self.root / rel
                    if info.type == pafs.FileType.Directory:
                        local.mkdir(parents=True, exist_ok=True)
                    elif info.type == pafs.FileType.File:
                        local.parent.mkdir(parents=True, exist_ok=True)
                        local.touch()
        except BaseException:
            self._tmp.cleanup()
            raise

    def fetch(self, path: pathlib.Path) -> None:
        import pyarrow.fs as pafs

        rel = path.relative_to(self.root).as_posix()
        try:
            pafs.copy_files(f"{self.base}/{rel}", str(path), source_filesystem=self.fs)
        except OSError as e:
            raise RingscopeError("RS_ERR_IO", f"cannot read {self.url}/{rel}: {e}") from e

    def release(self, path: pathlib.Path) -> None:
        path.write_bytes(b"")

    def shown(self, e: RingscopeError) -> RingscopeError:
        """``e`` naming the object's URL instead of its local copy."""
        return RingscopeError(e.status, str(e.message).replace(str(self.root), self.url))

    def close(self) -> None:
        self._tmp.cleanup()


def _part_kind(rel: Sequence[str], ext: str) -> Optional[int]:
    """Where a path lies in a hookpoint partition (``rel``: its components below ``hookpoint=NAME/``): 0 for a
    committed file of full-precision rows (``rank=R/part-*.EXT``), 1 for one of downcast rows
    (``rank=R/_f8e4m3_rowscaled/part-*.EXT``), None for anything else (files still being written are hidden,
    ``.part-*``). The one statement of a run's layout, for local directories and object-store listings alike."""
    if len(rel) not in (2, 3) or not rel[0].startswith("rank="):
        return None
    if not (rel[-1].startswith("part-") and rel[-1].endswith(f".{ext}")):
        return None
    if len(rel) == 3 and rel[1] != f"_{ROWSCALED}":
        return None
    return len(rel) - 2


def _part_files(part: pathlib.Path, ext: str) -> Tuple[List[pathlib.Path], List[pathlib.Path]]:
    """The committed files of one hookpoint partition (:func:`_part_kind`), in name order: its full-precision rows
    and its downcast rows. Something named like a part file that is not a file (a directory) is a
    :class:`RingscopeError` naming it."""
    found: Tuple[List[pathlib.Path], List[pathlib.Path]] = ([], [])
    for f in [*part.glob(f"rank=*/part-*.{ext}"), *part.glob(f"rank=*/_{ROWSCALED}/part-*.{ext}")]:
        kind = _part_kind(f.relative_to(part).parts, ext)
        if kind is None:
            continue
        if not f.is_file():
            raise RingscopeError("RS_ERR_IO", f"{f} is named like a committed part file but is not a file; a run "
                                              "directory holds only the files ringscope wrote there")
        found[kind].append(f)
    return sorted(found[0]), sorted(found[1])


def _files(root: pathlib.Path, fmt: str, hookpoints: Optional[Sequence[str]]) -> Tuple[str, List[Tuple[str, pathlib.Path]]]:
    ipc_root = root / "_arrow_ipc"

    def committed(base: pathlib.Path, ext: str):
        out = []
        for part in sorted(p for p in base.glob("hookpoint=*") if p.is_dir()):
            name = part.name[len("hookpoint="):]
            if hookpoints is None or name in hookpoints:
                full, downcast = _part_files(part, ext)
                # Downcast rows: a series of their own, read as batches of their own.
                out += [(name, f) for f in full + downcast]
        return out

    def names(base: pathlib.Path):
        return {p.name[len("hookpoint="):] for p in base.glob("hookpoint=*") if p.is_dir()}

    if not root.is_dir():
        raise RingscopeError("RS_ERR_IO", f"{root} is not a directory: give the run directory (<export.dir>/<run_id>)")
    available = names(root) | names(ipc_root)
    if not available:
        raise RingscopeError("RS_ERR_IO", f"{root} holds no hookpoint partitions: it is not a ringscope run "
                                          "directory (<export.dir>/<run_id>), or nothing was committed yet")
    for h in hookpoints or ():
        if h not in available:
            raise RingscopeError("RS_ERR_INVALID_ARGUMENT",
                                 f"hookpoints: {h!r} is not in {root}; it holds {', '.join(map(repr, sorted(available)))}")
    if fmt in ("auto", "arrow"):
        files = committed(ipc_root, "arrow")
        if files or fmt == "arrow":
            if not files:
                raise RingscopeError("RS_ERR_IO", f"{root} holds no committed Arrow IPC files (export.arrow_ipc)")
            return "arrow", files
    files = committed(root, "parquet")
    if not files:
        raise RingscopeError("RS_ERR_IO", f"{root} holds no committed files for those hookpoints yet")
    return "parquet", files


_POOL = (None, None)  # (pid, executor): the reader threads of this process (a forked DataLoader worker makes its own)
_READ_THREADS = min(8, os.cpu_count() or 1)


def _read_pool():
    """Threads that read Arrow IPC record batches and check their CRCs ahead of the one returned (file reads and
    zlib.crc32 on large buffers release the GIL)."""
    global _POOL
    from concurrent.futures import ThreadPoolExecutor

    pid, pool = _POOL
    if pid != os.getpid():
        pool = ThreadPoolExecutor(max_workers=_READ_THREADS, thread_name_prefix="ringscope-read")
        _POOL = (os.getpid(), pool)
    return pool


def _corrupt(path, what):
    return RingscopeError("RS_ERR_IO", f"{path} is corrupt: {what} (the file changed after it was written)")


class _Shard:
    """Which record batches (Arrow IPC) or row groups (Parquet) one shard reads: counted across every file read, in
    order, the shard ``index`` of ``count`` takes those whose number is ``index`` modulo ``count`` — a share of every
    file, so that the shards of a run of a few large files still split the work evenly."""

    def __init__(self, index: int, count: int):
        self.index, self.count, self.seen = index, count, 0

    def pick(self, n: int) -> range:
        """Of the next file's ``n`` units, the ones this shard reads."""
        first = (self.index - self.seen) % self.count
        self.seen += n
        return range(first, n, self.count)


def _all(n: int) -> range:
    return range(n)


def _ipc_blocks(source, path, size: int) -> List[Tuple[int, int, int]]:
    """(offset, metadata length, body length) of each record batch of an Arrow IPC file, from its footer (a
    flatbuffer ``Footer`` whose field 3, ``recordBatches``, is a vector of 24-byte ``Block`` structs; pyarrow does not
    expose them). Each batch is then read, checked and decoded from one read of its own bytes."""
    tail = source.read_at(10, size - 10) if size >= 10 else b""
    if len(tail) != 10 or tail[4:] != b"ARROW1":
        raise _corrupt(path, f"it does not end with an Arrow IPC footer: it was cut short ({size} bytes), or it is "
                             "not an Arrow IPC file")
    length = int.from_bytes(tail[:4], "little", signed=True)
    if not 0 < length <= size - 18:
        raise _corrupt(path, f"its footer length ({length}) does not fit the file ({size} bytes)")
    footer = source.read_at(length, size - 10 - length)

    def read(fmt, offset):
        if offset < 0:
            raise struct.error(f"an offset points before the footer ({offset})")
        return struct.unpack_from(fmt, footer, offset)

    try:
        root = read("<I", 0)[0]
        vtable = root - read("<i", root)[0]
        slot = 4 + 2 * 3  # the vtable's entry for field 3 (absent when the vtable is shorter: no batches)
        field = read("<H", vtable + slot)[0] if read("<H", vtable)[0] > slot else 0
        blocks = []
        if field:
            vector = root + field + read("<I", root + field)[0]
            count = read("<I", vector)[0]
            blocks = [read("<qi4xq", vector + 4 + 24 * i) for i in range(count)]
    except struct.error as e:
        raise _corrupt(path, f"its footer is not an Arrow IPC footer ({e})") from None
    if any(not (0 <= off and 8 <= meta and 0 <= body and off + meta + body <= size) for off, meta, body in blocks):
        raise _corrupt(path, "its footer lists record batches that are not in the file")
    return blocks


_FOOTER_CRC = b"ringscope.footer_crc32"


def _check_ipc_footer(source, path, start: int, size: int, metadata: dict) -> None:
    """The file's bytes after its last record batch (``start``: end-of-stream marker, footer, length, magic) against
    the CRC-32 in its footer, taken with that value as ``00000000`` (docs/format.md, "Checksums in dump files")."""
    want = metadata.get(_FOOTER_CRC)
    if want is None:
        raise RingscopeError("RS_ERR_IO", f"{path} has no footer checksum (ringscope.footer_crc32): it was written by "
                                          "a ringscope from before footer checksums (December 2026), or its footer "
                                          "changed after it was written; stream.iter_batches(..., verify=False) reads "
                                          "it unchecked")
    # Lowercase only, as written: an upper-case digit would read as the same number, and the value itself is the one
    # stretch the CRC does not cover.
    if len(want) != 8 or not set(want) <= set(b"0123456789abcdef"):
        raise _corrupt(path, f"ringscope.footer_crc32 is {want!r}: not 8 lowercase hex digits")
    crc = int(want, 16)
    tail = bytes(source.read_at(size - start, start))
    # The value as the footer stores it (a flatbuffers string: u32 length, bytes, NUL), put back as written.
    stored, written = (struct.pack("<I", 8) + v + b"\0" for v in (want, b"00000000"))
    at = tail.find(stored)
    while at >= 0:
        if zlib.crc32(tail[:at] + written + tail[at + len(stored):]) == crc:
            return
        at = tail.find(stored, at + 1)
    raise _corrupt(path, f"its footer (bytes {start}..{size}) does not match its CRC-32")


def _ipc_batches(path: pathlib.Path, columns, verify: bool, units, check):
    import pyarrow as pa
    from concurrent.futures import wait

    source = pa.OSFile(str(path), "r")
    futures = {}
    try:
        size = source.size()
        blocks = _ipc_blocks(source, path, size)
        reader = pa.ipc.open_file(source)
        if check is not None:
            check(reader.metadata or {}, reader.schema)
        n = reader.num_record_batches
        if len(blocks) != n:
            raise _corrupt(path, f"its footer lists {len(blocks)} record batches, pyarrow reads {n}")
        # What each batch is read as: its own bytes; with `verify`, the bytes its CRC-32 covers, which end with it.
        regions = [(off, off + meta + body) for off, meta, body in blocks]
        crcs = None
        if verify:
            # Each batch's bytes against its CRC-32 in the footer (docs/format.md, "Checksums in dump files").
            listed = (reader.metadata or {}).get(b"ringscope.batch_crc32")
            if listed is None:
                raise _corrupt(path, "no record batch checksums (ringscope.batch_crc32)")
            try:
                crcs = [(int(end), int(crc)) for end, crc in json.loads(listed)]
            except (ValueError, TypeError) as e:
                raise _corrupt(path, f"ringscope.batch_crc32 is not a list of [end, crc]: {e}") from None
            if len(crcs) != n:
                raise _corrupt(path, f"{len(crcs)} batch checksums for {n} batches")
            bounds = [(start, end) for start, (end, _) in zip([0] + [e for e, _ in crcs[:-1]], crcs)]
            if any(not 0 <= a <= b <= size for a, b in bounds):
                raise _corrupt(path, "batch checksums cover bytes past the file or out of order")
            if any(not (a <= lo and hi <= b) for (a, b), (lo, hi) in zip(bounds, regions)):
                raise _corrupt(path, "batch checksums do not cover the record batches the footer lists")
            regions = bounds
            _check_ipc_footer(source, path, crcs[-1][0] if crcs else 0, size, reader.metadata or {})

        def read(i):
            lo, hi = regions[i]
            data = source.read_at(hi - lo, lo)
            return data, (zlib.crc32(data) if crcs is not None and len(data) == hi - lo else None)

        # Batches are read (and their CRCs computed) on a few threads, a window ahead of the one returned: at most
        # that many batches are held in memory besides the ones returned.
        pool = _read_pool()
        ahead = _READ_THREADS + 2
        wanted = list(units(n))
        for k, i in enumerate(wanted):
            for j in wanted[k:k + ahead]:
                if j not in futures:
                    futures[j] = pool.submit(read, j)
            data, crc = futures.pop(i).result()
            lo, hi = regions[i]
            if len(data) != hi - lo:
                raise _corrupt(path, f"record batch {i} (bytes {lo}..{hi}) is cut short (truncated): the file now ends "
                                     f"at byte {lo + len(data)}")
            if crcs is not None and crc != crcs[i][1]:
                raise _corrupt(path, f"record batch {i} (bytes {lo}..{hi}) does not match its CRC-32")
            # Decoded from the bytes just checked (not read again): the batch's arrays are views of them.
            off, meta, body = blocks[i]
            message = pa.ipc.read_message(pa.py_buffer(data).slice(off - lo, meta + body))
            if message.type != "record batch":
                raise _corrupt(path, f"record batch {i} (bytes {off}..{off + meta + body}) is a {message.type} message")
            batch = pa.ipc.read_record_batch(message, reader.schema)
            yield batch if columns is None else batch.select(columns)
    finally:
        for f in futures.values():
            f.cancel()
        wait(list(futures.values()))  # no read may outlive the file it reads
        source.close()


def _parquet_batches(path: pathlib.Path, columns, verify: bool, units, check):
    import pyarrow.dataset as ds

    # A scanner over the one file: row groups are read ahead and decompressed on pyarrow's threads, in file order
    # (`read_row_groups` decompressed one column's row groups on one thread: 0.3 of pyarrow's whole-file read on a
    # 16-core host). Page CRCs are checked by pyarrow when `verify`. Plain reads: pyarrow maps no file.
    options = ds.ParquetFragmentScanOptions(page_checksum_verification=verify)
    checked = ds.ParquetFileFormat(default_fragment_scan_options=options)
    fragments = list(ds.dataset(str(path), format=checked).get_fragments())
    if len(fragments) != 1:  # a directory named like a part file
        raise RingscopeError("RS_ERR_IO", f"{path} is not one Parquet file")
    fragment = fragments[0]
    if check is not None:
        check(fragment.metadata.metadata or {}, fragment.physical_schema)
    n = fragment.num_row_groups
    wanted = list(units(n))
    if not wanted:
        return
    if len(wanted) < n:
        fragment = fragment.subset(row_group_ids=wanted)
    yield from fragment.to_batches(columns=columns, use_threads=True, fragment_scan_options=options,
                                   batch_readahead=max(16, os.cpu_count() or 1))


def _record_batches(fmt: str, path: pathlib.Path, columns: Optional[List[str]], verify: bool, units=_all,
                    check=None):
    """The record batches of one file: of its ``n`` units (Arrow IPC record batches, Parquet row groups), those
    ``units(n)`` lists, in file order. ``check(footer metadata, schema)`` runs before any is read. A file that cannot
    be read as written (cut short, changed, not a file of its format) is a :class:`RingscopeError` naming it."""
    import pyarrow as pa

    read = _ipc_batches if fmt == "arrow" else _parquet_batches
    try:
        yield from read(path, columns, verify, units, check)
    except FileNotFoundError as e:
        raise RingscopeError("RS_ERR_IO", f"{path} is gone: it was deleted or moved while the run was read ({e})") \
            from None
    except (OSError, EOFError, pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
        # What a changed or cut file reads as (memory errors are not corruption).
        raise _corrupt(path, f"{type(e).__name__}: {e}") from None


class _Series:
    """One hookpoint's file series (its full-precision files, or its downcast ones) and the check that each file
    belongs to it: the file's footer names that hookpoint (when it names one) and its rows have the series' dtype and
    width — those of the first file read. A file that does not (another hookpoint's file copied into the partition)
    is a :class:`RingscopeError` naming it and what differs."""

    def __init__(self, name: str, downcast: bool):
        self.name, self.downcast = name, downcast
        # (path, dtype name, row bytes) of the first file checked
        self.first: Optional[Tuple[pathlib.Path, str, int]] = None
        self.dtype: Optional[str] = None

    def check(self, path, meta: dict, schema) -> None:
        import pyarrow as pa

        i = schema.get_field_index("activation")
        if i < 0 or not pa.types.is_fixed_size_binary(schema.field(i).type):
            raise RingscopeError("RS_ERR_IO", f"{path} has no fixed-size activation column: it is not a ringscope "
                                              f"dump file, yet it lies in hookpoint {self.name!r}'s partition")
        field = schema.field(i)
        dtype = ((field.metadata or {}).get(b"ringscope.dtype") or b"").decode(errors="replace")
        width = field.type.byte_width
        wrong = []
        owner = meta.get(b"ringscope.hookpoint")
        if owner is not None and owner.decode(errors="replace") != self.name:
            wrong.append(f"its footer names hookpoint {owner.decode(errors='replace')!r}")
        if self.downcast != (dtype == ROWSCALED):
            wrong.append(f"its rows are {dtype or 'of no ringscope.dtype'}, in the "
                         f"{'downcast' if self.downcast else 'full-precision'} series")
        np_dtype = _NUMPY_FOR_DTYPE.get(dtype)
        if np_dtype is not None and width % np_dtype.itemsize:
            wrong.append(f"its rows are {width} bytes, not a whole number of {dtype} values")
        if self.first is not None and (dtype, width) != self.first[1:]:
            first, dtype0, width0 = self.first
            wrong.append(f"its rows are {width} bytes of {dtype or '?'} where the hookpoint's are {width0} bytes of "
                         f"{dtype0 or '?'} (row width or dtype differ from {first})")
        if wrong:
            raise RingscopeError("RS_ERR_IO", f"{path} does not belong in the partition of hookpoint {self.name!r}: "
                                              f"{'; '.join(wrong)} — a file of another hookpoint or run put there?")
        if self.first is None:
            self.first, self.dtype = (path, dtype, width), dtype

    def check_files(self, fmt: str, paths) -> None:
        """Checks every file (their footers only: no rows are read)."""
        for path in paths:
            for _ in _record_batches(fmt, path, None, False, lambda n: range(0), lambda m, s: self.check(path, m, s)):
                pass


def _int64(column: str, values: np.ndarray) -> np.ndarray:
    """``values`` (a metadata column) as int64, what torch indexes and counts with: unsigned ids above 2**63-1 are
    refused rather than wrapped to negative numbers — except the request id of rows of no request (2**64-1), which
    becomes -1."""
    if values.dtype.kind == "u" and values.dtype.itemsize == 8 and len(values) and values.max() > _I64_MAX and (
            column != "request_id" or bool(((values > _I64_MAX) & (values != _NO_REQUEST)).any())):
        raise RingscopeError("RS_ERR_INVALID_ARGUMENT",
                             f"{column}: {int(values.max())} does not fit a torch.int64 tensor (ids above 2**63-1 "
                             "cannot be torch tensors): read it as numpy uint64 (ringscope.read_dump with "
                             "as_torch=False, or ringscope.stream.iter_batches)")
    return values.astype(np.int64, copy=False)


def _rows(rb, with_meta: bool):
    """(activation as uint8 (rows, row_bytes), meta columns) of one Arrow record batch, without copies."""
    col = rb.column(rb.schema.get_field_index("activation"))
    width = col.type.byte_width
    raw = np.frombuffer(col.buffers()[1], dtype=np.uint8)[col.offset * width:(col.offset + len(col)) * width]
    meta = {c: rb.column(rb.schema.get_field_index(c)).to_numpy() for c in META_COLUMNS} if with_meta else {}
    return raw.reshape(len(col), width), meta


def iter_batches(path: "str | os.PathLike", hookpoints: Optional[Sequence[str]] = None, batch_size: int = 4096,
                 shuffle_buffer: int = 0, seed: int = 0, format: str = "auto", drop_last: bool = False,
                 with_meta: bool = False, shard: Tuple[int, int] = (0, 1), verify: bool = True) -> Iterator[Batch]:
    """Yields :class:`Batch` es of ``batch_size`` rows of one hookpoint at a time, reading the run at ``path`` file
    by file. Every row of the files read is yielded exactly once (``drop_last`` aside).

    ``hookpoints``: names to read (default: all). ``shuffle_buffer``: rows held to shuffle (0: stream order). Rows
    fill the buffer; once it is full, each batch is ``batch_size`` rows taken from random places in it, their places
    refilled by the rows that come next (the cost of a batch does not grow with the buffer); at the end what the
    buffer holds comes out in random order. A buffer of N rows costs N × row bytes of memory. ``seed``: of the
    shuffle. ``format``: ``"arrow"`` (Arrow IPC), ``"parquet"``, or ``"auto"`` (Arrow IPC when the run has it).
    ``shard``: ``(index, count)`` — read only every count-th record batch (Arrow IPC) or row group (Parquet), counted
    across all files read, from index: one shard per data-loader worker, each with a share of every file.
    ``drop_last``: leave out each hookpoint's last, shorter batch. ``verify``: check every Parquet page's CRC and
    every Arrow IPC batch's CRC-32 (a file changed after it was written raises :class:`RingscopeError` naming it,
    never yields changed values); ``False`` skips the checks for speed. Only committed files are read. A file cut
    short, even while it is read, or another hookpoint's file put into a partition is a :class:`RingscopeError`
    naming the file. ``path`` may be a run on object storage (``s3://bucket/prefix/run``; see the module docs)."""
    url = _object_url(path)
    root = pathlib.Path(os.fsdecode(_path("path", path))) if url is None else pathlib.Path()
    batch_size = _int("batch_size", batch_size, 1, 1 << 31)
    shuffle_buffer = _int("shuffle_buffer", shuffle_buffer, 0, 1 << 40)
    seed = _int("seed", seed, 0, (1 << 64) - 1)
    if not isinstance(format, str) or format not in FORMATS:
        raise RingscopeError("RS_ERR_INVALID_ARGUMENT", f"format: {format!r} is not one of {', '.join(FORMATS)}")
    if isinstance(hookpoints, str):
        hookpoints = [hookpoints]
    if hookpoints is not None:
        try:
            hookpoints = list(hookpoints)
        except TypeError:
            raise RingscopeError("RS_ERR_INVALID_ARGUMENT",
                                 f"hookpoints must be a name or a list of names, got {type(hookpoints).__name__}") from None
        for h in hookpoints:
            _text("hookpoints", h)
    if not isinstance(shard, (tuple, list)) or len(shard) != 2:
        raise RingscopeError("RS_ERR_INVALID_ARGUMENT", f"shard: {shard!r} is not (index, count)")
    count = _int("shard count", shard[1], 1, 1 << 20)
    index = _int("shard index", shard[0], 0, count - 1)
    remote = _Remote(url) if url is not None else None
    try:
        fmt, files = _files(remote.root if remote is not None else root, format, hookpoints)
        columns = ["activation", *META_COLUMNS] if with_meta else ["activation"]
        rng = np.random.default_rng(seed)
        shards = _Shard(index, count)
        by_series: Dict[Tuple[str, bool], List[pathlib.Path]] = {}
        for name, f in files:
            # A hookpoint's downcast rows have another row size: they are batched apart from its full-precision rows.
            by_series.setdefault((name, f.parent.name == f"_{ROWSCALED}"), []).append(f)
        for (name, downcast), paths in by_series.items():
            series = _Series(name, downcast)
            chunks = _chunks(series, fmt, paths, columns, verify, with_meta, shards, remote)
            if shuffle_buffer:
                chunks = _shuffled(chunks, shuffle_buffer, batch_size, rng)
            yield from _batched(series, chunks, batch_size, drop_last, with_meta)
    except RingscopeError as e:
        if remote is None:
            raise
        raise remote.shown(e) from e
    finally:
        if remote is not None:
            remote.close()


def _chunks(series: _Series, fmt, paths, columns, verify, with_meta, shards: _Shard, remote: Optional[_Remote] = None):
    """(activation uint8 rows, meta) of each non-empty record batch of the series this shard reads, in file order (a
    run on object storage: each file fetched just before it is read, and released after)."""
    for path in paths:
        if remote is not None:
            remote.fetch(path)
        for rb in _record_batches(fmt, path, columns, verify, shards.pick, lambda m, s: series.check(path, m, s)):
            if rb.num_rows:
                yield _rows(rb, with_meta)
        if remote is not None:
            remote.release(path)


def _shuffled(chunks, capacity: int, batch_size: int, rng):
    """The rows of ``chunks`` in random order, through a buffer of ``capacity`` rows: rows fill it; once it is full,
    each ``batch_size`` rows that come in take the places of as many rows drawn from random places of it, which go
    out (a batch costs O(batch_size), whatever the buffer's size); at the end the rows it holds go out in random
    order. Every row goes out exactly once."""
    acts: Optional[np.ndarray] = None
    meta: Optional[Dict[str, np.ndarray]] = None  # None exactly while acts is
    fill = 0

    def grow(rows, row_meta, need):
        # The buffer is allocated as it fills (doubling up to `capacity`): a large buffer over a small run stays small.
        size = min(capacity, max(need, 2 * (0 if acts is None else len(acts)), 1 << 12))
        new_acts = np.empty((size, rows.shape[1]), dtype=rows.dtype)
        new_meta = {c: np.empty(size, dtype=v.dtype) for c, v in row_meta.items()}
        if acts is not None:
            new_acts[:fill] = acts[:fill]
            for c in new_meta:
                new_meta[c][:fill] = meta[c][:fill]
        return new_acts, new_meta

    for rows, row_meta in chunks:
        at, n = 0, len(rows)
        while at < n:
            if fill < capacity:
                if acts is None or fill == len(acts):
                    acts, meta = grow(rows, row_meta, fill + n - at)
                assert meta is not None  # allocated with acts
                k = min(len(acts) - fill, n - at)
                acts[fill:fill + k] = rows[at:at + k]
                for c in meta:
                    meta[c][fill:fill + k] = row_meta[c][at:at + k]
                fill += k
                at += k
                continue
            assert acts is not None and meta is not None  # full: fill == capacity >= 1 rows held
            k = min(batch_size, capacity, n - at)
            slots = rng.choice(capacity, k, replace=False)
            out = acts[slots], {c: v[slots] for c, v in meta.items()}  # copies: the slots are refilled next
            acts[slots] = rows[at:at + k]
            for c in meta:
                meta[c][slots] = row_meta[c][at:at + k]
            at += k
            yield out
    if fill:
        assert acts is not None and meta is not None  # rows are held
        order = rng.permutation(fill)
        for lo in range(0, fill, batch_size):
            take = order[lo:lo + batch_size]
            yield acts[take], {c: v[take] for c, v in meta.items()}


def _batched(series: _Series, chunks, batch_size: int, drop_last: bool, with_meta: bool):
    """Batches of ``batch_size`` rows cut from ``chunks`` in order (a batch inside one chunk is a view of it)."""
    # (activation uint8 rows, meta) chunks not yet emitted, in order
    pending: List[Tuple[np.ndarray, Dict[str, np.ndarray]]] = []
    held = 0

    def take(k):
        nonlocal held
        parts, got = [], 0
        while got < k:
            rows, meta = pending[0]
            if len(rows) <= k - got:
                parts.append(pending.pop(0))
                got += len(rows)
            else:
                cut = k - got
                parts.append((rows[:cut], {c: v[:cut] for c, v in meta.items()}))
                pending[0] = (rows[cut:], {c: v[cut:] for c, v in meta.items()})
                got = k
        held -= k
        if len(parts) == 1:
            return parts[0]
        return np.concatenate([a for a, _ in parts]), {c: np.concatenate([m[c] for _, m in parts]) for c in parts[0][1]}

    def emit(rows, meta):
        n = len(rows)
        if series.dtype == ROWSCALED:
            b = Batch(hookpoint=series.name, dtype=series.dtype, activation=dequantize_rowscaled(rows), downcast=True)
        else:
            np_dtype = _NUMPY_FOR_DTYPE.get(series.dtype, np.dtype(np.uint8))
            b = Batch(hookpoint=series.name, dtype=series.dtype, activation=rows.view(np_dtype).reshape(n, -1),
                      downcast=False)
        for c in META_COLUMNS if with_meta else ():
            b[c] = meta[c]
        return b

    for rows, meta in chunks:
        pending.append((rows, meta))
        held += len(rows)
        while held >= batch_size:
            yield emit(*take(batch_size))
    if held and not drop_last:
        yield emit(*take(held))
