"""Random 4-bit checkpoints for the MoE decode benchmark (mlxcel-models/examples/moe_bench.rs).

    tests/reference/run.sh tests/reference/make_moe_bench_checkpoints.py [--out /tmp/moe-bench]

Writes <out>/qwen3_moe (hidden 512, 8 layers, 8 experts top-2, expert FFN 768) and
<out>/qwen3_dense (the same attention, dense FFN 1536 = 2 x 768: the same active
parameter count per token). Both affine 4-bit g64 (mlx-lm's quantize_model; its
qwen3_moe quant_predicate makes the routers 8-bit). Seeded mlx default init.
"""

import argparse
from pathlib import Path

import mlx.core as mx
from mlx_lm.utils import _get_classes, quantize_model, save_config, save_model

COMMON = {
    "hidden_size": 512,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "vocab_size": 4096,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 4096,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "hidden_act": "silu",
}
MODELS = {
    "qwen3_moe": {
        **COMMON,
        "model_type": "qwen3_moe",
        "architectures": ["Qwen3MoeForCausalLM"],
        "intermediate_size": 1536,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 768,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    },
    "qwen3_dense": {
        **COMMON,
        "model_type": "qwen3",
        "architectures": ["Qwen3ForCausalLM"],
        "intermediate_size": 1536,
    },
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("/tmp/moe-bench"))
    args = ap.parse_args()
    mx.set_default_device(mx.cpu)
    for name, config in MODELS.items():
        mx.random.seed(7)
        model_class, args_class = _get_classes(config)
        model = model_class(args_class.from_dict(config))
        model, config = quantize_model(model, dict(config), 64, 4, mode="affine")
        mx.eval(model.parameters())
        out = args.out / name
        out.mkdir(parents=True, exist_ok=True)
        save_model(out, model)
        save_config(config, out / "config.json")
        print(name, out)


if __name__ == "__main__":
    main()
