"""Goldens for quantizing dense checkpoints at load (`q_bits`): what
`mlx_lm.convert -q --q-bits B --q-group-size G` writes, as sha256 per tensor.

Two dense checkpoints, each rebuilt exactly by the Rust test
(tests/quantize_on_load.rs), whose input hashes are recorded too:

* `minilm`: a MiniLM-size llama (hidden 384, 2 layers, 6 heads / 2 KV heads,
  intermediate 1056 = 33 * 32, so `down_proj` takes groups of 32 but not 64 or
  128 and stays dense there, vocab 1024, untied), f32 tensors from an integer
  hash (`pattern`, exact in f32), config `torch_dtype` bfloat16 (convert
  rounds every tensor to bf16 before quantizing);
* `smollm2`: the default model (SmolLM2-135M-Instruct, MLX 4-bit g32 with
  8-bit embeddings) dequantized with `mx.dequantize` to f16, tied.

    tests/reference/run.sh tests/reference/make_quantize_on_load_goldens.py \\
        --smollm2 ~/.cache/mlxcel/models/SmolLM2-135M-Instruct \\
        --out tests/reference/goldens/quantize_on_load.json
"""

import argparse
import hashlib
import json
import shutil
import tempfile
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm.convert import convert

MINILM = {
    "model_type": "llama",
    "hidden_size": 384,
    "num_hidden_layers": 2,
    "intermediate_size": 1056,
    "num_attention_heads": 6,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 512,
    "vocab_size": 1024,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}
MINILM_CASES = [(4, 64), (4, 32), (8, 64), (8, 32), (3, 128), (6, 64)]
SMOLLM2_CASES = [(4, 32), (4, 64), (8, 64)]
TOKENIZER_FILES = ["tokenizer.json", "tokenizer_config.json"]


def pattern(seed: int, n: int) -> np.ndarray:
    """n values in [-1/16, 1/16) from a 32-bit integer hash (multiples of 2**-15)."""
    h = (np.arange(n, dtype=np.uint64) * np.uint64(2654435761) + np.uint64(seed * 40503 + 12345)) & np.uint64(0xFFFFFFFF)
    h ^= h >> np.uint64(13)
    h = (h * np.uint64(0x5BD1E995)) & np.uint64(0xFFFFFFFF)
    h ^= h >> np.uint64(15)
    return (((h >> np.uint64(20)).astype(np.int64) - 2048).astype(np.float32)) / np.float32(32768)


def minilm_shapes(c):
    h, i, v, hd = c["hidden_size"], c["intermediate_size"], c["vocab_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    shapes = {"model.embed_tokens.weight": [v, h], "model.norm.weight": [h], "lm_head.weight": [v, h]}
    for l in range(c["num_hidden_layers"]):
        p = f"model.layers.{l}"
        shapes |= {
            f"{p}.input_layernorm.weight": [h],
            f"{p}.post_attention_layernorm.weight": [h],
            f"{p}.self_attn.q_proj.weight": [q, h],
            f"{p}.self_attn.k_proj.weight": [kv, h],
            f"{p}.self_attn.v_proj.weight": [kv, h],
            f"{p}.self_attn.o_proj.weight": [h, q],
            f"{p}.mlp.gate_proj.weight": [i, h],
            f"{p}.mlp.up_proj.weight": [i, h],
            f"{p}.mlp.down_proj.weight": [h, i],
        }
    return shapes


def minilm_tensors():
    """Seed = index of the name in sorted order; norms are 1 + pattern."""
    out = {}
    for seed, (name, shape) in enumerate(sorted(minilm_shapes(MINILM).items())):
        v = pattern(seed, int(np.prod(shape))).reshape(shape)
        out[name] = mx.array(v + 1 if "norm" in name else v)
    return out


def smollm2_tensors(model_dir: Path):
    config = json.loads((model_dir / "config.json").read_text())
    q = config["quantization"]
    w = mx.load(str(model_dir / "model.safetensors"))
    out = {}
    for name, a in w.items():
        module = name.rsplit(".", 1)[0]
        if name.endswith((".scales", ".biases")) and module + ".scales" in w:
            continue
        if name.endswith(".weight") and module + ".scales" in w:
            p = q.get(module, q)
            a = mx.dequantize(a, w[module + ".scales"], w[module + ".biases"], p["group_size"], p["bits"])
        out[name] = a
    config.pop("quantization")
    config.pop("quantization_config", None)
    return config, out


def digest(a: mx.array) -> str:
    if a.dtype == mx.bfloat16:
        a = a.view(mx.uint16)
    return hashlib.sha256(np.ascontiguousarray(np.array(a)).tobytes()).hexdigest()[:16]


def case(name, config, tensors, cases, tokenizer_dir: Path, work: Path):
    dense = work / f"{name}-dense"
    dense.mkdir()
    mx.save_safetensors(str(dense / "model.safetensors"), tensors, metadata={"format": "mlx"})
    (dense / "config.json").write_text(json.dumps(config, indent=2))
    for f in TOKENIZER_FILES:
        shutil.copy(tokenizer_dir / f, dense / f)
    result = {"config": config, "dense": {k: digest(v) for k, v in sorted(tensors.items())}, "converted": {}}
    for bits, group in cases:
        out = work / f"{name}-q{bits}-g{group}"
        convert(str(dense), str(out), quantize=True, q_bits=bits, q_group_size=group)
        written = mx.load(str(out / "model.safetensors"))
        saved = json.loads((out / "config.json").read_text())
        result["converted"][f"{bits},{group}"] = {
            "quantization": saved["quantization"],
            "tensors": {k: [str(v.dtype).removeprefix("mlx.core."), list(v.shape), digest(v)] for k, v in sorted(written.items())},
        }
    return result


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--smollm2", type=Path, required=True, help="the default model's MLX checkpoint")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        goldens = {
            "mlx": mx.__version__,
            "minilm": case("minilm", MINILM, minilm_tensors(), MINILM_CASES, args.smollm2, work),
        }
        config, tensors = smollm2_tensors(args.smollm2)
        goldens["smollm2"] = case("smollm2", config, tensors, SMOLLM2_CASES, args.smollm2, work)
    args.out.write_text(json.dumps(goldens, indent=1, sort_keys=True) + "\n")
    print("wrote", args.out, args.out.stat().st_size, "bytes")


if __name__ == "__main__":
    main()
