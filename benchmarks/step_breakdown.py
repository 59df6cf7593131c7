"""Where a decode step's CPU time goes: exclusive CPU time (``time.process_time``) per category of code.

``StepBreakdown`` wraps the functions that do a step's work (the base matmuls, the LoRA delta, attention
with its KV write, norms, rotary, the MLP's activation, the attention block's and the decoder layer's own
glue, the runner's metadata) for the duration of a ``with`` block; each wrapper charges the time spent in
its function *minus* the time of the wrapped functions it calls, so the categories add up to the step
(what no wrapper covers is ``rest``: embedding, logits row selection, Python between calls). Measure with
one thread: with more, CPU time also counts the OpenMP workers' time. Where kernels fuse parts, the time
goes to one category: ``attention + KV write`` holds rotary in a fused decode step
(``fused_decode_attention``), ``norms`` the residual adds fused with them (``RMSNorm.add_and_norm``).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from types import TracebackType
from typing import Any

from loraplex.engine import runner
from loraplex.layers import lora_linear, mlp, norms, rotary, self_attention
from loraplex.models import base, llama

# (owner, attribute, category): module functions are patched where they are looked up
TARGETS: list[tuple[Any, str, str]] = [
    (lora_linear, "dense_linear", "base matmuls"),
    (base, "dense_linear", "base matmuls"),
    (lora_linear, "add_lora", "lora"),
    (lora_linear, "add_lora_sgmv", "lora"),
    (self_attention, "paged_attention", "attention + KV write"),
    (self_attention, "fused_decode_attention", "attention + KV write"),  # rotary included
    (norms.RMSNorm, "forward", "norms"),
    (norms.RMSNorm, "add_and_norm", "norms"),  # residual add included
    (self_attention, "apply_rotary", "rotary"),
    (rotary.RotaryEmbedding, "cos_sin", "rotary"),
    (mlp.GatedMLP, "forward", "mlp activation + glue"),
    (self_attention.SelfAttention, "forward", "attention block glue"),
    (llama.LlamaDecoderLayer, "forward", "layer glue (residual adds)"),
    (llama.LlamaDecoderLayer, "residual_forward", "layer glue (residual adds)"),
    (llama.LlamaForCausalLM, "run_layers", "layer glue (residual adds)"),
    (lora_linear.LoRALinear, "forward", "LoRALinear glue"),
    (runner, "prepare_step", "step metadata"),
]


class StepBreakdown:
    """``with StepBreakdown() as b: step()`` then ``b.times`` (seconds per category, this block only)."""

    def __init__(self) -> None:
        self.times: Counter[str] = Counter()
        self._children: list[float] = []  # per open wrapper: time of the wrappers it called
        self._saved: list[tuple[Any, str, Any]] = []

    def _wrap(self, fn: Callable[..., Any], category: str) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            self._children.append(0.0)
            start = time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                elapsed = time.process_time() - start
                children = self._children.pop()
                self.times[category] += elapsed - children
                if self._children:
                    self._children[-1] += elapsed

        return timed

    def __enter__(self) -> StepBreakdown:
        for owner, name, category in TARGETS:
            original = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
            self._saved.append((owner, name, original))
            setattr(owner, name, self._wrap(original, category))
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        for owner, name, original in reversed(self._saved):
            setattr(owner, name, original)
        self._saved.clear()


def step_breakdown(step: Callable[[], Any], repeats: int) -> dict[str, float]:
    """Mean CPU ms per category over ``repeats`` calls of ``step``, plus ``rest`` and ``total``."""
    with StepBreakdown() as b:
        start = time.process_time()
        for _ in range(repeats):
            step()
        total = time.process_time() - start
    result = {k: v / repeats * 1e3 for k, v in sorted(b.times.items(), key=lambda kv: -kv[1])}
    result["rest"] = total / repeats * 1e3 - sum(result.values())
    result["total"] = total / repeats * 1e3
    return result
