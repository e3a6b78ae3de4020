"""The plugin in a compiled vLLM engine (the default: torch.compile, fullgraph, inductor), in opt-in mode: only the
requests that opted in through SamplingParams(extra_args={"ringscope": ...}) are exported."""

import itertools

import pytest

from conftest import (RESIDUAL_CONFIG, check_capture, check_overlap_sources, mixed_step, overlap_config,
                      request_ids, work_between_submit_and_end)


@pytest.fixture(scope="module")
def compiled(engines):
    return engines("compiled_opt_in", "compiled", "opt_in")


def test_compiled_and_rows_equal_reference(compiled):
    assert compiled["compiled"], compiled["compilation_mode"]
    # Requests 0 (True), 1 (explicit id 7) and 4 (capture = true) opted in; 2 (a bad value) and 3 (capture = false)
    # not.
    dump = check_capture(compiled, captured_requests=[0, 1, 4])
    closed = compiled["closed"][0]["plugin"]
    assert closed["bad_extra_args"] == 1
    assert closed["opted_out_rows"] > 0 and closed["padding_rows"] == 0
    assert "not captured" in compiled["log"]  # the warning about the bad extra_args value
    lens = {i: len(r["prompt"]) for i, r in zip(request_ids(compiled), compiled["requests"]) if i is not None}
    assert mixed_step(dump, lens), "no step mixed a prefill and a decode: the scenario does not test batching"


def test_same_tokens_as_eager(compiled, eager_all):
    # The plugin does not change what the engine computes (eager and compiled give the same tokens here).
    assert [r["tokens"] for r in compiled["requests"]] == [r["tokens"] for r in eager_all["requests"]]


@pytest.fixture(scope="module")
def compiled_residual(engines):
    return engines("compiled_residual", "compiled", "all", RESIDUAL_CONFIG, env={"ENGINE_CHECK_SOURCES": "1"})


def test_captured_tensors_hold_their_values_until_the_step_ends(compiled_residual):
    # A CUDA engine copies a pass's captures when the pass ends: each captured tensor must still hold the captured
    # values then. Inductor computes a site's tensor once for an op at the site and again for the end op, reusing the
    # first buffer in between (seen with torch 2.13 on the residual of layer 0): captures noted at the sites read
    # another tensor's bytes at the end (with captures at the sites this fails: 10 of 20 changed). The plugin makes
    # these captures in the end op, from the tensors it receives — so this guards that structure; that those tensors
    # hold the right values is check_capture's comparison with the reference.
    assert compiled_residual["compiled"], compiled_residual["compilation_mode"]
    check_capture(compiled_residual, captured_requests=[0, 1, 2, 3, 4], sites=1)
    src = compiled_residual["sources"]
    assert src["captures"] >= 2 * len(compiled_residual["requests"]), src
    assert src["changed_before_end"] == 0, src


@pytest.fixture(scope="module")
def compiled_overlap(engines):
    return engines("compiled_overlap", "compiled", "all", overlap_config('["residual"]', "[0]"),
                   env={"ENGINE_CHECK_SOURCES": "1", "TORCH_LOGS": "output_code"})


def test_overlap_copy_submits_after_the_last_site_and_the_end_op_keeps_its_buffers(compiled_overlap):
    # vllm.overlap_copy with the residual of layer 0 of 2: the pass's captures are submitted after layer 0 (on CUDA
    # the copy starts there, on a side stream) and the step ends before layer 1's attention, joining it. The rows are
    # the reference's; each step is submitted once, with every capture before it; and the end op receives the very
    # buffers that were captured, holding the captured values — what the submitted copy reads until it is joined.
    res = compiled_overlap
    assert res["compiled"], res["compilation_mode"]
    assert res["overlap"] == [0, False, 1]  # submitted after layer 0 (its residual), ended before layer 1's attention
    # In the compiled code the model's work lies between the two ops (layer 1's qkv projection), where the copy
    # overlaps it; without a tensor of the join point in the end op, Inductor ran the end op right after the submit.
    between = work_between_submit_and_end(res["log"])
    assert between and min(between) >= 1, between
    check_capture(res, captured_requests=[0, 1, 2, 3, 4], sites=1, layers=1)
    check_overlap_sources(res, 1)  # one capture (layers.0.resid) per step


@pytest.fixture(scope="module")
def compiled_lm_head(engines):
    return engines("compiled_lm_head", "compiled", "all",
                   RESIDUAL_CONFIG.replace('sites = ["residual"]', 'sites = ["residual"]\noverlap_copy = "lm_head"'),
                   env={"ENGINE_CHECK_SOURCES": "1", "TORCH_LOGS": "output_code"})


def test_lm_head_copy_ends_the_pass_after_the_final_norm(compiled_lm_head):
    # vllm.overlap_copy = "lm_head": the pass ends with the end_holding op, placed by the decoder's final norm (its
    # output is one of the op's inputs). On CUDA a pass recorded into a graph holds its copy out of the graph and the
    # plugin launches it after each replay, reading the captured buffers after the graph has finished: nothing in the
    # compiled model may run after the op (no buffer reused after it) — here no matrix product follows it in its
    # graph, and it is the pass's only end op. On CPU the op ends the step at once: the rows are the reference's and
    # every captured tensor still held its values when the step ended.
    res = compiled_lm_head
    assert res["compiled"], res["compilation_mode"]
    code = [line.split("[__output_code]", 1)[1].strip() for line in res["log"].splitlines()
            if "[__output_code]" in line]
    ends = [i for i, line in enumerate(code) if line.startswith("torch.ops.ringscope_engine.end_holding.default(")]
    assert ends, "no end_holding op in the compiled code"
    assert not any(line.startswith(("torch.ops.ringscope_engine.end_capturing.default(",
                                    "torch.ops.ringscope_engine.end.default(")) for line in code)
    for i in ends:
        # What follows the op up to its graph's return: nothing but buffers released (the model's output, the final
        # norm's, is one of the op's inputs, so the op comes after it).
        rest = list(itertools.takewhile(lambda line: not line.startswith("return "), code[i + 1:]))
        assert all(line.startswith("del ") for line in rest), rest
    check_capture(res, captured_requests=[0, 1, 2, 3, 4], sites=1)
    src = res["sources"]
    assert src["captures"] >= 2 * len(res["requests"]), src
    assert src["changed_before_end"] == 0, src
