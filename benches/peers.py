"""Helpers for benches/peers.sh: one engine configuration per process.

Subcommands (each prints one JSON object on stdout; progress and llama.cpp's
own perf printouts go to stderr):

  llama     time llama.cpp (llama-cpp-python's low-level API) on a GGUF file:
            prompt processing and/or decode, read from llama.cpp's perf
            counters (llama_perf_context), median of --repeat runs
  quantize  write a requantized GGUF with llama_model_quantize
  mlxlm     time mlx-lm's stream_generate (its own prompt_tps/generation_tps)
  report    print the side-by-side table and ratios, write the JSON file
            (standard library only)

The prompt is --prompt-file (benches/prompt.txt) tokenized once with the
engine's own tokenizer, no special tokens, the ids repeated as needed and cut
to exactly --prompt-tokens ids, as `mlxcel bench` does.
"""

import argparse
import json
import os
import statistics
import sys
import time


def log(*args):
    print("peers.py:", *args, file=sys.stderr, flush=True)


def cycle_to(ids, n):
    if not ids:
        raise SystemExit("peers.py: the prompt file tokenizes to no tokens")
    return [ids[i % len(ids)] for i in range(n)]


def median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


# --------------------------------------------------------------------------
# llama.cpp
# --------------------------------------------------------------------------

def llama_cmd(args):
    import ctypes

    import numpy as np
    import llama_cpp as L

    L.llama_backend_init()
    mparams = L.llama_model_default_params()
    model = L.llama_model_load_from_file(args.model.encode(), mparams)
    if not model:
        raise SystemExit(f"peers.py: llama.cpp could not load {args.model}")
    vocab = L.llama_model_get_vocab(model)
    n_vocab = L.llama_vocab_n_tokens(vocab)

    text = open(args.prompt_file, "rb").read()
    buf = (L.llama_token * (len(text) + 16))()
    n = L.llama_tokenize(vocab, text, len(text), buf, len(buf), False, False)
    if n < 0:
        raise SystemExit(f"peers.py: llama_tokenize needs {-n} tokens")
    ids = cycle_to(list(buf[:n]), args.prompt_tokens)

    cparams = L.llama_context_default_params()
    # Room for the prompt, the generated tokens and the warm-up.
    cparams.n_ctx = args.prompt_tokens + args.gen_tokens + 64
    cparams.n_batch = args.batch
    cparams.n_ubatch = args.batch
    cparams.n_seq_max = 1
    cparams.n_threads = args.threads
    cparams.n_threads_batch = args.threads
    cparams.no_perf = False
    ctx = L.llama_init_from_model(model, cparams)
    if not ctx:
        raise SystemExit("peers.py: llama_init_from_model failed")
    mem = L.llama_get_memory(ctx)
    try:
        fa = L.llama_flash_attn_type_name(cparams.flash_attn_type).decode()
    except Exception:  # older bindings
        fa = str(cparams.flash_attn_type)

    def decode(tokens):
        arr = (L.llama_token * len(tokens))(*tokens)
        rc = L.llama_decode(ctx, L.llama_batch_get_one(arr, len(tokens)))
        if rc != 0:
            raise SystemExit(f"peers.py: llama_decode returned {rc}")
        L.llama_synchronize(ctx)

    def argmax_last():
        ptr = L.llama_get_logits_ith(ctx, -1)
        return int(np.ctypeslib.as_array(ptr, shape=(n_vocab,)).argmax())

    def feed_prompt(tokens):
        if args.mode == "decode":
            # One token per llama_decode call: never a batched matmul (the
            # native build's AMX path crashes on those here).
            for t in tokens:
                decode([t])
        else:
            for i in range(0, len(tokens), args.batch):
                decode(tokens[i:i + args.batch])

    def perf():
        return L.llama_perf_context(ctx)

    def one_run(prompt, gen, label):
        """Prompt, then gen tokens greedily (EOS ignored): gen - 1 decode calls."""
        L.llama_memory_clear(mem, True)
        L.llama_perf_context_reset(ctx)
        feed_prompt(prompt)
        # llama_perf_context reports n_p_eval and n_eval as at least 1 each,
        # so count the tokens here; the times are exact (batches of several
        # tokens add to t_p_eval, single tokens to t_eval).
        p = perf()
        prompt_ms = p.t_p_eval_ms + p.t_eval_ms
        prompt_n = len(prompt)
        if args.verbose:
            print(f"--- {label}: prompt ({len(prompt)} tokens)", file=sys.stderr, flush=True)
            L.llama_perf_context_print(ctx)
        token = argmax_last()
        L.llama_perf_context_reset(ctx)
        for _ in range(gen - 1):
            decode([token])
            token = argmax_last()
        d = perf()
        if args.verbose:
            print(f"--- {label}: decode ({gen - 1} tokens)", file=sys.stderr, flush=True)
            L.llama_perf_context_print(ctx)
        if d.n_eval != gen - 1 or d.t_p_eval_ms != 0:
            raise SystemExit(f"peers.py: unexpected perf counters after decode: n_eval {d.n_eval}, "
                             f"t_p_eval {d.t_p_eval_ms} ms (want {gen - 1} single-token evals)")
        run = {
            "prompt_ms": prompt_ms,
            "prompt_n": prompt_n,
            "decode_ms": d.t_eval_ms,
            "decode_n": gen - 1,
            "decode_tps": 1000.0 * (gen - 1) / d.t_eval_ms if d.t_eval_ms > 0 else None,
        }
        if args.mode == "full":
            run["prompt_tps"] = 1000.0 * prompt_n / prompt_ms if prompt_ms > 0 else None
        return run

    log(f"llama.cpp {args.label}: warm-up")
    one_run(ids[:16], 4, "warm-up")
    runs = []
    for i in range(1, args.repeat + 1):
        run = one_run(ids, args.gen_tokens, f"run {i}/{args.repeat}")
        log(f"llama.cpp {args.label}: run {i}/{args.repeat}: prompt "
            + (f"{run['prompt_tps']:.1f} tok/s" if run.get("prompt_tps") else "n/a (fed one token at a time)")
            + f", decode {run['decode_tps']:.1f} tok/s")
        runs.append(run)

    out = {
        "engine": "llama.cpp",
        "label": args.label,
        "model": args.model,
        "mode": args.mode,
        "prompt_tokens": len(ids),
        "gen_tokens": args.gen_tokens,
        "repeat": args.repeat,
        "threads": args.threads,
        "n_batch": args.batch,
        "n_ubatch": args.batch,
        "flash_attn": fa,
        "prompt_tps": median(r.get("prompt_tps") for r in runs) if args.mode == "full" else None,
        "decode_tps": median(r["decode_tps"] for r in runs),
        "llama_cpp_python": getattr(L, "__version__", None) or _version("llama_cpp_python"),
        "peak_rss_bytes": _peak_rss_bytes(),
        "system_info": L.llama_print_system_info().decode(errors="replace").strip(),
        "runs": runs,
    }
    print(json.dumps(out), flush=True)
    sys.stdout.flush()
    # Skip teardown: nothing to gain, and it keeps a crash in the free path
    # from turning a finished measurement into a failure.
    os._exit(0)


def _peak_rss_bytes():
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kilobytes on Linux


def _version(dist):
    try:
        import importlib.metadata as md
        return md.version(dist)
    except Exception:
        return None


def quantize_cmd(args):
    import llama_cpp as L

    ftypes = {"q8_0": L.LLAMA_FTYPE_MOSTLY_Q8_0, "q4_0": L.LLAMA_FTYPE_MOSTLY_Q4_0,
              "q4_1": L.LLAMA_FTYPE_MOSTLY_Q4_1}
    L.llama_backend_init()
    params = L.llama_model_quantize_default_params()
    params.ftype = ftypes[args.ftype]
    params.nthread = args.threads
    params.allow_requantize = True
    tmp = args.dst + f".tmp{os.getpid()}"
    start = time.perf_counter()
    rc = L.llama_model_quantize(args.src.encode(), tmp.encode(), params)
    if rc != 0:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise SystemExit(f"peers.py: llama_model_quantize returned {rc}")
    os.replace(tmp, args.dst)
    print(json.dumps({"dst": args.dst, "ftype": args.ftype, "bytes": os.path.getsize(args.dst),
                      "seconds": round(time.perf_counter() - start, 1)}))


# --------------------------------------------------------------------------
# mlx-lm
# --------------------------------------------------------------------------

def mlxlm_cmd(args):
    import importlib.metadata as md

    import mlx.core as mx
    from mlx_lm import load, stream_generate

    model, tokenizer = load(args.model)
    text = open(args.prompt_file, encoding="utf-8").read()
    ids = cycle_to(tokenizer.encode(text, add_special_tokens=False), args.prompt_tokens)
    eos = sorted(set(getattr(tokenizer, "eos_token_ids", None) or [tokenizer.eos_token_id]))

    def no_eos(tokens, logits):
        # Greedy decoding that never stops early: every run generates exactly --gen-tokens.
        logits[..., eos] = -float("inf")
        return logits

    def one_run(prompt, gen):
        last = None
        count = 0
        for last in stream_generate(model, tokenizer, prompt, max_tokens=gen, logits_processors=[no_eos]):
            count += 1
        return {"prompt_tokens": last.prompt_tokens, "prompt_tps": last.prompt_tps,
                "generation_tokens": last.generation_tokens, "decode_tps": last.generation_tps,
                "peak_memory_bytes": int(last.peak_memory * 1e9)}

    log("mlx-lm: warm-up")
    one_run(ids[:8], 2)
    runs = []
    for i in range(1, args.repeat + 1):
        run = one_run(ids, args.gen_tokens)
        log(f"mlx-lm: run {i}/{args.repeat}: prompt {run['prompt_tps']:.2f} tok/s, decode {run['decode_tps']:.2f} tok/s")
        runs.append(run)
    print(json.dumps({
        "engine": "mlx-lm",
        "model": args.model,
        "prompt_tokens": len(ids),
        "gen_tokens": args.gen_tokens,
        "repeat": args.repeat,
        "prompt_tps": median(r["prompt_tps"] for r in runs),
        "decode_tps": median(r["decode_tps"] for r in runs),
        "peak_memory_bytes": max(r["peak_memory_bytes"] for r in runs),
        "mlx": mx.__version__,
        "mlx_lm": md.version("mlx-lm"),
        "runs": runs,
    }))


# --------------------------------------------------------------------------
# report
# --------------------------------------------------------------------------

# Row key, label, and which result file (in --results-dir) it comes from.
ROWS = [
    ("mlxcel_q4", "mlxcel q4 (4-bit, g32)"),
    ("llama_portable_q4_1", "llama.cpp portable Q4_1"),
    ("llama_native_q4_1", "llama.cpp native Q4_1"),
    ("mlxcel_q8", "mlxcel q8 (8-bit, g32)"),
    ("llama_portable_q8_0", "llama.cpp portable Q8_0"),
    ("llama_native_q8_0", "llama.cpp native Q8_0"),
    ("mlx_lm_q4", "mlx-lm q4 (stock wheel)"),
]


def _num(x):
    return x if isinstance(x, (int, float)) and not isinstance(x, bool) and x == x and x > 0 else None


def _ratio(a, b):
    a, b = _num(a), _num(b)
    return a / b if a is not None and b is not None else None


def _best(**named):
    """(value, name) of the largest valid value, or (None, None)."""
    valid = [(v, k) for k, v in named.items() if _num(v) is not None]
    return max(valid) if valid else (None, None)


def load_results(results_dir):
    rows = {}
    for key, _ in ROWS:
        path = os.path.join(results_dir, key + ".json")
        note_path = os.path.join(results_dir, key + ".note")
        entry = {"status": "not run"}
        if os.path.exists(path):
            try:
                with open(path, encoding="utf-8") as f:
                    entry = parse_json_output(f.read())
                entry["status"] = "ok"
            except ValueError as e:
                entry = {"status": f"unparsable output ({e})"}
        if os.path.exists(note_path):
            with open(note_path, encoding="utf-8") as f:
                note = f.read().strip()
            if note:
                if entry.get("status") == "ok":
                    entry["note"] = note
                else:
                    entry["status"] = note
        load_path = os.path.join(results_dir, key + ".load")
        if os.path.exists(load_path):
            with open(load_path, encoding="utf-8") as f:
                try:
                    entry["loadavg_1min_at_start"] = float(f.read().strip())
                except ValueError:
                    pass
        rows[key] = entry
    return rows


def parse_json_output(text):
    """The last line of `text` that parses as a JSON object."""
    for line in reversed(text.strip().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(obj, dict):
                return obj
    raise ValueError("no JSON object in the output")


def parse_mlxcel_cmd(args):
    """Checks `mlxcel bench --json` output has the fields the report reads."""
    obj = parse_json_output(open(args.file, encoding="utf-8").read())
    # `process_peak_mlx_bytes` is the name since 2026-11; older binaries print `peak_mlx_bytes`.
    if "peak_mlx_bytes" not in obj and "process_peak_mlx_bytes" in obj:
        obj["peak_mlx_bytes"] = obj["process_peak_mlx_bytes"]
    missing = [k for k in ("prompt_tps", "decode_tps", "ttft_s", "peak_rss_bytes", "peak_mlx_bytes") if k not in obj]
    if missing:
        raise SystemExit(f"peers.py: mlxcel bench JSON lacks {', '.join(missing)}")
    print(json.dumps(obj))


def fmt(x, width=10, digits=1):
    x = _num(x)
    return f"{x:>{width}.{digits}f}" if x is not None else f"{'n/a':>{width}}"


def best_of_runs(entry, field):
    """The largest per-run value of field (the least disturbed run on a busy machine)."""
    values = [_num(run.get(field)) for run in entry.get("runs") or [] if isinstance(run, dict)]
    values = [v for v in values if v is not None]
    return max(values) if values else None


def fmt_pair(median_value, best_value, width=17):
    if _num(median_value) is None:
        return f"{'n/a':>{width}}"
    text = f"{median_value:.1f}"
    if _num(best_value) is not None:
        text += f" ({best_value:.1f})"
    return f"{text:>{width}}"


def fmt_mib(x):
    x = _num(x)
    return f"{x / 2**20:>9.1f}" if x is not None else f"{'':>9}"


def report_cmd(args):
    meta = json.loads(args.meta)
    rows = load_results(args.results_dir)
    r = {k: rows[k] for k, _ in ROWS}
    P, G = meta["prompt_tokens"], meta["gen_tokens"]

    lines = []
    for key, _ in ROWS:
        if r[key].get("status") == "ok":
            r[key]["best_prompt_tps"] = best_of_runs(r[key], "prompt_tps")
            r[key]["best_decode_tps"] = best_of_runs(r[key], "decode_tps")
    lines.append("tok/s: median of the runs (best run in parentheses)")
    lines.append(f"{'engine / configuration':<32} {'prompt tok/s':>17} {'decode tok/s':>17} {'tokens P/G':>11} {'peak MiB':>9} {'load':>5}  notes")
    lines.append("-" * 120)
    avx2_only = meta.get("llama_cpp_native_kind") == "avx2"
    if avx2_only:
        lines.insert(0, f"AVX2 only: mlxcel with {meta.get('mlxcel_env')}; the llama.cpp rows built with "
                        f"{meta.get('llama_cpp_native_cmake_args')}")
    for key, label in ROWS:
        e = r[key]
        if avx2_only:
            label = label.replace("llama.cpp native", "llama.cpp AVX2").replace("mlxcel q", "mlxcel AVX2 q")
        load = e.get("loadavg_1min_at_start")
        load_s = f"{load:>5.1f}" if isinstance(load, float) else f"{'':>5}"
        if e.get("status") != "ok":
            lines.append(f"{label:<32} {'n/a':>17} {'n/a':>17} {'':>11} {'':>9} {load_s}  {e.get('status')}")
            continue
        toks = f"{e.get('prompt_tokens', P)}/{e.get('gen_tokens', G)}"
        peak = e.get("peak_rss_bytes") or e.get("peak_memory_bytes")
        notes = []
        if key.startswith("mlxcel"):
            notes.append("peak = RSS" + (f"; MLX {e['peak_mlx_bytes'] / 2**20:.1f} MiB" if _num(e.get("peak_mlx_bytes")) else ""))
            if _num(e.get("ttft_s")):
                notes.append(f"TTFT {e['ttft_s']:.3f} s")
            if e.get("kernel_threads") is not None:
                notes.append(f"{e['kernel_threads']} kernel threads, {e.get('blas_threads', '?')} {e.get('blas', '')} threads")
        elif key.startswith("llama_native") and e.get("mode") == "decode":
            notes.append("peak = RSS; decode only (prompt fed one token at a time)")
        elif key.startswith("llama"):
            notes.append("peak = RSS")
        elif key == "mlx_lm_q4":
            notes.append("peak = MLX; its own token counts")
        if e.get("note"):
            notes.append(e["note"])
        lines.append(f"{label:<32} {fmt_pair(e.get('prompt_tps'), e.get('best_prompt_tps'))} "
                     f"{fmt_pair(e.get('decode_tps'), e.get('best_decode_tps'))} {toks:>11} {fmt_mib(peak)} {load_s}  {'; '.join(notes)}")

    def ratio_rows(prefix):
        get = lambda key, field: r[key].get(prefix + field) if r[key].get("status") == "ok" else None
        best_q4_decode, best_q4 = _best(portable=get("llama_portable_q4_1", "decode_tps"),
                                        native=get("llama_native_q4_1", "decode_tps"))
        best_q8_decode, best_q8 = _best(portable=get("llama_portable_q8_0", "decode_tps"),
                                        native=get("llama_native_q8_0", "decode_tps"))
        best_q4_prompt, best_q4p = _best(portable=get("llama_portable_q4_1", "prompt_tps"),
                                         native=get("llama_native_q4_1", "prompt_tps"))
        best_q8_prompt, best_q8p = _best(portable=get("llama_portable_q8_0", "prompt_tps"),
                                         native=get("llama_native_q8_0", "prompt_tps"))
        # The goals of issue 9: decode >= 1.2x, prompt >= 1.5x at 512 tokens
        # and >= 1.0x for 16-64-token prompts.
        prompt_goal = 1.5 if P >= 512 else 1.0 if P <= 64 else None
        return [
            ("mlxcel q4 decode / best llama.cpp Q4_1 decode", best_q4,
             _ratio(get("mlxcel_q4", "decode_tps"), best_q4_decode), 1.2),
            (f"mlxcel q4 prompt({P}) / best llama.cpp Q4_1 prompt({P})", best_q4p,
             _ratio(get("mlxcel_q4", "prompt_tps"), best_q4_prompt), prompt_goal),
            ("mlxcel q8 decode / best llama.cpp Q8_0 decode", best_q8,
             _ratio(get("mlxcel_q8", "decode_tps"), best_q8_decode), 1.2),
            (f"mlxcel q8 prompt({P}) / best llama.cpp Q8_0 prompt({P})", best_q8p,
             _ratio(get("mlxcel_q8", "prompt_tps"), best_q8_prompt), prompt_goal),
            ("mlxcel q4 decode / mlx-lm q4 decode", None,
             _ratio(get("mlxcel_q4", "decode_tps"), get("mlx_lm_q4", "decode_tps")), None),
            ("mlxcel q4 prompt / mlx-lm q4 prompt (different lengths)", None,
             _ratio(get("mlxcel_q4", "prompt_tps"), get("mlx_lm_q4", "prompt_tps")), None),
        ]

    lines.append("")
    lines.append(f"{'ratio (goal on the medians)':<58} {'medians':>14}  {'best runs':>14}  {'goal':>6}  verdict")
    lines.append("-" * 110)
    ratio_json = []
    for (name, which, value, goal), (_, which_best, value_best, _) in zip(ratio_rows(""), ratio_rows("best_")):
        verdict = "" if goal is None or value is None else ("met" if value >= goal else "NOT met")
        goal_s = f">= {goal:g}" if goal is not None else ""
        # In an --avx2-only run the "native" rows are the AVX2 build.
        label_of = lambda w: "avx2" if avx2_only and w == "native" else w
        show = lambda v, w: (f"{v:.2f}x" + (f" ({label_of(w)})" if w else "")) if v is not None else "n/a"
        lines.append(f"{name:<58} {show(value, which):>14}  {show(value_best, which_best):>14}  {goal_s:>6}  {verdict}")
        ratio_json.append({"name": name, "value": value, "against": which, "goal": goal,
                           "met": None if goal is None or value is None else value >= goal,
                           "value_best_runs": value_best, "against_best_runs": which_best})
    lines.append("")
    lines.append("load: the 1-minute load average when the configuration started; on this "
                 f"{meta.get('machine', {}).get('cpus', '?')}-CPU machine anything above about 1 means other "
                 "work shared the cores and the figures are low (llama.cpp's decode most of all).")
    measured = [key for key, _ in ROWS if isinstance(r[key].get("loadavg_1min_at_start"), float)]
    busy = [key for key in measured if r[key]["loadavg_1min_at_start"] >= 1.0]
    if busy:
        lines.append(f"WARNING: {len(busy)} of {len(measured)} configurations started on a busy machine (load >= 1.0); "
                     "the ratios above are not trustworthy. Re-run on a quiet machine or with --wait-quiet.")
    if "PASSIVE" in str(meta.get("llama_cpp_omp_wait_policy", "")):
        lines.append("llama.cpp ran with OMP_WAIT_POLICY=PASSIVE (--omp-passive).")
    print("\n".join(lines))

    out = dict(meta)
    out["results"] = r
    out["ratios"] = ratio_json
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    tmp = args.out + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(out, f, indent=2)
        f.write("\n")
    os.replace(tmp, args.out)
    print(f"\nresults written to {args.out}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)

    a = sub.add_parser("llama")
    a.add_argument("--model", required=True)
    a.add_argument("--label", default="")
    a.add_argument("--prompt-file", required=True)
    a.add_argument("--prompt-tokens", type=int, default=512)
    a.add_argument("--gen-tokens", type=int, default=128)
    a.add_argument("--repeat", type=int, default=3)
    a.add_argument("--threads", type=int, default=2)
    a.add_argument("--batch", type=int, default=512)
    a.add_argument("--mode", choices=["full", "decode"], default="full")
    a.add_argument("--verbose", action="store_true", help="llama_perf_context_print after each phase")
    a.set_defaults(fn=llama_cmd)

    q = sub.add_parser("quantize")
    q.add_argument("--src", required=True)
    q.add_argument("--dst", required=True)
    q.add_argument("--ftype", default="q8_0", choices=["q8_0", "q4_0", "q4_1"])
    q.add_argument("--threads", type=int, default=2)
    q.set_defaults(fn=quantize_cmd)

    m = sub.add_parser("mlxlm")
    m.add_argument("--model", required=True)
    m.add_argument("--prompt-file", required=True)
    m.add_argument("--prompt-tokens", type=int, default=64)
    m.add_argument("--gen-tokens", type=int, default=16)
    m.add_argument("--repeat", type=int, default=3)
    m.set_defaults(fn=mlxlm_cmd)

    p = sub.add_parser("parse-mlxcel")
    p.add_argument("file")
    p.set_defaults(fn=parse_mlxcel_cmd)

    r = sub.add_parser("report")
    r.add_argument("--results-dir", required=True)
    r.add_argument("--meta", required=True, help="JSON object: machine and parameters")
    r.add_argument("--out", required=True)
    r.set_defaults(fn=report_cmd)

    args = ap.parse_args()
    for name in ("gen_tokens",):
        if getattr(args, name, 2) < 2:
            raise SystemExit("peers.py: --gen-tokens must be at least 2")
    args.fn(args)


if __name__ == "__main__":
    main()
