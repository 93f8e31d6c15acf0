"""Greedy continuations of the original GGUF file by llama.cpp, for the prompts of an
mlx-lm golden file (make_smollm2_goldens.py), so that mlxcel's conversion of the same
GGUF can be checked against the engine the file was made for.

    ~/.cache/mlxcel/peers/venv-native/bin/python tests/reference/make_llama_cpp_goldens.py \\
        --gguf gemma-3-270m-q4_k_m.gguf --prompts tests/reference/goldens/gemma3_270m.json \\
        --out tests/reference/goldens/gemma3_270m.llama_cpp.json

Runs in the venv that benches/peers.sh builds (llama-cpp-python 0.3.36 from source,
native). For each prompt it records llama.cpp's own tokenization of the prompt text (BOS
as the GGUF asks; special tokens parsed, so chat templates keep their markers), the greedy
tokens (logits over the whole vocabulary, argmax, no EOS stop) and each step's top-2
logit gap. llama.cpp computes with its quantized weights and 8-bit activations, so its
logits are further from mlx-lm's float32 ones than mlxcel's are; the gaps say where a
difference is a near tie.
"""

import argparse
import importlib.metadata as md
import json
import platform
from pathlib import Path

import numpy as np
from llama_cpp import Llama


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", required=True, type=Path)
    ap.add_argument("--prompts", required=True, type=Path, help="an mlx-lm golden file whose prompt texts to use")
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--max-new", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    source = json.loads(args.prompts.read_text())
    llm = Llama(model_path=str(args.gguf), n_ctx=2048, n_threads=args.threads, logits_all=True, verbose=False)
    add_bos = bool(llm.metadata.get("tokenizer.ggml.add_bos_token", "false") == "true")
    records = []
    for case in source["prompts"]:
        text = case["prompt_text"]
        ids = llm.tokenize(text.encode("utf-8"), add_bos=add_bos, special=True)
        llm.reset()
        llm.eval(ids)
        tokens, gaps = [], []
        for _ in range(args.max_new):
            logits = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32)
            top2 = np.partition(logits, -2)[-2:]
            token = int(np.argmax(logits))
            tokens.append(token)
            gaps.append(float(f"{abs(float(top2[1] - top2[0])):.6g}"))
            llm.eval([token])
        records.append({
            "prompt": case["prompt"],
            "chat": case["chat"],
            "prompt_text": text,
            "input_ids": [int(i) for i in ids],
            "greedy": {"tokens": tokens, "top2_gap": gaps,
                       "text": llm.detokenize(tokens).decode("utf-8", errors="replace")},
        })
        print(f"{case['prompt'][:40]!r}: {len(ids)} prompt tokens -> {records[-1]['greedy']['text']!r}", flush=True)
    out = {
        "gguf": args.gguf.name,
        "engine": "llama.cpp via llama-cpp-python " + md.version("llama_cpp_python"),
        "add_bos": add_bos,
        "max_new_tokens": args.max_new,
        "python": platform.python_version(),
        "prompts": records,
    }
    args.out.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
