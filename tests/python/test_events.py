"""The events table from Python: ``ringscope.read_events`` lists what a run lost, when and why, and its rows lost per
(hookpoint, reason) are the manifest's dropped rows; a run that lost nothing has no table and reads as ``[]``.

Losses are provoked as in test_sink_failure.py: a file is put where the Parquet sink will create a hookpoint's
partition directory, so it fails at its first write and every record is counted as ``sink_error``.
"""
import json

import numpy as np
import pytest
import ringscope  # installed, or from the checkout (conftest.py)


def run(tmp_path, in_the_way, steps=6):
    config = {"ring": {"capacity": "4 MiB"}, "policy": {"mode": "best_effort"},
              "export": {"parquet": True, "dir": str(tmp_path), "run_id": "r"}}
    s = ringscope.Session(config)
    hp = s.register("layers.0.resid", site="residual", layer=0, dtype="bf16", row_width=8)
    if in_the_way:
        (tmp_path / "r" / "hookpoint=layers.0.resid").write_bytes(b"in the way")
    for n in range(steps):
        s.begin_step(n, [1, 2], [n, n])
        assert s.capture(hp, np.zeros((2, 8), dtype=np.uint16)) == "published"
        s.end_step()
        if in_the_way:
            s.flush(10.0)  # the record reached the sink, which failed on it
    return s.close(), tmp_path / "r"


def test_every_loss_is_listed_with_its_steps_and_adds_up_to_the_manifest(tmp_path):
    totals, run_dir = run(tmp_path, in_the_way=True)
    assert totals["dropped_by_reason"]["sink_error"] == 6
    events = ringscope.read_events(run_dir)
    assert events, "the run lost every record"
    assert all(list(e) == list(ringscope.EVENT_COLUMNS) for e in events)
    assert {(e["kind"], e["hookpoint"], e["reason"]) for e in events} == {("drop", "layers.0.resid", "sink_error")}
    assert min(e["first_step"] for e in events) == 0 and max(e["last_step"] for e in events) == 5
    assert sum(e["records_lost"] for e in events) == 6
    assert sum(e["rows_lost"] for e in events) == totals["dropped_rows"] == 12
    manifest = json.loads((run_dir / "_ringscope_run.json").read_text())
    dropped = manifest["hookpoints"][0]["accounting"]["dropped"]["sink_error"]["rows"]
    assert sum(e["rows_lost"] for e in events) == dropped
    assert len(manifest["events"]) == len(list((run_dir / ringscope.EVENTS_DIR).glob("part-*.parquet")))


def test_a_run_that_lost_nothing_reads_as_no_events_and_the_dump_is_unchanged(tmp_path):
    totals, run_dir = run(tmp_path, in_the_way=False)
    assert totals["dropped_records"] == 0
    assert not (run_dir / ringscope.EVENTS_DIR).exists()
    assert ringscope.read_events(run_dir) == []
    assert ringscope.read_dump(run_dir)["layers.0.resid"]["step"].tolist() == [n for n in range(6) for _ in (1, 2)]


def test_the_events_table_does_not_confuse_the_dump_readers_and_a_corrupt_file_is_named(tmp_path):
    config = {"ring": {"capacity": "4 MiB"}, "policy": {"mode": "best_effort"},
              "export": {"parquet": True, "dir": str(tmp_path), "run_id": "r"}}
    s = ringscope.Session(config)
    ok = s.register("layers.1.resid", site="residual", layer=1, dtype="bf16", row_width=8)
    s.begin_step(0, [1], [0])
    s.capture(ok, np.ones((1, 8), dtype=np.uint16))
    s.end_step()
    s.close()
    run_dir = tmp_path / "r"
    assert ringscope.read_events(run_dir) == []
    # A table next to the partitions (as a run with losses has): read_dump and the pyarrow dataset skip it.
    import shutil
    other = tmp_path / "other"
    run(other, in_the_way=True)
    shutil.copytree(other / "r" / ringscope.EVENTS_DIR, run_dir / ringscope.EVENTS_DIR)
    assert list(ringscope.read_dump(run_dir)) == ["layers.1.resid"]
    import pyarrow.dataset as ds
    assert ds.dataset(str(run_dir), format="parquet", partitioning="hive").count_rows() == 1
    victim = sorted((run_dir / ringscope.EVENTS_DIR).glob("part-*.parquet"))[0]
    data = bytearray(victim.read_bytes())
    data[data.index(b"layers.0.resid")] ^= 0x01  # its first copy is in the hookpoint column's first page
    victim.write_bytes(bytes(data))
    with pytest.raises(ringscope.RingscopeError) as e:
        ringscope.read_events(run_dir)
    assert e.value.status == "RS_ERR_IO" and victim.name in str(e.value)
    with pytest.raises(ringscope.RingscopeError):
        ringscope.read_events(tmp_path / "nope")
