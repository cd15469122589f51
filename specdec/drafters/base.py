"""The one drafter interface: propose for many rows at once, and say what it cost.

A row drafts ``k_i`` tokens; a drafter with a model runs ``max_i k_i`` batched draft steps,
a row leaving once it has its ``k_i`` (or once the drafter is unsure of it). Each row samples
with its own generator seeded from the round's seed, so what a row drafts never depends on
what it is batched with. A drafter without a distribution (prompt lookup) and greedy rows
return ``probs=None``: the verifier treats those drafts as point masses, which keeps sampling
exact. The verifier never asks which drafter it has.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Protocol

import torch

from specdec import trees
from specdec.batch.blocks import BLOCK
from specdec.batch.verify import batched_probs
from specdec import grammar as grammars
from specdec.grammar import GrammarSpec
from specdec.sampling import SamplingParams, draw, make_generator, penalize


@dataclass(frozen=True)
class Proposal:
    """Draft tokens for one row and the distribution each was drawn from.

    tokens:     [k'] ids, k' <= k; "no proposal" is an empty list, never None.
    probs:      [k', vocab] the processed q rows, or None (point masses: prompt lookup, greedy).
    confidence: [k'] the drafter's probability of each of its own tokens, or () for a drafter
                without a distribution (prompt lookup).
    parents:    None for a chain; for a token tree (``specdec.trees``) [k'] each node's parent
                (-1: a child of the pending token).
    branches:   a sampled token tree's draws (else None): for each node the drafter expanded
                (-1: the pending token) the candidates it drew there without replacement from
                its q, in draw order (``Trees``); ``probs`` is then [len(branches), vocab], that
                q at each. The tree's children of a node are some of its candidates; the others
                are verified too (a candidate needs only its parent's p). A tree without
                branches (a greedy row, a plug-in drafter's tree without q) holds point masses.
                Both verify exactly (``specdec.batch.verify``).
    """

    tokens: list[int]
    probs: torch.Tensor | None = None
    confidence: tuple[float, ...] = ()
    parents: tuple[int, ...] | None = None
    branches: tuple[tuple[int, tuple[int, ...]], ...] | None = None

    def __post_init__(self) -> None:
        if self.branches is None:
            assert self.probs is None or self.probs.shape[0] == len(self.tokens), (self.probs.shape, len(self.tokens))
        else:
            assert self.parents is not None and self.probs is not None and self.probs.shape[0] == len(self.branches)
        if self.parents is not None:
            assert len(self.parents) == len(self.tokens), (self.parents, len(self.tokens))
            assert self.branches is not None or self.probs is None, "a tree of point masses carries no q"
            trees.check(self.parents)

    def __len__(self) -> int:
        return len(self.tokens)


EMPTY_PROPOSAL = Proposal(tokens=[])


@dataclass(frozen=True)
class DraftRow:
    """One row to draft for: ``context`` is the sequence's full ids (its last token not yet
    fed to the target), ``blocks`` its block table (a drafter with a cache lays it out like
    the target's: ``specdec.batch.blocks``). ``stop_below``: the row's chain stops once the product of the
    drafter's probabilities of its own tokens so far falls below it (0: draft all ``k``).
    ``nodes``: 0 for a chain of ``k``; else a token tree of at most ``nodes`` nodes and depth ``k``,
    of which ``price`` (``specdec.trees.Price``) keeps as many as pay (None: the whole budget)."""

    key: str
    context: list[int]
    k: int
    params: SamplingParams
    seed: int
    blocks: tuple[int, ...] = ()
    stop_below: float = 0.0
    nodes: int = 0
    prompt_len: int = 0  # where the output starts in ``context`` (the request's penalties count it)
    grammar: GrammarSpec | None = None  # structured output: drafts stay inside it (``specdec.grammar``)
    price: trees.Price | None = None

    @property
    def capacity(self) -> int:
        """Tokens its blocks hold (0: no cache to fit)."""
        return len(self.blocks) * BLOCK


@dataclass
class Drafted:
    """A drafter's proposals for a step (one per row, in order), and what drafting cost:
    ``seconds`` of compute where it ran, over ``steps`` batched draft passes."""

    proposals: list[Proposal]
    seconds: float = 0.0
    steps: int = 0


class BatchDrafter(Protocol):
    """Proposes up to ``row.k`` tokens for every row of one step."""

    name: str

    def propose(self, rows: list[DraftRow]) -> Drafted: ...

    def release(self, key: str) -> None:
        """The sequence finished: drop any state kept for it."""


def _penalized(logits: torch.Tensor, rows: list[tuple[DraftRow, list[list[int]]]]) -> torch.Tensor:
    """A drafter's logits [sum of positions, V] with each penalized row's processors applied, as
    the target's are (``specdec.sampling.penalize``), so its drafts follow the penalized
    distribution; ``rows``: each row and the drafted tokens before each of its positions."""
    if not any(row.params.penalized for row, _ in rows):
        return logits
    logits, at = logits.float().clone(), 0
    for row, paths in rows:
        n = len(paths)
        if row.params.penalized:
            logits[at: at + n] = penalize(logits[at: at + n], row.params, row.context, row.prompt_len, paths)
        at += n
    return logits


def _constrained(logits: torch.Tensor, masks: list[torch.Tensor | None]) -> torch.Tensor:
    """A drafter's logits [n, V] with each masked position's forbidden tokens at -inf (a position
    whose mask forbids everything is left alone)."""
    logits = logits.float().clone()
    for j, allowed in enumerate(masks):
        if allowed is not None and bool(allowed.any()):
            logits[j] = logits[j].masked_fill(~allowed.to(logits.device), -math.inf)
    return logits


class Chains:
    """The draft chains of one step being built: each row's tokens, q rows, confidences and
    generator.

    Confidence stop: after each token a row stops when the product of its tokens' confidences
    (the drafter's probability of each token it chose: the chance, as the drafter sees it, that
    the whole chain so far is right) is below the row's ``stop_below``, or when one token's
    confidence is below ``threshold``. The token is still proposed: verifying it costs almost
    nothing; the draft steps after it are saved. The stop reads only the drafter's own
    distribution, so rejection sampling stays exact (a proposal's length may depend on q,
    never on p).
    """

    def __init__(self, rows: list[DraftRow]):
        self.rows = rows
        self.tokens: list[list[int]] = [[] for _ in rows]
        self.qs: list[list[torch.Tensor]] = [[] for _ in rows]
        self.confidence: list[list[float]] = [[] for _ in rows]
        self.reach = [1.0] * len(rows)  # product of each row's confidences so far
        self.gens = [None if r.params.greedy else make_generator(r.seed) for r in rows]
        self.stopped: set[int] = set()
        self.steps = 0
        self.began = time.perf_counter()
        # structured output: each such row walks a fork of its grammar's state along its drafts
        self.walkers = {i: grammars.tracker().state(r.key, r.grammar, r.context[r.prompt_len:]).fork()
                        for i, r in enumerate(rows) if r.grammar is not None}

    def live(self) -> list[int]:
        """The rows still drafting."""
        return [i for i, r in enumerate(self.rows) if len(self.tokens[i]) < r.k and i not in self.stopped]

    def extend(self, logits: torch.Tensor, live: list[int], threshold: float = 0.0) -> None:
        """Each live row's next draft token from its logits [len(live), V]: greedy or drawn from
        q with the row's generator; then the confidence stop (class docstring)."""
        rows = self.rows
        logits = _penalized(logits, [(rows[i], [self.tokens[i]]) for i in live])
        if self.walkers:
            logits = _constrained(logits, [grammars.tracker().grammars.next_allowed(self.walkers[i], logits.shape[-1])
                                           if i in self.walkers else None for i in live])
        sampled = [j for j, i in enumerate(live) if not rows[i].params.greedy]
        probs = batched_probs(logits[sampled], [rows[live[j]].params for j in sampled]) if sampled else None
        flat = logits.float()
        top, greedy = flat.max(-1)
        # a greedy token's confidence: its probability under the untempered distribution,
        # exp(max - logsumexp) without a softmax over the vocabulary
        greedy_conf = (top - flat.logsumexp(-1)).exp().tolist()
        greedy = greedy.tolist()
        at = 0
        for j, i in enumerate(live):
            if rows[i].params.greedy:
                token, confidence = greedy[j], greedy_conf[j]
            else:
                q = probs[at]
                at += 1
                token = draw(q, self.gens[i])
                self.qs[i].append(q)
                confidence = float(q[token])
            self.tokens[i].append(token)
            self.confidence[i].append(confidence)
            self.reach[i] *= confidence
            walker = self.walkers.get(i)
            if walker is not None and not walker.is_terminated() and not walker.accept_token(token):
                self.stopped.add(i)  # the grammar ends here (or the drafter strayed): verification decides
            elif confidence < threshold or self.reach[i] < rows[i].stop_below:
                self.stopped.add(i)  # unsure: let the target speak before drafting further
        self.steps += 1

    def drafted(self) -> Drafted:
        proposals = [Proposal(t, torch.stack(q) if q else None, tuple(c))
                     for t, q, c in zip(self.tokens, self.qs, self.confidence)]
        return Drafted(proposals, time.perf_counter() - self.began, self.steps)


@dataclass
class _Grown:
    """One row's tree while it grows: every candidate node (``tokens``, ``parents``, ``value``:
    the sum of the drafter's log-probabilities along its path, ``confidence``), and the nodes
    already fed to the drafter, in feed order (``fed``: node indices; a drafter's cache holds
    them as the tree ``fed_parents``)."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    value: list[float] = field(default_factory=list)
    confidence: list[float] = field(default_factory=list)
    fed: list[int] = field(default_factory=list)
    fed_parents: list[int] = field(default_factory=list)
    frontier: list[int] = field(default_factory=lambda: [trees.ROOT])
    depth: int = 0
    drawn: dict[int, tuple[torch.Tensor, list[int]]] = field(default_factory=dict)  # sampled: node -> (q, children in draw order)


class Trees:
    """The draft trees of one step being built, EAGLE-2 style (Li et al. 2024, "dynamic draft
    trees"): each pass scores a row's frontier (at first its pending token); every frontier
    node's ``width`` most likely tokens become candidates, valued by the sum of log-probabilities
    on their path (the drafter's estimate of the chance the target takes that path); the
    ``width`` best new candidates are the next frontier. After at most ``k`` passes the row
    proposes its ``nodes`` best candidates, which always include their ancestors.

    A frontier node that cannot enter the final tree (its value is below the ``nodes``-th best
    so far, and its descendants' values are lower still) is not expanded, so a confident
    drafter's tree stops early. The row's ``stop_below`` sizes the tree by what it pays: a node
    whose path probability ``exp(value)`` is below it is neither expanded nor proposed (the best
    child of the pending token always is). The loop sets it where one more verify token would
    cost more than the node is expected to add (``SpeculationPolicy.stop_below``). Of the nodes
    that pass it, the row's ``price`` keeps the best ``n`` that bring the most tokens per unit of
    the round's time (``specdec.trees.Price``).

    Candidates: a greedy row's are the drafter's ``width`` top tokens (point masses). A sampled
    row DRAWS its ``width`` candidates at each node it expands, without replacement from its
    processed distribution ``q`` there (``draw_without_replacement`` with the row's generator:
    each candidate from ``q`` with the earlier ones removed), and keeps ``q`` and the draw order
    (``Proposal.branches``) for recursive rejection sampling (``specdec.batch.verify``), which
    accepts a candidate with ``min(1, p'/q')`` where point masses get only ``p'``: on the demo
    pair at T = 1, the target's token is accepted at a node of 4 candidates 0.55 of the time
    against 0.39 (the EAGLE head on the bench's chat and sampling prompts, answers sampled from
    the target; one sample from q: 0.36). Which nodes are expanded
    and kept may depend on anything the drafter drew (their values): every candidate drawn at a
    kept node is verified, kept as a node or not, so a node's draw is always whole.
    """

    def __init__(self, rows: list[DraftRow], width: int):
        self.rows, self.width = rows, width
        self.grown = [_Grown() for _ in rows]
        self.gens = [None if r.params.greedy else make_generator(r.seed) for r in rows]
        self.steps = 0
        self.began = time.perf_counter()

    def live(self) -> list[int]:
        """The rows that still expand (tree rows with a frontier, below their depth)."""
        return [i for i, (r, g) in enumerate(zip(self.rows, self.grown))
                if r.nodes > 0 and r.k > 0 and g.frontier and g.depth < r.k and self._room(i) > 0]

    def _room(self, i: int) -> int:
        """Nodes row ``i`` may still feed: a drafter's cache holds the tree in the row's range."""
        row = self.rows[i]
        return row.capacity - len(row.context) - len(self.grown[i].fed) if row.capacity else 1 << 30

    def feed(self, i: int) -> tuple[list[int], tuple[int, ...] | None, int]:
        """Row ``i``'s next pass: (tokens after the context the drafter must hold, those tokens'
        tree parents (None at the root), how many of them are new: the frontier, whose logits
        come back). Records the frontier as fed."""
        g = self.grown[i]
        if g.frontier == [trees.ROOT]:
            return [], None, 1
        g.frontier = g.frontier[: self._room(i)]
        where = {node: j for j, node in enumerate(g.fed)}
        for node in g.frontier:
            parent = g.parents[node]
            g.fed_parents.append(trees.ROOT if parent == trees.ROOT else where[parent])
            where[node] = len(g.fed)
            g.fed.append(node)
        return [g.tokens[n] for n in g.fed], tuple(g.fed_parents), len(g.frontier)

    def extend(self, logits: torch.Tensor, live: list[int]) -> None:
        """Each live row's frontier scored: logits [sum over live rows of len(frontier), V], in
        frontier order, row after row."""
        rows = self.rows
        logits = _penalized(logits, [(rows[i], [self._path(i, f) for f in self.grown[i].frontier]) for i in live])
        if any(rows[i].grammar is not None for i in live):
            logits = _constrained(logits, [mask for i in live for mask in self._allowed(i, logits.shape[-1])])
        at = 0
        for i in live:
            g, row = self.grown[i], rows[i]
            n = len(g.frontier)
            lg = logits[at: at + n].float()
            at += n
            if row.params.greedy:
                top_v, top_i = lg.log_softmax(-1).topk(min(self.width, lg.shape[-1]), dim=-1)
            else:
                q = batched_probs(lg, [row.params] * n).cpu()
                top_v, top_i = draw_without_replacement(q, self.width, self.gens[i])
            new = []
            for r, (f, vals, ids) in enumerate(zip(g.frontier, top_v.tolist(), top_i.tolist())):
                if not row.params.greedy:
                    g.drawn[f] = (q[r], list(range(len(g.tokens), len(g.tokens) + sum(v > -math.inf for v in vals))))
                base = 0.0 if f == trees.ROOT else g.value[f]
                for v, t in zip(vals, ids):
                    if v == float("-inf"):
                        break
                    new.append(len(g.tokens))
                    g.tokens.append(t)
                    g.parents.append(f)
                    g.value.append(base + v)
                    g.confidence.append(math.exp(v))
            g.depth += 1
            floor = math.log(row.stop_below) if row.stop_below > 0 else -math.inf
            best = [j for j in sorted(new, key=lambda j: -g.value[j])[: self.width] if g.value[j] >= floor]
            if len(g.value) >= row.nodes:  # what the final tree would keep as things stand
                cut = sorted(g.value, reverse=True)[row.nodes - 1]
                best = [j for j in best if g.value[j] > cut]
            g.frontier = best
        self.steps += 1

    def _allowed(self, i: int, width: int) -> list[torch.Tensor | None]:
        """Row ``i``'s grammar masks at each frontier node (None without a grammar)."""
        row, frontier = self.rows[i], self.grown[i].frontier
        if row.grammar is None:
            return [None] * len(frontier)
        tracker = grammars.tracker()
        state = tracker.state(row.key, row.grammar, row.context[row.prompt_len:])
        return [tracker.grammars.after(state, self._path(i, f), width) for f in frontier]

    def _path(self, i: int, node: int) -> list[int]:
        """The tokens from row ``i``'s pending token down to ``node``, inclusive."""
        g, out = self.grown[i], []
        while node != trees.ROOT:
            out.append(g.tokens[node])
            node = g.parents[node]
        return out[::-1]

    def drafted(self, seconds: float | None = None) -> list[Proposal | None]:
        """Each row's tree (None for a row that drafts a chain): its ``nodes`` best candidates,
        in creation order (parents first)."""
        out: list[Proposal | None] = []
        for row, g in zip(self.rows, self.grown):
            if row.nodes <= 0:
                out.append(None)
                continue
            order = sorted(range(len(g.tokens)), key=lambda j: (-g.value[j], j))
            floor = math.log(row.stop_below) if row.stop_below > 0 else -math.inf
            chosen: dict[int, None] = {}  # best first, each after its parent
            for j in order:
                if len(chosen) >= row.nodes or (chosen and g.value[j] < floor):
                    break
                if g.parents[j] == trees.ROOT or g.parents[j] in chosen:
                    chosen[j] = None
            if row.price is not None:
                picked = list(chosen)
                chosen = dict.fromkeys(picked[: row.price.size([math.exp(g.value[j]) for j in picked])])
            keep = sorted(chosen)
            index = {j: n for n, j in enumerate(keep)}
            parents = tuple(trees.ROOT if g.parents[j] == trees.ROOT else index[g.parents[j]] for j in keep)
            qs, branches = None, None
            if keep and g.drawn:  # a sampled tree: the draws at the pending token and at every kept node
                at = [f for f in (trees.ROOT, *keep) if f in g.drawn]
                qs = torch.stack([g.drawn[f][0] for f in at])
                branches = tuple((trees.ROOT if f == trees.ROOT else index[f], tuple(g.tokens[c] for c in g.drawn[f][1]))
                                 for f in at)
            out.append(Proposal([g.tokens[j] for j in keep], qs, tuple(g.confidence[j] for j in keep),
                                parents if keep else None, branches))
        return out


def draw_without_replacement(q: torch.Tensor, width: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(log q of each, ids) [n, width]: ``width`` ids drawn without replacement from each row of
    ``q`` [n, vocab] (on the host), in draw order, each from ``q`` with the earlier ones removed
    by inverse transform sampling as ``specdec.sampling.draw`` does (one uniform from
    ``generator`` apiece; the order Gumbel top-k gives, without an exponential per vocabulary
    entry). One cumulative sum serves a row's draws: with ``R`` the ids drawn so far, the next
    is the first ``i`` with ``cdf(i) - S(i) > u (total - q(R))``, ``S(i)`` the mass of ``R`` up to
    ``i``, found by searching ``cdf`` for ``u (total - q(R)) + S`` until ``S`` stops growing. Once
    a row has no mass left (its nonzero entries drawn), log q is -inf (and the id 0).

    >>> g = torch.Generator().manual_seed(0)
    >>> draw_without_replacement(torch.tensor([[0.0, 0.5, 0.5, 0.0]]), 3, g)[0].exp().tolist()
    [[0.5, 0.5, 0.0]]
    """
    n, vocab = q.shape
    logq = torch.full((n, width), -math.inf)
    ids = torch.zeros((n, width), dtype=torch.long)
    q64 = q.double()
    cdf = q64.cumsum(-1)  # [n, vocab]
    for r in range(n):
        drawn: dict[int, float] = {}
        total = float(cdf[r, -1])
        for j in range(width):
            left = total - sum(drawn.values())
            if left <= total * 1e-9:  # nothing left to draw (a stop that reads q alone: still exact)
                break
            u = float(torch.rand(1, generator=generator, dtype=torch.float64))
            t = u * left
            shift, x = 0.0, -1
            while True:
                x = int(torch.searchsorted(cdf[r], torch.tensor([t + shift], dtype=torch.float64), right=True))
                grown = sum(m for d, m in drawn.items() if d <= x)
                if grown == shift:
                    break
                shift = grown
            if x >= vocab or x in drawn or float(q64[r, x]) <= 0.0:  # rounding at an edge: draw it plainly
                left = q64[r].clone()
                left[list(drawn)] = 0.0
                x = draw(left, generator)
            drawn[x] = float(q64[r, x])
            ids[r, j], logq[r, j] = x, math.log(float(q[r, x]))
    return logq, ids
