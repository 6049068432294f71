"""The decode loop (`rollout.Decoder`, eager step): determinism, masks, truncation flags, sampling
log-probs, and equality with transformers' generate (`reference_generate`, a test reference)."""

from __future__ import annotations

import contextlib

import pytest
import torch

from grpokit.models import backend_of
from grpokit.ops import completion_logps
from grpokit.rollout import Decoder, LoopControl, SamplingParams

from .reference_generate import completion_mask_from_ids, reference_generate

EOS = 2


def _decoder(model, tok, **kwargs) -> Decoder:
    return Decoder(backend_of(model), tok, **kwargs)


def test_mask_hand_checked_cases():
    """T = 4, EOS = 2. Row 0: EOS first -> only it counts. Row 1: no EOS -> all count, truncated.
    Row 2: EOS at the last allowed position -> all count, not truncated. Row 3: EOS then more
    tokens -> up to and including the first EOS. Row 4: a stop string completed at token 2."""
    ids = torch.tensor([[2, 0, 0, 0], [5, 6, 7, 8], [5, 6, 7, 2], [5, 2, 7, 2], [5, 6, 0, 0]])
    stops = torch.tensor([-1, -1, -1, -1, 2])
    mask, truncated = completion_mask_from_ids(ids, [EOS], stops)
    assert mask.tolist() == [
        [True, False, False, False],
        [True, True, True, True],
        [True, True, True, True],
        [True, True, False, False],
        [True, True, False, False],
    ]
    assert truncated.tolist() == [False, True, False, False, False]


@contextlib.contextmanager
def biased_logits(model, token: int, bias: float):
    """Add `bias` to one token's logit at every position (forces or forbids it)."""

    def hook(module, inputs, output):
        output = output.clone()
        output[..., token] += bias
        return output

    handle = model.lm_head.register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def test_same_seed_same_completions(tiny_policy):
    model, tok = tiny_policy
    sampler = _decoder(model, tok)
    prompts = [f"{a}+{a + 3}=" for a in range(16)]
    params = SamplingParams(num_generations=8, max_completion_length=6, seed=7)
    first, second = sampler.sample(prompts, params), sampler.sample(prompts, params)
    assert first.completion_ids.shape[0] == 128
    assert torch.equal(first.completion_ids, second.completion_ids)
    assert torch.equal(first.sampling_logps, second.sampling_logps)
    other = sampler.sample(prompts, SamplingParams(num_generations=8, max_completion_length=6, seed=8))
    assert not torch.equal(first.completion_ids, other.completion_ids)
    # rows p·G … p·G+G−1 hold prompt p
    assert torch.equal(first.prompt_ids[8:16], first.prompt_ids[8:9].expand(8, -1))


def test_eos_first_and_never(tiny_policy):
    model, tok = tiny_policy
    params = SamplingParams(num_generations=2, max_completion_length=5, seed=0)
    with biased_logits(model, EOS, 1e4):  # the backend is chosen when the decoder is made: hooks first
        first = _decoder(model, tok).sample(["1+1="], params)
    assert first.completion_mask.tolist() == [[True], [True]] and not first.truncated.any()
    assert first.completions == ["", ""]
    with biased_logits(model, EOS, -1e4):
        never = _decoder(model, tok).sample(["1+1="], params)
    assert never.completion_ids.shape == (2, 5) and never.completion_mask.all() and never.truncated.all()


@pytest.mark.parametrize("kwargs", [{}, {"temperature": 0.7}, {"repetition_penalty": 1.3}])
def test_sampling_logps_equal_a_forward_pass(tiny_policy, kwargs):
    """Without truncating warpers the sampling distribution is softmax(logits / temperature), so
    the recorded log-probs equal ops.completion_logps of a forward pass over prompt + completion
    (repetition penalty excepted, which reshapes the distribution: there they must differ)."""
    model, tok = tiny_policy
    sampler = _decoder(model, tok)
    params = SamplingParams(num_generations=4, max_completion_length=6, seed=3, **kwargs)
    r = sampler.sample(["12+3=", "7+8="], params)  # prompts of different lengths: left padding
    ids = torch.cat([r.prompt_ids, r.completion_ids], dim=1)
    mask = torch.cat([r.prompt_mask, r.completion_mask], dim=1).long()
    with torch.no_grad():
        logps = completion_logps(
            model(ids, attention_mask=mask).logits, ids, r.prompt_ids.shape[1], params.temperature
        )
    gap = torch.where(r.completion_mask, logps - r.sampling_logps, 0.0).abs().max()
    if "repetition_penalty" in kwargs:
        assert gap > 1e-3
    else:
        assert gap < 1e-5  # float32 forward passes of different batch shapes


@pytest.mark.parametrize("kwargs", [{"top_k": 1}, {"min_p": 1.0}, {"top_p": 1e-6}])
def test_truncating_warpers_renormalise_over_the_kept_tokens(tiny_policy, kwargs):
    """top_k = 1, min_p = 1 and a tiny top_p each keep only the most likely token: the draws are
    greedy and every recorded log-prob is log 1 = 0 (the distribution actually sampled from)."""
    model, tok = tiny_policy
    sampler = _decoder(model, tok)
    r = sampler.sample(["5+5="], SamplingParams(num_generations=8, max_completion_length=3, seed=1, **kwargs))
    assert torch.allclose(r.sampling_logps[r.completion_mask], torch.zeros(()), atol=1e-6)
    greedy = sampler.sample(
        ["5+5="], SamplingParams(num_generations=1, max_completion_length=3, temperature=0.0)
    )
    assert torch.equal(r.completion_ids, greedy.completion_ids.expand(8, -1))


def test_greedy_gives_identical_rows(tiny_policy):
    model, tok = tiny_policy
    r = _decoder(model, tok).sample(
        ["5+5="], SamplingParams(num_generations=3, max_completion_length=4, temperature=0.0)
    )
    assert torch.equal(r.completion_ids[0], r.completion_ids[1]) and torch.equal(
        r.completion_ids[1], r.completion_ids[2]
    )


def test_stop_strings_end_a_row(tiny_policy):
    model, tok = tiny_policy
    plus = tok.convert_tokens_to_ids("+")
    params = SamplingParams(num_generations=2, max_completion_length=6, seed=0, stop_strings=("+",))
    with biased_logits(model, plus, 1e4):
        r = _decoder(model, tok).sample(["1="], params)
    assert r.completion_mask.sum(1).tolist() == [1, 1] and not r.truncated.any()
    assert r.completions == ["+", "+"]


def test_long_prompts_are_cut_from_the_left_or_refused(tiny_policy, caplog):
    model, tok = tiny_policy
    sampler = _decoder(model, tok)
    cut = SamplingParams(num_generations=1, max_completion_length=2, max_prompt_length=3, seed=0)
    with caplog.at_level("WARNING"):
        r = sampler.sample(["123+4=", "1=", "99+1="], cut)
    assert r.num_truncated_prompts == 2 and "2 prompt(s)" in caplog.text
    assert tok.decode(r.prompt_ids[0]) == "+4="  # the end of the prompt is kept
    refuse = SamplingParams(
        num_generations=1, max_completion_length=2, max_prompt_length=3, prompt_truncation="error"
    )
    with pytest.raises(ValueError, match="prompt 0 has 6 tokens, more than max_prompt_length=3"):
        sampler.sample(["123+4=", "1="], refuse)
    with pytest.raises(ValueError, match="empty"):
        sampler.sample([], cut)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_generations": 0}, "num_generations"),
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"prompt_truncation": "right"}, "prompt_truncation"),
    ],
)
def test_bad_sampling_params(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


# ------------------------------------------------------------- against generate, and the loop's own rules


def _kv(tiny_policy, **kwargs):
    model, tok = tiny_policy
    return _decoder(model, tok, **kwargs)


def test_decoder_greedy_equals_generate(tiny_policy):
    model, tok = tiny_policy
    params = SamplingParams(num_generations=3, max_completion_length=6, temperature=0.0)
    prompts = ["12+3=", "7+8=", "1="]
    ours, reference = (
        _kv(tiny_policy).sample(prompts, params),
        reference_generate(model, tok, prompts, params),
    )
    assert torch.equal(ours.completion_ids, reference.completion_ids)
    assert torch.equal(ours.completion_mask, reference.completion_mask) and torch.equal(
        ours.truncated, reference.truncated
    )
    assert torch.equal(ours.prompt_ids, reference.prompt_ids) and ours.completions == reference.completions


@pytest.mark.parametrize("kwargs", [{}, {"temperature": 0.7}])
def test_decoder_logps_equal_a_forward_pass(tiny_policy, kwargs):
    model, tok = tiny_policy
    params = SamplingParams(num_generations=4, max_completion_length=6, seed=3, **kwargs)
    r = _kv(tiny_policy).sample(["12+3=", "7+8="], params)
    ids = torch.cat([r.prompt_ids, r.completion_ids], dim=1)
    mask = torch.cat([r.prompt_mask, r.completion_mask], dim=1).long()
    with torch.no_grad():
        logps = completion_logps(
            model(ids, attention_mask=mask).logits, ids, r.prompt_ids.shape[1], params.temperature
        )
    assert torch.where(r.completion_mask, logps - r.sampling_logps, 0.0).abs().max() < 1e-5


@pytest.mark.parametrize("stop_strings", [None, ["3"]])
def test_decoder_returns_ordinary_tensors_that_train(tiny_policy, stop_strings):
    """The decode loop runs in inference mode; what it returns must be ordinary tensors, or the
    training forward that embeds the sampled ids fails ('Inference tensors cannot be saved for
    backward')."""
    model, _ = tiny_policy
    params = SamplingParams(num_generations=2, max_completion_length=4, seed=1, stop_strings=stop_strings)
    r = _kv(tiny_policy).sample(["12+3=", "7+8="], params)
    tensors = [v for v in vars(r).values() if isinstance(v, torch.Tensor)]
    assert len(tensors) >= 6 and not any(t.is_inference() for t in tensors)
    ids = torch.cat([r.prompt_ids, r.completion_ids], dim=1)
    mask = torch.cat([r.prompt_mask, r.completion_mask], dim=1).long()
    model(ids, attention_mask=mask).logits.sum().backward()
    model.zero_grad()


def test_decoder_samples_in_eval_mode_when_the_model_has_dropout():
    """Sampling leaves a model without dropout in training mode (switching walks every module), but
    one with an active dropout module (a LoRA dropout, here a wrapped projection) is sampled in
    eval mode, as transformers' path is, and handed back in training mode."""
    from grpokit.models import build_policy, char_tokenizer

    tok = char_tokenizer("0123456789+=")
    model = build_policy(hidden_size=32, num_layers=2, num_heads=4, vocab_size=len(tok), dropout=0.0, seed=3)
    attn = model.model.layers[0].self_attn
    attn.q_proj = torch.nn.Sequential(torch.nn.Dropout(0.9), attn.q_proj)
    params = SamplingParams(num_generations=4, max_completion_length=6, seed=5)
    model.eval()
    expected = _decoder(model, tok).sample(["12+3=", "7+8="], params)
    model.train()
    ours = _decoder(model, tok).sample(["12+3=", "7+8="], params)
    assert model.training and model.model.layers[0].self_attn.q_proj[0].training
    assert torch.equal(ours.completion_ids, expected.completion_ids)
    torch.testing.assert_close(ours.sampling_logps, expected.sampling_logps, rtol=0, atol=0)


def test_decoder_is_seeded_and_stops_early(tiny_policy):
    model, _ = tiny_policy
    kv = _kv(tiny_policy)
    prompts = [f"{a}+{a + 3}=" for a in range(16)]
    params = SamplingParams(num_generations=8, max_completion_length=6, seed=7)
    assert torch.equal(kv.sample(prompts, params).completion_ids, kv.sample(prompts, params).completion_ids)
    with biased_logits(model, EOS, 1e4):
        first = _kv(tiny_policy).sample(
            ["1+1="], SamplingParams(num_generations=2, max_completion_length=5, seed=0)
        )
    assert first.completion_ids.shape == (2, 1) and first.completion_mask.all() and not first.truncated.any()


def test_checking_for_finished_rows_less_often_only_adds_padding(tiny_policy):
    """On a GPU the loop reads "every row finished?" every FINISH_CHECK_EVERY tokens (each read waits
    for the GPU): the rows, their masks and log-probs are those of checking every token, with at most
    that many extra padding columns."""
    model, _ = tiny_policy
    params = SamplingParams(num_generations=4, max_completion_length=12, seed=3)
    with biased_logits(model, EOS, 2.0):  # rows end after a few tokens, at different lengths
        every = _kv(tiny_policy).sample(["1+2=", "33+4="], params)
        sparse = _kv(tiny_policy, control=LoopControl(check_every=5)).sample(["1+2=", "33+4="], params)
    T = every.completion_ids.shape[1]
    assert T < 12 and sparse.completion_ids.shape[1] in range(T, min(T + 5, 12) + 1)  # stopped early too
    assert torch.equal(sparse.completion_ids[:, :T], every.completion_ids)
    assert torch.equal(sparse.completion_mask[:, :T], every.completion_mask)
    assert not sparse.completion_mask[:, T:].any() and (sparse.completion_ids[:, T:] == 0).all()  # pad id 0
    assert torch.equal(sparse.sampling_logps[:, :T], every.sampling_logps)
    assert sparse.completions == every.completions and torch.equal(sparse.truncated, every.truncated)


@pytest.mark.parametrize(
    "kwargs", [{}, {"temperature": 0.7, "top_k": 6, "top_p": 0.8}, {"min_p": 0.3, "repetition_penalty": 1.5}]
)
def test_decoder_draws_from_the_same_distribution_as_generate(tiny_policy, kwargs):
    """Statistical test: 20 000 two-token completions of one prompt from each sampler. The total
    variation distance between the two empirical distributions of the first two tokens must be
    below 0.03 (for identical distributions its expected value here is about 0.01)."""
    model, tok = tiny_policy
    n = 20_000
    params = SamplingParams(num_generations=n, max_completion_length=2, seed=11, **kwargs)
    ours = _kv(tiny_policy).sample(["3+4="], params).completion_ids
    reference = reference_generate(model, tok, ["3+4="], params).completion_ids
    V = len(tok)
    for position in range(2):
        p = torch.bincount(ours[:, position], minlength=V).double() / n
        q = torch.bincount(reference[:, position], minlength=V).double() / n
        assert 0.5 * (p - q).abs().sum() < 0.03, (position, p, q)


@pytest.mark.parametrize("top_p", [0.1, 0.5, 0.9, 0.999])
@pytest.mark.parametrize("sharpness", [0.3, 3.0])  # flat rows need the full sort, peaked ones do not
def test_top_p_without_a_full_sort_keeps_exactly_the_same_tokens(top_p, sharpness):
    from grpokit.rollout.processing import top_p_filter

    g = torch.Generator().manual_seed(int(top_p * 1000) + int(sharpness * 10))
    scores = torch.randn(16, 1000, generator=g) * sharpness
    scores[3, 5:] = -torch.inf  # a row already cut by top-k
    fast = top_p_filter(scores, top_p)
    full = top_p_filter(scores, top_p, candidates=scores.shape[-1])  # always the sorted route
    assert torch.equal(fast.isfinite(), full.isfinite())
    assert torch.equal(fast[fast.isfinite()], scores[fast.isfinite()])  # kept tokens keep their scores
    assert fast.isfinite().sum(-1).min() >= 1


def test_the_recorded_masks_are_those_the_ids_imply(tiny_policy):
    """The loop records which tokens the policy drew and where rows were cut as it draws: the masks,
    flags and texts equal those derived from the ids afterwards, for rows ending at every length."""
    model, tok = tiny_policy
    params = SamplingParams(num_generations=16, max_completion_length=6, seed=5)
    with biased_logits(model, EOS, 1.0):
        r = _decoder(model, tok).sample(["1+2=", "33+4="], params)
    lengths = r.completion_mask.sum(-1)
    assert lengths.min() < 4 and r.truncated.any() and not r.truncated.all()
    mask, truncated = completion_mask_from_ids(r.completion_ids, [EOS])
    assert torch.equal(r.completion_mask, mask) and torch.equal(r.truncated, truncated)
    assert r.completions == tok.batch_decode(torch.where(mask, r.completion_ids, 0), skip_special_tokens=True)
