"""What the serving-engine plugins (:mod:`ringscope.vllm`, :mod:`ringscope.sglang`) share: the engine table of the
configuration file (``sites``, ``layers``, ``requests``), request ids for string request ids, the session and its
hookpoints, the request map file, and the host side of the capture ops — a step begun from a per-token request-id
buffer (``-1``: never exported), the rows of each site copied, the step ended — with the rule that a plugin error
never takes the engine down (capture is switched off, said and counted).

The ops are ``torch.library`` custom ops that declare they write a one-byte sink buffer of the model, so
``torch.compile`` keeps them in the graph, in order, without a graph break: ``begin``, ``capture`` (one site's rows,
copied where the site is), ``end``, ``end_capturing`` (every site's rows of the pass, received at its end) and
``submit_capturing`` (the same, the copy started on a side stream and joined by a later ``end``).
"""

import _thread
import contextlib
import hashlib
import itertools
import json
import logging
import os
import pathlib
import signal
import threading
import weakref
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Tuple

from ._abi import _has_call
from .errors import RingscopeError
from .session import _stream_getter

if TYPE_CHECKING:
    import numpy as np

#: Sites an engine plugin captures, and the hookpoint name suffix of each (as :func:`ringscope.torch.attach` names
#: them: ``layers.{i}.resid``, ``layers.{i}.attn_out``, ``layers.{i}.mlp_out``, ``layers.{i}.attn_q`` ...).
SITES = {"residual": "resid", "attention_output": "attn_out", "mlp_output": "mlp_out",
         "attn_q": "attn_q", "attn_k": "attn_k", "attn_v": "attn_v"}
#: The attention sites (query and key after RoPE, value; rows of heads × head_dim): ``{ custom = "attn_q" }`` ...
ATTN_SITES = ("attn_q", "attn_k", "attn_v")
_TABLE_KEYS = {"sites", "layers", "requests"}

_CAPTURES: "weakref.WeakValueDictionary[int, EngineCapture]" = weakref.WeakValueDictionary()
_NEXT_KEY = itertools.count(1)


def truthy(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() not in ("", "0", "false", "no", "off")


def request_id_of(engine_request_id: str) -> int:
    """The ringscope request id of an engine request that names none: the first 63 bits of the BLAKE2b hash of its
    id (so it also fits the int64 tensors that CUDA graphs read)."""
    digest = hashlib.blake2b(engine_request_id.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


class PluginConfig:
    """The engine's table (``[vllm]``, ``[sglang]``), checked, and the rest of the configuration (for the session)."""

    #: vLLM only, set by :mod:`ringscope.vllm` once parsed: the tensor-parallel ranks that capture (None: all).
    ranks: Optional[List[int]]
    #: vLLM only, set by :mod:`ringscope.vllm` once parsed: ``vllm.overlap_copy`` (True, False or ``"lm_head"``; None:
    #: "auto", decided per engine).
    overlap_copy: "Optional[bool | str]"

    def __init__(self, session_config: dict, sites: List[str], layers, requests: str, source: str, extra: dict):
        self.session_config = session_config
        self.sites = sites
        self.layers = layers  # None: all
        self.requests = requests
        self.source = source
        self.extra = extra  # the table's engine-specific keys, checked by the plugin
        self.overlap_copy = False


class Plugin:
    """The skeleton every engine plugin module is built on: the environment variables that switch it on
    (``RINGSCOPE_<ENGINE>_CONFIG``) and off (``RINGSCOPE_<ENGINE>_DISABLE``), its configuration file (the engine's
    table checked, engine-specific keys by ``extra_keys`` and ``finish_config``), registration (idempotent, once per
    process: the engine's version checked, the configuration checked so that a bad file fails the first process with
    the file named, the engine patched), and the captures alive in this process (kept until ``close_all``). A plugin
    module makes one and exposes its methods as module functions; what differs between engines is what is patched."""

    def __init__(self, table: str, title: str, env_config: str, env_disable: str, logger: logging.Logger,
                 extra_keys: Tuple[str, ...] = (),
                 finish_config: Optional[Callable[[PluginConfig], PluginConfig]] = None):
        self.table, self.title = table, title
        self.env_config, self.env_disable = env_config, env_disable
        self.logger = logger
        self.extra_keys = extra_keys
        self._finish = finish_config or (lambda pc: pc)
        self.lock = threading.Lock()
        self.registered = False
        self.live: List[Any] = []  # strong references to the live captures, until close_all (atexit)

    def enabled(self) -> bool:
        return bool(os.environ.get(self.env_config)) and not truthy(self.env_disable)

    def load_config(self, path: "str | os.PathLike") -> PluginConfig:
        return self._finish(load_config(path, self.table, self.env_config, extra_keys=self.extra_keys))

    def parse_config(self, cfg: dict, source: str = "<dict>", base: Optional[pathlib.Path] = None) -> PluginConfig:
        return self._finish(parse_config(cfg, self.table, source, base, extra_keys=self.extra_keys))

    def register(self, check_version: Callable[[], None], patch: Callable[[], None]) -> None:
        """Does nothing unless :meth:`enabled`; else, once per process: ``check_version()``, the configuration file
        read and checked, ``patch()``."""
        if not self.enabled():
            if os.environ.get(self.env_config) and truthy(self.env_disable):
                self.logger.info("ringscope: %s is set: capture is off", self.env_disable)
            return
        with self.lock:
            if self.registered:
                return
            check_version()
            self.load_config(os.environ[self.env_config])  # fail early on a bad file
            patch()
            self.registered = True
            self.logger.info("ringscope: %s plugin registered (config %s)", self.title, os.environ[self.env_config])

    def captures(self) -> list:
        return list(self.live)

    def close_all(self) -> list:
        return close_live(self.live, self.logger)


def load_config(path: "str | os.PathLike", table: str, env: str, extra_keys=()) -> PluginConfig:
    """Reads and checks a plugin configuration file: a ringscope TOML file with an optional ``[table]`` table."""
    from .session import _toml

    tomllib = _toml()

    p = pathlib.Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        raise RingscopeError("RS_ERR_CONFIG", f"{env}={str(path)!r}: cannot read it ({e})") from None
    try:
        cfg = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise RingscopeError("RS_ERR_CONFIG", f"{p}: invalid TOML: {e}") from None
    return parse_config(cfg, table, source=str(p), base=p.parent, extra_keys=extra_keys)


def parse_config(cfg: dict, table: str, source: str = "<dict>", base: Optional[pathlib.Path] = None,
                 extra_keys=()) -> PluginConfig:
    cfg = dict(cfg)
    v = cfg.pop(table, {})
    if not isinstance(v, dict):
        raise RingscopeError("RS_ERR_CONFIG", f"{source}: [{table}] must be a table")
    known = _TABLE_KEYS | set(extra_keys)
    unknown = sorted(set(v) - known)
    if unknown:
        raise RingscopeError("RS_ERR_CONFIG", f"{source}: unknown key(s) {unknown} in [{table}]; known: {sorted(known)}")
    sites = v.get("sites", ["residual"])
    if isinstance(sites, str):
        sites = [sites]
    if not isinstance(sites, list) or not sites or any(s not in SITES for s in sites):
        raise RingscopeError("RS_ERR_CONFIG", f"{source}: {table}.sites = {sites!r}: give a non-empty list of "
                                              f"{list(SITES)}")
    layers = v.get("layers", "all")
    if layers == "all":
        layers = None
    elif not (isinstance(layers, list) and layers and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0
                                                          for i in layers)):
        raise RingscopeError("RS_ERR_CONFIG", f"{source}: {table}.layers = {layers!r}: give \"all\" or a non-empty "
                                              "list of decoder layer indices (0, 1, ...)")
    requests = v.get("requests", "all")
    if requests not in ("all", "opt_in"):
        raise RingscopeError("RS_ERR_CONFIG", f"{source}: {table}.requests = {requests!r}: give \"all\" or \"opt_in\"")
    # Relative probe weight paths are relative to the configuration file (the session gets a dict, not the file).
    if base is not None:
        for pr in cfg.get("probes", []) or []:
            if isinstance(pr, dict):
                for k in ("weights", "bias"):
                    if isinstance(pr.get(k), str) and not os.path.isabs(pr[k]):
                        pr[k] = str(base / pr[k])
    extra = {k: v[k] for k in extra_keys if k in v}
    return PluginConfig(cfg, list(dict.fromkeys(sites)), layers, requests, source, extra)


def opt_in(extra, where: str, default: bool, logger, engine_id: str, counters: dict):
    """``(opted in, explicit request id or None)`` from a request's ``{"ringscope": ...}`` parameter: ``True`` /
    ``False``, or ``{"capture": bool, "request_id": 0..2**63-1}``. A malformed one is counted (``bad_extra_args``),
    warned about, and not captured."""
    if extra is None:
        return default, None
    if isinstance(extra, bool):
        return extra, None
    if isinstance(extra, dict) and set(extra) <= {"capture", "request_id"} \
            and isinstance(extra.get("capture", True), bool) \
            and (extra.get("request_id") is None or (isinstance(extra["request_id"], int)
                                                     and not isinstance(extra["request_id"], bool)
                                                     and 0 <= extra["request_id"] < 2**63)):
        return extra.get("capture", True), extra.get("request_id")
    counters["bad_extra_args"] += 1
    logger.warning("ringscope: request %s: %s[\"ringscope\"] = %r is not true/false or {\"capture\": bool, "
                   "\"request_id\": 0..2**63-1}: not captured", engine_id, where, extra)
    return False, None


# -- the custom ops ------------------------------------------------------------------------------------------------

_OPS = None


def _on_capture(key: int, method: str, *args) -> None:
    cap = _CAPTURES.get(key)
    if cap is not None:
        cap._guard(getattr(cap, method), *args)


def _no_output(*args) -> None:
    return None


def ops():
    """``(begin, capture, end, end_capturing, submit_capturing, end_holding)``, defined on first use (so that importing
    a plugin does not import torch)."""
    global _OPS
    if _OPS is not None:
        return _OPS
    import torch

    # Each op's body: the capture of ``key`` (None once closed) runs its method under its error rule. No op returns
    # anything (``_no_output`` is every op's fake).
    @torch.library.custom_op("ringscope_engine::begin", mutates_args=("sink",))
    def begin(sink: torch.Tensor, request_ids: torch.Tensor, positions: torch.Tensor, key: int) -> None:
        _on_capture(key, "_begin", request_ids, positions)

    @torch.library.custom_op("ringscope_engine::capture", mutates_args=("sink",))
    def capture(x: torch.Tensor, sink: torch.Tensor, hookpoint: int, key: int) -> None:
        _on_capture(key, "_capture", x, hookpoint)

    @torch.library.custom_op("ringscope_engine::end", mutates_args=("sink",))
    def end(sink: torch.Tensor, keep: List[torch.Tensor], key: int) -> None:
        _on_capture(key, "_end_keeping", keep)

    @torch.library.custom_op("ringscope_engine::end_capturing", mutates_args=("sink",))
    def end_capturing(sink: torch.Tensor, tensors: List[torch.Tensor], hookpoints: List[int], key: int) -> None:
        _on_capture(key, "_end_capturing", tensors, hookpoints)

    # Declared to write ``tensors`` (it only reads them): compiled code must then hand a later op that takes the same
    # tensors (``end``, which ends the step and joins the copy) these very buffers, which it may not reuse before that
    # op — nor compute the tensors again into other buffers for it (see EngineCapture._end_capturing).
    @torch.library.custom_op("ringscope_engine::submit_capturing", mutates_args=("sink", "tensors"))
    def submit_capturing(sink: torch.Tensor, tensors: List[torch.Tensor], hookpoints: List[int], key: int) -> None:
        _on_capture(key, "_submit_capturing", tensors, hookpoints)

    # ``end_capturing`` whose copy may be held out of the CUDA graph being recorded (EngineCapture._end_holding);
    # ``after``, a tensor computed where the pass ends, places it there: compiled code reuses no buffer after it, so
    # the captured tensors hold their values after the graph too.
    @torch.library.custom_op("ringscope_engine::end_holding", mutates_args=("sink",))
    def end_holding(sink: torch.Tensor, tensors: List[torch.Tensor], hookpoints: List[int], after: torch.Tensor,
                    key: int) -> None:
        _on_capture(key, "_end_holding", tensors, hookpoints)

    for op in (begin, capture, end, end_capturing, submit_capturing, end_holding):
        op.register_fake(_no_output)
    _OPS = (begin, capture, end, end_capturing, submit_capturing, end_holding)
    return _OPS


# -- the capture ---------------------------------------------------------------------------------------------------

def planned_hookpoints(chosen: List[int], sites: List[str]) -> list:
    """``(name, site, layer)`` of every hookpoint a plugin captures."""
    return [(f"layers.{i}.{SITES[site]}", site, i) for i in chosen for site in sites]


def capture_bytes(planned: list, dt: str, hidden: int, widths: Optional[Dict[str, int]] = None) -> str:
    """What one captured token costs, for the plugins' start-up log line: the rows' bytes, and with each row's request id
    and position as the ring carries them (rows ``hidden`` wide unless ``widths`` says otherwise; at full precision,
    every planned hookpoint on: downcast or switched-off hookpoints take less)."""
    from .dtypes import ROW_META_BYTES, element_bytes

    rows = sum((widths or {}).get(name, hidden) for name, _, _ in planned) * element_bytes(dt)
    return f"{rows:,} bytes of rows per token ({rows + ROW_META_BYTES * len(planned):,} with their ids and positions)"


#: Sites whose tensors the engines' fused add-norm (vLLM's, SGLang's sgl_kernel) overwrites in place later in the
#: forward pass: a capture copy deferred to the pass's end would read the overwritten values.
OVERWRITTEN_SITES = ("attention_output", "mlp_output")


def refuse_deferred_overwrites(pc: PluginConfig, planned: list, engine: str, hint: str = "") -> List[str]:
    """The planned sites among :data:`OVERWRITTEN_SITES` (sorted); a configuration asking for deferred captures
    (``ring.defer_captures = true``) with any of them is refused, naming ``engine`` (and ``hint`` after the advice)."""
    overwritten = sorted({site for _, site, _ in planned if site in OVERWRITTEN_SITES})
    ring = pc.session_config.get("ring")
    if overwritten and isinstance(ring, dict) and ring.get("defer_captures") is True:
        raise RingscopeError("RS_ERR_CONFIG",
                             f"{pc.source}: ring.defer_captures = true with the site(s) {', '.join(overwritten)}: "
                             f"{engine} overwrites those outputs in place before a deferred copy would read them; "
                             f"leave ring.defer_captures out{hint}")
    return overwritten


def refuse_opt_in_without_kept_rows(pc: PluginConfig, table: str) -> None:
    """``requests = "opt_in"`` on CUDA needs a library that keeps the captured requests' rows only on the device
    (``rs_begin_step_graph_kept``, C ABI 11): with an older one every request not opted in would be exported as rows
    of no request — refused at load, naming the call (``table``: the engine's table, ``vllm`` or ``sglang``)."""
    if pc.requests == "opt_in" and not _has_call("rs_begin_step_graph_kept"):
        raise RingscopeError("RS_ERR_CONFIG",
                             f"{pc.source}: {table}.requests = \"opt_in\" on CUDA needs a library with "
                             "rs_begin_step_graph_kept (C ABI 11; without it the rows of requests not captured would "
                             "be exported as rows of no request): rebuild it with `cargo build --release -p "
                             "ringscope-ffi`, or use \"all\"")


def deferrable(pc: PluginConfig, planned: list, cuda: bool, engine: str) -> bool:
    """Whether an engine plugin defers its captures (CUDA: one copy kernel per forward pass, at its end, reading every
    captured tensor then, instead of one kernel per capture): when nothing in the pass writes a planned site's tensor
    after the site. The residual (a sum the plugin makes, or SGLang's snapshot of its stream: a new tensor) and q/k/v
    (the qkv projection's output, rotated; nothing writes it after attention reads it) stay as they are until then;
    the attention and MLP outputs do not (:data:`OVERWRITTEN_SITES`), so with those sites every capture copies at once,
    and a configuration asking for deferral with them is refused, naming ``engine``. CPU: never (rows are copied at
    once into the host ring)."""
    if not cuda:
        return False
    return not refuse_deferred_overwrites(pc, planned, engine, " (the plugin defers captures when every site allows it)")


def session_config(pc: PluginConfig, planned: list, dt: str, hidden: int, cuda: bool = False,
                   max_rows: int = 0, full_on_cuda: bool = False, widths: Optional[Dict[str, int]] = None,
                   defer: bool = False) -> dict:
    """The session's configuration: the user's, with the planned hookpoints declared (the user's entries for the
    same names are kept after checking their dtype and width). ``cuda``: the model is on a CUDA device, where the
    capture ops are recorded into the engine's CUDA graphs (steps begun on the device, :meth:`Session.begin_step_graph`):
    ``ring.backend`` defaults to ``"cuda"`` and ``policy.mode`` to ``"best_effort"``; ``"full"`` is taken only when the
    plugin admits every forward pass (``full_on_cuda``: :meth:`EngineCapture._arm` calls
    :meth:`Session.admit_graph_step`), with ``policy.on_deadline`` defaulting to ``"degrade"`` there (a pass that found
    no room in time has its captures dropped on the device and counted as ``deadline``; the engine is never stopped);
    other values are refused. ``ring.max_batch_rows`` defaults to ``max_rows`` (the most token rows of one forward
    pass), and a smaller value is refused (a larger pass would switch capture off). Rows are ``hidden`` wide unless
    ``widths`` says otherwise for a hookpoint (the attention sites: heads × head_dim). ``defer``: on CUDA,
    ``ring.defer_captures`` defaults to true — a step's captures are copied by one kernel when it ends instead of one
    kernel each (the plugin keeps every captured tensor unchanged until then); a user's ``false`` is kept."""
    cfg = json.loads(json.dumps(pc.session_config))  # deep copy
    if cuda:
        ring = cfg.setdefault("ring", {})
        policy = cfg.setdefault("policy", {})
        if not isinstance(ring, dict) or not isinstance(policy, dict):
            raise RingscopeError("RS_ERR_CONFIG", f"{pc.source}: [ring] and [policy] must be tables")
        ring.setdefault("backend", "cuda")
        policy.setdefault("mode", "best_effort")
        modes = ("best_effort", "full") if full_on_cuda else ("best_effort",)
        if ring["backend"] != "cuda" or policy["mode"] not in modes:
            why = "" if full_on_cuda else " (this plugin does not admit each replay for full mode on CUDA yet)"
            allowed = " or ".join(f'"{m}"' for m in modes)
            raise RingscopeError("RS_ERR_CONFIG",
                                 f"{pc.source}: the model is on a CUDA device, where the engine replays CUDA graphs "
                                 f"that begin their steps on the device{why}: this needs ring.backend = \"cuda\" and "
                                 f"policy.mode = {allowed} "
                                 f"(got ring.backend = {ring['backend']!r}, policy.mode = {policy['mode']!r}; leave "
                                 f"them out for \"cuda\" and \"best_effort\")")
        if policy["mode"] == "full":
            policy.setdefault("on_deadline", "degrade")
        if defer:
            ring.setdefault("defer_captures", True)
            if not isinstance(ring["defer_captures"], bool):
                raise RingscopeError("RS_ERR_CONFIG", f"{pc.source}: ring.defer_captures must be true or false (got "
                                                      f"{ring['defer_captures']!r})")
        if max_rows:
            ring.setdefault("max_batch_rows", max_rows)
            if not isinstance(ring["max_batch_rows"], int) or ring["max_batch_rows"] < max_rows:
                raise RingscopeError("RS_ERR_CONFIG",
                                     f"{pc.source}: ring.max_batch_rows = {ring['max_batch_rows']!r}, but a forward "
                                     f"pass of this engine can hold {max_rows} token rows: raise it, or leave it out")
    declared = {h.get("name"): h for h in cfg.get("hookpoints", []) if isinstance(h, dict)}
    for name, site, i in planned:
        h = declared.get(name)
        width = (widths or {}).get(name, hidden)
        entry = {"name": name, "site": {"custom": site} if site in ATTN_SITES else site, "layer": i, "dtype": dt,
                 "row_width": width}
        if h is None:
            cfg.setdefault("hookpoints", []).append(entry)
            continue
        if cuda and isinstance(h.get("rows"), list):
            # On CUDA the pass's kept rows stand for "all rows"; a list of batch rows would be taken as given — rows of
            # requests not captured included — and an engine numbers its batch rows differently at every pass.
            raise RingscopeError("RS_ERR_CONFIG",
                                 f"{pc.source}: hookpoint {name!r}: rows = {h['rows']!r} selects batch rows, which "
                                 "the engine numbers differently at every forward pass: use rows = \"all\" or "
                                 "\"last_per_request\"")
        if any(h.get(k) not in (None, entry[k]) for k in ("dtype", "row_width")):
            raise RingscopeError("RS_ERR_CONFIG",
                                 f"{pc.source}: hookpoint {name!r} is configured with {h.get('dtype')} rows of "
                                 f"{h.get('row_width')} elements, but the model's are {dt} rows of {width}")
        # The user's entry (enabled = false, a sampling rule, ...) with what the model says filled in.
        for k, v in entry.items():
            h.setdefault(k, v)
    return cfg


def _host_pass(rows: int, stream: int) -> None:
    raise RingscopeError("RS_ERR_STATE", "a host session has no device work before a forward pass")


class EngineCapture:
    """The host side of one engine worker's capture: its session and hookpoints, the request map file
    (``<run dir>/<side dir>/requests<suffix>.jsonl``), the counters, and the bodies of the capture ops. A plugin
    fills ``_req`` — the request id of each token row of the next forward pass, ``-1`` for rows never exported —
    before the forward pass (:meth:`_arm`), and calls :meth:`_finish` after it."""

    COUNTERS: Tuple[str, ...] = ("steps", "steps_captured", "rows_exported_requested", "padding_rows",
                                 "opted_out_rows", "lost_steps", "lost_rows", "bad_extra_args", "cached_requests",
                                 "cached_rows")

    def __init__(self, pc: PluginConfig, cfg: dict, planned: list, rank: int, side_dir: str, logger,
                 cuda: bool = False):
        from .session import Session

        self.pc = pc
        self.rank = rank
        self.logger = logger
        self.step = 0  # forward passes of real batches so far (the ringscope step)
        self.disabled: Optional[str] = None
        self._counters = {k: 0 for k in self.COUNTERS}
        self._armed: tuple = (None, 0, None)  # the last pass's row ids (_arm), how many are -1, as the probes take them
        self._active = False
        self._open = False
        # Held copies (the ``end_holding`` op): the slot of the graph being recorded (None: never held), and whether
        # this pass's copy is accounted for (ended or held by the op) — a replay runs no op, so after a replay it is
        # not, and the engine launches the graph's held copy.
        self._hold_slot: Optional[Callable[[], Optional[int]]] = None
        self._pass_ended = False
        self._sel: Optional["np.ndarray"] = None  # indices of the exported rows of the open step (None: all)
        self._rows = 0
        self._closed_stats: Optional[dict] = None
        self._closed = False
        # CUDA: the capture ops are recorded into the engine's CUDA graphs (and run eagerly otherwise) with the step
        # begun on the device from the request-id buffer and the model's positions (see session_config).
        self.cuda = cuda
        # Captures copied by one kernel at the end of each forward pass (session_config's ``defer``), not one each.
        ring = cfg.get("ring")
        self.deferred = bool(cuda and isinstance(ring, dict) and ring.get("defer_captures") is True)
        # Full mode on CUDA: every forward pass is admitted before it runs (see _arm).
        self.full = cuda and cfg.get("policy", {}).get("mode") == "full"
        export = cfg.get("export", {})
        if export.get("parquet") or export.get("arrow_ipc"):
            self.run_dir: Optional[pathlib.Path] = pathlib.Path(export.get("dir", "ringscope-out")) / export["run_id"]
        else:
            self.run_dir = None
        self.session = Session(cfg)
        # CUDA: what every pass asks of the session first (admission in full mode, control changes otherwise).
        self._before_pass: Callable[[int, int], None] = self.session._before_pass(self.full) if cuda else _host_pass
        # CUDA with probes: each pass's rows per request go to the probes from the host (Session.note_step_rows, the
        # cheap way), for their coverage's denominator; a library older than that call (C ABI 10) leaves it at the
        # positions' span.
        probe_rows = bool(cuda and cfg.get("probes"))
        self._note_rows: Optional[Callable[[Any], None]] = self.session._step_rows_noter() if probe_rows else None
        if probe_rows and self._note_rows is None:
            logger.warning("ringscope: the library predates rs_note_step_rows (C ABI 10): the probes' coverage "
                           "counts no expected rows on CUDA; rebuild it with `cargo build --release -p ringscope-ffi`")
        self.hookpoints = {name: self.session.hookpoint_id(name) for name, _, _ in planned}
        self.key = next(_NEXT_KEY)  # never reused (id() would be): compiled graphs hold it as a constant
        _CAPTURES[self.key] = self
        self._requests_file = None
        self._side_dir = side_dir
        # Ranks sharing the run directory each write their own side files (rank 0: the names of a single rank).
        self._rank_suffix = "" if rank == 0 else f".rank={rank}"
        if self.run_dir is not None:
            (self.run_dir / side_dir).mkdir(parents=True, exist_ok=True)
            self._requests_file = open(self.run_dir / side_dir / f"requests{self._rank_suffix}.jsonl", "a",
                                       encoding="utf-8")

    def __bool__(self):
        return True

    def _write_request(self, line: dict) -> None:
        if self._requests_file is not None:
            self._requests_file.write(json.dumps(line) + "\n")
            self._requests_file.flush()

    def _note_cached(self, rid: int, rows: int) -> None:
        """The engine's prefix cache held the first ``rows`` tokens of request ``rid``: recorded, never silent."""
        self.session.note_cached(self.step, rid, 0, rows)
        self._counters["cached_requests"] += 1
        self._counters["cached_rows"] += rows

    def _lost(self, rows: int) -> None:
        """A step not captured because capture is off after an error."""
        self._counters["lost_steps"] += 1
        self._counters["lost_rows"] += rows * len(self.hookpoints)

    def _finish(self) -> None:
        if self._open:  # a forward pass that raised between begin and end
            self._guard(self._end)
        self._active = False
        self.step += 1

    # -- the request-id buffer -----------------------------------------------------------------------------------
    def _request_id_buffer(self, decoder, device, rows: int) -> None:
        """Gives ``decoder`` its request-id buffer ``_ringscope_req`` (int64, at least ``rows`` long, ``-1``: a row
        never attributed) — what the ``begin`` op reads. On CUDA it is read by recorded graphs at a fixed address:
        the plugin fills it before every forward pass on the engine's stream (:meth:`_arm`)."""
        self._device = device
        if self.cuda:
            self._stream_now = _stream_getter(device.index)
        self._decoder = weakref.ref(decoder)
        # CUDA: every request-id buffer a recorded graph may read (replays read them at fixed addresses), pinned
        # staging slots for their host-to-device updates, and how much of them holds ids (the rest holds -1).
        self._req_bufs: List = []
        self._stage: List = []
        self._dirty = 0
        self._req_size = 0  # the length of the decoder's current request-id buffer
        self._uploaded = None  # the row ids (array) the buffers hold since the last upload (_upload)
        # CUDA: the kept-rows buffers (ringscope.Session.begin_step_graph's ``kept``), one beside each request-id
        # buffer, and whether they say "every row" since the last upload (then nothing is copied while they do).
        self._kept_bufs: List = []
        self._kept_all = False
        # A library that predates kept rows (C ABI 11) exports the rows of requests not captured as rows of no request.
        self._keeps = bool(self.cuda and _has_call("rs_begin_step_graph_kept"))
        if self.cuda and not self._keeps:
            self.logger.warning("ringscope: the library predates rs_begin_step_graph_kept (C ABI 11): rows of requests "
                                "not captured are exported as rows of no request; rebuild it with `cargo build "
                                "--release -p ringscope-ffi`")
        if self.cuda:
            import torch

            # The pass's number of token rows (the low word of an int64, uploaded with the ids): a graph recorded at
            # a padded batch size runs its captures over every row of it, and the rows past this bound — padding,
            # no request's — are neither captured nor scored on the device.
            self._valid = torch.full((1,), 2**31 - 1, dtype=torch.int64, device=device)
            for hp in self.hookpoints.values():
                self.session.set_valid_rows_device(hp, self._valid.data_ptr())
        self._grow(rows)

    def _arm(self, tok, n: int, padded: int) -> None:
        """Before a forward pass of ``padded`` token rows: ``tok``, the request id of each of its first ``n`` rows
        (``-1``: a request not captured), and ``-1`` for the rest (padding), into the request-id buffer; the
        capture ops are live for the pass."""
        if tok is not self._armed[0]:
            # Rows of requests that did not opt in: counted once per batch (a steady batch's passes reuse `tok`);
            # with probes on CUDA also the rows' request ids as the probes take them (-1: 2**64 - 1, no request).
            ids = tok[:n].astype("int64", copy=False).view("uint64") if self._note_rows is not None else None
            self._armed = (tok, int((tok < 0).sum()), ids)
        opted_out = self._armed[1]
        self._counters["opted_out_rows"] += opted_out
        self._counters["padding_rows"] += max(padded - n, 0)
        if padded > self._req_size:
            self._grow(padded)
        if self.cuda:
            # Full mode: room in the ring for everything a pass of `padded` rows can capture, reserved before it runs
            # (a graph replay cannot wait by itself) — a host-side check of two counters when there is room; past the
            # wait budget the pass's captures are dropped on the device and counted as `deadline`
            # (policy.on_deadline = "degrade", the plugin's default). Also uploads control changes, which is all
            # best-effort mode does here (the policy manager's, set_enabled, ...: they reach the recorded graphs
            # between replays), returning at once when none changed.
            self._before_pass(padded, self._stream_now())
            if self._note_rows is not None and n:
                # The probes' coverage denominator: what this pass runs of each request (a step begun inside a CUDA
                # graph gives the probes no batch of its own).
                self._note_rows(self._armed[2])
            if tok is not self._uploaded or n != self._dirty:  # else already in every buffer: nothing to copy
                self._upload(tok, n)
            # Every prepared pass begins one step on the device (a graph replay, or the eager ops), so the device's
            # step numbers follow self.step; its padding and the rows of requests not captured are kept out there.
            self._counters["steps_captured"] += 1
            self._counters["rows_exported_requested"] += (n - opted_out) * len(self.hookpoints)
        else:
            self._req_np[:n] = tok
            self._req_np[n:padded] = -1
        self._active = True

    def _grow(self, rows: int) -> None:
        """The request-id buffer (a buffer of the decoder), at least ``rows`` long. On CUDA a replaced buffer stays
        alive and keeps receiving the ids: graphs recorded earlier read it."""
        import torch

        decoder = self._decoder()
        assert decoder is not None  # the plugin grows the buffer of a live model, before its forward pass
        buf = getattr(decoder, "_ringscope_req", None)
        if buf is not None and buf.shape[0] >= rows:
            return
        size = max(rows, 2 * (0 if buf is None else buf.shape[0]))
        decoder.register_buffer("_ringscope_req", torch.full((size,), -1, dtype=torch.int64, device=self._device),
                                persistent=False)
        self._req_size = size
        if self.cuda:
            self._req_bufs.append(decoder._ringscope_req)
            # The kept rows (the count, or -1: every row; then the rows): read by the graphs recorded with this buffer.
            self._kept_bufs.append(torch.full((size + 1,), -1, dtype=torch.int32, device=self._device))
            self._kept_all = False
            # A slot: the ids of `size` rows, then the pass's number of rows (for self._valid); its event; the kept
            # rows.
            self._stage = [[torch.full((size + 1,), -1, dtype=torch.int64).pin_memory(), None,
                            torch.full((size + 1,), -1, dtype=torch.int32).pin_memory()] for _ in range(4)]
            self._stage_next = 0
            self._dirty = size  # a new buffer: all of every buffer is written next time
            self._uploaded = None
        else:
            self._req_np = decoder._ringscope_req.numpy()

    def _upload(self, tok, n: int) -> None:
        """CUDA: the request ids of the next forward pass's ``n`` token rows into every request-id buffer, and -1
        after them as far as earlier ids went; ``n`` as the bound of the rows captured (the rest is the graph's
        padding); and the rows kept (those of captured requests: all of them, or a list), on the engine's current
        stream (stream-ordered before the forward pass or graph replay). Through pinned staging slots, each reused
        only once its last copy has run.

        Not called for the same ``tok`` object as the previous upload (a plugin's steady batch: every decode step of
        the same requests, see :meth:`_arm`): those ids are already in every buffer — nothing else writes them, and a
        new buffer resets ``_uploaded``."""
        import torch

        m = min(max(n, self._dirty), self._req_bufs[-1].shape[0])
        slot = self._stage[self._stage_next]
        self._stage_next = (self._stage_next + 1) % len(self._stage)
        if slot[1] is not None:
            slot[1].synchronize()  # that slot's copy (4 steps ago) has run: nearly always already done
        host = slot[0].numpy()
        host[:n] = tok[:n]
        host[n:m] = -1
        host[-1] = n
        src = slot[0]
        for buf in self._req_bufs:
            k = min(m, buf.shape[0])
            buf[:k].copy_(src[:k], non_blocking=True)
        self._valid.copy_(src[-1:], non_blocking=True)
        # The kept rows: every row unless some of the pass's rows belong to requests not captured (-1), which are
        # then neither captured nor scored (not even as rows of no request).
        captured = tok[:n] >= 0
        skipped = not captured.all()
        if self._keeps and (skipped or not self._kept_all):
            import numpy

            kept = slot[2].numpy()
            if skipped:
                rows = numpy.flatnonzero(captured)
                kept[0] = rows.shape[0]
                kept[1:1 + rows.shape[0]] = rows
                k = 1 + rows.shape[0]
            else:
                kept[0] = -1  # KEEP_ALL
                k = 1
            for buf in self._kept_bufs:
                kk = min(k, buf.shape[0])  # an older, shorter buffer: its graphs never replay a pass this large
                buf[:kk].copy_(slot[2][:kk], non_blocking=True)
            self._kept_all = not skipped
        ev = slot[1] or torch.cuda.Event()
        ev.record()
        slot[1] = ev
        self._dirty = n
        self._uploaded = tok

    # -- inside the forward pass (op bodies) ----------------------------------------------------------------------
    def live(self) -> bool:
        """Whether the capture ops do anything now: inside a forward pass the plugin prepared, or (CUDA) while the
        engine records a CUDA graph — the ops are recorded, and every replay runs them. The engine's eager warm-up
        passes around a recording capture nothing (they would begin steps of no request)."""
        if self.disabled is not None or self._closed:
            return False
        return self._active or (self.cuda and _recording())

    def _guard(self, fn, *args) -> None:
        if not self.live():
            return
        try:
            fn(*args)
        except Exception as e:
            self._fail(e, fn.__name__.strip("_"), self._rows)

    def _fail(self, e: BaseException, where: str, rows: int = 0) -> None:
        """Capture is off from now on (the engine goes on): logged, and the ``rows`` of the step it happened in that
        were not captured counted as lost."""
        if self.cuda and _recording():
            # Half a step recorded into a CUDA graph would run at every replay: fail the recording (the engine's
            # start) instead, naming what went wrong.
            raise RingscopeError("RS_ERR_INVALID_ARGUMENT",
                                 f"ringscope: error while {where} during CUDA graph capture: {type(e).__name__}: "
                                 f"{e}") from e
        if self.disabled is None:
            self.disabled = f"{where}: {type(e).__name__}: {e}"
            self.logger.exception("ringscope: error while %s at step %d; capture is off for the rest of the run (the "
                                  "engine goes on)", where, self.step)
            self._lost(rows)
            if self._open:
                self._open = False
                try:
                    self.session.end_step()
                except Exception:
                    pass
            if self.cuda:
                # The engine's recorded CUDA graphs still run the capture kernels at every replay, with request ids
                # nobody updates any more: every hookpoint is switched off on the device, in stream order, and the
                # request-id buffers are cleared (no row attributed, should switching off fail).
                try:
                    self._uploaded = None
                    for buf in getattr(self, "_req_bufs", ()):
                        buf.fill_(-1)
                except Exception:
                    self.logger.exception("ringscope: clearing the request-id buffers failed")
                try:
                    for hp in self.hookpoints.values():
                        self.session.set_enabled(hp, False)
                    self.session.apply_controls()
                except Exception:
                    self.logger.exception("ringscope: switching the hookpoints off on the device failed")
        self._active = False

    def _begin(self, request_ids, positions) -> None:
        if self.cuda:
            # Begun on the device, from the request-id buffer (-1: a row of a request not captured, exported as
            # computed, never attributed; the padding after the pass's rows is not captured: self._valid) and the
            # model's positions, one token per row: recorded into a CUDA graph being captured, or run eagerly. No
            # host synchronisation either way.
            import torch

            stream = torch.cuda.current_stream(positions.device).cuda_stream
            self.session.begin_step_graph(request_ids, positions.reshape(-1, 1), stream=stream,
                                          kept=self._kept_bufs[-1] if self._keeps else None)
            self._open = True
            self._sel = None
            self._rows = request_ids.shape[0]
            return
        import numpy as np

        ids = request_ids.numpy()
        pos = positions.numpy()
        sel = ids >= 0
        self._rows = int(sel.sum())
        self._open = False
        if self._rows == 0:
            self._open = False
            return
        self._sel = None if self._rows == ids.shape[0] else np.flatnonzero(sel)
        if self._sel is None:
            self.session.begin_step(self.step, ids.astype(np.uint64), pos)
        else:
            self.session.begin_step(self.step, ids[self._sel].astype(np.uint64), pos[self._sel])
        self._open = True
        self._counters["steps_captured"] += 1

    def _capture(self, x, hookpoint: int) -> None:
        if not self._open:
            return
        if self.cuda:
            import torch

            self.session.capture_device(hookpoint, x.data_ptr(), x.shape[0],
                                        torch.cuda.current_stream(x.device).cuda_stream)
            return
        from .session import _capture_host_raw

        if self._sel is not None:
            x = x[self._sel]  # a new, contiguous tensor
        x = x.contiguous()
        _capture_host_raw(self.session._h, hookpoint, x.data_ptr(), x.numel() * x.element_size())
        self._counters["rows_exported_requested"] += x.shape[0]

    def _end(self) -> None:
        if self._open:
            self._open = False
            self.session.end_step()

    def _end_capturing(self, tensors, hookpoints) -> None:
        """Captures ``tensors[i]`` as hookpoint ``hookpoints[i]``, then ends the step: the ``end_capturing`` op, which
        receives every captured tensor of the pass at its end. Compiled code guarantees the values of an op's inputs
        where the op runs, and nothing about a buffer it has already handed to an earlier op: Inductor may compute a
        site's tensor once for a site op and again for the end op, and reuse the first buffer in between — a pointer
        noted at the site and read by a copy at the end would then read another tensor's bytes."""
        self._capture_each("end_capturing", tensors, hookpoints)
        self._end()

    def _end_holding(self, tensors, hookpoints) -> None:
        """The ``end_holding`` op: as ``end_capturing``, except that while a CUDA graph is being recorded and the
        engine gave a hold slot (``self._hold_slot``, a callable naming the graph being recorded) the step's copy is
        held out of the graph (:meth:`Session.hold_step`): the engine launches it after each replay (the vLLM
        plugin's ``_after_forward``). Eagerly (no graph) the step ends as with ``end_capturing``. Either way the pass's copy is
        accounted for (``self._pass_ended``)."""
        self._capture_each("end_holding", tensors, hookpoints)
        hold = self._hold_slot
        slot = hold() if hold is not None and self._open and self.cuda and _recording() else None
        if slot is None:
            self._end()
        else:
            self._open = False
            self.session.hold_step(slot)
        self._pass_ended = True

    def _submit_capturing(self, tensors, hookpoints) -> None:
        """Captures ``tensors[i]`` as hookpoint ``hookpoints[i]`` and starts copying the step's captures now, on a side
        stream (:meth:`Session.submit_captures`), so that the copy overlaps the engine's next kernels: the
        ``submit_capturing`` op. A later ``end`` op given the same tensors ends the step, which joins the copy; until
        then the tensors must hold their values (the op's declared write of them makes compiled code keep them)."""
        self._capture_each("submit_capturing", tensors, hookpoints)
        self._submit()

    def _capture_each(self, op: str, tensors, hookpoints) -> None:
        if len(tensors) != len(hookpoints):
            raise RingscopeError("RS_ERR_INVALID_ARGUMENT", f"{op}: {len(tensors)} tensors and "
                                                            f"{len(hookpoints)} hookpoints (one hookpoint per tensor)")
        for x, hookpoint in zip(tensors, hookpoints):
            self._capture(x, hookpoint)

    def _submit(self) -> None:
        if self._open and self.cuda:
            self.session.submit_captures()

    def _end_keeping(self, keep) -> None:
        """The ``end`` op: ends the step; ``keep`` are the tensors the step's copy reads, kept until here."""
        self._end()

    # -- results ---------------------------------------------------------------------------------------------------
    def counters(self) -> dict:
        """The plugin's own counters: ``steps`` (forward passes of real batches), ``steps_captured``, ``padding_rows``
        and ``opted_out_rows`` (token rows never given to ringscope), ``lost_steps`` / ``lost_rows`` (not captured
        because of a plugin error: rows × hookpoints), ``bad_extra_args``, ``cached_requests`` / ``cached_rows``
        (requests whose first tokens came from the engine's prefix cache, and those tokens: never computed, so never
        captured — see :meth:`ringscope.Session.note_cached`); and ``disabled`` (the error, or None)."""
        return {**self._counters, "disabled": self.disabled}

    def _remove_hooks(self) -> None:
        """Removes what the plugin added to the model (the subclass's hooks)."""

    def close(self) -> dict:
        """Ends capture, closes the session (which finishes its files) and writes the summary. Returns
        ``{"session": totals, "plugin": counters}``; closing again returns the same."""
        if self._closed_stats is not None:
            return self._closed_stats
        self._closed = True
        self._active = False
        self._remove_hooks()
        totals = self.session.close()
        self._closed_stats = {"session": totals, "plugin": self.counters()}
        if self._requests_file is not None:
            self._requests_file.close()
            assert self.run_dir is not None  # the requests file lies in it
            (self.run_dir / self._side_dir / f"summary{self._rank_suffix}.json").write_text(
                json.dumps({**self._closed_stats, "hookpoints": self.hookpoints, "rank": self.rank,
                            "deferred_captures": self.deferred}, indent=1))
        _CAPTURES.pop(self.key, None)
        return self._closed_stats


def close_live(live: list, logger) -> list:
    """Closes every capture in ``live`` (a plugin's list of live captures; each removes itself when it closes), even
    when one fails to; returns their results."""
    out = []
    while live:
        cap = live[0]
        try:
            out.append(cap.close())
        except Exception:
            logger.exception("ringscope: closing the session failed")
        if live and live[0] is cap:
            live.pop(0)
    return out


# -- stop signals ----------------------------------------------------------------------------------------------------
# An engine process stopped by a signal (Ctrl-C reaches every process of the group; a service manager sends SIGTERM to
# every process of its unit) must not lose the run: the signal may land anywhere — inside a forward pass, in the
# engine's idle loop, inside its own checks — and the engine's parent may kill the process moments later. So in the
# process that owns the sessions the plugin takes SIGINT and SIGTERM: the sessions are closed first (at once when no
# capture code is running, else as soon as the running forward pass is done), then the signal is delivered again to do
# what it did before (the previous handler, or the default action).

_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
_stop_lock = threading.RLock()  # re-entrant: the handler may run in the main thread while it holds the lock
_stop_state: Dict[str, Any] = {"busy": 0, "pending": [], "prev": {}, "close": None, "logger": None, "closing": False}


def guard_stop_signals(close, logger) -> bool:
    """Installs the stop-signal handlers of this process (once): ``close()`` closes its sessions. Only from the main
    thread (Python runs signal handlers there); returns whether they are installed."""
    st = _stop_state
    if threading.current_thread() is not threading.main_thread():
        logger.warning("ringscope: the sessions are opened outside the main thread: a SIGINT or SIGTERM to this "
                       "process may stop it before they close")
        return False
    st["close"], st["logger"] = close, logger
    for sig in _STOP_SIGNALS:
        if sig in st["prev"]:
            continue
        prev = signal.getsignal(sig)
        if prev is signal.SIG_IGN or prev is None:
            continue  # ignored (or not Python's): the signal does not stop this process
        st["prev"][sig] = prev
        signal.signal(sig, _on_stop_signal)
    return True


@contextlib.contextmanager
def critical():
    """Code a stop signal must not interrupt (a forward pass with its capture, a close): a signal that arrives
    meanwhile is acted on when the outermost such block ends."""
    st = _stop_state
    with _stop_lock:
        st["busy"] += 1
    try:
        yield
    finally:
        with _stop_lock:
            st["busy"] -= 1
            sig = st["pending"].pop(0) if st["busy"] == 0 and st["pending"] else None
        if sig is not None:
            # The handler runs again in the main thread, now that nothing is running.
            _thread.interrupt_main(sig)


def _on_stop_signal(signum, frame) -> None:
    st = _stop_state
    with _stop_lock:
        if st["busy"] or st["closing"]:
            if signum not in st["pending"] and not st["closing"]:
                st["pending"].append(signum)
            return
        st["closing"] = True
    log = st["logger"] or logging.getLogger("ringscope")
    try:
        log.warning("ringscope: %s received: closing the capture sessions before the process stops",
                    signal.Signals(signum).name)
        st["close"]()
    except Exception:
        log.exception("ringscope: closing the sessions on %s failed", signal.Signals(signum).name)
    finally:
        with _stop_lock:
            st["closing"] = False
        prev = st["prev"].pop(signum, signal.SIG_DFL)
        signal.signal(signum, prev)
    # What the signal did before: the previous handler (SIGINT's raises KeyboardInterrupt where the code was), or the
    # default action (SIGTERM's ends the process).
    os.kill(os.getpid(), signum)


def first(output):
    return output[0] if isinstance(output, (tuple, list)) else output


def model_dtype(param) -> str:
    from .torch import _TORCH_DTYPES

    dt = _TORCH_DTYPES.get(param.dtype)
    if dt is None:
        raise RingscopeError("RS_ERR_CONFIG", f"parameters of dtype {param.dtype} are not supported")
    return dt


def _recording() -> bool:
    """Whether a CUDA graph is being recorded on the current stream."""
    import torch

    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def check_cpu(device, plugin: str, engine: str, env: str) -> None:
    if device.type != "cpu":
        raise RingscopeError("RS_ERR_CONFIG",
                             f"{plugin}: the model is on {device}; the plugin supports {engine} on CPU only so far "
                             f"(unset {env} to serve without ringscope)")

