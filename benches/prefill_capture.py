"""Bulk capture as a user generating training data for sparse autoencoders would do it, end to end on one GPU.

    python benches/prefill_capture.py --out results.json [--dir /data/dumps]   # needs CUDA, torch, transformers,
                                                                             # libringscope + NVRTC
    python benches/prefill_capture.py --s3 --only S3 ...   # also: to a SeaweedFS S3 server on loopback (its data on
                                                           # --dir's disk; needs the `weed` binary, RINGSCOPE_WEED)

A 1B-shaped Llama (16 layers, hidden 2048, bf16, random weights: no download, see hf_overhead.py), prefill of
8 x 2048 tokens, `ringscope.torch.attach(model, session, sites=["residual"])`, `ring.backend = "cuda"`,
`ring.capacity = "16 GiB"`, full mode, 8 prefills (8.6 GB of activations), timed from the first capture until
`flush()` returned (with file sinks: everything written and the files committed) and `close()` finished. Each variant runs in its own process (so its peak RSS is
its own); the model alone, as GB/s of residuals produced, is measured the same way.
"""
import argparse
import json
import os
import resource
import subprocess
import sys
import time

PREFILLS, BATCH, TOKENS, LAYERS, HIDDEN = 8, 8, 2048, 16, 2048
BYTES = PREFILLS * BATCH * TOKENS * LAYERS * HIDDEN * 2


def variants(args):
    ring = {"backend": "cuda", "capacity": "16 GiB", "max_batch_rows": BATCH * TOKENS}
    policy = {"mode": "full", "full_deadline_ms": 120000}

    def files(ring=ring, **export):
        return {"ring": ring, "policy": policy,
                "export": {"dir": export.pop("dir", args.dir), "max_file_size": "1 GiB", **export}}
    return {
        "model alone (no capture)": None,
        "no sink": {"ring": ring, "policy": policy},
        "no sink, drain_chunk 32 MiB x 16": {"ring": {**ring, "drain_chunk": "32 MiB", "drain_in_flight": 16},
                                             "policy": policy},
        "Arrow IPC (disk), 8 threads": files(arrow_ipc=True, threads=8),
        "Arrow IPC (memory), 8 threads": files(arrow_ipc=True, threads=8, dir=args.shm),
        "Arrow IPC (memory), 12 threads": files(arrow_ipc=True, threads=12, dir=args.shm),
        "Arrow IPC (memory), 8 threads, 4 GiB ring": files({**ring, "capacity": "4 GiB"}, arrow_ipc=True, threads=8,
                                                           dir=args.shm),
        "Parquet zstd(1) (memory), 1 thread": files(parquet=True, threads=1, dir=args.shm),
        "Parquet zstd(1) (memory), 8 threads": files(parquet=True, threads=8, dir=args.shm),
        "Parquet lz4 (memory), 8 threads": files(parquet=True, threads=8, compression="lz4", dir=args.shm),
        # Object storage (docs/object-storage.md): an S3 server on loopback (--s3), its data on --dir's disk.
        "Parquet zstd(1) (disk), 8 threads": files(parquet=True, threads=8),
        "Parquet zstd(1) (S3 on loopback), 8 threads": files(parquet=True, threads=8, dir=S3_URL),
        "Arrow IPC (S3 on loopback), 8 threads": files(arrow_ipc=True, threads=8, dir=S3_URL),
    }


#: Where the S3 variants write (the bucket main() makes on the loopback server; credentials in the environment).
S3_URL = "s3://prefill/runs"


def run_variant(name, config):
    import torch
    import ringscope
    import ringscope.torch as rt
    from hf_overhead import build_model, DEV

    model = build_model(LAYERS)
    ids = [torch.randint(0, 1000, (BATCH, TOKENS), device=DEV) for _ in range(PREFILLS)]
    with torch.no_grad():
        model(input_ids=ids[0][:1, :128], use_cache=False)  # warm up kernels and allocator
    torch.cuda.synchronize()
    session = att = None
    if config is not None:
        session = ringscope.Session(config)
        att = rt.attach(model, session, sites=["residual"])
    out = {"variant": name}
    t0 = time.perf_counter()
    with torch.no_grad():
        for x in ids:
            model(input_ids=x, use_cache=False)
    torch.cuda.synchronize()
    out["prefills_s"] = time.perf_counter() - t0
    if session is not None:
        session.flush(timeout=600)
        out["flushed_s"] = time.perf_counter() - t0
        att.detach()
        t_close = time.perf_counter()
        totals = session.close()
        out["close_ms"] = (time.perf_counter() - t_close) * 1e3
        out["exported_rows"] = totals["exported_rows"]
        out["dropped_rows"] = totals["dropped_rows"]
        if "export" in config:
            root = config["export"]["dir"]
            if root.startswith("s3://"):
                import pyarrow.fs as pafs

                fs, base = pafs.FileSystem.from_uri(root)
                infos = fs.get_file_info(pafs.FileSelector(base, recursive=True))
                out["file_bytes"] = sum(i.size for i in infos if i.path.endswith((".parquet", ".arrow")))
            else:
                out["file_bytes"] = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(root)
                                        for f in fs if f.endswith((".parquet", ".arrow")))
    total_s = time.perf_counter() - t0
    out["total_s"] = total_s
    out["gb_per_s"] = BYTES / total_s / 1e9
    out["tokens_per_s"] = PREFILLS * BATCH * TOKENS / total_s
    out["expected_rows"] = PREFILLS * BATCH * TOKENS * LAYERS
    out["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print("RESULT " + json.dumps(out), flush=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="prefill_capture.json")
    p.add_argument("--dir", default="/tmp/ringscope-prefill")
    p.add_argument("--shm", default="/dev/shm/ringscope-prefill")
    p.add_argument("--only", default=None, help="variants to run: names or parts of names, separated by ';'")
    p.add_argument("--no-warmup", action="store_true",
                   help="skip the warm-up run (the in-memory Arrow IPC variant once, not counted, before the others)")
    p.add_argument("--s3", action="store_true", help="start an S3 server on loopback for the S3 variants")
    p.add_argument("--variant", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    vs = variants(args)
    if args.variant is not None:
        run_variant(args.variant, vs[args.variant])
        return
    server = None
    if args.s3:
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "python"))
        from s3server import S3Server

        os.makedirs(args.dir, exist_ok=True)
        server = S3Server(__import__("pathlib").Path(args.dir + "-s3"))
        server.start()
        server.bucket("prefill")
        os.environ.update(server.env())
    else:
        vs = {k: v for k, v in vs.items() if not (v and v.get("export", {}).get("dir") == S3_URL)}

    def run(name):
        cmd = [sys.executable, os.path.abspath(__file__), "--variant", name, "--dir", args.dir, "--shm", args.shm]
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=os.path.dirname(os.path.abspath(__file__)))
        line = next((l for l in proc.stdout.splitlines() if l.startswith("RESULT ")), None)
        for d in (args.dir, args.shm):
            subprocess.run(["rm", "-rf", d])
        if server is not None:
            server.filesystem().delete_dir_contents("prefill", missing_dir_ok=True)
        if line is None:
            return {"variant": name, "error": (proc.stderr or proc.stdout)[-2000:]}
        return json.loads(line[len("RESULT "):])

    # Memory a freshly started machine uses for the first time makes the first run that needs it slower (the kernel's
    # copies into tmpfs cost 2-3x the CPU: docs/gpu-benchmarks.md, session 16): the variant that touches the most
    # memory (its pinned staging and its files) runs once first, not counted.
    if not args.no_warmup:
        warm = "Arrow IPC (memory), 8 threads"
        print(json.dumps({"warm_up_not_counted": run(warm)}), flush=True)
    results = []
    for name in vs:
        if args.only and not any(o == name or (o not in vs and o in name) for o in args.only.split(";")):
            continue
        r = run(name)
        results.append(r)
        print(json.dumps(r), flush=True)
    print("\n| export | GB/s, first capture -> flushed and closed | tokens/s | close (ms) | peak RSS (MiB) | rows |")
    print("|---|---|---|---|---|---|")
    for r in results:
        if "error" in r:
            print(f"| {r['variant']} | failed: {r['error'][-300:]!r} |")
            continue
        rows = f"{r.get('exported_rows', '-')}/{r['expected_rows']}" if "exported_rows" in r else "-"
        print(f"| {r['variant']} | {r['gb_per_s']:.2f} | {r['tokens_per_s']:.0f} | {r.get('close_ms', float('nan')):.1f} "
              f"| {r['peak_rss_mib']:.0f} | {rows} |")
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    if server is not None:
        server.stop()


if __name__ == "__main__":
    main()
