"""The downcast rung from Python: a bf16 hookpoint whose downcast is turned on and off mid-run (Session.set_downcast),
dumped to Parquet and Arrow IPC; read_dump and stream.iter_batches read the downcast rows back as floats within
E4M3's error bound and mark them; full-precision rows stay exact; a plain pyarrow read of the run still sees one
schema; the manifest counts the downcast rows; a changed byte in a downcast file is caught."""
import json

import numpy as np
import pyarrow.dataset as ds
import pytest

import ringscope
from ringscope import RingscopeError, stream

WIDTH = 64
DOWNCAST_STEPS = range(4, 9)


def bf16_bits(x):
    return (np.asarray(x, dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("downcast")
    config = {"ring": {"capacity": "4 MiB"}, "policy": {"mode": "full"},
              "export": {"parquet": True, "arrow_ipc": True, "dir": str(root), "run_id": "dc"}}
    rng = np.random.default_rng(7)
    sent = {}
    with ringscope.Session(config) as s:
        hp = s.register("layers.0.resid", site="residual", layer=0, dtype="bf16", row_width=WIDTH)
        ids = s.register("token_ids", site="custom", dtype="i32", row_width=1)
        with pytest.raises(RingscopeError, match="token_ids.*i32"):
            s.set_downcast(ids, True)
        for step in range(12):
            s.set_downcast(hp, step in DOWNCAST_STEPS)
            n = 1 + step % 3
            req, pos = [10 + i for i in range(n)], [step] * n
            s.begin_step(step, req, pos)
            # Activation-like rows: normal values with a few outliers.
            x = bf16_bits(rng.standard_normal((n, WIDTH)) * np.where(rng.random((n, WIDTH)) < 0.02, 50, 1))
            assert s.capture(hp, x) == "published"
            s.capture(ids, np.arange(n, dtype=np.int32).reshape(n, 1))
            for i in range(n):
                sent[(step, req[i], pos[i])] = x[i]
            s.end_step()
        totals = s.close()
    assert totals["exported_rows"] == totals["produced_rows"]
    return root / "dc", sent


def check_rows(sent, step, req, pos, act, downcast):
    """Full-precision rows exact; downcast rows within E4M3's bound (all values here are E4M3 normals after
    scaling except those below amax / 28672, held to the subnormal bound)."""
    assert len(step) == len(sent)
    for k in range(len(step)):
        want = ringscope.as_float32(sent[(int(step[k]), int(req[k]), int(pos[k]))])
        assert bool(downcast[k]) == (int(step[k]) in DOWNCAST_STEPS)
        got = np.asarray(act[k], dtype=np.float32)
        if not downcast[k]:
            assert (got == want).all()
            continue
        amax = np.abs(want).max()
        scale = amax / 448
        normal = np.abs(want) >= amax / 28672
        err = np.abs(got - want)
        assert (err[normal] <= np.abs(want[normal]) / 16 * (1 + 1e-6)).all()
        assert (err[~normal] <= scale * 2.0 ** -10 * (1 + 1e-6)).all()
        assert (err > 0).any(), "a downcast that changes nothing is not one"


def test_read_dump_dequantizes_and_marks_downcast_rows(run):
    run_dir, sent = run
    d = ringscope.read_dump(run_dir, hookpoint="layers.0.resid")["layers.0.resid"]
    assert d["dtype"] == "f32" and d["source_dtype"] == "bf16" and d["activation"].dtype == np.float32
    assert d["downcast"].sum() == sum(1 + s % 3 for s in DOWNCAST_STEPS)
    check_rows(sent, d["step"], d["request_id"], d["position"], d["activation"], d["downcast"])
    assert list(d["step"]) == sorted(d["step"])
    # A hookpoint without downcast rows reads as before.
    t = ringscope.read_dump(run_dir, hookpoint="token_ids")["token_ids"]
    assert t["dtype"] == "i32" and not t["downcast"].any()


def test_read_dump_of_one_request_reads_its_downcast_and_full_rows(run):
    run_dir, sent = run
    whole = ringscope.read_dump(run_dir, hookpoint="layers.0.resid")["layers.0.resid"]
    d = ringscope.read_dump(run_dir, hookpoint="layers.0.resid", request=11)["layers.0.resid"]
    keep = whole["request_id"] == 11
    assert d["dtype"] == "f32" and d["downcast"].any() and not d["downcast"].all()
    for column in ("step", "request_id", "position", "activation", "downcast"):
        np.testing.assert_array_equal(d[column], whole[column][keep], err_msg=column)


@pytest.mark.parametrize("fmt", ["parquet", "arrow"])
def test_one_requests_rows_read_as_float32_when_the_hookpoint_has_downcast_rows_elsewhere(tmp_path, fmt):
    """The type of read_dump's rows is the hookpoint's, not the request's: request 1 captured only at full precision,
    request 2 only downcast — both read as float32 with source_dtype bf16, as the whole hookpoint does."""
    import shutil

    config = {"policy": {"mode": "full"}, "export": {"parquet": True, "arrow_ipc": True, "dir": str(tmp_path),
                                                      "run_id": "two"}}
    x = bf16_bits(np.random.default_rng(3).standard_normal((6, WIDTH)))
    with ringscope.Session(config) as s:
        hp = s.register("layers.0.resid", site="residual", layer=0, dtype="bf16", row_width=WIDTH)
        for step in range(6):
            s.set_downcast(hp, step >= 3)
            s.begin_step(step, [1 if step < 3 else 2], [step])
            s.capture(hp, x[step:step + 1])
            s.end_step()
        s.close()
    run = tmp_path / "two"
    if fmt == "arrow":
        for part in run.glob("hookpoint=*"):
            shutil.rmtree(part)
    whole = ringscope.read_dump(run)["layers.0.resid"]
    for request, rows in ((1, slice(0, 3)), (2, slice(3, 6))):
        got = ringscope.read_dump(run, request=request)["layers.0.resid"]
        assert (got["dtype"], got["source_dtype"]) == (whole["dtype"], whole["source_dtype"]) == ("f32", "bf16")
        np.testing.assert_array_equal(got["activation"], whole["activation"][rows])
        assert got["downcast"].tolist() == [request == 2] * 3


@pytest.mark.parametrize("fmt", ["arrow", "parquet"])
def test_iter_batches_yields_downcast_rows_as_floats_in_batches_of_their_own(run, fmt):
    run_dir, sent = run
    bs = list(stream.iter_batches(run_dir, hookpoints="layers.0.resid", batch_size=5, format=fmt, with_meta=True))
    assert {b["downcast"] for b in bs} == {True, False}
    for b in bs:
        assert b["dtype"] == ("f8e4m3_rowscaled" if b["downcast"] else "bf16")
    cat = lambda c: np.concatenate([b[c] for b in bs])  # noqa: E731
    acts = [b["activation"].astype(np.float32) if b["downcast"] else ringscope.as_float32(b["activation"]) for b in bs]
    flags = np.concatenate([np.full(len(b["step"]), b["downcast"]) for b in bs])
    check_rows(sent, cat("step"), cat("request_id"), cat("position"), np.concatenate(acts), flags)


def test_a_plain_dataset_read_sees_one_schema_and_the_manifest_counts_downcast_rows(run):
    run_dir, sent = run
    table = ds.dataset(str(run_dir / "hookpoint=layers.0.resid"), partitioning="hive").to_table()
    assert set(table.column("dtype").to_pylist()) == {"bf16"}
    assert table.num_rows == len(sent) - sum(1 + s % 3 for s in DOWNCAST_STEPS)
    files = sorted((run_dir / "hookpoint=layers.0.resid").glob("rank=0/_f8e4m3_rowscaled/part-*.parquet"))
    assert len(files) == 1
    import pyarrow.parquet as pq
    f = pq.ParquetFile(str(files[0]))
    meta = f.schema_arrow.field("activation").metadata
    assert meta[b"ringscope.dtype"] == b"f8e4m3_rowscaled" and b"scale" in meta[b"ringscope.layout"]
    assert f.schema_arrow.field("activation").type.byte_width == WIDTH + 4
    manifest = json.loads((run_dir / "_ringscope_run.json").read_text())
    acc = next(h for h in manifest["hookpoints"] if h["name"] == "layers.0.resid")["accounting"]
    assert acc["downcast"]["rows"] == sum(1 + s % 3 for s in DOWNCAST_STEPS)
    assert acc["downcast"]["records"] == len(DOWNCAST_STEPS)
    assert acc["exported"]["rows"] == len(sent)


def test_a_changed_byte_in_a_downcast_file_is_an_error(run, tmp_path):
    import shutil

    run_dir, _ = run
    copy = tmp_path / "dc"
    shutil.copytree(run_dir, copy)
    f = next((copy / "hookpoint=layers.0.resid").glob("rank=0/_f8e4m3_rowscaled/part-*.parquet"))
    # A byte in the middle of the activation column chunk (a page's data, under its CRC).
    import pyarrow.parquet as pq
    meta = pq.ParquetFile(f).metadata.row_group(0)
    c = next(meta.column(i) for i in range(meta.num_columns) if meta.column(i).path_in_schema == "activation")
    start = c.dictionary_page_offset if c.has_dictionary_page else c.data_page_offset
    data = bytearray(f.read_bytes())
    data[start + c.total_compressed_size // 2] ^= 0x10
    f.write_bytes(bytes(data))
    with pytest.raises(RingscopeError) as e:
        ringscope.read_dump(copy, hookpoint="layers.0.resid")
    assert e.value.status == "RS_ERR_IO" and f.name in e.value.message and "_f8e4m3_rowscaled" in e.value.message
