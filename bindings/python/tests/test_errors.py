"""Bad input: clear exceptions of the right class."""

import json
import os
import pathlib
import shutil

import pytest

import mlxcel
from mlxcel import GenerationError, InvalidParameter, MlxcelError, ModelLoadError, TokenizerError


def test_exception_hierarchy():
    for cls in (ModelLoadError, InvalidParameter, GenerationError, TokenizerError):
        assert issubclass(cls, MlxcelError)
    assert issubclass(InvalidParameter, ValueError)
    assert issubclass(MlxcelError, Exception)
    assert MlxcelError.__module__ == "mlxcel"


def test_bad_path_raises_model_load_error(tmp_path):
    with pytest.raises(ModelLoadError, match="no such model directory"):
        mlxcel.load(tmp_path / "does-not-exist")
    with pytest.raises(ModelLoadError):
        mlxcel.load(str(tmp_path))  # empty directory: no config.json / tokenizer
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(MlxcelError):
        mlxcel.load(tmp_path)


def test_unknown_architecture(tmp_path, model):
    import shutil

    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{model.path}/{name}", tmp_path / name)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "no-such-arch"}))
    with pytest.raises(ModelLoadError, match="no-such-arch"):
        mlxcel.load(tmp_path)


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"temperature": -1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"min_p": 2.0}, "min_p"),
        ({"top_k": -1}, "top_k"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -5}, "max_tokens"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_context_size": -1}, "repetition_context_size"),
        ({"seed": -1}, "seed"),
        ({"seed": 2**64}, "seed"),
    ],
)
def test_invalid_parameters(model, kwargs, name):
    for call in (
        lambda: model.generate("Hi", **kwargs),
        lambda: model.stream("Hi", **kwargs),
        lambda: model.chat([{"role": "user", "content": "Hi"}], **kwargs),
        lambda: model.chat_stream([{"role": "user", "content": "Hi"}], **kwargs),
    ):
        with pytest.raises(InvalidParameter) as err:
            call()
        assert err.value.name == name
        assert name in str(err.value)


def test_bad_prompts(model):
    with pytest.raises(InvalidParameter, match="empty"):
        model.generate([])
    with pytest.raises(InvalidParameter, match="vocabulary"):
        model.generate([10**6])
    with pytest.raises(InvalidParameter, match="context"):
        model.generate([42] * 9000, max_tokens=1)
    with pytest.raises(InvalidParameter):
        model.generate([-1])
    with pytest.raises(InvalidParameter):
        mlxcel.load(model.path, prefill_chunk=0)


@pytest.mark.parametrize(
    "call",
    [
        lambda m: m.generate(123),
        lambda m: m.generate(None),
        lambda m: m.generate(b"bytes"),
        lambda m: m.generate(["a", "b"]),
        lambda m: m.generate({"role": "user"}),
        lambda m: m.generate("Hi", temperature="hot"),
        lambda m: m.generate("Hi", max_tokens=1.5),
        lambda m: m.generate("Hi", max_tokens="8"),
        lambda m: m.generate("Hi", seed="x"),
        lambda m: m.generate("Hi", stop=5),
        lambda m: m.generate("Hi", stop=["ok", 5]),
        lambda m: m.generate("Hi", no_such_option=1),
        lambda m: m.generate("Hi", 8),  # options are keyword-only
        lambda m: m.stream(3.5),
        lambda m: m.chat("Hello"),
        lambda m: m.chat({"role": "user", "content": "Hi"}),
        lambda m: m.chat(["Hello"]),
        lambda m: m.chat([{"content": "no role"}]),
        lambda m: m.chat([{"role": 1, "content": "Hi"}]),
        lambda m: m.chat([{"role": "user", "content": 5}]),
        lambda m: m.chat([{"role": "user", "content": object()}]),
        lambda m: m.chat_stream(None),
        lambda m: m.apply_chat_template("Hello"),
        lambda m: m.tokenize(b"bytes"),
        lambda m: m.tokenize(None),
        lambda m: m.detokenize("abc"),
        lambda m: m.detokenize([1, "2"]),
        lambda m: mlxcel.load(42),
    ],
)
def test_wrong_types_raise_type_error(model, call):
    with pytest.raises(TypeError):
        call(model)


# The engine holds the defaults, the checks and the error kinds: C
# (mlxcel-capi/tests/facade.rs) and Node (test/mlxcel.test.js) check the
# same messages and codes.

def test_defaults_are_the_engines(model):
    defaults = mlxcel.generation_defaults()
    assert defaults == {
        "max_tokens": 256,
        "temperature": 0.0,
        "top_p": 1.0,
        "top_k": 0,
        "min_p": 0.0,
        "repetition_penalty": 1.0,
        "repetition_context_size": 20,
        "seed": None,
        "stop": [],
        "prefill_chunk": 512,
        "frequency_penalty": 0.0,
        "presence_penalty": 0.0,
        "dry_multiplier": 0.0,
        "dry_base": 1.75,
        "dry_allowed_length": 2,
        "dry_penalty_last_n": -1,
        "dry_sequence_breakers": ["\n", ":", '"', "*"],
        "top_n_sigma": -1.0,
        "typical_p": 1.0,
        "xtc_probability": 0.0,
        "xtc_threshold": pytest.approx(0.1),
        "min_keep": 0,
        "logit_bias": {},
        "samplers": ["penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc", "temperature"],
        "speculation": "off",
        "draft_max": 8,
        "draft_min": 0,
    }
    # Omitted arguments mean exactly the engine's defaults.
    prompt = "Once upon a time"
    explicit = {k: v for k, v in defaults.items() if k != "prefill_chunk"}
    assert model.generate(prompt) == model.generate(prompt, **explicit)


def test_the_sampler_chain(model):
    import math
    greedy = model.generate("The capital of France is", max_tokens=6)
    first = model.tokenize(greedy, add_special_tokens=False)[0]
    banned = model.generate("The capital of France is", max_tokens=6, logit_bias={first: -math.inf})
    assert not banned.startswith(greedy[:3]), banned
    kw = dict(max_tokens=16, temperature=0.9, top_k=40, dry_multiplier=0.8, xtc_probability=0.5,
              samplers="penalties;dry;top_k;xtc;temperature", seed=5)
    assert model.generate("Once upon a time", **kw) == model.generate("Once upon a time", **kw)
    assert model.generate_batch(["Once upon a time", "Hello"], **kw)[0] == model.generate("Once upon a time", **kw)
    for kwargs, name in [({"samplers": ["top_k", "mirostat"]}, "samplers"), ({"typical_p": 0}, "typical_p"),
                         ({"logit_bias": {10**6: 1.0}}, "logit_bias"), ({"dry_allowed_length": 0}, "dry_allowed_length")]:
        with pytest.raises(InvalidParameter) as err:
            model.generate("Hi", max_tokens=2, **kwargs)
        assert err.value.name == name, kwargs
    with pytest.raises(TypeError, match="unexpected keyword argument `mirostat`"):
        model.generate("Hi", mirostat=2)
    with pytest.raises(TypeError, match="logit_bias"):
        model.generate("Hi", logit_bias=[1, 2])


def test_logprobs_stream_with_their_chunks(model):
    with model.stream("The capital of France is", max_tokens=6, logprobs=3) as s:
        chunks = list(s)
    streamed = [l for c in chunks for l in c.logprobs]
    assert [l.token for l in streamed] == s.tokens
    assert [(l.token, l.logprob, l.top_logprobs) for l in streamed] == [(l.token, l.logprob, l.top_logprobs) for l in s.logprobs]
    first = streamed[0]
    assert len(first.top_logprobs) == 3 and first.top_logprobs[0][0] == first.token and first.logprob < 0
    with model.stream("The capital of France is", max_tokens=3, logprobs=2, post_sampling_probs=True) as s:
        list(s)
    assert all(l.logprob == 0.0 for l in s.logprobs)
    with pytest.raises(InvalidParameter) as err:
        model.generate("Hi", logprobs=21)
    assert err.value.name == "logprobs"


def test_bad_speculation_is_refused_by_name(model, tmp_path):
    with pytest.raises(InvalidParameter) as err:
        model.generate("Hi", max_tokens=2, speculation="nonsense")
    assert err.value.name == "speculation"
    assert "`speculation`" in str(err.value) and "nonsense" in str(err.value)
    with pytest.raises(InvalidParameter) as err:
        model.stream("Hi", max_tokens=2, speculation="nonsense")
    assert err.value.name == "speculation"
    with pytest.raises(InvalidParameter) as err:  # no draft model loaded
        model.generate("Hi", max_tokens=2, speculation="draft")
    assert err.value.name == "speculation"
    for kwargs, name in [({"draft_max": 15}, "draft_max"), ({"draft_max": 4, "draft_min": 5}, "draft_min")]:
        with pytest.raises(InvalidParameter) as err:
            model.generate("Hi", max_tokens=2, speculation="prompt-lookup", **kwargs)
        assert err.value.name == name, kwargs
    with pytest.raises(TypeError, match="speculation"):
        model.generate("Hi", speculation=1)
    with pytest.raises(ModelLoadError, match="no such model directory"):
        mlxcel.load(draft_model=tmp_path / "no-draft")


def test_bad_constraints_are_refused_by_name(model):
    with pytest.raises(InvalidParameter) as err:
        model.generate("Hi", max_tokens=2, json_schema='{"type": ')
    assert err.value.name == "json_schema"
    assert "`json_schema`" in str(err.value)
    with pytest.raises(InvalidParameter) as err:  # a dict serialized, then refused by the engine
        model.generate("Hi", max_tokens=2, json_schema={"type": "nope"})
    assert err.value.name == "json_schema"
    for kwargs, name in [({"regex": "(unclosed"}, "regex"), ({"grammar": "start: undefined_rule"}, "grammar"),
                         ({"regex": "a", "grammar": 'start: "a"'}, "grammar")]:
        with pytest.raises(InvalidParameter) as err:
            model.generate("Hi", max_tokens=2, **kwargs)
        assert err.value.name == name, kwargs
    with pytest.raises(InvalidParameter) as err:  # compiled when the row opens: raised by the first chunk
        list(model.stream("Hi", json_schema='{"type": '))
    assert err.value.name == "json_schema"
    with pytest.raises(TypeError, match="json_schema"):
        model.generate("Hi", json_schema=1)
    with pytest.raises(TypeError, match="regex"):
        model.generate("Hi", regex=b"a")


def test_bad_parameters_give_the_engines_messages(model):
    with pytest.raises(InvalidParameter) as err:
        model.generate("Hi", top_k=-1)
    assert str(err.value) == "invalid parameter `top_k`: must be an integer in [0, 2**32) (0 = off), got -1"
    with pytest.raises(InvalidParameter) as err:
        model.generate("Hi", temperature=-1)
    assert str(err.value) == "invalid parameter `temperature`: must be a finite number >= 0, got -1"
    with pytest.raises(InvalidParameter) as err:
        model.generate("Hi", seed=2**200)
    assert err.value.name == "seed" and "2**64" in str(err.value)


def test_a_missing_chat_template_is_a_tokenizer_error_everywhere(model, tmp_path):
    import os

    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json"):
        os.symlink(f"{model.path}/{name}", tmp_path / name)
    with open(f"{model.path}/tokenizer_config.json") as f:
        config = json.load(f)
    config.pop("chat_template", None)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    bare = mlxcel.load(tmp_path)
    messages = [{"role": "user", "content": "Hi"}]
    with pytest.raises(TokenizerError) as rendered:
        bare.apply_chat_template(messages)
    with pytest.raises(TokenizerError) as generated:
        bare.chat(messages, max_tokens=2)
    assert str(rendered.value) == str(generated.value)


def test_kv_pool_budget(model):
    with pytest.raises(InvalidParameter, match="kv_pool_bytes") as err:
        mlxcel.load(kv_pool_bytes=1000)
    assert err.value.name == "kv_pool_bytes"
    small = mlxcel.load(kv_pool_bytes=8 << 20)  # 11 blocks of 16 positions
    with pytest.raises(InvalidParameter, match="more than the KV pool's budget of 8 MiB") as err:
        small.generate("Once upon a time", max_tokens=400)
    assert err.value.name == "max_tokens"
    # Requests that fit only one at a time wait for each other, with the
    # text each gets alone on the default pool.
    prompts = ["Once upon a time", "The capital of France is"]
    alone = [model.generate(p, max_tokens=90) for p in prompts]
    assert small.generate_batch(prompts, max_tokens=90) == alone


def test_rotating_kv_cache(model):
    for kwargs, name in [({"max_kv_size": 4}, "max_kv_size"), ({"max_kv_size": 64, "kv_keep": -1}, "kv_keep")]:
        with pytest.raises(InvalidParameter, match=name) as err:
            mlxcel.load(**kwargs)
        assert err.value.name == name
    rotating = mlxcel.load(max_kv_size=90)  # the first 4 positions and the latest 86
    prompt = "The quick brown fox jumps over the lazy dog. " * 25
    stats = []
    for m in (model, rotating):
        with m.stream(prompt, max_tokens=40) as s:
            "".join(c.text for c in s)
        stats.append(s.stats)
    full, windowed = stats
    positions = full["prompt_tokens"] + full["generated_tokens"] - 1
    block_bytes = full["kv_cache_bytes"] // -(-positions // 16)
    # Without a window every position's block; with one the kept block, the
    # window's and the block the last step still read.
    assert full["kv_cache_bytes"] >= 16 * block_bytes
    assert windowed["kv_cache_bytes"] <= 10 * block_bytes, windowed


def test_eight_bit_kv_cache(model):
    for bits in (4, 16, 0):
        with pytest.raises(InvalidParameter, match="kv_bits") as err:
            mlxcel.load(kv_bits=bits)
        assert err.value.name == "kv_bits"
    small = mlxcel.load(kv_bits=8)
    prompt = "The quick brown fox jumps over the lazy dog. " * 10
    stats = []
    texts = []
    for m in (model, small):
        with m.stream(prompt, max_tokens=24, temperature=0.0) as s:
            texts.append("".join(c.text for c in s))
        stats.append(s.stats)
    full, eight = stats
    # 72 bytes per position and head instead of 256, over the same blocks.
    assert eight["kv_cache_bytes"] * 256 == full["kv_cache_bytes"] * 72, stats
    assert texts[1].strip(), texts


def dense_tiny_llama(model, out):
    """The tiny random llama (f32, hidden 64) with the default model's tokenizer."""
    tiny = pathlib.Path(__file__).resolve().parents[3] / "mlxcel-models/tests/data/tiny/llama"
    for name in ("config.json", "model.safetensors", "model.safetensors.index.json"):
        shutil.copy(tiny / name, out / name)
    for name in os.listdir(model.path):
        if name.startswith("tokenizer"):
            shutil.copy(f"{model.path}/{name}", out / name)
    return out


def test_quantize_at_load(model, tmp_path):
    for kwargs, name in [
        (dict(q_bits=7), "q_bits"),
        (dict(q_bits=4, q_group_size=48), "q_group_size"),
        (dict(q_group_size=64), "q_group_size"),
    ]:
        with pytest.raises(InvalidParameter, match=name) as err:
            mlxcel.load(**kwargs)
        assert err.value.name == name
    with pytest.raises(ModelLoadError, match="already quantized"):
        mlxcel.load(q_bits=4)
    dense = mlxcel.load(dense_tiny_llama(model, tmp_path))
    quantized = mlxcel.load(tmp_path, q_bits=4, q_group_size=32)
    assert dense.info.quantization is None
    assert quantized.info.quantization == {"bits": 4, "group_size": 32}
    assert quantized.info.bytes < dense.info.bytes / 4
    assert isinstance(quantized.generate("a b c", max_tokens=4, temperature=0.0), str)
