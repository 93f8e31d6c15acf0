"""Goldens for decoder-based sentence embeddings (last-token pooling over a
qwen3 body, as Qwen3-Embedding) from mlx-embeddings 0.1.0's `qwen3` model,
on tiny random weights.

    tests/reference/run.sh tests/reference/make_decoder_embedding_goldens.py

Writes mlxcel-models/tests/data/tiny/qwen3_embedding{,_q4_g32}/: config.json,
model.safetensors (no lm_head; mlx-embeddings' `model.`-prefixed names, and
for the 4-bit one Qwen3-Embedding's unprefixed names, as on the Hub) and
golden.json: each sequence's token ids and its text_embeds (last token of
the final norm's output, L2-normalised), computed in one right-padded batch
of mixed lengths with an attention mask.
"""

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map_with_path
from mlx_embeddings.models.qwen3 import Model, ModelArgs

OUT = Path(__file__).resolve().parents[2] / "mlxcel-models" / "tests" / "data" / "tiny"

CONFIG = {
    "model_type": "qwen3",
    "architectures": ["Qwen3Model"],
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 128,
    "vocab_size": 512,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": False,
}

LENGTHS = [7, 1, 19, 12, 3]


def build(seed: int) -> Model:
    mx.random.seed(seed)
    model = Model(ModelArgs(**{k: v for k, v in CONFIG.items() if k != "architectures"}))
    # RMSNorm gains 1 + 0.2 N(0, 1), as the tiny language-model goldens do.
    def gain(path, value):
        return 1 + 0.2 * mx.random.normal(value.shape) if path.endswith("norm.weight") else value
    model.update(tree_map_with_path(gain, model.parameters()))
    mx.eval(model.parameters())
    return model


def write(name: str, model: Model, quantization=None, prefixed=True) -> None:
    mx.random.seed(7)
    sequences = [mx.random.randint(0, CONFIG["vocab_size"], (n,)).tolist() for n in LENGTHS]
    width = max(LENGTHS)
    ids = mx.array([s + [0] * (width - len(s)) for s in sequences])
    mask = mx.array([[1] * len(s) + [0] * (width - len(s)) for s in sequences])
    embeds = model(ids, attention_mask=mask).text_embeds.astype(mx.float32).tolist()
    out = OUT / name
    out.mkdir(parents=True, exist_ok=True)
    config = dict(CONFIG)
    if quantization:
        config["quantization"] = quantization
    (out / "config.json").write_text(json.dumps(config, indent=1, sort_keys=True) + "\n")
    weights = dict(tree_flatten(model.parameters()))
    if not prefixed:
        weights = {k.removeprefix("model."): v for k, v in weights.items()}
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    golden = {
        "model_type": "qwen3",
        "reference": "mlx-embeddings 0.1.0 models.qwen3 (last-token pooling, L2 norm), one right-padded batch with an attention mask",
        "cases": [{"ids": s, "embedding": [round(v, 7) for v in e]} for s, e in zip(sequences, embeds)],
    }
    (out / "golden.json").write_text(json.dumps(golden, indent=1) + "\n")
    print(f"wrote {out}")


def main() -> None:
    write("qwen3_embedding", build(11))
    model = build(12)
    nn.quantize(model, group_size=32, bits=4)
    mx.eval(model.parameters())
    write("qwen3_embedding_q4_g32", model, {"group_size": 32, "bits": 4}, prefixed=False)


if __name__ == "__main__":
    main()
