"""Verification of a whole step at once, over the flattened ragged layout (vLLM v1's).

Row ``i`` drafted ``k_i`` tokens and the target scored ``k_i + 1`` positions for it; the
logits of all rows come back-to-back, ``[sum_i (k_i + 1), vocab]``. Greedy rows are matched in
one argmax; sampled rows get their distributions in one vectorised ``logits -> p`` (per-row
temperature, top-k, top-p), then exact rejection sampling with each row's own generator, so
a row's randomness never depends on what it is batched with.

The scalar functions in ``specdec.verify`` are the oracle: for the same logits and seed every
row's ``Verdict`` here equals ``verify_greedy`` / ``verify_sampled`` on that row alone
(same random draws in the same order: ``rand(k)``, then one ``specdec.sampling.draw``).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from specdec import trees
from specdec.sampling import SamplingParams, draw, make_generator, nucleus, penalize
from specdec.verify import Verdict, acceptance_probs, residual_distribution


def _pad_vocab(probs: torch.Tensor, width: int) -> torch.Tensor:
    """Zero-pad [..., v] to [..., width]: ids a model cannot emit have probability 0."""
    extra = width - probs.shape[-1]
    return torch.nn.functional.pad(probs, (0, extra)) if extra > 0 else probs


@dataclass(frozen=True)
class VerifyRow:
    """One row's drafts and how it samples. ``q``: [k, vocab] or None (point masses); a sampled
    tree's: [len(branches), vocab], the drafter's q at each node it drew candidates at.

    ``suppress``: token ids whose target logits are -inf at the row's first ``suppress_for``
    positions (``min_tokens``): a change of p itself, made before verification, so rejection
    sampling stays exact for the suppressed p whatever q proposed.
    """

    drafts: list[int]
    params: SamplingParams
    seed: int
    q: torch.Tensor | None = None
    suppress: tuple[int, ...] = ()
    suppress_for: int = 0
    parents: tuple[int, ...] | None = None  # the drafts are a token tree (``specdec.trees``)
    history: tuple[int, ...] | list[int] = ()  # the ids before the pending token's logits (penalties read it)
    prompt_len: int = 0  # where the output starts in ``history``
    logprobs: int | None = None  # report the emitted tokens' log-probabilities and this many top ones
    allowed: torch.Tensor | None = None  # structured output: bool [k + 1, vocab], what each position may emit
    branches: tuple[tuple[int, tuple[int, ...]], ...] | None = None  # a sampled tree's draws (``Proposal.branches``); q: their q rows

    def paths(self) -> list[list[int]]:
        """[k + 1] the drafts between the history and each scored position (a tree: the ancestors')."""
        if self.parents is None:
            return [self.drafts[:j] for j in range(len(self.drafts) + 1)]
        return [[], *([self.drafts[a] for a in trees.path_to(self.parents, i)] for i in range(len(self.drafts)))]

    @property
    def depths(self) -> list[int]:
        """[k + 1] each scored position's depth below the row's pending token (0: the root)."""
        if self.parents is None:
            return list(range(len(self.drafts) + 1))
        return [0, *trees.depths(self.parents)]


def batched_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """``specdec.sampling.logits_to_probs`` for many rows at once, row ``j`` with ``params[j]``.

    logits: [N, vocab]; every params must be non-greedy. Returns float32 [N, vocab], equal
    row for row to the scalar function (same operations, same order: temperature, min-p, top-k, top-p).
    """
    assert logits.dim() == 2 and logits.shape[0] == len(params), (logits.shape, len(params))
    vocab, dev = logits.shape[1], logits.device
    logits = logits.float() / torch.tensor([p.temperature for p in params], device=dev)[:, None]
    min_p = torch.tensor([p.min_p for p in params], device=dev)
    if (min_p > 0).any():  # log 0 = -inf: a row without min_p drops nothing
        floor = logits.amax(-1, keepdim=True) + torch.log(min_p)[:, None]
        logits = logits.masked_fill(logits < floor, -math.inf)
    top_k = torch.tensor([p.top_k if 0 < p.top_k < vocab else 0 for p in params], device=dev)
    if top_k.any():  # each row's k-th largest logit, from one partial top-k of the largest k
        largest = torch.topk(logits, int(top_k.max()), dim=-1).values
        kth = largest.gather(-1, (top_k - 1).clamp(min=0)[:, None])
        kth = torch.where(top_k[:, None] > 0, kth, torch.full_like(kth, -math.inf))
        logits = logits.masked_fill(logits < kth, -math.inf)
    top_p = torch.tensor([p.top_p for p in params], device=dev)
    return nucleus(logits, top_p).softmax(-1)


def verify_batch(rows: list[VerifyRow], logits: torch.Tensor) -> list[Verdict]:
    """One Verdict per row.

    rows:   B rows, row i with k_i drafts
    logits: [sum_i (k_i + 1), vocab] the target's logits, row after row, on the device they were
            computed on: greedy rows bring back only their argmax tokens; sampled rows' processed
            distributions come to the host, where each row's generator draws (so a seed gives the
            same text on any device).
    """
    sizes = [len(r.drafts) + 1 for r in rows]
    assert logits.dim() == 2 and logits.shape[0] == sum(sizes), (logits.shape, sizes)
    starts = [0]
    for n in sizes:
        starts.append(starts[-1] + n)
    verdicts: list[Verdict | None] = [None] * len(rows)
    logits = _constrain(rows, _suppress(rows, _penalize(rows, logits, starts), starts), starts)

    greedy = [i for i, r in enumerate(rows) if r.params.greedy]
    if greedy:
        argmax = logits.argmax(-1).tolist()  # [N]: one pass for every greedy row, ints to the host
        for i in greedy:
            match = _match if rows[i].parents is None else _match_tree
            verdicts[i] = match(rows[i], argmax[starts[i]: starts[i + 1]])

    sampled = [i for i, r in enumerate(rows) if not r.params.greedy]
    if sampled:
        index = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in sampled]).to(logits.device)
        params = [rows[i].params for i in sampled for _ in range(sizes[i])]
        p_all = batched_probs(logits[index], params).cpu()
        at = 0
        for i in sampled:
            p = p_all[at: at + sizes[i]]
            at += sizes[i]
            verdicts[i] = (_reject_sample if rows[i].parents is None else _sample_tree)(rows[i], p)
    asked = [i for i, r in enumerate(rows) if r.logprobs is not None]
    if asked:
        verdicts = _with_logprobs(rows, verdicts, logits, starts, asked)
    return verdicts  # type: ignore[return-value]


def _constrain(rows: list[VerifyRow], logits: torch.Tensor, starts: list[int]) -> torch.Tensor:
    """``logits`` with what each structured-output row's grammar forbids at -inf (``specdec.grammar``):
    a change of p itself, so verification stays exact for the constrained p. A position where the
    grammar would forbid every token (never reached by verification) is left as it is."""
    constrained = [i for i, r in enumerate(rows) if r.allowed is not None]
    if not constrained:
        return logits
    logits = logits.clone()
    for i in constrained:
        allowed = rows[i].allowed.to(logits.device)
        allowed = allowed | ~allowed.any(-1, keepdim=True)
        at = slice(starts[i], starts[i + 1])
        logits[at] = logits[at].masked_fill(~allowed, -math.inf)
    return logits


def _penalize(rows: list[VerifyRow], logits: torch.Tensor, starts: list[int]) -> torch.Tensor:
    """``logits`` with each penalized row's processors applied (``specdec.sampling.penalize``) at
    each of its positions, with that position's own history."""
    penalized = [i for i, r in enumerate(rows) if r.params.penalized]
    if not penalized:
        return logits
    logits = logits.float().clone()  # exact for the other rows (bf16 -> float32)
    for i in penalized:
        row = rows[i]
        at = slice(starts[i], starts[i + 1])
        logits[at] = penalize(logits[at], row.params, row.history, row.prompt_len, row.paths())
    return logits


def _with_logprobs(rows: list[VerifyRow], verdicts: list[Verdict], logits: torch.Tensor, starts: list[int],
                   asked: list[int]) -> list[Verdict]:
    """Each asking row's emitted tokens' log-probabilities, and its ``logprobs`` most likely tokens
    at each of them, under the distribution plain decoding reads them from: the processed logits
    (penalties, ``min_tokens``) after temperature (1 for greedy), before min-p / top-k / top-p
    (vLLM's processed log-probabilities; OpenAI reports a full distribution). One log-softmax over
    the emitted positions of every asking row; only numbers come back."""
    index, temps = [], []
    for i in asked:
        v, row = verdicts[i], rows[i]
        nodes = range(v.num_accepted) if v.path is None else v.path
        positions = [0, *(n + 1 for n in nodes)]  # the root, then each accepted node's
        index += [starts[i] + j for j in positions]
        temps += [1.0 if row.params.greedy else row.params.temperature] * len(positions)
    at = torch.tensor(index, device=logits.device)
    logp = (logits[at].float() / torch.tensor(temps, device=logits.device)[:, None]).log_softmax(-1)
    tokens = torch.tensor([t for i in asked for t in verdicts[i].tokens], device=logits.device)
    chosen = logp.gather(-1, tokens[:, None])[:, 0].tolist()
    most = max(rows[i].logprobs for i in asked)
    top_v, top_i = (logp.topk(most, dim=-1) if most else (logp[:, :0], logp[:, :0].long()))
    top_v, top_i = top_v.tolist(), top_i.tolist()
    out, j = list(verdicts), 0
    for i in asked:
        n, want = len(verdicts[i].tokens), rows[i].logprobs
        # a grammar may leave fewer than ``want`` tokens possible: the impossible ones are not "top"
        entries = tuple((chosen[j + m], tuple((t, v) for t, v in zip(top_i[j + m][:want], top_v[j + m][:want])
                                              if v != -math.inf)) for m in range(n))
        out[i] = dataclasses.replace(verdicts[i], logprobs=entries)
        j += n
    return out


def _suppress(rows: list[VerifyRow], logits: torch.Tensor, starts: list[int]) -> torch.Tensor:
    """``logits`` with each row's suppressed ids at -inf over its first ``suppress_for`` positions."""
    vocab = logits.shape[-1]
    masked = None
    for i, row in enumerate(rows):
        ids = [t for t in row.suppress if 0 <= t < vocab]
        if not (ids and row.suppress_for > 0 and len(ids) < vocab):  # never every token: p stays a distribution
            continue
        at = [starts[i] + j for j, d in enumerate(row.depths) if d < row.suppress_for]
        masked = logits.clone() if masked is None else masked
        rows_at, ids_at = torch.tensor(at, device=logits.device), torch.tensor(ids, device=logits.device)
        masked[rows_at[:, None], ids_at[None, :]] = -math.inf
    return logits if masked is None else masked


def _match(row: VerifyRow, target: list[int]) -> Verdict:
    """Greedy: the longest prefix of drafts the target agrees with, then its own token."""
    drafts = row.drafts
    k = len(drafts)
    n = 0
    while n < k and drafts[n] == target[n]:
        n += 1
    return Verdict(tokens=target[: n + 1], num_accepted=n, num_drafted=k)


def _reject_sample(row: VerifyRow, p: torch.Tensor) -> Verdict:
    """Exact rejection sampling for one row (``specdec.verify.verify_sampled``'s draws)."""
    k = len(row.drafts)
    q = None if row.q is None else row.q.to(device=p.device, dtype=p.dtype)  # a drafter's q may be on the GPU
    if q is not None and q.shape[-1] != p.shape[-1]:  # e.g. a padded embedding matrix
        width = max(q.shape[-1], p.shape[-1])
        p, q = _pad_vocab(p, width), _pad_vocab(q, width)
    generator = make_generator(row.seed)
    drafts = torch.tensor(row.drafts, dtype=torch.long)
    n = 0
    if k:
        ratio = acceptance_probs(drafts, q, p)
        u = torch.rand(k, generator=generator, dtype=ratio.dtype)
        rejected = (u >= ratio).nonzero()
        n = int(rejected[0]) if rejected.numel() else k
    if n < k:
        last_row = residual_distribution(p[n], None if q is None else q[n], row.drafts[n])
    else:
        last_row = p[k]
    last = draw(last_row, generator)
    return Verdict(tokens=row.drafts[:n] + [last], num_accepted=n, num_drafted=k)


def _match_tree(row: VerifyRow, target: list[int]) -> Verdict:
    """Greedy over a tree: from the root, follow the child whose token is the target's argmax
    at its parent; the first node without one gives the target's own token.

    target: [1 + N] the target's token at the root and at every node.
    """
    path, node = [], trees.ROOT
    while True:
        want = target[node + 1]
        nxt = next((c for c in trees.children(row.parents, node) if row.drafts[c] == want), None)
        if nxt is None:
            tokens = [row.drafts[c] for c in path] + [want]
            return Verdict(tokens=tokens, num_accepted=len(path), num_drafted=len(row.drafts), path=tuple(path))
        path.append(nxt)
        node = nxt


def remove_candidate(p: torch.Tensor, token: int) -> torch.Tensor:
    """The residual after a rejected point-mass candidate: ``norm(max(p - delta_token, 0))``,
    i.e. ``p`` with ``token`` removed and renormalised (``specdec.verify.residual_distribution``
    with ``q = None``)."""
    r = p.clone()
    r[token] = 0.0
    total = r.sum()
    return r / total if total > 0 else p


def drop_drawn(q: torch.Tensor, token: int) -> torch.Tensor:
    """The draft distribution of the next candidate of a draw without replacement: ``q`` with
    ``token`` removed and renormalised (all zeros when nothing is left)."""
    r = q.clone()
    r[token] = 0.0
    total = r.sum()
    return r / total if total > 0 else r


def rejection_residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The target distribution after a rejected candidate drawn from ``q``: ``norm(max(p - q, 0))``
    (``specdec.verify.residual_distribution``; ``p`` where that has no mass)."""
    return residual_distribution(p, q, -1)


def recursive_rejection(p: torch.Tensor, q: torch.Tensor, candidates: list[int] | tuple[int, ...],
                        generator: torch.Generator) -> tuple[int | None, torch.Tensor]:
    """One node of a sampled token tree: recursive rejection sampling over candidates drawn
    WITHOUT replacement from ``q`` (Jeon et al. 2024, "Recursive Speculative Decoding"; SpecInfer's
    multi-candidate sampling draws them with replacement). Returns (the position of the accepted
    candidate, None if none was) and the distribution the node's token is drawn from when none was.

    Candidate ``x_j`` is accepted with probability ``min(1, p_j(x_j) / q_j(x_j))``; on rejection
    ``p_{j+1} = norm(max(p_j - q_j, 0))`` and ``q_{j+1} = q_j`` without ``x_j`` (renormalised),
    the distribution the draw took ``x_{j+1}`` from. Each step is Leviathan et al.'s rejection
    sampling of ``p_j`` with proposal ``q_j``: it emits ``x_j`` with probability
    ``min(p_j, q_j)(x_j)`` and otherwise hands over ``p_{j+1}``, so by induction from the last
    step (which draws from ``p_{m+1}``) the node emits ``p`` exactly, averaged over the draw.

    p, q: [vocab] the target's and the drafter's processed distributions at the node.

    >>> g = torch.Generator().manual_seed(0)
    >>> recursive_rejection(torch.tensor([0.0, 1.0]), torch.tensor([0.5, 0.5]), [1, 0], g)[0]  # p(1)/q(1) = 2
    0
    """
    for j, x in enumerate(candidates):
        u = float(torch.rand(1, generator=generator, dtype=p.dtype))
        if u * float(q[x]) < float(p[x]):
            return j, p
        p, q = rejection_residual(p, q), drop_drawn(q, x)
    return None, p


def _sample_drawn_tree(row: VerifyRow, p: torch.Tensor) -> Verdict:
    """Exact sampling over a tree whose candidates were drawn from q (``row.branches``):
    ``recursive_rejection`` at each node from the root; an accepted candidate that is a node
    of the tree is the next node, one that is not (drawn, not kept) is the round's last token,
    and a node without draws (a leaf) draws its token from ``p``.

    p: [1 + N, vocab] the target's processed distribution at the root and every node.
    """
    generator = make_generator(row.seed)
    q = _pad_vocab(row.q.to(device=p.device, dtype=p.dtype), p.shape[-1])
    drawn = {node: (b, cands) for b, (node, cands) in enumerate(row.branches)}
    path, node = [], trees.ROOT
    while True:
        last_p = p[node + 1]
        if node in drawn:
            b, cands = drawn[node]
            j, last_p = recursive_rejection(last_p, q[b], cands, generator)
            if j is not None:
                child = next((c for c in trees.children(row.parents, node) if row.drafts[c] == cands[j]), None)
                if child is not None:
                    path.append(child)
                    node = child
                    continue
                tokens = [row.drafts[c] for c in path] + [cands[j]]
                return Verdict(tokens=tokens, num_accepted=len(path), num_drafted=len(row.drafts), path=tuple(path))
        last = draw(last_p, generator)
        tokens = [row.drafts[c] for c in path] + [last]
        return Verdict(tokens=tokens, num_accepted=len(path), num_drafted=len(row.drafts), path=tuple(path))


def _sample_tree(row: VerifyRow, p: torch.Tensor) -> Verdict:
    """Exact sampling over a token tree: multi-candidate speculative sampling (SpecInfer's
    multi-step speculative sampling, Miao et al. 2024; EAGLE's recursive rejection sampling)
    with every candidate a point mass (a tree with draws: ``_sample_drawn_tree``).

    At a node with candidate children ``x_1 .. x_m`` (distinct tokens, chosen from the drafter's
    own distribution, never from ``p``): accept ``x_1`` with probability ``p(x_1)``; if it is
    rejected, ``p <- norm(p without x_1)`` and try ``x_2`` the same way, and so on; an accepted
    child becomes the node, and when none is accepted the last residual gives the token. Each
    step returns ``x_j`` with probability ``prod_{i<j} (1 - p'(x_i)) * p'(x_j)``, which is
    ``p(x_j)``, and any other token with probability ``p(y)``: the output is ``p`` exactly, and
    a set of candidates holds the target's token with probability ``sum_j p(x_j)``.

    p: [1 + N, vocab] the target's processed distribution at the root and every node.
    """
    if row.branches is not None:
        return _sample_drawn_tree(row, p)
    generator = make_generator(row.seed)
    path, node = [], trees.ROOT
    while True:
        cur = p[node + 1]
        accepted = None
        for c in trees.children(row.parents, node):
            x = row.drafts[c]
            u = float(torch.rand(1, generator=generator, dtype=cur.dtype))
            if u < float(cur[x]):
                accepted = c
                break
            cur = remove_candidate(cur, x)
        if accepted is None:
            last = draw(cur, generator)
            tokens = [row.drafts[c] for c in path] + [last]
            return Verdict(tokens=tokens, num_accepted=len(path), num_drafted=len(row.drafts), path=tuple(path))
        path.append(accepted)
        node = accepted
