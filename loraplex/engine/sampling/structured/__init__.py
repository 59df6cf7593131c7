"""Structured outputs: constraints (``params.py``), their compilation off the step loop (``compiler.py``),
per-row masks in a mixed batch (``masks.py``) and requests waiting for their grammar (``waiting.py``)."""

from loraplex.engine.sampling.structured.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
