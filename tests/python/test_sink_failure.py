"""A sink that fails mid-run, seen from Python: ``Session.sink_failures()`` names it (with its error and time) while
the session runs and after it is closed; full mode refuses the next step with ``RS_ERR_SINK``; best-effort goes on
and counts the losses as ``sink_error``.

The failure is provoked the same way whoever runs the tests (root ignores permissions): a file is put where the
Parquet sink will create a hookpoint's partition directory, so its first write fails, as on a full disk.
"""
import time

import numpy as np
import pytest
import ringscope  # installed, or from the checkout (conftest.py)


def session(tmp_path, mode):
    config = {"ring": {"capacity": "4 MiB"}, "policy": {"mode": mode},
              "export": {"parquet": True, "dir": str(tmp_path), "run_id": "r"}}
    s = ringscope.Session(config)
    hp = s.register("layers.0.resid", site="residual", layer=0, dtype="bf16", row_width=8)
    (tmp_path / "r" / "hookpoint=layers.0.resid").write_bytes(b"in the way")
    return s, hp


def step(s, hp, n):
    s.begin_step(n, [1], [n])
    outcome = s.capture(hp, np.zeros((1, 8), dtype=np.uint16))
    s.end_step()
    return outcome


def test_full_mode_refuses_steps_once_a_sink_failed_and_says_which(tmp_path):
    s, hp = session(tmp_path, "full")
    assert s.sink_failures() == []
    before = time.time_ns()
    assert step(s, hp, 0) == "published"
    s.flush(10.0)  # the record reached the sink, which failed on it
    failures = s.sink_failures()
    assert len(failures) == 1, failures
    f = failures[0]
    assert f["sink"] == "parquet"
    assert "hookpoint=layers.0.resid" in f["message"]
    assert before <= f["unix_ns"] <= time.time_ns()
    with pytest.raises(ringscope.RingscopeError) as e:
        step(s, hp, 1)
    assert e.value.status == "RS_ERR_SINK"
    assert "sink `parquet`" in str(e.value)
    totals = s.close()
    assert (totals["produced_records"], totals["exported_records"]) == (1, 0)
    assert totals["dropped_by_reason"]["sink_error"] == 1
    assert s.sink_failures() == failures, "still answered after close"


def test_best_effort_keeps_capturing_and_counts_the_losses(tmp_path):
    s, hp = session(tmp_path, "best_effort")
    for n in range(5):
        assert step(s, hp, n) == "published"
        s.flush(10.0)
    assert [f["sink"] for f in s.sink_failures()] == ["parquet"]
    totals = s.close()
    assert totals["produced_records"] == totals["dropped_by_reason"]["sink_error"] == 5
