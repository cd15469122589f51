"""Choosing each round's mode and draft length ``k`` from measured acceptance and costs.

With per-token acceptance ``a``, a round of ``k`` drafts yields on average

    E(a, k) = (1 - a^(k+1)) / (1 - a)        tokens (the bonus/recovered token included)

and costs ``k * c + v(k)`` plain target steps, where ``c`` is a draft step's cost and
``v(k)`` a (k+1)-token verify pass's, both relative to one plain step. The expected speedup
of a round is ``S(a, k) = E(a, k) / (k c + v(k))``. A tree mode's ``a`` is per level (the target
took one of a node's candidates) and its ``k`` the tree's depth; it verifies its ``N`` nodes
whatever ``k``: ``S = E(a, k) / (k c + v(N))``. The policy picks the ``k`` in
``[1, k_max]`` that maximises ``S``; when even that is below ``1 + margin_off`` it decodes
plainly, probes with one speculative round every ``probe_interval`` plain tokens, and goes
back only when ``S`` clears the higher ``1 + margin_on`` (hysteresis: no flapping). A drafter
that costs nothing to ask (prompt lookup) is scored on every round, run or not
(``SpeculationPolicy.shadow``): its estimate needs no probe, and a request resumes with it as
soon as its own text starts repeating.

Worked example: a = 0.8, c = 0.1, v(k) = 1 + 0.02 k. k = 4: E = (1 - 0.8^5) / 0.2 = 3.36,
cost = 0.4 + 1.08 = 1.48, S = 2.27; k = 5: E = 3.69, cost = 1.60, S = 2.31; k = 6 is
already worse (3.95 / 1.72 = 2.30), so k = 5.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from pydantic import BaseModel, ConfigDict, Field

from specdec.config import Mode
from specdec.stats import RoundStats
from specdec.trees import Price


def expected_tokens(a: float, k: int) -> float:
    """E[tokens per round] = 1 + a + ... + a^k = (1 - a^(k+1)) / (1 - a); k + 1 at a = 1.

        >>> expected_tokens(0.5, 2)
        1.75
    """
    if not 0.0 <= a <= 1.0:
        raise ValueError(f"acceptance must be in [0, 1], got {a}")
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    if a > 1.0 - 1e-12:
        return float(k + 1)
    return (1.0 - a ** (k + 1)) / (1.0 - a)


def expected_speedup(a: float, k: int, c: float, v: Callable[[int], float]) -> float:
    """S(a, k) = E(a, k) / (k c + v(k)); k = 0 is plain decoding (1.0 when v(0) = 1)."""
    return expected_tokens(a, k) / (k * c + v(k))


def best_k(a: float, c: float, v: Callable[[int], float] | Sequence[float], k_max: int) -> tuple[int, float]:
    """The k in [1, k_max] with the highest expected speedup, and that speedup (the first k of
    the highest, as ``max`` gives). ``v``: a function of k, or its values for k = 0..k_max.
    Every row of every step asks it for every drafter: one loop, ``expected_speedup`` inlined
    (``E(a, k) = E(a, k - 1) + a^k``).

        >>> best_k(0.8, 0.1, lambda k: 1 + 0.02 * k, 8) == best_k(0.8, 0.1, [1 + 0.02 * k for k in range(9)], 8)
        True
    """
    expected_tokens(a, 0)  # the range check
    if callable(v):
        v = [v(k) for k in range(k_max + 1)]
    best, top = 0, float("-inf")
    e, power = 1.0, 1.0
    for k in range(1, k_max + 1):
        power *= a
        e += power
        s = e / (k * c + v[k])
        if s > top:
            best, top = k, s
    return best, top


class PolicyConfig(BaseModel):
    """Operator settings; live through ``user_config`` (``reconfigure``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kill_switch: bool = Field(False, description="All requests decode plainly.")
    default_mode: Mode | None = Field(
        None, description="Mode for requests that name none (None: the app's speculation.mode)."
    )
    k_max: int = Field(8, ge=1, le=32, description="Largest k a round may use.")
    adaptive: bool = Field(True, description="Pick k per round; False keeps the request's k.")
    margin_off: float = Field(
        0.08, ge=0, description="Fall back when the best S < 1 + this: the model's error margin."
    )
    margin_on: float = Field(0.15, ge=0, description="Resume when S >= 1 + this (> margin_off).")
    probe_interval: int = Field(16, ge=1, description="Plain tokens between probe rounds.")
    ewma: float = Field(
        0.1, gt=0, le=1, description="Weight of the newest round in a request's estimates (~1/ewma rounds of "
        "memory; a new request starts from the unit's estimates over every request's rounds).")
    prior_acceptance: float = Field(0.6, ge=0, le=1, description="a before any round is seen.")
    tree_nodes: int = Field(
        16, ge=1, le=64, description="A tree mode's (draft_tree, eagle_tree, medusa_tree) most nodes per round, "
        "its depth k: the target verifies them all in one pass, so more nodes hold the target's token more "
        "often and cost verify tokens (nearly free while a pass is memory-bound: a GPU, a small batch). An "
        "adaptive request keeps those that bring the most tokens per unit of time (trees.Price); one with "
        "an explicit k verifies them all."
    )
    replay_fraction: float = Field(
        0.0, ge=0, le=1, description="Quality guard: this share of finished greedy requests that speculated is "
        "replayed with speculation off, on spare capacity only, and must give the same tokens "
        "(``specdec.engine.replay``)."
    )
    replay_trip: int = Field(
        3, ge=1, description="Quality guard: after this many replays that differ, the unit switches speculation "
        "off by itself (the kill switch) and logs why; set kill_switch: false again to resume."
    )
    explore: float = Field(
        0.01, ge=0, le=1, description="How much an adaptive request's choice of drafter favours one it has "
        "seen little of lately: each drafter's acceptance is read optimistically by ``sqrt(explore * ln(N) / n)``, "
        "n its recent rounds and N everyone's (discounted upper confidence bounds), so a drafter that lost a "
        "few unlucky rounds is tried again while one that keeps losing is tried less and less; 0: greedy."
    )
    confidence_stop: bool = Field(
        True, description="An adaptive request's draft chain stops where the drafter's own confidence "
        "says one more draft would not pay (drafts with a distribution; a request's explicit k is kept whole)."
    )


RECENCY = 0.98  # a round's weight in DrafterRecord.recent after each later round: ~50 rounds' memory


def _learn(trials: dict, rounds: dict, key, trial: tuple[int, int], w: float, prior: float) -> float:
    """One round's (accepted drafts, rejections) into ``trials[key]``: weight ``w``, or
    ``1 / (n + 2)`` while the key has seen ``n < 1 / w - 2`` rounds (the prior counted as one);
    returns the weight used. ``DrafterRecord``'s docstring says why."""
    seen = rounds.get(key, 0)
    rounds[key] = seen + 1
    w = max(w, 1.0 / (seen + 2))
    acc, rej = trials.get(key, (prior, 1 - prior))
    trials[key] = ((1 - w) * acc + w * trial[0], (1 - w) * rej + w * trial[1])
    return w


class Costs(Protocol):
    """What the policy reads of the unit's measured costs (``specdec.engine.schedule.StepCosts``),
    relative to a plain step of one row: ``c(mode)`` a draft step, ``v(k)`` a (k+1)-token pass."""

    step_s: float | None

    def c(self, mode: str) -> float: ...

    def v(self, k: int) -> float: ...


@dataclass
class DrafterRecord:
    """What rounds taught about each drafter mode, as EWMAs over rounds (weight ``ewma``):
    ``trials`` (accepted drafts, rejections) whose ratio is the per-token acceptance (a round
    with many trials weighs more than one that failed at once); ``calibration`` (accepted,
    predicted by the drafter's confidences) of chain modes; ``sizes``, the nodes a tree mode's
    rounds proposed. A request's policy keeps one; the unit keeps one over every request's
    rounds (``StepLoop.record``), which a new request starts from instead of bare priors, so a
    drafter that does not pay here is not tried afresh by every request (nor one that does
    given up on a few unlucky rounds).

    ``matched``: prompt lookup's trials again, by the length of the suffix each round matched
    (``RoundStats.match``). Its proposal is the text that followed an earlier occurrence of the
    context's last n tokens, and n says how likely that text is the target's: teacher-forced on
    the demo target's answers to the bench's code prompts, a one-token match's first draft was
    the target's token 0.21 of the time, a four-token match's 0.91 (5.6 of 8 drafts accepted).
    One estimate over all of them made ``auto`` run lookup on weak matches and the other
    drafters on strong ones.

    ``rounds`` counts the rounds each mode's estimates have seen. Until they are ``1 / ewma``,
    a round weighs ``1 / (n + 2)`` instead (the mean of the rounds so far, the prior counted as
    one round): a record that starts from the prior (a seeded sampling request, which may not
    learn from the unit's other requests; a new unit) learns a drafter's acceptance in a few
    rounds, not in the ``~1 / ewma`` an EWMA from the prior takes. With five drafters that
    each start at the prior, that was the whole of a 96-token answer spent trying them in turn.

        >>> r = DrafterRecord()
        >>> for _ in range(2):  # two rounds of 4 drafts, each rejected at the first
        ...     r.observe(RoundStats(1, "draft", 4, 4, 0, 1, 0.0, 0.0), 0.1, 0.6, False)
        >>> round(r.acceptance("draft"), 2)  # the prior's (0.6, 0.4) and two (0, 1): an EWMA gives 0.49
        0.2
    """

    trials: dict[str, tuple[float, float]] = field(default_factory=dict)
    calibration: dict[str, tuple[float, float]] = field(default_factory=dict)
    sizes: dict[str, float] = field(default_factory=dict)
    rounds: dict[str, int] = field(default_factory=dict)
    recent: dict[str, float] = field(default_factory=dict)  # rounds of each mode, discounted by RECENCY a round
    matched: dict[tuple[str, int], tuple[float, float]] = field(default_factory=dict)  # (mode, match) -> trials
    matched_rounds: dict[tuple[str, int], int] = field(default_factory=dict)

    def observe(self, r: RoundStats, w: float, prior: float, tree: bool, ran: bool = True) -> None:
        """One round that drafted; ``tree``: its mode grows trees (``prior``: a before any round).
        ``ran``: False for a shadow round (``SpeculationPolicy.shadow``), the evidence about a
        drafter that did not run: the round that did advances the other modes' clock."""
        for m in self.recent if ran else ():
            self.recent[m] *= RECENCY
        self.recent[r.mode] = self.recent.get(r.mode, 0.0) * (1.0 if ran else RECENCY) + 1.0
        # A tree's a is per level: did the target take one of the candidates at each depth
        # (a path that ends at a leaf had nothing left to try: no rejection).
        full = r.full if r.full is not None else (r.accepted >= r.k if tree else r.accepted == r.drafted)
        trial = (r.accepted, 0 if full else 1)
        if r.match:
            _learn(self.matched, self.matched_rounds, (r.mode, r.match), trial, w, prior)
        w = _learn(self.trials, self.rounds, r.mode, trial, w, prior)
        if tree:
            size = self.sizes.get(r.mode)
            self.sizes[r.mode] = r.drafted if size is None else (1 - w) * size + w * r.drafted
        elif r.confidence:
            # How far the drafter's confidences over- or under-state acceptance: the drafts a
            # round was predicted to keep (the sum over j of the product of the first j
            # confidences) against those it kept.
            predicted, reach = 0.0, 1.0
            for c in r.confidence:
                reach *= c
                predicted += reach
            acc, pred = self.calibration.get(r.mode, (1.0, 1.0))
            self.calibration[r.mode] = ((1 - w) * acc + w * r.accepted, (1 - w) * pred + w * predicted)

    def acceptance(self, mode: str, match: int = 0) -> float | None:
        """``mode``'s per-token acceptance (None: no round yet); ``match``: prompt lookup's at
        that match length this round, where its rounds of that length have taught one."""
        acc, rej = self.matched.get((mode, match)) or self.trials.get(mode, (0.0, 0.0))
        return acc / (acc + rej) if acc + rej > 0 else None

    def copy(self) -> "DrafterRecord":
        return DrafterRecord(dict(self.trials), dict(self.calibration), dict(self.sizes), dict(self.rounds),
                             dict(self.recent), dict(self.matched), dict(self.matched_rounds))

    def optimism(self, explore: float) -> dict[str, float]:
        """What each mode's acceptance gains when drafters are chosen optimistically: the bonus
        of discounted UCB (Garivier and Moulines, 2011), ``sqrt(explore * ln N / n)`` with ``n``
        the mode's recent rounds and ``N`` all modes'. A mode not run for a while sees ``n``
        shrink and its bonus grow until it is tried again; one never run has none (its prior
        stands in). Two recent rounds against fifty of another: ``n`` = 2, ``N`` = 52, at
        ``explore`` = 0.01 a bonus of ``sqrt(0.01 * 3.95 / 2)`` = 0.14.

            >>> bonus = DrafterRecord(recent={"eagle_tree": 2.0, "eagle": 50.0}).optimism(0.01)
            >>> round(bonus["eagle_tree"], 2), round(bonus["eagle"], 2)
            (0.14, 0.03)
        """
        if explore <= 0.0:
            return {}
        scale = explore * math.log(max(math.e, sum(self.recent.values())))  # once a decision, not once a mode
        return {m: math.sqrt(scale / n) for m, n in self.recent.items() if n > 0.0}


@dataclass
class SpeculationPolicy:
    """Per-request controller: ``decide(rounds)`` before each round returns ``(mode, k)``.

    It reads the rounds it has not seen, updates the acceptance estimate of each round's mode,
    then picks the drafter and k with the best expected speedup (k = 0: plain decoding).
    ``observe(rounds)`` only keeps the estimates current (a round the loop decided itself).
    ``record``: where its estimates start (the unit's ``DrafterRecord``; empty: priors).
    """

    modes: list[str]  # the drafters it may choose among
    costs: Costs
    config: Callable[[], PolicyConfig]  # read every round: operator flags apply live
    k_request: int | None = None  # a request's explicit k (capped at k_max)
    adaptive: bool = True  # False: the request asked for a fixed mode and k
    tree_modes: dict[str, str] = field(default_factory=dict)  # tree mode -> the chain mode it grows trees of
    tree_width: int = 6  # candidates per expanded node (``SpeculationConfig.tree_width``)
    active: str = ""  # the drafter chosen last
    plain: bool = False  # in fallback
    plain_tokens: int = 0
    probing: bool = False
    events: list[tuple[int, str]] = field(default_factory=list)  # (round index, what)
    k_used: Counter = field(default_factory=Counter)
    record: DrafterRecord = field(default_factory=DrafterRecord)
    shadowed: frozenset[str] = frozenset()  # drafters every round scores, run or not (``shadow``)
    _seen: int = 0
    _speedup: float = 1.0  # the expected speedup of the last decision
    _matched: dict[str, int] = field(default_factory=dict)  # this round's match length of each lookup drafter

    def __post_init__(self) -> None:
        self.active = self.active or self.modes[0]
        self._start = self.record.copy()  # what it knew when admitted (the unit's record)

    @property
    def acceptance(self) -> dict[str, float]:
        """Each mode's per-token (a tree's: per-level) acceptance estimate so far."""
        return {m: a for m in self.record.trials if (a := self.record.acceptance(m)) is not None}

    def observe(self, rounds: list[RoundStats]) -> None:
        cfg = self.config()
        for r in rounds[self._seen :]:
            if r.drafted:
                self.record.observe(r, cfg.ewma, cfg.prior_acceptance, r.mode in self.tree_modes)
            if r.k == 0 and r.mode != "prefill":
                self.plain_tokens += r.emitted
        self._seen = len(rounds)

    def shadow(self, mode: str, proposed: list[int], emitted: list[int], match: int = 0) -> RoundStats | None:
        """A round's evidence about a drafter that did not run in it but costs nothing to ask
        (prompt lookup): ``proposed``, what it would have drafted from the round's context,
        against ``emitted``, the tokens the target emitted there. Verification keeps each
        emitted token a draw from the target's p given the ones before it, so it equals a
        point-mass draft ``d`` with probability ``p(d)``: the chance that ``d`` is accepted.
        The leading matches are accepted drafts, a mismatch among the emitted tokens is a
        rejection, and a proposal that outlasts them ends unrejected. Recorded as a round of
        ``mode`` (``match``: the length of the suffix it matched) and returned (for the unit's
        record too); None when it proposed nothing.

            proposed [5, 6, 7], emitted [5, 9]  ->  1 accepted, rejected
            proposed [5, 6, 7], emitted [5, 6]  ->  2 accepted, not rejected (unknown past 2)
        """
        if not proposed or mode not in self.shadowed:
            return None
        accepted = 0
        for d, t in zip(proposed, emitted):
            if d != t:
                break
            accepted += 1
        r = RoundStats(index=-1, mode=mode, k=len(proposed), drafted=len(proposed), accepted=accepted,
                       emitted=0, draft_s=0.0, verify_s=0.0, full=accepted >= min(len(proposed), len(emitted)),
                       match=match)
        cfg = self.config()
        self.record.observe(r, cfg.ewma, cfg.prior_acceptance, mode in self.tree_modes, ran=False)
        return r

    def stop_below(self, mode: str) -> float:
        """The confidence stop for this request's next chain (``specdec.drafters.base.Chains``)
        or tree (``specdec.drafters.base.Trees``, ``medusa_tree``).

        After draft j the chain is kept with probability ``kappa * R_j`` (``R_j``: the product of
        the drafter's confidences so far, ``kappa``: their calibration); one more draft costs a
        draft step and a verify position, ``c + (v(2) - v(1))`` plain steps, which at the
        expected speedup ``S`` would buy ``S (c + dv)`` tokens. The chain stops once
        ``kappa * R_j`` falls below that. A tree's node is worth its path probability and costs
        a verify position (its level's draft pass is shared by the whole frontier), so a tree
        keeps the nodes whose ``kappa * R`` is at least ``S dv`` (its drafter's chain
        calibration). 0 (draft all k, fill the node budget) for a request with an explicit k,
        or when the operator turned it off.

            c = 0.15, dv = 0.03, S = 1.2, kappa = 1  ->  a chain stops once R_j < 0.216,
                                                         a tree keeps nodes with R >= 0.036
        """
        cfg = self.config()
        if not (self.adaptive and cfg.confidence_stop):
            return 0.0
        cost = (0.0 if mode in self.tree_modes else self.costs.c(mode)) + max(0.0, self.costs.v(2) - self.costs.v(1))
        return min(0.95, max(1.0, self._speedup) * cost / self._kappa(mode))

    def _kappa(self, mode: str) -> float:
        """The calibration of ``mode``'s confidences (a tree's: its chain drafter's): accepted
        drafts over those its probabilities predicted, within [0.25, 4]."""
        acc, pred = self.record.calibration.get(self.tree_modes.get(mode, mode), (1.0, 1.0))
        return min(4.0, max(0.25, acc / pred)) if pred > 0 else 1.0

    def node_price(self, mode: str, k: int, nodes: int) -> Price | None:
        """What this request's tree of depth ``k`` pays for each of at most ``nodes`` nodes
        (``specdec.trees.Price``): the verify pass ``v(n)`` and its ``k`` draft passes, in plain
        steps, and the chain drafter's calibration. None (fill the budget) where ``stop_below``
        is 0: a request with an explicit k, or the confidence stop turned off."""
        cfg = self.config()
        if not self._priced(cfg) or mode not in self.tree_modes or nodes <= 0:
            return None
        return Price(tuple(self.costs.v(n) for n in range(nodes + 1)), k * self.costs.c(mode), self._kappa(mode))

    def _priced(self, cfg: PolicyConfig) -> bool:
        """Whether this request's trees are sized by their price (else they fill the budget)."""
        return self.adaptive and cfg.confidence_stop

    def tree_size(self, mode: str, cfg: PolicyConfig | None = None) -> int:
        """The nodes a round of tree ``mode`` is expected to verify: what its rounds proposed
        (an EWMA: the price sizes trees below the budget). Before any: a priced tree, the nodes
        that cost no more than the pending token's pass (below the verify curve's knee the price
        keeps every node the drafter grows, and past it only the likely ones); an unpriced one,
        the budget ``tree_nodes``. Priced at the budget, a tree looked dear (v(16) = 1.47 on the
        demo target) and ``auto`` never tried one, while its rounds kept 3 nodes and beat the
        chains (2-core AMD EPYC, AVX-512 BF16)."""
        cfg = cfg or self.config()
        size = self.record.sizes.get(mode)
        if size is None:
            size = cfg.tree_nodes
            if self._priced(cfg):  # v never falls as n grows: the last n at v(1), by bisection (every row, every step)
                free, lo, hi = self.costs.v(1) * (1 + 1e-3), 1, cfg.tree_nodes
                while lo < hi:
                    mid = (lo + hi + 1) // 2
                    lo, hi = (mid, hi) if self.costs.v(mid) <= free else (lo, mid - 1)
                size = lo
        return max(1, min(cfg.tree_nodes, round(size)))

    def _best(self, cfg: PolicyConfig, skip: frozenset[str] = frozenset()) -> tuple[str, int, float] | None:
        """The drafter and k to run and the best expected speedup over the drafters but ``skip``
        (None: no other). The speedup is the best estimate's (it decides fallback and the
        confidence stop); the drafter is the one whose optimistic estimate is best
        (``DrafterRecord.optimism``), run at the k its own estimate gives. Greedy, one unlucky
        round could retire the best drafter for the unit's life: the unit's record seeds every
        later request, and no request would run that drafter again to correct it."""
        options = self._options(cfg, skip)
        if not options:
            return None
        best = max(options, key=lambda o: o[2])
        if self.adaptive and cfg.explore > 0 and len(options) > 1:
            chosen = max(options, key=lambda o: o[3])
            return chosen[0], chosen[1], best[2]
        return best[:3]

    def _options(self, cfg: PolicyConfig, skip: frozenset[str]) -> list[tuple[str, int, float, float]]:
        """(mode, k, expected speedup, optimistic speedup) for each drafter but ``skip``."""
        k_max = min(cfg.k_max, self.k_request or cfg.k_max) if not self.adaptive else cfg.k_max
        options = []
        chain_v = [self.costs.v(k) for k in range(k_max + 1)]  # once a decision, not once a mode and k
        optimism = self.record.optimism(cfg.explore) if self.adaptive else {}
        for mode in self.modes:
            if mode in skip:
                continue
            a = self.estimate(mode, cfg)
            c = self.costs.c(mode)
            v = chain_v
            if mode in self.tree_modes:  # depth k, the same nodes whatever k: one verify of them all
                nodes = self.tree_size(mode, cfg)
                v = [self.costs.v(nodes)] * (k_max + 1)
                if self.adaptive and self.record.acceptance(mode) is None:
                    # the prior: no deeper than its nodes, and a level tries what its nodes allow
                    chain = self._chain_acceptance(mode, cfg)
                    o = max(((mode, j, expected_speedup(self._tree_prior(chain, nodes / j), j, c, v.__getitem__))
                             for j in range(1, min(k_max, nodes) + 1)), key=lambda o: o[2])
                    options.append((*o, o[2]))
                    continue
            if self.adaptive:
                k, s = best_k(a, c, v, k_max)
                bonus = optimism.get(mode, 0.0)
                options.append((mode, k, s, best_k(min(1.0, a + bonus), c, v, k_max)[1] if bonus else s))
            else:
                k = k_max
                options.append((mode, k, expected_speedup(a, k, c, v.__getitem__), 0.0))
        return options

    def estimate(self, mode: str, cfg: PolicyConfig | None = None) -> float:
        """The per-token (a tree's: per-level) acceptance of ``mode`` (prompt lookup's at this
        round's match length): measured, else its prior."""
        cfg = cfg or self.config()
        a = self.record.acceptance(mode, self._matched.get(mode, 0))
        if a is None:
            a = self._tree_prior(self._chain_acceptance(mode, cfg)) if mode in self.tree_modes else cfg.prior_acceptance
        return a

    def _chain_acceptance(self, mode: str, cfg: PolicyConfig) -> float:
        """The acceptance of tree ``mode``'s chain drafter: measured, else the prior."""
        chain = self.record.acceptance(self.tree_modes[mode])
        return cfg.prior_acceptance if chain is None else chain

    def _tree_prior(self, chain: float, per_level: float | None = None) -> float:
        """A tree mode's per-level acceptance before any of its rounds: its chain drafter's
        (``chain``), as if each level had ``width / 2`` independent tries (its candidates are
        the drafter's top ``width``, and the first matters most), or ``per_level`` nodes a level
        if fewer: ``1 - (1 - a_chain)^tries``. Its own rounds replace it at once; without it,
        ``auto`` would price a tree at a chain's acceptance and never try one."""
        tries = self.tree_width / 2 if per_level is None else min(self.tree_width / 2, per_level)
        return 1.0 - (1.0 - chain) ** max(1.0, tries)

    def decide(self, rounds: list[RoundStats], match: Callable[[str], int | None] | None = None) -> tuple[str, int]:
        """The next round's drafter and k (0: a plain round). ``match(mode)``: how long a
        suffix of the context prompt lookup matched this round, 0 if it has nothing to
        propose (None: ``mode`` is no lookup). Its estimate is the one for that length
        (``DrafterRecord.matched``); with nothing to propose, another drafter takes the round
        if it pays, else the round is plain; neither counts as a fallback."""
        self.observe(rounds)
        cfg = self.config()
        self._matched = {m: n for m in self.modes if (n := match(m)) is not None} if match is not None else {}
        k = self._k(len(rounds), cfg, len(self.modes) > 1)
        return self.active, k  # ``_k`` may switch the drafter: read ``active`` after it

    def _k(self, index: int, cfg: PolicyConfig, handover: bool = False) -> int:
        if cfg.kill_switch:
            return 0
        if self.costs.step_s is None and index == 1 and self.adaptive:
            return 0  # one plain step measures the unit's step time; it costs nothing
        mode, k, s = self._best(cfg)
        # A drafter every round scores needs no probe: its estimate is as fresh as the last round.
        current = self.plain and not self.probing and mode in self.shadowed and s >= 1 + cfg.margin_on
        due = not self.plain or self.probing or current or self.plain_tokens >= cfg.probe_interval
        if due and handover and self._matched.get(mode) == 0:
            if self.plain and not self.probing:
                return 0  # a probe of an idle drafter waits for a round where it has something
            other = self._best(cfg, frozenset({mode}))
            if other is None or other[2] < 1 + cfg.margin_off:
                return 0  # the best drafter has nothing this round, and no other pays: plain
            mode, k, s = other
        self._speedup = s
        if current:
            self.plain = False
            self._note(index, f"resume:{mode}")
        elif self.probing:  # the probe round just ran: decide on its evidence
            self.probing = False
            if s >= 1 + cfg.margin_on:
                self.plain = False
                self._note(index, f"resume:{mode}")
            else:
                self.plain_tokens = 0
        elif not self.plain and s < 1 + cfg.margin_off and self.adaptive:
            self.plain, self.plain_tokens = True, 0
            self._note(index, "fallback")
        if self.plain:
            if self.plain_tokens < cfg.probe_interval:
                return 0
            self.probing = True
            self._note(index, f"probe:{mode}")
            # The stretch that made it fall back is old news now: the probe is judged from what
            # the unit knew at admission (if anything), not from this request's last bad rounds.
            if mode in self._start.trials and mode not in self.shadowed:
                self.record.trials[mode] = self._start.trials[mode]
                self.record.rounds[mode] = self._start.rounds.get(mode, 0)
            k = min(k, 2)  # a cheap probe
        if mode != self.active:
            self._note(index, f"switch:{mode}")
            self.active = mode
        self.k_used[k] += 1
        return k

    def _note(self, index: int, what: str) -> None:
        """Record a decision; the loop puts it on the round it was taken for (``RoundStats.events``)."""
        self.events.append((index, what))

    def summary(self) -> dict:
        kinds = Counter(e.split(":")[0] for _, e in self.events)
        return {
            "fallbacks": kinds["fallback"],
            "probes": kinds["probe"],
            "mode_switches": kinds["switch"] + kinds["resume"],
            "k_histogram": {str(k): n for k, n in sorted(self.k_used.items())},
            "acceptance_estimate": {m: round(a, 4) for m, a in self.acceptance.items()},
        }
