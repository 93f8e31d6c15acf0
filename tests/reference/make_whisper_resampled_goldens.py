"""faster-whisper on the samples mlxcel decodes, for the clips that are not
16 kHz PCM/FLAC (resampled, or MP3).

faster-whisper resamples with FFmpeg's libswresample, mlxcel with rubato, so
the two feed the model slightly different samples. To check the model and
the decoding alone, this runs faster-whisper (float32, greedy, as
make_whisper_goldens.py) on mlxcel's own 16 kHz samples of each such clip
(`cargo run --release -p mlxcel-audio --example decode_16k`) and adds the run
to goldens/whisper_<model>.json with `"audio_input": "mlxcel 16 kHz samples"`.

    tests/reference/run.sh tests/reference/make_whisper_resampled_goldens.py
"""

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
from faster_whisper import WhisperModel

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_whisper_goldens import CACHE, CPU_THREADS, MODELS, ROOT, RecordingModel, run_one  # noqa: E402

GOLDENS = ROOT / "tests" / "reference" / "goldens"
CLIPS = ROOT / "tests" / "fixtures" / "audio"
AUDIO_INPUT = "mlxcel 16 kHz samples"


def mlxcel_samples(clip: Path, scratch: Path) -> np.ndarray:
    out = scratch / (clip.name + ".f32")
    subprocess.run(
        ["cargo", "run", "--quiet", "--release", "-p", "mlxcel-audio", "--example", "decode_16k", "--", str(clip), str(out)],
        check=True,
        cwd=ROOT,
    )
    return np.fromfile(out, dtype="<f4")


def needs_samples(clip: Path) -> bool:
    if clip.suffix == ".mp3":
        return True
    info = subprocess.run(["soxi", "-r", str(clip)], capture_output=True, text=True, check=True)
    return int(info.stdout.strip()) != 16000


def main():
    clips = sorted(p for p in CLIPS.iterdir() if p.suffix in (".flac", ".wav", ".mp3") and needs_samples(p))
    with tempfile.TemporaryDirectory() as scratch:
        samples = {clip.name: mlxcel_samples(clip, Path(scratch)) for clip in clips}
    for name, dir_name in MODELS.items():
        path = GOLDENS / f"whisper_{name}.json"
        doc = json.loads(path.read_text())
        model = WhisperModel(str(CACHE / "ct2" / dir_name), device="cpu", compute_type="float32", cpu_threads=CPU_THREADS)
        model.model = RecordingModel(model.model)
        for clip in clips:
            entry = doc["clips"][clip.name]
            entry["runs"] = [r for r in entry["runs"] if r.get("audio_input") != AUDIO_INPUT]
            tasks = sorted({r["task"] for r in entry["runs"]})
            for task in tasks:
                run = run_one(model, samples[clip.name], task, "float32")
                if run["fallback"]:
                    run = run_one(model, samples[clip.name], task, "float32", greedy_only=True)
                run["audio_input"] = AUDIO_INPUT
                entry["runs"].append(run)
                print(f"{name} {clip.name} {task}: {run['text_strip']!r}", file=sys.stderr)
        doc["mlxcel_samples_runs"] = __doc__.strip().splitlines()[0] + " (make_whisper_resampled_goldens.py)"
        path.write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
