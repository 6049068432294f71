"""The policy engine: one object that owns the policy being trained, its device and precision, how it
generates and how its log-probs are taken.

The training step talks to it in three calls and never sees what is underneath:

* `generate(prompts, params) -> Rollout`: G completions per prompt (the decode loop is chosen once:
  grpokit's KV-cached loop over the lean Llama forward, or transformers' generate);
* `logps(batch, rows, entropy=...) -> TokenLogps`: log-probs of the completion tokens of some rows under
  the policy, differentiable (the training forward);
* `frozen_logps(batch, micro, reference=...) -> [B, T]`: the same without gradients, under the policy
  as it is (old-policy log-probs) or under the reference policy.

The log-prob backend is chosen once too: hidden states and the LM head taken chunk by chunk
(`ops.linear_logps`, no [B, T, V] logits) when the model has a plain linear head and is not wrapped
for data parallelism (DDP's and FSDP's hooks live in the whole model's forward); within it, the lean
Llama decoder shares each prompt's keys and values across its G completions. Otherwise the model's
own logits.

Precision (`Precision`): the policy's weights are stored in `precision.master` and every forward
pass runs under autocast in `precision.compute`; the log-softmax, log-probs and loss stay float32.
The reference is a copy of the policy in the same storage, so at step 0 both give bit-identical
log-probs and the KL term starts at exactly 0.

`rollout` (the decode loops) is imported when an engine is made: the decode loops build on this
package's decoders, and the engine joins the two.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from collections.abc import Callable
from typing import Any, Protocol

import torch

from ..ops import TokenLogps, linear_logps, token_logps, token_logps_and_entropy
from ..models.device import Precision
from ..models.head import LMHead, last_hidden_states, lm_head_of
from ..models.lean_llama import LeanLlamaDecoder
from ..models.lora import reference_model


class Sequences(Protocol):
    """What log-probs are taken over: prompts and completions, B rows (a Rollout or a training Batch)."""

    prompt_ids: torch.Tensor  # [B, Lp] left-padded
    prompt_mask: torch.Tensor  # [B, Lp] bool
    completion_ids: torch.Tensor  # [B, T]
    completion_mask: torch.Tensor  # [B, T] bool: the tokens that carry loss
    # [B, T] bool: the tokens attended to (policy and environment); None: completion_mask (one turn)
    completion_attention: torch.Tensor | None


@dataclass(frozen=True)
class EngineSpec:
    """How the engine runs the policy: resolved once from the config (`config.plan`)."""

    device: torch.device
    precision: Precision = field(default_factory=Precision)
    decode_loop: str = "auto"  # eager, static, compiled, cuda_graph, or auto (by device)
    fused_logps: bool = True  # log-probs from hidden states and the head, no [B, T, V] logits
    temperature: float = 1.0  # log-probs are taken at the sampling temperature
    group_size: int = 1  # G: rows come in groups sharing a prompt (prefix sharing when checked true)


@dataclass(frozen=True)
class Wrapping:
    """The policy wrapped for data parallelism: DDP's wrapper, or under FSDP2 the module itself
    (sharded in place), and under FSDP the decode loop's early exit decided by every rank together."""

    train_module: torch.nn.Module  # what training passes go through
    lockstep: Callable[[bool], bool] | None = None  # FSDP: done on this rank -> done on every rank


@dataclass
class PolicyEngine:
    """The policy on its device, in its precision. Build with `PolicyEngine.create`."""

    module: torch.nn.Module  # the policy itself: what is sampled from and saved
    tokenizer: Any
    device: torch.device
    precision: Precision
    sampler: Any  # a rollout.Sampler over `module`
    reference: torch.nn.Module | None  # frozen π_ref; None when beta = 0 or for LoRA (adapters off)
    train_module: torch.nn.Module  # what training passes go through: `module`, or its DDP/FSDP wrapper
    distributed: bool = False  # wrapped for data parallelism (DDP, or FSDP2, which wraps in place)
    temperature: float = 1.0  # log-probs are taken at the sampling temperature (1 for greedy)
    group_size: int = 1  # G: rows come in groups sharing a prompt (prefix sharing when checked true)
    frozen_mode: Any = torch.inference_mode  # the gradient-free mode of frozen passes (see `create`)
    episodes: Any = None  # a rollout.EpisodeSampler over `module` for multi-turn episodes, else None
    environment: Any = None  # the envs.EnvironmentSpec of multi-turn episodes, else None (one turn)
    _head: LMHead | None = field(default=None, repr=False)  # the fused backend of the policy, if any
    _reference_head: LMHead | None = field(default=None, repr=False)

    @classmethod
    def create(
        cls,
        module: torch.nn.Module,
        tokenizer: Any,
        spec: EngineSpec,
        *,
        reference: torch.nn.Module | None = None,
        wrapping: Wrapping | None = None,
        environment: Any = None,
    ) -> PolicyEngine:
        """`module` (and `reference`) already on `spec.device` in `spec.precision.master`. `wrapping`:
        how the policy is wrapped for data parallelism (DDP, or FSDP2, which shards `module` in place),
        if it is; the fused backend is then off. `environment`: an `envs.EnvironmentSpec`: completions
        are then multi-turn episodes."""
        from ..rollout import SAMPLERS, EpisodeSampler, resolve_decode_loop

        wrapped = wrapping is not None
        lockstep = wrapping.lockstep if wrapping is not None else None
        train_module = wrapping.train_module if wrapping is not None else module
        sampler_model = train_module if lockstep is not None else module
        engine_sampler = SAMPLERS["kv"](sampler_model, tokenizer)
        # frozen passes: inference mode (cheapest per operation) on a plain module; no_grad through a
        # DDP/FSDP wrapper (FSDP's unsharded parameters must stay ordinary tensors)
        frozen_mode: Any = torch.no_grad if wrapped else torch.inference_mode
        if lockstep is not None:
            engine_sampler.sync_finished = lockstep
            engine_sampler.grad_free = torch.no_grad
        if hasattr(engine_sampler, "decode_loop"):
            loop = resolve_decode_loop(spec.decode_loop, spec.device)
            engine_sampler.decode_loop = "eager" if lockstep is not None else loop
        episodes = None
        if environment is not None:
            episodes = EpisodeSampler(sampler_model, tokenizer, environment)
            if lockstep is not None:
                episodes.sync_finished, episodes.grad_free = lockstep, torch.no_grad
        fused = spec.fused_logps and not wrapped
        return cls(
            module=module,
            tokenizer=tokenizer,
            device=spec.device,
            precision=spec.precision,
            sampler=engine_sampler,
            reference=reference,
            train_module=train_module,
            distributed=wrapped,
            temperature=spec.temperature,
            group_size=spec.group_size,
            frozen_mode=frozen_mode,
            episodes=episodes,
            environment=environment,
            _head=lm_head_of(module) if fused else None,
            _reference_head=lm_head_of(reference) if fused and reference is not None else None,
        )

    @property
    def fused(self) -> bool:
        """Whether log-probs come from hidden states and the LM head (no [B, T, V] logits)."""
        return self._head is not None

    def autocast(self) -> Any:
        return self.precision.autocast(self.device)

    @property
    def sampler_is_forward(self) -> bool:
        """Whether the decode loop's log-probs of its tokens equal this engine's forward pass to float32
        round-off, so that they can serve as old-policy log-probs. Only where that is tested and holds
        by construction: grpokit's KV-cached loop over the lean Llama decoder (rotary positions: a
        left-padding offset changes nothing), on one process, with no active dropout (the sampler runs
        in eval mode, training in train mode), in float32 without autocast, and no TF32 (a GPU's
        float32 matmuls then round to 10 bits, differently in the loop and the batched forward)."""
        head = self._head
        return (
            not self.distributed
            and head is not None
            and isinstance(head.decoder, LeanLlamaDecoder)
            and type(self.sampler).__name__ == "KVCacheSampler"
            and self.episodes is None  # multi-turn: observations are fed in chunks, another summation order
            and not self.sampler.has_dropout()
            and not self.precision.mixed
            and self.precision.compute == torch.float32
            and not (self.device.type == "cuda" and torch.backends.cuda.matmul.allow_tf32)
        )

    # ------------------------------------------------------------------ generation

    def generate(self, prompts: list[str], params: Any, rows: list[dict[str, Any]] | None = None) -> Any:
        """G completions for each prompt (a Rollout, on the host); with an environment, G episodes of
        each prompt, started from its row of `rows`."""
        with self.autocast():
            if self.episodes is not None:
                if rows is None:
                    raise ValueError("multi-turn episodes start from their dataset rows: pass rows=.")
                return self.episodes.sample(prompts, params, rows)
            return self.sampler.sample(prompts, params)

    # ------------------------------------------------------------------ log-probs

    def logps(self, batch: Sequences, rows: slice, *, entropy: bool) -> TokenLogps:
        """Log-probs (and entropies) of the completion tokens of `rows` under the policy, through the
        training forward (differentiable). [b, T]"""
        return self._stats(self.train_module, self._head, batch, rows, entropy)

    def frozen_logps(self, batch: Sequences, micro: int, *, reference: bool = False) -> torch.Tensor:
        """Log-probs under the policy as it is now, or under the reference, without gradients, `micro`
        rows a pass. [B, T] float32, an ordinary tensor (the loss may use it under autocast)."""
        B = batch.completion_ids.shape[0]
        with contextlib.ExitStack() as stack:
            if reference:
                model = stack.enter_context(reference_model(self.module, self.reference))
                head = self._reference_head if self.reference is not None else self._head
            else:
                model, head = self.train_module, self._head
            with self.frozen_mode():
                parts = [  # no entropies: nothing reads them for a frozen policy
                    self._stats(model, head, batch, slice(s, s + micro), entropy=False).logps
                    for s in range(0, B, micro)
                ]
        with torch.no_grad():
            return torch.cat(parts)  # outside inference mode: an ordinary tensor

    def _stats(
        self, model: Any, head: LMHead | None, batch: Sequences, rows: slice, entropy: bool
    ) -> TokenLogps:
        prompt_ids, prompt_mask = batch.prompt_ids[rows], batch.prompt_mask[rows]  # [b, Lp]
        targets = batch.completion_ids[rows]  # [b, T]
        # what the forward attends to: in a multi-turn transcript the environment's tokens too
        attention = getattr(batch, "completion_attention", None)  # (absent from older Sequences)
        attend = batch.completion_mask if attention is None else attention
        attended = attend[rows]  # [b, T]
        T = targets.shape[1]
        if head is None:  # the model's own logits
            ids = torch.cat([prompt_ids, targets], dim=1)  # [b, Lp+T]
            attention = torch.cat([prompt_mask, attended], dim=1).long()  # [b, Lp+T]
            with self.autocast():
                logits = model(input_ids=ids, attention_mask=attention, logits_to_keep=T + 1).logits
            logits = logits[:, :-1]  # [b, T, V]: position t scores targets[:, t]; float32 softmax below
            if entropy:
                return token_logps_and_entropy(logits, targets, self.temperature)
            logps = token_logps(logits, targets, self.temperature)
            return TokenLogps(logps=logps, entropy=logps.new_empty(0))
        with self.autocast():
            hidden = self._hidden(head, prompt_ids, prompt_mask, targets, attended)  # [b, T, H]
        out = linear_logps(  # outside autocast: the head's product and the softmax in the weight's dtype
            hidden.to(head.weight.dtype),
            head.weight,
            targets,
            temperature=self.temperature,
            bias=head.bias,
            return_entropy=entropy,
        )
        return out if isinstance(out, TokenLogps) else TokenLogps(logps=out, entropy=out.new_empty(0))

    def _hidden(
        self,
        head: LMHead,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        targets: torch.Tensor,
        attended: torch.Tensor,
    ) -> torch.Tensor:
        """The final hidden states that score each target token. [b, T, H]"""
        G, T = self.group_size, targets.shape[1]
        if isinstance(head.decoder, LeanLlamaDecoder) and whole_groups(prompt_ids, prompt_mask, G):
            return head.decoder.shared_prefix(prompt_ids[::G], prompt_mask[::G], targets, attended, G)
        ids = torch.cat([prompt_ids, targets], dim=1)  # [b, Lp+T]
        attention = torch.cat([prompt_mask, attended], dim=1).long()  # [b, Lp+T]
        return last_hidden_states(head, ids, attention, T + 1)[:, :-1]  # [b, T, H] scores targets


def whole_groups(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, G: int) -> bool:
    """Whether rows come in whole groups of G that share one prompt (checked, not assumed)."""
    b = prompt_ids.shape[0]
    if G < 2 or b % G:
        return False
    first_ids = prompt_ids[::G].repeat_interleave(G, 0)  # [b, Lp]
    first_mask = prompt_mask[::G].repeat_interleave(G, 0)  # [b, Lp]
    return bool(torch.equal(first_ids, prompt_ids) and torch.equal(first_mask, prompt_mask))
