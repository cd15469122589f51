"""What a request's output must match (``specdec.grammar`` compiles and enforces it).

Apart from ``specdec.grammar`` so that the HTTP front (``deployments.protocol``) can build and
check one without loading torch or xgrammar.
"""

from __future__ import annotations

from dataclasses import dataclass

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class GrammarSpec:
    """What the output must match. ``kind``: one of ``KINDS``; ``source``: the JSON schema's text,
    the regular expression, the JSON list of choices or the EBNF grammar ("" for json_object)."""

    kind: str
    source: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"grammar kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
