"""Reading a run back: :func:`read_dump` (Parquet or Arrow IPC, every page's or batch's CRC checked) and
:func:`read_events` (the events table)."""

from __future__ import annotations

import contextlib
import os
import pathlib
import tempfile
from typing import Iterator, Optional, Sequence

import numpy as np

from .errors import RingscopeError
from ._args import _path, _text, _u64
from .dtypes import _as_float32, dequantize_rowscaled, _NUMPY_FOR_DTYPE, ROWSCALED
from .stream import _object_url, _part_kind, _Series


_COMMIT_HINT = ("a file is committed when it reaches export.max_file_size or when the session is closed, so read "
                "after Session.close()")


def _request_filter(request: Optional[int]):
    """The pyarrow expression selecting the rows of ``request`` (None: every row)."""
    import pyarrow as pa
    import pyarrow.dataset as ds

    return None if request is None else ds.field("request_id") == pa.scalar(request, pa.uint64())


def _read_checked(part: "pathlib.Path | list", request: Optional[int] = None, filesystem=None, scheme: str = "",
                  series: "Optional[_Series]" = None):
    """The table of one hookpoint's Parquet files (its partition directory, whose `_`-prefixed downcast series pyarrow
    skips; or a list of files), each page's CRC checked (the writer puts one in every page header); a file whose bytes
    are not as written is a RingscopeError naming it. ``request``: only that request's rows (row groups whose
    request-id statistics exclude it are not read). ``filesystem``: where the files are (object storage: read in
    place, only the row groups needed; ``scheme`` — ``s3://`` say — makes their paths URLs in errors); ``series``:
    each file's footer is checked to belong to it first."""
    import pyarrow as pa
    import pyarrow.dataset as ds

    def broken(path, e) -> RingscopeError:
        # On object storage a read can also fail for want of the server: only a checksum failure is named corruption.
        local = not scheme or "crc" in str(e).lower() or "checksum" in str(e).lower()
        return RingscopeError("RS_ERR_IO", f"{scheme}{path} " + ("is corrupt (its bytes are not as written)" if local
                                                                  else "cannot be read") + f": {e}")

    where = f"{scheme}{part[0]} and {len(part) - 1} more" if isinstance(part, list) and len(part) > 1 else \
        f"{scheme}{part[0]}" if isinstance(part, list) and part else str(part)
    checked = ds.ParquetFileFormat(
        default_fragment_scan_options=ds.ParquetFragmentScanOptions(page_checksum_verification=True))
    try:
        if isinstance(part, list):
            dataset = ds.dataset([str(p) for p in part], format=checked, filesystem=filesystem)
        else:
            dataset = ds.dataset(str(part), format=checked, partitioning="hive")
    except (OSError, pa.ArrowException) as e:
        raise RingscopeError("RS_ERR_IO", f"cannot read {where}: {e}") from e
    if series is not None:
        for fragment in dataset.get_fragments():
            try:
                meta, schema = fragment.metadata.metadata or {}, fragment.physical_schema
            except (OSError, pa.ArrowException) as e:
                raise broken(fragment.path, e) from e
            series.check(scheme + fragment.path, meta, schema)
    try:
        return dataset.to_table(filter=_request_filter(request))
    except (OSError, pa.ArrowException) as e:
        failure = e
    # pyarrow does not say which file failed: read them one by one (what was asked of each) to name it.
    for fragment in dataset.get_fragments():
        try:
            fragment.to_table(filter=_request_filter(request))
        except (OSError, pa.ArrowException) as e:
            raise broken(fragment.path, e) from e
    raise RingscopeError("RS_ERR_IO", f"cannot read {where}: {failure}") from failure


def _read_ipc_checked(files: list, request: Optional[int] = None):
    """The table of Arrow IPC files (read, not memory-mapped), every record batch checked against its CRC-32 in the file's
    footer; a file whose bytes are not as written is a RingscopeError naming it. ``request``: only that request's
    rows are kept (every batch is still read and checked)."""
    import pyarrow as pa

    from .stream import _record_batches

    keep = _request_filter(request)
    tables = []
    for f in files:
        try:
            for b in _record_batches("arrow", f, None, verify=True):
                # A request's rows kept batch by batch, the rest let go as they are read.
                tables.append(pa.Table.from_batches([b]) if keep is None else pa.Table.from_batches([b]).filter(keep))
        except (OSError, pa.ArrowInvalid) as e:
            raise RingscopeError("RS_ERR_IO", f"{f} is corrupt (its bytes are not as written): {e}") from e
    return pa.concat_tables(tables) if tables else pa.Table.from_batches([])


def _activation_bytes(t) -> np.ndarray:
    """The activation column of table ``t`` as uint8 rows (rows, row bytes), without a copy."""
    flat = t.column("activation").combine_chunks()
    width = flat.type.byte_width
    raw = np.frombuffer(flat.buffers()[1], dtype=np.uint8)[flat.offset * width:]
    return raw[: t.num_rows * width].reshape(t.num_rows, width)


@contextlib.contextmanager
def _fetched(url: str, subdirs: Sequence[str]) -> Iterator[pathlib.Path]:
    """A local copy of the run at ``url`` (object storage, through pyarrow's file systems: credentials and endpoint
    from the standard environment, e.g. ``AWS_ENDPOINT_URL``): its manifests, and of its directories only
    ``subdirs`` (those that exist), in a temporary directory removed afterwards."""
    import pyarrow.fs as pafs

    try:
        fs, base = pafs.FileSystem.from_uri(url.rstrip("/"))
        listing = fs.get_file_info(pafs.FileSelector(base, allow_not_found=True))
    except (OSError, ValueError) as e:
        raise RingscopeError("RS_ERR_IO", f"cannot read {url}: {e}") from e
    if not listing:
        raise RingscopeError("RS_ERR_IO", f"{url} does not exist (no object under it): give the run's URL "
                                          "(<export.url>/<run_id>)")
    names = {pathlib.PurePosixPath(i.path).name: i for i in listing}
    with tempfile.TemporaryDirectory(prefix="ringscope-fetch-") as tmp:
        local = pathlib.Path(tmp) / pathlib.PurePosixPath(base).name
        local.mkdir()
        try:
            for name, info in names.items():
                wanted = any(name == d or d.startswith(name + "/") for d in subdirs)
                if info.type == pafs.FileType.File and name.startswith("_ringscope_run") and name.endswith(".json"):
                    pafs.copy_files(info.path, str(local / name), source_filesystem=fs)
                elif info.type == pafs.FileType.Directory and wanted:
                    for d in subdirs:
                        if d == name or d.startswith(name + "/"):
                            src = f"{base}/{d}"
                            if fs.get_file_info(src).type == pafs.FileType.Directory:
                                (local / d).mkdir(parents=True, exist_ok=True)
                                pafs.copy_files(src, str(local / d), source_filesystem=fs)
        except OSError as e:
            raise RingscopeError("RS_ERR_IO", f"cannot read {url}: {e}") from e
        yield local


def _run_subdirs(url: str, hookpoint: Optional[str]) -> list:
    """The directories of a run read_dump needs: every hookpoint's partitions (Parquet and Arrow IPC), or one's."""
    import pyarrow.fs as pafs

    try:
        fs, base = pafs.FileSystem.from_uri(url.rstrip("/"))
    except (OSError, ValueError) as e:
        raise RingscopeError("RS_ERR_IO", f"cannot read {url}: {e}") from e
    out = []
    for sub in ("", "_arrow_ipc/"):
        try:
            listed = fs.get_file_info(pafs.FileSelector(f"{base}/{sub}".rstrip("/"), allow_not_found=True))
        except OSError as e:
            raise RingscopeError("RS_ERR_IO", f"cannot read {url}: {e}") from e
        out += [sub + pathlib.PurePosixPath(i.path).name for i in listed
                if i.type == pafs.FileType.Directory and pathlib.PurePosixPath(i.path).name.startswith("hookpoint=")]
    if hookpoint is not None:
        names = sorted({d.rsplit("hookpoint=", 1)[1] for d in out})
        if names and hookpoint not in names:
            raise RingscopeError("RS_ERR_INVALID_ARGUMENT",
                                 f"hookpoint {hookpoint!r} is not in {url}; it holds {', '.join(map(repr, names))}")
        out = [d for d in out if d.endswith(f"hookpoint={hookpoint}")]
    # read_dump reads the Parquet files, or the Arrow IPC ones of a run that has no Parquet: only those are fetched.
    parquet = [d for d in out if not d.startswith("_arrow_ipc/")]
    return parquet or out


def _columns(pieces: list, as_torch: bool) -> Optional[dict]:
    """One hookpoint's columns as read_dump gives them, from its tables: ``pieces``, (table, dtype name) of each of
    its series that has committed files — its full-precision rows, its downcast rows (``ROWSCALED``) —, whether or
    not the rows read from them (one request's) are any: a hookpoint with downcast files reads as float32, whichever
    rows are asked for. None when no row was read."""
    if not any(t.num_rows for t, _ in pieces):
        return None
    names = ("step", "request_id", "position", "layer", "rank")
    if len(pieces) == 1 and pieces[0][1] != ROWSCALED:
        t, dtype_name = pieces[0]
        t = t.sort_by([("step", "ascending"), ("request_id", "ascending"), ("position", "ascending")])
        np_dtype = _NUMPY_FOR_DTYPE[dtype_name]
        raw = _activation_bytes(t)
        act = raw.reshape(-1).view(np_dtype).reshape(t.num_rows, raw.shape[1] // np_dtype.itemsize)
        cols = {c: t.column(c).to_numpy() for c in names if c in t.column_names}
        cols["downcast"] = np.zeros(t.num_rows, dtype=bool)
        source = dtype_name
    else:
        # Downcast rows: every row as float32, sorted together.
        source = next((d for _, d in pieces if d != ROWSCALED), None)
        pieces = [(t, d) for t, d in pieces if t.num_rows]
        acts, flags = [], []
        for t, d in pieces:
            raw = _activation_bytes(t)
            if d == ROWSCALED:
                acts.append(dequantize_rowscaled(raw))
            else:
                np_dtype = _NUMPY_FOR_DTYPE[d]
                acts.append(_as_float32(raw.reshape(-1).view(np_dtype).reshape(t.num_rows, -1), d))
            flags.append(np.full(t.num_rows, d == ROWSCALED))
        cols = {c: np.concatenate([t.column(c).to_numpy() for t, _ in pieces]) for c in names
                if all(c in t.column_names for t, _ in pieces)}
        order = np.lexsort((cols["position"], cols["request_id"], cols["step"]))
        cols = {c: v[order] for c, v in cols.items()}
        act = np.concatenate(acts)[order]
        cols["downcast"] = np.concatenate(flags)[order]
        dtype_name = "f32"
    if as_torch:
        import torch

        from .stream import _int64

        act_t = torch.from_numpy(act.copy())
        if dtype_name == "bf16":
            act_t = act_t.view(torch.bfloat16)
        # Own, writable copies; unsigned id columns as int64, what torch indexes and counts with (ids above
        # 2**63-1 are refused, not wrapped).
        cols = {k: torch.from_numpy(np.array(_int64(k, v) if v.dtype.kind == "u" else v)) for k, v in cols.items()}
        cols["activation"] = act_t
    else:
        cols["activation"] = act
    cols["dtype"] = dtype_name
    # The hookpoint's own dtype (None when every row read was downcast: the downcast files do not say it).
    cols["source_dtype"] = source
    return cols


def _table_dtype(t) -> Optional[str]:
    """The ringscope dtype of a table's full-precision rows (its activation field's metadata, else its column; None
    for a table without rows or metadata saying it)."""
    meta = t.schema.field("activation").metadata or {}
    return meta.get(b"ringscope.dtype", b"").decode() or (t.column("dtype")[0].as_py() if t.num_rows else None)


def _remote_parquet(url: str):
    """(file system, scheme prefix, {hookpoint: (full-precision files, downcast files)}, every hookpoint with a
    Parquet partition) of the committed Parquet files of a run on object storage — listed, not downloaded; empty for a
    run without Parquet (Arrow IPC only)."""
    import pyarrow.fs as pafs

    try:
        fs, base = pafs.FileSystem.from_uri(url)
        infos = fs.get_file_info(pafs.FileSelector(base, recursive=True, allow_not_found=True))
    except (OSError, ValueError) as e:
        raise RingscopeError("RS_ERR_IO", f"cannot read {url}: {e}") from e
    if not infos:
        raise RingscopeError("RS_ERR_IO", f"{url} does not exist (no object under it): give the run's URL "
                                          "(<export.url>/<run_id>)")
    found: dict = {}
    seen = set()  # every hookpoint with a Parquet partition, committed files or not
    for info in infos:
        parts = info.path[len(base):].lstrip("/").split("/")
        if parts[0].startswith("hookpoint="):
            seen.add(parts[0][len("hookpoint="):])
        kind = _part_kind(parts[1:], "parquet") if parts[0].startswith("hookpoint=") else None
        if info.type != pafs.FileType.File or kind is None:
            continue
        found.setdefault(parts[0][len("hookpoint="):], ([], []))[kind].append(info.path)
    return fs, url.split("://", 1)[0] + "://", {n: (sorted(f), sorted(d)) for n, (f, d) in found.items()}, seen


def _read_remote(url: str, listed, hookpoint: Optional[str], as_torch: bool, request: int) -> dict:
    """read_dump of one request's rows of a Parquet run on object storage, read in place: footers, then only the row
    groups whose request-id statistics do not rule the request out (every page read is CRC-checked)."""
    fs, scheme, series, seen = listed
    if hookpoint is not None and hookpoint not in series:
        if hookpoint in seen:
            raise RingscopeError("RS_ERR_IO", f"hookpoint {hookpoint!r} of {url} holds no committed files yet: "
                                              f"{_COMMIT_HINT}")
        raise RingscopeError("RS_ERR_INVALID_ARGUMENT",
                             f"hookpoint {hookpoint!r} is not in {url}; it holds {', '.join(map(repr, sorted(seen)))}")
    if not series:
        raise RingscopeError("RS_ERR_IO", f"the run {url} holds no committed files yet: {_COMMIT_HINT}")
    out = {}
    for name in sorted(series) if hookpoint is None else [hookpoint]:
        pieces = []
        for files, downcast in zip(series[name], (False, True)):
            if files:
                t = _read_checked(files, request, fs, scheme, _Series(name, downcast))
                pieces.append((t, ROWSCALED if downcast else _table_dtype(t)))
        cols = _columns(pieces, as_torch)
        if cols is not None:
            out[name] = cols
    return out


def _request_ids(run: "str | os.PathLike", hookpoint: str) -> np.ndarray:
    """The request ids that have rows in ``hookpoint`` of ``run`` (sorted, unique): of a Parquet run only that column
    is read (in place on object storage); an Arrow IPC run is read as read_dump reads it."""
    import pyarrow as pa
    import pyarrow.dataset as ds

    from .stream import _part_files

    url = _object_url(run)
    if url is not None:
        fs, _, series, _ = _remote_parquet(url)
        files = series.get(hookpoint, ([], []))
    else:
        part = pathlib.Path(os.fsdecode(run)) / f"hookpoint={hookpoint}"
        fs, files = None, _part_files(part, "parquet") if part.is_dir() else ([], [])
    if files[0] or files[1]:
        try:
            table = ds.dataset([str(f) for f in files[0] + files[1]], filesystem=fs, format="parquet").to_table(
                columns=["request_id"])
            return np.unique(table.column("request_id").to_numpy())
        except (OSError, pa.ArrowException):
            pass  # read_dump names what cannot be read
    return np.unique(read_dump(run, hookpoint)[hookpoint]["request_id"])


def read_dump(path: "str | os.PathLike", hookpoint: Optional[str] = None, as_torch: bool = False,
              request: Optional[int] = None) -> dict:
    """Reads a dump (a run directory: its Parquet files, or its Arrow IPC files when it has no Parquet) into ``{hookpoint name: {column: array}}``: ``step``, ``request_id``,
    ``position``, ``layer``, ``rank`` as numpy arrays, and ``activation`` as an array of shape (rows, row_width)
    with the right dtype — bf16 as ``torch.bfloat16`` when ``as_torch`` (every column becomes a torch tensor then;
    ``step``, ``request_id`` and ``position`` as int64, which torch indexes and counts with: a request id or step
    above 2**63-1 is a :class:`RingscopeError`, read such a run with ``as_torch=False``), else as uint16 bit patterns
    (:func:`as_float32` converts). Rows are sorted by (step, request_id, position).
    ``downcast`` (bool per row) marks rows that were downcast on capture (``Session.set_downcast``): a hookpoint
    with any has its ``activation`` as float32 for every row (full-precision rows converted exactly, downcast rows
    dequantized: E4M3 × the row's scale), and ``dtype`` ``"f32"``; ``source_dtype`` is the hookpoint's own dtype.
    Only committed files are read; hookpoints without one yet are left out. ``hookpoint``: read only that one.
    ``request``: only the rows of that request id (a hookpoint without any is left out); Parquet row groups whose
    request-id statistics rule it out are skipped, the rest are read and checked as always (on object storage such
    a read of a Parquet run reads the files in place: their footers and those row groups only). Raises
    :class:`RingscopeError` when ``path`` does not exist or is not a run directory, when ``hookpoint`` is not in the
    run, when the run (or that hookpoint) holds no committed file yet, and (``RS_ERR_IO``, naming the file) when a
    file's bytes are not as written — every Parquet page's CRC, every Arrow IPC record batch's CRC-32 is checked as it
    is read; a file cut short is found too — or when a file does not belong in its partition (another hookpoint's
    file, or rows of another width or dtype). ``path`` may be a run on object storage (``s3://bucket/prefix/run``,
    ``gs://``, ``az://``; credentials and endpoint from the environment, as pyarrow takes them: ``AWS_ENDPOINT_URL``,
    ``AWS_ACCESS_KEY_ID``, ...): its files (those of ``hookpoint`` only, when given) are downloaded into a temporary
    directory, read as above, and removed. Needs pyarrow."""
    if request is not None:
        request = _u64("request", request)
    url = _object_url(path)
    if url is not None:
        if hookpoint is not None:
            _text("hookpoint", hookpoint)
        if request is not None:
            listed = _remote_parquet(url)
            if listed[3]:  # a Parquet run: read in place, only the row groups that may hold the request
                return _read_remote(url, listed, hookpoint, as_torch, request)
        with _fetched(url, _run_subdirs(url, hookpoint)) as local:
            try:
                return read_dump(local, hookpoint, as_torch, request)
            except RingscopeError as e:
                raise RingscopeError(e.status, str(e.message).replace(str(local), url)) from e
    root = pathlib.Path(os.fsdecode(_path("path", path)))
    if hookpoint is not None:
        _text("hookpoint", hookpoint)
    if not root.exists():
        raise RingscopeError("RS_ERR_IO", f"{root} does not exist: give the run directory (<export.dir>/<run_id>)")
    if not root.is_dir():
        raise RingscopeError("RS_ERR_IO", f"{root} is not a directory: give the run directory "
                                          "(<export.dir>/<run_id>), not one of its files")
    base, ext = root, "parquet"
    ipc = root / "_arrow_ipc"
    if not any(p.is_dir() for p in root.glob("hookpoint=*")) and any(p.is_dir() for p in ipc.glob("hookpoint=*")):
        base, ext = ipc, "arrow"  # a run dumped to Arrow IPC only
    parts = sorted(p for p in base.glob("hookpoint=*") if p.is_dir())
    if not parts:
        runs = sorted(p.name for p in root.iterdir()
                      if p.is_dir() and (any(p.glob("hookpoint=*")) or any(p.glob("_arrow_ipc/hookpoint=*"))))
        if runs:
            raise RingscopeError("RS_ERR_IO", f"{root} is not a run directory but holds runs ({', '.join(runs)}): "
                                              f"give one, e.g. read_dump({str(root / runs[0])!r})")
        raise RingscopeError("RS_ERR_IO", f"{root} holds no committed files yet (no hookpoint=... partitions): "
                                          f"{_COMMIT_HINT}; or it is not a ringscope run directory "
                                          "(<export.dir>/<run_id>)")
    names: Sequence[str] = [p.name[len("hookpoint="):] for p in parts]  # (reused below for a tuple)
    if hookpoint is not None and hookpoint not in names:
        raise RingscopeError("RS_ERR_INVALID_ARGUMENT",
                             f"hookpoint {hookpoint!r} is not in {root}; it holds {', '.join(map(repr, names))}")
    # Committed files only: in-progress ones are hidden (.part-*.inprogress) and pyarrow skips them.
    # Downcast rows are a series of their own in each partition (rank=*/_f8e4m3_rowscaled/).
    from .stream import _part_files, _Series

    files = {p: _part_files(p, ext) for p in parts if hookpoint is None or p.name == f"hookpoint={hookpoint}"}
    committed = {p: full + downcast for p, (full, downcast) in files.items()}
    if not any(committed.values()):
        what = f"hookpoint {hookpoint!r} of {root}" if hookpoint is not None else f"the run {root}"
        raise RingscopeError("RS_ERR_IO", f"{what} holds no committed files yet: {_COMMIT_HINT}")
    parts = [p for p in parts if committed.get(p)]
    out = {}
    for part in parts:
        # One dataset per hookpoint: hookpoints differ in row width, so they do not share one Arrow schema.
        name = part.name[len("hookpoint="):]
        full_files, downcast_files = files[part]
        # Each file belongs where it lies (its footer names this hookpoint; one row width and dtype per series): a
        # file of another hookpoint copied into the partition is an error naming it, not a pyarrow or numpy error.
        _Series(name, False).check_files(ext, full_files)
        _Series(name, True).check_files(ext, downcast_files)
        pieces = []  # (table, dtype name) of the full-precision rows, then of the downcast rows
        if full_files:
            t = _read_checked(part, request) if ext == "parquet" else _read_ipc_checked(full_files, request)
            pieces.append((t, _table_dtype(t)))
        if downcast_files:
            t = (_read_checked(downcast_files, request) if ext == "parquet"
                 else _read_ipc_checked(downcast_files, request))
            pieces.append((t, ROWSCALED))
        cols = _columns(pieces, as_torch)
        if cols is not None:  # (None: no rows — of the request asked for, or at all)
            out[name] = cols
    return out


#: The events table's directory in a run directory, and its columns in order (docs/format.md, "The events table").
EVENTS_DIR = "_ringscope_events"


EVENT_COLUMNS = ("unix_ns", "hookpoint", "first_step", "last_step", "kind", "rung", "reason", "records_lost",
                 "rows_lost", "detail", "request_id", "first_position", "end_position")


#: Columns an events file written before they existed lacks: read as None.
_LATER_EVENT_COLUMNS = ("request_id", "first_position", "end_position")


def read_events(path: "str | os.PathLike") -> list:
    """Reads the events table of a run directory (``<run dir>/_ringscope_events/part-*.parquet``, written for
    Parquet and Arrow IPC dumps alike): a list of dicts, one per event, with the keys of :data:`EVENT_COLUMNS` —
    ``kind`` is ``"drop"`` (records of ``hookpoint`` dropped somewhere in steps ``first_step..=last_step`` for
    ``reason``, e.g. ``"ring_full"`` or ``"sink_error"``: ``records_lost`` records, ``rows_lost`` token rows),
    ``"rung"`` (the hookpoint moved to rung ``rung``; ``reason`` and ``detail`` say why), ``"stall"`` or ``"cached"``
    (the engine took request ``request_id``'s positions ``first_position..end_position`` from its prefix cache;
    these three are None for events about no one request). Events are in
    the order they were logged (file by file, in commit order). After a run has shut down, ``rows_lost`` summed per
    (hookpoint, reason) over the drops equals the manifest's dropped rows. A run that never lost anything has no
    events directory: that reads as ``[]``. Every Parquet page's CRC is checked (``RS_ERR_IO`` naming a corrupt
    file). Raises :class:`RingscopeError` when ``path`` is not a directory. ``path`` may be a run on object storage,
    as for :func:`read_dump`. Needs pyarrow."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    url = _object_url(path)
    if url is not None:
        with _fetched(url, [EVENTS_DIR]) as local:
            try:
                return read_events(local)
            except RingscopeError as e:
                raise RingscopeError(e.status, str(e.message).replace(str(local), url)) from e

    root = pathlib.Path(os.fsdecode(_path("path", path)))
    if not root.is_dir():
        raise RingscopeError("RS_ERR_IO", f"{root} is not a directory: give the run directory (<export.dir>/<run_id>)")
    # Committed files only: in-progress ones are hidden (.part-*.inprogress).
    files = sorted((root / EVENTS_DIR).glob("part-*.parquet"))
    events = []
    for f in files:
        try:
            table = pq.read_table(f, page_checksum_verification=True)
        except (OSError, pa.ArrowException) as e:
            raise RingscopeError("RS_ERR_IO", f"{f} is corrupt (its bytes are not as written): {e}") from e
        missing = [c for c in EVENT_COLUMNS if c not in table.column_names and c not in _LATER_EVENT_COLUMNS]
        if missing:
            raise RingscopeError("RS_ERR_IO", f"{f} is not a ringscope events file: no column(s) {', '.join(missing)}")
        for c in _LATER_EVENT_COLUMNS:
            if c not in table.column_names:
                table = table.append_column(c, pa.nulls(table.num_rows, pa.uint64()))
        events += table.select(list(EVENT_COLUMNS)).to_pylist()
    return events
