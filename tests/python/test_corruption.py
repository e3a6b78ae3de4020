"""A byte changed in a Parquet file after it was written is found by read_dump: every page carries its CRC, and
read_dump checks them, raising a RingscopeError that names the file instead of returning changed values."""
import pathlib

import numpy as np
import pyarrow.parquet as pq
import pytest
import ringscope  # installed, or from the checkout (conftest.py)


@pytest.fixture()
def run_dir(tmp_path):
    config = {"ring": {"capacity": "4 MiB"}, "policy": {"mode": "full"},
              "export": {"parquet": True, "dir": str(tmp_path), "run_id": "crc"}}
    rng = np.random.default_rng(0)
    with ringscope.Session(config) as s:
        hp = s.register("layers.0.resid", site="residual", layer=0, dtype="bf16", row_width=256)
        for step in range(40):
            s.begin_step(step, [7, 8, 9, 10], [step] * 4)
            s.capture(hp, rng.integers(0, 1 << 16, (4, 256), dtype=np.uint16))
            s.end_step()
        s.close()
    return tmp_path / "crc"


def chunk_range(path: pathlib.Path, column: str):
    meta = pq.ParquetFile(path).metadata.row_group(0)
    c = next(meta.column(i) for i in range(meta.num_columns) if meta.column(i).path_in_schema == column)
    start = c.dictionary_page_offset if c.has_dictionary_page else c.data_page_offset
    return start, c.total_compressed_size


@pytest.mark.parametrize("column, where", [("activation", 0.5), ("activation", 0.9), ("step", 1.0),
                                           ("request_id", 1.0)])
def test_a_flipped_byte_in_a_page_is_an_error_naming_the_file(run_dir, column, where):
    before = ringscope.read_dump(run_dir)["layers.0.resid"]["activation"].copy()
    victim = sorted(run_dir.glob("hookpoint=*/rank=*/part-*.parquet"))[0]
    start, size = chunk_range(victim, column)
    at = start + min(int(size * where), size - 1)
    data = bytearray(victim.read_bytes())
    data[at] ^= 0x10
    victim.write_bytes(bytes(data))
    with pytest.raises(ringscope.RingscopeError) as e:
        after = ringscope.read_dump(run_dir)["layers.0.resid"]["activation"]
        pytest.fail(f"read_dump returned {'changed' if (after != before).any() else 'the same'} values")
    assert e.value.status == "RS_ERR_IO" and victim.name in e.value.message and "corrupt" in e.value.message


@pytest.fixture()
def ipc_only_run(tmp_path):
    """The same captures dumped to Parquet and Arrow IPC by one session; then a copy of the run without its Parquet
    partitions (a run dumped to Arrow IPC only). Returns (both, ipc only)."""
    import shutil

    config = {"ring": {"capacity": "4 MiB"}, "policy": {"mode": "full"},
              "export": {"parquet": True, "arrow_ipc": True, "dir": str(tmp_path), "run_id": "both",
                         "max_file_size": "64 KiB"}}
    rng = np.random.default_rng(1)
    with ringscope.Session(config) as s:
        hps = [s.register(f"layers.{i}.resid", site="residual", layer=i, dtype="bf16", row_width=256) for i in (0, 1)]
        for step in range(60):
            s.begin_step(step, [3, 5, 8], [step] * 3)
            for hp in hps:
                s.capture(hp, rng.integers(0, 1 << 16, (3, 256), dtype=np.uint16))
            s.end_step()
        s.close()
    both, ipc = tmp_path / "both", tmp_path / "ipc"
    shutil.copytree(both, ipc)
    for part in ipc.glob("hookpoint=*"):
        shutil.rmtree(part)
    return both, ipc


def test_a_run_dumped_to_arrow_ipc_only_reads_the_same_rows(ipc_only_run):
    both, ipc = ipc_only_run
    assert len(list((ipc / "_arrow_ipc").glob("hookpoint=*/rank=*/part-*.arrow"))) > 2, "expected rotation"
    want, got = ringscope.read_dump(both), ringscope.read_dump(ipc)
    assert sorted(got) == sorted(want) == ["layers.0.resid", "layers.1.resid"]
    for name in want:
        assert got[name]["activation"].shape == (180, 256)
        for column in ("step", "request_id", "position", "layer", "rank", "activation", "downcast"):
            np.testing.assert_array_equal(got[name][column], want[name][column], err_msg=f"{name} {column}")
        assert got[name]["dtype"] == want[name]["dtype"] == "bf16"
    one = ringscope.read_dump(ipc, hookpoint="layers.1.resid")
    assert list(one) == ["layers.1.resid"]
    with pytest.raises(ringscope.RingscopeError, match="'nope' is not in"):
        ringscope.read_dump(ipc, hookpoint="nope")


@pytest.mark.parametrize("fmt", ["parquet", "arrow"])
def test_read_dump_of_one_request_gives_exactly_its_rows(ipc_only_run, fmt):
    """read_dump(..., request=R): the rows of R that a whole read holds, in the same order, nothing else; a request
    with no rows leaves the hookpoints out; a request id that is not one is a clear error."""
    run = ipc_only_run[0] if fmt == "parquet" else ipc_only_run[1]
    whole = ringscope.read_dump(run)
    for request in (3, 5, 8):
        got = ringscope.read_dump(run, request=request)
        assert sorted(got) == sorted(whole)
        for name, cols in whole.items():
            keep = cols["request_id"] == request
            assert keep.sum() == 60
            for column in ("step", "request_id", "position", "layer", "rank", "activation", "downcast"):
                np.testing.assert_array_equal(got[name][column], cols[column][keep], err_msg=f"{name} {column}")
            assert got[name]["dtype"] == "bf16"
    assert ringscope.read_dump(run, request=4) == {}
    assert list(ringscope.read_dump(run, "layers.1.resid", request=5)) == ["layers.1.resid"]
    for bad in (-1, 2**64, 1.0, "3"):
        with pytest.raises(ringscope.RingscopeError, match="request"):
            ringscope.read_dump(run, request=bad)


def test_a_flipped_byte_in_an_arrow_ipc_batch_is_an_error_naming_the_file(ipc_only_run):
    import json

    import pyarrow as pa

    _, ipc = ipc_only_run
    victim = sorted((ipc / "_arrow_ipc").glob("hookpoint=*/rank=*/part-*.arrow"))[0]
    ends = [end for end, _ in json.loads(pa.ipc.open_file(str(victim)).metadata[b"ringscope.batch_crc32"])]
    data = bytearray(victim.read_bytes())
    data[ends[0] - 64] ^= 0x10  # inside the first batch's body (its activations come last)
    victim.write_bytes(bytes(data))
    with pytest.raises(ringscope.RingscopeError) as e:
        ringscope.read_dump(ipc)
    assert e.value.status == "RS_ERR_IO" and victim.name in e.value.message and "corrupt" in e.value.message
