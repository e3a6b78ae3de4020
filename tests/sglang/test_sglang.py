"""The SGLang plugin (ringscope/sglang.py) against a real SGLang engine on CPU (0.5.23; and 0.5.17, through
tests/engine.sh sglang-0.5.17):

- "main": concurrent requests of different lengths, prefilled in 16-token chunks in the same forward passes as the
  others' decodes (SGLang's mixed chunks); then a prefix warmed by one request and shared by three (prefix-cache
  hits). Every exported row of every site equals an independent Hugging Face forward pass over the same checkpoint;
  request ids (one named by the request, the others hashed from SGLang's rid) and positions exact; the cached rows
  counted in the events table, the plugin's counters and the probe's coverage — never captured, never "safe".
- "stop": a probe with ``action = "stop"`` ends the requests it scores after their first forward pass (the one
  request captured with ``requests = "opt_in"``; on CUDA the others' rows are kept out on the device); the others run
  to their end.
- "deferred" (CUDA only): the residual and q/k/v copied by one kernel per pass, against the reference and "main".

RINGSCOPE_SGLANG_TEST_DTYPE=bfloat16 serves the same float32 checkpoint in bfloat16 (looser tolerances, below).
- "plain": SGLang without the plugin's configuration: no session, and the same tokens as with the plugin.
"""

import os
import pathlib
import re

import numpy as np
import pytest

from conftest import (CONFIG, DEVICE, DTYPE, LAST_TOKEN_PASS, TOLERANCE, activations, assert_rows_match,
                      check_rows, fed, mixed_step, positions_of, request_ids, side_file)

#: Attention weights rebuilt from captured q and k equal Hugging Face eager's within this (absolute): float32 on CPU,
#: TF32 attention on CUDA, or bfloat16 q and k.
ATTENTION_TOLERANCE = (1e-3 if TOLERANCE < 1e-3 else 5e-3) if DTYPE == "float32" else 0.1

PROBE = """
[[probes]]
name = "p"
hookpoint = "layers.1.resid"
weights = "{weights}"
thresholds = [1e30]
"""
STOP_PROBE = """
[[probes]]
name = "stop"
hookpoint = "layers.0.resid"
weights = "{weights}"
bias = [1.0]
thresholds = [0.5]
aggregate = "per_token"
action = "stop"
"""


def _weights(tmp_path_factory, w) -> str:
    import ringscope

    d = tmp_path_factory.mktemp("probe")
    return ringscope.save_probe(d / "w.npy", np.asarray(w, dtype=np.float32))["weights"]


@pytest.fixture(scope="module")
def main(engines, tmp_path_factory):
    w = np.random.default_rng(3).standard_normal((1, 64))
    # The attention sites too (test_attention_rebuilds_hf_eager_and_names_the_keys_of_a_cached_prefix).
    config = CONFIG.replace('"mlp_output"]', '"mlp_output", "attn_q", "attn_k", "attn_v"]')
    return engines("main", "main", config=config, extra=PROBE.format(weights=_weights(tmp_path_factory, w)))


@pytest.fixture(scope="module")
def plain(engines):
    return engines("plain", "plain", config=None)


def test_rows_equal_the_reference_with_mixed_prefill_and_decode_batches(main):
    import ringscope

    assert main.get("error") is None, main.get("traceback")
    reqs = main["requests"]
    rid = request_ids(main)
    assert rid[1] == 7 and None not in rid, rid
    cached = [r["cached_tokens"] for r in reqs]
    dump = ringscope.read_dump(main["run_dir"])
    assert sorted(dump) == sorted(f"layers.{i}.{s}" for i in range(2)
                                  for s in ("resid", "attn_out", "mlp_out", "attn_q", "attn_k", "attn_v"))
    dump = {k: v for k, v in dump.items() if not k.endswith(("attn_q", "attn_k", "attn_v"))}
    check_rows(main, dump, rid, cached)
    # Attention and MLP outputs are overwritten in place later in the pass: copied at their sites, also on CUDA.
    assert side_file(main, "summary.json")["deferred_captures"] is False
    lens = {rid[k]: len(r["prompt"]) for k, r in enumerate(reqs)}
    assert mixed_step(dump, lens), "no forward pass mixed a prefill and a decode: the scenario does not test batching"


def test_attention_rebuilds_hf_eager_and_names_the_keys_of_a_cached_prefix(main):
    """attn_q / attn_k / attn_v from SGLang's RadixAttention inputs: the manifest says how SGLang ran each layer; a
    request computed from position 0 rebuilds the weights of Hugging Face eager attention on the same checkpoint; one
    whose prefix came from the radix cache names the key positions no pass of it computed."""
    import torch

    import ringscope
    from conftest import hf_model

    reqs = main["requests"]
    rid = request_ids(main)
    run = main["run_dir"]
    meta = ringscope.attention_metadata(run)[0]
    for i in (0, 1):
        assert (meta[i]["num_heads"], meta[i]["num_kv_heads"], meta[i]["head_dim"]) == (4, 2, 16)
        assert meta[i]["scale"] == pytest.approx(16 ** -0.5) and meta[i]["sliding_window"] is None
    model = hf_model(pathlib.Path(main["out"]) / "model")
    dump = ringscope.read_dump(run, "layers.1.attn_v")["layers.1.attn_v"]
    checked = cached_seen = 0
    peak = worst = 0.0
    for k, r in enumerate(reqs):
        seq = fed(r, positions_of(dump, rid[k]))
        if r["cached_tokens"]:
            c = r["cached_tokens"]
            with pytest.raises(ringscope.RingscopeError, match=rf"key positions with no layers\.0\.attn_k row: 0\.\.{c - 1} "):
                ringscope.attention_pattern(run, rid[k], 0)
            got = ringscope.attention_pattern(run, rid[k], 0, allow_missing=True)
            np.testing.assert_array_equal(got.missing_key_positions, np.arange(c))
            cached_seen += 1
            continue
        vs = {}
        h = model.model.layers[1].self_attn.v_proj.register_forward_hook(
            lambda mod, a, out: vs.__setitem__("v", out[0].detach().numpy().copy()))
        with torch.no_grad():
            ref = model(torch.tensor([seq]), output_attentions=True).attentions
        h.remove()
        for i in (0, 1):
            got = ringscope.attention_pattern(run, rid[k], i)
            np.testing.assert_array_equal(got.query_positions, np.arange(len(seq)))
            worst = max(worst, float(np.abs(got.weights - ref[i][0].numpy()).max()))
            np.testing.assert_allclose(got.weights, ref[i][0].numpy(), atol=ATTENTION_TOLERANCE,
                                       rtol=0)
            peak = max(peak, float(ref[i][0].max()))
        rows = dump["request_id"] == rid[k]
        v = activations(dump)[rows][np.argsort(dump["position"][rows])]
        assert_rows_match(v, vs["v"], ("layers.1.attn_v", k), TOLERANCE)
        checked += 1
    print(f"attention weights: worst absolute difference {worst:.2e} (tolerance {ATTENTION_TOLERANCE:g})")
    assert checked >= 3 and cached_seen >= 1, (checked, cached_seen)
    assert peak > 0.6, "attention nearly uniform: the check could not see a wrong mask or head mapping"


@pytest.mark.skipif(DEVICE == "cpu", reason="captures are deferred on CUDA only (the CPU ring copies rows at once)")
def test_deferred_captures_give_the_rows_copied_at_their_sites(engines, main):
    """With only sites nothing overwrites later in the pass (the residual, q/k/v) the plugin defers its captures on
    CUDA: one copy kernel at the end of each forward pass reads every captured tensor. The residual rows equal the
    reference; q/k/v equal the rows the main engine copied at their sites (same requests, same scenario)."""
    import ringscope

    config = CONFIG.replace('"attention_output", "mlp_output"]', '"attn_q", "attn_k", "attn_v"]')
    res = engines("deferred", "main", config=config)
    assert res.get("error") is None, res.get("traceback")
    assert side_file(res, "summary.json")["deferred_captures"] is True
    assert side_file(main, "summary.json")["deferred_captures"] is False  # attention / MLP outputs: copied at once
    rid, mine = request_ids(res), request_ids(main)
    dump = ringscope.read_dump(res["run_dir"])
    check_rows(res, {k: v for k, v in dump.items() if k.endswith(".resid")}, rid,
               [r["cached_tokens"] for r in res["requests"]])
    theirs = ringscope.read_dump(main["run_dir"])
    def by_position(cols, request):
        rows = activations(cols)[cols["request_id"] == request]
        return dict(zip(positions_of(cols, request).tolist(), rows))

    for name in (f"layers.{i}.attn_{x}" for i in range(2) for x in "qkv"):
        for k in range(len(res["requests"])):
            got, want = by_position(dump[name], rid[k]), by_position(theirs[name], mine[k])
            # The same positions (with the overlap scheduler one engine may have run a last token the other did not).
            common = sorted(got.keys() & want.keys())
            assert common and len(common) >= max(len(got), len(want)) - LAST_TOKEN_PASS, (name, k)
            # Row by row, relative (layer 0's v rows of a repeated token are equal: no neighbour check here).
            assert_rows_match(np.stack([got[p] for p in common]), np.stack([want[p] for p in common]), (name, k),
                              TOLERANCE, neighbours=False)
    assert side_file(res, "summary.json")["session"]["dropped_rows"] == 0


def test_prefix_cache_hits_are_counted_in_the_events_table_and_the_coverage(main):
    import ringscope

    reqs = main["requests"]
    rid = request_ids(main)
    cached = [r["cached_tokens"] for r in reqs]
    # SGLang's own count (meta_info["cached_tokens"]) is the independent check. The three requests after the warm-up
    # share its 64-token prefix; the first three share their first tokens too (their prompts start alike), so the one
    # prefilled last finds part of its prompt cached by the earlier ones' chunks.
    assert cached[3:] == [0, 64, 64, 64], cached
    hits = [k for k, c in enumerate(cached) if c]
    summary = side_file(main, "summary.json")
    assert (summary["plugin"]["cached_requests"], summary["plugin"]["cached_rows"]) == (len(hits), sum(cached))
    assert summary["plugin"]["disabled"] is None and summary["plugin"]["lost_rows"] == 0
    events = [e for e in ringscope.read_events(main["run_dir"]) if e["kind"] == "cached"]
    assert sorted((e["detail"], e["rows_lost"], e["reason"], e["hookpoint"]) for e in events) == sorted(
        (f"request={rid[k]} positions=0..{cached[k]}", cached[k], "prefix_cache", "") for k in hits)
    reports = {r["request_id"]: r for r in side_file(main, "probe_reports.jsonl") if r["probe"] == "p"}
    scored = ringscope.read_dump(main["run_dir"], "layers.1.resid")["layers.1.resid"]
    for k, r in enumerate(reqs):
        cov = reports[rid[k]]["coverage"]
        assert cov["cached"] == cached[k], (k, cov)
        computed = len(fed(r, positions_of(scored, rid[k]))) - cached[k]
        # On CUDA the steps begin inside SGLang's graphs: the plugin tells the probes each pass's rows from the host
        # (Session.note_step_rows), so "expected" is the engine's own count there too.
        assert (cov["scored"], cov["expected"], cov["unobserved"]) == (computed, computed, 0), (k, cov)
    # The session's own accounting balances (every row produced was exported or counted).
    s = summary["session"]
    assert s["produced_rows"] == s["exported_rows"] + s["dropped_rows"] + s["sampled_out_rows"]
    assert s["dropped_rows"] == 0


def test_a_stop_probe_ends_the_request_it_flags_and_only_that_one(engines, tmp_path_factory):
    """The stop probe flags every row it scores: it ends each captured request after its first forward pass (the token
    generated there is kept) while the others run to their end. ``requests = "opt_in"``: only the first request is
    captured (the third's malformed ringscope parameter keeps it out, counted); on CUDA the other requests' rows are
    kept out of the capture on the device — no row of no request in the files. With the overlap scheduler on CUDA a
    stopped request may get one more token (its next batch can be scheduled before the flag is read)."""
    import ringscope

    cuda = DEVICE != "cpu"
    stop = engines("stop", "stop", requests="opt_in",
                   extra=STOP_PROBE.format(weights=_weights(tmp_path_factory, np.zeros((1, 64)))))

    assert stop.get("error") is None, stop.get("traceback")
    captured = (True, False, False)
    most = 2 if cuda and os.environ.get("RINGSCOPE_SGLANG_TEST_OVERLAP") == "1" else 1
    for r, cap in zip(stop["requests"], captured):
        if cap:
            assert 1 <= len(r["tokens"]) <= most and r["finish_reason"]["type"] == "stop", r
            assert r["finish_reason"].get("ringscope", {}).get("step") is not None, r["finish_reason"]
        else:
            assert len(r["tokens"]) == 8 and r["finish_reason"]["type"] == "length", r
    rid = request_ids(stop)
    assert [x is not None for x in rid] == list(captured), rid
    summary = side_file(stop, "summary.json")
    assert summary["plugin"]["stopped_requests"] == sum(captured)
    # The malformed {"ringscope": "yes"} is counted and warned about (named in the log), never an engine error.
    assert summary["plugin"]["bad_extra_args"] == 1 and summary["plugin"]["disabled"] is None
    assert 'custom_params["ringscope"] = \'yes\'' in stop["log"], stop["log"][-3000:]
    dump = ringscope.read_dump(stop["run_dir"])
    # Only the captured request's rows, on CUDA too (the others' are kept out on the device, not exported as rows of
    # no request).
    assert set(dump["layers.0.resid"]["request_id"].astype(np.uint64).tolist()) == {x for x in rid if x is not None}


#: (how the server is stopped, where its scheduler is then): engine.STOPS x engine.PLACES. A signal to the server's
#: process alone never reaches the scheduler: for those, the scheduler busy with a request in flight.
SERVER_STOPS = [("term", "busy"), ("int", "busy"),
                ("ctrlc", "idle"), ("ctrlc", "check"), ("ctrlc", "busy"),
                ("termgroup", "idle"), ("termgroup", "check"), ("termgroup", "busy")]
#: Each scenario runs this many times (RINGSCOPE_SGLANG_STOP_REPEATS; where a signal lands must not matter).
REPEATS = int(os.environ.get("RINGSCOPE_SGLANG_STOP_REPEATS", "2"))


@pytest.mark.parametrize("stop,place,n", [(s, p, n) for s, p in SERVER_STOPS for n in range(REPEATS)])
def test_a_launch_server_run_is_complete_however_the_server_is_stopped(engines, main, stop, place, n):
    """``python -m sglang.launch_server`` stopped by SIGTERM or SIGINT to its process, or by SIGINT (Ctrl-C) or
    SIGTERM to its whole process group, while its scheduler is held idle, inside SGLang's own memory checks, or
    inside a forward pass with a request in flight (tests/sglang/stub/ringscope_sglang_testhooks.py): the run is
    complete — manifest and summary written, accounting balanced, every row of the finished requests there and equal
    to the reference, no row of a request the run does not know — and nothing of the server is left behind."""
    import ringscope

    if DEVICE != "cpu" or os.environ.get("RINGSCOPE_SGLANG_TEST_OVERLAP") == "1":
        pytest.skip("the server scenarios run on CPU, in the first pass")
    res = engines(f"server-{stop}-{place}-{n}", f"server-{stop}-{place}")
    run = pathlib.Path(res["run_dir"])
    server_log = (pathlib.Path(res["out"]) / "server.log").read_text()
    assert res.get("error") is None, (res.get("traceback"), server_log[-3000:])
    assert res["held"][1] == place, res["held"]  # the signal was sent while the scheduler was there
    assert res["server_exit"] != "killed after 150 s", server_log[-3000:]
    assert res["left_behind"] is False, server_log[-3000:]
    # Stopping waits for no timeout (the plugin waits up to 60 s for a scheduler that neither answers nor exits).
    assert res["shutdown_seconds"] < 45, (res["shutdown_seconds"], server_log[-3000:])
    assert (run / "_ringscope_run.json").exists(), server_log[-3000:]
    summary = side_file(res, "summary.json")
    assert summary["plugin"]["disabled"] is None and summary["plugin"]["lost_rows"] == 0
    s = summary["session"]
    assert s["produced_rows"] == s["exported_rows"] + s["dropped_rows"] + s["sampled_out_rows"]
    assert s["dropped_rows"] == 0
    rid = request_ids(res)
    assert rid[1] == 7 and None not in rid, rid
    dump = ringscope.read_dump(res["run_dir"])
    # The server's own requests (its warm-up) and the one in flight are captured too, each a request of the map.
    known = {x["request_id"] for x in side_file(res, "requests.jsonl")}
    ours = {}
    for name, cols in dump.items():
        ids = cols["request_id"].astype(np.uint64)
        assert set(ids.tolist()) <= known, name
        keep = np.isin(ids, np.asarray(rid, dtype=np.uint64))
        ours[name] = {k: (v[keep] if isinstance(v, np.ndarray) and len(v) == len(ids) else v) for k, v in cols.items()}
    check_rows(res, ours, rid, [r["cached_tokens"] for r in res["requests"]])
    # The served tokens are the in-process engine's (same checkpoint, same greedy requests).
    assert [r["tokens"] for r in res["requests"]] == [r["tokens"] for r in main["requests"][:3]]


def test_without_the_configuration_sglang_runs_unchanged(plain, main):
    assert plain.get("error") is None, plain.get("traceback")
    assert not pathlib.Path(plain["run_dir"]).exists()
    assert "ringscope" not in plain["log"].lower() or "registered" not in plain["log"]
    assert [r["tokens"] for r in plain["requests"]] == [r["tokens"] for r in main["requests"][:3]]


def test_an_unsupported_model_or_version_is_a_clear_error(monkeypatch, tmp_path):
    import ringscope.sglang as rs
    from ringscope import RingscopeError

    class GPT2LMHeadModel:  # a model class the plugin does not support
        pass

    class Runner:
        model = GPT2LMHeadModel()

    with pytest.raises(RingscopeError, match="GPT2LMHeadModel is not supported.*LlamaForCausalLM"):
        rs.SglangCapture.install(Runner(), rs.parse_config({}))
    # Devices: CPU; CUDA only with the experimental path's opt-in, which then needs the CUDA ring in best-effort
    # mode (it defaults to them, and refuses others by name); anything else refused.
    import torch

    rs.check_device(torch.device("cpu"))
    monkeypatch.delenv(rs.ENV_CUDA, raising=False)
    with pytest.raises(RingscopeError, match=f"experimental.*{rs.ENV_CUDA}=1"):
        rs.check_device(torch.device("cuda", 0))
    monkeypatch.setenv(rs.ENV_CUDA, "1")
    rs.check_device(torch.device("cuda", 0))
    with pytest.raises(RingscopeError, match="supports SGLang on CPU only"):
        rs.check_device(torch.device("meta"))
    monkeypatch.delenv(rs.ENV_CUDA)
    planned = [("layers.0.resid", "residual", 0)]
    cfg = rs._engine.session_config(rs.parse_config({}), planned, "f32", 64, cuda=True)
    assert (cfg["ring"]["backend"], cfg["policy"]["mode"]) == ("cuda", "best_effort")
    with pytest.raises(RingscopeError, match='policy.mode = "best_effort".*got ring.backend = .cuda., policy.mode = .full.'):
        rs._engine.session_config(rs.parse_config({"policy": {"mode": "full"}}), planned, "f32", 64, cuda=True)
    assert "ring" not in rs._engine.session_config(rs.parse_config({}), planned, "f32", 64)
    # ring.max_batch_rows on CUDA: defaults to the largest forward pass; a smaller value is refused by name.
    cfg = rs._engine.session_config(rs.parse_config({}), planned, "f32", 64, cuda=True, max_rows=9000)
    assert cfg["ring"]["max_batch_rows"] == 9000
    with pytest.raises(RingscopeError, match="ring.max_batch_rows = 100, but a forward pass .* 9000 token rows"):
        rs._engine.session_config(rs.parse_config({"ring": {"max_batch_rows": 100}}), planned, "f32", 64, cuda=True,
                                  max_rows=9000)
    # What the CUDA path cannot do is refused at install, naming it: speculative decoding; requests = "opt_in" with a
    # library that cannot keep the captured requests' rows only (before C ABI 11).
    import types

    class LlamaForCausalLM:  # a supported model class whose parameters are on a CUDA device (no GPU needed)
        model = types.SimpleNamespace(layers=[object(), object()])
        config = types.SimpleNamespace(hidden_size=64)

        def parameters(self):
            return iter([types.SimpleNamespace(device=torch.device("cuda", 0), dtype=torch.float32)])

    def cuda_runner(**server_args):
        return types.SimpleNamespace(model=LlamaForCausalLM(), server_args=types.SimpleNamespace(**server_args))

    monkeypatch.setenv(rs.ENV_CUDA, "1")
    with pytest.raises(RingscopeError, match="speculative_algorithm = 'EAGLE' is not supported on CUDA"):
        rs.SglangCapture.install(cuda_runner(speculative_algorithm="EAGLE"), rs.parse_config({}))
    with monkeypatch.context() as m:
        m.setattr(rs._engine, "_has_call", lambda call: call != "rs_begin_step_graph_kept")
        with pytest.raises(RingscopeError, match='requests = "opt_in" on CUDA needs a library with '
                                                 'rs_begin_step_graph_kept'):
            rs.SglangCapture.install(cuda_runner(), rs.parse_config({"sglang": {"requests": "opt_in"}}))
    # A deferred copy of an output SGLang overwrites in place within the step (its fused add-norm) is refused.
    with pytest.raises(RingscopeError, match="defer_captures = true with the site.s. mlp_output: SGLang overwrites"):
        rs.SglangCapture.install(cuda_runner(), rs.parse_config({"sglang": {"sites": ["residual", "mlp_output"]},
                                                                 "ring": {"defer_captures": True}}))
    monkeypatch.delenv(rs.ENV_CUDA)
    cfg = tmp_path / "c.toml"
    cfg.write_text("[sglang]\nsites = [\"logits\"]\n")
    monkeypatch.setenv(rs.ENV_CONFIG, str(cfg))
    with pytest.raises(RingscopeError, match="sglang.sites"):
        rs.load_config(cfg)
    # The kill switch: configured, but off — nothing is patched.
    monkeypatch.setenv(rs.ENV_DISABLE, "1")
    monkeypatch.setattr(rs._PLUGIN, "registered", False)
    rs.register()
    from sglang.srt.model_executor.model_runner import ModelRunner

    assert not getattr(ModelRunner.forward, "_ringscope", False)
    monkeypatch.delenv(rs.ENV_DISABLE)
    import sglang

    monkeypatch.setattr(sglang, "__version__", "0.4.0")
    monkeypatch.setattr(rs._PLUGIN, "registered", False)
    supported = ", ".join(rs.SUPPORTED_SGLANG)
    with pytest.raises(RingscopeError, match=re.escape(f"supports SGLang {supported}; this is SGLang 0.4.0")):
        rs.register()
    # SGLang 0.5.17's layers return (their MLP's output, the stream before it): the residual is their sum, and
    # anything else from a layer is a clear error (the hook then switches capture off, naming it).
    monkeypatch.setattr(sglang, "__version__", "0.5.17")
    pick = rs._residual_pick()
    h, r = torch.ones(2, 4), torch.full((2, 4), 2.0)
    assert torch.equal(pick((h, r), (), {}), h + r)
    with pytest.raises(RingscopeError, match=r"a decoder layer returned Tensor, not \(hidden_states, residual\)"):
        pick(h, (), {})
