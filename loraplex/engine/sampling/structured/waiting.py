"""Requests waiting for their grammar to compile, held outside the scheduler so the step loop never waits.

Requests submitted together (the choices of an ``n > 1`` request, the prompts of a prompt list) stay
together: a group goes to the scheduler whole, once every grammar in it is compiled, so they are still
admitted in one step (and share one prefill). A grammar that fails to compile (or passes its time
budget) fails its request alone; a request aborted while its grammar compiles abandons the compile
(``GrammarState.abandon``: it is cancelled when no other request waits for it).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from loraplex.errors import LoraplexError, RequestError

if TYPE_CHECKING:
    from loraplex.engine.request import Request


class GrammarWaitlist:
    def __init__(self) -> None:
        self._groups: list[list[Request]] = []

    def __len__(self) -> int:
        return len(self._groups)

    def hold(self, group: Sequence[Request]) -> list[Request]:
        """``group`` itself when it can be scheduled now, else [] (it is held until ``released``)."""
        if all(r.grammar is None or r.grammar.ready for r in group):
            return list(group)
        self._groups.append(list(group))
        return []

    def released(self) -> tuple[list[list[Request]], list[tuple[Request, LoraplexError]]]:
        """(groups whose grammars are all compiled, in arrival order; requests whose grammar failed)."""
        ready, failed, waiting = [], [], []
        for group in self._groups:
            if not all(r.grammar is None or r.grammar.ready for r in group):
                waiting.append(group)
                continue
            good = []
            for request in group:
                error = _compile_error(request)
                if error is None:
                    good.append(request)
                else:
                    failed.append((request, error if isinstance(error, RequestError) else RequestError(
                        f"structured_outputs: the grammar failed to compile: {error}", "structured_outputs")))
            if good:
                ready.append(good)
        self._groups = waiting
        return ready, failed

    def remove(self, request: Request) -> bool:
        """Drop ``request`` (aborted while its grammar compiles); False if it is not held here."""
        for group in self._groups:
            if request in group:
                group.remove(request)
                if request.grammar is not None:
                    request.grammar.abandon()  # its compile is cancelled when no other request waits for it
                if not group:
                    self._groups.remove(group)
                return True
        return False


def _compile_error(request: Request) -> BaseException | None:
    """Why ``request``'s grammar did not compile (None: it did, or there is none)."""
    if request.grammar is None:
        return None
    if request.grammar.compiled.cancelled():  # the pool stopped (the engine is going away)
        return RequestError("structured_outputs: the grammar compile was cancelled", "structured_outputs")
    return request.grammar.compiled.exception()
