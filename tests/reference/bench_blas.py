"""Time a float32 matmul: compare `run.sh bench_blas.py` with MLXCEL_OPENBLAS=none."""
import os, time
import mlx.core as mx

n = int(os.environ.get("N", "1024"))
a = mx.random.normal((n, n), key=mx.random.key(0))
b = mx.random.normal((n, n), key=mx.random.key(1))
mx.eval(mx.matmul(a, b))
reps = 5
t = time.perf_counter()
for _ in range(reps):
    mx.eval(mx.matmul(a, b))
dt = (time.perf_counter() - t) / reps
print(f"LD_PRELOAD={os.environ.get('LD_PRELOAD', '')!r} n={n} "
      f"{dt * 1e3:.1f} ms/matmul  {2 * n**3 / dt / 1e9:.1f} GFLOP/s")
