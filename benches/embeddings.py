"""mlx-embeddings 0.1.0 timing for benches/embeddings.sh: the same texts, in
the same batches, padded per batch as its README does; one warm-up pass, then
the median of --repeat passes. Prints one JSON object.

    tests/reference/run.sh benches/embeddings.py MODEL_DIR TEXTS_FILE BATCH REPEAT
"""

import json
import statistics
import sys
import time

import mlx.core as mx
from mlx_embeddings.utils import load


def main():
    model_dir, texts_file, batch, repeat = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    texts = [line.rstrip("\n") for line in open(texts_file, encoding="utf-8")]
    model, tokenizer = load(model_dir)

    def one_pass():
        tokens = 0
        for start in range(0, len(texts), batch):
            inputs = tokenizer.batch_encode_plus(
                texts[start:start + batch], return_tensors="mlx", padding=True, truncation=True, max_length=256
            )
            out = model(inputs["input_ids"], attention_mask=inputs["attention_mask"])
            mx.eval(out.text_embeds)
            tokens += int(inputs["attention_mask"].sum().item())
        return tokens

    tokens = one_pass()
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        one_pass()
        times.append(time.perf_counter() - started)
    seconds = statistics.median(times)
    print(json.dumps({"engine": "mlx-embeddings", "texts": len(texts), "tokens": tokens, "seconds": seconds,
                      "texts_per_second": len(texts) / seconds, "tokens_per_second": tokens / seconds}))


if __name__ == "__main__":
    main()
