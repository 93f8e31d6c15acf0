"""Logits of mlx-whisper 0.4.3 on the checkpoints `mlxcel convert --ctranslate2`
writes (mlx-whisper's layout: `config.json` + `weights.safetensors`, which
`mlx_whisper.load_models.load_model` loads as is), for the Rust check in
tests/whisper.rs (`logits_match_mlx_whisper`).

For each model: the log-mel window of en_fox_us.flac as mlxcel builds it
(faster-whisper's features, zero-padded to 3000 frames), the decoder prompt
(<|startoftranscript|> and, for base, <|en|><|transcribe|>) followed by
faster-whisper's first 6 tokens, and mlx-whisper's float32 logits at the
last 4 positions. Written to goldens/whisper_mlx.safetensors (the window once,
`tokens_<model>`, `logits_<model>`).

    tests/reference/run.sh tests/reference/make_whisper_mlx_goldens.py
"""

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
from faster_whisper.audio import decode_audio
from faster_whisper.feature_extractor import FeatureExtractor
from mlx_whisper.load_models import load_model
from safetensors.numpy import save_file

ROOT = Path(__file__).resolve().parents[2]
CACHE = Path.home() / ".cache" / "mlxcel"
CLIP = ROOT / "tests" / "fixtures" / "audio" / "en_fox_us.flac"


def main():
    audio = decode_audio(str(CLIP), sampling_rate=16000)
    features = FeatureExtractor(feature_size=80)(audio, padding=160)
    content = features.shape[-1] - 1
    window = np.zeros((80, 3000), dtype=np.float32)
    window[:, :content] = features[:, :content]
    out = {"mel": window}
    for name, prompt in [("tiny.en", [50257]), ("base", [50258, 50259, 50359])]:
        golden = json.loads((ROOT / "tests" / "reference" / "goldens" / f"whisper_{name}.json").read_text())
        run = golden["clips"]["en_fox_us.flac"]["runs"][0]
        tokens = prompt + run["segments"][0]["tokens"][:6]
        model = load_model(str(CACHE / "models" / f"whisper-{name}"), dtype=mx.float32)
        audio_features = model.embed_audio(mx.array(window.T[None]))
        logits = model.logits(mx.array([tokens]), audio_features)[0]
        mx.eval(logits)
        out[f"tokens_{name}"] = np.array(tokens, dtype=np.int32)
        out[f"logits_{name}"] = np.array(logits, dtype=np.float32)[-4:]
        print(name, "tokens", tokens, "argmax", np.array(logits).argmax(-1).tolist())
    save_file(
        out,
        str(ROOT / "tests" / "reference" / "goldens" / "whisper_mlx.safetensors"),
        metadata={"mlx_whisper": "0.4.3", "clip": CLIP.name, "positions": "the last 4 of each prompt"},
    )

if __name__ == "__main__":
    main()
