#!/usr/bin/env bash
# Sentence embeddings, mlxcel against mlx-embeddings 0.1.0 side by side on
# all-MiniLM-L6-v2: the same texts (sentences of benches/prompt.txt, 4 to 60
# words, cycled to --texts), the same batches (--batch-size), the same threads,
# R interleaved rounds. mlxcel: `mlxcel embed --batch-size B` (its own timer,
# load excluded: the median of --repeat runs). mlx-embeddings: benches/embeddings.py
# in tests/reference/.venv (the stock mlx-cpu wheel with Debian's OpenBLAS
# preloaded, its fastest CPU setup here), load excluded, one warm-up pass.
#
# Usage: benches/embeddings.sh [--texts N] [--batch-size B] [--repeat N] [--rounds R]
#            [--threads T] [--out FILE]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TEXTS=256 BATCH=32 REPEAT=3 ROUNDS=2 THREADS=2 OUT=""
while [[ $# -gt 0 ]]; do
    case "$1" in
        --texts) TEXTS="$2"; shift 2 ;;
        --batch-size) BATCH="$2"; shift 2 ;;
        --repeat) REPEAT="$2"; shift 2 ;;
        --rounds) ROUNDS="$2"; shift 2 ;;
        --threads) THREADS="$2"; shift 2 ;;
        --out) OUT="$2"; shift 2 ;;
        -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "embeddings.sh: unknown option $1" >&2; exit 2 ;;
    esac
done
MLXCEL="$ROOT/target/release/mlxcel"
[[ -x "$MLXCEL" ]] || (cd "$ROOT" && cargo build --release -p mlxcel)
MODEL_DIR="$("$MLXCEL" pull all-MiniLM-L6-v2)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
python3 - "$ROOT/benches/prompt.txt" "$TEXTS" > "$work/texts.txt" <<'PY'
import re, sys
words = open(sys.argv[1], encoding="utf-8").read().split()
texts, i, n = [], 0, 4
while len(texts) < int(sys.argv[2]):
    texts.append(" ".join(words[i:i + n]))
    i = (i + n) % (len(words) - 60)
    n = 4 + (n * 7 + 3) % 57
print("\n".join(texts))
PY
export MLXCEL_NUM_THREADS="$THREADS" OMP_NUM_THREADS="$THREADS" OPENBLAS_NUM_THREADS="$THREADS"
cpu="$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ //')"
results=()
for round in $(seq "$ROUNDS"); do
    best=()
    for _ in $(seq "$REPEAT"); do
        line="$("$MLXCEL" embed --model "$MODEL_DIR" --batch-size "$BATCH" < "$work/texts.txt" 2>&1 >/dev/null | grep '^embedded')"
        best+=("$(sed -E 's/.* in ([0-9.]+) s.*/\1/' <<<"$line")")
    done
    seconds="$(printf '%s\n' "${best[@]}" | sort -n | sed -n "$(( (REPEAT + 1) / 2 ))p")"
    results+=("{\"round\": $round, \"engine\": \"mlxcel\", \"seconds\": $seconds}")
    peer="$("$ROOT/tests/reference/run.sh" "$ROOT/benches/embeddings.py" "$MODEL_DIR" "$work/texts.txt" "$BATCH" "$REPEAT" 2>/dev/null | tail -1)"
    results+=("$(python3 -c 'import json,sys; d=json.loads(sys.argv[1]); print(json.dumps({"round": int(sys.argv[2]), "engine": d["engine"], "seconds": d["seconds"], "tokens": d["tokens"]}))' "$peer" "$round")")
done
summary="$(printf '%s\n' "${results[@]}" | python3 -c '
import json, statistics, sys
rows = [json.loads(l) for l in sys.stdin]
texts, batch, threads, cpu = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
tokens = next(r["tokens"] for r in rows if "tokens" in r)
out = {"cpu": cpu, "threads": int(threads), "texts": texts, "tokens": tokens, "batch_size": int(batch)}
for engine in ("mlxcel", "mlx-embeddings"):
    s = statistics.median(r["seconds"] for r in rows if r["engine"] == engine)
    out[engine] = {"seconds": round(s, 4), "texts_per_second": round(texts / s, 1), "tokens_per_second": round(tokens / s)}
out["ratio"] = round(out["mlxcel"]["texts_per_second"] / out["mlx-embeddings"]["texts_per_second"], 2)
print(json.dumps(out, indent=1))
' "$TEXTS" "$BATCH" "$THREADS" "$cpu")"
echo "$summary"
[[ -z "$OUT" ]] || echo "$summary" > "$OUT"
