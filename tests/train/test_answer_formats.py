"""answer_format beyond loading: accuracy counts what the format's reward pays (GSM8K: the number
after the completion's last '####', not the whole completion), evaluation combines the rewards with
the training weights and reports each one, and what learns from demonstrations (the warm start,
gkd's off-policy steps) learns the dataset's worked solution, not the bare number."""

from __future__ import annotations

import dataclasses
import json

import pytest

from grpokit.config import GRPOConfig
from grpokit.config.plan import Evaluation, grpo_plan
from grpokit.data import ANSWER_FORMATS, demonstration, sft_rows, solution_column
from grpokit.engine import EngineSpec, PolicyEngine
from grpokit.models import build_policy, char_tokenizer
from grpokit.rewards import BUILTIN_REWARDS
from grpokit.train.inputs import held_out_metrics, resolve_data

ROWS = [
    {"question": "2+2?", "answer": "2+2=<<2+2=4>>4\n#### 4"},
    {"question": "999+1?", "answer": "999+1=1000\n#### 1,000"},
    {"question": "8-1?", "answer": "8-1=7\n#### 7"},
    {"question": "3*3?", "answer": "3*3=9\n#### 9"},
]
# what a chat model writes, each judged by hand under GSM8K's strict rule
COMPLETIONS = [
    ("Two and two make four.\n#### 4", True),
    ("999 + 1 = 1,000\n#### $1,000", True),  # commas and a dollar sign are read
    ("8 - 1 = 7", False),  # the right number without the marker
    ("#### 9\nno, wait: #### 6", False),  # the last marker is the answer
]


def data_of(tmp_path, **more):
    path = tmp_path / "gsm.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in ROWS))
    options = dict(task=None, dataset=str(path), eval_dataset=str(path), prompt_column="question")
    cfg = GRPOConfig(**(options | {"answer_format": "gsm8k"} | more), output_dir=str(tmp_path / "run"))
    plan = grpo_plan(cfg)
    return plan, resolve_data(plan.data, plan.episodes, plan.rewards, require_rewards=False)


def test_accuracy_under_gsm8k_is_what_its_reward_pays(tmp_path):
    _, data = data_of(tmp_path)
    assert data.eval_rows[1]["answer"] == "1000"  # bare, as the rewards compare
    judged = [data.is_correct(c, row) for (c, _), row in zip(COMPLETIONS, data.eval_rows, strict=True)]
    assert judged == [right for _, right in COMPLETIONS]
    paid = BUILTIN_REWARDS["gsm8k_answer"](
        [""] * 4, [c for c, _ in COMPLETIONS], answer=[r["answer"] for r in data.eval_rows]
    )
    assert [p == 1.0 for p in paid] == judged
    assert ANSWER_FORMATS["raw"].judge is None  # raw data keeps the exact answer
    _, raw = data_of(tmp_path, answer_format="raw")
    assert raw.is_correct(ROWS[0]["answer"] + " ", raw.eval_rows[0]) and not raw.is_correct(
        "4", raw.eval_rows[0]
    )


def test_evaluation_weights_the_rewards_as_training_does(tmp_path):
    """Greedy completions replaced by the scripted ones above: accuracy 2/4, and the mean reward is
    gsm8k_answer + 0.1 · gsm8k_format (the preset's weights), each reported on its own too."""
    plan, data = data_of(tmp_path, reward_funcs=["gsm8k_answer", "gsm8k_format"], reward_weights=[1.0, 0.1])
    tok = char_tokenizer("".join(sorted({ch for r in ROWS for ch in r["question"]})))
    model = build_policy(hidden_size=16, num_layers=1, num_heads=2, vocab_size=len(tok), dropout=0.0, seed=0)
    engine = PolicyEngine.create(model, tok, EngineSpec())
    drawn = engine.generate

    def scripted(prompts, params, rows=None):
        rollout = drawn(prompts, params, rows)
        return dataclasses.replace(rollout, completions=[c for c, _ in COMPLETIONS][: len(prompts)])

    engine.generate = scripted
    settings = dataclasses.replace(plan.evaluation, prompt_column="question")
    assert isinstance(settings, Evaluation)
    metrics = held_out_metrics(engine, data, settings)
    answer, form = [1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 0.0, 1.0]  # by hand: "#### 6" ends the 4th
    assert metrics["accuracy"] == 0.5
    assert metrics["rewards/gsm8k_answer/mean"] == pytest.approx(sum(answer) / 4, abs=1e-7)
    assert metrics["rewards/gsm8k_format/mean"] == pytest.approx(sum(form) / 4, abs=1e-7)
    expected = sum(a + 0.1 * f for a, f in zip(answer, form, strict=True)) / 4
    assert metrics["reward"] == pytest.approx(expected, abs=1e-6)  # 0.575, not 1.25 with weights 1, 1


def test_demonstrations_are_the_worked_solutions(tmp_path):
    _, data = data_of(tmp_path)
    row = data.train_rows[1]
    assert solution_column("answer") == "answer_solution" and row["answer_solution"] == ROWS[1]["answer"]
    assert demonstration(row, "answer", "gsm8k") == "999+1=1000\n#### 1,000"  # what the warm start learns
    assert demonstration(row, "answer") == "1000"  # raw: the answer itself
    tok = char_tokenizer("".join(sorted({ch for r in ROWS for ch in r["question"] + r["answer"]})))
    learned = sft_rows(data.train_rows, tok, "question", "answer", answer_format="gsm8k")
    assert [r["answer"] for r in learned] == [r["answer"] for r in ROWS]


def test_a_column_where_the_solution_would_be_kept_is_refused_and_raw_data_ignores_it(tmp_path):
    from grpokit.data import DataError, apply_answer_format

    rows = [{"q": "a", "answer": "#### 3", "answer_solution": "mine"}]
    with pytest.raises(DataError, match=r"row 0 has a column 'answer_solution', where answer_format=gsm8k"):
        apply_answer_format(rows, "answer", "gsm8k", "f.jsonl")
    assert demonstration(rows[0], "answer") == "#### 3"  # raw: the answer, whatever else the row holds
    assert (
        demonstration({"answer": "3", "answer_solution": "1+2=3\n#### 3"}, "answer", "gsm8k")
        == "1+2=3\n#### 3"
    )


def test_the_built_in_rewards_and_accuracy_read_answer_column(tmp_path):
    """answer_column=final: gsm8k_answer compares with that column (given to it as `answer`, under
    its own name), accuracy agrees with it, and a user's own function is left as it is (it gets every
    column by its own name, as TRL passes them)."""
    from grpokit.rewards import answers_from

    rows = [{"question": r["question"], "final": r["answer"]} for r in ROWS]
    path = tmp_path / "final.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    options = dict(task=None, dataset=str(path), eval_dataset=str(path), prompt_column="question")
    cfg = GRPOConfig(
        **options,
        answer_column="final",
        answer_format="gsm8k",
        reward_funcs=["gsm8k_answer"],
        output_dir=str(tmp_path / "r"),
    )
    plan = grpo_plan(cfg)
    data = resolve_data(plan.data, plan.episodes, plan.rewards, require_rewards=False)
    (gsm8k,) = data.reward_funcs
    completions = [c for c, _ in COMPLETIONS]
    columns = {"final": [r["final"] for r in data.eval_rows]}  # no 'answer' column in these rows
    assert gsm8k.__name__ == "gsm8k_answer" and gsm8k.takes_text
    paid = gsm8k([""] * 4, completions, **columns)
    judged = [data.is_correct(c, row) for c, row in zip(completions, data.eval_rows, strict=True)]
    assert [p == 1.0 for p in paid] == judged == [right for _, right in COMPLETIONS]

    def own(prompts, completions, final, **_):
        return [1.0] * len(completions)

    assert answers_from(own, "final") is own
