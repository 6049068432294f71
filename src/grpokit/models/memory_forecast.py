"""How much memory one GRPO step holds, counted from the model's shape and the step's, before any of it
is allocated (`grpokit doctor`'s forecast).

Pure arithmetic on numbers: `ModelShape` (read from a model, `ModelShape.of`, or from its config,
`ModelShape.from_config`) and `StepShape` (rows, micro-batch, lengths, dtypes, which paths the step
takes) go into `forecast_memory`, which returns each part in bytes (`MemoryForecast`) and the peak of
the step's phases. Every count is of what grpokit's code holds at that phase, not a rule of thumb:

* sampling: the weights, the reference copy, the gradients and AdamW state of the last update (the
  gradients are dropped only when the next update starts), the KV cache of all B rows, and one decode
  step's [B, V] logits and the draw's temporaries;
* reference pass (β ≠ 0, or any frozen pass): the same persistent state and a gradient-free forward's
  transients over one micro-batch;
* update: the persistent state, what the forward saves for the backward over one micro-batch (the
  lean Llama forward of `lean_llama`, or transformers' for other models or with gradient
  checkpointing), and the LM head's buffers (`ops.linear_logps`'s chunks and gradients, or the full
  [b, T, V] logits and their gradient when the log-probs are not fused).

Shape letters: B rows sampled per step on this rank (prompts · G), b rows per micro-batch, Lp prompt
tokens, T completion tokens, S = Lp + T, V vocabulary, H hidden size, I the MLP's intermediate size,
L layers, h attention heads, kv key/value heads, d = head dimension, N parameters. c: bytes of the
compute dtype, m: of the master (stored) dtype.

The process's own memory (the Python and torch runtime, the tokenizer, the data) is not counted here:
the caller measures it (`baseline_bytes`, e.g. the RSS after imports) and the total adds it.
Measured against peak RSS on a CPU in benchmarks/doctor_memory.py (benchmarks/RESULTS.md, "Doctor
memory forecast").
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any

from ..ops.divergence import CHUNK_LOGITS
from ..ops.linear_logps import chunk_rows
from .backend import LeanBackend, backend_of
from .lean_llama import packing_pays

FLOAT32 = 4
# ops/logprobs.py's chunk of the unfused route: 2**21 float32 elements
UNFUSED_CHUNK_ELEMENTS = 1 << 21
# [B, V] float32 buffers of one decode step: the logits, their log-softmax (rollout.process_logits),
# the probabilities and their blocked cumulative sum (rollout.processing.inverse_cdf)
DECODE_STEP_BUFFERS = 4


@dataclass(frozen=True)
class ModelShape:
    """A causal LM's shape, as the forecast counts it."""

    vocab_size: int  # V
    hidden_size: int  # H
    num_layers: int  # L
    num_heads: int  # h
    num_kv_heads: int  # kv
    intermediate_size: int  # I
    tied_embeddings: bool  # the LM head is the embedding matrix (counted once)
    num_parameters: int  # N: every parameter, shared ones once
    trainable_parameters: int | None = None  # those AdamW updates (LoRA: the adapters); None: all N
    head_dim: int | None = None  # d; None: H / h
    lean_forward: bool = True  # trained through lean_llama's forward (else transformers')
    attention_dropout: bool = False  # attention dropout in training: the math path keeps the probabilities

    @property
    def d(self) -> int:
        return self.head_dim or self.hidden_size // self.num_heads

    @property
    def trainable(self) -> int:
        return self.num_parameters if self.trainable_parameters is None else self.trainable_parameters

    @classmethod
    def of(cls, model: Any) -> ModelShape:
        """The shape of a transformers causal LM (LoRA-wrapped too): its config, and its parameters
        counted exactly (numel; tied ones once), the trainable ones apart."""
        shape = cls.from_config(_config(model))
        parameters = list(model.parameters())  # (each shared parameter once)
        return replace(
            shape,
            num_parameters=sum(p.numel() for p in parameters),
            trainable_parameters=sum(p.numel() for p in parameters if p.requires_grad),
            lean_forward=isinstance(backend_of(model), LeanBackend),
        )

    @classmethod
    def from_config(cls, config: Any) -> ModelShape:
        """The shape a transformers config describes, without building the model: parameters counted
        as a Llama-family model (Llama, Mistral, Qwen2) holds them — embedding V·H, per layer the q, k,
        v, o projections H·h·d + 2·H·kv·d + h·d·H (q/k/v biases where the config has them), the MLP
        3·H·I and two norms 2·H, the final norm H, and the head V·H unless tied. Exact for those
        families; `of(model)` counts any model exactly."""
        V, H, L = config.vocab_size, config.hidden_size, config.num_hidden_layers
        h = config.num_attention_heads
        kv = getattr(config, "num_key_value_heads", None) or h
        d = getattr(config, "head_dim", None) or H // h
        intermediate = config.intermediate_size
        tied = bool(getattr(config, "tie_word_embeddings", False))
        model_type = getattr(config, "model_type", "")
        qkv_bias = bool(getattr(config, "attention_bias", False)) or model_type == "qwen2"
        o_bias = bool(getattr(config, "attention_bias", False))
        mlp_bias = bool(getattr(config, "mlp_bias", False))
        per_layer = (
            H * h * d + 2 * H * kv * d + h * d * H + 3 * H * intermediate + 2 * H
        )  # projections, MLP, norms
        per_layer += (h * d + 2 * kv * d) * qkv_bias + H * o_bias + (2 * intermediate + H) * mlp_bias
        dropout = float(getattr(config, "attention_dropout", 0.0) or 0.0) > 0.0
        lean = model_type in ("llama", "qwen2") and not dropout
        return cls(
            vocab_size=V,
            hidden_size=H,
            num_layers=L,
            num_heads=h,
            num_kv_heads=kv,
            intermediate_size=intermediate,
            tied_embeddings=tied,
            num_parameters=V * H * (1 if tied else 2) + L * per_layer + H,
            head_dim=d,
            lean_forward=lean,
            attention_dropout=dropout,
        )


def _config(model: Any) -> Any:
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model  # peft: the LM inside
    return inner.config


@dataclass(frozen=True)
class StepShape:
    """One GRPO step on this rank, as the forecast counts it."""

    rows: int  # B: completions sampled per step on this rank (prompts · G)
    micro_batch_size: int  # b: rows per forward and backward
    prompt_length: int  # Lp (the longest prompt: rows are padded to it)
    completion_length: int  # T (max_completion_length: the KV cache is allocated for it)
    reference: bool = False  # β ≠ 0 on a full fine-tune: a frozen copy of the weights and its pass
    compute_bytes: int = 4  # c: the compute dtype (float32 4, bfloat16 2)
    master_bytes: int = 4  # m: the stored weights and their AdamW state (float32 4)
    fused_logps: bool = True  # log-probs from hidden states through the head in chunks (ops.linear_logps)
    gradient_checkpointing: bool = False  # each layer keeps its input only and is run again in the backward
    group_size: int = 1  # G: rows come in groups sharing a prompt (the lean forward runs it once)
    static_decode: bool = False  # the static decode loop (CUDA graphs on a GPU): weight copies and KV kept
    teacher_states: bool = False  # loss_type=gkd: the teacher's last hidden states kept through the update

    def __post_init__(self) -> None:
        if min(self.rows, self.micro_batch_size, self.completion_length, self.group_size) < 1:
            raise ValueError(f"rows, micro_batch_size, completion_length and group_size must be >= 1: {self}")
        if self.prompt_length < 0 or self.rows % self.group_size:
            raise ValueError(f"prompt_length must be >= 0 and rows a multiple of group_size: {self}")

    @property
    def micro_batches(self) -> int:
        return -(-self.rows // self.micro_batch_size)


@dataclass(frozen=True)
class MemoryForecast:
    """Each part in bytes, the peak of each phase (persistent state included, baseline not), and the
    total: baseline + the largest phase."""

    weights: int  # N·m
    reference: int  # N·m when a reference copy is kept
    gradients: int  # N_trainable·m
    optimizer: int  # AdamW: exp_avg and exp_avg_sq, 2·N_trainable·m
    activations: int  # saved for the backward over one micro-batch
    held_gradients: int  # with the prompt in its own pass: gradients autograd holds until its backward
    kv_cache: int  # sampling: every row's keys and values
    logits: int  # the update's LM head beyond the activations: chunks and gradients, or full logits
    decode_logits: int  # one decode step's [B, V] logits and the draw's temporaries
    decode_weights: int  # the static decode loop's compute-dtype copies of the matrices (0: eager loop)
    cast_weights: int  # under autocast, compute-dtype copies of the weights the forward multiplies by
    frozen_pass: int  # a gradient-free pass's transients over one micro-batch (0 without one)
    teacher: int  # a distillation teacher's weights, N_T·m (0 without one)
    # gkd: its hidden states for the batch, B·T·H_T·m, held through the update, and the loss's chunk of
    # both models' logits and their temporaries (about ten float32 buffers of one chunk)
    teacher_states: int
    baseline: int  # the process's own, as the caller measured it
    sampling: int
    reference_pass: int
    update: int
    total: int

    @property
    def peak_phase(self) -> str:
        """The phase that sets the total: "sampling", "reference_pass" or "update"."""
        phases = {"sampling": self.sampling, "reference_pass": self.reference_pass, "update": self.update}
        return max(phases, key=phases.__getitem__)


@dataclass(frozen=True)
class ForwardPass:
    """One pass of the training forward over a micro-batch: `rows` rows of `queries` new positions,
    each attending to `keys` positions (its own and those before it, cached or recomputed)."""

    rows: int
    queries: int
    keys: int

    @property
    def tokens(self) -> int:
        return self.rows * self.queries


def forward_passes(model: ModelShape, step: StepShape) -> tuple[ForwardPass, ...]:
    """The passes the training forward makes over one micro-batch of b rows (`TransformersBackend.hidden`):

    * the lean forward with rows in whole groups of G ≥ 2 (`LeanLlamaDecoder.shared_prefix`): each
      prompt once, b/G rows of Lp, then the completions, b rows of T − 1 tokens attending to
      Lp + T − 1 keys; or, where `packing_pays`, one pass over b/G rows of Lp + G·(T − 1) tokens;
    * otherwise one pass over b rows of Lp + T tokens.
    (The padding-free pass, taken when a tenth of the completion slots or more are padding, runs fewer
    tokens than these: it is not forecast.)"""
    b, G = step.micro_batch_size, step.group_size
    Lp, T = step.prompt_length, step.completion_length
    if lean_route(model, step) and G > 1 and b % G == 0 and T > 1:
        if packing_pays(Lp, T, G):
            N = Lp + G * (T - 1)
            return (ForwardPass(b // G, N, N),)
        return ForwardPass(b // G, Lp, Lp), ForwardPass(b, T - 1, Lp + T - 1)
    return (ForwardPass(b, Lp + T, Lp + T),)


def lean_route(model: ModelShape, step: StepShape) -> bool:
    """Whether the training forward is lean_llama's: a lean-covered model, log-probs through the fused
    head (the unfused route calls the model itself). With gradient checkpointing too: the lean forward
    checkpoints its layers."""
    return model.lean_forward and step.fused_logps


def layer_saved_per_token(model: ModelShape, lean: bool) -> int:
    """Elements (c bytes each) one decoder layer saves for the backward per token, besides the keys
    and values (`activation_bytes`) and a few float32 per token:

    * each RMSNorm: its normalised input (H) and its output (H), which the next projections save;
      transformers' norm also keeps its input (H more);
    * attention: q after the rotary embedding (h·d) and SDPA's output (h·d), which SDPA saves; the
      output, transposed back to [b, L, h·d], is a view (the rotary product kept the projection's
      [b, L, h, d] layout, and SDPA's output follows it), saved by o_proj as it is;
    * MLP: gate (I, saved by SiLU), SiLU's output and up (I each, saved by their product), and the
      product (I, saved by down_proj).
    The residual sums are saved by nothing (each norm keeps its own normalised copy)."""
    H, I = model.hidden_size, model.intermediate_size  # noqa: E741 - the shape letter
    q = model.num_heads * model.d
    norm = 2 * H if lean else 3 * H
    return 2 * norm + 2 * q + 4 * I


def layer_bytes(model: ModelShape, step: StepShape, p: ForwardPass, lean: bool) -> int:
    """What one decoder layer saves for the backward in pass `p` (`pass_bytes` has the terms); with
    gradient checkpointing, what exists only while that layer is run again in the backward."""
    c, h = step.compute_bytes, model.num_heads
    saved = p.tokens * (layer_saved_per_token(model, lean) * c + (h + 2) * FLOAT32)
    saved += p.rows * p.keys * 2 * model.num_kv_heads * model.d * c
    if model.attention_dropout:
        saved += p.rows * h * p.queries * p.keys * (2 * c + 1)
    if not lean:  # transformers' attention keeps a mask of its own in every layer
        saved += p.rows * p.queries * p.keys * step.master_bytes
    return saved


def pass_bytes(model: ModelShape, step: StepShape, p: ForwardPass, lean: bool) -> int:
    """What one forward pass saves for the backward, head excluded:

    * per layer and token: `layer_saved_per_token`·c, and float32 SDPA's log-sum-exp per head and
      each norm's reciprocal root (h + 2); the keys after the rotary embedding and the values, for
      every key position of every row (rows·keys·2·kv·d·c: a row's own, or with the prompt's keys
      repeated in front of them); with attention dropout, SDPA's math path keeps the probabilities,
      their dropout mask and the dropped ones, rows·h·queries·keys·(2c + 1);
    * the additive attention mask, rows·queries·keys, m bytes: once per pass in the lean forward, in
      every layer in transformers' (which makes none when no row is padded: an upper bound there);
    * once per pass: the rotary cos and sin (2·d, m bytes, per token; in transformers' per position,
      shared by the rows), the token ids (int64);
    * the final norm: its normalised input (H, and its input too in transformers'), and its root;
    * with gradient checkpointing: each layer's input (H per token, m bytes: the residual stream
      stays in the stored dtype under autocast), the keys and values of earlier positions a pass
      attends to (the prompt's, repeated in front of each row's: every layer's, rows·(keys −
      queries)·2·kv·d·c), and one layer's activations while it is recomputed, instead of every
      layer's."""
    c, m = step.compute_bytes, step.master_bytes
    H = model.hidden_size
    per_layer = layer_bytes(model, step, p, lean)
    mask = p.rows * p.queries * p.keys * m
    if step.gradient_checkpointing:  # layer inputs and earlier keys held, one layer recomputed
        earlier = p.rows * (p.keys - p.queries) * 2 * model.num_kv_heads * model.d * c
        layers = model.num_layers * (p.tokens * H * m + earlier) + per_layer
    else:
        layers = model.num_layers * per_layer
    # the lean mask, the rotary cos and sin (lean: looked up per token; transformers': per position,
    # shared by the rows) and the token ids
    once = (mask if lean else 0) + (p.tokens if lean else p.queries) * 2 * model.d * m + p.tokens * 8
    final = p.tokens * ((H if lean else 2 * H) * c + FLOAT32)
    return layers + once + final


def activation_bytes(model: ModelShape, step: StepShape) -> int:
    """What the training forward over one micro-batch saves for the backward: its passes
    (`pass_bytes`; with gradient checkpointing and the prompt in a pass of its own, the prompt's keys
    and values, which the completions' pass reads), and what the head keeps, per scored token (b·T):
    the hidden states it reads (H, m bytes: cast to the head's dtype), the token id (int64), the
    log-sum-exp and the entropy (float32); unfused, lm_head's input, the last T + 1 positions (H, c
    bytes), and the logits (`head_bytes`)."""
    lean = lean_route(model, step)
    route = forward_passes(model, step)
    passes = sum(pass_bytes(model, step, p, lean) for p in route)
    if step.gradient_checkpointing and len(route) == 2:  # the prompt pass's keys and values, every layer's,
        # held for the completions' pass (which holds them repeated too: `pass_bytes`)
        key_value = 2 * model.num_kv_heads * model.d * step.compute_bytes  # per position
        passes += model.num_layers * route[0].rows * route[0].keys * key_value
    tokens = step.micro_batch_size * step.completion_length
    if not step.fused_logps:  # lm_head saves its input: the last T + 1 positions, copied
        rows = step.micro_batch_size * (step.completion_length + 1)
        return passes + rows * model.hidden_size * step.compute_bytes + tokens * (8 + 2 * FLOAT32)
    return passes + tokens * (model.hidden_size * step.master_bytes + 8 + 2 * FLOAT32)


def head_bytes(model: ModelShape, step: StepShape) -> int:
    """The update's LM head beyond the saved activations, at its peak.

    Fused (`ops.linear_logps`, rows = chunk_rows(V, H) tokens a chunk, at most b·T): the forward
    keeps a chunk's float32 logits and, for the entropy, their exponentials, 2·rows·V·4; the backward
    one chunk, the gradient of the hidden states (b·T·H·m), and the head's weight gradient
    [V, H] float32 made whole before it reaches `.grad`: that buffer is the gradient itself when
    `.grad` is empty (the first micro-batch), one more [V, H] when it is added to an existing one
    (later micro-batches, or a tied embedding, whose gradient arrives at the end of the backward).

    Unfused: the model's logits [b, T + 1, V] (c bytes) kept for the backward, then their gradient
    [b, T, V] and its copy into the full [b, T + 1, V] (two at a time), and the chunked log-softmax's
    four float32 chunk buffers (2**21 elements each)."""
    V, H = model.vocab_size, model.hidden_size
    tokens = step.micro_batch_size * step.completion_length
    if not step.fused_logps:
        full = step.micro_batch_size * (step.completion_length + 1) * V * step.compute_bytes
        return 2 * full + 4 * min(UNFUSED_CHUNK_ELEMENTS, tokens * V) * FLOAT32
    chunk = min(chunk_rows(V, H), tokens) * V * FLOAT32
    weight_grad = V * H * FLOAT32 if model.tied_embeddings or step.micro_batches > 1 else 0
    backward = chunk + tokens * H * step.master_bytes + weight_grad
    return max(2 * chunk, backward)


def held_gradient_bytes(model: ModelShape, step: StepShape) -> int:
    """When the prompt runs in a pass of its own, every weight it uses (all but an untied head) gets
    two gradient contributions, and autograd holds the first, a whole gradient of each such weight,
    until the second arrives at the end of the backward. Beyond the gradients already counted only
    when they are added to existing ones (micro-batches after the first): then the peak is at the start
    of the prompt pass's backward, with those held gradients and that pass's own saved activations."""
    passes = forward_passes(model, step)
    if len(passes) < 2 or step.micro_batches < 2:
        return 0
    shared = model.num_parameters - (0 if model.tied_embeddings else model.vocab_size * model.hidden_size)
    return min(model.trainable, shared) * step.master_bytes + pass_bytes(model, step, passes[0], True)


def frozen_pass_bytes(model: ModelShape, step: StepShape) -> int:
    """A gradient-free forward over one micro-batch (reference or old-policy log-probs): within a layer
    the residual stream, the normed input (H each) and the MLP's gate, SiLU and up (3·I) live at once,
    c bytes per token, with the attention mask; then the hidden states the head reads (b·T·H·m) and
    two float32 chunks."""
    V, H = model.vocab_size, model.hidden_size
    widest = max(forward_passes(model, step), key=lambda p: p.tokens)
    layer = widest.tokens * (2 * H + 3 * model.intermediate_size) * step.compute_bytes
    mask = widest.rows * widest.queries * widest.keys * step.master_bytes
    tokens = step.micro_batch_size * step.completion_length
    chunk = min(chunk_rows(V, H), tokens) * V * FLOAT32
    return layer + mask + tokens * H * step.master_bytes + 2 * chunk


def layer_copy_bytes(model: ModelShape, step: StepShape) -> int:
    """Under autocast on the lean forward, the compute-dtype copies of the layers' matrices that a frozen
    pass or a rollout keeps while it lasts (`engine.weights_cast_once`): every parameter but the
    embedding, an untied head and the norms, c bytes each; 0 in float32 or on transformers' forward."""
    if step.compute_bytes == step.master_bytes or not model.lean_forward:
        return 0
    V, H, L = model.vocab_size, model.hidden_size, model.num_layers
    head = 0 if model.tied_embeddings else V * H
    return (model.num_parameters - V * H - head - (2 * L + 1) * H) * step.compute_bytes


# gkd's loss chunk (`ops.chunked_generalized_jsd`): both models' logits, their log-softmaxes, the
# mixture and the products, each [positions, V] float32
GKD_CHUNK_BUFFERS = 10


def forecast_memory(
    model: ModelShape, step: StepShape, baseline_bytes: int = 0, teacher: ModelShape | None = None
) -> MemoryForecast:
    """Each part of one GRPO step's memory, the peak of each phase, and the total (see the module's
    docstring; every formula is in the helper that counts it). `teacher`: a distillation teacher's
    shape (loss_type=opd or gkd): its weights stay, its gradient-free pass is a frozen pass of its own,
    and with `step.teacher_states` its hidden states are held through the update."""
    m, c = step.master_bytes, step.compute_bytes
    N, trainable = model.num_parameters, model.trainable
    V, H, L = model.vocab_size, model.hidden_size, model.num_layers
    weights = N * m  # every parameter in the stored dtype
    reference = N * m if step.reference else 0  # models.make_reference: a deep copy
    gradients = trainable * m  # .grad in the parameter's dtype
    optimizer = 2 * trainable * m  # torch AdamW: exp_avg, exp_avg_sq like the parameter
    # KV cache: keys and values, [L, B, kv, Lp + T, d] each, in the compute dtype
    S = step.prompt_length + step.completion_length
    kv_cache = 2 * L * model.num_kv_heads * model.d * step.rows * S * c
    decode_logits = DECODE_STEP_BUFFERS * step.rows * V * FLOAT32
    embeddings = V * H  # the embedding matrix: never copied for decoding or by autocast
    matrices = N - embeddings - (2 * L + 1) * H  # the layers' matrices and an untied head
    if model.tied_embeddings:
        matrices += embeddings  # the head's copy is made all the same
    decode_weights = matrices * c if step.static_decode else 0
    # under autocast every matrix the forward multiplies by is cast once and kept for the backward (on
    # the lean forward once per optimizer step: `engine.weights_cast_once`); the fused head multiplies
    # outside autocast, in the stored dtype
    cast = matrices - (embeddings if step.fused_logps else 0)
    cast_weights = cast * c if c != m else 0
    activations = activation_bytes(model, step)
    logits = head_bytes(model, step)
    held = held_gradient_bytes(model, step)
    frozen = frozen_pass_bytes(model, step) + layer_copy_bytes(model, step) if step.reference else 0
    teacher_weights = teacher.num_parameters * m if teacher is not None else 0  # in the policy's dtype
    teacher_pass = frozen_pass_bytes(teacher, step) + layer_copy_bytes(teacher, step) if teacher else 0
    held_states = 0
    if teacher is not None and step.teacher_states:  # [B, T, H_T] in the head's (stored) dtype
        held_states = step.rows * step.completion_length * teacher.hidden_size * m
        positions = min(max(1, CHUNK_LOGITS // V), step.micro_batch_size * step.completion_length)
        held_states += GKD_CHUNK_BUFFERS * positions * V * FLOAT32
    persistent = weights + reference + gradients + optimizer + decode_weights + teacher_weights
    copies = layer_copy_bytes(model, step)  # a rollout's, held while it lasts (prefill included)
    if step.static_decode:  # the static loop's KV buffers outlive the rollout
        persistent += kv_cache
        sampling = persistent + decode_logits + copies
    else:
        sampling = persistent + kv_cache + decode_logits + copies
    reference_pass = persistent + max(frozen, teacher_pass) if step.reference or teacher is not None else 0
    # the update's peak: the start of the backward (everything saved, the head's buffers), or with the
    # prompt in a pass of its own the start of that pass's backward (`held_gradient_bytes`)
    update = persistent + held_states + cast_weights + max(activations + logits, held)
    return MemoryForecast(
        weights=weights,
        reference=reference,
        gradients=gradients,
        optimizer=optimizer,
        activations=activations,
        held_gradients=held,
        kv_cache=kv_cache,
        logits=logits,
        decode_logits=decode_logits,
        decode_weights=decode_weights,
        cast_weights=cast_weights,
        frozen_pass=frozen,
        teacher=teacher_weights,
        teacher_states=held_states,
        baseline=baseline_bytes,
        sampling=sampling,
        reference_pass=reference_pass,
        update=update,
        total=baseline_bytes + max(sampling, reference_pass, update),
    )


def largest_micro_batch(
    model: ModelShape,
    step: StepShape,
    budget_bytes: int,
    baseline_bytes: int = 0,
    teacher: ModelShape | None = None,
) -> int | None:
    """The largest micro_batch_size dividing step.rows whose forecast total fits `budget_bytes`, or
    None when even 1 does not fit (`teacher`: as `forecast_memory` takes it)."""
    for micro in sorted((k for k in range(1, step.rows + 1) if step.rows % k == 0), reverse=True):
        shape = replace(step, micro_batch_size=micro)
        if forecast_memory(model, shape, baseline_bytes, teacher).total <= budget_bytes:
            return micro
    return None


_UNITS = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?|\.\d+)\s*([a-zA-Z]*)\s*$")


def parse_bytes(text: str) -> int:
    """A memory size as written on a command line -> bytes: a number with a unit, binary (KiB, MiB,
    GiB, TiB: powers of 1024) or decimal (KB, MB, GB, TB: powers of 1000), case-insensitive, or a
    bare number of bytes. "80GiB" -> 85899345920, "24GB" -> 24000000000, "512MiB" -> 536870912."""
    match = _SIZE.match(text) if isinstance(text, str) else None
    unit = match.group(2).lower() if match else ""
    if match is None or (unit and unit not in _UNITS):
        raise ValueError(
            f"cannot read {text!r} as a memory size: write a number and a unit, binary (KiB, MiB, GiB, "
            "TiB) or decimal (KB, MB, GB, TB), such as 80GiB, 24GB or 512MiB, or a number of bytes."
        )
    return int(float(match.group(1)) * _UNITS[unit or "b"])
