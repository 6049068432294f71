"""transformers' `generate` as a test reference for grpokit's decode loop (not part of the package):
the same processors, the same masks, and the log-probability of each drawn token under the processed
distribution, recorded by a logits processor placed after all others."""

from __future__ import annotations

from typing import Any

import torch

from grpokit.models import model_device
from grpokit.rollout import Rollout, SamplingParams, tokenize_prompts
from grpokit.rollout.decode import eos_and_pad


def completion_mask_from_ids(
    completion_ids: torch.Tensor, eos_token_ids: list[int], stop_ends: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mask and truncation flags of one-turn completions, from their ids alone. [B, T] -> ([B, T], [B])

    A row ends at its first EOS, which counts; or where a stop string completed (`stop_ends` [B],
    exclusive, −1 = none), whichever comes first. A row with neither was cut by max_completion_length:
    all its tokens count and it is flagged truncated. (The decode loop records the same as it draws.)
    """
    B, T = completion_ids.shape
    positions = torch.arange(T).expand(B, T)  # [B, T]
    is_eos = torch.isin(completion_ids, torch.tensor(eos_token_ids))  # [B, T]
    end = torch.where(is_eos, positions + 1, T).amin(-1)  # [B] exclusive; T when no EOS
    stopped = torch.zeros(B, dtype=torch.bool) if stop_ends is None else stop_ends >= 0  # [B]
    if stop_ends is not None:
        end = torch.where(stopped, torch.minimum(end, stop_ends), end)
    return positions < end[:, None], ~is_eos.any(-1) & ~stopped


class _Recorder:
    """LogitsProcessor: log π_sample(token_t) of every generated token, O(B·V) memory."""

    def __init__(self) -> None:
        self.previous: torch.Tensor | None = None  # [B, V] log-softmax of the last processed scores
        self.logps: list[torch.Tensor] = []  # T × [B]

    def _collect(self, ids: torch.Tensor) -> None:
        if self.previous is not None:
            self.logps.append(self.previous.gather(-1, ids[:, -1:]).squeeze(-1))

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self._collect(input_ids)
        self.previous = torch.log_softmax(scores.float(), dim=-1)
        return scores


def _processors(params: SamplingParams, recorder: _Recorder) -> Any:
    from transformers import (
        LogitsProcessorList,
        MinPLogitsWarper,
        RepetitionPenaltyLogitsProcessor,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    chain: list[Any] = []
    if params.repetition_penalty != 1.0:
        chain.append(RepetitionPenaltyLogitsProcessor(params.repetition_penalty))
    if params.temperature > 0.0:
        if params.temperature != 1.0:
            chain.append(TemperatureLogitsWarper(params.temperature))
        if params.top_k:
            chain.append(TopKLogitsWarper(params.top_k))
        if params.top_p < 1.0:
            chain.append(TopPLogitsWarper(params.top_p))
        if params.min_p:
            chain.append(MinPLogitsWarper(params.min_p))
    return LogitsProcessorList([*chain, recorder])


def reference_generate(model: Any, tokenizer: Any, prompts: list[str], params: SamplingParams) -> Rollout:
    """G completions per prompt by `model.generate` (no stop strings), as a Rollout."""
    assert not params.stop_strings, "the reference covers EOS only"
    ids, mask, truncated_prompts = tokenize_prompts(tokenizer, prompts, params)
    eos, pad = eos_and_pad(model, tokenizer)
    G, device = params.num_generations, model_device(model)
    ids, mask = ids.repeat_interleave(G, dim=0), mask.repeat_interleave(G, dim=0)  # [B, Lp]
    recorder = _Recorder()
    greedy = params.temperature == 0.0
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[] if device.type == "cpu" else [device]):
            if params.seed is not None:
                torch.manual_seed(params.seed)
            out = model.generate(
                input_ids=ids.to(device),
                attention_mask=mask.long().to(device),
                max_new_tokens=params.max_completion_length,
                do_sample=not greedy,
                temperature=None if greedy else 1.0,
                top_p=None if greedy else 1.0,
                top_k=None if greedy else 0,
                pad_token_id=pad,
                eos_token_id=eos,
                logits_processor=_processors(params, recorder),
                return_dict_in_generate=True,
            )
    finally:
        model.train(was_training)
    sequences = out.sequences.cpu()  # [B, Lp + T]
    recorder._collect(sequences)
    tokens = sequences[:, ids.shape[1] :]  # [B, T]
    logps = torch.stack(recorder.logps, dim=1).cpu()  # [B, T]
    completion_mask, truncated = completion_mask_from_ids(tokens, eos)
    return Rollout(
        prompt_ids=ids,
        prompt_mask=mask,
        completion_ids=tokens,
        completion_mask=completion_mask,
        truncated=truncated,
        sampling_logps=torch.where(completion_mask, logps, 0.0),
        completions=tokenizer.batch_decode(
            torch.where(completion_mask, tokens, pad), skip_special_tokens=True
        ),
        num_generations=G,
        num_truncated_prompts=truncated_prompts,
    )
