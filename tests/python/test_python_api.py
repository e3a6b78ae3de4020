"""The Python package (ffi/python, ctypes over libringscope): a session from Python with numpy arrays, an online
consumer, the read-back helper, and every bad input the API promises to turn into a RingscopeError.

Uses the installed package (`pip install ./ffi/python`) or, if it is not installed, the sources in ffi/python with the
library RINGSCOPE_LIB names (test.sh: the one `cargo test` built) or else `cargo build --release -p ringscope-ffi`'s.
"""
import numpy as np
import pytest
import ringscope  # installed, or from the checkout (conftest.py)


def bf16_bits(x):
    return (np.asarray(x, dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16)


def test_a_session_from_python_round_trips_through_parquet(tmp_path):
    config = {"ring": {"capacity": "4 MiB"}, "policy": {"mode": "full"},
              "export": {"parquet": True, "dir": str(tmp_path), "run_id": "py"}}
    rng = np.random.default_rng(0)
    sent = {}
    with ringscope.Session(config) as s:
        ids = [s.register(f"layers.{l}.resid", site="residual", layer=l, dtype="bf16", row_width=32) for l in range(3)]
        probe = s.subscribe("probe", layers=[1])
        for step in range(12):
            n = 1 + step % 4
            req = [100 + (step + i) % 5 for i in range(n)]
            pos = [step * 4 + i for i in range(n)]
            s.begin_step(step, req, pos)
            for l, hp in enumerate(ids):
                x = bf16_bits(rng.standard_normal((n, 32)))
                assert s.capture(hp, x) == "published"
                for i in range(n):
                    sent[(l, step, req[i], pos[i])] = x[i]
            s.end_step()
        assert s.stats(ids[0])["produced_rows"] == sum(1 + step % 4 for step in range(12))
        first = probe.poll(5.0)
        assert first is not None and first.step == 0 and first.dtype == "bf16"
        assert (first.rows[0] == sent[(1, 0, first.request_id[0], first.position[0])]).all()
        totals = s.close()
    assert totals["exported_rows"] == totals["produced_rows"] == 3 * sum(1 + step % 4 for step in range(12))
    assert totals["dropped_rows"] == 0
    assert s.close() == totals, "closing twice is harmless"

    dump = ringscope.read_dump(tmp_path / "py")
    assert sorted(dump) == [f"layers.{l}.resid" for l in range(3)]
    for l in range(3):
        d = dump[f"layers.{l}.resid"]
        assert d["dtype"] == "bf16" and d["activation"].shape[1] == 32
        for k in range(len(d["step"])):
            key = (l, int(d["step"][k]), int(d["request_id"][k]), int(d["position"][k]))
            assert (d["activation"][k] == sent.pop(key)).all()
    assert not sent, "every captured row is in the dump"


def test_bad_input_raises_clear_errors(tmp_path):
    with pytest.raises(ringscope.RingscopeError) as e:
        ringscope.Session("[ring]\ncapacity = \"a lot\"\n")
    assert e.value.status == "RS_ERR_CONFIG" and "capacity" in e.value.message
    with pytest.raises(ringscope.RingscopeError, match="unknown field"):
        ringscope.Session({"ring": {"colour": "blue"}})

    s = ringscope.Session("")
    hp = s.register("h", dtype="f32", row_width=4)
    with pytest.raises(ringscope.RingscopeError) as e:
        s.capture(hp, np.zeros((1, 4), dtype=np.float32))
    assert e.value.status == "RS_ERR_STEP"
    s.begin_step(0, [1, 2], [0, 0])
    with pytest.raises(ringscope.RingscopeError, match="holds f32"):
        s.capture(hp, np.zeros((2, 4), dtype=np.float64))
    with pytest.raises(ringscope.RingscopeError, match="C-contiguous"):
        s.capture(hp, np.zeros((4, 2), dtype=np.float32).T)
    with pytest.raises(ringscope.RingscopeError) as e:
        s.capture(hp, np.zeros((3, 4), dtype=np.float32))  # 3 rows for a 2-row batch
    assert e.value.status == "RS_ERR_CAPTURE" and "expected 32" in e.value.message
    with pytest.raises(ringscope.RingscopeError, match="one of each"):
        s.begin_step(1, [1, 2], [0])
    with pytest.raises(ringscope.RingscopeError) as e:
        s.capture_device(hp, 0x1000, 1, 0)
    assert "host backend" in e.value.message
    hb = s.register("b", dtype="bf16", row_width=4)
    with pytest.raises(ringscope.RingscopeError, match="holds bf16; got an array of float16"):
        s.capture(hb, np.zeros((2, 4), dtype=np.float16))
    assert s.capture(hb, np.zeros((2, 4), dtype=np.uint16)) == "published"
    with pytest.raises(ringscope.RingscopeError, match="int64 CUDA tensor"):
        s.begin_step_graph(np.zeros(2, dtype=np.int64), np.zeros(2, dtype=np.int64), stream=0)
    # Ended-sequence tokens: checked before the tensors, each mistake named.
    z = np.zeros(2, dtype=np.int64)
    for kwargs, want in [({"tokens": z}, "give tokens and ended_tokens together"),
                         ({"ended_tokens": [2]}, "give tokens and ended_tokens together"),
                         ({"tokens": z, "ended_tokens": "2"}, "ended_tokens must be a sequence of token ids"),
                         ({"tokens": z, "ended_tokens": 2}, "ended_tokens must be a sequence of token ids"),
                         ({"tokens": z, "ended_tokens": [2.0]}, "ended_tokens must be an integer"),
                         ({"tokens": z, "ended_tokens": [2**63]}, "ended_tokens must be an integer"),
                         ({"tokens": z, "ended_tokens": list(range(9))}, "9 ended_tokens, at most 8"),
                         ({"tokens": z, "ended_tokens": [2, -1]}, "request_ids must be a contiguous int64 CUDA tensor"),
                         ({"kept": z, "tokens": z, "ended_tokens": [2]}, "give kept or tokens, not both"),
                         ({"kept": z}, "kept must be a contiguous one-dimensional int32 CUDA tensor"),
                         ({"kept": [1, 0]}, "kept must be a contiguous one-dimensional int32 CUDA tensor")]:
        with pytest.raises(ringscope.RingscopeError, match=want) as e:
            s.begin_step_graph(z, z, stream=0, **kwargs)
        assert e.value.status == "RS_ERR_INVALID_ARGUMENT"
    with pytest.raises(ringscope.RingscopeError) as e:
        s.apply_controls(stream=0)
    assert "host backend" in e.value.message
    # What an engine plugin calls before every pass (the C call alone): the same errors, every time.
    for full in (False, True, False):
        with pytest.raises(ringscope.RingscopeError) as e:
            s._before_pass(full)(4, 0)
        assert "host backend" in e.value.message
    with pytest.raises(ringscope.RingscopeError):
        s.set_every_n_steps(hp, 0)
    s.end_step()
    s.close()
    with pytest.raises(ringscope.RingscopeError) as e:
        s.begin_step(2, [1], [0])
    assert e.value.status == "RS_ERR_CLOSED"
    with pytest.raises(ringscope.RingscopeError) as e:
        s.register("late", dtype="f32", row_width=4)
    assert e.value.status == "RS_ERR_CLOSED"


def test_flush_makes_everything_captured_so_far_readable_before_close(tmp_path):
    config = {"ring": {"capacity": "4 MiB"}, "policy": {"mode": "full"},
              "export": {"parquet": True, "threads": 2, "dir": str(tmp_path), "run_id": "fl"}}
    rng = np.random.default_rng(1)
    with ringscope.Session(config) as s:
        hp = s.register("layers.0.resid", site="residual", layer=0, dtype="bf16", row_width=16)
        sent = []
        for half in range(2):
            for step in range(half * 5, half * 5 + 5):
                s.begin_step(step, [7, 8], [step, step])
                x = bf16_bits(rng.standard_normal((2, 16)))
                assert s.capture(hp, x) == "published"
                sent.append(x)
                s.end_step()
            s.flush(10.0)  # the open files are committed: the dump so far reads back, the session still open
            d = ringscope.read_dump(tmp_path / "fl")["layers.0.resid"]
            assert list(d["step"]) == [k for k in range(half * 5 + 5) for _ in range(2)]
            assert (d["activation"] == np.concatenate(sent)).all()
        totals = s.close()
    assert totals["exported_rows"] == totals["produced_rows"] == 20
