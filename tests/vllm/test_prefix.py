"""vLLM's prefix caching made visible (issue 29): requests whose first tokens came from the prefix cache are never
computed there, so ringscope sees only their other rows — and records the cached ones: the plugin's counters, a
`cached` row per such request in the events table, and `coverage["cached"]` of the probe's report on it."""

import pathlib

import numpy as np
import pytest

from conftest import CONFIG, assert_rows_match, reference, request_ids

PREFIX_CONFIG = CONFIG.replace('"mlp_output"]', '"mlp_output", "attn_q", "attn_k"]') + """
[[probes]]
name = "p"
hookpoint = "layers.1.resid"
weights = "{{weights}}"
thresholds = [1e30]
"""


@pytest.fixture(scope="module")
def prefix(engines, tmp_path_factory):
    import ringscope

    d = tmp_path_factory.mktemp("probe")
    w = np.random.default_rng(3).standard_normal((1, 128)).astype(np.float32)
    probe = ringscope.save_probe(d / "p.npy", w)
    return engines("prefix", "eager", "prefix", config=PREFIX_CONFIG.replace("{{weights}}", probe["weights"]))


def test_cached_rows_are_counted_never_captured_and_the_rest_is_exact(prefix):
    import ringscope

    assert prefix.get("error") is None, prefix.get("traceback")
    reqs = prefix["requests"]
    cached = [r["num_cached_tokens"] for r in reqs]
    # 32-token blocks: the second request shares 64 tokens (two blocks), the third 40 (one whole block).
    assert cached == [0, 64, 32, 0], cached
    rid = request_ids(prefix)
    (closed,) = prefix["closed"]
    assert (closed["plugin"]["cached_requests"], closed["plugin"]["cached_rows"]) == (2, 96)
    dump = ringscope.read_dump(prefix["run_dir"])
    seqs = [r["prompt"] + r["tokens"][:-1] for r in reqs]
    ref = reference(pathlib.Path(prefix["out"]) / "model", seqs)
    for name, cols in dump.items():
        if name.endswith(("attn_q", "attn_k")):
            continue  # test_attention_of_a_cached_prefix_names_the_keys_not_computed
        req, pos, act = cols["request_id"], cols["position"], cols["activation"]
        for k, r in enumerate(reqs):
            rows = req == rid[k]
            # Exactly the positions the engine computed: from the first uncached one to the last fed token.
            assert sorted(pos[rows].tolist()) == list(range(cached[k], len(seqs[k]))), (name, k)
            order = np.argsort(pos[rows])
            assert_rows_match(act[rows][order], ref[(k, name)][cached[k]:], (name, k))
    # The events table names each cached span; the probe's coverage counts it (not as scored, not as expected).
    events = [e for e in ringscope.read_events(prefix["run_dir"]) if e["kind"] == "cached"]
    assert sorted((e["detail"], e["rows_lost"], e["reason"]) for e in events) == sorted(
        (f"request={rid[k]} positions=0..{c}", c, "prefix_cache") for k, c in enumerate(cached) if c)
    for k, r in enumerate(reqs):
        cov = prefix["coverage"][r["vllm_request_id"]]
        assert cov["cached"] == cached[k], (k, cov)
        assert cov["scored"] == cov["expected"] == len(seqs[k]) - cached[k], (k, cov)


def test_attention_of_a_cached_prefix_names_the_keys_not_computed(prefix):
    """The queries of a request whose first 64 tokens came from the prefix cache see keys no pass of it computed: the
    rebuild names them (or, allowed, leaves their columns NaN); a request without a cache hit rebuilds exactly what
    Hugging Face eager attention gives."""
    import torch

    import ringscope
    from conftest import hf_model

    reqs = prefix["requests"]
    rid = request_ids(prefix)
    run = prefix["run_dir"]
    with pytest.raises(ringscope.RingscopeError, match=r"see key positions with no layers\.1\.attn_k row: 0\.\.63 "
                                                        r"\(taken from a prefix cache"):
        ringscope.attention_pattern(run, rid[1], 1)
    got = ringscope.attention_pattern(run, rid[1], 1, allow_missing=True)
    n = len(reqs[1]["prompt"]) + len(reqs[1]["tokens"]) - 1
    assert not got.exact
    np.testing.assert_array_equal(got.missing_key_positions, np.arange(64))
    np.testing.assert_array_equal(got.query_positions, np.arange(64, n))
    assert np.isnan(got.weights[:, :, :64]).all()
    np.testing.assert_allclose(got.weights[:, :, 64:].sum(axis=2), 1.0, atol=1e-5)

    seq = reqs[0]["prompt"] + reqs[0]["tokens"][:-1]
    with torch.no_grad():
        ref = hf_model(pathlib.Path(prefix["out"]) / "model")(torch.tensor([seq]), output_attentions=True).attentions
    for i in (0, 1):
        exact = ringscope.attention_pattern(run, rid[0], i)
        np.testing.assert_allclose(exact.weights, ref[i][0].numpy(), atol=1e-3, rtol=0)
