"""What `attach` captures from Hugging Face `generate` in the cases a user hit (issue 28): left-padded batches (padding
is no request's tokens; positions are the tokens' real positions), rows of sequences that ended, logits computed for
the last prompt token only, request ids across calls, and the token ids that join rows to text. A random tiny Llama
(no download), on the CPU with the host backend, and on a GPU with the CUDA backend when there is one (also runnable
as a script there: `python tests/python/test_hf_rows.py`, which runs every test on both devices).

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

import ringscope
import ringscope.torch as rt

PAD = 0


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def tiny(device="cpu", layers=2):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                   pad_token_id=PAD, bos_token_id=1, eos_token_id=2)
    return transformers.LlamaForCausalLM(cfg).eval().to(device)


def session_for(device):
    ring = {"backend": "cuda"} if device == "cuda" else {}
    return ringscope.Session({"ring": ring, "policy": {"mode": "full"}})


def rows_by_hookpoint(session, sub, att):
    session.close()
    names = {v: k for k, v in att.hookpoints.items()}
    out = {}
    for r in sub:
        for k in range(len(r.rows)):
            out.setdefault(names[r.hookpoint], []).append((r.step, int(r.request_id[k]), int(r.position[k]),
                                                           r.rows[k].copy()))
    return out


def left_padded(device="cpu"):
    prompts = [[5, 6, 7, 8, 9], [10, 11]]
    width = max(map(len, prompts))
    ids = torch.tensor([[PAD] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    return prompts, ids, mask


def generate_left_padded(device, sites, new_tokens, **outputs):
    """`generate` of the left-padded batch with `attach(sites)`: the prompts, the padded ids, generate's output and
    the captured rows by hookpoint."""
    model = tiny(device)
    session = session_for(device)
    att = rt.attach(model, session, sites=sites)
    sub = session.subscribe("check")
    prompts, ids, mask = left_padded(device)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=False, return_dict_in_generate=True, pad_token_id=PAD, **outputs)
    return prompts, ids, out, rows_by_hookpoint(session, sub, att)


@pytest.mark.parametrize("device", DEVICES)
def test_left_padding_is_not_captured_and_positions_are_real(device):
    prompts, ids, out, got = generate_left_padded(device, ("residual", "tokens"), 3, output_hidden_states=True)
    width = ids.shape[1]
    # Prefill: each request's real tokens only, at positions 0 .. len-1, bit-identical to the model's hidden states.
    for layer in range(2 - 1):
        prefill = [(req, pos, row) for step, req, pos, row in got[f"layers.{layer}.resid"] if step == 0]
        assert sorted((req, pos) for req, pos, _ in prefill) == [(b, t) for b, p in enumerate(prompts)
                                                               for t in range(len(p))]
        for req, pos, row in prefill:
            pad = width - len(prompts[req])
            want = out.hidden_states[0][layer + 1][req, pad + pos].cpu().numpy()
            assert row.tobytes() == want.tobytes(), (req, pos)
    # Decode steps: every request's next position, no duplicate (request, position) anywhere.
    keys = [(req, pos) for _, req, pos, _ in got["layers.0.resid"]]
    assert len(keys) == len(set(keys)), "a (request, position) was captured twice"
    for b, p in enumerate(prompts):
        assert sorted(pos for req, pos in keys if req == b) == list(range(len(p) + 2))
    # The token ids join rows to text: the prompt's tokens, then the generated ones fed back.
    tokens = {(req, pos): int(row.view(np.int64)[0]) for _, req, pos, row in got["tokens"]}
    for b, p in enumerate(prompts):
        assert [tokens[(b, t)] for t in range(len(p))] == p
        generated = out.sequences[b, width:width + 2].tolist()
        assert [tokens[(b, len(p) + i)] for i in range(2)] == generated


@pytest.mark.parametrize("device", DEVICES)
def test_two_generate_calls_get_distinct_request_ids_by_default(device):
    model = tiny(device)
    session = session_for(device)
    att = rt.attach(model, session)  # default sites: residual and tokens
    sub = session.subscribe("check")
    prompt = torch.tensor([[5, 6, 7], [9, 10, 11]], device=device)
    with torch.no_grad():
        for _ in range(2):
            model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=2, min_new_tokens=2,
                           do_sample=False, pad_token_id=PAD)
    got = rows_by_hookpoint(session, sub, att)
    by_request = {}
    for step, req, pos, _ in got["layers.0.resid"]:
        by_request.setdefault(req, set()).add(step)
    assert sorted(by_request) == [0, 1, 2, 3], sorted(by_request)
    assert max(by_request[0]) < min(by_request[2]), "the second call's rows are requests 2 and 3"
    assert att.current_request_ids(2) == [2, 3]
    assert "tokens" in got


@pytest.mark.parametrize("device", DEVICES)
def test_rows_of_a_sequence_that_ended_are_not_captured(device):
    model = tiny(device)
    prompt = torch.tensor([[5, 6, 7], [9, 10, 11]], device=device)
    with torch.no_grad():
        plain = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=4, min_new_tokens=4,
                               do_sample=False, pad_token_id=PAD)
    # Make row 0's first generated token its end-of-sequence token (greedy decoding is deterministic).
    eos = int(plain[0, 3])
    if eos in plain[1, 3:].tolist():
        pytest.skip("both rows generate the chosen token")
    model.generation_config.eos_token_id = eos
    session = session_for(device)
    att = rt.attach(model, session, sites=("residual",))
    sub = session.subscribe("check")
    with torch.no_grad():
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=4, do_sample=False,
                             pad_token_id=PAD)
    assert out[0, 3] == eos and out.shape[1] == 7, out
    got = rows_by_hookpoint(session, sub, att)
    positions = {b: sorted(pos for _, req, pos, _ in got["layers.0.resid"] if req == b) for b in (0, 1)}
    # Row 0 ended at its first generated token: the steps that fed it its EOS and padding capture nothing of it.
    assert positions[0] == [0, 1, 2], positions
    assert positions[1] == [0, 1, 2, 3, 4, 5], positions


@pytest.mark.parametrize("device", DEVICES)
def test_rows_of_a_sequence_a_stopping_criterion_ended_are_not_captured(device):
    """A row ended by a stopping criterion other than ringscope's (so ringscope is not told) is fed the pad token
    from the step after next: those rows are no request's tokens either."""
    model = tiny(device)
    prompt = torch.tensor([[5, 6, 7], [9, 10, 11]], device=device)

    class StopRowZero(transformers.StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            return torch.tensor([True, False], device=input_ids.device)

    with torch.no_grad():
        plain = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=4, min_new_tokens=4,
                               do_sample=False, pad_token_id=PAD)
    if PAD in plain[1, 3:].tolist():
        pytest.skip("row 1 generates the pad token")
    session = session_for(device)
    att = rt.attach(model, session, sites=("residual", "tokens"))
    sub = session.subscribe("check")
    with torch.no_grad():
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=4, do_sample=False,
                             pad_token_id=PAD, stopping_criteria=transformers.StoppingCriteriaList([StopRowZero()]))
    assert out[0, 4:].tolist() == [PAD] * 3, out
    got = rows_by_hookpoint(session, sub, att)
    positions = {b: sorted(pos for _, req, pos, _ in got["layers.0.resid"] if req == b) for b in (0, 1)}
    # Row 0 ended after its first generated token (position 3, fed at the next step); then it is fed padding.
    assert positions[0] == [0, 1, 2, 3], positions
    assert positions[1] == [0, 1, 2, 3, 4, 5], positions
    assert PAD not in [int(row.view(np.int64)[0]) for _, _, _, row in got["tokens"]]


@pytest.mark.parametrize("defer", [False, True])
@pytest.mark.parametrize("where", ["kernels", "torch"])
def test_graph_recorded_decode_steps_mark_rows_of_ended_sequences_as_no_request(monkeypatch, where, defer):
    """A decode step recorded as a CUDA graph has a fixed batch and runs no Python at replay: a row fed its EOS or
    the pad token is captured with request id NO_REQUEST (2**64-1), decided on the device at every replay — by
    ringscope's own recorded kernels from the step's tokens (the begin kernel, or the deferred captures' one kernel),
    or, where those cannot (more ended tokens than they take, an older library), by torch kernels recorded before
    the step begins; the other rows keep their requests."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU (CUDA graphs)")
    if where == "kernels":
        def refuse(self, req, ids):
            raise AssertionError("recorded torch kernels for ended rows: ringscope's kernels should decide them")
        monkeypatch.setattr(rt.Attachment, "_live_request_ids", refuse)
    else:
        monkeypatch.setattr(rt.Attachment, "_ended_on_device", lambda self, req, ids: None)
    model = tiny("cuda")
    # Best-effort: replays need no host call (full mode would call session.admit_graph_step() before each replay).
    session = ringscope.Session({"ring": {"backend": "cuda", "defer_captures": defer},
                                 "policy": {"mode": "best_effort"}})
    att = rt.attach(model, session, sites=("residual", "tokens"))
    sub = session.subscribe("check")
    cache = transformers.StaticCache(config=model.config, max_cache_len=16)
    with torch.no_grad():
        model(input_ids=torch.tensor([[5, 6, 7], [9, 10, 11]], device="cuda"), past_key_values=cache,
              cache_position=torch.arange(3, device="cuda"), use_cache=True)
    tok = torch.tensor([[20], [21]], device="cuda")
    cp = torch.tensor([3], device="cuda")
    pid = torch.full((2, 1), 3, device="cuda")

    def forward():
        return model(input_ids=tok, position_ids=pid, cache_position=cp, past_key_values=cache, use_cache=True)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.no_grad():
        forward()  # an eager step at position 3 (warm-up before recording)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        forward()
    eos = model.config.eos_token_id
    for i, t0 in enumerate([22, eos, PAD]):  # row 0: a token, then its EOS fed back, then padding
        tok[0, 0], tok[1, 0] = t0, 30 + i
        cp.add_(1)
        pid.add_(1)
        graph.replay()
    torch.cuda.synchronize()
    got = rows_by_hookpoint(session, sub, att)
    by_request = {}
    for _, req, pos, _ in got["layers.0.resid"]:
        by_request.setdefault(req, []).append(pos)
    assert {k: sorted(v) for k, v in by_request.items()} == {0: [0, 1, 2, 3, 4], 1: [0, 1, 2, 3, 4, 5, 6],
                                                             rt.NO_REQUEST: [5, 6]}, by_request
    tokens = sorted((pos, int(row.view(np.int64)[0])) for _, req, pos, row in got["tokens"] if req == rt.NO_REQUEST)
    assert tokens == [(5, eos), (6, PAD)], tokens


def test_full_mode_graph_recorded_decode_steps_are_admitted_and_lose_nothing():
    """Full mode with the step recorded inside the CUDA graph: ``admit_graph_step`` before every replay (the replay
    itself cannot wait for ring space). Every replay's rows arrive, bit-identical to the model's own hidden states of
    that replay, with their requests and positions; nothing is dropped."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU (CUDA graphs)")
    model = tiny("cuda")
    session = ringscope.Session({"ring": {"backend": "cuda", "defer_captures": True},
                                 "policy": {"mode": "full", "full_deadline_ms": 10000}})
    att = rt.attach(model, session, sites=("residual",))
    sub = session.subscribe("check")
    cache = transformers.StaticCache(config=model.config, max_cache_len=48)
    with torch.no_grad():
        model(input_ids=torch.tensor([[5, 6, 7], [9, 10, 11]], device="cuda"), past_key_values=cache,
              cache_position=torch.arange(3, device="cuda"), use_cache=True)
    tok = torch.tensor([[20], [21]], device="cuda")
    cp = torch.tensor([3], device="cuda")
    pid = torch.full((2, 1), 3, device="cuda")

    def forward():
        return model(input_ids=tok, position_ids=pid, cache_position=cp, past_key_values=cache, use_cache=True,
                     output_hidden_states=True)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.no_grad():
        forward()  # an eager step at position 3 (warm-up before recording)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        out = forward()
    reference = {}
    for i in range(30):
        tok[0, 0], tok[1, 0] = 40 + i, 80 + i
        cp.add_(1)
        pid.add_(1)
        session.admit_graph_step()
        graph.replay()
        for b in range(2):
            reference[(b, 4 + i)] = out.hidden_states[1][b, 0].cpu().numpy().copy()
    torch.cuda.synchronize()
    got = rows_by_hookpoint(session, sub, att)
    totals = session.close()
    assert totals["dropped_rows"] == 0 and totals["exported_rows"] == totals["produced_rows"], totals
    replayed = {(req, pos): row for _, req, pos, row in got["layers.0.resid"] if pos >= 4}
    assert sorted(replayed) == sorted(reference)
    for key, row in replayed.items():
        assert np.array_equal(row.view(np.float32), reference[key]), key


@pytest.mark.parametrize("compiled_before", [False, True], ids=["attached first", "compiled and run before attach"])
def test_full_mode_compiled_generate_admits_every_replay_and_loses_nothing(tmp_path, compiled_before):
    """Full mode, ``generate`` with a static cache on a GPU: transformers compiles the decode step with
    ``reduce-overhead`` (CUDA graph trees), whose replays begin their steps on the device and cannot wait for ring
    space; ``attach`` admits every call of the compiled step. The ring holds about four decode steps and the Parquet
    sink is slower than the model, so the drain falls behind: admissions wait, and every row of every step
    arrives — each (request, position) of each layer once, equal to an eager pass over the generated tokens — with
    nothing dropped. Also when the model was compiled and run (its graphs recorded) before ``attach``: torch.compile
    does not notice hooks added to modules that had none, and until session 35 replayed those hook-free graphs for the
    attached model (its decode steps captured nothing; ``attach`` now gives the hooked modules classes of their own)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU (CUDA graphs)")
    torch._dynamo.reset()
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=2048, intermediate_size=512, num_hidden_layers=2,
                                   num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=128,
                                   pad_token_id=PAD, bos_token_id=1, eos_token_id=2)
    model = transformers.LlamaForCausalLM(cfg).eval().to("cuda")
    batch, prompt, new = 64, 2, 32  # a decode step: 64 rows x 2 layers x 8 KiB = 1 MiB; the prefill 2 MiB
    session = ringscope.Session({"ring": {"backend": "cuda", "capacity": "4 MiB", "defer_captures": True},
                                 "policy": {"mode": "full", "full_deadline_ms": 30000},
                                 "export": {"parquet": True, "dir": str(tmp_path), "run_id": "compiled"}})
    ids = torch.randint(3, 128, (batch, prompt), device="cuda")
    # min_new_tokens keeps EOS out; the pad token is suppressed too (a replay feeding it would mark the row ended).
    gc = transformers.GenerationConfig(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=PAD,
                                       suppress_tokens=[PAD], cache_implementation="static",
                                       compile_config=transformers.CompileConfig(mode="reduce-overhead"))
    if compiled_before:
        with torch.no_grad():
            model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gc)
    att = rt.attach(model, session, sites=("residual",))
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gc)
    torch.cuda.synchronize()
    stats = session.stats_all()
    totals = session.close()
    assert att._recorded_graph, "the decode step was not recorded as a CUDA graph: nothing replayed"
    att.detach()
    assert totals["dropped_rows"] == 0 and totals["exported_rows"] == totals["produced_rows"], totals
    print(f"full-mode waits: {stats['stalls']} ({stats['stall_time_s'] * 1e3:.1f} ms); rows {totals['exported_rows']}")
    assert stats["stalls"] > 0, "no admission waited: the drain kept up, so this run did not test what it is for"
    dump = ringscope.read_dump(tmp_path / "compiled")
    want = {(r, p) for r in range(batch) for p in range(prompt + new - 1)}
    with torch.no_grad():
        hs = model(out[:, :-1], output_hidden_states=True).hidden_states
    for layer in range(2):
        d = dump[f"layers.{layer}.resid"]
        got = list(zip(d["request_id"].tolist(), d["position"].tolist()))
        assert len(got) == len(want) and set(got) == want, (layer, len(got), len(want))
        if layer == 1:
            continue  # the last layer's output_hidden_states entry is after the final norm
        rows = torch.from_numpy(d["activation"]).to("cuda")
        ref = hs[layer + 1][torch.from_numpy(d["request_id"].astype(np.int64)).to("cuda"),
                            torch.from_numpy(d["position"].astype(np.int64)).to("cuda")]
        err = ((rows - ref).abs().amax(-1) / ref.abs().amax(-1)).max().item()
        assert err <= 1e-2, err  # compiled float32 (fused kernels) against eager


@pytest.mark.parametrize("device", DEVICES)
def test_a_forward_pass_whose_rows_all_ended_captures_nothing_and_does_not_fail(device):
    """A decode step fed only end-of-sequence tokens has no request's token: no step, no rows, no error."""
    model = tiny(device)
    session = session_for(device)
    att = rt.attach(model, session, sites=("residual", "tokens"))
    sub = session.subscribe("check")
    cache = transformers.DynamicCache()
    with torch.no_grad():
        model(input_ids=torch.tensor([[5, 6, 7]], device=device), past_key_values=cache, use_cache=True)
        model(input_ids=torch.tensor([[2]], device=device), past_key_values=cache, use_cache=True)  # EOS fed back
        model(input_ids=torch.tensor([[0]], device=device), past_key_values=cache, use_cache=True)  # padding after it
    got = rows_by_hookpoint(session, sub, att)
    assert sorted(pos for _, _, pos, _ in got["layers.0.resid"]) == [0, 1, 2]
    assert sorted(pos for _, _, pos, _ in got["tokens"]) == [0, 1, 2]


def test_an_eager_step_asks_the_device_only_for_the_values_it_needs(monkeypatch):
    """The begin of an eager step reads device values on the host (through ``_on_host``, one wait for all): a prefill
    given neither positions nor a mask nor a cache position needs none — were it to read any (the last tokens, say,
    which only later steps use), the host would wait for the GPU at every prefill (CPU here: what is asked is the
    same on a GPU, where test_an_eager_prefill_makes_the_host_wait_for_the_gpu_no_more_often_than_the_plain_model
    counts the waits)."""
    asked = []
    original = rt._on_host

    def recorder(**tensors):
        asked.append(sorted(k for k, t in tensors.items() if t is not None))
        return original(**tensors)
    monkeypatch.setattr(rt, "_on_host", recorder)
    model = tiny("cpu", layers=2)
    session = ringscope.Session({"policy": {"mode": "full"}})
    att = rt.attach(model, session, sites=("residual",))
    try:
        with torch.no_grad():
            model(input_ids=torch.tensor([[5, 6, 7], [9, 10, 11]]), use_cache=False)
            assert asked == [[]]
            cache = transformers.DynamicCache()
            model(input_ids=torch.tensor([[5, 6, 7], [9, 10, 11]]), attention_mask=torch.ones(2, 3, dtype=torch.int64),
                  past_key_values=cache, use_cache=True)
            assert asked[1] == ["mask"]  # a prefill: no last tokens
            model(input_ids=torch.tensor([[2], [12]]), attention_mask=torch.ones(2, 4, dtype=torch.int64),
                  cache_position=torch.tensor([3]), past_key_values=cache, use_cache=True)
            assert asked[2] == ["cp", "last", "mask", "pos"]  # a decode step: all in one call
    finally:
        att.detach()
    session.close()


def _host_waits(call):
    """The host's waits for the GPU during ``call()``, as torch's sync debug mode warns of them (one per call)."""
    import warnings
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with torch.no_grad():
                call()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return [str(w.message).splitlines()[0] for w in seen if "synchroniz" in str(w.message)]


def test_an_eager_prefill_makes_the_host_wait_for_the_gpu_no_more_often_than_the_plain_model():
    """At every prefill `attach` wrote the step's request ids into the tensor recorded graphs read with a copy from
    pageable memory, which waits for everything queued on the stream first: with prefills launched back to back the
    GPU then idled while the host prepared the step. The host's waits are counted by torch's sync debug mode (one
    warning per synchronising call): the attached forward pass must make the same ones as the plain one (the model's
    own: transformers' mask creation reads a device value)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    model = tiny("cuda", layers=2)
    ids = torch.randint(3, 100, (2, 6), device="cuda")

    def waits():
        return _host_waits(lambda: model(input_ids=ids, use_cache=False))

    waits()
    plain = waits()
    session = ringscope.Session({"ring": {"backend": "cuda"}, "policy": {"mode": "full"}})
    att = rt.attach(model, session, sites=("residual", "tokens", "logits"))
    try:
        waits()  # the first pass makes the request-id tensor
        attached = [waits() for _ in range(3)]  # each a new prefill: new request ids written
    finally:
        att.detach()
    stats = session.close()
    assert all(a == plain for a in attached), (plain, attached)
    assert stats["produced_rows"] == stats["exported_rows"] == 4 * 2 * 6 * (2 + 2)  # 4 passes x 12 rows x 4 hookpoints


def test_an_eager_decode_step_reads_the_device_values_it_needs_with_one_wait():
    """An eager decode step of `generate`'s kind (cache position, positions, attention mask, a model with an EOS
    token) needs a few device values on the host to begin the step; `attach` read them one by one, each a wait for
    the GPU. One wait for all of them now: the attached step may wait at most once more than the plain one."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    model = tiny("cuda", layers=2)
    prompt = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]], device="cuda")

    def decode_waits():
        cache = transformers.DynamicCache()
        with torch.no_grad():
            model(input_ids=prompt, attention_mask=torch.ones_like(prompt), past_key_values=cache, use_cache=True)
        n = prompt.shape[1]
        return _host_waits(lambda: model(
            input_ids=torch.tensor([[20], [21]], device="cuda"),
            attention_mask=torch.ones((2, n + 1), dtype=torch.int64, device="cuda"),
            cache_position=torch.tensor([n], device="cuda"), position_ids=torch.full((2, 1), n, device="cuda"),
            past_key_values=cache, use_cache=True))

    decode_waits()
    plain = decode_waits()
    session = ringscope.Session({"ring": {"backend": "cuda"}, "policy": {"mode": "full"}})
    att = rt.attach(model, session, sites=("residual",))
    try:
        decode_waits()
        attached = decode_waits()
    finally:
        att.detach()
    session.close()
    assert len(attached) <= len(plain) + 1, (plain, attached)


@pytest.mark.parametrize("device", DEVICES)
def test_logits_of_the_last_prompt_token_are_captured_as_that_token(device):
    prompts, _, out, got = generate_left_padded(device, ("logits",), 2, output_logits=True)
    rows = {(step, req, pos): row for step, req, pos, row in got["logits"]}
    for b, p in enumerate(prompts):
        # Prefill: the last prompt token's logits (the only ones `generate` computes; on CUDA a last-rows capture),
        # then the decode step's.
        assert rows[(0, b, len(p) - 1)].tobytes() == out.logits[0][b].cpu().numpy().tobytes()
        assert rows[(1, b, len(p))].tobytes() == out.logits[1][b].cpu().numpy().tobytes()
    assert len(rows) == 2 * len(prompts)


if __name__ == "__main__":
    import inspect
    import sys

    failed = 0
    for name, fn in list(globals().items()):
        if not name.startswith("test_"):
            continue
        for device in DEVICES if inspect.signature(fn).parameters else [None]:
            try:
                fn(device) if device else fn()
                print(f"ok   {name}[{device}]")
            except pytest.skip.Exception as e:
                print(f"skip {name}[{device}]: {e}")
            except Exception as e:  # noqa: BLE001 - the script reports every failure
                failed += 1
                print(f"FAIL {name}[{device}]: {type(e).__name__}: {e}")
    sys.exit(1 if failed else 0)
