"""Golden outputs of SmolLM2-135M-Instruct under mlx-lm's 8-bit KV cache.

    tests/reference/run.sh tests/reference/make_quantized_kv_goldens.py \
        --model ~/.cache/mlxcel/models/SmolLM2-135M-Instruct \
        --out tests/reference/goldens/smollm2_kv8.json

The checkpoint is dequantized to float32 as in make_smollm2_goldens.py (so
the cache quantizes f32 keys and values, and its scales and biases are f32,
as ours are). Every layer gets `QuantizedKVCache(group_size=64, bits=8)`
(what `mlx_lm.generate --kv-bits 8 --kv-group-size 64
--quantized-kv-start 0` runs). The prompt goes in one forward pass, then a
greedy continuation one token at a time. The JSON records the prompt ids,
the continuation with each step's top-2 logit gap, and per position of
prompt + continuation the top-16 (id, logit) pairs and the logsumexp.

8-bit keys make the output sensitive to the last bit of every key: a
feature on a rounding edge lands on either side, and the difference grows
through the layers. `last_bit_envelope` measures that on mlx-lm itself:
prompt + continuation in one pass with each layer's new keys and values
multiplied by (1 + 1e-6 * N(0, 1)) before they are quantized (three seeds),
against the same pass unperturbed: the largest |Δlogit| at the top-16
tokens, and the largest and mean |Δlogsumexp|. Two f32 implementations of
the model differ by about that much in their keys, so the parity test
allows a multiple of it.
"""

import argparse
import importlib.metadata as md
import json
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm import load
from mlx_lm.models.cache import QuantizedKVCache

from make_smollm2_goldens import dequantize_to_f32, g6


def run(model, ids, max_new, topk):
    cache = [QuantizedKVCache(group_size=64, bits=8) for _ in model.layers]
    logits = model(mx.array([ids]), cache=cache)[0].astype(mx.float32)
    lse = mx.logsumexp(logits, axis=-1)
    mx.eval(logits, lse)
    rows = [(np.array(logits[i]), float(lse[i])) for i in range(len(ids))]
    tokens, gaps = [], []
    last = rows[-1][0]
    for _ in range(max_new):
        top2 = np.partition(last, -2)[-2:]
        gaps.append(g6(top2[1] - top2[0]))
        tokens.append(int(np.argmax(last)))
        step = model(mx.array([[tokens[-1]]]), cache=cache)[0, -1].astype(mx.float32)
        s = mx.logsumexp(step)
        mx.eval(step, s)
        rows.append((np.array(step), float(s)))
        last = rows[-1][0]
    rows = rows[:-1]  # the last step's logits follow the last recorded token
    top, vals, lses = [], [], []
    for logits, s in rows:
        order = np.argsort(-logits, kind="stable")[:topk]
        top.append([int(i) for i in order])
        vals.append([g6(logits[i]) for i in order])
        lses.append(g6(s))
    return {"tokens": tokens, "top2_gap": gaps, "top_ids": top, "top_logits": vals, "logsumexp": lses}


class PerturbedKVCache(QuantizedKVCache):
    def update_and_fetch(self, keys, values):
        keys = keys * (1 + 1e-6 * mx.random.normal(keys.shape))
        values = values * (1 + 1e-6 * mx.random.normal(values.shape))
        return super().update_and_fetch(keys, values)


def last_bit_envelope(model, ids, top_ids):
    def one_pass(cache_type):
        logits = model(mx.array([ids]), cache=[cache_type(group_size=64, bits=8) for _ in model.layers])[0]
        logits = logits.astype(mx.float32)
        lse = mx.logsumexp(logits, axis=-1)
        mx.eval(logits, lse)
        return np.array(logits), np.array(lse)

    base_logits, base_lse = one_pass(QuantizedKVCache)
    rows = np.arange(len(ids))[:, None]
    worst_logit, worst_lse, mean_lse = 0.0, 0.0, 0.0
    for seed in range(3):
        mx.random.seed(seed)
        logits, lse = one_pass(PerturbedKVCache)
        worst_logit = max(worst_logit, float(np.abs(logits[rows, top_ids] - base_logits[rows, top_ids]).max()))
        worst_lse = max(worst_lse, float(np.abs(lse - base_lse).max()))
        mean_lse = max(mean_lse, float(np.abs(lse - base_lse).mean()))
    return {"max_logit": g6(worst_logit), "max_logsumexp": g6(worst_lse), "mean_logsumexp": g6(mean_lse)}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, type=Path)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--prompt-tokens", type=int, default=200)
    ap.add_argument("--max-new", type=int, default=32)
    ap.add_argument("--topk", type=int, default=16)
    args = ap.parse_args()
    mx.set_default_device(mx.cpu)

    model, tokenizer = load(str(args.model))
    model, _ = dequantize_to_f32(model)
    text = (Path(__file__).resolve().parents[2] / "benches" / "prompt.txt").read_text()
    ids = [int(i) for i in tokenizer.encode(text, add_special_tokens=True)][: args.prompt_tokens]
    result = run(model, ids, args.max_new, args.topk)
    positions = ids + result["tokens"][:-1]
    envelope = last_bit_envelope(model, positions, np.array(result["top_ids"]))
    out = {
        "model": args.model.name,
        "compute_dtype": "float32 (dequantized)",
        "kv_cache": "QuantizedKVCache(group_size=64, bits=8)",
        "versions": {"mlx": md.version("mlx"), "mlx_lm": md.version("mlx-lm")},
        "input_ids": ids,
        "last_bit_envelope": envelope,
        **result,
    }
    args.out.write_text(json.dumps(out, separators=(",", ":")) + "\n")


if __name__ == "__main__":
    main()
