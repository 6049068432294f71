"""`grpokit report RUN_DIR`: PNG plots of a run's metrics and an HTML page showing them with the config."""

from __future__ import annotations

import html
import json
from pathlib import Path

PLOTS = {
    "reward": ["reward", "eval/reward"],
    "accuracy": ["eval/accuracy", "accuracy", "eval/pass@1", "eval/pass@4", "eval/pass@8"],
    "margin": ["margin", "eval/margin"],
    "rewards": ["chosen_rewards", "rejected_rewards", "eval/chosen_rewards", "eval/rejected_rewards"],
    "kl": ["kl"],
    "entropy": ["entropy"],
    "length": ["completions/mean_length", "eval/completions/mean_length"],
    "loss": ["loss"],
    "clipping": ["clip_ratio/region_mean", "clip_ratio/low_mean", "clip_ratio/high_mean"],
    # the share of groups whose G rewards all agree: their advantages are 0, nothing is learned from them
    "zero_spread": ["frac_reward_zero_std"],
}
SFT_PLOT = ("sft_loss", "sft/loss")  # the supervised warm start, from sft_metrics.jsonl, by its own steps


def _read_rows(path: Path) -> list[dict]:
    """The JSON rows of a metrics file. A last line cut short (the run was killed while writing it)
    is left out, as a resumed run drops it; any other line that is not JSON is named."""
    lines = path.read_text(encoding="utf-8", errors="replace").split("\n")
    rows = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as error:
            if number == len(lines):  # no newline after it: the write was cut short
                break
            raise ValueError(
                f"{path}: line {number} is not valid JSON ({error.msg}); the file was edited or damaged."
            ) from None
    return rows


def read_sft_metrics(run_dir: Path) -> list[dict]:
    """The warm start's rows ({"sft_step", "sft/loss"}), or none when the run had no warm start."""
    path = run_dir / "sft_metrics.jsonl"
    if not path.is_file():
        return []
    return _read_rows(path)


def read_metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{run_dir} has no metrics.jsonl: is it a grpokit run directory?")
    return _read_rows(path)


def write_report(run_dir: str | Path) -> Path:
    """Write RUN_DIR/report/{<metric>.png, index.html}; returns the HTML path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run = Path(run_dir)
    rows = read_metrics(run)
    out = run / "report"
    out.mkdir(exist_ok=True)
    figures = []
    sft_rows = read_sft_metrics(run)
    plots: list[tuple[str, dict[str, list[tuple[float, float]]], str]] = [
        (name, {k: [(r["step"], r[k]) for r in rows if r.get(k) is not None] for k in keys}, "step")
        for name, keys in PLOTS.items()
    ]
    name, key = SFT_PLOT
    plots.append(
        (name, {key: [(r["sft_step"], r[key]) for r in sft_rows if r.get(key) is not None]}, "sft step")
    )
    for name, series, xlabel in plots:
        series = {k: v for k, v in series.items() if v}
        if not series:
            continue
        fig, ax = plt.subplots(figsize=(6, 3.2))
        for key, points in series.items():
            steps, values = zip(*points, strict=True)
            ax.plot(steps, values, marker="o" if len(points) < 20 else None, label=key)
        ax.set_xlabel(xlabel)
        ax.set_title(name)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / f"{name}.png", dpi=100)
        plt.close(fig)
        figures.append(name)
    config = (run / "config.yaml").read_text() if (run / "config.yaml").is_file() else "(no config.yaml)"
    last_eval = next((r for r in reversed(rows) if any(k.startswith("eval/") for k in r)), {})
    summary = "".join(
        f"<tr><td>{html.escape(k)}</td><td>{v:.4g}</td></tr>"
        for k, v in last_eval.items()
        if k.startswith("eval/") and isinstance(v, (int, float))
    )
    page = out / "index.html"
    page.write_text(
        "<!doctype html><meta charset='utf-8'><title>grpokit run report</title>"
        "<style>body{font-family:sans-serif;max-width:1300px;margin:2em auto}img{width:600px}"
        "pre{background:#f4f4f4;padding:1em}td{padding:0 1em}</style>"
        f"<h1>{html.escape(run.name)}</h1>"
        f"<p>{len(rows)} metric rows, last step {rows[-1]['step'] if rows else 0}</p>"
        f"<h2>Last evaluation</h2><table>{summary}</table><h2>Curves</h2>"
        + "".join(f"<img src='{n}.png' alt='{n}'>" for n in figures)
        + f"<h2>Config</h2><pre>{html.escape(config)}</pre>"
    )
    return page
