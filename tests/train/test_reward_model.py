"""Reward-model training (Bradley–Terry), preference data, and RLHF with a learned reward."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from grpokit.config import ConfigError, GRPOConfig, RewardConfig, load_config
from grpokit.data import DataError, collate_preferences, get_task, load_preferences, preference_pairs
from grpokit.models import build_reward_model, char_tokenizer, reward_scores
from grpokit.ops import bradley_terry_loss
from grpokit.train.reward import evaluate_reward_model, reward_step, train_reward
from tests.helpers import TINY_MODEL, TINY_MODEL_VALUES, read_metrics

TOK = char_tokenizer("0123456789+=")
PAIRS = [
    {"prompt": "1+1=", "chosen": "2", "rejected": "3", "margin": 0.5},
    {"prompt": "12+30=", "chosen": "42", "rejected": "41", "margin": 1.0},
    {"prompt": "99+99=", "chosen": "198", "rejected": "7", "margin": 0.0},
    {"prompt": "5+0=", "chosen": "5", "rejected": "50", "margin": 2.0},
]


def tiny_rm(seed: int = 0):
    return build_reward_model(
        hidden_size=16, num_layers=1, num_heads=2, vocab_size=len(TOK), max_seq_len=32, seed=seed
    )


def reward_cfg(tmp_path, **overrides) -> RewardConfig:
    base = dict(
        output_dir=str(tmp_path / "rm"),
        **TINY_MODEL_VALUES,
        max_steps=3,
        batch_size=8,
        micro_batch_size=8,
        num_eval_pairs=16,
        eval_steps=0,
        save_steps=0,
        progress=False,
        learning_rate=1e-3,
        max_length=32,
    )
    return RewardConfig(**(base | overrides))


def alone(model, text: str) -> torch.Tensor:
    ids = torch.tensor([TOK(text, add_special_tokens=False)["input_ids"] + [TOK.eos_token_id]])
    return reward_scores(model, ids, torch.ones_like(ids, dtype=torch.bool))[0]


@pytest.mark.parametrize("margin", [False, True])
@pytest.mark.parametrize("centering", [None, 0.01])
def test_training_loss_is_bradley_terry_of_the_models_scores(tmp_path, margin, centering):
    """reward_step's loss on a batch = ops.bradley_terry_loss of each sequence scored alone (no padding)."""
    model = tiny_rm()
    rows = [p if margin else {k: v for k, v in p.items() if k != "margin"} for p in PAIRS]
    with torch.no_grad():
        chosen = torch.stack([alone(model, r["prompt"] + r["chosen"]) for r in rows])
        rejected = torch.stack([alone(model, r["prompt"] + r["rejected"]) for r in rows])
        expected = bradley_terry_loss(
            chosen,
            rejected,
            margin=torch.tensor([r["margin"] for r in PAIRS]) if margin else None,
            center_rewards_coefficient=centering,
        )
    cfg = reward_cfg(tmp_path, center_rewards_coefficient=centering, batch_size=4, micro_batch_size=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    metrics = reward_step(cfg, model, TOK, rows, opt, sched)
    torch.testing.assert_close(metrics["loss"], expected.loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(metrics["accuracy"], expected.metrics["accuracy"])


def test_micro_batches_accumulate_the_batch_mean_gradient():
    """One batch of 4 pairs, or 2 micro-batches of 2: the same SGD update (float32 summation order)."""
    deltas = []
    for micro in (4, 2, 1):
        model = tiny_rm()
        before = [p.detach().clone() for p in model.parameters()]
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        cfg = RewardConfig(batch_size=4, micro_batch_size=micro, max_grad_norm=1e9, max_length=32)
        reward_step(cfg, model, TOK, PAIRS, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0))
        deltas.append(
            torch.cat([(p.detach() - b).flatten() for p, b in zip(model.parameters(), before, strict=True)])
        )
    torch.testing.assert_close(deltas[1], deltas[0], rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(deltas[2], deltas[0], rtol=1e-4, atol=1e-6)


def test_scores_do_not_depend_on_padding():
    model = tiny_rm().eval()
    batch = collate_preferences(TOK, PAIRS, 32)  # left-padded to the longest of 8 sequences
    with torch.no_grad():
        padded = reward_scores(model, batch.input_ids, batch.attention_mask)
        texts = [r["prompt"] + r["chosen"] for r in PAIRS] + [r["prompt"] + r["rejected"] for r in PAIRS]
        unpadded = torch.stack([alone(model, t) for t in texts])
        right = torch.zeros_like(batch.input_ids)
        right_mask = torch.zeros_like(batch.attention_mask)
        for i in range(len(texts)):
            ids = batch.input_ids[i][batch.attention_mask[i]]
            right[i, : len(ids)], right_mask[i, : len(ids)] = ids, True
        right_padded = reward_scores(model, right, right_mask)
    torch.testing.assert_close(padded, unpadded, rtol=0, atol=1e-5)
    torch.testing.assert_close(right_padded, unpadded, rtol=0, atol=1e-5)


def test_long_pairs_are_dropped_or_truncated_and_counted():
    long = PAIRS + [{"prompt": "1" * 40 + "=", "chosen": "1", "rejected": "2"}]
    dropped = collate_preferences(TOK, long, 16, "drop")
    assert (dropped.num_pairs, dropped.num_dropped, dropped.num_truncated) == (4, 1, 0)
    cut = collate_preferences(TOK, long, 16, "truncate")
    assert (cut.num_pairs, cut.num_truncated) == (5, 1) and cut.input_ids.shape[1] == 16
    assert cut.input_ids[4, -1].item() == TOK.eos_token_id  # the end (answer + EOS) is kept
    with pytest.raises(DataError, match="raise max_length"):
        collate_preferences(TOK, long[-1:], 16, "drop")


def test_preference_files_and_conversations(tmp_path):
    (tmp_path / "p.jsonl").write_text("\n".join(json.dumps(p) for p in PAIRS))
    assert load_preferences(tmp_path / "p.jsonl") == PAIRS
    (tmp_path / "bad.jsonl").write_text(json.dumps({"chosen": "a"}))
    with pytest.raises(DataError, match="row 0 has no 'rejected'"):
        load_preferences(tmp_path / "bad.jsonl")
    (tmp_path / "margin.jsonl").write_text(json.dumps({"chosen": "a", "rejected": "b", "margin": "big"}))
    with pytest.raises(DataError, match="margin 'big' is not a number"):
        load_preferences(tmp_path / "margin.jsonl")
    tok = char_tokenizer("0123456789+=|:ua")
    tok.chat_template = "{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}|{% endfor %}"
    rows = [
        {
            "prompt": [{"role": "user", "content": "1+1="}],
            "chosen": [{"role": "assistant", "content": "2"}],
            "rejected": [{"role": "assistant", "content": "3"}],
        }
    ]
    batch = collate_preferences(tok, rows, 32)
    texts = [tok.decode(ids[mask]) for ids, mask in zip(batch.input_ids, batch.attention_mask, strict=True)]
    assert texts == ["u:1+1=|a:2|", "u:1+1=|a:3|"]


@pytest.mark.parametrize("name", ["addition", "reverse", "countdown"])
def test_built_in_preference_pairs(name):
    task = get_task(name)
    for near in (0.0, 1.0):
        pairs = preference_pairs(task, task.train[:50], seed=1, near_miss=near)
        for row, pair in zip(task.train[:50], pairs, strict=True):
            assert task.is_correct(pair["chosen"], row) and not task.is_correct(pair["rejected"], row)
    if name == "addition":  # near misses are a learner's slips: a digit off by 1 or 2, or a carry
        near_pairs = preference_pairs(task, task.train[:50], seed=1, near_miss=1.0)
        slips = {abs(int(p["chosen"]) - int(p["rejected"])) for p in near_pairs}
        assert slips <= {1, 2, 9, 10, 11} and len(slips) >= 4, slips


@pytest.mark.slow  # two reward runs and a resume (1.9 s): the full suite runs it; the fast tier under 75 s
def test_train_reward_writes_metrics_checkpoints_calibration_and_resumes_bitwise(tmp_path):
    straight = reward_cfg(tmp_path / "a", max_steps=4, save_steps=2)
    result = train_reward(straight)
    rows = read_metrics(tmp_path / "a" / "rm")
    step_rows = [r for r in rows if "loss" in r]
    assert {
        "loss",
        "accuracy",
        "margin",
        "chosen_rewards",
        "rejected_rewards",
        "grad_norm",
        "learning_rate",
        "step_time",
        "num_dropped",
        "num_truncated",
    } <= set(step_rows[0])
    assert (
        "eval/calibration/4-inf/count" in rows[-1] and (tmp_path / "a" / "rm" / "calibration.json").is_file()
    )
    assert set(result.eval_after) >= {"accuracy", "margin", "chosen_rewards", "rejected_rewards"}
    interrupted = reward_cfg(tmp_path / "b", max_steps=4, save_steps=2)

    def stop(kind, step, data):
        if kind == "step" and step == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train_reward(interrupted, on_event=stop)
    train_reward(interrupted.model_copy(update={"resume": True}))
    from tests.train.helpers import weights

    a, b = weights(tmp_path / "a" / "rm"), weights(tmp_path / "b" / "rm")
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize(
    ("overrides", "stored"),
    [
        ({"device": "cpu"}, torch.float32),
        ({"device": "auto"}, torch.float32),
        ({"dtype": "bfloat16"}, torch.float32),  # float32 master weights, bf16 autocast
        ({"dtype": "bfloat16", "master_weights": "dtype"}, torch.bfloat16),
    ],
)
def test_train_reward_places_the_model_and_keeps_the_master_dtype(tmp_path, overrides, stored):
    """The model trains on the resolved device in the master dtype (forward passes under autocast,
    the loss in float32); metrics are plain numbers and checkpoints are on the host."""
    cfg = reward_cfg(tmp_path, max_steps=2, **overrides)
    rows = []

    def on_event(kind, step, data):
        if kind == "step":
            rows.append(data)

    result = train_reward(cfg, on_event=on_event)
    assert result.steps == 2 and all(isinstance(r["loss"], float) and r["loss"] == r["loss"] for r in rows)
    from tests.train.helpers import weights

    assert {w.dtype for w in weights(tmp_path / "rm").values()} == {stored}
    state = torch.load(tmp_path / "rm" / "checkpoint-2" / "state.pt", weights_only=True)
    moments = [v for s in state["optimizer"]["state"].values() for v in s.values()]
    assert moments and all(v.device.type == "cpu" for v in moments)
    model = tiny_rm().to(stored)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    metrics = reward_step(cfg, model, TOK, PAIRS, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0))
    assert metrics["loss"].dtype == torch.float32


def test_reward_trainer_facade_and_evaluation(tmp_path):
    from grpokit import RewardTrainer

    model = tiny_rm()
    (tmp_path / "pairs.jsonl").write_text("\n".join(json.dumps(p) for p in PAIRS * 4))
    result = RewardTrainer(
        model,
        str(tmp_path / "pairs.jsonl"),
        reward_cfg(tmp_path, batch_size=4, micro_batch_size=4),
        eval_dataset=PAIRS,
        tokenizer=TOK,
    ).train()
    assert result.eval_after["num_pairs"] == 4
    metrics = evaluate_reward_model(model, TOK, PAIRS, max_length=32)
    assert sum(metrics[k] for k in metrics if k.endswith("/count")) == 4
    with pytest.raises(ValueError, match="needs its tokenizer"):
        RewardTrainer(model, PAIRS)


def test_grpo_reward_funcs_from_the_config(tmp_path):
    """{model: DIR} loads a trained reward model as a reward function; {builtin: ...} picks one."""
    from grpokit.config.plan import reward_spec
    from grpokit.models import save_policy
    from grpokit.train.grpo import train_grpo
    from grpokit.train.inputs import configured_rewards
    from tests.train.helpers import tiny_config

    save_policy(tiny_rm(), TOK, tmp_path / "rm")
    cfg = tiny_config(
        tmp_path,
        reward_funcs=[{"model": str(tmp_path / "rm"), "batch_size": 8}, {"builtin": "task"}],
        max_steps=1,
    )
    funcs = configured_rewards(reward_spec(cfg), get_task("addition"))
    assert [getattr(f, "__name__", "") for f in funcs] == ["reward_model:rm", "reward"]
    result = train_grpo(cfg)
    rows = read_metrics(result.output_dir)
    assert "rewards/reward_model:rm/mean" in rows[1] and rows[1]["rewards/reward_model:rm/std"] > 0
    with pytest.raises(ConfigError, match="exactly one of 'model'"):
        load_config(GRPOConfig, None, ["reward_funcs=[{model: a, builtin: task}]"])
    with pytest.raises(ValueError, match="reward function 'nope' is not a built-in reward"):
        GRPOConfig(reward_funcs=[{"builtin": "nope"}])  # said by the config, before any work


@pytest.mark.slow
def test_cli_reward_and_eval_reward(tmp_path):
    out = tmp_path / "rm"
    shared = [
        *TINY_MODEL,
        "num_eval_pairs=16",
        "batch_size=8",
        "micro_batch_size=8",
    ]
    train = subprocess.run(
        [
            sys.executable,
            "-m",
            "grpokit",
            "reward",
            f"output_dir={out}",
            "max_steps=2",
            "progress=false",
            *shared,
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert train.returncode == 0, train.stderr
    assert "held-out pairwise accuracy" in train.stdout
    evaluation = subprocess.run(
        [sys.executable, "-m", "grpokit", "eval-reward", f"model={out / 'checkpoint-2'}", *shared],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert evaluation.returncode == 0, evaluation.stderr
    assert json.loads(evaluation.stdout)["num_pairs"] == 16


@pytest.mark.slow
def test_reward_model_learns_the_preference_task(tmp_path):
    """Acceptance: with the built-in preset, held-out pairwise accuracy rises from about chance
    to at least 0.85 within 300 steps (measured: 0.48 -> 0.9; about 30 s on 2 CPU cores)."""
    from grpokit.cli import REWARD_PRESET, _config

    cfg = _config(
        RewardConfig,
        REWARD_PRESET,
        [f"output_dir={tmp_path / 'rm'}", "progress=false", "save_steps=0"],
    )
    result = train_reward(cfg)
    assert 0.35 <= result.eval_before["accuracy"] <= 0.65
    assert result.eval_after["accuracy"] >= 0.85


def test_wrong_answers_exist_for_degenerate_rows():
    """A reverse row like '5555' has no wrong reordering: a digit is changed instead (no endless loop)."""
    import random

    from grpokit.data.preferences import _wrong_answer

    task = get_task("reverse")
    row = {"prompt": "5555>", "answer": "5555"}
    wrong = _wrong_answer(task, row, random.Random(0), near_miss=1.0)
    assert len(wrong) == 4 and wrong != "5555"


def test_a_tiny_reward_model_on_a_preference_file_takes_its_characters(tmp_path):
    """task=None, model=tiny, dataset=FILE (docs/reward-models.md): the character tokenizer is built
    from every prompt, chosen and rejected text of the training and held-out files."""
    from grpokit.config.plan import PairSpec
    from grpokit.train.reward import preference_data

    train, held = tmp_path / "prefs.jsonl", tmp_path / "held.jsonl"
    train.write_text(json.dumps({"prompt": "1+2=", "chosen": "3", "rejected": "4"}) + "\n")
    held.write_text(json.dumps({"prompt": "5*5=", "chosen": "25", "rejected": "x"}) + "\n")
    spec = PairSpec(task=None, seed=0, dataset=str(train), eval_dataset=str(held))
    rows, eval_rows, alphabet = preference_data(spec, None, None)
    assert (len(rows), len(eval_rows), alphabet) == (1, 1, "*+12345=x")


def test_eval_reward_without_pairs_still_names_what_is_missing():
    """task=None and no eval_dataset: the error names the missing pairs, not an empty alphabet."""
    from grpokit.config.plan import PairSpec
    from grpokit.train.reward import preference_data

    assert preference_data(PairSpec(task=None, seed=0), [], None) == ([], [], None)
