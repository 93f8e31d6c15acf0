#!/usr/bin/env bash
# mlxcel against llama.cpp on a real model beyond the default one, side by side:
# the same GGUF file (llama.cpp reads it as it is; mlxcel reads its conversion,
# `mlxcel pull NAME [--q-bits B]`), the same prompt (benches/prompt.txt cut to
# --prompt-tokens ids by each engine's tokenizer), the same threads, R interleaved
# rounds. Each round runs `mlxcel bench --json` and `benches/peers.py llama`
# (llama.cpp's own perf counters), each the median of --repeat runs.
#
# Usage: benches/models.sh --model NAME --gguf FILE [--q-bits B] [--prompt-tokens P]
#            [--gen-tokens G] [--repeat N] [--rounds R] [--threads T] [--out FILE]
#
# llama.cpp comes from the native llama-cpp-python venv that benches/peers.sh builds
# (${MLXCEL_CACHE_DIR:-~/.cache/mlxcel}/peers/venv-native; `benches/peers.sh --build-only`).
# The GGUF of a packaged model is its wheels' members joined (`mlxcel models` names them;
# ../shared/MODELS.md says how).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE="${MLXCEL_CACHE_DIR:-$HOME/.cache/mlxcel}"
MODEL="" GGUF="" QBITS="" PROMPT=512 GEN=128 REPEAT=3 ROUNDS=2 THREADS=2 OUT=""
while [[ $# -gt 0 ]]; do
    case "$1" in
        --model) MODEL="$2"; shift 2 ;;
        --gguf) GGUF="$2"; shift 2 ;;
        --q-bits) QBITS="$2"; shift 2 ;;
        --prompt-tokens) PROMPT="$2"; shift 2 ;;
        --gen-tokens) GEN="$2"; shift 2 ;;
        --repeat) REPEAT="$2"; shift 2 ;;
        --rounds) ROUNDS="$2"; shift 2 ;;
        --threads) THREADS="$2"; shift 2 ;;
        --out) OUT="$2"; shift 2 ;;
        -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "models.sh: unknown option $1" >&2; exit 2 ;;
    esac
done
[[ -n "$MODEL" && -n "$GGUF" ]] || { echo "models.sh: --model NAME and --gguf FILE are required" >&2; exit 2; }
[[ -f "$GGUF" ]] || { echo "models.sh: no GGUF at $GGUF" >&2; exit 2; }
PY="$CACHE/peers/venv-native/bin/python"
[[ -x "$PY" ]] || { echo "models.sh: no llama.cpp venv at $PY (run benches/peers.sh --build-only)" >&2; exit 2; }
MLXCEL="$ROOT/target/release/mlxcel"
[[ -x "$MLXCEL" ]] || (cd "$ROOT" && cargo build --release -p mlxcel)
pull=("$MODEL"); [[ -n "$QBITS" ]] && pull+=(--q-bits "$QBITS")
DIR="$("$MLXCEL" pull "${pull[@]}")"
CPU="$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ //')"
FAMILY="$(grep -m1 'cpu family' /proc/cpuinfo | cut -d: -f2 | tr -d ' ')"
CPU_MODEL="$(grep -m1 '^model\s' /proc/cpuinfo | cut -d: -f2 | tr -d ' ')"
TMP="$(mktemp -d)"; trap 'rm -rf "$TMP"' EXIT
echo "models.sh: $MODEL ($DIR) vs llama.cpp on $(basename "$GGUF"); $CPU (family $FAMILY model $CPU_MODEL), $THREADS threads"
echo "prompt $PROMPT tokens, generate $GEN, median of $REPEAT runs per round, $ROUNDS rounds"
for r in $(seq 1 "$ROUNDS"); do
    MLXCEL_NUM_THREADS="$THREADS" "$MLXCEL" bench --model "$DIR" --prompt-tokens "$PROMPT" --gen-tokens "$GEN" \
        --repeat "$REPEAT" --json > "$TMP/mlxcel.$r.json" 2> "$TMP/mlxcel.$r.log"
    "$PY" "$ROOT/benches/peers.py" llama --model "$GGUF" --prompt-file "$ROOT/benches/prompt.txt" \
        --prompt-tokens "$PROMPT" --gen-tokens "$GEN" --repeat "$REPEAT" --threads "$THREADS" \
        > "$TMP/llama.$r.json" 2> "$TMP/llama.$r.log"
done
python3 - "$TMP" "$ROUNDS" "$MODEL" "${QBITS:-as converted}" "$CPU (family $FAMILY model $CPU_MODEL)" "$PROMPT" "$GEN" "$THREADS" "$OUT" <<'PY'
import json, sys, statistics
tmp, rounds, model, qbits, cpu, prompt, gen, threads, out = sys.argv[1:]
rows = []
for r in range(1, int(rounds) + 1):
    m = json.load(open(f"{tmp}/mlxcel.{r}.json"))
    l = json.load(open(f"{tmp}/llama.{r}.json"))
    rows.append({"round": r, "mlxcel_prompt_tps": m["prompt_tps"], "llama_prompt_tps": l["prompt_tps"],
                 "mlxcel_decode_tps": m["decode_tps"], "llama_decode_tps": l["decode_tps"]})
print(f"{'round':>5} {'prompt mlxcel':>14} {'llama.cpp':>10} {'ratio':>6} {'decode mlxcel':>14} {'llama.cpp':>10} {'ratio':>6}")
for x in rows:
    print(f"{x['round']:>5} {x['mlxcel_prompt_tps']:>14.1f} {x['llama_prompt_tps']:>10.1f} {x['mlxcel_prompt_tps']/x['llama_prompt_tps']:>6.2f}"
          f" {x['mlxcel_decode_tps']:>14.1f} {x['llama_decode_tps']:>10.1f} {x['mlxcel_decode_tps']/x['llama_decode_tps']:>6.2f}")
med = lambda k: statistics.median(x[k] for x in rows)
summary = {"model": model, "q_bits": qbits, "cpu": cpu, "threads": int(threads), "prompt_tokens": int(prompt),
           "gen_tokens": int(gen), "rounds": rows,
           "median_prompt_ratio": statistics.median(x["mlxcel_prompt_tps"] / x["llama_prompt_tps"] for x in rows),
           "median_decode_ratio": statistics.median(x["mlxcel_decode_tps"] / x["llama_decode_tps"] for x in rows)}
print(f"median ratios: prompt {summary['median_prompt_ratio']:.2f}x, decode {summary['median_decode_ratio']:.2f}x")
if out:
    json.dump(summary, open(out, "w"), indent=1)
PY
