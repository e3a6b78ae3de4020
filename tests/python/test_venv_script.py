"""tests/venv.sh (sourced by test.sh and the engine tests' run.sh): a test environment is reused only while it holds
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
