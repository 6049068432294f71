"""Device placement and precision, exercised on a CPU-only machine.

* `resolve_device` and `Precision` (models.device); `distributed.choose_backend`'s decision with any
  number of GPUs, and `distributed.init` acting on it.
* Inputs made on the host reach a model on another device: the model is put on torch's `meta`
  device (shapes only, no data), where a host tensor meeting a meta weight fails exactly as a host
  tensor meeting a CUDA weight does ("index is on cpu", the bug measured on an H100).
* Mixed precision: the lean Llama forward and the KV sampler under `torch.autocast(bfloat16)` with
  float32 weights, against transformers' forward under the same autocast.
* A reward model placed by `RewardModelFunction.from_path(device=...)`; `run_sft` and `evaluate`
  with a model given on the CPU, in mixed precision.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from grpokit.models import (
    KVCache,
    LeanLlamaDecoder,
    Precision,
    backend_of,
    build_policy,
    build_reward_model,
    char_tokenizer,
    lean_decoder,
    lm_head_of,
    model_device,
    resolve_device,
    reward_scores,
)
from grpokit.train import distributed

META = torch.device("meta")


@pytest.fixture
def no_cuda(monkeypatch):
    """torch sees no GPU, whatever the machine (the tests below are about the CPU-only answers)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)


@pytest.fixture
def one_gpu(monkeypatch):
    """torch sees one GPU (nothing here runs on it: only device objects are made)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)


def _policy(seed: int = 0, vocab_size: int = 40):
    return build_policy(
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        vocab_size=vocab_size,
        dropout=0.0,
        seed=seed,
        intermediate_size=96,
    ).eval()


def _ids_and_mask(b: int = 3, L: int = 9):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 40, (b, L), generator=g)
    mask = torch.ones(b, L, dtype=torch.long)
    mask[0, :3] = 0  # left padding of different widths
    mask[1, :1] = 0
    return ids * mask, mask


# ----------------------------------------------------------------------------- resolve_device, Precision


def test_resolve_device_auto_is_the_cpu_without_cuda(no_cuda):
    assert resolve_device("auto") == torch.device("cpu")
    assert resolve_device("auto", local_rank=3) == torch.device("cpu")
    assert resolve_device("cpu") == torch.device("cpu")


def test_resolve_device_cuda_without_cuda_names_the_way_out(no_cuda):
    for name in ("cuda", "cuda:0"):
        with pytest.raises(RuntimeError, match="device=cpu"):
            resolve_device(name)


@pytest.mark.parametrize("name", ["gpu", "CUDA", "cuda0", ""])  # the config's pattern refuses cuda:x
def test_resolve_device_refuses_other_names(name):
    with pytest.raises(ValueError, match="auto, cpu, cuda or cuda:N"):
        resolve_device(name)


def test_resolve_device_picks_the_rank_gpu_and_checks_the_index(one_gpu):
    assert resolve_device("auto") == torch.device("cuda", 0)
    assert resolve_device("cuda", local_rank=0) == torch.device("cuda", 0)
    assert resolve_device("cuda:0", local_rank=5) == torch.device("cuda", 0)  # explicit: as written
    with pytest.raises(RuntimeError, match="1 GPU"):
        resolve_device("cuda:1")
    with pytest.raises(RuntimeError, match="1 GPU"):
        resolve_device("auto", local_rank=1)


def test_precision_of_config_values():
    mixed = Precision.of("bfloat16")
    assert (mixed.compute, mixed.master, mixed.mixed) == (torch.bfloat16, torch.float32, True)
    pure = Precision.of("bfloat16", "dtype")
    assert (pure.compute, pure.master, pure.mixed) == (torch.bfloat16, torch.bfloat16, False)
    plain = Precision.of()
    assert (plain.compute, plain.master, plain.mixed) == (torch.float32, torch.float32, False)
    assert Precision.of("float16").compute == torch.float16
    cpu = torch.device("cpu")
    with mixed.autocast(cpu):
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
        assert torch.mm(torch.ones(2, 2), torch.ones(2, 2)).dtype == torch.bfloat16
    with pure.autocast(cpu):  # weights already in the compute dtype: no autocast
        assert not torch.is_autocast_enabled("cpu")
    assert not torch.is_autocast_enabled("cpu")


def test_model_device():
    model = torch.nn.Linear(2, 2)
    assert model_device(model) == torch.device("cpu")
    assert model_device(model.to(META)) == META
    assert model_device(torch.nn.ReLU()) == torch.device("cpu")  # no parameters


# ----------------------------------------------------------------------------- host inputs, model elsewhere


@pytest.mark.parametrize("T", [1, 4, 30])  # one token, the packed path, the two-pass path
def test_shared_prefix_takes_host_inputs_to_the_model_device(T):
    """The H100 crash (`index is on cpu` in shared_prefix): host inputs, model elsewhere."""
    model = _policy().to(META)
    decoder = lean_decoder(model)
    assert isinstance(decoder, LeanLlamaDecoder)
    ids, mask = _ids_and_mask(b=2, L=5)
    suffix = torch.randint(3, 40, (4, T))
    hidden = decoder.shared_prefix(ids, mask.bool(), suffix, torch.ones(4, T, dtype=torch.bool), 2)
    assert hidden.device == META and hidden.shape == (4, T, 64)


def test_lean_forward_and_cache_live_on_the_model_device():
    model = _policy().to(META)
    decoder = lean_decoder(model)
    ids, mask = _ids_and_mask()
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    assert decoder(input_ids=ids, attention_mask=mask).last_hidden_state.device == META
    assert decoder(input_ids=ids, position_ids=positions).last_hidden_state.device == META
    with torch.no_grad():
        cache = decoder.new_cache(3, 12, torch.zeros(1))  # `like` on the host: only its dtype counts
        assert isinstance(cache, KVCache) and cache.keys.device == META and cache.values.device == META
        out = decoder(ids[:, :6], key_mask=mask[:, :6], position_ids=positions[:, :6], cache=cache)
        assert out.last_hidden_state.device == META and cache.length == 6
    targets = torch.randint(3, 40, (3, 2))
    hidden = backend_of(model).hidden(ids, mask.bool(), targets, torch.ones(3, 2, dtype=torch.bool), 1)
    assert hidden.device == META and hidden.shape == (3, 2, 64)


class _Probe(torch.nn.Module):
    """A model on the meta device that records the devices of what it is called with."""

    def __init__(self, logits_width: int = 1) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1, device=META))
        self.seen: list[torch.device] = []
        self.width = logits_width

    def forward(self, input_ids, attention_mask, **kwargs):
        self.seen += [input_ids.device, attention_mask.device]
        self.seen += [v.device for v in kwargs.values() if isinstance(v, torch.Tensor)]
        return SimpleNamespace(logits=torch.zeros(*input_ids.shape[:1], self.width, device=META))


def test_reward_scores_take_host_inputs_to_the_model_device():
    probe = _Probe()
    ids, mask = _ids_and_mask()
    scores = reward_scores(probe, ids, mask.bool())
    assert scores.device == META and scores.shape == (3,)
    assert probe.seen and set(probe.seen) == {META}  # ids, mask and position ids


def test_sft_loss_takes_host_batches_to_the_model_device():
    from grpokit.train.sft import sft_batch, sft_loss

    tok = char_tokenizer("0123456789+=")
    probe = _Probe(logits_width=len(tok))
    probe.forward = lambda input_ids, attention_mask, **_: (  # type: ignore[method-assign]
        probe.seen.extend([input_ids.device, attention_mask.device])
        or SimpleNamespace(logits=torch.zeros(*input_ids.shape, len(tok), device=META))
    )
    batch = sft_batch(tok, [{"prompt": "1+2=", "answer": "3"}, {"prompt": "10+2=", "answer": "12"}])
    assert sft_loss(probe, batch).device == META
    assert set(probe.seen) == {META}


# ----------------------------------------------------------------------------- mixed precision (autocast)


def test_lean_forward_under_autocast_equals_transformers_under_autocast():
    """float32 weights, bfloat16 autocast. Both forwards feed the same bfloat16 values to the same
    matmuls and differ only in float32 element-wise arithmetic (norms, rotary), so they agree to
    float32 round-off; autocast itself moves the states by bfloat16 round-off (2^-8 relative, about
    1e-2 here). The tolerance, 5% of that move, separates the two by orders of magnitude (measured:
    2e-7 against 1e-2) and still admits a rare bfloat16 rounding flip of a single element. The KV
    cache is allocated in bfloat16, the dtype autocast's projections produce, and cached decoding
    agrees with the full forward just as closely."""
    model = _policy()
    decoder = lean_decoder(model)
    ids, mask = _ids_and_mask()
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    real = mask.bool()
    with torch.no_grad():
        full = model.model(input_ids=ids, attention_mask=mask, position_ids=positions).last_hidden_state
        with torch.autocast("cpu", dtype=torch.bfloat16):
            expected = model.model(
                input_ids=ids, attention_mask=mask, position_ids=positions
            ).last_hidden_state
            ours = decoder(input_ids=ids, attention_mask=mask, position_ids=positions).last_hidden_state
            cache = decoder.new_cache(3, 12, model.lm_head.weight)
            parts = [
                decoder(
                    ids[:, a:b], key_mask=mask[:, :b].bool(), position_ids=positions[:, a:b], cache=cache
                ).last_hidden_state
                for a, b in [(0, 6), (6, 7), (7, 8), (8, 9)]  # a prefill, then token by token
            ]
        outside = decoder.new_cache(3, 12, model.lm_head.weight)
    assert cache.keys.dtype == cache.values.dtype == torch.bfloat16
    assert outside.keys.dtype == torch.float32  # without autocast: the weights' dtype
    autocast_move = (expected - full)[real].abs().max().item()
    assert autocast_move > 1e-3  # the forward really ran in bfloat16
    tolerance = 0.05 * autocast_move
    torch.testing.assert_close(ours[real], expected[real], rtol=0, atol=tolerance)
    torch.testing.assert_close(torch.cat(parts, dim=1)[real], expected[real], rtol=0, atol=tolerance)


@pytest.mark.parametrize("kwargs", [{"temperature": 0.0}, {}])
def test_lean_backend_under_autocast_matches_transformers_backend(kwargs, monkeypatch):
    """The decode loop over the lean backend under bfloat16 autocast (float32 weights) draws the tokens
    it draws over transformers' forward under the same autocast, with the same log-probs (as above:
    float32 round-off apart), from a bfloat16 cache; the Rollout comes back on the host."""
    from grpokit.models import TransformersBackend, backend_of
    from grpokit.rollout import Decoder, SamplingParams

    tok = char_tokenizer("0123456789+=")
    model = build_policy(hidden_size=64, num_layers=2, num_heads=4, vocab_size=len(tok), dropout=0.0, seed=3)
    caches: list[KVCache] = []
    original = LeanLlamaDecoder.new_cache

    def recorded(self, *args, **kw):
        caches.append(original(self, *args, **kw))
        return caches[-1]

    monkeypatch.setattr(LeanLlamaDecoder, "new_cache", recorded)
    params = SamplingParams(num_generations=4, max_completion_length=8, seed=5, **kwargs)
    prompts = ["12+3=", "7+8=", "99+99="]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lean = Decoder(backend_of(model), tok).sample(prompts, params)
        # transformers' forward and DynamicCache
        plain = Decoder(TransformersBackend(model, lm_head_of(model)), tok).sample(prompts, params)
    assert len(caches) == 1 and caches[0].keys.dtype == torch.bfloat16
    assert torch.equal(lean.completion_ids, plain.completion_ids)
    torch.testing.assert_close(lean.sampling_logps, plain.sampling_logps, rtol=1e-5, atol=1e-5)
    for field in ("prompt_ids", "completion_ids", "completion_mask", "sampling_logps"):
        assert getattr(lean, field).device == torch.device("cpu"), field
    assert lean.sampling_logps.dtype == torch.float32


# ----------------------------------------------------------------------------- reward model function


@pytest.fixture
def saved_reward_model(tmp_path):
    tok = char_tokenizer("0123456789+=")
    model = build_reward_model(
        hidden_size=16, num_layers=1, num_heads=2, vocab_size=len(tok), max_seq_len=32, seed=0
    )
    model.save_pretrained(tmp_path, safe_serialization=True)
    tok.save_pretrained(tmp_path)
    return tmp_path, model, tok


def test_reward_model_function_placed_on_the_cpu(saved_reward_model):
    from grpokit.rewards import RewardModelFunction

    path, model, tok = saved_reward_model
    fn = RewardModelFunction.from_path(path, device="cpu", batch_size=2)
    assert model_device(fn.model) == torch.device("cpu")
    scores = fn(["1+1=", "22+22=", "3+3="], ["2", "44", "7"])
    assert len(scores) == 3 and all(type(s) is float for s in scores)  # host floats
    alone = torch.tensor([tok("3+3=7", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]])
    with torch.no_grad():
        assert scores[2] == pytest.approx(model(input_ids=alone).logits[0, 0].item(), abs=1e-5)
    bf16 = RewardModelFunction.from_path(path, device=torch.device("cpu"), dtype="bfloat16")
    assert next(bf16.model.parameters()).dtype == torch.bfloat16


def test_reward_model_function_defaults_to_auto(saved_reward_model, no_cuda, monkeypatch):
    from grpokit.rewards import RewardModelFunction
    from grpokit.rewards.reward_model import placement

    path, _, _ = saved_reward_model
    assert model_device(RewardModelFunction.from_path(path).model) == torch.device("cpu")
    with pytest.raises(RuntimeError, match="device=cpu"):
        RewardModelFunction.from_path(path, device="cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert placement("auto") == torch.device("cuda", 0)
    monkeypatch.setenv("LOCAL_RANK", "1")  # a second rank on a one-GPU machine: the CPU, as the policy
    assert placement("auto") == torch.device("cpu")
    with pytest.raises(RuntimeError, match="1 GPU"):
        placement("cuda")
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert placement("cuda") == torch.device("cuda", 0)


# ----------------------------------------------------------------------------- SFT and evaluation


def test_run_sft_on_a_given_cpu_model_in_mixed_precision():
    """The model trains where it is given, stored in float32, its forward passes under bfloat16
    autocast: the first loss is the autocast loss of the initial model, not the float32 one. (Every
    row is the same, so the batch run_sft draws is this one in any order; the two losses differ by
    bfloat16 round-off, and the first loss must sit within 5% of that gap of the autocast one.)"""
    from grpokit.config.plan import SFTSchedule
    from grpokit.train.sft import run_sft, sft_batch, sft_loss

    tok = char_tokenizer("0123456789+=")
    rows = [{"prompt": "12+34=", "answer": "46"}] * 4
    model = build_policy(hidden_size=32, num_layers=1, num_heads=2, vocab_size=len(tok), dropout=0.0, seed=0)
    batch = sft_batch(tok, rows)
    with torch.no_grad():
        fp32_loss = sft_loss(model, batch).item()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            bf16_loss = sft_loss(model, batch).item()
    gap = abs(bf16_loss - fp32_loss)
    assert gap > 1e-6  # autocast changes the loss
    before = {k: v.clone() for k, v in model.state_dict().items()}
    schedule = SFTSchedule(steps=3, batch_size=len(rows), learning_rate=1e-2, seed=0)
    result = run_sft(model, tok, rows, schedule, precision=Precision.of("bfloat16"))
    assert len(result.losses) == 3 and all(type(x) is float for x in result.losses)
    assert abs(result.losses[0] - bf16_loss) <= 0.05 * gap
    assert all(p.dtype == torch.float32 and p.device.type == "cpu" for p in model.parameters())
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())  # it trained


def test_evaluate_samples_through_the_engine_it_is_given():
    """Evaluation draws only through `engine.generate` (so on the engine's device, in its precision
    and decode loop): greedy completions `batch_size` rows a call, then pass@k's sampled ones at the
    settings' temperature and seed; the weights stay as the engine keeps them."""
    from grpokit.config.plan import Evaluation
    from grpokit.engine import EngineSpec, PolicyEngine
    from grpokit.train.evaluation import EvalTask, evaluate

    tok = char_tokenizer("0123456789+=")
    model = build_policy(hidden_size=32, num_layers=1, num_heads=2, vocab_size=len(tok), dropout=0.0, seed=0)
    rows = [{"prompt": f"{a}+{a}=", "answer": str(2 * a)} for a in (1, 4, 2)]
    spec = EngineSpec(dtype="bfloat16")
    engine = PolicyEngine.create(model, tok, spec)
    calls: list[tuple[int, float, int | None, int]] = []
    generate = engine.generate

    def spy(prompts, params, rows=None):
        calls.append((len(prompts), params.temperature, params.seed, params.num_generations))
        return generate(prompts, params, rows)

    engine.generate = spy

    def reward(prompts, completions, **_):
        return [float(len(c)) for c in completions]

    right = lambda completion, row: completion.strip() == row["answer"]  # noqa: E731
    settings = Evaluation(pass_at_k=2, temperature=0.7, seed=5, batch_size=2)
    metrics = evaluate(engine, EvalTask(rows, [reward], right, max_completion_length=4), settings)
    # greedy: 2 + 1 prompts; pass@2: one prompt (2 rows) a call
    assert calls == [(2, 0.0, None, 1), (1, 0.0, None, 1), (1, 0.7, 5, 2), (1, 0.7, 5, 2), (1, 0.7, 5, 2)]
    assert all(type(v) is float for v in metrics.values()) and 0.0 <= metrics["accuracy"] <= 1.0
    assert 0.0 <= metrics["pass@2"] <= 1.0
    assert all(p.dtype == torch.float32 for p in model.parameters())
    calls.clear()
    plain = evaluate(engine, EvalTask(rows, [reward], None, None, 4))
    assert calls == [(3, 0.0, None, 1)]  # no batch_size: all at once; no correctness: no pass@k
    assert type(plain["reward"]) is float and "accuracy" not in plain


# ----------------------------------------------------------------------------- distributed placement


@pytest.mark.parametrize(
    ("device", "gpus", "rank", "ranks", "expected"),
    [
        ("cpu", 4, 1, 2, ("gloo", "cpu")),
        ("auto", 0, 1, 2, ("gloo", "cpu")),
        ("auto", 2, 1, 2, ("nccl", "cuda:1")),
        ("auto", 8, 0, 2, ("nccl", "cuda:0")),
        ("cuda", 2, 1, 2, ("nccl", "cuda:1")),
        ("cuda:1", 2, 0, 1, ("nccl", "cuda:1")),  # one rank per node: the GPU named
    ],
)
def test_choose_backend(device, gpus, rank, ranks, expected):
    backend, placed = distributed.choose_backend(device, gpus, rank, ranks)
    assert (backend, placed) == (expected[0], torch.device(expected[1]))


def test_two_ranks_on_one_gpu_never_share_it_with_nccl(caplog):
    """auto: every rank of the node falls back to gloo on the CPU (rank 0 too: the ranks must agree
    on the backend), with a one-line warning; cuda: an error naming the way out."""
    with caplog.at_level(logging.WARNING, logger="grpokit.train.distributed"):
        chosen = [distributed.choose_backend("auto", 1, rank, 2) for rank in (0, 1)]
    assert chosen == [("gloo", torch.device("cpu"))] * 2
    assert len(caplog.records) == 2 and all("\n" not in r.getMessage() for r in caplog.records)
    assert "2 ranks" in caplog.records[0].getMessage() and "1 GPU" in caplog.records[0].getMessage()
    for rank in (0, 1):
        with pytest.raises(RuntimeError, match="device=cpu"):
            distributed.choose_backend("cuda", 1, rank, 2)
    with pytest.raises(ValueError, match="one GPU"):
        distributed.choose_backend("cuda:0", 2, 0, 2)  # every rank of the node on cuda:0
    with pytest.raises(RuntimeError, match="device=cpu"):
        distributed.choose_backend("cuda", 0, 0, 2)
    with pytest.raises(RuntimeError, match="2 GPU"):
        distributed.choose_backend("cuda:2", 2, 0, 1)
    for name in ("gpu", "cuda:x"):
        with pytest.raises(ValueError, match="auto, cpu, cuda or cuda:N"):
            distributed.choose_backend(name, 2, 0, 2)


def test_init_alone_resolves_the_device(no_cuda, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    alone = distributed.init()
    assert not alone.enabled and alone.device == torch.device("cpu")
    assert distributed.init("cpu").device == torch.device("cpu")
    with pytest.raises(RuntimeError, match="device=cpu"):
        distributed.init("cuda")


def test_init_under_torchrun_acts_on_the_decision(one_gpu, monkeypatch):
    """Two ranks on a one-GPU machine: rank 1 joins a gloo group on the CPU and never selects a GPU."""
    calls: list[tuple[str, object]] = []
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(distributed.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(
        distributed.dist, "init_process_group", lambda backend: calls.append(("init", backend))
    )
    monkeypatch.setattr(distributed.dist, "get_rank", lambda: 1)
    monkeypatch.setattr(distributed.dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: calls.append(("set_device", device)))
    d = distributed.init()
    assert calls == [("init", "gloo")] and d.device == torch.device("cpu")
    assert (d.rank, d.world_size, d.local_rank, d.enabled) == (1, 2, 1, True)
    calls.clear()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")  # one rank on this node: it takes the GPU
    monkeypatch.setenv("LOCAL_RANK", "0")
    d = distributed.init("auto")
    assert calls == [("set_device", torch.device("cuda", 0)), ("init", "nccl")]
    assert d.device == torch.device("cuda", 0)
