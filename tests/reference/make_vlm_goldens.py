"""Write a tiny random SmolVLM (Idefics3) checkpoint plus golden outputs from mlx-vlm.

Usage (from the repository root):

    tests/reference/run.sh tests/reference/make_vlm_goldens.py [--out mlxcel-models/tests/data/tiny/smolvlm]

Writes <out>/:
  config.json, model.safetensors(.index.json)   mlx-vlm's smolvlm Model with seeded random weights,
                                                 saved by mlx_vlm.utils.save_weights / save_config
  tokenizer.json, tokenizer_config.json         a byte-level BPE trained here on a fixed text, with
  chat_template.json                             SmolVLM's special tokens and chat template
  preprocessor_config.json, processor_config.json  SmolVLM's image processor at tiny sizes
  images/                                        the test images (PNG, JPEG, RGBA PNG), generated here
  golden.json                                    ids, rows/cols, greedy tokens, metadata
  golden.safetensors                             pixel values, masks, vision and connector outputs, logits

Everything is computed from the checkpoint as mlx_vlm.utils.load reads it back from disk:
images through mlx_vlm.utils.load_image (EXIF transpose, convert("RGB")), the processor
(transformers' SmolVLMImageProcessorPil under mlx-vlm's SmolVLMProcessor), the vision tower,
the connector, the full-prompt logits, and 16 greedy tokens through mlx-vlm's generate_step.
"""

import argparse
import copy
import importlib.metadata as md
import json
import platform
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten
from PIL import Image

REPO = Path(__file__).resolve().parents[2]
DEFAULT_OUT = REPO / "mlxcel-models" / "tests" / "data" / "tiny" / "smolvlm"

N_GREEDY = 16
MIN_GAP = 0.05
MAX_ATTEMPTS = 30
SEED = 4242

MAX_ROWS = 4  # <row_i_col_j> tokens for i, j in 1..MAX_ROWS (size 192 / tile 64 needs 3)

# SmolVLM's chat template (HuggingFaceTB/SmolVLM-256M-Instruct, chat_template.json).
CHAT_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}"
    "{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}<end_of_utterance>\n"
    "{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Describe this image in one sentence.",
    "What is in the picture? A cat, a dog, a tree and a house.",
    "Compare the two images. Which one is brighter?",
    "User: Assistant: The image shows a red square on a blue background.",
]


def build_tokenizer(out):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<fake_token_around_image>", "<image>",
                "<end_of_utterance>", "<global-img>"]
    specials += [f"<row_{i}_col_{j}>" for i in range(1, MAX_ROWS + 1) for j in range(1, MAX_ROWS + 1)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 4, trainer)
    tok.save(str(out / "tokenizer.json"))
    added = {str(tok.token_to_id(s)): {"content": s, "lstrip": False, "normalized": False, "rstrip": False,
                                       "single_word": False, "special": True} for s in specials}
    (out / "tokenizer_config.json").write_text(json.dumps({
        "added_tokens_decoder": added,
        "additional_special_tokens": ["<fake_token_around_image>", "<image>", "<end_of_utterance>"],
        "bos_token": "<|im_start|>",
        "eos_token": "<end_of_utterance>",
        "pad_token": "<|im_end|>",
        "unk_token": "<|endoftext|>",
        "clean_up_tokenization_spaces": False,
        "model_max_length": 8192,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "processor_class": "SmolVLMProcessor",
        "chat_template": CHAT_TEMPLATE,
    }, indent=2))
    (out / "chat_template.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}, indent=2))
    return tok


def write_processor_files(out, image_seq_len):
    (out / "preprocessor_config.json").write_text(json.dumps({
        "do_convert_rgb": True,
        "do_image_splitting": True,
        "do_normalize": True,
        "do_pad": True,
        "do_rescale": True,
        "do_resize": True,
        "image_mean": [0.5, 0.5, 0.5],
        "image_processor_type": "SmolVLMImageProcessor",
        "image_std": [0.5, 0.5, 0.5],
        "max_image_size": {"longest_edge": 64},
        "processor_class": "SmolVLMProcessor",
        "resample": 1,
        "rescale_factor": 1 / 255,
        "size": {"longest_edge": 192},
    }, indent=2))
    (out / "processor_config.json").write_text(json.dumps({
        "image_seq_len": image_seq_len,
        "processor_class": "SmolVLMProcessor",
    }, indent=2))


def make_images(out):
    """Three small images of different sizes and aspect ratios, seeded."""
    rng = np.random.default_rng(7)
    images = out / "images"
    images.mkdir()

    def smooth(h, w, c):
        y, x = np.mgrid[0:h, 0:w].astype(np.float64)
        base = np.stack([
            127 + 100 * np.sin(x / 7.0 + k) * np.cos(y / 11.0 - k) for k in range(c)
        ], -1)
        return np.clip(base + rng.normal(0, 25, (h, w, c)), 0, 255).astype(np.uint8)

    Image.fromarray(smooth(75, 100, 3), "RGB").save(images / "landscape.png")
    Image.fromarray(smooth(130, 50, 3), "RGB").save(images / "portrait.jpg", quality=90)
    rgba = smooth(40, 40, 4)
    rgba[..., 3] = np.where(rgba[..., 3] > 127, 255, rgba[..., 3])  # some transparency
    Image.fromarray(rgba, "RGBA").save(images / "square_rgba.png")
    return ["images/landscape.png", "images/portrait.jpg", "images/square_rgba.png"]


def tiny_config(tok):
    text = {
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_hidden_layers": 2,
        "rms_norm_eps": 1e-5,
        "rope_theta": 100000.0,
        "vocab_size": tok.get_vocab_size(),
        "max_position_embeddings": 2048,
        "tie_word_embeddings": False,
    }
    vision = {
        "model_type": "smolvlm_vision",
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_attention_heads": 2,
        "num_hidden_layers": 2,
        "image_size": 64,
        "patch_size": 16,
        "num_channels": 3,
        "layer_norm_eps": 1e-6,
    }
    return {
        "architectures": ["SmolVLMForConditionalGeneration"],
        "model_type": "smolvlm",
        "image_token_id": tok.token_to_id("<image>"),
        "scale_factor": 2,
        "vocab_size": tok.get_vocab_size(),
        "eos_token_id": [tok.token_to_id("<end_of_utterance>")],
        "text_config": text,
        "vision_config": vision,
        "torch_dtype": "float32",
    }


def init_model(config, seed):
    from mlx_vlm.utils import get_model_and_args
    from mlx_vlm.models.smolvlm import ModelConfig, TextConfig, VisionConfig

    mx.random.seed(seed)
    cfg = ModelConfig.from_dict(config)
    cfg.text_config = TextConfig.from_dict(config["text_config"])
    cfg.vision_config = VisionConfig.from_dict(config["vision_config"])
    module, _ = get_model_and_args(config)
    model = module.Model(cfg)
    key = mx.random.key(seed)
    params = []
    for i, (name, p) in enumerate(tree_flatten(model.parameters())):
        k = mx.random.split(key, i + 2)[i + 1]
        if name == "language_model.norm.weight":
            p = 3.0 * (1.0 + 0.2 * mx.random.normal(p.shape, key=k))
        elif name.endswith("norm.weight") or name.endswith("layer_norm1.weight") or name.endswith("layer_norm2.weight") \
                or name.endswith("post_layernorm.weight"):
            p = 1.0 + 0.2 * mx.random.normal(p.shape, key=k)
        elif name.endswith(".bias"):
            p = 0.1 * mx.random.normal(p.shape, key=k)
        elif name.endswith("position_embedding.weight") or name.endswith("embed_tokens.weight"):
            p = 0.5 * mx.random.normal(p.shape, key=k)
        elif name == "connector.modality_projection.proj.weight":
            # Image features as large as the token embeddings, so the images visibly steer the logits.
            p = 0.3 * mx.random.normal(p.shape, key=k)
        params.append((name, p))
    model.update(tree_unflatten(params))
    mx.eval(model.parameters())
    return model


def versions():
    return {k: md.version(k) for k in ("mlx", "mlx-vlm", "transformers", "numpy", "pillow", "tokenizers")} | {
        "python": platform.python_version()}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args()
    mx.set_default_device(mx.cpu)
    out = args.out
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)

    from mlx_vlm.utils import load, load_image, save_config, save_weights
    from mlx_vlm.generate.ar import generate_step

    tok = build_tokenizer(out)
    config = tiny_config(tok)
    v = config["vision_config"]
    image_seq_len = (v["image_size"] // v["patch_size"]) ** 2 // config["scale_factor"] ** 2
    write_processor_files(out, image_seq_len)
    image_files = make_images(out)

    cases = [
        {"name": "one_image", "images": [0],
         "messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe this image."}]}]},
        {"name": "two_images", "images": [1, 2],
         "messages": [{"role": "user", "content": [
             {"type": "text", "text": "Compare "}, {"type": "image"}, {"type": "text", "text": " and "},
             {"type": "image"}, {"type": "text", "text": "."}]}]},
    ]

    for attempt in range(MAX_ATTEMPTS):
        seed = SEED + 100 * attempt
        for f in out.glob("model*.safetensors*"):
            f.unlink()
        model = init_model(copy.deepcopy(config), seed)
        save_weights(out, model)
        save_config(copy.deepcopy(config), out / "config.json")
        del model
        model, processor = load(str(out))
        tensors = {}
        results = []
        ok = True
        for case in cases:
            images = [load_image(str(out / image_files[i])) for i in case["images"]]
            prompt = processor.apply_chat_template(case["messages"], add_generation_prompt=True)
            inputs = processor(text=[prompt], images=[images])
            ids = inputs["input_ids"]
            pv = inputs["pixel_values"]
            pam = inputs["pixel_attention_mask"]
            n = case["name"]
            # Vision tower and connector on the real (all) tiles.
            b, t, c, h, w = pv.shape
            flat = pv.reshape(b * t, c, h, w)
            vision, *_ = model.vision_model(flat.transpose(0, 2, 3, 1), patch_attention_mask=None)
            connector = model.connector(vision.astype(flat.dtype))
            logits = model(ids, pv, pixel_attention_mask=pam).logits[0].astype(mx.float32)
            toks, gaps = [], []
            for (tok_id, logprobs), _ in zip(
                generate_step(ids, model, pv, None, max_tokens=N_GREEDY, temperature=0.0, pixel_attention_mask=pam),
                range(N_GREEDY),
            ):
                lp = np.array(logprobs.astype(mx.float32)).reshape(-1)
                top2 = np.sort(lp)[-2:]
                toks.append(int(tok_id))
                gaps.append(float(top2[1] - top2[0]))
            if min(gaps) < MIN_GAP:
                ok = False
                break
            # The same prompt with every tile's pixels replaced by another image's: the images matter.
            other = mx.array(np.roll(np.array(pv), 1, axis=1)) if t > 1 else pv * 0.5
            ablated = model(ids, other, pixel_attention_mask=pam).logits[0].astype(mx.float32)
            mx.eval(vision, connector, logits, ablated)
            tensors[f"{n}.vision"] = np.array(vision)
            tensors[f"{n}.connector"] = np.array(connector)
            tensors[f"{n}.logits"] = np.array(logits)
            results.append({
                "name": n,
                "messages": case["messages"],
                "images": [image_files[i] for i in case["images"]],
                "prompt": prompt,
                "input_ids": np.array(ids[0]).tolist(),
                "greedy_tokens": toks,
                "greedy_top2_gap": [float(f"{g:.6g}") for g in gaps],
                "logit_abs_max": float(np.abs(np.array(logits)).max()),
                "tiles_rolled_logit_max_abs_diff": float(np.abs(np.array(logits) - np.array(ablated)).max()),
                # At the last prompt position (what the first greedy token comes from).
                "tiles_rolled_last_logit_max_abs_diff": float(np.abs(np.array(logits[-1]) - np.array(ablated[-1])).max()),
            })
        if ok:
            break
    else:
        raise SystemExit(f"no seed with min top-2 gap >= {MIN_GAP}")

    # Each image alone through the image processor: pixel values, mask, rows and cols.
    per_image = []
    for i, f in enumerate(image_files):
        img = load_image(str(out / f))
        feats = processor.image_processor([[img]], return_row_col_info=True)
        tensors[f"image{i}.pixel_values"] = np.asarray(feats["pixel_values"][0], dtype=np.float32)
        tensors[f"image{i}.pixel_attention_mask"] = np.asarray(feats["pixel_attention_mask"][0]).astype(np.int32)
        tensors[f"image{i}.rgb"] = np.asarray(img, dtype=np.uint8)
        per_image.append({"file": f, "size": list(img.size), "rows": int(feats["rows"][0][0]),
                          "cols": int(feats["cols"][0][0])})

    from safetensors.numpy import save_file
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(out / "golden.safetensors"))
    golden = {
        "seed": seed,
        "seed_attempts": attempt + 1,
        "versions": versions(),
        "image_seq_len": image_seq_len,
        "image_token_id": config["image_token_id"],
        "images": per_image,
        "cases": results,
        "greedy_method": "mlx_vlm.generate.ar.generate_step, temperature 0, no EOS",
    }
    (out / "golden.json").write_text(json.dumps(golden, indent=1) + "\n")
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    print(f"smolvlm seed={seed} attempts={attempt + 1} {size / 1024:.0f} KiB "
          + " ".join(f"{r['name']}: {len(r['input_ids'])} ids, min_gap={min(r['greedy_top2_gap']):.3g}" for r in results))


if __name__ == "__main__":
    main()
