"""PyTorch integration: a ``torch.library`` custom op for captures, and :func:`attach` for Hugging Face decoders.

``ringscope::capture`` is an ordinary custom operator: recordable into CUDA graphs (``torch.cuda.graph``) — on a CUDA
tensor it launches ringscope's capture kernel on the current stream, which reads everything that varies (the batch
descriptor, the hookpoint's controls) from device memory at replay time — and opaque to ``torch.compile`` (no graph
break). It declares that it writes a one-element ``sink`` tensor so that compilers never drop it as dead code.

:func:`attach` adds forward hooks to a model — no forked model code — that capture the chosen sites of the chosen
layers, and wraps the model's ``forward`` (an instance attribute, removed by ``detach``) to hand ringscope each step's
batch descriptor (request id and token position of every row) before the forward pass and end the step after it, so
every exported row says whose token it is. When a forward pass is recorded into a CUDA
graph (best-effort sessions), the step itself is recorded too: the positions are read from the model's
``position_ids`` / ``cache_position`` tensor and the request ids from a device tensor (:meth:`Attachment.
set_request_ids`) at every replay, so replays need no Python call. With ``ring.defer_captures = true`` a step's
captures are copied by one kernel when the forward pass ends (one graph node per step, not one per hookpoint); the
attachment keeps each captured tensor alive until then.

:class:`ProbeStoppingCriteria` (built on first use; needs transformers) ends the rows of ``generate`` whose requests a
probe of the session (``[[probes]]`` with ``action = "stop"``, on hookpoints ``attach`` captures) has flagged.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import itertools
import threading
import types
import warnings
import weakref
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple, cast

import numpy as np
import torch

from ._abi import MAX_ENDED_TOKENS, _has_call
from ._args import _int, _int_array, _timeout_ms, _u32, _U32_MAX, _u64
from .attention import layer_entry
from .dtypes import ROW_META_BYTES, element_bytes
from .errors import RingscopeError
from .session import Session, _capture_device_raw, _capture_host_raw, _current_stream, _submit_captures_raw

__all__ = ["capture", "submit", "step", "attach", "plan", "Attachment", "ProbeStoppingCriteria", "SUPPORTED_MODEL_TYPES"]

_TORCH_DTYPES = {torch.bfloat16: "bf16", torch.float16: "f16", torch.float32: "f32", torch.float64: "f64",
                 torch.int8: "i8", torch.uint8: "u8", torch.int16: "i16", torch.int32: "i32", torch.int64: "i64"}


@torch.library.custom_op("ringscope::capture", mutates_args=("sink",))
def capture(x: torch.Tensor, sink: torch.Tensor, session: int, hookpoint: int, row_width: int) -> None:
    """Captures ``x`` (any shape whose last dimension is the row width; rows in row-major order) into hookpoint
    ``hookpoint`` of the session whose C handle is ``session``. CUDA tensors: a kernel on the current stream (graph
    capturable); CPU tensors: a host copy."""
    _capture_now(x, session, hookpoint, row_width)


def _capture_now(x: torch.Tensor, session: int, hookpoint: int, row_width: int) -> None:
    session, hookpoint = _u64("session", session), _u32("hookpoint", hookpoint)
    row_width = _u32("row_width", row_width, lo=1)
    if not x.is_contiguous():
        raise RingscopeError("RS_ERR_INVALID_ARGUMENT",
                             f"ringscope.capture needs a contiguous tensor (got strides {tuple(x.stride())}); "
                             "call .contiguous() first")
    if x.dim() == 0 or x.shape[-1] != row_width:
        raise RingscopeError("RS_ERR_INVALID_ARGUMENT",
                             f"hookpoint {hookpoint} has rows of {row_width} elements; got a tensor of shape "
                             f"{tuple(x.shape)}")
    rows = x.numel() // row_width
    if x.is_cuda:
        _capture_device_raw(session, hookpoint, x.data_ptr(), _u32("rows", rows), _current_stream(x.device.index))
    else:
        _capture_host_raw(session, hookpoint, x.data_ptr(), x.numel() * x.element_size())


@capture.register_fake
def _(x, sink, session, hookpoint, row_width):
    return None


@torch.library.custom_op("ringscope::submit", mutates_args=("sink",))
def submit(sink: torch.Tensor, session: int) -> None:
    """Starts copying the step's deferred captures now, on a side stream (``Session.submit_captures``); a custom op
    so that compiled models keep it in place without a graph break."""
    _submit_captures_raw(_u64("session", session))


@submit.register_fake
def _(sink, session):
    return None


# Attachments by key, for the step ops below (custom ops take ints and tensors, not Python objects).
_ATTACHMENTS: "weakref.WeakValueDictionary[int, Attachment]" = weakref.WeakValueDictionary()

# For each module class that `attach` hooks: a subclass of it (same name, module and qualified name, nothing added)
# that hooked modules take while attached (Attachment._distinguish).
_HOOKED_CLASSES: Dict[type, type] = {}


@functools.lru_cache(maxsize=None)
def _cuda_available() -> bool:
    """``torch.cuda.is_available()``, asked once: it does not change in a process, and every hook asks whether a graph
    is being recorded (where CUDA is absent it took ~9 µs a call on a 2-core machine, 16 captures a step)."""
    return torch.cuda.is_available()


def _recording() -> bool:
    """Whether the current CUDA stream is recording a graph."""
    return _cuda_available() and torch.cuda.is_current_stream_capturing()


def _one_of(values: np.ndarray, ids: Iterable[int]) -> np.ndarray:
    """Which of ``values`` (a few token ids, one per batch row) are in ``ids`` (a few token ids) — ``np.isin`` for
    the tiny arrays of every eager step, without its ~20-50 µs of setup."""
    wanted = np.fromiter(ids, dtype=np.int64)
    return (values.astype(np.int64, copy=False)[:, None] == wanted[None, :]).any(axis=1)


def _hooked_class(cls: type) -> type:
    """The subclass hooked modules of class ``cls`` take while attached. torch.compile (dynamo) does not guard on a
    module's *empty* hook dicts (``torch._dynamo.config.skip_nnmodule_hook_guards``, on by default), so a graph it
    compiled for a module without hooks — the same model before ``attach``, or any model of that class — would be
    replayed for the attached one, without the hooks: nothing captured, silently. It does guard on each module's
    type, so a module of another class never runs such a graph."""
    sub = _HOOKED_CLASSES.get(cls)
    if sub is None:
        sub = _HOOKED_CLASSES.setdefault(cls, type(cls.__name__, (cls,), {
            "__module__": cls.__module__, "__qualname__": cls.__qualname__, "__doc__": cls.__doc__,
            "_ringscope_unhooked_class": cls}))
    return sub
# Keys are never reused (id() would be, once an attachment is garbage-collected): a compiled graph guards on its
# attachment's key, so a new attachment never passes the guards of an old one's graphs.
_NEXT_KEY = itertools.count(1)


def _attachment(key: int) -> "Attachment":
    att = _ATTACHMENTS.get(key)
    if att is None:
        raise RingscopeError("RS_ERR_INVALID_ARGUMENT",
                             f"ringscope: attachment {key} no longer exists (detached or garbage-collected) but a "
                             "compiled graph still calls it: detach() before dropping the model, or recompile")
    return att


@torch.library.custom_op("ringscope::step", mutates_args=("sink",))
def step(sink: torch.Tensor, request_ids: torch.Tensor, positions: torch.Tensor, captures: List[torch.Tensor],
         hookpoints: List[int], attachment: int) -> None:
    """One whole step of attachment ``attachment``, from tensors the compiled graph holds when the forward pass
    ends: begins it (``request_ids`` int64 ``[batch]``, one request per batch row; ``positions`` int64
    ``[batch, seq]``, ``[1, seq]`` or ``[seq]`` shared by every row), captures ``captures[i]`` into hookpoint
    ``hookpoints[i]``, and ends it. Inside a CUDA graph being recorded all of it is recorded (replays read the
    tensors on the device and make no host call); otherwise it runs eagerly.

    What :func:`attach`'s hooks call when the model is compiled. One op at the end, not one per capture, because
    a compiler may recompute a tensor instead of keeping it alive: every address ringscope reads (deferred captures
    read theirs when the step ends) is an input of this one call, valid while it runs."""
    _attachment(attachment)._step_tensors(request_ids, positions, captures, hookpoints)


@step.register_fake
def _(sink, request_ids, positions, captures, hookpoints, attachment):
    return None


def _decoder(model):
    """(layers, final_norm, lm_head, family) of a Hugging Face decoder, found by attribute, not by forking code."""
    mt = getattr(getattr(model, "config", None), "model_type", None)
    base = getattr(model, "model", None)
    if mt in ("llama", "qwen2", "qwen3", "mistral", "gemma2") and base is not None and hasattr(base, "layers"):
        return list(base.layers), base.norm, getattr(model, "lm_head", None), "llama"
    tr = getattr(model, "transformer", None)
    if mt == "gpt2" and tr is not None and hasattr(tr, "h"):
        return list(tr.h), tr.ln_f, getattr(model, "lm_head", None), "gpt2"
    raise RingscopeError("RS_ERR_INVALID_ARGUMENT",
                         f"attach: model type {mt!r} is not supported (supported: {', '.join(SUPPORTED_MODEL_TYPES)})")


SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral", "gemma2", "gpt2")
# Query, key and value of each head (attention's inputs: q and k after RoPE): see _AttentionTap.
_ATTN_SITES = ("attn_q", "attn_k", "attn_v")
_SITES = ("residual", "attention_output", "mlp_output", "final_norm", "logits", "tokens") + _ATTN_SITES
#: Model types whose attention ``attach`` can capture as ``attn_q`` / ``attn_k`` / ``attn_v`` (and rebuild).
ATTENTION_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral", "gemma2")
# The token ids of each step's rows (int64, one per row): what joins captured rows to text.
_TOKENS = "tokens"


def _device_ids(ids: List[int]) -> torch.Tensor:
    """Request ids as the int64 tensor a step begun inside a CUDA graph reads: ids past 2**63 - 1 cannot be named
    there (eager steps take the full u64 range)."""
    for i, r in enumerate(ids):
        _int(f"request_ids[{i}]", r, 0, 2**63 - 1, " (request ids read by CUDA graphs are int64)")
    return torch.tensor(ids, dtype=torch.int64)


def _on_host(**tensors: Optional[torch.Tensor]) -> Dict[str, Optional[torch.Tensor]]:
    """CPU copies (detached) of the given tensors (``None`` stays ``None``), with one wait for the device at most: the
    CUDA ones are copied without blocking, in stream order on their devices' current streams, then each such stream
    is waited for once. An eager step's begin reads up to four small device values (the cache position, positions,
    the attention mask, the last tokens); read one by one, each was a device round trip on the host's path."""
    out: Dict[str, Optional[torch.Tensor]] = {}
    devices = set()
    for name, t in tensors.items():
        if t is not None and t.is_cuda:
            out[name] = t.detach().to("cpu", non_blocking=True)
            devices.add(t.device)
        else:
            out[name] = None if t is None else t.detach().to("cpu")
    for d in devices:
        torch.cuda.current_stream(d).synchronize()
    return out


def _staged(x: torch.Tensor, device) -> torch.Tensor:
    """``x`` (a CPU tensor) as the source of a non-blocking copy to ``device`` that the host does not wait for: pinned
    where ``device`` is a CUDA device (torch's pinned-memory cache keeps it until the device has read it), as it is
    elsewhere. A copy from pageable memory first waits for everything queued on the stream: at every eager prefill the
    GPU then idled while the host prepared the step."""
    return x.pin_memory() if torch.device(device).type == "cuda" else x


_TOO_FEW_IDS = ("attach: compiling or recording a graph of a batch larger than the request-id tensor, which must exist "
                "before: run one eager forward pass of that batch size first (the usual warm-up) or call "
                "set_request_ids(...)")
_NO_POSITIONS = ("attach: a compiled forward pass needs the decoder layers called with position_ids or cache_position "
                 "(the step's token positions are read from them)")
# While tracing, the status travels in the message (the compilation fails with it, not with a RingscopeError).
_TOO_FEW_IDS_TRACED = _TOO_FEW_IDS + " [RS_ERR_INVALID_ARGUMENT]"
_NO_POSITIONS_TRACED = _NO_POSITIONS + " [RS_ERR_INVALID_ARGUMENT]"
_SINK_DEVICE_TRACED = ("attach: the last captured module has no _ringscope_sink buffer on its output's device (the "
                       "buffer was removed, or the module's output is on another device than the module): the "
                       "compiled step op has no sink to write [RS_ERR_INVALID_ARGUMENT]")


def _refuse_while_tracing(which: str) -> None:
    """Fails the compilation with one of the messages above: dynamo cannot trace the construction of ringscope's
    exception class, and ``torch._check`` takes only a message function without free variables."""
    if which == "ids":
        torch._check(False, lambda: _TOO_FEW_IDS_TRACED)
    if which == "sink":
        torch._check(False, lambda: _SINK_DEVICE_TRACED)
    torch._check(False, lambda: _NO_POSITIONS_TRACED)


_OUTSIDE_A_STEP = ("attach: a captured module ran outside a step of the attached model: its forward pass begins "
                   "the steps (attach wraps model.forward), so either the module was called on its own, or "
                   "model.forward was replaced after attach (by another library?) — replace it before attach, or "
                   "detach() and attach again —, or the model is a copy of an attached model (attach the copy "
                   "itself, or copy before attach)")


def _first(output):
    return output[0] if isinstance(output, (tuple, list)) else output


# The request id of a row of no request (an ended sequence in a step recorded as a CUDA graph, whose shape is fixed):
# 2**64 - 1 as the library and the files store it, -1 as the int64 tensors here hold it.
NO_REQUEST = 2**64 - 1


def _pad_id(model) -> Optional[int]:
    """The pad token id ``generate`` feeds the rows of ended sequences (its generation config's, else its config's);
    None when there is none (``generate`` then feeds the end-of-sequence token)."""
    for cfg in (getattr(model, "generation_config", None), getattr(model, "config", None)):
        pad = getattr(cfg, "pad_token_id", None)
        if isinstance(pad, int) and pad >= 0:
            return pad
    return None


def _eos_ids(model) -> set:
    """The model's end-of-sequence token ids (its generation config's, else its config's)."""
    out = set()
    for cfg in (getattr(model, "generation_config", None), getattr(model, "config", None)):
        eos = getattr(cfg, "eos_token_id", None)
        if eos is None:
            continue
        for e in (eos if isinstance(eos, (list, tuple)) else [eos]):
            if isinstance(e, int) and e >= 0:
                out.add(e)
        if out:
            break
    return out


class _Traced:
    """What an attachment's hooks read and write while torch.compile traces the model's forward pass: the step's
    request-id tensors and positions, the captured tensors and their hookpoints, for the one step op at the end
    (:func:`step`). Kept apart from the :class:`Attachment` and reached by the hooks through one module-global
    dictionary, ``_TRACED``, by the attachment's key: dynamo guards every object a traced hook reads, and an object
    reached by two paths (the attachment through each layer's hook) gets a check, evaluated in Python at every call,
    that the paths still lead to one object — 17 such checks for 16 captured layers. This object holds nothing of
    the model and nothing of the attachment (whose collection drops it: a model dropped without
    ``detach()`` is freed as before)."""

    def __init__(self, key: int, req_ids: Dict[torch.device, torch.Tensor], ended_tokens: Sequence[int]) -> None:
        self.key = key
        self.req_ids = req_ids  # the attachment's own dictionary (its tensors are updated in place)
        self.ended_tokens = tuple(ended_tokens)
        self.tokens_hp: Optional[int] = None
        self.tokens: Optional[torch.Tensor] = None  # the step's token ids, noted by the embedding's pre-hook
        self.keep: List[torch.Tensor] = []  # request ids, positions, then each captured tensor
        self.keep_hp: List[int] = []  # the hookpoint of each captured tensor

    def capture(self, x: torch.Tensor, hp: int, width: int = 0) -> None:
        """Notes ``x`` for hookpoint ``hp`` (``width``: unused, as :meth:`Attachment._capture` takes it)."""
        self.keep.append(x)
        self.keep_hp.append(hp)  # captured by the step op at the end of the forward pass

    def begin(self, module, args, kwargs) -> None:
        """The first decoder layer's pre-hook: notes the step's request-id and position tensors (from the layer's
        own arguments)."""
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        pos = kwargs.get("position_ids")
        if pos is None:
            pos = kwargs.get("cache_position")
        if hidden is None or pos is None:
            _refuse_while_tracing("positions")
        self.keep.clear()
        self.keep_hp.clear()
        tokens, self.tokens = self.tokens, None
        t = self.req_ids.get(hidden.device)
        if t is None or t.numel() < hidden.shape[0]:
            _refuse_while_tracing("ids")
        req = _live_request_ids(cast(torch.Tensor, t)[:hidden.shape[0]], tokens, self.ended_tokens)
        self.keep.extend((req, pos))
        if self.tokens_hp is not None and tokens is not None:
            # The step's token ids: captured by the step op like the sites.
            self.keep.append(tokens.to(torch.int64).reshape(-1, 1))
            self.keep_hp.append(self.tokens_hp)

    def note_tokens(self, module, args, kwargs) -> None:
        ids = kwargs.get("input", args[0] if args else None)
        self.tokens = ids if isinstance(ids, torch.Tensor) else None

    def end(self, module, device) -> None:
        """After the last captured module (``module``): the whole step as one op (see :func:`step`). The op's sink is
        the module's ``_ringscope_sink`` buffer (attach adds it): reached through the module, it is a static input of
        the compiled graph (CUDA graph trees record a graph that mutates only static inputs), on the module's device
        wherever the model is moved."""
        if len(self.keep) < 2:
            return  # the first decoder layer did not run in this graph: nothing to attribute rows to
        sink = getattr(module, "_ringscope_sink", None)
        if not isinstance(sink, torch.Tensor) or sink.device != device:
            _refuse_while_tracing("sink")
        step(sink, self.keep[0], self.keep[1], self.keep[2:], list(self.keep_hp), self.key)
        self.keep.clear()
        self.keep_hp.clear()


# Each attachment's traced state by its key (see _Traced); removed when the attachment is detached or collected.
_TRACED: Dict[int, _Traced] = {}


def _live_request_ids(req: torch.Tensor, ids: Optional[torch.Tensor], ended_tokens: Sequence[int]) -> torch.Tensor:
    """Steps recorded as CUDA graphs or compiled (fixed shape, no host code at replay): ``req`` with -1 (no
    request, :data:`NO_REQUEST`) for the rows of a decode step fed one of ``ended_tokens`` (end of sequence, pad) —
    what ``generate`` feeds the rows of ended sequences —, computed on the device at every replay."""
    if not ended_tokens or not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.shape[1] != 1 \
            or ids.shape[0] != req.shape[0]:
        return req
    last = ids[:, -1]
    ended = last == ended_tokens[0]
    for t in ended_tokens[1:]:
        ended = ended | (last == t)
    return req.masked_fill(ended, -1)


class _StepAround:
    """Begins and ends a step around an attached model's own forward pass, as the model's ``forward`` (an instance
    attribute; a handle in ``Attachment._handles``, whose ``remove`` puts back what was there). Hooks on the model
    did this before: a call of a hooked module runs the module's hook path in Python and, under torch.compile, each
    hook as a compiled frame of its own with its guards — +20-28 µs per compiled call on the build machine
    (benches/compiled_host.py, ``top_hooks``); this traces into the forward pass (compiled, the step begins and ends
    inside the graph). Its signature is the forward pass's, so ``generate`` and others inspecting ``model.forward``
    see the model's parameters; the class's ``forward`` is looked up at each call (a patch of the class made after
    attach is used), and an instance ``forward`` that was there before attach is called inside and put back by
    ``remove``. What it reads from the model is named by the attachment's key, so that a wrapper left in another
    library's chain by ``detach()`` passes calls through, whatever is attached later. Unlike the model hooks it
    replaces, it begins the step after every forward pre-hook of the model and ends it before every forward hook."""

    def __init__(self, att: "Attachment", model: torch.nn.Module) -> None:
        self.model: Optional[torch.nn.Module] = model
        self.shadowed = vars(model).get("forward")  # an instance attribute it replaces (another library's wrapper)
        self.inner_name = f"_ringscope_inner_forward_{att._key}"  # the shadowed forward, if any
        self.att_name = f"_ringscope_attachment_{att._key}"
        inner_name, att_name = self.inner_name, self.att_name

        def forward(self, *args, **kwargs):  # (named `self` as the forward pass it wraps: the same graph input names)
            inner = self.__dict__.get(inner_name)
            if torch.compiler.is_compiling():  # the step begins and ends inside the graph (_Traced, step op)
                return type(self).forward(self, *args, **kwargs) if inner is None else inner(*args, **kwargs)
            att = self.__dict__.get(att_name)
            if att is not None and _ATTACHMENTS.get(att._key) is not att:
                # A deep copy of the attached model: its hooks are the original's (functions are not copied), and its
                # copied attachment would open steps in the original's session.
                raise RingscopeError("RS_ERR_STEP", _OUTSIDE_A_STEP)
            if att is not None:
                att._begin(self, args, kwargs)
            output = type(self).forward(self, *args, **kwargs) if inner is None else inner(*args, **kwargs)
            if att is not None:  # (None: detached while another library's wrapper kept this one in its chain)
                att._end(self, args, kwargs, output)
            return output

        # A code object of its own per attachment: dynamo keeps its caches and what it learnt about shapes (automatic
        # dynamic shapes) per code object, and models of other classes must not share them.
        forward.__code__ = forward.__code__.replace(co_name=f"forward_{type(model).__name__}_{att._key}")
        shown = self.shadowed if self.shadowed is not None else types.MethodType(type(model).forward, model)
        functools.update_wrapper(forward, getattr(shown, "__func__", shown))
        sig = inspect.signature(shown)
        forward.__signature__ = sig.replace(  # type: ignore[attr-defined]
            parameters=[inspect.Parameter("self", inspect.Parameter.POSITIONAL_ONLY), *sig.parameters.values()])
        if self.shadowed is not None:
            model.__dict__[inner_name] = self.shadowed
        model.__dict__[att_name] = att
        self.installed = model.__dict__["forward"] = types.MethodType(forward, model)

    def remove(self) -> None:
        model, self.model = self.model, None
        if model is None:
            return
        if vars(model).get("forward") is self.installed:
            if self.shadowed is None:
                del model.__dict__["forward"]  # the class's own again
            else:
                model.__dict__["forward"] = self.shadowed
            model.__dict__.pop(self.inner_name, None)
        # (Else another library wrapped it since: this one stays in its chain and passes the call through.)
        model.__dict__.pop(self.att_name, None)


class Attachment:
    """What :func:`attach` installed: the session, the hookpoint ids by name, and the hooks (``detach()`` removes
    them). Set ``request_ids`` (one per batch row) before a forward pass to name the rows' requests. By default
    every forward pass that starts new sequences (a prefill: nothing cached yet) gets new ids — ``generate`` calls
    one after another never share a request id: the first call's rows are requests ``0 .. batch-1``, the next
    call's continue from there —, and the decode steps that follow keep them (:meth:`current_request_ids`)."""

    def __init__(self, session: Session, model):
        self.session = session
        self.model = model
        self.hookpoints: Dict[str, int] = {}
        # Request id per batch row as an int64 tensor per device, read by steps begun inside a CUDA graph or by a
        # compiled graph (see set_request_ids): updated in place, so recorded graphs never name stale requests.
        self._req_ids: Dict[torch.device, torch.Tensor] = {}
        # Tensors replaced by larger ones (a larger batch came): graphs recorded earlier still read them, so they are
        # kept alive and updated with the current ids too.
        self._retired: List[torch.Tensor] = []
        self._request_ids: Optional[List[int]] = None
        self.step = 0
        self._handles: List = []
        self._sink_module: Optional[torch.nn.Module] = None  # the module holding the step op's sink buffer
        self._open = False
        # Captured tensors of the open step: kept alive until the step ends, so that with `ring.defer_captures`
        # their memory is not reused before the step's capture kernel has read it.
        self._keep: List[torch.Tensor] = []
        self._widths: Dict[int, int] = {}
        self._key = next(_NEXT_KEY)
        self._recorded_graph = False  # a CUDA graph recorded one of this attachment's steps (see detach)
        # Default request ids (request_ids unset): those of the sequences in flight, and the next one to give.
        self._auto_ids: Optional[List[int]] = None
        self._next_id = 0
        # Eager steps: which batch rows' sequences have ended (fed their EOS token, or stopped by
        # ProbeStoppingCriteria) — sticky until the next prefill —, and the rows of the open step that are captured
        # (None: all; else an index tensor: padding and ended rows left out).
        self._finished: Optional[np.ndarray] = None
        self._kept: Optional[torch.Tensor] = None
        self._step_shape = (0, 0)  # (batch, seq) of the open eager step
        self._eos = _eos_ids(model)
        # Input tokens that mark a decode row as an ended sequence's: `generate` feeds an ended row its EOS token
        # (the one it generated), then the pad token (the EOS token when there is no pad token).
        pad = _pad_id(model)
        self._ended_tokens = sorted(self._eos | ({pad} if pad is not None else set()))
        self._tokens_hp: Optional[int] = None
        self._rows_setting: "str | Sequence[int]" = "all"  # attach's `rows`, restored after a last-token capture
        self._duplicate_ids = False  # the open eager step names one request on several batch rows
        self._warned_last = False
        self._admitting: Optional[Callable] = None  # full mode on CUDA: the model's wrapped get_compiled_call
        self._shadowed: Optional[Callable] = None  # the instance attribute it replaced, if any
        # Hooked modules, their own classes and the classes they took (_distinguish).
        self._classes: List[Tuple[torch.nn.Module, type, type]] = []
        _ATTACHMENTS[self._key] = self
        self._traced = _TRACED[self._key] = _Traced(self._key, self._req_ids, self._ended_tokens)
        weakref.finalize(self, _TRACED.pop, self._key, None)

    @property
    def request_ids(self) -> Optional[List[int]]:
        """The request id of each batch row (``None``: row ``b`` is request ``b``). Setting it also updates, in
        place, the tensors that recorded CUDA graphs and compiled graphs read at every call, so they never name
        stale requests; set it outside graph recording."""
        return self._request_ids

    @request_ids.setter
    def request_ids(self, ids: Optional[Sequence[int]]) -> None:
        self._request_ids = None if ids is None else _int_array("request_ids", ids, np.uint64).tolist()
        if _recording():
            raise RingscopeError("RS_ERR_INVALID_ARGUMENT",
                                 "attach: request ids were set while a CUDA graph is being recorded; set them before "
                                 "recording or between replays")
        new = _device_ids(cast(List[int], self._request_ids)) if ids is not None else None  # set from ids above
        for t in self._id_tensors():
            if new is None:
                t.copy_(torch.arange(t.numel(), dtype=torch.int64))
            elif new.numel() <= t.numel():  # a larger batch gets a new tensor at its first eager forward pass
                t[:new.numel()].copy_(new)
            else:  # a graph recorded with a smaller batch reads the first rows
                t.copy_(new[:t.numel()])

    def set_request_ids(self, request_ids: Sequence[int], device=None) -> None:
        """Names the requests of the batch rows (one id per row), like setting ``request_ids``, and makes sure the
        tensor that CUDA graphs and compiled graphs read exists and is large enough (call it outside graph
        recording)."""
        self.request_ids = request_ids
        dev = torch.device(device) if device is not None else next(self.model.parameters()).device
        self._request_id_tensor(dev, len(cast(List[int], self._request_ids)))  # set from request_ids above

    def apply_controls(self, stream: Optional[int] = None) -> None:
        """Makes control changes (``session.set_enabled`` etc.) reach recorded CUDA graphs whose steps begin inside
        the graph (their replays make no host call). Call between replays."""
        self.session.apply_controls(stream)

    def _id_tensors(self) -> List[torch.Tensor]:
        """Every request-id tensor a recorded graph may read: the current one per device and the retired ones."""
        return list(self._req_ids.values()) + self._retired

    def _request_id_tensor(self, device, batch: int) -> torch.Tensor:
        t = self._req_ids.get(device)
        if t is None or t.numel() < batch:
            if torch.compiler.is_compiling():
                _refuse_while_tracing("ids")
            if _recording():
                raise RingscopeError("RS_ERR_INVALID_ARGUMENT", f"{_TOO_FEW_IDS} (a batch of {batch} rows)")
            if t is not None:
                self._retired.append(t)
            t = self._req_ids[device] = torch.arange(max(batch, 256), dtype=torch.int64, device=device)
            # Read in place by compiled graphs (CUDA graph trees copy an input that is not static into memory of
            # their own at every replay): compiled code reaches it through a global (_Traced), which dynamo would
            # otherwise take as an input like any other. Unguarded: a replacement is caught by CUDA graph trees'
            # check of static addresses (a new recording), not by a recompilation.
            torch._dynamo.mark_static_address(t, guard=False)
            ids = self.request_ids if self.request_ids is not None else self._auto_ids
            if ids is not None and len(ids) <= t.numel():
                t[:len(ids)].copy_(_staged(_device_ids(ids), device), non_blocking=True)
        return t[:batch]

    def current_request_ids(self, batch: int) -> List[int]:
        """The request id of each of ``batch`` rows as the steps now name them: ``request_ids`` when set, else the
        ids the last prefill gave (``0 .. batch-1`` before any)."""
        if self.request_ids is not None:
            return list(self.request_ids)
        if self._auto_ids is not None and len(self._auto_ids) == batch:
            return list(self._auto_ids)
        return list(range(batch))

    def _new_sequences(self, batch: int) -> None:
        """A prefill: default request ids for its rows (when ``request_ids`` is unset), in the tensors recorded graphs
        read too; no row has ended."""
        self._finished = np.zeros(batch, dtype=bool)
        if self.request_ids is not None:
            return
        self._auto_ids = list(range(self._next_id, self._next_id + batch))
        self._next_id += batch
        ids = _device_ids(self._auto_ids)
        for t in self._id_tensors():
            n = min(batch, t.numel())
            # Stream-ordered before this step's kernels and any graph replayed after it on this stream (or on one
            # that waits for it, as the replay must for the cache this step fills).
            t[:n].copy_(_staged(ids[:n], t.device), non_blocking=True)

    def _mark_finished(self, rows) -> None:
        """Rows whose sequences ``generate`` ended (ProbeStoppingCriteria): left out of the steps that follow."""
        if self._finished is not None and len(self._finished) == len(rows):
            self._finished |= np.asarray(rows, dtype=bool)

    def _distinguish(self) -> None:
        """Gives every module this attachment hooked a class of its own while attached
        (:func:`_hooked_class`), so that torch.compile compiles the attached model anew instead of replaying a graph
        it compiled without the hooks. ``detach()`` gives the modules their classes back. A module whose class cannot
        be changed (a layout of its own, ``__slots__``) keeps it, with a warning."""
        # A hook handle refers to the dict it was added to (`_forward_hooks` or `_forward_pre_hooks`, with kwargs too).
        hooked = {id(d) for d in (getattr(h, "hooks_dict_ref", lambda: None)() for h in self._handles) if d is not None}
        for m in self.model.modules():
            cls = type(m)
            if "_ringscope_unhooked_class" in vars(cls) or not (
                    id(m._forward_hooks) in hooked or id(m._forward_pre_hooks) in hooked):
                continue
            try:
                sub = _hooked_class(cls)  # (a class may refuse subclasses: its __init_subclass__ raises)
                m.__class__ = sub
            except Exception as e:
                warnings.warn(f"ringscope.torch.attach: the class of a hooked {cls.__qualname__} cannot be changed "
                              f"({e}): a graph torch.compile compiled for it without hooks could still be replayed "
                              "for it (compile the model after attach)", RuntimeWarning, stacklevel=3)
                continue
            self._classes.append((m, cls, sub))

    def detach(self) -> None:
        """Removes the hooks and the sink buffer :func:`attach` added to the model (and, full mode on CUDA, the
        admission around ``generate``'s compiled step) and gives the hooked modules their own classes back. When
        torch.compile recorded CUDA graphs of this attachment's steps, also resets torch.compile
        (``torch._dynamo.reset()``): every compiled graph of the process is dropped and recompiled on its next call."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        _TRACED.pop(self._key, None)
        for m, cls, sub in self._classes:
            if type(m) is sub:  # (a class changed since by someone else is left as it is)
                m.__class__ = cls
        self._classes.clear()
        if self._admitting is not None and vars(self.model).get("get_compiled_call") is self._admitting:
            if self._shadowed is None:
                del self.model.get_compiled_call  # the class's own again
            else:
                self.model.get_compiled_call = self._shadowed
        self._admitting = self._shadowed = None
        if self._sink_module is not None and getattr(self._sink_module, "_ringscope_sink", None) is not None:
            delattr(self._sink_module, "_ringscope_sink")
        self._sink_module = None
        if self._recorded_graph:
            # torch.compile recorded CUDA graphs that write into this session's device memory at every replay and run
            # no Python: drop every compiled graph of the process (dynamo cannot drop one model's alone), so that
            # none can replay after the session is closed.
            torch._dynamo.reset()
            self._recorded_graph = False

    def _admit_compiled_steps(self) -> None:
        """Full mode on the CUDA backend. ``generate``'s compiled decode step (static cache; transformers compiles it
        with ``mode="reduce-overhead"``) replays a CUDA graph that begins its step on the device, and a replay cannot
        wait for ring space by itself: unadmitted, a replay that finds the ring full loses its rows (counted as
        ``ring_full``). So the model's ``get_compiled_call`` (transformers' ``GenerationMixin``; nothing to wrap on
        other models) is wrapped: every call of a compiled step that replays CUDA graphs first admits its rows —
        :meth:`Session.admit_graph_step` for the call's batch × tokens (made as the engine plugins make it before every
        pass), on the current stream of the inputs' device: a check of two host
        counters when the ring has room, a wait for the drain (up to the step's wait budget) when it has not. A call
        that runs its step eagerly after all (CUDA graph trees' warm-up of a new shape) is admitted again from the
        host; the reservation it leaves is released by a later admission, which may wait once for the stream."""
        original = getattr(self.model, "get_compiled_call", None)
        if not callable(original):
            return
        model, session = self.model, self.session

        def get_compiled_call(compile_config=None):
            compiled = original(compile_config)
            config = getattr(model, "_last_compile_config", None) or compile_config
            if config is None and callable(getattr(model, "_default_compile_config", None)):
                config = model._default_compile_config()
            if compiled == model.__call__ or not _replays_cuda_graphs(config):
                return compiled  # not compiled, or compiled without CUDA graphs: its steps are begun from the host

            admit = session._before_pass(True)  # the engine plugins' per-pass admission: the C call alone

            def admitted(*args, **kwargs):
                if self._admitting is not None:  # still attached
                    batch, seq, device = self._inputs(args, kwargs)
                    admit(batch * seq, _current_stream(device.index if device.type == "cuda" else None))
                return compiled(*args, **kwargs)
            return admitted

        # An instance attribute of the same name (a user's own wrapper) is put back by detach().
        self._shadowed = vars(model).get("get_compiled_call")
        self._admitting = model.get_compiled_call = get_compiled_call

    # -- the batch descriptor ------------------------------------------------------------------------------------
    def begin_step(self, request_ids: Sequence[int], positions, stream: Optional[int] = None) -> None:
        """Starts a step by hand, for CUDA-graph replays (the forward pass inside a graph does not run Python hooks
        at replay): one request id and one position per captured row, in row order. Call before ``replay()``;
        before recording the graph too (captures are recorded inside an open step)."""
        if stream is None and _cuda_available() and torch.cuda.is_initialized():
            stream = torch.cuda.current_stream().cuda_stream
        self.session.begin_step(self.step, request_ids, positions, stream=stream)
        self._open = True

    def end_step(self) -> None:
        """Ends a step started with :meth:`begin_step` (when a graph was recorded in it, the recording already
        ended it inside the graph)."""
        if self._open:
            self.session.end_step()
        self._open = False
        self._keep.clear()
        self.step += 1

    @staticmethod
    def _inputs(args, kwargs):
        """(batch, seq, device) of a forward call, from ``input_ids`` or ``inputs_embeds``."""
        ids = kwargs.get("input_ids", args[0] if args else None)
        x = ids if ids is not None else kwargs.get("inputs_embeds")
        if x is None:
            raise RingscopeError("RS_ERR_INVALID_ARGUMENT",
                                 "attach: the forward call has neither input_ids nor inputs_embeds, so the step's "
                                 "batch is unknown")
        return x.shape[0], x.shape[1], x.device

    def _begin(self, module, args, kwargs):
        """Begins an eager step (or one recorded as a CUDA graph) before the forward pass (:class:`_StepAround`;
        compiled, the step begins inside the graph: :meth:`_Traced.begin`)."""
        batch, seq, device = self._inputs(args, kwargs)
        pos = kwargs.get("position_ids")
        if pos is None:
            pos = kwargs.get("cache_position")
        if _recording():
            if self._open:
                return  # recording a graph inside a step begun by hand (begin_step before each replay)
            if pos is None or not pos.is_cuda:
                raise RingscopeError("RS_ERR_INVALID_ARGUMENT",
                                     "attach: recording a CUDA graph needs position_ids or cache_position as CUDA "
                                     "tensors in the forward call (the step's token positions are read from them at "
                                     "every replay), or begin_step by hand before recording and before each replay")
            ids_in = kwargs.get("input_ids", args[0] if args else None)
            req = self._request_id_tensor(device, batch)
            tokens = self._ended_on_device(req, ids_in)
            if tokens is None:
                req = self._live_request_ids(req, ids_in)
            self._begin_tensors(req, pos, tokens)
            if self._tokens_hp is not None and isinstance(ids_in, torch.Tensor) and ids_in.is_cuda:
                # The static input tensor: every replay captures the tokens it then holds.
                _capture_now(ids_in.reshape(-1, 1), self.session._h, self._tokens_hp, 1)
            return
        # Tokens already in the cache: from cache_position, else the cache (`past_key_values`, or `cache` as newer
        # transformers name it), else the attention mask's width.
        # (The cache is asked only without cache_position: a static cache counts its tokens with device kernels.)
        cp = kwargs.get("cache_position")
        mask = kwargs.get("attention_mask")
        ids_in = kwargs.get("input_ids", args[0] if args else None)
        cp1 = cp.reshape(-1)[:1] if isinstance(cp, torch.Tensor) and cp.numel() > 0 else None
        past_len = None
        if cp1 is None:
            past = kwargs.get("past_key_values", kwargs.get("cache"))
            if past is not None and hasattr(past, "get_seq_length"):
                past_len = past.get_seq_length()
            if past_len is None and isinstance(mask, torch.Tensor) and mask.dim() == 2 and mask.shape[1] >= seq:
                past_len = mask.shape[1] - seq
            past_len = past_len or 0
        # What the host reads of the model's device tensors, read with one wait for the device (not one per value),
        # and only what this step needs: a prefill without them (no positions, no mask, no cache position) reads
        # nothing and does not wait. The mask: where it covers the whole sequence so far; the last tokens: after the
        # first step (a row fed its EOS token generated it at the step before).
        mask_covers = isinstance(mask, torch.Tensor) and mask.dim() == 2 and mask.shape[0] == batch and (
            mask.shape[1] >= seq if past_len is None else mask.shape[1] == past_len + seq)
        last_needed = bool(self._ended_tokens) and isinstance(ids_in, torch.Tensor) and ids_in.dim() == 2 and (
            past_len is None or past_len > 0)
        host = _on_host(cp=cp1, pos=pos if isinstance(pos, torch.Tensor) else None,
                        mask=mask if mask_covers else None, last=ids_in[:, -1] if last_needed else None)
        if host["pos"] is not None:
            pos = host["pos"]
        if past_len is None:
            past_len = int(cast(torch.Tensor, host["cp"])[0])  # (cp1 was given)
        if pos is None:
            pos = torch.arange(past_len, past_len + seq)
        if self.request_ids is not None and len(self.request_ids) != batch:
            raise RingscopeError("RS_ERR_INVALID_ARGUMENT",
                                 f"attach: {len(self.request_ids)} request ids set for a batch of {batch} rows")
        if past_len == 0 or self._finished is None or len(self._finished) != batch:
            self._new_sequences(batch)
        # Real token positions and padding from the attention mask (left-padded batches: `generate` pads on the left,
        # and padding rows are no tokens of any request), when it covers the whole sequence so far.
        keep = None
        if host["mask"] is not None and host["mask"].shape[1] == past_len + seq:
            m = host["mask"] != 0
            if not bool(m.all()):
                pos = (m.to(torch.int64).cumsum(-1) - 1).clamp(min=0)[:, -seq:]
                keep = m[:, -seq:].clone()
        # Sequences that ended: a row fed its EOS token generated it at the step before (``generate`` keeps a finished
        # row in the batch, feeding it padding), so from here on its rows are no request's tokens.
        ended_now = None
        if past_len > 0 and host["last"] is not None:
            last = host["last"].numpy()
            self._finished |= _one_of(last, self._eos)
            # A row fed the pad token is an ended sequence's too (one that a stopping criterion ended), at this step.
            ended_now = self._finished | _one_of(last, self._ended_tokens)
        if ended_now is not None and ended_now.any() or self._finished.any():
            ended = torch.from_numpy(ended_now if ended_now is not None else self._finished)[:, None]
            ended = ended.expand(batch, seq)
            keep = ~ended if keep is None else keep & ~ended
        req = np.asarray(self.current_request_ids(batch), dtype=np.uint64)
        if device.type == "cuda":
            self._request_id_tensor(device, batch)  # ready for a graph recorded after this eager pass
        self._begin_eager(req, pos, batch, device, keep)
        if self._tokens_hp is not None and isinstance(ids_in, torch.Tensor) and ids_in.dim() == 2:
            tokens = self._keep_rows(ids_in.to(torch.int64).reshape(-1, 1))
            if tokens.shape[0]:
                tokens = tokens.contiguous()
                self._keep.append(tokens)  # alive until the step's (possibly deferred) capture has read it
                _capture_now(tokens, self.session._h, self._tokens_hp, 1)

    def _begin_tensors(self, request_ids: torch.Tensor, pos: torch.Tensor,
                       tokens: Optional[torch.Tensor] = None) -> None:
        """Begins a step from a request-id tensor ``[batch]`` and a positions tensor (``[batch, seq]``, ``[1, seq]``
        or ``[seq]``): recorded into the CUDA graph being captured, else eagerly. ``tokens`` (recording only, from
        :meth:`_ended_on_device`): each batch row's token, for the recorded kernels to leave out rows of ended
        sequences."""
        batch = request_ids.shape[0]
        if pos.dim() == 2 and pos.shape[0] == 1 and batch > 1:
            pos = pos[0]  # one row of positions broadcast over the batch
        if pos.dim() not in (1, 2) or (pos.dim() == 2 and pos.shape[0] != batch):
            raise RingscopeError("RS_ERR_INVALID_ARGUMENT",
                                 f"attach: positions of shape {tuple(pos.shape)} for a batch of {batch} rows (want "
                                 "[batch, seq], [1, seq] or [seq])")
        if pos.is_cuda and torch.cuda.is_current_stream_capturing():
            if self._open:
                return  # a step begun by hand before recording
            self.session.begin_step_graph(request_ids, pos.to(torch.int64),
                                          stream=torch.cuda.current_stream(pos.device).cuda_stream, tokens=tokens,
                                          ended_tokens=self._ended_tokens if tokens is not None else ())
            self._open = True
            return
        req = request_ids.detach().to("cpu", torch.int64).numpy()
        if (req < -1).any():
            raise RingscopeError("RS_ERR_INVALID_ARGUMENT", f"attach: negative request ids {req[req < -1][:4]}")
        # -1: a row of no request (an ended sequence, see _live_request_ids): left out, as eager steps leave it out.
        keep = None
        if (req == -1).any():
            keep = torch.from_numpy(req != -1)[:, None].expand(batch, pos.shape[-1])
        self._begin_eager(req.astype(np.uint64), pos, batch, pos.device, keep)

    def _begin_eager(self, req: np.ndarray, pos: torch.Tensor, batch: int, device,
                     keep: Optional[torch.Tensor] = None) -> None:
        """Begins an eager step of ``batch`` × ``seq`` rows; ``keep`` (bool ``[batch, seq]``): the rows that are
        tokens of a request (the others — padding, ended sequences — are left out of the step and of every capture)."""
        seq = pos.shape[-1]
        # Range-checked by begin_step (a negative position is refused, not wrapped to 2**32 - 1).
        positions = np.broadcast_to(pos.detach().to("cpu", torch.int64).numpy().reshape(-1, seq), (batch, seq))
        if self._open:
            self.session.end_step()
            self._open = False
            self._keep.clear()
        stream = _current_stream(device.index) if device.type == "cuda" else None
        self._duplicate_ids = len(set(req.tolist())) != len(req)
        reqs, positions = np.repeat(req, seq), positions.reshape(-1)
        self._kept = None
        if keep is not None and not bool(keep.all()):
            flat = keep.reshape(-1).numpy()
            reqs, positions = reqs[flat], positions[flat]
            self._kept = _staged(torch.from_numpy(np.flatnonzero(flat)), device).to(device, non_blocking=True)
        self._step_shape = (batch, seq)
        if len(reqs) == 0:
            # Every row is padding or an ended sequence: no step (a step has rows), and the hooks capture nothing.
            return
        self.session.begin_step(self.step, reqs, positions, stream=stream)
        self._open = True

    def _ended_on_device(self, req: torch.Tensor, ids: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """Recording a decode step as a CUDA graph: the tokens ``[batch]`` (a view of ``input_ids``) from which
        ringscope's own recorded kernels tell the rows of ended sequences at every replay — no kernel of the model's
        for it (what :meth:`_live_request_ids` launches otherwise). ``None`` where that does not apply: no ended
        tokens, not a one-token decode step of int64 CUDA tokens, more ended tokens than the kernels take, or a
        library older than it."""
        if not self._ended_tokens or len(self._ended_tokens) > MAX_ENDED_TOKENS or not isinstance(ids, torch.Tensor) \
                or ids.dim() != 2 or ids.shape[1] != 1 or ids.shape[0] != req.shape[0] or not ids.is_cuda \
                or ids.dtype != torch.int64 or not _has_call("rs_begin_step_graph_ended"):
            return None
        return ids[:, -1]

    def _live_request_ids(self, req: torch.Tensor, ids: Optional[torch.Tensor]) -> torch.Tensor:
        """A step recorded as a CUDA graph: :func:`_live_request_ids`, kept alive until the step ends."""
        live = _live_request_ids(req, ids, self._ended_tokens)
        if live is not req:
            self._keep.append(live)  # read by the step's kernels until it ends (recorded graphs: at every replay)
        return live

    def _keep_rows(self, x: torch.Tensor) -> torch.Tensor:
        """The rows of ``x`` (``[batch × seq, width]``) the open eager step captures."""
        return x if self._kept is None else x.index_select(0, self._kept.to(x.device))

    def _end(self, module, args, kwargs, output):
        """Ends the step :meth:`_begin` began (compiled, it ends inside the graph: :meth:`_Traced.end`)."""
        self._end_tensors()
        self._keep.clear()

    def _end_tensors(self) -> None:
        if _recording():
            # Recording: end the step inside the graph, so that every replay runs what ending it launches (the
            # deferred captures' kernel). A step begun by hand is then ended already when end_step() is called.
            if self._open:
                self.session.end_step()
                self._open = False
            return
        if self._open:
            self.session.end_step()
            self._open = False
        self.step += 1

    def _step_tensors(self, request_ids, positions, captures, hookpoints) -> None:
        recording = _recording()
        if recording:
            self._recorded_graph = True  # torch.compile's CUDA graphs (mode="reduce-overhead") record this step
        self._begin_tensors(request_ids, positions)
        alive = []  # filtered copies: read by a deferred capture when the step ends, so kept until then
        try:
            for x, hp in zip(captures, hookpoints):
                if not recording:
                    # Run eagerly: rows of no request (ended sequences) are left out, as in eager steps.
                    if not self._open:
                        continue  # every row is of no request: no step, nothing captured
                    x = self._keep_rows(x.reshape(-1, self._widths[hp]))
                    if x.shape[0] == 0:
                        continue
                    x = x.contiguous()
                    alive.append(x)
                _capture_now(x, self.session._h, hp, self._widths[hp])
        finally:
            self._end_tensors()

    def _hook(self, name: str, width: int, pick=_first):
        hp, key = self.hookpoints[name], self._key

        def hook(module, args, output):
            if torch.compiler.is_compiling():  # (the traced state by one global path: see _Traced)
                _TRACED[key].capture(pick(output).contiguous(), hp)
                return
            self._capture(pick(output).contiguous(), hp, width)

        return hook

    def _capture(self, x: torch.Tensor, hp: int, width: int) -> None:
        """Captures ``x`` (contiguous; ``[..., width]``, the step's rows in order) into hookpoint ``hp`` the way the
        forward pass runs: noted for the step op while torch.compile traces, recorded while a CUDA graph is, else
        eagerly (padding and ended rows left out)."""
        if torch.compiler.is_compiling():
            _TRACED[self._key].capture(x, hp)  # captured by the step op at the end of the forward pass
            return
        if _recording():
            self._keep.append(x)
            _capture_now(x, self.session._h, hp, width)
            return
        batch, seq = self._step_shape
        rows = x.numel() // width
        if seq > 1 and rows == batch:
            # The model computed this site for each row's last token only (logits at a `generate` prefill).
            self._capture_last_tokens(x, hp, width)
            return
        x = self._keep_rows(x.reshape(-1, width))
        self._keep.append(x)
        if x.shape[0]:
            if not self._open:
                raise RingscopeError("RS_ERR_STEP", _OUTSIDE_A_STEP)
            _capture_now(x, self.session._h, hp, width)

    def _capture_last_tokens(self, x: torch.Tensor, hp: int, width: int) -> None:
        """Captures ``x`` — one row per batch row, its last token's — as those tokens' rows, not the step's first
        rows: the rows of the requests in the step, in batch order, are its last rows per request. CUDA: a last-rows
        capture (:meth:`Session.capture_device_last_rows`); host backend: through the hookpoint's last-token
        selection for this one capture."""
        batch, seq = self._step_shape
        rows = x.reshape(batch, width)
        if self._kept is not None:
            # Rows whose last token is in the step (left padding never pads a row's last token; ended rows are out).
            last = torch.arange(batch, device=self._kept.device) * seq + seq - 1
            rows = rows[torch.isin(last, self._kept).to(rows.device)]
        if rows.shape[0] == 0:
            return
        if not self._open:
            raise RingscopeError("RS_ERR_STEP", _OUTSIDE_A_STEP)
        if rows.is_cuda and (isinstance(self._rows_setting, (list, tuple)) or self._duplicate_ids):
            # A row list names batch rows a one-row-per-request source does not hold, and requests sharing rows
            # have one last row between them: skipped (and said once) rather than misattributed.
            if not self._warned_last:
                import warnings
                warnings.warn("ringscope attach: a site the model computed for each row's last token only (logits at a "
                              "prefill) is not captured on the CUDA backend when attach selects a list of rows or rows "
                              "share a request id", stacklevel=3)
                self._warned_last = True
            return
        rows = rows.contiguous()
        self._keep.append(rows)
        if rows.is_cuda:
            self.session.capture_device_last_rows(hp, rows.data_ptr(), rows.shape[0],
                                                  _current_stream(rows.device.index))
            return
        self.session.set_rows(hp, "last_per_request")
        try:
            _capture_now(rows, self.session._h, hp, width)
        finally:
            self.session.set_rows(hp, self._rows_setting)


_NO_ROTARY = ("attach: an attention module with attn_q / attn_k attached returned without calling its modeling "
              "module's apply_rotary_pos_emb in this thread, whose outputs those sites capture (an attention forward replaced, "
              "RoPE applied another way, or a forward pass of another model of the same family running in another "
              "thread at the same time, which is not supported while attached): its query and key rows cannot be "
              "captured")
_NO_ROTARY_TRACED = _NO_ROTARY + " [RS_ERR_INVALID_ARGUMENT]"


class _RotaryPatch:
    """The ``apply_rotary_pos_emb`` of one Hugging Face modeling module, replaced while attention sites are attached
    by a wrapper that calls the original and hands its outputs — the rotated query and key the attention function
    then receives — to the :class:`_AttentionTap` s of the attention module that is running (``active``: set by their
    pre-forward hooks, cleared by their forward hooks; several when several attachments capture one module). With no
    tap active the wrapper only calls the original. One per modeling module, shared by every attachment that uses it;
    the original is put back when the last one detaches.

    The attention modules' ``forward`` look the function up in their module's globals at each call, so the wrapper
    is what runs (and what torch.compile traces; a compiled graph guards on the global and recompiles after a
    change). What is active is per modeling module: in eager mode the wrapper hands its outputs over only in the
    thread whose attention module made them active, so a model of the same family running in another thread is never
    captured by mistake — but two attached models of one family running forward passes in two threads at once are
    not supported (a tap that gets no rotated tensors raises). The patch holds no tap (the taps' lists live on their
    attention modules): a model dropped without ``detach()`` is freed as before."""

    _by_module: Dict[str, "_RotaryPatch"] = {}

    def __init__(self, module, original) -> None:
        import inspect

        self.module, self.original = module, original
        self.active: Optional[List["_AttentionTap"]] = None
        self.thread = 0  # eager mode: the thread whose attention module made `active` active
        self.users = 0
        params = list(inspect.signature(original).parameters.values())
        at = [p.name for p in params].index("unsqueeze_dim") - 4  # its index among the arguments after q, k, cos, sin
        default = params[at + 4].default
        patch = self

        def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):
            out = original(q, k, cos, sin, *args, **kwargs)
            taps = patch.active
            if taps is not None and (torch.compiler.is_compiling() or patch.thread == threading.get_ident()):
                rotated = (out[0], out[1], kwargs.get("unsqueeze_dim", args[at] if len(args) > at else default))
                for tap in taps:
                    tap.rotated = rotated
            return out

        apply_rotary_pos_emb.__wrapped__ = original  # type: ignore[attr-defined]
        self.wrapper = apply_rotary_pos_emb

    @classmethod
    def of(cls, module) -> "_RotaryPatch":
        """The patch of ``module`` (a modeling module), made on first use; a RingscopeError when the module's function
        was replaced by something else while an earlier attachment's wrapper was installed (installing it again would
        undo that replacement)."""
        patch = cls._by_module.get(module.__name__)
        if patch is not None and patch.module is module:
            if module.apply_rotary_pos_emb not in (patch.wrapper, patch.original):
                raise RingscopeError("RS_ERR_INVALID_ARGUMENT",
                                     f"attach: {module.__name__}.apply_rotary_pos_emb was replaced while an attachment "
                                     "with attention sites was installed (a kernel library patching the model?): "
                                     "detach() every attachment of this model family, then attach again")
            return patch
        patch = cls._by_module[module.__name__] = cls(module, module.apply_rotary_pos_emb)
        return patch

    def add(self, attn, tap: "_AttentionTap") -> "_RotaryPatch._Added":
        """Installs the wrapper (if it is not there) and adds ``tap`` to ``attn``'s taps (a list kept on ``attn``: what
        its taps' hooks make active). The handle's ``remove`` undoes both."""
        if self.module.apply_rotary_pos_emb is not self.wrapper:
            self.module.apply_rotary_pos_emb = self.wrapper
        self.users += 1
        peers = attn.__dict__.setdefault("_ringscope_taps", [])
        peers.append(tap)
        return _RotaryPatch._Added(self, attn, tap)

    class _Added:
        def __init__(self, patch: "_RotaryPatch", attn, tap: "_AttentionTap") -> None:
            self.patch: Optional[_RotaryPatch] = patch
            self.attn, self.tap = attn, tap

        def remove(self) -> None:
            patch, self.patch = self.patch, None
            if patch is None:
                return
            peers = self.attn.__dict__.get("_ringscope_taps", [])
            if self.tap in peers:
                peers.remove(self.tap)
            if not peers:
                self.attn.__dict__.pop("_ringscope_taps", None)
            self.tap.rotated = None
            patch.users -= 1
            if patch.active is self.tap.peers:
                patch.active = None
            if patch.users == 0:
                patch.active = None
                if patch.module.apply_rotary_pos_emb is patch.wrapper:
                    patch.module.apply_rotary_pos_emb = patch.original
                if _RotaryPatch._by_module.get(patch.module.__name__) is patch:
                    del _RotaryPatch._by_module[patch.module.__name__]


class _AttentionTap:
    """The ``attn_q`` / ``attn_k`` captures of one Hugging Face attention module (Llama, Qwen2/3, Mistral, Gemma2)
    for one attachment: the query and key after RoPE exactly as the attention function receives them for the step's
    new tokens, without forking model code and without computing anything again.

    A pre-forward hook on the attention module makes its taps the active ones of its modeling module's
    :class:`_RotaryPatch`; the patched ``apply_rotary_pos_emb`` hands them the tensors the model just rotated
    (``[batch, heads, seq, head_dim]``); the module's forward hook captures them as ``[tokens, heads × head_dim]``
    rows — the model's own tensors, so bit for bit what attention used, whatever the dtype or device. (``attn_v`` is
    ``v_proj``'s output as it is, captured by an ordinary hook.) Device tensor ops of static shapes only: recordable
    into CUDA graphs and traceable by torch.compile like every other site. The cost: the captures, plus a copy of q
    and of k into token-major rows where their memory is head-major and a step has more than one token."""

    def __init__(self, att: "Attachment", attn, patch: _RotaryPatch, layer: int, heads: int, kv_heads: int,
                 head_dim: int, q: Optional[Tuple[int, int]], k: Optional[Tuple[int, int]]):
        self.att, self.key, self.patch, self.layer = att, att._key, patch, layer
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_hp, self.k_hp = q, k  # (hookpoint, row width) or None
        self.rotated: Optional[Tuple[torch.Tensor, torch.Tensor, int]] = None
        att._handles.append(patch.add(attn, self))
        self.peers: List[_AttentionTap] = attn.__dict__["_ringscope_taps"]
        att._handles.append(attn.register_forward_pre_hook(self._before))
        att._handles.append(attn.register_forward_hook(self._after, with_kwargs=True))

    def _before(self, module, args):
        self.rotated = None
        self.patch.active = self.peers
        if not torch.compiler.is_compiling():
            self.patch.thread = threading.get_ident()

    def _after(self, module, args, kwargs, output):
        rotated, self.rotated = self.rotated, None
        self.patch.active = None
        if rotated is None:
            if torch.compiler.is_compiling():
                torch._check(False, lambda: _NO_ROTARY_TRACED)
            raise RingscopeError("RS_ERR_INVALID_ARGUMENT", f"{_NO_ROTARY} (layer {self.layer})")
        q, k, unsqueeze_dim = rotated
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        tokens = tuple(hidden.shape[:2]) if isinstance(hidden, torch.Tensor) and hidden.dim() == 3 else None
        # Traced, the captures go to the attachment's traced state by its key (see _Traced), not through the tap.
        capture = _TRACED[self.key].capture if torch.compiler.is_compiling() else self.att._capture
        if self.q_hp is not None:
            capture(self._rows(q, unsqueeze_dim, self.heads, tokens), *self.q_hp)
        if self.k_hp is not None:
            capture(self._rows(k, unsqueeze_dim, self.kv_heads, tokens), *self.k_hp)

    def _rows(self, x: torch.Tensor, unsqueeze_dim: int, heads: int, tokens) -> torch.Tensor:
        """``x`` (``[batch, heads, seq, head_dim]``, or ``[batch, seq, heads, head_dim]`` when the model rotated with
        ``unsqueeze_dim=2``) as contiguous ``[batch, seq, heads × head_dim]`` rows; ``tokens``: the module's
        ``(batch, seq)``, which they must match."""
        if unsqueeze_dim == 1:
            x = x.transpose(1, 2)
        if (x.dim() != 4 or x.shape[2] != heads or x.shape[3] != self.head_dim
                or (tokens is not None and tuple(x.shape[:2]) != tokens)):
            raise RingscopeError("RS_ERR_INVALID_ARGUMENT",
                                 f"attach: layer {self.layer}'s apply_rotary_pos_emb returned a tensor of shape "
                                 f"{tuple(x.shape)} (unsqueeze_dim={unsqueeze_dim}), not "
                                 f"[{', '.join(map(str, tokens)) if tokens else 'batch, seq'}, "
                                 f"{heads}, {self.head_dim}] as the layer's input, heads and head_dim say")
        return x.reshape(x.shape[0], x.shape[1], heads * self.head_dim).contiguous()


def _attention_module(model, layer, index: int, family: str):
    """The attention module of decoder layer ``index``, its RoPE function, and its layer's attention metadata
    (see :func:`ringscope.attention.attention_pattern`) — or a RingscopeError naming why its attention cannot be
    captured for an exact rebuild."""
    import inspect
    import sys

    mt = model.config.model_type
    if family != "llama" or mt not in ATTENTION_MODEL_TYPES:
        raise RingscopeError("RS_ERR_INVALID_ARGUMENT",
                             f"attach: sites {', '.join(_ATTN_SITES)} are not supported for model type {mt!r} "
                             f"(supported: {', '.join(ATTENTION_MODEL_TYPES)})")
    attn = layer.self_attn
    modeling = sys.modules.get(type(attn).__module__)
    rope = getattr(modeling, "apply_rotary_pos_emb", None)
    try:
        calls = "apply_rotary_pos_emb(" in inspect.getsource(type(attn).forward)
    except (OSError, TypeError):
        calls = True  # no source to read (a frozen build): the tap says so at the first forward pass if not
    # (signature() reads through the wrapper of an attachment already there: it sets __wrapped__)
    if rope is None or "unsqueeze_dim" not in inspect.signature(rope).parameters or not calls:
        raise RingscopeError("RS_ERR_INVALID_ARGUMENT",
                             f"attach: layer {index}'s attention ({type(attn).__qualname__}) does not call an "
                             "apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim) of its module: its query and key "
                             "after RoPE cannot be captured")
    cfg = model.config
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = attn.head_dim
    if not getattr(attn, "is_causal", True):
        raise RingscopeError("RS_ERR_INVALID_ARGUMENT",
                             f"attach: layer {index}'s attention is bidirectional: attn sites capture causal "
                             "decoders only")
    if getattr(attn, "sinks", None) is not None:
        raise RingscopeError("RS_ERR_INVALID_ARGUMENT",
                             f"attach: layer {index}'s attention has sinks, which attn sites do not support yet")
    if hasattr(attn, "sliding_window"):
        window = attn.sliding_window  # per layer (Qwen2/3, Gemma2: None on full-attention layers)
    elif mt == "mistral":
        window = getattr(cfg, "sliding_window", None)  # Mistral: every layer, from the config
    else:
        window = None  # Llama: a `sliding_window` a checkpoint's config.json carries is not applied
    impl = str(getattr(cfg, "_attn_implementation", None) or "eager")
    softcap = getattr(attn, "attn_logit_softcapping", None)
    if softcap and not impl.startswith(("eager", "flex_attention", "flash_attention")):
        # SDPA (Gemma2's default) has no soft-cap: Hugging Face drops the model's `softcap` there.
        raise RingscopeError("RS_ERR_INVALID_ARGUMENT",
                             f"attach: layer {index} soft-caps its attention logits, which the attention "
                             f"implementation {impl!r} does not apply (transformers passes the cap only to eager, "
                             "flex and flash attention): load the model with attn_implementation=\"eager\" (or flex / "
                             "flash) to capture its attention sites, so that what is rebuilt is what ran")
    meta = layer_entry(cfg, index, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, scale=attn.scaling,
                       sliding_window=window, softcap=softcap, module=type(attn).__qualname__,
                       attn_implementation=impl)
    return attn, modeling, meta


def _hookpoint(session: Session, name: str, site: str, layer: Optional[int], dtype: str, width: int) -> int:
    """Registers hookpoint ``name``, or takes the one the session's configuration declared under that name (for
    ``[[probes]]``, which the session resolves against ``[[hookpoints]]`` when it starts) once its rows are checked
    to be the model's."""
    try:
        existing = session.hookpoint_id(name)
    except RingscopeError as e:
        if e.status != "RS_ERR_CAPTURE":  # RS_ERR_CAPTURE: no hookpoint of that name
            raise
        return session.register(name, site=site, layer=layer, dtype=dtype, row_width=width)
    info = session._hookpoint_info(existing)
    if info["dtype"] is not None and (info["dtype"], info["row_width"]) != (dtype, width):
        raise RingscopeError("RS_ERR_INVALID_ARGUMENT",
                             f"attach: hookpoint {name!r} is configured with {info['dtype']} rows of "
                             f"{info['row_width']} elements, but the model's are {dtype} rows of {width}: configure "
                             f"it with dtype = \"{dtype}\" and row_width = {width} (or leave it out: attach adds it)")
    session._row_bytes[existing] = (dtype, width)
    return existing


def _declare_hookpoints(config, planned, dtype: str) -> str:
    """``config`` (TOML text, bytes, a dict or None) as TOML text with a ``[[hookpoints]]`` entry for each planned
    capture it does not declare yet."""
    from .session import _config_text, _toml

    tomllib = _toml()
    text = _config_text(config).decode("utf-8")
    try:
        declared = {h.get("name") for h in tomllib.loads(text).get("hookpoints", []) if isinstance(h, dict)}
    except tomllib.TOMLDecodeError as e:
        raise RingscopeError("RS_ERR_CONFIG", f"invalid config: {e}") from None
    extra = []
    for name, site, layer, width, _module, _pick, *own_dtype in planned:
        if name in declared:
            continue
        hp_dtype = own_dtype[0] if own_dtype else dtype
        site_toml = f'"{site}"' if site in ("residual", "attention_output", "mlp_output", "logits") \
            else f'{{ custom = "{site}" }}'
        layer_toml = "" if layer is None else f"layer = {layer}\n"
        extra.append(f'[[hookpoints]]\nname = "{name}"\nsite = {site_toml}\n{layer_toml}dtype = "{hp_dtype}"\n'
                     f"row_width = {width}\n")
    return text + ("\n" if text and not text.endswith("\n") else "") + "\n".join(extra)


def _plan(model, sites: Iterable[str], layers: Optional[Iterable[int]]) -> "_Planned":
    """What :func:`attach` would capture of ``model`` (checked as attach checks it: the model, the sites, the layers,
    whether each layer's attention can be rebuilt), without touching the model or a session."""
    decoder_layers, final_norm, lm_head, family = _decoder(model)
    sites = list(sites)
    bad = [s for s in sites if s not in _SITES]
    if bad:
        raise RingscopeError("RS_ERR_INVALID_ARGUMENT", f"attach: unknown site(s) {bad}; use {list(_SITES)}")
    chosen = list(range(len(decoder_layers))) if layers is None else [
        _int(f"layers[{k}]", i, 0, _U32_MAX) for k, i in enumerate(layers)]
    for i in chosen:
        if not 0 <= i < len(decoder_layers):
            raise RingscopeError("RS_ERR_INVALID_ARGUMENT",
                                 f"attach: layer {i} does not exist (the model has {len(decoder_layers)})")
    dtype = next(model.parameters()).dtype
    if dtype not in _TORCH_DTYPES:
        raise RingscopeError("RS_ERR_INVALID_ARGUMENT", f"attach: parameters of dtype {dtype} are not supported")
    dt = _TORCH_DTYPES[dtype]
    hidden = model.config.hidden_size if hasattr(model.config, "hidden_size") else model.config.n_embd
    # What will be captured: (name, site, layer, row width, module, pick); module None: an _AttentionTap's.
    planned: List[Tuple[str, str, Optional[int], int, Any, Callable[[Any], Any]]] = []
    attention: List[Tuple[int, Any, Any, dict]] = []  # (layer, attention module, its modeling module, metadata)
    for i in chosen:
        layer = decoder_layers[i]
        if "residual" in sites:
            planned.append((f"layers.{i}.resid", "residual", i, hidden, layer, _first))
        if "attention_output" in sites:
            attn = layer.self_attn if family == "llama" else layer.attn
            planned.append((f"layers.{i}.attn_out", "attention_output", i, hidden, attn, _first))
        if "mlp_output" in sites:
            planned.append((f"layers.{i}.mlp_out", "mlp_output", i, hidden, layer.mlp, _first))
        if any(s in sites for s in _ATTN_SITES):
            attn, modeling, meta = _attention_module(model, layer, i, family)
            q_w, kv_w = meta["num_heads"] * meta["head_dim"], meta["num_kv_heads"] * meta["head_dim"]
            meta["hookpoints"] = {}
            # q and k: captured by the layer's _AttentionTap (module None here); v: v_proj's output as it is.
            for site, width, module in (("attn_q", q_w, None), ("attn_k", kv_w, None), ("attn_v", kv_w, attn.v_proj)):
                if site in sites:
                    planned.append((f"layers.{i}.{site}", site, i, width, module, _first))
                    meta["hookpoints"][site[-1]] = f"layers.{i}.{site}"
            attention.append((i, attn, modeling, meta))
    if "final_norm" in sites:
        planned.append(("final_norm", "final_norm", None, hidden, final_norm, _first))
    if "logits" in sites:
        if lm_head is None:
            raise RingscopeError("RS_ERR_INVALID_ARGUMENT", "attach: the model has no lm_head for the logits site")
        planned.append(("logits", "logits", None, lm_head.out_features, lm_head, _first))
    declared = list(planned) + ([(_TOKENS, _TOKENS, None, 1, None, None, "i64")] if _TOKENS in sites else [])
    return _Planned(decoder_layers, final_norm, lm_head, chosen, dt, planned, attention, declared, sites)


class _Planned:
    """:func:`_plan`'s result: the model's parts attach hooks, and what it captures."""

    def __init__(self, decoder_layers, final_norm, lm_head, chosen, dt, planned, attention, declared, sites):
        self.decoder_layers, self.final_norm, self.lm_head = decoder_layers, final_norm, lm_head
        self.chosen, self.dt, self.planned, self.attention, self.declared, self.sites = (
            chosen, dt, planned, attention, declared, sites)


def plan(model, *, sites: Iterable[str] = ("residual", "tokens"), layers: Optional[Iterable[int]] = None) -> dict:
    """What :func:`attach` with these ``sites`` and ``layers`` would capture of ``model``, and how many bytes that is per
    token — to see the rate before turning a site on (q/k/v rows are as large as the KV cache). Nothing is attached and
    no session is needed; the arguments are checked as ``attach`` checks them, and what it would refuse (an unknown
    site, a layer the model lacks, attention that cannot be rebuilt) raises the same error.

    Returns ``{"hookpoints": [...], "bytes_per_token": N, "ring_bytes_per_token": M}``: per hookpoint its ``name``,
    ``site``, ``layer`` (None for model-wide sites), ``dtype``, ``row_width`` and ``row_bytes``; ``bytes_per_token`` is
    the rows' bytes one captured token adds (what the files hold before compression), ``ring_bytes_per_token`` adds
    each row's request id and position (16 bytes a row) as the ring and the PCIe link carry them (plus, per hookpoint
    and step, a 64-byte header and up to 126 bytes of alignment: docs/format.md). ``logits`` count as one row per
    token, which they are in decode steps (a ``generate`` prefill captures only each row's last prompt token).
    Multiply by tokens per second for the rate the policy manager's budgets (``[policy]``) weigh. These are the rows
    as captured at full precision: rows downcast on capture (``Session.set_downcast``) take 1 byte an element plus 4,
    and a hookpoint switched off takes none."""
    p = _plan(model, sites, layers)
    hookpoints = []
    for name, site, layer, width, _module, _pick, *own_dtype in p.declared:  # as _declare_hookpoints reads them
        dtype = own_dtype[0] if own_dtype else p.dt
        hookpoints.append({"name": name, "site": site, "layer": layer, "dtype": dtype, "row_width": width,
                           "row_bytes": width * element_bytes(dtype)})
    total = sum(h["row_bytes"] for h in hookpoints)
    return {"hookpoints": hookpoints, "bytes_per_token": total,
            "ring_bytes_per_token": total + ROW_META_BYTES * len(hookpoints)}


def attach(model, session: "Session | str | dict | None" = None, *, sites: Iterable[str] = ("residual", "tokens"),
           layers: Optional[Iterable[int]] = None, rows: "str | Sequence[int]" = "all") -> Attachment:
    """Attaches ringscope to a Hugging Face decoder (Llama, Qwen2/3, Mistral, GPT-2 families).

    ``sites``: any of ``residual`` (the residual stream after each chosen layer: ``output_hidden_states[i + 1]`` for
    every layer but the last, whose entry in ``output_hidden_states`` is taken after the final norm),
    ``attention_output``, ``mlp_output`` (the blocks' outputs before they are added to the residual stream),
    ``final_norm`` (``output_hidden_states[-1]``), ``logits`` (what the model computed: at a ``generate`` prefill,
    each row's last token only), ``tokens`` (the input token id of every captured row, int64: joins rows to text).
    ``layers``: which decoder layers (default all).
    ``rows``: ``"all"``, ``"last_per_request"`` or a list of batch rows. ``session``: a :class:`Session`, or its
    configuration (TOML text or dict). Returns an :class:`Attachment`; every forward pass becomes one ringscope step.

    Rows that are no request's tokens are not captured in eager steps: padding (``attention_mask`` 0: a left-padded
    batch's pad tokens) and the rows of sequences that ended (fed their EOS token, or — fed the pad token — ended by
    a stopping criterion such as :class:`ProbeStoppingCriteria`); positions are the tokens' real positions (from
    ``attention_mask``). A step recorded as a CUDA graph (by hand or by ``torch.compile``'s ``reduce-overhead``)
    has a fixed shape and runs no Python at replay: its decode rows fed an EOS or pad token are captured with the
    request id of no request — :data:`NO_REQUEST`, ``2**64 - 1`` in the files, ``-1`` in int64 tensors — and
    probes never score them into a request, flag or alert for them (``probe_stats()["no_request_rows"]`` counts
    them). Compiled steps run without CUDA graphs leave them out, as eager steps do.
    """
    for prev in list(_ATTACHMENTS.values()):
        if prev.model is model and prev._handles:
            if prev.session.totals is None:
                raise RingscopeError("RS_ERR_INVALID_ARGUMENT",
                                     "attach: the model is attached already to an open session (detach() that "
                                     "attachment first)")
            prev.detach()  # its session is closed: its hooks could only fail
    p = _plan(model, sites, layers)
    decoder_layers, final_norm, lm_head = p.decoder_layers, p.final_norm, p.lm_head
    chosen, dt, planned, attention, declared, sites = p.chosen, p.dt, p.planned, p.attention, p.declared, p.sites
    if not isinstance(session, Session):
        # A configuration: its hookpoints are declared before the session starts, so that its [[probes]] can read
        # them (probes bind to configured hookpoints when the session starts).
        session = Session(_declare_hookpoints(session, declared, dt))
    att = Attachment(session, model)
    try:
        param_device = next(model.parameters()).device
        att._request_id_tensor(param_device, 1)
        att._rows_setting = rows
        if _TOKENS in sites:
            att._tokens_hp = att._traced.tokens_hp = att.hookpoints[_TOKENS] = _hookpoint(session, _TOKENS, _TOKENS,
                                                                                          None, "i64", 1)
            att._widths[att._tokens_hp] = 1

        for name, site, layer_index, width, module, pick in planned:
            att.hookpoints[name] = _hookpoint(session, name, site, layer_index, dt, width)
            att._widths[att.hookpoints[name]] = width
            if rows != "all":
                session.set_rows(att.hookpoints[name], rows)
            if module is not None:
                att._handles.append(module.register_forward_hook(att._hook(name, width, pick)))
        for i, attn, modeling, meta in attention:
            q, k = (f"layers.{i}.attn_q", f"layers.{i}.attn_k")
            if q in att.hookpoints or k in att.hookpoints:
                _AttentionTap(att, attn, _RotaryPatch.of(modeling), i, meta["num_heads"], meta["num_kv_heads"],
                              meta["head_dim"],
                              (att.hookpoints[q], att._widths[att.hookpoints[q]]) if q in att.hookpoints else None,
                              (att.hookpoints[k], att._widths[att.hookpoints[k]]) if k in att.hookpoints else None)
        if attention:
            # What rebuilding the layers' attention patterns from the rows needs (ringscope.attention_pattern); a second
            # attach on the session adds its layers (a layer attached again: its latest entry).
            layers_meta = dict(getattr(session, "_attention_layers", {}))
            layers_meta.update({meta["layer"]: meta for *_, meta in attention})
            session.set_metadata("attention", {"format": 1, "source": "transformers",
                                               "model_type": model.config.model_type,
                                               "layers": [layers_meta[i] for i in sorted(layers_meta)]})
            setattr(session, "_attention_layers", layers_meta)
        # After the last captured module, the step's deferred captures can be copied while the rest of the forward pass
        # runs (a side stream; joined when the step ends). A no-op without deferred captures.
        last = lm_head if "logits" in sites else final_norm if "final_norm" in sites else decoder_layers[max(chosen)] \
            if chosen else None
        if last is not None:
            # Compiled, the step ends inside the graph right after the last capture, on the engine's stream: no side
            # stream is forked (inductor may split the graph into several CUDA graphs around the custom ops, and a fork
            # left open at the end of one would be unjoined work in its recording).
            # Traced, these hooks reach the attachment's traced state by its key only (see _Traced); eagerly the
            # attachment.
            key = att._key

            def submit_hook(module, args, output):
                if torch.compiler.is_compiling():
                    _TRACED[key].end(module, _first(output).device)
                elif att._open:
                    _submit_captures_raw(_u64("session", session._h))

            def begin_hook(module, args, kwargs):
                if torch.compiler.is_compiling():
                    _TRACED[key].begin(module, args, kwargs)

            def tokens_hook(module, args, kwargs):
                if torch.compiler.is_compiling():
                    _TRACED[key].note_tokens(module, args, kwargs)
            # The step op's sink: a (non-persistent) buffer of the module whose hook ends the step (see _Traced.end).
            last_param = next(last.parameters(), None)
            last.register_buffer("_ringscope_sink", torch.zeros(1, dtype=torch.uint8, device=param_device
                                 if last_param is None else last_param.device), persistent=False)
            att._sink_module = last
            att._handles.append(last.register_forward_hook(submit_hook))
            att._handles.append(decoder_layers[0].register_forward_pre_hook(begin_hook, with_kwargs=True))
            embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
            if att._tokens_hp is not None and embed is not None:
                att._handles.append(embed.register_forward_pre_hook(tokens_hook, with_kwargs=True))
        att._handles.append(_StepAround(att, model))
        att._distinguish()
        st = session.stats_all() if _has_call("rs_session_stats") else {}
        if st.get("mode") == "full" and st.get("backend") == "cuda":
            att._admit_compiled_steps()
    except BaseException:
        att.detach()  # nothing half-installed stays on the model (hooks, the RoPE wrapper, the sink buffer)
        raise
    return att


def _replays_cuda_graphs(config) -> bool:
    """Whether a transformers ``CompileConfig`` compiles a step that replays CUDA graphs: the ``cudagraphs`` backend,
    or inductor with the mode ``reduce-overhead`` or ``max-autotune``, the option ``triton.cudagraphs``, or (no mode,
    no such option) inductor's global ``triton.cudagraphs`` setting. Other backends ignore the mode."""
    backend = getattr(config, "backend", "inductor")
    if backend == "cudagraphs":
        return True
    if backend != "inductor":
        return False
    mode, options = getattr(config, "mode", None), getattr(config, "options", None) or {}
    if mode in ("reduce-overhead", "max-autotune"):
        return True
    if "triton.cudagraphs" in options:
        return bool(options["triton.cudagraphs"])
    if mode not in (None, "default"):
        return False  # max-autotune-no-cudagraphs
    return bool(importlib.import_module("torch._inductor.config").triton.cudagraphs)


_ON_TIMEOUT = ("raise", "stop", "continue")


def _probe_stopping_criteria_class():
    """Builds :class:`ProbeStoppingCriteria` on first use, so that ``import ringscope.torch`` does not import
    transformers."""
    from transformers import StoppingCriteria

    class ProbeStoppingCriteria(StoppingCriteria):
        """A Hugging Face ``StoppingCriteria`` that ends the rows of ``generate`` whose requests a probe with
        ``action = "stop"`` has flagged. After every step it waits (up to ``timeout`` seconds) for the probes to
        score the step's rows (:meth:`Session.wait_probes`), then reads the stop flag of each row's request — row
        ``b`` is request ``attachment.current_request_ids(batch)[b]``, exactly as :func:`attach` names the rows it
        captures. A flagged row is finished (``generate`` pads it from then on, and the attachment captures it no
        more) while the others go on. ``on_timeout`` says what a step whose rows were not all scored in time does: ``"raise"`` (default:
        ``RS_ERR_TIMEOUT``), ``"stop"`` (fail closed: end every row) or ``"continue"`` (act on the flags raised so
        far). ``stopped`` maps each request it ended to the ringscope step after which it did (the step numbers of the
        alerts: the attachment's steps, 0 being the first prefill).

        One row per request: with ``num_beams`` or ``num_return_sequences`` above 1 give every row its own request
        id (``attachment.request_ids``). The probes' wait does not wait for file sinks to commit what they hold."""

        def __init__(self, attachment: Attachment, timeout: float = 10.0, on_timeout: str = "raise"):
            if not isinstance(attachment, Attachment):
                raise RingscopeError("RS_ERR_INVALID_ARGUMENT",
                                     f"ProbeStoppingCriteria needs the Attachment that attach() returned, got "
                                     f"{type(attachment).__name__}")
            _timeout_ms("timeout", timeout)
            if on_timeout not in _ON_TIMEOUT:
                raise RingscopeError("RS_ERR_INVALID_ARGUMENT",
                                     f"on_timeout must be one of {list(_ON_TIMEOUT)}, got {on_timeout!r}")
            if not attachment.session.probe_stats():
                raise RingscopeError("RS_ERR_CONFIG",
                                     "ProbeStoppingCriteria: the session has no probes: configure [[probes]] with "
                                     "action = \"stop\" on the hookpoints attach() captures")
            self.attachment = attachment
            self.timeout = timeout
            self.on_timeout = on_timeout
            self.stopped: Dict[int, int] = {}

        def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
            att, session = self.attachment, self.attachment.session
            batch = input_ids.shape[0]
            ids = att.current_request_ids(batch)
            if len(ids) != batch:
                raise RingscopeError("RS_ERR_INVALID_ARGUMENT",
                                     f"ProbeStoppingCriteria: {len(ids)} request ids for a batch of {batch} rows "
                                     "(beam search or several sequences per prompt: one request id per row)")
            step = att.step - 1  # the forward pass that just ended was this ringscope step
            try:
                session.wait_probes(self.timeout)
            except RingscopeError as e:
                if e.status != "RS_ERR_TIMEOUT" or self.on_timeout == "raise":
                    raise
                if self.on_timeout == "stop":
                    for r in ids:
                        self.stopped.setdefault(int(r), step)
                    return torch.ones(batch, dtype=torch.bool, device=input_ids.device)
            done = [session.is_flagged(r) for r in ids]
            for r, d in zip(ids, done):
                if d:
                    self.stopped.setdefault(int(r), step)
            # `generate` ends these rows: the attachment leaves them out of the steps that follow.
            att._mark_finished(done)
            return torch.tensor(done, dtype=torch.bool, device=input_ids.device)

    return ProbeStoppingCriteria


_LAZY: Dict[str, type] = {}


def __getattr__(name):
    if name == "ProbeStoppingCriteria":
        if name not in _LAZY:
            _LAZY[name] = _probe_stopping_criteria_class()
        return _LAZY[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class ActivationDataset(torch.utils.data.IterableDataset):
    """A dump as a stream of training batches: ``torch`` tensors of ``batch_size`` rows of one hookpoint, read file
    by file (Arrow IPC where the run has it, else Parquet), optionally shuffled within a buffer of ``shuffle_buffer``
    rows; bf16 stays ``torch.bfloat16``. Use it with ``DataLoader(ds, batch_size=None, num_workers=N)``: each worker
    reads its own share of every file (every N-th record batch or row group), so that even a run of one large file
    is split between the workers; together they yield every row once. Each item is a dict: ``activation`` (rows,
    row_width), ``hookpoint``, and with ``with_meta`` the ``step``, ``request_id`` and ``position`` of every row
    (int64 tensors: a step or request id above 2**63-1 is a :class:`RingscopeError`, not wrapped). Arguments as
    :func:`ringscope.stream.iter_batches`; they are checked here, not in the workers."""

    def __init__(self, path, hookpoints=None, batch_size: int = 4096, shuffle_buffer: int = 0, seed: int = 0,
                 format: str = "auto", drop_last: bool = False, with_meta: bool = False, verify: bool = True):
        from . import stream

        self._args = dict(path=path, hookpoints=hookpoints, batch_size=batch_size, shuffle_buffer=shuffle_buffer,
                          seed=seed, format=format, drop_last=drop_last, with_meta=with_meta,
                          verify=verify)
        # Check everything (and that the run has files) now: an error in a worker process is harder to read.
        next(iter(stream.iter_batches(**{**self._args, "batch_size": 1, "shuffle_buffer": 0})), None)

    def __iter__(self):
        from . import stream

        info = torch.utils.data.get_worker_info()
        shard = (info.id, info.num_workers) if info is not None else (0, 1)
        seed = self._args["seed"] + (info.id if info is not None else 0)
        for b in stream.iter_batches(**{**self._args, "seed": seed}, shard=shard):
            rows = b["activation"]
            # Rows straight from a file's read buffer are read-only: such a tensor gets a copy of its own.
            act = torch.from_numpy(rows if rows.flags.writeable else rows.copy())
            if b["dtype"] == "bf16":
                act = act.view(torch.bfloat16)
            item = {"hookpoint": b["hookpoint"], "activation": act}
            for c in stream.META_COLUMNS:
                if c in b:
                    item[c] = torch.from_numpy(stream._int64(c, b[c]))
            yield item
