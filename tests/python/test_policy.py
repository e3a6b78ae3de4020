"""The policy manager from Python: budgets in the config (errors name the key), the ladder at work under a drain cap
(rungs in ``stats_all``, rung changes in the events table), and full mode's deadline degrading instead of failing.
"""
import time

import numpy as np
import pytest
import ringscope  # installed, or from the checkout (conftest.py)


def hookpoints(n, width):
    return [{"name": f"layers.{i}.resid", "site": "residual", "layer": i, "dtype": "f32", "row_width": width,
             "priority": i} for i in range(n)]


@pytest.mark.parametrize("policy, key", [
    ({"drain_rate": "fast"}, "not a rate"),
    ({"high_watermark": 2.0}, "policy.high_watermark"),
    ({"mode": "full", "max_step_overhead": 0.01}, "policy.max_step_overhead"),
    ({"mode": "best_effort", "gpu_memory": "1 MiB"}, "policy.gpu_memory"),
])
def test_bad_budgets_are_errors_naming_the_key(policy, key):
    config = {"ring": {"capacity": "4 MiB", "max_batch_rows": 64}, "policy": policy, "hookpoints": hookpoints(2, 64)}
    with pytest.raises(ringscope.RingscopeError, match=key.replace(".", r"\.")):
        ringscope.Session(config)


def test_a_drain_cap_moves_hookpoints_down_the_ladder_and_says_so(tmp_path):
    config = {"ring": {"capacity": "16 MiB", "max_batch_rows": 64},
              "policy": {"mode": "best_effort", "drain_rate": "5 MB/s", "dwell_ms": 50},
              "export": {"parquet": True, "dir": str(tmp_path), "run_id": "r", "compression": "none"},
              "hookpoints": hookpoints(4, 1024)}
    s = ringscope.Session(config)
    rows = np.zeros((64, 1024), dtype=np.float32)
    for step in range(80):  # ~1 MiB a step every few ms: far over 5 MB/s
        s.begin_step(step, list(range(64)), [step] * 64)
        for hp in range(4):
            s.capture(hp, rows)
        s.end_step()
        time.sleep(0.005)
    stats = s.stats_all()
    rungs = {h["name"]: h["rung"] for h in stats["hookpoints"]}
    assert stats["stalls"] == 0 and stats["stall_time_s"] == 0.0  # best-effort never waits
    assert all(h["downcast_rows"] <= h["counters"]["exported_rows"] for h in stats["hookpoints"])
    totals = s.close()
    assert totals["sampled_out_rows"] > 0, rungs
    assert rungs["layers.0.resid"] != "full", rungs  # the lowest priority gives way first
    events = [e for e in ringscope.read_events(tmp_path / "r") if e["kind"] == "rung"]
    assert events and {e["reason"] for e in events} <= {"drain_rate", "recovered"}, events
    assert any(e["hookpoint"] == "layers.0.resid" and e["reason"] == "drain_rate" for e in events), events
    assert totals["produced_rows"] == totals["exported_rows"] + totals["dropped_rows"] + totals["sampled_out_rows"]
