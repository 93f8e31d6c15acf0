"""Speech to text from Python: ``load_transcriber(...).transcribe`` is a
translation of the engine's Transcriber, on the packaged whisper-tiny.en and
the Whisper test clips (tests/fixtures/audio; their faster-whisper texts are
in tests/reference/goldens/whisper_tiny.en.json)."""

import threading
import wave
from pathlib import Path

import numpy as np
import pytest

import mlxcel

REPO = Path(__file__).resolve().parents[3]
CLIPS = REPO / "tests" / "fixtures" / "audio"
FOX = " The quick brown fox jump over the lazy nog."
WAV = " This file is a plain 16 bit frame file."


@pytest.fixture(scope="module")
def transcriber() -> mlxcel.Transcriber:
    return mlxcel.load_transcriber()


def wav_samples(path: Path) -> np.ndarray:
    with wave.open(str(path)) as w:
        assert (w.getnchannels(), w.getsampwidth(), w.getframerate()) == (1, 2, 16000)
        return np.frombuffer(w.readframes(w.getnframes()), dtype="<i2").astype(np.float32) / 32768.0


def test_a_file_by_path(transcriber):
    assert not transcriber.is_multilingual and transcriber.languages == []
    assert "English-only" in repr(transcriber)
    result = transcriber.transcribe(CLIPS / "en_fox_us.flac")
    assert result["text"] == FOX
    assert result["task"] == "transcribe"
    assert result["language"] == "en" and result["language_probability"] == 1.0
    assert abs(result["duration"] - 2.909) < 1e-3
    [segment] = result["segments"]
    assert set(segment) == {
        "id", "seek", "start", "end", "text", "tokens", "temperature", "avg_logprob", "compression_ratio", "no_speech_prob"
    }
    assert segment["id"] == 0 and segment["seek"] == 0 and segment["start"] == 0.0 and 2.0 < segment["end"] <= 3.0
    assert segment["text"] == FOX and segment["tokens"][0] == 50363 and segment["temperature"] == 0.0
    # A str path is the same.
    assert transcriber.transcribe(str(CLIPS / "en_fox_us.flac"))["text"] == FOX


def test_bytes_samples_and_lists(transcriber):
    data = (CLIPS / "en_fox_us.flac").read_bytes()
    assert transcriber.transcribe(data)["text"] == FOX
    assert transcriber.transcribe(bytearray(data))["text"] == FOX
    assert transcriber.transcribe(memoryview(data))["text"] == FOX
    samples = wav_samples(CLIPS / "en_mono_16k.wav")
    assert len(samples) == 45728
    from_array = transcriber.transcribe(samples)
    assert from_array["text"] == WAV and abs(from_array["duration"] - 2.858) < 1e-9
    # float64 arrays are cast; lists of floats work too.
    assert transcriber.transcribe(samples.astype(np.float64))["text"] == WAV
    assert transcriber.transcribe(samples.tolist()) == from_array
    # The file itself decodes to the same samples.
    assert transcriber.transcribe(CLIPS / "en_mono_16k.wav") == from_array


def test_options(transcriber):
    samples = wav_samples(CLIPS / "en_mono_16k.wav")
    text_only = transcriber.transcribe(samples, temperature=0.0, without_timestamps=True, language="en")
    assert text_only["text"] == WAV
    assert text_only["segments"][0]["tokens"][0] != 50363  # no timestamp tokens
    # Thresholds may be turned off; a list of temperatures is the fallback order.
    result = transcriber.transcribe(samples, temperature=[0.0, 0.5], compression_ratio_threshold=None, no_speech_threshold=None)
    assert result["text"] == WAV


def test_errors(transcriber):
    with pytest.raises(mlxcel.InvalidParameter) as e:
        transcriber.transcribe(CLIPS / "no_such_clip.flac")
    assert e.value.name == "audio" and "no_such_clip.flac" in str(e.value)
    with pytest.raises(mlxcel.InvalidParameter) as e:
        transcriber.transcribe(b"this is not audio at all")
    assert e.value.name == "audio"
    with pytest.raises(mlxcel.InvalidParameter, match="no audio samples"):
        transcriber.transcribe(np.zeros(0, dtype=np.float32))
    with pytest.raises(mlxcel.InvalidParameter, match="sample 1 is not a finite number"):
        transcriber.transcribe([0.0, float("nan")])
    with pytest.raises(mlxcel.InvalidParameter) as e:
        transcriber.transcribe(np.zeros((2, 100), dtype=np.float32))
    assert e.value.name == "audio"
    samples = np.zeros(1600, dtype=np.float32)
    for kwargs, name in [
        ({"task": "summarize"}, "task"),
        ({"task": "translate"}, "task"),  # English-only model
        ({"language": "de"}, "language"),
        ({"temperature": 3.0}, "temperatures"),
        ({"temperature": []}, "temperatures"),
        ({"best_of": 0}, "best_of"),
        ({"max_initial_timestamp": 31.0}, "max_initial_timestamp"),
    ]:
        with pytest.raises(mlxcel.InvalidParameter) as e:
            transcriber.transcribe(samples, **kwargs)
        assert e.value.name == name, kwargs
        assert isinstance(e.value, ValueError)
    with pytest.raises(TypeError):
        transcriber.transcribe(42)
    with pytest.raises(TypeError):
        transcriber.transcribe(["a", "b"])
    with pytest.raises(TypeError):
        transcriber.transcribe(samples, temperature="hot")
    with pytest.raises(mlxcel.InvalidParameter, match="English-only"):
        transcriber.detect_language(samples)
    with pytest.raises(mlxcel.ModelLoadError):
        mlxcel.load_transcriber("/no/such/whisper", progress=False)


def test_two_threads_on_one_transcriber(transcriber):
    jobs = {"fox": CLIPS / "en_fox_us.flac", "wav": wav_samples(CLIPS / "en_mono_16k.wav")}
    results, errors = {}, []

    def run(name):
        try:
            results[name] = transcriber.transcribe(jobs[name])["text"]
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(name,)) for name in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert results == {"fox": FOX, "wav": WAV}
