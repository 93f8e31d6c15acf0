"""The official openai Python SDK against `mlxcel serve` (started by run.sh;
its base URL in MLXCEL_SERVER_URL): chat and legacy completions, streamed and
not, usage with cached tokens, logprobs, structured output, and the SDK's
own error classes for bad input and a bad key."""

import json
import os

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
    assert [m.id for m in models.data] == ["smol"]


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
