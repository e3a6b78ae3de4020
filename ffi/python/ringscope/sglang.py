"""ringscope as an SGLang plugin: captures decoder-layer activations of a serving SGLang engine into a ringscope
session, and makes its prefix cache (RadixAttention) visible in the dataset and the probes' coverage.

Enable it by pointing ``RINGSCOPE_SGLANG_CONFIG`` at a ringscope TOML file (the same configuration as every other
path: ``[ring]``, ``[policy]``, ``[export]``, ``[[hookpoints]]``, ``[[probes]]`` ...) that may hold an ``[sglang]``
table::

    [export]
    parquet = true
    dir = "ringscope-out"

    [sglang]
    sites = ["residual"]          # residual | attention_output | mlp_output | attn_q | attn_k | attn_v
    layers = "all"                # or a list of decoder layer indices
    requests = "all"              # or "opt_in": only requests with sampling_params
                                  #   {"custom_params": {"ringscope": True}}

The plugin is an ``sglang.srt.plugins`` entry point (``ringscope = "ringscope.sglang:register"``), which SGLang calls
with no arguments in every process it starts. Without ``RINGSCOPE_SGLANG_CONFIG`` it does nothing (SGLang runs
unchanged, no ringscope session); ``RINGSCOPE_SGLANG_DISABLE=1`` turns it off even when configured.

How it hooks SGLang (0.5.23 and 0.5.17; the model lives in the scheduler process): :func:`register` wraps

- ``ModelRunner.load_model``: once the model is loaded (before any graph is captured or compiled), the plugin checks
  the model and the capture set — an unsupported architecture, tensor parallelism, a layer that does not exist or a
  bad ``[sglang]`` table fail the engine's start with an error naming what is supported —, opens the ringscope session
  and adds hooks to the chosen decoder layers;
- ``ModelRunner.forward``: before each forward pass, the request id of every token row (``ForwardBatch.rids`` and
  the rows each request has in the pass: its new prompt tokens at an extend, one at a decode), written into a buffer
  the capture ops read; rows of requests that did not opt in are ``-1`` (never exported). A request's first extend
  that starts past position 0 starts after its prefix-cache hit: those tokens are computed by no forward pass, so the
  plugin records them (:meth:`ringscope.Session.note_cached`: a ``cached`` row in the run's events table,
  ``coverage["cached"]`` of every probe's report on the request, the counters ``cached_requests`` / ``cached_rows``);
- ``ForwardBatch.init_new``: keeps the batch's requests next to it, for their ``custom_params`` (opt-in, ids);
- ``Scheduler.ringscope_close`` (added) and ``Engine.shutdown``: SGLang ends its scheduler process with SIGKILL, so
  the plugin closes the session first (``Engine.shutdown`` calls ``collective_rpc("ringscope_close")``): its files
  and manifest are complete when ``shutdown()`` returns;
- stopping, however it happens: a SIGINT or SIGTERM that reaches the scheduler process itself (Ctrl-C reaches every
  process of the group; a service manager may signal them all) closes the session first — at once when the
  scheduler is idle or inside SGLang's own code, after the running forward pass when it is inside one — and is then
  delivered again to do what it did before (``_engine.guard_stop_signals``). In the server's process
  (``python -m sglang.launch_server``), the end of the HTTP server however it ends (SIGINT to its process alone
  stops it gracefully, then SGLang kills the process tree with SIGKILL) and SGLang's SIGQUIT handler (a child
  process died: it kills the process tree too) first have the scheduler close the session, through its RPC address,
  waiting until it answers or every scheduler has exited (at most 60 s; never blocking on a scheduler that is gone).
  On SIGTERM to the server SGLang's schedulers exit on their own and close the session at exit.

The hooks call the same custom ops as the vLLM plugin (``ringscope_engine::begin``, ``::capture``, ``::end``); the
residual stream after layer ``i`` (``layers.{i}.resid``, HF's ``output_hidden_states[i + 1]``) is, with 0.5.23, SGLang's
residual stream snapshot after the layer (the layer returns only its contribution; SGLang keeps the running residual
in the forward batch), with 0.5.17 the sum of the two tensors the layer returns (its MLP's output and the stream
before it). Hookpoints are named as :func:`ringscope.torch.attach` names them.

Request ids: SGLang's are strings. A request's id is ``custom_params["ringscope"]["request_id"]`` when given
(0..2**63-1), else a 63-bit hash of its SGLang ``rid`` (:func:`request_id_of`; ``meta_info["id"]`` of its output).
Every captured request is written once to ``<run dir>/_ringscope_sglang/requests.jsonl`` (``{"request_id",
"sglang_rid", "explicit", "first_step"}``; a request a probe stopped once more with ``stopped_after_step``), and at
close a summary with the plugin's counters to ``summary.json`` there and, with probes, every probe's last report on
every captured request to ``probe_reports.jsonl`` (scores, alerts, coverage with its ``cached`` rows).

Probes with ``action = "stop"``: after each forward pass the plugin waits (up to 10 s) for the probes to score its
rows, and a request whose stop flag is up is finished there (SGLang keeps the token just generated; the output's
``finish_reason`` is ``{"type": "stop", "ringscope": {"request_id", "step"}}``). A request recomputed after SGLang retracted it (KV cache full) keeps its id: its recomputed rows appear again.

Errors while serving never take the engine down: the plugin logs the error, disables capture for the rest of the
run and counts the steps and rows it did not capture from then on (``lost_steps``, ``lost_rows``: rows of those forward
passes × hookpoints). Forward passes of other modes (speculative decoding's verify passes, split prefills) capture
nothing and are counted (``skipped_steps``); a draft model's runner captures nothing.

Verified with SGLang 0.5.23 on CPU (eager; with and without its overlap scheduler) and 0.5.17 (both schedulers; with
0.5.17's overlap scheduler a request that has just finished may get one more forward pass, over its last token: its
rows are captured like every computed token's). With ``enable_torch_compile``, or
with tensor or pipeline parallelism the plugin refuses to load, naming why. On a CUDA device it refuses too, unless
``RINGSCOPE_SGLANG_EXPERIMENTAL_CUDA=1``: the CUDA path — the same capture ops, recorded into SGLang's CUDA graphs
(decode and breakable prefill graphs) with each step begun on the device from a request-id buffer at a fixed address
(updated before every forward pass with the pass's number of rows and the rows it keeps: a graph's padding rows
and the rows of requests not captured are neither captured nor scored on the device; speculative decoding and
diffusion models are refused there), the CUDA ring in best-effort mode, captures deferred to one copy kernel per forward pass when every
site allows it (the residual, q/k/v) — has run end to end on an H100 with SGLang 0.5.17 and its CUDA kernel package
(tests/sglang/run_cuda.sh: rows within 5e-3 of a Hugging Face reference, ids and positions exact, both schedulers;
benches/sglang_gpu.py: the residual of all 16 layers of a 1B bf16 model +4.2–4.6% per decode step). On CUDA the session must close only once the engine stops
replaying its graphs (``Engine.shutdown`` does that with no requests in flight): the recorded kernels write into the
session's device memory. With SGLang's overlap scheduler
(its default) the next batch may be scheduled before a stop flag is read: a stopped request can get one more token.
"""

import atexit
import json
import logging
import os
import time
from typing import Any, Dict, List

from .errors import RingscopeError
from . import _engine
from ._engine import EngineCapture, PluginConfig, first as _first, request_id_of, truthy as _truthy

__all__ = ["register", "close_all", "captures", "request_id_of", "SUPPORTED_ARCHITECTURES", "SUPPORTED_SGLANG",
           "ENV_CONFIG", "ENV_DISABLE"]

logger = logging.getLogger("ringscope.sglang")

ENV_CONFIG = "RINGSCOPE_SGLANG_CONFIG"
ENV_DISABLE = "RINGSCOPE_SGLANG_DISABLE"
#: Opt-in for the CUDA path (capture ops recorded into SGLang's CUDA graphs), verified on an H100 with SGLang 0.5.17 but
#: not yet measured for cost: without it a model on a CUDA device is refused.
ENV_CUDA = "RINGSCOPE_SGLANG_EXPERIMENTAL_CUDA"
#: SGLang versions the plugin's hooks were written and tested against (its internals move between releases).
SUPPORTED_SGLANG = ("0.5.17", "0.5.23")
#: Model classes whose decoder layers are ``layer(positions, hidden_states, forward_batch)`` with ``self_attn`` and
#: ``mlp`` submodules and a plain residual stream (tested: Llama).
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM",)
SIDE_DIR = "_ringscope_sglang"

_PLUGIN = _engine.Plugin("sglang", "SGLang", ENV_CONFIG, ENV_DISABLE, logger)
_LIVE: List["SglangCapture"] = _PLUGIN.live  # strong references until close_all (atexit) or ringscope_close


def enabled() -> bool:
    """Whether the plugin is configured (``RINGSCOPE_SGLANG_CONFIG``) and not switched off
    (``RINGSCOPE_SGLANG_DISABLE``)."""
    return _PLUGIN.enabled()


def load_config(path: "str | os.PathLike") -> PluginConfig:
    """Reads and checks a plugin configuration file (a ringscope TOML file with an optional ``[sglang]`` table)."""
    return _PLUGIN.load_config(path)


def parse_config(cfg: dict, source: str = "<dict>", base=None) -> PluginConfig:
    return _PLUGIN.parse_config(cfg, source, base)


# -- registration --------------------------------------------------------------------------------------------------

def _check_installed_version() -> None:
    import sglang

    version = getattr(sglang, "__version__", "?")
    if version not in SUPPORTED_SGLANG:
        raise RingscopeError("RS_ERR_CONFIG",
                             f"ringscope.sglang supports SGLang {', '.join(SUPPORTED_SGLANG)}; this is SGLang "
                             f"{version} (unset {ENV_CONFIG} to run without ringscope)")


def register() -> None:
    """The ``sglang.srt.plugins`` entry point. Idempotent; does nothing unless :func:`enabled`. Checks the SGLang
    version and the configuration file (a bad one fails the engine's start, with the file named) and wraps what the
    module docs list."""
    _PLUGIN.register(_check_installed_version, _patch)


def check_device(device) -> None:
    """CPU; or CUDA with :data:`ENV_CUDA` set (the experimental CUDA path). Anything else is a clear error."""
    if device.type == "cuda":
        if not _truthy(ENV_CUDA):
            raise RingscopeError("RS_ERR_CONFIG",
                                 f"ringscope.sglang: the model is on {device}: the plugin's CUDA path (its capture ops "
                                 "recorded into SGLang's CUDA graphs) is experimental — its rows were verified on an "
                                 "H100 with SGLang 0.5.17, its cost is not measured yet; set "
                                 f"{ENV_CUDA}=1 to use it, or unset {ENV_CONFIG} to serve without ringscope")
        return
    _engine.check_cpu(device, "ringscope.sglang", "SGLang", ENV_CONFIG)


def _wrapped(fn, wrapper):
    wrapper._ringscope = True
    wrapper.__wrapped__ = fn
    wrapper.__name__ = getattr(fn, "__name__", "wrapped")
    return wrapper


def _patch() -> None:
    from sglang.srt.entrypoints.engine import Engine
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch
    from sglang.srt.model_executor.model_runner import ModelRunner

    load_model = ModelRunner.__dict__["load_model"]
    if not getattr(load_model, "_ringscope", False):
        def wrapped_load_model(self, *args, **kwargs):
            out = load_model(self, *args, **kwargs)
            if getattr(self, "is_draft_worker", False):
                # Speculative decoding's draft model: its passes are not the served model's; nothing is captured.
                self._ringscope = None
            elif enabled() and getattr(self, "_ringscope", None) is None:
                # Errors here (bad capture set, unsupported model) fail the engine's start, as they should.
                self._ringscope = SglangCapture.install(self, load_config(os.environ[ENV_CONFIG]))
                # SIGINT / SIGTERM to the scheduler (Ctrl-C reaches every process of the group): the session is
                # closed first, wherever the signal lands.
                _engine.guard_stop_signals(close_all, logger)
            return out
        ModelRunner.load_model = _wrapped(load_model, wrapped_load_model)

    forward = ModelRunner.__dict__["forward"]
    if not getattr(forward, "_ringscope", False):
        def wrapped_forward(self, forward_batch, *args, **kwargs):
            cap = getattr(self, "_ringscope", None)
            if not cap:
                return forward(self, forward_batch, *args, **kwargs)
            with _engine.critical():  # a stop signal closes the session after the pass, not inside it
                if not cap._prepare(forward_batch):
                    return forward(self, forward_batch, *args, **kwargs)
                try:
                    return forward(self, forward_batch, *args, **kwargs)
                finally:
                    cap._finish()
        ModelRunner.forward = _wrapped(forward, wrapped_forward)

    init_new = ForwardBatch.__dict__["init_new"].__func__
    if not getattr(init_new, "_ringscope", False):
        def wrapped_init_new(cls, batch, model_runner, *args, **kwargs):
            fb = init_new(cls, batch, model_runner, *args, **kwargs)
            if getattr(model_runner, "_ringscope", None):
                # The requests of the batch, for their custom_params (the forward batch keeps only their ids).
                fb._ringscope_reqs = getattr(batch, "reqs", None)
            return fb
        ForwardBatch.init_new = classmethod(_wrapped(init_new, wrapped_init_new))

    if not hasattr(Scheduler, "ringscope_close"):
        def ringscope_close(self):
            """RPC target (``Engine.collective_rpc("ringscope_close")``): closes this scheduler's captures."""
            close_all()
        Scheduler.ringscope_close = ringscope_close

    shutdown = Engine.__dict__["shutdown"]
    if not getattr(shutdown, "_ringscope", False):
        def wrapped_shutdown(self, *args, **kwargs):
            # The scheduler process is killed (SIGKILL) by shutdown: close the sessions there first.
            if enabled() and not getattr(self, "_ringscope_closed", False) and \
                    getattr(self, "send_to_rpc", None) is not None:
                self._ringscope_closed = True
                try:
                    _close_remote(self)
                except Exception:
                    logger.exception("ringscope: closing the scheduler's session before shutdown failed")
            return shutdown(self, *args, **kwargs)
        Engine.shutdown = _wrapped(shutdown, wrapped_shutdown)

    # `python -m sglang.launch_server` / `sglang serve`. When the HTTP server ends — SIGINT to the server (uvicorn stops
    # gracefully, then returns or raises KeyboardInterrupt), Ctrl-C to the group, an exception, SIGTERM (SGLang drains
    # and asks its schedulers to exit) — the next thing SGLang does is kill the process tree (SIGKILL): close the
    # scheduler's session first, through the RPC address an Engine would use (a scheduler that exited on its own has
    # closed it at exit). Only in a main process (SGLang's own processes are its children), and only where SGLang's
    # HTTP server can be imported.
    import multiprocessing

    http_server = None
    if multiprocessing.parent_process() is None:
        try:
            # An optional import over the None above (mypy sees a redefinition).
            from sglang.srt.entrypoints import http_server  # type: ignore[no-redef]
        except ImportError as e:
            logger.debug("ringscope: no SGLang HTTP server here (%s)", e)
    run = http_server.__dict__.get("_setup_and_run_http_server") if http_server is not None else None
    if run is not None and not getattr(run, "_ringscope", False):
        def wrapped_run(server_args, tokenizer_manager, template_manager, port_args, *args, **kwargs):
            _server["port_args"] = port_args
            try:
                return run(server_args, tokenizer_manager, template_manager, port_args, *args, **kwargs)
            finally:
                # However the HTTP server ended — an exception, or a graceful stop on SIGINT that returns normally —
                # SGLang kills the process tree next.
                if enabled():
                    try:
                        _close_server(port_args)
                    except Exception:
                        logger.exception("ringscope: closing the scheduler's session as the server stopped failed; "
                                         "the run's last files and manifest may be missing")
        http_server._setup_and_run_http_server = _wrapped(run, wrapped_run)

    # A child process that dies (the detokenizer on Ctrl-C, a scheduler) makes the server kill the whole process tree
    # with SIGKILL from its SIGQUIT handler: the scheduler may be closing its session right then. Let it finish.
    if run is not None:
        from sglang.srt.managers.tokenizer_manager import SignalHandler

        sigquit = SignalHandler.__dict__.get("running_phase_sigquit_handler")
        if sigquit is not None and not getattr(sigquit, "_ringscope", False):
            def wrapped_sigquit(self, *args, **kwargs):
                if enabled() and _server.get("port_args") is not None:
                    try:
                        _close_server(_server["port_args"])
                    except Exception:
                        logger.exception("ringscope: closing the scheduler's session before the server's shutdown "
                                         "failed; the run's last files and manifest may be missing")
                return sigquit(self, *args, **kwargs)
            SignalHandler.running_phase_sigquit_handler = _wrapped(sigquit, wrapped_sigquit)


#: The HTTP server's port arguments (its scheduler's RPC address), in a ``launch_server`` process.
_server: dict = {}


#: How long ``Engine.shutdown`` waits for the scheduler to close the session (it may have died already).
CLOSE_TIMEOUT_S = 60.0


def _close_remote(engine) -> None:
    """``collective_rpc("ringscope_close")`` with a bounded wait: SGLang's own waits forever, and a scheduler that
    has died never answers."""
    _ask_to_close(engine.send_to_rpc)


def _close_server(port_args) -> None:
    """For a server started by ``sglang.launch_server`` (no Engine): asks the scheduler to close its sessions, through
    a socket of our own at its RPC address."""
    import zmq
    from sglang.srt.utils.network import get_zmq_socket

    if _server.get("closed"):
        return
    ctx = zmq.Context(1)
    sock = get_zmq_socket(ctx, zmq.DEALER, port_args.rpc_ipc_name, True)
    try:
        if _ask_to_close(sock):
            _server["closed"] = True
    finally:
        sock.close(linger=0)
        ctx.term()


def _ask_to_close(sock) -> bool:
    """Asks the scheduler at the other end of ``sock`` to close its sessions; waits until it answers, or every
    scheduler process (a child of this one) has exited — a scheduler stopped by a signal closes its sessions itself
    before it exits —, or ``CLOSE_TIMEOUT_S``. Returns whether the sessions are closed."""
    import psutil
    import zmq
    from sglang.srt.entrypoints import engine as engine_mod
    from sglang.srt.managers.io_struct import RpcReqInput
    from sglang.srt.utils.cudacore_pyspy_dump_utils import collect_scheduler_processes

    deadline = time.monotonic() + CLOSE_TIMEOUT_S
    sent = False
    while time.monotonic() < deadline:
        if not sent:
            # Never a blocking send: with no scheduler at the other end (it has exited) a DEALER socket's send
            # blocks forever.
            try:
                engine_mod.sock_send(sock, RpcReqInput(method="ringscope_close", parameters=None), flags=zmq.NOBLOCK)
                sent = True
            except zmq.Again:
                time.sleep(0.1)
        if sent and sock.poll(100, zmq.POLLIN):
            reply = engine_mod.sock_recv(sock)
            if getattr(reply, "success", False):
                logger.info("ringscope: the scheduler closed its session before the shutdown")
                return True
            logger.error("ringscope: closing the scheduler's session failed: %s", getattr(reply, "message", reply))
            return False
        alive = []
        for c in collect_scheduler_processes():
            try:
                if c.status() != psutil.STATUS_ZOMBIE:
                    alive.append(c)
            except psutil.NoSuchProcess:
                pass
        if not alive:
            return True  # the schedulers have exited (closing their sessions first: at exit, or on the signal)
    logger.error("ringscope: the scheduler did not close its session within %.0f s (has it died?); its last files and "
                 "manifest may be missing", CLOSE_TIMEOUT_S)
    return False


# -- the capture ---------------------------------------------------------------------------------------------------

#: SGLang versions whose decoder layers return ``(their MLP's output, the residual stream before it)``; the others
#: (0.5.23) return their contribution and keep the running residual themselves.
PAIR_RESIDUAL_SGLANG = ("0.5.17",)


def _residual_pick():
    """``pick(output, args, kwargs)`` of a decoder layer's forward hook: the residual stream after the layer, as each
    supported SGLang version gives it. 0.5.23: the layer returns its contribution and SGLang keeps the running residual
    (a snapshot of it from the forward batch); 0.5.17 (:data:`PAIR_RESIDUAL_SGLANG`): the layer returns ``(its MLP's
    output, the residual stream before that MLP)``, whose sum is the stream after it (computed here: SGLang adds them
    only in the next layer's norm)."""
    import sglang

    version = str(getattr(sglang, "__version__", ""))
    if version in PAIR_RESIDUAL_SGLANG:
        def summed(output, args, kwargs):
            if not isinstance(output, tuple) or len(output) != 2 or output[1] is None:
                raise RingscopeError("RS_ERR_STATE",
                                     f"ringscope.sglang: a decoder layer returned {type(output).__name__}, not "
                                     f"(hidden_states, residual) as SGLang {version}'s layers do")
            return output[0] + output[1]
        return summed

    from sglang.srt.layers.layer_boundary.residual import batch as residual_batch

    def snapshot(output, args, kwargs):
        fb = kwargs.get("forward_batch", args[2] if len(args) > 2 else None)
        return residual_batch.snapshot(output, fb)
    return snapshot


def _default_run_id() -> str:
    return time.strftime("sglang-%Y%m%dT%H%M%SZ", time.gmtime()) + f"-{os.getpid()}"



def _attention_entry(model, layer, index: int) -> dict:
    """The attention metadata of decoder layer ``index`` as SGLang runs it (see :func:`ringscope.attention_metadata`),
    or a RingscopeError naming why its attention cannot be captured for an exact rebuild: SGLang's ``RadixAttention``
    of a causal decoder with keys and values of one head size. SGLang's window counts the keys before the query
    (``sliding_window_size = W - 1``); the metadata says keys seen, itself included (W)."""
    self_attn = getattr(layer, "self_attn", None)
    attn: Any = getattr(self_attn, "attn", None)
    why = None
    if attn is None or type(attn).__name__ != "RadixAttention":
        why = f"uses {type(attn).__name__}, not SGLang's RadixAttention"
    elif getattr(attn, "is_cross_attention", False):
        why = "is cross-attention"
    elif str(getattr(getattr(attn, "attn_type", None), "value", getattr(attn, "attn_type", "decoder"))).lower() \
            != "decoder":
        why = f"is {attn.attn_type} attention, not a causal decoder's"
    elif getattr(attn, "v_head_dim", attn.head_dim) not in (attn.head_dim, -1):
        why = "has values of another head size than its keys"
    elif getattr(attn, "use_irope", False):
        why = "uses chunked local attention (iRoPE)"
    if why is not None:
        raise RingscopeError("RS_ERR_CONFIG",
                             f"ringscope.sglang: sites {', '.join(_engine.ATTN_SITES)}: layer {index} of "
                             f"{type(model).__name__} {why}, which the attention sites do not capture")
    from .attention import layer_entry

    window = int(getattr(attn, "sliding_window_size", -1) or -1)  # SGLang keeps W - 1 (-1: none)
    return layer_entry(model.config, index, num_heads=attn.tp_q_head_num, num_kv_heads=attn.tp_k_head_num,
                       head_dim=attn.head_dim, scale=attn.scaling,
                       sliding_window=window + 1 if window >= 0 else None, softcap=getattr(attn, "logit_cap", 0),
                       module=f"{type(self_attn).__name__}.attn (RadixAttention)")


class SglangCapture(EngineCapture):
    """What the plugin installed into one SGLang model runner: the session, the hookpoints, the hooks, the
    counters."""

    COUNTERS = EngineCapture.COUNTERS + ("skipped_steps", "stopped_requests", "probe_wait_timeouts")
    #: How long a step waits for the probes to score its rows before it looks at their stop flags.
    PROBE_WAIT_S = 10.0

    @classmethod
    def install(cls, runner, pc: PluginConfig) -> "SglangCapture":
        model = runner.model
        arch = type(model).__name__
        if arch not in SUPPORTED_ARCHITECTURES:
            raise RingscopeError("RS_ERR_CONFIG",
                                 f"ringscope.sglang: model class {arch} is not supported (supported: "
                                 f"{', '.join(SUPPORTED_ARCHITECTURES)}); unset {ENV_CONFIG} to serve it without "
                                 "ringscope")
        sa = getattr(runner, "server_args", None)
        tp = int(getattr(sa, "tp_size", 1) or 1)
        pp = int(getattr(sa, "pp_size", 1) or 1)
        if tp != 1 or pp != 1:
            raise RingscopeError("RS_ERR_CONFIG",
                                 f"ringscope.sglang: tensor/pipeline parallelism (tp_size={tp}, pp_size={pp}) is not "
                                 f"supported yet: serve with tp_size=1 and pp_size=1, or unset {ENV_CONFIG}")
        if getattr(sa, "enable_torch_compile", False):
            raise RingscopeError("RS_ERR_CONFIG",
                                 "ringscope.sglang: enable_torch_compile is not supported yet (its graphs pad batches "
                                 f"the plugin does not see): serve without it, or unset {ENV_CONFIG}")
        decoder = getattr(model, "model", None)
        layers = getattr(decoder, "layers", None)
        if layers is None:
            raise RingscopeError("RS_ERR_CONFIG", f"ringscope.sglang: {arch} has no model.layers")
        n = len(layers)
        chosen = list(range(n)) if pc.layers is None else list(dict.fromkeys(pc.layers))
        bad = [i for i in chosen if not 0 <= i < n]
        if bad:
            raise RingscopeError("RS_ERR_CONFIG",
                                 f"{pc.source}: sglang.layers names layer(s) {bad} but {arch} has {n} decoder layers "
                                 f"(0..{n - 1})")
        param = next(model.parameters())
        check_device(param.device)
        dt = _engine.model_dtype(param)
        return cls(runner, model, decoder, layers, chosen, pc, dt, model.config.hidden_size)

    def __init__(self, runner, model, decoder, layers, chosen, pc: PluginConfig, dt, hidden):
        import torch

        begin_op, capture_op, end_op, *_ = _engine.ops()
        # Captured requests, for the probes' reports at close: ringscope id -> SGLang rid (bounded, oldest dropped).
        self._captured: Dict[int, str] = {}
        planned = _engine.planned_hookpoints(chosen, pc.sites)
        attention = {i: _attention_entry(model, layers[i], i) for i in chosen} \
            if any(s in _engine.ATTN_SITES for s in pc.sites) else {}
        widths = {name: (attention[i]["num_heads"] if site == "attn_q" else attention[i]["num_kv_heads"])
                  * attention[i]["head_dim"] for name, site, i in planned if site in _engine.ATTN_SITES}
        cuda = next(model.parameters()).device.type == "cuda"
        sa = runner.server_args
        if attention and str(getattr(sa, "kv_cache_dtype", "auto") or "auto") != "auto":
            raise RingscopeError("RS_ERR_CONFIG",
                                 f"ringscope.sglang: sites {', '.join(_engine.ATTN_SITES)}: kv_cache_dtype = "
                                 f"{sa.kv_cache_dtype!r} quantises the keys and values attention reads, so the captured "
                                 "rows would not be what it attends over: serve with kv_cache_dtype=\"auto\"")
        # The most token rows of one forward pass (a prefill chunk with decodes beside it), and then some.
        max_rows = max(int(getattr(sa, "max_prefill_tokens", 0) or 0),
                       int(getattr(sa, "chunked_prefill_size", 0) or 0), 8192)
        max_rows += int(getattr(sa, "max_running_requests", 0) or 0) + 256
        if cuda:
            bad = [k for k in ("speculative_algorithm", "dllm_algorithm") if getattr(sa, k, None)]
            if bad:
                raise RingscopeError("RS_ERR_CONFIG",
                                     f"ringscope.sglang: {bad[0]} = {getattr(sa, bad[0])!r} is not supported on CUDA "
                                     "(their passes replay CUDA graphs the plugin does not prepare): serve without it, "
                                     f"or unset {ENV_CONFIG}")
            _engine.refuse_opt_in_without_kept_rows(pc, "sglang")
        # Deferred on CUDA when every site allows it: one copy kernel per forward pass instead of one per capture
        # (SGLang runs its layers eagerly, so each capture kernel is a graph node of its own between the engine's).
        # SGLang's fused add-norm (sgl_kernel) overwrites the attention and MLP outputs within the step: with those
        # sites every capture copies at once.
        cfg = _engine.session_config(pc, planned, dt, hidden, cuda=cuda, max_rows=max_rows if cuda else 0,
                                      widths=widths, defer=_engine.deferrable(pc, planned, cuda, "SGLang"))
        export = cfg.setdefault("export", {})
        if export.get("parquet") or export.get("arrow_ipc"):
            export.setdefault("run_id", _default_run_id())
        super().__init__(pc, cfg, planned, 0, SIDE_DIR, logger, cuda=cuda)
        _LIVE.append(self)
        if attention:
            for name, site, i in planned:
                if site in _engine.ATTN_SITES:
                    attention[i].setdefault("hookpoints", {})[site[-1]] = name
            # What rebuilding the layers' attention patterns needs (ringscope.attention_pattern), as SGLang runs them.
            self.session.set_metadata("attention", {
                "format": 1, "source": "sglang",
                "model_type": str(getattr(model.config, "model_type", type(model).__name__)),
                "layers": [attention[i] for i in sorted(attention)]})
        # Probes with action = "stop": after each forward pass the plugin waits for the probes to score its rows and
        # ends the requests they flagged (SGLang keeps the token just generated and finishes the request).
        self._stops = any(isinstance(p, dict) and p.get("action") == "stop" for p in cfg.get("probes", []) or [])
        self._step_reqs = None
        self._prepared = False
        self.stopped: Dict[int, int] = {}  # ringscope request id -> the step after which a probe ended it

        device = next(model.parameters()).device
        decoder.register_buffer("_ringscope_sink", torch.zeros(1, dtype=torch.uint8, device=device), persistent=False)
        self._request_id_buffer(decoder, device, max_rows)
        self._handles = []
        key = self.key
        keep: List = []

        # The hooks run in SGLang's eager forward passes (torch.compile is refused) and, on CUDA, while SGLang records
        # its CUDA graphs (the ops are recorded; replays run them with no Python). They do nothing unless the step is
        # being captured or a graph recorded, and an error in them switches capture off instead of failing the
        # engine (while recording, it fails the recording: half a step must not be replayed).
        def begin_hook(module, args, kwargs):
            if not self.live():
                return
            try:
                positions = kwargs.get("positions", args[0] if args else None)
                hs = kwargs.get("hidden_states", args[1] if len(args) > 1 else None)
                nt = hs.shape[0]
                keep.clear()
                if nt > decoder._ringscope_req.shape[0]:
                    raise RingscopeError("RS_ERR_INVALID_ARGUMENT",
                                         f"a forward pass of {nt} token rows, more than the "
                                         f"{decoder._ringscope_req.shape[0]} its request-id buffer was sized for")
                pos = positions.reshape(-1)[:nt]
                if pos.dtype != torch.int64:
                    pos = pos.to(torch.int64)
                    keep.append(pos)
                begin_op(decoder._ringscope_sink, decoder._ringscope_req[:nt], pos, key)
            except Exception as e:
                self._fail(e, "beginning the step", self._rows)

        self._handles.append(layers[0].register_forward_pre_hook(begin_hook, with_kwargs=True))

        def site_hook(name, pick):
            hp = self.hookpoints[name]

            def hook(module, args, kwargs, output):
                if not self._open or not self.live():
                    return
                try:
                    x = pick(output, args, kwargs).reshape(-1, hidden).contiguous()
                    keep.append(x)
                    capture_op(x, decoder._ringscope_sink, hp, key)
                except Exception as e:
                    self._fail(e, f"capturing {name}", self._rows)
            return hook

        residual = _residual_pick()

        def attention_hook(i):
            # RadixAttention.forward(q, k, v, forward_batch, ...): [tokens, heads × head_dim] (or [tokens, heads,
            # head_dim]), q and k after RoPE. Captured before the attention kernel runs.
            sites = [(j, self.hookpoints[name], widths[name]) for j, s in enumerate(("attn_q", "attn_k", "attn_v"))
                     for name, site, li in planned if li == i and site == s]

            def hook(module, args, kwargs):
                if not self._open or not self.live():
                    return
                try:
                    qkv = [kwargs.get(n, args[j] if len(args) > j else None) for j, n in enumerate(("q", "k", "v"))]
                    for j, hp, width in sites:
                        x = qkv[j].reshape(-1, width).contiguous()
                        keep.append(x)
                        capture_op(x, decoder._ringscope_sink, hp, key)
                except Exception as e:
                    self._fail(e, f"capturing layer {i}'s attention", self._rows)
            return hook

        for i in sorted(attention):
            self._handles.append(layers[i].self_attn.attn.register_forward_pre_hook(attention_hook(i), with_kwargs=True))
        for name, site, i in planned:
            layer = layers[i]
            if site in _engine.ATTN_SITES:
                continue  # attention_hook above
            if site == "residual":
                target, pick = layer, residual
            elif site == "attention_output":
                target, pick = layer.self_attn, lambda out, a, k: _first(out)
            else:
                target, pick = layer.mlp, lambda out, a, k: _first(out)
            self._handles.append(target.register_forward_hook(site_hook(name, pick), with_kwargs=True))

        def end_hook(module, args, output):
            if not self.live():
                return
            try:
                end_op(decoder._ringscope_sink, list(keep), key)
            except Exception as e:
                self._fail(e, "ending the step", self._rows)
            keep.clear()

        self._handles.append(layers[len(layers) - 1].register_forward_hook(end_hook))
        if self.cuda:
            # The hookpoints' controls on the device before SGLang records its graphs (which read them at replay).
            self.session.apply_controls()
            torch.cuda.current_stream(self._device).synchronize()
        copies = ("" if not cuda else "; deferred captures: one copy kernel per forward pass"
                  if self.deferred else "; one copy kernel per capture")
        logger.info("ringscope: capturing %d hookpoints (%s of layers %s) into %s, %s%s", len(planned),
                    ", ".join(pc.sites), chosen, self.run_dir or "the session's consumers",
                    _engine.capture_bytes(planned, dt, hidden, widths), copies)

    def _remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    # -- per step, on the host (the scheduler's thread) -----------------------------------------------------------
    def _request(self, req) -> tuple:
        """``(ringscope id, opted in, first seen now)`` of a request: kept on SGLang's request object itself, so a
        retracted request keeps its state and a new request reusing an old rid gets its own."""
        got = getattr(req, "_ringscope", None)
        if got is not None:
            return got[0], got[1], False
        rid = req.rid
        sp = getattr(req, "sampling_params", None)
        custom = getattr(sp, "custom_params", None) if sp is not None else None
        extra = custom.get("ringscope") if isinstance(custom, dict) else None
        opted, explicit = _engine.opt_in(extra, "custom_params", self.pc.requests == "all", logger, rid,
                                         self._counters)
        rid_u = explicit if explicit is not None else request_id_of(rid)
        req._ringscope = (rid_u, opted)
        if opted:
            self._write_request({"request_id": rid_u, "sglang_rid": rid, "explicit": explicit is not None,
                                 "first_step": self.step})
            self._captured[rid_u] = rid
            if len(self._captured) > 65536:  # keep the newest half (insertion order): amortised O(1)
                self._captured = dict(list(self._captured.items())[32768:])
        return rid_u, opted, True

    def _prepare(self, fb) -> bool:
        """Before a forward pass: the request id of every token row, in place. Returns whether the pass counts as a
        step (idle passes and speculative decoding's passes do not)."""
        import numpy as np

        self._prepared = False
        if self._closed:
            return False
        n = 0
        try:
            mode = fb.forward_mode
            if mode.is_idle():
                return False
            if mode.is_target_verify() or mode.is_split_prefill() or mode.is_dllm_extend() \
                    or not (mode.is_extend() or mode.is_decode()):
                self._counters["skipped_steps"] += 1  # speculative / split / diffusion passes: not captured
                return False
            self._counters["steps"] += 1
            self._prepared = True
            rids = list(fb.rids or [])
            if mode.is_extend():  # EXTEND, and MIXED (extends and one-token decodes): rows per request
                counts = np.asarray(fb.extend_seq_lens_cpu, dtype=np.int64)
                prefix = list(fb.extend_prefix_lens_cpu)
            else:
                counts = np.ones(len(rids), dtype=np.int64)
                prefix = None
            n = int(counts.sum())
            if self.disabled is not None:
                self._lost(n)
                return True
            reqs = getattr(fb, "_ringscope_reqs", None)
            if reqs is None or len(reqs) != len(rids) or [r.rid for r in reqs] != rids:
                raise RingscopeError("RS_ERR_INVALID_ARGUMENT",
                                     "the forward batch's requests are not those of its rids (SGLang internals changed?)")
            self._step_reqs = reqs
            ids = np.empty(len(rids), dtype=np.int64)
            for k, req in enumerate(reqs):
                rid, opted, new = self._request(req)
                ids[k] = rid if opted else -1
                if new and opted and prefix is not None and int(prefix[k]) > 0:
                    # A request's first extend starts past position 0 only after a prefix-cache hit: tokens no
                    # forward pass computes, recorded as such (events table, probes' coverage).
                    self._note_cached(rid, int(prefix[k]))
            tok = np.repeat(ids, counts)
            padded = int(fb.positions.shape[0]) if getattr(fb, "positions", None) is not None else n
            self._arm(tok, n, padded)
        except Exception as e:  # never take the engine down
            self._fail(e, "preparing the step", n)
        return self._prepared

    def _finish(self) -> None:
        if not self._prepared:
            return
        self._prepared = False
        captured = self._active and self.disabled is None
        super()._finish()
        reqs, self._step_reqs = self._step_reqs, None
        if not (captured and self._stops and reqs):
            return
        try:
            self._apply_stops(reqs)
        except Exception as e:  # never take the engine down
            self._fail(e, "applying the probes' stop flags")

    def _apply_stops(self, reqs) -> None:
        """Ends the requests of the step just run that a probe with ``action = "stop"`` has flagged. Waits up to
        ``PROBE_WAIT_S`` for the probes to score the step; after a wait ran out, only 50 ms (the scheduler must not
        stall behind a stuck consumer), counted in ``probe_wait_timeouts``."""
        if self.cuda:
            import torch

            # The step's kernels (a graph replay) may still be queued: the probes can only score rows that exist.
            torch.cuda.current_stream(self._device).synchronize()
        try:
            self.session.wait_probes(0.05 if self._counters["probe_wait_timeouts"] else self.PROBE_WAIT_S)
        except RingscopeError as e:
            if e.status != "RS_ERR_TIMEOUT":
                raise
            self._counters["probe_wait_timeouts"] += 1  # act on the flags raised so far
        step = self.step - 1
        for req in reqs:
            got = getattr(req, "_ringscope", None)
            if got is None or not got[1] or getattr(req, "_ringscope_stopped", False):
                continue
            if self.session.is_flagged(got[0]) and not req.finished() and req.to_finish is None:
                req.to_finish = _probe_stop(got[0], step)
                req._ringscope_stopped = True
                self.stopped[got[0]] = step
                self._counters["stopped_requests"] += 1
                self._write_request({"request_id": got[0], "sglang_rid": req.rid, "stopped_after_step": step})

    def _write_probe_reports(self) -> None:
        """At close, with probes and a run directory: every probe's last report on every captured request still
        known (scores, alerts, coverage — ``cached`` included) to ``probe_reports.jsonl`` next to the request map."""
        if self.run_dir is None or not self.session.probe_stats():
            return
        try:
            self.session.wait_probes(self.PROBE_WAIT_S)
        except RingscopeError as e:
            if e.status != "RS_ERR_TIMEOUT":
                raise
        probes = [p["name"] for p in self.session.probe_stats()]
        with open(self.run_dir / SIDE_DIR / "probe_reports.jsonl", "w", encoding="utf-8") as f:
            for request_id, rid in self._captured.items():
                for name in probes:
                    r = self.session.probe_request(name, request_id)
                    if r is not None:
                        f.write(json.dumps({**r, "sglang_rid": rid, "stopped_after_step":
                                            self.stopped.get(request_id)}) + "\n")

    def close(self) -> dict:
        if self._closed_stats is None and not self._closed:
            try:
                self._write_probe_reports()
            except Exception:
                logger.exception("ringscope: writing the probes' reports at close failed")
        out = super().close()
        if self in _LIVE:
            _LIVE.remove(self)
        return out


_STOP_CLASS = None


def _probe_stop(request_id: int, step: int):
    """The finish reason of a request a ringscope probe ended: reported as a stop (``finish_reason["type"] ==
    "stop"``) with ``"ringscope": {"request_id", "step"}``."""
    global _STOP_CLASS
    if _STOP_CLASS is None:
        from sglang.srt.managers.schedule_batch import BaseFinishReason

        class FINISH_RINGSCOPE_PROBE(BaseFinishReason):
            def __init__(self, request_id: int, step: int):
                super().__init__()
                self.request_id, self.step = request_id, step

            def to_json(self):
                return {"type": "stop", "matched": None,
                        "ringscope": {"request_id": self.request_id, "step": self.step}}

        _STOP_CLASS = FINISH_RINGSCOPE_PROBE
    return _STOP_CLASS(request_id, step)


def captures() -> List[SglangCapture]:
    """The plugin's live captures in this process (the scheduler process holds the engine's)."""
    return _PLUGIN.captures()


def close_all() -> list:
    """Closes every capture of this process (also run at exit, on SIGINT / SIGTERM, and by ``Engine.shutdown``
    through the scheduler's ``ringscope_close``); returns their results."""
    with _engine.critical():
        return _PLUGIN.close_all()


atexit.register(close_all)

