"""The engine core in a process of its own (how `vllm serve` runs): the plugin, loaded there through its entry point,
captures, and the dump is complete once the engine has shut down (the session closes at the process's exit)."""

import json
import pathlib

import ringscope


def test_multiprocess_engine(engines):
    res = engines("multiprocess", "eager", "multiprocess",
                  config='[export]\nparquet = true\ndir = "{dir}"\nrun_id = "run"\n# {requests}\n')
    assert res.get("error") is None, res.get("traceback")
    run = pathlib.Path(res["out"]) / "dump" / "run"
    dump = ringscope.read_dump(run)
    assert sorted(dump) == ["layers.0.resid", "layers.1.resid"]
    (line,) = (run / "_ringscope_vllm" / "requests.jsonl").read_text().splitlines()
    rid = json.loads(line)["request_id"]
    # 3 prompt tokens, then 3 decode steps (the 4th token is sampled, never fed back).
    assert dump["layers.1.resid"]["request_id"].tolist() == [rid] * 6
    assert dump["layers.1.resid"]["position"].tolist() == [0, 1, 2, 3, 4, 5]
    summary = json.loads((run / "_ringscope_vllm" / "summary.json").read_text())
    s = summary["session"]
    assert s["exported_rows"] == 12 and s["produced_rows"] == s["exported_rows"] + s["dropped_rows"]
