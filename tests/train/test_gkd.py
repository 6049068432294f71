"""Generalised knowledge distillation (issue 27, point 1): `loss_type: gkd` with `teacher_model`, the
generalised JSD (`gkd_beta`) between the student's and the teacher's whole next-token distributions at
each completion token, a token mean over the batch; a share `lmbda` of steps on the student's own
samples, the others on the dataset's answers.

The trainer's loss equals a direct computation from both models' full logits, in value and in every
parameter's gradient, whatever the micro-batch split; the dataset's answers become completions token
for token; a student takes on a teacher's habit with no reward; the on/off-policy choice is the same
across a resume (bitwise) and refuses what it cannot take, in one line."""

from __future__ import annotations

import copy

import pytest
import torch

from grpokit.cli import main
from grpokit.config import GRPOConfig
from grpokit.data.errors import DataError
from grpokit.engine import EngineSpec, PolicyEngine
from grpokit.models import build_policy, char_tokenizer
from grpokit.ops import generalized_jsd
from grpokit.report import write_report
from grpokit.rollout import SamplingParams
from grpokit.train.distill import gkd_loss, learns_on_policy
from grpokit.train.grpo import train_grpo
from tests.helpers import read_metrics
from tests.train.helpers import ones_reward, tiny_config, weights
from tests.train.test_distillation import habit_teacher, student_run
from tests.train.test_fused_logps import _batch

TOKENIZER = char_tokenizer("0123456789+=")


def _engine(model, fused: bool, temperature: float = 0.8) -> PolicyEngine:
    spec = EngineSpec(fused_logps=fused, temperature=temperature)
    return PolicyEngine.create(model, TOKENIZER, spec)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_the_loss_equals_a_direct_computation_in_value_and_every_gradient(beta):
    """The engine's route (hidden states and the head, a chunk at a time, counted positions only)
    against both models' whole logits through `generalized_jsd`, masked, summed, divided by the count:
    equal losses and gradients, and the sum over two micro-batches equals one pass over all rows."""
    student = build_policy(hidden_size=32, num_layers=2, num_heads=4, vocab_size=40, seed=1, dropout=0.0)
    student = student.double()
    teacher = build_policy(hidden_size=16, num_layers=1, num_heads=2, vocab_size=40, seed=2, dropout=0.0)
    teacher = teacher.double().requires_grad_(False)
    twin = copy.deepcopy(student)
    batch = _batch(40)
    mask = batch.completion_mask  # [6, 4], one row ending early
    count = torch.tensor(float(mask.sum()))
    states = _engine(teacher, fused=True).frozen_head_states(batch, 3)
    assert states.states.shape == (6, 4, 16) and states.weight is not None
    engine = _engine(student, fused=True)
    total = 0.0
    for rows in (slice(0, 2), slice(2, 6)):  # two micro-batches, one normaliser: the whole batch's count
        out, logps = gkd_loss(engine, batch, rows, states, beta, count)
        out.loss.backward()
        total += out.loss.detach()
    # directly: the models' own logits at the positions that score each completion token
    ids = torch.cat([batch.prompt_ids, batch.completion_ids], 1)
    attention = torch.cat([batch.prompt_mask, batch.completion_mask], 1).long()
    z_s = twin(input_ids=ids, attention_mask=attention).logits[:, -5:-1]  # [6, 4, V]
    z_t = teacher(input_ids=ids, attention_mask=attention).logits[:, -5:-1]
    per_token = generalized_jsd(z_s, z_t, beta=beta, temperature=0.8)  # [6, 4]
    expected = per_token[mask].sum() / count
    expected.backward()
    torch.testing.assert_close(total, expected.detach(), rtol=1e-10, atol=1e-12)
    for (name, a), b in zip(student.named_parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-8, atol=1e-12, msg=name)
    # its reports: the divergence, and k1 of the reverse KL and the teacher's log-prob at the written token
    out, logps = gkd_loss(engine, batch, slice(2, 6), states, beta, count)
    rows_mask = mask[2:6]

    def picked(z):  # [6, 4, V] -> [4, 4]: the log-prob of each written token of rows 2-5
        return torch.log_softmax(z[2:6] / 0.8, -1).gather(-1, batch.completion_ids[2:6, :, None])[..., 0]

    s, t = picked(z_s.detach()), picked(z_t)
    torch.testing.assert_close(logps[rows_mask], s[rows_mask].float(), rtol=0, atol=1e-6)
    assert (logps[~rows_mask] == 0).all()
    torch.testing.assert_close(out.metrics["distill/kl"], (s - t)[rows_mask].mean(), rtol=0, atol=1e-10)
    torch.testing.assert_close(out.metrics["distill/teacher_logps"], t[rows_mask].mean(), rtol=0, atol=1e-10)
    torch.testing.assert_close(
        out.metrics["distill/divergence"], per_token[2:6][rows_mask].mean().detach(), rtol=0, atol=1e-10
    )
    p = torch.softmax(z_s[2:6].detach() / 0.8, -1)
    entropy = -(p * p.log()).sum(-1)  # [4, 4]
    torch.testing.assert_close(out.metrics["entropy"], entropy[rows_mask].mean(), rtol=0, atol=1e-10)


def test_the_dataset_answers_become_completions_token_for_token():
    """GKD's off-policy rows (`Decoder.demonstrate`): the prompt tokenised as sampling does, the answer
    on its own then EOS, the mask over exactly those tokens, cut at max_completion_length (truncated)."""
    model = build_policy(hidden_size=16, num_layers=1, num_heads=2, vocab_size=len(TOKENIZER), seed=0)
    decoder = _engine(model, fused=True).decoder
    params = SamplingParams(num_generations=4, max_completion_length=4)
    demo = decoder.demonstrate(["12+3=", "4+4="], ["15", "12345"], params)
    eos = TOKENIZER.eos_token_id
    assert demo.num_generations == 1 and demo.completion_ids.shape == (2, 4)
    first = demo.completion_ids[0][demo.completion_mask[0]].tolist()
    assert first == TOKENIZER("15", add_special_tokens=False)["input_ids"] + [eos]
    assert TOKENIZER.decode(demo.completion_ids[1][demo.completion_mask[1]]) == "1234"  # no room for EOS
    assert demo.truncated.tolist() == [False, True] and demo.completion_mask.sum(-1).tolist() == [3, 4]
    prompts = [TOKENIZER.decode(ids[m]) for ids, m in zip(demo.prompt_ids, demo.prompt_mask, strict=True)]
    assert prompts == ["12+3=", "4+4="] and not demo.prompt_mask[1, 0]  # left-padded
    assert (demo.sampling_logps == 0).all() and demo.completions == ["15", "12345"]


def _student(tmp_path, name, teacher, on_event=None, **overrides):
    gkd = dict(loss_type="gkd", teacher_model=str(teacher))
    return student_run(tmp_path, name, on_event, **gkd, **overrides)[1]


def _offpolicy_student(tmp_path, name, teacher, **overrides):
    """A gkd student on off-policy steps only (lmbda = 0), every step's completions logged: its metrics
    rows, and the completions events' data."""
    seen = []
    record = lambda kind, step, data: seen.append(data) if kind == "completions" else None  # noqa: E731
    rows = _student(tmp_path, name, teacher, record, lmbda=0.0, log_completions_steps=1, **overrides)
    return rows, seen


def test_a_student_takes_the_teachers_habit_from_its_own_samples_and_from_answers(tmp_path):
    teacher = habit_teacher(tmp_path)
    own = _student(tmp_path, "own", teacher, lmbda=1.0, gkd_beta=0.5)
    # measured on seeds 1, 2, 3 and 7: the divergence 0.55-0.56 -> below 0.006 nats, '1's 0.05-0.15 -> 1.0
    assert own[0]["distill/divergence"] > 0.2 and own[-1]["distill/divergence"] < 0.02
    assert own[-1]["rewards/ones_reward/mean"] > 0.8
    assert all(r["distill/on_policy"] == 1.0 for r in own)
    page = write_report(tmp_path / "own").read_text()  # the distance to the teacher, plotted
    assert (
        "distillation.png" in page and (tmp_path / "own" / "report" / "distillation.png").stat().st_size > 0
    )
    answers, seen = _offpolicy_student(tmp_path, "answers", teacher, gkd_beta=0.0)
    # the teacher's distributions over the dataset's answers: the forward KL falls 6-300× (seeds 1, 2, 3, 7:
    # 2.6-2.8 -> 0.009-0.26 nats)
    assert answers[0]["distill/divergence"] > 1.0
    assert answers[-1]["distill/divergence"] < 0.15 * answers[0]["distill/divergence"]
    assert all(r["distill/on_policy"] == 0.0 and "reward" not in r for r in answers)
    for data in seen:  # each logged completion is its prompt's answer: a + b of "a+b="
        for prompt, completion in zip(data["prompts"], data["completions"], strict=True):
            a, b = prompt.split("=")[0].split("+")
            assert completion == str(int(a) + int(b)), (prompt, completion)


def test_seq_kd_learns_from_the_teachers_samples_and_needs_no_answers(tmp_path):
    """seq_kd: the off-policy steps' completions are the teacher's samples (sequence-level KD): here a
    teacher that writes '1's, so the logged completions are mostly '1's, which no answer of the addition
    task is; the divergence falls as it does on answers; rows without an answer column train."""
    teacher = habit_teacher(tmp_path)
    rows, seen = _offpolicy_student(tmp_path, "seq_kd", teacher, seq_kd=True)
    written = "".join(c for data in seen for c in data["completions"])
    # measured on seeds 1, 2, 3, 7: 0.99-1.0 of the teacher's characters are '1's; the divergence 0.54-0.57 ->
    # 0.001-0.005 nats
    assert len(seen) == 15 and written.count("1") / len(written) > 0.8
    assert all(r["distill/on_policy"] == 0.0 and "reward" not in r for r in rows)
    assert (
        rows[0]["distill/divergence"] > 0.2
        and rows[-1]["distill/divergence"] < 0.1 * rows[0]["distill/divergence"]
    )
    unanswered = [{"prompt": f"{i}+1="} for i in range(40)]
    cfg = tiny_config(
        tmp_path, output_dir=str(tmp_path / "b"), loss_type="gkd", teacher_model=str(teacher), seq_kd=True
    )
    held_out = [{"prompt": f"{i}+2=", "answer": str(i + 2)} for i in range(4)]  # (the task's accuracy)
    result = train_grpo(cfg, reward_funcs=[ones_reward], train_rows=unanswered, eval_rows=held_out)
    assert result.steps == 2


def test_the_share_of_on_policy_steps_is_lmbda_and_a_resume_is_bitwise(tmp_path):
    spec = GRPOConfig(loss_type="gkd", teacher_model="x", lmbda=0.3, seed=5)
    from grpokit.config.plan import step_spec

    chosen = [learns_on_policy(step_spec(spec), s) for s in range(1, 2001)]
    assert abs(sum(chosen) / 2000 - 0.3) < 0.035  # 3.4 standard deviations of a binomial share
    assert chosen == [learns_on_policy(step_spec(spec), s) for s in range(1, 2001)]  # (seed, step) alone
    teacher = habit_teacher(tmp_path)
    gkd = dict(
        loss_type="gkd", teacher_model=str(teacher), lmbda=0.5, save_steps=2, learning_rate=3e-2, seed=3
    )
    straight = train_grpo(tiny_config(tmp_path, output_dir=str(tmp_path / "straight"), max_steps=6, **gkd))
    train_grpo(tiny_config(tmp_path, output_dir=str(tmp_path / "stopped"), max_steps=2, **gkd))
    train_grpo(tiny_config(tmp_path, output_dir=str(tmp_path / "stopped"), max_steps=6, resume=True, **gkd))
    rows = read_metrics(straight.output_dir)
    kinds = {r["distill/on_policy"] for r in rows if "distill/on_policy" in r}
    assert kinds == {0.0, 1.0}  # the six steps hold both kinds (seed 3)
    a, b = weights(tmp_path / "straight"), weights(tmp_path / "stopped")
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=0, atol=0, msg=name)
    for changed in ({"lmbda": 0.6}, {"gkd_beta": 0.1}, {"seq_kd": True}):
        other = tiny_config(
            tmp_path, output_dir=str(tmp_path / "stopped"), max_steps=8, resume=True, **(gkd | changed)
        )
        with pytest.raises(ValueError, match=next(iter(changed))):
            train_grpo(other)


@pytest.mark.parametrize(
    ("overrides", "says"),
    [
        ({"loss_type": "gkd"}, "loss_type=gkd distills from teacher_model"),
        ({"loss_type": "gkd", "teacher_model": "x", "gkd_beta": 1.5}, "gkd_beta"),
        ({"loss_type": "gkd", "teacher_model": "x", "lmbda": -0.1}, "lmbda"),
        ({"gkd_beta": 0.2}, "gkd_beta=0.2 is read only by loss_type=gkd"),
        ({"lmbda": 1.0}, "lmbda=1 is read only by loss_type=gkd"),
        ({"seq_kd": True}, "seq_kd=true is read only by loss_type=gkd"),
        ({"loss_type": "gkd", "teacher_model": "x", "distill_coef": 2.0}, "read only by loss_type=opd"),
        ({"loss_type": "gkd", "teacher_model": "x", "beta": 0.04}, "no reference term"),
        ({"loss_type": "gkd", "teacher_model": "x", "dynamic_sampling": True}, "does not read rewards"),
        ({"loss_type": "gkd", "teacher_model": "x", "curriculum": True}, "does not read rewards"),
        ({"loss_type": "gkd", "teacher_model": "x", "target_entropy": 1.0}, "target_entropy"),
        (
            {"loss_type": "gkd", "teacher_model": "x", "sampling_correction": "token_mask"},
            "sampling_correction",
        ),
        ({"loss_type": "gkd", "teacher_model": "x", "tools": ["calculator"]}, "set lmbda=1"),
        ({"loss_type": "gkd", "teacher_model": "x", "top_entropy_quantile": 0.5}, "no policy-gradient"),
        ({"loss_type": "gkd", "teacher_model": "x", "epsilon_high": 0.28}, "no policy-gradient"),
        ({"loss_type": "gkd", "teacher_model": "x", "seq_kd": True, "lmbda": 1.0}, "never drawn"),
    ],
)
def test_bad_gkd_options_are_refused(overrides, says):
    with pytest.raises(ValueError, match=says):
        GRPOConfig(**overrides)


def test_missing_answers_and_another_head_size_are_refused_in_one_line(tmp_path, capsys):
    teacher = habit_teacher(tmp_path)
    rows = [{"prompt": f"{i}+1="} for i in range(40)]  # no answer column
    cfg = tiny_config(tmp_path, output_dir=str(tmp_path / "a"), loss_type="gkd", teacher_model=str(teacher))
    with pytest.raises(DataError, match="has no 'answer' column") as refused:
        train_grpo(cfg, reward_funcs=[ones_reward], train_rows=rows, eval_rows=rows[:4])
    assert "lmbda=1" in str(refused.value) and "\n" not in str(refused.value)
    # a teacher whose output layer is padded larger than the policy's (as Qwen2.5-7B's against 0.5B's)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    padded = AutoModelForCausalLM.from_pretrained(teacher)
    padded.resize_token_embeddings(padded.get_output_embeddings().weight.shape[0] + 8)
    padded.save_pretrained(tmp_path / "padded")
    AutoTokenizer.from_pretrained(teacher).save_pretrained(tmp_path / "padded")
    args = [
        f"output_dir={tmp_path}/b",
        "loss_type=gkd",
        f"teacher_model={tmp_path / 'padded'}",
        "sft_steps=0",
    ]
    code = main(["train", *args, "max_steps=1", "progress=false", "num_eval_prompts=4"])
    err = capsys.readouterr().err
    assert code == 2 and "output layer scores" in err and "Traceback" not in err
    assert not (tmp_path / "b" / "config.yaml").exists()  # refused before the run directory was prepared


def test_a_teacher_without_hidden_states_and_a_plain_head_is_refused_for_gkd(tmp_path, capsys):
    """fused_logps=false: the teacher's pass could only keep whole distributions, [B, T, V]; refused in
    one line, where opd (its log-probs of the written tokens only) trains."""
    teacher = habit_teacher(tmp_path)
    common = [f"teacher_model={teacher}", "fused_logps=false", "max_steps=1", "progress=false", "sft_steps=0"]
    code = main(
        ["train", f"output_dir={tmp_path}/gkd", "loss_type=gkd", "lmbda=1", *common, "num_eval_prompts=4"]
    )
    err = capsys.readouterr().err
    assert code == 2 and "no hidden states and plain LM head" in err and "Traceback" not in err
    code = main(["train", f"output_dir={tmp_path}/opd", "loss_type=opd", *common, "num_eval_prompts=4"])
    assert code == 0


def test_an_update_reports_token_means_when_the_last_micro_batch_is_shorter():
    """An off-policy batch holds P rows, which micro_batch_size need not divide: the update's metrics
    are the token means over the whole batch, not a mean of the micro-batches' means."""
    from grpokit.config.plan import grpo_plan
    from grpokit.ops import HeadStates
    from grpokit.train import distributed
    from grpokit.train.batch_source import InProcess
    from grpokit.train.before_update import LogpsBeforeUpdate
    from grpokit.train.grpo_setup import build_trainee
    from grpokit.train.inputs import RunData
    from grpokit.train.update import optimizer_step

    cfg = GRPOConfig(
        device="cpu",
        loss_type="gkd",
        teacher_model="teacher",  # (not loaded: its logits are given)
        prompts_per_step=2,
        num_generations=4,
        micro_batch_size=4,
        max_completion_length=4,
        fused_logps=False,
        temperature=0.8,
    )
    model = build_policy(
        hidden_size=32, num_layers=2, num_heads=4, vocab_size=40, seed=1, dropout=0.0
    ).double()
    data = RunData([], [], [lambda *a, **k: []], None, None, None, 4)
    trainee = build_trainee(grpo_plan(cfg).trainee, model, TOKENIZER, data, InProcess(), distributed.Dist())
    batch = _batch(40)  # 6 rows: micro-batches of 4 and 2, one row ending early
    mask = batch.completion_mask
    teacher = torch.randn(6, 4, 40, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    ids = torch.cat([batch.prompt_ids, batch.completion_ids], 1)
    attention = torch.cat([batch.prompt_mask, mask], 1).long()
    with torch.no_grad():
        z_s = model(input_ids=ids, attention_mask=attention).logits[:, -5:-1]  # [6, 4, V]
    expected = generalized_jsd(z_s, teacher, beta=0.5, temperature=0.8)[mask].mean()
    frozen = LogpsBeforeUpdate(old=None, ref=None, weights=None, teacher_states=HeadStates(teacher))
    metrics = optimizer_step(
        trainee.engine, trainee.update, batch, frozen, trainee.params, distributed.Dist()
    )
    torch.testing.assert_close(torch.as_tensor(metrics["distill/divergence"]), expected, rtol=1e-10, atol=0)
    # the loss is the same token mean (it is the objective the gradient descends)
    torch.testing.assert_close(torch.as_tensor(metrics["loss"]).double(), expected, rtol=1e-10, atol=0)
