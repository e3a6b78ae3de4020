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


@pytest.mark.torch
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


# -- on runs written here (no CI dump needed) ------------------------------------------------------------------------

WIDTH = 1024  # bf16 values per row of hookpoint "a": 512 rows are 1 MiB, a record batch of their own in Arrow IPC
ROWS = 512
STEPS = 20


@pytest.fixture(scope="module")
def own_run(tmp_path_factory):
    """A run written here, to Parquet and Arrow IPC: hookpoint "a" (bf16, WIDTH) in one file per format — in Arrow
    IPC one record batch per step, STEPS of them —, "b" (f32, 32 wide: another row width and dtype), "c" (bf16, as
    wide as "a", one step). Row k of "a" has request id k (every row its own). Returns (run dir, rows of "a" sent)."""
    root = tmp_path_factory.mktemp("own")
    config = {"ring": {"capacity": "64 MiB"}, "policy": {"mode": "full"},
              "export": {"parquet": True, "arrow_ipc": True, "dir": str(root), "run_id": "own"}}
    rng = np.random.default_rng(3)
    sent = rng.integers(0, 1 << 16, (STEPS * ROWS, WIDTH), dtype=np.uint16)
    with ringscope.Session(config) as s:
        a = s.register("a", site="residual", layer=0, dtype="bf16", row_width=WIDTH)
        b = s.register("b", site="residual", layer=1, dtype="f32", row_width=32)
        c = s.register("c", site="residual", layer=2, dtype="bf16", row_width=WIDTH)
        for step in range(STEPS):
            s.begin_step(step, list(range(step * ROWS, (step + 1) * ROWS)), list(range(ROWS)))
            assert s.capture(a, sent[step * ROWS:(step + 1) * ROWS]) == "published"
            s.capture(b, rng.standard_normal((ROWS, 32)).astype(np.float32))
            if step == 0:
                s.capture(c, sent[:ROWS])
            s.end_step()
        totals = s.close()
    assert totals["exported_rows"] == totals["produced_rows"]
    run = root / "own"
    ipc = list((run / "_arrow_ipc" / "hookpoint=a").glob("rank=0/part-*.arrow"))
    assert len(ipc) == 1 and __import__("pyarrow").ipc.open_file(str(ipc[0])).num_record_batches == STEPS
    return run, sent


def one_format(run, dest, fmt):
    """A copy of `run` with only its `fmt` files (an Arrow IPC-only run reads as one with read_dump too)."""
    import shutil

    dest.mkdir()
    if fmt == "arrow":
        shutil.copytree(run / "_arrow_ipc", dest / "_arrow_ipc")
    else:
        for part in run.glob("hookpoint=*"):
            shutil.copytree(part, dest / part.name)
    return dest


def only_file(run, fmt, hookpoint="a"):
    base = run / "_arrow_ipc" if fmt == "arrow" else run
    (f,) = (base / f"hookpoint={hookpoint}").glob(f"rank=0/part-*.{'arrow' if fmt == 'arrow' else 'parquet'}")
    return f


def check_every_row_once(sent, batches):
    """Every row of "a" exactly once, bit for bit (request id k is row k)."""
    req = np.concatenate([np.asarray(b["request_id"]) for b in batches]).astype(np.int64)
    act = np.concatenate([np.asarray(b["activation"]) for b in batches])
    order = np.argsort(req, kind="stable")
    np.testing.assert_array_equal(req[order], np.arange(len(sent)))
    np.testing.assert_array_equal(act[order], sent)


@pytest.mark.parametrize("fmt, verify", [("arrow", True), ("arrow", False), ("parquet", True)])
@pytest.mark.parametrize("shuffle", [0, 1000, 1 << 20])  # none; a buffer smaller than the data; larger
def test_every_row_exactly_once_with_and_without_a_shuffle_buffer(own_run, fmt, verify, shuffle):
    run, sent = own_run
    bs = list(stream.iter_batches(run, "a", batch_size=300, shuffle_buffer=shuffle, format=fmt, with_meta=True,
                                  verify=verify))
    assert [len(b["activation"]) for b in bs] == [300] * (len(sent) // 300) + [len(sent) % 300]
    check_every_row_once(sent, bs)
    req = np.concatenate([b["request_id"] for b in bs])
    assert (np.diff(req.astype(np.int64)) > 0).all() == (shuffle == 0), "stream order only without a buffer"
    if shuffle:
        # Mixed across the whole run, not only within a buffer's reach of where a row was read.
        first = bs[0]["request_id"]
        assert first.max() - first.min() > (1000 if shuffle > len(sent) else 300)


def test_a_shuffled_batch_costs_o_batch_not_o_buffer(own_run, monkeypatch):
    """The shuffle draws about one random number per row (each batch is drawn from random places of the buffer),
    not a permutation of the whole buffer per batch: 65,536-row buffers made shuffled reading 11x slower than
    stream order, and buffers for sparse autoencoders hold ~1M rows."""
    run, sent = own_run
    drawn = []

    class Counting:
        def __init__(self, rng):
            self.rng = rng

        def __getattr__(self, name):
            def call(*args, **kwargs):
                out = getattr(self.rng, name)(*args, **kwargs)
                drawn.append(np.size(out))
                return out
            return call

    real = np.random.default_rng
    monkeypatch.setattr(np.random, "default_rng", lambda seed: Counting(real(seed)))
    bs = list(stream.iter_batches(run, "a", batch_size=256, shuffle_buffer=4096, with_meta=True))
    check_every_row_once(sent, bs)
    assert sum(drawn) <= 2 * len(sent), f"{sum(drawn)} random draws for {len(sent)} rows"


@pytest.mark.parametrize("fmt", ["arrow", "parquet"])
@pytest.mark.parametrize("count", [2, 3])
def test_shards_split_every_file_and_together_yield_every_row_once(own_run, fmt, count):
    # "a" is one file: a shard per file left all but one data-loader worker idle.
    run, sent = own_run
    shards = [list(stream.iter_batches(run, "a", batch_size=500, format=fmt, with_meta=True, shard=(i, count)))
              for i in range(count)]
    rows = [sum(len(b["activation"]) for b in bs) for bs in shards]
    assert min(rows) > 0 and max(rows) - min(rows) <= max(rows) // 2, f"unbalanced shards: {rows}"
    check_every_row_once(sent, [b for bs in shards for b in bs])


def tagged_dataset(*args, **kwargs):
    """An ActivationDataset whose items say which data-loader worker yielded them."""
    import torch
    from ringscope.torch import ActivationDataset

    class Tagged(ActivationDataset):
        def __iter__(self):
            worker = torch.utils.data.get_worker_info().id
            for item in super().__iter__():
                yield {**item, "worker": worker}

    return Tagged(*args, **kwargs)


@pytest.mark.torch
def test_two_data_loader_workers_share_one_file_and_yield_every_row_exactly_once(own_run):
    torch = pytest.importorskip("torch")

    run, sent = own_run
    ds = tagged_dataset(run, hookpoints="a", batch_size=700, shuffle_buffer=2000, with_meta=True)
    items = list(torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2))
    assert all(i["request_id"].dtype == torch.int64 and i["activation"].dtype == torch.bfloat16 for i in items)
    rows = [sum(len(i["activation"]) for i in items if i["worker"] == w) for w in (0, 1)]
    assert min(rows) >= len(sent) // 3, f"rows per worker: {rows} (\"a\" is one file: both must read it)"
    check_every_row_once(sent, [{"request_id": i["request_id"].numpy(),
                                 "activation": i["activation"].view(torch.int16).numpy().view(np.uint16)}
                                for i in items])


TRUNCATE_WHILE_READING = """
import os, sys
from ringscope import RingscopeError, stream
run, victim, verify = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
batches = stream.iter_batches(run, "a", batch_size=512, format="arrow", verify=verify)
next(batches)
os.truncate(victim, os.path.getsize(victim) // 2)  # someone else cuts the file while it is read
try:
    for b in batches:
        b["activation"].sum()
except RingscopeError as e:
    print("RingscopeError:", e)
else:
    print("read to the end")
"""


@pytest.mark.parametrize("verify", [True, False])
def test_a_file_truncated_while_it_is_read_is_an_error_naming_it_not_sigbus(own_run, tmp_path, verify):
    # In a process of its own: a memory-mapped file cut while it was read killed the reader with SIGBUS.
    import subprocess
    import sys

    run = one_format(own_run[0], tmp_path / "run", "arrow")
    victim = only_file(run, "arrow")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(pathlib.Path(ringscope.__file__).parents[1]),
                                                        os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", TRUNCATE_WHILE_READING, str(run), str(victim), str(int(verify))],
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, f"the reader died (status {done.returncode}): {done.stderr[-2000:]}"
    assert done.stdout.startswith("RingscopeError:"), done.stdout
    assert str(victim) in done.stdout and "truncated" in done.stdout


def cut(f, how):
    """Truncates or damages file `f` as `how` says."""
    size = f.stat().st_size
    data = bytearray(f.read_bytes())
    if how == "footer length":
        data[-10:-6] = (0x7FFFFFF0).to_bytes(4, "little")
    elif how == "footer zeroed":
        length = int.from_bytes(data[-10:-6], "little")
        data[-10 - length:-10] = bytes(length)
    else:
        data = data[:{"half": size // 2, "last bytes": size - 3, "first bytes": 5, "empty": 0}[how]]
    f.write_bytes(bytes(data))


@pytest.mark.parametrize("how", ["half", "last bytes", "first bytes", "empty", "footer length", "footer zeroed"])
@pytest.mark.parametrize("reader", ["iter_batches", "read_dump"])
def test_a_truncated_or_damaged_arrow_ipc_file_is_an_error_naming_it(own_run, tmp_path, how, reader):
    run = one_format(own_run[0], tmp_path / "run", "arrow")
    victim = only_file(run, "arrow")
    cut(victim, how)
    with pytest.raises(RingscopeError) as e:
        if reader == "read_dump":
            ringscope.read_dump(run, hookpoint="a")
        else:
            for verify in (True, False):
                list(stream.iter_batches(run, "a", format="arrow", verify=verify))
    assert e.value.status == "RS_ERR_IO" and str(victim) in e.value.message


@pytest.mark.parametrize("fmt", ["arrow", "parquet"])
@pytest.mark.parametrize("foreign", ["b", "c"])  # another row width and dtype; as wide as "a"
@pytest.mark.parametrize("reader", ["iter_batches", "read_dump"])
def test_another_hookpoints_file_in_a_partition_is_an_error_naming_it(own_run, tmp_path, fmt, foreign, reader):
    import shutil

    run = one_format(own_run[0], tmp_path / "run", fmt)
    own = only_file(run, fmt)
    intruder = own.with_name("part-99999" + own.suffix)
    shutil.copy(only_file(run, fmt, foreign), intruder)
    with pytest.raises(RingscopeError) as e:
        if reader == "read_dump":
            ringscope.read_dump(run, hookpoint="a")
        else:
            list(stream.iter_batches(run, "a", batch_size=1000, format=fmt))
    msg = e.value.message
    assert str(intruder) in msg and "hookpoint 'a'" in msg and f"names hookpoint {foreign!r}" in msg
    if foreign == "b":
        assert f"{4 * 32} bytes of f32 where the hookpoint's are {2 * WIDTH} bytes of bf16" in msg


def test_every_byte_of_an_arrow_ipc_footer_is_checked(own_run, tmp_path):
    """Before: a byte flipped 300 bytes before the end of a file (in its footer) went unnoticed. Every byte after
    the last record batch — end-of-stream marker, footer, its length, the magic — flipped one at a time, by three
    different bits, fails the footer's check (pyarrow opening the file, then its CRC-32); a few of them, the one 300
    bytes before the end included, through the reader itself: an error naming the file."""
    import json

    import pyarrow as pa

    run = one_format(own_run[0], tmp_path / "run", "arrow")
    victim = only_file(run, "arrow")
    good = victim.read_bytes()
    end = json.loads(pa.ipc.open_file(str(victim)).metadata[b"ringscope.batch_crc32"])[-1][0]
    assert len(good) - end > 300

    data = bytearray(good)  # flipped and flipped back in place: pyarrow reads it without a copy

    def footer_checked() -> bool:
        try:
            metadata = pa.ipc.open_file(pa.BufferReader(data)).metadata or {}
            stream._check_ipc_footer(pa.BufferReader(data), victim, end, len(data), metadata)
        except (RingscopeError, pa.ArrowException, OSError):
            return False
        return True

    assert footer_checked()
    unnoticed = []
    for at in range(end, len(good)):
        for bit in (0x01, 0x20, 0x80):
            data[at] ^= bit
            if footer_checked():
                unnoticed.append((at, bit))
            data[at] ^= bit
    assert not unnoticed, \
        f"{len(unnoticed)} flips of the footer's {len(good) - end} bytes went unnoticed: {unnoticed[:10]}"
    for at in (end, len(good) - 300, len(good) - 20, len(good) - 1):
        bad = bytearray(good)
        bad[at] ^= 0x01
        victim.write_bytes(bytes(bad))
        with pytest.raises(RingscopeError) as e:
            list(stream.iter_batches(run, "a", batch_size=4096, format="arrow"))
        assert e.value.status == "RS_ERR_IO" and str(victim) in e.value.message, (at, e.value)
    victim.write_bytes(good)
    assert sum(len(b["activation"]) for b in stream.iter_batches(run, "a", format="arrow")) == len(own_run[1])


def test_an_arrow_ipc_file_without_a_footer_checksum_is_a_clear_error(own_run, tmp_path):
    """A file written before footer checksums existed (or whose key changed on disk): an error naming the file, the
    key, and how to read it unchecked."""
    run = one_format(own_run[0], tmp_path / "run", "arrow")
    victim = only_file(run, "arrow")
    data = victim.read_bytes()
    assert data.count(b"ringscope.footer_crc32") == 1
    # The key renamed in place (same length): the file reads as one without it, every other byte as written.
    victim.write_bytes(data.replace(b"ringscope.footer_crc32", b"ringscope.footer_crcXX"))
    with pytest.raises(RingscopeError) as e:
        list(stream.iter_batches(run, "a", format="arrow"))
    msg = e.value.message
    assert e.value.status == "RS_ERR_IO" and str(victim) in msg
    assert "ringscope.footer_crc32" in msg and "verify=False" in msg


@pytest.mark.parametrize("fmt", ["arrow", "parquet"])
@pytest.mark.parametrize("where", ["", "_f8e4m3_rowscaled/"])
@pytest.mark.parametrize("reader", ["iter_batches", "read_dump"])
def test_a_directory_named_like_a_part_file_is_an_error_naming_it(own_run, tmp_path, fmt, where, reader):
    run = one_format(own_run[0], tmp_path / "run", fmt)
    own = only_file(run, fmt)
    intruder = own.parent / where / ("part-99999" + own.suffix)  # next to the run's own file, which stays
    (intruder / "inner").mkdir(parents=True)
    with pytest.raises(RingscopeError) as e:
        if reader == "read_dump":
            ringscope.read_dump(run, hookpoint="a")
        else:
            list(stream.iter_batches(run, "a", batch_size=1000, format=fmt))
    assert e.value.status == "RS_ERR_IO" and str(intruder) in e.value.message and "not a file" in e.value.message


@pytest.mark.torch
def test_meta_columns_are_int64_tensors_and_ids_past_int64_are_refused(tmp_path):
    torch = pytest.importorskip("torch")
    from ringscope.torch import ActivationDataset

    for ids, name in [([7, 8, 2**63 - 1], "fits"), ([7, 2**63 + 5], "big")]:
        config = {"policy": {"mode": "full"}, "export": {"arrow_ipc": True, "dir": str(tmp_path), "run_id": name}}
        with ringscope.Session(config) as s:
            hp = s.register("x", site="residual", layer=0, dtype="f32", row_width=4)
            s.begin_step(3, ids, [0] * len(ids))
            s.capture(hp, np.ones((len(ids), 4), dtype=np.float32))
            s.end_step()
            s.close()
        ds = ActivationDataset(tmp_path / name, batch_size=2, with_meta=True)
        if name == "fits":
            items = list(ds)
            assert all(i[c].dtype == torch.int64 for i in items for c in stream.META_COLUMNS)
            assert torch.cat([i["request_id"] for i in items]).tolist() == ids
        else:
            with pytest.raises(RingscopeError, match=r"request_id: 9223372036854775813 does not fit"):
                list(ds)
