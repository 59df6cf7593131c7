"""Tests only, no flag: faults armed at run time in an engine, in whichever process it runs.

When ``LORAPLEX_TEST_FAULTS`` names a folder at ``Engine`` construction, the engine looks in it for these
files, so that a test can inject the same fault into the in-process engine and into ``loraplex serve``'s
engine process (``tests/test_faults.py``):

- ``forward``: the next model forward pass raises ``RuntimeError("injected fault in the model forward")``
  (the file is removed first: one fault per file written);
- ``nan-slot``: each slot write of the adapter whose folder the file names (its text) leaves NaN in the
  LoRA B matrices of that slot, while the file exists;
- ``die``: the next step raises ``InjectedDeath``, which is not an ``Exception``: the step loop ends.

Without the variable (every real run) nothing is installed and the engine's methods are its own.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from loraplex.engine.engine import Engine

FAULTS_ENV = "LORAPLEX_TEST_FAULTS"


class InjectedDeath(BaseException):
    """The ``die`` fault: a step raised what the step loop does not catch."""


def _take(flag: Path) -> bool:
    """Whether ``flag`` was armed; disarms it (only the step thread reads the flags)."""
    try:
        flag.unlink()
    except FileNotFoundError:
        return False
    return True


def install_faults(engine: Engine) -> None:
    """Wrap ``engine``'s forward pass, slot writes and step with the faults of the folder named by
    ``LORAPLEX_TEST_FAULTS``; nothing when the variable is unset."""
    folder = os.environ.get(FAULTS_ENV)
    if not folder:
        return
    flags = Path(folder)
    execute, set_slot, step = engine.runner.execute, engine.model.set_slot, engine.step

    def faulty_execute(*args: object, **kwargs: object) -> object:
        if _take(flags / "forward"):
            raise RuntimeError("injected fault in the model forward")
        return execute(*args, **kwargs)

    def poisoning_set_slot(slot: int, weights: object) -> None:
        set_slot(slot, weights)  # type: ignore[arg-type]
        poisoned = flags / "nan-slot"
        if poisoned.is_file() and poisoned.read_text() == str(getattr(weights, "path", None)):
            for module in engine.model.modules():
                if hasattr(module, "lora_b"):
                    module.lora_b[slot].fill_(float("nan"))

    def dying_step() -> list:
        if _take(flags / "die"):
            raise InjectedDeath("injected: the step thread dies")
        return step()

    engine.runner.execute = faulty_execute  # type: ignore[method-assign]
    engine.model.set_slot = poisoning_set_slot  # type: ignore[method-assign]
    engine.step = dying_step  # type: ignore[method-assign]
