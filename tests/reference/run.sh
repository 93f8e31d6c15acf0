#!/usr/bin/env bash
# Run a reference script inside tests/reference/.venv with OpenBLAS preloaded.
#
#   tests/reference/run.sh tests/reference/make_tiny_goldens.py [args...]
#
# MLX's Linux CPU wheel links a slow reference BLAS; preloading Debian's
# OpenBLAS (libopenblas0-pthread) makes f32 matmuls ~10-50x faster.
# Override the library with MLXCEL_OPENBLAS=/path/libopenblas.so.0, or set
# MLXCEL_OPENBLAS=none to run without it.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
bash "$HERE/setup_venv.sh" >&2

lib="${MLXCEL_OPENBLAS:-}"
if [[ -z "$lib" ]]; then
    for cand in \
        /usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \
        /usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0 \
        /usr/lib/x86_64-linux-gnu/openblas*-pthread/libopenblas.so.0 \
        /usr/lib/x86_64-linux-gnu/libopenblas.so.0 \
        /usr/lib/aarch64-linux-gnu/libopenblas.so.0; do
        if [[ -e "$cand" ]]; then lib="$cand"; break; fi
    done
fi
if [[ "$lib" != "none" ]]; then
    if [[ -z "$lib" || ! -e "$lib" ]]; then
        echo "run.sh: libopenblas.so.0 not found (apt-get install libopenblas0-pthread)," \
             "running with MLX's bundled BLAS (slow)" >&2
    else
        export LD_PRELOAD="$lib${LD_PRELOAD:+:$LD_PRELOAD}"
    fi
fi
exec "$HERE/.venv/bin/python" "$@"
