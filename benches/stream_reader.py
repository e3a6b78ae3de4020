"""Throughput of the streaming reader (ringscope.stream / ringscope.torch.ActivationDataset) next to plain pyarrow
reading the same files, in the same run.

    cargo run --release --example dump_parquet -- --layers 4 --hidden 2048 --requests 512 --run-id big --arrow-ipc
    PYTHONPATH=ffi/python python3 benches/stream_reader.py ringscope-out/big [--rounds 3] [--shuffle-buffer 1048576]

Baselines: every Arrow IPC file memory-mapped and read whole (`pa.ipc.open_file(pa.memory_map(f)).read_all()`), the
activation column turned into a numpy view, and every byte summed once (so both sides touch the data); every
Parquet file read whole with `pq.read_table(f, columns=["activation"])`, the same. The reader's batches are summed
the same way. Files are read once before timing (page cache warm: this measures the reader, not the disk). The
reader reads Arrow IPC files with plain reads (a mapped file cut by another process is SIGBUS), so it copies what
the memory-mapped baseline does not.

Shuffled reading is timed with a buffer of --shuffle-buffer rows (default 1,048,576: what sparse autoencoder training
holds), which costs that many rows of memory (4 GiB at 2048 bf16 values a row). Each batch is drawn from random
places of the buffer, so the cost of a batch does not grow with the buffer; a run of fewer rows than the buffer is
only shuffled once, at its end, which measures less (the script says so).
"""
import argparse
import pathlib
import sys
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "ffi" / "python"))
from ringscope import stream  # noqa: E402


def column_bytes(t):
    col = t.column("activation").combine_chunks()
    w = col.type.byte_width
    return np.frombuffer(col.buffers()[1], dtype=np.uint8)[col.offset * w:(col.offset + len(col)) * w]


def pyarrow_ipc(files):
    n = 0
    for f in files:
        t = pa.ipc.open_file(pa.memory_map(str(f), "r")).read_all()
        a = column_bytes(t)
        a.sum()
        n += a.nbytes
    return n


def pyarrow_parquet(files):
    n = 0
    for f in files:
        a = column_bytes(pq.read_table(str(f), columns=["activation"]))
        a.sum()
        n += a.nbytes
    return n


def ours(run, fmt, shuffle, verify=True):
    n = 0
    for b in stream.iter_batches(run, batch_size=4096, format=fmt, shuffle_buffer=shuffle, verify=verify):
        a = b["activation"]
        a.view(np.uint8).sum()
        n += a.nbytes
    return n


def largest_hookpoint_rows(ipc, parquet):
    rows = {}
    for f in parquet:
        rows[f.parent.parent.name] = rows.get(f.parent.parent.name, 0) + pq.read_metadata(f).num_rows
    for f in ipc if not rows else ():
        r = pa.ipc.open_file(str(f))
        rows[f.parent.parent.name] = rows.get(f.parent.parent.name, 0) + sum(
            r.get_batch(i).num_rows for i in range(r.num_record_batches))
    return max(rows.values(), default=0)


def timed(f, rounds):
    best = None
    for _ in range(rounds):
        t = time.perf_counter()
        n = f()
        s = time.perf_counter() - t
        best = s if best is None else min(best, s)
    return n, best


def main():
    p = argparse.ArgumentParser()
    p.add_argument("run")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--shuffle-buffer", type=int, default=1 << 20, help="rows of the shuffle buffer timed")
    args = p.parse_args()
    run = pathlib.Path(args.run)
    ipc = sorted((run / "_arrow_ipc").glob("hookpoint=*/rank=*/part-*.arrow"))
    parquet = sorted(run.glob("hookpoint=*/rank=*/part-*.parquet"))
    buf = args.shuffle_buffer
    most = largest_hookpoint_rows(ipc, parquet)
    if most and most < buf:
        print(f"note: the largest hookpoint has {most:,} rows, fewer than the {buf:,}-row shuffle buffer: its rows are "
              "shuffled once at the end (dump more rows to time batches drawn from a full buffer)")
    rows = [
        ("pyarrow, Arrow IPC memory-mapped, whole files", lambda: pyarrow_ipc(ipc)),
        ("ringscope.stream, Arrow IPC, batches of 4096 (CRCs checked)", lambda: ours(run, "arrow", 0)),
        ("ringscope.stream, Arrow IPC, batches of 4096, verify=False", lambda: ours(run, "arrow", 0, False)),
        (f"ringscope.stream, Arrow IPC, shuffled in {buf:,} rows", lambda: ours(run, "arrow", buf)),
        ("pyarrow, Parquet, whole files", lambda: pyarrow_parquet(parquet)),
        ("ringscope.stream, Parquet, batches of 4096 (page CRCs checked)", lambda: ours(run, "parquet", 0)),
        ("ringscope.stream, Parquet, batches of 4096, verify=False", lambda: ours(run, "parquet", 0, False)),
        (f"ringscope.stream, Parquet, shuffled in {buf:,} rows", lambda: ours(run, "parquet", buf)),
    ]
    rows = [(name, f) for name, f in rows if (ipc if "IPC" in name else parquet)]  # the formats the run has
    for _, f in rows:  # warm the page cache
        f()
    results = [(name, *timed(f, args.rounds)) for name, f in rows]
    print(f"| reader ({run}) | GB/s of activations | ÷ pyarrow, same format |")
    print("|---|---|---|")
    base = {}
    for name, n, s in results:
        fmt = "ipc" if "IPC" in name else "parquet"
        rate = n / s / 1e9
        if name.startswith("pyarrow"):
            base[fmt] = rate
        print(f"| {name} | {rate:.2f} | {rate / base[fmt]:.2f} |")


if __name__ == "__main__":
    main()
