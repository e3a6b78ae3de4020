"""The plugin in a compiled vLLM engine (the default: torch.compile, fullgraph, inductor), in opt-in mode: only the
requests that opted in through SamplingParams(extra_args={"ringscope": ...}) are exported."""

import pytest

from conftest import check_capture, mixed_step, request_ids


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
