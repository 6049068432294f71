"""Run under torchrun (1 or 2 processes): one optimizer update on a fixed global batch, for each
case; rank 0 saves the accumulated gradients (before the optimizer) and the updated weights, whole,
to OUT/<case>-ws<world>.pt. The test compares world sizes. A fixed batch (not sampled) isolates the
distributed update from sampling.

Everything runs in float64: what the test is about (normalisers, gradient averaging, sharding) must
agree to the last bits, and float64 round-off of a different summation order (1e-16 relative) stays
far below any tolerance the test uses on every CPU instruction set, where float32's (1e-7) does not
once Adam's first step divides near-zero gradients by their own magnitude (see the test)."""

from __future__ import annotations

import sys
from dataclasses import replace
from typing import Any

import torch

from grpokit.config import GRPOConfig, RewardConfig
from grpokit.config.plan import grpo_plan
from grpokit.models import build_policy, build_reward_model, char_tokenizer
from grpokit.ops import HeadStates
from grpokit.train import distributed
from grpokit.train.batch import Batch
from grpokit.train.batch_source import InProcess
from grpokit.train.before_update import LogpsBeforeUpdate
from grpokit.train.grpo_setup import build_trainee
from grpokit.train.inputs import RunData
from grpokit.train.reward import reward_step
from grpokit.train.update import optimizer_step

TOK = char_tokenizer("0123456789+=")
B, T, LP = 8, 5, 3  # global rows (2 prompts × 4 completions), completion and prompt widths


def fixed_batch() -> tuple[Batch, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    lengths = torch.tensor([5, 3, 1, 4, 5, 2, 5, 4])
    batch = Batch(
        prompt_ids=torch.randint(4, 16, (B, LP), generator=g),
        prompt_mask=torch.ones(B, LP, dtype=torch.bool),
        completion_ids=torch.randint(4, 16, (B, T), generator=g),
        completion_mask=torch.arange(T)[None] < lengths[:, None],
        advantages=torch.randn(B, generator=g),
        sampling_logps=torch.zeros(B, T),
        prompts=[""] * B,
        completions=[""] * B,
        rewards=torch.zeros(B),
    )
    ref = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3  # reference log-probs
    return replace(batch, advantages=batch.advantages.double()), ref


def shard(batch: Batch, rows: slice) -> Batch:
    return Batch(
        batch.prompt_ids[rows],
        batch.prompt_mask[rows],
        batch.completion_ids[rows],
        batch.completion_mask[rows],
        batch.advantages[rows],
        batch.sampling_logps[rows],
        batch.prompts[rows],
        batch.completions[rows],
        batch.rewards[rows],
    )


def teacher_logits() -> torch.Tensor:
    """A fixed teacher's logits over the whole vocabulary at every completion position, [B, T, V] float64
    (gkd's teacher states with no head: the logits themselves)."""
    return torch.randn(B, T, len(TOK), generator=torch.Generator().manual_seed(11), dtype=torch.float64) * 2


def grpo_case(d: distributed.Dist, loss_type: str, strategy: str, out: str, offload: bool = False) -> None:
    gkd = loss_type == "gkd"  # the divergence to a teacher: no reference term, the teacher's logits fixed
    cfg = GRPOConfig(
        device="cpu",  # where `main` put this rank (gloo): the policy must not go to a GPU
        loss_type=loss_type,
        strategy=strategy,
        fsdp_cpu_offload=offload,
        beta=0.0 if gkd else 0.04,
        teacher_model="teacher" if gkd else None,  # (not loaded here: its logits are given below)
        learning_rate=1e-2,
        lr_scheduler_type="constant",
        prompts_per_step=2,
        num_generations=4,
        micro_batch_size=2,
        max_completion_length=T,
        # one process would otherwise take the lean forward and two processes transformers' (DDP and
        # FSDP need the whole model's forward): equal to float32 round-off, which Adam's first step
        # (g / (|g| + eps)) magnifies for near-zero gradients. The same forward on both sides
        # isolates what this test is about, the world size; the lean forward has its own parity tests.
        fused_logps=False,
    )
    model = build_policy(
        hidden_size=16,
        num_layers=2,
        num_heads=2,
        vocab_size=len(TOK),
        dropout=0.0,
        max_seq_len=32,
        seed=0,
        intermediate_size=32,
    ).double()
    data = RunData([], [], [lambda *a, **k: []], None, None, None, T)
    trainee = build_trainee(grpo_plan(cfg).trainee, model, TOK, data, InProcess(), d)  # float64: not placed
    batch, ref = fixed_batch()
    per_rank = B // d.world_size
    rows = slice(d.rank * per_rank, (d.rank + 1) * per_rank)
    engine = trainee.engine
    teacher = HeadStates(teacher_logits()[rows]) if gkd else None
    frozen = LogpsBeforeUpdate(old=None, ref=None if gkd else ref[rows], weights=None, teacher_states=teacher)
    optimizer_step(engine, trainee.update, shard(batch, rows), frozen, trainee.params, d)
    result = {
        "weights": distributed.full_state_dict(d, engine.train_module),
        "grads": full_grads(engine.train_module),
    }
    if d.is_main:
        name = f"{strategy}_offload" if offload else strategy
        torch.save(result, f"{out}/grpo-{loss_type}-{name}-ws{d.world_size}.pt")


def full_grads(model: Any) -> dict[str, torch.Tensor]:
    """Every parameter's gradient as applied (after averaging over ranks and clipping), whole:
    FSDP's sharded gradients are gathered (a collective: every rank calls this)."""
    grads = {}
    for name, p in distributed.unwrap(model).named_parameters():
        g = p.grad
        grads[name] = (g.full_tensor() if hasattr(g, "full_tensor") else g).detach().cpu().clone()
    return grads


def reward_case(d: distributed.Dist, strategy: str, out: str) -> None:
    pairs = [
        {"prompt": f"{i}+{i}=", "chosen": str(2 * i), "rejected": str(2 * i + 1 + i % 3)} for i in range(8)
    ]
    cfg = RewardConfig(
        device="cpu",
        batch_size=8 // d.world_size,
        micro_batch_size=2,
        learning_rate=1e-2,
        max_length=32,
        strategy=strategy,
    )
    model = build_reward_model(
        hidden_size=16,
        num_layers=2,
        num_heads=2,
        vocab_size=len(TOK),
        max_seq_len=32,
        seed=0,
        intermediate_size=32,
    ).double()
    model = distributed.wrap(d, model, strategy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    per_rank = len(pairs) // d.world_size
    reward_step(cfg, model, TOK, pairs[d.rank * per_rank : (d.rank + 1) * per_rank], opt, sched)
    result = {"weights": distributed.full_state_dict(d, model), "grads": full_grads(model)}
    if d.is_main:
        torch.save(result, f"{out}/reward-{strategy}-ws{d.world_size}.pt")


def main() -> None:
    out = sys.argv[1]
    # gloo on the CPU whatever the machine: the models here are built on the CPU in float64; on a machine
    # with a GPU, device=auto would start NCCL on it (and with more ranks than GPUs fall back to the CPU
    # only because NCCL cannot hold two ranks on one GPU), so which backend ran would depend on the machine
    d = distributed.init(device="cpu")
    for strategy in ("ddp", "fsdp"):
        for loss_type in ("dapo", "grpo", "dr_grpo", "gkd"):
            grpo_case(d, loss_type, strategy, out)
        reward_case(d, strategy, out)
    grpo_case(d, "dapo", "fsdp", out, offload=True)
    if d.is_main:  # the starting point, to check that the update moved the weights
        torch.save(
            build_policy(
                hidden_size=16,
                num_layers=2,
                num_heads=2,
                vocab_size=len(TOK),
                dropout=0.0,
                max_seq_len=32,
                seed=0,
                intermediate_size=32,
            )
            .double()
            .state_dict(),
            f"{out}/initial.pt",
        )
    distributed.shutdown(d)


if __name__ == "__main__":
    main()
