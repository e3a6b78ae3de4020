"""Tensor-parallel ranks: every rank has its own session (and ring) and writes the `rank=R` partitions of one run —
here two processes through the C ABI (the Python package is ctypes over it), run at the same time, writing into the
same run directory. Each rank writes its own manifest (`_ringscope_run.json` for rank 0,
`_ringscope_run.rank=R.json` for the others) and its own events files; readers see one dataset: `read_dump` every
rank's rows (a `rank` column), `inspect` the merged accounting of every rank against every rank's files.

A replicated tensor (the residual stream is the same on every tensor-parallel rank) is captured once — only rank 0
opens a session, which is what the vLLM plugin's default `vllm.ranks = [0]` does — or once per rank (`"all"`).
"""
import json
import os
import subprocess
import sys

import numpy as np

import ringscope
from test_retention import inspect_binary

RANK = r"""
import sys
import numpy as np
import ringscope
run_dir, run_id, rank = sys.argv[1], sys.argv[2], int(sys.argv[3])
config = {"policy": {"mode": "full"},
          "export": {"parquet": True, "arrow_ipc": True, "dir": run_dir, "run_id": run_id, "rank": rank},
          "hookpoints": [{"name": "layers.0.resid", "site": "residual", "layer": 0, "dtype": "f32", "row_width": 8}]}
with ringscope.Session(config) as s:
    hp = s.hookpoint_id("layers.0.resid")
    for step in range(5):
        s.begin_step(step, [7, 9], [step, step])
        # Replicated over the ranks: every rank holds the same rows.
        s.capture(hp, np.arange(16, dtype=np.float32).reshape(2, 8) + 100 * step)
        s.end_step()
"""


def run_ranks(out, run_id, ranks):
    package = os.path.dirname(os.path.dirname(os.path.abspath(ringscope.__file__)))
    env = {**os.environ, "PYTHONPATH": package + os.pathsep + os.environ.get("PYTHONPATH", "")}
    procs = [subprocess.Popen([sys.executable, "-c", RANK, str(out), run_id, str(r)], env=env) for r in ranks]
    assert [p.wait(timeout=120) for p in procs] == [0] * len(ranks)
    return out / run_id


def inspect(run):
    return subprocess.run([inspect_binary(), "--verify", str(run)], capture_output=True, text=True, timeout=120)


def test_two_ranks_write_one_dataset_that_readers_see_whole(tmp_path):
    run = run_ranks(tmp_path, "tp", [0, 1])
    manifests = sorted(p.name for p in run.glob("_ringscope_run*.json"))
    assert manifests == ["_ringscope_run.json", "_ringscope_run.rank=1.json"]
    assert [json.loads((run / m).read_text())["rank"] for m in manifests] == [0, 1]
    assert sorted(p.name for p in (run / "hookpoint=layers.0.resid").iterdir()) == ["rank=0", "rank=1"]

    dump = ringscope.read_dump(run)["layers.0.resid"]
    assert sorted(dump["rank"].tolist()) == [0] * 10 + [1] * 10
    rows = {}
    for k in range(len(dump["rank"])):
        rows.setdefault((int(dump["step"][k]), int(dump["request_id"][k])), []).append(dump["activation"][k])
    assert len(rows) == 10 and all(len(v) == 2 and np.array_equal(v[0], v[1]) for v in rows.values()), \
        "every rank captured the replicated rows once"

    checked = inspect(run)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "PROBLEM" not in checked.stdout
    # The merged accounting: 20 rows produced and exported, over both ranks, for each file sink.
    lines = [line.split() for line in checked.stdout.splitlines() if "layers.0.resid" in line]
    assert len(lines) == 2 and all(line[6] == "20" and line[10] == "20" and line[11] == "20" for line in lines), \
        checked.stdout


def test_a_replicated_tensor_captured_once_and_a_missing_rank_manifest_is_a_problem(tmp_path):
    run = run_ranks(tmp_path, "rank0", [0])
    dump = ringscope.read_dump(run)["layers.0.resid"]
    assert dump["rank"].tolist() == [0] * 10
    assert inspect(run).returncode == 0

    run = run_ranks(tmp_path, "both", [0, 1])
    (run / "_ringscope_run.rank=1.json").unlink()
    checked = inspect(run)
    assert checked.returncode != 0 and "20 rows on disk but the manifest says the sink committed 10" in checked.stdout, \
        checked.stdout
