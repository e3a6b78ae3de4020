"""Draws one attention head's pattern for a prompt, rebuilt from the rows ringscope captured.

    python examples/attention_pattern.py                                # a tiny random Llama, no download
    python examples/attention_pattern.py --model Qwen/Qwen2.5-0.5B --prompt "The capital of France is" --layer 3 --head 2
    python examples/attention_pattern.py --png pattern.png              # also as an image (needs matplotlib)

It attaches ringscope to a Hugging Face model with the sites ``attn_q`` and ``attn_k`` (the query and key of every head
after RoPE), runs the prompt once, closes the session (which writes the run's Parquet files and its manifest, with
each layer's attention parameters), then calls ``ringscope.attention_pattern(run, request, layer, head)`` and prints
the weights as a shaded grid: row ``i`` is the query at position ``i``, column ``j`` the key at ``j``. It also runs
the model with eager attention and ``output_attentions=True`` and prints the largest difference between the two
(the rebuild is float32 from the captured rows: ~1e-7 for a float32 model, ~1e-2 in bf16).
"""
import argparse
import sys
import tempfile

import torch

import ringscope
import ringscope.torch as rt

SHADES = " .:-=+*#%@"


def tiny_model():
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, initializer_range=0.35)
    return transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float32)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="a Hugging Face model id or directory (Llama, Qwen2/3, Mistral, Gemma2 families)")
    ap.add_argument("--prompt", default="ringscope rebuilds attention from the rows it captured")
    ap.add_argument("--layer", type=int, default=1)
    ap.add_argument("--head", type=int, default=0)
    ap.add_argument("--out", help="where the run goes (default: a temporary directory)")
    ap.add_argument("--png", help="also save the pattern as an image (needs matplotlib)")
    args = ap.parse_args(argv)

    if args.model:
        import transformers

        tok = transformers.AutoTokenizer.from_pretrained(args.model)
        model = transformers.AutoModelForCausalLM.from_pretrained(args.model, attn_implementation="eager")
        ids = tok(args.prompt, return_tensors="pt").input_ids
        labels = [tok.decode([t]) for t in ids[0].tolist()]
    else:
        model = tiny_model()
        ids = torch.tensor([[(7 * i + 3) % 120 + 5 for i in range(len(args.prompt.split()) * 2)]])
        labels = [str(t) for t in ids[0].tolist()]
    model.eval()
    out = args.out or tempfile.mkdtemp(prefix="ringscope-attention-")
    session = ringscope.Session({"export": {"parquet": True, "dir": out, "run_id": "prompt"}})
    att = rt.attach(model, session, sites=["attn_q", "attn_k"], layers=[args.layer])
    with torch.no_grad():
        ref = model(ids, output_attentions=True).attentions[args.layer][0, args.head].float().numpy()
    request = att.current_request_ids(1)[0]
    session.close()
    att.detach()

    run = f"{out}/prompt"
    p = ringscope.attention_pattern(run, request, args.layer, head=args.head)
    w = p.weights
    print(f"layer {args.layer}, head {args.head} of request {request} ({run}): {len(p.query_positions)} queries × "
          f"{len(p.key_positions)} keys; rows are queries, columns keys; shade = weight ({SHADES!r}, 0 to 1)")
    width = max(len(s) for s in labels[:40]) if labels else 0
    for i, row in enumerate(w[:40]):
        cells = "".join(SHADES[min(int(x * len(SHADES)), len(SHADES) - 1)] for x in row[:80])
        print(f"{labels[i][:width]:>{width}} |{cells}|")
    diff = float(abs(w - ref).max())
    print(f"largest difference from eager attention's own weights (output_attentions): {diff:.2e}")
    if args.png:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 6))
        ax.imshow(w, cmap="viridis", vmin=0, vmax=1)
        ax.set_xlabel("key position")
        ax.set_ylabel("query position")
        ax.set_title(f"layer {args.layer}, head {args.head}")
        fig.savefig(args.png, dpi=120, bbox_inches="tight")
        print(f"saved {args.png}")
    return diff


if __name__ == "__main__":
    sys.exit(0 if main() < 1e-3 or "--model" in sys.argv else 1)
