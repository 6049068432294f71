"""A TRL user's script runs with only its import changed (issue 25, point 6), and the TRL-shaped
`GRPOTrainer` behind it: TRL 1.16's parameters in TRL's order, names for reward functions, a peft
LoraConfig, and one line for each TRL parameter grpokit does not take."""

from __future__ import annotations

import ast
import inspect
import sys
import textwrap

import pytest
import torch

from grpokit import GRPOConfig, GRPOTrainer
from grpokit.rewards import exact_answer, format_tags
from tests.helpers import read_steps

# Written as TRL 1.16's README quickstart writes it (a datasets.Dataset with a "prompt" column, a
# reward that prefers 20-character completions); tiny sizes, the model from the test's hub cache.
TRL_SCRIPT = textwrap.dedent(
    """
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    dataset = Dataset.from_dict({"prompt": [f"Write about the number {i}:" for i in range(16)]})


    def reward_len(completions, **kwargs):
        return [-abs(20 - len(completion)) for completion in completions]


    training_args = GRPOConfig(
        output_dir="qwen2-chat-GRPO",
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        num_generations=4,
        max_completion_length=8,
        learning_rate=1e-5,
        max_steps=2,
        logging_steps=1,
        report_to="none",
    )
    trainer = GRPOTrainer(
        model="tiny-org/qwen2-chat",
        reward_funcs=reward_len,
        args=training_args,
        train_dataset=dataset,
    )
    trainer.train()
    """
)
GRPOKIT_SCRIPT = TRL_SCRIPT.replace("from trl import", "from grpokit import")


def test_the_scripts_differ_in_the_import_line_only_and_are_valid_trl():
    """The string is TRL's: every GRPOConfig option is a field of TRL's GRPOConfig and the trainer's
    keywords bind to TRL's GRPOTrainer."""
    import dataclasses

    import trl

    changed = [
        (a, b) for a, b in zip(TRL_SCRIPT.splitlines(), GRPOKIT_SCRIPT.splitlines(), strict=True) if a != b
    ]
    assert changed == [
        ("from trl import GRPOConfig, GRPOTrainer", "from grpokit import GRPOConfig, GRPOTrainer")
    ]
    calls = {
        node.func.id: node
        for node in ast.walk(ast.parse(TRL_SCRIPT))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
    }
    fields = {f.name for f in dataclasses.fields(trl.GRPOConfig)}
    assert {k.arg for k in calls["GRPOConfig"].keywords} <= fields
    inspect.signature(trl.GRPOTrainer.__init__).bind(
        None, **{k.arg: 0 for k in calls["GRPOTrainer"].keywords}
    )


def test_a_trl_script_trains_with_only_its_import_changed(hub_offline, tmp_path, monkeypatch):
    """per_device_train_batch_size=4 × gradient_accumulation_steps=2 = TRL's generation batch of 8
    completions per optimizer step: 2 prompts × num_generations=4 per grpokit step, 4 rows per pass."""
    from grpokit.train import draw as draw_module

    scored = []  # (completions, distinct prompts) of each training step's scoring

    def spy(funcs, prompts, completions, **kwargs):
        scored.append((len(completions), len(set(prompts))))
        return score_completions(funcs, prompts, completions, **kwargs)

    score_completions = draw_module.score_completions
    monkeypatch.setattr(draw_module, "score_completions", spy)
    monkeypatch.chdir(tmp_path)
    script = {"__name__": "__main__"}
    exec(compile(GRPOKIT_SCRIPT, "trl_script.py", "exec"), script)  # noqa: S102
    assert scored == [(8, 2), (8, 2)]  # two steps of TRL's generation batch: 8 completions of 2 prompts
    out = tmp_path / "qwen2-chat-GRPO"
    config = (out / "config.yaml").read_text()
    assert "prompts_per_step: 2\n" in config and "micro_batch_size: 4\n" in config
    assert "model: tiny-org/qwen2-chat\n" in config
    steps = read_steps(out)
    assert [row["step"] for row in steps] == [1, 2]  # max_steps=2, logging_steps=1
    for row in steps:
        assert 1 <= row["completions/max_length"] <= 8, row  # max_completion_length=8
        assert row["rewards/reward_len/mean"] == row["reward"] <= 0  # -|20 - len|: never above 0
        assert row["learning_rate"] <= 1e-5 and row["num_generation_batches"] == 1
    assert (out / "checkpoint-2").is_dir()
    # what TRL's own tests read after train(): trainer.state.log_history, TRL's keys per logged step,
    # the summary last with train_loss the mean of the steps' losses
    history = script["trainer"].state.log_history
    assert [entry["step"] for entry in history] == [1, 2, 2] and script["trainer"].state.global_step == 2
    for entry, row in zip(history, steps, strict=False):
        assert entry["loss"] == row["loss"] and entry["reward"] == row["reward"]
        assert entry["epoch"] == row["step"] * 2 / 16  # 2 prompts a step of 16
    assert history[-1]["train_loss"] == (steps[0]["loss"] + steps[1]["loss"]) / 2
    assert history[-1]["rewards/reward_len/mean"] == steps[1]["rewards/reward_len/mean"]
    assert history[-1]["train_runtime"] > 0 and "loss" not in history[-1]


def test_train_returns_trls_train_output_through_which_grpokits_result_reads(tmp_path, tiny_policy):
    from transformers.trainer_utils import TrainOutput

    model, tok = tiny_policy
    args = tiny_args(tmp_path / "run", max_steps=2)
    trainer = GRPOTrainer(model, exact_answer, args, ROWS, ROWS[:2], processing_class=tok)
    out = trainer.train()
    assert isinstance(out, TrainOutput) and out.global_step == 2 == out[0]
    assert out.training_loss == out.metrics["train_loss"] == trainer.state.log_history[-1]["train_loss"]
    assert (
        out.output_dir == tmp_path / "run" and out.steps == 2 and out.eval_after is trainer.result.eval_after
    )
    assert "accuracy" in out.eval_after
    with pytest.raises(AttributeError):
        getattr(out, "no_such_field")  # noqa: B009 - the lookup is what is tested


def test_run_length_is_trls_when_max_steps_is_unset():
    """TRL counts num_train_epochs (3 by default) over the training prompts when max_steps is unset
    (-1 in TRL); grpokit's GRPOTrainer does the same, and max_steps given wins."""
    from grpokit.train.grpo import steps_of_epochs

    rows = [{"prompt": str(i)} for i in range(17)]
    trainer = GRPOTrainer("tiny", exact_answer, GRPOConfig(prompts_per_step=1), rows)
    assert trainer.config.num_train_epochs == 3
    assert steps_of_epochs(trainer.config, rows, None).max_steps == 51  # 3 passes of 17 prompts
    assert steps_of_epochs(GRPOConfig(num_train_epochs=0.5, prompts_per_step=4), rows, None).max_steps == 3
    assert GRPOTrainer("tiny", exact_answer, GRPOConfig(max_steps=7), rows).config.num_train_epochs is None
    unset = GRPOConfig(max_steps=-1, prompts_per_step=2)  # TRL's "count the epochs"
    assert "max_steps" not in unset.model_fields_set
    assert steps_of_epochs(unset.model_copy(update={"num_train_epochs": 1.0}), rows, None).max_steps == 9
    given = GRPOConfig(max_steps=5, num_train_epochs=2.0)
    assert steps_of_epochs(given, rows, None).max_steps == 5


# ----------------------------------------------------------------------------- the signature


def test_the_parameters_are_trls_in_trls_order():
    import trl

    theirs = list(inspect.signature(trl.GRPOTrainer.__init__).parameters)
    ours = inspect.signature(GRPOTrainer.__init__).parameters
    positional = [n for n, p in ours.items() if p.kind is p.POSITIONAL_OR_KEYWORD]
    assert positional == theirs[: theirs.index("peft_config") + 1]
    keyword_only = {n for n, p in ours.items() if p.kind is p.KEYWORD_ONLY}
    assert keyword_only == {"tools", "rollout_func", "environment_factory", "is_correct"}
    assert set(theirs) <= set(ours)  # every TRL parameter is taken or answered
    for name in ("reward_funcs", "args", "train_dataset", "processing_class", "callbacks", "optimizers"):
        assert ours[name].default == inspect.signature(trl.GRPOTrainer.__init__).parameters[name].default


ROWS = [{"prompt": f"{i}+{i}=", "answer": str(2 * i)} for i in range(8)]


def tiny_args(output_dir, **options) -> GRPOConfig:
    """A short run of the tiny policy: 2 prompts × 2 completions of at most 4 tokens a step."""
    short = dict(prompts_per_step=2, num_generations=2, max_completion_length=4, progress=False)
    return GRPOConfig(output_dir=str(output_dir), **(short | dict(eval_steps=0, save_steps=0) | options))


def test_args_positionally_and_none_as_in_trl():
    trainer = GRPOTrainer("tiny", [exact_answer], GRPOConfig(max_steps=3, num_generations=2), ROWS)
    assert trainer.config.max_steps == 3 and trainer.config.task is None and len(trainer.train_rows) == 8
    trainer = GRPOTrainer("tiny", exact_answer, None, ROWS)  # TRL: args=None is the defaults
    assert trainer.config.learning_rate == GRPOConfig().learning_rate and trainer.reward_funcs == [
        exact_answer
    ]


@pytest.mark.parametrize(
    ("given", "line"),
    [
        (
            {"callbacks": [object()]},
            "does not take callbacks (TRL's); follow the run with trainer.train(on_event",
        ),
        ({"optimizers": (object(), None)}, "does not take optimizers (TRL's); grpokit builds AdamW"),
        ({"quantization_config": object()}, "does not take quantization_config"),
    ],
)
def test_trl_parameters_grpokit_does_not_take_are_one_line_each(given, line):
    with pytest.raises(ValueError) as error:
        GRPOTrainer("tiny", exact_answer, None, ROWS, **given)
    assert line in str(error.value) and "\n" not in str(error.value)
    GRPOTrainer("tiny", exact_answer, None, ROWS, callbacks=[], optimizers=(None, None))  # TRL's defaults


def test_a_model_name_with_a_processing_class_is_loaded_here_and_used_with_it(tmp_path, tiny_policy):
    from grpokit.models import save_policy

    model, tok = tiny_policy
    save_policy(model, tok, tmp_path / "policy")
    trainer = GRPOTrainer(str(tmp_path / "policy"), exact_answer, None, ROWS, processing_class=tok)
    assert trainer.processing_class is tok and isinstance(trainer.model, type(model))
    assert trainer.config.model == str(tmp_path / "policy")
    assert trainer.args is trainer.config  # (TRL's name for it)
    with pytest.raises(
        ValueError, match=r"needs its tokenizer, and it does not say where it was loaded from: GRPOTrainer"
    ):
        GRPOTrainer(model, exact_answer, None, ROWS)  # built in memory: nowhere to load a tokenizer from


def test_a_model_name_alone_is_loaded_here_with_its_tokenizer_as_trl_does(tmp_path, tiny_policy):
    """TRL loads a named model in __init__ (trainer.model is the module) and, with no processing_class,
    the tokenizer it was saved with; a model loaded from a directory gets that directory's tokenizer."""
    from transformers import AutoModelForCausalLM

    from grpokit.models import save_policy

    model, tok = tiny_policy
    save_policy(model, tok, tmp_path / "policy")
    trainer = GRPOTrainer(str(tmp_path / "policy"), exact_answer, None, ROWS)
    assert isinstance(trainer.model, type(model))
    theirs, ours = trainer.model.state_dict(), model.state_dict()
    assert theirs.keys() == ours.keys() and all(torch.equal(theirs[k], ours[k]) for k in ours)
    assert trainer.processing_class.get_vocab() == tok.get_vocab()
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "policy")
    trainer = GRPOTrainer(loaded, exact_answer, None, ROWS)
    assert trainer.model is loaded and trainer.processing_class.get_vocab() == tok.get_vocab()


# ----------------------------------------------------------------------------- peft_config


def test_a_peft_lora_config_sets_grpokits_lora_options():
    peft = pytest.importorskip("peft")
    lora = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1, target_modules=["v_proj", "q_proj"])
    cfg = GRPOTrainer("tiny", exact_answer, None, ROWS, peft_config=lora).config
    assert (cfg.use_peft, cfg.lora_r, cfg.lora_alpha, cfg.lora_dropout) == (True, 4, 8, 0.1)
    assert cfg.lora_target_modules == ["q_proj", "v_proj"]
    everything = peft.LoraConfig(target_modules="all-linear", task_type="CAUSAL_LM")
    assert (
        GRPOTrainer("tiny", exact_answer, None, ROWS, peft_config=everything).config.lora_target_modules
        is None
    )
    # peft's own choice for the model type when target_modules is None: q_proj, v_proj for a Llama
    chosen = GRPOTrainer("tiny", exact_answer, None, ROWS, peft_config=peft.LoraConfig()).config
    assert chosen.lora_target_modules == ["q_proj", "v_proj"] and chosen.lora_r == 8  # peft's r
    with pytest.raises(ValueError, match="peft_config sets use_dora, which grpokit's LoRA does not have"):
        GRPOTrainer("tiny", exact_answer, None, ROWS, peft_config=peft.LoraConfig(use_dora=True))
    with pytest.raises(ValueError, match="is a regular expression; name the modules as a list"):
        GRPOTrainer("tiny", exact_answer, None, ROWS, peft_config=peft.LoraConfig(target_modules=".*proj"))
    with pytest.raises(ValueError, match="grpokit trains LoRA adapters only"):
        GRPOTrainer("tiny", exact_answer, None, ROWS, peft_config=peft.IA3Config())


# ----------------------------------------------------------------------------- reward functions by name


def test_reward_functions_by_builtin_name_and_by_reference(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        "def ones(completions, **kw):\n    return [1.0] * len(completions)\n"
    )
    (tmp_path / "trl_pkg").mkdir()
    (tmp_path / "trl_pkg" / "__init__.py").write_text("")
    (tmp_path / "trl_pkg" / "mod.py").write_text(
        "def twos(completions, **kw):\n    return [2.0] * len(completions)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    names = ["exact_answer", "format_tags", "my_rewards.py:ones", "trl_pkg.mod.twos", "trl_pkg.mod:twos"]
    funcs = GRPOTrainer("tiny", names, None, ROWS).reward_funcs
    assert funcs[:2] == [exact_answer, format_tags]
    assert [f.__name__ for f in funcs[2:]] == ["ones", "twos", "twos"]
    assert funcs[3] is sys.modules["trl_pkg.mod"].twos
    assert GRPOTrainer("tiny", "exact_answer", None, ROWS).reward_funcs == [exact_answer]  # one, as TRL takes
    with pytest.raises(ValueError) as error:
        GRPOTrainer("tiny", ["exact_answr"], None, ROWS)
    assert "reward function 'exact_answr' is not a built-in reward (exact_answer, math_answer" in str(
        error.value
    )
    with pytest.raises(ValueError, match="trl_pkg.mod has no function 'threes'"):
        GRPOTrainer("tiny", ["trl_pkg.mod.threes"], None, ROWS)


def test_peft_defaults_for_a_hub_id_come_from_its_config_through_the_cache(hub_offline):
    """peft_config without target_modules on a hub id: peft's default for the model type read from
    the cached config (Qwen2: q_proj, v_proj); an id the cache lacks is the loader's one line."""
    peft = pytest.importorskip("peft")
    from tests.hub_cache import QWEN

    chosen = GRPOTrainer(QWEN, exact_answer, None, ROWS, peft_config=peft.LoraConfig()).config
    assert chosen.lora_target_modules == ["q_proj", "v_proj"]
    with pytest.raises(
        ValueError, match=r"'org/absent' is not in the Hugging Face cache .*hf download org/absent"
    ):
        GRPOTrainer("org/absent", exact_answer, None, ROWS, peft_config=peft.LoraConfig())


# ----------------------------------------------------------------------------- TRL's asynchronous trainer

# Written as TRL 1.16's experimental AsyncGRPOTrainer wants it: the reward a module-level function of
# an importable module (TRL scores in a spawned process, and so does grpokit's rollout worker).
TRL_ASYNC_SCRIPT = textwrap.dedent(
    """
    from datasets import Dataset
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer

    from my_rewards import reward_len

    dataset = Dataset.from_dict({"prompt": [f"Write about the number {i}:" for i in range(16)]})

    training_args = AsyncGRPOConfig(
        output_dir="qwen2-chat-AsyncGRPO",
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        num_generations=4,
        max_completion_length=8,
        learning_rate=1e-5,
        max_steps=3,
        logging_steps=1,
        report_to="none",
        max_staleness=1,
        vllm_server_base_url="http://localhost:8000",
    )
    trainer = AsyncGRPOTrainer(
        model="tiny-org/qwen2-chat",
        reward_funcs=reward_len,
        args=training_args,
        train_dataset=dataset,
    )
    trainer.train()
    """
)
GRPOKIT_ASYNC_SCRIPT = TRL_ASYNC_SCRIPT.replace(
    "from trl.experimental.async_grpo import", "from grpokit import"
)
REWARDS_MODULE = (
    "def reward_len(completions, **kwargs):\n    return [-abs(20 - len(c)) for c in completions]\n"
)


def _trl_async(monkeypatch):
    """TRL's experimental AsyncGRPOConfig and AsyncGRPOTrainer (its import warning silenced, as TRL says)."""
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer

    return AsyncGRPOConfig, AsyncGRPOTrainer


def test_the_async_scripts_differ_in_the_import_line_only_and_are_valid_trl(monkeypatch):
    import dataclasses

    TRLConfig, TRLTrainer = _trl_async(monkeypatch)

    changed = [
        (a, b)
        for a, b in zip(TRL_ASYNC_SCRIPT.splitlines(), GRPOKIT_ASYNC_SCRIPT.splitlines(), strict=True)
        if a != b
    ]
    assert len(changed) == 1 and changed[0][1] == "from grpokit import AsyncGRPOConfig, AsyncGRPOTrainer"
    calls = {
        node.func.id: node
        for node in ast.walk(ast.parse(TRL_ASYNC_SCRIPT))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
    }
    assert {k.arg for k in calls["AsyncGRPOConfig"].keywords} <= {
        f.name for f in dataclasses.fields(TRLConfig)
    }
    inspect.signature(TRLTrainer.__init__).bind(
        None, **{k.arg: 0 for k in calls["AsyncGRPOTrainer"].keywords}
    )


@pytest.mark.slow  # a rollout worker process
@pytest.mark.loopback  # the script's vLLM server: grpokit serve-policy's, on 127.0.0.1
def test_a_trl_async_script_trains_with_only_its_import_changed(hub_offline, tmp_path, monkeypatch, caplog):
    """Asynchronous: every batch exactly max_staleness=1 weight versions old after the first (step 1
    samples with version 0, step s ≥ 2 with version s − 2); the script's vLLM server URL names a
    `grpokit serve-policy` server (started here, where the script's vLLM server would be), which
    samples every batch and is sent each version; TRL's batch names as in the synchronous script."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpokit.config.specs import EngineSpec
    from grpokit.engine import PolicyEngine
    from grpokit.serve.policy import PolicyServer
    from tests.hub_cache import QWEN, snapshot

    (tmp_path / "my_rewards.py").write_text(REWARDS_MODULE)
    monkeypatch.delitem(sys.modules, "my_rewards", raising=False)  # the script's import goes at the end
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    where = snapshot(hub_offline, QWEN)
    model, tokenizer = AutoModelForCausalLM.from_pretrained(where), AutoTokenizer.from_pretrained(where)
    engine = PolicyEngine.create(model, tokenizer, EngineSpec(), device=torch.device("cpu"))
    with PolicyServer(engine, QWEN, log=lambda _: None) as server:
        script = GRPOKIT_ASYNC_SCRIPT.replace("http://localhost:8000", server.url.rstrip("/"))
        exec(compile(script, "trl_async_script.py", "exec"), {"__name__": "__main__"})  # noqa: S102
        assert server.version == 1 and server.decodes == 3  # the last batch's version; 3 batches
    out = tmp_path / "qwen2-chat-AsyncGRPO"
    config = (out / "config.yaml").read_text()
    assert "max_staleness: 1\n" in config and "prompts_per_step: 2\n" in config
    steps = read_steps(out)
    assert [row["async/weight_version"] for row in steps] == [0.0, 0.0, 1.0]
    assert [row["async/staleness"] for row in steps] == [0.0, 1.0, 1.0]
    for row in steps:
        assert row["rewards/reward_len/mean"] == row["reward"] <= 0
    said = [r.getMessage() for r in caplog.records if "vllm_server_base_url" in r.getMessage()]
    assert len(said) == 1 and "is taken as rollout_server_urls=['http://127.0.0.1:" in said[0]


def test_the_async_parameters_are_trls_in_trls_order(monkeypatch):
    from grpokit import AsyncGRPOTrainer

    _, TRLTrainer = _trl_async(monkeypatch)

    theirs = list(inspect.signature(TRLTrainer.__init__).parameters)
    assert list(inspect.signature(AsyncGRPOTrainer.__init__).parameters) == theirs


@pytest.mark.parametrize("name", ["rollout_worker", "weight_transfer"])
def test_trls_async_transports_are_refused_in_one_line(name):
    from grpokit import AsyncGRPOTrainer

    with pytest.raises(ValueError, match=rf"^grpokit's AsyncGRPOTrainer does not take {name} \(TRL's\); "):
        AsyncGRPOTrainer("tiny", exact_answer, None, ROWS, **{name: object()})


def test_an_async_trainer_is_asynchronous_whatever_its_args():
    from grpokit import AsyncGRPOConfig, AsyncGRPOTrainer

    assert AsyncGRPOTrainer("tiny", exact_answer, None, ROWS).config.max_staleness == 1
    assert AsyncGRPOTrainer("tiny", exact_answer, GRPOConfig(), ROWS).config.max_staleness == 1
    assert AsyncGRPOTrainer("tiny", exact_answer, {"max_staleness": 3}, ROWS).config.max_staleness == 3
    assert AsyncGRPOConfig(max_staleness=0).max_staleness == 0
    assert AsyncGRPOConfig(max_staleness=None).max_staleness is None  # (the synchronous loop, if asked)


# ----------------------------------------------------------------------------- TRL's mask methods


def test_get_high_entropy_mask_is_torch_quantile_of_the_valid_tokens():
    """TRL's method: keep a valid token when its entropy is ≥ torch.quantile(valid entropies, threshold),
    checked against that definition on random entropies and ragged masks, as a bool mask."""
    g = torch.Generator().manual_seed(3)
    trainer = GRPOTrainer.__new__(GRPOTrainer)  # (the method reads nothing of the trainer)
    for threshold in (0.0, 0.2, 0.5, 0.8, 1.0):
        entropies = torch.rand(4, 7, generator=g)
        mask = torch.arange(7)[None] < torch.tensor([7, 3, 5, 1])[:, None]
        cut = torch.quantile(entropies[mask], threshold)
        expected = (entropies >= cut) & mask
        got = trainer.get_high_entropy_mask(entropies, mask.long(), threshold)
        assert got.dtype == torch.bool and got.equal(expected), threshold


def test_get_off_policy_mask_is_trls_rule_row_by_row():
    g = torch.Generator().manual_seed(4)
    logps, q = -torch.rand(6, 5, generator=g) * 3, -torch.rand(6, 5, generator=g) * 3
    mask = (torch.arange(5)[None] < torch.tensor([5, 4, 3, 2, 1, 5])[:, None]).float()
    advantages = torch.tensor([1.0, -1.0, -0.5, 0.0, -2.0, -1.0])[:, None]
    got = GRPOTrainer.get_off_policy_mask(advantages, logps, q, mask, 0.3)
    for i in range(6):
        n = int(mask[i].sum())
        drift = float((q[i, :n] - logps[i, :n]).mean())
        assert got[i, 0].item() == float(advantages[i, 0] >= 0 or drift <= 0.3), i
    assert got.shape == (6, 1) and got.dtype == torch.float32


def test_off_policy_mask_threshold_reaches_the_loss_with_the_samplers_log_probs(
    tmp_path, tiny_policy, monkeypatch
):
    from grpokit.train import update

    seen = []
    loss = update.grpo_loss

    def spy(*args, **kwargs):
        seen.append((kwargs["off_policy_mask_threshold"], kwargs["off_policy_logps"]))
        return loss(*args, **kwargs)

    monkeypatch.setattr(update, "grpo_loss", spy)
    model, tok = tiny_policy
    args = tiny_args(tmp_path / "run", max_steps=1, off_policy_mask_threshold=0.5)
    GRPOTrainer(model, exact_answer, args, ROWS, ROWS[:2], processing_class=tok).train()
    assert seen and all(t == 0.5 and q is not None and q.shape[0] == 4 for t, q in seen)  # B = 2 × 2 rows


def test_reward_functions_see_the_step_and_log_metrics_into_trls_history(tmp_path, tiny_policy):
    """TRL's trainer_state and log_metric reach a user's reward function in a run: global_step counts
    the steps done before the batch, and a logged value is the step's metric logged/<name> in
    metrics.jsonl and <name> in trainer.state.log_history, as TRL logs it."""
    steps_seen = []

    def reward(prompts, completions, trainer_state, log_metric, **_):
        steps_seen.append(trainer_state.global_step)
        log_metric("mean_length", sum(map(len, completions)) / len(completions))
        return [float(len(c)) for c in completions]

    model, tok = tiny_policy
    args = tiny_args(tmp_path / "run", max_steps=2)
    trainer = GRPOTrainer(model, reward, args, ROWS, ROWS[:2], processing_class=tok)
    trainer.train()
    assert steps_seen == [None, 0, 1, None]  # evaluations (no step) around steps 1 and 2
    rows = read_steps(tmp_path / "run")
    history = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert [h["mean_length"] for h in history] == [r["logged/mean_length"] for r in rows]
    assert all(0 < r["logged/mean_length"] <= 4 * 4 for r in rows)  # characters of ≤ 4 tokens


def test_trls_entropy_options_train_as_trls(tmp_path, tiny_policy):
    """entropy_coef: each step's loss is policy_loss − c·(mean token entropy) (one micro-batch: exactly,
    to float32 round-off); use_adaptive_entropy with a target above any entropy: the coefficient rises by
    entropy_coef_delta every step, and trainer.entropy_coef is where it ended, as TRL's."""
    model, tok = tiny_policy
    fixed = GRPOTrainer(
        model, exact_answer, tiny_args(tmp_path / "fixed", max_steps=3, entropy_coef=0.5), ROWS, ROWS[:2],
        processing_class=tok,
    )  # fmt: skip
    fixed.train()
    steps = [entry for entry in fixed.state.log_history if "loss" in entry]
    assert len(steps) == 3
    for entry in steps:
        assert entry["policy_loss"] - entry["loss"] == pytest.approx(0.5 * entry["entropy"], abs=1e-5)
        assert entry["entropy_coef"] == 0.5
    adaptive = tiny_args(
        tmp_path / "adaptive", max_steps=3, entropy_coef=0.01, use_adaptive_entropy=True, entropy_target=15.0
    )
    trainer = GRPOTrainer(model, exact_answer, adaptive, ROWS, ROWS[:2], processing_class=tok)
    trainer.train()
    assert trainer.entropy_coef == pytest.approx(0.01 + 0.005 * 3, abs=1e-12)
    applied = [entry["entropy/coef"] for entry in trainer.state.log_history if "loss" in entry]
    assert applied == pytest.approx([0.0, 0.015, 0.02])  # none before an entropy is measured


def test_evaluate_reports_trls_keys_for_one_dataset_and_for_named_ones(tmp_path, tiny_policy):
    """trainer.evaluate(): the held-out metrics of the model as it is, under eval_<key> (eval_<name>_<key>
    for a dict of named datasets, TRL's), the same numbers as a run's own evaluation of those rows."""
    model, tok = tiny_policy
    named = {"small": ROWS[:2], "more": ROWS[2:6]}
    trainer = GRPOTrainer(
        model, exact_answer, tiny_args(tmp_path / "run", max_steps=1), ROWS, named, processing_class=tok
    )
    assert trainer.eval_dataset is named and trainer.eval_rows == ROWS[:6]  # a run evaluates all six
    metrics = trainer.evaluate()
    assert metrics["eval_small_num_prompts"] == 2 and metrics["eval_more_num_prompts"] == 4
    one = trainer.evaluate(ROWS[:2])
    assert one["eval_num_prompts"] == 2 and one["eval_reward"] == metrics["eval_small_reward"]
    assert one["eval_accuracy"] == metrics["eval_small_accuracy"] and one["eval_runtime"] > 0
    assert trainer.state.log_history[-1]["eval_num_prompts"] == 2
    result = trainer.train()  # the run's starting evaluation of the same six rows, the same model
    assert result.eval_before["num_prompts"] == 6
    both = (2 * metrics["eval_small_accuracy"] + 4 * metrics["eval_more_accuracy"]) / 6
    assert result.eval_before["accuracy"] == pytest.approx(both, abs=1e-12)
    with pytest.raises(ValueError, match="needs a model: model='tiny' is built by train"):
        GRPOTrainer("tiny", exact_answer, None, ROWS).evaluate(ROWS)


def test_a_peft_config_wraps_the_model_in_init_and_trains_only_its_adapters(hub_offline, tmp_path):
    """As TRL's: with peft_config, trainer.model is the PeftModel from __init__ on; a run trains the
    adapters of that very module (each changes) and leaves the base weights as they were."""
    peft = pytest.importorskip("peft")
    from tests.hub_cache import QWEN

    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    args = tiny_args(tmp_path / "run", max_steps=2, learning_rate=0.1)
    trainer = GRPOTrainer(
        QWEN,
        lambda completions, **_: [float(len(c)) for c in completions],
        args,
        ROWS,
        ROWS[:2],
        peft_config=lora,
    )
    assert isinstance(trainer.model, peft.PeftModel)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    after = dict(trainer.model.named_parameters())
    adapters = [n for n in before if "lora_" in n]
    assert adapters and all(not torch.equal(before[n], after[n]) for n in adapters)
    assert all(torch.equal(before[n], after[n]) for n in before if "lora_" not in n)


def test_evaluates_eval_loss_is_the_steps_loss_on_held_out_groups(tmp_path, tiny_policy, monkeypatch):
    """TRL's eval_loss: G completions of each held-out prompt, their group advantages, and the step's
    loss on the policy as it is (on-policy: ratio 1). dapo's is −Σ A·L / Σ L over the completions of
    lengths L, written out here from the batch the evaluation scored."""
    from grpokit.train import eval_run

    scored = []

    def spy(*args, **kwargs):
        out = score_rollout(*args, **kwargs)
        scored.append(out[0])
        return out

    score_rollout = eval_run.score_rollout
    monkeypatch.setattr(eval_run, "score_rollout", spy)
    model, tok = tiny_policy

    def reward(completions, **_):
        return [float(len(c)) for c in completions]

    args = tiny_args(
        tmp_path / "run", max_steps=1, loss_type="dapo", num_generations=4, max_completion_length=6
    )
    metrics = GRPOTrainer(model, reward, args, ROWS, ROWS[:3], processing_class=tok).evaluate()
    (batch,) = scored
    lengths = batch.completion_mask.sum(-1).double()
    expected = -(batch.advantages.double() * lengths).sum() / lengths.sum()
    assert batch.advantages.shape == (12,) and batch.advantages.abs().sum() > 0  # 3 prompts × 4
    assert metrics["eval_loss"] == pytest.approx(expected.item(), abs=1e-6)


def test_save_model_writes_what_from_pretrained_loads_and_push_to_hub_is_answered(tmp_path, hub_offline):
    """TRL's closing lines, `trainer.save_model(output_dir)` and `trainer.push_to_hub()`: the trained
    model and its tokenizer as from_pretrained loads them (a PeftModel: its adapters, as TRL saves
    them); push_to_hub without push_to_hub=true is one line saying how."""
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.hub_cache import QWEN

    trainer = GRPOTrainer(
        QWEN, exact_answer, tiny_args(tmp_path / "run", max_steps=1, learning_rate=0.1), ROWS, ROWS[:2]
    )
    trainer.train()
    trainer.save_model(str(tmp_path / "saved"))
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "saved")
    trained = trainer.model.state_dict()
    assert all(torch.equal(tensor, trained[name]) for name, tensor in loaded.state_dict().items())
    assert (
        AutoTokenizer.from_pretrained(tmp_path / "saved").get_vocab() == trainer.processing_class.get_vocab()
    )
    adapters = GRPOTrainer(
        QWEN, exact_answer, tiny_args(tmp_path / "lora"), ROWS, peft_config=peft.LoraConfig(r=2)
    )
    adapters.save_model(str(tmp_path / "adapters"))
    assert (tmp_path / "adapters" / "adapter_model.safetensors").is_file()
    with pytest.raises(ValueError, match="set push_to_hub=true and hub_model_id=ORG/NAME"):
        trainer.push_to_hub()
    with pytest.raises(ValueError, match="model='tiny' is built inside the run"):
        GRPOTrainer("tiny", exact_answer, None, ROWS).save_model()
