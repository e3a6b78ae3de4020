"""The plugin in an eager vLLM engine (enforce_eager): every request captured."""

import json
import pathlib

from conftest import check_capture, mixed_step, request_ids


def test_rows_equal_reference(eager_all):
    assert not eager_all["compiled"]
    dump = check_capture(eager_all, captured_requests=list(range(5)))
    lens = {i: len(r["prompt"]) for i, r in zip(request_ids(eager_all), eager_all["requests"])}
    assert mixed_step(dump, lens), "no step mixed a prefill and a decode: the scenario does not test batching"


def test_request_map_and_salt(eager_all):
    run = pathlib.Path(eager_all["run_dir"])
    lines = [json.loads(x) for x in (run / "_ringscope_vllm" / "requests.jsonl").read_text().splitlines()]
    assert sorted(x["external_request_id"] for x in lines) == sorted(r["vllm_request_id"] for r in eager_all["requests"])
    assert request_ids(eager_all)[1] == 7
    summary = json.loads((run / "_ringscope_vllm" / "summary.json").read_text())
    assert summary["plugin"]["disabled"] is None and summary["session"]["exported_rows"] > 0
    # The compile-cache key is salted with the capture set.
    assert len(eager_all["additional_config"]["ringscope"]) == 16
