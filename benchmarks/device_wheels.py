"""The Python packages a lent GPU machine lacks for `gpu_check.py` (issue 55), fetched here as wheels.

The machine (the device tool's H100/H200) has no network. Its image holds torch, transformers,
accelerate, peft, pandas, pyarrow, matplotlib, tensorboard, pytest and the rest of ON_THE_MACHINE,
but not pydantic, datasets, the HTTP stack of the reward server, nor trl, the reference the step
is compared against. This script downloads those (CARRIED, at the versions installed here, which
the test suite ran) for the machine's Python into `.whl/` (ignored by git), which the device call
carries and `gpu_session.sh` installs:

    python3 benchmarks/device_wheels.py                 # here, once: .whl/ (13 wheels, under 5 MiB)
    run(command="bash benchmarks/gpu_session.sh 480", carry=[".whl"], timeout_s=540)  # the lease

(`gpu_session.sh` says how a lease's 15 minutes are spent.)

`--python-version 3.11` fetches the same set for this machine's Python (a rehearsal of the lease
in a virtual environment holding only ON_THE_MACHINE). The suite checks that every package grpokit
and trl need, at any depth, is in one list or the other.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# grpokit's runtime requirements and trl's, at any depth, that the machine's image lacks
CARRIED = (
    "pydantic", "pydantic-core", "annotated-types", "typing-inspection",  # the config schema
    "datasets", "dill", "multiprocess",  # hub-layout datasets (and trl)
    "httpx2", "httpcore2", "truststore", "starlette", "uvicorn",  # reward servers
    "trl",  # the reference implementation gpu_vs_trl.py runs
)  # fmt: skip
# the rest of that closure, and the test runner's plugins pyproject.toml's addopts name (xdist), in the
# image's package list as the device tool gave it (2026-11-17)
ON_THE_MACHINE = (
    "absl-py", "accelerate", "annotated-doc", "anyio", "click", "contourpy", "cycler", "execnet",
    "filelock", "fonttools", "fsspec", "grpcio", "h11", "hf-xet", "huggingface-hub", "idna", "jinja2",
    "kiwisolver", "markdown", "markdown-it-py", "markupsafe", "matplotlib", "mdurl", "mpmath",
    "networkx", "numpy", "packaging", "pandas", "peft", "pillow", "protobuf", "psutil", "pyarrow",
    "pygments", "pyparsing", "pytest", "pytest-xdist", "python-dateutil", "pyyaml", "regex", "rich",
    "safetensors", "setuptools", "shellingham", "six", "sympy", "tensorboard", "tensorboard-data-server",
    "tokenizers", "torch", "tqdm", "transformers", "typer", "typing-extensions", "werkzeug", "xxhash",
)  # fmt: skip
# the lent machine's Python and platforms (pip matches a manylinux tag exactly, so several are named)
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64")  # fmt: skip


def pinned() -> list[str]:
    """CARRIED at the versions installed here (the ones the suite tests)."""
    missing = []
    pins = []
    for name in CARRIED:
        try:
            pins.append(f"{name}=={metadata.version(name)}")
        except metadata.PackageNotFoundError:
            missing.append(name)
    if missing:
        raise SystemExit(f"not installed here: {', '.join(missing)}; run `bash scripts/setup.sh test` first")
    return pins


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--python-version", default="3.12", help="the lent machine's (default 3.12)")
    parser.add_argument("--dest", default=str(ROOT / ".whl"), help="default: .whl/ in the checkout")
    args = parser.parse_args(argv)
    dest = Path(args.dest)
    shutil.rmtree(dest, ignore_errors=True)  # one version of each: two would stop the install there
    platforms = [arg for platform in PLATFORMS for arg in ("--platform", platform)]
    command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
               "--python-version", args.python_version, "--implementation", "cp", *platforms,
               "--dest", str(dest), *pinned()]  # fmt: skip
    subprocess.run(command, check=True)
    wheels = sorted(dest.glob("*.whl"))
    size = sum(wheel.stat().st_size for wheel in wheels)
    print(f"{len(wheels)} wheels, {size / 2**20:.1f} MiB, in {dest}")
    return 0 if len(wheels) == len(CARRIED) else 1


if __name__ == "__main__":
    raise SystemExit(main())
