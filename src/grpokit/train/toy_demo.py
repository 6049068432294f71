"""A GRPO run you can read in one screen: a tabular policy learns 4-digit answers.

Each of P prompts (an integer p) has one right answer, the four digits of (37·p + 11) mod 10000.
The policy is a table of logits θ[p, t, v] (no network), so the run takes seconds on a laptop CPU
and every step of GRPO is visible:

    sample G answers per prompt -> score (digits right, plus a small format bonus)
    -> combine_rewards -> group_advantages -> num_iterations clipped updates against the
       sampling policy (old_logps) with a KL penalty to the initial policy (ref_logps)

Only `grpokit.ops` is used for the math; this file is the plumbing around it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..models import resolve_device
from ..ops import combine_rewards, group_advantages, grpo_loss, token_logps

DIGITS, T = 10, 4  # vocabulary: the ten digits; completion width: four digits


@dataclass(frozen=True)
class ToyConfig:
    steps: int = 60
    num_prompts: int = 16  # P
    num_generations: int = 8  # G
    num_iterations: int = 2  # μ: updates per sampled batch (makes old_logps ≠ logps, so clipping acts)
    loss_type: str = "dapo"
    beta: float = 0.04
    epsilon: float = 0.2
    epsilon_high: float = 0.28
    learning_rate: float = 0.3
    seed: int = 0
    device: str = "auto"  # auto | cpu | cuda | cuda:N; draws come from a CPU generator on any device


def answers(num_prompts: int) -> torch.Tensor:
    """The right answer of every prompt, as digits. [P, T]"""
    values = (37 * torch.arange(num_prompts) + 11) % 10**T  # [P]
    powers = 10 ** torch.arange(T - 1, -1, -1)  # [T]
    return (values[:, None] // powers) % 10  # [P, T]


def digit_reward(completions: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Fraction of digits right. [B, T], [B, T] -> [B]"""
    return (completions == target).float().mean(-1)


def leading_digit_reward(completions: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """1 when the first digit is right, else unscorable (NaN): shows NaN-aware combination. [B]"""
    right = completions[:, 0] == target[:, 0]
    return torch.where(
        right,
        torch.ones_like(right, dtype=torch.float),
        torch.full_like(right, float("nan"), dtype=torch.float),
    )


def greedy_accuracy(theta: torch.Tensor, target: torch.Tensor) -> float:
    return (theta.argmax(-1) == target).all(-1).float().mean().item()


def run(toy: ToyConfig, on_step=None) -> dict[str, float]:
    """Train; call `on_step(step, metrics)` after each step. Returns accuracy before and after."""
    gen = torch.Generator().manual_seed(toy.seed)
    torch.manual_seed(toy.seed)
    device = resolve_device(toy.device)
    P, G = toy.num_prompts, toy.num_generations
    target = answers(P).to(device)  # [P, T]
    theta = torch.nn.Parameter((0.5 * torch.randn(P, T, DIGITS, generator=gen)).to(device))  # [P, T, V]
    ref_theta = theta.detach().clone()  # the reference policy: the initial table
    optimizer = torch.optim.Adam([theta], lr=toy.learning_rate)
    weights = torch.tensor([1.0, 0.25], device=device)
    before = greedy_accuracy(theta.detach(), target)

    for step in range(1, toy.steps + 1):
        # sample G completions per prompt from the current policy
        with torch.no_grad():
            probs = torch.softmax(theta, -1).repeat_interleave(G, dim=0)  # [B, T, V]
            draws = torch.multinomial(probs.reshape(-1, DIGITS).cpu(), 1, generator=gen)  # [B·T, 1]
            completions = draws.reshape(P * G, T).to(device)  # [B, T]
            row_target = target.repeat_interleave(G, dim=0)  # [B, T]
            rewards_per_func = torch.stack(
                [digit_reward(completions, row_target), leading_digit_reward(completions, row_target)], dim=1
            )  # [B, R]
            rewards = combine_rewards(rewards_per_func, weights)  # [B]
            adv = group_advantages(rewards, G)
            old_logps = token_logps(theta.repeat_interleave(G, dim=0), completions)  # [B, T]
            ref_logps = token_logps(ref_theta.repeat_interleave(G, dim=0), completions)  # [B, T]
        mask = torch.ones(P * G, T, dtype=torch.bool, device=device)  # [B, T] every digit counts
        for _ in range(toy.num_iterations):
            logps = token_logps(theta.repeat_interleave(G, dim=0), completions)  # [B, T]
            out = grpo_loss(
                logps,
                adv.advantages,
                mask,
                old_logps=old_logps,
                ref_logps=ref_logps,
                loss_type=toy.loss_type,
                beta=toy.beta,
                epsilon=toy.epsilon,
                epsilon_high=toy.epsilon_high,
            )
            optimizer.zero_grad()
            out.loss.backward()
            optimizer.step()
        if on_step is not None:
            metrics = {
                "reward": torch.nanmean(rewards).item(),
                "frac_reward_zero_std": adv.is_std_zero.float().mean().item(),
                "loss": out.loss.item(),
                "greedy_accuracy": greedy_accuracy(theta.detach(), target),
            } | {name: value.item() for name, value in out.metrics.items()}
            on_step(step, metrics)
    return {"accuracy_before": before, "accuracy_after": greedy_accuracy(theta.detach(), target)}


# ----------------------------------------------------------------------------- grpokit demo

SHOWN = {  # metric -> its column in the demo's table
    "reward": "reward",
    "frac_reward_zero_std": "zero-std groups",
    "kl": "kl",
    "clip_ratio/region_mean": "clipped",
    "loss": "loss",
    "greedy_accuracy": "accuracy",
}


def run_shown(toy: ToyConfig, console: Any) -> dict[str, float]:
    """`run` as `grpokit demo` shows it on `console`: a progress bar, then a table of ten steps' metrics
    and the accuracy before and after. Returns `run`'s result."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn
    from rich.table import Table

    title = f"GRPO on the toy digits task ({toy.loss_type}, P={toy.num_prompts}, G={toy.num_generations})"
    table = Table(title=title)
    for header in ["step", *SHOWN.values()]:
        table.add_column(header, justify="right")
    every = max(1, toy.steps // 10)
    columns = TextColumn("training"), BarColumn(), TextColumn("{task.completed}/{task.total}")
    with Progress(*columns, TimeRemainingColumn(), console=console, transient=True) as bar:
        task = bar.add_task("train", total=toy.steps)

        def on_step(step: int, metrics: dict[str, float]) -> None:
            bar.update(task, advance=1)
            if step % every == 0 or step == toy.steps:
                table.add_row(str(step), *(f"{metrics.get(name, float('nan')):.4f}" for name in SHOWN))

        result = run(toy, on_step)
    console.print(table)
    console.print(
        f"greedy accuracy (all four digits right): {100 * result['accuracy_before']:.1f}% before, "
        f"{100 * result['accuracy_after']:.1f}% after {toy.steps} steps"
    )
    return result
