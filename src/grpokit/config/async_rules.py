"""What asynchronous GRPO (max_staleness) cannot take, decided in one place (`async_refusal`): read by
the config's validation with what the config says, and again before a run (train/async_rollout.py
`check_rollout`) with what only the run knows: its processes, episodes from a task's tools or Python."""

from __future__ import annotations

from dataclasses import dataclass

from ..ops.loss_types import LOSS_TYPES


@dataclass(frozen=True)
class AsyncFacts:
    """What the refusals look at: the config's options, and the run's facts."""

    loss_type: str = "grpo"
    lora: bool = False  # use_peft
    servers: bool = False  # rollout_server_urls
    episodes: bool = False  # multi-turn episodes (tools, the task's tools, or an environment)
    workers: int = 1  # rollout_workers
    dynamic_sampling: bool = False
    curriculum: bool = False
    world_size: int = 1  # processes (torchrun)


def async_refusal(f: AsyncFacts) -> str | None:
    """What asynchronous GRPO refuses of `f`, in one line naming the option and the fix; None: taken."""
    sync = "drop max_staleness (the synchronous loop takes it)"
    if f.lora:
        why = "the worker loads whole published weights, not LoRA adapters"
        return f"use_peft with max_staleness is not supported yet: {why}; {sync}"
    if LOSS_TYPES[f.loss_type].demonstrations:
        why = f"{f.loss_type} also learns from dataset answers, which the worker does not draw"
        return f"loss_type with max_staleness is not supported yet: {why}; {sync}"
    if f.servers and f.episodes:
        return (
            "tools with rollout_server_urls is not supported: multi-turn episodes (tools, the task's tools, "
            "or an environment) run in process; drop rollout_server_urls, or set tools=[]"
        )
    if f.servers and f.workers > 1:
        why = "one worker updates the servers' weights; drop one of them"
        return f"rollout_workers with rollout_server_urls is not supported: {why}"
    for name in ("dynamic_sampling", "curriculum"):
        if getattr(f, name) and f.workers > 1:
            return (
                f"{name} with rollout_workers={f.workers} is refused: which prompts a step draws depends on "
                "the last step's rewards, so the workers cannot take steps in turn; set rollout_workers=1"
            )
        if getattr(f, name) and f.world_size > 1:
            return (
                f"{name} with max_staleness under torchrun is not supported yet: its ranks agree through "
                "collectives, which the rollout workers (one per process) do not take part in; drop one of "
                "them, or run on one process"
            )
    return None
