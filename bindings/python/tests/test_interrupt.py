"""Ctrl-C and cancellation: KeyboardInterrupt within a fraction of a second,
even in the middle of a long prompt."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

import mlxcel

CHILD = textwrap.dedent(
    """
    import signal, sys, time, mlxcel
    # Python leaves SIGINT ignored when it starts with it ignored (a
    # background job of a non-interactive shell): Ctrl-C is what is tested.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    model = mlxcel.load()
    prompt = "The quick brown fox jumps over the lazy dog. " * 700  # ~7000 tokens
    mode = sys.argv[1]
    print("READY", flush=True)
    try:
        if mode == "generate":
            model.generate(prompt, max_tokens=64)
        elif mode == "chat_stream":
            for chunk in model.chat_stream([{"role": "user", "content": prompt}], max_tokens=64):
                pass
        print("FINISHED", flush=True)
    except KeyboardInterrupt:
        print("INTERRUPTED", time.monotonic(), flush=True)
        sys.exit(42)
    """
)


@pytest.mark.parametrize("mode", ["generate", "chat_stream"])
@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
def test_sigint_during_a_long_prompt_raises_keyboard_interrupt(mode):
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, mode],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout.readline().strip() == "READY"
        time.sleep(1.0)  # well inside the prefill of ~7000 tokens
        assert child.poll() is None
        sent = time.monotonic()
        child.send_signal(signal.SIGINT)
        line = child.stdout.readline().split()
        stdout, stderr = child.communicate(timeout=60)
        exited = time.monotonic()
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert line and line[0] == "INTERRUPTED", (line, stderr)
    raised_after = float(line[1]) - sent  # CLOCK_MONOTONIC is system-wide
    print(f"{mode}: KeyboardInterrupt {raised_after * 1000:.0f} ms after SIGINT, exit after {exited - sent:.2f} s")
    assert raised_after < 2.0
    assert child.returncode == 42, stderr
    # The cancelled generation stops at its next prefill chunk; exit waits for it.
    assert exited - sent < 30


def test_close_cancels_a_stream(model):
    prompt = "The quick brown fox jumps over the lazy dog. " * 200
    with model.stream(prompt, max_tokens=200) as stream:
        pass  # never iterated: closing cancels the prefill
    assert list(stream) == []
    stream = model.stream("Once upon a time, in a land far away,", max_tokens=200)
    first = next(stream)
    assert first.token is not None
    stream.close()
    assert list(stream) == []
    # The cancelled row has left the batch: a new generation runs alone and as usual.
    assert model.generate("The capital of France is", max_tokens=3).startswith(" Paris")


def test_dropping_a_stream_cancels_it(model):
    stream = model.stream("Once upon a time, in a land far away,", max_tokens=500)
    next(stream)
    del stream
    assert model.generate("The capital of France is", max_tokens=3).startswith(" Paris")
