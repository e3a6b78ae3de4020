"""Bad input fails clearly and early; an error while serving never takes the engine down."""

import pytest

from conftest import CONFIG, RESIDUAL_CONFIG


def test_layer_that_does_not_exist_fails_at_load(engines):
    res = engines("bad_layer", "eager", "all", config=CONFIG.replace('layers = "all"', "layers = [0, 5]"))
    assert "vllm.layers names layer(s) [5]" in res["error"] and "2 decoder layers" in res["error"]
    assert "requests" not in res  # failed at load, before serving


def test_bad_vllm_table_fails_at_start(engines):
    res = engines("bad_key", "eager", "all", config=CONFIG.replace('layers = "all"', 'layer = "all"'))
    assert "unknown key(s) ['layer'] in [vllm]" in res["error"]
    res = engines("bad_site", "eager", "all", config=CONFIG.replace('"mlp_output"]', '"mlp"]'))
    assert "vllm.sites" in res["error"] and "attention_output" in res["error"]


def test_unsupported_vllm_version(monkeypatch, tmp_path):
    import vllm

    import ringscope.vllm as rv
    from ringscope import RingscopeError

    cfg = tmp_path / "c.toml"
    cfg.write_text("")
    monkeypatch.setenv(rv.ENV_CONFIG, str(cfg))
    monkeypatch.delenv(rv.ENV_DISABLE, raising=False)
    monkeypatch.setattr(vllm, "__version__", "0.99.0")
    monkeypatch.setattr(rv._PLUGIN, "registered", False)
    with pytest.raises(RingscopeError, match=r"supports vLLM 0\.26\.x to 0\.32\.x; this is vLLM 0\.99\.0"):
        rv.register()
    for bad in ("0.25.1", "0.33.0", "1.0.0", "dev"):
        with pytest.raises(RingscopeError, match=f"supports vLLM 0\\.26\\.x to 0\\.32\\.x; this is vLLM {bad}"):
            rv.check_version(bad)
    for good in ("0.26.0", "0.29.3", "0.32.0", "0.32.1rc1"):
        rv.check_version(good)


def test_unsupported_model(tmp_path):
    import torch

    import ringscope.vllm as rv
    from ringscope import RingscopeError

    class GPT2LMHeadModel(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(2, 2)

    class Runner:
        def get_model(self):
            return GPT2LMHeadModel()

    with pytest.raises(RingscopeError, match="GPT2LMHeadModel is not supported.*LlamaForCausalLM"):
        rv.VllmCapture.install(Runner(), rv.parse_config({}))


def test_error_while_serving_disables_capture(engines, eager_all):
    res = engines("fault", "eager", "fault")
    assert res.get("error") is None, res.get("traceback")
    f = res["fault"]
    # The engine went on, computing the same tokens.
    assert f["tokens"] == [r["tokens"] for r in eager_all["requests"][:2]] == f["tokens_after"]
    assert f["before"]["disabled"] is None
    assert "injected fault" in f["after"]["disabled"]
    assert f["after"]["lost_steps"] > 0 and f["after"]["lost_rows"] > 0
    assert "capture is off for the rest of the run" in res["log"]
    closed = res["closed"][0]
    s = closed["session"]
    assert s["produced_rows"] == s["exported_rows"] + s["dropped_rows"] + s["sampled_out_rows"]


def test_error_while_capturing_in_the_end_op_disables_capture(engines, eager_all):
    # Only the residual: the end op makes the pass's captures (the fault is raised there), compiled.
    res = engines("fault_end_op", "compiled", "fault", config=RESIDUAL_CONFIG)
    assert res.get("error") is None, res.get("traceback")
    f = res["fault"]
    assert f["tokens"] == [r["tokens"] for r in eager_all["requests"][:2]] == f["tokens_after"]
    assert f["before"]["disabled"] is None
    assert "end_capturing" in f["after"]["disabled"] and "injected fault" in f["after"]["disabled"]
    assert f["after"]["lost_steps"] > 0 and f["after"]["lost_rows"] > 0
    s = res["closed"][0]["session"]
    assert s["produced_rows"] == s["exported_rows"] + s["dropped_rows"] + s["sampled_out_rows"]


def test_the_default_run_id_is_the_same_in_every_worker_of_an_engine():
    from ringscope import vllm as plugin

    # vLLM's instance id: the engine config's creation time in ns, pickled to every worker.
    assert plugin._default_run_id("1764610000123456789") == "vllm-20251201T172640Z-123456789"
    assert plugin._default_run_id("1764610000123456789") == plugin._default_run_id("1764610000123456789")
    assert plugin._default_run_id("ab12c") == "vllm-ab12c"
    assert plugin._default_run_id("").startswith("vllm-")


def test_devices_and_cuda_engine_settings_are_checked_with_clear_errors():
    import types

    import torch

    from ringscope import RingscopeError
    from ringscope import vllm as plugin

    plugin._check_device(torch.device("cpu"))
    plugin._check_device(torch.device("cuda", 0))  # the CUDA path: capture recorded into vLLM's CUDA graphs
    with pytest.raises(RingscopeError, match="supports vLLM on CPU only"):
        plugin._check_device(torch.device("meta"))

    def runner(dp=1, spec=None):
        return types.SimpleNamespace(vllm_config=types.SimpleNamespace(
            parallel_config=types.SimpleNamespace(data_parallel_size=dp), speculative_config=spec))

    plugin._check_cuda_engine(runner())
    # Pipeline parallelism (any device): its stages share tensor-parallel rank numbers, so their files would collide.
    plugin._check_parallel(runner())
    plugin._check_parallel(types.SimpleNamespace(vllm_config=types.SimpleNamespace(
        parallel_config=types.SimpleNamespace(pipeline_parallel_size=1))))
    with pytest.raises(RingscopeError, match="pipeline_parallel_size = 2 is not supported .the stages would write"):
        plugin._check_parallel(types.SimpleNamespace(vllm_config=types.SimpleNamespace(
            parallel_config=types.SimpleNamespace(pipeline_parallel_size=2))))
    with pytest.raises(RingscopeError, match="data_parallel_size = 2 is not supported on CUDA"):
        plugin._check_cuda_engine(runner(dp=2))
    with pytest.raises(RingscopeError, match="speculative decoding is not supported on CUDA"):
        plugin._check_cuda_engine(runner(spec=object()))


def test_full_mode_on_cuda_is_taken_with_admission_and_degrade_by_default():
    """The vLLM plugin admits every forward pass on CUDA, so full mode is taken there (a pass that finds no room in
    time is degraded — its captures dropped on the device and counted —, never an error the engine cannot receive);
    the SGLang plugin does not admit, and full mode stays refused for it; other values are refused by name."""
    from ringscope import RingscopeError, _engine
    from ringscope.vllm import parse_config

    planned = [("layers.0.resid", "residual", 0)]
    cfg = _engine.session_config(parse_config({"policy": {"mode": "full"}}), planned, "bf16", 64, cuda=True,
                                 max_rows=512, full_on_cuda=True)
    assert cfg["policy"] == {"mode": "full", "on_deadline": "degrade"}
    assert cfg["ring"] == {"backend": "cuda", "max_batch_rows": 512}
    cfg = _engine.session_config(parse_config({"policy": {"mode": "full", "on_deadline": "error"}}), planned, "bf16",
                                 64, cuda=True, full_on_cuda=True)
    assert cfg["policy"]["on_deadline"] == "error"  # the user's choice is kept
    cfg = _engine.session_config(parse_config({}), planned, "bf16", 64, cuda=True, full_on_cuda=True)
    assert cfg["policy"] == {"mode": "best_effort"}  # still the default: full mode waits for the drain
    with pytest.raises(RingscopeError, match='policy.mode = "best_effort" or "full" .*policy.mode = .lossy.'):
        _engine.session_config(parse_config({"policy": {"mode": "lossy"}}), planned, "bf16", 64, cuda=True,
                               full_on_cuda=True)
    with pytest.raises(RingscopeError, match='does not admit each replay.*policy.mode = "best_effort" \\(got'):
        _engine.session_config(parse_config({"policy": {"mode": "full"}}), planned, "bf16", 64, cuda=True)


def test_captures_are_deferred_on_cuda_unless_the_configuration_says_otherwise():
    """On CUDA the vLLM plugin asks for deferred captures (one copy kernel per forward pass instead of one per
    hookpoint); a user's ``ring.defer_captures = false`` is kept, a value that is not a boolean is refused by name,
    and the CPU path (host ring, immediate copies) is left alone."""
    from ringscope import RingscopeError, _engine
    from ringscope.vllm import parse_config

    planned = [("layers.0.resid", "residual", 0)]
    cfg = _engine.session_config(parse_config({}), planned, "bf16", 64, cuda=True, full_on_cuda=True, defer=True)
    assert cfg["ring"]["defer_captures"] is True
    cfg = _engine.session_config(parse_config({"ring": {"defer_captures": False}}), planned, "bf16", 64, cuda=True,
                                 full_on_cuda=True, defer=True)
    assert cfg["ring"]["defer_captures"] is False
    with pytest.raises(RingscopeError, match="ring.defer_captures must be true or false .got 'yes'"):
        _engine.session_config(parse_config({"ring": {"defer_captures": "yes"}}), planned, "bf16", 64, cuda=True,
                               full_on_cuda=True, defer=True)
    cfg = _engine.session_config(parse_config({}), planned, "bf16", 64, cuda=False, defer=True)
    assert "defer_captures" not in cfg.get("ring", {})
    cfg = _engine.session_config(parse_config({}), planned, "bf16", 64, cuda=True, full_on_cuda=True)
    assert "defer_captures" not in cfg["ring"]  # the SGLang plugin's CUDA path: immediate captures


def test_captures_are_deferred_only_for_sites_vllm_leaves_unchanged_until_the_pass_ends():
    """The attention and MLP outputs are overwritten in place by vLLM's next fused add-norm: with either site the
    plugin copies every capture at once (no deferral), and a configuration that asks for deferral with them is refused
    naming the sites; the residual and q/k/v are deferred; the CPU path never defers."""
    from ringscope import RingscopeError
    from ringscope.vllm import deferrable, parse_config

    resid = [("layers.0.resid", "residual", 0), ("layers.0.attn_q", "attn_q", 0), ("layers.0.attn_v", "attn_v", 0)]
    mixed = resid + [("layers.0.attn_out", "attention_output", 0), ("layers.0.mlp_out", "mlp_output", 0)]
    assert deferrable(parse_config({}), resid, cuda=True)
    assert not deferrable(parse_config({}), resid, cuda=False)
    assert not deferrable(parse_config({}), mixed, cuda=True)
    assert not deferrable(parse_config({"ring": {"defer_captures": False}}), mixed, cuda=True)
    with pytest.raises(RingscopeError, match="ring.defer_captures = true with the site.s. attention_output, "
                                             "mlp_output: vLLM overwrites those outputs in place"):
        deferrable(parse_config({"ring": {"defer_captures": True}}), mixed, cuda=True)
    assert not deferrable(parse_config({"ring": {"defer_captures": True}}), mixed, cuda=False)  # CPU: host ring


def test_the_v2_model_runner_is_refused_by_name(monkeypatch, tmp_path):
    """vLLM's V2 model runner (its own load_model and forward path) is not supported: loading a model with it while
    the plugin is configured is a clear error naming the way out, never a silent engine without capture."""
    import sys
    import types

    import ringscope.vllm as rv
    from ringscope import RingscopeError

    class V2Runner:  # stands for vllm.v1.worker.gpu.model_runner.GPUModelRunner
        loaded = False

        def load_model(self, *args, **kwargs):
            V2Runner.loaded = True

    fake = types.ModuleType("fake_v2_runner")
    fake.GPUModelRunner = V2Runner
    monkeypatch.setitem(sys.modules, "fake_v2_runner", fake)
    monkeypatch.setitem(rv._VERSIONED, "v2_runner", "fake_v2_runner:GPUModelRunner")
    cfg = tmp_path / "c.toml"
    cfg.write_text("")
    monkeypatch.setenv(rv.ENV_CONFIG, str(cfg))
    monkeypatch.delenv(rv.ENV_DISABLE, raising=False)
    rv._patch_runners()
    with pytest.raises(RingscopeError, match="V2 model runner.*VLLM_USE_V2_MODEL_RUNNER=0"):
        V2Runner().load_model()
    assert not V2Runner.loaded
    # Not configured: the V2 runner loads as vLLM made it.
    monkeypatch.delenv(rv.ENV_CONFIG)
    V2Runner().load_model()
    assert V2Runner.loaded


def test_the_bytes_per_token_the_plugins_log_are_those_of_the_hookpoints_the_session_is_configured_with():
    """What the plugins log when they install as one captured token's cost (capture_bytes) is the bytes of the
    hookpoints the session is configured with (the attention sites' rows are heads × head_dim wide, the others the
    hidden size)."""
    from ringscope import _engine
    from ringscope.vllm import parse_config

    planned = _engine.planned_hookpoints([0, 5], ["residual", "attn_q", "attn_k", "attn_v"])
    widths = {name: 2048 if site == "attn_q" else 512 for name, site, _ in planned if site in _engine.ATTN_SITES}
    cfg = _engine.session_config(parse_config({}), planned, "bf16", 2048, widths=widths)
    rows = sum(h["row_width"] * 2 for h in cfg["hookpoints"])
    assert rows == 2 * (2048 + 2048 + 512 + 512) * 2
    assert _engine.capture_bytes(planned, "bf16", 2048, widths) == \
        f"{rows:,} bytes of rows per token ({rows + 16 * len(planned):,} with their ids and positions)"
