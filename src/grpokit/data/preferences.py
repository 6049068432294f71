"""Preference pairs for reward-model training: `chosen` / `rejected` completions, an optional shared
`prompt`, an optional per-pair `margin`. Text, or conversations (lists of {"role", "content"})
rendered with the tokenizer's chat template. Pairs longer than `max_length` are truncated (the
start of the text is cut, the answer kept) or dropped, as configured, and counted."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from .prompts import DataError, load_prompts
from .task import Task


def load_preferences(source: Any) -> list[dict[str, Any]]:
    """Rows with non-empty `chosen` and `rejected` (and a numeric `margin` when present)."""
    rows = load_prompts(source, prompt_column="chosen")
    for i, row in enumerate(rows):
        if row.get("rejected") in (None, "", []):
            raise DataError(
                f"preference row {i} has no 'rejected' completion; every pair needs chosen and rejected."
            )
        if "margin" in row and not isinstance(row["margin"], (int, float)):
            try:
                row["margin"] = float(row["margin"])
            except (TypeError, ValueError):
                raise DataError(f"preference row {i}: margin {row['margin']!r} is not a number.") from None
    return rows


def _text(value: Any, tokenizer: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(m, dict) and "role" in m for m in value):
        if getattr(tokenizer, "chat_template", None) is None:
            raise DataError(
                "conversational preferences need a tokenizer with a chat template; this one has none."
            )
        return tokenizer.apply_chat_template(value, tokenize=False)
    raise DataError(f"a completion must be a string or a list of messages, got {type(value).__name__}.")


def pretokenize(tokenizer: Any, rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows with their token ids attached (`chosen_input_ids`, `rejected_input_ids`), so that a
    training loop tokenizes each pair once rather than at every step."""
    out = []
    for row in rows:
        chosen, rejected = pair_token_ids(tokenizer, row)
        out.append(row | {"chosen_input_ids": chosen, "rejected_input_ids": rejected})
    return out


def pair_token_ids(tokenizer: Any, row: dict[str, Any]) -> tuple[list[int], list[int]]:
    """prompt + chosen + EOS and prompt + rejected + EOS, as token ids (precomputed ones if present)."""
    if "chosen_input_ids" in row:
        return row["chosen_input_ids"], row["rejected_input_ids"]
    prompt = row.get("prompt") or ""
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []

    def encode(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    if isinstance(row["chosen"], list):  # a conversation: the prompt messages, then the answer turn
        prefix = prompt if isinstance(prompt, list) else []
        return encode(_text(prefix + row["chosen"], tokenizer)), encode(
            _text(prefix + row["rejected"], tokenizer)
        )
    head = _text(prompt, tokenizer)
    return encode(head + row["chosen"]) + eos, encode(head + row["rejected"]) + eos


@dataclass(frozen=True)
class PreferenceBatch:
    """Chosen and rejected sequences stacked as one batch of 2n rows (one forward pass): rows
    0..n−1 are the chosen completions, n..2n−1 the rejected ones, pair i = rows (i, n + i)."""

    input_ids: torch.Tensor  # [2n, L] left-padded
    attention_mask: torch.Tensor  # [2n, L] bool
    margin: torch.Tensor | None  # [n] or None
    num_truncated: int
    num_dropped: int

    @property
    def num_pairs(self) -> int:
        return self.input_ids.shape[0] // 2


def collate_preferences(
    tokenizer: Any,
    rows: Sequence[dict[str, Any]],
    max_length: int,
    long_pairs: Literal["truncate", "drop"] = "truncate",
) -> PreferenceBatch:
    from ..models.reward_model import pad_left

    chosen, rejected, margins, truncated, dropped = [], [], [], 0, 0
    for row in rows:
        c, r = pair_token_ids(tokenizer, row)
        if max(len(c), len(r)) > max_length:
            if long_pairs == "drop":
                dropped += 1
                continue
            truncated += 1
            c, r = c[-max_length:], r[-max_length:]  # keep the end: the answers being compared
        chosen.append(c)
        rejected.append(r)
        margins.append(float(row.get("margin", 0.0)))
    if not chosen:
        raise DataError(
            f"every pair of the batch is longer than max_length={max_length} and was dropped; "
            "raise max_length or set long_pairs='truncate'."
        )
    ids, mask = pad_left(chosen + rejected, tokenizer.pad_token_id)  # [2n, L]
    has_margin = any("margin" in row for row in rows)
    return PreferenceBatch(ids, mask, torch.tensor(margins) if has_margin else None, truncated, dropped)


# ----------------------------------------------------------------------------- built-in preference tasks


# the mistakes a learner of addition makes: one digit off by one or two, or a carry slip
_ADDITION_SLIPS = (-11, -10, -9, -2, -1, 1, 2, 9, 10, 11)


def _wrong_answer(task: Task, row: dict[str, Any], rng: random.Random, near_miss: float) -> str:
    """A wrong completion for a task row: a near miss (off by a little) with probability near_miss."""
    right = row.get("answer") or row.get("solution")
    for _ in range(100):
        if task.name == "addition":
            value = int(right)
            wrong = (
                str(max(0, value + rng.choice(_ADDITION_SLIPS)))
                if rng.random() < near_miss
                else str(rng.randint(0, 198))
            )
        elif task.name == "reverse":
            digits = list(right)
            if len(set(digits)) == 1:  # "5555": no reordering is wrong, so change one digit
                i = rng.randrange(len(digits))
                digits[i] = rng.choice([d for d in "0123456789" if d != digits[i]])
            elif rng.random() < near_miss:
                i = rng.randrange(len(digits) - 1)
                digits[i], digits[i + 1] = digits[i + 1], digits[i]
            else:
                rng.shuffle(digits)
            wrong = "".join(digits)
        else:  # countdown: the right expression with one operator changed
            ops = [i for i, ch in enumerate(right) if ch in "+-*"]
            i = rng.choice(ops)
            wrong = right[:i] + rng.choice([o for o in "+-*" if o != right[i]]) + right[i + 1 :]
        if not task.is_correct(wrong, row):
            return wrong
    return right + "0"  # no random variant was wrong (vanishingly rare): a longer, wrong answer


def preference_pairs(
    task: Task, rows: Sequence[dict[str, Any]], *, seed: int = 0, near_miss: float = 0.0
) -> list[dict[str, Any]]:
    """chosen = the right answer, rejected = a wrong one (a near miss with probability near_miss)."""
    rng = random.Random(seed)
    pairs = []
    for row in rows:
        right = row.get("answer") or row.get("solution")
        pairs.append(
            {"prompt": row["prompt"], "chosen": right, "rejected": _wrong_answer(task, row, rng, near_miss)}
        )
    return pairs
