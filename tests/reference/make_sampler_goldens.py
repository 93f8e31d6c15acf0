"""Golden outputs of llama.cpp's samplers, for the parity test of our chain.

    LLAMA_CPP_LIB_PATH=<dir with libllama.so> PYTHONPATH=<llama-cpp-python src> \
    tests/reference/run.sh tests/reference/make_sampler_goldens.py \
        --gguf ~/.cache/mlxcel/peers/models/SmolLM2-135M-Instruct.Q4_1.gguf \
        --out tests/reference/goldens/llama_cpp_samplers.json

Uses llama-cpp-python 0.3.36's low-level bindings (`llama_sampler_init_*`,
`llama_sampler_apply`) over the llama.cpp it vendors, built as a shared
library (benches/peers.sh and benches/batch.sh build it; any build of that
tree with BUILD_SHARED_LIBS works). The vocabulary (for DRY's sequence
breakers) is SmolLM2's, read from the GGUF with vocab_only.

Each case is a candidate array (64 distinct token ids with float32 logits:
random, with ties, with -inf entries, or one dominant token) and a history
of 96 tokens with repeats, some crossing a sequence breaker. Each
configuration runs one stage alone, or logit bias plus the whole default
chain (llama-server's order), on a fresh sampler that first accepts the
history; the JSON records the candidates it leaves, in its order, as
(id, logit). XTC runs with probability 1, so it does not depend on the
generator. The default chain runs twice: with typical-p 0.95 and
top-n-sigma off (llama-server's default), and with top-n-sigma 2 and
typical-p off: top-n-sigma leaves -inf logits in the set, and over those
llama.cpp's typical-p computes a NaN entropy and sorts by NaN (no defined
order), as it does for a candidate array given with -inf entries.
"""

import argparse
import ctypes
import json
from pathlib import Path

import numpy as np
import llama_cpp as L

BREAKERS = ["\n", ":", '"', "*"]


def tokenize(vocab, text):
    buf = (L.llama_token * 64)()
    n = L.llama_tokenize(vocab, text.encode(), len(text.encode()), buf, 64, False, False)
    return [buf[i] for i in range(n)]


def configs(n_vocab):
    one = lambda name, make, **p: {"stage": name, "params": p, "make": make}
    out = []
    for last_n, rep, freq, pres in [(64, 1.3, 0.2, 0.1), (16, 0.8, 0.0, 0.0), (96, 1.0, 0.5, 0.0)]:
        out.append(one("penalties", lambda v, a=last_n, b=rep, c=freq, d=pres: L.llama_sampler_init_penalties(n_vocab, a, b, c, d),
                       repetition_context_size=last_n, repetition_penalty=rep, frequency_penalty=freq, presence_penalty=pres))
    for mult, base, allowed, last_n in [(0.8, 1.75, 2, 96), (1.5, 2.0, 3, 40), (1.0, 1.1, 1, 96)]:
        def make(v, m=mult, b=base, a=allowed, n=last_n):
            arr = (ctypes.c_char_p * len(BREAKERS))(*[s.encode() for s in BREAKERS])
            return L.llama_sampler_init_dry(v, m, b, a, n, arr, len(BREAKERS))
        out.append(one("dry", make, dry_multiplier=mult, dry_base=base, dry_allowed_length=allowed, dry_penalty_last_n=last_n))
    for n in [1.0, 2.0]:
        out.append(one("top_n_sigma", lambda v, n=n: L.llama_sampler_init_top_n_sigma(n), top_n_sigma=n))
    for k in [1, 10, 40, 100]:
        out.append(one("top_k", lambda v, k=k: L.llama_sampler_init_top_k(k), top_k=k))
    for p, keep in [(0.9, 0), (0.5, 3)]:
        out.append(one("typ_p", lambda v, p=p, k=keep: L.llama_sampler_init_typical(p, k), typical_p=p, min_keep=keep))
    for p, keep in [(0.9, 0), (0.3, 5), (0.999, 1)]:
        out.append(one("top_p", lambda v, p=p, k=keep: L.llama_sampler_init_top_p(p, k), top_p=p, min_keep=keep))
    for p, keep in [(0.05, 0), (0.3, 4)]:
        out.append(one("min_p", lambda v, p=p, k=keep: L.llama_sampler_init_min_p(p, k), min_p=p, min_keep=keep))
    for t, keep in [(0.1, 0), (0.05, 2)]:
        out.append(one("xtc", lambda v, t=t, k=keep: L.llama_sampler_init_xtc(1.0, t, k, 0), xtc_probability=1.0, xtc_threshold=t, min_keep=keep))
    for t in [0.7, 1.5, 0.0]:
        out.append(one("temperature", lambda v, t=t: L.llama_sampler_init_temp(t), temperature=t))
    return out


def default_chain(n_vocab, bias, sigma):
    p = dict(repetition_context_size=64, repetition_penalty=1.1, frequency_penalty=0.1, presence_penalty=0.05,
             dry_multiplier=0.8, dry_base=1.75, dry_allowed_length=2, dry_penalty_last_n=96, top_n_sigma=sigma,
             top_k=40, typical_p=1.0 if sigma > 0 else 0.95, top_p=0.95, min_p=0.05, xtc_probability=1.0, xtc_threshold=0.1,
             temperature=0.8, min_keep=0)

    def make(v):
        chain = L.llama_sampler_chain_init(L.llama_sampler_chain_default_params())
        arr = (L.llama_logit_bias * len(bias))(*[L.llama_logit_bias(t, b) for t, b in bias])
        L.llama_sampler_chain_add(chain, L.llama_sampler_init_logit_bias(n_vocab, len(bias), arr))
        L.llama_sampler_chain_add(chain, L.llama_sampler_init_penalties(n_vocab, 64, 1.1, 0.1, 0.05))
        br = (ctypes.c_char_p * len(BREAKERS))(*[s.encode() for s in BREAKERS])
        L.llama_sampler_chain_add(chain, L.llama_sampler_init_dry(v, 0.8, 1.75, 2, 96, br, len(BREAKERS)))
        L.llama_sampler_chain_add(chain, L.llama_sampler_init_top_n_sigma(sigma))
        L.llama_sampler_chain_add(chain, L.llama_sampler_init_top_k(40))
        L.llama_sampler_chain_add(chain, L.llama_sampler_init_typical(p["typical_p"], 0))
        L.llama_sampler_chain_add(chain, L.llama_sampler_init_top_p(0.95, 0))
        L.llama_sampler_chain_add(chain, L.llama_sampler_init_min_p(0.05, 0))
        L.llama_sampler_chain_add(chain, L.llama_sampler_init_xtc(1.0, 0.1, 0, 0))
        L.llama_sampler_chain_add(chain, L.llama_sampler_init_temp(0.8))
        return chain

    return {"stage": "default_chain", "params": {**p, "logit_bias": bias}, "make": make}


def run(smpl, ids, logits, history):
    for t in history:
        L.llama_sampler_accept(smpl, t)
    n = len(ids)
    arr = (L.llama_token_data * n)(*[L.llama_token_data(int(i), float(x), 0.0) for i, x in zip(ids, logits)])
    cur = L.llama_token_data_array(data=arr, size=n, selected=-1, sorted=False)
    L.llama_sampler_apply(smpl, ctypes.byref(cur))
    out = [[int(cur.data[i].id), f32(cur.data[i].logit)] for i in range(cur.size)]
    L.llama_sampler_free(smpl)
    return out


def f32(x):
    x = float(np.float32(x))
    return x if np.isfinite(x) else ("-inf" if x < 0 else "inf")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", required=True, type=Path)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--cases", type=int, default=24)
    args = ap.parse_args()

    L.llama_backend_init()
    mp = L.llama_model_default_params()
    mp.vocab_only = True
    model = L.llama_model_load_from_file(str(args.gguf).encode(), mp)
    assert model, args.gguf
    vocab = L.llama_model_get_vocab(model)
    n_vocab = L.llama_vocab_n_tokens(vocab)
    breaker_ids = sorted({t for s in BREAKERS for t in tokenize(vocab, s)})

    rng = np.random.default_rng(0)
    cases = []
    kinds = ["random", "ties", "neg_inf", "peaked"]
    for c in range(args.cases):
        kind = kinds[c % len(kinds)]
        ids = rng.choice(n_vocab, size=64, replace=False)
        logits = rng.normal(0.0, 2.0, size=64).astype(np.float32)
        if kind == "ties":
            logits = (np.round(logits * 2) / 2).astype(np.float32)
        elif kind == "neg_inf":
            logits[rng.choice(64, size=7, replace=False)] = -np.inf
        elif kind == "peaked":
            logits[rng.integers(64)] += 8.0
        # History: candidates with repeats; a run of 6 repeated later, the
        # second copy cut short (its next token extends it), across a breaker
        # in every other case.
        pool = list(ids[:24]) + breaker_ids[:2]
        run6 = [int(x) for x in rng.choice(ids[:24], size=6)]
        filler = lambda k: [int(x) for x in rng.choice(pool, size=k)]
        second = run6[:4] if c % 2 == 0 else run6[:2] + [breaker_ids[c % len(breaker_ids)]] + run6[2:4]
        history = filler(40) + run6 + filler(40) + second
        history = history[-96:]
        results = []
        bias = [[int(ids[0]), 2.5], [int(ids[1]), "-inf"], [int(ids[5]), -1.25]]
        typed = [(t, float("-inf") if b == "-inf" else b) for t, b in bias]
        for cfg in configs(n_vocab) + [default_chain(n_vocab, typed, -1.0), default_chain(n_vocab, typed, 2.0)]:
            params = dict(cfg["params"])
            if "logit_bias" in params:
                params["logit_bias"] = bias
            results.append({"stage": cfg["stage"], "params": params, "out": run(cfg["make"](vocab), ids, logits, history)})
        cases.append({"kind": kind, "ids": [int(i) for i in ids], "logits": [f32(x) for x in logits], "history": history, "results": results})

    out = {
        "llama_cpp": "vendor/llama.cpp of llama-cpp-python 0.3.36",
        "vocab": args.gguf.name,
        "dry_sequence_breakers": BREAKERS,
        "cases": cases,
    }
    args.out.write_text(json.dumps(out, separators=(",", ":")) + "\n")


if __name__ == "__main__":
    main()
