"""Make a tiny stand-in for the converted SmolLM2 checkpoint, to exercise
make_smollm2_goldens.py without the real model (no network needed).

    tests/reference/run.sh tests/reference/make_dev_checkpoint.py /tmp/dev-smollm2
    tests/reference/run.sh tests/reference/make_smollm2_goldens.py \
        --model /tmp/dev-smollm2 --out /tmp/dev-smollm2.json

The stand-in has SmolLM2's layout in miniature: llama, tied embeddings, 4-bit
affine group-32 weights with float16 scales/biases, a byte-level BPE tokenizer
(vocab 512, trained here on a few sentences) with <|im_start|>/<|im_end|> and
a ChatML chat template.
"""
import copy
import sys
from pathlib import Path

import mlx.core as mx
from mlx_lm.utils import _get_classes, quantize_model, save_config, save_model
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant.<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CORPUS = [
    "The capital of France is Paris. Once upon a time, in a small village, there lived",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)",
    "What is the capital of France? Write a haiku about the sea. The sea is blue and wide.",
] * 20


def main(out):
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS, trainer)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        unk_token="<|endoftext|>",
        pad_token="<|im_end|>",
    )
    hf.chat_template = CHATML
    hf.save_pretrained(out)

    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "vocab_size": 512,
        "rms_norm_eps": 1e-5,
        "rope_theta": 100000.0,
        "max_position_embeddings": 2048,
        "tie_word_embeddings": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "float16",
    }
    mx.random.seed(7)
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    model.set_dtype(mx.float16)
    model, config = quantize_model(model, copy.deepcopy(config), 32, 4, mode="affine")
    save_model(out, model)
    save_config(config, out / "config.json")
    print(f"wrote {out}")


if __name__ == "__main__":
    main(sys.argv[1])
