"""Probe files (:func:`save_probe`) and calibration retention (:func:`calibration_retention`)."""

from __future__ import annotations

import json
import numbers
import os
import pathlib
from typing import Any, Dict, Optional, cast

import numpy as np

from ._abi import PROBE_MAX_OUTPUTS
from .errors import RingscopeError
from ._args import _flag, _int, _int_array, _invalid, _path, _show, _text, _U64_MAX
from .dtypes import _as_float32, as_float32
from .dump import read_dump


def _probe_matrix(name: str, values, shape_hint: str) -> np.ndarray:
    """A numpy array, torch tensor or nested list of finite numbers → float32 (C order)."""
    if hasattr(values, "detach") and hasattr(values, "cpu"):  # a torch tensor: no grad, on the host, as float32
        values = values.detach().cpu().float().numpy()
    try:
        a = np.asarray(values)
    except (TypeError, ValueError) as e:
        raise _invalid(f"{name} must be an array of numbers {shape_hint}, got {type(values).__name__}: {e}") from None
    if a.dtype.kind not in "fiu" and a.dtype.name != "bfloat16":
        raise _invalid(f"{name} must hold numbers {shape_hint}, got an array of {a.dtype}")
    a = np.ascontiguousarray(a, dtype=np.float32)
    bad = np.argwhere(~np.isfinite(a))
    if bad.size:
        at = tuple(int(i) for i in bad[0])
        raise _invalid(f"{name}{list(at)} is {a[at]} ({name} must be finite; {len(bad)} value(s) are not)")
    return a


def save_probe(path: "str | os.PathLike", weights, bias=None) -> dict:
    """Writes a linear probe trained elsewhere (numpy, torch) as a file a ``[[probes]]`` entry reads: ``weights``
    of shape ``[K, d]`` (``K`` outputs, 1..=:data:`PROBE_MAX_OUTPUTS`, over rows of ``d`` elements — the
    hookpoint's row width) or ``[d]`` (one output), and optionally ``bias`` (``K`` numbers). Scores are
    ``weights @ x + bias``, in float32 (what the file holds). ``path`` ending in ``.safetensors``: tensors ``weight``
    and, given a bias, ``bias`` in one file; ending in ``.npy``: the weights (the bias then goes inline in the
    configuration). Every value must be finite. Returns the entry's keys to use: ``{"weights": <absolute path>}``,
    plus ``"bias": [...]`` for a ``.npy`` with a bias — e.g. ``Session({"probes": [{"name": "p", "hookpoint": "h",
    "threshold": 0.5, **ringscope.save_probe("p.npy", w, b)}], ...})``."""
    raw = _path("path", path)
    target = pathlib.Path(os.fsdecode(raw)).absolute()
    suffix = target.suffix.lower()
    if suffix not in (".npy", ".safetensors"):
        raise _invalid(f"path must end in .npy or .safetensors (the formats probes read), got {str(target)!r}")
    w = _probe_matrix("weights", weights, "of shape [K, d] or [d]")
    if w.ndim not in (1, 2) or w.size == 0:
        raise _invalid(f"weights must have shape [K, d] or [d] with K, d >= 1, got shape {w.shape}")
    k = 1 if w.ndim == 1 else w.shape[0]
    if k > PROBE_MAX_OUTPUTS:
        raise _invalid(f"weights have {k} outputs (rows); a probe has 1..={PROBE_MAX_OUTPUTS}")
    b = None
    if bias is not None:
        b = _probe_matrix("bias", bias, f"of shape [{k}]").reshape(-1) if np.ndim(bias) <= 1 else None
        if b is None or b.shape != (k,):
            raise _invalid(f"bias must have one number per output: shape [{k}], got shape {np.shape(bias)}")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        if suffix == ".npy":
            with open(target, "wb") as f:
                np.save(f, w.astype("<f4"), allow_pickle=False)
        else:
            tensors = [("weight", w)] + ([("bias", b)] if b is not None else [])
            header, offset = {}, 0
            for name, t in tensors:
                header[name] = {"dtype": "F32", "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
                offset += t.nbytes
            text = json.dumps(header, separators=(",", ":")).encode()
            text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
            with open(target, "wb") as f:
                f.write(len(text).to_bytes(8, "little") + text)
                for _, t in tensors:
                    f.write(t.astype("<f4").tobytes())
    except OSError as e:
        raise RingscopeError("RS_ERR_IO", f"cannot write the probe to {target}: {e}") from e
    entry: Dict[str, Any] = {"weights": str(target)}
    if b is not None and suffix == ".npy":
        entry["bias"] = [float(v) for v in b]
    return entry


# -- calibration retention (ProbeX) --------------------------------------------------------------------------------
# `inspect retention` in Python, over read_dump (Parquet dumps): the same rows, the same arithmetic (f64 means of the
# rows as float32, rows with a non-finite element skipped; weights as float32), the same fields.


class _Ids:
    """A calibration group: request ids as sorted, disjoint, inclusive ranges."""

    def __init__(self, name: str, value):
        self.name = name
        if isinstance(value, str):
            self.text = value
            ranges = self._parse(name, value)
        elif isinstance(value, range) and value.step == 1:
            self.text = f"{value.start}-{value.stop - 1}" if len(value) else ""
            if len(value) and not (0 <= value.start and value.stop - 1 <= _U64_MAX):
                raise _invalid(f"{name} must hold request ids in 0..={_U64_MAX}, got {value!r}")
            ranges = [(value.start, value.stop - 1)] if len(value) else []
        else:
            ids = np.unique(_int_array(name, value, np.uint64))
            self.text = _show(value)
            ranges = [(int(i), int(i)) for i in ids]
        if not ranges:
            raise _invalid(f"{name} is empty: give the request ids of a calibration group")
        merged: list = []
        for lo, hi in sorted(ranges):
            if merged and lo <= merged[-1][1] + 1:
                merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
            else:
                merged.append((lo, hi))
        self.ranges = merged
        self._lo = np.array([r[0] for r in merged], dtype=np.uint64)
        self._hi = np.array([r[1] for r in merged], dtype=np.uint64)

    @staticmethod
    def _parse(name: str, text: str) -> list:
        """inspect's syntax: ``0-49,60,70-79``, or ``@FILE`` with one id or range a line (``#`` comments)."""
        body = text
        if text.startswith("@"):
            try:
                lines = pathlib.Path(text[1:]).read_text().splitlines()
            except OSError as e:
                raise _invalid(f"{name}: cannot read {text[1:]}: {e}") from None
            body = ",".join(line.strip() for line in lines if line.strip() and not line.strip().startswith("#"))

        def one(s: str) -> int:
            s = s.strip()
            if not s.isdigit() or int(s) > _U64_MAX:
                raise _invalid(f"{name}: {s!r} is not a request id (an unsigned 64-bit integer) in {text!r}")
            return int(s)

        ranges = []
        for item in body.split(","):
            if not item.strip():
                raise _invalid(f"{name}: an empty item in {text!r}: give ids and ranges like '0-49,60'")
            lo_text, sep, hi_text = item.partition("-")
            lo, hi = (one(lo_text), one(hi_text)) if sep else (one(item), one(item))
            if lo > hi:
                raise _invalid(f"{name}: the range {item.strip()} is empty (its start is past its end)")
            ranges.append((lo, hi))
        return ranges

    def count(self) -> int:
        return sum(hi - lo + 1 for lo, hi in self.ranges)

    def mask(self, request_id: np.ndarray) -> np.ndarray:
        rid = np.asarray(request_id, dtype=np.uint64)
        i = np.searchsorted(self._hi, rid, side="left")
        inside = i < len(self._hi)
        return inside & (self._lo[np.minimum(i, len(self._lo) - 1)] <= rid)

    def common(self, other: "_Ids"):
        i = j = 0
        while i < len(self.ranges) and j < len(other.ranges):
            (a0, a1), (b0, b1) = self.ranges[i], other.ranges[j]
            if max(a0, b0) <= min(a1, b1):
                return max(a0, b0)
            if a1 < b1:
                i += 1
            else:
                j += 1
        return None


# Looked up with the header's "dtype" value, whatever JSON holds there (a miss: not a dtype retention reads).
_SAFETENSORS_DTYPES: Dict[object, str] = {"F32": "<f4", "F16": "<f2", "F64": "<f8", "BF16": "<u2"}


def _load_safetensors(path: pathlib.Path, tensor: str) -> np.ndarray:
    import json

    data = path.read_bytes()
    try:
        n = int.from_bytes(data[:8], "little")
        header = json.loads(data[8:8 + n])
        if not isinstance(header, dict):
            raise ValueError("the header is not a JSON object")
    except (ValueError, UnicodeDecodeError) as e:
        raise _invalid(f"weights: {path}: not a safetensors file: {e}") from None
    entry = header.get(tensor) if tensor != "__metadata__" else None
    if not isinstance(entry, dict):
        names = ", ".join(sorted(k for k in header if k != "__metadata__"))
        raise _invalid(f"weights: {path}: no tensor {tensor!r} (it has {names}); name the weights with tensor=")
    dtype = _SAFETENSORS_DTYPES.get(entry.get("dtype"))
    if dtype is None:
        raise _invalid(f"weights: {path}: tensor {tensor!r} is {entry.get('dtype')}; use F32, F16, BF16 or F64")
    try:
        start, end = entry["data_offsets"]
        values = np.frombuffer(data[8 + n + start:8 + n + end], dtype=dtype).reshape(entry["shape"])
    except (KeyError, TypeError, ValueError) as e:
        raise _invalid(f"weights: {path}: tensor {tensor!r} is malformed: {e}") from None
    return as_float32(values) if entry["dtype"] == "BF16" else values


def _retention_weights(weights, tensor: str) -> np.ndarray:
    """[K, d] float32 weights from an array ([K, d] or [d]) or a .npy / .safetensors file."""
    if isinstance(weights, (str, bytes, os.PathLike)):
        path = pathlib.Path(os.fsdecode(_path("weights", weights)))
        suffix = path.suffix.lower()
        if not path.is_file():
            raise _invalid(f"weights: {path} is not a file")
        if suffix == ".npy":
            try:
                w = np.load(path, allow_pickle=False)
            except (ValueError, OSError) as e:
                raise _invalid(f"weights: {path}: not a .npy file: {e}") from None
        elif suffix == ".safetensors":
            w = _load_safetensors(path, _text("tensor", tensor).decode())
        else:
            raise _invalid(f"weights: {path}: unknown file type: use a .safetensors or a .npy file (or an array)")
        what = str(path)
    else:
        w = np.asarray(weights)
        what = "the array"
    if w.dtype.kind != "f" and w.dtype.name != "bfloat16":
        raise _invalid(f"weights: {what} holds {w.dtype}; weights are floats")
    if w.ndim == 1:
        w = w[None, :]
    if w.ndim != 2 or w.shape[0] == 0 or w.shape[1] == 0:
        raise _invalid(f"weights: {what} has shape {w.shape}; weights are [K, d] or [d]")
    w = np.ascontiguousarray(w, dtype=np.float32)
    bad = np.argwhere(~np.isfinite(w))
    if len(bad):
        k, j = bad[0]
        raise _invalid(f"weights: {what}: weight [{k}, {j}] is {w[k, j]} (weights must be finite)")
    return w


def _retention_side(run, which: str, hookpoint: str, groups, width: int, last_token: bool, rank):
    """(rows per group, μ_a − μ_b or None) of one run."""
    cols = read_dump(run, hookpoint=hookpoint)[hookpoint]
    if cols["dtype"] not in ("f32", "f16", "bf16"):
        raise _invalid(f"hookpoint {hookpoint!r} holds rows of dtype {cols['dtype']}: retention reads float rows")
    act = cols["activation"]
    if act.shape[1] != width:
        raise _invalid(f"weights are [*, {width}] but rows of hookpoint {hookpoint!r} in {which}{run} have "
                       f"{act.shape[1]} elements: the probe does not read this hookpoint")
    rid, pos = cols["request_id"], cols["position"]
    keep = np.ones(len(rid), dtype=bool) if rank is None else cols["rank"] == rank
    rows, means = [], []
    for g in groups:
        sel = np.flatnonzero(keep & g.mask(rid))
        if len(sel) == 0:
            raise _invalid(f"{g.name} ({g.text}) has no rows at hookpoint {hookpoint!r} in {which}{run}: none of "
                           f"its {g.count()} request ids was captured there")
        if last_token:
            # Each request's highest position: the last row of each request once sorted by (request, position).
            order = sel[np.lexsort((pos[sel], rid[sel]))]
            last = np.r_[rid[order][1:] != rid[order][:-1], True]
            sel = order[last]
        x = _as_float32(act[sel], cols["dtype"]).astype(np.float64)
        x = x[np.isfinite(x).all(axis=1)]
        rows.append(len(x))
        means.append(x.mean(axis=0) if len(x) else None)
    # any() does not narrow for mypy: both means are arrays here.
    diff = None if any(m is None for m in means) else cast(np.ndarray, means[0]) - cast(np.ndarray, means[1])
    return rows, diff


def _cosine(w: np.ndarray, v) -> float:
    if v is None:
        return float("nan")
    w = w.astype(np.float64)
    ww, vv = float(w @ w), float(v @ v)
    return float("nan") if ww == 0.0 or vv == 0.0 else float(w @ v) / (np.sqrt(ww) * np.sqrt(vv))


def calibration_retention(run: "str | os.PathLike", weights, hookpoint: str, group_a, group_b,
                          reference: "str | os.PathLike | None" = None, min: Optional[float] = None,
                          last_token: bool = False, *, tensor: str = "weight", rank: Optional[int] = None) -> list:
    """ProbeX's calibration retention of a probe over Parquet dumps (what ``inspect retention`` reports).

    For each probe output k (weights ``w_k``), the alignment is ``cos(w_k, μ_a − μ_b)``: μ_a and μ_b are the means
    of the rows the run ``run`` captured at ``hookpoint`` for the requests of ``group_a`` and ``group_b`` (every row of
    those requests; with ``last_token``, only each request's highest captured position). The retention is that
    alignment divided by the alignment in ``reference`` (the same request ids there): ≈ 1 while the probe's direction
    still separates the groups as it did, ≈ 0 where the representation it reads is gone.

    ``weights``: a float array of shape [K, d] or [d], or a path to a ``.npy`` or ``.safetensors`` file (the tensor
    ``tensor``). ``group_a``/``group_b``: request ids — a sequence of ints, a ``range``, or a string in inspect's
    syntax (``"0-49,60"``, ``"@ids.txt"``); disjoint. ``min``: flag outputs whose retention (without a reference:
    alignment) is below it or not a number. ``rank``: read only that rank's rows.

    Returns one dict per output: ``output``, ``rows_a``, ``rows_b``, ``alignment``, ``reference_rows_a``,
    ``reference_rows_b``, ``reference_alignment``, ``retention`` (the reference fields None without a reference; NaN
    where a value is not a number), ``flagged``. Rows with a NaN or infinite element are not counted. Raises
    :class:`RingscopeError` naming the argument for bad input (an unknown hookpoint, weights whose width is not the
    hookpoint's, an empty group, ...) and as :func:`read_dump` does for the dumps. Needs pyarrow."""
    _text("hookpoint", hookpoint)
    if not isinstance(tensor, str):
        _text("tensor", tensor)
    last_token = _flag("last_token", last_token)
    if min is not None:
        ok = isinstance(min, numbers.Real) and not isinstance(min, (bool, np.bool_)) and np.isfinite(float(min))
        if not ok:
            raise _invalid(f"min must be a finite number or None, got {_show(min)}")
        min = float(min)
    if rank is not None:
        rank = _int("rank", rank, 0, 2**31 - 1)
    groups = (_Ids("group_a", group_a), _Ids("group_b", group_b))
    common = groups[0].common(groups[1])
    if common is not None:
        raise _invalid(f"request {common} is in both group_a and group_b: the groups must be disjoint")
    w = _retention_weights(weights, tensor)
    rows, diff = _retention_side(run, "", hookpoint, groups, w.shape[1], last_token, rank)
    ref_rows, ref_diff = (None, None) if reference is None else \
        _retention_side(reference, "the reference run ", hookpoint, groups, w.shape[1], last_token, rank)
    out = []
    for k in range(w.shape[0]):
        alignment = _cosine(w[k], diff)
        ref_alignment = None if reference is None else _cosine(w[k], ref_diff)
        retention = None if ref_alignment is None else \
            (float("nan") if ref_alignment == 0.0 else alignment / ref_alignment)
        value = alignment if retention is None else retention
        out.append({
            "output": k,
            "rows_a": rows[0],
            "rows_b": rows[1],
            "alignment": alignment,
            "reference_rows_a": None if ref_rows is None else ref_rows[0],
            "reference_rows_b": None if ref_rows is None else ref_rows[1],
            "reference_alignment": ref_alignment,
            "retention": retention,
            "flagged": min is not None and not value >= min,
        })
    return out
