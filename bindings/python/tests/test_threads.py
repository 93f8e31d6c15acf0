"""One Model from several threads at once, with the GIL released."""

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import mlxcel

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Water boils at",
    "The three primary colors are",
]


def test_four_threads_match_sequential(model):
    sequential = [model.generate(p, max_tokens=16) for p in PROMPTS]
    sampled = model.generate(PROMPTS[0], max_tokens=16, temperature=0.8, seed=5)
    with ThreadPoolExecutor(max_workers=4) as pool:
        parallel = list(pool.map(lambda p: model.generate(p, max_tokens=16), PROMPTS))
        streamed = list(pool.map(lambda p: "".join(c.text for c in model.stream(p, max_tokens=16)), PROMPTS))
        seeded = list(pool.map(lambda _: model.generate(PROMPTS[0], max_tokens=16, temperature=0.8, seed=5), range(4)))
    assert parallel == sequential
    assert streamed == sequential
    assert seeded == [sampled] * 4


def test_gil_is_released_while_generating(model):
    done = threading.Event()
    result = []

    def work():
        result.append(model.generate("Once upon a time", max_tokens=24))
        done.set()

    thread = threading.Thread(target=work)
    spins = 0
    start = time.monotonic()
    thread.start()
    while not done.is_set():
        spins += 1
    elapsed = time.monotonic() - start
    thread.join()
    assert result and result[0]
    # Held GIL: the loop would run only in the interpreter's 5 ms switch slots
    # between blocking native calls; released: it spins freely.
    assert spins > 20_000 * elapsed, (spins, elapsed)


def test_stream_moves_between_threads(model):
    stream = model.stream("Once upon a time", max_tokens=8)
    first = next(stream)
    assert first.text
    with ThreadPoolExecutor(max_workers=1) as pool:
        rest = pool.submit(lambda: list(stream)).result(timeout=120)
    assert rest[-1].finish_reason in ("stop", "length")


def test_concurrent_iteration_is_refused_and_close_works_from_another_thread(model):
    stream = model.stream("The quick brown fox jumps over the lazy dog. " * 300, max_tokens=8)
    with ThreadPoolExecutor(max_workers=1) as pool:
        waiting = pool.submit(next, stream)  # blocks in the long prefill
        time.sleep(0.5)
        assert not waiting.done()
        try:
            next(stream)
        except RuntimeError as e:
            assert "another thread" in str(e)
        else:
            raise AssertionError("a second concurrent next() was not refused")
        stream.close()  # cancels; the waiting next() returns the last chunk
        last = waiting.result(timeout=60)
    assert last.finish_reason == "cancelled"
    assert list(stream) == []


def test_generate_batch_matches_each_alone(model):
    alone = [model.generate(p, max_tokens=20) for p in PROMPTS]
    assert model.generate_batch(PROMPTS, max_tokens=20) == alone
    seeded = model.generate(PROMPTS[1], max_tokens=20, temperature=0.8, seed=9)
    assert model.generate_batch([PROMPTS[1]] * 3, max_tokens=20, temperature=0.8, seed=9) == [seeded] * 3
    assert model.generate_batch([], max_tokens=4) == []


def test_generate_batch_checks_its_arguments(model):
    import pytest

    with pytest.raises(TypeError, match="list of prompts"):
        model.generate_batch("The capital of France is")
    with pytest.raises(TypeError, match="prompt"):
        model.generate_batch(["fine", 3.5])


def test_generations_leave_no_threads_behind(model):
    # Every generation runs on the model's one scheduler thread: the
    # process's thread count stays flat however many calls were made.
    def threads():
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("Threads:"))

    model.generate("warm up", max_tokens=2)
    before = threads()
    for i in range(30):
        model.generate(f"Count to {i}:", max_tokens=2)
        next(iter(model.stream("Abandoned", max_tokens=8)))
    assert threads() <= before + 1, (before, threads())


def test_a_second_turn_reuses_the_cached_prefix(model):
    system = "You answer in one short sentence. " + "The printing press spread across Europe in fifty years. " * 8

    def turn(question):
        stream = model.chat_stream([{"role": "system", "content": system}, {"role": "user", "content": question}],
                                   max_tokens=8)
        text = "".join(c.text for c in stream)
        return text, stream.stats

    first, stats = turn("When did it spread?")
    assert stats["prompt_tokens"] > 64
    again, stats = turn("How far did it spread?")
    assert 64 <= stats["cached_tokens"] < stats["prompt_tokens"], stats
    # A fresh model (empty cache) answers the second question with the same text.
    fresh = mlxcel.load(progress=False)
    assert "".join(c.text for c in fresh.chat_stream(
        [{"role": "system", "content": system}, {"role": "user", "content": "How far did it spread?"}],
        max_tokens=8)) == again
