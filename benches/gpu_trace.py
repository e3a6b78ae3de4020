"""Where a step's time goes on the GPU: a PyTorch profiler trace (CUPTI kernels, copies and memsets, CUDA graph
replays' kernels included) cut into steps, shared by benches/step_profile.py (Hugging Face) and benches/vllm_gpu.py
(``profile``).

A step is the time from one ``MARKER`` annotation's start (``torch.profiler.record_function``) to the next one's: every
GPU activity whose launching runtime call (matched by CUPTI's correlation id) lies in that window belongs to the step,
wherever on the GPU's timeline it ran. Per step: ``wall_us`` (start to next start, host clock), ``busy_us`` (union of
the step's GPU activity intervals), ``kernel_us`` (sum of their durations), ``span_us`` (first start to last end on
the GPU), ``n`` (activities), ``other_us`` / ``other_n`` (GPU time and number of activities that ran inside the
step's window but were launched by another thread — ringscope's drain — or by a call the trace does not record: the
profiler keeps the driver API's kernel launches only, and ringscope copies through the driver API). Only activities
launched from the thread that marks the steps count as the step's. Per activity name: mean count and microseconds per step, so that two variants' traces
show what one adds to the other.
"""
import bisect
import json
import os
import statistics
import tempfile

MARKER = "ringscope_bench_step"
GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def profiled(fn):
    """Runs ``fn()`` under the PyTorch profiler (CPU + CUDA activities) and returns the trace's events."""
    prof = start()
    try:
        fn()
    except BaseException:
        prof.__exit__(None, None, None)
        raise
    return stop(prof)


def start():
    """The PyTorch profiler (CPU + CUDA activities), started; :func:`stop` ends it and returns the trace's events (for
    what cannot be one call, such as the worker processes of a tensor-parallel engine)."""
    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
    prof.__enter__()
    return prof


def stop(prof):
    """Waits for the GPU, ends ``prof`` (from :func:`start`) and returns its trace's events."""
    import torch

    try:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    finally:
        prof.__exit__(None, None, None)
    fd, path = tempfile.mkstemp(suffix=".json", prefix="trace-")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            return json.load(f)["traceEvents"]
    finally:
        os.unlink(path)


def marked(fn, marker=MARKER, label=None):
    """``fn`` wrapped so that each call is one step of the trace (labelled ``label``: see :func:`steps_of`)."""
    from torch.profiler import record_function

    name = marker if label is None else f"{marker}:{label}"

    def f(*args, **kwargs):
        with record_function(name):
            return fn(*args, **kwargs)
    return f


def _union(intervals):
    total, end = 0.0, None
    for s, e in sorted(intervals):
        if end is None or s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total


def steps_of(events, marker=MARKER, skip_first=1, label=None):
    """The trace's steps (see the module's text); the first ``skip_first`` and the last (its window has no end) are
    left out. Steps may be labelled (marked with ``marker + ":" + label``, :func:`marked`'s ``label``): every marked
    step ends where the next one of any label starts, and ``label`` keeps only the steps of that label (the first
    ``skip_first`` of them left out)."""
    marks = [e for e in events if e.get("cat") == "user_annotation"
             and (e.get("name") == marker or e.get("name", "").startswith(marker + ":"))]
    marks.sort(key=lambda e: e["ts"])
    starts = [e["ts"] for e in marks]
    tids = {e.get("tid") for e in marks}
    launches = {}
    for e in events:
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {}):
            launches[e["args"]["correlation"]] = (e["ts"], e.get("tid") in tids)
    steps = [{"start": s, "end": n, "acts": [], "other": [], "label": m["name"][len(marker) + 1:] or None}
             for s, n, m in zip(starts, starts[1:], marks)]
    for e in events:
        if e.get("cat") not in GPU_CATS:
            continue
        t, ours = launches.get(e.get("args", {}).get("correlation"), (None, False))
        if t is not None and ours:
            k = bisect.bisect_right(starts, t) - 1
            if 0 <= k < len(steps):
                steps[k]["acts"].append(e)
        else:
            # Launched by another thread (ringscope's drain), or by a call the profiler does not record (it keeps
            # the driver API's kernel launches only, not its copies — ringscope's own copies go through the driver
            # API): what ran on the GPU beside the step, by when it ran.
            k = bisect.bisect_right(starts, e["ts"]) - 1
            if 0 <= k < len(steps):
                steps[k]["other"].append(e)
    out = []
    if label is not None:
        steps = [st for st in steps if st["label"] == label]
    for st in steps[skip_first:]:
        acts = st["acts"]
        if not acts:
            continue
        iv = [(a["ts"], a["ts"] + a.get("dur", 0)) for a in acts]
        other = [(max(a["ts"], st["start"]), min(a["ts"] + a.get("dur", 0), st["end"])) for a in st["other"]]
        out.append({"wall_us": st["end"] - st["start"], "busy_us": _union(iv),
                    "kernel_us": sum(a.get("dur", 0) for a in acts),
                    "span_us": max(e for _, e in iv) - min(s for s, _ in iv), "n": len(acts),
                    "other_us": _union([iv_ for iv_ in other if iv_[1] > iv_[0]]), "other_n": len(st["other"]),
                    "acts": acts})
    return out


def summary(steps, top=30):
    """Medians of the per-step numbers, and the activities by name (mean count and µs per step), largest first."""
    if not steps:
        return {"steps": 0}
    res = {"steps": len(steps)}
    for k in ("wall_us", "busy_us", "kernel_us", "span_us", "n", "other_us", "other_n"):
        xs = sorted(s[k] for s in steps)
        res[k] = {"p50": statistics.median(xs), "p10": xs[len(xs) // 10], "p90": xs[(9 * len(xs)) // 10]}
    by = {}
    for s in steps:
        for a in s["acts"]:
            c = by.setdefault(_name(a), [0, 0.0])
            c[0] += 1
            c[1] += a.get("dur", 0)
    names = sorted(by.items(), key=lambda kv: -kv[1][1])
    res["by_name"] = {n: {"count": round(c / len(steps), 3), "us": round(us / len(steps), 3)} for n, (c, us) in names}
    res["top"] = dict(list(res["by_name"].items())[:top])
    return res


def _name(a):
    n = a.get("name", "?")
    return ("[memcpy] " if a.get("cat") == "gpu_memcpy" else "[memset] " if a.get("cat") == "gpu_memset" else "") + n


def diff(base, other):
    """What ``other`` (a summary) runs per step that ``base`` does not, or more often: name -> count/µs differences,
    largest µs first; and the medians' differences."""
    out = {k: other[k]["p50"] - base[k]["p50"] for k in ("wall_us", "busy_us", "kernel_us", "span_us", "n", "other_us")
           if k in base and k in other}
    names = set(base.get("by_name", {})) | set(other.get("by_name", {}))
    zero = {"count": 0, "us": 0.0}
    d = {}
    for n in names:
        a, b = base["by_name"].get(n, zero), other["by_name"].get(n, zero)
        if abs(b["count"] - a["count"]) >= 0.5 or abs(b["us"] - a["us"]) >= 1.0:
            d[n] = {"count": round(b["count"] - a["count"], 3), "us": round(b["us"] - a["us"], 3)}
    out["by_name"] = dict(sorted(d.items(), key=lambda kv: -abs(kv[1]["us"])))
    return out
