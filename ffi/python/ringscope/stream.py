"""Streaming batches of activations out of a dump: what training a sparse autoencoder or a probe on a dump wants.

:func:`iter_batches` reads a run directory file by file — memory-mapped Arrow IPC files where the run has them
(``export.arrow_ipc``), else Parquet — and yields fixed-size batches of one hookpoint's rows, optionally shuffled
within a buffer, without loading the run into memory. Activations keep their dtype: bf16 rows come out as their
``uint16`` bit patterns (numpy has no bfloat16; ``ringscope.torch.ActivationDataset`` turns them into
``torch.bfloat16`` tensors without a copy of the values). Rows downcast on capture (``Session.set_downcast``) live
in a file series of their own per partition (``rank=*/_f8e4m3_rowscaled/``): they come in batches of their own,
dequantized to float32 (E4M3 × the row's scale), with ``downcast`` True. Needs pyarrow.
"""
import json
import os
import pathlib
import zlib
from typing import Iterator, List, Optional, Sequence, Tuple

import numpy as np

from . import ROWSCALED, RingscopeError, _NUMPY_FOR_DTYPE, _int, _path, _text, dequantize_rowscaled

META_COLUMNS = ("step", "request_id", "position")
FORMATS = ("auto", "arrow", "parquet")


class Batch(dict):
    """One batch: ``hookpoint`` (name), ``dtype`` (ringscope dtype name of the rows as stored), ``activation``
    (rows, row_width), ``downcast`` (the rows were downcast on capture: ``dtype`` is ``f8e4m3_rowscaled`` and
    ``activation`` holds their float32 values, dequantized) and, with ``with_meta``, ``step``, ``request_id``,
    ``position`` (numpy arrays, one value per row)."""


def _files(root: pathlib.Path, fmt: str, hookpoints: Optional[Sequence[str]]) -> Tuple[str, List[Tuple[str, pathlib.Path]]]:
    ipc_root = root / "_arrow_ipc"

    def committed(base: pathlib.Path, ext: str):
        out = []
        for part in sorted(p for p in base.glob("hookpoint=*") if p.is_dir()):
            name = part.name[len("hookpoint="):]
            if hookpoints is None or name in hookpoints:
                out += [(name, f) for f in sorted(part.glob(f"rank=*/part-*.{ext}"))]
                # Downcast rows: a series of their own, read as batches of their own.
                out += [(name, f) for f in sorted(part.glob(f"rank=*/_{ROWSCALED}/part-*.{ext}"))]
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


_POOL = (None, None)  # (pid, executor): the CRC threads of this process (a forked DataLoader worker makes its own)
_CRC_THREADS = min(8, os.cpu_count() or 1)


def _crc_pool():
    """Threads that check batch CRCs while batches are read (zlib.crc32 releases the GIL on large buffers)."""
    global _POOL
    from concurrent.futures import ThreadPoolExecutor

    pid, pool = _POOL
    if pid != os.getpid():
        pool = ThreadPoolExecutor(max_workers=_CRC_THREADS, thread_name_prefix="ringscope-crc")
        _POOL = (os.getpid(), pool)
    return pool


def _corrupt(path, what):
    return RingscopeError("RS_ERR_IO", f"{path} is corrupt: {what} (the file changed after it was written)")


def _record_batches(fmt: str, path: pathlib.Path, columns: List[str], verify: bool):
    import pyarrow as pa

    if fmt == "arrow":
        # Memory-mapped: the activations are read straight from the page cache, not copied into Arrow buffers.
        source = pa.memory_map(str(path), "r")
        reader = pa.ipc.open_file(source)
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
            if len(crcs) != reader.num_record_batches:
                raise _corrupt(path, f"{len(crcs)} batch checksums for {reader.num_record_batches} batches")
            whole = memoryview(source.read_buffer(source.size()))
            bounds = [(start, end) for start, (end, _) in zip([0] + [e for e, _ in crcs[:-1]], crcs)]
            if any(not 0 <= a <= b <= len(whole) for a, b in bounds):
                raise _corrupt(path, "batch checksums cover bytes past the file or out of order")
        # The CRCs are computed on a few threads, a window of batches ahead of the one returned (each batch is still
        # checked before it is returned); what a closed or failed reader left in the window is cancelled.
        pool = _crc_pool() if crcs is not None else None
        ahead = 2 * _CRC_THREADS
        sums = {}
        try:
            for i in range(reader.num_record_batches):
                if pool is not None:
                    for j in range(i, min(i + ahead, len(bounds))):
                        if j not in sums:
                            sums[j] = pool.submit(zlib.crc32, whole[bounds[j][0]:bounds[j][1]])
                    if sums.pop(i).result() != crcs[i][1]:
                        a, b = bounds[i]
                        raise _corrupt(path, f"record batch {i} (bytes {a}..{b}) does not match its CRC-32")
                batch = reader.get_batch(i)
                yield batch if columns is None else batch.select(columns)
        finally:
            for f in sums.values():
                f.cancel()
    else:
        import pyarrow.dataset as ds

        # A scanner over the one file: row groups are read ahead and decompressed on pyarrow's threads, in file order
        # (`read_row_groups` decompressed one column's row groups on one thread: 0.3 of pyarrow's whole-file read on a
        # 16-core host). Page CRCs are checked by pyarrow when `verify`.
        checked = ds.ParquetFileFormat(
            default_fragment_scan_options=ds.ParquetFragmentScanOptions(page_checksum_verification=verify))
        try:
            scanner = ds.dataset(str(path), format=checked).scanner(
                columns=columns, use_threads=True, batch_readahead=max(16, os.cpu_count() or 1))
            yield from scanner.to_batches()
        except (OSError, pa.ArrowInvalid) as e:  # what a changed file reads as (memory errors are not corruption)
            raise _corrupt(path, str(e)) from None


def _rows(rb, with_meta: bool):
    """(activation as uint8 (rows, row_bytes), dtype name, meta columns) of one Arrow record batch, without copies."""
    col = rb.column(rb.schema.get_field_index("activation"))
    field = rb.schema.field("activation")
    dtype = ((field.metadata or {}).get(b"ringscope.dtype", b"") or b"").decode()
    width = col.type.byte_width
    raw = np.frombuffer(col.buffers()[1], dtype=np.uint8)[col.offset * width:(col.offset + len(col)) * width]
    meta = {c: rb.column(rb.schema.get_field_index(c)).to_numpy() for c in META_COLUMNS} if with_meta else {}
    return raw.reshape(len(col), width), dtype, meta


def iter_batches(path: "str | os.PathLike", hookpoints: Optional[Sequence[str]] = None, batch_size: int = 4096,
                 shuffle_buffer: int = 0, seed: int = 0, format: str = "auto", drop_last: bool = False,
                 with_meta: bool = False, shard: Tuple[int, int] = (0, 1), verify: bool = True) -> Iterator[Batch]:
    """Yields :class:`Batch` es of ``batch_size`` rows of one hookpoint at a time, reading the run at ``path`` file
    by file.

    ``hookpoints``: names to read (default: all). ``shuffle_buffer``: rows held and shuffled before batches are
    drawn from them (0: stream order; a buffer of N rows costs N × row bytes of memory). ``format``: ``"arrow"``
    (memory-mapped Arrow IPC files), ``"parquet"``, or ``"auto"`` (Arrow IPC when the run has it). ``shard``:
    ``(index, count)`` — read only every count-th file, from index (one shard per data-loader worker).
    ``drop_last``: leave out each hookpoint's last, shorter batch. ``verify``: check every Parquet page's CRC and
    every Arrow IPC batch's CRC-32 (a file changed after it was written raises :class:`RingscopeError` naming it,
    never yields changed values); ``False`` skips the checks for speed. Only committed files are read."""
    root = pathlib.Path(os.fsdecode(_path("path", path)))
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
    fmt, files = _files(root, format, hookpoints)
    files = files[index::count]
    columns = ["activation", *META_COLUMNS] if with_meta else ["activation"]
    rng = np.random.default_rng(seed)
    by_hookpoint = {}
    for name, f in files:
        # A hookpoint's downcast rows have another row size: they are batched apart from its full-precision rows.
        by_hookpoint.setdefault((name, f.parent.name == f"_{ROWSCALED}"), []).append(f)
    for (name, _), paths in by_hookpoint.items():
        yield from _hookpoint_batches(name, fmt, paths, columns, batch_size, shuffle_buffer, rng, drop_last, with_meta,
                                      verify)


def _hookpoint_batches(name, fmt, paths, columns, batch_size, shuffle_buffer, rng, drop_last, with_meta, verify):
    pending = []  # (activation uint8 rows, meta) chunks not yet emitted, in order
    held = 0
    dtype = None
    keep = max(shuffle_buffer, batch_size)

    def take_all():
        """Everything pending as one array (and its metadata), shuffled when a shuffle buffer is asked for."""
        acts = np.concatenate([a for a, _ in pending]) if len(pending) > 1 else pending[0][0]
        meta = {c: np.concatenate([m[c] for _, m in pending]) for c in META_COLUMNS} if with_meta else {}
        if shuffle_buffer:
            order = rng.permutation(len(acts))
            acts = acts[order]
            meta = {c: v[order] for c, v in meta.items()}
        return acts, meta

    def emit(acts, meta, lo, hi):
        np_dtype = _NUMPY_FOR_DTYPE.get(dtype, np.dtype(np.uint8))
        rows = acts[lo:hi]
        if dtype == ROWSCALED:
            b = Batch(hookpoint=name, dtype=dtype, activation=dequantize_rowscaled(rows), downcast=True)
        else:
            b = Batch(hookpoint=name, dtype=dtype, activation=rows.view(np_dtype).reshape(hi - lo, -1), downcast=False)
        for c in META_COLUMNS if with_meta else ():
            b[c] = meta[c][lo:hi]
        return b

    for path in paths:
        for rb in _record_batches(fmt, path, columns, verify):
            if rb.num_rows == 0:
                continue
            acts, dt, meta = _rows(rb, with_meta)
            dtype = dtype or dt
            pending.append((acts, meta))
            held += rb.num_rows
            if held < keep + batch_size:
                continue
            acts, meta = take_all()
            # Emit whole batches while at least `shuffle_buffer` rows stay behind to mix with what comes next.
            n = (len(acts) - shuffle_buffer) // batch_size if shuffle_buffer else len(acts) // batch_size
            for i in range(n):
                yield emit(acts, meta, i * batch_size, (i + 1) * batch_size)
            rest = n * batch_size
            # Copy what stays: the views above may point into memory-mapped files that move on.
            pending = [(acts[rest:].copy(), {c: v[rest:].copy() for c, v in meta.items()})]
            held = len(acts) - rest
    if held == 0:
        return
    acts, meta = take_all()
    n = len(acts) // batch_size
    for i in range(n):
        yield emit(acts, meta, i * batch_size, (i + 1) * batch_size)
    if len(acts) > n * batch_size and not drop_last:
        yield emit(acts, meta, n * batch_size, len(acts))
