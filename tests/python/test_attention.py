"""Attention sites (issue 40): `attach`'s `attn_q` / `attn_k` / `attn_v` rows are the query and key after RoPE and the
value each layer's attention receives, bit for bit; the run's manifest says how each layer attends; and
`ringscope.attention_pattern` rebuilds from them the weights Hugging Face eager attention returns
(`output_attentions=True`) within 1e-3 — GQA and MQA, a sliding window on some layers or all, q/k norms before RoPE,
logit soft-capping — for several left-padded requests in one batch, and over a prefill plus decode steps. Bad input
(a model whose attention is not supported, a layer or head or request that is not there, keys that were not captured)
is a clear error. Random tiny models built from configs (no download), weights scaled up so that attention is far
from uniform (a mask or head-mapping mistake would not hide in near-equal weights).

Runnable as a script on a GPU too (`python tests/python/test_attention.py`): the same checks on the CUDA backend.
Skipped when torch or transformers is missing, unless RINGSCOPE_REQUIRE_TORCH is set (.ci/run sets it).
"""
import os

import numpy as np
import pytest

pytestmark = pytest.mark.torch

if os.environ.get("RINGSCOPE_REQUIRE_TORCH"):
    import torch
    import transformers
else:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")

import ringscope
import ringscope.torch as rt

PAD = 0
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, max_position_embeddings=128,
              pad_token_id=PAD, bos_token_id=1, eos_token_id=2, initializer_range=0.35)


def model_of(kind, device="cpu"):
    """A tiny random model of ``kind`` (eager attention, float32) and what its layers should say about themselves."""
    torch.manual_seed(0)
    if kind == "llama":  # GQA: 4 query heads over 2 KV heads
        cfg = transformers.LlamaConfig(num_attention_heads=4, num_key_value_heads=2, **COMMON)
        windows = [None, None]
    elif kind == "qwen2":  # MQA, layer 0 full, layer 1 a window of 4 keys
        cfg = transformers.Qwen2Config(num_attention_heads=4, num_key_value_heads=1, use_sliding_window=True,
                                       sliding_window=4, max_window_layers=1, **COMMON)
        windows = [None, 4]
    elif kind == "qwen3":  # q_norm / k_norm between the projections and RoPE
        cfg = transformers.Qwen3Config(num_attention_heads=4, num_key_value_heads=2, head_dim=16, **COMMON)
        windows = [None, None]
    elif kind == "mistral":  # a window of 3 keys on every layer
        cfg = transformers.MistralConfig(num_attention_heads=4, num_key_value_heads=2, sliding_window=3, **COMMON)
        windows = [3, 3]
    elif kind == "gemma2":  # logits soft-capped, query_pre_attn_scalar, sliding layers alternating
        cfg = transformers.Gemma2Config(num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=4,
                                        attn_logit_softcapping=2.0, query_pre_attn_scalar=8, **COMMON)
        windows = [4, None]
    else:
        raise ValueError(kind)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float32)
    return model.eval().to(device), windows


def session_for(tmp_path, device, run="r"):
    ring = {"backend": "cuda"} if device == "cuda" else {}
    return ringscope.Session({"ring": ring, "policy": {"mode": "full"},
                              "export": {"parquet": True, "dir": str(tmp_path), "run_id": run}})


def batch(device, lengths=(9, 6, 11)):
    """Left-padded prompts of ``lengths`` tokens (all longer than the windows above)."""
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 128, (n,), generator=g).tolist() for n in lengths]
    width = max(lengths)
    ids = torch.tensor([[PAD] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    return prompts, ids, mask


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "mistral", "gemma2"])
def test_rebuilt_patterns_equal_eager_attention_weights(tmp_path, device, kind):
    model, windows = model_of(kind, device)
    session = session_for(tmp_path, device)
    att = rt.attach(model, session, sites=("attn_q", "attn_k", "attn_v"))
    prompts, ids, mask = batch(device)
    with torch.no_grad():
        out = model(ids, attention_mask=mask, output_attentions=True, use_cache=False)
    session.close()
    run = tmp_path / "r"
    meta = ringscope.attention_metadata(run)[0]
    assert [meta[i]["sliding_window"] for i in range(2)] == windows
    for i in range(2):
        attn = model.model.layers[i].self_attn
        assert meta[i]["scale"] == pytest.approx(attn.scaling)
        assert (meta[i]["num_heads"], meta[i]["num_kv_heads"], meta[i]["head_dim"]) == \
            (model.config.num_attention_heads, model.config.num_key_value_heads, attn.head_dim)
        assert meta[i]["softcap"] == (2.0 if kind == "gemma2" else None)
        assert meta[i]["hookpoints"] == {"q": f"layers.{i}.attn_q", "k": f"layers.{i}.attn_k",
                                         "v": f"layers.{i}.attn_v"}
    ids_of_rows = att.current_request_ids(len(prompts))
    width = ids.shape[1]
    for b, p in enumerate(prompts):
        pad = width - len(p)
        for i in range(2):
            ref = out.attentions[i][b, :, pad:, pad:].float().cpu().numpy()
            got = ringscope.attention_pattern(run, ids_of_rows[b], i)
            assert got.exact and got.heads == [0, 1, 2, 3]
            np.testing.assert_array_equal(got.query_positions, np.arange(len(p)))
            np.testing.assert_array_equal(got.key_positions, np.arange(len(p)))
            np.testing.assert_allclose(got.weights, ref, atol=1e-3, rtol=0)
            # Far from uniform: a mistake in the mask or the head mapping would show.
            assert ref.max() > 0.6, ref.max()
            one = ringscope.attention_pattern(run, ids_of_rows[b], i, head=3)
            np.testing.assert_array_equal(one.weights, got.weights[3])


def test_rows_are_the_tensors_the_attention_function_receives(tmp_path, monkeypatch):
    """q and k after RoPE, v as the model computed them: bit for bit what eager attention is called with."""
    from transformers.models.qwen3 import modeling_qwen3

    model, _ = model_of("qwen3")
    seen = []
    original = modeling_qwen3.eager_attention_forward

    def spy(module, query, key, value, *args, **kwargs):
        seen.append((module.layer_idx, query.detach().clone(), key.detach().clone(), value.detach().clone()))
        return original(module, query, key, value, *args, **kwargs)

    monkeypatch.setattr(modeling_qwen3, "eager_attention_forward", spy)
    session = session_for(tmp_path, "cpu")
    rt.attach(model, session, sites=("attn_q", "attn_k", "attn_v"), layers=[1])
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    with torch.no_grad():
        model(ids, use_cache=False)
    session.close()
    dump = ringscope.read_dump(tmp_path / "r")
    _, q, k, v = next(s for s in seen if s[0] == 1)  # [1, heads, seq, dim]
    for name, ref in (("attn_q", q), ("attn_k", k), ("attn_v", v)):
        rows = dump[f"layers.1.{name}"]["activation"]
        want = ref[0].transpose(0, 1).reshape(ids.shape[1], -1).numpy()
        np.testing.assert_array_equal(rows, want)
    assert set(dump) == {"layers.1.attn_q", "layers.1.attn_k", "layers.1.attn_v"}


def test_the_rows_come_from_the_models_own_rope_wrapped_only_while_attached(tmp_path):
    """Nothing is computed again: the rows are the outputs of the model's apply_rotary_pos_emb, wrapped while an
    attachment needs it. A model of the same family that is not attached runs as before and adds no rows; two
    models attached at once each get their own rows; detaching the last puts the original function back."""
    from transformers.models.llama import modeling_llama

    def users():  # taps using the wrapper (attachments of earlier tests that were never detached count too)
        patch = rt._RotaryPatch._by_module.get(modeling_llama.__name__)
        return patch.users if patch is not None else 0

    before = users()
    original = getattr(modeling_llama.apply_rotary_pos_emb, "__wrapped__", modeling_llama.apply_rotary_pos_emb)
    (a, _), (b, _), (plain, _) = model_of("llama"), model_of("llama"), model_of("llama")
    with torch.no_grad():
        for p in b.parameters():  # b differs from a: rows swapped between the two would show
            p.mul_(0.5)
    ids = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
    with torch.no_grad():
        want = plain(ids).logits
    one, two = session_for(tmp_path, "cpu", "one"), session_for(tmp_path, "cpu", "two")
    att_a = rt.attach(a, one, sites=("attn_q", "attn_k"))
    att_b = rt.attach(b, two, sites=("attn_k",), layers=[1])
    assert modeling_llama.apply_rotary_pos_emb.__wrapped__ is original and users() == before + 3
    with torch.no_grad():
        torch.testing.assert_close(plain(ids).logits, want, rtol=0, atol=0)  # not attached: not captured
        a(ids)
        b(ids)
    att_b.detach()
    assert modeling_llama.apply_rotary_pos_emb.__wrapped__ is original and users() == before + 2  # a needs it
    with torch.no_grad():
        a(ids[:1])
    att_a.detach()
    assert users() == before
    if before == 0:
        assert modeling_llama.apply_rotary_pos_emb is original
    assert one.close()["dropped_rows"] == 0 and two.close()["dropped_rows"] == 0
    d1, d2 = ringscope.read_dump(tmp_path / "one"), ringscope.read_dump(tmp_path / "two")
    assert sorted(d1) == ["layers.0.attn_k", "layers.0.attn_q", "layers.1.attn_k", "layers.1.attn_q"]
    assert list(d2) == ["layers.1.attn_k"]
    for name in d1:
        assert d1[name]["activation"].shape[0] == 8 + 4, name  # two steps: 2 x 4 tokens, then 1 x 4
    assert d2["layers.1.attn_k"]["activation"].shape[0] == 8

    def keys(model, layer):  # the keys the model's cache holds: what its attention used
        with torch.no_grad():
            out = model(ids, use_cache=True)
        k = out.past_key_values.layers[layer].keys  # [batch, kv heads, seq, head_dim], post-RoPE
        return k.transpose(1, 2).reshape(8, -1).numpy()

    np.testing.assert_array_equal(d1["layers.1.attn_k"]["activation"][:8], keys(a, 1))
    np.testing.assert_array_equal(d2["layers.1.attn_k"]["activation"], keys(b, 1))
    assert not np.array_equal(keys(a, 1), keys(b, 1))
    with torch.no_grad():  # detached: the model runs without ringscope
        torch.testing.assert_close(a(ids).logits, want, rtol=0, atol=0)


def test_attention_that_does_not_call_its_rope_is_a_clear_error(tmp_path, monkeypatch):
    """An attention module whose forward calls no apply_rotary_pos_emb of its module is refused at attach; one whose
    function was replaced after attach (a kernel library patching the model) fails its first forward pass, naming the
    layer, instead of capturing nothing."""
    from transformers.models.llama import modeling_llama

    class OwnAttention(modeling_llama.LlamaAttention):
        def forward(self, *args, **kwargs):
            return super().forward(*args, **kwargs)

    model, _ = model_of("llama")
    model.model.layers[1].self_attn.__class__ = OwnAttention
    with pytest.raises(ringscope.RingscopeError, match=r"layer 1's attention \(.*OwnAttention\) does not call an "
                                                        r"apply_rotary_pos_emb"):
        rt.attach(model, session_for(tmp_path, "cpu", "own"), sites=("attn_k",))
    session = session_for(tmp_path, "cpu")
    att = rt.attach(model, session, sites=("attn_q",), layers=[0])
    monkeypatch.setattr(modeling_llama, "apply_rotary_pos_emb", lambda q, k, cos, sin, unsqueeze_dim=1: (q, k))
    with pytest.raises(ringscope.RingscopeError, match=r"returned without calling its modeling module's "
                                                        r"apply_rotary_pos_emb.* \(layer 0\)"):
        with torch.no_grad():
            model(torch.tensor([[5, 6, 7]]))
    # Attaching another model of the family now would install the wrapper over the replacement: refused.
    other, _ = model_of("llama")
    with pytest.raises(ringscope.RingscopeError, match=r"modeling_llama\.apply_rotary_pos_emb was replaced while"):
        rt.attach(other, session_for(tmp_path, "cpu", "other"), sites=("attn_q",))
    monkeypatch.undo()  # the wrapper back in place, then removed by the detach
    att.detach()
    session.close()
    # Put back, unless attachments of earlier tests (never detached) still use the wrapper.
    assert (modeling_llama.__name__ in rt._RotaryPatch._by_module
            or not hasattr(modeling_llama.apply_rotary_pos_emb, "__wrapped__"))


def test_a_model_of_the_family_in_another_thread_is_not_captured_and_models_are_freed(tmp_path):
    """While an attached model's attention runs, a model of the same family running in another thread (not attached)
    neither is captured nor changes the attached model's rows; and an attached model dropped without detach() is
    freed (the wrapper holds no tap)."""
    import gc
    import threading
    import weakref

    model, _ = model_of("llama")
    other, _ = model_of("llama")
    with torch.no_grad():
        for p in other.parameters():
            p.mul_(0.5)
    ids = torch.tensor([[5, 6, 7, 8]])
    session = session_for(tmp_path, "cpu")
    att = rt.attach(model, session, sites=("attn_k",), layers=[0])

    def run_other(module, args):  # inside layer 0's attention, after its RoPE, before its taps capture
        t = threading.Thread(target=lambda: other(ids))
        t.start()
        t.join()

    handle = model.model.layers[0].self_attn.o_proj.register_forward_pre_hook(run_other)
    with torch.no_grad():
        out = model(ids, use_cache=True)
    handle.remove()
    want = out.past_key_values.layers[0].keys.transpose(1, 2).reshape(4, -1).numpy()
    assert session.close()["dropped_rows"] == 0
    rows = ringscope.read_dump(tmp_path / "r", "layers.0.attn_k")["layers.0.attn_k"]["activation"]
    np.testing.assert_array_equal(rows, want)

    ref = weakref.ref(model)
    del model, att, out
    gc.collect()
    assert ref() is None, "an attached model dropped without detach() is still alive"


def test_an_attach_that_fails_part_way_leaves_nothing_installed(tmp_path, monkeypatch):
    """A failure after the hooks went in (here: the session refusing the attention metadata) takes them out again —
    hooks, the RoPE wrapper, the taps' lists, the sink buffer — and a later attach works."""
    from transformers.models.llama import modeling_llama

    model, _ = model_of("llama")

    def hooks():
        return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())

    before, rope = hooks(), modeling_llama.apply_rotary_pos_emb
    session = session_for(tmp_path, "cpu")

    def refuse(key, value):
        raise ringscope.RingscopeError("RS_ERR_INVALID_ARGUMENT", "refused for the test")

    monkeypatch.setattr(session, "set_metadata", refuse)
    with pytest.raises(ringscope.RingscopeError, match="refused for the test"):
        rt.attach(model, session, sites=("attn_q", "attn_k", "residual"))
    assert hooks() == before and modeling_llama.apply_rotary_pos_emb is rope
    assert not any(hasattr(m, "_ringscope_sink") for m in model.modules())
    assert not any("_ringscope_taps" in m.__dict__ for m in model.modules())
    monkeypatch.undo()
    att = rt.attach(model, session, sites=("attn_q", "attn_k"))
    with torch.no_grad():
        model(torch.tensor([[5, 6, 7]]))
    att.detach()
    assert session.close()["exported_rows"] == 2 * 2 * 3


@pytest.mark.parametrize("device", DEVICES)
def test_a_prefill_and_decode_steps_rebuild_the_whole_sequence(tmp_path, device):
    """Keys gathered over steps (the prompt's prefill, then one token per decode step) give the weights a single
    forward pass over the final sequence gives."""
    model, _ = model_of("qwen2", device)
    session = session_for(tmp_path, device)
    att = rt.attach(model, session, sites=("attn_q", "attn_k"))
    prompts, ids, mask = batch(device, (7, 5))
    with torch.no_grad():
        gen = model.generate(ids, attention_mask=mask, max_new_tokens=5, min_new_tokens=5, do_sample=False,
                             pad_token_id=PAD)
    rids = att.current_request_ids(2)
    session.close()
    att.detach()
    fed = gen[:, :-1]  # the last generated token was never fed back
    full_mask = torch.cat([mask, torch.ones_like(fed[:, mask.shape[1]:])], dim=1)
    with torch.no_grad():
        ref = model(fed, attention_mask=full_mask, output_attentions=True, use_cache=False).attentions
    for b, p in enumerate(prompts):
        pad = ids.shape[1] - len(p)
        n = len(p) + 4
        for i in range(2):
            got = ringscope.attention_pattern(tmp_path / "r", rids[b], i)
            np.testing.assert_array_equal(got.query_positions, np.arange(n))
            np.testing.assert_allclose(got.weights, ref[i][b, :, pad:, pad:].float().cpu().numpy(), atol=1e-3, rtol=0)


def test_a_compiled_static_cache_generate_captures_q_k_v_without_graph_breaks(tmp_path):
    """`generate` with a static cache, its decode step compiled by inductor with fullgraph=True (a graph break would
    fail it): the attention hooks are traced into the graph, and the rows rebuild the eager weights. (Llama: a static
    cache of a sliding-window model recompiles as it fills, whatever is attached.)"""
    from torch._dynamo.utils import counters

    model, _ = model_of("llama")
    session = session_for(tmp_path, "cpu")
    att = rt.attach(model, session, sites=("attn_q", "attn_k", "attn_v"))
    att.set_request_ids([41, 42])
    prompt = torch.tensor([[5, 6, 7, 8, 9], [9, 10, 11, 12, 13]])
    gc = transformers.GenerationConfig(
        max_new_tokens=5, min_new_tokens=5, do_sample=False, pad_token_id=PAD, cache_implementation="static",
        compile_config=transformers.CompileConfig(fullgraph=True, backend="inductor", mode="default"))
    gc.compile_config._compile_all_devices = True  # transformers compiles on GPUs only unless told
    graphs = counters["stats"]["unique_graphs"]
    with torch.no_grad():
        gen = model.generate(prompt, attention_mask=torch.ones_like(prompt), generation_config=gc)
    assert counters["stats"]["unique_graphs"] - graphs == 1 and not counters["graph_break"]
    stats = session.close()
    att.detach()
    assert stats["dropped_rows"] == 0
    with torch.no_grad():
        ref = model(gen[:, :-1], output_attentions=True, use_cache=False).attentions
    for b, rid in enumerate([41, 42]):
        for i in range(2):
            got = ringscope.attention_pattern(tmp_path / "r", rid, i)
            np.testing.assert_array_equal(got.query_positions, np.arange(9))
            np.testing.assert_allclose(got.weights, ref[i][b].float().numpy(), atol=1e-3, rtol=0)
    v = ringscope.read_dump(tmp_path / "r", "layers.1.attn_v")["layers.1.attn_v"]
    assert v["activation"].shape == (2 * 9, 2 * 16)  # 2 KV heads of 16


def test_keys_not_captured_are_named_or_left_out_when_allowed(tmp_path):
    """A step whose key rows were not captured: the rebuild names the positions; with allow_missing their columns
    are NaN, every row sums to 1 over the captured keys, and the pattern says it is not exact."""
    model, _ = model_of("llama")
    session = session_for(tmp_path, "cpu")
    att = rt.attach(model, session, sites=("attn_q", "attn_k"))
    k0 = att.hookpoints["layers.0.attn_k"]
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        session.set_enabled(k0, False)  # the prefill's keys of layer 0 are not captured
        out = model(ids, use_cache=True)
        session.set_enabled(k0, True)
        model(torch.tensor([[10]]), past_key_values=out.past_key_values, use_cache=True)
    rid = att.current_request_ids(1)[0]
    session.close()
    with pytest.raises(ringscope.RingscopeError, match=r"key positions with no layers\.0\.attn_k row: 0\.\.4"):
        ringscope.attention_pattern(tmp_path / "r", rid, 0)
    got = ringscope.attention_pattern(tmp_path / "r", rid, 0, allow_missing=True)
    assert not got.exact
    np.testing.assert_array_equal(got.missing_key_positions, np.arange(5))
    assert np.isnan(got.weights[:, :, :5]).all()
    # Queries at 0..4 see only missing keys; the one at 5 sees itself: weight 1.
    np.testing.assert_allclose(got.weights[:, 5, 5], 1.0)
    assert ringscope.attention_pattern(tmp_path / "r", rid, 1).exact  # layer 1 lost nothing


def test_bad_requests_are_clear_errors(tmp_path):
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    with pytest.raises(ringscope.RingscopeError, match=r"attn_q, attn_k, attn_v are not supported for model type "
                                                        r"'gpt2' \(supported: llama, qwen2, qwen3, mistral, gemma2\)"):
        rt.attach(gpt2, session_for(tmp_path, "cpu", "g"), sites=("attn_q",))

    model, _ = model_of("llama")
    session = session_for(tmp_path, "cpu")
    att = rt.attach(model, session, sites=("attn_q", "attn_k", "residual"), layers=[1])
    with torch.no_grad():
        model(torch.tensor([[5, 6, 7]]))
    rid = att.current_request_ids(1)[0]
    session.close()
    run = tmp_path / "r"
    with pytest.raises(ringscope.RingscopeError, match=r"layer 0 has no attention metadata .* \(layers with them: \[1\]\)"):
        ringscope.attention_pattern(run, rid, 0)
    with pytest.raises(ringscope.RingscopeError, match=r"head 4 is out of range: layer 1 has 4 query heads \(0\.\.3\)"):
        ringscope.attention_pattern(run, rid, 1, head=4)
    with pytest.raises(ringscope.RingscopeError, match=rf"request {rid + 7} has no layers\.1\.attn_q rows .*requests "
                                                        rf"there: {rid}\)"):
        ringscope.attention_pattern(run, rid + 7, 1)
    for bad in (-1, 1.5, "1", None):
        with pytest.raises(ringscope.RingscopeError, match="request"):
            ringscope.attention_pattern(run, bad, 1)
    with pytest.raises(ringscope.RingscopeError, match="layer"):
        ringscope.attention_pattern(run, rid, -1)
    with pytest.raises(ringscope.RingscopeError, match="head"):
        ringscope.attention_pattern(run, rid, 1, head=-1)
    with pytest.raises(ringscope.RingscopeError, match="allow_missing"):
        ringscope.attention_pattern(run, rid, 1, allow_missing="yes")
    with pytest.raises(ringscope.RingscopeError, match="is not a run directory"):
        ringscope.attention_pattern(tmp_path / "nope", rid, 1)

    # A run without attention sites: no metadata to rebuild from.
    plain = session_for(tmp_path, "cpu", "plain")
    rt.attach(model, plain, sites=("residual",))
    with torch.no_grad():
        model(torch.tensor([[5, 6, 7]]))
    plain.close()
    with pytest.raises(ringscope.RingscopeError, match="has no attention metadata .*capture sites attn_q and attn_k"):
        ringscope.attention_pattern(tmp_path / "plain", 0, 0)

    # Only attn_q: the rebuild says what is lacking.
    only_q = session_for(tmp_path, "cpu", "q")
    rt.attach(model, only_q, sites=("attn_q",))
    with torch.no_grad():
        model(torch.tensor([[5, 6, 7]]))
    only_q.close()
    with pytest.raises(ringscope.RingscopeError, match="captured without attn_k: rebuilding its attention needs both"):
        ringscope.attention_pattern(tmp_path / "q", 0, 0)


def test_set_metadata_refuses_what_is_not_json(tmp_path):
    session = session_for(tmp_path, "cpu")
    for key, value, says in ((1, 1, "key must be a str"), ("k", object(), "is not JSON"),
                             ("k", float("nan"), "is not JSON"), ("a b", 1, "A-Z a-z 0-9"), ("k\0", 1, "NUL")):
        with pytest.raises(ringscope.RingscopeError, match=says):
            session.set_metadata(key, value)
    session.set_metadata("k", {"a": [1, 2.5, None, "x"]})
    session.close()
    with pytest.raises(ringscope.ClosedError):
        session.set_metadata("k", 1)
    import json
    manifest = json.loads((tmp_path / "r" / "_ringscope_run.json").read_text())
    assert manifest["metadata"] == {"k": {"a": [1, 2.5, None, "x"]}}



def test_the_example_draws_a_head_that_equals_eager_attention(tmp_path, capsys):
    """examples/attention_pattern.py, as the README runs it: the drawn pattern is the eager one."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[2] / "examples" / "attention_pattern.py"
    spec = importlib.util.spec_from_file_location("attention_pattern_example", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    assert example.main(["--out", str(tmp_path), "--layer", "1", "--head", "2"]) < 1e-6
    text = capsys.readouterr().out
    assert "layer 1, head 2 of request 0" in text and "largest difference" in text
    assert text.count("|") >= 2 * 16  # one drawn row per query


def test_the_metadata_says_what_ran_not_what_the_config_carries(tmp_path):
    """Gemma2 under SDPA (its default) runs without its soft-cap: refused (load it with eager); a Llama checkpoint
    whose config carries a `sliding_window` Llama never applies: no window; a second attach on the session adds
    its layers."""
    cfg = transformers.Gemma2Config(num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=4,
                                    attn_logit_softcapping=2.0, **COMMON)
    sdpa = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()
    with pytest.raises(ringscope.RingscopeError, match="soft-caps its attention logits, which the attention "
                                                        "implementation 'sdpa' does not apply"):
        rt.attach(sdpa, session_for(tmp_path, "cpu", "g"), sites=("attn_q",))

    torch.manual_seed(0)
    llama = transformers.AutoModelForCausalLM.from_config(
        transformers.LlamaConfig(num_attention_heads=4, num_key_value_heads=2, sliding_window=3, **COMMON),
        attn_implementation="eager").eval()
    session = session_for(tmp_path, "cpu")
    a0 = rt.attach(llama, session, sites=("attn_q", "attn_k"), layers=[0])
    a0.detach()
    rt.attach(llama, session, sites=("attn_q", "attn_k"), layers=[1])
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    with torch.no_grad():
        ref = llama(ids, output_attentions=True).attentions
    session.close()
    meta = ringscope.attention_metadata(tmp_path / "r")[0]
    assert sorted(meta) == [0, 1] and meta[1]["sliding_window"] is None and meta[1]["attn_implementation"] == "eager"
    got = ringscope.attention_pattern(tmp_path / "r", 0, 1)
    np.testing.assert_allclose(got.weights, ref[1][0].numpy(), atol=1e-3, rtol=0)  # all 6 keys, no window


def test_engine_attention_that_cannot_be_rebuilt_is_refused_by_name():
    """The vLLM and SGLang plugins read their metadata from the engine's attention modules: variants whose rows
    would not be what the engine attends over are refused at load, naming why (stand-ins for the engines' modules)."""
    import types

    from ringscope import sglang as rsg
    from ringscope import vllm as rv

    class Attention:  # vLLM's plain attention layer, as far as the plugin reads it
        def __init__(self, **kw):
            self.num_heads, self.num_kv_heads, self.head_size, self.sliding_window = 4, 1, 16, None  # tp = 2
            self.attn_type, self.kv_cache_dtype, self.query_quant = "decoder", "auto", None
            self.impl = types.SimpleNamespace(scale=0.25, logits_soft_cap=0, alibi_slopes=None, sinks=None)
            self.__dict__.update(kw)

    def vllm_layer(**kw):
        return types.SimpleNamespace(self_attn=types.SimpleNamespace(attn=Attention(**kw)))

    model = types.SimpleNamespace(config=types.SimpleNamespace(num_attention_heads=8, num_key_value_heads=2))
    ok = rv._attention_entry(model, vllm_layer(sliding_window=4096), 3, rank=1)
    assert (ok["q_head_offset"], ok["kv_head_offset"], ok["sliding_window"], ok["softcap"], ok["scale"]) == \
        (4, 1, 4096, None, 0.25)
    replicated = rv._attention_entry(model, vllm_layer(num_heads=2, num_kv_heads=1), 0, rank=3)  # tp = 4 > 2 KV heads
    assert (replicated["q_head_offset"], replicated["kv_head_offset"]) == (6, 1)
    for kw, says in (({"kv_cache_dtype": "fp8_e4m3"}, "keeps its KV cache as fp8_e4m3"),
                     ({"query_quant": object()}, "quantises its queries"),
                     ({"attn_type": "encoder_decoder"}, "is encoder_decoder attention"),
                     ({"head_size_v": 8}, "has values of another head size"),
                     ({"impl": types.SimpleNamespace(scale=1.0, alibi_slopes=[1.0])}, "uses ALiBi"),
                     ({"impl": types.SimpleNamespace(scale=1.0, sinks=[0.0])}, "has attention sinks"),
                     ({"kv_sharing_target_layer_name": "model.layers.0"}, "shares its KV cache")):
        with pytest.raises(ringscope.RingscopeError, match=rf"layer 3 of SimpleNamespace {says}"):
            rv._attention_entry(model, vllm_layer(**kw), 3, rank=0)

    class MLAAttention(Attention):
        pass

    mla = types.SimpleNamespace(self_attn=types.SimpleNamespace(attn=MLAAttention()))
    with pytest.raises(ringscope.RingscopeError, match="uses MLAAttention, not vLLM's plain Attention"):
        rv._attention_entry(model, mla, 3, rank=0)

    class RadixAttention:
        def __init__(self, **kw):
            self.tp_q_head_num, self.tp_k_head_num, self.head_dim, self.v_head_dim = 4, 2, 16, 16
            self.scaling, self.logit_cap, self.sliding_window_size = 0.25, 0.0, 3
            self.__dict__.update(kw)

    def sglang_layer(**kw):
        return types.SimpleNamespace(self_attn=types.SimpleNamespace(attn=RadixAttention(**kw)))

    e = rsg._attention_entry(model, sglang_layer(), 0)
    assert (e["sliding_window"], e["softcap"], e["scale"]) == (4, None, 0.25)  # SGLang's W - 1, stored as W
    assert rsg._attention_entry(model, sglang_layer(sliding_window_size=-1), 0)["sliding_window"] is None
    for kw, says in (({"is_cross_attention": True}, "is cross-attention"), ({"v_head_dim": 8}, "another head size"),
                     ({"use_irope": True}, "chunked local attention")):
        with pytest.raises(ringscope.RingscopeError, match=says):
            rsg._attention_entry(model, sglang_layer(**kw), 0)


def test_gemma2_sites_other_than_attention_are_the_models_own_tensors(tmp_path):
    """Gemma2 came to `attach` with the attention sites: its residual rows are output_hidden_states (every layer but
    the last, whose entry is after the final norm) and its attention_output rows the attention module's output."""
    model, _ = model_of("gemma2")
    session = session_for(tmp_path, "cpu")
    rt.attach(model, session, sites=("residual", "attention_output"))
    attn_out = []
    h = model.model.layers[1].self_attn.register_forward_hook(lambda m, a, out: attn_out.append(out[0][0].detach()))
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        hs = model(ids, output_hidden_states=True).hidden_states
    h.remove()
    session.close()
    dump = ringscope.read_dump(tmp_path / "r")
    np.testing.assert_array_equal(dump["layers.0.resid"]["activation"], hs[1][0].numpy())
    np.testing.assert_array_equal(dump["layers.1.attn_out"]["activation"], attn_out[0].numpy())


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_plan_states_each_sites_row_bytes_before_anything_is_attached(tmp_path, kind):
    """`ringscope.torch.plan` says what `attach` would capture and its bytes per token without attaching; the rows a
    run then holds are exactly that wide, and what attach refuses, plan refuses alike."""
    model, _ = model_of(kind)
    sites = ["attn_q", "attn_k", "attn_v", "residual", "tokens"]
    p = rt.plan(model, sites=sites, layers=[1])
    assert not any(getattr(m, "_forward_hooks", None) for m in model.modules()), "plan attached hooks"
    heads, kv_heads, hd = model.config.num_attention_heads, model.config.num_key_value_heads, 16
    want = {"layers.1.attn_q": heads * hd * 4, "layers.1.attn_k": kv_heads * hd * 4,
            "layers.1.attn_v": kv_heads * hd * 4, "layers.1.resid": 64 * 4, "tokens": 8}
    assert {h["name"]: h["row_bytes"] for h in p["hookpoints"]} == want
    assert p["bytes_per_token"] == sum(want.values())
    assert p["ring_bytes_per_token"] == sum(want.values()) + 16 * len(want)
    # What a run holds: every hookpoint's rows exactly that wide, one row per token.
    s = session_for(tmp_path, "cpu")
    att = rt.attach(model, s, sites=sites, layers=[1])
    prompts, ids, mask = batch("cpu")
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
    att.detach()
    s.close()
    dump = ringscope.read_dump(str(tmp_path / "r"))
    tokens = sum(len(x) for x in prompts)
    for name, row_bytes in want.items():
        rows = dump[name]["activation"]
        assert rows.shape[0] == tokens, name
        assert rows.shape[1] * rows.dtype.itemsize == row_bytes, name
    # Refused alike.
    for k, bad in enumerate(({"sites": ["attn_z"]}, {"layers": [2]})):
        with pytest.raises(ringscope.RingscopeError) as planned:
            rt.plan(model, **{"sites": sites, **bad})
        other = session_for(tmp_path, "cpu", run=f"bad{k}")
        with pytest.raises(ringscope.RingscopeError) as attached:
            rt.attach(model, other, **{"sites": sites, **bad})
        other.close()
        assert str(planned.value) == str(attached.value)


if __name__ == "__main__":
    import sys
    sys.exit(pytest.main([__file__, "-v", "-p", "no:cacheprovider"]))
