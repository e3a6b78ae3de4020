"""Not configured, or switched off: vLLM runs unchanged, with no ringscope session."""

import pathlib


def test_not_configured(engines, eager_all):
    off = engines("off", "eager", "all", config=None)
    assert off.get("error") is None, off.get("traceback")
    assert not off["plugin_installed"] and not off["sink_buffer"]
    assert not off["ringscope_library_loaded"]
    assert "ringscope" not in (off["additional_config"] or {})
    assert [r["tokens"] for r in off["requests"]] == [r["tokens"] for r in eager_all["requests"]]


def test_kill_switch(engines, eager_all):
    killed = engines("killed", "eager", "all", env={"RINGSCOPE_VLLM_DISABLE": "1"})
    assert killed.get("error") is None, killed.get("traceback")
    assert not killed["plugin_installed"] and not killed["sink_buffer"]
    assert not killed["ringscope_library_loaded"]
    assert not (pathlib.Path(killed["out"]) / "dump").exists()
    assert [r["tokens"] for r in killed["requests"]] == [r["tokens"] for r in eager_all["requests"]]


def test_entry_point_installed():
    from importlib.metadata import entry_points

    eps = {e.name: e.value for e in entry_points(group="vllm.general_plugins")}
    assert eps.get("ringscope") == "ringscope.vllm:register", eps
