"""Write tiny random mlx-lm checkpoints plus golden outputs for mlxcel's parity tests.

Usage (from the repository root):

    tests/reference/run.sh tests/reference/make_tiny_goldens.py \
        [--out mlxcel-models/tests/data/tiny] [--only llama,qwen3]

For every variant this writes <out>/<name>/:
  config.json                    Hugging Face style keys, written by mlx_lm.utils.save_config
  model.safetensors              written by mlx_lm.utils.save_model (keys model.layers.0...)
  model.safetensors.index.json   written by mlx_lm.utils.save_model as well
  golden.json                    inputs and reference outputs (see README.md)

The models are built with mlx-lm's own model classes, seeded, saved the way
mlx-lm saves a checkpoint, then *reloaded* with mlx_lm.utils.load_model; the
golden outputs come from the reloaded model, so they describe exactly what
mlx-lm computes from the files on disk.
"""

import argparse
import copy
import importlib.metadata as md
import json
import platform
import shutil
import sys
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import _get_classes, load_model, quantize_model, save_config, save_model

REPO = Path(__file__).resolve().parents[2]
DEFAULT_OUT = REPO / "mlxcel-models" / "tests" / "data" / "tiny"

INPUT_IDS = [1, 17, 243, 99, 511, 8, 300, 42, 7, 128, 256, 3]
N_GREEDY = 16
MIN_GAP = 0.05  # logits are O(5); see README.md
MAX_ATTEMPTS = 30

BASE = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 128,
    "vocab_size": 512,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
}

LLAMA = {
    **BASE,
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "rope_theta": 10000.0,
    "attention_bias": False,
    "mlp_bias": False,
    "hidden_act": "silu",
}
MISTRAL = {**LLAMA, "architectures": ["MistralForCausalLM"], "model_type": "mistral"}
QWEN2 = {
    **BASE,
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "rope_theta": 1000000.0,
    "hidden_act": "silu",
}
# mlx-lm's qwen2 derives head_dim = hidden / heads (= 16 here); it has no head_dim key.
del QWEN2["head_dim"]
QWEN3 = {
    **BASE,
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "rope_theta": 1000000.0,
    "attention_bias": False,
    "hidden_act": "silu",
}

# Gemma 3 (text): 3 layers with global attention on every third, a sliding
# window of 5 (shorter than the 12-token prompt, so it masks), local and global
# RoPE bases, a query scale that is not head_dim ** -0.5, GELU (tanh) MLP, the
# four norms per block and the sqrt(hidden) embedding scale.
GEMMA3 = {
    **BASE,
    "architectures": ["Gemma3ForCausalLM"],
    "model_type": "gemma3_text",
    "num_hidden_layers": 3,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "rope_local_base_freq": 100.0,
    "query_pre_attn_scalar": 24,
    "sliding_window": 5,
    "sliding_window_pattern": 3,
    "hidden_activation": "gelu_pytorch_tanh",
}
del GEMMA3["tie_word_embeddings"]
# MoE: 4 experts, top 2, expert FFN 64 (hidden 64, so the 4-bit g32 variants quantize every
# projection; mlx-lm's qwen3_moe quant_predicate makes its router 8-bit g64).
MIXTRAL = {
    **BASE,
    "architectures": ["MixtralForCausalLM"],
    "model_type": "mixtral",
    "rope_theta": 1000000.0,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "intermediate_size": 64,
    "hidden_act": "silu",
}
del MIXTRAL["head_dim"]
QWEN3_MOE = {
    **BASE,
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "num_hidden_layers": 3,
    "rope_theta": 1000000.0,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 64,
    "norm_topk_prob": True,
    # Layer 1 dense (mlp_only_layers), layers 0 and 2 sparse.
    "decoder_sparse_step": 1,
    "mlp_only_layers": [1],
    "attention_bias": False,
    "hidden_act": "silu",
}

# Gemma 2: Gemma's four norms per block with 1 + weight gains, GELU (tanh),
# the sqrt(hidden) embedding scale, always tied; soft-caps low enough to bend
# these scores and logits (attention 5, final 8); a query scale that is not
# head_dim ** -0.5. mlx-lm's gemma2 ignores `sliding_window` (kept here as
# Hugging Face's configs carry it, shorter than the prompt: it must not mask).
GEMMA2 = {
    **{k: v for k, v in GEMMA3.items() if k not in ("rope_local_base_freq", "sliding_window_pattern")},
    "architectures": ["Gemma2ForCausalLM"],
    "model_type": "gemma2",
    "attn_logit_softcapping": 5.0,
    "final_logit_softcapping": 8.0,
}
# OLMo 2: post-norm blocks, q/k norms over the whole projection.
OLMO2 = {
    **BASE,
    "architectures": ["Olmo2ForCausalLM"],
    "model_type": "olmo2",
    "rope_theta": 500000.0,
    "attention_bias": False,
    "mlp_bias": False,
    "hidden_act": "silu",
}
# Phi-3: fused qkv_proj and gate_up_proj; head_dim = hidden / heads (no key).
PHI3 = {
    **BASE,
    "architectures": ["Phi3ForCausalLM"],
    "model_type": "phi3",
    "rope_theta": 10000.0,
    "original_max_position_embeddings": 512,
    "hidden_act": "silu",
}
del PHI3["head_dim"]
# su / longrope: mlx-lm's SuScaledRoPE applies long_factor at every position
# (short_factor is read, never used) and scales q and k by
# sqrt(1 + ln(512 / 16) / ln(16)) = 1.5. The 28 positions of prompt + greedy
# run past original_max_position_embeddings (16) all the same.
PHI3_SU = {
    **PHI3,
    "original_max_position_embeddings": 16,
    "rope_scaling": {
        "type": "su",
        "short_factor": [1.0, 1.0, 1.1, 1.2, 1.3, 1.5, 1.7, 2.0],
        "long_factor": [1.0, 1.2, 1.6, 2.4, 3.5, 5.0, 7.5, 11.0],
    },
}


# name -> dict(config=..., dtype=..., quant=(group_size, bits) | None, predicate=..., seed=...)
def variants():
    v = {}
    v["llama"] = dict(config=LLAMA, desc="llama, untied lm_head, float32")
    v["llama_tied"] = dict(
        config={**LLAMA, "tie_word_embeddings": True}, desc="llama, tied embeddings"
    )
    v["llama_rope_llama3"] = dict(
        config={
            **LLAMA,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        },
        desc="llama with llama3 rope scaling (original_max_position_embeddings 64 so "
        "that the scaling changes the logits at these positions)",
    )
    v["llama_rope_linear"] = dict(
        config={**LLAMA, "rope_scaling": {"type": "linear", "factor": 2.0}},
        desc="llama with linear rope scaling (factor 2)",
    )
    v["mistral"] = dict(config=MISTRAL, desc="model_type mistral (mlx-lm maps it to llama)")
    v["qwen2"] = dict(config=QWEN2, desc="qwen2: q/k/v biases, head_dim implied")
    v["qwen3"] = dict(config=QWEN3, desc="qwen3: q_norm/k_norm, explicit head_dim, no biases")
    v["llama_bf16"] = dict(
        config=LLAMA, dtype="bfloat16", desc="llama, weights stored in bfloat16"
    )
    v["llama_f16"] = dict(
        config=LLAMA, dtype="float16", desc="llama, weights stored in float16"
    )
    v["llama_q4_g32"] = dict(
        config=LLAMA, quant=(32, 4), desc="llama, affine 4-bit, group 32 (mlx-lm quantize_model)"
    )
    v["qwen3_q8_g64"] = dict(
        config=QWEN3, quant=(64, 8), desc="qwen3, affine 8-bit, group 64"
    )
    v["llama_q3_g128"] = dict(
        config={
            **LLAMA,
            "hidden_size": 128,
            "intermediate_size": 256,
            "head_dim": 32,
        },
        quant=(128, 3),
        desc="llama (hidden 128, intermediate 256, head_dim 32), affine 3-bit, group 128",
    )

    # Mixed precision, exactly as mlx_lm.utils.quantize_model records it: a
    # quant_predicate returning a dict is written to config["quantization"][path];
    # returning False leaves the layer unquantized and is NOT recorded (mlx-lm's
    # loader then finds no "<path>.scales" in the weights and keeps it a Linear).
    def mixed(path, module):
        if path == "model.embed_tokens":
            return {"group_size": 64, "bits": 8, "mode": "affine"}
        if path == "model.layers.1.mlp.down_proj":
            return False
        return True

    v["llama_q4_mixed"] = dict(
        config={**LLAMA, "tie_word_embeddings": True},
        quant=(32, 4),
        predicate=mixed,
        desc="llama tied, 4-bit g32; embed_tokens (and so the tied lm_head) 8-bit g64 "
        "recorded as a per-module override; model.layers.1.mlp.down_proj left "
        "unquantized (not recorded in config, as mlx-lm does; inferred from the absence "
        "of .scales)",
    )
    # Same, but with the explicit `"<path>": false` entry in config.json that some
    # converters write; mlx-lm's loader honours it (class_predicate returns it).
    v["llama_q4_mixed_false"] = dict(
        config=LLAMA,
        quant=(32, 4),
        predicate=mixed,
        explicit_false=["model.layers.1.mlp.down_proj"],
        desc="llama untied, 4-bit g32, embed_tokens 8-bit g64, "
        "model.layers.1.mlp.down_proj unquantized and recorded as false in config.json",
    )
    # Gemma's norms scale by 1 + weight: gains near 1 need weights near 0.
    v["gemma3_text"] = dict(
        config=GEMMA3, norm_offset=0.0, desc="gemma3_text, untied lm_head, float32"
    )
    v["gemma3_text_tied_q4_g32"] = dict(
        config=GEMMA3,
        norm_offset=0.0,
        tied=True,
        quant=(32, 4),
        desc="gemma3_text, tied embeddings (no lm_head, as Gemma 3 ships), affine 4-bit, group 32",
    )
    # YaRN over a 32-position original context: the ramp spans the middle pairs
    # (beta_fast 32 / beta_slow 1 at head_dim 16) and the attention factor is
    # 0.1 * ln(4) + 1; the q4 variant runs it through the fused block.
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
            "beta_fast": 32.0, "beta_slow": 1.0}
    v["llama_rope_yarn"] = dict(
        config={**LLAMA, "rope_scaling": yarn},
        desc="llama with yarn rope scaling (factor 4, original context 32)",
    )
    v["llama_rope_yarn_q4"] = dict(
        config={**LLAMA, "rope_scaling": yarn}, quant=(32, 4),
        desc="llama with yarn rope scaling, affine 4-bit group 32",
    )
    # `ablate`: config keys whose change must move the logits (recorded as
    # stats.ablation_effect_max_abs_diff).
    no_caps = {"attn_logit_softcapping": 1e9, "final_logit_softcapping": 1e9}
    v["gemma2"] = dict(
        config=GEMMA2, norm_offset=0.0, ablate=no_caps,
        desc="gemma2 (always tied), attention and final soft-caps, float32",
    )
    v["gemma2_q4_g32"] = dict(
        config=GEMMA2, norm_offset=0.0, quant=(32, 4), ablate=no_caps,
        desc="gemma2 (tied embeddings, quantized too), affine 4-bit, group 32",
    )
    v["olmo2"] = dict(config=OLMO2, desc="olmo2: post-norms, whole-projection q/k norms, untied, float32")
    v["olmo2_q4_g32"] = dict(config=OLMO2, quant=(32, 4), desc="olmo2, affine 4-bit, group 32")
    v["phi3"] = dict(config=PHI3, desc="phi3: fused qkv_proj and gate_up_proj, untied, float32")
    v["phi3_su"] = dict(
        config=PHI3_SU,
        desc="phi3 with su rope scaling (long factors, attention factor 1.5, original context 16)",
    )
    v["phi3_q4_g32"] = dict(config=PHI3, quant=(32, 4), desc="phi3, fused projections quantized: affine 4-bit, group 32")
    # Mixtures of experts (explicit seeds: independent of the variants' order).
    v["mixtral"] = dict(config=MIXTRAL, seed=1700, desc="mixtral: 4 experts top-2 (softmax over the top 2), float32")
    v["mixtral_q4_g32"] = dict(
        config=MIXTRAL, seed=1800, quant=(32, 4), desc="mixtral, affine 4-bit g32 (experts and router)"
    )
    v["qwen3_moe"] = dict(
        config=QWEN3_MOE, seed=1900,
        desc="qwen3_moe: q/k norms, 4 experts top-2 renormalized, layer 1 dense (mlp_only_layers), float32",
    )
    v["qwen3_moe_q4_g32"] = dict(
        config=QWEN3_MOE, seed=2000, quant=(32, 4),
        desc="qwen3_moe, affine 4-bit g32 (router 8-bit g64 by mlx-lm's quant_predicate)",
    )
    for i, name in enumerate(v):
        v[name].setdefault("seed", 1000 + i)
    return v


def init_model(config, seed, norm_offset=1.0, tied=False):
    """Build an mlx-lm model with seeded random weights (norm weights perturbed
    from norm_offset; tied: without an lm_head, as mlx-lm's sanitize leaves a
    checkpoint that has none)."""
    mx.random.seed(seed)
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    key = mx.random.key(seed)
    params = []
    for i, (name, p) in enumerate(tree_flatten(model.parameters())):
        k = mx.random.fold_in(key, i) if hasattr(mx.random, "fold_in") else mx.random.split(key, i + 2)[i + 1]
        if name == "model.norm.weight":
            # Larger final gain: logits of order +-6 instead of +-2, so greedy
            # decisions are well separated.
            p = 3.0 * (1.0 + 0.2 * mx.random.normal(p.shape, key=k)) - (1.0 - norm_offset)
        elif name.endswith("norm.weight"):
            p = norm_offset + 0.2 * mx.random.normal(p.shape, key=k)
        elif name.endswith(".bias"):
            p = 0.1 * mx.random.normal(p.shape, key=k)
        params.append((name, p))
    model.update(tree_unflatten(params))
    if tied:
        model.tie_word_embeddings = True
        model.pop("lm_head")
    mx.eval(model.parameters())
    return model


def r6(x):
    """Round floats to 6 significant digits for JSON."""
    a = np.asarray(x, dtype=np.float64)
    return np.vectorize(lambda v: float(f"{v:.6g}"), otypes=[object])(a).tolist() if a.ndim else float(f"{a:.6g}")


def forward_logits(model, ids):
    out = model(mx.array(ids)[None])[0].astype(mx.float32)
    mx.eval(out)
    return np.array(out)


def greedy(model, ids, n):
    """Greedy decoding with the KV cache, exactly through mlx_lm.generate.generate_step."""
    toks, gaps, step_logits = [], [], []
    cache = make_prompt_cache(model)
    for (tok, logprobs), _ in zip(
        generate_step(mx.array(ids), model, max_tokens=n, prompt_cache=cache), range(n)
    ):
        lp = np.array(logprobs.astype(mx.float32))
        top2 = np.sort(lp)[-2:]
        toks.append(int(tok))
        gaps.append(float(top2[1] - top2[0]))
        step_logits.append(lp)
    return toks, gaps, np.stack(step_logits)


def versions():
    return {
        "mlx": md.version("mlx"),
        "mlx_lm": md.version("mlx-lm"),
        "numpy": md.version("numpy"),
        "python": platform.python_version(),
    }


def build(name, spec, out_root):
    t0 = time.perf_counter()
    out = out_root / name
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    config = copy.deepcopy(spec["config"])
    dtype = spec.get("dtype", "float32")
    config["torch_dtype"] = dtype

    base_config = config
    # Deterministic seed search: take the first seed whose greedy decisions are
    # all separated by at least MIN_GAP (so tiny numeric differences between
    # implementations cannot flip a greedy token).
    for attempt in range(MAX_ATTEMPTS):
        seed = spec["seed"] + 100 * attempt
        config = copy.deepcopy(base_config)
        model = init_model(config, seed, spec.get("norm_offset", 1.0), spec.get("tied", False))
        if dtype != "float32":
            model.set_dtype(getattr(mx, dtype))
        if spec.get("quant"):
            gs, bits = spec["quant"]
            model, config = quantize_model(
                model, config, gs, bits, mode="affine", quant_predicate=spec.get("predicate")
            )
            for path in spec.get("explicit_false", []):
                config["quantization"][path] = False
                config["quantization_config"][path] = False
        mx.eval(model.parameters())
        for f in out.iterdir():
            f.unlink()
        save_model(out, model)
        save_config(copy.deepcopy(config), out / "config.json")
        del model

        # Everything below uses the model as mlx-lm loads it back from disk.
        model, _ = load_model(out)
        logits = forward_logits(model, INPUT_IDS)
        logits2 = forward_logits(model, INPUT_IDS)
        toks, gaps, step_logits = greedy(model, INPUT_IDS, N_GREEDY)
        if min(gaps) >= MIN_GAP:
            break
    else:
        raise SystemExit(f"{name}: no seed with min top-2 gap >= {MIN_GAP}")

    # Teacher-forced full forward over input + greedy tokens vs the KV-cache steps:
    # the same numbers computed through a different graph (cache vs no cache).
    full = forward_logits(model, INPUT_IDS + toks[:-1])
    full_lp = full - np.log(np.exp(full - full.max(-1, keepdims=True)).sum(-1, keepdims=True)) - full.max(-1, keepdims=True)
    cache_vs_full = float(np.abs(full_lp[len(INPUT_IDS) - 1 :] - step_logits).max())
    scale = float(np.abs(logits).max())

    golden = {
        "name": name,
        "description": spec["desc"],
        "model_type": config["model_type"],
        "weights_dtype": dtype,
        "compute_dtype": dtype,
        "seed": seed,
        "seed_attempts": attempt + 1,
        "versions": versions(),
        "input_ids": INPUT_IDS,
        "logits_shape": list(logits.shape),
        "logits": r6(logits),
        "greedy": {
            "n": N_GREEDY,
            "method": "mlx_lm.generate.generate_step (KV cache, argmax), no EOS",
            "tokens": toks,
            "top2_gap": [float(f"{g:.6g}") for g in gaps],
            "min_top2_gap": float(f"{min(gaps):.6g}"),
            # log-softmax of the logits at each generation step, [N_GREEDY, vocab]
            "step_logprobs": r6(step_logits),
        },
        "stats": {
            "logit_abs_max": float(f"{scale:.6g}"),
            "logit_std": float(f"{float(logits.std()):.6g}"),
            "rerun_max_abs_diff": float(np.abs(logits - logits2).max()),
            "cache_vs_full_logprob_max_abs_diff": float(f"{cache_vs_full:.3g}"),
        },
    }
    if dtype != "float32":
        # Same weights upcast to float32: what an f32 compute path should give.
        model.set_dtype(mx.float32)
        up = forward_logits(model, INPUT_IDS)
        golden["logits_upcast_f32"] = r6(up)
        golden["stats"]["native_vs_upcast_max_abs_diff"] = float(
            f"{float(np.abs(up - logits).max()):.3g}"
        )
    if config.get("rope_scaling") and not config.get("quantization"):
        # Sanity check that the scaling matters at these positions.
        cfg = json.loads((out / "config.json").read_text())
        cfg.pop("rope_scaling")
        mc, ac = _get_classes(cfg)
        plain = mc(ac.from_dict(cfg))
        plain.update(model.parameters())
        golden["stats"]["rope_scaling_effect_max_abs_diff"] = float(
            f"{float(np.abs(forward_logits(plain, INPUT_IDS) - logits).max()):.3g}"
        )
    if spec.get("ablate"):
        # The same weights with these config keys changed: they visibly matter.
        cfg = {**json.loads((out / "config.json").read_text()), **spec["ablate"]}
        mc, ac = _get_classes(cfg)
        other = mc(ac.from_dict(cfg))
        if cfg.get("quantization"):
            nn.quantize(other, **{k: cfg["quantization"][k] for k in ("group_size", "bits")})
        other.update(model.parameters())
        golden["stats"]["ablation"] = spec["ablate"]
        golden["stats"]["ablation_effect_max_abs_diff"] = float(
            f"{float(np.abs(forward_logits(other, INPUT_IDS) - logits).max()):.3g}"
        )
    if config.get("quantization"):
        golden["quantization"] = config["quantization"]

    (out / "golden.json").write_text(json.dumps(golden, separators=(",", ":")) + "\n")
    dt = time.perf_counter() - t0
    size = sum(f.stat().st_size for f in out.iterdir())
    print(
        f"{name:22s} seed={seed} {dt:5.2f}s {size / 1024:6.0f} KiB  scale={scale:.3g} "
        f"min_gap={min(gaps):.3g} cache_vs_full={cache_vs_full:.2g} "
        + " ".join(f"{k}={v}" for k, v in golden["stats"].items() if k in (
            "native_vs_upcast_max_abs_diff", "rope_scaling_effect_max_abs_diff", "rerun_max_abs_diff",
            "ablation_effect_max_abs_diff"))
    )


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--only", default="", help="comma-separated variant names")
    args = ap.parse_args()
    mx.set_default_device(mx.cpu)
    vs = variants()
    names = [n for n in args.only.split(",") if n] or list(vs)
    t0 = time.perf_counter()
    for n in names:
        build(n, vs[n], args.out)
    print(f"total {time.perf_counter() - t0:.1f}s; mlx {mx.__version__}, mlx-lm {md.version('mlx-lm')}")


if __name__ == "__main__":
    sys.exit(main())
