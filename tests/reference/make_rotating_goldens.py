"""Golden outputs of SmolLM2-135M-Instruct under mlx-lm's rotating KV cache.

    tests/reference/run.sh tests/reference/make_rotating_goldens.py \
        --model ~/.cache/mlxcel/models/SmolLM2-135M-Instruct \
        --out tests/reference/goldens/smollm2_rotating.json

The checkpoint is dequantized to float32 as in make_smollm2_goldens.py.
Every layer gets `RotatingKVCache(max_size, keep)`, and the prompt is fed
one token at a time: at decode the cache holds exactly the first `keep`
positions and the latest `max_size - keep`, so every position attends to
those (mlx-lm's multi-token prefill masks a plain window of `max_size`
instead, and keeps no sinks). The JSON records, per case, the prompt ids,
a greedy continuation with each step's top-2 logit gap, and per position
of prompt + continuation the top-16 (id, logit) pairs and the logsumexp.
"""

import argparse
import importlib.metadata as md
import json
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm import load
from mlx_lm.models.cache import RotatingKVCache

from make_smollm2_goldens import dequantize_to_f32, g6

# (max_size, keep): a window that is not a multiple of the pool's 16-token
# blocks, and one without sinks (Gemma 3's sliding layers).
CASES = [(90, 4), (71, 0)]


def run(model, ids, max_size, keep, max_new, topk):
    cache = [RotatingKVCache(max_size=max_size, keep=keep) for _ in model.layers]
    rows = []

    def feed(token):
        logits = model(mx.array([[token]]), cache=cache)[0, -1].astype(mx.float32)
        lse = mx.logsumexp(logits)
        mx.eval(logits, lse)
        rows.append((np.array(logits), float(lse)))
        return rows[-1][0]

    for t in ids:
        last = feed(t)
    tokens, gaps = [], []
    for _ in range(max_new):
        top2 = np.partition(last, -2)[-2:]
        gaps.append(g6(top2[1] - top2[0]))
        tokens.append(int(np.argmax(last)))
        last = feed(tokens[-1])
    rows = rows[:-1]  # the last feed's logits follow the last recorded token
    top, vals, lse = [], [], []
    for logits, s in rows:
        order = np.argsort(-logits, kind="stable")[:topk]
        top.append([int(i) for i in order])
        vals.append([g6(logits[i]) for i in order])
        lse.append(g6(s))
    return {"tokens": tokens, "top2_gap": gaps, "top_ids": top, "top_logits": vals, "logsumexp": lse}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, type=Path)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--prompt-tokens", type=int, default=200)
    ap.add_argument("--max-new", type=int, default=24)
    ap.add_argument("--topk", type=int, default=16)
    args = ap.parse_args()
    mx.set_default_device(mx.cpu)

    model, tokenizer = load(str(args.model))
    model, _ = dequantize_to_f32(model)
    text = (Path(__file__).resolve().parents[2] / "benches" / "prompt.txt").read_text()
    ids = [int(i) for i in tokenizer.encode(text, add_special_tokens=True)][: args.prompt_tokens]

    cases = []
    for max_size, keep in CASES:
        result = run(model, ids, max_size, keep, args.max_new, args.topk)
        cases.append({"max_size": max_size, "keep": keep, **result})
    out = {
        "model": args.model.name,
        "compute_dtype": "float32 (dequantized)",
        "versions": {"mlx": md.version("mlx"), "mlx_lm": md.version("mlx-lm")},
        "input_ids": ids,
        "cases": cases,
    }
    args.out.write_text(json.dumps(out, separators=(",", ":")) + "\n")


if __name__ == "__main__":
    main()
