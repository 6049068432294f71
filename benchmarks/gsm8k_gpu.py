"""The `gsm8k` preset on one GPU, the command a user runs first (issue 25), where nothing can be
downloaded: a randomly initialised model of Qwen2.5-0.5B-Instruct's shape (hidden 896, 24 layers,
14 heads, 2 KV heads, V = 151,936, tied head; a byte-level BPE tokenizer trained here, ChatML
template, EOS <|im_end|>) saved in a Hugging Face cache made here under the hub id
`Qwen/Qwen2.5-0.5B-Instruct`, and a GSM8K-like dataset directory in hub-repo layout (generated
word problems with `#### N` answers). Then, offline, exactly

    grpokit train gsm8k model=Qwen/Qwen2.5-0.5B-Instruct dataset=DIR num_eval_prompts=N eval_steps=0

for as many steps as fit in --minutes: the run is sent SIGINT at the deadline, finishes its step,
saves and stops, as a user's Ctrl-C does. Reported from metrics.jsonl: step time, completion
tokens per second, the timing split, and the GPU's peak memory (`memory/max_allocated_gib`). A
random model earns no GSM8K reward: this measures the recipe's cost, not its accuracy.

    python benchmarks/gsm8k_gpu.py [--minutes 10] [--out FILE] [key=value ...]
    python benchmarks/gsm8k_gpu.py --smoke     # the tiny Qwen shape on the CPU, 2 steps (the suite)

A random model writes all 1024 completion tokens, the preset's worst case: at micro_batch_size 32
that is about 49k tokens of activations per micro-batch (66 GiB at the peak by the memory forecast,
without activation checkpointing), so on an 80 GB card this run is also the preset's memory check.
The preset sets auto_find_batch_size: a step whose update runs out of memory is redone with the
micro-batch halved, said in a warning on stderr; `micro_batch_size=8` is the override to compare.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests.hub_cache builds the cache a download would leave
HUB_ID = "Qwen/Qwen2.5-0.5B-Instruct"
PEAK = "memory/max_allocated_gib"  # the trainer's metric of the GPU's peak


def summarise(rows: list[dict[str, Any]], warmup: int) -> dict[str, Any]:
    steps = [r for r in rows if "step_time" in r]
    timed = steps[warmup:] or steps

    def median(key: str) -> float | None:
        values = [r[key] for r in timed if key in r]
        return statistics.median(values) if values else None

    return {
        "steps": len(steps),
        "step_time_s": median("step_time"),
        "completion_tokens_per_s": median("tokens_per_second"),
        "completion_mean_length": median("completions/mean_length"),
        "timing_s": {k: median(f"timing/{k}") for k in ("sampling", "scoring", "reference", "update")},
        "peak_gpu_memory_gib": max((r[PEAK] for r in steps if PEAK in r), default=None),
        "reward": median("reward"),
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    from tests.hub_cache import QWEN_05B_SHAPE, build_qwen, gsm8k_like, snapshot

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "overrides", nargs="*", help="key=value options added to the command (e.g. micro_batch_size=8)"
    )
    parser.add_argument("--smoke", action="store_true", help="tiny shape on the CPU, 2 steps")
    parser.add_argument("--minutes", type=float, default=10.0, help="training time before the SIGINT")
    parser.add_argument("--eval-prompts", type=int, default=64, help="held-out prompts before and after")
    parser.add_argument(
        "--out", default=None, help="default: benchmarks/results/gsm8k_gpu.json (none with --smoke)"
    )
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        home = Path(tmp) / "hf_home"
        start = time.perf_counter()
        build_qwen(snapshot(home, HUB_ID), shape=None if args.smoke else QWEN_05B_SHAPE)
        data = gsm8k_like(
            Path(tmp) / "gsm8k", train=64 if args.smoke else 7473, test=16 if args.smoke else 1319
        )
        built = time.perf_counter() - start
        out_dir = Path(tmp) / "run"
        command = [
            "train",
            "gsm8k",
            f"model={HUB_ID}",
            f"dataset={data}",
            f"output_dir={out_dir}",
            "eval_steps=0",
        ]
        command += [
            f"num_eval_prompts={args.eval_prompts}",
            "progress=false",
            "report_to=none",
            "save_steps=0",
        ]
        if args.smoke:
            command += ["device=cpu", "dtype=float32", "prompts_per_step=2", "micro_batch_size=10",
                        "max_steps=2", "max_completion_length=16", "num_eval_prompts=2",
                        "max_prompt_length=null"]  # fmt: skip
        command += args.overrides  # last: they win
        env = os.environ | {"HF_HOME": str(home), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
        env["PYTHONUNBUFFERED"] = "1"
        child = subprocess.Popen([sys.executable, "-m", "grpokit", *command], cwd=ROOT, env=env)
        try:
            code = child.wait(timeout=None if args.smoke else args.minutes * 60)
        except subprocess.TimeoutExpired:  # the deadline: a user's Ctrl-C, the step finishes and is saved
            child.send_signal(signal.SIGINT)
            code = child.wait()
        metrics = out_dir / "metrics.jsonl"
        rows = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.is_file() else []
        result = {
            "command": "grpokit " + " ".join(c if "=" not in c or not c.split("=")[1].startswith("/") else
                                             c.split("=")[0] + "=DIR" for c in command),
            "exit_code": code,
            "cache_and_data_built_s": round(built, 1),
            "model": "random-init Qwen2.5-0.5B shape" if not args.smoke else "tiny Qwen2",
        } | summarise(rows, warmup=0 if args.smoke else 1)  # fmt: skip
        import torch

        result["device"] = (
            torch.cuda.get_device_name(0) if torch.cuda.is_available() and not args.smoke else "cpu"
        )
        result["torch"] = torch.__version__
    out = args.out or (None if args.smoke else str(ROOT / "benchmarks" / "results" / "gsm8k_gpu.json"))
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    return 0 if code == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
