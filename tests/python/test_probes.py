"""Issue 15, probes from Python (ctypes over the C ABI's probe calls) on the host backend:

(a) planted-direction synthetic data: the per-request mean scores (`probe_request`) and a fused probe's per-row scores
    (its `probes.<name>` hookpoint, read back with `read_dump`) equal a numpy reference within 1e-5 relative, the
    AUROC of the means is >= 0.99, alerts fire exactly once for exactly the planted requests, and only those are
    flagged;
(b) the Hugging Face integration on CPU: a tiny random Llama generates for two prompts with a stop probe, and
    `ProbeStoppingCriteria` ends exactly the flagged row at the step the probe flags it while the other row goes on;
(c) bad input: probes that cannot work are refused at start (nothing started), and bad arguments are a
    RingscopeError naming them.

Needs the built library (RINGSCOPE_LIB, or the checkout's target/release); (b) needs torch and transformers (skipped
without them unless RINGSCOPE_REQUIRE_TORCH is set).
"""
import math
import os
import time

import numpy as np
import pytest
import ringscope

RingscopeError = ringscope.RingscopeError

D = 32
REQUESTS = 24
PROMPT = 6
DECODE = 6
TOKENS = PROMPT + DECODE
HP = "layers.3.residual"


def planted_direction():
    u = np.random.default_rng(7).standard_normal(D)
    return (u / np.linalg.norm(u)).astype(np.float32)


def is_planted(request):
    return request % 4 == 1


def token(request, position):
    """A request's token: noise, plus 3 x the planted direction for planted requests (float32, as captured)."""
    x = np.random.default_rng(request * 1_000_003 + position * 7919 + 1).standard_normal(D).astype(np.float32)
    if is_planted(request):
        x = x + np.float32(3.0) * planted_direction()
    return x


def probe_weights():
    """Output 0 reads the planted direction; output 1 a random one (threshold 100: never alerts)."""
    w = np.stack([planted_direction(), (0.1 * np.random.default_rng(99).standard_normal(D)).astype(np.float32)])
    return w, np.array([-0.25, 0.5], dtype=np.float32)


def auroc(scores, labels):
    """Area under the ROC curve (ties count half), in numpy."""
    scores, labels = np.asarray(scores, dtype=np.float64), np.asarray(labels, dtype=bool)
    pos, neg = scores[labels], scores[~labels]
    wins = (pos[:, None] > neg[None, :]).sum() + 0.5 * (pos[:, None] == neg[None, :]).sum()
    return wins / (len(pos) * len(neg))


def close_to(got, want, rel=1e-5):
    """|got - want| <= rel * max(|want|, 1): relative, with scores near 0 compared at the scale of 1."""
    got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    return np.abs(got - want) <= rel * np.maximum(np.abs(want), 1.0)


def wait_scored(session, rows, timeout=30.0):
    """Waits until every probe has scored `rows` rows. (`Session.wait_probes` first waits for every record to be
    exported, and a Parquet sink exports a record only when its file is committed, i.e. at close here.)"""
    deadline = time.monotonic() + timeout
    while True:
        stats = session.probe_stats()
        if all(p["rows"] >= rows for p in stats):
            return stats
        assert time.monotonic() < deadline, f"the probes did not score {rows} rows in {timeout} s: {stats}"
        time.sleep(0.005)


def test_planted_direction_scores_equal_numpy_and_alerts_fire_exactly_for_the_planted_requests(tmp_path):
    w, b = probe_weights()
    shared = {"hookpoint": HP, "aggregate": "mean", "thresholds": [1.25, 100.0], "min_tokens": PROMPT}
    config = {
        "ring": {"capacity": "4 MiB"}, "policy": {"mode": "full"},
        "export": {"parquet": True, "dir": str(tmp_path), "run_id": "planted"},
        "hookpoints": [{"name": HP, "site": "residual", "layer": 3, "dtype": "f32", "row_width": D}],
        "probes": [
            # Weights as .npy, the bias inline in the configuration (what save_probe returns for .npy).
            {"name": "deception", **ringscope.save_probe(tmp_path / "deception.npy", w, b), **shared,
             "action": "stop", "labels": ["deceptive", "noise"]},
            # Weights and bias in one safetensors file; scored in the capture path, its scores exported.
            {"name": "fused", **ringscope.save_probe(tmp_path / "fused.safetensors", w, b), **shared,
             "mode": "fused"},
        ],
        "alerts": {"flag_slots": 256},
    }
    s = ringscope.Session(config)
    hp = s.hookpoint_id(HP)
    steps = [[(r, p) for r in range(REQUESTS) for p in range(PROMPT)]]
    steps += [[(r, PROMPT + t) for r in range(REQUESTS)] for t in range(DECODE)]
    for step, rows in enumerate(steps):
        s.begin_step(step, [r for r, _ in rows], [p for _, p in rows])
        s.capture(hp, np.stack([token(r, p) for r, p in rows]))
        s.end_step()
    stats = wait_scored(s, REQUESTS * TOKENS)
    assert [(p["name"], p["mode"], p["hookpoint"], p["scores_hookpoint"]) for p in stats] == [
        ("deception", "consumer", HP, None), ("fused", "fused", HP, "probes.fused")]

    # Per-request means against the f64 reference, both probes.
    x = {(r, p): token(r, p).astype(np.float64) for r in range(REQUESTS) for p in range(TOKENS)}
    means = []
    for r in range(REQUESTS):
        want = np.mean([w.astype(np.float64) @ x[(r, p)] + b for p in range(TOKENS)], axis=0)
        for probe in ("deception", "fused"):
            report = s.probe_request(probe, r)
            assert report is not None and report["request_id"] == r
            assert close_to(report["scores"], want).all(), (probe, r, report["scores"], want)
            assert report["alerted"] == [is_planted(r), False], (probe, r)
            assert report["coverage"] == {"scored": TOKENS, "nan": 0, "expected": TOKENS, "unobserved": 0,
                                          "cached": 0}
            assert report["last_step"] == DECODE
        means.append(s.probe_request("deception", r)["scores"][0])
    assert auroc(means, [is_planted(r) for r in range(REQUESTS)]) >= 0.99
    assert s.probe_request("deception", 10_000) is None, "a request the probe never saw"

    # Alerts: once per request and probe, exactly the planted requests; the stop probe flags exactly those.
    alerts = list(s.alerts())
    planted = {r for r in range(REQUESTS) if is_planted(r)}
    for probe, action, label in (("deception", "stop", "deceptive"), ("fused", "alert", "0")):
        mine = [a for a in alerts if a.probe == probe]
        assert sorted(a.request_id for a in mine) == sorted(planted), probe
        for a in mine:
            assert (a.output, a.label, a.action, a.threshold) == (0, label, action, 1.25), a
            assert a.score >= 1.25 and a.step >= 0 and a.position >= PROMPT - 1, a
    assert len(alerts) == 2 * len(planted)
    assert s.poll_alert(0.0) is None and s.alerts_dropped() == 0
    assert [s.is_flagged(r) for r in range(REQUESTS)] == [is_planted(r) for r in range(REQUESTS)]
    flags = s.probe_flags()
    assert flags.dtype == np.uint64 and flags.shape == (256,) and not flags.flags.writeable
    ids = np.arange(REQUESTS, dtype=np.uint64)
    assert (flags[ids % 256] == ids + 1).tolist() == [is_planted(r) for r in range(REQUESTS)]
    assert [p["alerts"] for p in s.probe_stats()] == [len(planted), len(planted)]

    # Finishing a request hands over each probe's last report and lowers its flag.
    finished = s.finish_request(1)
    assert sorted(finished) == ["deception", "fused"] and finished["deception"]["alerted"] == [True, False]
    assert not s.is_flagged(1) and flags[1] == 0 and s.probe_request("deception", 1) is None
    totals = s.close()
    assert totals["dropped_rows"] == 0

    # The fused probe's scores, exported as their own table: one row of K scores per captured row.
    dump = ringscope.read_dump(tmp_path / "planted", hookpoint="probes.fused")["probes.fused"]
    assert dump["dtype"] == "f32" and dump["activation"].shape == (REQUESTS * TOKENS, 2)
    rows = np.stack([x[(int(r), int(p))] for r, p in zip(dump["request_id"], dump["position"])])
    assert close_to(dump["activation"], rows @ w.T.astype(np.float64) + b).all(), "f64 reference"
    f32 = rows.astype(np.float32) @ w.T + b
    assert close_to(dump["activation"], f32).all(), "numpy f32 reference"


# -- (b) Hugging Face generate, stopped by a probe --------------------------------------------------------------

PAD = 0
PROMPT_LEN = 8
NEW_TOKENS = 6
STOP_STEP = 2  # the probe may alert only once a request has PROMPT_LEN + STOP_STEP scored tokens


def hf():
    if os.environ.get("RINGSCOPE_REQUIRE_TORCH"):
        import torch
        import transformers
    else:
        torch = pytest.importorskip("torch")
        transformers = pytest.importorskip("transformers")
    return torch, transformers


def tiny_llama(torch, transformers):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    return transformers.LlamaForCausalLM(cfg).eval()


def generate(model, torch, prompt, **kwargs):
    with torch.no_grad():
        return model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=NEW_TOKENS,
                              min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=PAD, suppress_tokens=[PAD],
                              **kwargs)


def test_rows_of_no_request_are_exported_marked_and_never_scored_flagged_or_alerted(tmp_path):
    """Request id 2**64-1 (NO_REQUEST: an ended sequence's row in a fixed-shape graph step, or an engine's padding
    row): the rows are exported with it, but no probe scores them into a request, alerts or raises a flag for them
    (flag slot 2**64-1 % 64 belongs to request 63, whose flag must stay up)."""
    no_request = 2**64 - 1
    w, b = probe_weights()
    probe = {"hookpoint": HP, "aggregate": "per_token", "thresholds": [1.0, 100.0], "action": "stop"}
    config = {
        "policy": {"mode": "full"},
        "hookpoints": [{"name": HP, "site": "residual", "layer": 3, "dtype": "f32", "row_width": D}],
        "probes": [{"name": "consumer", **ringscope.save_probe(tmp_path / "c.npy", w, b), **probe},
                   {"name": "fused", **ringscope.save_probe(tmp_path / "f.npy", w, b), **probe, "mode": "fused"}],
        "alerts": {"flag_slots": 64},
    }
    s = ringscope.Session(config)
    sub = s.subscribe("check")
    hp = s.hookpoint_id(HP)
    hot = (5 * planted_direction()).astype(np.float32)  # crosses threshold 1.0 on output 0
    s.begin_step(0, [63], [0])
    s.capture(hp, hot[None, :])
    s.end_step()
    s.begin_step(1, [63, no_request, no_request], [1, 0, 0])
    s.capture(hp, np.stack([np.zeros(D, np.float32), hot, hot]))
    s.end_step()
    s.wait_probes(30)
    stats = s.probe_stats()
    assert [(p["rows"], p["no_request_rows"], p["alerts"]) for p in stats] == [(2, 2, 1), (2, 2, 1)], stats
    assert s.is_flagged(63)
    assert {a.request_id for a in s.alerts()} == {63}
    assert s.probe_request("consumer", no_request) is None
    s.close()
    rows = [(int(r.request_id[k]), int(r.position[k])) for r in sub if r.hookpoint == hp for k in range(len(r.rows))]
    assert sorted(rows) == sorted([(63, 0), (63, 1), (no_request, 0), (no_request, 0)]), rows


def test_rows_from_the_prefix_cache_are_counted_in_coverage_and_the_events_table(tmp_path):
    """Issue 29: an engine that takes a request's first 96 prompt rows from its prefix cache computes (and ringscope
    sees) only the rest: `note_cached` makes the 96 visible — `coverage["cached"]` of every probe, a `cached` row in
    the events table naming the request and positions, the session's `cached_rows` — never read as "safe"."""
    w, b = probe_weights()
    config = {
        "policy": {"mode": "full"},
        "export": {"parquet": True, "dir": str(tmp_path), "run_id": "cached"},
        "hookpoints": [{"name": HP, "site": "residual", "layer": 3, "dtype": "f32", "row_width": D}],
        "probes": [{"name": "p", **ringscope.save_probe(tmp_path / "p.npy", w, b), "hookpoint": HP,
                    "thresholds": [100.0, 100.0]}],
    }
    s = ringscope.Session(config)
    hp = s.hookpoint_id(HP)
    s.note_cached(0, 5, 0, 96)
    s.begin_step(0, [5] * 4 + [6] * 2, [96, 97, 98, 99, 0, 1])
    s.capture(hp, np.stack([token(5, p) for p in range(4)] + [token(6, p) for p in range(2)]))
    s.end_step()
    s.wait_probes(30)
    assert s.probe_request("p", 5)["coverage"] == {"scored": 4, "nan": 0, "expected": 4, "unobserved": 0,
                                                   "cached": 96}
    assert s.probe_request("p", 6)["coverage"]["cached"] == 0
    assert s.stats_all()["cached_rows"] == 96
    for args, what in (((0, 5, 0, 0), "0 rows"), ((0, 2**64 - 1, 0, 3), "NO_REQUEST"),
                       ((0, 5, 2**32 - 1, 2), "ending at position")):
        with pytest.raises(RingscopeError, match=what) as e:
            s.note_cached(*args)
        assert e.value.status == "RS_ERR_INVALID_ARGUMENT"
    s.close()
    events = [e for e in ringscope.read_events(tmp_path / "cached") if e["kind"] == "cached"]
    assert [(e["hookpoint"], e["first_step"], e["reason"], e["records_lost"], e["rows_lost"], e["detail"])
            for e in events] == [("", 0, "prefix_cache", 0, 96, "request=5 positions=0..96")]
    # Typed columns, so that a DuckDB or Polars user joins events to rows without parsing `detail`.
    assert [(e["request_id"], e["first_position"], e["end_position"]) for e in events] == [(5, 0, 96)]
    import pyarrow.parquet as pq

    (events_file,) = (tmp_path / "cached" / ringscope.EVENTS_DIR).glob("part-*.parquet")
    schema = pq.read_schema(events_file)
    assert [(c, str(schema.field(c).type), schema.field(c).nullable)
            for c in ("request_id", "first_position", "end_position")] == [(c, "uint64", True) for c in
                                                                          ("request_id", "first_position",
                                                                           "end_position")]
    others = [e for e in ringscope.read_events(tmp_path / "cached") if e["kind"] != "cached"]
    assert all(e["request_id"] is None and e["end_position"] is None for e in others)
    with pytest.raises(RingscopeError):
        s.note_cached(1, 5, 0, 1)  # closed


def test_rows_noted_for_device_begun_steps_are_the_coverage_denominator(tmp_path):
    """A step begun inside a CUDA graph gives the probes no batch: the engine plugins report each pass's rows per
    request from the host (`note_step_rows`, NO_REQUEST for padding), and `coverage["expected"]` counts them as a
    host-begun step's batch does — rows that never reached the probe are `unobserved`."""
    w, b = probe_weights()
    config = {"hookpoints": [{"name": HP, "site": "residual", "layer": 3, "dtype": "f32", "row_width": D}],
              "probes": [{"name": "p", **ringscope.save_probe(tmp_path / "p.npy", w, b), "hookpoint": HP,
                          "thresholds": [100.0, 100.0]}]}
    s = ringscope.Session(config)
    hp = s.hookpoint_id(HP)
    s.begin_step(0, [5, 5], [0, 1])
    s.capture(hp, np.stack([token(5, p) for p in range(2)]))
    s.end_step()
    s.note_step_rows(np.array([5, 2**64 - 1, 7, 5], dtype=np.uint64))  # two more rows of 5, one of 7, a padding row
    s.note_step_rows([])
    s.wait_probes(30)
    cov = s.probe_request("p", 5)["coverage"]
    assert (cov["scored"], cov["expected"], cov["unobserved"]) == (2, 4, 2), cov
    cov = s.probe_request("p", 7)["coverage"]
    assert (cov["scored"], cov["expected"], cov["unobserved"]) == (0, 1, 1), cov
    # The plugins' per-pass way to the same call (no checks, no ctypes conversion): the same counts.
    note = s._step_rows_noter()
    note(np.array([7, 7, 2**64 - 1], dtype=np.uint64))
    s.wait_probes(30)
    cov = s.probe_request("p", 7)["coverage"]
    assert (cov["scored"], cov["expected"], cov["unobserved"]) == (0, 3, 3), cov
    for bad, what in ((np.array([-1]), r"request_ids\[0\] must be an integer in 0..=18446744073709551615, got -1"),
                      ("5", "must be a sequence of integers"), (np.zeros((2, 2), dtype=np.uint64), "one-dimensional")):
        with pytest.raises(RingscopeError, match=what) as e:
            s.note_step_rows(bad)
        assert e.value.status == "RS_ERR_INVALID_ARGUMENT"
    s.close()
    with pytest.raises(RingscopeError, match="closed"):
        s.note_step_rows([5])
    with pytest.raises(RingscopeError, match="closed"):
        note(np.array([5], dtype=np.uint64))


@pytest.mark.torch
def test_a_probe_stops_exactly_the_flagged_row_of_hugging_face_generate(tmp_path):
    torch, transformers = hf()
    import ringscope.torch as rt

    model = tiny_llama(torch, transformers)
    prompt = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12], [60, 61, 62, 63, 64, 65, 66, 67]])
    # Reference run (no ringscope): layer 1's residual (what attach captures as layers.1.resid) of every token.
    ref = generate(model, torch, prompt, output_hidden_states=True, return_dict_in_generate=True)
    hidden = [np.concatenate([hs[2][b].double().numpy() for hs in ref.hidden_states]) for b in range(2)]
    # The probe reads the direction from row 0's prompt to row 1's; each request's running mean score, per step.
    direction = hidden[1][:PROMPT_LEN].mean(0) - hidden[0][:PROMPT_LEN].mean(0)
    w = (direction / np.linalg.norm(direction)).astype(np.float32)
    running = [np.cumsum(h @ w.astype(np.float64)) / np.arange(1, len(h) + 1) for h in hidden]
    # Token count after step s is PROMPT_LEN + s; the probe may alert from step STOP_STEP on.
    at = {b: {s: running[b][PROMPT_LEN + s - 1] for s in range(STOP_STEP, NEW_TOKENS)} for b in range(2)}
    quiet = max(at[0].values())
    assert at[1][STOP_STEP] > quiet + 1e-3, "the constructed case separates the rows"
    threshold = float((at[1][STOP_STEP] + quiet) / 2)

    config = {"policy": {"mode": "full"}, "probes": [{
        "name": "stopper", "hookpoint": "layers.1.resid", **ringscope.save_probe(tmp_path / "stopper.npy", w),
        "aggregate": "mean", "threshold": threshold, "min_tokens": PROMPT_LEN + STOP_STEP, "action": "stop"}]}
    # attach() adds the hookpoints to the configuration, so the probe finds layers.1.resid when the session starts.
    att = rt.attach(model, config, sites=("residual",), layers=[1])
    session = att.session
    att.request_ids = [41, 42]
    criteria = rt.ProbeStoppingCriteria(att, timeout=30.0)
    out = generate(model, torch, prompt, stopping_criteria=transformers.StoppingCriteriaList([criteria]))

    new = out[:, PROMPT_LEN:]
    assert criteria.stopped == {42: STOP_STEP}, criteria.stopped
    # Row 1 (request 42) keeps the tokens of steps 0..=STOP_STEP, then is padded; row 0 goes on to the end, as it
    # did without the probe.
    assert (new[1, :STOP_STEP + 1] != PAD).all() and (new[1, STOP_STEP + 1:] == PAD).all(), new
    assert new.shape[1] == NEW_TOKENS and (new[0] != PAD).all(), new
    assert torch.equal(out[0], ref.sequences[0]), "the other row is not disturbed"
    assert torch.equal(out[1, :PROMPT_LEN + STOP_STEP + 1], ref.sequences[1, :PROMPT_LEN + STOP_STEP + 1])

    alerts = list(session.alerts())
    assert [(a.probe, a.request_id, a.step, a.position, a.action) for a in alerts] == [
        ("stopper", 42, STOP_STEP, PROMPT_LEN + STOP_STEP - 1, "stop")]
    assert session.is_flagged(42) and not session.is_flagged(41)
    report = session.finish_request(42)["stopper"]
    assert report["alerted"] == [True] and report["coverage"]["unobserved"] == 0
    assert not session.is_flagged(42)
    session.close()


@pytest.mark.torch
def test_the_stopping_criteria_and_attach_refuse_bad_input(tmp_path):
    torch, transformers = hf()
    import ringscope.torch as rt

    model = tiny_llama(torch, transformers)
    with pytest.raises(RingscopeError, match="needs the Attachment"):
        rt.ProbeStoppingCriteria(ringscope.Session(""))
    att = rt.attach(model, "", layers=[0])
    with pytest.raises(RingscopeError, match="no probes") as e:
        rt.ProbeStoppingCriteria(att)
    assert e.value.status == "RS_ERR_CONFIG"
    att.session.close()
    w = ringscope.save_probe(tmp_path / "w.npy", np.ones(64, dtype=np.float32))
    probe = {"name": "p", "hookpoint": "layers.0.resid", **w, "threshold": 1.0, "action": "stop"}
    att = rt.attach(model, {"probes": [probe]}, layers=[0])
    for kwargs, match in (({"on_timeout": "ignore"}, "on_timeout"), ({"timeout": -1}, "timeout")):
        with pytest.raises(RingscopeError, match=match):
            rt.ProbeStoppingCriteria(att, **kwargs)
    att.request_ids = [1, 2, 3]
    criteria = rt.ProbeStoppingCriteria(att)
    with pytest.raises(RingscopeError, match="3 request ids for a batch of 2 rows"):
        criteria(torch.zeros(2, 4, dtype=torch.long), None)
    att.session.close()
    # A configured hookpoint whose rows are not the model's: named, before anything is captured.
    hp = {"name": "layers.0.resid", "site": "residual", "layer": 0, "dtype": "bf16", "row_width": 64}
    with pytest.raises(RingscopeError, match="'layers.0.resid' is configured with bf16 rows of 64 elements"):
        rt.attach(model, {"hookpoints": [hp]}, layers=[0])


# -- (c) bad input --------------------------------------------------------------------------------------------


def probe_config(tmp_path, **probe):
    body = {"name": "p", "hookpoint": "h", **probe}
    if "thresholds" not in body:
        body.setdefault("threshold", 1.0)
    return {"export": {"parquet": True, "dir": str(tmp_path / "out"), "run_id": "r"},
            "hookpoints": [{"name": "h", "site": "residual", "dtype": "f32", "row_width": D}], "probes": [body]}


def test_probes_that_cannot_work_are_refused_at_start_and_nothing_starts(tmp_path):
    good = ringscope.save_probe(tmp_path / "good.npy", np.ones(D))
    narrow = ringscope.save_probe(tmp_path / "narrow.npy", np.ones(D - 1))
    nan = np.ones(D, dtype=np.float32)
    nan[3] = np.nan
    np.save(tmp_path / "nan.npy", nan)  # written around save_probe, which refuses NaN itself
    cases = [
        (dict(good, hookpoint="nope"), "no hookpoint `nope`"),
        (narrow, "weights are 1 × 31 but hookpoint `h` has rows of 32 elements"),
        ({"weights": str(tmp_path / "nan.npy")}, r"weight \[0, 3\] is NaN"),
        (dict(good, aggregate="median"), "unknown aggregate `median`"),
        (dict(good, action="explode"), "unknown action `explode`"),
        ({"weights": str(tmp_path / "missing.npy")}, "missing.npy"),
    ]
    for probe, match in cases:
        with pytest.raises(RingscopeError, match=match) as e:
            ringscope.Session(probe_config(tmp_path, **probe))
        assert e.value.status == "RS_ERR_CONFIG" and "`p`" in e.value.message, e.value
        assert not (tmp_path / "out").exists(), "nothing was started: not even the run directory"


def test_probe_calls_refuse_bad_arguments_and_name_them(tmp_path):
    def bad(match, call, status="RS_ERR_INVALID_ARGUMENT"):
        with pytest.raises(RingscopeError, match=match) as e:
            call()
        assert e.value.status == status, e.value

    # save_probe checks what it writes.
    for args, match in (
        (("w.txt", np.ones(4)), "must end in .npy or .safetensors"),
        (("w.npy", np.ones((2, 2, 2))), r"shape \[K, d\] or \[d\]"),
        (("w.npy", np.ones((65, 4))), "65 outputs"),
        (("w.npy", np.array([1.0, np.inf])), r"weights\[1\] is inf"),
        (("w.npy", [[1.0, 2.0], ["a", "b"]]), "weights must hold numbers"),
        (("w.npy", np.ones((2, 4)), [1.0]), r"one number per output: shape \[2\]"),
        (("w.npy", np.ones((2, 4)), [1.0, math.nan]), r"bias\[1\] is nan"),
    ):
        bad(match, lambda: ringscope.save_probe(tmp_path / args[0], *args[1:]))
    bad("path must be a path", lambda: ringscope.save_probe(5, np.ones(4)))
    # The safetensors file save_probe writes is the one the library reads (weights and bias).
    entry = ringscope.save_probe(tmp_path / "sub" / "p.safetensors", np.full((2, D), 0.5), [1.0, 2.0])
    assert entry == {"weights": str(tmp_path / "sub" / "p.safetensors")}

    # A session without probes: the probe calls say so; the counters are zero.
    with ringscope.Session("") as s:
        bad("no probes", lambda: s.poll_alert(), "RS_ERR_CONFIG")
        bad("no probes", lambda: list(s.alerts()), "RS_ERR_CONFIG")
        bad("no probes", lambda: s.probe_flags(), "RS_ERR_CONFIG")
        bad("no probes", lambda: s.wait_probes(0), "RS_ERR_CONFIG")
        bad("no probes", lambda: s.probe_request("p", 1), "RS_ERR_CONFIG")
        assert (s.is_flagged(1), s.probe_stats(), s.alerts_dropped(), s.finish_request(1)) == (False, [], 0, {})

    s = ringscope.Session(probe_config(tmp_path, **entry, thresholds=[1.0, 2.0]))
    bad("probe must be a string", lambda: s.probe_request(5, 1))
    bad("probe contains a NUL", lambda: s.probe_request("p\0q", 1))
    bad(r"no probe `q` \(this session has p\)", lambda: s.probe_request("q", 1))
    for call in (lambda v: s.probe_request("p", v), s.is_flagged, s.finish_request):
        for v in (-1, 2**64, 1.5, True, None):
            bad("request_id must be an integer", lambda: call(v))
    for v in (-1, math.nan, "1", 2**33):
        bad("timeout must be a number of seconds", lambda: s.poll_alert(v))
        bad("timeout must be a number of seconds", lambda: s.alerts(v))
        bad("timeout must be a number of seconds", lambda: s.wait_probes(v))
    assert s.poll_alert(0) is None and list(s.alerts(0.01)) == []
    s.close()
    bad("closed", lambda: s.probe_request("p", 1), "RS_ERR_CLOSED")
    bad("closed", lambda: s.is_flagged(1), "RS_ERR_CLOSED")
    assert list(s.alerts(None)) == [], "after close: every alert delivered, the iterator ends"
    assert [p["name"] for p in s.probe_stats()] == ["p"], "the final totals answer after close"
