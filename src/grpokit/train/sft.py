"""A minimal supervised warm start: cross-entropy on the answer tokens (and EOS) of a task.

GRPO learns only from completions that sometimes succeed; a random policy never does, so the
demo first teaches the format and some of the skill with a few hundred supervised steps.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ..config.plan import SFTSchedule
from ..models.device import Precision, model_device
from .optim import lr_factor


def _encode_all(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    """Each text's token ids (none for an empty one), in one call to the tokenizer: a fast
    tokenizer encodes the list at once, where a call per text spent more time in Python than in
    encoding (a tenth of the main job's warm start)."""
    nonempty = [text for text in texts if text]
    encoded = iter(tokenizer(nonempty, add_special_tokens=False)["input_ids"] if nonempty else [])
    return [list(next(encoded)) if text else [] for text in texts]


def sft_batch(tokenizer: Any, rows: Sequence[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """Left-padded prompt + answer + EOS, with a bool mask of the tokens to learn. [n, L] each.
    A row with "segments" ([(text, learned)], a multi-turn episode) instead of "answer" learns the
    policy's segments and the final EOS, and reads the environment's as context; each segment is
    tokenized on its own, as a multi-turn rollout tokenizes each turn."""
    laid = [
        [(row["prompt"], False), *(row["segments"] if "segments" in row else [(row["answer"], True)])]
        for row in rows
    ]
    encoded = iter(_encode_all(tokenizer, [text for parts in laid for text, _ in parts]))
    sequences, learned = [], []
    for parts in laid:
        ids, learn = [], []
        for _, policy in parts:
            part = next(encoded)
            ids += part
            learn += [bool(policy)] * len(part)
        sequences.append(ids + [tokenizer.eos_token_id])
        learned.append(learn + [True])
    width = max(len(s) for s in sequences)
    pad = [width - len(s) for s in sequences]
    ids = torch.tensor(
        [[tokenizer.pad_token_id] * p + s for p, s in zip(pad, sequences, strict=True)]
    )  # [n, L]
    positions = torch.arange(width)[None, :]  # [1, L]
    attention = positions >= torch.tensor(pad)[:, None]  # [n, L]
    target = torch.tensor([[False] * p + m for p, m in zip(pad, learned, strict=True)])  # [n, L]
    return {"input_ids": ids, "attention_mask": attention, "target_mask": target}


def sft_loss(model: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Mean cross-entropy (float32) of the target tokens: logits[:, t] predicts ids[:, t + 1]. The
    batch is moved to the model's device; the loss is a 0-d tensor there."""
    device = model_device(model)
    batch = {name: value.to(device) for name, value in batch.items()}
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"].long()).logits[:, :-1]
    targets = batch["input_ids"][:, 1:]  # [n, L-1]
    mask = batch["target_mask"][:, 1:]  # [n, L-1]
    per_token = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1), reduction="none"
    )
    per_token = per_token.reshape(targets.shape)
    return (per_token * mask).sum() / mask.sum().clamp(min=1)


@dataclass(frozen=True)
class SFTResult:
    losses: list[float]  # one per step taken
    stopped: bool  # `should_stop` ended it before `steps`
    reached: bool = False  # `done` ended it (the warm start reached its goal)


@dataclass(frozen=True)
class SFTHooks:
    """What a supervised run reports to and stops on: `on_step(step, loss)` after each step;
    `done(step)` True ends it as complete (its goal reached); `should_stop()` True ends it as
    interrupted (a signal)."""

    on_step: Callable[[int, float], None] | None = None
    should_stop: Callable[[], bool] | None = None
    done: Callable[[int], bool] | None = None


def run_sft(
    model: Any,
    tokenizer: Any,
    rows: Sequence[dict[str, Any]],
    schedule: SFTSchedule,
    hooks: SFTHooks = SFTHooks(),
    precision: Precision | None = None,
) -> SFTResult:
    """Up to `schedule.steps` AdamW steps on random batches of `rows` (warm-up then cosine decay,
    gradients clipped to `schedule.max_grad_norm`), reporting to and stopped by `hooks`.

    The model trains where it is (`model_device`): batches go there, losses come back to the host.
    precision: the model is stored in `precision.master` and its forward passes run under autocast
    in `precision.compute` (float16 with wider weights: with a gradient scaler); None: as stored."""
    steps, batch_size, max_grad_norm = schedule.steps, schedule.batch_size, schedule.max_grad_norm
    on_step, should_stop, done = hooks.on_step, hooks.should_stop, hooks.done
    device = model_device(model)
    precision = precision or Precision(compute=torch.float32, master=torch.float32)
    # float16 gradients of float32 weights underflow without scaling; bfloat16's range needs none
    scaler = torch.amp.GradScaler(device.type, enabled=precision.mixed and precision.compute == torch.float16)
    rng = random.Random(schedule.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=schedule.learning_rate, weight_decay=0.0)
    # warm-up, then cosine decay to 0: a warm start that ends settled, not half-way down a steep stretch
    warmup_steps = schedule.warmup_steps
    lr_schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, kind="cosine", warmup_steps=warmup_steps, max_steps=steps)
    )
    model.train()
    rows = list(rows)
    losses: list[float] = []
    for step in range(1, steps + 1):
        batch = sft_batch(tokenizer, rng.sample(rows, min(batch_size, len(rows))))
        with precision.autocast(device):
            loss = sft_loss(model, batch)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        if max_grad_norm is not None:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        scaler.step(optimizer)
        scaler.update()
        lr_schedule.step()
        losses.append(loss.item())
        if on_step is not None:
            on_step(step, losses[-1])
        if done is not None and step < steps and done(step):
            return SFTResult(losses, stopped=False, reached=True)
        if should_stop is not None and step < steps and should_stop():
            return SFTResult(losses, stopped=True)
    return SFTResult(losses, stopped=False)
