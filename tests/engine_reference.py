"""The independent reference the engine-plugin tests (tests/vllm, tests/sglang) check captured rows against: a Hugging
Face ``LlamaForCausalLM`` loaded from the checkpoint the engine served, whose own forward hooks give every layer's
output (the residual stream after it, before the final norm), attention and MLP outputs. Imported by both test
directories' conftest.py (each runs in its own virtual environment)."""

import numpy as np


def hf_model(model_dir):
    """The checkpoint the engine served, loaded by Hugging Face transformers (its own Llama code)."""
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(model_dir, attn_implementation="eager", dtype="float32").eval()


def reference(model_dir, sequences):
    """{(sequence index, hookpoint name): array [len, hidden]}: every layer's residual stream, attention and MLP
    outputs at every position of each token sequence, from the Hugging Face model's own forward hooks."""
    import torch

    m = hf_model(model_dir)
    got = {}
    cur = {}
    for i, layer in enumerate(m.model.layers):
        def hook(name):
            def f(mod, args, out):
                cur[name] = (out[0] if isinstance(out, tuple) else out)[0].detach().numpy().copy()
            return f
        layer.register_forward_hook(hook(f"layers.{i}.resid"))
        layer.self_attn.register_forward_hook(hook(f"layers.{i}.attn_out"))
        layer.mlp.register_forward_hook(hook(f"layers.{i}.mlp_out"))
    with torch.no_grad():
        for k, seq in enumerate(sequences):
            cur.clear()
            m(torch.tensor([seq]))
            for name, v in cur.items():
                got[(k, name)] = v
    return got


def assert_rows_match(a, b, what, tolerance: float = 1e-4, neighbours: bool = True) -> float:
    """Captured rows ``a`` (in position order) equal the reference's ``b`` within ``tolerance`` relative, and (unless
    ``neighbours`` is false: rows that may repeat, such as layer 0's values of a repeated token) the check can tell
    rows apart (a neighbouring position's row is off by more than twice the tolerance, and 1e-2). Returns the largest
    relative error."""
    assert a.shape == b.shape, (what, a.shape, b.shape)
    err = np.linalg.norm(a - b, axis=1) / np.maximum(np.linalg.norm(b, axis=1), 1e-30)
    assert err.max() < tolerance, (what, err.max())
    if neighbours and len(b) > 1:
        off = np.linalg.norm(a[1:] - b[:-1], axis=1) / np.linalg.norm(b[:-1], axis=1)
        assert off.min() > max(1e-2, 2 * tolerance), (what, off.min())
    return float(err.max())


def mixed_step(dump: dict, prompt_lens: "dict[int, int]") -> bool:
    """Whether some step holds a decode row of one request and a prefill row of another (continuous batching)."""
    cols = dump["layers.0.resid"]
    for step in np.unique(cols["step"]):
        m = cols["step"] == step
        decode, prefill = set(), set()
        for r, p in zip(cols["request_id"][m].tolist(), cols["position"][m].tolist()):
            (decode if p >= prompt_lens[r] else prefill).add(r)
        if decode and prefill and decode != prefill:
            return True
    return False
