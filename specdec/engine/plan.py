"""One step of the unit, as one typed plan: what every sequence does in it.

The planner (``StepLoop``) writes a ``StepPlan``; every later stage (drafting, the target's
pass, verification, commit) only reads it. A row is a sequence catching up and maybe
speculating: it feeds the tokens its target cache misses (a whole prompt, a chunk of one,
or just the last token) plus ``k`` drafts. Prefill is not a mode: it is a row whose cache
misses the prompt. A row that does not ``emit`` (a prompt chunk that does not reach the end
of the prompt) produces no token this step.

Also here: the round helpers every stage shares (``round_seed``, ``cut_round``, ``draft_budget``).
"""

from __future__ import annotations

from dataclasses import dataclass

from specdec import trees
from specdec.batch.blocks import BLOCK
from specdec.drafters.base import EMPTY_PROPOSAL, Proposal
from specdec.grammar import GrammarSpec
from specdec.sampling import SamplingParams

_MASK64 = 0xFFFF_FFFF_FFFF_FFFF
TARGET, DRAFT = 0, 1  # the two consumers of a round's randomness
CHOICE = 2  # choice_seed's role: another choice of the same request
DRAFT_RETRY_ROUNDS = 8  # plain rounds after a drafter failure before drafting again


class DraftUnavailable(RuntimeError):
    """Raised by the target side when the drafts it was handed failed (e.g. the draft worker died)."""


def round_seed(request_seed: int, round_index: int, role: int) -> int:
    """A 63-bit seed for one round and one role (splitmix64 of the three numbers): a request's
    randomness depends on nothing but its seed, so it is the same alone, batched or resumed."""
    z = (request_seed * 0x9E3779B97F4A7C15 + round_index * 2 + role + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


def choice_seed(request_seed: int, index: int) -> int:
    """Choice ``index``'s seed (``n`` / ``best_of``), from the request's: choice 0 keeps it."""
    return request_seed if index == 0 else round_seed(request_seed, index, CHOICE)


def cut_round(tokens: list[int], remaining: int, stop_ids: frozenset[int]) -> tuple[list[int], str | None]:
    """What a request keeps of a round's tokens, and why it ends (None: it goes on).

    At most ``remaining`` tokens; a stop token (EOS, a stop id) ends the request and is kept.

        >>> cut_round([5, 9, 2, 7], 10, frozenset({2}))
        ([5, 9, 2], 'stop')
        >>> cut_round([5, 9, 2, 7], 2, frozenset({2}))
        ([5, 9], 'length')
    """
    tokens = tokens[:remaining]
    for i, token in enumerate(tokens):
        if token in stop_ids:
            return tokens[: i + 1], "stop"
    return tokens, ("length" if len(tokens) >= remaining else None)


def draft_budget(k: int, remaining: int) -> int:
    """A round emits at most k + 1 tokens: never draft past ``max_tokens``."""
    return max(0, min(k, remaining - 1))


@dataclass(frozen=True)
class Row:
    """One sequence's part in one step."""

    key: str  # the loop's cache key (never a client's)
    context: list[int]  # [n] ids the target holds after the step, before drafts: prompt (or a chunk) + output
    blocks: tuple[int, ...]  # the sequence's block table (``specdec.batch.blocks``), grown for this step
    emits: bool = True  # False: a prompt chunk; no logits, no token this step
    mode: str = "off"  # "off" or a drafter's name (``specdec.drafters.DRAFTERS``)
    k: int = 0  # drafts to propose at most; 0 for plain rows and chunks
    stop_below: float = 0.0  # the confidence stop (``specdec.drafters.base.Chains``); 0: draft all k
    nodes: int = 0  # a tree mode's node budget (depth k); 0: a chain
    price: trees.Price | None = None  # what its tree's nodes cost: it keeps those that pay (None: the budget)
    params: SamplingParams = SamplingParams()
    target_seed: int = 0  # round_seed(..., TARGET): verification's randomness
    draft_seed: int = 0  # round_seed(..., DRAFT): the drafter's
    proposal: Proposal = EMPTY_PROPOSAL  # drafts made while planning (drafters that run in the loop)
    suppress: tuple[int, ...] = ()  # min_tokens: ids the target may not emit ...
    suppress_for: int = 0  # ... at this round's first positions
    prompt_len: int = 0  # where the output starts in ``context`` (penalties count the output)
    logprobs: int | None = None  # the request wants its tokens' log-probabilities (and this many top ones)
    grammar: GrammarSpec | None = None  # structured output: what the output must match (``specdec.grammar``)

    @property
    def capacity(self) -> int:
        """Tokens its blocks hold."""
        return len(self.blocks) * BLOCK

    @property
    def speculates(self) -> bool:
        return self.emits and self.k > 0


@dataclass(frozen=True)
class StepPlan:
    """Every row of one step, in order; rows of one mode draft together."""

    rows: list[Row]

    def drafting(self, mode: str) -> list[Row]:
        """The rows that draft with ``mode`` this step, in plan order."""
        return [r for r in self.rows if r.speculates and r.mode == mode]

    @property
    def modes(self) -> set[str]:
        return {r.mode for r in self.rows if r.speculates}
