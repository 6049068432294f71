"""Multi-turn rollouts (the decode loop with an environment, rollout/decode.py) and their log-probs and loss.

An episode's transcript mixes the policy's tokens (trained) and the environment's (context only). The
tests build episodes by hand and by sampling, and check which tokens carry loss, that every log-prob
equals one forward over the whole transcript, that the KV cache is never re-run over a transcript,
and that a row of context alone contributes nothing to the loss or its gradient."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch

from grpokit.engine import EngineSpec, PolicyEngine
from grpokit.envs import EnvironmentSpec, calc, tool_environment
from grpokit.models import (
    LeanLlamaDecoder,
    TransformersBackend,
    backend_of,
    build_policy,
    char_tokenizer,
    lm_head_of,
)
from grpokit.ops import grpo_loss
from grpokit.rollout import Decoder, SamplingParams
from grpokit.rollout.decode import StopStrings

ALPHABET = "0123456789+=[](){}\"calc:;' ertonkwusdbfhimp"
EOS = 2


@pytest.fixture(scope="module")
def policy():
    tok = char_tokenizer(ALPHABET)
    model = build_policy(
        hidden_size=32, num_layers=2, num_heads=4, vocab_size=len(tok), dropout=0.0, max_seq_len=256, seed=5
    )
    return model, tok


def transcript_logps(model, prompt_ids, prompt_mask, completion_ids, attention) -> torch.Tensor:
    """log π(token) of every completion token from ONE forward over prompt + whole transcript. [B, T]"""
    ids = torch.cat([prompt_ids, completion_ids], dim=1)
    mask = torch.cat([prompt_mask, attention], dim=1)
    positions = (mask.long().cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask.long(), position_ids=positions).logits
    logits = logits[:, prompt_ids.shape[1] - 1 : -1].double()  # position t scores completion token t
    return torch.log_softmax(logits, -1).gather(-1, completion_ids[..., None]).squeeze(-1)


class Echo:
    """Answers every turn with "{k}" (k = the turn), and pays 0.5 a turn; done after `turns` turns.
    Policy turns end at EOS or "]" (its stop string)."""

    stop_strings = ("]",)

    def __init__(self, turns: int = 10) -> None:
        self.turns, self.k = turns, 0

    def reset(self, row, seed):
        self.seed = seed
        return row.get("intro", "")

    def step(self, text):
        self.k += 1
        return "{" + str(self.k) + "}", 0.5, self.k >= self.turns


def _runs(mask_row: list[bool]) -> list[tuple[bool, int, int]]:
    """Maximal runs of equal mask values: (value, start, end)."""
    runs, start = [], 0
    for t in range(1, len(mask_row) + 1):
        if t == len(mask_row) or mask_row[t] != mask_row[start]:
            runs.append((mask_row[start], start, t))
            start = t
    return runs


def _sample(policy, spec, T=40, G=4, seed=0, prompts=("12+3=", "7+8=", "1="), rows=None, backend=None, **kw):
    model, tok = policy
    sampler = Decoder(backend or backend_of(model), tok, environment=spec)
    rows = rows or [{"prompt": p} for p in prompts]
    params = SamplingParams(num_generations=G, max_completion_length=T, seed=seed, **kw)
    return sampler.sample(list(prompts), params, rows)


def test_which_tokens_carry_loss_and_their_logps_equal_one_forward(policy):
    model, tok = policy
    spec = EnvironmentSpec(lambda: Echo(turns=10), max_turns=3, stop_strings=Echo.stop_strings)
    r = _sample(policy, spec, T=40, G=4)
    assert r.completion_ids.shape[1] <= 40
    env_ids = {k: tok("{" + str(k) + "}", add_special_tokens=False)["input_ids"] for k in (1, 2)}
    close = tok("]", add_special_tokens=False)["input_ids"][0]
    for b in range(r.completion_ids.shape[0]):
        n = int(r.attention[b].sum())
        assert r.attention[b, :n].all() and not r.attention[b, n:].any()  # real tokens, then padding
        runs = _runs(r.completion_mask[b, :n].tolist())
        policy_runs = [run for run in runs if run[0]]
        assert len(policy_runs) == int(r.num_turns[b]) <= 3
        for k, (trained, start, end) in enumerate(runs):
            ids = r.completion_ids[b, start:end].tolist()
            if trained:  # the policy's turn ends at EOS or "]", or at the budget (then truncated)
                assert ids[-1] in (EOS, close) or (end == n and r.truncated[b]), (b, ids)
                assert EOS not in ids[:-1] and close not in ids[:-1]
            else:  # the environment's answer to turn k // 2 + 1, whole unless the budget cut it
                expected = env_ids[k // 2 + 1]
                assert ids == expected or (end == n and r.truncated[b] and ids == expected[: end - start])
        # the environment was stepped after every turn but one cut by the budget, and paid 0.5 a step
        last = r.completion_ids[b, n - 1].item()
        cut = bool(r.truncated[b]) and runs[-1][0] and last not in (EOS, close)
        stepped = len(policy_runs) - cut
        paid = r.env_rewards[b].item()
        assert paid == pytest.approx(0.5 * stepped) if stepped else paid != paid, (b, paid, stepped)
    # every trained token's sampling log-prob is that of one forward over the transcript; others are 0
    reference = transcript_logps(model, r.prompt_ids, r.prompt_mask, r.completion_ids, r.attention)
    m = r.completion_mask
    torch.testing.assert_close(r.sampling_logps[m].double(), reference[m], rtol=0, atol=1e-5)
    assert (r.sampling_logps[~m] == 0).all()
    assert r.env_metrics == {}  # Echo counts nothing


def test_the_training_forward_scores_a_hand_built_episode_as_one_forward(policy):
    """An episode written by hand: prompt "12+3=", the policy calls the tool, the tool answers, the
    policy answers. Loss on the policy's tokens only; every log-prob equals one forward over the whole
    transcript, through the fused head with the shared prompt and through the model's own logits."""
    model, tok = policy
    enc = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    segments = [('[calc("12+3")]', True), ("{15}", False), ("15", True)]
    ids, trained = [], []
    for text, by_policy in segments:
        ids += enc(text)
        trained += [by_policy] * len(enc(text))
    ids, trained = ids + [EOS], trained + [True]
    T = len(ids) + 3  # right padding after the transcript
    G = 2
    completion = torch.full((G, T), tok.pad_token_id)
    completion[:, : len(ids)] = torch.tensor(ids)
    mask = torch.zeros(G, T, dtype=torch.bool)
    mask[:, : len(ids)] = torch.tensor(trained)
    attention = torch.zeros(G, T, dtype=torch.bool)
    attention[:, : len(ids)] = True
    completion[1, -5:-3] = torch.tensor(enc("99"))  # the second row's answer differs
    prompt = torch.tensor([enc("12+3=")] * G)
    batch = SimpleNamespace(
        prompt_ids=prompt,
        prompt_mask=torch.ones_like(prompt, dtype=torch.bool),
        completion_ids=completion,
        completion_mask=mask,
        completion_attention=attention,
    )
    assert mask[0].tolist()[:14] == [True] * 14 and mask[0, 14:18].tolist() == [False] * 4
    reference = transcript_logps(model, batch.prompt_ids, batch.prompt_mask, completion, attention)
    for fused in (True, False):
        engine = PolicyEngine.create(model, tok, EngineSpec(fused_logps=fused, group_size=G))
        assert engine.fused == fused
        logps = engine.logps(batch, slice(0, G), entropy=False).logps.double()
        torch.testing.assert_close(logps[attention], reference[attention], rtol=0, atol=1e-5)
    # were the environment's tokens masked out of attention, the answer's log-probs would change:
    # the test can tell context from padding
    hidden_env = transcript_logps(model, batch.prompt_ids, batch.prompt_mask, completion, mask)
    assert (hidden_env[0, 18:22] - reference[0, 18:22]).abs().max() > 1e-3


def test_an_all_context_row_contributes_nothing(policy):
    """A row whose tokens are all context (mask False) changes neither the loss nor its gradient,
    whatever its advantage and log-probs."""
    torch.manual_seed(0)
    B, T = 4, 6
    logps = torch.randn(B, T, dtype=torch.float64, requires_grad=True)
    mask = torch.rand(B, T) > 0.3
    mask[2] = False  # an episode with no policy token (the environment wrote the whole budget)
    adv = torch.randn(B, dtype=torch.float64)
    for loss_type in ("grpo", "dapo", "dr_grpo", "bnpo"):
        base = grpo_loss(logps, adv, mask, loss_type=loss_type, max_completion_length=T)
        (grad,) = torch.autograd.grad(base.loss, logps)
        other = adv.clone()
        other[2] = 100.0
        changed = grpo_loss(logps, other, mask, loss_type=loss_type, max_completion_length=T)
        (grad_changed,) = torch.autograd.grad(changed.loss, logps)
        # grpo averages over rows with tokens: the empty row neither adds a term nor counts
        torch.testing.assert_close(changed.loss, base.loss, rtol=0, atol=1e-12)
        assert (grad[2] == 0).all() and torch.equal(grad, grad_changed)


def test_the_kv_cache_is_kept_across_turns(policy, monkeypatch):
    """The prompt is prefilled once per prompt (P rows); every later forward feeds one new token per
    row or an observation chunk, never a transcript again; tokens fed per row never exceed the slots."""
    calls = []
    real = LeanLlamaDecoder.__call__

    def counting(self, input_ids, *args, **kwargs):
        calls.append(tuple(input_ids.shape))
        return real(self, input_ids, *args, **kwargs)

    monkeypatch.setattr(LeanLlamaDecoder, "__call__", counting)
    spec = EnvironmentSpec(lambda: Echo(turns=10), max_turns=3, stop_strings=Echo.stop_strings)
    r = _sample(policy, spec, T=40, G=4)
    assert calls[0] == (3, r.prompt_ids.shape[1])  # P = 3 prompts, once each
    widths = [L for _, L in calls[1:]]
    assert all(b == 12 for b, _ in calls[1:])  # B = 12 rows after the prompt
    assert max(widths) <= 1 + 3  # one token, or the token that ended a turn + "{k}"
    assert sum(widths) <= r.completion_ids.shape[1] * 3  # the cache grew by the turns' slots, no re-runs
    assert sum(w > 1 for w in widths) <= 2  # one chunk of observations between turns


def test_hf_forward_and_lean_forward_draw_the_same_episodes(policy, monkeypatch):
    spec = tool_environment([calc], "brackets", max_turns=3)
    lean = _sample(policy, spec, T=30)
    model = policy[0]
    hf = _sample(policy, spec, T=30, backend=TransformersBackend(model, lm_head_of(model)))
    assert torch.equal(lean.completion_ids, hf.completion_ids)
    assert torch.equal(lean.completion_mask, hf.completion_mask)
    torch.testing.assert_close(lean.sampling_logps, hf.sampling_logps, rtol=0, atol=1e-5)


@contextlib.contextmanager
def favouring(model, tok, bias: dict[str, float]):
    """An LM head with a bias toward some characters (a random policy then writes calls)."""
    plain = model.lm_head
    head = torch.nn.Linear(plain.in_features, plain.out_features, bias=True)
    with torch.no_grad():
        head.weight.copy_(plain.weight)
        head.bias.zero_()
        for char, value in bias.items():
            head.bias[tok.convert_tokens_to_ids(char)] = value
    model.lm_head = head
    try:
        yield
    finally:
        model.lm_head = plain


def test_same_seed_same_episodes_and_malformed_calls_are_observations(policy):
    spec = tool_environment([calc], "brackets", max_turns=3)
    with favouring(*policy, {"[": 4.0, "]": 2.0}):
        a = _sample(policy, spec, T=30, seed=4)
        b = _sample(policy, spec, T=30, seed=4)
        c = _sample(policy, spec, T=30, seed=5)
    assert torch.equal(a.completion_ids, b.completion_ids) and a.completions == b.completions
    assert not torch.equal(a.completion_ids, c.completion_ids)
    # a random policy writes broken calls: they came back as error observations, counted
    assert a.env_metrics["malformed_calls"] > 0
    assert any("{error:" in text for text in a.completions)


def test_observations_never_exceed_the_budget(policy):
    class Verbose(Echo):
        def step(self, text):
            return "{" + "1" * 50 + "}", None, False

    spec = EnvironmentSpec(Verbose, max_turns=4, stop_strings=("]",))
    r = _sample(policy, spec, T=20, G=2)
    lengths = r.attention.sum(-1)
    assert (lengths <= 20).all()
    answered = r.num_turns >= 1
    # an observation that did not fit ended its episode, truncated; no reward was ever paid
    assert r.truncated[lengths == 19].all() and answered.all()
    assert r.env_rewards.isnan().all()


def test_reset_text_is_context_and_episodes_get_their_own_seed(policy):
    seeds = []

    class Intro(Echo):
        def reset(self, row, seed):
            seeds.append(seed)
            return "{0}"

    spec = EnvironmentSpec(lambda: Intro(turns=1), max_turns=2, stop_strings=("]",))
    r = _sample(policy, spec, T=20, G=3, prompts=("1=", "2="), seed=9)
    intro = torch.tensor(char_tokenizer(ALPHABET)("{0}", add_special_tokens=False)["input_ids"])
    assert torch.equal(r.completion_ids[:, :3], intro.expand(6, 3))
    assert not r.completion_mask[:, :3].any() and r.completion_mask[:, 3].all()
    assert len(set(seeds)) == 6  # one seed per episode, derived from the sampling seed
    assert (r.num_turns == 1).all()
    # stepped once and paid, unless the turn ran into the budget (then never stepped: no reward)
    assert (r.env_rewards[~r.truncated] == 0.5).all() and r.env_rewards[r.truncated].isnan().all()
    assert (~r.truncated).any()


def test_rows_must_match_prompts(policy):
    spec = tool_environment([calc], "brackets")
    with pytest.raises(ValueError, match="an episode needs its row"):
        Decoder(backend_of(policy[0]), policy[1], environment=spec).sample(
            ["1="], SamplingParams(num_generations=2), []
        )


def test_a_stop_string_merged_with_what_follows_still_ends_the_turn():
    """BPE tokenizers merge a closing marker with a newline ("</tool_call>\\n"): the turn still ends."""
    pieces = {0: "<tool_call>", 1: 'calc("1+2")', 2: "</tool_call>\n", 3: "</tool_", 4: "call>"}
    tokenizer = SimpleNamespace(decode=lambda ids, **_: "".join(pieces.get(i, "") for i in ids))

    def stopped(ids: list[int]) -> bool:
        columns = torch.tensor([len(ids)])
        run = SimpleNamespace(
            rows=SimpleNamespace(column=columns, finished=torch.zeros(1, dtype=torch.bool)),
            tape=SimpleNamespace(tokens=torch.tensor([ids + [9, 9]])),  # padding after the transcript
        )
        check = StopStrings(tokenizer, ("</tool_call>",), run, [0])
        check.before = [len(ids) - 1]  # the last token was drawn just now
        check()
        return bool(run.rows.finished[0]) and check.ends == [len(ids)]

    assert stopped([0, 1, 2])
    assert stopped([0, 1, 3, 4])  # split over two tokens
    assert not stopped([0, 1, 3])
