"""The policy engine: one object that owns the policy being trained, its device and precision, its
model backend and its decoder. It is the only way the policy generates or scores:

* `generate(prompts, params, rows) -> Rollout`: G completions per prompt, or G multi-turn episodes
  with an environment (`rollout.Decoder`, the one decode loop);
* `logps(batch, rows, entropy=...) -> TokenLogps`: log-probs of the completion tokens of some rows under
  the policy, differentiable (the training forward);
* `frozen_logps(batch, micro, reference=...) -> [B, T]`: the same without gradients, under the policy
  as it is (old-policy log-probs) or under the reference policy.

Log-probs take one route where it exists: the backend's final hidden states through the LM head chunk
by chunk (`ops.linear_logps`, no [B, T, V] logits), with each prompt's keys and values shared by its G
completions on the lean backend. The model's own logits serve only where hidden states cannot be had:
a head that is not a plain linear layer, or a model wrapped for data parallelism (DDP's and FSDP's
hooks live in the whole model's forward).

Precision (`Precision`): the policy's weights are stored in `precision.master` and every forward
pass runs under autocast in `precision.compute`; the log-softmax, log-probs and loss stay float32.
The reference is a copy of the policy in the same storage, so at step 0 both give bit-identical
log-probs and the KL term starts at exactly 0.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from ..models.backend import LeanBackend, TransformersBackend, backend_of
from ..models.device import Precision
from ..models.lora import reference_model
from ..ops import TokenLogps, linear_logps, token_logps, token_logps_and_entropy
from ..rollout import Decoder, LoopControl, Rollout, SamplingParams, resolve_decode_loop


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
    decoder: Decoder  # the decode loop over the policy's backend
    reference: torch.nn.Module | None  # frozen π_ref; None when beta = 0 or for LoRA (adapters off)
    train_module: torch.nn.Module  # what training passes go through: `module`, or its DDP/FSDP wrapper
    distributed: bool = False  # wrapped for data parallelism (DDP, or FSDP2, which wraps in place)
    temperature: float = 1.0  # log-probs are taken at the sampling temperature (1 for greedy)
    group_size: int = 1  # G: rows come in groups sharing a prompt (prefix sharing when checked true)
    frozen_mode: Any = torch.inference_mode  # the gradient-free mode of frozen passes (see `create`)
    environment: Any = None  # the envs.EnvironmentSpec of multi-turn episodes, else None (one turn)
    # the backends whose hidden states give log-probs (None: the model's own logits)
    backend: TransformersBackend | None = field(default=None, repr=False)
    reference_backend: TransformersBackend | None = field(default=None, repr=False)

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
        if it is; the fused log-prob route is then off. `environment`: an `envs.EnvironmentSpec`:
        completions are then multi-turn episodes."""
        wrapped = wrapping is not None
        lockstep = wrapping.lockstep if wrapping is not None else None
        train_module = wrapping.train_module if wrapping is not None else module
        backend = backend_of(module)
        # under FSDP the decode loop runs through the sharded module, every rank in step: the eager
        # loop, gradient-free by no_grad (FSDP's unsharded parameters must stay ordinary tensors)
        if lockstep is not None:
            decoding = backend_of(train_module) if train_module is not module else backend
            loop, control = "eager", LoopControl(sync_finished=lockstep, grad_free=torch.no_grad)
        else:
            decoding, loop, control = (
                backend,
                resolve_decode_loop(spec.decode_loop, spec.device),
                LoopControl(),
            )
        fused = spec.fused_logps and not wrapped and backend.head is not None
        reference_backend = backend_of(reference) if fused and reference is not None else None
        return cls(
            module=module,
            tokenizer=tokenizer,
            device=spec.device,
            precision=spec.precision,
            decoder=Decoder(decoding, tokenizer, loop, environment, control),
            reference=reference,
            train_module=train_module,
            distributed=wrapped,
            temperature=spec.temperature,
            group_size=spec.group_size,
            # frozen passes: inference mode (cheapest per operation) on a plain module; no_grad through
            # a DDP/FSDP wrapper
            frozen_mode=torch.no_grad if wrapped else torch.inference_mode,
            environment=environment,
            backend=backend if fused else None,
            reference_backend=reference_backend
            if reference_backend is not None and reference_backend.head is not None
            else None,
        )

    @property
    def fused(self) -> bool:
        """Whether log-probs come from hidden states and the LM head (no [B, T, V] logits)."""
        return self.backend is not None

    def autocast(self) -> Any:
        return self.precision.autocast(self.device)

    @property
    def sampler_is_forward(self) -> bool:
        """Whether the decode loop's log-probs of its tokens equal this engine's forward pass to float32
        round-off, so that they can serve as old-policy log-probs. Only where that is tested and holds
        by construction: the lean backend (rotary positions: a left-padding offset changes nothing)
        sampling and scoring, one turn (multi-turn observations are fed in chunks, another summation
        order), on one process, with no active dropout (sampling runs in eval mode, training in train
        mode), in float32 without autocast, and no TF32 (a GPU's float32 matmuls then round to 10 bits,
        differently in the loop and the batched forward)."""
        backend = self.backend
        return (
            not self.distributed
            and isinstance(backend, LeanBackend)
            and self.decoder.backend is backend
            and self.environment is None
            and backend.capabilities.exact_sampler_logps
            and not self.precision.mixed
            and self.precision.compute == torch.float32
            and not (self.device.type == "cuda" and torch.backends.cuda.matmul.allow_tf32)
        )

    # ------------------------------------------------------------------ generation

    def generate(
        self, prompts: list[str], params: SamplingParams, rows: list[dict[str, Any]] | None = None
    ) -> Rollout:
        """G completions for each prompt (a Rollout, on the host); with an environment, G episodes of
        each prompt, started from its row of `rows`."""
        with self.autocast():
            return self.decoder.sample(prompts, params, rows)

    # ------------------------------------------------------------------ log-probs

    def logps(self, batch: Sequences, rows: slice, *, entropy: bool) -> TokenLogps:
        """Log-probs (and entropies) of the completion tokens of `rows` under the policy, through the
        training forward (differentiable). [b, T]"""
        return self._stats(self.train_module, self.backend, batch, rows, entropy)

    def frozen_logps(self, batch: Sequences, micro: int, *, reference: bool = False) -> torch.Tensor:
        """Log-probs under the policy as it is now, or under the reference, without gradients, `micro`
        rows a pass. [B, T] float32, an ordinary tensor (the loss may use it under autocast)."""
        B = batch.completion_ids.shape[0]
        with contextlib.ExitStack() as stack:
            if reference:
                model = stack.enter_context(reference_model(self.module, self.reference))
                backend = self.reference_backend if self.reference is not None else self.backend
            else:
                model, backend = self.train_module, self.backend
            with self.frozen_mode():
                parts = [  # no entropies: nothing reads them for a frozen policy
                    self._stats(model, backend, batch, slice(s, s + micro), entropy=False).logps
                    for s in range(0, B, micro)
                ]
        with torch.no_grad():
            return torch.cat(parts)  # outside inference mode: an ordinary tensor

    def _stats(
        self, model: Any, backend: TransformersBackend | None, batch: Sequences, rows: slice, entropy: bool
    ) -> TokenLogps:
        prompt_ids, prompt_mask = batch.prompt_ids[rows], batch.prompt_mask[rows]  # [b, Lp]
        targets = batch.completion_ids[rows]  # [b, T]
        # what the forward attends to: in a multi-turn transcript the environment's tokens too
        attention = getattr(batch, "completion_attention", None)  # (absent from older Sequences)
        attend = batch.completion_mask if attention is None else attention
        attended = attend[rows]  # [b, T]
        T = targets.shape[1]
        if backend is None or backend.head is None:  # the model's own logits
            ids = torch.cat([prompt_ids, targets], dim=1)  # [b, Lp+T]
            attention = torch.cat([prompt_mask, attended], dim=1).long()  # [b, Lp+T]
            with self.autocast():
                logits = model(input_ids=ids, attention_mask=attention, logits_to_keep=T + 1).logits
            logits = logits[:, :-1]  # [b, T, V]: position t scores targets[:, t]; float32 softmax below
            if entropy:
                return token_logps_and_entropy(logits, targets, self.temperature)
            logps = token_logps(logits, targets, self.temperature)
            return TokenLogps(logps=logps, entropy=logps.new_empty(0))
        head = backend.head
        with self.autocast():
            hidden = backend.hidden(prompt_ids, prompt_mask, targets, attended, self.group_size)  # [b, T, H]
        out = linear_logps(  # outside autocast: the head's product and the softmax in the weight's dtype
            hidden.to(head.weight.dtype),
            head.weight,
            targets,
            temperature=self.temperature,
            bias=head.bias,
            return_entropy=entropy,
        )
        return out if isinstance(out, TokenLogps) else TokenLogps(logps=out, entropy=out.new_empty(0))
