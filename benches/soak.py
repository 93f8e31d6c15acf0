#!/usr/bin/env python3
"""Soak test of `import mlxcel`: many requests on one model, some streamed to
the end, some abandoned after their first chunk, some closed (cancelled),
with the process's RSS and thread count at checkpoints. Memory and threads
must plateau: the report's `rss_growth_last_half_mib` compares the last
checkpoint with the one at half way.

Usage: bindings/python/.venv/bin/python benches/soak.py [--requests 5000] [--every 500] [--out FILE]
(the venv that bindings/python/test.sh creates, with mlxcel installed)
"""
import argparse
import json
import time

import mlxcel


def status(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1])
    return 0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=5000)
    ap.add_argument("--every", type=int, default=500)
    ap.add_argument("--out")
    args = ap.parse_args()
    model = mlxcel.load(progress=False)
    prompts = ["The capital of France is", "def add(a, b):", "Once upon a time", "Water boils at"]
    checkpoints = []
    start = time.monotonic()
    for i in range(1, args.requests + 1):
        prompt = prompts[i % len(prompts)] + f" ({i})"
        kind = i % 4
        if kind == 0:
            model.generate(prompt, max_tokens=4)
        elif kind == 1:
            "".join(c.text for c in model.stream(prompt, max_tokens=4))
        elif kind == 2:
            next(iter(model.stream(prompt, max_tokens=64)))  # abandoned: dropped mid-generation
        else:
            s = model.stream(prompt, max_tokens=64)
            next(iter(s))
            s.close()  # cancelled
        if i % args.every == 0:
            point = {"requests": i, "rss_mib": status("VmRSS:") / 1024, "threads": status("Threads:"),
                     "seconds": time.monotonic() - start}
            checkpoints.append(point)
            print(json.dumps(point), flush=True)
    half = checkpoints[len(checkpoints) // 2 - 1] if len(checkpoints) > 1 else checkpoints[0]
    report = {"binding": "python", "requests": args.requests, "checkpoints": checkpoints,
              "rss_growth_last_half_mib": checkpoints[-1]["rss_mib"] - half["rss_mib"],
              "threads_first_last": [checkpoints[0]["threads"], checkpoints[-1]["threads"]]}
    print(json.dumps({k: v for k, v in report.items() if k != "checkpoints"}))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
