"""The doctor's memory forecast (`grpokit.models.forecast_memory`) against the peak RSS of real GRPO
steps on the CPU, for three model sizes (issue 26, point 2: within 25%).

Each size runs in a fresh process: imports, the 32k-character tokenizer and the prompts first, then
the process's own RSS is read (the baseline the forecast is given), then the Llama is built
(`models.build_policy`, V = 32000, untied, no dropout) and trained through grpokit's own loop
(`train_grpo`, 2 steps: 2 prompts × 4 completions of 64 tokens, micro-batches of 4, β = 0.04 so a
reference copy and its pass exist). The peak RSS (`ru_maxrss`) is read when step 2's metrics are
reported, before the final checkpoint is written: step 2 is the steady state, where AdamW's state
already exists during the backward (at step 1 it is created after it). The forecast is
`forecast_memory(ModelShape.of(model), StepShape(...), baseline).total`.

    python benchmarks/doctor_memory.py            # the three sizes; writes results/doctor_memory.json
    python benchmarks/doctor_memory.py --smoke    # one tiny size, nothing written unless --out

Each size is measured twice: under glibc's defaults (the acceptance figure), and with
MALLOC_MMAP_THRESHOLD_=131072, so that every freed block of 128 KiB or more goes back to the system
at once and RSS follows what the code holds rather than what the allocator keeps.

What measuring taught the counting (each a count of what the code holds, no factor):
* the first count was already within 25% (0.92, 0.90, 0.87) but undercounted the largest size's
  update: its peak RSS is at the start of the prompt pass's backward, not of the whole backward. The
  lean forward runs each prompt once per group in a pass of its own (`shared_prefix`), so every weight
  but an untied head is used twice, and autograd holds a whole gradient of each until the prompt
  pass's contribution arrives: +0.45 GB at 162M parameters (`held_gradients`);
* autograd's saved tensors (tests/models/test_memory_forecast.py hooks them): SDPA's output
  transposed back to [b, L, h·d] is a view, not a copy; the suffix pass's SDPA saves the prompt's keys
  and values repeated in front of each row's; transformers' attention keeps its mask in every layer;
* the gradients of an update live until the next update starts (`zero_grad` runs at its start), so
  sampling and the reference pass hold them beside AdamW's state; AdamW's state exists during the
  backward only from step 2 on, hence the measurement at step 2;
* the remaining gap under glibc's defaults is the allocator's: freed heap memory stays resident
  (mallinfo2: up to 0.7 GB free in the arena at the end of the largest size's step 2; malloc_trim
  returns it), about 10% of the peak; with freed memory returned at once the forecast is within 2-4%,
  the rest being the runtime's own first-use allocations after the baseline (thread pools, caches made
  on first use: about 35 MB, what the smoke size measures alone).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path

HERE = Path(__file__).resolve().parent
# name -> (hidden, layers, heads, intermediate, vocabulary)
SIZES = {
    "smoke": (32, 1, 2, 64, 512),
    "small": (256, 4, 4, 1024, 32000),
    "medium": (512, 8, 8, 2048, 32000),
    "large": (768, 12, 12, 3072, 32000),
}
PROMPTS, GENERATIONS, TOKENS, MICRO = 2, 4, 64, 4
BOUND = 0.25  # |forecast / measured - 1| must not exceed it
EXACT_MMAP_THRESHOLD = 128 * 1024  # MALLOC_MMAP_THRESHOLD_ of the second measurement
GIB = 2**30


def rss_bytes() -> int:
    """This process's resident set now (VmRSS)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def dense_reward(prompts, completions, **_):
    """The share of a completion's characters among the first 500 of the alphabet's extra characters."""
    chosen = {chr(0x4E00 + i) for i in range(500)}
    return [sum(ch in chosen for ch in c) / max(len(c), 1) for c in completions]


def measure(size: str, seed: int = 0, dtype: str = "float32") -> dict:
    """One size, in this (fresh) process: baseline, model, two GRPO steps, peak RSS and the forecast;
    `dtype`: the compute dtype (bfloat16: autocast over float32 weights, whose compute-dtype copies the
    forecast counts)."""
    import torch
    from transformers import LlamaForCausalLM  # noqa: F401 - build_policy's import, counted in the baseline

    from grpokit.config import GRPOConfig
    from grpokit.data import get_task
    from grpokit.models import ModelShape, StepShape, build_policy, char_tokenizer, forecast_memory
    from grpokit.train.grpo import train_grpo

    hidden, layers, heads, intermediate, vocab = SIZES[size]
    task = get_task("addition", seed=seed)
    extra = "".join(chr(0x4E00 + i) for i in range(vocab - 4 - len(set(task.alphabet))))
    tokenizer = char_tokenizer(task.alphabet + extra)
    assert len(tokenizer) == vocab, len(tokenizer)
    prompt_length = max(len(tokenizer(r["prompt"])["input_ids"]) for r in task.train)
    baseline = rss_bytes()  # imports, tokenizer and prompts: the process's own
    model = build_policy(
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        vocab_size=vocab,
        dropout=0.0,
        max_seq_len=256,
        seed=seed,
        intermediate_size=intermediate,
    )
    peaks: dict[int, int] = {}  # step -> peak RSS when it reported
    marks: dict[str, tuple[int, int]] = {"built": (rss_bytes(), peak_rss_bytes())}  # (RSS, peak) by event

    def on_event(kind: str, step: int, data: dict) -> None:
        marks[f"{kind}{step}"] = (rss_bytes(), peak_rss_bytes())
        if kind == "step":
            peaks[step] = peak_rss_bytes()

    with tempfile.TemporaryDirectory() as tmp:
        cfg = GRPOConfig(
            output_dir=str(Path(tmp) / "run"),
            task=None,
            seed=seed,
            prompts_per_step=PROMPTS,
            num_generations=GENERATIONS,
            micro_batch_size=MICRO,
            max_completion_length=TOKENS,
            beta=0.04,
            learning_rate=1e-5,
            max_steps=2,
            num_eval_prompts=2,
            eval_steps=0,
            save_steps=0,
            log_completions_steps=0,
            progress=False,
            dtype=dtype,
        )
        began = time.perf_counter()
        train_grpo(
            cfg,
            model=model,
            tokenizer=tokenizer,
            reward_funcs=[dense_reward],
            train_rows=task.train,
            eval_rows=task.eval[:2],
            on_event=on_event,
        )
        seconds = time.perf_counter() - began
    shape = ModelShape.of(model)
    step = StepShape(
        rows=PROMPTS * GENERATIONS,
        micro_batch_size=MICRO,
        prompt_length=prompt_length,
        completion_length=TOKENS,
        reference=True,
        compute_bytes=torch.empty((), dtype=getattr(torch, dtype)).element_size(),
        master_bytes=4,
        fused_logps=True,
        group_size=GENERATIONS,
    )
    forecast = forecast_memory(shape, step, baseline)
    measured = peaks[2]
    return {
        "size": size,
        "shape": {"hidden": hidden, "layers": layers, "heads": heads, "intermediate": intermediate},
        "vocab": vocab,
        "parameters": shape.num_parameters,
        "work": f"{PROMPTS} prompts x {GENERATIONS} completions x {TOKENS} tokens, prompts of at most "
        f"{prompt_length} tokens, micro-batches of {MICRO}, beta 0.04",
        "baseline_bytes": baseline,
        "forecast_bytes": forecast.total,
        "forecast_parts": asdict(forecast),
        "peak_phase": forecast.peak_phase,
        "measured_peak_rss_bytes": measured,
        "measured_peak_rss_step1_bytes": peaks[1],
        "peak_rss_with_final_checkpoint_bytes": peak_rss_bytes(),
        "ratio": forecast.total / measured,
        "seconds": seconds,
        "marks": marks,
        "torch": torch.__version__,
        "dtype": dtype,
    }


def run_child(size: str, exact_malloc: bool = False, dtype: str = "float32") -> dict:
    """`measure(size)` in a fresh process; with `exact_malloc`, glibc's malloc returns every freed block
    of 128 KiB or more to the system at once (a fixed mmap threshold), so that RSS follows what the
    code holds rather than what the allocator keeps."""
    env = dict(os.environ)
    env.pop("MALLOC_MMAP_THRESHOLD_", None)
    if exact_malloc:
        env["MALLOC_MMAP_THRESHOLD_"] = str(EXACT_MMAP_THRESHOLD)
    out = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--child", size, "--dtype", dtype],
        check=True,
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def measure_size(size: str, exact_malloc: bool, dtype: str = "float32") -> dict:
    """One size under glibc's defaults (the acceptance figure), and optionally again with freed memory
    returned at once."""
    row = run_child(size, dtype=dtype)
    if exact_malloc:
        exact = run_child(size, exact_malloc=True, dtype=dtype)
        row["exact_malloc"] = {
            "measured_peak_rss_bytes": exact["measured_peak_rss_bytes"],
            "baseline_bytes": exact["baseline_bytes"],
            "forecast_bytes": exact["forecast_bytes"],
            "ratio": exact["ratio"],
        }
    return row


def machine() -> dict:
    model = platform.processor() or "unknown"
    try:
        lines = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout.splitlines()
        model = next(line.split(":", 1)[1].strip() for line in lines if line.startswith("Model name"))
    except (OSError, subprocess.CalledProcessError, StopIteration):
        pass
    return {"cpu": model, "cores": os.cpu_count(), "python": platform.python_version()}


def table(rows: list[dict]) -> str:
    lines = [
        "| size | parameters | baseline GiB | forecast GiB | measured peak RSS GiB | forecast / measured "
        "| with freed memory returned: measured GiB, ratio |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        exact = r.get("exact_malloc")
        returned = f"{exact['measured_peak_rss_bytes'] / GIB:.2f}, {exact['ratio']:.3f}" if exact else "-"
        lines.append(
            f"| {r['size']} | {r['parameters']:,} | {r['baseline_bytes'] / GIB:.2f} "
            f"| {r['forecast_bytes'] / GIB:.2f} | {r['measured_peak_rss_bytes'] / GIB:.2f} "
            f"| {r['ratio']:.3f} | {returned} |"
        )
    return "\n".join(lines)


def results_section(result: dict) -> str:
    m = result["machine"]
    checkpoint = max(
        r["peak_rss_with_final_checkpoint_bytes"] - r["measured_peak_rss_bytes"] for r in result["rows"]
    )
    saving = (
        "which did not raise it" if checkpoint <= 0 else f"which raised it by {checkpoint / 2**20:.0f} MiB"
    )
    intro = (
        f"{m['cpu']}, {m['cores']} cores, {result['date']}. Command: `{result['command']}`. Each size in a "
        "fresh process: the baseline is the RSS after imports, tokenizer and prompts; the measured peak is "
        f"`ru_maxrss` when step 2 of `train_grpo` reports (before the final checkpoint, {saving}); the "
        "forecast is `forecast_memory(...).total` with that baseline. Work: "
        f"{result['rows'][0]['work']}; Llama, V = 32000, untied, float32. The last column measures "
        f"again with MALLOC_MMAP_THRESHOLD_={EXACT_MMAP_THRESHOLD} (every freed block of 128 KiB or more "
        "returned to the system at once): what the code holds. The difference is glibc's, freed heap "
        "memory that stays resident (measured apart with mallinfo2: 0.7 GB free in its arena at the end "
        "of the largest size's step 2); what the forecast misses beyond it is the runtime's own "
        "first-use memory after the baseline (about 35 MB, what the `--smoke` size measures alone). "
        "JSON: `results/doctor_memory.json`; what the measurements changed in the counting: the "
        "script's docstring."
    )
    verdict = f"All within {BOUND:.0%}: {'yes' if result['all_within_bound'] else 'NO'}."
    intro = textwrap.fill(intro, 100, break_long_words=False, break_on_hyphens=False)
    return f"\n## Doctor memory forecast (issue 26)\n\n{intro}\n\n{table(result['rows'])}\n\n{verdict}\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="one tiny size (V = 512); writes only --out")
    parser.add_argument("--child", choices=sorted(SIZES), help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=None, help="default: results/doctor_memory.json")
    parser.add_argument("--no-results-md", action="store_true", help="do not append to RESULTS.md")
    parser.add_argument(
        "--dtype", choices=["float32", "bfloat16"], default="float32", help="compute dtype (weights: float32)"
    )
    parser.add_argument("--sizes", nargs="+", choices=sorted(SIZES), default=None, help="default: all three")
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(measure(args.child, dtype=args.dtype)))
        return 0
    sizes = ["smoke"] if args.smoke else (args.sizes or ["small", "medium", "large"])
    rows = [measure_size(size, exact_malloc=not args.smoke, dtype=args.dtype) for size in sizes]
    result = {
        "rows": rows,
        "bound": BOUND,
        "all_within_bound": all(abs(r["ratio"] - 1) <= BOUND for r in rows),
        "machine": machine(),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": "python benchmarks/doctor_memory.py" + (" --smoke" if args.smoke else ""),
    }
    print(table(rows))
    out = args.out or (None if args.smoke else HERE / "results" / "doctor_memory.json")
    if out is not None:
        out.write_text(json.dumps(result, indent=2) + "\n")
    if not args.smoke and not args.no_results_md:
        with open(HERE / "RESULTS.md", "a") as f:
            f.write(results_section(result))
    return 0 if result["all_within_bound"] else 1


if __name__ == "__main__":
    sys.exit(main())
