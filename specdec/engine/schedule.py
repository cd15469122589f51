"""Choosing each request's k under load: the goodput rule (SmartSpec, arXiv 2406.14066).

A step's time is modelled as ``T = verify(tokens in the batch) + sum_m draft_m(steps, rows)``,
both linear and fitted online from the unit's own measurements. (A lone request's policy reads
the same passes as a hinge instead, ``_Curve.hinge``: flat while memory-bound, then a line.) With per-token acceptance
``a_i``, the j-th draft token of request i adds ``a_i^j`` expected tokens. Starting from
``k_i = 0`` for every row, draft tokens are added greedily, highest ``a_i^(k_i+1)`` first, while

    a_i^(k_i+1) > G * dT        (G = expected tokens / T, the step's goodput so far)

so speculation shrinks by itself as the batch fills (every added token delays every row) and
comes back when the batch empties. Rows whose k is fixed (an explicit k, a seeded sampling
request that must not depend on what it is batched with) are taken as they are.

Worked example (costs in ms: verify = 40 + 2.5 per token, a draft step 4 + 1 per row): one
row with a = 0.8 starts at G = 1 / 42.5. Its 1st draft adds 0.8 tokens for 2.5 + 5 = 7.5 ms
(0.8 > 0.0235 * 7.5 = 0.18: taken), its 2nd 0.64 for 7.5 ms, ... With eight rows at a = 0.3
and plain decoding at 57.5 ms, G = 0.139: a first draft adds 0.3 for 2.5 + 1 + 4 = 7.5 ms
(0.3 < 1.04: not taken), so a full batch of weak drafts decodes plainly.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

PRIOR_STEP_S = 0.04  # a plain step of one row before anything is measured (replaced at once)


class _Line:
    """``y = a + b x`` fitted by least squares to one point per distinct ``x``: the EWMA of
    its samples, for the ``points`` most recently seen ``x``; before two distinct ``x`` are
    seen, ``b = prior_slope * a`` through the mean point.

    One point per ``x``, not a window of samples: under steady load nearly every step has the
    same size, and a window would soon hold that one size and forget the slope the others
    showed (then fall back to the prior's, and pay to learn it again).

        >>> line = _Line(0.04, 0.03)
        >>> for _ in range(50):
        ...     line.observe(16, 0.100)                 # a steady batch of 16 rows
        >>> line.observe(20, 0.120)                     # one step with 4 more tokens
        >>> for _ in range(50):
        ...     line.observe(16, 0.100)
        >>> round(line.b * 1e3, 2)                      # still 5 ms a token
        5.0
    """

    def __init__(self, prior_a: float, prior_slope: float, points: int = 32, ewma: float = 0.2):
        self.a, self.b = prior_a, prior_slope * prior_a
        self.prior_slope, self.points, self.ewma = prior_slope, points, ewma
        self.means: dict[float, float] = {}  # x -> EWMA of y, least recently seen first
        self.seen = False

    def observe(self, x: float, y: float) -> None:
        old = self.means.pop(x, None)
        self.means[x] = y if old is None else (1 - self.ewma) * old + self.ewma * y
        if len(self.means) > self.points:
            del self.means[next(iter(self.means))]
        self.seen = True
        n = len(self.means)
        mx = sum(self.means) / n
        my = sum(self.means.values()) / n
        var = sum((px - mx) ** 2 for px in self.means)
        if var > 0:
            b = sum((px - mx) * (py - my) for px, py in self.means.items()) / var
            b = max(b, 0.0)
            self.a, self.b = max(my - b * mx, 1e-6), b
        else:  # one x so far: keep the prior's shape through the measured point
            self.a = my / (1 + self.prior_slope * mx)
            self.b = self.prior_slope * self.a

    def __call__(self, x: float) -> float:
        return self.a + self.b * x


class _Curve(_Line):
    """``_Line`` (``curve(x)``, the goodput rule's) that also fits its points with a hinge,
    ``curve.hinge(x) = a + b * max(0, x - knee)``: flat up to a knee, a line after it, the knee
    at the measured ``x`` that fits best (least squares; a knee below every point is one line).
    A pass is flat while it is memory-bound (a few tokens cost what one does) and grows once it
    is compute-bound, which no one line fits: on the demo target (2-core AMD EPYC, AVX-512 BF16)
    1-4 tokens took 32-35 ms and 17 tokens 75 ms, and a line through them priced one draft at 7%
    of a step instead of none (``auto`` then fell back to plain decoding on chat). Two
    parameters and a knee over every point, not a curve through each: a point's EWMA carries
    this machine's noise (+-10%), which a fit through every point would follow. Each knee's fit
    is O(1) from suffix sums: the refit after every step stays a few tens of microseconds.

        >>> curve = _Curve(0.04, 0.03)
        >>> for x, y in ((1, 0.034), (2, 0.033), (4, 0.034), (17, 0.075)):
        ...     curve.observe(x, y)
        >>> [round(curve.hinge(x) / curve.hinge(1), 2) for x in (2, 3, 5, 17)]
        [1.0, 1.0, 1.09, 2.23]
        >>> [round(curve(x) / curve(1), 2) for x in (2, 3, 5, 17)]   # the line through the same points
        [1.09, 1.18, 1.36, 2.45]
    """

    def __init__(self, prior_a: float, prior_slope: float, points: int = 32, ewma: float = 0.2):
        super().__init__(prior_a, prior_slope, points, ewma)
        self._hinge: tuple[float, float, float] | None = None  # (a, b, knee)

    def observe(self, x: float, y: float) -> None:
        super().observe(x, y)
        pts = sorted(self.means.items())
        n = len(pts)
        if n < 3:
            self._hinge = None
            return
        my = sum(py for _, py in pts) / n
        syy = sum((py - my) ** 2 for _, py in pts)
        best = (syy, my, 0.0, pts[-1][0])  # flat: (sse, a, b, knee)
        s1 = s2 = sxy = sy = 0.0  # suffix sums over the points right of the knee
        for j in range(n - 1, -1, -1):
            px, py = pts[j]
            s1, s2, sxy, sy = s1 + px, s2 + px * px, sxy + px * py, sy + py
            m = n - j  # the points right of the knee
            knee = pts[j - 1][0] if j > 0 else pts[0][0] - 1  # j = 0: a knee below every point (one line)
            sz = s1 - m * knee
            szz = s2 - 2 * knee * s1 + m * knee * knee - sz * sz / n
            szy = (sxy - knee * sy) - sz * my
            if szz <= 0 or szy <= 0:
                continue
            b = szy / szz
            sse = syy - szy * b
            if sse <= best[0] * (1 + 1e-9):  # a tie goes to the knee further left (a line below the points)
                best = (sse, my - b * sz / n, b, knee)
        self._hinge = (max(best[1], 1e-6), best[2], best[3])  # one assignment: readers see old or new

    def hinge(self, x: float) -> float:
        fit = self._hinge
        if fit is None:
            return self(x)
        a, b, knee = fit
        return a + b * max(0.0, x - knee)


class StepCosts:
    """The unit's measured step costs, fitted online (thread-safe).

    ``verify_s(tokens)``: one target pass over that many tokens of decode rows (pending tokens
    and drafts; ``observe_verify`` is given only steps without a prompt in them: a prompt
    chunk's tokens cost about half a decode step's each, 1.6 against 3-7 ms on the demo target
    on a 2-core AMD EPYC with AVX2 only, and priced a draft token as if it were one);
    ``draft_step_s(mode, rows)``: one batched draft step over that many rows.

    It also serves each request's ``SpeculationPolicy`` as its cost model, in the units of a
    lone request: ``step_s`` = a 1-token pass, ``c(mode)`` = a 1-row draft step / step_s,
    ``v(k)`` = a (k+1)-token pass / step_s, read from the same passes fitted as a hinge
    (``_Curve.hinge``). The goodput rule keeps the line over a batch's tokens: with the hinge there,
    drafts below the knee looked free to a batch, and ``auto`` lost throughput at 4 streams
    (paired through HTTP, 2-core AMD EPYC with AVX-512 BF16: 0.93x plain against 0.99x with
    the line; a lone stream 1.17x against 1.03x with the hinge in the policy).
    """

    def __init__(self, prior_c: dict[str, float] | None = None, prior_verify_slope: float = 0.03):
        self.prior_c = {"draft": 0.15, "ngram": 0.01, "early_exit": 0.3, "eagle": 0.1, "medusa": 0.05, **(prior_c or {})}
        self._verify = _Curve(PRIOR_STEP_S, prior_verify_slope)  # a line for a batch, a hinge for one request
        self._draft: dict[str, _Line] = {}
        self._lock = threading.Lock()
        # The policy's view (``c``, ``v``), computed once between observations: every row of a
        # step asks it for every drafter and k, and it changes only when a step is observed.
        self._c: dict[str, float] = {}
        self._v: dict[int, float] = {}

    def observe_verify(self, tokens: int, seconds: float) -> None:
        with self._lock:
            self._verify.observe(tokens, seconds)
            self._c, self._v = {}, {}

    def observe_draft(self, mode: str, rows: int, seconds_per_step: float) -> None:
        with self._lock:
            line = self._draft.get(mode)
            if line is None:
                line = self._draft[mode] = _Line(self.prior_c.get(mode, 0.2) * self._verify(1), 0.1)
            line.observe(rows, seconds_per_step)
            self._c = {}

    def verify_s(self, tokens: int) -> float:
        return self._verify(tokens)

    def draft_step_s(self, mode: str, rows: int) -> float:
        line = self._draft.get(mode)
        if line is None:
            return self.prior_c.get(mode, 0.2) * self._verify(1) * (1 + 0.1 * rows) / 1.1
        return line(rows)

    def draft_row_s(self, mode: str) -> float:
        """What one more row adds to an existing draft step."""
        line = self._draft.get(mode)
        return line.b if line is not None else 0.1 * self.draft_step_s(mode, 1) / 1.1

    # --- the per-request policy's view (``specdec.policy.Costs``) -----------------------------

    @property
    def step_s(self) -> float | None:
        return self._verify(1) if self._verify.seen else None

    def c(self, mode: str) -> float:
        memo = self._c  # an observation between here and the store replaces it: the value is not kept
        c = memo.get(mode)
        if c is None:
            if mode not in self._draft or not self._verify.seen:
                c = self.prior_c.get(mode, 0.2)
            else:
                c = self.draft_step_s(mode, 1) / self._verify(1)
            memo[mode] = c
        return c

    def v(self, k: int) -> float:
        memo = self._v
        v = memo.get(k)
        if v is None:
            v = memo[k] = 1.0 if k == 0 else max(1.0, self._verify.hinge(k + 1) / self._verify.hinge(1))
        return v


@dataclass
class Candidate:
    """A decode row before its k is chosen."""

    a: float  # per-token acceptance estimate of its mode
    k_cap: int  # the most it may draft this step (its policy's k, max_tokens, k_max)
    mode: str  # the drafter it would use
    fixed: bool = False  # take k_cap as it is (explicit k, seeded sampling)
    nodes: int = 0  # a tree mode's nodes (depth k_cap): all or nothing


def allocate(cands: list[Candidate], costs: StepCosts, other_tokens: int = 0) -> list[int]:
    """Each row's k for this step by the goodput rule (module docstring).

    ``other_tokens``: tokens of this step that are not decode rows (prefill chunks).
    """
    k = [c.k_cap if c.fixed else 0 for c in cands]
    width = [c.nodes if c.nodes and kc else kc for c, kc in zip(cands, k)]  # verify tokens past the pending one
    steps: dict[str, int] = {}
    for c, kc in zip(cands, k):
        steps[c.mode] = max(steps.get(c.mode, 0), kc)
    rows_in_step: dict[tuple[str, int], int] = {}
    for c, kc in zip(cands, k):
        for j in range(1, kc + 1):
            rows_in_step[(c.mode, j)] = rows_in_step.get((c.mode, j), 0) + 1
    expected = sum(_expected(c.a, kc) for c, kc in zip(cands, k))
    tokens = other_tokens + sum(w + 1 for w in width)
    t = costs.verify_s(tokens) + sum(
        sum(costs.draft_step_s(m, rows_in_step[(m, j)]) for j in range(1, s + 1)) for m, s in steps.items()
    )
    per_token = costs.verify_s(tokens + 1) - costs.verify_s(tokens)
    open_rows = {i for i, c in enumerate(cands) if not c.fixed and c.k_cap > 0 and not c.nodes}
    # Trees first, all or nothing, best gain per second first: a tree adds E(a, k) - 1 tokens
    # for its nodes' verify tokens and k draft passes (or k more rows in passes that run anyway).
    for i in sorted((i for i, c in enumerate(cands) if not c.fixed and c.k_cap > 0 and c.nodes),
                    key=lambda i: -_expected(cands[i].a, cands[i].k_cap)):
        c = cands[i]
        gain = _expected(c.a, c.k_cap) - 1
        have = steps.get(c.mode, 0)
        dt = c.nodes * per_token + sum(costs.draft_step_s(c.mode, 1) if j > have else costs.draft_row_s(c.mode)
                                       for j in range(1, c.k_cap + 1))
        if gain > (expected / t) * dt:
            k[i] = c.k_cap
            expected += gain
            t += dt
            steps[c.mode] = max(have, c.k_cap)
    while open_rows:
        i = max(open_rows, key=lambda j: cands[j].a ** (k[j] + 1))
        c = cands[i]
        j = k[i] + 1
        gain = c.a ** j
        if j > steps.get(c.mode, 0):  # a new draft step for this mode
            dt = per_token + costs.draft_step_s(c.mode, 1)
        else:
            dt = per_token + costs.draft_row_s(c.mode)
        if gain > (expected / t) * dt:
            k[i] = j
            expected += gain
            t += dt
            steps[c.mode] = max(steps.get(c.mode, 0), j)
            if k[i] >= c.k_cap:
                open_rows.discard(i)
        else:
            open_rows.discard(i)
    return k


def _expected(a: float, k: int) -> float:
    return float(k + 1) if a >= 1.0 else (1.0 - a ** (k + 1)) / (1.0 - a)


class GoodputGuard:
    """Speculation in a batch must not cost throughput: a check on the goodput rule by what
    steps really delivered.

    The rule above trusts a fitted cost model and each row's acceptance estimate; when either is
    off (a draft pass that costs more in a full batch than it did alone, an optimistic
    estimate), speculating steps deliver fewer tokens per second than plain ones would. The
    guard keeps, per batch size (buckets 2-3, 4-7, 8-15, 16+ decode rows), an EWMA of the output
    tokens per second and per row of steps that speculated and of steps that did not (per row:
    a bucket holds steps of several sizes, and plain steps of 3 rows must not outrun speculating
    ones of 2 by their extra row alone), and allows speculation in a bucket only where it
    measurably wins (at least ``1 + margin`` of plain): a step's tokens per second do not show
    all that speculation costs a batch. Its rows accept different numbers of drafts, so they
    finish at different steps: a wave of requests leaves thinner batches behind it, and the
    prompts that follow come in steps of their own (on the demo pair at 4 streams, speculating
    steps delivered 0-3% more than plain ones per row, and the turns took 2-3% longer). Until it
    has ``min_samples`` of both in a bucket, its observed steps alternate between them (so it
    learns in ``2 * min_samples`` steps, and pays for at most half of them on a losing arm);
    then it keeps both estimates fresh: the ``explore``-th step of a bucket runs the arm it
    would not, and while the winner stays the same, the gap to the next such step doubles, up to
    ``max_explore`` (a new winner starts it again at ``explore``). An exploring step is dear: a
    speculating step of 4 rows after a plain stretch catches every row's drafter up and verifies
    the drafts of whatever drafters the rows chose, 29-204 ms (most 40-200) against a 33-49 ms
    plain step on the demo pair (2-core AMD EPYC, AVX-512 BF16): 3-10 of them took 0.1-0.9 s of
    a 4.5-6 s turn of 4 streams.

    The decision compares the arms by a ratio, not by their two rates: the losing arm runs
    rarely, so its rate is old when it is read, while the machine's speed drifts (this one's
    plain step went from 30 to 45 ms within minutes, which made an old speculating rate look
    like a win). Each step of the rare arm (either arm while learning) is set against the
    current rate of the other, and the guard keeps an EWMA of those ratios (weight
    ``ratio_ewma`` a step: the rare arm's steps are few).

        >>> g = GoodputGuard(min_samples=2, explore=100)
        >>> for _ in range(3):
        ...     g.observe(8, True, tokens=10, seconds=0.1)    # 100 tok/s speculating (8 rows)
        ...     g.observe(8, False, tokens=12, seconds=0.1)   # 120 tok/s plain (8 rows)
        >>> g.allow(8), g.allow(2)
        (False, True)
    """

    def __init__(self, margin: float = 0.03, ewma: float = 0.1, min_samples: int = 8, explore: int = 32,
                 max_explore: int = 512, ratio_ewma: float = 0.25):
        self.margin, self.ewma, self.ratio_ewma, self.min_samples = margin, ewma, ratio_ewma, min_samples
        self.explore, self.max_explore = explore, max(explore, max_explore)
        self._rate: dict[tuple[int, bool], float] = {}
        self._seen: dict[tuple[int, bool], int] = {}
        self._steps: dict[int, int] = {}
        self._ratio: dict[int, float] = {}  # per bucket, EWMA of speculating / plain rate, from the rare arm's steps
        self._winner: dict[int, bool] = {}  # per bucket, the arm that won when last asked (once known)
        self._gap: dict[int, int] = {}  # per bucket, steps from one exploring step to the next
        self._next: dict[int, int] = {}  # per bucket, the step that explores next
        self._lock = threading.Lock()

    @staticmethod
    def bucket(rows: int) -> int:
        return min(rows, 16).bit_length()  # 2-3 -> 2, 4-7 -> 3, 8-15 -> 4, 16+ -> 5

    def observe(self, rows: int, speculated: bool, *, tokens: int, seconds: float) -> None:
        if rows < 2 or seconds <= 0:
            return
        b = self.bucket(rows)
        key = (b, speculated)
        with self._lock:
            rate = tokens / (rows * seconds)
            other = self._rate.get((b, not speculated))
            if other is not None and self._winner.get(b) != speculated:  # the rare arm, or learning
                r = rate / other if speculated else other / rate
                old = self._ratio.get(b)
                self._ratio[b] = r if old is None else (1 - self.ratio_ewma) * old + self.ratio_ewma * r
            old = self._rate.get(key)
            self._rate[key] = rate if old is None else (1 - self.ewma) * old + self.ewma * rate
            self._seen[key] = self._seen.get(key, 0) + 1

    def allow(self, rows: int, observed: bool = True) -> bool:
        """May a step of ``rows`` decode rows speculate? (A lone row: always; its policy decides.)

        ``observed``: the step is one the guard will observe (no prompt in it), so it may be the
        one that runs the other arm. A step with a prompt is never observed: exploring there
        would pay for the losing arm (a speculating step after a plain stretch catches every
        row's drafter up first: 64 ms on the demo pair at 8 rows) and learn nothing. Nor does
        such a step get the benefit of the doubt while nothing is known: it speculates only
        where the guard has seen speculation win (a step with a prompt that speculated at 13-16
        rows spent 31-126 ms catching drafters up, unobserved).
        """
        if rows < 2:
            return True
        b = self.bucket(rows)
        with self._lock:
            step = self._steps.get(b, 0) + int(observed)
            self._steps[b] = step
            ratio = self._ratio.get(b)
            known = ratio is not None and min(self._seen.get((b, True), 0), self._seen.get((b, False), 0)) >= self.min_samples
            # Nothing known yet: an observed step tries speculation (half of them, below); others stay plain.
            wins = ratio >= 1 + self.margin if known else observed
            if not observed:
                return wins
            if not known:  # learn both arms quickly: alternate until each has min_samples
                return wins if step % 2 else not wins
            if self._winner.get(b) != wins:  # known for the first time, or a new winner: explore soon
                self._winner[b], self._gap[b] = wins, self.explore
                self._next[b] = step + self.explore - step % self.explore
            if step < self._next[b]:
                return wins
            self._gap[b] = min(2 * self._gap[b], self.max_explore)  # the same winner: explore less often
            self._next[b] = step + self._gap[b]
            return not wins  # the other arm, so that its estimate stays current

    def state(self) -> dict:
        """Per bucket: (speculating, plain) tokens/s per row, for operators and tests."""
        with self._lock:
            return {b: (self._rate.get((b, True)), self._rate.get((b, False))) for b in sorted({k[0] for k in self._rate})}

    def ratio(self, rows: int) -> float | None:
        """What speculating delivers per row over plain decoding at this batch size, as judged."""
        with self._lock:
            return self._ratio.get(self.bucket(rows))
