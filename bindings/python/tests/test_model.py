"""Loading, info, generation, streaming, chat and the tokenizer on SmolLM2-135M-Instruct."""

import os
import pathlib

import pytest

import mlxcel

PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


def test_package_files():
    root = pathlib.Path(mlxcel.__file__).parent
    assert (root / "py.typed").is_file()
    assert (root / "_mlxcel.pyi").is_file()
    assert mlxcel.MLX_VERSION == "0.32.4"
    assert mlxcel.__version__


def test_libmlx_comes_from_the_mlx_wheel():
    """The extension's rpath finds site-packages/mlx/lib/libmlx.so (mlx-cpu)."""
    maps = pathlib.Path("/proc/self/maps")
    if not maps.exists():
        pytest.skip("no /proc")
    libs = {line.split()[-1] for line in maps.read_text().splitlines() if "libmlx.so" in line}
    site = pathlib.Path(mlxcel.__file__).resolve().parent.parent
    assert libs == {str(site / "mlx" / "lib" / "libmlx.so")}


def test_info(model):
    info = model.info
    assert info.architecture == "llama"
    assert info.num_layers == 30
    assert info.hidden_size == 576
    assert info.vocab_size == 49152
    assert info.context_length == 8192
    assert 134_000_000 < info.parameters < 136_000_000
    assert 90_000_000 < info.bytes < 110_000_000  # 4-bit, 8-bit embeddings
    assert info.quantization == {"bits": 4, "group_size": 32}
    assert info.dtype in ("float32", "float16", "bfloat16")
    embed = [g for g in info.groups if "embed" in g["name"]]
    assert embed and embed[0]["quantization"] == {"bits": 8, "group_size": 32}
    d = info.to_dict()
    assert d["architecture"] == "llama" and d["num_layers"] == 30 and d["bytes"] == info.bytes
    assert "llama" in repr(info)
    assert "llama" in repr(model)
    assert os.path.isdir(model.path)
    assert model.eos_token_ids
    assert model.prefill_chunk == mlxcel.generation_defaults()["prefill_chunk"] == 512


def test_load_takes_a_packaged_model_by_name(model):
    # The default model's catalog name resolves to its cache directory (fetched on first use).
    by_name = mlxcel.load("SmolLM2-135M-Instruct", progress=False)
    assert by_name.path == model.path
    assert by_name.generate(PROMPT, max_tokens=8) == model.generate(PROMPT, max_tokens=8)
    with pytest.raises(mlxcel.ModelLoadError, match="no such model directory"):
        mlxcel.load("no-such-packaged-model-q4", progress=False)


def test_generate_greedy_is_deterministic(model):
    a = model.generate(PROMPT, max_tokens=8)
    assert isinstance(a, str) and a.strip()
    assert model.generate(PROMPT, max_tokens=8) == a


def test_token_prompt_matches_text_prompt(model):
    ids = model.tokenize(PROMPT)
    assert model.generate(ids, max_tokens=8) == model.generate(PROMPT, max_tokens=8)
    assert model.generate(tuple(ids), max_tokens=4) == model.generate(PROMPT, max_tokens=4)


def test_stream_chunks_concatenate_to_generate(model):
    full = model.generate(PROMPT, max_tokens=16)
    stream = model.stream(PROMPT, max_tokens=16)
    assert stream.finish_reason is None and stream.stats is None
    chunks = list(stream)
    assert len(chunks) >= 2
    assert "".join(c.text for c in chunks) == full
    *body, last = chunks
    assert all(c.finish_reason is None and isinstance(c.token, int) and c.text for c in body)
    assert last.finish_reason in ("stop", "length") and last.text == "" and last.token is None
    assert stream.finish_reason == last.finish_reason
    assert stream.text == full
    assert 1 <= len(stream.tokens) <= 16
    stats = stream.stats
    assert stats["generated_tokens"] == len(stream.tokens)
    assert stats["prompt_tokens"] == len(model.tokenize(PROMPT))
    assert stats["time_to_first_token"] > 0
    assert stats["kv_cache_bytes"] > 0
    assert stats["process_peak_memory_bytes"] >= model.info.bytes
    assert stats["cached_tokens"] == 0  # a short prompt never uses the prefix cache
    assert list(stream) == []  # exhausted
    assert "Chunk(" in repr(last)


def test_max_tokens_gives_length(model):
    stream = model.stream("Count: 1, 2, 3,", max_tokens=3)
    chunks = list(stream)
    assert chunks[-1].finish_reason == "length"
    assert len(stream.tokens) == 3


def test_stop_strings(model):
    text = model.generate("List three colors: red,", max_tokens=24)
    assert "," in text
    stream = model.stream("List three colors: red,", max_tokens=24, stop=",")
    stopped = "".join(c.text for c in stream)
    assert "," not in stopped
    assert text.startswith(stopped)
    assert stream.finish_reason == "stop"
    assert model.generate("List three colors: red,", max_tokens=24, stop=[",", "\n"]) == stopped.split("\n")[0]


def test_seeded_sampling_is_reproducible(model):
    kw = dict(max_tokens=24, temperature=1.0, top_p=0.95, top_k=50, seed=1234)
    a = model.generate("Once upon a time", **kw)
    assert model.generate("Once upon a time", **kw) == a
    assert "".join(c.text for c in model.stream("Once upon a time", **kw)) == a
    others = {model.generate("Once upon a time", **{**kw, "seed": s}) for s in (1, 2, 3)}
    assert len(others | {a}) > 1


def test_sampling_parameters_are_accepted(model):
    out = model.generate(PROMPT, max_tokens=6, temperature=0.7, min_p=0.05, repetition_penalty=1.3, seed=7)
    assert isinstance(out, str)
    out = model.generate(PROMPT, max_tokens=6, repetition_penalty=1.2, repetition_context_size=4)
    assert isinstance(out, str)


# A prompt whose continuation repeats its own text, so prompt lookup drafts.
LIST = "<ul><li>one</li><li>two</li><li>three</li><li>"


def test_greedy_prompt_lookup_gives_the_tokens_of_plain_decoding(model):
    with model.stream(LIST, max_tokens=32) as plain:
        list(plain)
    with model.stream(LIST, max_tokens=32, speculation="prompt-lookup", draft_max=6) as spec:
        list(spec)
    assert spec.tokens == plain.tokens and spec.text == plain.text
    assert plain.stats["draft_tokens"] == plain.stats["accepted_tokens"] == 0
    assert 0 < spec.stats["accepted_tokens"] <= spec.stats["draft_tokens"], spec.stats
    assert model.generate(LIST, max_tokens=32, speculation="prompt-lookup") == plain.text
    assert model.generate_batch([LIST, PROMPT], max_tokens=16, speculation="prompt-lookup") == [
        model.generate(p, max_tokens=16) for p in (LIST, PROMPT)
    ]


def test_a_draft_model_keeps_the_greedy_tokens(model):
    # The model drafting for itself: it shares the tokenizer (the engine
    # drafts little or nothing with a draft as large as the model).
    drafted = mlxcel.load(draft_model=model.path)
    with drafted.stream(LIST, max_tokens=24, speculation="draft") as s:
        list(s)
    assert s.text == model.generate(LIST, max_tokens=24)
    assert s.stats["accepted_tokens"] <= s.stats["draft_tokens"]


COLOUR_SCHEMA = {
    "type": "object",
    "properties": {"colour": {"enum": ["red", "green", "blue"]}},
    "required": ["colour"],
    "additionalProperties": False,
}
COLOURS = [{"colour": c} for c in ("red", "green", "blue")]
SKY = [{"role": "user", "content": "What colour is the sky? Answer in JSON."}]


def test_json_schema_constrains_the_output(model):
    import json

    as_text = model.chat(SKY, max_tokens=32, json_schema=json.dumps(COLOUR_SCHEMA))
    assert json.loads(as_text) in COLOURS, as_text
    assert model.chat(SKY, max_tokens=32, json_schema=COLOUR_SCHEMA) == as_text
    with model.chat_stream(SKY, max_tokens=32, json_schema=COLOUR_SCHEMA, temperature=1.0, seed=3) as s:
        list(s)
    assert json.loads(s.text) in COLOURS and s.finish_reason == "stop", s.text
    assert s.stats["mask_time"] > 0
    sampled = model.generate_batch(["Pick a colour:", "Name one:"], max_tokens=32, json_schema=COLOUR_SCHEMA, temperature=1.0, seed=1)
    assert all(json.loads(t) in COLOURS for t in sampled), sampled
    with model.stream(PROMPT, max_tokens=2) as plain:
        list(plain)
    assert plain.stats["mask_time"] == 0


def test_regex_and_grammar_constrain_the_output(model):
    assert model.chat(SKY, max_tokens=16, regex="(yes|no)") in ("yes", "no")
    lark = 'start: "The sky is " colour "."\ncolour: "red" | "green" | "blue"'
    assert model.generate(PROMPT, max_tokens=16, grammar=lark) in [f"The sky is {c}." for c in ("red", "green", "blue")]


def test_chat_with_the_smollm2_template(model):
    rendered = model.apply_chat_template(CHAT)
    assert rendered.startswith("<|im_start|>system\n")
    assert "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n" in rendered
    assert rendered.endswith("<|im_start|>assistant\n")
    without = model.apply_chat_template(CHAT, add_generation_prompt=False)
    assert not without.endswith("<|im_start|>assistant\n") and rendered.startswith(without)
    system = model.apply_chat_template([{"role": "system", "content": "Be brief."}] + CHAT)
    assert system.startswith("<|im_start|>system\nBe brief.<|im_end|>\n")

    reply = model.chat(CHAT, max_tokens=24)
    assert "Paris" in reply
    assert "<|im_end|>" not in reply
    stream = model.chat_stream(CHAT, max_tokens=24)
    assert "".join(c.text for c in stream) == reply
    assert stream.finish_reason in ("stop", "length")
    # The same as generating from the rendered template's tokens.
    ids = model.tokenize(rendered, add_special_tokens=False)
    assert model.generate(ids, max_tokens=24) == reply


def test_chat_accepts_extra_message_fields(model):
    messages = [{"role": "user", "content": "Hi", "name": "bob", "extra": [1, 2.5, None, True]}]
    assert model.apply_chat_template(messages).endswith("<|im_start|>assistant\n")


def test_tokenize_detokenize_round_trip(model):
    for text in ["Hello, world!", "  spaces\tand\nnewlines  ", "ünïcödé 你好 🙂", "<|im_start|>user"]:
        ids = model.tokenize(text, add_special_tokens=False)
        assert all(isinstance(i, int) for i in ids)
        assert model.detokenize(ids) == text
    special = model.tokenize("<|im_start|>user", add_special_tokens=False)
    assert special[0] == 1  # <|im_start|> is one special token in SmolLM2
    assert model.detokenize(special, skip_special_tokens=True) == "user"
    assert model.tokenize("") == [] or model.tokenize("", add_special_tokens=False) == []
    assert model.detokenize([]) == ""


def test_model_constructor_and_path_types(model):
    again = mlxcel.Model(pathlib.Path(model.path), prefill_chunk=16)
    assert again.prefill_chunk == 16
    assert again.generate(PROMPT, max_tokens=4) == model.generate(PROMPT, max_tokens=4)
    assert str(mlxcel.default_model_path()) == str(model.path)
