"""The real path end to end, offline: a model by hub id from a test-made Hugging Face cache (BPE
tokenizer, chat template), a dataset directory in hub-repo layout, the `gsm8k` preset at toy size,
a warm start, evaluation, checkpoints that transformers loads, resume; and the pieces they rest on
(system prompt, chat template variables, the GSM8K rewards)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from grpokit.data import render_prompt, with_system_prompt
from grpokit.rewards import BUILTIN_REWARDS
from tests.helpers import read_metrics
from tests.hub_cache import QWEN, grpokit_offline

ROWS = [
    {
        "question": f"Tom has {a} apples and buys {b} more. How many apples does he have?",
        "answer": f"He has {a} + {b} = {a + b} apples.\n#### {a + b:,}",
    }
    for a, b in [(3, 4), (12, 30), (250, 1000), (7, 8), (40, 2), (9, 9), (15, 5), (600, 700)]
]


def gsm8k_like(root: Path) -> Path:
    """A dataset directory as a hub dataset repo lays it out: README front matter naming config
    `main` and its parquet splits."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    (root / "main").mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(ROWS[:6]), root / "main" / "train-00000-of-00001.parquet")
    pq.write_table(pa.Table.from_pylist(ROWS[6:]), root / "main" / "test-00000-of-00001.parquet")
    (root / "README.md").write_text(
        "---\nconfigs:\n- config_name: main\n  data_files:\n  - split: train\n    path: main/train-*\n"
        "  - split: test\n    path: main/test-*\n---\n# a GSM8K-like dataset\n"
    )
    return root


def test_gsm8k_rewards_read_the_answer_after_the_last_marker():
    answer, fmt = BUILTIN_REWARDS["gsm8k_answer"], BUILTIN_REWARDS["gsm8k_format"]
    completions = [
        "3 + 4 = 7\n#### 7",
        "#### 6\nno, #### 7",
        "The answer is 7.",
        "#### 1,250",
        "#### 7 apples",
    ]
    refs = ["7", "He has 3 + 4 = 7.\n#### 7", "7", "#### 1,250", "7"]
    assert answer([""] * 5, completions, answer=refs) == [1.0, 1.0, 0.0, 1.0, 1.0]
    assert fmt([""] * 5, completions) == [1.0, 1.0, 0.0, 1.0, 0.0]
    assert answer([""], ["#### 7"], answer=["no number"]) == [None]


def test_a_system_prompt_opens_every_prompt_and_template_variables_reach_the_template(hub_offline):
    from transformers import AutoTokenizer

    rows = [
        {"q": "What is 2+2?"},
        {"q": [{"role": "system", "content": "Own."}, {"role": "user", "content": "Hi"}]},
    ]
    out = with_system_prompt(rows, "q", "Be brief.")
    assert out[0]["q"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2+2?"},
    ]
    assert out[1]["q"] == rows[1]["q"]  # its own system message kept
    assert rows[0]["q"] == "What is 2+2?"  # the input rows untouched
    tok = AutoTokenizer.from_pretrained(QWEN)
    assert render_prompt(out[0]["q"], tok) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    tok.chat_template = "{{ messages[0]['content'] }}{% if enable_thinking is false %}/no_think{% endif %}"
    assert render_prompt(out[0]["q"], tok, template_kwargs={"enable_thinking": False}) == "Be brief./no_think"
    assert render_prompt(out[0]["q"], tok) == "Be brief."


TOY = [
    "device=cpu",
    "dtype=float32",
    "prompts_per_step=2",
    "num_generations=4",
    "micro_batch_size=8",
    "max_prompt_length=null",
    "max_completion_length=12",
    "num_eval_prompts=2",
    "eval_steps=0",
    "save_steps=1",
    "report_to=none",
    "progress=false",
    "sft_steps=2",
    "sft_batch_size=4",
]


@pytest.mark.slow
def test_the_gsm8k_preset_trains_a_hub_model_on_a_hub_layout_dataset_and_resumes(hub_home, tmp_path):
    """`grpokit train gsm8k model=ORG/NAME dataset=DIR` at toy size, through the CLI, offline: the chat
    template renders the system prompt, a warm start learns the worked solutions, GRPO scores with the
    GSM8K rewards, evaluation reports accuracy and each reward, every checkpoint loads with transformers'
    Auto classes (chat template included), and resume continues the run."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    data, out = gsm8k_like(tmp_path / "gsm8k_data"), tmp_path / "run"
    common = ["gsm8k", f"model={QWEN}", f"dataset={data}", f"output_dir={out}", *TOY]
    first = grpokit_offline(hub_home, "train", *common, "max_steps=2")
    assert first.returncode == 0, first.stderr[-3000:]
    rows = read_metrics(out)
    steps = [r for r in rows if "rewards/gsm8k_answer/mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert all("rewards/gsm8k_format/mean" in r for r in steps)
    evaluated = [r for r in rows if "eval/accuracy" in r]  # held-out accuracy on the test split
    assert evaluated and all(
        r["eval/reward"]
        == pytest.approx(r["eval/rewards/gsm8k_answer/mean"] + 0.1 * r["eval/rewards/gsm8k_format/mean"])
        for r in evaluated
    )  # the preset's weights, 1 and 0.1
    assert (out / "sft_metrics.jsonl").read_text().count("\n") >= 2  # the warm start ran its steps

    checkpoint = out / "checkpoint-2"
    model = AutoModelForCausalLM.from_pretrained(checkpoint)
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    original = AutoTokenizer.from_pretrained(
        hub_home
        / "hub"
        / "models--tiny-org--qwen2-chat"
        / "snapshots"
        / "0123456789abcdef0123456789abcdef01234567"
    )
    assert tokenizer.chat_template == original.chat_template and tokenizer.eos_token == "<|im_end|>"
    assert model.generation_config.eos_token_id == [
        tokenizer.convert_tokens_to_ids("<|im_end|>"),
        tokenizer.pad_token_id,
    ]
    saved = load_file(checkpoint / "model.safetensors")
    for name, tensor in model.state_dict().items():  # transformers reads exactly what was written
        key = name if name in saved else "model.embed_tokens.weight"  # the tied head is stored once
        assert torch.equal(tensor, saved[key]), name

    second = grpokit_offline(hub_home, "train", *common, "max_steps=3", "resume=true")
    assert second.returncode == 0, second.stderr[-3000:]
    rows = read_metrics(out)
    assert [r["step"] for r in rows if "rewards/gsm8k_answer/mean" in r] == [1, 2, 3]


@pytest.mark.slow
def test_the_trained_weights_are_what_transformers_loads(hub_offline, tmp_path):
    """Python API with a model loaded by hub id: after training, the last checkpoint loads with
    AutoModelForCausalLM to exactly the weights the run ended with."""
    from transformers import AutoModelForCausalLM

    from grpokit.config import GRPOConfig
    from grpokit.models import load_policy
    from grpokit.train.grpo import train_grpo

    loaded = load_policy(QWEN)
    before = {k: v.clone() for k, v in loaded.model.state_dict().items()}
    cfg = GRPOConfig(
        task=None,
        dataset=str(gsm8k_like(tmp_path / "data")),
        dataset_config="main",
        prompt_column="question",
        answer_format="gsm8k",
        system_prompt="Answer after ####.",
        output_dir=str(tmp_path / "run"),
        max_steps=2,
        learning_rate=1e-3,
        **{item.split("=")[0]: _value(item.split("=")[1]) for item in TOY if not item.startswith("sft")},
    )
    train_grpo(cfg, model=loaded.model, tokenizer=loaded.tokenizer, reward_funcs=[_longer_is_better])
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "checkpoint-2")
    trained = loaded.model.state_dict()
    assert any(not torch.equal(trained[k], before[k]) for k in before)  # it trained
    for name, tensor in reloaded.state_dict().items():
        assert torch.equal(tensor, trained[name]), name


def _longer_is_better(completions, **_):
    """A reward that varies within a group on a random model (GSM8K's are all 0 there), written as
    for TRL: the prompts are conversations (a system prompt), so each completion is an assistant turn."""
    return [float(len(c[0]["content"])) for c in completions]


def _value(text: str):
    return {"null": None, "false": False, "true": True}.get(text, int(text) if text.isdigit() else text)


@pytest.mark.slow
def test_eval_and_train_take_a_hub_id_at_a_revision_from_the_cli(hub_offline, tmp_path, capsys):
    """`grpokit eval model=ORG/NAME model_revision=REV` on a hub-layout dataset (GSM8K answers judged
    after '####', both rewards reported), `train` at that revision, and a revision the cache lacks:
    one line naming it and the download command."""
    from grpokit.cli import main
    from tests.hub_cache import REVISION

    data = gsm8k_like(tmp_path / "data")
    common = [
        f"model={QWEN}",
        "task=null",
        f"dataset={data}",
        "dataset_config=main",
        "prompt_column=question",
        "answer_format=gsm8k",
        "reward_funcs=[gsm8k_answer, gsm8k_format]",
        "reward_weights=[1.0, 0.1]",
        "max_completion_length=8",
        "num_eval_prompts=2",
        "device=cpu",
        "dtype=float32",
    ]
    assert main(["eval", *common, f"model_revision={REVISION}"]) == 0
    metrics = json.loads(capsys.readouterr().out)
    assert metrics["num_prompts"] == 2.0 and 0.0 <= metrics["accuracy"] <= 1.0
    assert metrics["reward"] == pytest.approx(
        metrics["rewards/gsm8k_answer/mean"] + 0.1 * metrics["rewards/gsm8k_format/mean"]
    )
    out = tmp_path / "run"
    train = [*common, f"model_revision={REVISION}", f"output_dir={out}", "max_steps=1", "report_to=none"]
    train += [
        "prompts_per_step=2",
        "num_generations=2",
        "micro_batch_size=4",
        "eval_steps=0",
        "progress=false",
        "max_prompt_length=null",
    ]
    assert main(["train", *train]) == 0
    saved = json.loads((out / "checkpoint-1" / "config.json").read_text())
    assert saved["architectures"] == ["Qwen2ForCausalLM"]
    capsys.readouterr()
    assert main(["eval", *common, "model_revision=v9"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and "--debug" in err[1] and "Traceback" not in err[0], err  # one line, and the hint
    assert f"'{QWEN}' at revision 'v9'" in err[0] and f"hf download {QWEN} --revision v9" in err[0], err


@pytest.mark.slow
def test_resume_on_a_hub_chat_model_ends_where_the_uninterrupted_run_ends(hub_offline, tmp_path):
    """A BPE chat model by hub id, a hub-layout dataset, a system prompt: two steps in one run, and
    one step, stopped, then resumed for the second, end with bitwise equal weights and the same
    rewards at step 2 (the prompt order, the sampler's draw and the optimizer state all resume)."""
    from safetensors.torch import load_file

    from grpokit.config import GRPOConfig
    from grpokit.train.grpo import train_grpo

    data = gsm8k_like(tmp_path / "data")

    def run(out, steps, **more):
        cfg = GRPOConfig(
            model=QWEN,
            task=None,
            dataset=str(data),
            dataset_config="main",
            prompt_column="question",
            answer_format="gsm8k",
            system_prompt="Answer after ####.",
            output_dir=str(out),
            max_steps=steps,
            learning_rate=1e-3,
            lr_scheduler_type="constant",  # the same rate at step 2 whether the run was to end at 1 or 2
            **{item.split("=")[0]: _value(item.split("=")[1]) for item in TOY if not item.startswith("sft")},
            **more,
        )
        train_grpo(cfg, reward_funcs=[_longer_is_better])

    whole, split = tmp_path / "whole", tmp_path / "split"
    run(whole, 2)
    run(split, 1)
    run(split, 2, resume=True)
    a = load_file(whole / "checkpoint-2" / "model.safetensors")
    b = load_file(split / "checkpoint-2" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    first = load_file(whole / "checkpoint-1" / "model.safetensors")
    assert any(not torch.equal(a[k], first[k]) for k in a)  # step 2 moved the weights

    def step2(out):
        rows = read_metrics(out)
        return next(r["reward"] for r in rows if r.get("step") == 2 and "reward" in r)

    assert step2(whole) == step2(split)
