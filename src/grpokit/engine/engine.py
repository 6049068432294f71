"""The policy engine: one object that owns the policy being trained, its device and precision, its
model backend and its decoder. It is the only way the policy generates or scores:

* `generate(prompts, params, rows) -> Rollout`: G completions per prompt, or G multi-turn episodes
  with an environment (`rollout.Decoder`, the one decode loop);
* `logps(batch, rows, entropy=...) -> TokenLogps`: log-probs of the completion tokens of some rows under
  the policy, differentiable (the training forward);
* `frozen_logps(batch, micro, reference=...) -> [B, T]`: the same without gradients, under the policy
  as it is (old-policy log-probs) or under the reference policy;
* `head_states(batch, rows)` / `frozen_head_states(batch, micro)`: the last hidden states and the LM
  head (or the logits), for a divergence over whole next-token distributions (loss_type=gkd);
* `replayed_logps(batch, micro, params) -> Replayed`: without gradients, both the policy's log-probs
  and those of the distribution the sampler drew from (top-k, top-p, min-p replayed on the training
  forward's logits), so an importance ratio against the sampler's log-probs compares like with like.

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
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from ..config.specs import EngineSpec as EngineSpec  # re-exported: the plan builds it
from ..models.backend import LeanBackend, TransformersBackend, backend_of
from ..models.device import Precision, model_device
from ..models.lean_llama import LeanLlamaDecoder
from ..models.lora import reference_model
from ..ops import HeadStates, TokenLogps, linear_logps, token_logps, token_logps_and_entropy
from ..rollout import Decoder, LoopControl, Rollout, SamplingParams, process_logits, resolve_decode_loop
from .compiled import CompiledPasses, PassOptions, compile_refusal, compiles
from .weights import load_weights_file


class Sequences(Protocol):
    """What log-probs are taken over: prompts and completions, B rows (a Rollout or a training Batch)."""

    prompt_ids: torch.Tensor  # [B, Lp] left-padded
    prompt_mask: torch.Tensor  # [B, Lp] bool
    completion_ids: torch.Tensor  # [B, T]
    completion_mask: torch.Tensor  # [B, T] bool: the tokens that carry loss
    # [B, T] bool: the tokens attended to (policy and environment); None: completion_mask (one turn)
    completion_attention: torch.Tensor | None


class Sampler(Protocol):
    """What draws a step's completions and takes each weight version the trainer publishes:
    `PolicyEngine` in process, `engine.remote.RemotePolicy` on rollout servers. train/draw.py samples
    through either."""

    tokenizer: Any
    device: torch.device
    environment: Any  # an envs.EnvironmentSpec (multi-turn episodes), or None

    def generate(
        self,
        prompts: Sequence[str | Sequence[int]],
        params: SamplingParams,
        rows: list[dict[str, Any]] | None,
    ) -> Rollout: ...

    def update_weights(self, path: str, version: int) -> None: ...


@dataclass(frozen=True)
class Replayed:
    """The completion tokens' log-probs under the policy now, two ways (`PolicyEngine.replayed_logps`)."""

    policy: torch.Tensor  # [B, T] float32 under softmax(z / temperature): the loss's policy
    sampled: torch.Tensor  # [B, T] float32 under the sampler's distribution: z with its filters applied


def truncates(params: SamplingParams) -> bool:
    """Whether the sampler draws from a distribution other than softmax(z / temperature): top-k, top-p
    or min-p cut its support and renormalise. (The repetition penalty also reshapes it, from each row's
    own history; it is not replayed, so a ratio against the sampler's log-probs then carries it.)"""
    return params.temperature > 0.0 and (bool(params.top_k) or params.top_p < 1.0 or bool(params.min_p))


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
    compiled: CompiledPasses | None = None  # torch_compile: the training passes compiled, else eager

    @classmethod
    def create(
        cls,
        module: torch.nn.Module,
        tokenizer: Any,
        spec: EngineSpec,
        *,
        device: torch.device | None = None,
        reference: torch.nn.Module | None = None,
        wrapping: Wrapping | None = None,
        environment: Any = None,
    ) -> PolicyEngine:
        """`module` (and `reference`) already on `device` (None: the device of `module`'s parameters)
        in the master dtype of `spec`'s precision. `wrapping`: how the policy is wrapped for data
        parallelism (DDP, or FSDP2, which shards `module` in place), if it is; the fused log-prob route
        is then off. `environment`: an `envs.EnvironmentSpec`: completions are then multi-turn
        episodes."""
        device = model_device(module) if device is None else device
        precision = Precision.of(spec.dtype, spec.master_weights)
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
                resolve_decode_loop(spec.decode_loop, device),
                LoopControl(),
            )
        fused = spec.fused_logps and not wrapped and backend.head is not None
        reference_backend = backend_of(reference) if fused and reference is not None else None
        compiled = None
        if compiles(spec.torch_compile, device):
            episodes, compiler = environment is not None, spec.torch_compile_backend
            refusal = compile_refusal(backend if fused else None, module, wrapped, episodes, compiler)
            if refusal is not None:
                raise ValueError(refusal)
            compiled = CompiledPasses(mode=spec.torch_compile_mode, backend=spec.torch_compile_backend)
        return cls(
            module=module,
            tokenizer=tokenizer,
            device=device,
            precision=precision,
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
            compiled=compiled,
        )

    @property
    def fused(self) -> bool:
        """Whether log-probs come from hidden states and the LM head (no [B, T, V] logits)."""
        return self.backend is not None

    @property
    def mixed_dtype(self) -> torch.dtype | None:
        """The compute dtype autocast runs the forward passes in, or None without autocast."""
        return self.precision.compute if self.precision.mixed else None

    def weights_cast_once(self, reference: bool = False) -> contextlib.AbstractContextManager[None]:
        """Within this context the policy's (or the reference's) matrices are cast to the compute dtype
        once, at their first use, and the copies shared by every pass inside: all the micro-batches of
        an optimizer step, or of a frozen pass, or the tokens of a rollout. Under mixed precision on the
        lean forward (eager, one process); otherwise nothing (float32, or compiled passes, which cast
        inside their graphs). The passes give what autocast's own casts give, bit for bit. The weights
        must not change inside: the update opens it around the gradients' accumulation, before the
        optimizer steps."""
        backend = (self.reference_backend or self.backend) if reference else self.backend
        decoder = getattr(backend, "decoder", None)
        if not self.precision.mixed or self.compiled is not None or not isinstance(decoder, LeanLlamaDecoder):
            return contextlib.nullcontext()
        return decoder.weights_cast_once(self.precision.compute)

    def autocast(self) -> Any:
        return self.precision.autocast(self.device)

    @property
    def float32_exact(self) -> bool:
        """Whether the policy computes in float32 without autocast or TF32: two forwards of the same
        weights then agree to float32 round-off (the runtime invariants' tight bounds apply)."""
        return (
            not self.precision.mixed
            and self.precision.compute == torch.float32
            and not (self.device.type == "cuda" and torch.backends.cuda.matmul.allow_tf32)
        )

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
            and self.float32_exact
        )

    # ------------------------------------------------------------------ generation

    def generate(
        self,
        prompts: Sequence[str | Sequence[int]],
        params: SamplingParams,
        rows: list[dict[str, Any]] | None = None,
    ) -> Rollout:
        """G completions for each prompt, a text or its token ids (a Rollout, on the host); with an
        environment, G episodes of each prompt, started from its row of `rows`."""
        with self.autocast(), self._decoding_cast_once():
            return self.decoder.sample(prompts, params, rows)

    def _decoding_cast_once(self) -> contextlib.AbstractContextManager[None]:
        """`weights_cast_once` for the decode loop, when it decodes through the policy's own lean
        backend on one process: the prefill and the eager loop's steps read the copies (the static
        loop's steps read stacked copies of their own, `lean_llama.DecodeWeights`)."""
        if self.distributed or self.decoder.backend is not self.backend:
            return contextlib.nullcontext()
        return self.weights_cast_once()

    def update_weights(self, path: str, version: int) -> None:
        """The policy's weights replaced by version `version`'s file at `path` (`engine/weights.py`: the
        whole file checked first; a refused file raises WeightsFileError and changes nothing)."""
        load_weights_file(self.module, path, self.device)

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
            stack.enter_context(self.weights_cast_once(reference=reference and self.reference is not None))
            with self.frozen_mode():
                parts = [  # no entropies: nothing reads them for a frozen policy
                    self._stats(model, backend, batch, slice(s, s + micro), entropy=False).logps
                    for s in range(0, B, micro)
                ]
        with torch.no_grad():
            return torch.cat(parts)  # outside inference mode: an ordinary tensor

    def head_states(self, batch: Sequences, rows: slice) -> HeadStates:
        """What the policy's next-token distributions at `rows`' completion positions come from, for a
        divergence over whole distributions (loss_type=gkd): the last hidden states [b, T, H] with the LM
        head, the logits to be formed a chunk at a time (`ops.chunked_generalized_jsd`); or the model's
        own logits [b, T, V] where hidden states cannot be had. Differentiable: the training forward."""
        backend = self.backend
        with self.autocast():
            if backend is None or backend.head is None:
                return HeadStates(self._logits(self.train_module, batch, rows))  # [b, T, V]
            hidden = backend.hidden(  # [b, T, H]
                batch.prompt_ids[rows],
                batch.prompt_mask[rows],
                batch.completion_ids[rows],
                self._attended(batch)[rows],
                self.group_size,
            )
        head = backend.head
        return HeadStates(hidden.to(head.weight.dtype), head.weight, head.bias)

    def frozen_head_states(self, batch: Sequences, micro: int) -> HeadStates:
        """`head_states` of every row, `micro` rows a pass, without gradients (a teacher's): [B, T, H]
        with the head (or [B, T, V] logits). Under no_grad, not inference mode: the student's loss reads
        them inside its autograd graph."""
        B = batch.completion_ids.shape[0]
        with torch.no_grad(), self.weights_cast_once():
            parts = [self.head_states(batch, slice(s, s + micro)) for s in range(0, B, micro)]
            return HeadStates(torch.cat([p.states for p in parts]), parts[0].weight, parts[0].bias)

    def replayed_logps(self, batch: Sequences, micro: int, params: SamplingParams) -> Replayed:
        """The policy's log-probs as now, without gradients, under the loss's distribution and under
        the sampler's (`params`' top-k, top-p and min-p replayed on this forward's logits, chunk by chunk:
        no [B, T, V] tensor beyond one chunk). Where the sampler computes what this forward computes,
        exp(sampled − the sampler's own log-probs) is 1 to round-off whatever the filters: the ratio
        TRL takes against a full-vocabulary forward is off by the kept mass instead (trl#6789)."""
        B = batch.completion_ids.shape[0]
        policy, sampled = [], []
        with self.frozen_mode(), self.weights_cast_once():
            for start in range(0, B, micro):
                rows = slice(start, start + micro)
                full, drawn = self._replay(batch, rows, params)
                policy.append(full)
                sampled.append(drawn)
        with torch.no_grad():
            return Replayed(policy=torch.cat(policy), sampled=torch.cat(sampled))

    def _replay(
        self, batch: Sequences, rows: slice, params: SamplingParams
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """([b, T], [b, T]) float32 log-probs of `rows`' completion tokens: softmax(z / temperature), and
        the sampler's distribution (`rollout.process_logits`, the very function it draws from)."""
        targets = batch.completion_ids[rows]  # [b, T]
        b, T = targets.shape
        backend = self.backend
        with self.autocast():
            if backend is None or backend.head is None:
                logits = self._logits(self.train_module, batch, rows)  # [b, T, V]
                weight = None
            else:
                logits = backend.hidden(  # [b, T, H]
                    batch.prompt_ids[rows],
                    batch.prompt_mask[rows],
                    targets,
                    self._attended(batch)[rows],
                    self.group_size,
                )
                weight = backend.head
        flat, ids = logits.reshape(b * T, -1), targets.reshape(-1)  # [bT, V or H], [bT]
        full = torch.empty(b * T, device=flat.device)  # [bT] float32
        drawn = torch.empty(b * T, device=flat.device)  # [bT] float32
        V = flat.shape[1] if weight is None else weight.weight.shape[0]
        chunk = max(1, (1 << 22) // V)  # rows of [n, V] float32 logits at a time: 16 MiB
        for s in range(0, b * T, chunk):
            z = flat[s : s + chunk]
            if weight is not None:  # hidden states through the head, in its dtype, then float32
                z = torch.nn.functional.linear(z.to(weight.weight.dtype), weight.weight, weight.bias)
            z = z.float()  # [n, V]
            at = ids[s : s + chunk, None]  # [n, 1]
            full[s : s + chunk] = torch.log_softmax(z / self.temperature, -1).gather(-1, at).squeeze(-1)
            drawn[s : s + chunk] = process_logits(z, None, params).gather(-1, at).squeeze(-1)
        return full.view(b, T), drawn.view(b, T)

    @staticmethod
    def _attended(batch: Sequences) -> torch.Tensor:
        """[B, T] bool: what the forward attends to (in a multi-turn transcript the environment's tokens)."""
        attention = getattr(batch, "completion_attention", None)  # (absent from older Sequences)
        return batch.completion_mask if attention is None else attention

    def _logits(self, model: Any, batch: Sequences, rows: slice) -> torch.Tensor:
        """[b, T, V]: the model's own logits at the positions that score `rows`' completion tokens."""
        T = batch.completion_ids.shape[1]
        ids = torch.cat([batch.prompt_ids[rows], batch.completion_ids[rows]], dim=1)  # [b, Lp+T]
        attention = torch.cat([batch.prompt_mask[rows], self._attended(batch)[rows]], dim=1).long()
        logits = model(input_ids=ids, attention_mask=attention, logits_to_keep=T + 1).logits
        return logits[:, :-1]  # position t scores targets[:, t]

    def _stats(
        self, model: Any, backend: TransformersBackend | None, batch: Sequences, rows: slice, entropy: bool
    ) -> TokenLogps:
        prompt_ids, prompt_mask = batch.prompt_ids[rows], batch.prompt_mask[rows]  # [b, Lp]
        targets = batch.completion_ids[rows]  # [b, T]
        attended = self._attended(batch)[rows]  # [b, T]
        if backend is None or backend.head is None:  # the model's own logits
            with self.autocast():
                logits = self._logits(model, batch, rows)  # [b, T, V]; float32 softmax below
            if entropy:
                return token_logps_and_entropy(logits, targets, self.temperature)
            logps = token_logps(logits, targets, self.temperature)
            return TokenLogps(logps=logps, entropy=logps.new_empty(0))
        if self.compiled is not None:  # torch_compile: the same pass, compiled on bucketed widths
            how = PassOptions(self.group_size, self.temperature, entropy, self.mixed_dtype)
            return self.compiled.stats(backend, batch, rows, self._attended(batch), how)
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
