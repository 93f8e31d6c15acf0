#!/usr/bin/env bash
# Whisper real-time factor, mlxcel against faster-whisper 1.2.1 (CTranslate2
# 4.8.5, float32 and int8) side by side, on the same CTranslate2 weights and
# clips, 2 threads, R interleaved rounds. The input is the 2-minute clip
# (tests/fixtures/audio/en_news_2min.flac, 5 windows of 30 s) or, with --all,
# every clip of tests/fixtures/audio one after another. Both sides time what a
# transcription does (decoding the file, features, encoder, decoder; model
# loading excluded) with the same greedy settings (faster-whisper beam_size=1,
# its defaults otherwise; mlxcel's defaults are the same). mlxcel's time is
# its own `mlxcel transcribe` report; faster-whisper's is
# benches/whisper_peers.py (one warm-up pass, then one timed pass per round).
# RTF = wall seconds / audio seconds (lower is faster); the ratio is
# faster-whisper's RTF over mlxcel's (above 1: mlxcel is faster).
#
# Usage: benches/whisper.sh [--model tiny.en|base] [--rounds R] [--all] [--out FILE]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
MODEL=tiny.en ROUNDS=3 ALL=0 OUT=""
while [[ $# -gt 0 ]]; do
    case "$1" in
        --model) MODEL="$2"; shift 2 ;;
        --rounds) ROUNDS="$2"; shift 2 ;;
        --all) ALL=1; shift ;;
        --out) OUT="$2"; shift 2 ;;
        -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "whisper.sh: unknown option $1" >&2; exit 2 ;;
    esac
done
MLXCEL="$ROOT/target/release/mlxcel"
[[ -x "$MLXCEL" ]] || (cd "$ROOT" && cargo build --release -p mlxcel)
"$MLXCEL" pull "whisper-$MODEL" >/dev/null
bash "$ROOT/tests/reference/fetch_whisper_ct2.sh" >/dev/null
if [[ "$ALL" == 1 ]]; then
    mapfile -t FILES < <(ls "$ROOT"/tests/fixtures/audio/*.{flac,wav,mp3} | sort)
    PEER_INPUT=()
else
    FILES=("$ROOT/tests/fixtures/audio/en_news_2min.flac")
    PEER_INPUT=(--only-long)
fi
cpu="$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//')"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
for round in $(seq "$ROUNDS"); do
    "$MLXCEL" transcribe --model "whisper-$MODEL" "${FILES[@]}" 2>&1 >/dev/null \
        | sed -n 's/^transcribed \([0-9.]*\) s of audio in \([0-9.]*\) s.*/\1 \2/p' >> "$work/mlxcel"
    for ct in float32 int8; do
        "$ROOT/tests/reference/run.sh" "$ROOT/benches/whisper_peers.py" --model "$MODEL" --compute-type "$ct" \
            --repeat 1 "${PEER_INPUT[@]}" 2>/dev/null | tail -n1 \
            | python3 -c 'import json,sys; r=json.loads(sys.stdin.read()); print(r["audio_seconds"], r["wall_seconds"])' >> "$work/fw-$ct"
    done
    echo "whisper.sh: round $round of $ROUNDS done" >&2
done
python3 - "$work" "$MODEL" "$cpu" "$ROUNDS" "$ALL" <<'PY' | tee ${OUT:+"$OUT"}
import statistics, sys
work, model, cpu, rounds, all_clips = sys.argv[1:]
def load(name):
    rows = [tuple(map(float, l.split())) for l in open(f"{work}/{name}") if l.strip()]
    audio = rows[0][0]
    return audio, statistics.median(w for _, w in rows), [w for _, w in rows]
ours = load("mlxcel")
print(f"Whisper {model}, {'all clips' if all_clips == '1' else 'en_news_2min.flac'} ({ours[0]:.1f} s of audio), {cpu}, 2 threads, median of {rounds} interleaved rounds\n")
print("| engine | wall s (median) | RTF | faster-whisper RTF / this RTF |")
print("|---|---|---|---|")
print(f"| mlxcel (float16 weights, float32 compute) | {ours[1]:.2f} | {ours[1] / ours[0]:.4f} | |")
for ct in ("float32", "int8"):
    fw = load(f"fw-{ct}")
    print(f"| faster-whisper {ct} | {fw[1]:.2f} | {fw[1] / fw[0]:.4f} | mlxcel is {fw[1] / ours[1]:.2f}x as fast |")
PY
