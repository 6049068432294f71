"""torch_compile: the training passes through torch.compile (TRL's torch_compile, torch_compile_mode,
torch_compile_backend).

What is compiled: the policy's log-prob pass (the lean decoder's hidden states, then the chunked
head and log-softmax, `ops.linear_logps`) in the training forward and its backward (AOT autograd
compiles both), and the same pass without gradients for the frozen passes (old policy, reference);
the loss (`ops.grpo_loss`) through `CompiledPasses.loss`. Eager mode runs exactly the code it runs
without this module: nothing here is on its path.

Shapes are bucketed so that a run compiles a bounded number of graphs: the completion width T and the
prompt width Lp are rounded up (`width_bucket`: multiples of 4 up to 32, then of a quarter of the
power of two below, so at most 3 tokens or a third more, and four buckets an octave), the prompts left-padded
and the completions right-padded with tokens nothing attends to, and the log-probs of the real tokens
sliced back. Causal attention makes a completion token's log-prob independent of the padding after it;
left padding shifts every rotary position of a row by the same amount, which attention does not see.
So the compiled pass computes the eager pass's numbers up to float round-off (tests/test_compiled.py
bounds the gap). Each distinct (pass, rows, Lp bucket, T bucket) is one graph; `graph_count` counts
them and the step logs it (`compile/graphs`).

What a compiled run cannot take is refused in one line (`compile_refusal`): a model the lean decoder
does not cover, a head that is not plain, LoRA, a model wrapped for data parallelism, multi-turn
episodes, and the padding-free pass (its layout depends on the data: the compiled pass takes the padded
routes, packing the G completions of a prompt where `lean_llama.packing_pays`).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from ..models.backend import TransformersBackend, whole_groups
from ..ops import TokenLogps, linear_logps

# torch_compile=auto, by device type: whether the compiled training pass is on. Measured, not assumed
# (benchmarks/RESULTS.md, "The compiled training pass"): on a 2-core CPU the compile costs tens of
# seconds per graph and a step of the small models trained there repays it only after many steps, so
# auto leaves it off; on a GPU it is off until the GPU-figures issue measures it there.
COMPILE_BY_DEVICE: dict[str, bool] = {"cpu": False, "cuda": False}
MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
_NON_LEAF_GRAD = "The .grad attribute of a Tensor that is not a leaf Tensor"  # torch's warning
GRAPHS_MAX = 64  # graphs torch.compile keeps per compiled function (dynamo's recompile limit)


def compiles(torch_compile: bool | str, device: torch.device) -> bool:
    """Whether the training passes are compiled: torch_compile true or false, or auto by device."""
    if torch_compile == "auto":
        return COMPILE_BY_DEVICE.get(device.type, False)
    return bool(torch_compile)


def width_bucket(n: int) -> int:
    """n tokens rounded up to a compiled width: a multiple of 4 up to 32, then of a quarter of the power
    of two below n (33 -> 40, 100 -> 112, 129 -> 160, 257 -> 320): at most 3 tokens or a third more,
    at most four widths between two powers of two."""
    step = max(4, 1 << max((n - 1).bit_length() - 3, 0))
    return -(-max(n, 1) // step) * step


def compile_refusal(
    backend: TransformersBackend | None,
    module: torch.nn.Module,
    wrapped: bool,
    episodes: bool,
    compiler: str | None = None,
) -> str | None:
    """Why the training passes of this policy cannot be compiled (by torch.compile's backend
    `compiler`, None for inductor), in one line, or None."""
    fix = "set torch_compile=false"
    dynamo = torch._dynamo  # noqa: SLF001 - torch.compile's own registry of backends
    if compiler is not None and compiler not in dynamo.list_backends(exclude_tags=()):
        named = ", ".join(["aot_eager", "eager", *dynamo.list_backends()])
        return f"torch_compile_backend={compiler} is not a torch.compile backend; use one of: {named}"
    if wrapped:
        return (
            f"torch_compile under torchrun (DDP or FSDP) is not supported yet; {fix} for a multi-process run"
        )
    if hasattr(module, "get_base_model"):
        return f"torch_compile with use_peft (LoRA) is not supported yet; {fix} or use_peft=false"
    if episodes:
        return f"torch_compile with multi-turn episodes (tools, environment) is not supported yet; {fix}"
    decoder = getattr(backend, "decoder", None)
    if backend is None or backend.head is None or not hasattr(decoder, "shared_prefix"):
        return (
            "torch_compile needs a Llama-family policy (Llama, Qwen2, Mistral) with a plain linear LM head "
            f"and fused_logps=true, which grpokit's lean decoder computes; {fix} for this model"
        )
    return None


@dataclass(frozen=True)
class PassOptions:
    """What a log-prob pass takes besides its tensors: G (rows sharing a prompt), the temperature,
    whether entropies are wanted, and the compute dtype of a mixed-precision forward (None: none)."""

    group_size: int
    temperature: float
    entropy: bool
    autocast: torch.dtype | None


def _stats(
    backend: TransformersBackend,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    targets: torch.Tensor,
    attended: torch.Tensor,
    how: PassOptions,
    groups: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """What torch.compile traces: the engine's fused log-prob pass on bucketed shapes, with the route
    (whole groups or not; never the padding-free pass) decided outside. -> ([b, T], [b, T] or [0])"""
    head = backend.head
    assert head is not None
    mixed = (
        torch.autocast(prompt_ids.device.type, dtype=how.autocast)
        if how.autocast is not None
        else nullcontext()
    )
    with mixed:
        G = how.group_size
        hidden = backend.hidden(prompt_ids, prompt_mask, targets, attended, G, groups=groups, packing="never")
    out = linear_logps(
        hidden.to(head.weight.dtype),
        head.weight,
        targets,
        temperature=how.temperature,
        bias=head.bias,
        return_entropy=how.entropy,
    )
    if isinstance(out, TokenLogps):
        return out.logps, out.entropy
    return out, out.new_empty(0)


@dataclass
class CompiledPasses:
    """The engine's compiled passes (`PolicyEngine.compiled`); one per engine."""

    mode: str | None = None  # torch_compile_mode (None: torch's default)
    backend: str | None = None  # torch_compile_backend (None: inductor)
    graphs: set[tuple[Any, ...]] = field(default_factory=set)  # each (pass, shapes) compiled
    _stats: Any = field(default=None, repr=False)
    _losses: dict[Callable[..., Any], Any] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        config = torch._dynamo.config  # noqa: SLF001 - the documented knob, under its private module
        name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
        setattr(config, name, max(getattr(config, name), GRAPHS_MAX))
        self._stats = self._compile(_stats, dynamic=False)

    def _compile(self, fn: Callable[..., Any], dynamic: bool | None) -> Any:
        mode = None if self.mode in (None, "default") else self.mode
        return torch.compile(fn, dynamic=dynamic, mode=mode, backend=self.backend or "inductor")

    @property
    def graph_count(self) -> int:
        """Distinct compiled pass shapes so far (bounded by the width buckets)."""
        return len(self.graphs)

    def stats(
        self, backend: TransformersBackend, batch: Any, rows: slice, attended: torch.Tensor, how: PassOptions
    ) -> TokenLogps:
        """The log-probs (and entropies) of `rows`' completion tokens [b, T], through the compiled pass
        on bucketed widths; `attended`: [B, T] the completion tokens attended to."""
        device = backend.device
        prompt_ids, prompt_mask = batch.prompt_ids[rows].to(device), batch.prompt_mask[rows].to(device)
        targets, attended = batch.completion_ids[rows].to(device), attended[rows].to(device)  # [b, T]
        (b, Lp), T = prompt_ids.shape, targets.shape[1]
        Lq, Tq = width_bucket(Lp), width_bucket(T)
        # whole groups: on the real prompts (the padding added is the same for every row)
        groups = whole_groups(prompt_ids, prompt_mask, how.group_size)
        prompt_ids = F.pad(prompt_ids, (Lq - Lp, 0))  # [b, Lq]: left padding nothing attends to
        prompt_mask = F.pad(prompt_mask.bool(), (Lq - Lp, 0))  # [b, Lq]
        targets, attended = F.pad(targets, (0, Tq - T)), F.pad(attended.bool(), (0, Tq - T))  # [b, Tq]
        decoder = backend.decoder
        with torch.inference_mode(False):  # the rotary table is read by graphs that train: never an
            decoder.rotary_table(Lq + Tq, decoder.llama.embed_tokens.weight.dtype, device)  # inference tensor
        frozen = not torch.is_grad_enabled()
        self.graphs.add((id(backend), frozen, how, groups, b, Lq, Tq))
        with decoder.joined_projections():  # (q/k/v and gate/up: one product each in the graph)
            logps, entropies = self._stats(backend, prompt_ids, prompt_mask, targets, attended, how, groups)
        return TokenLogps(logps=logps[:, :T], entropy=entropies[:, :T] if how.entropy else entropies)

    def loss(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """`fn` (the loss) compiled, once per function; its widths are the batch's, so dynamic shapes
        (torch marks a width dynamic once it has changed): a few graphs in all."""
        if fn not in self._losses:
            compiled = self._compile(fn, dynamic=None)

            def call(*args: Any, **kwargs: Any) -> Any:
                with warnings.catch_warnings():  # dynamo reads .grad of the log-probs while it traces
                    warnings.filterwarnings("ignore", message=_NON_LEAF_GRAD, category=UserWarning)
                    return compiled(*args, **kwargs)

            self._losses[fn] = call
        return self._losses[fn]
