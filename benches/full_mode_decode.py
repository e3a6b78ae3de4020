"""Full (lossless) mode at decode speed: what a replayed decode step costs when every row must reach Parquet.

    python benches/full_mode_decode.py --out results.json --dir /dev/shm/rs   # needs CUDA, torch, transformers,
                                                                              # libringscope + NVRTC

Model: hf_overhead.py's 1B-shape Llama (16 layers, hidden 2048, bf16, random weights), decode with HF's StaticCache,
one step recorded as a CUDA graph and replayed; the residual stream of all 16 layers of every row captured and
written to Parquet (zstd, 8 threads) in the ringscope variants. Variants, all in this one process, interleaved (the
order rotates every round, so drift of the machine falls on all of them alike):
  (a1, a2, a3) the plain step, recorded three times: how far recordings of the same step differ is the resolution;
  (full_graph) full mode, the step begun inside the graph (its batch from device tensors), deferred captures, and
      ``Session.admit_graph_step()`` before every replay: a host-side check that the ring has room for a whole step
      (it waits only when the drain is behind);
  (full_ahead) the same, but each replay's admission made right after the previous replay is launched (the first
      before the first replay): the order of an engine that prepares the next step while the GPU runs this one —
      the admission's host time then overlaps the GPU's work instead of delaying the launch;
  (full_host) full mode as before: ``begin_step`` from Python before every replay (a host-written descriptor and a
      begin kernel per step), one capture kernel per layer;
  (best_effort) the step begun inside the graph, deferred captures, no host call per replay;
  (best_effort_probed) the same, with three calls timed where full_graph admits (``probe_host_us_by_phase``): a C
      call that does nothing, a CUDA driver call (a stream query) and the session's control call (the C ABI's handle
      lookup, no driver call) — which of them is as slow there as the synchronised admission says where its time goes.
First, the host time of one ``admit_graph_step`` call and of its parts (``admit_cost_us``).
Per batch size: per-step time synchronised every step (median, p99) and pipelined (many steps, one sync); for each
ringscope variant the session's totals (rows produced / exported / dropped, full-mode waits); for ``full_graph`` the
host time of each ``admit_graph_step`` during the run (``admit_host_us``: synchronised and pipelined steps together;
``admit_host_us_by_phase``: apart, and the warm-up steps before each — in synchronised steps the GPU waits for it,
in pipelined ones it overlaps the GPU; in both the drain and the sinks work beside it, where ``admit_cost_us`` has
them idle; vLLM's in-process timing saw ~20 µs per call where the idle one is ~2 µs), and the same for
``full_ahead``. The timing adds two clock reads to each of ``full_graph``'s and ``full_ahead``'s steps (well under a
microsecond, below the resolution). Then prefill (8 × 512 tokens, eager) plain (recorded twice: the resolution) vs
full mode with no sink, into Parquet and into Arrow IPC, and best-effort into Arrow IPC, each session flushed outside
its timed block (``--only-prefill`` for that part alone), and next to them references that move the same bytes with
torch alone (:class:`TorchCopies`: outputs kept alive, an SM copy to a device buffer, a side-stream copy to pinned
memory, both) — the cost of the traffic itself, apart from ringscope's path.
"""
import argparse
import json
import os
import shutil
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hf_overhead import DEV, Decoder, build_model, host_begun_replay, interleaved  # noqa: E402

import ringscope  # noqa: E402
import ringscope.torch as rt  # noqa: E402


def session(root, name, mode, defer=True, export="parquet", capacity="1 GiB", drain_chunk=None):
    policy = {"mode": mode, "full_deadline_ms": 20000} if mode == "full" else {"mode": mode}
    config = {"ring": {"backend": "cuda", "capacity": capacity, "max_batch_rows": 4096, "defer_captures": defer},
              "policy": policy}
    if drain_chunk:
        config["ring"]["drain_chunk"] = drain_chunk
    if export:
        d = os.path.join(root, name)
        shutil.rmtree(d, ignore_errors=True)
        config["export"] = {"dir": d, export: True, "threads": 8}
    return ringscope.Session(config)


def replay(d, before=None):
    def step():
        if before is not None:
            before()
        d.graph.replay()
        d.advance()
    return step


def replay_admitting_ahead(d, admit):
    """A step that replays the decoder's graph and then admits the *next* replay (the first step admits its own
    first): every replay is still admitted before it runs — its admission is stream-ordered after the previous replay
    — but the admission's host time overlaps that replay on the GPU."""
    primed = []

    def step():
        if not primed:
            admit()
            primed.append(True)
        d.graph.replay()
        d.advance()
        admit()
    return step


def run_batch(model, batch, steps, rounds, root, results):
    max_len = 16 + rounds * (10 + 2 * steps) + 16
    variants, sessions = {}, {}
    variants["a1"] = replay(Decoder(model, batch, max_len))

    phase = {"now": "warm"}  # which part of time_steps runs (the admissions' host times are kept per part)
    admit_ns = {"full_graph": {}, "full_ahead": {}}

    def timed(admit, into, clock=time.perf_counter_ns):
        def call():
            # Timed while the drain and the sinks work on earlier steps (in the isolated admit_cost: idle).
            t = clock()
            admit()
            into.setdefault(phase["now"], []).append(clock() - t)
        return call

    s = sessions["full_graph"] = session(root, f"b{batch}_full_graph", "full")
    att = rt.attach(model, s, sites=["residual"])
    try:
        variants["full_graph"] = replay(Decoder(model, batch, max_len),
                                        before=timed(s.admit_graph_step, admit_ns["full_graph"]))
    finally:
        att.detach()
    variants["a2"] = replay(Decoder(model, batch, max_len))

    s = sessions["full_ahead"] = session(root, f"b{batch}_full_ahead", "full")
    att = rt.attach(model, s, sites=["residual"])
    try:
        variants["full_ahead"] = replay_admitting_ahead(Decoder(model, batch, max_len),
                                                        timed(s.admit_graph_step, admit_ns["full_ahead"]))
    finally:
        att.detach()

    s = sessions["full_host"] = session(root, f"b{batch}_full_host", "full", defer=False)
    variants["full_host"] = host_begun_replay(model, s, batch, max_len)

    s = sessions["best_effort"] = session(root, f"b{batch}_best_effort", "best_effort")
    att3 = rt.attach(model, s, sites=["residual"])
    try:
        variants["best_effort"] = replay(Decoder(model, batch, max_len))
    finally:
        att3.detach()

    # Best-effort again, with three calls timed where full_graph admits (after the previous step's synchronisation,
    # while the drain and the sinks work on it): a C call that does nothing, a CUDA driver call (a stream query) and
    # the session's control call (returns at once: the C ABI's handle lookup, no driver call). Which of them is as
    # slow there as the admission says where its synchronised time goes.
    s = sessions["best_effort_probed"] = session(root, f"b{batch}_best_effort_probed", "best_effort")
    att4 = rt.attach(model, s, sites=["residual"])
    lib, stream = ringscope._load(), torch.cuda.current_stream().cuda_stream

    def probes(s=s, clock=time.perf_counter_ns):
        t0 = clock()
        lib.rs_abi_version()
        t1 = clock()
        torch.cuda.current_stream().query()
        t2 = clock()
        s.apply_controls(stream)
        t3 = clock()
        into = probe_ns.setdefault(phase["now"], {"noop_c_call": [], "stream_query": [], "apply_controls": []})
        for name, ns in (("noop_c_call", t1 - t0), ("stream_query", t2 - t1), ("apply_controls", t3 - t2)):
            into[name].append(ns)
    probe_ns: dict = {}
    try:
        variants["best_effort_probed"] = replay(Decoder(model, batch, max_len), before=probes)
    finally:
        att4.detach()

    variants["a3"] = replay(Decoder(model, batch, max_len))

    row = interleaved(variants, steps, rounds, on_phase=lambda name: phase.__setitem__("now", name))
    for key, sess in sessions.items():
        sess.flush(timeout=600)
        stats = sess.stats_all()
        totals = sess.close()
        row[key]["totals"] = {k: totals[k] for k in ("produced_rows", "exported_rows", "dropped_rows")}
        row[key]["totals"].update(stalls=stats["stalls"], stall_time_s=stats["stall_time_s"])
    def quantiles(ns):
        q = sorted(ns)
        return {"p50": q[len(q) // 2] / 1e3, "p90": q[len(q) * 9 // 10] / 1e3, "p99": q[len(q) * 99 // 100] / 1e3,
                "n": len(q)}
    for key, by_phase in admit_ns.items():
        if by_phase:
            row[key]["admit_host_us"] = quantiles([t for p, ts in by_phase.items() if p != "warm" for t in ts])
            row[key]["admit_host_us_by_phase"] = {p: quantiles(ts) for p, ts in by_phase.items()}
    row["best_effort_probed"]["probe_host_us_by_phase"] = {
        p: {name: quantiles(ts) for name, ts in calls.items()} for p, calls in probe_ns.items()}
    plain = ["a1", "a2", "a3"]
    for m in ("median_ms", "p99_ms", "pipelined_ms"):
        base = sorted(row[k][m] for k in plain)[1]  # the median of the three recordings
        spread = (max(row[k][m] for k in plain) - min(row[k][m] for k in plain)) / base
        row.setdefault("resolution", {})[m.replace("_ms", "")] = spread
        for k, v in row.items():
            if k != "resolution":
                v[m.replace("_ms", "_overhead")] = v[m] / base - 1
    results[f"batch_{batch}"] = row
    print(json.dumps({f"batch_{batch}": row}, indent=1), flush=True)


class TorchCopies:
    """A reference without ringscope: every decoder layer's output moved by torch alone, so that what moving a
    prefill's activations costs by itself is told apart from what ringscope's path adds. ``kind``:
      ``keep``: no copy; every layer's output is kept alive until the next forward (as deferred captures keep them);
      ``d2d``: copied into a preallocated device buffer (the SM copy that writing a device ring takes);
      ``d2h``: copied straight to pinned host memory on a side stream (the copy engine; the tensor is kept from reuse
          until its copy is done);
      ``d2d_d2h``: both, a device buffer then a side-stream copy of it to pinned memory (a ring and its drain; four
          slots of a prefill each, reused in turn without waiting for their copies — no back-pressure, as the drain
          keeps up: ~5 ms of copies per ~25 ms prefill).
    Nothing is checked or kept: the bytes only move."""

    def __init__(self, model, kind, rows, hidden):
        layers = list(model.model.layers)
        width = rows * hidden
        slots = 4 if kind == "d2d_d2h" else 1
        self.kind, self.slot, self.slots = kind, 0, slots
        self.dev = torch.empty((slots, len(layers), width), dtype=torch.bfloat16, device=DEV) if "d2d" in kind else None
        self.host = torch.empty((len(layers), width), dtype=torch.bfloat16, pin_memory=True) if "d2h" in kind else None
        self.side = torch.cuda.Stream()
        self.kept = []
        self.handles = [layer.register_forward_hook(self._hook(i, len(layers))) for i, layer in enumerate(layers)]

    def _hook(self, i, layers):
        def hook(module, args, output):
            x = output[0] if isinstance(output, tuple) else output
            if i == 0:
                self.kept.clear()
                self.slot = (self.slot + 1) % self.slots
            if self.kind == "keep":
                self.kept.append(x)
                return
            src = x.reshape(-1)
            if self.dev is not None:
                self.dev[self.slot, i].copy_(src)
                src = self.dev[self.slot, i]
            if self.host is not None:
                self.side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(self.side):
                    self.host[i].copy_(src, non_blocking=True)
                x.record_stream(self.side)
        return hook

    def detach(self):
        for h in self.handles:
            h.remove()
        self.kept.clear()
        torch.cuda.synchronize()


def prefill_makers(root, drain_chunks=(), references=True):
    """The prefill variants by name, each a function that makes its session (or names its torch-only reference, or
    gives None for plain): a session is made only for a variant that runs (every ring is allocated up front)."""
    makers = {"plain": lambda: None,
              "full_no_sink": lambda: session(root, "prefill_none", "full", export=None, capacity="8 GiB"),
              "best_effort_no_sink": lambda: session(root, "prefill_be_none", "best_effort", export=None,
                                                     capacity="8 GiB"),
              # One copy kernel per layer as it runs, instead of one for the step beside the LM head.
              "full_no_sink_immediate": lambda: session(root, "prefill_none_imm", "full", defer=False, export=None,
                                                        capacity="8 GiB")}
    for chunk in drain_chunks:
        # The drain's largest device-to-host copy (ring.drain_chunk, 4 MiB by default): fewer, larger copies make
        # fewer driver calls beside the engine's launches.
        # (4 GiB rings, enough for a block's 12 prefills of 256 MiB.)
        makers[f"full_no_sink_chunk_{chunk.replace(' ', '')}"] = lambda chunk=chunk: session(
            root, "prefill_none_" + chunk.replace(" ", ""), "full", export=None, capacity="4 GiB", drain_chunk=chunk)
    for fmt in ("parquet", "arrow_ipc"):
        makers[f"full_{fmt}"] = lambda fmt=fmt: session(root, f"prefill_{fmt}", "full", export=fmt, capacity="8 GiB")
    makers["best_effort_arrow_ipc"] = lambda: session(root, "prefill_be_ipc", "best_effort", export="arrow_ipc",
                                                      capacity="8 GiB")
    if references:
        for kind in ("keep", "d2d", "d2h", "d2d_d2h"):
            makers[f"torch_{kind}"] = lambda kind=kind: kind
    makers["plain2"] = lambda: None
    return makers


def prefill(model, root, results, batch=8, tokens=512, n=8, rounds=3, drain_chunks=(), references=True, only=()):
    """Eager prefill, plain against the capturing variants, interleaved (the order rotates every round). The plain
    forward is recorded twice (``plain``, ``plain2``): how far those two differ is the resolution. After each timed
    block the variant's session is flushed *outside* the timer, so that a sink still writing one variant's rows does
    not run beside the next variant's block (a variant's own sink work during its block counts: that is its cost)."""
    ids = torch.randint(0, 1000, (batch, tokens), device=DEV)

    def run():
        with torch.no_grad():
            model(input_ids=ids, use_cache=False)

    makers = prefill_makers(root, drain_chunks, references)
    unknown = set(only) - set(makers)
    if unknown:
        raise ValueError(f"prefill variants {sorted(unknown)}: there are {list(makers)}")
    variants = {k: make() for k, make in makers.items() if not only or k in only or k in ("plain", "plain2")}
    out = {k: [] for k in variants}
    flush_s = {k: [] for k in variants}
    host_ms = {k: [] for k in variants}
    synced_ms = {k: [] for k in variants}
    names = list(variants)
    for r in range(rounds):
        for k in names[r % len(names):] + names[:r % len(names)]:
            s = variants[k]
            if isinstance(s, str):
                att, s = TorchCopies(model, s, batch * tokens, model.config.hidden_size), None
            else:
                att = rt.attach(model, s, sites=["residual"]) if s is not None else None
            run()
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(n):
                run()
            torch.cuda.synchronize()
            out[k].append((time.perf_counter() - t) * 1e3 / n)
            if s is not None:
                t = time.perf_counter()
                s.flush(timeout=600)
                flush_s[k].append(time.perf_counter() - t)
            # The host's part (outside the timed block, with the block's rows written): from an idle GPU, how long
            # the forward call takes to return (launches, hooks, the model's own synchronisations) and until the GPU
            # is done.
            for _ in range(3):
                torch.cuda.synchronize()
                t = time.perf_counter()
                run()
                t1 = time.perf_counter()
                torch.cuda.synchronize()
                host_ms[k].append((t1 - t) * 1e3)
                synced_ms[k].append((time.perf_counter() - t) * 1e3)
            if att is not None:
                att.detach()
            if s is not None:
                s.flush(timeout=600)
    row = {}
    for k, s in variants.items():
        row[k] = {"ms_per_prefill": sorted(out[k])[len(out[k]) // 2], "rounds_ms": out[k],
                  "host_ms_from_idle": sorted(host_ms[k])[len(host_ms[k]) // 2],
                  "synced_ms_from_idle": sorted(synced_ms[k])[len(synced_ms[k]) // 2]}
        if isinstance(s, ringscope.Session):
            t = time.perf_counter()
            s.flush(timeout=600)
            totals = s.close()
            row[k]["flush_after_block_s"] = flush_s[k]
            row[k]["flush_and_close_s"] = time.perf_counter() - t
            row[k]["totals"] = {x: totals[x] for x in ("produced_rows", "exported_rows", "dropped_rows")}
    plains = sorted(row[k]["ms_per_prefill"] for k in ("plain", "plain2"))
    base = plains[0]
    for v in row.values():
        v["overhead"] = v["ms_per_prefill"] / base - 1
    row["resolution"] = plains[1] / plains[0] - 1
    results[f"prefill_{batch}x{tokens}"] = row
    print(json.dumps({f"prefill_{batch}x{tokens}": row}, indent=1), flush=True)


def admit_cost(results, n=20000):
    """Host time of one ``admit_graph_step`` and its parts (the GPU idle, room at once), µs per call."""
    s = ringscope.Session({"ring": {"backend": "cuda", "capacity": "4 GiB"},
                           "policy": {"mode": "full", "full_deadline_ms": 20000}})
    s.register("h", dtype="bf16", row_width=2048)
    stream = torch.cuda.current_stream().cuda_stream
    lib = ringscope._load()
    h = s._h

    def per_call(f):
        f()
        t = time.perf_counter()
        for _ in range(n):
            f()
        return (time.perf_counter() - t) / n * 1e6
    row = {
        "ctypes_noop_rs_abi_version": per_call(lib.rs_abi_version),
        "torch_current_stream": per_call(lambda: torch.cuda.current_stream().cuda_stream),
        "rs_admit_graph_step_raw": per_call(lambda: lib.rs_admit_graph_step(h, 8, stream)),
        "admit_graph_step_explicit_stream": per_call(lambda: s.admit_graph_step(8, stream=stream)),
        "admit_graph_step_default": per_call(lambda: s.admit_graph_step(8)),
        "default_stream_lookup": per_call(ringscope._current_stream),
    }
    stats = s.stats_all()
    row["stalls"] = stats["stalls"]
    s.close()
    results["admit_cost_us"] = row
    print(json.dumps({"admit_cost_us": row}, indent=1), flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="full_mode_decode.json")
    ap.add_argument("--dir", default="/dev/shm/ringscope-full-mode", help="where the Parquet files go")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--prefill-rounds", type=int, default=5, help="0: no prefill measurement")
    ap.add_argument("--only-prefill", action="store_true")
    ap.add_argument("--drain-chunks", default="", help="prefill: more full-mode variants without a sink, one per "
                    "ring.drain_chunk given (e.g. '32 MiB,128 MiB')")
    ap.add_argument("--prefill-variants", default="", help="prefill: only these variants (comma-separated; plain and "
                    "plain2 always)")
    args = ap.parse_args()
    only = [v.strip() for v in args.prefill_variants.split(",") if v.strip()]
    chunks = [c.strip() for c in args.drain_chunks.split(",") if c.strip()]
    unknown = set(only) - set(prefill_makers(args.dir, chunks))
    if unknown:  # before anything touches the GPU
        ap.error(f"--prefill-variants: no variant {', '.join(sorted(unknown))} (there are "
                 f"{', '.join(prefill_makers(args.dir, chunks))})")
    results = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
               "graphs": "torch.cuda.graph (manual capture of one decode step over StaticCache)"}
    if not args.only_prefill:
        admit_cost(results)
    model = build_model(args.layers)
    for b in ([] if args.only_prefill else map(int, args.batches.split(","))):
        run_batch(model, b, args.steps, args.rounds, args.dir, results)
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    if args.prefill_rounds > 0:  # --prefill-rounds 0: decode only
        prefill(model, args.dir, results, rounds=args.prefill_rounds,
                drain_chunks=chunks, only=only)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
