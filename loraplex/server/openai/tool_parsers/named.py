"""A named ``tool_choice``: the output is constrained to that function's arguments, so the whole text is
one call's arguments (reported as far as they go when ``max_tokens`` cuts them)."""

from __future__ import annotations

import json
from dataclasses import dataclass

from loraplex.server.openai.tool_parsers.calls import PartialCall, Scan


@dataclass(frozen=True)
class NamedParser:
    name: str
    forced: bool = True

    def scan(self, text: str) -> Scan:
        try:
            json.loads(text)
            complete = True
        except ValueError:
            complete = False
        return Scan("", [PartialCall(self.name, text, complete)])
