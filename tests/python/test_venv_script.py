"""tests/venv.sh (sourced by test.sh and tests/engine.sh): a test environment is reused only while it holds
exactly what its requirement files pin; anything installed, upgraded or removed by hand since, or a changed
requirement file, makes the next run build it again from scratch (a reused environment can never pass where a fresh
one would fail). A directory the scripts did not make is refused, not deleted."""

import pathlib
import subprocess

ROOT = pathlib.Path(__file__).resolve().parents[2]


def ensure(tmp_path, req):
    script = f"""
set -euo pipefail
. "{ROOT}/tests/venv.sh"
install_nothing() {{ echo installing-into "$py"; }}
ensure_venv "{tmp_path}/env" install_nothing "{req}"
"""
    return subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=300)


def site_packages(env: pathlib.Path) -> pathlib.Path:
    return next(env.glob("lib/python3*/site-packages"))


def test_an_environment_that_drifted_from_its_pins_is_built_again(tmp_path):
    req = tmp_path / "requirements.txt"
    req.write_text("# nothing\n")
    first = ensure(tmp_path, req)
    assert first.returncode == 0, first.stderr
    assert "installing-into" in first.stdout and "creating" in first.stdout
    again = ensure(tmp_path, req)
    assert again.returncode == 0 and "installing-into" not in again.stdout, again.stdout  # reused as it is

    # A package installed by hand (pip freeze lists it): the next run starts from scratch.
    dist = site_packages(tmp_path / "env") / "handmade-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: handmade\nVersion: 1.0\n")
    (dist / "INSTALLER").write_text("pip\n")
    (dist / "RECORD").write_text("")
    drifted = ensure(tmp_path, req)
    assert drifted.returncode == 0, drifted.stderr
    assert "no longer holds exactly" in drifted.stdout and "installing-into" in drifted.stdout, drifted.stdout
    assert not (site_packages(tmp_path / "env") / "handmade-1.0.dist-info").exists()

    # A changed requirement file: the same.
    req.write_text("# something else\n")
    changed = ensure(tmp_path, req)
    assert "no longer holds exactly" in changed.stdout and "installing-into" in changed.stdout, changed.stdout


def test_a_directory_the_scripts_did_not_make_is_refused_not_deleted(tmp_path):
    req = tmp_path / "requirements.txt"
    req.write_text("")
    (tmp_path / "env").mkdir()
    (tmp_path / "env" / "mine.txt").write_text("keep me")
    res = ensure(tmp_path, req)
    assert res.returncode != 0 and "was not made by the test scripts" in res.stderr, (res.stdout, res.stderr)
    assert (tmp_path / "env" / "mine.txt").read_text() == "keep me"


def test_share_files_links_only_large_files_with_the_same_bytes(tmp_path):
    """tests/share_files.py (run by tests/venv.sh after building an environment): a large file that another cached
    environment holds byte for byte becomes a hard link to it; a file that differs, a small one, or one with another
    mode stays a copy of its own; both environments keep every file whole when the other is deleted."""
    import os
    import shutil

    big = os.urandom(2 << 20)
    envs = {}
    for name in ("a", "b"):
        site = tmp_path / name / "lib" / "python3.11" / "site-packages" / "nvidia"
        site.mkdir(parents=True)
        (site / "same.so").write_bytes(big)
        (site / "differs.so").write_bytes(big[:-1] + (b"x" if name == "a" else b"y"))
        (site / "small.py").write_bytes(b"tiny")
        (site / "mode.so").write_bytes(big)
        os.chmod(site / "mode.so", 0o755 if name == "a" else 0o644)
        envs[name] = site
    res = subprocess.run(["python3", str(ROOT / "tests" / "share_files.py"), str(tmp_path / "b"), str(tmp_path / "a"),
                          str(tmp_path / "missing")], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert "1 files shared" in res.stdout, res.stdout
    a, b = envs["a"], envs["b"]
    assert os.stat(a / "same.so").st_ino == os.stat(b / "same.so").st_ino
    for name in ("differs.so", "small.py", "mode.so"):
        assert os.stat(a / name).st_ino != os.stat(b / name).st_ino, name
    shutil.rmtree(tmp_path / "a")
    assert (b / "same.so").read_bytes() == big


def test_a_build_that_was_cut_short_is_built_again(tmp_path):
    """A build interrupted before its record was written (test.sh stopped while an engine's environment was being
    made in the background) is recognised by its marker and started again, not refused."""
    req = tmp_path / "requirements.txt"
    req.write_text("")
    env = tmp_path / "env"
    env.mkdir()
    (env / ".ringscope-building").write_text("")
    (env / "half-installed.txt").write_text("")
    res = ensure(tmp_path, req)
    assert res.returncode == 0, res.stderr
    assert "did not finish" in res.stdout and "installing-into" in res.stdout, res.stdout
    assert not (env / "half-installed.txt").exists() and not (env / ".ringscope-building").exists()
    assert (env / ".ringscope-env").exists()


def test_the_test_scripts_refuse_an_unknown_argument_by_name():
    """./test.sh and tests/engine.sh: a mistyped option or engine is a clear error (exit 2, naming it and the usage),
    before anything is built or installed."""
    res = subprocess.run(["bash", str(ROOT / "test.sh"), "--quik"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "unknown argument '--quik'" in res.stderr and "--quick" in res.stderr, res.stderr
    res = subprocess.run(["bash", str(ROOT / "tests" / "engine.sh"), "vlm"], capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 2 and "usage: tests/engine.sh vllm|sglang" in res.stderr and "'vlm'" in res.stderr, \
        res.stderr
