"""Two tensor-parallel ranks (tensor_parallel_size=2: vLLM's multiprocessing executor, a worker process per rank,
all-reduces over gloo / shared memory). With ``vllm.ranks = "all"`` each rank captures into a session of its own, in
one run directory (``rank=R`` partitions, a manifest and the plugin's side files per rank); by default only rank 0
captures. Every site captured here is replicated over the ranks (vLLM all-reduces the attention and MLP outputs), so
the ranks' rows must be equal, and equal to the Hugging Face reference."""

import json
import os
import pathlib
import subprocess

import numpy as np
import pytest

import ringscope
from conftest import reference, request_ids

ROOT = pathlib.Path(__file__).resolve().parents[2]
TP_CONFIG = """
[policy]
mode = "full"
[export]
parquet = true
dir = "{{dir}}"
{run_id}
[vllm]
sites = {sites}
{ranks}
# {{requests}}
"""


def inspect_binary() -> str:
    candidates = [os.environ.get("RINGSCOPE_INSPECT")]
    for target in (os.environ.get("CARGO_TARGET_DIR"), ROOT / "target"):
        if target:
            candidates += [pathlib.Path(target) / "release" / "inspect", pathlib.Path(target) / "debug" / "inspect"]
    for c in candidates:
        if c and pathlib.Path(c).is_file():
            return str(c)
    pytest.fail("no inspect binary: build it (cargo build --release -p ringscope-inspect) or set RINGSCOPE_INSPECT")


def served(engines, name, sites, ranks, run_id, scenario="tp"):
    config = TP_CONFIG.format(sites=json.dumps(sites), ranks=ranks, run_id=f'run_id = "{run_id}"' if run_id else "")
    res = engines(name, "eager", scenario, config=config)
    assert res.get("error") is None, res.get("traceback")
    assert res["tensor_parallel_size"] == 2
    # Without export.run_id the ranks must still agree on one run directory (vLLM's instance id names it).
    runs = sorted((pathlib.Path(res["out"]) / "dump").iterdir())
    assert len(runs) == 1 and (run_id is None or runs[0].name == run_id), runs
    return dict(res, run_dir=str(runs[0])), runs[0]


@pytest.fixture(scope="module")
def tp_all(engines):
    return served(engines, "tp_all", ["residual", "attention_output", "mlp_output"], 'ranks = "all"', run_id=None)


@pytest.fixture(scope="module")
def tp_default(engines):
    return served(engines, "tp_default", ["residual"], "", run_id="run")  # vllm.ranks left out: [0]


def rows_of(cols, rank):
    """One rank's rows, ordered by (step, request, position): (keys [n, 3], activations [n, hidden])."""
    m = cols["rank"] == rank
    step, req, pos = cols["step"][m], cols["request_id"][m], cols["position"][m]
    order = np.lexsort((pos, req, step))
    return np.stack([step[order], req[order], pos[order]], axis=1), cols["activation"][m][order]


def check_reference(res, dump, ranks):
    """Each rank's rows are exactly those of every request's every position fed through the model (its prompt and
    every generated token but the last), and equal the reference's rows."""
    reqs = res["requests"]
    rid = request_ids(res)  # rank 0's request map, checked against the documented mapping
    assert rid[1] == 7 and None not in rid
    seqs = [r["prompt"] + r["tokens"][:-1] for r in reqs]
    ref = reference(pathlib.Path(res["out"]) / "model", seqs)
    want = sorted((rid[k], p) for k in range(len(reqs)) for p in range(len(seqs[k])))
    for name, cols in dump.items():
        assert cols["dtype"] == "f32" and cols["activation"].shape[1] == 128
        assert sorted(set(cols["rank"].tolist())) == ranks, name
        for rank in ranks:
            keys, act = rows_of(cols, rank)
            assert sorted(map(tuple, keys[:, 1:].tolist())) == want, (name, rank)
            for k in range(len(reqs)):
                m = keys[:, 1] == rid[k]
                a = act[m][np.argsort(keys[m, 2])]
                b = ref[(k, name)]
                assert a.shape == b.shape
                err = np.linalg.norm(a - b, axis=1) / np.maximum(np.linalg.norm(b, axis=1), 1e-30)
                assert err.max() < 1e-4, (name, rank, k, err.max())
                if len(b) > 1:  # the check tells rows apart: a neighbouring position's row is far off
                    off = np.linalg.norm(a[1:] - b[:-1], axis=1) / np.linalg.norm(b[:-1], axis=1)
                    assert off.min() > 1e-2, (name, rank, k, off.min())


def verify(run):
    p = subprocess.run([inspect_binary(), "--verify", str(run)], capture_output=True, text=True)
    assert p.returncode == 0, p.stdout + p.stderr
    return p.stdout


def test_all_ranks_capture_equal_rows(tp_all):
    res, run = tp_all
    dump = ringscope.read_dump(run)
    assert sorted(dump) == sorted(f"layers.{i}.{s}" for i in range(2) for s in ("resid", "attn_out", "mlp_out"))
    for name in dump:
        assert sorted(p.name for p in (run / f"hookpoint={name}").iterdir()) == ["rank=0", "rank=1"]
    assert (run / "_ringscope_run.json").is_file() and (run / "_ringscope_run.rank=1.json").is_file()
    # Replicated over the ranks: the same (step, request, position) rows, bit for bit the same activations.
    for name, cols in dump.items():
        k0, a0 = rows_of(cols, 0)
        k1, a1 = rows_of(cols, 1)
        assert len(k0) > 0 and np.array_equal(k0, k1), name
        assert np.array_equal(a0, a1), (name, float(np.abs(a0 - a1).max()))
    check_reference(res, dump, ranks=[0, 1])
    verify(run)


def test_all_ranks_side_files(tp_all):
    res, run = tp_all
    side = run / "_ringscope_vllm"
    assert sorted(p.name for p in side.iterdir()) == ["requests.jsonl", "requests.rank=1.jsonl", "summary.json",
                                                       "summary.rank=1.json"]
    # Both ranks saw the same requests at the same steps; each wrote its own map once.
    r0 = (side / "requests.jsonl").read_text().splitlines()
    r1 = (side / "requests.rank=1.jsonl").read_text().splitlines()
    assert len(r0) == len(res["requests"]) and sorted(r0) == sorted(r1)
    dump = ringscope.read_dump(run)
    for rank, f in ((0, "summary.json"), (1, "summary.rank=1.json")):
        s = json.loads((side / f).read_text())
        assert s["rank"] == rank
        rows = sum(int((c["rank"] == rank).sum()) for c in dump.values())
        assert s["session"]["exported_rows"] == rows == s["plugin"]["rows_exported_requested"]
        assert s["plugin"]["lost_rows"] == 0 and s["plugin"]["disabled"] is None


def test_default_ranks_only_rank_0(tp_default):
    res, run = tp_default
    dump = ringscope.read_dump(run)
    assert sorted(dump) == ["layers.0.resid", "layers.1.resid"]
    for name in dump:
        assert [p.name for p in (run / f"hookpoint={name}").iterdir()] == ["rank=0"]
    assert not list(run.glob("_ringscope_run.rank=*.json")) and (run / "_ringscope_run.json").is_file()
    assert sorted(p.name for p in (run / "_ringscope_vllm").iterdir()) == ["requests.jsonl", "summary.json"]
    check_reference(res, dump, ranks=[0])
    verify(run)


ATTN_SITES = ["attn_q", "attn_k", "attn_v"]


@pytest.fixture(scope="module")
def tp_attention(engines):
    return served(engines, "tp_attention", ATTN_SITES, 'ranks = "all"', run_id="attn", scenario="tp_attention")


@pytest.fixture(scope="module")
def tp_attention_mqa(engines):
    return served(engines, "tp_attention_mqa", ATTN_SITES, 'ranks = "all"', run_id="attn", scenario="tp_attention_mqa")


@pytest.mark.parametrize("which", ["gqa", "mqa"])
def test_attention_heads_of_both_ranks_rebuild_hf_eager_attention(request, which):
    """Attention sites under tensor parallelism (issue 40): each rank captures its own heads and says so in its
    manifest — rank 0 query heads 0-1, rank 1 query heads 2-3 (the model has 4) and, over 2 KV heads, KV head 0 and 1;
    over one KV head (MQA, fewer KV heads than ranks) a copy of it each. attention_pattern puts the ranks' heads
    together: every head of every request within 1e-3 of Hugging Face eager attention's weights on the same
    checkpoint (weights far from uniform), one head read from its rank alone; each rank's value rows are its KV
    head's part of v_proj's output."""
    from test_attention import eager_reference

    res, run = request.getfixturevalue("tp_attention" if which == "gqa" else "tp_attention_mqa")
    kv = 2 if which == "gqa" else 1
    meta = ringscope.attention_metadata(run)
    assert sorted(meta) == [0, 1]
    for rank in (0, 1):
        for i in (0, 1):
            e = meta[rank][i]
            assert (e["num_heads"], e["num_kv_heads"], e["head_dim"]) == (2, 1, 32), (rank, i)
            assert (e["q_head_offset"], e["kv_head_offset"], e["total_num_heads"], e["total_num_kv_heads"]) == \
                (2 * rank, rank if kv == 2 else 0, 4, kv), (rank, i)
    dump = ringscope.read_dump(run)
    assert dump["layers.0.attn_q"]["activation"].shape[1] == 2 * 32  # a rank's 2 query heads
    rid = request_ids(res)
    peak = 0.0
    for k, r in enumerate(res["requests"]):
        seq = r["prompt"] + r["tokens"][:-1]
        weights, vs = eager_reference(pathlib.Path(res["out"]) / "model", seq)
        for i in (0, 1):
            got = ringscope.attention_pattern(run, rid[k], i)
            assert got.exact and got.heads == [0, 1, 2, 3]
            np.testing.assert_array_equal(got.query_positions, np.arange(len(seq)))
            np.testing.assert_allclose(got.weights, weights[i], atol=1e-3, rtol=0)
            peak = max(peak, float(weights[i].max()))
            one = ringscope.attention_pattern(run, rid[k], i, head=3)  # rank 1's second head
            np.testing.assert_array_equal(one.weights, got.weights[3])
            v = dump[f"layers.{i}.attn_v"]
            for rank in (0, 1):
                rows = (v["request_id"] == rid[k]) & (v["rank"] == rank)
                got_v = v["activation"][rows][np.argsort(v["position"][rows])]
                head = rank if kv == 2 else 0
                want = vs[i][:, 32 * head:32 * (head + 1)]
                # Relative to each row (the ranks' all-reduce sums in another order than one process: ~1e-6 here).
                err = np.linalg.norm(got_v - want, axis=1) / np.linalg.norm(want, axis=1)
                assert err.max() < 1e-4, (which, i, rank, k, err.max())
    assert peak > 0.6, "attention nearly uniform: the check could not see a wrong head mapping"
    verify(run)
