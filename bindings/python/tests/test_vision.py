"""Chat messages with image parts on the tiny random SmolVLM
(mlxcel-models/tests/data/tiny/smolvlm): paths, bytes and OpenAI's
image_url data URLs give the reference's greedy tokens (golden.json);
bad images and images for a text-only model raise InvalidParameter
naming `images`."""

import base64
import json
import pathlib

import pytest

import mlxcel

DIR = pathlib.Path(__file__).resolve().parents[3] / "mlxcel-models/tests/data/tiny/smolvlm"
GOLDEN = json.loads((DIR / "golden.json").read_text())
CASE = GOLDEN["cases"][0]
WANT = CASE["greedy_tokens"]
PNG = (DIR / "images/landscape.png").read_bytes()


@pytest.fixture(scope="module")
def vlm():
    return mlxcel.load(str(DIR))


def greedy_tokens(model, content):
    stream = model.chat_stream([{"role": "user", "content": content}], max_tokens=len(WANT), temperature=0.0)
    for _ in stream:
        pass
    return stream.tokens


def test_image_parts_give_the_reference_tokens(vlm):
    assert vlm.supports_images
    text = {"type": "text", "text": "Describe this image."}
    url = "data:image/png;base64," + base64.b64encode(PNG).decode()
    for image in (
        {"type": "image", "path": str(DIR / "images/landscape.png")},
        {"type": "image", "data": PNG},
        {"type": "image", "data": bytearray(PNG)},
        {"type": "image_url", "image_url": {"url": url}},
    ):
        assert greedy_tokens(vlm, [image, text]) == WANT, image["type"]
    # Two images within text (golden.json's second case).
    two = GOLDEN["cases"][1]
    images = iter(two["images"])
    content = [
        {"type": "image", "path": str(DIR / next(images))} if p["type"] == "image" else p for p in two["messages"][0]["content"]
    ]
    assert greedy_tokens(vlm, content) == two["greedy_tokens"]
    # The template sees the image parts.
    rendered = vlm.apply_chat_template([{"role": "user", "content": [{"type": "image", "data": PNG}, text]}])
    assert "<image>" in rendered


def test_bad_images_name_images(vlm):
    def fails(part, needle):
        with pytest.raises(mlxcel.InvalidParameter) as e:
            vlm.chat([{"role": "user", "content": [part, {"type": "text", "text": "Hi"}]}], max_tokens=2)
        assert e.value.name == "images", e.value
        assert needle in str(e.value)

    fails({"type": "image", "data": b"not an image"}, "not an image in a supported format")
    fails({"type": "image", "data": PNG[: len(PNG) // 3]}, "PNG")
    fails({"type": "image", "data": b""}, "empty")
    fails({"type": "image", "path": "/no/such/file.png"}, "/no/such/file.png")
    fails({"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}, "not fetched")
    with pytest.raises(TypeError, match="bytes"):
        vlm.chat([{"role": "user", "content": [{"type": "image", "data": "abc"}]}], max_tokens=2)
    with pytest.raises(mlxcel.InvalidParameter, match="not supported"):
        vlm.chat([{"role": "user", "content": [{"type": "video", "path": "a.mp4"}]}], max_tokens=2)


def test_images_for_a_text_only_model_name_its_architecture(model):
    assert not model.supports_images
    with pytest.raises(mlxcel.InvalidParameter) as e:
        model.chat([{"role": "user", "content": [{"type": "image", "data": PNG}, {"type": "text", "text": "Hi"}]}], max_tokens=2)
    assert e.value.name == "images"
    assert "`llama`, a text-only architecture" in str(e.value)
