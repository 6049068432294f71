"""Bad inputs around the user's own modules, models and data, each refused in one line (exit 2) before
the run directory is written, so that the corrected command runs:

* a reward, tool or environment module that calls sys.exit at import (it used to end the command with
  its code, 0: a training that never ran recorded as a success);
* a chat template that rejects the messages (a template's raise_exception, a Jinja error);
* a model, or an opd/gkd teacher, whose input embedding has fewer rows than its tokenizer has ids;
* a dataset directory that is a loading script;
* an older-layout LoRA checkpoint whose adapters are a pickle that names code;
* num_generations or max_completion_length far beyond the device's memory;
and two reward functions of one name (their metrics were one), and a reward function that edits its
arguments in place (the next function saw the edits)."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest
import torch

from grpokit.cli import main
from grpokit.config import GRPOConfig, load_config
from grpokit.data import DataError, render_prompt
from grpokit.rewards import (
    BUILTIN_REWARDS,
    CallRules,
    RewardReferenceError,
    load_reward_reference,
    reward_names,
    score_completions,
)
from tests.helpers import read_metrics, tiny_run
from tests.hub_cache import build_qwen

# one step of the tiny run, its sample completions and learning rate left to the preset and model=tiny
SMALL = tiny_run("log_completions_steps", "learning_rate", max_steps=1)
HINT = "(run with --debug for the traceback)"
PROGRESS = re.compile(r"^(Loading|Writing) [\w ]+: +\d+%\|")  # transformers' bars ("Loading weights:  0%|")


def one_line(capsys: pytest.CaptureFixture[str], command: str) -> str:
    """The error line of a command that exited 2: the line and the hint, nothing else on stderr (no
    traceback, no second message; transformers' progress bars for loading weights aside); returned
    without its 'grpokit COMMAND: error: ' prefix."""
    err = [line for line in capsys.readouterr().err.strip().splitlines() if not PROGRESS.match(line)]
    assert len(err) == 2 and err[1] == HINT, err
    prefix = f"grpokit {command}: error: "
    assert err[0].startswith(prefix), err
    return err[0][len(prefix) :]


# ----------------------------------------------------------------------------- 1. a module that exits

EXITING = """import sys


def reward(prompts, completions, **columns):
    return [0.0] * len(completions)


sys.exit(0)  # a script's top level: run on import
"""
FIX = "a module grpokit imports must not exit; move the script part under `if __name__ == '__main__':`."


@pytest.mark.parametrize(
    ("argv", "culprit"),
    [
        (
            ["train", "reward_funcs=[{python: exiting.py:reward}]"],
            "reward_funcs {python: 'exiting.py:reward'}: importing exiting.py",
        ),
        (
            ["train", "reward_funcs=[exiting_mod:reward]"],
            "reward_funcs {python: 'exiting_mod:reward'}: importing exiting_mod",
        ),
        (["train", "tools=[exiting.py:reward]"], "tools entry 'exiting.py:reward': importing exiting.py"),
        (
            ["train", "environment=exiting.py:reward", "task=null", "dataset=questions.jsonl"],
            "environment 'exiting.py:reward': importing exiting.py",
        ),
        (
            ["serve-reward", "exiting_mod:reward", "--port", "0"],
            "reward function 'exiting_mod:reward': importing exiting_mod",
        ),
    ],
    ids=["reward file", "reward module", "tool", "environment", "serve-reward"],
)
def test_a_module_that_exits_at_import_is_one_line(tmp_path, capsys, monkeypatch, argv, culprit):
    (tmp_path / "exiting.py").write_text(EXITING)
    (tmp_path / "exiting_mod.py").write_text(EXITING)
    _questions(tmp_path / "questions.jsonl")
    monkeypatch.syspath_prepend(str(tmp_path))
    run = tmp_path / "run"
    assert main([*argv, *([f"output_dir={run}", *SMALL] if argv[0] == "train" else [])]) == 2
    assert one_line(capsys, argv[0]) == f"{culprit} called sys.exit(0): {FIX}"
    assert not run.exists()  # nothing left that refuses the corrected command


def test_the_doctor_reports_a_module_that_exits_as_fatal_not_as_a_success(tmp_path, capsys):
    from grpokit.train.doctor import checkup

    (tmp_path / "exiting.py").write_text(EXITING)
    args = ["reward_funcs=[{python: exiting.py:reward}]", *SMALL]
    assert main(["doctor", *args]) == 1  # its table, with the fatal finding: never 0
    assert "1 fatal finding" in capsys.readouterr().out
    cfg = load_config(GRPOConfig, None, args)
    fatal = [f for f in checkup(cfg).findings if f.level == "fatal"]
    assert [f.advice for f in fatal] == [
        f"reward_funcs {{python: 'exiting.py:reward'}}: importing exiting.py called sys.exit(0): {FIX}"
    ]


def test_an_exit_while_the_function_is_looked_up_or_without_a_code_is_said_too(tmp_path):
    """A module __getattr__ runs when the function is looked up; sys.exit() and sys.exit('text')
    are exits too. Once the file is fixed, the same process loads it (no half-run module kept)."""
    lazy = tmp_path / "lazy.py"
    lazy.write_text("import sys\n\ndef __getattr__(name):\n    sys.exit(3)\n")
    with pytest.raises(RewardReferenceError) as error:
        load_reward_reference(f"{lazy}:reward")
    assert f"importing {lazy} called sys.exit(3): {FIX}" in str(error.value)

    script = tmp_path / "script.py"
    for call in ("sys.exit()", "sys.exit('done')", "exit(1)"):
        script.write_text(f"import sys\n\ndef reward(prompts, completions):\n    return [1.0]\n\n{call}\n")
        with pytest.raises(RewardReferenceError) as error:
            load_reward_reference("script.py:reward")
        shown = call.replace("exit(1)", "sys.exit(1)")
        assert (
            str(error.value)
            == f"reward_funcs {{python: 'script.py:reward'}}: importing script.py called {shown}: {FIX}"
        )
    script.write_text("def reward(prompts, completions):\n    return [1.0]\n")
    assert load_reward_reference("script.py:reward")([""], [""]) == [1.0]


# ----------------------------------------------------------------------------- 2. a chat template that raises

NO_SYSTEM = (
    "{%- if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{%- endif %}"
)


@pytest.fixture(scope="module")
def rejecting_model(tmp_path_factory) -> Path:
    """A Qwen2 chat model whose template refuses a system message, as Gemma's does."""
    from transformers import AutoTokenizer

    where = tmp_path_factory.mktemp("rejecting") / "model"
    build_qwen(where)
    tokenizer = AutoTokenizer.from_pretrained(where)
    tokenizer.chat_template = NO_SYSTEM + tokenizer.chat_template
    tokenizer.save_pretrained(where)
    return where


def _questions(path: Path) -> Path:
    rows = [{"prompt": f"What is {a} + {a}?", "answer": str(2 * a)} for a in range(8)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("command", ["train", "eval", "doctor"])
def test_a_chat_template_that_rejects_the_messages_is_one_line(rejecting_model, tmp_path, capsys, command):
    data = _questions(tmp_path / "questions.jsonl")
    run = tmp_path / "run"
    args = [
        f"model={rejecting_model}",
        "task=null",
        f"dataset={data}",
        "system_prompt=Be brief.",
        f"output_dir={run}",
    ]
    assert main([command, *args, *SMALL, "reward_funcs=[exact_answer]"]) == 2
    assert one_line(capsys, command) == (
        f"the chat template of {rejecting_model} rejects these messages (roles: system, user): System role "
        "not supported; give prompts in the roles and order it takes (without a system message if it takes "
        "none: unset system_prompt), set the variables it reads with chat_template_kwargs, or use a model "
        "whose template takes them."
    )
    assert not run.exists()


def test_a_template_jinja_cannot_render_is_a_data_error_naming_jinja_s_words(rejecting_model):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(rejecting_model)
    tokenizer.chat_template = "{{ messages[0]['content'] | no_such_filter }}"
    with pytest.raises(DataError) as error:
        render_prompt([{"role": "user", "content": "hi"}], tokenizer)
    message = str(error.value)
    assert "\n" not in message and "rejects these messages (roles: user): " in message
    assert "no_such_filter" in message


# ----------------------------------------------------------------------------- 3. an embedding too small


@pytest.fixture(scope="module")
def short_embedding(tmp_path_factory) -> tuple[Path, Path, int]:
    """(a Qwen2 chat model, the same model saved with 8 embedding rows fewer than its tokenizer has
    ids, the tokenizer's size)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root = tmp_path_factory.mktemp("embedding")
    build_qwen(root / "whole")
    build_qwen(root / "short")
    model = AutoModelForCausalLM.from_pretrained(root / "short")
    size = len(AutoTokenizer.from_pretrained(root / "short"))
    model.resize_token_embeddings(size - 8)
    model.save_pretrained(root / "short")
    return root / "whole", root / "short", size


def _embedding_line(what: str, size: int) -> str:
    return (
        f"{what}: its input embedding has {size - 8} rows but its tokenizer has {size} token ids, so ids "
        f"from {size - 8} on cannot be embedded; resize the embeddings to the tokenizer "
        "(model.resize_token_embeddings(len(tokenizer)), then save_pretrained) or use the tokenizer the "
        "model was trained with."
    )


@pytest.mark.parametrize("role", ["policy", "opd teacher", "gkd teacher"])
def test_a_model_whose_embedding_misses_token_ids_is_one_line(short_embedding, tmp_path, capsys, role):
    """As the policy, or as a teacher: gkd's refusal of a teacher of another head size advised opd,
    which such a teacher fails the same way; its refusal is now the embedding's, with the fix."""
    whole, short, size = short_embedding
    data = _questions(tmp_path / "questions.jsonl")
    run = tmp_path / "run"
    args = ["task=null", f"dataset={data}", f"output_dir={run}", *SMALL, "reward_funcs=[exact_answer]"]
    if role == "policy":
        args.append(f"model={short}")
        what = f"model {str(short)!r}"
    else:
        args += [f"model={whole}", f"loss_type={role.split()[0]}", f"teacher_model={short}"]
        what = f"teacher_model={str(short)!r}"
    assert main(["train", *args]) == 2
    line = one_line(capsys, "train")
    assert line == _embedding_line(what, size)
    assert "loss_type=opd" not in line
    assert not run.exists()


def test_eval_refuses_a_model_whose_embedding_misses_token_ids(short_embedding, tmp_path, capsys):
    _, short, size = short_embedding
    data = _questions(tmp_path / "questions.jsonl")
    assert main(["eval", f"model={short}", "task=null", f"dataset={data}", *SMALL]) == 2
    assert one_line(capsys, "eval") == _embedding_line(f"model {str(short)!r}", size)


# ----------------------------------------------------------------------------- 4. a dataset script

SCRIPT = """import datasets


class Questions(datasets.GeneratorBasedBuilder):
    def _info(self):
        return datasets.DatasetInfo(features=datasets.Features({"prompt": datasets.Value("string")}))
"""


@pytest.mark.parametrize("command", ["train", "eval"])
def test_a_dataset_directory_with_a_loading_script_is_one_line(tmp_path, capsys, command):
    directory = tmp_path / "questions"
    directory.mkdir()
    (directory / "questions.py").write_text(SCRIPT)
    _questions(directory / "train.jsonl")  # data beside it: `datasets` would still want the script
    run = tmp_path / "run"
    args = ["task=null", f"dataset={directory}", f"output_dir={run}", *SMALL, "reward_funcs=[exact_answer]"]
    assert main([command, *args]) == 2
    assert one_line(capsys, command) == (
        f"dataset {str(directory)!r} holds a loading script (questions.py), and grpokit does not run "
        "dataset scripts; convert the data to JSONL or Parquet files (the script's output, loaded once with "
        "datasets<4.0, saved by .to_json() or .to_parquet()) and give dataset=FILE or a directory of them."
    )
    assert not run.exists()
    (directory / "questions.py").unlink()  # converted: the same command trains
    if command == "train":
        assert main([command, *args]) == 0


def test_a_hub_repository_s_script_found_by_datasets_is_the_same_line(tmp_path, monkeypatch):
    import datasets

    from grpokit.data.hub import load_dataset_dict

    def scripted(path, config):
        raise RuntimeError("Dataset scripts are no longer supported, but found gsm8k.py")

    monkeypatch.setattr(datasets, "load_dataset", scripted)
    with pytest.raises(DataError, match=r"^dataset 'openai/gsm8k' holds a loading script \(gsm8k\.py\), and"):
        load_dataset_dict("openai/gsm8k", None)


# ----------------------------------------------------------------------------- 5. a pickled LoRA adapter


class _Payload:
    """Unpickling this creates `marker`: what a crafted adapter file would do to run code."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def _older_lora_checkpoint(root: Path) -> Path:
    """A LoRA checkpoint of the earlier layout with PEFT's pickled adapters: the base model at the root,
    lora_adapter/adapter_config.json and adapter_model.bin (safe_serialization=False), non-zero."""
    pytest.importorskip("peft")
    from peft import LoraConfig, get_peft_model

    from grpokit.models import build_policy, char_tokenizer, save_policy

    tokenizer = char_tokenizer("0123456789+=")
    base = build_policy(
        hidden_size=16, num_layers=1, num_heads=2, vocab_size=len(tokenizer), max_seq_len=32, seed=0,
        intermediate_size=32,
    )  # fmt: skip
    save_policy(base, tokenizer, root)
    config = LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    get_peft_model(base, config).save_pretrained(root / "lora_adapter", safe_serialization=False)
    assert (root / "lora_adapter" / "adapter_model.bin").is_file()
    assert not (root / "lora_adapter" / "adapter_model.safetensors").exists()
    return root


PICKLE_LINE = (
    "checkpoint {root}: lora_adapter/adapter_model.bin is a pickle that holds more than tensors and is not "
    "loaded (it could run code); save the adapters as adapter_model.safetensors from a trusted copy (PEFT's "
    "save_pretrained with safe_serialization=True)."
)


@pytest.mark.parametrize("command", ["eval", "train", "export"])
def test_a_pickled_lora_adapter_that_names_code_runs_nothing_and_is_one_line(tmp_path, capsys, command):
    root = _older_lora_checkpoint(tmp_path / "checkpoint-3")
    marker = tmp_path / "code-ran"
    torch.save({"weights": _Payload(marker)}, root / "lora_adapter" / "adapter_model.bin")
    run = tmp_path / "run"
    argv = (
        ["export", str(root), str(tmp_path / "out")]
        if command == "export"
        else [command, f"model={root}", f"output_dir={run}", *SMALL]
    )
    assert main(argv) == 2
    assert one_line(capsys, command) == PICKLE_LINE.format(root=root)
    assert not marker.exists() and not run.exists()


def test_resuming_a_lora_checkpoint_with_a_pickle_that_names_code_refuses_before_loading(tmp_path):
    from peft import LoraConfig, get_peft_model

    from grpokit.models import load_lora_weights, load_policy

    root = _older_lora_checkpoint(tmp_path / "checkpoint-3")
    model = get_peft_model(load_policy(root).model, LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    marker = tmp_path / "code-ran"
    torch.save({"weights": _Payload(marker)}, root / "lora_adapter" / "adapter_model.bin")
    with pytest.raises(ValueError) as error:
        load_lora_weights(model, root)
    assert str(error.value) == PICKLE_LINE.format(root=root) and not marker.exists()
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # nothing loaded


def test_a_pickled_lora_adapter_of_tensors_loads_merged_and_trains(tmp_path, capsys):
    """PEFT's own older files (tensors only, read with weights_only=True) still load: merged as the
    adapters compute, every weight trainable (PEFT had frozen the base: `train model=` of such a
    checkpoint failed with 'optimizer got an empty parameter list')."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from grpokit.models import load_policy

    root = _older_lora_checkpoint(tmp_path / "checkpoint-3")
    merged = load_policy(root).model.eval()
    assert all(p.requires_grad for p in merged.parameters())
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    with torch.no_grad():
        base = AutoModelForCausalLM.from_pretrained(root, local_files_only=True)  # the root: the base
        unmerged = PeftModel.from_pretrained(base, root / "lora_adapter")
        assert torch.allclose(merged(ids).logits, unmerged.eval()(ids).logits, atol=1e-5)
    assert main(["train", f"model={root}", f"output_dir={tmp_path / 'run'}", *SMALL]) == 0, (
        capsys.readouterr().err
    )


# ----------------------------------------------------------------------------- 6. sizes beyond the memory


def test_num_generations_beyond_memory_is_refused_before_the_run_directory_and_the_fix_runs(
    tmp_path, capsys, monkeypatch
):
    """Against a machine of 256 MiB, which the test's tiny model (about 0.6 GiB for 4 × 100000 rows)
    exceeds twice over, as the preset's (123 GiB at prompts_per_step=32) does any machine under 61 GiB:
    one line naming num_generations, nothing left in output_dir, and the same command with
    num_generations=4 then trains."""
    from grpokit.train import memory_check

    monkeypatch.setattr(
        memory_check, "device_memory", lambda device: (2**28, "this machine's 256.0 MiB of RAM")
    )
    run = tmp_path / "run"
    args = [f"output_dir={run}", *SMALL]
    assert main(["train", *args, "num_generations=100000"]) == 2
    line = one_line(capsys, "train")
    assert line.startswith("num_generations=100000: one step's rollout is forecast to need "), line
    assert "(the KV cache and decode buffers of prompts_per_step × num_generations = 4 × 100000 rows" in line
    assert line.endswith(
        "more than 2 × this machine's 256.0 MiB of RAM; lower num_generations (`grpokit doctor` forecasts a "
        "step's memory)."
    )
    assert not run.exists()
    assert main(["train", *args, "num_generations=4"]) == 0, capsys.readouterr().err
    assert (run / "checkpoint-1").is_dir()


@pytest.mark.parametrize("value", ["1e8", "100000000"])
def test_max_completion_length_beyond_any_memory_is_one_line(tmp_path, capsys, value):
    """The built-in tiny model is built to fit any length: the memory is what refuses it (the
    preset's model, unmocked: 95 TiB, beyond any machine)."""
    run = tmp_path / "run"
    assert main(["train", f"max_completion_length={value}", f"output_dir={run}", "sft_steps=0"]) == 2
    line = one_line(capsys, "train")
    assert line.startswith("max_completion_length=100000000: one step's rollout is forecast to need ")
    assert "lower max_completion_length" in line and "more than 2 × " in line
    assert not run.exists()


def test_max_completion_length_beyond_a_model_s_context_is_refused_by_the_context(
    hub_offline, tmp_path, capsys
):
    from tests.hub_cache import QWEN

    data = _questions(tmp_path / "questions.jsonl")
    args = [f"model={QWEN}", "task=null", f"dataset={data}", "reward_funcs=[exact_answer]", "sft_steps=0"]
    assert main(["train", *args, "max_completion_length=1e8", f"output_dir={tmp_path / 'run'}"]) == 2
    line = one_line(capsys, "train")
    assert "plus max_completion_length=100000000 make" in line and "model's context of 512" in line
    assert not (tmp_path / "run").exists()


def test_realistic_steps_are_never_refused(monkeypatch):
    """Qwen2.5-0.5B's shape at usual sizes against 16 GiB; a 7B's at a large step against an 80 GiB GPU."""
    from transformers import Qwen2Config

    from grpokit.config.plan import grpo_plan
    from grpokit.models import ModelShape
    from grpokit.train import memory_check
    from tests.hub_cache import QWEN_05B_SHAPE

    small = ModelShape.from_config(Qwen2Config(**QWEN_05B_SHAPE, tie_word_embeddings=True))
    large = ModelShape.from_config(
        Qwen2Config(
            hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
            num_key_value_heads=4, vocab_size=152064, max_position_embeddings=32768,
        )
    )  # fmt: skip
    cases = [
        (small, 2**34, dict(num_generations=8, prompts_per_step=8, micro_batch_size=8), 1024),
        (large, 80 * 2**30, dict(num_generations=16, prompts_per_step=8, micro_batch_size=16), 4096),
    ]
    for shape, memory, sizes, length in cases:
        monkeypatch.setattr(memory_check, "device_memory", lambda device, m=memory: (m, "memory"))
        plan = grpo_plan(GRPOConfig(**sizes, max_completion_length=length, dtype="bfloat16"))
        assert memory_check.step_memory_refusal(plan, shape, 512, length, torch.device("cpu")) is None
        typo = dict(sizes, num_generations=1000 * sizes["num_generations"])  # three zeros too many
        plan = grpo_plan(GRPOConfig(**typo, max_completion_length=length, dtype="bfloat16"))
        refusal = memory_check.step_memory_refusal(plan, shape, 512, length, torch.device("cpu"))
        assert refusal is not None and refusal.startswith(f"num_generations={typo['num_generations']}:")


def test_the_machine_s_memory_is_read_and_a_lower_limit_on_the_process_wins(monkeypatch, tmp_path):
    import os
    import resource

    from grpokit.train import memory_check

    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    monkeypatch.setattr(memory_check, "CGROUP_LIMITS", (str(tmp_path / "memory.max"),))
    monkeypatch.setattr(resource, "getrlimit", lambda what: (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    (tmp_path / "memory.max").write_text("max\n")  # cgroup v2 without a limit
    total, where = memory_check.device_memory(torch.device("cpu"))
    assert total == physical and "RAM" in where
    (tmp_path / "memory.max").write_text(f"{2**31}\n")  # a container's 2 GiB
    assert memory_check.device_memory(torch.device("cpu")) == (
        2**31,
        "the 2.0 GiB this process may use (its cgroup's or ulimit's limit)",
    )
    monkeypatch.setattr(resource, "getrlimit", lambda what: (2**30, resource.RLIM_INFINITY))  # ulimit -v
    assert memory_check.device_memory(torch.device("cpu"))[0] == 2**30


# ----------------------------------------------------------------------------- 7. two rewards of one name


def test_reward_names_are_made_distinct_after_every_name_is_known():
    def named(name):
        def fn(prompts, completions, **_):
            return [0.0] * len(completions)

        fn.__name__ = name
        return fn

    funcs = [named("exact_answer"), named("exact_answer"), named("exact_answer_2"), named("other")]
    assert reward_names(funcs) == ["exact_answer", "exact_answer_3", "exact_answer_2", "other"]
    exact = BUILTIN_REWARDS["exact_answer"]
    assert reward_names([exact, exact, exact]) == ["exact_answer", "exact_answer_2", "exact_answer_3"]


def _two_rewards(tmp_path: Path) -> list[str]:
    """Two files each defining `reward`: one pays 0.25, the other 0.75."""
    for name, value in (("first", 0.25), ("second", 0.75)):
        (tmp_path / f"{name}.py").write_text(
            f"def reward(prompts, completions, **columns):\n    return [{value}] * len(completions)\n"
        )
    return ["reward_funcs=[{python: first.py:reward}, {python: second.py:reward}]", "reward_weights=[1, 2]"]


def test_two_reward_functions_of_one_name_keep_their_own_metrics(tmp_path, caplog, capsys):
    run = tmp_path / "run"
    args = [f"output_dir={run}", *SMALL, *_two_rewards(tmp_path), "eval_steps=1"]
    with caplog.at_level(logging.WARNING, logger="grpokit"):
        assert main(["train", *args]) == 0, capsys.readouterr().err
    said = [r.getMessage() for r in caplog.records if "share a name" in r.getMessage()]
    assert said == [
        "reward functions share a name: the later ones are reported as 'reward' as 'reward_2' "
        "(rewards/<name>/mean); give each function a name of its own (__name__, or a url entry's name) "
        "to choose them."
    ]
    rows = read_metrics(run)
    step = next(r for r in rows if "rewards/reward/mean" in r)
    assert (step["rewards/reward/mean"], step["rewards/reward_2/mean"]) == (0.25, 0.75)
    evaluated = next(r for r in rows if "eval/rewards/reward/mean" in r)  # evaluation names them alike
    assert (evaluated["eval/rewards/reward/mean"], evaluated["eval/rewards/reward_2/mean"]) == (0.25, 0.75)


def test_the_doctor_names_two_rewards_of_one_name_as_training_does(tmp_path):
    from grpokit.train.doctor import checkup

    cfg = load_config(GRPOConfig, None, [*SMALL, *_two_rewards(tmp_path)])
    rows = {f.item: f.value for f in checkup(cfg, groups=1).findings if f.section == "rewards"}
    assert rows["reward"].startswith("reference answers 0.25") and rows["reward_2"].startswith(
        "reference answers 0.75"
    )


# ----------------------------------------------------------------------------- 8. a reward that edits


@pytest.mark.parametrize(
    "rules", [CallRules(), CallRules(timeout=30.0)], ids=["this thread", "worker thread"]
)
def test_a_reward_that_edits_its_arguments_in_place_changes_nothing_the_next_one_sees(rules):
    prompts = [[{"role": "user", "content": f"q{i}"}] for i in range(4)]
    completions = [[{"role": "assistant", "content": f"a{i}"}] for i in range(4)]
    answers = ["0", "1", "2", "3"]
    snapshot = json.dumps([prompts, completions, answers])
    seen = {}

    def vandal(prompts, completions, answer, **_):
        scores = [1.0] * len(completions)
        prompts[0][0]["content"] = "edited"
        prompts.append([])
        completions[1][0]["content"] = "edited"
        completions.pop()
        answer.clear()
        return scores

    def witness(prompts, completions, answer, **_):
        seen.update(prompts=prompts, completions=completions, answer=answer)
        return [0.5] * len(completions)

    scores = score_completions(
        [vandal, witness], prompts, completions, columns={"answer": answers}, rules=rules
    )
    assert json.dumps([seen["prompts"], seen["completions"], seen["answer"]]) == snapshot
    assert json.dumps([prompts, completions, answers]) == snapshot  # the caller's lists too
    assert scores.rewards.tolist() == [1.5] * 4
