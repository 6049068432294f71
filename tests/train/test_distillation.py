"""On-policy distillation (issue 27, point 1): `loss_type: opd` with `teacher_model` makes each token's
advantage the group's plus λ·(log π_T − log π_S), the negative of the reverse KL's sample at the
sampled token. Hand-checked on a 2-token, 3-word example; its expected policy gradient is exactly the
reverse KL's descent direction; the loss's gradient passes gradcheck; a student distils a teacher's
habit with no reward at all; options and a teacher of another tokenizer are refused in one line;
resume is bitwise and keeps the teacher."""

from __future__ import annotations

import math

import pytest
import torch

from grpokit.cli import main
from grpokit.config import GRPOConfig
from grpokit.ops import distillation_advantages, grpo_loss
from grpokit.train.grpo import train_grpo
from tests.helpers import read_steps
from tests.train.helpers import ones_reward, tiny_config, weights


def test_the_per_token_advantage_on_two_tokens_of_a_three_word_vocabulary():
    # student and teacher over words {a, b, c}; the student sampled "a" then "b"
    student = torch.tensor([[0.5, 0.25, 0.25], [0.25, 0.5, 0.25]]).log()  # [T=2, V=3]
    teacher = torch.tensor([[0.25, 0.25, 0.5], [0.125, 0.75, 0.125]]).log()
    sampled = torch.tensor([0, 1])
    s = student.gather(1, sampled[:, None]).T  # [1, 2]: log 0.5, log 0.5
    t = teacher.gather(1, sampled[:, None]).T  # [1, 2]: log 0.25, log 0.75
    mask = torch.tensor([[True, True]])
    out = distillation_advantages(torch.tensor([0.1]), s, t, mask, coef=2.0)
    expected = [0.1 + 2.0 * math.log(0.25 / 0.5), 0.1 + 2.0 * math.log(0.75 / 0.5)]  # -1.2863, 0.9109
    assert out.shape == (1, 2)
    assert out[0].tolist() == pytest.approx(expected, abs=1e-6)
    masked = distillation_advantages(torch.tensor([0.1]), s, t, torch.tensor([[True, False]]), coef=2.0)
    assert masked[0, 1].item() == 0.0 and masked[0, 0].item() == pytest.approx(expected[0], abs=1e-6)


def test_its_expected_policy_gradient_descends_the_reverse_kl_exactly():
    """Σ_y π_S(y)·∇log π_S(y)·(log π_T(y) − log π_S(y)) = −∇ KL(π_S ‖ π_T), over all three words."""
    logits = torch.tensor([0.3, -0.2, 0.9], dtype=torch.float64, requires_grad=True)
    teacher = torch.tensor([0.2, 0.5, 0.3], dtype=torch.float64).log()
    logp = torch.log_softmax(logits, -1)
    kl = (logp.exp() * (logp - teacher)).sum()
    (descent,) = torch.autograd.grad(-kl, logits, retain_graph=True)
    expected_gradient = torch.zeros(3, dtype=torch.float64)
    for y in range(3):
        advantage = distillation_advantages(
            torch.zeros(1, dtype=torch.float64),
            logp[y].reshape(1, 1),
            teacher[y].reshape(1, 1),
            torch.ones(1, 1, dtype=torch.bool),
            coef=1.0,
        )
        (score,) = torch.autograd.grad(logp[y], logits, retain_graph=True)
        expected_gradient += logp[y].exp().detach() * score * advantage.double().item()
    torch.testing.assert_close(expected_gradient, descent, rtol=0, atol=1e-12)


def test_the_opd_loss_passes_gradcheck():
    g = torch.Generator().manual_seed(0)
    logps = (-torch.rand(2, 3, generator=g, dtype=torch.float64)).requires_grad_()
    teacher = -torch.rand(2, 3, generator=g, dtype=torch.float64)
    mask = torch.tensor([[True, True, False], [True, True, True]])
    old = logps.detach() + 0.05 * torch.randn(2, 3, generator=g, dtype=torch.float64)

    def loss(current):
        adv = distillation_advantages(
            torch.tensor([0.3, -0.3], dtype=torch.float64), old, teacher, mask, coef=0.7
        )
        return grpo_loss(current, adv.double(), mask, old_logps=old, loss_type="opd").loss

    assert torch.autograd.gradcheck(loss, (logps,), eps=1e-6, atol=1e-6)


def habit_teacher(tmp_path):
    """A teacher with a habit: a tiny policy trained to write '1's (its reward rises 0.15 -> 0.98)."""
    cfg = tiny_config(tmp_path, output_dir=str(tmp_path / "teacher"), max_steps=15, learning_rate=3e-2)
    result = train_grpo(cfg, reward_funcs=[ones_reward])
    return result.output_dir / "checkpoint-15"


def student_run(tmp_path, name, on_event=None, **overrides):
    """A 15-step student of the tiny set-up with `overrides`: its result and its metrics rows."""
    # the share of '1's is logged (rewards/ones_reward/mean) but weighs nothing: reward_weights [0]
    cfg = tiny_config(
        tmp_path,
        output_dir=str(tmp_path / name),
        max_steps=15,
        reward_weights=[0.0],
        learning_rate=3e-2,
        **overrides,
    )
    result = train_grpo(cfg, reward_funcs=[ones_reward], on_event=on_event)
    return result, read_steps(result.output_dir)


def test_a_student_distils_the_teachers_habit_with_no_reward(tmp_path):
    teacher = habit_teacher(tmp_path)
    _, distilled = student_run(tmp_path, "opd", loss_type="opd", teacher_model=str(teacher))
    _, alone = student_run(tmp_path, "alone")
    # measured over seeds 1, 2, 3: the reverse KL 5.0-5.8 -> 0.00-0.05 nats, '1's 0.05-0.15 -> 0.97-1.0,
    # and without the teacher the '1's stay at 0.02-0.12
    assert distilled[0]["distill/kl"] > 3.0 and distilled[-1]["distill/kl"] < 0.5
    assert distilled[-1]["rewards/ones_reward/mean"] > 0.8
    assert alone[-1]["rewards/ones_reward/mean"] < 0.3 and "distill/kl" not in alone[0]
    assert all(r["distill/teacher_logps"] < 0.0 for r in distilled)


@pytest.mark.slow  # two runs and a rollout worker process
def test_a_student_distils_from_batches_one_version_stale(tmp_path):
    """opd under max_staleness=1: the worker samples, the trainer scores against the teacher and
    distils from batches one version old (the decoupled objective's weights); the habit is learnt as
    in the synchronous run (test above: its thresholds)."""
    teacher = habit_teacher(tmp_path)
    _, distilled = student_run(tmp_path, "opd", loss_type="opd", teacher_model=str(teacher), max_staleness=1)
    assert [r["async/staleness"] for r in distilled] == [0.0] + [1.0] * 14
    assert distilled[0]["distill/kl"] > 3.0 and distilled[-1]["distill/kl"] < 0.5
    assert distilled[-1]["rewards/ones_reward/mean"] > 0.8


def test_resume_is_bitwise_and_keeps_the_teacher(tmp_path):
    teacher = habit_teacher(tmp_path)
    opd = dict(loss_type="opd", teacher_model=str(teacher), save_steps=2, learning_rate=3e-2)
    train_grpo(tiny_config(tmp_path, output_dir=str(tmp_path / "straight"), max_steps=4, **opd))
    train_grpo(tiny_config(tmp_path, output_dir=str(tmp_path / "stopped"), max_steps=2, **opd))
    train_grpo(tiny_config(tmp_path, output_dir=str(tmp_path / "stopped"), max_steps=4, resume=True, **opd))
    a, b = weights(tmp_path / "straight"), weights(tmp_path / "stopped")
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=0, atol=0, msg=name)
    other = tiny_config(
        tmp_path,
        output_dir=str(tmp_path / "stopped"),
        max_steps=6,
        resume=True,
        **(opd | {"distill_coef": 2.0}),
    )
    with pytest.raises(ValueError, match="distill_coef"):
        train_grpo(other)


@pytest.mark.parametrize(
    ("overrides", "says"),
    [
        ({"loss_type": "opd"}, "loss_type=opd distills from teacher_model"),
        ({"teacher_model": "runs/x/final"}, "teacher_model is read only by loss_type=opd"),
        ({"loss_type": "opd", "teacher_model": "tiny"}, "would be an untrained model"),
        ({"loss_type": "opd", "teacher_model": "x", "distill_coef": -1.0}, "distill_coef"),
        ({"loss_type": "opd", "teacher_model": "x", "teacher_device": "gpu0"}, "teacher_device"),
    ],
)
def test_bad_distillation_options_are_refused(overrides, says):
    with pytest.raises(ValueError, match=says):
        GRPOConfig(**overrides)


def test_a_teacher_with_another_tokenizer_is_refused_in_one_line(tmp_path, capsys):
    # a teacher over another alphabet: its character tokenizer differs from the addition task's
    other = tiny_config(tmp_path, output_dir=str(tmp_path / "other"), max_steps=1, task="countdown")
    teacher = train_grpo(other).output_dir / "checkpoint-1"
    args = [f"output_dir={tmp_path}/student", "loss_type=opd", f"teacher_model={teacher}", "sft_steps=0"]
    code = main(["train", *args, "max_steps=1", "progress=false", "num_eval_prompts=4"])
    err = capsys.readouterr().err
    assert code == 2 and "another tokenizer than the policy" in err and "Traceback" not in err
