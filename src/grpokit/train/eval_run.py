"""`grpokit eval`: a policy's held-out metrics, its data, rewards, model and engine resolved as a
training run resolves them (train/inputs.py)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

import torch

from ..config.plan import GRPOPlan
from ..data import render_prompt
from ..engine import PolicyEngine
from ..models import enable_fast_matmul, place, resolve_device
from ..ops import grpo_loss
from .batch import merge_groups
from .draw import StepPrompts, score_rollout
from .evaluation import greedy_completions
from .grpo_setup import sampling_params
from .inputs import (
    RunData,
    UserInputs,
    held_out_metrics,
    precision_of,
    probe_engine,
    resolve_data,
    tiny_context,
)
from .run import check_known_characters, policy_and_tokenizer, policy_tokenizer
from .trainee import StepParams


def evaluate_policy(plan: GRPOPlan, server: str | None = None) -> dict[str, float]:
    """Greedy accuracy (exact answer: the task's, or an `answer` column's), mean reward of the plan's
    reward functions (else the task's, else correctness) and pass@k, on the task's held-out prompts or
    on eval_dataset (else dataset's dataset_test_split, if it has one, else dataset). `plan`:
    `config.plan.eval_plan`'s (evaluation trains nothing, so its rows need no answers). `server`: a
    `grpokit serve-policy` URL that samples instead (the model is not loaded: its tokenizer is, and
    checked against the server's)."""
    if server is None:
        engine, data = policy_engine(plan)
        return held_out_metrics(engine, data, plan.evaluation)
    remote, data = _on_server(plan, server)
    try:
        return held_out_metrics(remote, data, plan.evaluation)
    finally:
        remote.close()


@dataclass(frozen=True)
class ServerSamples:
    """Greedy completions of the first held-out prompts, sampled on a server (the report shows them)."""

    url: str
    model: str
    version: int  # the server's weight version when they were sampled
    prompts: list[str]  # as the policy read them
    completions: list[str]
    rewards: list[float]  # the run's reward functions combined (NaN: unscorable)


def server_samples(plan: GRPOPlan, server: str, count: int) -> ServerSamples:
    """`count` held-out prompts' greedy completions from `server`, scored as evaluation scores them."""
    remote, data = _on_server(plan, server)
    try:
        probe = remote.probe(remote.urls[0])
        greedy = greedy_completions(remote, data.eval_task(count), plan.evaluation)
    finally:
        remote.close()
    rewards = greedy.scores.rewards.tolist()
    return ServerSamples(
        remote.urls[0], probe.model, probe.version, greedy.prompts, greedy.sampled.texts, rewards
    )


def _on_server(plan: GRPOPlan, server: str) -> tuple[Any, RunData]:
    """A RemotePolicy on `server` with the plan's tokenizer (checked against the server's), and the data."""
    from ..engine.remote import RemotePolicy

    data = resolve_data(plan.data, plan.episodes, plan.rewards, require_rewards=False, evaluate_only=True)
    if data.environment is not None:
        raise ValueError(
            "sampling on a server (--server) with multi-turn episodes (tools, an environment) is not "
            "supported: they run in process; leave out --server"
        )
    tokenizer = policy_tokenizer(plan.model, data.alphabet)
    return RemotePolicy((server,), tokenizer, plan.rollout.request_timeout), data


def evaluate_given(plan: GRPOPlan, given: UserInputs) -> dict[str, float]:
    """The held-out metrics of a policy given in Python (`GRPOTrainer.evaluate`): `given.model` with
    its tokenizer on `given.eval_rows`, scored by `given.reward_funcs`, sampled as training samples. The
    model is moved to the plan's device and precision, as a run moves it."""
    data = resolve_data(
        plan.data, plan.episodes, plan.rewards, given, require_rewards=False, evaluate_only=True
    )
    device = resolve_device(plan.trainee.placement.device)
    settings = plan.trainee.engine
    model = place(given.model, device, precision_of(settings))
    engine = probe_engine(settings, model, given.tokenizer, data, device)
    return held_out_metrics(engine, data, plan.evaluation) | {"loss": held_out_loss(engine, data, plan)}


def held_out_loss(engine: PolicyEngine, data: RunData, plan: GRPOPlan) -> float:
    """The loss a training step would take on the held-out prompts (TRL's eval loss): G completions
    of each, sampled as training samples, scored by the run's reward functions into group advantages,
    and the step's loss (no reference: its KL term is absent) on the policy as it is, with no
    gradient. Rows a micro-batch at a time, each micro-batch's loss weighted as a step weighs it."""
    spec = plan.trainee.step
    params = StepParams.of(spec, sampling_params(plan.trainee.sampling, data))
    G = params.sampling.num_generations
    rows = list(data.eval_rows)
    schemas = engine.environment.tool_schemas if engine.environment is not None else None  # as training
    texts = [
        render_prompt(r[spec.prompt_column], engine.tokenizer, schemas, spec.chat_template_kwargs)
        for r in rows
    ]
    drawn = StepPrompts(rows=rows, texts=texts, drawn=list(range(len(rows))))
    rollout = engine.generate(texts, replace(params.sampling, seed=spec.seed), rows=rows)
    batch, _, _ = score_rollout(rollout, drawn, data.reward_funcs, spec, G, None, 0)
    pad = engine.tokenizer.pad_token_id
    batch = merge_groups([(batch, list(range(len(rows))))], G, pad).to(engine.device)
    loss = replace(params.loss, beta=0.0)  # (no reference here)
    micro, B = spec.micro_batch_size, batch.completion_ids.shape[0]
    weight = 1.0 if loss.variant.global_normaliser else 1.0 / -(-B // micro)  # as a step weighs them
    total = 0.0
    with torch.no_grad():
        for start in range(0, B, micro):
            part = slice(start, start + micro)
            out = grpo_loss(
                engine.logps(batch, part, entropy=False).logps,
                batch.advantages[part],
                batch.completion_mask[part],
                num_items_in_batch=batch.completion_mask.sum(),
                **asdict(loss),
            )
            total += float(out.loss) * weight
    return total


def policy_engine(plan: GRPOPlan) -> tuple[PolicyEngine, RunData]:
    """The plan's policy in an engine that only generates, on its device and in its precision, as
    training samples (`grpokit eval`, `grpokit serve-policy`), and the run's data (model: tiny is made
    to fit its prompts)."""
    data = resolve_data(plan.data, plan.episodes, plan.rewards, require_rewards=False, evaluate_only=True)
    context = tiny_context(plan.data.prompt_column, data)  # model: tiny's, made to fit the prompts
    model, tokenizer = policy_and_tokenizer(plan.model, data.alphabet, context)
    device = resolve_device(plan.trainee.placement.device)
    enable_fast_matmul(device)  # TF32 matmuls on a GPU
    settings = plan.trainee.engine
    model = place(model, device, precision_of(settings))  # weights as training keeps them
    # a checkpoint's character tokenizer would read characters it never learned as <unk>
    columns = [plan.data.prompt_column]
    check_known_characters(tokenizer, plan.model.name, [(data.eval_source, data.eval_rows)], columns)
    return probe_engine(settings, model, tokenizer, data, device), data  # sampling as training's does
