"""OpenBLAS preloaded at import: MLX's cblas calls resolve to it."""

import glob
import os
import subprocess
import sys

import pytest

import mlxcel

HAVE_OPENBLAS = sys.platform == "linux" and bool(
    glob.glob("/usr/lib/*-linux-gnu/libopenblas.so.0") + glob.glob("/usr/lib*/libopenblas.so.0")
)

MATMUL = "import mlxcel; from mlxcel._mlxcel import _matmul_seconds; print(mlxcel.BLAS, _matmul_seconds(1024))"


def run(code, **env):
    out = subprocess.run(
        [sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


@pytest.mark.skipif(not HAVE_OPENBLAS, reason="no system OpenBLAS")
def test_openblas_is_preloaded():
    assert mlxcel.BLAS == "openblas"
    maps = open("/proc/self/maps").read()
    assert "libopenblas" in maps


@pytest.mark.skipif(not HAVE_OPENBLAS, reason="no system OpenBLAS")
def test_cblas_sgemm_binds_to_openblas(tmp_path):
    """The dynamic linker's own account: libmlx's cblas_sgemm goes to OpenBLAS."""
    log = tmp_path / "ld"
    run(MATMUL.replace("1024", "64"), LD_DEBUG="bindings", LD_DEBUG_OUTPUT=str(log))
    bindings = [
        line
        for path in glob.glob(f"{log}.*")
        for line in open(path, errors="replace")
        if "`cblas_sgemm'" in line and "libmlx.so" in line
    ]
    assert bindings, "libmlx never bound cblas_sgemm"
    assert all("libopenblas" in line for line in bindings), bindings


@pytest.mark.skipif(not HAVE_OPENBLAS, reason="no system OpenBLAS")
def test_openblas_matmul_is_faster_than_the_bundled_blas():
    # One OpenBLAS thread: a like-for-like comparison that other load on the
    # machine does not skew.
    blas, fast = run(MATMUL, OPENBLAS_NUM_THREADS="1")
    bundled, slow = run(MATMUL, MLXCEL_BLAS="bundled")
    assert (blas, bundled) == ("openblas", "bundled")
    print(f"1024x1024 f32 matmul: OpenBLAS (1 thread) {float(fast) * 1000:.0f} ms, bundled reference BLAS {float(slow) * 1000:.0f} ms")
    assert float(slow) > 2 * float(fast)
