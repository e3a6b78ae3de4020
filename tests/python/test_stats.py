"""Issue 14, observability of the observer from Python: Session.stats_all() mirrors the Rust SessionStats, and
Session.metrics_text() is the Prometheus text exposition.

Needs the built library (RINGSCOPE_LIB, or the checkout's target/release), like test_python_api.py.
"""
import re

import numpy as np
import pytest
import ringscope


def test_stats_all_counts_steps_production_and_destinations():
    with ringscope.Session({"policy": {"mode": "best_effort"}}) as s:
        h = s.register("layers.0.resid", dtype="f32", row_width=4)
        s.set_every_n_steps(h, 2)
        probe = s.subscribe('probe "q"')
        for step in range(3):
            s.begin_step(step, [7, 8], [step, step])
            s.capture(h, np.zeros((2, 4), np.float32))
            s.end_step()
        s.flush()
        st = s.stats_all()
        assert (st["mode"], st["backend"], st["steps"], st["last_step"]) == ("best_effort", "host", 3, 2)
        assert st["step_time_s"] is not None and st["step_interval_s"] is not None
        assert st["ring"]["capacity_bytes"] > 0 and st["uptime_s"] > 0
        assert (st["drain"]["records"], st["drain"]["rows"], st["drain"]["data_bytes"]) == (2, 4, 4 * 16)
        [hp] = st["hookpoints"]
        assert (hp["id"], hp["name"], hp["row_bytes"], hp["rung"]) == (h, "layers.0.resid", 16, "every_2")
        assert hp["counters"]["produced_rows"] == 6 and hp["counters"]["sampled_out_records"] == 1
        assert (hp["produced_bytes"], hp["exported_bytes"]) == (6 * 16, 4 * 16)
        [d] = st["destinations"]
        assert (d["name"], d["kind"], d["queued_records"], d["delivered_records"], d["failed"]) == \
            ('probe "q"', "consumer", 2, 0, False)
        assert probe.poll(5.0) is not None
        assert s.stats_all()["destinations"][0]["delivered_records"] == 1
        s.set_enabled(h, False)
        assert s.stats_all()["hookpoints"][0]["rung"] == "off"
        probe.close()


def test_metrics_text_is_the_prometheus_exposition():
    with ringscope.Session("") as s:
        h = s.register("odd\\name", dtype="f32", row_width=4)
        s.begin_step(0, [1], [0])
        s.capture(h, np.zeros((1, 4), np.float32))
        s.end_step()
        s.flush()
        text = s.metrics_text()
    assert text.endswith("\n")
    sample = re.compile(r'^ringscope_[a-zA-Z0-9_]+(\{([a-z_]+="([^"\\\n]|\\[\\"n])*",?)*\})? [0-9.e+-]+$')
    for line in text.splitlines():
        assert line.startswith("# HELP ringscope_") or line.startswith("# TYPE ringscope_") or sample.match(line), line
    assert 'ringscope_hookpoint_produced_rows_total{hookpoint="odd\\\\name"} 1\n' in text
    assert "# TYPE ringscope_ring_used_bytes gauge\n" in text
    assert "ringscope_steps_total 1\n" in text


def test_stats_after_close_is_an_error_naming_the_session():
    s = ringscope.Session("")
    s.close()
    for call in (s.stats_all, s.metrics_text):
        with pytest.raises(ringscope.RingscopeError, match="closed") as e:
            call()
        assert e.value.status == "RS_ERR_CLOSED"
