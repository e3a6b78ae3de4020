"""What each capture adds to one eager decode step, counted rather than timed (runs on a CPU): the top-level aten and
ringscope ops the torch profiler sees in a decode step of a 16-layer Llama (hidden 256, 8 query / 2 KV heads, batch 8)
without capture, with ``attach(sites=["attn_q", "attn_k", "attn_v"], layers=[0, 5, 10, 15])`` and with the residual
stream of all 16 layers — the ops beyond the plain step's, by name. On a GPU each compute op is a kernel (views are
not): a count that does not depend on the machine's noise.

    RINGSCOPE_LIB=target/debug/libringscope.so PYTHONPATH=ffi/python python3 benches/attention_ops.py
"""
import collections

import torch
import transformers
from torch.profiler import ProfilerActivity, profile

import ringscope
import ringscope.torch as rt

PREFIXES = ("aten::", "ringscope")


def ops(model, sites=None, layers=None) -> collections.Counter:
    att = session = None
    if sites:
        session = ringscope.Session({"policy": {"mode": "full"}, "export": {"parquet": False}})
        att = rt.attach(model, session, sites=sites, layers=layers)
    with torch.no_grad():
        out = model(torch.tensor([[5, 6, 7, 8]] * 8), use_cache=True)
        with profile(activities=[ProfilerActivity.CPU]) as p:
            model(torch.tensor([[9]] * 8), past_key_values=out.past_key_values, use_cache=True)
    if att is not None:
        att.detach()
        session.close()
    return collections.Counter(e.name for e in p.events() if e.name.startswith(PREFIXES)
                               and not (e.cpu_parent and e.cpu_parent.name.startswith(PREFIXES)))


def main() -> None:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=16,
                                   num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=256)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    plain = ops(model)
    print(f"plain decode step: {sum(plain.values())} top-level ops")
    for label, sites, layers in (("q/k/v of 4 layers", ("attn_q", "attn_k", "attn_v"), [0, 5, 10, 15]),
                                 ("residual of 16 layers", ("residual",), None)):
        extra = ops(model, sites, layers) - plain
        print(f"{label}: +{sum(extra.values())}: {dict(extra.most_common())}")


if __name__ == "__main__":
    main()
