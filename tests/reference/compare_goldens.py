"""Compare two trees of tiny goldens (e.g. a re-run, or a run without OpenBLAS).

    tests/reference/run.sh tests/reference/compare_goldens.py DIR_A DIR_B

Prints, per model: max |logits_A - logits_B|, that difference relative to the
logit scale (max |logits|), whether greedy tokens agree, and whether the
model.safetensors files are byte-identical.
"""
import json
import sys
from pathlib import Path

import numpy as np


def main(a, b):
    a, b = Path(a), Path(b)
    worst = 0.0
    for d in sorted(p for p in a.iterdir() if (p / "golden.json").exists()):
        ga = json.loads((d / "golden.json").read_text())
        gb = json.loads((b / d.name / "golden.json").read_text())
        la, lb = np.array(ga["logits"]), np.array(gb["logits"])
        diff = float(np.abs(la - lb).max())
        rel = diff / float(np.abs(la).max())
        worst = max(worst, rel)
        same_w = (d / "model.safetensors").read_bytes() == (b / d.name / "model.safetensors").read_bytes()
        same_g = ga["greedy"]["tokens"] == gb["greedy"]["tokens"]
        print(f"{d.name:22s} max_abs={diff:.3g} rel={rel:.3g} greedy_equal={same_g} weights_identical={same_w}")
    print(f"worst relative diff {worst:.3g}")


if __name__ == "__main__":
    main(*sys.argv[1:3])
