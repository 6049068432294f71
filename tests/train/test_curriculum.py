"""The difficulty curriculum (`curriculum: true`, data/curriculum.py): hand-built rewards move prompts
between the pools exactly as specified, set-aside prompts come back with the revisit probability, the
state survives a checkpoint file and a resumed run is bitwise the uninterrupted one, it composes with
dynamic sampling, and bad option values are one line."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from grpokit.config import ConfigError, GRPOConfig
from grpokit.config.load import load_config
from grpokit.data import Curriculum, CurriculumRule, PromptSampler
from grpokit.data.curriculum import ACTIVE, FAILED, SOLVED
from grpokit.train.checkpoint import list_checkpoints
from grpokit.train.grpo import train_grpo
from tests.helpers import read_steps, tiny_run
from tests.train.helpers import tiny_config, weights

ONES, ZEROS, MIXED = [1.0] * 4, [0.0] * 4, [0.0, 1.0, 0.0, 1.0]  # a group of G = 4 rewards


def visit(curriculum: Curriculum, groups: dict[int, list[float]]) -> None:
    """One batch: prompt -> its group's rewards; a group is equal when its scored rewards are (NaN:
    unscored), as `group_advantages` finds it."""
    equal = [len({r for r in g if not math.isnan(r)}) == 1 for g in groups.values()]
    curriculum.record(list(groups), list(groups.values()), equal)


# ----------------------------------------------------------------------------- the pools


def test_hand_built_rewards_move_prompts_between_pools_exactly_as_specified():
    c = Curriculum(4, CurriculumRule(patience=2, revisit=0.1), floor=1, seed=0)
    # 1: one visit is not a streak of 2: every prompt stays active
    visit(c, {0: ONES, 1: ZEROS, 2: MIXED, 3: ONES})
    assert c.pool == [ACTIVE] * 4 and c.streak == [1, -1, 0, 1]
    # 2: two all-correct visits in a row set 0 aside as solved, two all-wrong 1 as failed; 3's streak
    # of solved visits is broken by spread
    visit(c, {0: ONES, 1: ZEROS, 2: ONES, 3: MIXED})
    assert c.pool == [SOLVED, FAILED, ACTIVE, ACTIVE] and c.streak == [2, -2, 1, 0]
    assert c.metrics() == {"curriculum/active": 0.5, "curriculum/solved": 0.25, "curriculum/failed": 0.25}
    # 3: revisited, 0 is solved again (stays aside, the streak capped at k); 1 now has spread (back to
    # active); 2's solved streak is broken by a failed visit
    visit(c, {0: ONES, 1: MIXED, 2: ZEROS})
    assert c.pool == [SOLVED, ACTIVE, ACTIVE, ACTIVE] and c.streak == [2, 0, -1, 0]
    # 4: the policy changed on 0 (all wrong): back to active; 2 failed twice in a row: failed
    visit(c, {0: ZEROS, 2: ZEROS})
    assert c.pool == [ACTIVE, ACTIVE, FAILED, ACTIVE] and c.streak == [-1, 0, -2, 0]
    # 5: 0 failed again: straight from one pool to the other is possible only through k visits
    visit(c, {0: ZEROS, 2: ONES})
    assert c.pool == [FAILED, ACTIVE, ACTIVE, ACTIVE] and c.streak == [-2, 0, 1, 0]
    assert c.visits == 4 + 4 + 3 + 2 + 2 and c.counts == [3, 0, 1]


def test_patience_one_sets_aside_on_the_first_zero_spread_visit():
    c = Curriculum(3, CurriculumRule(patience=1, revisit=0.0), floor=1, seed=0)
    visit(c, {0: ONES, 1: ZEROS, 2: MIXED})
    assert c.pool == [SOLVED, FAILED, ACTIVE]


def test_solved_and_failed_are_judged_against_the_range_of_rewards_seen():
    """Any reward: the upper half of the rewards seen so far is solved, the lower half failed; before
    any two rewards differed, an all-equal group is failed; a group nothing scored is no visit."""
    c = Curriculum(6, CurriculumRule(patience=1, revisit=0.0), floor=1, seed=0)
    visit(c, {0: [2.0] * 4})  # the only reward seen so far: nothing has been seen to score better
    assert c.pool[0] == FAILED and (c.low, c.high) == (2.0, 2.0)
    visit(c, {1: [-1.0, 2.0, 2.0, 2.0]})  # the range is now [-1, 2]: midpoint 0.5
    assert c.pool[1] == ACTIVE
    visit(c, {2: [0.75] * 4, 3: [0.25] * 4, 4: [0.5] * 4})  # partial credit, and exactly the midpoint
    assert c.pool[2:5] == [SOLVED, FAILED, SOLVED]
    nan = float("nan")
    visit(c, {5: [nan] * 4})  # unscored: no visit (the streak and the count stay)
    assert c.pool[5] == ACTIVE and c.streak[5] == 0 and c.visits == 5
    visit(c, {5: [nan, 2.0, 2.0, 2.0]})  # judged on the scored rewards
    assert c.pool[5] == SOLVED and (c.low, c.high) == (-1.0, 2.0)


def test_the_range_includes_the_batch_being_judged():
    """A batch whose groups are each all-equal but differ from one another is judged against itself."""
    c = Curriculum(2, CurriculumRule(patience=1, revisit=0.0), floor=0, seed=0)
    visit(c, {0: ONES, 1: ZEROS})
    assert c.pool == [SOLVED, FAILED]


def test_the_active_pool_never_shrinks_below_one_step():
    c = Curriculum(5, CurriculumRule(patience=1, revisit=0.0), floor=3, seed=0)
    visit(c, {0: MIXED, 1: ONES, 2: ONES, 3: ZEROS, 4: ONES})  # four would leave; two may
    assert c.pool == [ACTIVE, SOLVED, SOLVED, ACTIVE, ACTIVE] and c.counts[ACTIVE] == 3
    assert c.streak == [0, 1, 1, -1, 1]  # 3 and 4 keep their streaks: they leave once room is made
    visit(c, {1: MIXED})
    visit(c, {4: ONES})
    assert c.pool == [ACTIVE, ACTIVE, SOLVED, ACTIVE, SOLVED]
    sampler = PromptSampler([{"p": i} for i in range(5)], 3, seed=0, curriculum=CurriculumRule(1, 0.0))
    sampler.curriculum = c
    for _ in range(6):  # revisit 0: only the three active prompts, each batch three distinct ones
        assert sorted(r["p"] for r in sampler.next_batch()) == [0, 1, 3]


# ----------------------------------------------------------------------------- revisits


def set_aside(sampler: PromptSampler, keep: int) -> None:
    """Every prompt from `keep` on solved (patience 1); the first `keep` seen with spread."""
    n = len(sampler.rows)
    sampler.record(range(n), [MIXED] * keep + [ONES] * (n - keep), [False] * keep + [True] * (n - keep))


@pytest.mark.parametrize("p", [0.0, 0.2, 1.0])
def test_set_aside_prompts_are_revisited_with_probability_p(p):
    rows = [{"p": i} for i in range(1000)]
    sampler = PromptSampler(rows, 10, seed=5, curriculum=CurriculumRule(patience=1, revisit=p))
    set_aside(sampler, keep=10)
    c = sampler.curriculum
    assert c is not None and c.counts == [10, 990, 0]
    drawn = [r["p"] for _ in range(150) for r in sampler.next_batch()]
    # the walk takes exactly what each epoch offers: every active prompt, each set-aside one whose coin
    # for that epoch is below p, in the epoch's shuffled order
    offered = []
    for epoch in range(sampler.epoch + 1):
        sampler.epoch = epoch
        offered += [i for i in sampler._order() if c.offers(i, epoch)]
    assert drawn == offered[: len(drawn)]
    epochs = sampler.epoch  # whole epochs walked
    revisits = sum(c.coins(e)[i] < p for e in range(epochs) for i in range(10, 1000))
    share = revisits / (990 * epochs)
    if p in (0.0, 1.0):
        assert share == p
    else:  # binomial: 3 epochs of 990 draws, sd 0.0073
        assert epochs >= 3 and abs(share - p) < 0.03, (share, epochs)
    assert all(drawn.count(i) >= epochs for i in range(10))  # the active ones, once an epoch


def test_revisit_coins_come_from_the_seed():
    rule = CurriculumRule(patience=1, revisit=0.3)
    a, b, c = (Curriculum(200, rule, floor=1, seed=s) for s in (1, 1, 2))
    assert a.coins(0) == b.coins(0) and a.coins(3) == b.coins(3)
    assert a.coins(0) != c.coins(0) and a.coins(0) != a.coins(1)


def test_a_curriculum_with_every_prompt_active_draws_what_no_curriculum_draws():
    """Until a prompt is set aside nothing changes: the same batches, bit for bit."""
    rows = [{"p": i} for i in range(7)]
    plain = PromptSampler(rows, 3, seed=4)
    curious = PromptSampler(rows, 3, seed=4, curriculum=CurriculumRule(patience=2, revisit=0.0))
    for _ in range(10):
        assert plain.next_batch() == curious.next_batch()
        curious.record(curious.last_indices, [MIXED] * 3, [False] * 3)
    assert "curriculum" not in plain.state_dict()  # the state of a run without it is as before


# ----------------------------------------------------------------------------- state


def test_the_state_round_trips_through_a_checkpoint_file(tmp_path):
    rows = [{"p": i} for i in range(12)]
    rule = CurriculumRule(patience=2, revisit=0.25)
    a = PromptSampler(rows, 4, seed=9, curriculum=rule)
    for step in range(29):  # a mix of outcomes, by prompt and step
        a.next_batch()
        groups = [[ONES, ZEROS, MIXED][(i + step // 10) % 3] for i in a.last_indices]
        a.record(a.last_indices, groups, [g != MIXED for g in groups])
    state = a.state_dict()
    assert {SOLVED, FAILED} <= set(state["curriculum"]["pool"])  # some prompts are set aside
    torch.save(state, tmp_path / "state.pt")
    loaded = torch.load(tmp_path / "state.pt", weights_only=True)  # as a checkpoint's state.pt is read
    b = PromptSampler(rows, 4, seed=9, curriculum=rule)
    b.load_state_dict(loaded)
    assert b.state_dict() == state and b.curriculum.counts == a.curriculum.counts
    for _ in range(20):
        assert a.next_batch() == b.next_batch()
        a.record(a.last_indices, [ONES] * 4, [True] * 4)
        b.record(b.last_indices, [ONES] * 4, [True] * 4)
    assert a.state_dict() == b.state_dict()
    # a copy: what the loop keeps to put back after an abandoned step does not move on with the sampler
    assert state != a.state_dict() and torch.load(tmp_path / "state.pt", weights_only=True) == state
    other = PromptSampler(rows[:10], 4, seed=9, curriculum=rule)
    with pytest.raises(ValueError, match="holds 12 prompts, this dataset 10"):
        other.load_state_dict(state)


# ----------------------------------------------------------------------------- in training

G = 4
ROWS = [{"prompt": f"{i}+{i}=", "answer": str(2 * i)} for i in range(8)]
# prompts 0-1: every completion right, 2-3: every one wrong, 4-7: half and half
KIND = {row["prompt"]: "solved" if i < 2 else "failed" if i < 4 else "mixed" for i, row in enumerate(ROWS)}


def by_prompt(prompts, completions, **_):
    """Rewards decided by the prompt and the completion's place in its group (rows p·G … p·G+G−1)."""
    kinds = [KIND[p] for p in prompts]
    return [1.0 if k == "solved" else 0.0 if k == "failed" else float(i % G) % 2 for i, k in enumerate(kinds)]


def train(tmp_path, name, on_event=None, **options):
    cfg = tiny_config(tmp_path / name, task=None, **options)
    train_grpo(cfg, train_rows=ROWS, eval_rows=ROWS[:4], reward_funcs=[by_prompt], on_event=on_event)
    return cfg


def saved_prompts(cfg) -> dict:
    state = torch.load(list_checkpoints(Path(cfg.output_dir))[-1] / "state.pt", weights_only=True)
    return state["prompts"]


def test_a_run_with_the_curriculum_resumes_bitwise(tmp_path):
    """5 steps straight against stopped after step 3 (last checkpoint: step 2, where prompts 0-3 have
    just been set aside) and resumed: the same weights, metrics and pools. A resume that lost the pools
    would draw the set-aside prompts again from step 3 on."""
    options = dict(max_steps=5, save_steps=2, curriculum=True, curriculum_patience=1, curriculum_revisit=0.5)
    straight = train(tmp_path, "a", **options)

    def stop_at_3(kind, step, data):
        if kind == "step" and step == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train(tmp_path, "b", on_event=stop_at_3, **options)
    at_2 = torch.load(tmp_path / "b" / "run" / "checkpoint-2" / "state.pt", weights_only=True)
    assert sorted(at_2["prompts"]["curriculum"]["pool"]) == [0, 0, 0, 0, 1, 1, 2, 2]  # 0-3 set aside
    events = []
    resumed = train(
        tmp_path, "b", on_event=lambda kind, step, data: events.append((kind, step)), resume=True, **options
    )
    assert ("resumed", 2) in events
    a, b = weights(Path(straight.output_dir)), weights(Path(resumed.output_dir))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    rows_straight, rows_resumed = read_steps(straight.output_dir), read_steps(resumed.output_dir)
    assert untimed(rows_straight) == untimed(rows_resumed)  # the pool shares included
    assert saved_prompts(straight) == saved_prompts(resumed)
    assert rows_straight[-1]["curriculum/active"] == 0.5


def untimed(rows: list[dict]) -> list[dict]:
    """Metrics rows without what depends on the clock."""
    clock = ("time", "timing", "tokens_per_second", "cpu_threads")
    return [{k: v for k, v in r.items() if not any(c in k for c in clock)} for r in rows]


def test_the_curriculum_composes_with_dynamic_sampling(tmp_path):
    """Both on: every generation batch dynamic sampling draws is recorded (resampled ones included), and
    once the zero-spread prompts are set aside a step needs one batch where dynamic sampling alone
    keeps drawing more."""
    options = dict(max_steps=6, dynamic_sampling=True, max_resample_batches=4, save_steps=0)
    both = train(tmp_path, "both", curriculum=True, curriculum_patience=1, curriculum_revisit=0.0, **options)
    alone = train(tmp_path, "alone", **options)
    rows_both, rows_alone = read_steps(both.output_dir), read_steps(alone.output_dir)
    batches_both = [r["num_generation_batches"] for r in rows_both]
    batches_alone = [r["num_generation_batches"] for r in rows_alone]
    state = saved_prompts(both)["curriculum"]
    assert state["visits"] == 4 * sum(batches_both)  # P groups a batch, every batch a visit
    assert sorted(state["pool"]) == [0, 0, 0, 0, 1, 1, 2, 2]
    # from the step after every prompt was seen once: one batch of four informative groups
    seen = next(i for i, r in enumerate(rows_both) if r["curriculum/active"] == 0.5)
    assert all(b == 1 for b in batches_both[seen + 1 :]) and seen + 1 < len(batches_both)
    assert all(r["frac_reward_zero_std"] == 0.0 for r in rows_both[seen + 1 :])
    assert sum(batches_both) < sum(batches_alone), (batches_both, batches_alone)
    assert all(r["frac_reward_zero_std"] > 0 for r in rows_alone[seen + 1 :])  # alone they keep coming
    assert "curriculum/active" not in rows_alone[0]


def test_the_pool_metrics_are_shares_of_the_dataset(tmp_path):
    cfg = train(tmp_path, "m", max_steps=3, curriculum=True, curriculum_patience=1, curriculum_revisit=0.0)
    rows = read_steps(cfg.output_dir)
    for row in rows:
        shares = [row[f"curriculum/{pool}"] for pool in ("active", "solved", "failed")]
        assert math.isclose(sum(shares), 1.0) and all(s * 8 == int(s * 8) for s in shares)
    assert rows[-1]["curriculum/solved"] == rows[-1]["curriculum/failed"] == 0.25


# ----------------------------------------------------------------------------- options


@pytest.mark.parametrize(
    ("override", "text"),
    [
        ("curriculum_patience=0", "curriculum_patience: Input should be greater than or equal to 1 (got 0)"),
        ("curriculum_patience=1.5", "curriculum_patience: Input should be a valid integer"),
        (
            "curriculum_revisit=1.5",
            "curriculum_revisit: Input should be less than or equal to 1 (got 1.5); "
            "allowed: 0 ≤ curriculum_revisit ≤ 1",
        ),
        ("curriculum_revisit=-0.1", "allowed: 0 ≤ curriculum_revisit ≤ 1"),
        ("curriculum_revisit=.nan", "curriculum_revisit: Input should be a finite number"),
        ("curriculum=maybe", "curriculum: Input should be a valid boolean"),
        ("curriculum_revist=0.2", "did you mean 'curriculum_revisit'?"),
    ],
)
def test_bad_option_values_are_refused_in_one_line(override, text):
    with pytest.raises(ConfigError) as caught:
        load_config(GRPOConfig, None, [override])
    header, *lines = str(caught.value).splitlines()
    assert len(lines) == 1 and text in lines[0], str(caught.value)


@pytest.mark.parametrize(("patience", "revisit"), [(0, 0.1), (2, 1.01), (2, -0.5), (1.5, 0.1)])
def test_the_rule_refuses_bad_values_from_python_too(patience, revisit):
    with pytest.raises(ValueError, match="curriculum_(patience|revisit) must be"):
        CurriculumRule(patience, revisit)


def test_the_options_reach_the_sampler(tmp_path):
    from grpokit.config.plan import step_spec
    from grpokit.train.grpo_setup import curriculum_rule

    cfg = GRPOConfig(curriculum=True, curriculum_patience=3, curriculum_revisit=0.05)
    assert curriculum_rule(step_spec(cfg)) == CurriculumRule(patience=3, revisit=0.05)
    assert curriculum_rule(step_spec(GRPOConfig(curriculum_patience=3))) is None


REWARD_FILE = """
KIND = {f"{i}+{i}=": "solved" if i < 2 else "failed" if i < 4 else "mixed" for i in range(8)}


def by_prompt(prompts, completions, **_):
    kinds = [KIND[p] for p in prompts]
    return [1.0 if k == "solved" else 0.0 if k == "failed" else float(i % 4 % 2) for i, k in enumerate(kinds)]
"""


@pytest.mark.slow
def test_two_processes_keep_the_same_pools_from_both_halves_of_a_step(tmp_path):
    """Under torchrun each rank scores its own half of the step's prompts; the curriculum records both
    halves on every rank: the pools set aside every zero-spread prompt, and the ranks agree (the logged
    shares, averaged over ranks, are those of one set of pools)."""
    from tests.distributed.test_world_size import torchrun

    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    (tmp_path / "reward.py").write_text(REWARD_FILE)
    out = tmp_path / "run"
    torchrun(
        2,
        "-m",
        "grpokit",
        "train",
        f"output_dir={out}",
        *(
            "device=cpu",
            "task=null",
            f"dataset={tmp_path / 'rows.jsonl'}",
            f"reward_funcs={tmp_path}/reward.py:by_prompt",
        ),
        *tiny_run("num_eval_prompts", "log_completions_steps", max_steps=4),
        *("curriculum=true", "curriculum_patience=1", "curriculum_revisit=0.0"),
    )
    state = torch.load(out / "checkpoint-4" / "state.pt", weights_only=True)["prompts"]["curriculum"]
    assert sorted(state["pool"]) == [0, 0, 0, 0, 1, 1, 2, 2] and state["visits"] == 16
    rows = read_steps(out)
    assert [r["curriculum/active"] for r in rows[2:]] == [0.5, 0.5]
