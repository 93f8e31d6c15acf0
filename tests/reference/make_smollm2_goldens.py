"""Golden outputs of a real checkpoint (MLX format), in float32.

    tests/reference/run.sh tests/reference/make_smollm2_goldens.py \
        --model ~/.cache/mlxcel/models/SmolLM2-135M-Instruct \
        --out tests/reference/goldens/smollm2.json

Other real models take their own prompts (`--raw-prompt` / `--chat-prompt`,
repeatable, replacing the defaults; `--no-chat` for base models without a
chat template), e.g. Gemma 3:

    tests/reference/run.sh tests/reference/make_smollm2_goldens.py \
        --model ~/.cache/mlxcel/models/gemma-3-270m --no-chat \
        --out tests/reference/goldens/gemma3_270m.json

The checkpoint (4-bit affine, group 32, float16 scales/biases) is loaded with
mlx_lm.load and every quantized layer is DEQUANTIZED to float32: scales and
biases are upcast to float32 first, so each weight is exactly
float32(scale) * q + float32(bias) (one f32 rounding) -- the exact values the
quantized checkpoint stands for. All other parameters (norms) are cast to
float32 too, and the whole model runs in float32.

For each prompt the JSON records the tokenization, a greedy continuation
(KV cache, mlx_lm.generate.generate_step, stops at EOS) with the top-2 logit
gap per step, the decoded text, and teacher-forced logits over
prompt + continuation, compactly: per position the top-16 (id, logit) pairs
and the logsumexp over the vocabulary.
"""

import argparse
import importlib.metadata as md
import json
import os
import platform
import sys
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm import load
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import dequantize_model

RAW_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
]
CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
]


def g6(v):
    return float(f"{float(v):.6g}")


def dequantize_to_f32(model):
    n = 0
    for _, m in model.named_modules():
        if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            m.scales = m.scales.astype(mx.float32)
            if m.get("biases") is not None:
                m.biases = m.biases.astype(mx.float32)
            n += 1
    model = dequantize_model(model)  # mlx-lm's helper: mx.dequantize per layer
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    dtypes = {str(v.dtype) for _, v in tree_flatten(model.parameters())}
    assert dtypes == {"mlx.core.float32"}, dtypes
    return model, n


def greedy(model, ids, max_new, eos_ids):
    toks, gaps, steps = [], [], []
    cache = make_prompt_cache(model)
    for (tok, logprobs), _ in zip(
        generate_step(mx.array(ids), model, max_tokens=max_new, prompt_cache=cache),
        range(max_new),
    ):
        lp = np.array(logprobs.astype(mx.float32))
        top2 = np.partition(lp, -2)[-2:]
        toks.append(int(tok))
        gaps.append(g6(abs(top2[1] - top2[0])))
        steps.append(lp)
        if int(tok) in eos_ids:
            break
    return toks, gaps, np.stack(steps)


def teacher_forced(model, ids, k):
    logits = model(mx.array(ids)[None])[0].astype(mx.float32)
    lse = mx.logsumexp(logits, axis=-1)
    mx.eval(logits, lse)
    logits, lse = np.array(logits), np.array(lse)
    top = np.argsort(-logits, axis=-1, kind="stable")[:, :k]
    vals = np.take_along_axis(logits, top, axis=-1)
    return logits, lse, top, vals


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, type=Path)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--max-new", type=int, default=48)
    ap.add_argument("--topk", type=int, default=16)
    ap.add_argument("--raw-prompt", action="append", help="a raw prompt (repeatable; replaces the defaults)")
    ap.add_argument("--chat-prompt", action="append", help="a chat prompt (repeatable; replaces the defaults)")
    ap.add_argument("--no-chat", action="store_true", help="no chat prompts (a base model without a template)")
    args = ap.parse_args()
    mx.set_default_device(mx.cpu)

    t_start = time.perf_counter()
    model, tokenizer = load(str(args.model))
    src_cfg = json.loads((args.model / "config.json").read_text())
    model, n_deq = dequantize_to_f32(model)
    t_load = time.perf_counter() - t_start
    eos_ids = sorted(int(i) for i in tokenizer.eos_token_ids)

    raw = args.raw_prompt or RAW_PROMPTS
    chat_prompts = [] if args.no_chat else (args.chat_prompt or CHAT_PROMPTS)
    prompts = [(p, False) for p in raw] + [(p, True) for p in chat_prompts]
    records = []
    n_gen = 0
    t_gen = 0.0
    for prompt, chat in prompts:
        if chat:
            # Exactly what `mlx_lm.generate --prompt ...` does with a chat template.
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
            )
            ids = tokenizer.encode(text, add_special_tokens=False)
        else:
            text = prompt
            ids = tokenizer.encode(prompt, add_special_tokens=True)
        ids = [int(i) for i in ids]

        t0 = time.perf_counter()
        toks, gaps, step_lp = greedy(model, ids, args.max_new, set(eos_ids))
        t_gen += time.perf_counter() - t0
        n_gen += len(toks)
        stopped = toks[-1] in eos_ids
        text_toks = toks[:-1] if stopped else toks

        seq = ids + toks
        logits, lse, top, vals = teacher_forced(model, seq, args.topk)
        # Cache vs no cache: log-softmax at the generation positions.
        full_lp = logits[len(ids) - 1 : len(ids) - 1 + len(toks)] - lse[len(ids) - 1 : len(ids) - 1 + len(toks), None]
        cache_vs_full = float(np.abs(full_lp - step_lp).max())
        # Greedy tokens must also be the teacher-forced argmax.
        tf_argmax = top[len(ids) - 1 : len(ids) - 1 + len(toks), 0].tolist()

        records.append(
            {
                "prompt": prompt,
                "chat": chat,
                "prompt_text": text,
                "input_ids": ids,
                "greedy": {
                    "tokens": toks,
                    "finish_reason": "stop" if stopped else "length",
                    "top2_gap": gaps,
                    "min_top2_gap": min(gaps),
                    "text": tokenizer.decode(text_toks),
                    "teacher_forced_argmax_agrees": tf_argmax == toks,
                },
                "teacher_forced": {
                    "note": "positions over input_ids + greedy.tokens; row i predicts token i+1",
                    "n_positions": len(seq),
                    "topk_ids": top.tolist(),
                    "topk_logits": [[g6(v) for v in row] for row in vals],
                    "logsumexp": [g6(v) for v in lse],
                },
                "stats": {
                    "logit_abs_max": g6(np.abs(logits).max()),
                    "cache_vs_full_logprob_max_abs_diff": float(f"{cache_vs_full:.3g}"),
                },
            }
        )
        print(
            f"{'chat' if chat else 'raw '} {prompt!r}: {len(ids)} prompt + {len(toks)} gen "
            f"({'eos' if stopped else 'len'}), min_gap={min(gaps):.3g}, "
            f"cache_vs_full={cache_vs_full:.2g} -> {tokenizer.decode(text_toks)!r}",
            flush=True,
        )

    runtime = time.perf_counter() - t_start
    golden = {
        "model": args.model.name,
        "model_dir_config": {
            k: src_cfg.get(k)
            for k in ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "tie_word_embeddings", "torch_dtype", "quantization")
        },
        "weights": "dequantized to float32 (scales/biases upcast to f32, then mx.dequantize via mlx_lm.utils.dequantize_model); "
        f"{n_deq} quantized modules",
        "compute_dtype": "float32",
        "eos_token_ids": eos_ids,
        "max_new_tokens": args.max_new,
        "topk": args.topk,
        "versions": {
            "mlx": md.version("mlx"),
            "mlx_lm": md.version("mlx-lm"),
            "transformers": md.version("transformers"),
            "tokenizers": md.version("tokenizers"),
            "numpy": md.version("numpy"),
            "python": platform.python_version(),
        },
        "runtime": {
            "total_s": round(runtime, 2),
            "load_and_dequantize_s": round(t_load, 2),
            "greedy_s": round(t_gen, 2),
            "greedy_tokens": n_gen,
            "greedy_tok_per_s": round(n_gen / t_gen, 2),
            "blas_preload": os.environ.get("LD_PRELOAD", ""),
        },
        "prompts": records,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(golden, ensure_ascii=False, separators=(",", ":")) + "\n")
    print(
        f"wrote {args.out} ({args.out.stat().st_size / 1024:.0f} KiB) in {runtime:.1f}s, "
        f"{n_gen / t_gen:.1f} tok/s greedy"
    )


if __name__ == "__main__":
    sys.exit(main())
