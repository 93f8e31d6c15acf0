#!/usr/bin/env python3
"""Batched decode, side by side: `mlxcel bench --batch N` against llama.cpp's
own server (`llama-server -np N -cb`) on the same SmolLM2-135M weights
(mlxcel's 4-bit default model, llama.cpp's Q4_1 GGUF that it was converted
from), the same prompt length, the same number of generated tokens, greedy,
EOS ignored, 2 threads each.

Both engines get N different prompts of P tokens (benches/prompt.txt,
tokenized by each engine's own tokenizer, row r starting 37*r tokens later)
at once. Aggregate decode = generated tokens of all rows after their first,
over the wall time from the first row's first token to the last row's last.
llama-server's rows are timed client-side from their streamed tokens.

Usage: benches/batch.py --server PATH/llama-server --gguf PATH.gguf
           [--mlxcel target/release/mlxcel] [--batch 1,8] [--prompt-tokens 16]
           [--gen-tokens 128] [--threads 2] [--rounds 3] [--out results.json]
benches/batch.sh builds llama-server from the llama-cpp-python sdist and calls this.
"""
import argparse
import shlex
import json
import os
import platform
import socket
import subprocess
import sys
import threading
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))


def cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(port, path, body, stream=False):
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    return urllib.request.urlopen(req, timeout=600) if stream else json.load(urllib.request.urlopen(req, timeout=600))


def llama_server_round(port, prompts, gen):
    """All prompts at once; per row (time of first token, time of last token, tokens)."""
    rows = [None] * len(prompts)
    start = threading.Barrier(len(prompts))

    def one(i):
        body = {"prompt": prompts[i], "n_predict": gen, "temperature": 0.0, "ignore_eos": True,
                "cache_prompt": False, "stream": True, "samplers": ["top_k"], "top_k": 1}
        start.wait()
        first = last = None
        n = 0
        with post(port, "/completion", body, stream=True) as resp:
            for raw in resp:
                line = raw.decode().strip()
                if not line.startswith("data: "):
                    continue
                event = json.loads(line[6:])
                now = time.perf_counter()
                if event.get("content") or event.get("tokens"):
                    n += 1
                    first = first or now
                    last = now
                if event.get("stop"):
                    n = event.get("timings", {}).get("predicted_n", n)
                    break
        rows[i] = (first, last, n)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    first = min(r[0] for r in rows)
    last = max(r[1] for r in rows)
    decoded = sum(r[2] - 1 for r in rows)
    return decoded / (last - first)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--server", required=True)
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--mlxcel", default=os.path.join(HERE, "..", "target", "release", "mlxcel"))
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--prompt-tokens", type=int, default=16)
    ap.add_argument("--gen-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out")
    ap.add_argument("--server-args", default="",
                    help="more llama-server arguments, e.g. --no-repack (its AMX repacking crashes on some AMX CPUs)")
    args = ap.parse_args()
    batches = [int(b) for b in args.batch.split(",")]
    text = open(os.path.join(HERE, "prompt.txt")).read()
    env = dict(os.environ, MLXCEL_NUM_THREADS=str(args.threads))
    results = {"cpu": cpu_model(), "prompt_tokens": args.prompt_tokens, "gen_tokens": args.gen_tokens,
               "threads": args.threads, "server_args": args.server_args, "rounds": []}
    max_batch = max(batches)
    port = free_port()
    ctx = max_batch * (args.prompt_tokens + args.gen_tokens + 16)
    server = subprocess.Popen(
        [args.server, "-m", args.gguf, "-np", str(max_batch), "-cb", "-c", str(ctx), "-t", str(args.threads),
         "-tb", str(args.threads), "--port", str(port), "--host", "127.0.0.1", "--no-webui",
         *shlex.split(args.server_args)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(600):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except Exception:
                time.sleep(0.2)
        else:
            sys.exit("llama-server did not become healthy")
        ids = post(port, "/tokenize", {"content": text, "add_special": False})["tokens"]
        ids = (ids * (args.prompt_tokens // len(ids) + 2))
        base = ids[: args.prompt_tokens + 37 * max_batch]
        prompts = lambda n: [base[37 * r: 37 * r + args.prompt_tokens] for r in range(n)]
        llama_server_round(port, prompts(1), 8)  # warm-up
        for rnd in range(1, args.rounds + 1):
            row = {"round": rnd}
            for b in batches:
                bench = subprocess.run(
                    [args.mlxcel, "bench", "--json", "--batch", str(b), "--prompt-tokens", str(args.prompt_tokens),
                     "--gen-tokens", str(args.gen_tokens), "--repeat", "1"],
                    env=env, capture_output=True, text=True, check=True)
                ours = json.loads(bench.stdout)["aggregate_decode_tps"]
                theirs = llama_server_round(port, prompts(b), args.gen_tokens)
                row[f"batch{b}"] = {"mlxcel": ours, "llama_server": theirs, "ratio": ours / theirs}
                print(f"round {rnd}, batch {b}: mlxcel {ours:.1f} tok/s, llama-server {theirs:.1f} tok/s, "
                      f"ratio {ours / theirs:.2f}", flush=True)
            results["rounds"].append(row)
    finally:
        server.terminate()
        server.wait()
    for b in batches:
        m = sorted(r[f"batch{b}"]["mlxcel"] for r in results["rounds"])[len(results["rounds"]) // 2]
        l = sorted(r[f"batch{b}"]["llama_server"] for r in results["rounds"])[len(results["rounds"]) // 2]
        print(f"batch {b}: median mlxcel {m:.1f} tok/s, llama-server {l:.1f} tok/s")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
