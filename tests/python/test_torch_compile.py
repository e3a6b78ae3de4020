"""`attach()` under torch.compile on CPU (host backend): Hugging Face `generate` with a static cache, whose decode
step transformers compiles (here with inductor and `fullgraph=True`, so any graph break would be an error), and
`torch.compile(model)` directly. The step's batch descriptor is begun and ended by custom ops inside the compiled
graph (positions from the model's own tensors, request ids from a tensor the attachment updates in place): one
`ringscope::step` op at the end of the forward pass takes the batch tensors and every captured tensor.

Every captured row is compared with an eager `output_hidden_states` forward pass over the same tokens. Tolerance:
inductor fuses RMSNorm and the matmul epilogues, so compiled float32 rows differ from eager ones by rounding only;
measured at 2.6e-7 of the row's largest magnitude on this model, the test allows 1e-5.

Skipped when torch or transformers is missing, unless RINGSCOPE_REQUIRE_TORCH is set (.ci/run sets it).
"""
import os

import numpy as np
import pytest

pytestmark = pytest.mark.torch  # test.sh runs these in the vLLM test environment (one torch for both)

if os.environ.get("RINGSCOPE_REQUIRE_TORCH"):
    import torch
    import transformers
else:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")

from torch._dynamo.utils import counters

import ringscope
import ringscope.torch as rt

REL_TOL = 1e-5


def tiny(layers=3):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    return transformers.LlamaForCausalLM(cfg).eval()


def rows_by_key(records, att):
    names = {v: k for k, v in att.hookpoints.items()}
    got = {}
    for r in records:
        for k in range(len(r.rows)):
            key = (names[r.hookpoint], r.step, int(r.request_id[k]), int(r.position[k]))
            assert key not in got, f"row captured twice: {key}"
            got[key] = r.rows[k]
    return got


def check_against_eager(model, att, got, sequences, request_ids, first_new):
    """Every residual row of every layer but the last (whose output_hidden_states entry is after the final norm)
    equals the eager forward pass over the generated tokens, at the same request and position."""
    with torch.no_grad():
        hs = model(sequences[:, :-1], output_hidden_states=True).hidden_states
    n_layers = len(hs) - 1
    checked = 0
    for (name, step, req, pos), row in got.items():
        layer = int(name.split(".")[1])
        b = request_ids.index(req)
        # Step 0 is the prefill (positions 0..first_new-1), step s > 0 decodes position first_new + s - 1.
        assert (step == 0 and pos < first_new) or pos == first_new + step - 1, (name, step, req, pos)
        if layer == n_layers - 1:
            continue
        want = hs[layer + 1][b, pos].numpy()
        err = np.abs(row - want).max() / np.abs(want).max()
        assert err <= REL_TOL, (name, step, req, pos, err)
        checked += 1
    return checked


def test_compiled_static_cache_generate_captures_every_step_without_graph_breaks():
    model = tiny()
    session = ringscope.Session({"policy": {"mode": "full"}})
    att = rt.attach(model, session, sites=("residual",))
    sub = session.subscribe("check")
    att.set_request_ids([41, 42])
    prompt = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
    new = 6
    gc = transformers.GenerationConfig(
        max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0, cache_implementation="static",
        # fullgraph: a graph break introduced by ringscope would fail the compilation instead of splitting it.
        compile_config=transformers.CompileConfig(fullgraph=True, backend="inductor", mode="default"))
    gc.compile_config._compile_all_devices = True  # transformers compiles on GPUs only unless told
    graphs = counters["stats"]["unique_graphs"]
    with torch.no_grad():
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), generation_config=gc)
    assert counters["stats"]["unique_graphs"] - graphs == 1, "one compiled graph for every decode step"
    assert not counters["graph_break"], dict(counters["graph_break"])
    stats = session.close()
    got = rows_by_key(list(sub), att)
    att.detach()
    layers = len(model.model.layers)
    # The prefill (eager in generate) and new - 1 compiled decode steps, every row of every layer.
    assert len(got) == (4 + new - 1) * 2 * layers
    assert stats["exported_rows"] == len(got) and stats["dropped_rows"] == 0
    assert {s for (_, s, _, _) in got} == set(range(new))
    assert check_against_eager(model, att, got, out, [41, 42], first_new=4) == (4 + new - 1) * 2 * (layers - 1)


def test_torch_compile_of_the_model_keeps_the_step_in_the_graph():
    model = tiny(layers=2)
    session = ringscope.Session({"policy": {"mode": "full"}})
    att = rt.attach(model, session, sites=("residual",))
    sub = session.subscribe("check")
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    ids = torch.tensor([[3, 4, 5], [6, 7, 8]])
    pos = torch.arange(3).expand(2, 3)
    explanation = torch._dynamo.explain(model)(input_ids=ids, position_ids=pos)
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1
    code = explanation.graphs[0].code
    # One op at the end of the forward pass holds the whole step: the batch tensors and every captured tensor.
    assert code.count("torch.ops.ringscope.step") == 1 and "ringscope.capture" not in code, code
    with torch.no_grad():
        for step, rids in enumerate([[7, 8], [9, 10]]):
            att.request_ids = rids  # updates, in place, the tensor the compiled graph reads
            compiled(input_ids=ids, position_ids=pos + step)
    stats = session.close()
    got = rows_by_key(list(sub), att)
    # The explain() run was step 0 (request ids 0 and 1); then one step per compiled call.
    assert {(s, r) for (_, s, r, _) in got} == {(0, 0), (0, 1), (1, 7), (1, 8), (2, 9), (2, 10)}
    assert {p for (_, s, _, p) in got if s == 2} == {1, 2, 3}
    assert stats["exported_rows"] == 3 * 2 * 3 * 2  # steps × batch × tokens × layers


def _static_generate(model, new=5, backend="eager"):
    gc = transformers.GenerationConfig(
        max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0, cache_implementation="static",
        compile_config=transformers.CompileConfig(fullgraph=True, backend=backend, mode="default"))
    gc.compile_config._compile_all_devices = True
    prompt = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
    with torch.no_grad():
        return model.generate(prompt, attention_mask=torch.ones_like(prompt), generation_config=gc)


@pytest.fixture
def fresh_dynamo():
    """No compiled graph of an earlier test in the process, and none of this one left for a later one."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("which", ["the same model", "another model of its class"])
def test_a_graph_compiled_without_the_hooks_is_never_replayed_for_an_attached_model(fresh_dynamo, which):
    """torch.compile does not guard on a module's empty hook dicts (``skip_nnmodule_hook_guards``), so a graph compiled
    before ``attach`` — of the same model, or of any model of its class — used to be replayed for the attached model,
    hooks and all left out: the compiled decode steps captured nothing, silently (only the eager prefill's rows came
    through). ``attach`` gives the hooked modules a class of their own while attached, which dynamo does guard."""
    plain = tiny(layers=2)
    before = _static_generate(plain)  # compiled and run without hooks first
    model = plain if which == "the same model" else tiny(layers=2)
    session = ringscope.Session({"policy": {"mode": "full"}})
    att = rt.attach(model, session, sites=("residual",))
    sub = session.subscribe("check")
    assert type(model).__name__ == "LlamaForCausalLM" and isinstance(model, transformers.LlamaForCausalLM)
    att.set_request_ids([41, 42])
    out = _static_generate(model)
    stats = session.close()
    got = rows_by_key(list(sub), att)
    # The prefill (eager in generate) and the 4 compiled decode steps, every row of both layers.
    assert len(got) == (4 + 5 - 1) * 2 * 2, f"{len(got)} rows: the compiled decode steps were not captured"
    assert {s for (_, s, _, _) in got} == set(range(5)) and stats["dropped_rows"] == 0
    att.detach()
    assert check_against_eager(model, att, got, out, [41, 42], first_new=4) == (4 + 5 - 1) * 2 * 1
    assert type(model) is transformers.LlamaForCausalLM
    assert all(type(m).__module__.startswith(("transformers.", "torch.")) and "_ringscope_unhooked_class" not in vars(type(m))
               for m in model.modules()), "detach() gives every module its own class back"
    # Detached, the model compiles and generates as before (and the plain model's tokens are untouched).
    assert torch.equal(_static_generate(model), out)
    if which == "the same model":
        assert torch.equal(before, out)


def test_an_attached_models_graph_is_never_replayed_for_a_plain_one(fresh_dynamo):
    """The other order, which held before the classes too (dynamo guards non-empty hook dicts by their length) and
    must go on holding: compiled while attached, then a model of the same class without hooks compiles its own graph
    and captures nothing into the attachment's session."""
    model = tiny(layers=2)
    session = ringscope.Session({})
    att = rt.attach(model, session, sites=("residual",))
    sub = session.subscribe("check")
    _static_generate(model)

    def produced():
        return sum(session.stats(hp)["produced_rows"] for hp in att.hookpoints.values())
    n = produced()
    assert n == (4 + 5 - 1) * 2 * 2
    other = tiny(layers=2)
    ref = other.generate(torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]]), max_new_tokens=5, min_new_tokens=5,
                         do_sample=False, pad_token_id=0)
    assert torch.equal(_static_generate(other), ref)
    assert produced() == n, "the plain model's steps went into the attached model's session"
    session.close()
    assert len(rows_by_key(list(sub), att)) == n
    att.detach()


def test_a_module_whose_class_cannot_be_changed_is_a_warning_and_attach_still_captures(monkeypatch):
    """A hooked module class that refuses a subclass (or a layout that refuses the new class) cannot be told apart
    from an unhooked one by torch.compile: attach says so (a RuntimeWarning naming the class), keeps it, and works."""
    def refuses(cls):
        raise TypeError(f"{cls.__qualname__} refuses subclasses")
    monkeypatch.setattr(rt, "_hooked_class", refuses)
    model = tiny(layers=2)
    session = ringscope.Session({})
    with pytest.warns(RuntimeWarning, match="LlamaDecoderLayer cannot be changed"):
        att = rt.attach(model, session, sites=("residual",))
    sub = session.subscribe("check")
    assert type(model.model.layers[0]) is transformers.models.llama.modeling_llama.LlamaDecoderLayer
    with torch.no_grad():
        model(input_ids=torch.tensor([[1, 2, 3]]))
    session.close()
    assert len(rows_by_key(list(sub), att)) == 3 * 2
    att.detach()


def test_full_mode_on_cuda_admits_every_call_of_a_compiled_step_that_replays_cuda_graphs(monkeypatch):
    """Full mode on the CUDA backend: a replayed CUDA graph begins its step on the device and cannot wait for ring
    space, so ``attach`` wraps transformers' ``get_compiled_call`` and every call of a compiled step that replays
    CUDA graphs (inductor's ``reduce-overhead``, ``max-autotune``, ``triton.cudagraphs``; the ``cudagraphs``
    backend) admits its batch × tokens rows first. Here (no GPU) the CUDA session is stood in for by a host one that
    says it is a full-mode CUDA session and whose per-pass admission is recorded, and transformers' compiler by a
    function that records its calls; the GPU test is ``test_hf_rows.py``'s
    ``test_full_mode_compiled_generate_admits_every_replay_and_loses_nothing``."""
    model = tiny(layers=2)
    session = ringscope.Session({"policy": {"mode": "full"}})
    att = rt.attach(model, session, sites=("residual",))
    assert "get_compiled_call" not in vars(model), "a host session's steps are begun from the host: nothing to admit"
    att.detach()
    events = []

    def users_own(config):  # an instance attribute that was there before attach: detach() puts it back
        model._last_compile_config = config
        return lambda **kw: events.append(("step", tuple(kw["input_ids"].shape)))
    model.get_compiled_call = users_own
    real_stats = ringscope.Session.stats_all
    monkeypatch.setattr(ringscope.Session, "stats_all",
                        lambda self: {**real_stats(self), "mode": "full", "backend": "cuda"})
    session = ringscope.Session({"policy": {"mode": "full"}})
    att = rt.attach(model, session, sites=("residual",))
    assert vars(model)["get_compiled_call"] is not users_own, "a full-mode CUDA session wraps get_compiled_call"
    # The wrapper admits through the engine plugins' per-pass call (Session._before_pass(True): the C call alone).
    monkeypatch.setattr(session, "_before_pass",
                        lambda full: lambda rows, stream: events.append(("admit", rows) if full else ("controls",)))
    monkeypatch.setattr(rt, "_current_stream", lambda device=None: 0)  # no CUDA here
    ids = torch.zeros((3, 2), dtype=torch.int64)
    graphs = [transformers.CompileConfig(mode="reduce-overhead"), transformers.CompileConfig(mode="max-autotune"),
              transformers.CompileConfig(mode=None, options={"triton.cudagraphs": True}),
              transformers.CompileConfig(backend="cudagraphs", mode=None)]
    for config in graphs:
        events.clear()
        model.get_compiled_call(config)(input_ids=ids)
        model.get_compiled_call(config)(input_ids=ids[:1, :1])
        assert events == [("admit", 6), ("step", (3, 2)), ("admit", 1), ("step", (1, 1))], (config.to_dict(), events)
    no_graphs = [transformers.CompileConfig(mode="default"),
                 transformers.CompileConfig(mode="max-autotune-no-cudagraphs"),
                 transformers.CompileConfig(mode=None, options={"triton.cudagraphs": False}),
                 transformers.CompileConfig(backend="eager"),  # its default mode, reduce-overhead, is ignored there
                 transformers.CompileConfig(backend="aot_eager")]
    # A call that names no batch (neither input_ids nor inputs_embeds) is a clear error, before anything runs.
    events.clear()
    with pytest.raises(ringscope.RingscopeError, match="neither input_ids nor inputs_embeds"):
        model.get_compiled_call(graphs[0])(attention_mask=ids)
    assert events == []
    for config in no_graphs:
        events.clear()
        model.get_compiled_call(config)(input_ids=ids)
        assert events == [("step", (3, 2))], ("compiled without CUDA graphs: its steps are begun (and wait) on the "
                                              "host", config.to_dict(), events)
    att.detach()
    assert vars(model).get("get_compiled_call") is users_own, "detach() gives the model back what it had"
    del model.get_compiled_call
    session.close()


def test_compiled_bad_input_is_a_clear_error():
    model = tiny(layers=2)
    session = ringscope.Session("")
    rt.attach(model, session, sites=("residual",))
    with pytest.raises(ringscope.RingscopeError, match="attached already to an open session"):
        rt.attach(model, session)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    # No positions in the call: the layers get none either under fullgraph tracing of this model's forward (HF
    # computes them), so this works; a batch larger than the request-id tensor is refused at trace time.
    with pytest.raises(Exception, match="larger than the request-id tensor.*RS_ERR_INVALID_ARGUMENT"):
        compiled(input_ids=torch.ones(300, 2, dtype=torch.int64))
    session.close()


def test_the_step_op_and_the_traced_hooks_refuse_bad_input():
    model = tiny(layers=2)
    session = ringscope.Session("")
    att = rt.attach(model, session, sites=("residual",))
    sink, ids = torch.zeros(1, dtype=torch.uint8), torch.tensor([1, 2])
    # Positions whose batch does not match the request ids: named, nothing begun.
    with pytest.raises(ringscope.RingscopeError, match=r"positions of shape \(3, 4\) for a batch of 2 rows"):
        rt.step(sink, ids, torch.zeros(3, 4, dtype=torch.int64), [], [], att._key)
    # A compiled graph calling an attachment that no longer exists.
    with pytest.raises(ringscope.RingscopeError, match="attachment 999999 no longer exists"):
        rt.step(sink, ids, torch.zeros(2, 1, dtype=torch.int64), [], [], 999999)
    # A decoder layer traced without positions: the compilation fails, saying what is missing.
    traced = torch.compile(lambda h: att._traced.begin(None, (h,), {}), backend="eager", fullgraph=True)
    with pytest.raises(Exception, match="needs the decoder layers called with position_ids or cache_position"):
        traced(torch.ones(2, 3, 64))
    # The step op's sink buffer gone from the last captured module: the compilation fails, naming it.
    del att._sink_module._ringscope_sink
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    with pytest.raises(Exception, match="has no _ringscope_sink buffer"), torch.no_grad():
        compiled(input_ids=torch.tensor([[1, 2, 3]]), position_ids=torch.arange(3)[None])
    att.detach()
    assert session.close()["exported_rows"] == 0


def graph_inputs_of_compiled_decode_step(model):
    """The inputs (name, shape, static or not) of the graph torch.compile builds of `generate`'s decode step with a
    static cache, captured by a backend that only looks at the graph (and runs it as it is)."""
    graphs = []

    def inspecting_backend(gm, example_inputs, **_):
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        graphs.append([(n.name, tuple(x.shape), getattr(x, "_dynamo_static_input_type", None) is not None)
                       for n, x in zip(placeholders, example_inputs) if isinstance(x, torch.Tensor)])
        return gm.forward

    torch._dynamo.reset()
    prompt = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
    gc = transformers.GenerationConfig(
        max_new_tokens=3, min_new_tokens=3, do_sample=False, pad_token_id=0, cache_implementation="static",
        compile_config=transformers.CompileConfig(fullgraph=True, backend=inspecting_backend))
    gc.compile_config._compile_all_devices = True
    with torch.no_grad():
        model.generate(prompt, attention_mask=torch.ones_like(prompt), generation_config=gc)
    assert len(graphs) == 1, f"{len(graphs)} graphs"
    return graphs[0]


def test_the_compiled_step_gains_only_static_inputs():
    """CUDA graph trees copy every non-static input of a compiled step into the graph's own memory at each replay,
    and check the addresses of static ones: what ringscope adds to the decode step's graph must be static tensors that
    keep their address (the request-id tensor the attachment updates in place, and the sink byte), never a
    per-call input."""
    plain = graph_inputs_of_compiled_decode_step(tiny(layers=2))
    model = tiny(layers=2)
    session = ringscope.Session({"policy": {"mode": "best_effort"}})
    att = rt.attach(model, session, sites=("residual",))
    try:
        attached = graph_inputs_of_compiled_decode_step(model)
    finally:
        att.detach()
        session.close()
    names = {name for name, _, _ in plain}
    added = [i for i in attached if i[0] not in names]
    assert len(attached) == len(plain) + 2, (plain, attached)
    assert sorted(shape for _, shape, _ in added) == [(1,), (256,)], added  # the sink byte, the request ids
    assert all(static for _, _, static in added), added
    assert [i for i in plain if not i[2]] == [i for i in attached if not i[2]], "the same per-call inputs"


def test_compiled_static_cache_generate_records_the_token_ids():
    """The `tokens` site inside compiled decode steps (issue 28: rows joinable to text): every step's rows carry the
    token fed at that position, prefill (eager) and compiled decode steps alike."""
    model = tiny(layers=2)
    session = ringscope.Session({"policy": {"mode": "full"}})
    att = rt.attach(model, session, sites=("residual", "tokens"))
    sub = session.subscribe("check")
    prompt = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
    new = 4
    gc = transformers.GenerationConfig(
        max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0, cache_implementation="static",
        compile_config=transformers.CompileConfig(fullgraph=True, backend="inductor", mode="default"))
    gc.compile_config._compile_all_devices = True
    with torch.no_grad():
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), generation_config=gc)
    assert not counters["graph_break"], dict(counters["graph_break"])
    session.close()
    got = rows_by_key(list(sub), att)
    att.detach()
    tokens = {(req, pos): int(row.view(np.int64)[0]) for (name, _, req, pos), row in got.items() if name == "tokens"}
    first = att.current_request_ids(2)
    # Every position fed to the model (the prompt, then each generated token but the last) once, with its token.
    assert len(tokens) == 2 * (4 + new - 1), sorted(tokens)
    for b, req in enumerate(first):
        assert [tokens[(req, p)] for p in range(4 + new - 1)] == out[b, :4 + new - 1].tolist()


def test_compiled_decode_steps_leave_out_the_rows_of_ended_sequences():
    """Compiled decode steps (inductor, no CUDA graphs: the step op runs eagerly) leave out the rows of a sequence
    that ended — fed its EOS token, then the pad token — as eager steps do (issue 28)."""
    model = tiny(layers=2)
    prompt = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
    new = 4
    with torch.no_grad():
        plain = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new,
                               min_new_tokens=new, do_sample=False, pad_token_id=0)
    eos = int(plain[0, 4])  # row 0's first generated token becomes its end-of-sequence token
    if eos in plain[1, 4:].tolist() or 0 in plain[1, 4:].tolist():
        pytest.skip("row 1 generates the chosen EOS or the pad token")
    model.generation_config.eos_token_id = eos
    model.generation_config.pad_token_id = 0
    session = ringscope.Session({"policy": {"mode": "full"}})
    att = rt.attach(model, session, sites=("residual", "tokens"))
    sub = session.subscribe("check")
    gc = transformers.GenerationConfig(
        max_new_tokens=new, do_sample=False, pad_token_id=0, eos_token_id=eos, cache_implementation="static",
        compile_config=transformers.CompileConfig(fullgraph=True, backend="inductor", mode="default"))
    gc.compile_config._compile_all_devices = True
    counters.clear()
    with torch.no_grad():
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), generation_config=gc)
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert out[0, 4] == eos and out[0, 5:].tolist() == [0] * (new - 1), out
    session.close()
    got = rows_by_key(list(sub), att)
    att.detach()
    first = att.current_request_ids(2)
    positions = {b: sorted(pos for (name, _, req, pos) in got if name == "layers.0.resid" and req == first[b])
                 for b in (0, 1)}
    assert positions[0] == [0, 1, 2, 3], positions  # the prompt; the steps that fed it EOS and padding: nothing
    assert positions[1] == list(range(4 + new - 1)), positions
    assert all(req in first for (_, _, req, _) in got), "no row of no request reaches the files in eager steps"
