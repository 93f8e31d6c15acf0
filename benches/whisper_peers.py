"""faster-whisper real-time factor on the Whisper test clips: the peer that
mlxcel's transcription is compared against.

    tests/reference/run.sh benches/whisper_peers.py [--models ~/.cache/mlxcel/ct2]
        [--model tiny.en,base] [--compute-type float32,int8] [--threads 2]
        [--repeat 3] [--only-long] [--out FILE]

For each model and compute type: WhisperModel(dir, device="cpu",
compute_type=C, cpu_threads=T), then transcribe() exactly as the goldens do
(beam_size=1, vad_filter=False, word_timestamps=False, every other option at
faster-whisper 1.2.1's default; base detects the language) on

- `en_news_2min.flac` (122 s of speech, several 30-s windows), and
- `all`: every clip in tests/fixtures/audio, one after another,

one warm-up pass, then the median of --repeat timed passes. The time covers
decoding the file (PyAV), features, language detection, encoder and decoder:
everything transcribe() does, model loading excluded. Prints one JSON line
per (model, compute type, input): audio seconds, wall seconds (median), RTF =
wall / audio (lower is faster), the CPU model from /proc/cpuinfo, versions.
"""

import argparse
import json
import os
import platform
import statistics
import time
from importlib import metadata
from pathlib import Path

import ctranslate2
import faster_whisper
from faster_whisper import WhisperModel
from faster_whisper.audio import decode_audio

ROOT = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("MLXCEL_CACHE_DIR", Path.home() / ".cache" / "mlxcel"))
MODELS = {"tiny.en": "whisper-tiny.en", "base": "whisper-base"}
OPTIONS = dict(beam_size=1, vad_filter=False, word_timestamps=False, condition_on_previous_text=True)


def cpu_model():
    for line in open("/proc/cpuinfo"):
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def cpu_flags():
    wanted = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_int8")
    for line in open("/proc/cpuinfo"):
        if line.startswith("flags"):
            have = set(line.split(":", 1)[1].split())
            return [f for f in wanted if f in have]
    return []


def transcribe_all(model, paths):
    words = 0
    for p in paths:
        segments, _info = model.transcribe(str(p), **OPTIONS)
        words += sum(len(s.text.split()) for s in segments)  # consuming runs the decoder
    return words


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", type=Path, default=CACHE / "ct2")
    ap.add_argument("--model", default="tiny.en,base")
    ap.add_argument("--compute-type", default="float32,int8")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--clips", type=Path, default=ROOT / "tests" / "fixtures" / "audio")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--only-long", action="store_true", help="only the 2-minute clip")
    args = ap.parse_args()

    clips = sorted(p for p in args.clips.iterdir() if p.suffix in (".flac", ".wav", ".mp3"))
    long_clip = args.clips / "en_news_2min.flac"
    inputs = {"en_news_2min.flac": [long_clip], "all": clips}
    if args.only_long:
        del inputs["all"]
    seconds = {p: decode_audio(str(p)).shape[0] / 16000 for p in clips}
    common = dict(
        cpu=cpu_model(),
        cpu_flags=cpu_flags(),
        nproc=os.cpu_count(),
        threads=args.threads,
        faster_whisper=faster_whisper.__version__,
        ctranslate2=ctranslate2.__version__,
        options=OPTIONS,
        repeat=args.repeat,
    )
    lines = []
    for name in args.model.split(","):
        for ct in args.compute_type.split(","):
            model = WhisperModel(
                str(args.models / MODELS[name]), device="cpu", compute_type=ct, cpu_threads=args.threads
            )
            for label, paths in inputs.items():
                audio_s = sum(seconds[p] for p in paths)
                transcribe_all(model, paths)  # warm-up
                times = []
                for _ in range(args.repeat):
                    t0 = time.perf_counter()
                    words = transcribe_all(model, paths)
                    times.append(time.perf_counter() - t0)
                wall = statistics.median(times)
                rec = dict(
                    engine="faster-whisper",
                    model=name,
                    compute_type=ct,
                    input=label,
                    files=len(paths),
                    audio_seconds=round(audio_s, 3),
                    wall_seconds=round(wall, 3),
                    wall_all=[round(t, 3) for t in times],
                    rtf=round(wall / audio_s, 4),
                    words=words,
                    **common,
                )
                print(json.dumps(rec), flush=True)
                lines.append(rec)
            del model
    if args.out:
        with open(args.out, "w") as f:
            for rec in lines:
                f.write(json.dumps(rec) + "\n")


if __name__ == "__main__":
    main()
