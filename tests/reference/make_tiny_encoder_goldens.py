"""Goldens for a tiny random XLM-RoBERTa encoder (sentence embeddings: mean
pooling and L2 normalisation) from mlx-embeddings 0.1.0's `xlm_roberta`.

    tests/reference/run.sh tests/reference/make_tiny_encoder_goldens.py

Writes mlxcel-models/tests/data/tiny/xlm_roberta/: config.json,
model.safetensors (Hugging Face names under `roberta.`, as the task models
save them, pooler included) and golden.json: each sequence's token ids and
its text_embeds, computed in one padded batch (pad id 1) with an attention
mask. Token ids start at 2, so no real token is the pad id (XLM-RoBERTa
numbers positions from pad_token_id + 1, skipping pads).

Also writes xlm_roberta_rerank/: the same encoder as an
XLMRobertaForSequenceClassification with one label and a seeded head
(`classifier.dense`, `classifier.out_proj`: out_proj(tanh(dense(h[<s>])))),
and golden.json with each input's score from mlx-embeddings' last hidden
state through that head.
"""

import json
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten, tree_map_with_path
from mlx_embeddings.models.xlm_roberta import Model, ModelArgs

OUT = Path(__file__).resolve().parents[2] / "mlxcel-models" / "tests" / "data" / "tiny" / "xlm_roberta"

CONFIG = {
    "model_type": "xlm-roberta",
    "architectures": ["XLMRobertaModel"],
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "max_position_embeddings": 40,
    "vocab_size": 512,
    "type_vocab_size": 1,
    "layer_norm_eps": 1e-5,
    "pad_token_id": 1,
    "hidden_act": "gelu",
    "position_embedding_type": "absolute",
}

LENGTHS = [9, 2, 37, 14, 5]


def main() -> None:
    mx.random.seed(21)
    args = {k: v for k, v in CONFIG.items() if k not in ("architectures", "hidden_act")}
    model = Model(ModelArgs(**args))
    model.eval()  # MLX modules start in training mode: dropout on
    # LayerNorm gains 1 + 0.2 N(0, 1) and biases 0.1 N(0, 1), so norms matter.
    def perturb(path, value):
        if "LayerNorm.weight" in path:
            return 1 + 0.2 * mx.random.normal(value.shape)
        if "LayerNorm.bias" in path:
            return 0.1 * mx.random.normal(value.shape)
        return value
    model.update(tree_map_with_path(perturb, model.parameters()))
    mx.eval(model.parameters())
    sequences = [mx.random.randint(2, CONFIG["vocab_size"], (n,)).tolist() for n in LENGTHS]
    width = max(LENGTHS)
    ids = mx.array([s + [CONFIG["pad_token_id"]] * (width - len(s)) for s in sequences])
    mask = mx.array([[1] * len(s) + [0] * (width - len(s)) for s in sequences])
    embeds = model(ids, attention_mask=mask).text_embeds.astype(mx.float32).tolist()
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "config.json").write_text(json.dumps(CONFIG, indent=1, sort_keys=True) + "\n")
    weights = {f"roberta.{k}": v for k, v in tree_flatten(model.parameters())}
    mx.save_safetensors(str(OUT / "model.safetensors"), weights, metadata={"format": "pt"})
    golden = {
        "model_type": "xlm-roberta",
        "reference": "mlx-embeddings 0.1.0 models.xlm_roberta text_embeds (mean pooling, L2 norm), one padded batch with an attention mask",
        "cases": [{"ids": s, "embedding": [round(v, 7) for v in e]} for s, e in zip(sequences, embeds)],
    }
    (OUT / "golden.json").write_text(json.dumps(golden, indent=1) + "\n")
    print(f"wrote {OUT}")

    # The cross-encoder: the same encoder, no pooler, a seeded head.
    hidden = CONFIG["hidden_size"]
    mx.random.seed(22)
    head = {
        "classifier.dense.weight": 0.1 * mx.random.normal((hidden, hidden)),
        "classifier.dense.bias": 0.1 * mx.random.normal((hidden,)),
        "classifier.out_proj.weight": 0.3 * mx.random.normal((1, hidden)),
        "classifier.out_proj.bias": mx.array([0.25]),
    }
    states = model(ids, attention_mask=mask).last_hidden_state.astype(mx.float32)
    first = states[:, 0, :]
    dense = mx.tanh(first @ head["classifier.dense.weight"].T + head["classifier.dense.bias"])
    scores = (dense @ head["classifier.out_proj.weight"].T + head["classifier.out_proj.bias"])[:, 0].tolist()
    rerank = OUT.parent / "xlm_roberta_rerank"
    rerank.mkdir(parents=True, exist_ok=True)
    config = dict(CONFIG, architectures=["XLMRobertaForSequenceClassification"], id2label={"0": "LABEL_0"})
    (rerank / "config.json").write_text(json.dumps(config, indent=1, sort_keys=True) + "\n")
    encoder = {k: v for k, v in weights.items() if ".pooler." not in k}
    mx.save_safetensors(str(rerank / "model.safetensors"), {**encoder, **head}, metadata={"format": "pt"})
    golden = {
        "model_type": "xlm-roberta",
        "reference": "mlx-embeddings 0.1.0 models.xlm_roberta last_hidden_state[:, 0] through the seeded head, one padded batch",
        "cases": [{"ids": s, "score": round(v, 7)} for s, v in zip(sequences, scores)],
    }
    (rerank / "golden.json").write_text(json.dumps(golden, indent=1) + "\n")
    print(f"wrote {rerank}")


if __name__ == "__main__":
    main()
