"""`grpokit report RUN_DIR`: PNG plots of a run's metrics and an HTML page showing them with the config."""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Any

PLOTS = {
    "reward": ["reward", "eval/reward"],
    "accuracy": ["eval/accuracy", "accuracy", "eval/pass@1", "eval/pass@4", "eval/pass@8"],
    "margin": ["margin", "eval/margin"],
    "rewards": ["chosen_rewards", "rejected_rewards", "eval/chosen_rewards", "eval/rejected_rewards"],
    "kl": ["kl"],
    "entropy": ["entropy", "entropy/target"],
    "length": ["completions/mean_length", "eval/completions/mean_length"],
    "loss": ["loss"],
    "clipping": ["clip_ratio/region_mean", "clip_ratio/low_mean", "clip_ratio/high_mean"],
    # the share of groups whose G rewards all agree: their advantages are 0, nothing is learned from them
    "zero_spread": ["frac_reward_zero_std"],
    # the sampler's log-probs against the training forward's (what sampling_correction corrects)
    "logp_mismatch": ["sampling/sampling_logp_difference/mean", "sampling/sampling_logp_difference/max"],
    # loss_type=opd or gkd: how far the student is from its teacher (nats a token)
    "distillation": ["distill/kl", "distill/divergence"],
    # curriculum: the share of prompts in each pool; target_entropy: the bonus's coefficient
    "curriculum": ["curriculum/active", "curriculum/solved", "curriculum/failed"],
    "entropy_control": ["entropy/coef"],
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


def read_alerts(run_dir: Path) -> list[dict]:
    """The run's training-health alerts (alerts.jsonl: step, name, value, threshold, advice), or none."""
    path = run_dir / "alerts.jsonl"
    return _read_rows(path) if path.is_file() else []


def _mark_alerts(ax: object, alerts: list[dict]) -> None:
    """A dashed red line at each alert's step, named at the top of the plot."""
    for alert in alerts:
        ax.axvline(alert["step"], color="tab:red", linestyle="--", linewidth=1, alpha=0.8)  # type: ignore[attr-defined]
        ax.annotate(  # type: ignore[attr-defined]
            alert["name"],
            (alert["step"], 1.0),
            xycoords=("data", "axes fraction"),
            xytext=(-3, -3),  # beside the line, not on it
            textcoords="offset points",
            rotation=90,
            fontsize=7,
            color="tab:red",
            va="top",
            ha="right",
        )


def _alerts_table(alerts: list[dict]) -> str:
    """The alerts as an HTML table (none: a line saying so)."""
    if not alerts:
        return "<h2>Alerts</h2><p>None fired.</p>"
    rows = "".join(
        f"<tr><td>{a['step']}</td><td>{html.escape(str(a['name']))}</td><td>{a['value']:.4g}</td>"
        f"<td>{a['threshold']:g}</td><td>{html.escape(str(a['advice']))}</td></tr>"
        for a in alerts
    )
    head = (
        "<tr><th>step</th><th>alert</th><th>value</th><th>threshold</th><th>what it means, the fix</th></tr>"
    )
    return f"<h2>Alerts</h2><table>{head}{rows}</table>"


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
    alerts = read_alerts(run)
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
        if xlabel == "step":
            _mark_alerts(ax, alerts)
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
        f"<h2>Last evaluation</h2><table>{summary}</table>"
        + _alerts_table(alerts)
        + "<h2>Curves</h2>"
        + "".join(f"<img src='{n}.png' alt='{n}'>" for n in figures)
        + f"<h2>Config</h2><pre>{html.escape(config)}</pre>"
    )
    write_reward_diagnostics(run, out, page)
    return page


# ----------------------------------------------------------------------------- reward-model diagnostics

DIAGNOSTICS_HEADING = "Reward model diagnostics"


def write_reward_diagnostics(run: Path, out: Path, page: Path) -> list[str]:
    """From RUN_DIR/reward_diagnostics.json (a reward-model run's, train/reward_diagnostics.py), write
    calibration.png, accuracy_by_margin.png and length_bias.png into `out` and add a "Reward model
    diagnostics" section with them and the padding check to the HTML `page` (before its config).
    Returns the figures written: none when the run has no such file."""
    path = run / "reward_diagnostics.json"
    if not path.is_file():
        return []
    try:
        found = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} is not valid JSON ({error.msg}); the file was edited or damaged.") from None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figures = []
    for name, draw in (
        ("calibration", _draw_calibration),
        ("accuracy_by_margin", _draw_accuracy_by_margin),
        ("length_bias", _draw_length_bias),
    ):
        fig, ax = plt.subplots(figsize=(6, 3.6))
        if draw(ax, found):
            fig.tight_layout()
            fig.savefig(out / f"{name}.png", dpi=100)
            figures.append(name)
        plt.close(fig)
    section = (
        f"<h2>{DIAGNOSTICS_HEADING}</h2>"
        f"<p>{found.get('num_pairs', 0)} held-out pairs, step {found.get('step', '?')}</p>"
        + "".join(f"<img src='{n}.png' alt='{n}'>" for n in figures)
        + f"<p>{html.escape(_padding_line(found.get('padding_invariance') or {}))}</p>"
    )
    text = page.read_text(encoding="utf-8")
    config_at = text.find("<h2>Config</h2>")
    page.write_text(text[:config_at] + section + text[config_at:] if config_at >= 0 else text + section)
    return figures


def _draw_calibration(ax: Any, found: dict) -> bool:
    """Observed vs Bradley–Terry predicted accuracy per |margin| bucket, on the diagonal when calibrated."""
    buckets = [
        b
        for b in (found.get("calibration") or {}).get("buckets", [])
        if b.get("count")
        and b.get("observed_accuracy") is not None
        and b.get("predicted_accuracy") is not None
    ]
    if not buckets:
        return False
    ax.plot([0, 1], [0, 1], color="grey", linestyle="--", linewidth=1, label="calibrated")
    predicted = [b["predicted_accuracy"] for b in buckets]
    observed = [b["observed_accuracy"] for b in buckets]
    sizes = [20 + 200 * b["count"] / max(c["count"] for c in buckets) for b in buckets]
    ax.scatter(predicted, observed, s=sizes, zorder=3, label="|margin| bucket (area: pairs)")
    for b, x, y in zip(buckets, predicted, observed, strict=True):
        ax.annotate(b["bucket"], (x, y), fontsize=7, xytext=(5, -9), textcoords="offset points")
    ece = found["calibration"].get("expected_calibration_error")
    ax.set_title("calibration" + (f": ECE {ece:.3f}" if ece is not None else ""))
    ax.set_xlabel("predicted accuracy, mean sigmoid(|margin|)")
    ax.set_ylabel("observed accuracy")
    ax.set_xlim(0, 1.02)
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", markerscale=0.4)
    return True


def _draw_accuracy_by_margin(ax: Any, found: dict) -> bool:
    """Pairwise accuracy per |margin| bucket, bars labelled with their pair counts."""
    rows = found.get("accuracy_by_margin") or []
    if not any(r.get("count") for r in rows):
        return False
    names = [r["bucket"] for r in rows]
    accuracy = [r["accuracy"] if r.get("accuracy") is not None else 0.0 for r in rows]
    bars = ax.bar(names, accuracy, color="C0")
    for bar, r in zip(bars, rows, strict=True):
        ax.annotate(
            f"n={r['count']}" if r.get("count") else "empty",
            (bar.get_x() + bar.get_width() / 2, bar.get_height()),
            ha="center",
            va="bottom",
            fontsize=8,
        )
    ax.axhline(0.5, color="grey", linestyle="--", linewidth=1)
    ax.set_ylim(0, 1.1)
    ax.set_xlabel("|r_chosen − r_rejected|")
    ax.set_ylabel("accuracy")
    ax.set_title("accuracy by margin bucket")
    ax.grid(alpha=0.3, axis="y")
    return True


def _draw_length_bias(ax: Any, found: dict) -> bool:
    """Score against token length, chosen and rejected sequences in two colours."""
    bias = found.get("length_bias") or {}
    points = bias.get("points") or {}
    if not any(points.get(k) for k in ("chosen", "rejected")):
        return False
    for key, colour in (("chosen", "C2"), ("rejected", "C3")):
        if points.get(key):
            lengths, scores = zip(*points[key], strict=True)
            ax.scatter(lengths, scores, s=12, alpha=0.6, color=colour, label=key)
    r, wins = bias.get("correlation"), bias.get("longer_wins")
    title = "score vs length: r = " + ("n/a" if r is None else f"{r:.3f}")
    if wins is not None:
        title += f", longer scores higher in {wins:.0%} of {bias.get('num_unequal_pairs', 0)} pairs"
    ax.set_title(title, fontsize=9)
    ax.set_xlabel("tokens")
    ax.set_ylabel("score")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return True


def _padding_line(padding: dict) -> str:
    """The padding check in one sentence."""
    if not padding.get("num_sequences"):
        return "Padding invariance: not checked (no held-out sequences)."
    verdict = "invariant" if padding.get("invariant") else "NOT INVARIANT: the scores depend on padding"
    return (
        f"Padding invariance: max |Δscore| = {padding['max_abs_delta']:.3g} over {padding['num_sequences']} "
        f"sequences scored alone vs batched (left {padding.get('left', float('nan')):.3g}, right "
        f"{padding.get('right', float('nan')):.3g}; up to {padding.get('max_padding', 0)} pad tokens, "
        f"{padding.get('compute_dtype', '?')}; tolerance {padding.get('tolerance', float('nan')):.3g}): "
        f"{verdict}."
    )
