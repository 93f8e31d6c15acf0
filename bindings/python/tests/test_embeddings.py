"""Embeddings and reranking from Python: ``load_embedder(...).embed`` and
``load_reranker(...).rerank`` are translations of the engine's Embedder and
Reranker, checked against the mlx-embeddings goldens that the Rust tests use
(tests/reference/goldens/all_minilm_l6_v2.json and minilm_rerank.json)."""

import json
import math
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np  # test.sh installs it: embed() returns NumPy arrays when it imports
import pytest

import mlxcel

REPO = Path(__file__).resolve().parents[3]
GOLDENS = REPO / "tests" / "reference" / "goldens"
# The engine's tolerance against mlx-embeddings (tests/embeddings.rs).
MIN_COSINE = 0.999999


def cosine(a, b):
    dot = sum(float(x) * float(y) for x, y in zip(a, b))
    return dot / math.sqrt(sum(float(x) ** 2 for x in a) * sum(float(y) ** 2 for y in b))


@pytest.fixture(scope="module")
def embedder() -> mlxcel.Embedder:
    return mlxcel.load_embedder()


@pytest.fixture(scope="module")
def goldens():
    return json.loads((GOLDENS / "all_minilm_l6_v2.json").read_text())["cases"]


def test_vectors_match_mlx_embeddings(embedder, goldens):
    assert embedder.dims == 384 and embedder.max_tokens == 256
    texts = [case["text"] for case in goldens]
    vectors = embedder.embed(texts)
    assert isinstance(vectors, np.ndarray) and vectors.dtype == np.float32
    assert vectors.shape == (len(texts), 384) and vectors.flags.writeable
    for case, vector in zip(goldens, vectors):
        assert cosine(vector, case["embedding"]) >= MIN_COSINE, case["text"]
    assert embedder.token_counts(texts) == [len(case["ids"]) for case in goldens]
    # One str gives one vector, the same as in the batch.
    single = embedder.embed(texts[1])
    assert single.shape == (384,)
    assert single.tolist() == vectors[1].tolist()


def test_without_numpy_vectors_are_lists(goldens):
    # A fresh interpreter where `import numpy` fails.
    code = (
        "import sys, json; sys.modules['numpy'] = None\n"
        "import mlxcel\n"
        "e = mlxcel.load_embedder(progress=False)\n"
        "v = e.embed(json.loads(sys.argv[1]))\n"
        "print(json.dumps([type(v).__name__, type(v[0]).__name__, v]))\n"
    )
    texts = [case["text"] for case in goldens[:3]]
    out = subprocess.run([sys.executable, "-c", code, json.dumps(texts)], capture_output=True, text=True, check=True)
    outer, inner, vectors = json.loads(out.stdout)
    assert (outer, inner) == ("list", "list")
    for case, vector in zip(goldens, vectors):
        assert len(vector) == 384 and cosine(vector, case["embedding"]) >= MIN_COSINE


def test_threads_get_the_same_vectors(embedder, goldens):
    texts = [case["text"] for case in goldens]
    alone = [embedder.embed([t])[0].tolist() for t in texts]
    results, errors = {}, []

    def work(i):
        try:
            order = texts[i:] + texts[:i]
            v = embedder.embed(order)
            results[i] = {t: row.tolist() for t, row in zip(order, v)}
        except Exception as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for i in range(1, 4):
        assert results[i] == results[0]
    for t, v in zip(texts, alone):
        assert results[0][t] == v


def test_embed_errors_name_what_is_wrong(embedder):
    with pytest.raises(mlxcel.InvalidParameter) as e:
        embedder.embed([])
    assert e.value.name == "input" and "no texts" in str(e.value)
    with pytest.raises(TypeError, match=r"`texts\[1\]` must be a str, not int"):
        embedder.embed(["a", 3])
    with pytest.raises(TypeError, match="`texts` must be a list of str"):
        embedder.embed({"a": 1})
    with pytest.raises(mlxcel.ModelLoadError, match="no such model directory"):
        mlxcel.load_embedder("/no/such/dir")
    # A language model is not an embedding model.
    with pytest.raises(mlxcel.ModelLoadError, match="llama"):
        mlxcel.load_embedder(mlxcel.default_model_path(progress=False))


@pytest.fixture(scope="module")
def cross_encoder_dir(embedder, tmp_path_factory):
    """The test cross-encoder: the real MiniLM encoder with a seeded one-label head."""
    out = tmp_path_factory.mktemp("cross-encoder")
    script = REPO / "tests" / "fixtures" / "make_cross_encoder.py"
    subprocess.run([sys.executable, str(script), str(embedder.path), str(out)], check=True, capture_output=True)
    return out


def test_rerank_matches_mlx_embeddings_bert_with_the_same_head(cross_encoder_dir):
    golden = json.loads((GOLDENS / "minilm_rerank.json").read_text())
    reranker = mlxcel.load_reranker(cross_encoder_dir)
    documents = [case["document"] for case in golden["cases"]]
    scores = reranker.rerank(golden["query"], documents)
    assert len(scores) == len(documents)
    worst = max(abs(s - case["score"]) for s, case in zip(scores, golden["cases"]))
    assert worst <= 2e-6, worst
    # Alone, a pair scores the same.
    assert reranker.rerank(golden["query"], [documents[2]]) == [scores[2]]


def test_rerank_errors_name_what_is_wrong(cross_encoder_dir, embedder):
    reranker = mlxcel.load_reranker(cross_encoder_dir)
    with pytest.raises(mlxcel.InvalidParameter) as e:
        reranker.rerank("q", [])
    assert e.value.name == "documents"
    with pytest.raises(TypeError, match="`documents` must be a list of str, not a str"):
        reranker.rerank("q", "a document")
    with pytest.raises(TypeError, match="`query` must be a str"):
        reranker.rerank(None, ["a"])
    with pytest.raises(mlxcel.ModelLoadError, match="no sequence-classification head"):
        mlxcel.load_reranker(embedder.path)
    with pytest.raises(mlxcel.ModelLoadError, match="load it as a reranker"):
        mlxcel.load_embedder(cross_encoder_dir)
