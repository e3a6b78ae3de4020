"""What the capture kernels cost inside a CUDA graph, by entry count and rows, on the GPU's own clock (CUPTI).

    python benches/capture_kernel_latency.py --out latency.json   # needs CUDA, torch, libringscope + NVRTC

Each case records one graph: a step begun inside it (``begin_step_graph`` from device tensors), N captures of R rows
(bf16 rows of 2048 elements, or 512 — the q/k/v shapes of a 1B Llama), the step's end; replays it 200 times under
the PyTorch profiler and reports the median duration of each ringscope kernel. Deferred captures
(``ring.defer_captures``: one ``ringscope_capture_many`` for the step) and immediate ones (one ``ringscope_capture``
per entry). Whether the deferred kernel's time grows with N (its placement and counting are one thread's loops) or
is flat (a chain of dependent memory operations) says where its fixed latency is. Rows go to an Arrow IPC sink in a
temporary directory, so every record is published and drained as in a real run.
"""
import argparse
import json
import os
import statistics
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_trace  # noqa: E402

import ringscope  # noqa: E402

CASES = [  # (entries, rows, row width)
    (1, 1, 2048), (4, 1, 2048), (16, 1, 2048), (48, 1, 2048), (16, 8, 2048), (16, 64, 2048), (12, 1, 512),
    (12, 64, 512), (48, 64, 2048)]


def case(n, rows, width, defer, tmp, replays=200):
    s = ringscope.Session({"ring": {"backend": "cuda", "capacity": "1 GiB", "max_batch_rows": 64,
                                    "defer_captures": defer},
                           "policy": {"mode": "best_effort"},
                           "export": {"arrow_ipc": True, "dir": tmp, "run_id": f"n{n}-r{rows}-w{width}-{defer}"}})
    try:
        hps = [s.register(f"h{i}", row_width=width) for i in range(n)]
        dev = torch.device("cuda")
        xs = [torch.randn(rows, width, device=dev).to(torch.bfloat16) for _ in range(n)]
        req = torch.arange(rows, dtype=torch.int64, device=dev)
        pos = torch.zeros(rows, 1, dtype=torch.int64, device=dev)
        stream = torch.cuda.Stream()
        graph = torch.cuda.CUDAGraph()
        s.apply_controls(stream=stream.cuda_stream)
        stream.synchronize()
        with torch.cuda.graph(graph, stream=stream):
            h = torch.cuda.current_stream().cuda_stream
            s.begin_step_graph(req, pos, stream=h)
            for hp, x in zip(hps, xs):
                s.capture_device(hp, x.data_ptr(), rows, h)
            s.end_step()
        for _ in range(20):
            graph.replay()
        torch.cuda.synchronize()

        def run():
            for _ in range(replays):
                graph.replay()
        events = gpu_trace.profiled(run)
        durs = {}
        for e in events:
            if e.get("cat") == "kernel" and e.get("name", "").startswith("ringscope_"):
                durs.setdefault(e["name"], []).append(e.get("dur", 0))
        s.flush(timeout=60)
        totals = s.close()
    except BaseException:
        s.close()
        raise
    return {"entries": n, "rows": rows, "row_width": width, "deferred": defer,
            "kernels_us": {k: {"median": statistics.median(v), "per_replay": len(v) / replays} for k, v in durs.items()},
            "dropped_rows": totals["dropped_rows"], "exported_rows": totals["exported_rows"]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="capture_kernel_latency.json")
    args = ap.parse_args()
    out = {"device": torch.cuda.get_device_name(), "cases": []}
    with tempfile.TemporaryDirectory() as tmp:
        for n, rows, width in CASES:
            for defer in (True, False):
                r = case(n, rows, width, defer, tmp)
                out["cases"].append(r)
                per = {k: round(v["median"], 2) for k, v in r["kernels_us"].items()}
                print(f"n={n:2d} rows={rows:2d} width={width} {'deferred ' if defer else 'immediate'}: {per} "
                      f"dropped={r['dropped_rows']}", flush=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
