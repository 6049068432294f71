"""reasoning-gym's procedural task generators as a grpokit task (`task: reasoning_gym:NAME`).

reasoning-gym (pip install reasoning-gym) generates questions with reference answers and scores an
answer with each generator's own `score_answer` (1.0 right; some give partial credit). Here:

* training rows come from the generator with the run's seed, held-out rows from another seed, with
  every held-out question removed from training;
* the reward is the generator's score of the completion's answer (the text inside <answer>…</answer>
  when there is one, else the whole completion, stripped); accuracy counts scores of 1.0;
* every row has an `answer` column (the generator's), so the supervised warm start can learn them.

Nothing is downloaded: the generators are code.
"""

from __future__ import annotations

import re
from typing import Any

from .task import Task

TRAIN_ROWS = 2000  # countdown generates ~100 rows a second: 2000 keep set-up under 30 s
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def extract_answer(completion: str) -> str:
    """The last <answer>…</answer>'s text, or the whole completion; stripped."""
    found = _ANSWER.findall(completion)
    return (found[-1] if found else completion).strip()


def reasoning_gym_task(name: str, seed: int = 0, num_eval: int = 200, size: int = TRAIN_ROWS) -> Task:
    try:
        import reasoning_gym
    except ImportError:
        raise ValueError(
            f"task reasoning_gym:{name} needs the reasoning-gym package: pip install reasoning-gym "
            "(or pip install 'grpokit[gym]')."
        ) from None
    from reasoning_gym.factory import DATASETS

    if name not in DATASETS:
        known = ", ".join(sorted(DATASETS))
        raise ValueError(f"reasoning-gym has no task {name!r}; its tasks: {known}.")
    splits = {
        "train": reasoning_gym.create_dataset(name, size=size, seed=seed),
        "eval": reasoning_gym.create_dataset(name, size=num_eval, seed=seed + 1_000_003),
    }

    def rows(split: str) -> list[dict[str, Any]]:
        return [
            {"prompt": entry["question"], "answer": str(entry["answer"]), "rg_split": split, "rg_index": i}
            for i, entry in enumerate(splits[split])
        ]

    held_out = rows("eval")
    seen = {r["prompt"] for r in held_out}
    train = [r for r in rows("train") if r["prompt"] not in seen]

    def score(completion: str, row: dict[str, Any]) -> float:
        dataset = splits[row["rg_split"]]
        return float(dataset.score_answer(extract_answer(completion), dataset[row["rg_index"]]) or 0.0)

    def is_correct(completion: str, row: dict[str, Any]) -> bool:
        return score(completion, row) >= 1.0

    longest_answer = max(len(r["answer"]) for r in train + held_out)
    return Task(
        name=f"reasoning_gym:{name}",
        alphabet="".join(sorted({c for r in train + held_out for c in r["prompt"] + r["answer"]})),
        train=train,
        eval=held_out,
        is_correct=is_correct,
        max_prompt_length=max(len(r["prompt"]) for r in train + held_out),  # characters: a bound on tokens
        max_completion_length=min(128, 2 * longest_answer + 8),
        score=score,
    )
