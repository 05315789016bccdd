"""What a request's structured output must match, as the front ends validate it and the engine compiles it
(grammar.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

GrammarKind = Literal["json_object", "json_schema", "regex", "grammar"]


@dataclass(frozen=True)
class GrammarSpec:
    """What a request's output must match; `field` names it in errors (the API's field)."""

    kind: GrammarKind
    value: str = ""  # the JSON schema, regex or EBNF grammar; empty for json_object
    field: str = "response_format"
    prefix: str = ""  # literal text before the JSON (a JSON kind only; a tool call's opening tag)
    suffix: str = ""  # literal text after it
