"""The vLLM plugin's host work before each forward pass on its CUDA path (which CI's CPU engines never take): with a
stand-in model runner and a recording stand-in for the session's per-pass call, what each pass asks of the session,
when the request ids are uploaded, what is counted, and that an error there turns capture off without reaching the
engine. (The GPU runs in benches/vllm_gpu.py check the rows themselves.)"""

import logging
import os
import types

import numpy as np
import pytest

from ringscope import _engine
from ringscope import vllm as rv
from ringscope.errors import RingscopeError


class Runner:
    """What the plugin reads of vLLM's model runner before a pass: the batch's request ids and query start offsets."""

    def __init__(self):
        self.requests = {}
        self.input_batch = types.SimpleNamespace(num_reqs=0, req_ids=[], num_computed_tokens_cpu=np.zeros(64, np.int64))
        self.query_start_loc = types.SimpleNamespace(np=np.zeros(65, np.int32))

    def batch(self, tokens_per_request: dict):
        ids = list(tokens_per_request)
        for r in ids:
            self.requests.setdefault(r, types.SimpleNamespace(sampling_params=None))
        self.input_batch.num_reqs = len(ids)
        self.input_batch.req_ids = ids
        self.query_start_loc.np[:len(ids) + 1] = np.concatenate([[0], np.cumsum(list(tokens_per_request.values()))])


def capture(calls, uploads, full=False, noted=None):
    """A VllmCapture on its CUDA path with everything below the per-pass host work stood in for; with ``noted`` (a
    list), a session with probes whose per-pass rows (``note_step_rows``) are recorded there."""
    c = rv.VllmCapture.__new__(rv.VllmCapture)
    c.pc = types.SimpleNamespace(requests="all")
    c.logger = logging.getLogger("test")
    c.step, c.disabled, c._closed, c._open, c._active, c._rows = 0, None, False, False, False, 0
    c._counters = {k: 0 for k in _engine.EngineCapture.COUNTERS}
    c._armed, c._ids, c._last_batch = (None, 0, None), {}, (None, None)
    c._note_rows = None if noted is None else (lambda ids: noted.append(np.array(ids, dtype=np.uint64)))
    c.cuda, c.full = True, full
    c.hookpoints = {"layers.0.resid": 0, "layers.1.resid": 1}
    c._requests_file = None
    c._req_size, c._uploaded, c._dirty = 64, None, 0
    c._stream_now = lambda: 1234
    c._before_pass = lambda rows, stream: calls.append((rows, stream))

    def upload(tok, n):
        uploads.append((list(tok[:n]), n))
        c._uploaded, c._dirty = tok, n
    c._upload = upload
    c.session = types.SimpleNamespace(set_enabled=lambda *a: None, apply_controls=lambda *a: None,
                                      end_step=lambda: None)
    return c


def test_each_pass_asks_the_session_once_and_uploads_ids_only_when_the_batch_changed():
    r1, r2, r3 = (rv.request_id_of(f"req-{i}") for i in (1, 2, 3))
    calls, uploads = [], []
    c, runner = capture(calls, uploads), Runner()
    padded = types.SimpleNamespace(shape=(8,))
    runner.batch({"req-1": 3, "req-2": 1})  # a prefill chunk next to a decode
    c._prepare(runner, padded)
    c._finish()
    assert calls == [(8, 1234)] and uploads == [([r1, r1, r1, r2], 4)]
    runner.batch({"req-1": 1, "req-2": 1})  # both decode: new token counts, new rows
    for _ in range(3):  # a steady batch: the same rows, nothing uploaded again
        c._prepare(runner, padded)
        c._finish()
    assert calls == [(8, 1234)] * 4 and uploads == [([r1, r1, r1, r2], 4), ([r1, r2], 2)]
    runner.batch({"req-2": 1, "req-3": 1})  # one left, one joined
    c._prepare(runner, types.SimpleNamespace(shape=(2,)))
    c._finish()
    assert calls[-1] == (2, 1234) and uploads[-1] == ([r2, r3], 2)
    k = c._counters
    assert (k["steps"], k["steps_captured"], k["padding_rows"]) == (5, 5, 4 + 6 * 3)
    assert k["rows_exported_requested"] == (4 + 2 * 3 + 2) * 2
    assert c.step == 5 and c.disabled is None


def test_with_probes_each_pass_notes_its_rows_per_request_for_their_coverage():
    """On CUDA steps are begun inside graphs, which give the probes no batch: before every pass the plugin notes its
    rows (Session.note_step_rows) — the batch's request ids, padding left out, a request not captured as NO_REQUEST —
    also for a steady batch's passes, which upload nothing."""
    r1, r2 = (rv.request_id_of(f"req-{i}") for i in (1, 2))
    calls, uploads, noted = [], [], []
    c, runner = capture(calls, uploads, noted=noted), Runner()
    runner.batch({"req-1": 3, "req-2": 1})
    c._prepare(runner, types.SimpleNamespace(shape=(8,)))
    c._finish()
    runner.batch({"req-1": 1, "req-2": 1})
    for _ in range(2):
        c._prepare(runner, types.SimpleNamespace(shape=(8,)))
        c._finish()
    assert [n.tolist() for n in noted] == [[r1, r1, r1, r2], [r1, r2], [r1, r2]]
    assert len(uploads) == 2 and c.disabled is None
    # A request that is not captured (-1 in the request-id buffer) is noted as no request's rows.
    c.pc = types.SimpleNamespace(requests="opt_in")
    runner.batch({"req-9": 2, "req-1": 1})
    c._prepare(runner, types.SimpleNamespace(shape=(4,)))
    c._finish()
    assert noted[-1].tolist() == [2**64 - 1, 2**64 - 1, r1] and c.disabled is None
    # Without probes nothing is noted.
    c2, runner2 = capture([], [], noted=None), Runner()
    runner2.batch({"req-1": 1})
    c2._prepare(runner2, types.SimpleNamespace(shape=(1,)))
    assert c2._note_rows is None and c2._armed[2] is None and c2.disabled is None


def test_an_error_before_a_pass_turns_capture_off_and_the_engine_goes_on(monkeypatch):
    monkeypatch.setattr(_engine, "_recording", lambda: False)
    uploads = []
    c, runner = capture([], uploads), Runner()

    def refuse(rows, stream):
        raise RingscopeError("RS_ERR_DEADLINE", "no room in time")
    c._before_pass = refuse
    runner.batch({"req-1": 2})
    c._prepare(runner, types.SimpleNamespace(shape=(2,)))  # does not raise
    assert c.disabled and "no room in time" in c.disabled
    assert not c.live() and uploads == []
    c._finish()
    c._prepare(runner, types.SimpleNamespace(shape=(2,)))  # later passes are counted as lost, not captured
    assert c._counters["lost_steps"] == 2 and c._counters["steps_captured"] == 0


@pytest.mark.parametrize("full", [False, True])
def test_the_sessions_per_pass_call_is_the_c_call_and_its_errors(full):
    """Session._before_pass against a real (host) session: the C call's error comes back as RingscopeError."""
    import ringscope

    mode = "full" if full else "best_effort"
    s = ringscope.Session({"ring": {"capacity": "1 MiB"}, "policy": {"mode": mode}})
    s.register("h", dtype="f32", row_width=4)
    try:
        with pytest.raises(RingscopeError, match="host backend"):
            s._before_pass(full)(4, 0)
        if full:  # a pass of no rows is refused as admit_graph_step refuses it, not admitted as the largest step
            with pytest.raises(RingscopeError, match="rows must be an integer in 1"):
                s._before_pass(full)(0, 0)
    finally:
        s.close()


def test_the_end_op_captures_each_tensor_as_its_hookpoint_in_order_then_ends_the_step():
    # The end_capturing op's body (the captures of a pass whose sites only collect their tensors): one capture per
    # (tensor, hookpoint) in the order received, then the step's end; lists of different lengths are a clear error.
    c = rv.VllmCapture.__new__(rv.VllmCapture)
    done = []
    c._capture = lambda x, hookpoint: done.append(("capture", x, hookpoint))
    c._end = lambda: done.append(("end",))
    c._end_capturing(["a", "b", "c"], [3, 0, 7])
    assert done == [("capture", "a", 3), ("capture", "b", 0), ("capture", "c", 7), ("end",)]
    done.clear()
    with pytest.raises(RingscopeError, match=r"end_capturing: 2 tensors and 3 hookpoints"):
        c._end_capturing(["a", "b"], [1, 2, 3])
    assert done == []


def test_the_submit_op_captures_each_tensor_in_order_then_submits_and_the_end_op_ends_the_step():
    # overlap_copy's ops: submit_capturing captures like end_capturing, then starts the copy (a side stream on CUDA)
    # instead of ending the step; end ends it. Lists of different lengths are a clear error naming the op.
    c = rv.VllmCapture.__new__(rv.VllmCapture)
    done = []
    c._capture = lambda x, hookpoint: done.append(("capture", x, hookpoint))
    c._submit = lambda: done.append(("submit",))
    c._end = lambda: done.append(("end",))
    c._submit_capturing(["a", "b"], [5, 2])
    c._end_keeping(["a", "b"])
    assert done == [("capture", "a", 5), ("capture", "b", 2), ("submit",), ("end",)]
    done.clear()
    with pytest.raises(RingscopeError, match=r"submit_capturing: 1 tensors and 2 hookpoints"):
        c._submit_capturing(["a"], [1, 2])
    assert done == []


@pytest.mark.parametrize("planned,end,want", [
    # q/k/v last, in the last layer: submitted after its attention, the step ends with the last layer.
    ([("l.0.q", "attn_q", 0), ("l.15.v", "attn_v", 15)], 16, (15, True, None)),
    # q/k/v last in an earlier layer: the step ends before the next layer's attention (the same compiled piece).
    ([("l.0.q", "attn_q", 0), ("l.5.k", "attn_k", 5)], 16, (5, True, 6)),
    # The residual last (it comes after the layer's q/k/v): submitted after the layer, ended before the next
    # attention; the worker's last layer's residual leaves nothing to overlap.
    ([("l.5.q", "attn_q", 5), ("l.5.r", "residual", 5)], 16, (5, False, 6)),
    ([("l.3.r", "residual", 3), ("l.15.r", "residual", 15)], 16, None),
    # A pipeline stage's layers end earlier than the model's.
    ([("l.7.r", "residual", 7)], 8, None),
    ([("l.7.q", "attn_q", 7)], 8, (7, True, None)),
    ([], 16, None),
])
def test_overlap_copy_submits_after_the_last_site_and_joins_before_the_next_attention(planned, end, want):
    assert rv._overlap_points(planned, end) == want


def test_overlap_copy_is_a_bool_or_auto_and_true_is_refused_with_sites_copied_at_their_site():
    base = {"vllm": {"sites": ["residual", "attn_q"], "overlap_copy": True}}
    assert rv._overlap_copy(rv.parse_config(base)) is True
    assert rv._overlap_copy(rv.parse_config({"vllm": {"sites": ["residual"], "overlap_copy": False}})) is False
    # Left out or "auto": decided per engine (None), also with sites copied at their site.
    assert rv._overlap_copy(rv.parse_config({"vllm": {"sites": ["residual"]}})) is None
    assert rv._overlap_copy(rv.parse_config({"vllm": {"sites": ["mlp_output"], "overlap_copy": "auto"}})) is None
    for bad in ("yes", 1, "Auto", "LM_HEAD"):
        with pytest.raises(RingscopeError,
                           match=rf"vllm.overlap_copy = {bad!r}: give true, false, \"lm_head\" or \"auto\""):
            rv.parse_config({"vllm": {"overlap_copy": bad}})
    with pytest.raises(RingscopeError, match=r"overlap_copy = true with the site\(s\) mlp_output"):
        rv.parse_config({"vllm": {"sites": ["residual", "mlp_output"], "overlap_copy": True}})
    # "lm_head": the copy held out of the graphs — as given, refused where true is.
    assert rv._overlap_copy(rv.parse_config({"vllm": {"sites": ["residual", "attn_v"], "overlap_copy": "lm_head"}})) \
        == "lm_head"
    with pytest.raises(RingscopeError, match=r'overlap_copy = "lm_head" with the site\(s\) attention_output'):
        rv.parse_config({"vllm": {"sites": ["residual", "attention_output"], "overlap_copy": "lm_head"}})
    with pytest.raises(RingscopeError, match=r'overlap_copy = "lm_head" with ring.defer_captures = false'):
        rv.parse_config({"ring": {"defer_captures": False}, "vllm": {"sites": ["residual"], "overlap_copy": "lm_head"}})
    assert rv._overlap_wanted(rv.parse_config({"vllm": {"sites": ["residual"], "overlap_copy": "lm_head"}}), True,
                              None) == ("lm_head", "")


def test_overlap_copy_needs_deferred_captures():
    with pytest.raises(RingscopeError, match=r"overlap_copy = true with ring.defer_captures = false"):
        rv.parse_config({"ring": {"defer_captures": False}, "vllm": {"sites": ["residual"], "overlap_copy": True}})
    assert rv._overlap_copy(rv.parse_config({"ring": {"defer_captures": True},
                                             "vllm": {"sites": ["residual"], "overlap_copy": True}}))


class _Compilation:
    """A stand-in for vLLM's CompilationConfig: its class's default splitting (attention) ops."""
    _attention_ops = ["vllm::unified_attention_with_output", "vllm::mamba_mixer2"]

    def __init__(self, splitting_ops, partition=False):
        self.splitting_ops = splitting_ops
        self.use_inductor_graph_partition = partition


def _runner(cc):
    return types.SimpleNamespace(vllm_config=types.SimpleNamespace(compilation_config=cc))


def test_overlap_copy_is_refused_where_a_split_could_fall_between_the_fork_and_the_join():
    # vLLM's defaults are fine: its attention ops, to which 0.26 and later append the KV-cache updates (on CUDA), and
    # none on CPU.
    for ops in (["vllm::unified_attention_with_output", "vllm::mamba_mixer2"], [], None,
                ["vllm::unified_attention_with_output", "vllm::mamba_mixer2", "vllm::unified_kv_cache_update",
                 "vllm::unified_mla_kv_cache_update"]):
        rv._check_overlap_engine(_runner(_Compilation(ops)))
    with pytest.raises(RingscopeError, match=r"= true with compilation_config.use_inductor_graph_partition"):
        rv._check_overlap_engine(_runner(_Compilation(["vllm::unified_attention_with_output"], partition=True)))
    with pytest.raises(RingscopeError, match=r"splitting ops besides vLLM's attention ops \(vllm::all_reduce\)"):
        rv._check_overlap_engine(_runner(_Compilation(["vllm::unified_attention_with_output", "vllm::all_reduce"])))


def test_overlap_copy_auto_is_on_on_cuda_where_it_can_be_and_says_why_not_elsewhere():
    fine = _runner(_Compilation(["vllm::unified_attention_with_output"]))

    def wanted(table, cuda=True, runner=fine, **session):
        return rv._overlap_wanted(rv.parse_config(dict(session, vllm=table)), cuda, runner)

    assert wanted({"sites": ["residual"]}) == (True, "")
    assert wanted({"sites": ["attn_q", "attn_k"], "overlap_copy": "auto"}) == (True, "")
    # Given: as given (true was checked against the engine where the capture was created).
    assert wanted({"sites": ["residual"], "overlap_copy": False}) == (False, "")
    assert wanted({"sites": ["residual"], "overlap_copy": True}, cuda=False) == (True, "")
    # CPU: rows are copied at once, nothing would run beside the model.
    assert wanted({"sites": ["residual"]}, cuda=False) == (False, "")
    on, why = wanted({"sites": ["residual", "mlp_output"]})
    assert not on and "the site(s) mlp_output: those are copied at their sites" in why
    # Verified on GPUs in best-effort and full mode on one GPU (full mode since session 49): tensor parallelism leaves
    # it off.
    assert wanted({"sites": ["residual"]}, policy={"mode": "full"}) == (True, "")
    assert wanted({"sites": ["residual"]}, policy={"mode": "best_effort"}) == (True, "")
    tp2 = types.SimpleNamespace(vllm_config=types.SimpleNamespace(
        compilation_config=_Compilation(["vllm::unified_attention_with_output"]),
        parallel_config=types.SimpleNamespace(tensor_parallel_size=2)))
    on, why = wanted({"sites": ["residual"]}, runner=tp2)
    assert not on and why.startswith("vllm.overlap_copy off: tensor_parallel_size = 2")
    on, why = wanted({"sites": ["residual"]}, ring={"defer_captures": False})
    assert not on and why.startswith("vllm.overlap_copy off: ring.defer_captures = false: overlapping the copy needs")
    on, why = wanted({"sites": ["residual"]},
                     runner=_runner(_Compilation(["vllm::unified_attention_with_output"], partition=True)))
    assert not on and why.startswith("vllm.overlap_copy off: compilation_config.use_inductor_graph_partition")
    on, why = wanted({"sites": ["residual"]},
                     runner=_runner(_Compilation(["vllm::unified_attention_with_output", "vllm::all_reduce"])))
    assert not on and "(vllm::all_reduce)" in why


def test_overlap_copys_start_up_words():
    assert rv._overlap_note((3, True, 4), True, True) == "; the copy overlaps the pass from layer 3's attention to " \
                                                         "layer 4's attention"
    assert rv._overlap_note(None, True, True).startswith("; vllm.overlap_copy: nothing after the last site")
    assert rv._overlap_note(None, True, False) == ""
    assert rv._overlap_note(None, True, False, "vllm.overlap_copy off: x") == "; vllm.overlap_copy off: x"


def test_lm_head_needs_a_final_norm_and_compute_logits():
    class Norm:
        def register_forward_hook(self, hook):
            pass

    class Model:
        def compute_logits(self, h):
            return h

    m = Model()
    m.model = types.SimpleNamespace(norm=Norm())
    assert rv._lm_head_problem(m) is None
    m.model = types.SimpleNamespace()
    assert rv._lm_head_problem(m) == "Model.model has no final norm module (model.norm) to end the pass at"
    bare = types.SimpleNamespace(model=types.SimpleNamespace(norm=Norm()))
    assert rv._lm_head_problem(bare) == "SimpleNamespace has no compute_logits to join the copy after"
    assert "beside the LM head" in rv._overlap_note(None, True, "lm_head")
    assert "on CPU rows are copied at once" in rv._overlap_note(None, False, "lm_head")


def test_auto_holds_the_copy_out_of_the_graphs_where_the_side_stream_would_overlap_nothing():
    class Norm:
        def register_forward_hook(self, hook):
            pass

    class Model:
        model = types.SimpleNamespace(norm=Norm())

        def compute_logits(self, h):
            return h

    def effective(table, on, planned, model=Model()):
        return rv._effective_overlap(rv.parse_config({"vllm": table}), on, planned, 16, model)

    resid = [("l.3.r", "residual", 3), ("l.15.r", "residual", 15)]
    qkv = [("l.0.q", "attn_q", 0), ("l.15.v", "attn_v", 15)]
    # "auto", on: the last layer's residual leaves the side stream nothing to overlap — held out of the graphs.
    assert effective({"sites": ["residual"]}, True, resid) == "lm_head"
    # q/k/v of the last layer: the side stream overlaps its MLP (cheaper at batch 1 and 8 in session 50).
    assert effective({"sites": ["attn_q", "attn_v"]}, True, qkv) is True
    # "auto" off (CPU, tensor parallelism, ...), or given: as decided.
    assert effective({"sites": ["residual"]}, False, resid) is False
    assert effective({"sites": ["residual"], "overlap_copy": True}, True, resid) is True
    # Sites copied at their sites, or a model without a final norm: as decided.
    assert effective({"sites": ["residual"]}, True, resid + [("l.1.m", "mlp_output", 1)]) is True
    assert effective({"sites": ["residual"]}, True, resid, model=types.SimpleNamespace(model=None)) is True


class _HeldSession:
    """Records the held-copy calls a capture makes."""

    def __init__(self):
        self.calls = []

    def hold_step(self, slot):
        self.calls.append(("hold", slot))

    def launch_held(self, slot, stream):
        self.calls.append(("launch", slot, stream))

    def join_held(self, stream):
        self.calls.append(("join", stream))

    def end_step(self):
        self.calls.append(("end",))


def _held_capture(monkeypatch, key):
    c = rv.VllmCapture.__new__(rv.VllmCapture)
    c.session = _HeldSession()
    c.cuda, c.disabled, c._closed, c._open, c._rows = True, None, False, True, 4
    c._slots, c._join_owed, c._pass_ended = {}, False, False
    c._hold_slot = c._graph_slot
    c._stream_now = lambda: 77
    c._capture = lambda x, hookpoint: c.session.calls.append(("capture", x, hookpoint))
    monkeypatch.setattr(rv.VllmCapture, "_graph_key", staticmethod(lambda: key[0]))
    return c


def test_the_end_holding_op_holds_a_recorded_pass_and_the_replay_launches_it(monkeypatch):
    # overlap_copy = "lm_head": recording a graph, the end_holding op captures each tensor and holds the step's copy
    # in the slot of the graph being recorded (one per (CUDA graph mode, batch descriptor), as vLLM keys its graphs).
    key = [("FULL", ("desc", 8))]
    c = _held_capture(monkeypatch, key)
    monkeypatch.setattr(_engine, "_recording", lambda: True)
    c._end_holding(["a", "b"], [3, 4])
    assert c.session.calls == [("capture", "a", 3), ("capture", "b", 4), ("hold", 0)]
    assert c._pass_ended and not c._open
    key[0] = ("PIECEWISE", ("desc", 8))
    c._open, c.session.calls = True, []
    c._end_holding(["a"], [3])
    assert c.session.calls == [("capture", "a", 3), ("hold", 1)] and c._slots == {("FULL", ("desc", 8)): 0,
                                                                                   ("PIECEWISE", ("desc", 8)): 1}
    # A replay runs no op: after it the plugin launches the graph's held copy, and the engine's stream waits for it
    # once (after compute_logits, or before the next pass's ids change).
    monkeypatch.setattr(_engine, "_recording", lambda: False)
    c.session.calls, c._pass_ended = [], False
    key[0] = ("FULL", ("desc", 8))
    c._after_forward()
    assert c.session.calls == [("launch", 0, 77)] and c._join_owed
    c._join()
    c._join()
    assert c.session.calls == [("launch", 0, 77), ("join", 77)]
    # An eager pass (no graph): the op ends the step at once, and nothing is launched after it.
    c.session.calls, c._pass_ended, c._open = [], False, True
    c._end_holding(["a"], [3])
    c._after_forward()
    assert c.session.calls == [("capture", "a", 3), ("end",)]
    # A graph not held (recorded outside vLLM's forward context: its copy is inside it): nothing to launch.
    c.session.calls, c._pass_ended = [], False
    key[0] = ("FULL", ("other", 2))
    c._after_forward()
    assert c.session.calls == [] and not c._join_owed


def test_a_failed_launch_of_a_held_copy_turns_capture_off_and_counts_the_pass(monkeypatch):
    c = _held_capture(monkeypatch, [("FULL", 1)])
    c._slots = {("FULL", 1): 0}
    failed = []
    c._fail = lambda e, where, rows=0: failed.append((str(e), where, rows))

    def refuse(slot, stream):
        raise RingscopeError("RS_ERR_INVALID_ARGUMENT", "launch_held: no held copy in slot 0")

    c.session.launch_held = refuse
    c._after_forward()
    assert failed == [("launch_held: no held copy in slot 0 [RS_ERR_INVALID_ARGUMENT]",
                       "launching the pass's held copy", 4)] and not c._join_owed


def test_the_join_follows_compute_logits_and_close_puts_the_models_own_back():
    class Model:
        def compute_logits(self, h):
            order.append("logits")
            return h * 2

    order = []
    m = Model()
    c = rv.VllmCapture.__new__(rv.VllmCapture)
    c._handles, c._logits_model = [], None
    c._join = lambda: order.append("join")
    c._join_after_logits(types.SimpleNamespace(model=m))
    assert m.compute_logits(3) == 6 and order == ["logits", "join"]
    c._remove_hooks()
    order.clear()
    assert m.compute_logits(3) == 6 and order == ["logits"] and "compute_logits" not in vars(m)


@pytest.mark.torch
def test_the_submit_op_declares_it_writes_its_tensors():
    # What makes compiled code hand the end op the submitted buffers themselves (never a second computation of them,
    # never reused in between): the op's schema says it writes them. (The CPU engines' Inductor handed the same
    # buffers even without the declaration, so tests/vllm cannot tell it is missing; this can.)
    if os.environ.get("RINGSCOPE_REQUIRE_TORCH"):
        import torch
    else:
        torch = pytest.importorskip("torch")
    _engine.ops()
    args = {a.name: a for a in torch.ops.ringscope_engine.submit_capturing.default._schema.arguments}
    assert args["tensors"].alias_info is not None and args["tensors"].alias_info.is_write
    assert args["sink"].alias_info is not None and args["sink"].alias_info.is_write


def test_a_row_list_for_a_plugin_hookpoint_is_refused_on_cuda():
    # On CUDA a pass's kept rows (the captured requests' rows) stand for "all rows"; a list of batch rows would be
    # taken as given, rows of requests not captured included, and the engine renumbers its batch rows every pass.
    planned = [("layers.0.resid", "residual", 0)]
    listed = {"hookpoints": [{"name": "layers.0.resid", "rows": [0, 2]}]}
    with pytest.raises(RingscopeError, match=r"hookpoint 'layers.0.resid': rows = \[0, 2\] selects batch rows"):
        _engine.session_config(rv.parse_config(listed), planned, "bf16", 64, cuda=True, max_rows=64)
    # Named selections stay, and on the host (rows copied there, never on the device) a list is taken as before.
    named = {"hookpoints": [{"name": "layers.0.resid", "rows": "last_per_request"}]}
    cfg = _engine.session_config(rv.parse_config(named), planned, "bf16", 64, cuda=True, max_rows=64)
    assert cfg["hookpoints"][0]["rows"] == "last_per_request"
    assert _engine.session_config(rv.parse_config(listed), planned, "bf16", 64)["hookpoints"][0]["rows"] == [0, 2]


def test_opt_in_on_cuda_is_refused_with_a_library_that_cannot_keep_rows(monkeypatch):
    # Before C ABI 11 every request not opted in would leave rows of no request in the files: refused at load.
    # (The vLLM plugin calls this at load on CUDA; the SGLang plugin's test covers its call.)
    def refuse(pc):
        _engine.refuse_opt_in_without_kept_rows(pc, "vllm")

    pc = rv.parse_config({"vllm": {"requests": "opt_in"}})
    refuse(pc)  # this library keeps rows
    refuse(rv.parse_config({}))
    monkeypatch.setattr(_engine, "_has_call", lambda call: call != "rs_begin_step_graph_kept")
    with pytest.raises(RingscopeError, match=r'vllm.requests = "opt_in" on CUDA needs a library with '
                                             r'rs_begin_step_graph_kept \(C ABI 11'):
        refuse(pc)
    refuse(rv.parse_config({"vllm": {"requests": "all"}}))  # "all" is not refused


def _fake_runner(device_type: str, norm: bool = True):
    """A model runner as ``VllmCapture.install`` reads it up to its load-time checks: a supported architecture with two
    decoder layers whose parameters are on ``device_type``."""
    class LlamaForCausalLM:
        config = types.SimpleNamespace(hidden_size=64, model_type="llama")

        def __init__(self):
            self.model = types.SimpleNamespace(layers=[object(), object()])
            if norm:
                self.model.norm = types.SimpleNamespace(register_forward_hook=lambda hook: None)

        def parameters(self):
            return iter([types.SimpleNamespace(device=types.SimpleNamespace(type=device_type, index=0))])

        def compute_logits(self, h):
            return h

    par = types.SimpleNamespace(pipeline_parallel_size=1, data_parallel_size=1, tensor_parallel_size=1)
    return types.SimpleNamespace(model=LlamaForCausalLM(),
                                 vllm_config=types.SimpleNamespace(parallel_config=par, speculative_config=None))


def test_install_refuses_opt_in_on_cuda_with_a_library_that_cannot_keep_rows(monkeypatch):
    # The plugin's load-time call itself (the test above calls the function): with a library before C ABI 11, a
    # CUDA model and requests = "opt_in", install fails the engine's start naming the missing call.
    monkeypatch.setattr(_engine, "_has_call", lambda call: call != "rs_begin_step_graph_kept")
    pc = rv.parse_config({"vllm": {"requests": "opt_in"}})
    with pytest.raises(RingscopeError, match=r'vllm.requests = "opt_in" on CUDA needs a library with '
                                             r'rs_begin_step_graph_kept'):
        rv.VllmCapture.install(_fake_runner("cuda"), pc)


def test_install_refuses_lm_head_for_a_model_without_a_final_norm():
    pc = rv.parse_config({"vllm": {"sites": ["residual"], "overlap_copy": "lm_head"}})
    with pytest.raises(RingscopeError, match=r'vllm.overlap_copy = "lm_head": LlamaForCausalLM.model has no final '
                                             r'norm module \(model.norm\)'):
        rv.VllmCapture.install(_fake_runner("cuda", norm=False), pc)
