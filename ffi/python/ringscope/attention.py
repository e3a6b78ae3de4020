"""Attention patterns rebuilt from captured rows: :func:`attention_pattern` and :func:`attention_metadata`.

The ``attn_q`` / ``attn_k`` / ``attn_v`` sites (``ringscope.torch.attach``, the vLLM and SGLang plugins) capture
what a layer's attention receives for each new token: its query and key after RoPE and its value, ``heads ×
head_dim`` per row. A token's key and value are its KV-cache fragment. The run's manifest holds, under
``metadata.attention``, what a rebuild needs per layer (heads, head size, softmax scale, causal, sliding window,
logit soft-cap, sinks; RoPE parameters for information), as the engine ran it. From them the weights are rebuilt in
float32 the way the engines compute them::

    s[h, i, j] = scale · q[i, h] · k[j, h // (H / KV)]           (query head h reads KV head h // (H / KV))
    s = softcap · tanh(s / softcap)                                (when the layer soft-caps its logits)
    key j visible to query i  ⇔  pos[j] ≤ pos[i]  and, with a window W,  pos[j] > pos[i] − W
    w[h, i, :] = softmax over the visible keys (with sinks: one more logit per head in the denominator)

Needs numpy and, to read the rows, pyarrow (as :func:`ringscope.read_dump`); no torch.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import numpy as np

from ._args import _flag, _int, _path, _u64, _U32_MAX
from .errors import RingscopeError

__all__ = ["AttentionPattern", "attention_pattern", "attention_metadata"]

#: The ``format`` of ``metadata.attention`` this reader understands.
ATTENTION_FORMAT = 1


@dataclass
class AttentionPattern:
    """The attention weights of one request in one layer, rebuilt from captured rows.

    ``weights``: float32 ``[heads, queries, keys]`` (``[queries, keys]`` when one head was asked for); row ``i`` is
    the query at ``query_positions[i]``, column ``j`` the key at ``key_positions[j]``; keys a query does not see
    (later positions, outside its window) weigh 0. ``heads``: the (model-wide) query head of each entry of the first
    axis. ``missing_key_positions``: key positions some query sees but no row holds (only with
    ``allow_missing=True``; the weight of a query on such a key is NaN — queries that do not see it keep 0 there —,
    every query's row is a softmax over the captured keys it sees, and ``exact`` is False: rows of queries that see
    no missing key are still exact). ``metadata``: the layer's entry of ``metadata.attention`` (rank 0's)."""

    weights: np.ndarray
    query_positions: np.ndarray
    key_positions: np.ndarray
    heads: List[int]
    layer: int
    request: int
    missing_key_positions: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    exact: bool = True
    metadata: dict = field(default_factory=dict)


def _json_safe(value):
    """``value`` (a config entry) as plain JSON values: numbers, strings, booleans, None, lists and dicts (keys as
    strings); NaN and infinities as None; anything else as its ``str``."""
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if isinstance(value, bool) or value is None or isinstance(value, (int, str)):
        return value
    if isinstance(value, float):
        return value if np.isfinite(value) else None
    return str(value)


def layer_entry(config, layer: int, *, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                sliding_window: Optional[int], softcap: Optional[float], module: str, q_head_offset: int = 0,
                kv_head_offset: int = 0, total_num_heads: Optional[int] = None,
                total_num_kv_heads: Optional[int] = None, **extra) -> dict:
    """One layer's entry of ``metadata.attention`` (the layout :func:`attention_metadata` reads), from what the
    capturing side read off the engine's modules; the RoPE parameters (information only) from the model's
    ``config``. ``sliding_window``: keys a query sees, itself included (falsy: none); ``softcap``: falsy: none."""
    rope = getattr(config, "rope_parameters", None) or {"rope_theta": getattr(config, "rope_theta", None),
                                                         "rope_scaling": getattr(config, "rope_scaling", None)}
    return {
        "layer": layer, "num_heads": int(num_heads), "num_kv_heads": int(num_kv_heads), "head_dim": int(head_dim),
        "q_head_offset": q_head_offset, "kv_head_offset": kv_head_offset,
        "total_num_heads": int(total_num_heads if total_num_heads is not None else num_heads),
        "total_num_kv_heads": int(total_num_kv_heads if total_num_kv_heads is not None else num_kv_heads),
        "scale": float(scale), "causal": True, "sliding_window": int(sliding_window) if sliding_window else None,
        "softcap": float(softcap) if softcap else None, "sinks": None, "alibi_slopes": None,
        "rope": _json_safe(rope), "partial_rotary_factor": getattr(config, "partial_rotary_factor", None),
        "module": module, **extra,
    }


def _manifests(root: pathlib.Path) -> Dict[int, dict]:
    """The run's manifests by rank (``_ringscope_run.json``, ``_ringscope_run.rank=R.json``)."""
    out = {}
    for p in sorted(root.glob("_ringscope_run*.json")):
        try:
            m = json.loads(p.read_text())
        except (OSError, ValueError) as e:
            raise RingscopeError("RS_ERR_IO", f"cannot read the run manifest {p}: {e}") from e
        if isinstance(m, dict):
            out[int(m.get("rank", 0) or 0)] = m
    return out


def _root(run) -> pathlib.Path:
    root = pathlib.Path(os.fsdecode(_path("run", run)))
    if not root.is_dir():
        raise RingscopeError("RS_ERR_IO", f"{root} is not a run directory (<export.dir>/<run_id>)")
    return root


def attention_metadata(run: "str | os.PathLike") -> Dict[int, dict]:
    """The run's attention metadata by rank: ``{rank: {layer: entry}}``, each entry as the engine ran the layer —
    ``num_heads`` / ``num_kv_heads`` (this rank's), ``q_head_offset`` / ``kv_head_offset`` (its first heads in the
    model), ``head_dim``, ``scale``, ``causal``, ``sliding_window`` (keys a query sees, itself included; None: all),
    ``softcap``, ``sinks``, ``alibi_slopes``, ``rope`` (information: the rows are after RoPE), ``hookpoints`` (``q`` /
    ``k`` / ``v``: the names of its captured sites). Ranks whose manifest has none are left out; ``{}`` when no rank
    has any. Manifests are written when a session closes."""
    from .dump import _fetched
    from .stream import _object_url

    url = _object_url(run)
    if url is not None:
        with _fetched(url, []) as local:
            return attention_metadata(local)
    out: Dict[int, dict] = {}
    for rank, m in _manifests(_root(run)).items():
        entry = (m.get("metadata") or {}).get("attention")
        if not isinstance(entry, dict):
            continue
        if entry.get("format") != ATTENTION_FORMAT:
            raise RingscopeError("RS_ERR_INVALID_ARGUMENT",
                                 f"rank {rank}'s attention metadata is format {entry.get('format')!r}; this ringscope "
                                 f"reads format {ATTENTION_FORMAT}: upgrade ringscope")
        out[rank] = {int(e["layer"]): e for e in entry.get("layers", [])}
    return out


def _ranges(positions: np.ndarray) -> str:
    """Sorted positions as ``a..b`` ranges (``b`` included), the first few."""
    parts: List[str] = []
    i = 0
    while i < len(positions) and len(parts) < 8:
        j = i
        while j + 1 < len(positions) and positions[j + 1] == positions[j] + 1:
            j += 1
        parts.append(f"{positions[i]}" if i == j else f"{positions[i]}..{positions[j]}")
        i = j + 1
    return ", ".join(parts) + (", ..." if i < len(positions) else "")


def _rows(dump: dict, name: str, rank: int, request: int, width: int):
    """(positions, float32 rows) of ``request`` in hookpoint ``name`` on ``rank``: one row per position, the one of the
    latest step where a position was computed more than once (recomputation after preemption). ``dump[name]`` None:
    the request has no rows there."""
    from .dtypes import _as_float32

    cols = dump[name]
    if cols is None:
        return np.zeros(0, dtype=np.int64), np.zeros((0, width), dtype=np.float32)
    if cols["downcast"].any():
        raise RingscopeError("RS_ERR_INVALID_ARGUMENT",
                             f"rows of {name} were downcast to E4M3 on capture: too coarse to rebuild attention; "
                             "capture attention sites without downcast")
    act = cols["activation"]
    if act.shape[1] != width:
        raise RingscopeError("RS_ERR_INVALID_ARGUMENT",
                             f"{name} has rows of {act.shape[1]} elements but its layer's attention metadata says "
                             f"{width}: the run's files and manifest disagree")
    keep = cols["request_id"] == np.uint64(request)
    if "rank" in cols:
        keep &= cols["rank"] == rank
    pos, step = cols["position"][keep].astype(np.int64), cols["step"][keep]
    order = np.lexsort((-step.astype(np.float64), pos))  # by position, latest step first
    pos, idx = pos[order], np.flatnonzero(keep)[order]
    first = np.ones(len(pos), dtype=bool)
    first[1:] = pos[1:] != pos[:-1]
    return pos[first], _as_float32(act[idx[first]], cols["dtype"]).astype(np.float32)


def _checked(e, layer: int, rank: int) -> dict:
    """A layer's metadata entry with its numbers checked (an engine writing it through ``rs_session_set_metadata``
    may get it wrong): a RingscopeError naming the key, not a numpy error later."""
    where = f"layer {layer}'s attention metadata (rank {rank})"
    if not isinstance(e, dict):
        raise RingscopeError("RS_ERR_INVALID_ARGUMENT", f"{where} is not an object")

    def integer(key, lo, default=None):
        v = e.get(key, default)
        if not isinstance(v, int) or isinstance(v, bool) or v < lo:
            raise RingscopeError("RS_ERR_INVALID_ARGUMENT", f"{where}: {key} = {v!r}; give an integer >= {lo}")
        return v

    out = dict(e)
    out["num_heads"], out["num_kv_heads"], out["head_dim"] = (integer("num_heads", 1), integer("num_kv_heads", 1),
                                                              integer("head_dim", 1))
    if out["num_heads"] % out["num_kv_heads"]:
        raise RingscopeError("RS_ERR_INVALID_ARGUMENT",
                             f"{where}: num_heads = {out['num_heads']} is not a multiple of num_kv_heads = "
                             f"{out['num_kv_heads']}")
    out["q_head_offset"] = integer("q_head_offset", 0, 0)
    scale = e.get("scale")
    if not isinstance(scale, (int, float)) or isinstance(scale, bool) or not math.isfinite(scale) or scale <= 0:
        raise RingscopeError("RS_ERR_INVALID_ARGUMENT", f"{where}: scale = {scale!r}; give a positive number")
    window = e.get("sliding_window")
    out["sliding_window"] = None if window is None else integer("sliding_window", 1)
    cap = e.get("softcap")
    if cap is not None and (not isinstance(cap, (int, float)) or isinstance(cap, bool) or not math.isfinite(cap)
                            or cap <= 0):
        raise RingscopeError("RS_ERR_INVALID_ARGUMENT", f"{where}: softcap = {cap!r}; give a positive number or null")
    sinks = e.get("sinks")
    if sinks is not None and (not isinstance(sinks, list) or len(sinks) != out["num_heads"]
                              or not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in sinks)):
        raise RingscopeError("RS_ERR_INVALID_ARGUMENT",
                             f"{where}: sinks must be null or {out['num_heads']} numbers (one per query head)")
    return out


def _keys_seen(qpos: np.ndarray, window: Optional[int]) -> np.ndarray:
    """The sorted key positions any query at ``qpos`` (sorted) sees: the union of ``[max(0, p - W + 1), p]``
    (``[0, p]`` without a window), built from the merged intervals."""
    lo = np.maximum(qpos - window + 1, 0) if window else np.zeros_like(qpos)
    parts, start, end = [], int(lo[0]), int(qpos[0])
    for a, b in zip(lo[1:].tolist(), qpos[1:].tolist()):
        if a > end + 1:
            parts.append(np.arange(start, end + 1))
            start = a
        end = max(end, b)
    parts.append(np.arange(start, end + 1))
    return np.concatenate(parts).astype(np.int64)


def attention_pattern(run: "str | os.PathLike", request: int, layer: int, head: Optional[int] = None, *,
                      allow_missing: bool = False) -> AttentionPattern:
    """Rebuilds the attention weights of request ``request`` in layer ``layer`` from the run's captured ``attn_q`` and
    ``attn_k`` rows and the layer's attention metadata (see the module's docstring for the formula): every query the
    run holds for the request — from the first position computed on (a prefix-cache hit's positions were not
    computed, so they have no query) — against every key it sees. ``head``: one query head (model-wide index), else
    all. Tensor-parallel ranks each hold their own heads: they are put together.

    A key a query needs that no row holds (positions taken from a prefix cache, rows not selected or sampled, rows
    dropped) makes the softmax's denominator unknown: a RingscopeError naming the positions, unless
    ``allow_missing=True`` (see :class:`AttentionPattern`). Clear errors also for a run without attention metadata,
    a layer without it or without both sites, a request with no query rows, a head out of range, downcast rows and
    variants the rebuild does not implement (ALiBi). Each call reads the request's rows of the layer's ``attn_q`` /
    ``attn_k`` hookpoints (``read_dump(..., request=)``: Parquet row groups that cannot hold them are skipped).
    ``run`` may be on object storage (``s3://…``): the manifests are fetched, and the rows of a Parquet run read in
    place (footers and the row groups that may hold the request), those of an Arrow IPC run downloaded. Needs
    pyarrow."""
    from .dump import _request_ids, read_dump
    from .stream import _object_url

    request = _u64("request", request)
    layer = _int("layer", layer, 0, _U32_MAX)
    if head is not None:
        head = _int("head", head, 0, _U32_MAX)
    allow_missing = _flag("allow_missing", allow_missing)
    # On object storage the manifests are fetched, and the rows read in place (a Parquet run: only the row groups
    # that may hold the request).
    url = _object_url(run)
    root: "str | pathlib.Path" = url if url is not None else _root(run)
    meta = attention_metadata(root)
    if not meta:
        raise RingscopeError("RS_ERR_INVALID_ARGUMENT",
                             f"{root} has no attention metadata (or no manifest yet: it is written when the session "
                             "closes): capture sites attn_q and attn_k (ringscope.torch.attach(..., sites=[\"attn_q\", "
                             "\"attn_k\"]), or the vLLM / SGLang plugin's sites)")
    ranks = sorted(r for r, by_layer in meta.items() if layer in by_layer)
    if not ranks:
        layers_with = sorted({i for by_layer in meta.values() for i in by_layer})
        raise RingscopeError("RS_ERR_INVALID_ARGUMENT",
                             f"layer {layer} has no attention metadata in {root}: its attention sites were not "
                             f"captured (layers with them: {layers_with})")
    entries = sorted(((_checked(meta[r][layer], layer, r), r) for r in ranks), key=lambda er: er[0]["q_head_offset"])
    for entry, _ in entries:
        hps = entry.get("hookpoints", {})
        lacking = [f"attn_{k}" for k in ("q", "k") if not hps.get(k)]
        if lacking:
            raise RingscopeError("RS_ERR_INVALID_ARGUMENT",
                                 f"layer {layer} of {root} was captured without {' and '.join(lacking)}: rebuilding "
                                 "its attention needs both attn_q and attn_k")
        if entry.get("alibi_slopes") is not None:
            raise RingscopeError("RS_ERR_INVALID_ARGUMENT",
                                 f"layer {layer} uses ALiBi, which attention_pattern does not rebuild")
    total = int(entries[0][0].get("total_num_heads") or sum(e["num_heads"] for e, _ in entries))
    if head is not None and head >= total:
        raise RingscopeError("RS_ERR_INVALID_ARGUMENT",
                             f"head {head} is out of range: layer {layer} has {total} query heads (0..{total - 1})")
    if head is not None:
        # Only the rank that holds the head is read and computed.
        holding = [(e, r) for e, r in entries if e["q_head_offset"] <= head < e["q_head_offset"] + e["num_heads"]]
        if not holding:
            held = sorted(h for e, _ in entries for h in range(e["q_head_offset"], e["q_head_offset"] + e["num_heads"]))
            raise RingscopeError("RS_ERR_INVALID_ARGUMENT",
                                 f"head {head} of layer {layer} is on no rank of {root} (ranks hold heads "
                                 f"{_ranges(np.array(held))})")
        entries = holding[:1]

    # Only the request's rows are read (Parquet row groups that cannot hold them are skipped); None: it has none.
    dumps: Dict[str, Optional[dict]] = {}
    for entry, _ in entries:
        for k in ("q", "k"):
            name = entry["hookpoints"][k]
            if name not in dumps:
                dumps[name] = read_dump(root, name, request=request).get(name)

    weights: List[np.ndarray] = []
    heads: List[int] = []
    qpos_all: Optional[np.ndarray] = None
    kpos_all: Optional[np.ndarray] = None
    missing_all = np.zeros(0, dtype=np.int64)
    for e, rank in entries:
        nh, nkv, d = e["num_heads"], e["num_kv_heads"], e["head_dim"]
        qpos, q = _rows(dumps, e["hookpoints"]["q"], rank, request, nh * d)
        kpos, k = _rows(dumps, e["hookpoints"]["k"], rank, request, nkv * d)
        if len(qpos) == 0:
            ids = _request_ids(root, e["hookpoints"]["q"])
            raise RingscopeError("RS_ERR_INVALID_ARGUMENT",
                                 f"request {request} has no {e['hookpoints']['q']} rows"
                                 f"{f' on rank {rank}' if len(entries) > 1 else ''} in {root} (requests there: "
                                 f"{', '.join(map(str, ids[:8]))}{', ...' if len(ids) > 8 else ''})")
        if qpos_all is not None and not np.array_equal(qpos, qpos_all):
            raise RingscopeError("RS_ERR_IO",
                                 f"the ranks of layer {layer} hold request {request}'s queries at different positions "
                                 "(rows dropped on one rank): its heads cannot be put together")
        window = e["sliding_window"]
        cols = _keys_seen(qpos, window)  # key positions of the output, captured or not
        have = np.isin(cols, kpos)
        seen = cols[None, :] <= qpos[:, None]  # [Nq, Nk]: what each query attends to
        if window:
            seen &= cols[None, :] > qpos[:, None] - window
        missing = np.unique(cols[(seen & ~have[None, :]).any(axis=0)])
        if len(missing) and not allow_missing:
            raise RingscopeError("RS_ERR_INVALID_ARGUMENT",
                                 f"request {request}'s queries in layer {layer} see key positions with no "
                                 f"{e['hookpoints']['k']} row: {_ranges(missing)} (taken from a prefix cache — see "
                                 "read_events' 'cached' rows; serve without prefix caching to study attention —, not "
                                 "selected or sampled, or dropped); allow_missing=True rebuilds over the captured keys "
                                 "only")
        if len(missing):
            missing_all = np.union1d(missing_all, missing)
        kmat = np.zeros((len(cols), nkv, d), dtype=np.float32)
        kmat[have] = k[np.searchsorted(kpos, cols[have])].reshape(-1, nkv, d)
        qmat = q.reshape(len(qpos), nh, d)
        group = nh // nkv
        chosen = range(nh) if head is None else [head - e["q_head_offset"]]
        visible = seen & have[None, :]
        w = np.empty((len(chosen), len(qpos), len(cols)), dtype=np.float32)
        for out_i, h in enumerate(chosen):
            # Query head h reads KV head h // group.
            s = (qmat[:, h] @ kmat[:, h // group].T) * np.float32(e["scale"])  # [Nq, Nk]
            if e.get("softcap"):
                c = np.float32(e["softcap"])
                s = c * np.tanh(s / c)
            s = np.where(visible, s, -np.inf)
            with np.errstate(invalid="ignore", divide="ignore"):  # a query that sees no captured key: a NaN row
                m = s.max(axis=1, keepdims=True)
                m = np.where(np.isfinite(m), m, np.float32(0))
                sinks = e.get("sinks")
                if sinks is not None:
                    sink = np.float32(sinks[h])
                    m = np.maximum(m, sink)
                ex = np.exp(s - m)
                denom = ex.sum(axis=1, keepdims=True)
                if sinks is not None:
                    denom = denom + np.exp(sink - m)
                w[out_i] = ex / denom
            if len(missing):
                w[out_i][seen & ~have[None, :]] = np.nan  # seen by the query but not captured
        weights.append(w)
        heads += [e["q_head_offset"] + h for h in chosen]
        qpos_all, kpos_all = qpos, cols
    assert qpos_all is not None and kpos_all is not None  # entries is not empty
    out = np.concatenate(weights, axis=0)
    if head is not None:
        out = out[0]
    return AttentionPattern(weights=out, query_positions=qpos_all, key_positions=kpos_all, heads=heads, layer=layer,
                            request=request, missing_key_positions=missing_all, exact=len(missing_all) == 0,
                            metadata=entries[0][0])
