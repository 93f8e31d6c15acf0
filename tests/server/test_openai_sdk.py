"""The official openai Python SDK against `mlxcel serve` (started by run.sh;
its base URL in MLXCEL_SERVER_URL): chat and legacy completions, streamed and
not, usage with cached tokens, logprobs, structured output, and the SDK's
own error classes for bad input and a bad key; embeddings from the
--embedding-model (all-MiniLM-L6-v2) in both encodings; speech to text from
the --whisper-model (whisper-tiny.en) with client.audio.transcriptions."""

import json
import os
from pathlib import Path

import openai
import pytest

BASE = os.environ["MLXCEL_SERVER_URL"] + "/v1"
KEY = os.environ.get("MLXCEL_SERVER_KEY", "sk-test")
MESSAGES = [
    {"role": "system", "content": "You are a terse assistant. Answer every question in as few words as you can, without any preamble."},
    {"role": "user", "content": "Name a primary color."},
]


@pytest.fixture(scope="module")
def client():
    return openai.OpenAI(base_url=BASE, api_key=KEY, max_retries=0, timeout=120)


def test_models_lists_the_served_model(client):
    models = client.models.list()
    assert [m.id for m in models.data] == ["smol", "all-MiniLM-L6-v2", "whisper-tiny.en"]


def test_chat_completion_with_usage_and_logprobs(client):
    r = client.chat.completions.create(model="smol", messages=MESSAGES, max_tokens=12, temperature=0, logprobs=True, top_logprobs=3)
    choice = r.choices[0]
    assert r.object == "chat.completion"
    assert choice.message.role == "assistant"
    assert choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert r.usage.completion_tokens == len(choice.logprobs.content) > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert all(len(t.top_logprobs) == 3 for t in choice.logprobs.content)
    assert all(t.logprob <= 0 for t in choice.logprobs.content)
    # The same conversation again: served from the prefix cache, same answer.
    again = client.chat.completions.create(model="smol", messages=MESSAGES, max_tokens=12, temperature=0)
    assert again.choices[0].message.content == choice.message.content
    assert again.usage.prompt_tokens_details.cached_tokens > 0


def test_streamed_chat_matches_the_unstreamed_one(client):
    whole = client.chat.completions.create(model="smol", messages=MESSAGES, max_completion_tokens=16, temperature=0)
    stream = client.chat.completions.create(
        model="smol", messages=MESSAGES, max_completion_tokens=16, temperature=0, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_legacy_completions_stream_and_not(client):
    r = client.completions.create(model="smol", prompt="The capital of France is", max_tokens=8, temperature=0, logprobs=2)
    assert r.object == "text_completion"
    text = r.choices[0].text
    assert text and len(r.choices[0].logprobs.tokens) == r.usage.completion_tokens == 8
    streamed = "".join(c.choices[0].text for c in client.completions.create(model="smol", prompt="The capital of France is", max_tokens=8, temperature=0, stream=True) if c.choices)
    assert streamed == text
    seeded = dict(model="smol", prompt="Once upon a time", max_tokens=12, temperature=1.0, seed=11)
    assert client.completions.create(**seeded).choices[0].text == client.completions.create(**seeded).choices[0].text


def test_json_schema_response_format(client):
    schema = {"type": "object", "properties": {"color": {"type": "string"}, "hex": {"type": "string"}}, "required": ["color", "hex"]}
    r = client.chat.completions.create(
        model="smol",
        messages=[{"role": "user", "content": "Give a color and its hex code as JSON."}],
        max_tokens=60,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "color", "schema": schema}},
    )
    value = json.loads(r.choices[0].message.content)
    assert isinstance(value["color"], str) and isinstance(value["hex"], str)


def test_bad_input_raises_the_sdk_error_naming_the_field(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="smol", messages=MESSAGES, temperature=-1)
    assert "temperature" in str(e.value)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="smol", messages=MESSAGES, n=3)
    assert "`n`" in str(e.value)


def test_a_wrong_key_is_refused():
    bad = openai.OpenAI(base_url=BASE, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def _cosine(a, b):
    dot = sum(x * y for x, y in zip(a, b))
    return dot / (sum(x * x for x in a) ** 0.5 * sum(y * y for y in b) ** 0.5)


def test_embeddings_in_both_encodings(client):
    texts = ["The cat sits on the mat.", "A kitten is resting on a rug.", "Stock prices fell sharply today."]
    # The SDK asks for base64 unless told otherwise, and decodes it.
    default = client.embeddings.create(model="all-MiniLM-L6-v2", input=texts)
    floats = client.embeddings.create(model="all-MiniLM-L6-v2", input=texts, encoding_format="float")
    assert [d.index for d in default.data] == [0, 1, 2]
    assert default.model == "all-MiniLM-L6-v2"
    assert default.usage.prompt_tokens == floats.usage.prompt_tokens > 3 * 2
    for a, b in zip(default.data, floats.data):
        assert len(a.embedding) == 384
        assert max(abs(x - y) for x, y in zip(a.embedding, b.embedding)) < 1e-7
    vectors = [d.embedding for d in floats.data]
    assert _cosine(vectors[0], vectors[1]) > 0.5 > 0.2 > _cosine(vectors[0], vectors[2])
    one = client.embeddings.create(model="all-MiniLM-L6-v2", input=texts[1], encoding_format="float")
    assert one.data[0].embedding == vectors[1]


def test_embeddings_refuse_other_dimensions(client):
    with pytest.raises(openai.BadRequestError) as error:
        client.embeddings.create(model="all-MiniLM-L6-v2", input="hi", dimensions=128)
    assert "dimensions" in str(error.value)


CLIPS = Path(__file__).resolve().parents[1] / "fixtures" / "audio"
FOX = "The quick brown fox jump over the lazy nog."


def test_audio_transcriptions(client):
    with open(CLIPS / "en_fox_us.flac", "rb") as f:
        r = client.audio.transcriptions.create(model="whisper-1", file=f)
    assert r.text == FOX
    with open(CLIPS / "en_fox_us.flac", "rb") as f:
        v = client.audio.transcriptions.create(model="whisper-1", file=f, response_format="verbose_json", language="en")
    assert v.text == FOX and v.language == "en" and abs(v.duration - 2.909) < 1e-3
    assert v.segments[0].text == " " + FOX and v.segments[0].start == 0.0
    with open(CLIPS / "en_fox_us.flac", "rb") as f:
        srt = client.audio.transcriptions.create(model="whisper-1", file=f, response_format="srt")
    assert srt.startswith("1\n00:00:00,000 --> ")
    with open(CLIPS / "en_fox_us.flac", "rb") as f:
        text = client.audio.transcriptions.create(model="whisper-1", file=f, response_format="text")
    assert text.strip() == FOX


def test_audio_errors(client):
    with pytest.raises(openai.BadRequestError) as error:
        client.audio.transcriptions.create(model="whisper-1", file=("clip.wav", b"this is not audio"))
    assert error.value.body["param"] == "file"
    with open(CLIPS / "en_fox_us.flac", "rb") as f, pytest.raises(openai.BadRequestError) as error:
        client.audio.translations.create(model="whisper-1", file=f)
    assert "English-only" in str(error.value)
