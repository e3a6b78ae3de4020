"""Attention sites in a compiled vLLM engine (issue 40): `attn_q` / `attn_k` / `attn_v` captured from vLLM's
`Attention` inputs (q and k after RoPE) while it serves several requests with chunked prefill and continuous
batching; `ringscope.attention_pattern` rebuilds from them the weights Hugging Face eager attention gives on the same
checkpoint (`output_attentions=True`) within 1e-3; the values equal Hugging Face's `v_proj` outputs; the manifest says
how vLLM ran each layer. With prefix caching, the rebuild names the key positions no pass computed."""

import json
import pathlib

import numpy as np
import pytest

from conftest import CONFIG, check_overlap_sources, overlap_config, request_ids, work_between_submit_and_end

ATTN_CONFIG = CONFIG.replace('sites = ["residual", "attention_output", "mlp_output"]',
                             'sites = ["attn_q", "attn_k", "attn_v"]')


@pytest.fixture(scope="module")
def attention(engines):
    return engines("attention", "compiled", "attention", config=ATTN_CONFIG)


@pytest.fixture(scope="module")
def attention_window(engines):
    """A Mistral with an 8-key sliding window on every layer (prompts up to 40 tokens)."""
    return engines("attention_window", "compiled", "attention_window", config=ATTN_CONFIG)


def eager_reference(model_dir, seq):
    """Hugging Face's own attention weights and v_proj outputs over ``seq``: ({layer: [heads, n, n]}, {layer: [n, kv·d]})."""
    import torch
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager", dtype="float32").eval()
    vs = {}
    for i, layer in enumerate(m.model.layers):
        layer.self_attn.v_proj.register_forward_hook(
            lambda mod, a, out, i=i: vs.__setitem__(i, out[0].detach().numpy().copy()))
    with torch.no_grad():
        out = m(torch.tensor([seq]), output_attentions=True)
    return {i: a[0].numpy() for i, a in enumerate(out.attentions)}, vs


@pytest.fixture(scope="module")
def attention_overlap(engines):
    """q/k/v of the last layer with vllm.overlap_copy: submitted after its attention, the step ended with the layer."""
    return engines("attention_overlap", "compiled", "attention",
                   config=overlap_config('["attn_q", "attn_k", "attn_v"]', "[1]"),
                   env={"ENGINE_CHECK_SOURCES": "1", "TORCH_LOGS": "output_code"})


@pytest.fixture(scope="module")
def attention_overlap_mid(engines):
    """q/k/v of the first of two layers with vllm.overlap_copy: submitted after its attention, the step ended before
    the next layer's attention."""
    return engines("attention_overlap_mid", "compiled", "attention",
                   config=overlap_config('["attn_q", "attn_k", "attn_v"]', "[0]"),
                   env={"ENGINE_CHECK_SOURCES": "1", "TORCH_LOGS": "output_code"})


def check_rebuild(res, layers):
    """Every request's attention weights rebuilt from the captured q and k of ``layers`` equal Hugging Face eager
    attention's (1e-3), and its v rows Hugging Face's v_proj outputs."""
    import ringscope

    run = pathlib.Path(res["run_dir"])
    dump = ringscope.read_dump(run)
    rids = request_ids(res)
    (closed,) = res["closed"]
    assert closed["session"]["dropped_rows"] == 0 and closed["plugin"]["lost_rows"] == 0
    peak = 0.0
    for k, r in enumerate(res["requests"]):
        seq = r["prompt"] + r["tokens"][:-1]
        weights, vs = eager_reference(pathlib.Path(res["out"]) / "model", seq)
        for i in layers:
            got = ringscope.attention_pattern(run, rids[k], i)
            assert got.exact
            np.testing.assert_array_equal(got.query_positions, np.arange(len(seq)))
            np.testing.assert_allclose(got.weights, weights[i], atol=1e-3, rtol=0)
            peak = max(peak, float(weights[i].max()))
            v = dump[f"layers.{i}.attn_v"]
            rows = v["request_id"] == rids[k]
            got_v = v["activation"][rows][np.argsort(v["position"][rows])]
            np.testing.assert_allclose(got_v, vs[i], rtol=1e-4, atol=1e-5)
    assert peak > 0.6, "attention nearly uniform: the check could not see a wrong mask or head mapping"


def test_vllm_attention_rows_rebuild_hf_eager_attention(attention):
    import ringscope

    assert attention.get("error") is None, attention.get("traceback")
    assert attention["compiled"], attention["compilation_mode"]
    run = pathlib.Path(attention["run_dir"])
    meta = ringscope.attention_metadata(run)[0]
    manifest = json.loads((run / "_ringscope_run.json").read_text())
    assert manifest["metadata"]["attention"]["source"] == "vllm"
    for i in (0, 1):
        e = meta[i]
        assert (e["num_heads"], e["num_kv_heads"], e["head_dim"], e["q_head_offset"]) == (4, 2, 32, 0)
        assert e["scale"] == pytest.approx(32 ** -0.5) and e["sliding_window"] is None and e["softcap"] is None
        assert e["hookpoints"] == {"q": f"layers.{i}.attn_q", "k": f"layers.{i}.attn_k", "v": f"layers.{i}.attn_v"}
    dump = ringscope.read_dump(run)
    assert dump["layers.0.attn_q"]["activation"].shape[1] == 4 * 32
    assert dump["layers.0.attn_k"]["activation"].shape[1] == 2 * 32
    check_rebuild(attention, (0, 1))


def test_overlap_copy_of_the_last_layers_qkv_rebuilds_the_same_attention(attention_overlap):
    # vllm.overlap_copy with q/k/v of the last layer: captured and submitted after its attention (on CUDA the copy
    # runs beside the layer's output projection and MLP), the step ended at the layer's end. Each step submitted
    # once, with every capture before it; the end op receives the captured buffers, unchanged; the rows rebuild
    # Hugging Face's attention.
    res = attention_overlap
    assert res.get("error") is None, res.get("traceback")
    assert res["compiled"], res["compilation_mode"]
    assert res["overlap"] == [1, True, None]
    # The layer's output projection and MLP (3 matrix products) between the submit and the end in the compiled code.
    between = work_between_submit_and_end(res["log"])
    assert between and min(between) >= 3, between
    check_overlap_sources(res, 3)
    check_rebuild(res, (1,))


def test_overlap_copy_of_a_middle_layers_qkv_ends_the_step_before_the_next_attention(attention_overlap_mid):
    # The same for layer 0 of 2: the step ends in a pre-hook of layer 1's attention; between the two ops layer 0's
    # output projection and MLP and layer 1's qkv projection (4 matrix products).
    res = attention_overlap_mid
    assert res.get("error") is None, res.get("traceback")
    assert res["compiled"], res["compilation_mode"]
    assert res["overlap"] == [0, True, 1]
    between = work_between_submit_and_end(res["log"])
    assert between and min(between) >= 4, between
    check_overlap_sources(res, 3)
    check_rebuild(res, (0,))


def test_a_sliding_window_is_read_from_vllm_and_rebuilt(attention_window):
    """vLLM's own window (Attention.sliding_window, from the checkpoint's config) in the manifest, and patterns that
    see only the last 8 keys, as Hugging Face eager Mistral does."""
    import ringscope

    res = attention_window
    assert res.get("error") is None, res.get("traceback")
    run = pathlib.Path(res["run_dir"])
    meta = ringscope.attention_metadata(run)[0]
    assert [meta[i]["sliding_window"] for i in (0, 1)] == [8, 8]
    rids = request_ids(res)
    longest = 0
    for k, r in enumerate(res["requests"]):
        seq = r["prompt"] + r["tokens"][:-1]
        weights, _ = eager_reference(pathlib.Path(res["out"]) / "model", seq)
        for i in (0, 1):
            got = ringscope.attention_pattern(run, rids[k], i)
            np.testing.assert_allclose(got.weights, weights[i], atol=1e-3, rtol=0)
            # Nothing beyond the window: every query's weights on keys 8 or more before it are 0.
            q, kk = np.meshgrid(got.query_positions, got.key_positions, indexing="ij")
            assert (got.weights[:, kk <= q - 8] == 0).all()
        longest = max(longest, len(seq))
    assert longest > 16, "no request longer than twice the window"
