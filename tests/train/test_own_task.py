"""A user's own task without Python beyond the reward (issue 13): a dataset file with `model: tiny`
(the tokenizer from the data's characters), a reward by reference, `sft` on prompt/answer rows,
`eval` of the YAML's data and rewards, and LoRA from the config, exported merged."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from grpokit.cli import main
from grpokit.config import ConfigError, GRPOConfig, load_config
from grpokit.data import DataError, check_characters, data_alphabet, require_answers
from grpokit.rewards import RewardReferenceError, load_reward_reference
from tests.helpers import TINY_MODEL, read_metrics, tiny_run

TINY = [*TINY_MODEL, "progress=false"]  # sft and eval
GRPO_SMALL = tiny_run(sft_batch_size=4)
ONES = "reward_funcs=[{python: tests.train.helpers:ones_reward}]"  # dense: the adapters must move
REWARDS = '''
def sorted_digits(prompts, completions, **columns):
    """1.0 when the completion is the prompt's digits in sorted order."""
    return [1.0 if c.strip() == "".join(sorted(p.rstrip(":"))) else 0.0 for p, c in zip(prompts, completions)]

NOT_A_FUNCTION = 3
'''


def _rows(numbers: list[str], with_answer: bool = True) -> list[dict[str, str]]:
    return [{"prompt": f"{n}:"} | ({"answer": "".join(sorted(n))} if with_answer else {}) for n in numbers]


def _write(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture
def own_task(tmp_path, monkeypatch):
    """A sorting task over digits 1-5 (train) and a held-out file; the reward lives in my_rewards.py."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my_rewards.py").write_text(REWARDS)
    train = _write(tmp_path / "train.jsonl", _rows(["312", "231", "5142", "4213", "1432", "253"]))
    held_out = _write(tmp_path / "held_out.jsonl", _rows(["321", "4152"]))
    return tmp_path, train, held_out


# ----------------------------------------------------------------------------- data: alphabet and checks


def test_alphabet_is_the_sorted_characters_of_prompts_and_answers():
    rows = [{"prompt": "ba=", "answer": "c d"}, {"prompt": "a", "other": "XYZ"}]
    assert data_alphabet(rows, [{"prompt": "!", "answer": 7}]) == " !7=abcd"  # no other column's characters
    assert data_alphabet(rows, prompt_column="other", answer_column="prompt") == "=XYZab"


def test_an_unknown_character_names_itself_the_row_and_the_fix():
    rows = [{"prompt": "12"}, {"prompt": "1x2y"}]
    check_characters(rows[:1], "12", source="d.jsonl")
    message = r"d\.jsonl: row 1 has the character 'x' in 'prompt'.*model: tiny builds"
    with pytest.raises(DataError, match=message):
        check_characters(rows, "12", source="d.jsonl")


def test_missing_answers_name_the_column_and_the_way_out():
    with pytest.raises(DataError, match=r"f\.jsonl has no column 'answer' \(columns: prompt\).*sft_steps=0"):
        require_answers([{"prompt": "a"}], "answer", source="f.jsonl", purpose="the warm start")
    with pytest.raises(DataError, match="row 1 has no 'answer' .1 rows lack one"):
        require_answers([{"answer": "1"}, {"answer": ""}], "answer", source="f.jsonl", purpose="x")


# ----------------------------------------------------------------------------- rewards by reference


def test_python_reward_by_file_module_and_dotted_reference(own_task, monkeypatch):
    tmp_path, _, _ = own_task
    by_file = load_reward_reference("my_rewards.py:sorted_digits")
    assert by_file(["312:", "312:"], ["123", "321"]) == [1.0, 0.0]
    assert load_reward_reference(str(tmp_path / "my_rewards.py") + ":sorted_digits") is by_file  # one module
    # Another test's my_rewards may be imported already; whatever this test imports goes at its end.
    monkeypatch.delitem(sys.modules, "my_rewards", raising=False)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert load_reward_reference("my_rewards:sorted_digits")(["21:"], ["12"]) == [1.0]
    assert load_reward_reference("my_rewards.sorted_digits")(["21:"], ["21"]) == [0.0]  # TRL's dotted form


@pytest.mark.parametrize(
    ("reference", "message"),
    [
        ("nope.py:f", r"file 'nope\.py' does not exist \(relative paths are read from the working directory"),
        ("my_rewards.py:sorted_digit", r"my_rewards\.py has no function 'sorted_digit'; did you mean"),
        ("my_rewards.py:NOT_A_FUNCTION", r"my_rewards\.py:NOT_A_FUNCTION is a int, not a function"),
        ("no_such_package.rewards:f", r"no module named 'no_such_package'; install the package"),
        ("bad.py:f", r"running bad\.py raised ZeroDivisionError"),
    ],
)
def test_a_bad_reward_reference_is_one_line(own_task, reference, message):
    (own_task[0] / "bad.py").write_text("1 / 0\n")
    with pytest.raises(RewardReferenceError, match=message) as error:
        load_reward_reference(reference)
    assert "\n" not in str(error.value) and repr(reference) in str(error.value)


@pytest.mark.parametrize(
    "entry",
    [
        "{python: nofunction}",
        "{python: 'a.py:'}",
        "{python: 'a.py:f', builtin: task}",
        "{python: 'a.py:f', device: cpu}",
    ],
)
def test_reward_entries_are_validated_with_the_config(entry):
    with pytest.raises(ConfigError, match="reward_funcs entry"):
        load_config(GRPOConfig, None, [f"reward_funcs=[{entry}]"])


# ----------------------------------------------------------------------------- grpokit train / sft / eval


def test_train_on_an_own_dataset_with_a_reward_by_reference_then_eval(own_task, capsys):
    tmp_path, train, held_out = own_task
    run = tmp_path / "run"
    (tmp_path / "task.yaml").write_text(
        f"task: null\ndataset: {train}\neval_dataset: {held_out}\nmodel: tiny\n"
        f"reward_funcs: [{{python: my_rewards.py:sorted_digits}}]\noutput_dir: {run}\n"
    )
    assert main(["train", "task.yaml", *GRPO_SMALL, "sft_steps=3"]) == 0, capsys.readouterr().err
    checkpoint = run / "checkpoint-2"
    vocab = json.loads((checkpoint / "tokenizer.json").read_text())["model"]["vocab"]
    assert "".join(t for t in vocab if len(t) == 1) == "12345:"  # the data's own characters, sorted
    metrics = read_metrics(run)
    assert "rewards/sorted_digits/mean" in metrics[-2] and "eval/accuracy" in metrics[-1]
    capsys.readouterr()

    # eval reads the YAML's held-out file and its reward; accuracy from the answer column
    assert main(["eval", "task.yaml", f"model={checkpoint}", "max_completion_length=4"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["num_prompts"] == 2.0 and {"accuracy", "reward"} <= set(out)

    # a prompt with a character the checkpoint's tokenizer never saw: refused, not scored as <unk>
    other = _write(tmp_path / "other.jsonl", [{"prompt": "96:", "answer": "69"}])
    assert main(["eval", "task.yaml", f"model={checkpoint}", f"eval_dataset={other}"]) == 2
    err = capsys.readouterr().err
    assert "other.jsonl: row 0 has the character '9' in 'prompt'" in err and "Traceback" not in err


def test_sft_steps_on_rows_without_answers_fail_before_any_work(own_task, capsys):
    tmp_path, _, _ = own_task
    prompts_only = _write(tmp_path / "prompts.jsonl", _rows(["12", "21"], with_answer=False))
    args = ["task=null", f"dataset={prompts_only}", f"output_dir={tmp_path / 'r'}"]
    reward = "reward_funcs=[{python: my_rewards.py:sorted_digits}]"
    assert main(["train", *args, reward, *GRPO_SMALL, "sft_steps=5"]) == 2
    err = capsys.readouterr().err
    assert f"{prompts_only} has no column 'answer' (columns: prompt)" in err and "sft_steps=0" in err
    assert not (tmp_path / "r").exists()
    assert main(["sft", "task=null", f"dataset={prompts_only}", f"output_dir={tmp_path / 's'}", *TINY]) == 2
    assert "has no column 'answer'" in capsys.readouterr().err and not (tmp_path / "s").exists()


def test_sft_on_a_dataset_then_train_from_it(own_task, capsys):
    tmp_path, train, held_out = own_task
    out = tmp_path / "sft"
    args = ["task=null", f"dataset={train}", f"eval_dataset={held_out}", f"output_dir={out}", "max_steps=3"]
    assert main(["sft", *args, "batch_size=4", *TINY]) == 0, capsys.readouterr().err
    assert "held-out greedy accuracy" in capsys.readouterr().out
    vocab = json.loads((out / "final" / "tokenizer.json").read_text())["model"]["vocab"]
    assert "".join(t for t in vocab if len(t) == 1) == "12345:"
    # the saved model is a starting point for GRPO on the same data
    grpo = ["task=null", f"dataset={train}", f"model={out / 'final'}", f"output_dir={tmp_path / 'g'}"]
    assert main(["train", *grpo, "reward_funcs=[{python: my_rewards.py:sorted_digits}]", *GRPO_SMALL]) == 0


def test_unknown_characters_in_training_data_for_a_char_checkpoint(own_task, capsys):
    tmp_path, train, held_out = own_task
    out = tmp_path / "sft"
    assert main(["sft", "task=null", f"dataset={train}", f"output_dir={out}", "max_steps=1", *TINY]) == 0
    wider = _write(tmp_path / "wider.jsonl", _rows(["1238"]))
    args = ["task=null", f"dataset={wider}", f"model={out / 'final'}", f"output_dir={tmp_path / 'g'}"]
    assert main(["train", *args, "reward_funcs=[{python: my_rewards.py:sorted_digits}]", *GRPO_SMALL]) == 2
    assert "wider.jsonl: row 0 has the character '8' in 'prompt'" in capsys.readouterr().err


# ----------------------------------------------------------------------------- LoRA from the config


@pytest.fixture
def lora_run(tmp_path_factory):
    pytest.importorskip("peft")
    run = tmp_path_factory.mktemp("lora") / "run"
    args = [f"output_dir={run}", "use_peft=true", "lora_r=2", "lora_alpha=4", "beta=0.04"]
    assert main(["train", *args, ONES, *GRPO_SMALL, "learning_rate=0.1", "sft_steps=2"]) == 0
    return run


def test_lora_trains_only_adapters_and_exports_merged(lora_run, tmp_path, capsys):
    """A LoRA checkpoint's root is the trained model with the adapters merged: transformers' Auto
    class loads it as it is and computes what the PEFT model (base + adapters) computes; PEFT's
    adapter files and the base weights (for resume) are in lora_adapter/. `export` writes the root's
    model alone; a checkpoint of the earlier layout (base at the root) is merged on load."""
    import shutil

    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from grpokit.models import load_policy

    checkpoint = lora_run / "checkpoint-2"
    adapters = load_file(checkpoint / "lora_adapter" / "adapter_model.safetensors")
    targets = {k.split(".")[-3] for k in adapters}
    assert targets == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert any(v.abs().max() > 0 for k, v in adapters.items() if "lora_B" in k)  # GRPO moved the adapters
    assert {v.shape[0] for k, v in adapters.items() if "lora_A" in k} == {2}  # lora_r reached PEFT
    adapter_config = json.loads((checkpoint / "lora_adapter" / "adapter_config.json").read_text())
    assert (adapter_config["r"], adapter_config["lora_alpha"], adapter_config["lora_dropout"]) == (2, 4, 0.05)
    root = load_file(checkpoint / "model.safetensors")
    base = load_file(checkpoint / "lora_adapter" / "base" / "model.safetensors")
    assert set(root) == set(base) and "lm_head.weight" in root  # plain names
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(root[q], base[q])  # the adapters are in the root's weights
    assert torch.equal(root["lm_head.weight"], base["lm_head.weight"])  # not adapted: as it was

    ids = torch.tensor([[4, 5, 6, 7, 8]])
    auto = AutoModelForCausalLM.from_pretrained(checkpoint, local_files_only=True).eval()
    with torch.no_grad():
        unmerged = _peft_model(checkpoint)(ids).logits
        # float32 round-off only: W + s·B·A summed once against x·W + s·(x·A)·B
        assert torch.allclose(auto(ids).logits, unmerged, atol=1e-5)
        untrained = AutoModelForCausalLM.from_pretrained(checkpoint / "lora_adapter" / "base").eval()
        assert (untrained(ids).logits - unmerged).abs().max() > 1e-3  # the adapters matter here

    merged = load_policy(checkpoint).model
    assert all(torch.equal(v, root[k]) for k, v in merged.state_dict().items() if k in root)
    capsys.readouterr()
    assert main(["export", str(checkpoint), str(tmp_path / "merged")]) == 0
    assert "LoRA adapters merged" in capsys.readouterr().out
    assert not (tmp_path / "merged" / "lora_adapter").exists()
    weights = load_file(tmp_path / "merged" / "model.safetensors")
    assert weights.keys() == root.keys() and all(torch.equal(weights[k], root[k]) for k in root)

    earlier = tmp_path / "earlier"  # the layout before: base at the root, adapters beside it
    shutil.copytree(checkpoint, earlier)
    shutil.move(earlier / "lora_adapter" / "base" / "model.safetensors", earlier / "model.safetensors")
    shutil.rmtree(earlier / "lora_adapter" / "base")
    with torch.no_grad():
        assert torch.allclose(load_policy(earlier).model.eval()(ids).logits, unmerged, atol=1e-5)

    assert main(["eval", f"model={checkpoint}", "num_eval_prompts=4", "max_completion_length=4"]) == 0
    assert "accuracy" in json.loads(capsys.readouterr().out)


def _peft_model(checkpoint):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(checkpoint / "lora_adapter" / "base", local_files_only=True)
    return PeftModel.from_pretrained(base, checkpoint / "lora_adapter").eval()


def test_lora_resume_continues_bitwise(tmp_path):
    pytest.importorskip("peft")
    from safetensors.torch import load_file

    lora = ["use_peft=true", "lora_r=2", "lora_target_modules=[q_proj, v_proj]", "lora_dropout=0.0"]
    whole, split = tmp_path / "whole", tmp_path / "split"
    lora.append(ONES)
    assert main(["train", f"output_dir={whole}", *lora, *GRPO_SMALL, "max_steps=2"]) == 0
    assert main(["train", f"output_dir={split}", *lora, *GRPO_SMALL, "max_steps=2", "save_steps=1"]) == 0
    import shutil

    shutil.rmtree(split / "checkpoint-2")
    assert main(["train", f"output_dir={split}", *lora, *GRPO_SMALL, "max_steps=2", "resume=true"]) == 0
    a = load_file(whole / "checkpoint-2" / "lora_adapter" / "adapter_model.safetensors")
    b = load_file(split / "checkpoint-2" / "lora_adapter" / "adapter_model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert {k.split(".")[-3] for k in a} == {"q_proj", "v_proj"}

    # a checkpoint of the earlier layout (base weights at the root, no lora_adapter/base/) resumes too
    from grpokit.train.checkpoint import write_manifest

    earlier = split / "checkpoint-1"
    shutil.rmtree(split / "checkpoint-2")
    shutil.move(earlier / "lora_adapter" / "base" / "model.safetensors", earlier / "model.safetensors")
    shutil.rmtree(earlier / "lora_adapter" / "base")
    write_manifest(earlier)
    assert main(["train", f"output_dir={split}", *lora, *GRPO_SMALL, "max_steps=2", "resume=true"]) == 0
    c = load_file(split / "checkpoint-2" / "lora_adapter" / "adapter_model.safetensors")
    assert all(torch.equal(a[k], c[k]) for k in a)
    merged = load_file(whole / "checkpoint-2" / "model.safetensors")  # and it writes the new layout
    assert all(
        torch.equal(v, merged[k]) for k, v in load_file(split / "checkpoint-2" / "model.safetensors").items()
    )


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["lora_r=0"], "lora_r: Input should be greater than or equal to 1"),
        (["lora_dropout=1.0"], "lora_dropout: Input should be less than 1"),
        (["lora_target_modules=[]"], "lora_target_modules: List should have at least 1 item"),
    ],
)
def test_bad_lora_values_name_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(GRPOConfig, None, overrides)


def test_lora_target_that_matches_nothing_and_missing_peft(tmp_path, capsys, monkeypatch):
    pytest.importorskip("peft")
    args = ["use_peft=true", "lora_target_modules=[qproj]", f"output_dir={tmp_path / 'r'}", *GRPO_SMALL]
    assert main(["train", *args]) == 2
    err = capsys.readouterr().err
    assert "lora_target_modules ['qproj'] match no module of the model; its linear layers are" in err
    assert "q_proj" in err
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "peft" else real(name, *a)
    )
    assert main(["train", "use_peft=true", f"output_dir={tmp_path / 'r2'}", *GRPO_SMALL]) == 2
    assert "use_peft=true needs the peft package: pip install 'grpokit[lora]'." in capsys.readouterr().err
    assert not (tmp_path / "r2").exists()


def test_answer_column_names_the_column_answers_come_from(tmp_path):
    """answer_column=label: the warm start learns the label column and evaluation scores against it;
    left at 'answer', the same rows are refused before any work."""
    from grpokit.train.grpo import train_grpo

    from .helpers import ones_reward, tiny_config

    rows = [{"prompt": f"{i}+1=", "label": str(i + 1)} for i in range(12)]
    cfg = tiny_config(tmp_path, task=None, sft_steps=2, sft_batch_size=4, answer_column="label", max_steps=1)
    result = train_grpo(cfg, reward_funcs=[ones_reward], train_rows=rows, eval_rows=rows[:4])
    assert 0.0 <= result.eval_before["accuracy"] <= 1.0  # exact match against the label column
    assert len((tmp_path / "run" / "sft_metrics.jsonl").read_text().splitlines()) == 2
    with pytest.raises(DataError, match="no column 'answer'"):
        train_grpo(
            cfg.model_copy(update={"answer_column": "answer", "output_dir": str(tmp_path / "other")}),
            reward_funcs=[ones_reward],
            train_rows=rows,
            eval_rows=rows[:4],
        )
    assert not (tmp_path / "other").exists()  # refused before any work
