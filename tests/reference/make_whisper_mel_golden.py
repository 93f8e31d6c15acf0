"""Log-mel golden for the Whisper front end, from faster-whisper 1.2.1.

    tests/reference/run.sh tests/reference/make_whisper_mel_golden.py \
        [--clip tests/fixtures/audio/en_scotland.flac] \
        [--out tests/reference/goldens/whisper_mel.safetensors]

Writes float32 tensors:

- `audio` [N]: the clip as faster_whisper.audio.decode_audio(path, 16000)
  returns it (PyAV -> s16 mono 16 kHz -> / 32768);
- `mel` [80, N // 160 + 1]: FeatureExtractor(feature_size=80)(audio), called
  exactly as WhisperModel.transcribe() calls it (padding=160,
  chunk_length=None), i.e. the full-clip features before windowing; a
  transcription window is mel[:, seek : seek + min(3000, N // 160 - seek)]
  padded with zeros to 3000 frames;
- `mel_filters` [80, 201]: the extractor's mel filter bank.

The encoder inputs are not stored (3000 frames, mostly zeros): the first
transcription window is mel[:, :N // 160] and the language-detection window is
mel[:, :3000] (which keeps the last frame), each padded with zeros to 3000
frames.

The safetensors metadata records the clip, versions and the comparison with
OpenAI's log-mel as implemented by mlx-whisper 0.4.3
(mlx_whisper.audio.log_mel_spectrogram with the same padding of 160 samples):
max |difference| over all values, and for the filter banks.
"""

import argparse
import hashlib
import json
from importlib import metadata
from pathlib import Path

import numpy as np
from faster_whisper.audio import decode_audio
from faster_whisper.feature_extractor import FeatureExtractor
from safetensors.numpy import save_file

ROOT = Path(__file__).resolve().parents[2]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--clip", type=Path, default=ROOT / "tests/fixtures/audio/en_scotland.flac")
    ap.add_argument("--out", type=Path, default=ROOT / "tests/reference/goldens/whisper_mel.safetensors")
    args = ap.parse_args()

    audio = decode_audio(str(args.clip), sampling_rate=16000)
    fe = FeatureExtractor(feature_size=80)
    mel = fe(audio, chunk_length=None)  # padding=160 (the default), as in transcribe()
    content_frames = mel.shape[-1] - 1
    assert mel.shape == (80, audio.shape[0] // 160 + 1), mel.shape

    # OpenAI's log-mel (mlx-whisper's port) on the same samples.
    import mlx.core as mx
    import mlx_whisper.audio as mwa

    mlx_mel = np.array(mwa.log_mel_spectrogram(mx.array(audio), n_mels=80, padding=160)).T
    mlx_filters = np.array(mwa.mel_filters(80))
    cmp = dict(
        mlx_whisper_mel_shape=list(mlx_mel.shape),
        mel_max_abs_diff=float(np.abs(mlx_mel - mel).max()),
        mel_mean_abs_diff=float(np.abs(mlx_mel - mel).mean()),
        mel_filters_max_abs_diff=float(np.abs(mlx_filters - fe.mel_filters).max()),
        mel_filters_max_abs=float(np.abs(fe.mel_filters).max()),
    )
    cmp["mel_within_1e-4"] = cmp["mel_max_abs_diff"] <= 1e-4

    meta = dict(
        clip=str(args.clip.relative_to(ROOT)),
        clip_sha256=hashlib.sha256(args.clip.read_bytes()).hexdigest(),
        num_samples=str(audio.shape[0]),
        content_frames=str(content_frames),
        feature_extractor="faster_whisper.feature_extractor.FeatureExtractor(feature_size=80)(audio, padding=160, chunk_length=None)",
        faster_whisper=metadata.version("faster-whisper"),
        av=metadata.version("av"),
        numpy=np.__version__,
        mlx_whisper=metadata.version("mlx-whisper"),
        comparison_with_mlx_whisper=json.dumps(cmp),
        generator="tests/reference/make_whisper_mel_golden.py",
    )
    tensors = dict(
        audio=np.ascontiguousarray(audio, dtype=np.float32),
        mel=np.ascontiguousarray(mel, dtype=np.float32),
        mel_filters=np.ascontiguousarray(fe.mel_filters, dtype=np.float32),
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(args.out), metadata=meta)
    print(f"wrote {args.out} ({args.out.stat().st_size} bytes)")
    for k, v in tensors.items():
        print(f"  {k}: {list(v.shape)} {v.dtype}")
    print(json.dumps(cmp, indent=1))


if __name__ == "__main__":
    main()
