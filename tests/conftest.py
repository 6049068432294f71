"""Shared fixtures. Ops tests run in float64 unless a test is about another dtype."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import pytest
import torch

GOLDEN_DIR = Path(__file__).parent / "golden"


def pytest_configure(config: pytest.Config) -> None:
    """The default suite is the CPU test bench on every machine: with `device: auto` a machine with a
    GPU would otherwise run its end-to-end tests there, where kernels and random streams differ from
    the CPU's that the bitwise and golden checks pin. GPUs are hidden (before anything asks torch
    about CUDA) unless the run is `pytest -m gpu`, which selects the tests written for a GPU."""
    if (config.option.markexpr or "").strip() != "gpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    # torch.compile's on-disk cache does not key its C++ kernels by ATEN_CPU_CAPABILITY: a kernel
    # vectorised for AVX-512 is found again by a run with ATEN_CPU_CAPABILITY=default, whose headers
    # lack the vector types, and fails to build. One cache per capability.
    capability = os.environ.get("ATEN_CPU_CAPABILITY", "native")
    cache = Path(tempfile.gettempdir()) / f"grpokit-tests-inductor-{capability}"
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache))
    _pin_cpu_threads()


def _pin_cpu_threads() -> None:
    """Every test computes on a fixed number of CPU threads, whatever else runs on the machine: the
    usable cores shared out among pytest-xdist's workers (2 workers x 1 thread on 2 cores; all of them
    without xdist), at least one. torch's count is set here for this process, and OMP_NUM_THREADS and
    MKL_NUM_THREADS for the processes the tests start (a `python3 -m grpokit` run reads them).

    OMP_NUM_THREADS is also what keeps grpokit's CPU-thread governor (train/threads.py) from adapting
    in a run whose `num_threads` is unset: under a pinned environment it never reads the machine's
    load, so no run in a test changes its count or says "other processes are using ... cores" because
    another worker, or anything else, holds a core. tests/train/test_threads.py tests that adaptation
    on a simulated machine."""
    from grpokit.train.threads import usable_cores

    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))  # set in each worker by xdist
    count = max(1, usable_cores() // workers)
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[name] = str(count)
    torch.set_num_threads(count)


@pytest.fixture(scope="session")
def seed_vectors() -> dict:
    """Outputs of the reference implementations on one shared input (shared/reference/seed_vectors.json)."""
    return json.loads((GOLDEN_DIR / "seed_vectors.json").read_text())


@pytest.fixture
def gen() -> torch.Generator:
    return torch.Generator().manual_seed(1234)


@pytest.fixture(autouse=True)
def _own_working_directory(tmp_path, monkeypatch):
    """Every test runs in its own empty directory, whatever the directory pytest was started from
    holds: a relative path (the presets' `output_dir: runs/addition`, a CLI call without output_dir)
    must never meet a run that `python3 -m grpokit train` left in a checkout, nor leave one there.
    Files of the repository are read relative to `__file__`, never to the working directory."""
    monkeypatch.chdir(tmp_path)


def _is_loopback(address) -> bool:
    """Whether a connect() address is this machine's loopback (127.0.0.0/8, ::1, and the same as
    ::ffff:127.x.x.x) or unspecified (0.0.0.0, ::: a connect there reaches this machine), by its IP only."""
    import ipaddress

    try:
        ip = ipaddress.ip_address(address[0])
    except (ValueError, TypeError, IndexError):
        return False
    ip = getattr(ip, "ipv4_mapped", None) or ip
    return ip.is_loopback or ip.is_unspecified


@pytest.fixture(autouse=True)
def _no_network(monkeypatch, request):
    """Every test runs with internet sockets blocked: nothing may reach a model hub or anything else.
    A test marked `loopback` may also connect to this machine's loopback addresses (127.0.0.0/8, ::1;
    0.0.0.0, :: and ::ffff:127.x.x.x reach them too), where it runs a server of its own; every other
    address stays blocked for it too."""
    import socket

    real_connect = socket.socket.connect
    loopback = request.node.get_closest_marker("loopback") is not None

    def guarded(self, address):
        if self.family in (socket.AF_INET, socket.AF_INET6) and not (loopback and _is_loopback(address)):
            raise ConnectionError(f"network access attempted in a test: {address!r}")
        return real_connect(self, address)

    monkeypatch.setattr(socket.socket, "connect", guarded)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="session")
def tiny_policy():
    """A 2-layer Llama over the addition alphabet and its character tokenizer (built, never downloaded)."""
    from grpokit.models import build_policy, char_tokenizer

    tokenizer = char_tokenizer("0123456789+=")
    model = build_policy(
        hidden_size=32,
        num_layers=2,
        num_heads=4,
        vocab_size=len(tokenizer),
        dropout=0.0,
        max_seq_len=64,
        seed=3,
    )
    return model, tokenizer


@pytest.fixture(scope="session")
def hub_home(tmp_path_factory) -> Path:
    """An HF_HOME whose hub cache holds the tiny chat models of `tests/hub_cache.py` (built once)."""
    from tests.hub_cache import build_hub_cache

    home = tmp_path_factory.mktemp("hf_home")
    build_hub_cache(home)
    return home


def read_hub_from(home: Path, monkeypatch) -> Path:
    """This process, and the processes it starts, read models and datasets from `home`'s Hugging Face
    cache only, as a user's machine does after `hf download` with HF_HUB_OFFLINE=1. huggingface_hub and
    datasets read their environment once at import: their constants are set too."""
    import datasets.config
    from huggingface_hub import constants

    from tests.hub_cache import offline_env

    for name, value in offline_env(home).items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HF_DATASETS_CACHE", raising=False)
    monkeypatch.setattr(constants, "HF_HOME", str(home))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", home / "datasets")  # its cache lands there too
    return home


@pytest.fixture
def hub_offline(hub_home, monkeypatch) -> Path:
    """The hub read from `hub_home`'s cache only (read_hub_from)."""
    return read_hub_from(hub_home, monkeypatch)


@pytest.fixture
def empty_hub_offline(tmp_path, monkeypatch) -> Path:
    """An empty Hugging Face cache, read offline: any hub id or dataset name is missing, at once, as on
    a machine that never downloaded it."""
    return read_hub_from(tmp_path / "empty_hf_home", monkeypatch)


@pytest.fixture(autouse=True)
def _every_logged_metric_is_in_the_reference(request, monkeypatch):
    """Every key any run of the suite logs (MetricsWriter.write, in this process) has its entry in the
    metrics reference (grpokit/train/metric_names.py, docs/reference/metrics.md); a test that writes
    made-up keys on purpose is marked custom_metrics."""
    if request.node.get_closest_marker("custom_metrics") is not None:
        yield
        return
    from grpokit.train.metric_names import undescribed
    from grpokit.train.metrics import MetricsWriter

    missing: set[str] = set()
    write = MetricsWriter.write

    def checked(self, step, metrics, prefix=""):
        row = write(self, step, metrics, prefix)
        missing.update(undescribed(row))
        return row

    monkeypatch.setattr(MetricsWriter, "write", checked)
    yield
    assert not missing, f"logged without an entry in grpokit/train/metric_names.py: {sorted(missing)}"
