"""Times mlx-lm's stream_generate on a checkpoint and prints one JSON line.

Run through tests/reference/run.sh (the pinned mlx-lm venv). With
MLXCEL_OPENBLAS=none it uses the stock mlx-cpu wheel as a user would get it.
"""
import argparse
import json
import time

from mlx_lm import load, stream_generate

parser = argparse.ArgumentParser()
parser.add_argument("--model", required=True)
parser.add_argument("--prompt", required=True)
parser.add_argument("--max-tokens", type=int, default=16)
args = parser.parse_args()

model, tokenizer = load(args.model)
start = time.perf_counter()
last = None
text = ""
for last in stream_generate(model, tokenizer, args.prompt, max_tokens=args.max_tokens):
    text += last.text
print(json.dumps({
    "engine": "mlx-lm",
    "prompt_tokens": last.prompt_tokens,
    "prompt_tps": round(last.prompt_tps, 3),
    "generation_tokens": last.generation_tokens,
    "decode_tps": round(last.generation_tps, 3),
    "peak_memory_gb": round(last.peak_memory, 3),
    "wall_s": round(time.perf_counter() - start, 2),
    "text": text,
}))
