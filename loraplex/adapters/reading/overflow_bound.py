"""The load-time bound that keeps an adapter's deltas finite in a float32 step (finite weights can still
overflow: one ``lora_A`` at 3e38 turns every row that uses it into inf, then NaN).

Semantics: the input bound. ``INPUT_NORM = 2**64`` bounds the L2 norm of any layer input a float32 step
can carry: a hidden state with ``||x||_2 > 2**64`` has a sum of squares past float32's largest value
(about ``2**128``), so the next RMSNorm's variance (computed in float32) is already inf. Normed inputs
(q/k/v, gate/up, lm_head) are far below it; the bound is assumed for the others (o_proj, down_proj).

Semantics: the deltas. A projection's delta is ``d = (x A^T) B^T`` with ``A [r, in]``, ``B [out, r]``
(scale folded into B). Every partial sum of ``t = x A^T`` is at most ``sum_k |x_k||A_ik| <=
||x||_2 ||A||_F`` and every partial sum of ``d`` at most ``||t||_2 ||B_j||_2 <= ||x||_2 ||A||_F ||B||_F``
(Cauchy-Schwarz), in any summation order. So ``||A||_F <= WEIGHT_BOUND`` and ``||A||_F ||B||_F <=
WEIGHT_BOUND`` with ``WEIGHT_BOUND = 2**63`` keep every value of the delta within ``2**127``, half of
float32's range: the base output it is added to has room, and a bfloat16 slot (same exponent range)
rounds it by far less than that margin. The same product bounds LoRA on lm_head (input: the final
normed hidden state) and on embed_tokens (input: one row of ``A^T``, ``||A[:, x]|| <= ||A||_F``).
Replaced or added vocabulary rows (saved matrices, trainable tokens) need ``||W_a||_F <= WEIGHT_BOUND``:
an embedding row then fits the residual stream's ``2**64``, and a logit ``h . w`` stays within ``2**127``.
DoRA's magnitude needs ``||m||_2 <= WEIGHT_BOUND``; once its scale ``g = m / ||W + dW||`` is folded
(``check_dora_scales``), a row's output ``g_j (x W_j + d_j)`` is within ``||x|| g_j (||W_j|| + ||dW_j||)
<= ||x|| (|m_j| + 2 g_j ||B_j|| ||A||_F)`` (as ``g_j ||W_j|| <= |m_j| + g_j ||dW_j||`` and ``||dW_j|| <=
||B_j|| ||A||_F``), which must stay within ``WEIGHT_BOUND`` (as an L2 norm over the rows, so that an
embedding's row fits too).

The same norms find NaN and inf: a norm that is not finite is looked at again, and a tensor holding a
NaN or an inf raises ``InvalidAdapter`` naming it (so a load needs no separate pass for finiteness).

Realistic adapters sit ~15 orders of magnitude below the bound (PEFT's initial ``||A||_F`` is about
``sqrt(r)``; trained ``||A||_F ||B||_F`` is in the tens to thousands). Norms are taken in float32 (one
``_foreach_norm`` per kind of tensor); only a value that may be past the bound (a norm that overflowed
to inf, or one near the bound) is taken again in float64, which decides and is the value reported. A
NaN never passes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from loraplex.adapters.reading.weights import AdapterWeights
from loraplex.errors import AdapterOverflow, InvalidAdapter

INPUT_NORM = 2.0**64
OUTPUT_BOUND = 2.0**127
WEIGHT_BOUND = OUTPUT_BOUND / INPUT_NORM  # 2**63 ~ 9.2e18

_WHY = (f"over the bound {WEIGHT_BOUND:.3g} (= 2^127 / 2^64: a float32 step's delta must stay within 2^127 for "
        "any layer input of L2 norm up to 2^64)")


def check_pairs(source: str, pairs: Mapping[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
    """``pairs[module] = (A, B)`` (B scale-folded): ``AdapterOverflow`` naming the first module past the bound
    (``InvalidAdapter`` if a tensor holds NaN or inf)."""
    if not pairs:
        return
    norms = _norms([t for pair in pairs.values() for t in pair])
    for (module, (a, b)), a_norm, b_norm in zip(pairs.items(), norms[0::2], norms[1::2], strict=True):
        if a_norm <= _SURE and a_norm * b_norm <= _SURE:
            continue
        a_norm, b_norm = _exact(f"{source}: {module}.lora_A", a), _exact(f"{source}: {module}.lora_B", b)
        if not a_norm <= WEIGHT_BOUND:
            raise AdapterOverflow(f"{source}: module {module!r}: ||lora_A||_F = {a_norm:.3g}, {_WHY}")
        if not a_norm * b_norm <= WEIGHT_BOUND:
            raise AdapterOverflow(f"{source}: module {module!r}: ||lora_A||_F * ||scale * lora_B||_F = "
                                  f"{a_norm:.3g} * {b_norm:.3g} = {a_norm * b_norm:.3g}, {_WHY}")


def check_norms(source: str, tensors: Mapping[str, torch.Tensor]) -> None:
    """Vocabulary rows and DoRA magnitudes by name: each tensor's L2 (Frobenius) norm within the bound."""
    for (name, tensor), norm in zip(tensors.items(), _norms(list(tensors.values())), strict=True):
        if not norm <= _SURE and not (norm := _exact(f"{source}: {name}", tensor)) <= WEIGHT_BOUND:
            raise AdapterOverflow(f"{source}: {name}: L2 norm {norm:.3g}, {_WHY}")


def check_dora_scales(weights: AdapterWeights) -> None:
    """After ``CausalLM.prepare`` folded DoRA's ``g``: for each DoRA module, with ``B``'s rows running over
    ``m``'s (an embedding's ``B [hidden, r]``), ``||(|m| + 2 g ||B_j|| ||A||_F)||_2`` within the bound."""
    folded = {f"layers.{layer}.{proj}": (weights.magnitudes[(layer, proj)], g, *weights.modules[(layer, proj)])
              for (layer, proj), g in weights.dora_scales.items()}
    folded |= {name: (v.magnitude, v.dora_scale, *v.lora) for name, v in weights.vocab.items()
               if v.dora_scale is not None}
    for module, (m, g, a, b) in folded.items():
        gain = m.double().abs() + 2 * g.double().abs() * torch.linalg.vector_norm(b, dim=1, dtype=torch.float64) \
            * _exact(f"{weights.path}: {module}", a)
        norm = float(torch.linalg.vector_norm(gain))
        if not norm <= WEIGHT_BOUND:
            raise AdapterOverflow(f"{weights.path}: module {module!r}: DoRA's folded gain "
                                  f"||(|m| + 2 g ||B_j|| ||A||_F)||_2 = {norm:.3g}, {_WHY}")


_SURE = WEIGHT_BOUND * (1 - 1e-3)  # float32 norms below this are within the bound whatever their rounding


def _exact(what: str, tensor: torch.Tensor) -> float:
    """The L2 norm in float64; ``InvalidAdapter`` naming ``what`` if the tensor holds NaN or inf."""
    norm = float(torch.linalg.vector_norm(tensor, dtype=torch.float64))
    if not math.isfinite(norm) and not bool(torch.isfinite(tensor).all()):
        raise InvalidAdapter(f"{what} contains NaN or inf values")
    return norm


def _norms(tensors: list[torch.Tensor]) -> list[float]:
    if not tensors:
        return []
    return torch.stack(torch._foreach_norm([t.float() for t in tensors])).tolist()
