"""The PyTorch / Hugging Face integration on CPU (host backend): a randomly initialised Llama-architecture model
(config built here, no downloads) runs `generate` with ringscope attached, and every exported row must be
bit-identical to the matching `output_hidden_states` entry, with the right request id and position. Also: the
custom op under torch.compile without graph breaks, and the bad inputs the API promises to refuse.

Skipped when torch or transformers is missing, unless RINGSCOPE_REQUIRE_TORCH is set (.ci/run sets it).
"""
import os
import types

import numpy as np
import pytest

pytestmark = pytest.mark.torch  # test.sh runs these in the vLLM test environment (one torch for both)

if os.environ.get("RINGSCOPE_REQUIRE_TORCH"):
    import torch
    import transformers
else:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")

import ringscope
import ringscope.torch as rt


def tiny(model_type="llama", layers=3):
    torch.manual_seed(0)
    if model_type == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=128, n_embd=64, n_layer=layers, n_head=4, n_positions=64)
        return transformers.GPT2LMHeadModel(cfg).eval()
    config, cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    }[model_type]
    cfg = config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    return cls(cfg).eval()


def collect(session, sub):
    session.close()
    return list(sub)


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "mistral", "gpt2"])
def test_generate_rows_equal_output_hidden_states_bit_for_bit(model_type):
    model = tiny(model_type)
    session = ringscope.Session({"policy": {"mode": "full"}})
    att = rt.attach(model, session, sites=("residual", "final_norm"))
    sub = session.subscribe("check")
    att.request_ids = [41, 42]
    prompt = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
    with torch.no_grad():
        # min_new_tokens: a random model may emit its EOS token, and the count below expects 4 forward passes.
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=4, min_new_tokens=4,
                             do_sample=False, output_hidden_states=True, return_dict_in_generate=True, pad_token_id=0)
    records = collect(session, sub)
    names = {v: k for k, v in att.hookpoints.items()}
    got = {}
    for r in records:
        for k in range(len(r.rows)):
            got[(names[r.hookpoint], r.step, int(r.request_id[k]), int(r.position[k]))] = r.rows[k]
    n_layers = len(out.hidden_states[0]) - 1
    checked = 0
    for step, hs in enumerate(out.hidden_states):
        seq = hs[0].shape[1]
        for b, req in enumerate([41, 42]):
            for t in range(seq):
                pos = t if step == 0 else 3 + step
                for i in range(n_layers - 1):
                    want = hs[i + 1][b, t].numpy()
                    row = got.pop((f"layers.{i}.resid", step, req, pos))
                    assert row.view(np.uint32).tobytes() == want.view(np.uint32).tobytes(), (step, req, pos, i)
                    checked += 1
                want = hs[n_layers][b, t].numpy()
                assert got.pop(("final_norm", step, req, pos)).tobytes() == want.tobytes()
                # The last layer's residual is hidden_states[-1] before the final norm: present, not compared here.
                got.pop((f"layers.{n_layers - 1}.resid", step, req, pos))
                checked += 1
    assert not got, f"rows nobody expected: {list(got)[:5]}"
    assert checked == (4 + 3) * 2 * n_layers


def test_eager_hooks_capture_without_the_custom_ops(monkeypatch):
    """Run eagerly, attach's hooks call ringscope directly: the torch.library ops (``capture``, ``submit``) exist for
    torch.compile's traces, and their dispatch cost 80-120 us of host time per call in eager steps (measured on an
    H100, docs/gpu-benchmarks.md, session 36). With both ops made to fail, an eager generate still captures every
    row."""
    def refuse(*args, **kwargs):
        raise AssertionError("an eager step went through a ringscope custom op")
    monkeypatch.setattr(rt, "capture", refuse)
    monkeypatch.setattr(rt, "submit", refuse)
    model = tiny(layers=2)
    session = ringscope.Session({"policy": {"mode": "full"}})
    att = rt.attach(model, session, sites=("residual", "tokens", "logits"))
    sub = session.subscribe("check")
    prompt = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=3, min_new_tokens=3,
                       do_sample=False, pad_token_id=0)
    att.detach()
    names = {v: k for k, v in att.hookpoints.items()}
    rows: dict = {}
    for r in collect(session, sub):
        rows[names[r.hookpoint]] = rows.get(names[r.hookpoint], 0) + len(r.rows)
    # The prompt's 4 tokens and 2 decode steps: every layer's residual and every token; logits of the prompt's last
    # token (generate computes no others) and of each decode step.
    assert rows == {"layers.0.resid": 6, "layers.1.resid": 6, "tokens": 6, "logits": 3}, rows


def test_attach_wraps_the_models_forward_and_detach_puts_back_what_was_there():
    """The step begins and ends around the model's forward pass through an instance attribute ``forward`` (module hooks
    on the model cost a Python hook path and, compiled, two more frames per call): ``generate`` and others inspecting
    ``model.forward`` see the model's own parameters; a forward that another library wrapped before attach (an
    instance attribute, as accelerate's hooks make) still runs, inside, and is put back by detach; a deep copy of an
    attached model is refused by name when called; detached, nothing of ringscope is left on the model."""
    import copy
    import inspect

    model = tiny(layers=2)
    want_sig = inspect.signature(model.forward)
    calls = []
    original = model.forward

    def accelerate_like(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)
    model.forward = accelerate_like
    session = ringscope.Session({"policy": {"mode": "full"}})
    att = rt.attach(model, session, sites=("residual",))
    sub = session.subscribe("check")
    assert inspect.signature(model.forward) == inspect.signature(accelerate_like)
    assert not model._forward_pre_hooks and not model._forward_hooks, "no hooks on the model itself"
    ids = torch.tensor([[5, 6, 7]])
    with torch.no_grad():
        model(input_ids=ids)
    assert len(calls) == 1
    att.detach()
    assert model.forward is accelerate_like
    assert not any("ringscope" in k for k in vars(model)), [k for k in vars(model) if "ringscope" in k]
    del model.forward
    assert inspect.signature(model.forward) == want_sig
    with torch.no_grad():
        model(input_ids=ids)
    rows = collect(session, sub)
    assert sum(len(r.rows) for r in rows) == 3 * 2, "one step captured while attached, none after detach"
    plain = tiny(layers=2)
    session = ringscope.Session({})
    att = rt.attach(plain, session, sites=("residual",))
    assert inspect.signature(plain.forward) == want_sig
    with torch.no_grad():
        plain(input_ids=ids)
        copied = copy.deepcopy(plain)
        assert copied.forward.__self__ is copied
        # The copy's hooks are the original's (functions are not copied): a clear error, not rows of no step, and
        # the original goes on working (as it does after its inner model is called on its own, refused too).
        with pytest.raises(ringscope.StepError, match="a copy of an attached model"):
            copied(input_ids=ids)
        with pytest.raises(ringscope.StepError, match="called on its own"):
            plain.model(input_ids=ids)
        plain(input_ids=ids)
    assert any(hasattr(m, "_ringscope_sink") for m in plain.modules())
    att.detach()
    assert "forward" not in vars(plain) and not any("ringscope" in k for k in vars(plain))
    assert not any(hasattr(m, "_ringscope_sink") for m in plain.modules()), "detach leaves the step op's sink"
    session.close()


def test_the_forward_wrapper_follows_class_patches_and_survives_other_wrappers(monkeypatch):
    """A patch of the model's class made after attach (as kernel libraries make) is what runs; a forward replaced
    (not wrapped) after attach is refused by name; a wrapper another library puts on top of attach's is kept by
    detach(), passes calls through, and a later attach captures each step once (no recursion through the old
    wrapper)."""
    model = tiny(layers=2)
    session = ringscope.Session({"policy": {"mode": "full"}})
    sub = session.subscribe("check")
    att = rt.attach(model, session, sites=("residual",))
    ids = torch.tensor([[5, 6, 7]])
    patched = []
    original = type(model).forward

    def patched_forward(self, *args, **kwargs):
        patched.append(1)
        return original(self, *args, **kwargs)
    monkeypatch.setattr(type(model), "forward", patched_forward)
    with torch.no_grad():
        model(input_ids=ids)
    assert patched == [1], "the class's forward, patched after attach, did not run"
    monkeypatch.undo()
    # Replaced after attach (not wrapped): the steps are not begun, and the captures say so by name.
    ours = model.forward
    model.forward = types.MethodType(type(model).forward, model)
    with pytest.raises(ringscope.StepError, match="replaced after attach"), torch.no_grad():
        model(input_ids=ids)
    model.forward = ours
    theirs = model.forward

    def on_top(*args, **kwargs):
        return theirs(*args, **kwargs)
    model.forward = on_top
    att.detach()
    assert model.forward is on_top
    with torch.no_grad():
        model(input_ids=ids)  # detached: passes through, nothing captured
    att = rt.attach(model, session, sites=("residual",))
    with torch.no_grad():
        model(input_ids=ids)
    att.detach()
    rows = collect(session, sub)
    assert sorted(r.step for r in rows) == [0, 0, 0, 0], [(r.step, len(r.rows)) for r in rows]
    assert sum(len(r.rows) for r in rows) == 2 * 2 * 3


def test_the_traced_state_goes_with_its_attachment():
    """What the hooks use while torch.compile traces lives in a module-global dictionary (one path for dynamo to
    guard, see ringscope.torch._Traced): detach removes it, and an attached model dropped without detach() is freed
    with it."""
    import gc
    import weakref

    model = tiny(layers=2)
    session = ringscope.Session({})
    att = rt.attach(model, session, sites=("residual",))
    key = att._key
    assert key in rt._TRACED
    att.detach()
    assert key not in rt._TRACED
    att = rt.attach(model, session, sites=("residual",))
    key = att._key
    ref = weakref.ref(model)
    del model, att
    gc.collect()
    assert ref() is None, "an attached model dropped without detach() is still alive"
    assert key not in rt._TRACED
    session.close()


def test_the_capture_op_compiles_without_graph_breaks():
    session = ringscope.Session("")
    hp = session.register("x", dtype="f32", row_width=8)
    sink = torch.zeros(1, dtype=torch.uint8)

    def f(x):
        y = x * 2
        rt.capture(y, sink, session._h, hp, 8)
        return y + 1

    session.begin_step(0, [1, 2], [0, 0])
    explanation = torch._dynamo.explain(f)(torch.ones(2, 8))  # runs f once
    session.end_step()
    assert explanation.graph_break_count == 0
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    session.begin_step(1, [1, 2], [1, 1])
    assert torch.equal(compiled(torch.ones(2, 8)), torch.full((2, 8), 3.0))
    session.end_step()
    assert session.close()["exported_rows"] == 4, "the compiled graph kept the capture"


def test_bad_input_is_a_clear_python_exception():
    with pytest.raises(ringscope.RingscopeError, match="not supported"):
        rt.attach(torch.nn.Linear(2, 2), "")
    model = tiny()
    with pytest.raises(ringscope.RingscopeError, match="layer 7 does not exist"):
        rt.attach(model, "", layers=[7])
    with pytest.raises(ringscope.RingscopeError, match="unknown site"):
        rt.attach(model, "", sites=["everything"])
    session = ringscope.Session("")
    hp = session.register("x", dtype="f32", row_width=8)
    sink = torch.zeros(1, dtype=torch.uint8)
    session.begin_step(0, [1, 2], [0, 0])
    with pytest.raises(ringscope.RingscopeError, match="contiguous"):
        rt.capture(torch.ones(8, 2).t(), sink, session._h, hp, 8)
    with pytest.raises(ringscope.RingscopeError, match="rows of 8 elements"):
        rt.capture(torch.ones(2, 4), sink, session._h, hp, 8)
    with pytest.raises(ringscope.RingscopeError, match="expected 64"):
        rt.capture(torch.ones(2, 8, dtype=torch.float64), sink, session._h, hp, 8)
    session.end_step()
    session.close()
    with pytest.raises(ringscope.RingscopeError) as e:
        rt.capture(torch.ones(2, 8), sink, session._h, hp, 8)
    assert e.value.status == "RS_ERR_CLOSED"


def test_request_id_tensors_a_recorded_graph_reads_stay_alive_and_current():
    """A graph recorded with a batch of up to 256 rows reads the attachment's request-id tensor at every replay. A
    larger batch later gets a larger tensor: the old one must stay allocated (a replay would read freed memory) and
    keep receiving the ids set afterwards (a replay would name stale requests)."""
    model = tiny()
    session = ringscope.Session({"policy": {"mode": "full"}})
    att = rt.attach(model, session)
    cpu = torch.device("cpu")
    recorded = att._request_id_tensor(cpu, 2)  # what a graph recorded at batch 2 holds
    att.set_request_ids(list(range(100, 400)), device=cpu)  # a 300-row batch: a larger tensor
    assert att._request_id_tensor(cpu, 300).data_ptr() != recorded.data_ptr()
    att.request_ids = [7, 8]
    assert recorded.tolist() == [7, 8]
    att.request_ids = None
    assert recorded.tolist() == [0, 1]
    att.detach()
    session.close()
