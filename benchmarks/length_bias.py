"""Dr. GRPO's length finding put to the test on the chain task (issue 54).

Liu et al. 2025 ("Understanding R1-Zero-Like Training: A Critical Perspective") report that GRPO's
per-sequence normalisation (each completion's token losses averaged over its own length) lets the
incorrect completions grow longer as training goes on, and that Dr. GRPO (token losses summed and
divided by a constant) removes that drift. This script trains the `chain` preset (sums of 8-16 digits
written out step by step: completions of 41-126 tokens, in a long or a short style the policy picks)
with loss_type grpo, dr_grpo and dapo, on several seeds, everything else the preset's, and records
step by step the mean length of the right and of the wrong completions, the share right, and the
held-out accuracy.

For each seed the preset's warm start runs once; every loss then trains from that same warmed policy
(`sft_steps=0`), so that within a seed the losses differ in nothing else.

    python benchmarks/length_bias.py [--seeds 1 2 3] [--steps 150] [--losses grpo dr_grpo dapo]
        [--beta B] [--lr-scheduler-type constant|linear|cosine] [--out benchmarks/results/length_bias.json]
        [--figure docs/images/length_bias.png] [--plot-only]

`--plot-only` redraws the figure and the table from the JSON.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

SERIES = {  # what is followed, step by step: metric -> label
    "completions/correct_mean_length": "mean length of right completions (tokens)",
    "completions/incorrect_mean_length": "mean length of wrong completions (tokens)",
    "completions/correct_ratio": "share of the step's completions right",
    # from the step's completions (below): what a length change is made of
    "wrong_excess": "wrong: length beyond the solution in its style (chars)",
    "wrong_terms": "wrong: terms in their prompts",
    "short_style": "share of completions in the short style",
}
FROM_METRICS = list(SERIES)[:3]


def completion_figures(prompts: list[str], completions: list[str], rewards: list[float]) -> dict:
    """What a step's completions are made of. A wrong completion's excess is its length beyond the
    worked solution of its prompt in the style it chose (the short style starts with '+'): rambling on
    is positive, stopping short negative. Its prompt's terms show whether the wrong ones are simply the
    longer sums (a longer right answer, not a longer wrong one)."""
    from grpokit.data.tasks import chain_solution

    excess, terms, short = [], [], 0
    for prompt, completion, reward in zip(prompts, completions, rewards, strict=True):
        numbers = [int(t) for t in prompt.removesuffix("=").split("+")]
        style = "short" if completion.startswith("+") else "full"
        short += style == "short"
        if reward < 1.0:
            excess.append(len(completion) - len(chain_solution(numbers, style)))
            terms.append(len(numbers))
    return {
        "wrong_excess": statistics.fmean(excess) if excess else None,
        "wrong_terms": statistics.fmean(terms) if terms else None,
        "short_style": short / len(completions),
    }


def preset_config(seed: int, output_dir: Path, **overrides):
    from grpokit.config import GRPOConfig
    from grpokit.config.applied import preset_values

    values = preset_values("chain") | {"output_dir": str(output_dir), "seed": seed, "progress": False}
    values |= {"save_steps": 0, "log_completions_steps": 0, "overwrite": True, "report_to": []}
    return GRPOConfig(**(values | overrides))


def tiny_policy(cfg):
    """The tiny Llama and tokenizer the preset's run builds (train/run.py: policy_and_tokenizer)."""
    from grpokit.config.plan import grpo_plan
    from grpokit.data import get_task
    from grpokit.train.run import policy_and_tokenizer

    task = get_task("chain", seed=cfg.seed)
    plan = grpo_plan(cfg)
    return policy_and_tokenizer(plan.model, task.alphabet, 4 * (task.max_prompt_length + 128))


def warm_config(seed: int, scratch: Path):
    """The warm start's run: the preset's, stopped after one GRPO step. It keeps the preset's
    num_eval_prompts: the task's held-out prompts are its first num_eval_prompts rows, so a warm start
    with fewer would learn, worked solutions and all, prompts the later runs hold out (it did, with 2:
    held-out accuracy of 54% that GRPO then 'lost', a collapse that was the warm start's memory)."""
    return preset_config(seed, scratch / f"warm_s{seed}", max_steps=1, eval_steps=0)


def warmed_policy(seed: int, scratch: Path):
    """The preset's warm start for `seed` (stopped, as the preset's is, once a probe is solved to its target):
    the policy's weights at its end, and the tokenizer."""
    from grpokit.train.events import EventKind
    from grpokit.train.grpo import train_grpo

    cfg = warm_config(seed, scratch)
    model, tokenizer = tiny_policy(cfg)
    saved = {}

    def on_event(kind, step, data):
        if kind == EventKind.SFT_DONE:  # the model, warmed in place, before GRPO's first step
            saved["state"] = copy.deepcopy(model.state_dict())
            saved["probe"] = data.get("probe_accuracy")

    result = train_grpo(cfg, model=model, tokenizer=tokenizer, on_event=on_event)
    if result.stopped_by is not None or "state" not in saved:  # a stopped warm start is no start
        raise SystemExit(f"seed {seed}: the warm start was stopped ({result.stopped_by}); nothing recorded")
    return saved, tokenizer


def train_loss(seed: int, loss: str, steps: int, warmed: dict, tokenizer, scratch: Path, **overrides) -> dict:
    from grpokit.train.events import EventKind
    from grpokit.train.grpo import train_grpo

    run_dir = scratch / f"{loss}_s{seed}"
    cfg = preset_config(
        seed, run_dir, loss_type=loss, sft_steps=0, max_steps=steps, log_completions_steps=1, **overrides
    )
    model, _ = tiny_policy(cfg)
    model.load_state_dict(warmed["state"])
    figures: list[dict] = []

    def on_event(kind, step, data):
        if kind == EventKind.COMPLETIONS:  # every step's (log_completions_steps=1)
            figures.append(completion_figures(data["prompts"], data["completions"], data["rewards"]))

    began = time.perf_counter()
    result = train_grpo(cfg, model=model, tokenizer=tokenizer, on_event=on_event)
    if result.stopped_by is not None:  # a signal: the whole benchmark ends, nothing half-run is kept
        raise SystemExit(f"seed {seed} {loss}: stopped ({result.stopped_by}); the runs before it are kept")
    seconds = time.perf_counter() - began
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    out = {key: [r.get(key) for r in rows if "loss" in r] for key in FROM_METRICS}  # (a step's row)
    out |= {key: [f[key] for f in figures] for key in SERIES if key not in FROM_METRICS}
    out["eval"] = [(r["step"], r["eval/accuracy"]) for r in rows if "eval/accuracy" in r]
    out["eval_lengths"] = [
        (
            r["step"],
            r.get("eval/completions/correct_mean_length"),
            r.get("eval/completions/incorrect_mean_length"),
        )
        for r in rows
        if "eval/accuracy" in r
    ]
    out["seconds"] = round(seconds, 1)
    return out


def _mean(values: list) -> float:
    """The mean of the finite values (a step with no right, or no wrong, completion has none)."""
    kept = [v for v in values if v is not None and math.isfinite(v)]
    return statistics.fmean(kept) if kept else math.nan


def window(series: list, first: bool, width: int) -> float:
    """The mean over the first or the last `width` steps."""
    return _mean(series[:width] if first else series[-width:])


def summary(results: dict, width: int) -> dict:
    """Per loss: the first and last `width` steps' mean lengths (right, wrong) and share right, and the
    held-out accuracy before and after, each averaged over seeds; and each seed's drift of the wrong
    completions' length (last window minus first)."""
    table = {}
    for loss, seeds in results["runs"].items():
        row = {}
        for key in SERIES:
            row[key] = [
                statistics.fmean(window(r.get(key, []), True, width) for r in seeds.values()),
                statistics.fmean(window(r.get(key, []), False, width) for r in seeds.values()),
            ]
        wrong = "completions/incorrect_mean_length"
        row["wrong_length_drift_per_seed"] = [
            round(window(r[wrong], False, width) - window(r[wrong], True, width), 1) for r in seeds.values()
        ]
        row["eval_accuracy"] = [
            statistics.fmean(r["eval"][0][1] for r in seeds.values()),
            statistics.fmean(r["eval"][-1][1] for r in seeds.values()),
        ]
        table[loss] = row
    return table


def smoothed(series: list, width: int) -> list[float]:
    values = [math.nan if v is None else v for v in series]
    return [_mean(values[max(0, i - width + 1) : i + 1]) for i in range(len(values))]


def draw(results: dict, figure: Path, width: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(13, 6.6))
    axes = axes.reshape(-1)
    colours = {"grpo": "tab:red", "dr_grpo": "tab:blue", "dapo": "tab:green"}
    for loss, seeds in results["runs"].items():
        for i, (key, label) in enumerate(SERIES.items()):
            for n, r in enumerate(seeds.values()):
                curve = smoothed(r.get(key, []), width)
                axes[i].plot(
                    range(1, len(curve) + 1),
                    curve,
                    color=colours.get(loss),
                    alpha=0.8,
                    linewidth=1,
                    label=loss if n == 0 else None,
                )
            axes[i].set_title(label, fontsize=9)
            axes[i].set_xlabel("GRPO step")
    axes[0].legend(fontsize=8)
    fig.suptitle(
        f"chain task, {len(next(iter(results['runs'].values())))} seeds per loss "
        f"(one line a seed; {width}-step running mean)",
        fontsize=10,
    )
    fig.tight_layout()
    figure.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(figure, dpi=110)
    plt.close(fig)


def markdown(table: dict, width: int) -> str:
    lines = [
        f"| loss | right: length, first → last {width} steps | wrong: length | wrong: drift per seed "
        "| wrong: excess | wrong: terms | short style | share right | held-out accuracy |",
        "|---|---|---|---|---|---|---|---|---|",
    ]

    def moved(pair: list, digits: int) -> str:
        return f"{pair[0]:.{digits}f} → {pair[1]:.{digits}f}"

    for loss, row in table.items():
        right, wrong = row["completions/correct_mean_length"], row["completions/incorrect_mean_length"]
        share, acc = row["completions/correct_ratio"], row["eval_accuracy"]
        drift = ", ".join(f"{d:+.1f}" for d in row["wrong_length_drift_per_seed"])
        lines.append(
            f"| {loss} | {moved(right, 1)} | {moved(wrong, 1)} | {drift} | {moved(row['wrong_excess'], 1)} "
            f"| {moved(row['wrong_terms'], 1)} | {moved(row['short_style'], 2)} | {moved(share, 2)} "
            f"| {100 * acc[0]:.1f}% → {100 * acc[1]:.1f}% |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--losses", nargs="+", default=["grpo", "dr_grpo", "dapo"])
    parser.add_argument("--window", type=int, default=20, help="steps averaged at the start and the end")
    parser.add_argument("--out", default="benchmarks/results/length_bias.json")
    parser.add_argument("--figure", default="docs/images/length_bias.png")
    parser.add_argument("--plot-only", action="store_true")
    parser.add_argument("--beta", type=float, default=None, help="the KL coefficient (default: the preset's)")
    schedules = ["constant", "linear", "cosine"]
    parser.add_argument("--lr-scheduler-type", choices=schedules, default=None, help="default: the preset's")
    args = parser.parse_args()
    out = Path(args.out)
    if args.plot_only:
        results = json.loads(out.read_text())
    else:
        chosen = {"beta": args.beta, "lr_scheduler_type": args.lr_scheduler_type}
        overrides = {key: value for key, value in chosen.items() if value is not None}
        results = {"steps": args.steps, **chosen, "runs": {loss: {} for loss in args.losses}}
        results["warm_probe"] = {}
        with tempfile.TemporaryDirectory() as tmp:
            scratch = Path(tmp)
            for seed in args.seeds:
                warmed, tokenizer = warmed_policy(seed, scratch)
                results["warm_probe"][str(seed)] = warmed["probe"]
                for loss in args.losses:
                    r = train_loss(seed, loss, args.steps, warmed, tokenizer, scratch, **overrides)
                    results["runs"][loss][str(seed)] = r
                    before, after = r["eval"][0][1], r["eval"][-1][1]
                    print(f"seed {seed} {loss}: {before:.3f} -> {after:.3f}, {r['seconds']} s", flush=True)
                    out.parent.mkdir(parents=True, exist_ok=True)
                    out.write_text(json.dumps(results))
    table = summary(results, args.window)
    results["summary"] = table
    out.write_text(json.dumps(results))
    draw(results, Path(args.figure), args.window)
    print(markdown(table, args.window))
    return 0


if __name__ == "__main__":
    sys.exit(main())
