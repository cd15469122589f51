"""Checks shared by the drafter tests on the batched step loop: the end-to-end distribution
check, and greedy equality with plain decoding (``greedy_accepted``).

With top_k=3 the first three sampled tokens have 27 possible continuations whose exact
probabilities the target gives directly; speculative samples, drawn through the engine's step
loop 16 rows at a time, are compared with them by a chi-square goodness-of-fit test (cells
with expectation < 5 pooled). The first token comes from the prefill, so three tokens leave
room for one draft; ``length=4`` (81 cells) lets a round propose a chain of two.
"""

import dataclasses
import itertools

import torch
from scipy.stats import chisquare

from specdec.sampling import SamplingParams, logits_to_probs, penalize

PARAMS = SamplingParams(temperature=1.0, top_k=3)
CELLS = list(itertools.product(range(3), repeat=3))  # ranks within the top 3, not ids


def cells(length: int = 3) -> list[tuple[int, ...]]:
    return list(itertools.product(range(3), repeat=length))


def exact_distribution(model, ids: list[int], length: int = 3, params: SamplingParams = PARAMS) -> tuple[dict, dict]:
    """(probability of each rank cell, cell of each ``length``-token continuation) under
    ``params`` (top_k=3; logits processors applied to each continuation's own history)."""
    exact, cell_of = {}, {}
    with torch.inference_mode():
        for cell in cells(length):
            seq, prob = list(ids), 1.0
            for rank in cell:
                logits = model(input_ids=torch.tensor([seq])).logits[0, -1:]
                if params.penalized:
                    logits = penalize(logits, params, seq, len(ids), [[]])
                p = logits_to_probs(logits[0].double(), params)
                token = int(torch.topk(p, 3).indices[rank])
                prob *= float(p[token])
                seq.append(token)
            exact[cell], cell_of[tuple(seq[len(ids) :])] = prob, cell
    return exact, cell_of


def batched_cells(engine, ids: list[int], n: int, mode: str, k: int = 2, length: int = 3,
                  params: SamplingParams = PARAMS) -> tuple[dict, dict, int]:
    """``n`` seeded ``length``-token samples of ``mode`` drawn 16 at a time through the step
    loop: (exact cell probabilities, observed counts, draft tokens proposed)."""
    model = engine.loop.target.runner.model
    exact, cell_of = exact_distribution(model, ids, length, params)
    counts, drafted = dict.fromkeys([*cells(length), "impossible"], 0), 0
    for base in range(0, n, 16):
        handles = [engine.loop.submit(engine.request(ids, max_tokens=length, mode=mode, k=k, ignore_eos=True,
                                                     params=dataclasses.replace(params, seed=s)))
                   for s in range(base, min(n, base + 16))]
        for h in handles:
            events = list(h)
            # a continuation outside the target's top 3 has probability 0 under p
            counts[cell_of.get(tuple(t for e in events for t in e.token_ids), "impossible")] += 1
            drafted += sum(e.stats.drafted for e in events)
    return exact, counts, drafted


def batched_pvalue(exact: dict, counts: dict, n: int) -> float:
    """Chi-square p-value of ``counts`` against ``exact`` (cells expected below 5 pooled)."""
    keys = list(exact)
    obs, exp = [counts[c] for c in keys], [exact[c] * n for c in keys]
    small = [i for i, e in enumerate(exp) if e < 5]
    big = [i for i in range(len(keys)) if i not in small]
    obs = [obs[i] for i in big] + [sum(obs[i] for i in small)]
    exp = [exp[i] for i in big] + [sum(exp[i] for i in small)]
    if exp[-1] == 0:  # every small cell impossible (min_p can empty one): nothing may land there
        if obs[-1]:
            return 0.0
        obs, exp = obs[:-1], exp[:-1]
    return float(chisquare(obs, exp).pvalue)


def batched_result(engine, ids: list[int], n: int, mode: str, k: int = 2, length: int = 3,
                   params: SamplingParams = PARAMS) -> dict:
    """One batched chi-square run of ``mode``: ``{"p": p-value, "drafted": draft tokens,
    "impossible": continuations outside the target's top 3}``; ``p`` is None when there are
    impossible continuations (they already refute the distribution)."""
    exact, counts, drafted = batched_cells(engine, ids, n, mode, k, length, params)
    p = None if counts["impossible"] else batched_pvalue(exact, counts, n)
    return {"p": p, "drafted": drafted, "impossible": counts["impossible"]}


def batched_test_and_control(engine, ids: list[int], n: int, mode: str, monkeypatch, k: int = 2,
                             length: int = 3, params: SamplingParams = PARAMS) -> tuple[dict, dict]:
    """The batched chi-square run of ``mode`` (``batched_result``), then its negative control:
    a verifier that accepts every draft (its output is the drafter's distribution)."""
    import specdec.batch.verify as batch_verify

    honest = batched_result(engine, ids, n, mode, k, length, params)
    monkeypatch.setattr(batch_verify, "acceptance_probs", lambda x, q, p: torch.ones(len(x)))
    return honest, batched_result(engine, ids, n, mode, k, length, params)


def assert_tree_sampling_exact(engine, ids: list[int], n: int, mode: str, monkeypatch, k: int) -> None:
    """A token-tree mode's batched chi-square over 4 tokens (81 cells) passes at 1e-3 with drafts
    proposed, and fails with its negative control: a verifier that skips the residual update
    after a rejected candidate (it tries the next one against p again)."""
    import specdec.batch.verify as batch_verify

    honest = batched_result(engine, ids, n, mode, k=k, length=4)
    assert honest["drafted"] >= 2 * n and honest["impossible"] == 0 and honest["p"] > 1e-3, honest
    monkeypatch.setattr(batch_verify, "rejection_residual", lambda p, q: p)
    control = batched_result(engine, ids, n, mode, k=k, length=4)
    assert control["impossible"] > 0 or control["p"] < 1e-3, control


def greedy_accepted(engine, prompts: list[str], mode: str, k: int, max_tokens: int = 24) -> int:
    """Asserts each prompt's greedy tokens in ``mode`` (k drafts a round) are plain decoding's;
    the drafts accepted over all of them."""
    accepted = 0
    for prompt in prompts:
        ids = engine.encode(prompt=prompt)
        plain = engine.generate(ids, max_tokens=max_tokens, mode="off", ignore_eos=True)
        spec = engine.generate(ids, max_tokens=max_tokens, mode=mode, k=k, ignore_eos=True)
        assert spec.token_ids == plain.token_ids, (prompt, mode, k)
        accepted += spec.speculation.accepted_tokens
    return accepted
