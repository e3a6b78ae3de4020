"""A session's life through Python and the C ABI under the conditions an independent check found wrong (issue 28):
two closers at once, many sessions opened and closed, two writers of one run, probe files that are not what they
claim, and a metrics endpoint with idle or slow clients."""
import os
import socket
import threading
import time

import numpy as np
import pytest

import ringscope

D = 16


def _probe_config(tmp_path, **extra):
    w = ringscope.save_probe(tmp_path / "w.safetensors", np.eye(2, D, dtype=np.float32), np.zeros(2, np.float32))
    cfg = {"hookpoints": [{"name": "h", "site": "residual", "layer": 0, "dtype": "f32", "row_width": D}],
           "probes": [{"name": "p", "hookpoint": "h", "threshold": 0.5, **w}]}
    cfg.update(extra)
    return cfg


def _steps(s, n=20):
    hp = s.hookpoint_id("h")
    for step in range(n):
        s.begin_step(step, [1, 2], [step, step])
        s.capture(hp, np.ones((2, D), np.float32))
        s.end_step()


def test_close_from_two_threads_gives_both_callers_the_same_totals(tmp_path):
    """Before: the losing caller got all-zero totals (20 of 20 runs)."""
    for _ in range(20):
        s = ringscope.Session(_probe_config(tmp_path))
        _steps(s)
        out, barrier = [], threading.Barrier(2)

        def close():
            barrier.wait()
            out.append(s.close())
        threads = [threading.Thread(target=close) for _ in range(2)]
        [t.start() for t in threads]
        [t.join() for t in threads]
        assert len(out) == 2 and out[0] == out[1], out
        assert out[0]["produced_rows"] == 40 and out[0]["exported_rows"] == 40, out[0]


def _rss_mib():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs /proc")
@pytest.mark.parametrize("alerts", ["unread alerts", "no alert"])
def test_closed_sessions_with_probes_do_not_keep_their_memory(tmp_path, alerts):
    """Before: every closed session with probes kept its alerts queue (5-6.5 MiB): 200 cycles grew RSS by 1.3 GiB;
    then one whose probe never alerted kept ~3.3 MiB (200 cycles: +670 MiB)."""
    cfg = _probe_config(tmp_path)
    if alerts == "no alert":
        cfg["probes"][0]["threshold"] = 1e9
    for _ in range(10):  # warm up the allocator and the library
        s = ringscope.Session(cfg)
        _steps(s, 2)
        s.close()
    before = _rss_mib()
    for _ in range(200):
        s = ringscope.Session(cfg)
        _steps(s, 2)
        s.close()
    grown = _rss_mib() - before
    assert grown < 150, f"RSS grew {grown:.0f} MiB over 200 closed sessions"
    if alerts == "no alert":
        assert s.probe_stats()[0]["alerts"] == 0, "the probe was meant never to alert"


def test_a_second_writer_of_one_run_and_rank_is_refused_and_the_first_keeps_its_rows(tmp_path):
    """Before: both opened; the second's part-00000.parquet and manifest replaced the first's."""
    def cfg():
        return {"export": {"parquet": True, "dir": str(tmp_path), "run_id": "r"},
                "hookpoints": [{"name": "h", "site": "residual", "layer": 0, "dtype": "f32", "row_width": D}]}
    first = ringscope.Session(cfg())
    with pytest.raises(ringscope.RingscopeError, match="another session") as e:
        ringscope.Session(cfg())
    assert e.value.status == "RS_ERR_CONFIG"
    _steps(first, 3)
    first.close()
    with pytest.raises(ringscope.RingscopeError, match="already holds a dump"):
        ringscope.Session(cfg())
    dump = ringscope.read_dump(tmp_path / "r")
    assert len(dump["h"]["step"]) == 6


@pytest.mark.parametrize("make, want", [
    (lambda p: os.mkfifo(p), "a FIFO"),
    (lambda p: os.symlink("/dev/zero", p), "a device"),
    (lambda p: p.write_bytes(b"\x93NUMPY\x02\x00" + (0xFFFFFFF0).to_bytes(4, "little") + b" " * 64), "damaged"),
])
def test_probe_files_that_are_not_regular_or_lie_about_their_size_are_clear_errors(tmp_path, make, want):
    """Before: a FIFO hung session open, /dev/zero read without bound, a huge npy header length aborted."""
    path = tmp_path / "w.npy"
    make(path)
    cfg = {"hookpoints": [{"name": "h", "site": "residual", "layer": 0, "dtype": "f32", "row_width": D}],
           "probes": [{"name": "p", "hookpoint": "h", "threshold": 0.5, "weights": str(path)}]}
    t = time.monotonic()
    with pytest.raises(ringscope.RingscopeError, match=want) as e:
        ringscope.Session(cfg)
    assert "w.npy" in str(e.value) and time.monotonic() - t < 10


def test_metrics_port_is_reported_and_idle_clients_delay_neither_scrapes_nor_close():
    """Before: one connection at a time — 200 idle clients made a scrape wait > 20 s; no API said the port."""
    s = ringscope.Session({"metrics": {"listen": "127.0.0.1:0"}})
    port = s.metrics_port()
    assert port > 0
    idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(200)]
    try:
        t = time.monotonic()
        with socket.create_connection(("127.0.0.1", port), timeout=30) as c:
            c.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            got = b""
            while chunk := c.recv(65536):
                got += chunk
        scrape = time.monotonic() - t
        # Every idle client is cut off at its deadline (2 s), never waited on by the others: a scrape is answered
        # (200, or 503 while too many connections are open) within a few of those deadlines, not 200 of them.
        assert got.startswith((b"HTTP/1.1 200", b"HTTP/1.1 503")), got[:80]
        assert scrape < 10, f"a scrape took {scrape:.1f} s with 200 idle clients"
        t = time.monotonic()
        s.close()
        assert time.monotonic() - t < 5, "idle metrics clients held up close()"
    finally:
        for c in idle:
            c.close()
    plain = ringscope.Session()
    assert plain.metrics_port() == 0
    plain.close()
    with pytest.raises(ringscope.RingscopeError) as e:
        plain.metrics_port()
    assert e.value.status == "RS_ERR_CLOSED"


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_session_used_from_a_forked_child_is_a_clear_error_and_the_parent_run_stays_whole(tmp_path):
    """Before: the child's close got RS_ERR_PANIC ("threads should not terminate unexpectedly")."""
    cfg = {"export": {"parquet": True, "dir": str(tmp_path), "run_id": "fork"},
           "hookpoints": [{"name": "h", "site": "residual", "layer": 0, "dtype": "f32", "row_width": D}]}
    s = ringscope.Session(cfg)
    _steps(s, 3)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report what each call did, never run the parent's cleanup
        code = 0
        try:
            out = []
            for call in (s.close, lambda: _steps(s, 1), s.stats_all):
                try:
                    call()
                    out.append("ok")
                except ringscope.RingscopeError as e:
                    out.append(f"{e.status}|{e.message}")
                except BaseException as e:  # noqa: BLE001 - reported to the parent
                    out.append(f"other|{type(e).__name__}: {e}")
            # A session of the child's own works.
            own = {**cfg, "export": {**cfg["export"], "run_id": "child"}}
            with ringscope.Session(own) as c:
                _steps(c, 2)
            out.append(f"child {c.totals['exported_rows']}")
            os.write(w, "\n".join(out).encode())
        except BaseException as e:  # noqa: BLE001
            os.write(w, f"crash {type(e).__name__}: {e}".encode())
            code = 1
        finally:
            os._exit(code)
    os.close(w)
    with os.fdopen(r) as f:
        lines = f.read().split("\n")
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, lines
    assert len(lines) == 4, lines
    for line in lines[:3]:
        code, _, message = line.partition("|")
        assert code == "RS_ERR_STATE", lines
        assert f"opened by process {os.getpid()}" in message and f"this is process {pid}" in message, line
    assert lines[3] == "child 4", lines
    # The parent's session went on untouched by the child.
    _steps(s, 1)
    totals = s.close()
    assert totals["produced_rows"] == 8 and totals["exported_rows"] == 8, totals
    assert ringscope.read_dump(tmp_path / "fork", hookpoint="h")["h"]["activation"].shape == (8, D)


def test_reading_toml_without_tomllib_or_tomli_is_a_clear_error(monkeypatch):
    """Before Python 3.11 the TOML reader is tomli (a dependency there); without either, a RingscopeError naming it."""
    import sys

    monkeypatch.setitem(sys.modules, "tomllib", None)
    monkeypatch.setitem(sys.modules, "tomli", None)
    with pytest.raises(ringscope.RingscopeError) as e:
        ringscope._toml()
    assert e.value.status == "RS_ERR_CONFIG" and "pip install tomli" in e.value.message

