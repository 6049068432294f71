"""`grpokit report RUN_DIR`: PNG plots of a run's metrics and an HTML page showing them with the config."""

from __future__ import annotations

import html
import math
import re
from pathlib import Path
from typing import Any

from .train.run_files import (
    AlertRow,
    MetricsRow,
    PaddingCheck,
    RewardDiagnostics,
    SftMetricsRow,
    read_json,
    read_jsonl,
)

# each plot: the series it draws, and its y axis (what is measured, in what unit)
PLOTS: dict[str, tuple[list[str], str]] = {
    "reward": (["reward", "eval/reward"], "reward (batch mean)"),
    "accuracy": (
        [
            "eval/accuracy",
            "accuracy",
            "eval/pass@1",
            "eval/pass@4",
            "eval/pass@8",
        ],
        "share of prompts solved (0-1)",
    ),
    "margin": (["margin", "eval/margin"], "score margin (chosen - rejected, logits)"),
    "rewards": (
        ["chosen_rewards", "rejected_rewards", "eval/chosen_rewards", "eval/rejected_rewards"],
        "reward model score (logit)",
    ),
    "kl": (["kl"], "KL to the reference (nats/token)"),
    "entropy": (["entropy", "entropy/target"], "entropy (nats/token)"),
    "length": (["completions/mean_length", "eval/completions/mean_length"], "completion length (tokens)"),
    # where the answers can be judged: right and wrong completions' lengths apart (length bias shows here)
    "length_by_correctness": (
        [
            "completions/correct_mean_length",
            "completions/incorrect_mean_length",
            "eval/completions/correct_mean_length",
            "eval/completions/incorrect_mean_length",
        ],
        "completion length, right and wrong (tokens)",
    ),
    "loss": (["loss"], "loss (per token, as optimised)"),
    "clipping": (
        ["clip_ratio/region_mean", "clip_ratio/low_mean", "clip_ratio/high_mean"],
        "share of tokens clipped (0-1)",
    ),
    # the share of groups whose G rewards all agree: their advantages are 0, nothing is learned from them
    "zero_spread": (["frac_reward_zero_std"], "share of groups with zero spread (0-1)"),
    # the sampler's log-probs against the training forward's (what sampling_correction corrects)
    "logp_mismatch": (
        ["sampling/sampling_logp_difference/mean", "sampling/sampling_logp_difference/max"],
        "|sampler - trainer| log-prob (nats/token)",
    ),
    # loss_type=opd or gkd: how far the student is from its teacher (nats a token)
    "distillation": (["distill/kl", "distill/divergence"], "divergence to the teacher (nats/token)"),
    # curriculum: the share of prompts in each pool; target_entropy: the bonus's coefficient
    "curriculum": (["curriculum/active", "curriculum/solved", "curriculum/failed"], "share of prompts (0-1)"),
    "entropy_control": (["entropy/coef"], "entropy bonus coefficient (per nat)"),
}
# the supervised warm start, from sft_metrics.jsonl, by its own steps
SFT_PLOT = ("sft_loss", "sft/loss", "cross-entropy (nats/token)")
PLOTTABLE = 1e300  # larger values are left out of a plot (float32's largest is 3.4e38)


def read_sft_metrics(run_dir: Path) -> list[dict]:
    """The warm start's rows ({"sft_step", "sft/loss"}), or none when the run had no warm start."""
    path = run_dir / "sft_metrics.jsonl"
    return read_jsonl(path, SftMetricsRow) if path.is_file() else []


def read_metrics(run_dir: Path) -> list[dict]:
    """The run's metric rows (metrics.jsonl), each checked by its schema (train/run_files.py)."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{run_dir} has no metrics.jsonl: is it a grpokit run directory?")
    return read_jsonl(path, MetricsRow)


def read_alerts(run_dir: Path) -> list[dict]:
    """The run's training-health alerts (alerts.jsonl: step, name, value, threshold, advice), or none."""
    path = run_dir / "alerts.jsonl"
    return read_jsonl(path, AlertRow) if path.is_file() else []


def _label(text: str) -> str:
    """Text from a run's files as matplotlib draws it literally: a "$" would start mathtext, whose
    parse error on a name like "$\\x$" would end the report."""
    return str(text).replace("$", r"\$")


def _file_name(name: str) -> str:
    """A figure's file name within the report directory: letters, digits, "-" and "_" only, so no
    name ("../../x", "/etc/x") can place a file elsewhere."""
    safe = re.sub(r"[^A-Za-z0-9_-]", "_", name)
    return safe or "_"


def _plottable(value: Any) -> bool:
    """A value a plot can place: a number (NaN and ±inf leave a gap) within ±PLOTTABLE where finite
    (a span of ±1e308 overflows the axis); not null."""
    return value is not None and not (math.isfinite(value) and abs(value) > PLOTTABLE)


def _mark_alerts(ax: object, alerts: list[dict]) -> None:
    """A dashed red line at each alert's step, named at the top of the plot."""
    for alert in alerts:
        ax.axvline(alert["step"], color="tab:red", linestyle="--", linewidth=1, alpha=0.8)  # type: ignore[attr-defined]
        ax.annotate(  # type: ignore[attr-defined]
            _label(alert["name"]),
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


def _escape(value: Any) -> str:
    """Any value shown on the page, as HTML text (quotes too: safe inside a quoted attribute)."""
    return html.escape(str(value), quote=True)


def _images(figures: list[str]) -> str:
    return "".join(f"<img src='{_escape(n)}.png' alt='{_escape(n)}'>" for n in figures)


def _cells(*values: Any) -> str:
    """A table row of the values, each escaped."""
    return "<tr>" + "".join(f"<td>{_escape(v)}</td>" for v in values) + "</tr>"


def _alerts_table(alerts: list[dict]) -> str:
    """The alerts as an HTML table (none: a line saying so)."""
    if not alerts:
        return "<h2>Alerts</h2><p>None fired.</p>"
    rows = "".join(
        _cells(a["step"], a["name"], f"{a['value']:.4g}", f"{a['threshold']:g}", a["advice"]) for a in alerts
    )
    head = (
        "<tr><th>step</th><th>alert</th><th>value</th><th>threshold</th><th>what it means, the fix</th></tr>"
    )
    return f"<h2>Alerts</h2><table>{head}{rows}</table>"


def _draw_curves(
    out: Path, rows: list[dict], sft_rows: list[dict], alerts: list[dict]
) -> tuple[list[str], list[str]]:
    """One PNG per plot of `PLOTS` (and the warm start's loss) that has points, its y axis named with
    its unit; a series that is 0 at every step (clip ratios with one update a batch) is left out, and
    named in a note on the plot, or, when no series is left, in the page's notes. -> (figure names,
    notes)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plots: list[tuple[str, dict[str, list[tuple[float, float]]], str, str]] = [
        (name, {k: [(r["step"], r[k]) for r in rows if _plottable(r.get(k))] for k in keys}, "step", ylabel)
        for name, (keys, ylabel) in PLOTS.items()
    ]
    name, key, ylabel = SFT_PLOT
    plots.append(
        (
            name,
            {key: [(r["sft_step"], r[key]) for r in sft_rows if _plottable(r.get(key))]},
            "sft step",
            ylabel,
        )
    )
    figures, notes = [], []
    for name, drawn, xlabel, ylabel in plots:
        drawn = {k: v for k, v in drawn.items() if v}
        zero = [k for k, v in drawn.items() if all(value == 0 for _, value in v)]
        series = {k: v for k, v in drawn.items() if k not in zero}
        if not series:
            if zero:
                notes.append(f"{name}: {', '.join(zero)} 0 at every step (not drawn)")
            continue
        fig, ax = plt.subplots(figsize=(6, 3.2))
        for key, points in series.items():
            steps, values = zip(*points, strict=True)
            ax.plot(steps, values, marker="o" if len(points) < 20 else None, label=_label(key))
        if xlabel == "step":
            _mark_alerts(ax, alerts)
        if zero:
            ax.annotate(
                _label(f"0 at every step, not drawn: {', '.join(zero)}"),
                (0.01, 0.01),
                xycoords="axes fraction",
                fontsize=7,
                color="dimgray",
            )
        ax.set_xlabel(xlabel)
        ax.set_ylabel(_label(ylabel), fontsize=8)
        ax.set_title(_label(name))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / f"{_file_name(name)}.png", dpi=100)
        plt.close(fig)
        figures.append(_file_name(name))
    return figures, notes


def write_report(run_dir: str | Path, server: str | None = None, samples: int = 8) -> Path:
    """Write RUN_DIR/report/{<metric>.png, index.html}; returns the HTML path. Every file of the run
    is read through its schema (train/run_files.py): a damaged one is a RunFileError naming it, its
    line and the field; everything from the run's files is escaped on the page. `server`: a `grpokit
    serve-policy` URL: the page also shows the greedy completions of `samples` held-out prompts of the
    run's config sampled there, with their rewards (the policy as the server holds it now)."""
    run = Path(run_dir)
    rows = read_metrics(run)
    alerts = read_alerts(run)
    sft_rows = read_sft_metrics(run)
    out = run / "report"
    out.mkdir(exist_ok=True)
    figures, notes = _draw_curves(out, rows, sft_rows, alerts)
    config_file = run / "config.yaml"
    config = (
        config_file.read_text(encoding="utf-8", errors="replace")
        if config_file.is_file()
        else "(no config.yaml)"
    )
    last_eval = next((r for r in reversed(rows) if any(k.startswith("eval/") for k in r)), {})
    summary = "".join(
        _cells(k, f"{v:.4g}")
        for k, v in last_eval.items()
        if k.startswith("eval/") and isinstance(v, (int, float))
    )
    page = out / "index.html"
    page.write_text(
        "<!doctype html><meta charset='utf-8'><title>grpokit run report</title>"
        "<style>body{font-family:sans-serif;max-width:1300px;margin:2em auto}img{width:600px}"
        "pre{background:#f4f4f4;padding:1em}td{padding:0 1em}</style>"
        f"<h1>{_escape(run.name)}</h1>"
        f"<p>{len(rows)} metric rows, last step {_escape(rows[-1]['step'] if rows else 0)}</p>"
        f"<h2>Last evaluation</h2><table>{summary}</table>"
        + _alerts_table(alerts)
        + "<h2>Curves</h2>"
        + _images(figures)
        + "".join(f"<p>{_escape(note)}</p>" for note in notes)
        + (_server_samples(run, server, samples) if server is not None else "")
        + f"<h2>Config</h2><pre>{_escape(config)}</pre>",
        encoding="utf-8",
    )
    write_reward_diagnostics(run, out, page)
    return page


# ----------------------------------------------------------------------------- reward-model diagnostics

DIAGNOSTICS_HEADING = "Reward model diagnostics"


def _server_samples(run: Path, server: str, count: int) -> str:
    """The "Sample completions" section: `count` held-out prompts of the run's config.yaml, greedy on
    `server`, each with its reward."""
    from .config import GRPOConfig, load_config
    from .config.plan import eval_plan
    from .train.eval_run import server_samples

    config = run / "config.yaml"
    if not config.is_file():
        raise ValueError(
            f"{config} does not exist: --server samples the held-out prompts of the run's config"
        )
    found = server_samples(eval_plan(load_config(GRPOConfig, config, [])), server, count)
    rows = "".join(
        f"<tr><td><pre>{_escape(p)}</pre></td><td><pre>{_escape(c)}</pre></td><td>{r:.4g}</td></tr>"
        for p, c, r in zip(found.prompts, found.completions, found.rewards, strict=True)
    )
    return (
        f"<h2>Sample completions</h2><p>greedy, from {_escape(found.url)} ({_escape(found.model)}, weight "
        f"version {found.version})</p><table><tr><th>prompt</th><th>completion</th><th>reward</th></tr>"
        f"{rows}</table>"
    )


def write_reward_diagnostics(run: Path, out: Path, page: Path) -> list[str]:
    """From RUN_DIR/reward_diagnostics.json (a reward-model run's, train/reward_diagnostics.py), write
    calibration.png, accuracy_by_margin.png and length_bias.png into `out` and add a "Reward model
    diagnostics" section with them and the padding check to the HTML `page` (before its config).
    Returns the figures written: none when the run has no such file. The file is read through its
    schema (RunFileError names a damaged one)."""
    path = run / "reward_diagnostics.json"
    if not path.is_file():
        return []
    found = read_json(path, RewardDiagnostics)
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
            fig.savefig(out / f"{_file_name(name)}.png", dpi=100)
            figures.append(_file_name(name))
        plt.close(fig)
    section = (
        f"<h2>{DIAGNOSTICS_HEADING}</h2>"
        f"<p>{_escape(found.num_pairs)} held-out pairs, step {_escape(found.step)}</p>"
        + _images(figures)
        + f"<p>{_escape(_padding_line(found.padding_invariance))}</p>"
    )
    text = page.read_text(encoding="utf-8")
    config_at = text.find("<h2>Config</h2>")
    page.write_text(
        text[:config_at] + section + text[config_at:] if config_at >= 0 else text + section, encoding="utf-8"
    )
    return figures


def _draw_calibration(ax: Any, found: RewardDiagnostics) -> bool:
    """Observed vs Bradley–Terry predicted accuracy per |margin| bucket, on the diagonal when calibrated."""
    buckets = [
        b
        for b in found.calibration.buckets
        if b.count
        and b.observed_accuracy is not None
        and b.predicted_accuracy is not None
        and _plottable(b.observed_accuracy)
        and _plottable(b.predicted_accuracy)
    ]
    if not buckets:
        return False
    ax.plot([0, 1], [0, 1], color="grey", linestyle="--", linewidth=1, label="calibrated")
    predicted = [b.predicted_accuracy for b in buckets]
    observed = [b.observed_accuracy for b in buckets]
    most = max(b.count for b in buckets)
    sizes = [20 + 200 * b.count / most for b in buckets]
    ax.scatter(predicted, observed, s=sizes, zorder=3, label="|margin| bucket (area: pairs)")
    for b, x, y in zip(buckets, predicted, observed, strict=True):
        ax.annotate(_label(b.bucket), (x, y), fontsize=7, xytext=(5, -9), textcoords="offset points")
    ece = found.calibration.expected_calibration_error
    ax.set_title("calibration" + (f": ECE {ece:.3f}" if ece is not None else ""))
    ax.set_xlabel("predicted accuracy, mean sigmoid(|margin|)")
    ax.set_ylabel("observed accuracy")
    ax.set_xlim(0, 1.02)
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", markerscale=0.4)
    return True


def _draw_accuracy_by_margin(ax: Any, found: RewardDiagnostics) -> bool:
    """Pairwise accuracy per |margin| bucket, bars labelled with their pair counts."""
    rows = found.accuracy_by_margin
    if not any(r.count for r in rows):
        return False
    names = [_label(r.bucket) for r in rows]
    accuracy = [r.accuracy if r.accuracy is not None and _plottable(r.accuracy) else 0.0 for r in rows]
    bars = ax.bar(names, accuracy, color="C0")
    for bar, r in zip(bars, rows, strict=True):
        ax.annotate(
            f"n={r.count}" if r.count else "empty",
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


def _draw_length_bias(ax: Any, found: RewardDiagnostics) -> bool:
    """Score against token length, chosen and rejected sequences in two colours."""
    bias = found.length_bias
    points = {
        key: [(n, s) for n, s in getattr(bias.points, key) if _plottable(n) and _plottable(s)]
        for key in ("chosen", "rejected")
    }
    if not any(points.values()):
        return False
    for key, colour in (("chosen", "C2"), ("rejected", "C3")):
        if points[key]:
            lengths, scores = zip(*points[key], strict=True)
            ax.scatter(lengths, scores, s=12, alpha=0.6, color=colour, label=key)
    r, wins = bias.correlation, bias.longer_wins
    title = "score vs length: r = " + ("n/a" if r is None else f"{r:.3f}")
    if wins is not None:
        title += f", longer scores higher in {wins:.0%} of {bias.num_unequal_pairs} pairs"
    ax.set_title(title, fontsize=9)
    ax.set_xlabel("tokens")
    ax.set_ylabel("score")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return True


def _padding_line(padding: PaddingCheck) -> str:
    """The padding check in one sentence (a value the file lacks: "?")."""
    if not padding.num_sequences:
        return "Padding invariance: not checked (no held-out sequences)."
    verdict = "invariant" if padding.invariant else "NOT INVARIANT: the scores depend on padding"
    return (
        f"Padding invariance: max |Δscore| = {_g(padding.max_abs_delta)} over {padding.num_sequences} "
        f"sequences scored alone vs batched (left {_g(padding.left)}, right {_g(padding.right)}; up to "
        f"{_g(padding.max_padding)} pad tokens, {padding.compute_dtype or '?'}; tolerance "
        f"{_g(padding.tolerance)}): {verdict}."
    )


def _g(value: float | None) -> str:
    return "?" if value is None else f"{value:.3g}"
