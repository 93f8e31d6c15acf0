"""Whisper transcription goldens from faster-whisper on the real CTranslate2 weights.

    tests/reference/run.sh tests/reference/make_whisper_goldens.py \
        [--models ~/.cache/mlxcel/ct2] [--clips tests/fixtures/audio] \
        [--out tests/reference/goldens] [--only tiny.en,base]

Writes tests/reference/goldens/whisper_tiny.en.json and whisper_base.json.
The models come from tests/reference/fetch_whisper_ct2.sh (run here when a
model directory is missing). tests/reference/FASTER_WHISPER_NOTES.md explains
the decoding algorithm these numbers come from.

For every clip in tests/fixtures/audio (flac, wav, mp3) and every model, the
script runs WhisperModel(dir, device="cpu", compute_type=C, cpu_threads=2)
.transcribe(path, **OPTIONS) with C = float32 (the parity reference) and C =
int8 (to show whether quantization changes the text), and records:

- text: "".join(segment.text), and text_strip = text.strip();
- each segment: id, seek, start, end, text, tokens, temperature, avg_logprob,
  compression_ratio, no_speech_prob;
- info: language, language_probability (base: detected on the first 30 s;
  tiny.en: "en" with probability 1), the top 5 of all_language_probs,
  duration (decoded samples / 16000), num_samples;
- calls: every ctranslate2 `generate` call transcribe() made, in order (one per
  window and temperature): the prompt token ids, the temperature, the tokens
  returned (timestamps included, EOT excluded), the raw score,
  no_speech_prob. A Rust decoder can check its prompts and windows against it.
  Greedy calls (temperature 0) also carry `margins`: for each decoding step
  (the EOT step included), the gap between the largest and the second largest
  processed logit (after suppression and the timestamp rules), i.e. how far
  the argmax was from flipping; `min_margin` and `min_margin_step` give the
  smallest. A step with a margin near float32 rounding (say < 1e-3) may
  legitimately flip in another implementation.

For base, clips whose language is not English also run with task="translate".
Sampling at temperature > 0 (fallback) is seeded with
ctranslate2.set_random_seed(0) before each transcribe() call, so the
goldens reproduce with these versions, but a different implementation cannot
match sampled tokens: `fallback` marks the runs where it happened, and for each
of them the script adds a run with temperature=0.0 only
(temperature_option "0.0 only"), which is deterministic.
"""

import argparse
import hashlib
import json
import os
import platform
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

import ctranslate2
import faster_whisper
import numpy as np
from faster_whisper import WhisperModel
from faster_whisper.audio import decode_audio
from faster_whisper.tokenizer import Tokenizer
from faster_whisper.transcribe import get_suppressed_tokens

ROOT = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("MLXCEL_CACHE_DIR", Path.home() / ".cache" / "mlxcel"))

MODELS = {
    "tiny.en": "whisper-tiny.en",
    "base": "whisper-base",
}

# The options passed to transcribe(). Everything else is faster-whisper
# 1.2.1's default (listed in DEFAULTS_RECORDED for the record).
OPTIONS = dict(
    beam_size=1,  # greedy at temperature 0 (faster-whisper's own default is 5)
    vad_filter=False,
    word_timestamps=False,
    condition_on_previous_text=True,
)
DEFAULTS_RECORDED = dict(
    best_of=5,
    patience=1.0,
    length_penalty=1.0,
    repetition_penalty=1.0,
    no_repeat_ngram_size=0,
    temperature=[0.0, 0.2, 0.4, 0.6, 0.8, 1.0],
    compression_ratio_threshold=2.4,
    log_prob_threshold=-1.0,
    no_speech_threshold=0.6,
    prompt_reset_on_temperature=0.5,
    initial_prompt=None,
    prefix=None,
    suppress_blank=True,
    suppress_tokens=[-1],
    without_timestamps=False,
    max_initial_timestamp=1.0,
    multilingual=False,
    max_new_tokens=None,
    chunk_length=None,
    clip_timestamps="0",
    hallucination_silence_threshold=None,
    hotwords=None,
    language_detection_threshold=0.5,
    language_detection_segments=1,
)
COMPUTE_TYPES = ["float32", "int8"]
CPU_THREADS = 2


class RecordingModel:
    """Stands in for the ctranslate2.models.Whisper inside a WhisperModel and
    records each generate() call."""

    def __init__(self, inner):
        self._inner = inner
        self.calls = []

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def generate(self, encoder_output, prompts, **kwargs):
        greedy = float(kwargs.get("sampling_temperature", 0.0)) == 0.0
        if greedy:
            # The processed logits of each step (after suppression and the
            # timestamp rules): the same decode, the same tokens.
            kwargs = dict(kwargs, return_logits_vocab=True)
        results = self._inner.generate(encoder_output, prompts, **kwargs)
        for r in results:
            call = dict(
                prompt=[int(t) for t in prompts[0]],
                temperature=float(kwargs.get("sampling_temperature", 0.0)),
                beam_size=int(kwargs.get("beam_size", 1)),
                num_hypotheses=int(kwargs.get("num_hypotheses", 1)),
                max_length=int(kwargs["max_length"]),
                max_initial_timestamp_index=int(kwargs["max_initial_timestamp_index"]),
                tokens=[int(t) for t in r.sequences_ids[0]],
                score=float(r.scores[0]),
                no_speech_prob=float(r.no_speech_prob),
            )
            if greedy:
                margins = []
                for step in r.logits[0]:
                    x = np.array(step, dtype=np.float32)
                    top2 = np.partition(x, -2)[-2:]
                    margins.append(float(top2[1] - top2[0]))
                call["margins"] = [round(m, 4) for m in margins]
                i = int(np.argmin(margins))
                call["min_margin"] = margins[i]
                call["min_margin_step"] = i
            self.calls.append(call)
        return results


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def tokenizer_facts(model: WhisperModel, task="transcribe", language="en"):
    tok = Tokenizer(model.hf_tokenizer, model.model.is_multilingual, task=task, language=language)
    return dict(
        eot=tok.eot,
        sot=tok.sot,
        sot_prev=tok.sot_prev,
        sot_lm=tok.sot_lm,
        transcribe=tok.transcribe,
        translate=tok.translate,
        no_speech=tok.no_speech,
        no_timestamps=tok.no_timestamps,
        timestamp_begin=tok.timestamp_begin,
        hf_tokenizer_vocab_size=model.hf_tokenizer.get_vocab_size(with_added_tokens=True),
        ct2_vocabulary_size=sum(1 for _ in open(model.model_dir / "vocabulary.txt", encoding="utf-8")),
        sot_sequence_example=dict(task=task, language=language, tokens=tok.sot_sequence),
        non_speech_tokens=list(tok.non_speech_tokens),
        suppress_tokens=list(get_suppressed_tokens(tok, [-1])),
    )


def run_one(model, path, task, compute_type, greedy_only=False):
    rec = model.model
    rec.calls = []
    ctranslate2.set_random_seed(0)
    extra = dict(temperature=0.0) if greedy_only else {}
    t0 = time.perf_counter()
    audio = path if isinstance(path, np.ndarray) else str(path)
    segments, info = model.transcribe(audio, task=task, **OPTIONS, **extra)
    segments = list(segments)
    wall = time.perf_counter() - t0
    text = "".join(s.text for s in segments)
    top = sorted(info.all_language_probs or [], key=lambda x: -x[1])[:5]
    return dict(
        compute_type=compute_type,
        task=task,
        temperature_option="0.0 only" if greedy_only else "default fallback list",
        text=text,
        text_strip=text.strip(),
        language=info.language,
        language_probability=float(info.language_probability),
        top_language_probs=[[l, float(p)] for l, p in top],
        duration=float(info.duration),
        num_segments=len(segments),
        temperatures=sorted({float(s.temperature) for s in segments}),
        fallback=any(c["temperature"] > 0 for c in rec.calls),
        segments=[
            dict(
                id=s.id,
                seek=s.seek,
                start=float(s.start),
                end=float(s.end),
                text=s.text,
                tokens=[int(t) for t in s.tokens],
                temperature=float(s.temperature),
                avg_logprob=float(s.avg_logprob),
                compression_ratio=float(s.compression_ratio),
                no_speech_prob=float(s.no_speech_prob),
            )
            for s in segments
        ],
        calls=list(rec.calls),
        wall_s=round(wall, 3),
    )


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", type=Path, default=CACHE / "ct2")
    ap.add_argument("--clips", type=Path, default=ROOT / "tests" / "fixtures" / "audio")
    ap.add_argument("--out", type=Path, default=ROOT / "tests" / "reference" / "goldens")
    ap.add_argument("--only", default=",".join(MODELS))
    ap.add_argument("--clip", action="append", help="only these clip file names")
    args = ap.parse_args()

    if any(not (args.models / MODELS[m] / "model.bin").is_file() for m in args.only.split(",")):
        subprocess.run(
            ["bash", str(ROOT / "tests" / "reference" / "fetch_whisper_ct2.sh"), str(args.models)],
            check=True,
        )

    clips = sorted(
        p for p in args.clips.iterdir() if p.suffix in (".flac", ".wav", ".mp3")
    )
    if args.clip:
        clips = [p for p in clips if p.name in args.clip]
    args.out.mkdir(parents=True, exist_ok=True)
    cpu = next(
        (l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")),
        platform.processor(),
    )

    for name in args.only.split(","):
        mdir = args.models / MODELS[name]
        doc = dict(
            model=name,
            model_dir_name=MODELS[name],
            model_bin_sha256=sha256(mdir / "model.bin"),
            versions=dict(
                faster_whisper=faster_whisper.__version__,
                ctranslate2=ctranslate2.__version__,
                av=metadata.version("av"),
                numpy=np.__version__,
                tokenizers=metadata.version("tokenizers"),
                python=platform.python_version(),
            ),
            generator="tests/reference/make_whisper_goldens.py",
            cpu=cpu,
            model_args=dict(device="cpu", cpu_threads=CPU_THREADS, compute_types=COMPUTE_TYPES),
            transcribe_options=OPTIONS,
            transcribe_defaults=DEFAULTS_RECORDED,
            translate_runs="multilingual model only, clips whose float32 transcribe detected a language other than en",
            random_seed="ctranslate2.set_random_seed(0) before each transcribe() (only matters when fallback is true)",
            clips={},
        )
        models = {}
        for ct in COMPUTE_TYPES:
            m = WhisperModel(str(mdir), device="cpu", compute_type=ct, cpu_threads=CPU_THREADS)
            m.model = RecordingModel(m.model)
            m.model_dir = mdir
            models[ct] = m
        doc["multilingual"] = bool(models["float32"].model.is_multilingual)
        doc["tokenizer"] = tokenizer_facts(
            models["float32"], "transcribe", "en" if doc["multilingual"] else None
        )

        for clip in clips:
            audio = decode_audio(str(clip), sampling_rate=16000)
            entry = dict(
                file=clip.name,
                sha256=sha256(clip),
                num_samples=int(audio.shape[0]),
                runs=[],
            )
            for ct in COMPUTE_TYPES:
                r = run_one(models[ct], clip, "transcribe", ct)
                entry["runs"].append(r)
                print(
                    f"{name} {ct:7s} {clip.name:26s} [{r['language']} {r['language_probability']:.3f}]"
                    f"{' FALLBACK' if r['fallback'] else ''} {r['wall_s']:.1f}s: {r['text_strip']!r}",
                    file=sys.stderr,
                )
            lang = entry["runs"][0]["language"]
            if doc["multilingual"] and lang != "en":
                for ct in COMPUTE_TYPES:
                    r = run_one(models[ct], clip, "translate", ct)
                    entry["runs"].append(r)
                    print(
                        f"{name} {ct:7s} {clip.name:26s} translate"
                        f"{' FALLBACK' if r['fallback'] else ''}: {r['text_strip']!r}",
                        file=sys.stderr,
                    )
            # Where sampling (temperature > 0) happened, also record the run with
            # temperature=0.0 only: deterministic, so any implementation can match it.
            for task, ct in [(r["task"], r["compute_type"]) for r in entry["runs"] if r["fallback"]]:
                r = run_one(models[ct], clip, task, ct, greedy_only=True)
                entry["runs"].append(r)
                print(
                    f"{name} {ct:7s} {clip.name:26s} {task} temperature=0 only: {r['text_strip']!r}",
                    file=sys.stderr,
                )
            by = {
                (r["task"], r["compute_type"]): r
                for r in entry["runs"]
                if r["temperature_option"] == "default fallback list"
            }
            entry["int8_text_differs"] = {
                task: by[(task, "float32")]["text"] != by[(task, "int8")]["text"]
                for task in sorted({r["task"] for r in entry["runs"]})
            }
            doc["clips"][clip.name] = entry

        greedy_calls = [
            (c, r["task"], r["compute_type"], r["temperature_option"], k, call)
            for c, e in doc["clips"].items()
            for r in e["runs"]
            for k, call in enumerate(r["calls"])
            if "min_margin" in call
        ]
        doc["summary"] = dict(
            smallest_margins_float32=[
                dict(clip=c, task=t, temperature_option=o, call=k, step=call["min_margin_step"],
                     margin=call["min_margin"])
                for c, t, ct, o, k, call in sorted(greedy_calls, key=lambda g: g[5]["min_margin"])
                if ct == "float32"
            ][:10],
            int8_text_differs=[
                f"{c}:{t}" for c, e in doc["clips"].items() for t, d in e["int8_text_differs"].items() if d
            ],
            fallback=[
                f"{c}:{r['task']}:{r['compute_type']}"
                for c, e in doc["clips"].items()
                for r in e["runs"]
                if r["fallback"]
            ],
        )
        out = args.out / f"whisper_{name}.json"
        with open(out, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=1, ensure_ascii=False)
            f.write("\n")
        print(f"wrote {out}: {doc['summary']}", file=sys.stderr)


if __name__ == "__main__":
    main()
