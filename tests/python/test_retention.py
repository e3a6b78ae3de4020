"""ringscope.calibration_retention (ProbeX's calibration retention) on constructed dumps where the expected value is
known, checked against `inspect retention --json` on the same dumps.

Each run captures, at a bf16 hookpoint of width 32, rows ``base + noise + sign · S · v`` for requests 0..100 (group a:
0..50, sign +1; group b: 50..100, sign −1; S = 4; noise uniform in [−0.5, 0.5), independent per run; requests of 2, 3
or 4 tokens). The reference run's concept direction is ``v = e0``; the "quantized" run's is rotated by 60° toward e1;
the "broken" run's is e3, orthogonal to the probe. The probe: ``w0 = e0``, ``w1 = (e0 + e2)/√2``. Expected retention:
cos 60° = 0.5 (both outputs) and 0 (flagged). Tolerance 0.02: each group mean has ≥ 149 rows, so the noise in
μ_a − μ_b is σ ≈ 0.033 per coordinate against a signal of 8, and the retention's σ ≲ 0.006 (0.04 with --last-token:
50 rows a group). Python and the CLI read the same rows and do the same arithmetic: they agree to 1e-9.

Needs the built library (RINGSCOPE_LIB, or the checkout's target/release) and the `inspect` binary
(RINGSCOPE_INSPECT, or target/release/inspect of the checkout or of $CARGO_TARGET_DIR: test.sh builds it first)."""
import json
import math
import os
import pathlib
import subprocess

import numpy as np
import pytest

import ringscope
from ringscope import RingscopeError

ROOT = pathlib.Path(__file__).resolve().parents[2]
D = 32
HP = "layers.12.residual"
OTHER = "layers.3.residual"
S = 4.0
THETA = math.radians(60)


def inspect_binary() -> str:
    candidates = [os.environ.get("RINGSCOPE_INSPECT")]
    for target in (os.environ.get("CARGO_TARGET_DIR"), ROOT / "target"):
        if target:
            candidates += [pathlib.Path(target) / "release" / "inspect", pathlib.Path(target) / "debug" / "inspect"]
    for c in candidates:
        if c and pathlib.Path(c).is_file():
            return str(c)
    pytest.fail("no inspect binary: build it (cargo build --release -p ringscope-inspect) or set RINGSCOPE_INSPECT")


def length(r):
    return 2 + r % 3


def bf16_bits(x):
    """float32 → bf16 bit patterns, rounded to nearest even."""
    b = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint16)


def axis(i):
    v = np.zeros(D, dtype=np.float32)
    v[i] = 1.0
    return v


def probe_weights():
    w1 = (axis(0) + axis(2)) / np.float32(math.sqrt(2))
    return np.stack([axis(0), w1]).astype(np.float32)


def write_run(root, run_id, seed, concept):
    rng = np.random.default_rng(seed)
    config = {"ring": {"capacity": "4 MiB"}, "policy": {"mode": "full"},
              "export": {"parquet": True, "arrow_ipc": False, "dir": str(root), "run_id": run_id}}
    base = 1.0 + 0.05 * np.arange(D, dtype=np.float32)
    with ringscope.Session(config) as s:
        hp = s.register(HP, site="residual", layer=12, dtype="bf16", row_width=D)
        other = s.register(OTHER, site="residual", layer=3, dtype="bf16", row_width=16)
        for p in range(4):
            req = [r for r in range(100) if p < length(r)]
            s.begin_step(p, req, [p] * len(req))
            sign = np.where(np.array(req) < 50, 1.0, -1.0).astype(np.float32)[:, None]
            x = base + rng.uniform(-0.5, 0.5, (len(req), D)).astype(np.float32) + sign * np.float32(S) * concept
            assert s.capture(hp, bf16_bits(x)) == "published"
            s.capture(other, np.zeros((len(req), 16), dtype=np.uint16))
            s.end_step()
    return root / run_id


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("retention")
    rotated = np.zeros(D, dtype=np.float32)
    rotated[:2] = [math.cos(THETA), math.sin(THETA)]
    out = {"ref": write_run(root, "ref", 1, axis(0)), "rot": write_run(root, "rot", 2, rotated),
           "gone": write_run(root, "gone", 3, axis(3)), "root": root}
    w = probe_weights()
    np.save(root / "probe.npy", w)
    # A safetensors file, written by hand (no dependency): 8-byte header length, JSON header, data.
    header = json.dumps({"weight": {"dtype": "F32", "shape": list(w.shape), "data_offsets": [0, w.nbytes]}})
    header += " " * (-len(header) % 8)
    (root / "probe.safetensors").write_bytes(len(header).to_bytes(8, "little") + header.encode() + w.tobytes())
    return out


def cli(run, weights, *more):
    args = [inspect_binary(), "retention", str(run), "--weights", str(weights), "--hookpoint", HP,
            "--group-a", "0-49", "--group-b", "50-99", "--json", *map(str, more)]
    p = subprocess.run(args, capture_output=True, text=True)
    assert p.returncode in (0, 3), p.stderr
    return p.returncode, json.loads(p.stdout)


def same(py, js, what):
    """A Python number against the CLI's JSON one (null: NaN or absent)."""
    if js is None:
        assert py is None or math.isnan(py), f"{what}: {py} vs null"
    else:
        assert py is not None and abs(py - js) <= 1e-9, f"{what}: {py} vs {js}"


def check_against_cli(result, js):
    assert len(result) == len(js["outputs"])
    for r, o in zip(result, js["outputs"]):
        assert set(r) == set(o), (set(r), set(o))
        for key in ("output", "rows_a", "rows_b", "reference_rows_a", "reference_rows_b", "flagged"):
            assert r[key] == o[key], (key, r[key], o[key])
        for key in ("alignment", "reference_alignment", "retention"):
            same(r[key], o[key], key)


@pytest.mark.parametrize("last_token", [False, True])
def test_rotation_by_60_degrees_retains_half_and_matches_the_cli(runs, last_token):
    flag = ["--last-token"] if last_token else []
    tol = 0.04 if last_token else 0.02
    result = ringscope.calibration_retention(runs["rot"], probe_weights(), HP, range(0, 50), range(50, 100),
                                             reference=runs["ref"], min=0.4, last_token=last_token)
    code, js = cli(runs["rot"], runs["root"] / "probe.safetensors", "--reference", runs["ref"], "--min", "0.4", *flag)
    check_against_cli(result, js)
    assert code == 0
    rows = (50, 50) if last_token else (149, 150)
    for r, want in zip(result, (0.5, 0.5 / math.sqrt(2))):
        assert (r["rows_a"], r["rows_b"]) == rows
        assert (r["reference_rows_a"], r["reference_rows_b"]) == rows
        assert abs(r["alignment"] - want) <= tol, r
        assert abs(r["retention"] - math.cos(THETA)) <= tol, r
        assert r["flagged"] is False


def test_the_concept_gone_retains_nothing_and_is_flagged(runs):
    result = ringscope.calibration_retention(runs["gone"], runs["root"] / "probe.npy", HP, "0-49", "50-99",
                                             reference=runs["ref"], min=0.5)
    code, js = cli(runs["gone"], runs["root"] / "probe.npy", "--reference", runs["ref"], "--min", "0.5")
    check_against_cli(result, js)
    assert code == 3 and js["flagged"] == 2
    for r in result:
        assert abs(r["retention"]) <= 0.02 and r["flagged"] is True, r


def test_a_run_against_itself_retains_exactly_one_and_weights_load_alike(runs):
    for weights in (probe_weights(), runs["root"] / "probe.npy", str(runs["root"] / "probe.safetensors"),
                    probe_weights()[0]):
        result = ringscope.calibration_retention(runs["ref"], weights, HP, [*range(50)], np.arange(50, 100),
                                                 reference=runs["ref"], min=0.99)
        assert abs(result[0]["alignment"] - 1.0) <= 0.01
        for r in result:
            assert abs(r["retention"] - 1.0) <= 1e-12 and not r["flagged"], r
    # Without a reference: alignments only; min applies to them (output 1's is 0.35 in the rotated run).
    result = ringscope.calibration_retention(runs["rot"], probe_weights(), HP, "0-49", "50-99", min=0.45)
    code, js = cli(runs["rot"], runs["root"] / "probe.npy", "--min", "0.45")
    check_against_cli(result, js)
    assert code == 3
    assert [r["flagged"] for r in result] == [False, True]
    assert result[0]["retention"] is None and result[0]["reference_alignment"] is None


def test_bad_arguments_are_errors_naming_the_argument(runs, tmp_path):
    run, w = runs["rot"], probe_weights()

    def refused(match, *args, **kw):
        with pytest.raises(RingscopeError, match=match):
            ringscope.calibration_retention(*args, **kw)

    refused(r"request 50 is in both group_a and group_b", run, w, HP, "0-50", "50-99")
    refused(r"group_b \(500-599\) has no rows at hookpoint 'layers.12.residual'.*none of its 100 request ids",
            run, w, HP, "0-49", "500-599")
    refused(r"group_a: 'x' is not a request id", run, w, HP, "0-x", "50-99")
    refused(r"group_a: the range 9-1 is empty", run, w, HP, "9-1", "50-99")
    refused(r"group_a must be a sequence of integers", run, w, HP, None, "50-99")
    refused(r"group_b\[0\] must be an integer", run, w, HP, "0-49", [-1])
    refused(r"group_a is empty", run, w, HP, [], "50-99")
    refused(r"hookpoint 'layers.99.residual' is not in .*layers.12.residual", run, w, "layers.99.residual",
            "0-49", "50-99")
    refused(r"weights are \[\*, 32\] but rows of hookpoint 'layers.3.residual'.* have 16 elements",
            run, w, OTHER, "0-49", "50-99")
    bad = w.copy()
    bad[1, 3] = np.nan
    refused(r"weights: the array: weight \[1, 3\] is nan", run, bad, HP, "0-49", "50-99")
    refused(r"weights: .* has shape \(2, 2, 16\)", run, w.reshape(2, 2, 16), HP, "0-49", "50-99")
    refused(r"weights: the array holds int64", run, np.ones(D, dtype=np.int64), HP, "0-49", "50-99")
    refused(r"weights: .*nope.npy is not a file", run, tmp_path / "nope.npy", HP, "0-49", "50-99")
    (tmp_path / "w.txt").write_text("1 2 3")
    refused(r"weights: .*unknown file type", run, tmp_path / "w.txt", HP, "0-49", "50-99")
    refused(r"no tensor 'probe.w' \(it has weight\)", run, runs["root"] / "probe.safetensors", HP, "0-49",
            "50-99", tensor="probe.w")
    refused(r"min must be a finite number", run, w, HP, "0-49", "50-99", min=float("nan"))
    refused(r"min must be a finite number", run, w, HP, "0-49", "50-99", min="0.5")
    refused(r"last_token must be True or False", run, w, HP, "0-49", "50-99", last_token="yes")
    refused(r"hookpoint must be a string", run, w, 12, "0-49", "50-99")
    refused(r"does not exist", tmp_path / "no-run", w, HP, "0-49", "50-99")
    refused(r"the reference run|does not exist", run, w, HP, "0-49", "50-99", reference=tmp_path / "no-run")
