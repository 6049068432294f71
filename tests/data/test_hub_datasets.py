"""Datasets by name: a directory laid out like a Hugging Face Hub dataset repo, and the same repo by
its hub name from a hand-made Hugging Face cache, offline; dataset_config / dataset_train_split /
dataset_test_split; GSM8K answers made bare (answer_format=gsm8k); the errors; the CLI; a short run.
Everything offline: HF_HOME, the hub cache and datasets' cache are in tmp_path."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from grpokit.cli import main
from grpokit.config import GRPOConfig
from grpokit.config.plan import grpo_plan
from grpokit.data import ANSWER_FORMATS, DataError, apply_answer_format, gsm8k_answer, load_prompts
from grpokit.train.inputs import resolve_data
from tests.helpers import TINY_MODEL
from tests.hub_cache import dataset_snapshot


@pytest.fixture(autouse=True)
def _needs_datasets():
    """datasets (and pyarrow) are imported by the first test that runs here, not when the module is
    collected: a pytest-xdist worker that runs none of these does not pay their ~1 s import."""
    pytest.importorskip("datasets")
    pytest.importorskip("pyarrow.parquet")


# GSM8K-like rows: a question, and a worked solution ending in "#### ANSWER"; the bare answers by hand
TRAIN = [
    {"question": "3+4?", "answer": "3+4=<<3+4=7>>7\n#### 7"},
    {"question": "1000+234?", "answer": "1000+234=1234\n#### 1,234"},
    {"question": "6*7?", "answer": "6*7=42\n#### 42"},
    {"question": "2-7?", "answer": "2-7=-5\n#### -5"},
    {"question": "9+1?", "answer": "#### 10"},
    {"question": "5*5?", "answer": "5*5=25\n####25"},
]
TRAIN_ANSWERS = ["7", "1234", "42", "-5", "10", "25"]
TEST = [
    {"question": "2+2?", "answer": "2+2=4\n#### 4"},
    {"question": "999+1?", "answer": "999+1=1000\n#### 1,000"},
    {"question": "8-1?", "answer": "8-1=7\n#### 7"},
]
TEST_ANSWERS = ["4", "1000", "7"]

CARD = """---
configs:
- config_name: main
  data_files:
  - split: train
    path: main/train-*.parquet
  - split: test
    path: main/test-*.parquet
- config_name: socratic
  data_files:
  - split: train
    path: socratic/train-*.parquet
---
# tiny gsm8k
"""


def bare(rows, answers):
    """The rows as answer_format=gsm8k loads them: the bare answer, and the worked solution kept."""
    return [
        {**row, "answer": answer, "answer_solution": row["answer"]}
        for row, answer in zip(rows, answers, strict=True)
    ]


def write_repo(root: Path) -> Path:
    """A dataset repo: README.md front matter with two configs (main: train + test; socratic: train)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    for folder in ("main", "socratic"):
        (root / folder).mkdir(parents=True, exist_ok=True)
    (root / "README.md").write_text(CARD)
    pq.write_table(pa.Table.from_pylist(TRAIN), root / "main" / "train-00000-of-00001.parquet")
    pq.write_table(pa.Table.from_pylist(TEST), root / "main" / "test-00000-of-00001.parquet")
    pq.write_table(pa.Table.from_pylist(TRAIN[:4]), root / "socratic" / "train-00000-of-00001.parquet")
    return root


@pytest.fixture
def offline(empty_hub_offline) -> Path:
    """HF_HOME in tmp_path, offline, for huggingface_hub and datasets (tests/conftest.py)."""
    return empty_hub_offline


@pytest.fixture
def repo(tmp_path, offline) -> Path:
    return write_repo(tmp_path / "gsm8k")


@pytest.fixture
def hub_cached(tmp_path, offline) -> str:
    """tiny-org/gsm8k in the hub cache as `hf download` leaves it (tests/hub_cache.py)."""
    return dataset_snapshot(offline, "tiny-org/gsm8k", write_repo(tmp_path / "download"))


# ----------------------------------------------------------------------------- answer_format


def test_gsm8k_answer_by_hand():
    assert gsm8k_answer("3+4=<<3+4=7>>7\n#### 7") == "7"
    assert gsm8k_answer("so 1,234 in all\n#### 1,234") == "1234"
    assert gsm8k_answer("#### 1,000,000") == "1000000"
    assert gsm8k_answer("####-5") == "-5"
    assert gsm8k_answer("#### 3.5 \n") == "3.5"
    assert gsm8k_answer("a #### 1\nb #### 2") == "2"  # the last marker is the final answer
    assert gsm8k_answer("7") is None  # no marker
    assert gsm8k_answer("work\n####   ") is None  # nothing after it
    assert (
        set(ANSWER_FORMATS)
        == {"raw", "gsm8k"}
        == set(GRPOConfig.model_fields["answer_format"].annotation.__args__)
    )


def test_answer_format_applies_to_every_row_and_names_a_bad_one():
    rows = [{"q": "a", "answer": "x\n#### 1,5"}, {"q": "b", "answer": "just 15"}]
    made = apply_answer_format(rows[:1], "answer", "gsm8k", "f.jsonl")
    assert made == [{"q": "a", "answer": "15", "answer_solution": "x\n#### 1,5"}]
    assert rows[0] == {"q": "a", "answer": "x\n#### 1,5"}  # the caller's rows are not changed
    assert apply_answer_format(rows, "answer", "raw", "f.jsonl") == rows
    with pytest.raises(DataError) as error:
        apply_answer_format(rows, "answer", "gsm8k", "f.jsonl")
    assert "f.jsonl: row 1 has answer='just 15'" in str(error.value)
    assert "'#### ANSWER'" in str(error.value) and "answer_format=raw" in str(error.value)
    with pytest.raises(DataError, match=r"f.jsonl has no column 'solution' \(columns: answer, q\)"):
        apply_answer_format(rows, "solution", "gsm8k", "f.jsonl")


def test_answer_format_applies_to_files_too(tmp_path):
    (tmp_path / "g.jsonl").write_text("\n".join(json.dumps(r) for r in TRAIN))
    rows = load_prompts(tmp_path / "g.jsonl", prompt_column="question", answer_format="gsm8k")
    assert rows == bare(TRAIN, TRAIN_ANSWERS)


# ----------------------------------------------------------------------------- a directory, a hub name


def test_directory_in_hub_layout_gives_each_split(repo):
    read = dict(dataset_config="main", prompt_column="question", answer_format="gsm8k")
    assert load_prompts(repo, **read) == bare(TRAIN, TRAIN_ANSWERS)
    assert load_prompts(str(repo), split="test", **read) == bare(TEST, TEST_ANSWERS)
    assert load_prompts(repo, dataset_config="socratic", prompt_column="question") == TRAIN[:4]  # raw


def test_hub_name_is_read_from_the_cache_offline(hub_cached):
    read = dict(dataset_config="main", prompt_column="question", answer_format="gsm8k")
    assert load_prompts(hub_cached, **read) == bare(TRAIN, TRAIN_ANSWERS)
    assert load_prompts(hub_cached, split="test", **read) == bare(TEST, TEST_ANSWERS)


def config(tmp_path, dataset, **more) -> GRPOConfig:
    base = dict(task=None, dataset_config="main", prompt_column="question", answer_format="gsm8k")
    return GRPOConfig(**(base | more), dataset=str(dataset), output_dir=str(tmp_path / "run"))


def data_of(cfg: GRPOConfig, **given):
    plan = grpo_plan(cfg)
    return resolve_data(plan.data, plan.episodes, plan.rewards, require_rewards=False, **given)


def test_the_run_trains_on_the_train_split_and_holds_out_the_test_split(tmp_path, hub_cached):
    data = data_of(config(tmp_path, hub_cached))
    assert data.train_rows == bare(TRAIN, TRAIN_ANSWERS)
    assert data.eval_rows == bare(TEST, TEST_ANSWERS)
    assert data.eval_source == "tiny-org/gsm8k (split test)"
    # judged as gsm8k_answer pays: the number after the completion's last "####" (verl's strict rule)
    assert data.is_correct("2+2=4\n#### 4", data.eval_rows[0]) is True
    assert data.is_correct("#### 1,000", data.eval_rows[1]) and data.is_correct(
        "#### 1000.0", data.eval_rows[1]
    )
    assert data.is_correct("4", data.eval_rows[0]) is False  # the right number without the marker
    assert data.is_correct("#### 4\nno: #### 5", data.eval_rows[0]) is False
    # the splits are options: train on test, hold out train
    swapped = data_of(config(tmp_path, hub_cached, dataset_train_split="test", dataset_test_split="train"))
    assert swapped.train_rows == bare(TEST, TEST_ANSWERS) and swapped.eval_rows == bare(TRAIN, TRAIN_ANSWERS)
    # a config without the default 'test' split: no held-out rows; eval (evaluate_only): its train split
    socratic = config(tmp_path, hub_cached, dataset_config="socratic")
    assert data_of(socratic).eval_rows == []
    evaluated = data_of(socratic, evaluate_only=True)
    assert evaluated.train_rows == [] and evaluated.eval_rows == bare(TRAIN[:4], TRAIN_ANSWERS[:4])


def test_eval_dataset_by_name_reads_its_test_split(tmp_path, repo):
    (tmp_path / "train.jsonl").write_text("\n".join(json.dumps(r) for r in TRAIN))
    data = data_of(config(tmp_path, tmp_path / "train.jsonl", eval_dataset=str(repo)))
    assert data.train_rows == bare(TRAIN, TRAIN_ANSWERS) and data.train_source.endswith("train.jsonl")
    assert data.eval_rows == bare(TEST, TEST_ANSWERS)


def test_python_api_takes_a_dataset_name(repo):
    from grpokit import GRPOTrainer

    options = dict(dataset_config="main", prompt_column="question", answer_format="gsm8k")
    trainer = GRPOTrainer("tiny", [], args=options, train_dataset=str(repo), eval_dataset=str(repo))
    assert trainer.train_rows == bare(TRAIN, TRAIN_ANSWERS)
    assert trainer.eval_rows == bare(TEST, TEST_ANSWERS)


# ----------------------------------------------------------------------------- errors


def message(call) -> str:
    with pytest.raises(DataError) as error:
        call()
    text = str(error.value)
    assert "\n" not in text, text
    return text


def test_a_missing_split_is_named_with_the_splits_there_are(tmp_path, repo):
    text = message(
        lambda: load_prompts(repo, dataset_config="main", prompt_column="question", split="training")
    )
    assert "no split 'training'" in text and "(splits: train, test)" in text, text
    # a held-out split named on purpose must exist (the default 'test' may be absent: test above)
    text = message(lambda: data_of(config(tmp_path, repo, dataset_test_split="validation")))
    assert "no split 'validation'" in text and "(splits: train, test)" in text, text


def test_a_missing_column_is_named_with_the_columns_there_are(repo):
    text = message(lambda: load_prompts(repo, dataset_config="main"))
    assert "no column 'prompt'" in text and "(columns: answer, question)" in text, text
    assert "set prompt_column" in text, text
    text = message(
        lambda: load_prompts(
            repo, dataset_config="main", prompt_column="question", answer_column="sol", answer_format="gsm8k"
        )
    )
    assert "no column 'sol'" in text and "(columns: answer, question)" in text, text


def test_a_wrong_or_missing_config_lists_the_configs(repo):
    text = message(lambda: load_prompts(repo, dataset_config="mian", prompt_column="question"))
    assert "no config 'mian'" in text and "(configs: main, socratic)" in text, text
    text = message(lambda: load_prompts(repo, prompt_column="question"))
    assert "several configs (configs: main, socratic); set dataset_config" in text, text


def test_a_name_not_in_the_cache_offline_says_where_it_looked_and_how_to_download(offline):
    text = message(lambda: load_prompts("tiny-org/absent"))
    for part in (
        "'tiny-org/absent'",
        str(offline / "hub"),
        str(offline / "datasets"),
        "HF_HUB_OFFLINE",
        "`hf download tiny-org/absent --repo-type dataset`",
    ):
        assert part in text, (part, text)


def test_the_cli_prints_one_line_without_a_traceback(tmp_path, repo, capsys):
    code = main(["train", "task=null", f"dataset={repo}", "dataset_config=nope", f"output_dir={tmp_path}/r"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert (
        err.splitlines()[0].startswith("grpokit train: error: dataset ") and "configs: main, socratic" in err
    )


# ----------------------------------------------------------------------------- CLI and a short run


def test_print_config_resolves_the_dataset_options(repo, capsys):
    import yaml

    args = [
        f"dataset={repo}",
        "dataset_config=main",
        "task=null",
        "prompt_column=question",
        "answer_format=gsm8k",
    ]
    assert main(["print-config", *args]) == 0
    shown = yaml.safe_load(capsys.readouterr().out)
    assert shown["dataset"] == str(repo) and shown["dataset_config"] == "main"
    assert (shown["dataset_train_split"], shown["dataset_test_split"]) == ("train", "test")
    assert shown["answer_format"] == "gsm8k" and shown["prompt_column"] == "question"


def test_a_short_run_on_a_hub_dataset_sees_bare_answers(tmp_path, hub_cached):
    from grpokit.train.grpo import train_grpo
    from tests.train.helpers import tiny_config

    seen: list[str] = []

    def record(prompts, completions, answer, **_):
        seen.extend(answer)
        return [float(c.strip() == a) for c, a in zip(completions, answer, strict=True)]

    cfg = tiny_config(
        tmp_path,
        task=None,
        dataset=hub_cached,
        dataset_config="main",
        prompt_column="question",
        answer_format="gsm8k",
        max_steps=2,
    )
    result = train_grpo(cfg, reward_funcs=[record])
    # the reward saw bare answers: of the training rows (2 steps of 4 prompts x 4) and the held-out ones
    assert result.steps == 2 and set(seen) <= {*TRAIN_ANSWERS, *TEST_ANSWERS} and set(seen) & {*TRAIN_ANSWERS}
    assert result.eval_after["num_prompts"] == len(TEST) and "accuracy" in result.eval_after


def test_sft_and_eval_commands_resolve_the_same_way(tmp_path, repo, capsys):
    common = [f"dataset={repo}", "dataset_config=main", "task=null", "prompt_column=question"]
    common += ["answer_format=gsm8k", *TINY_MODEL, "progress=false"]
    assert main(["sft", *common, "max_steps=2", "batch_size=4", f"output_dir={tmp_path}/sft"]) == 0
    assert "held-out greedy accuracy" in capsys.readouterr().out  # the test split was held out
    assert main(["eval", *common, f"model={tmp_path}/sft/final", "max_completion_length=4"]) == 0
    metrics = json.loads(capsys.readouterr().out)
    assert metrics["num_prompts"] == len(TEST)


def test_trls_dataset_name_is_dataset():
    from grpokit.config import ConfigError, load_config

    cfg = load_config(GRPOConfig, None, ["task=null", "dataset_name=openai/gsm8k", "dataset_config=main"])
    assert (cfg.dataset, cfg.dataset_config) == ("openai/gsm8k", "main")
    with pytest.raises(ConfigError, match="dataset_name .TRL's name. and dataset are both set"):
        load_config(GRPOConfig, None, ["dataset_name=a/b", "dataset=c/d"])
