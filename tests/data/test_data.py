"""Prompt data sources, their errors, chat rendering, the prompt sampler and the built-in tasks."""

from __future__ import annotations

import json

import pytest

from grpokit.data import (
    DataError,
    PromptSampler,
    columns_of,
    evaluate_expression,
    get_task,
    load_prompts,
    render_prompt,
)

ROWS = [{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+2=", "answer": "4"}]


def test_every_source_gives_the_same_rows(tmp_path):
    (tmp_path / "p.jsonl").write_text("\n".join(json.dumps(r) for r in ROWS) + "\n\n")
    (tmp_path / "p.json").write_text(json.dumps(ROWS))
    (tmp_path / "p.csv").write_text("prompt,answer\n1+1=,2\n2+2=,4\n")
    for name in ("p.jsonl", "p.json", "p.csv"):
        assert load_prompts(tmp_path / name) == ROWS, name
    assert load_prompts(ROWS) == ROWS
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "p.parquet")
    assert load_prompts(tmp_path / "p.parquet") == ROWS


def test_datasets_dataset_is_accepted():
    datasets = pytest.importorskip("datasets")
    assert load_prompts(datasets.Dataset.from_list(ROWS)) == ROWS


@pytest.mark.parametrize(
    ("content", "name", "match"),
    [
        ('{"prompt": "a"}\n{"prompt": "b",,}\n', "bad.jsonl", r"bad.jsonl: line 2 is not valid JSON"),
        ('{"prompt": "a"}\n[1, 2]\n', "list.jsonl", r"line 2 is a JSON list"),
        ("", "empty.jsonl", r"empty.jsonl has no rows"),
        (
            '{"question": "a"}\n',
            "col.jsonl",
            r"has no column 'prompt' \(columns: question\); set prompt_column",
        ),
        ('{"prompt": "a"}\n{"prompt": ""}\n', "blank.jsonl", r"row 1 has an empty 'prompt'"),
        ("prompt\n", "empty.csv", r"empty.csv has no rows"),
        ("{}", "obj.json", r"expected a JSON list of objects"),
        ("x", "p.txt", r"unknown file type '.txt'"),
    ],
)
def test_bad_files_name_the_file_and_the_problem(tmp_path, content, name, match):
    (tmp_path / name).write_text(content)
    with pytest.raises(DataError, match=match):
        load_prompts(tmp_path / name)


def test_missing_file_and_wrong_source_type(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        load_prompts(tmp_path / "nope.jsonl")
    with pytest.raises(DataError, match="cannot read prompts from a int"):
        load_prompts(3)


def test_custom_prompt_column_and_columns_reach_rewards():
    rows = load_prompts([{"q": "1+1=", "answer": "2", "level": 1}], prompt_column="q")
    assert columns_of(rows, "q", repeat=2) == {"answer": ["2", "2"], "level": [1, 1]}


def test_conversational_prompts_use_the_chat_template(tiny_policy):
    _, tok = tiny_policy
    messages = [{"role": "user", "content": "1+1="}]
    with pytest.raises(DataError, match="chat template"):
        render_prompt(messages, tok)
    tok.chat_template = (
        "{% for m in messages %}{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}={% endif %}"
    )
    try:
        assert render_prompt(messages, tok) == "1+1=="
    finally:
        tok.chat_template = None
    assert render_prompt("plain", None) == "plain"
    with pytest.raises(DataError, match="string or a list"):
        render_prompt({"role": "user"}, tok)


def test_prompt_sampler_is_deterministic_and_resumable():
    rows = [{"prompt": str(i)} for i in range(5)]
    a = PromptSampler(rows, 3, seed=1)
    batches = [a.next_batch() for _ in range(4)]
    assert [len(b) for b in batches] == [3, 3, 3, 3]
    first_epoch = [r["prompt"] for b in batches[:1] for r in b] + [r["prompt"] for r in batches[1][:2]]
    assert sorted(first_epoch) == [str(i) for i in range(5)]  # an epoch visits every row once
    b = PromptSampler(rows, 3, seed=1)
    b.next_batch()
    state = b.state_dict()
    c = PromptSampler(rows, 3, seed=1)
    c.load_state_dict(state)
    assert [c.next_batch() for _ in range(3)] == batches[1:]


@pytest.mark.parametrize("name", ["addition", "chain", "countdown", "reverse"])
def test_tasks_have_disjoint_deterministic_splits(name):
    task = get_task(name, seed=0)
    again = get_task(name, seed=0)
    assert task.train == again.train and task.eval == again.eval
    assert len(task.eval) == 200 and not {r["prompt"] for r in task.train} & {r["prompt"] for r in task.eval}
    assert get_task(name, seed=1).eval != task.eval
    for row in task.train[:200] + task.eval:
        assert len(row["prompt"]) <= task.max_prompt_length
        assert set(row["prompt"]) <= set(task.alphabet)


def test_task_checkers_on_hand_written_answers():
    add = get_task("addition")
    assert add.is_correct("46", {"answer": "46"}) and add.is_correct(" 46 ", {"answer": "46"})
    assert not add.is_correct("47", {"answer": "46"}) and not add.is_correct("", {"answer": "46"})
    rev = get_task("reverse")
    assert rev.is_correct("4321", {"answer": "4321"}) and not rev.is_correct("1234", {"answer": "4321"})
    cd = get_task("countdown")
    row = {"numbers": [3, 5, 2], "target": 16}
    assert cd.is_correct("(3+5)*2", row) and cd.is_correct("2*(5+3)", row)
    assert not cd.is_correct("3*5+1", row)  # 1 is not a given number
    assert not cd.is_correct("(3+5)*2*1", row) and not cd.is_correct("8*2", row)
    assert not cd.is_correct("(3+3)*2", {"numbers": [3, 5, 2], "target": 12})  # 3 used twice
    assert not cd.is_correct("__import__('os')", row) and not cd.is_correct("5/0", row)
    assert evaluate_expression("7/2") is not None and evaluate_expression("2**3") is None


def test_task_reward_and_accuracy():
    task = get_task("addition")
    rows = [{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+2=", "answer": "4"}]
    assert task.reward(["1+1=", "2+2="], ["2", "5"], answer=["2", "4"]) == [1.0, 0.0]
    assert task.accuracy(["2", "5"], rows) == 0.5


def test_every_countdown_row_is_solvable_by_construction():
    """Rows come from an expression over their own numbers; the first 300 are re-solved by brute force."""
    import itertools

    task = get_task("countdown")
    for row in task.train[:300]:
        a, b, c = row["numbers"]
        found = any(
            task.is_correct(f"({x}{o1}{y}){o2}{z}", row)
            for x, y, z in itertools.permutations((a, b, c))
            for o1, o2 in itertools.product("+-*", repeat=2)
        )
        assert found, row


def test_every_file_suffix_that_names_a_file_has_a_reader():
    from grpokit.data.errors import FILE_SUFFIXES
    from grpokit.data.prompts import READERS

    assert tuple(READERS) == FILE_SUFFIXES
