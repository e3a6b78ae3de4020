"""The streaming reader (ringscope.stream, ringscope.torch.ActivationDataset) over the CI dump (Parquet and Arrow
IPC): every row exactly once, bit for bit, in batches of the size asked; shuffling, sharding and bad arguments."""
import os
import pathlib

import numpy as np
import pytest

import ringscope
from ringscope import RingscopeError
from ringscope import stream

ROOT = pathlib.Path(__file__).resolve().parents[2]
RUN_DIR = pathlib.Path(os.environ.get("RINGSCOPE_RUN_DIR", ROOT / "ringscope-out" / "ci"))
HP = "layers.1.resid"


@pytest.fixture(scope="module")
def expected():
    if not (RUN_DIR / "_arrow_ipc").exists():
        pytest.fail(f"no Arrow IPC dump at {RUN_DIR}: run the dump_parquet example with --arrow-ipc first")
    return ringscope.read_dump(RUN_DIR, hookpoint=HP)[HP]


def keyed(step, request_id, position, act):
    """Rows sorted by (step, request id, position), as read_dump returns them."""
    order = np.lexsort((position, request_id, step))
    return step[order], request_id[order], position[order], act[order]


def collect(batches):
    bs = list(batches)
    cat = lambda c: np.concatenate([b[c] for b in bs])  # noqa: E731
    return bs, cat("step"), cat("request_id"), cat("position"), cat("activation")


@pytest.mark.parametrize("fmt", ["arrow", "parquet"])
@pytest.mark.parametrize("shuffle", [0, 1000])
def test_every_row_once_bit_exact_in_full_batches(expected, fmt, shuffle):
    bs, step, req, pos, act = collect(stream.iter_batches(RUN_DIR, hookpoints=HP, batch_size=96, format=fmt,
                                                          shuffle_buffer=shuffle, with_meta=True))
    n = len(expected["step"])
    assert [len(b["activation"]) for b in bs] == [96] * (n // 96) + ([n % 96] if n % 96 else [])
    assert all(b["hookpoint"] == HP and b["dtype"] == "bf16" for b in bs)
    assert act.dtype == np.uint16 and act.shape == expected["activation"].shape
    got = keyed(step, req, pos, act)
    for g, e in zip(got, (expected["step"], expected["request_id"], expected["position"], expected["activation"])):
        np.testing.assert_array_equal(g, e)
    in_order = (np.diff(step.astype(np.int64)) >= 0).all()
    assert in_order == (shuffle == 0), "stream order without a shuffle buffer, mixed with one"


def test_shuffle_is_seeded_and_drop_last_and_shards_partition_the_rows(expected):
    a = [b["request_id"] for b in stream.iter_batches(RUN_DIR, HP, 64, shuffle_buffer=500, seed=7, with_meta=True)]
    b = [b["request_id"] for b in stream.iter_batches(RUN_DIR, HP, 64, shuffle_buffer=500, seed=7, with_meta=True)]
    c = [b["request_id"] for b in stream.iter_batches(RUN_DIR, HP, 64, shuffle_buffer=500, seed=8, with_meta=True)]
    assert all((x == y).all() for x, y in zip(a, b)) and any((x != y).any() for x, y in zip(a, c))
    sizes = [len(b["activation"]) for b in stream.iter_batches(RUN_DIR, HP, 1000, drop_last=True)]
    assert sizes and set(sizes) == {1000}
    n = len(expected["step"])
    files = len(list((RUN_DIR / "_arrow_ipc" / f"hookpoint={HP}").glob("rank=*/part-*.arrow")))
    count = min(files, 2)
    rows = [sum(len(b["activation"]) for b in stream.iter_batches(RUN_DIR, HP, 128, shard=(i, count)))
            for i in range(count)]
    assert sum(rows) == n


def test_all_hookpoints_by_default():
    names = {b["hookpoint"] for b in stream.iter_batches(RUN_DIR, batch_size=4096)}
    assert names == {f"layers.{l}.resid" for l in range(4)}


@pytest.mark.parametrize("kwargs, needle", [
    (dict(batch_size=0), "batch_size"),
    (dict(batch_size=1.5), "batch_size"),
    (dict(shuffle_buffer=-1), "shuffle_buffer"),
    (dict(format="csv"), "format"),
    (dict(hookpoints="nope"), "nope"),
    (dict(hookpoints=7), "hookpoints"),
    (dict(shard=(2, 2)), "shard index"),
    (dict(shard=3), "shard"),
])
def test_bad_arguments_name_what_is_wrong(kwargs, needle):
    with pytest.raises(RingscopeError) as e:
        next(stream.iter_batches(RUN_DIR, **kwargs))
    assert needle in str(e.value)


def test_a_path_that_is_not_a_run_is_an_error(tmp_path):
    for path, needle in [(tmp_path / "missing", "not a directory"), (tmp_path, "no hookpoint partitions")]:
        with pytest.raises(RingscopeError) as e:
            next(stream.iter_batches(path))
        assert needle in str(e.value)


def test_torch_dataset_in_a_data_loader_keeps_bf16_and_every_row(expected):
    torch = pytest.importorskip("torch")
    from ringscope.torch import ActivationDataset

    with pytest.raises(RingscopeError):
        ActivationDataset(RUN_DIR, hookpoints="nope")
    ds = ActivationDataset(RUN_DIR, hookpoints=HP, batch_size=100, shuffle_buffer=300, with_meta=True)
    for workers in (0, 2):
        loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=workers)
        items = list(loader)
        act = torch.cat([i["activation"] for i in items])
        assert act.dtype == torch.bfloat16 and act.shape == expected["activation"].shape
        step, req, pos = (torch.cat([i[c] for i in items]).numpy() for c in ("step", "request_id", "position"))
        got = keyed(step, req, pos, act.view(torch.int16).numpy().view(np.uint16))
        np.testing.assert_array_equal(got[3], expected["activation"])
        np.testing.assert_array_equal(got[1], expected["request_id"])


def test_a_changed_byte_in_a_dump_file_is_an_error_naming_it_not_changed_values(tmp_path):
    import shutil

    import pyarrow as pa
    import pyarrow.parquet as pq

    run = tmp_path / "run"
    shutil.copytree(RUN_DIR, run)
    ipc = sorted((run / "_arrow_ipc" / f"hookpoint={HP}").glob("rank=*/part-*.arrow"))[0]
    reader = pa.ipc.open_file(str(ipc))
    ends = [end for end, _ in __import__("json").loads(reader.metadata[b"ringscope.batch_crc32"])]
    parquet = sorted((run / f"hookpoint={HP}").glob("rank=*/part-*.parquet"))[0]
    column = pq.ParquetFile(parquet).metadata.row_group(0)
    act = next(column.column(i) for i in range(column.num_columns) if column.column(i).path_in_schema == "activation")
    for fmt, victim, at in [("arrow", ipc, (ends[0] + ends[1]) // 2 if len(ends) > 1 else ends[0] - 100),
                            ("parquet", parquet, act.data_page_offset + act.total_compressed_size // 2)]:
        data = bytearray(victim.read_bytes())
        data[at] ^= 0x10
        victim.write_bytes(bytes(data))
        with pytest.raises(RingscopeError) as e:
            for _ in stream.iter_batches(run, HP, 256, format=fmt):
                pass
        assert victim.name in str(e.value) and "corrupt" in str(e.value)
        if fmt == "arrow":
            # Without the checks the reader goes on and returns the changed value. (Parquet's zstd pages carry a
            # frame checksum every decoder checks, so there the change is found even then.)
            assert sum(len(b["activation"]) for b in stream.iter_batches(run, HP, 256, format=fmt, verify=False)) > 0


@pytest.mark.parametrize("listed", [b"not json at all", b'[[1, 2, 3]]', b'[["x", 1]]', b'[[999999999999, 1]]'])
def test_batch_checksums_that_make_no_sense_are_an_error_naming_the_file(tmp_path, listed):
    import shutil

    import pyarrow as pa

    run = tmp_path / "run"
    shutil.copytree(RUN_DIR, run)
    victim = sorted((run / "_arrow_ipc" / f"hookpoint={HP}").glob("rank=*/part-*.arrow"))[0]
    reader = pa.ipc.open_file(str(victim))
    batch = reader.get_batch(0)
    footer = {**reader.metadata, b"ringscope.batch_crc32": listed}  # the file's own metadata, the CRCs replaced
    with pa.OSFile(str(victim), "wb") as sink, pa.ipc.new_file(sink, batch.schema, metadata=footer) as w:
        w.write_batch(batch)
    with pytest.raises(RingscopeError) as e:
        for _ in stream.iter_batches(run, HP, 256, format="arrow"):
            pass
    assert victim.name in str(e.value) and "corrupt" in str(e.value)
    want = "out of order" if listed.startswith(b"[[9") else "not a list of [end, crc]"
    assert want in str(e.value)
