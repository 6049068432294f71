"""`grpokit doctor` (issue 26, point 2): the pre-flight finds what would make a run fail or learn
nothing, before it runs. Each finding is provoked on purpose (a constant reward, a reward that scores
nothing, a slow reward, completions cut short, a model that is not in the cache, a GPU too small) and
the same checks stay quiet on a healthy config. The forecast against the main job's first steps and
the presets' time are in tests/test_main_job.py (slow)."""

from __future__ import annotations

import re
import time
from dataclasses import replace

import pytest

from grpokit.cli import main
from grpokit.models import parse_bytes
from grpokit.train.doctor import checkup
from grpokit.train.grpo import train_grpo
from tests.train.helpers import ones_reward, tiny_config


def _levels(report, section):
    return {f.item: (f.level, f.value, f.advice) for f in report.findings if f.section == section}


def _config(tmp_path, *funcs, **overrides):
    """A tiny run's config with reward functions named by reference, as a user's config names them."""
    base = dict(sft_steps=0, prompts_per_step=8, max_completion_length=6)
    names = [f"tests.test_doctor.{f.__name__}" for f in funcs]
    return tiny_config(tmp_path, reward_funcs=names, **(base | overrides))


def constant_reward(prompts, completions, **_):
    return [0.5] * len(completions)


def nothing_reward(prompts, completions, **_):
    return [None] * len(completions)


def slow_reward(prompts, completions, **_):
    time.sleep(0.2)  # a call: 1.6 s for a step's 128 completions in batches of 16
    return [float(len(c)) for c in completions]


def test_a_healthy_config_has_no_warning_and_every_section(tmp_path):
    report = checkup(
        _config(tmp_path, ones_reward_ref, max_completion_length=48)
    )  # a random policy ends by then
    sections = {f.section for f in report.findings}
    assert sections == {"config", "data", "rewards", "sampling", "time", "memory"}
    assert not report.fatal and [f for f in report.findings if f.level != "ok"] == []
    assert 0.0 <= report.zero_spread <= 0.5 and report.mean_length > 0 and report.step_seconds > 0
    assert report.memory_bytes > 0
    # tiny_config leaves lr_scheduler_type unset: the value chosen for a tiny model is said
    assert _levels(report, "config")["chosen for model=tiny"][1] == "lr_scheduler_type=constant"
    data = _levels(report, "data")
    assert "prompt tokens" in data and data["rows"][1].startswith("9996 training, 4 held out")


def ones_reward_ref(prompts, completions, **kwargs):
    return ones_reward(prompts, completions, **kwargs)


def test_a_constant_reward_is_flagged_and_its_groups_forecast_as_zero_spread(tmp_path):
    report = checkup(_config(tmp_path, constant_reward))
    rewards = _levels(report, "rewards")
    assert rewards["constant_reward"][0] == "warn" and "same score" in rewards["constant_reward"][2]
    assert report.zero_spread == 1.0
    sampling = _levels(report, "sampling")
    assert sampling["zero-spread groups"][0] == "warn" and "cannot learn" in sampling["zero-spread groups"][2]


def test_a_reward_that_scores_nothing_is_fatal(tmp_path, capsys):
    report = checkup(_config(tmp_path, nothing_reward))
    assert report.fatal and _levels(report, "rewards")["nothing_reward"][0] == "fatal"


def test_a_slow_reward_and_cut_completions_are_flagged(tmp_path):
    report = checkup(_config(tmp_path, slow_reward, max_completion_length=2, prompts_per_step=32))
    latency = _levels(report, "rewards")["slow_reward latency"]
    assert latency[0] == "warn" and "slow" in latency[2]
    cut = _levels(report, "sampling")["cut at max_completion_length=2"]
    assert cut[0] == "warn" and report.truncated > 0.2
    # what asynchronous GRPO would change: the slow reward is most of the step, and overlapped with the
    # update a step takes the longer of the two (their figures as the line states them)
    line = _levels(report, "time")["asynchronous"][1]
    found = re.fullmatch(
        r"sampling and scoring are (\d+)% of the step \(~([\d.]+) s of ~([\d.]+) s\): with max_staleness=1 "
        r"a step would take about ([\d.]+) s if each kept its speed \(on a CPU .*\)",
        line,
    )
    assert found, line
    share, drawing, whole, overlapped = (float(x) for x in found.groups())
    assert share > 50 and overlapped == pytest.approx(max(drawing, whole - drawing), abs=0.011)


def test_with_max_staleness_the_forecast_is_the_longer_phase():
    from grpokit.config import GRPOConfig
    from grpokit.config.plan import grpo_plan
    from grpokit.train.doctor import Checkup, _async_finding

    report = Checkup()
    _async_finding(report, grpo_plan(GRPOConfig(max_staleness=2)), 0.75, 0.5, "cuda")
    assert _levels(report, "time")["asynchronous"][1] == (
        "max_staleness=2: sampling and scoring (~0.75 s) overlap the update (~0.50 s): about 0.75 s a step"
    )
    # three workers sample three batches at once (each on hardware of its own): the update is the longer
    report = Checkup()
    _async_finding(report, grpo_plan(GRPOConfig(max_staleness=2, rollout_workers=3)), 0.75, 0.5, "cuda")
    assert _levels(report, "time")["asynchronous"][1] == (
        "max_staleness=2: sampling and scoring (~0.75 s by 3 workers at once) overlap the update "
        "(~0.50 s): about 0.50 s a step"
    )
    # at most k + 1 at once; k = 0 overlaps nothing (each batch needs the update before it)
    report = Checkup()
    _async_finding(report, grpo_plan(GRPOConfig(max_staleness=1, rollout_workers=4)), 1.5, 0.5, "cuda")
    assert "~1.50 s by 2 workers at once" in _levels(report, "time")["asynchronous"][1]
    assert "about 0.75 s a step" in _levels(report, "time")["asynchronous"][1]
    report = Checkup()
    _async_finding(report, grpo_plan(GRPOConfig(max_staleness=0)), 0.75, 0.5, "cuda")
    assert "about 1.25 s a step" in _levels(report, "time")["asynchronous"][1]


def test_a_gpu_too_small_gets_the_micro_batch_that_fits_or_none(tmp_path):
    cfg = _config(tmp_path, ones_reward_ref)
    small = checkup(cfg, gpu_memory=parse_bytes("1KiB"))
    named = [f for f in small.findings if f.section == "memory" and f.item.startswith("peak on a GPU")]
    assert len(named) == 1 and named[0].level == "warn" and "does not fit" in named[0].advice
    roomy = checkup(cfg, gpu_memory=parse_bytes("80GiB"))
    named = [f for f in roomy.findings if f.section == "memory" and f.item.startswith("peak on a GPU")]
    assert named[0].level == "ok" and "80.00 GiB" in named[0].value


def test_the_command_prints_a_table_and_exits_non_zero_on_a_fatal_finding(
    tmp_path, monkeypatch, capsys, empty_hub_offline
):
    monkeypatch.setenv("COLUMNS", "250")  # the table's rows on one line each
    code = main(["doctor", f"output_dir={tmp_path}/run", "model=someone/not-in-the-cache", "sft_steps=0"])
    out = capsys.readouterr().out
    assert code == 1 and "FATAL" in out and "someone/not-in-the-cache" in out
    assert "Traceback" not in out
    code = main(["doctor", f"output_dir={tmp_path}/run", "sft_steps=0", "--groups", "4"])
    out = capsys.readouterr().out
    assert code == 0 and "zero-spread groups" in out and "no fatal finding" in out
    assert "chosen for model=tiny" not in out  # the preset sets them: nothing was chosen
    assert not (tmp_path / "run").exists()  # the doctor writes nothing to output_dir


def test_parse_bytes_names_the_forms_it_takes():
    assert parse_bytes("80GiB") == 80 * 2**30
    with pytest.raises(ValueError, match="GiB"):
        parse_bytes("eighty")


def test_a_learning_rate_that_would_undo_a_pretrained_model_is_flagged(tmp_path, empty_hub_offline):
    cfg = tiny_config(tmp_path, model="someone/pretrained", learning_rate=1e-3, sft_steps=0)
    report = checkup(cfg)
    config = _levels(report, "config")
    assert config["learning_rate"][0] == "warn" and "1e-6 to 1e-5" in config["learning_rate"][2]
    assert report.fatal  # and the model is not in the (empty) cache
    lora = checkup(tiny_config(tmp_path, model="someone/pretrained", learning_rate=1e-3, use_peft=True))
    assert "learning_rate" not in _levels(lora, "config")


def test_a_learning_rate_too_low_for_the_random_tiny_model_is_flagged(tmp_path):
    """TRL's 1e-6 set on model=tiny (random weights) learns nothing: a warning naming the rate to set;
    left unset, the chosen 1e-4 gets none."""
    slow = _levels(checkup(tiny_config(tmp_path, learning_rate=1e-6, sft_steps=0)), "config")
    assert slow["learning_rate"][0] == "warn" and "set 1e-4" in slow["learning_rate"][2]
    assert "learning_rate" not in _levels(checkup(tiny_config(tmp_path, sft_steps=0)), "config")


def test_a_distillation_teacher_is_counted_in_memory_and_a_missing_one_is_fatal(tmp_path, empty_hub_offline):
    """loss_type=gkd: the teacher's shape comes from its config alone; its weights and its held hidden
    states join the forecast parts and the peak. A teacher the cache does not hold is a fatal finding
    that names it."""
    teacher = train_grpo(tiny_config(tmp_path, output_dir=str(tmp_path / "teacher"), max_steps=1))
    teacher_dir = teacher.output_dir / "checkpoint-1"
    alone = checkup(_config(tmp_path, ones_reward_ref))
    gkd = checkup(_config(tmp_path, ones_reward_ref, loss_type="gkd", teacher_model=str(teacher_dir)))
    parts = _levels(gkd, "memory")["forecast parts"][1]
    assert "teacher " in parts and "teacher_states " in parts and not gkd.fatal
    assert gkd.memory_bytes > alone.memory_bytes
    missing = checkup(_config(tmp_path, ones_reward_ref, loss_type="opd", teacher_model="someone/teacher"))
    level, value, advice = _levels(missing, "config")["teacher_model"]
    assert missing.fatal and level == "fatal" and value == "someone/teacher" and "someone/teacher" in advice


def test_a_teacher_train_would_refuse_is_fatal_before_any_loading_of_its_weights(tmp_path):
    """What `train` refuses on loading the teacher, the doctor finds from its tokenizer and config:
    another tokenizer (a countdown policy's characters) for opd, another output-layer size for gkd."""
    other = train_grpo(
        tiny_config(tmp_path, output_dir=str(tmp_path / "other"), max_steps=1, task="countdown")
    )
    report = checkup(
        _config(
            tmp_path, ones_reward_ref, loss_type="opd", teacher_model=str(other.output_dir / "checkpoint-1")
        )
    )
    level, _, advice = _levels(report, "config")["teacher_model"]
    assert report.fatal and level == "fatal" and "another tokenizer than the policy" in advice
    from transformers import AutoModelForCausalLM, AutoTokenizer

    same = (
        train_grpo(tiny_config(tmp_path, output_dir=str(tmp_path / "same"), max_steps=1)).output_dir
        / "checkpoint-1"
    )
    padded = AutoModelForCausalLM.from_pretrained(same)
    padded.resize_token_embeddings(padded.get_output_embeddings().weight.shape[0] + 8)
    padded.save_pretrained(tmp_path / "padded")
    AutoTokenizer.from_pretrained(same).save_pretrained(tmp_path / "padded")
    for loss_type, fatal in (("gkd", True), ("opd", False)):
        report = checkup(
            _config(tmp_path, ones_reward_ref, loss_type=loss_type, teacher_model=str(tmp_path / "padded"))
        )
        assert report.fatal is fatal, loss_type
        if fatal:
            assert "output layer scores" in _levels(report, "config")["teacher_model"][2]


def test_memory_advice_offers_gradient_checkpointing_when_it_fits():
    """At Qwen2.5-0.5B's shape on gpu_vs_trl's work (8 × 8 × 256, micro-batches of 16, bf16 on float32
    weights, a reference, the CUDA-graph decode), the forecast peak is 16.6 GiB, of which 4.8 GiB are
    the micro-batch's activations; checkpointing cuts them to 0.6 GiB, and the peak is then set by the
    gradients autograd holds while the prompt's pass waits for its backward (1.9 GiB): 12.9 GiB. On a
    14 GiB budget the advice names the micro-batch that fits and checkpointing with its peak; where
    nothing fits, both are said not to."""
    from grpokit.models import ModelShape, StepShape, forecast_memory
    from grpokit.train.doctor import memory_fit

    H, L, h, kv, inter, V = 896, 24, 14, 2, 4864, 151936
    d = H // h
    N = V * H + L * (2 * H * h * d + 2 * H * kv * d + 3 * H * inter + 2 * H) + H  # tied, no bias
    shape = ModelShape(V, H, L, h, kv, inter, True, N)
    step = StepShape(
        rows=64,
        micro_batch_size=16,
        prompt_length=65,
        completion_length=256,
        reference=True,
        compute_bytes=2,
        master_bytes=4,
        group_size=8,
        static_decode=True,
    )
    gib = 2**30
    plain = forecast_memory(shape, step).total
    checkpointed = forecast_memory(shape, replace(step, gradient_checkpointing=True)).total
    assert 16.5 * gib < plain < 16.7 * gib and 12.8 * gib < checkpointed < 13.0 * gib
    fit = memory_fit(shape, step, 14 * gib, 0, None)
    assert not fit.fits and fit.best is not None and fit.best < 16
    assert fit.advice == f"use micro_batch_size={fit.best}, or gradient_checkpointing=true (peak 12.88 GiB)"
    assert memory_fit(shape, step, 20 * gib, 0, None).advice == ""
    none = memory_fit(shape, step, 9 * gib, 0, None)  # below the weights, gradients and AdamW state
    assert none.best is None and "gradient_checkpointing=true does not fit either" in none.advice
    on = memory_fit(shape, replace(step, gradient_checkpointing=True), 14 * gib, 0, None)
    assert on.fits and on.advice == ""


def test_episodes_whose_policy_never_calls_its_tool_are_flagged(tmp_path):
    """A random character-level policy never writes the 11-character "<tool_call>": the episodes'
    finding warns, naming the warm start; it reports the turns and the tool's counts per episode."""
    import json

    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(10, 30) for b in range(10, 20)]
    data = tmp_path / "sums.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = tiny_config(
        tmp_path, task=None, dataset=str(data), tools=["calc"], tool_call_format="hermes", sft_steps=0,
        max_completion_length=24, reward_funcs=["exact_answer"],
    )  # fmt: skip
    level, value, advice = _levels(checkup(cfg), "sampling")["episodes"]
    assert level == "warn" and "sft_steps" in advice
    counts = "0.00 tool_calls, 0.00 tool_errors, 0.00 tool_timeouts, 0.00 malformed_calls"
    assert value == f"1.00 turns, {counts} per episode (16 episodes)"


def test_the_gsm8k_rewards_are_probed_with_the_worked_solutions(tmp_path):
    """answer_format=gsm8k keeps the bare answer in the answer column; the doctor's reference probe
    is what a demonstration writes (the worked solution ending in '#### N'), which both GSM8K rewards
    pay, so neither is flagged as scoring every probe alike."""
    import json

    rows = [{"question": f"{a}+{a}?", "answer": f"{a}+{a}={2 * a}\n#### {2 * a}"} for a in range(1, 17)]
    (tmp_path / "gsm.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    cfg = tiny_config(
        tmp_path,
        task=None,
        dataset=str(tmp_path / "gsm.jsonl"),
        prompt_column="question",
        answer_format="gsm8k",
        reward_funcs=["gsm8k_answer", "gsm8k_format"],
        sft_steps=0,
        prompts_per_step=8,
        max_completion_length=6,
    )
    rewards = _levels(checkup(cfg), "rewards")
    for name in ("gsm8k_answer", "gsm8k_format"):
        level, shown, advice = rewards[name]
        assert level == "ok" and shown.startswith("reference answers 1,"), (name, shown, advice)
