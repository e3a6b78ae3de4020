"""`ringscope.attention_pattern` without torch: a run written through the plain Session API (as a C engine would
write one, `rs_session_set_metadata` included) by two tensor-parallel ranks, each holding half of the query and KV
heads, rebuilt and compared with attention computed by the definition — a loop over heads, queries and keys in
float64 — for causal, sliding-window, soft-capped and sink-carrying layers; several steps and requests interleaved,
a position computed twice (the later row wins). Bad metadata and rows that disagree with it are clear errors.
"""
import json
import math
import re

import numpy as np
import pytest

import ringscope

H, KV, D = 8, 2, 4
N = 9  # positions of request 5 (request 6 has N - 2)


def reference(q, k, scale, window=None, softcap=None, sinks=None):
    """[H, N, N] float64: the attention weights by their definition, one (head, query, key) at a time."""
    n = q.shape[0]
    out = np.zeros((H, n, n))
    for h in range(H):
        g = h // (H // KV)
        for i in range(n):
            logits = {}
            for j in range(n):
                if j > i or (window is not None and j <= i - window):
                    continue
                s = scale * float(np.dot(q[i, h].astype(np.float64), k[j, g].astype(np.float64)))
                if softcap:
                    s = softcap * math.tanh(s / softcap)
                logits[j] = s
            m = max(list(logits.values()) + ([sinks[h]] if sinks is not None else []))
            z = sum(math.exp(v - m) for v in logits.values()) + (math.exp(sinks[h] - m) if sinks is not None else 0)
            for j, v in logits.items():
                out[h, i, j] = math.exp(v - m) / z
    return out


def write_run(root, q, k, layer_meta, extra_rows=True, url=None, skip_k_step=None):
    """Two ranks, each a Session with its half of the heads; request 5 (N tokens) is prefilled in two steps and
    request 6 beside it; request 5's position 3 is computed again in a last step (recomputation after preemption),
    with other values (×1.25): the rebuild must use those."""
    rng = np.random.default_rng(9)
    q6 = rng.standard_normal((N - 2, H, D)).astype(np.float32)
    k6 = rng.standard_normal((N - 2, KV, D)).astype(np.float32)
    for rank in (0, 1):
        hs, ks = slice(rank * H // 2, (rank + 1) * H // 2), slice(rank * KV // 2, (rank + 1) * KV // 2)
        where = {"url": url} if url else {"dir": str(root)}
        s = ringscope.Session({"export": {"parquet": True, **where, "run_id": "r", "rank": rank}})
        qh = s.register("layers.0.attn_q", site="attn_q", layer=0, dtype="f32", row_width=H // 2 * D)
        kh = s.register("layers.0.attn_k", site="attn_k", layer=0, dtype="f32", row_width=KV // 2 * D)
        steps = [([5] * 5 + [6] * 4, list(range(5)) + list(range(4)), [q[:5], q6[:4]], [k[:5], k6[:4]]),
                 ([5] * (N - 5) + [6] * (N - 6), list(range(5, N)) + list(range(4, N - 2)),
                  [q[5:], q6[4:]], [k[5:], k6[4:]])]
        if extra_rows:
            steps.append(([5], [3], [q[3:4] * 1.25], [k[3:4] * 1.25]))
        for step, (rids, pos, qs, kks) in enumerate(steps):
            s.begin_step(step, rids, pos)
            s.capture(qh, np.ascontiguousarray(np.concatenate(qs)[:, hs].reshape(len(rids), -1)))
            if step != skip_k_step:
                s.capture(kh, np.ascontiguousarray(np.concatenate(kks)[:, ks].reshape(len(rids), -1)))
            s.end_step()
        entry = dict(layer_meta, layer=0, num_heads=H // 2, num_kv_heads=KV // 2, head_dim=D,
                     q_head_offset=rank * H // 2, kv_head_offset=rank * KV // 2, total_num_heads=H,
                     total_num_kv_heads=KV, causal=True,
                     hookpoints={"q": "layers.0.attn_q", "k": "layers.0.attn_k"})
        if entry.get("sinks") is not None:
            entry["sinks"] = entry["sinks"][hs]
        s.set_metadata("attention", {"format": 1, "source": "test", "layers": [entry]})
        s.close()
    return f"{url}/r" if url else root / "r"


@pytest.mark.parametrize("case", [
    {"scale": 0.5},
    {"scale": 0.5, "sliding_window": 3},
    {"scale": 0.7, "softcap": 1.5},
    {"scale": 0.5, "sinks": [0.3, -1.0, 2.0, 0.0, 1.0, -0.5, 0.25, 3.0]},
], ids=["causal", "window", "softcap", "sinks"])
def test_two_ranks_rebuild_attention_by_its_definition(tmp_path, case):
    rng = np.random.default_rng(1)
    q = (rng.standard_normal((N, H, D)) * 1.5).astype(np.float32)
    k = (rng.standard_normal((N, KV, D)) * 1.5).astype(np.float32)
    meta = {"scale": case["scale"], "sliding_window": case.get("sliding_window"), "softcap": case.get("softcap"),
            "sinks": case.get("sinks"), "alibi_slopes": None}
    run = write_run(tmp_path, q, k, meta)
    q[3] *= 1.25  # the latest step's row of position 3
    k[3] *= 1.25
    want = reference(q, k, case["scale"], case.get("sliding_window"), case.get("softcap"), case.get("sinks"))
    got = ringscope.attention_pattern(run, 5, 0)
    assert got.heads == list(range(H)) and got.exact
    np.testing.assert_array_equal(got.query_positions, np.arange(N))
    np.testing.assert_array_equal(got.key_positions, np.arange(N))
    np.testing.assert_allclose(got.weights, want, atol=1e-6, rtol=0)
    one = ringscope.attention_pattern(run, 5, 0, head=6)  # on rank 1
    np.testing.assert_array_equal(one.weights, got.weights[6])
    meta_by_rank = ringscope.attention_metadata(run)
    assert sorted(meta_by_rank) == [0, 1] and meta_by_rank[1][0]["q_head_offset"] == H // 2
    # inspect merges the ranks' manifests and says what can be rebuilt.
    import subprocess

    from test_retention import inspect_binary

    out = subprocess.run([inspect_binary(), "--verify", str(run)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    notes = [f"window {case['sliding_window']}"] if "sliding_window" in case else []
    notes += [f"softcap {case['softcap']}"] if "softcap" in case else []
    assert f"attention: layers [0] from test ({H} query / {KV} KV heads{'; ' + ', '.join(notes) if notes else ''})" \
        in out.stdout, out.stdout


def test_bad_metadata_and_rows_that_disagree_are_clear_errors(tmp_path):
    rng = np.random.default_rng(2)
    q = rng.standard_normal((N, H, D)).astype(np.float32)
    k = rng.standard_normal((N, KV, D)).astype(np.float32)
    run = write_run(tmp_path / "a", q, k, {"scale": 0.5, "alibi_slopes": [0.1] * (H // 2)})
    with pytest.raises(ringscope.RingscopeError, match="layer 0 uses ALiBi, which attention_pattern does not rebuild"):
        ringscope.attention_pattern(run, 5, 0)
    run = write_run(tmp_path / "b", q, k, {"scale": 0.5, "head_dim": D, "num_heads": H // 2})
    with pytest.raises(ringscope.RingscopeError, match="head 8 is out of range: layer 0 has 8 query heads"):
        ringscope.attention_pattern(run, 5, 0, head=8)
    # A manifest whose widths disagree with the files.
    for name in ("_ringscope_run.json", "_ringscope_run.rank=1.json"):
        m = json.loads((run / name).read_text())
        m["metadata"]["attention"]["layers"][0]["head_dim"] = 5
        (run / name).write_text(json.dumps(m))
    with pytest.raises(ringscope.RingscopeError, match="has rows of 16 elements but its layer's attention metadata "
                                                        "says 20"):
        ringscope.attention_pattern(run, 5, 0)
    m = json.loads((run / "_ringscope_run.json").read_text())
    m["metadata"]["attention"]["format"] = 99
    (run / "_ringscope_run.json").write_text(json.dumps(m))
    with pytest.raises(ringscope.RingscopeError, match="attention metadata is format 99; this ringscope reads format 1"):
        ringscope.attention_metadata(run)


def test_keys_not_captured_are_nan_only_where_a_query_sees_them(tmp_path):
    """Request 5's keys at positions 5..8 are not captured (the second step's attn_k): queries 0..4 never see them
    (weight 0, exact for those rows), queries 5..8 do (NaN there, the rest a softmax over the captured keys)."""
    rng = np.random.default_rng(3)
    q = rng.standard_normal((N, H, D)).astype(np.float32)
    k = rng.standard_normal((N, KV, D)).astype(np.float32)
    run = write_run(tmp_path, q, k, {"scale": 0.5}, extra_rows=False, skip_k_step=1)
    with pytest.raises(ringscope.RingscopeError, match=r"key positions with no layers\.0\.attn_k row: 5\.\.8 "):
        ringscope.attention_pattern(run, 5, 0)
    got = ringscope.attention_pattern(run, 5, 0, allow_missing=True)
    assert not got.exact and list(got.missing_key_positions) == [5, 6, 7, 8]
    want = reference(q, k, 0.5)
    np.testing.assert_allclose(got.weights[:, :5], want[:, :5], atol=1e-6, rtol=0)  # untouched by the missing keys
    assert np.isnan(got.weights[:, 5:, 5:]).sum() == H * (1 + 2 + 3 + 4)  # exactly the (query, key) pairs seen
    np.testing.assert_allclose(np.nansum(got.weights[:, 5:], axis=2), 1.0, atol=1e-6)


@pytest.mark.parametrize("bad, says", [
    ({"num_kv_heads": 0}, "num_kv_heads = 0; give an integer >= 1"),
    ({"num_kv_heads": 3}, "num_heads = 4 is not a multiple of num_kv_heads = 3"),
    ({"scale": None}, "scale = None; give a positive number"),
    ({"scale": float("inf")}, "scale = inf; give a positive number"),
    ({"sliding_window": -2}, "sliding_window = -2; give an integer >= 1"),
    ({"softcap": "big"}, "softcap = 'big'; give a positive number or null"),
    ({"sinks": [1.0]}, "sinks must be null or 4 numbers"),
    ({"head_dim": True}, "head_dim = True; give an integer >= 1"),
])
def test_malformed_metadata_is_named(tmp_path, bad, says):
    """Metadata a C engine wrote wrongly (rs_session_set_metadata takes any JSON): the key is named."""
    rng = np.random.default_rng(5)
    q = rng.standard_normal((N, H, D)).astype(np.float32)
    k = rng.standard_normal((N, KV, D)).astype(np.float32)
    run = write_run(tmp_path, q, k, {"scale": 0.5})
    for name in ("_ringscope_run.json", "_ringscope_run.rank=1.json"):
        m = json.loads((run / name).read_text())
        m["metadata"]["attention"]["layers"][0].update(bad)
        (run / name).write_text(json.dumps(m, allow_nan=True))
    with pytest.raises(ringscope.RingscopeError, match=re.escape(says)):
        ringscope.attention_pattern(run, 5, 0)
