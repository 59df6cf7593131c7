"""``PoolingParams``: how a prefill-only request turns its prompt's final hidden states into one vector.

A request pools when its ``SamplingParams.pooling`` is set (``max_tokens`` must then be 0: it computes its
prompt and finishes, its KV blocks returned at once, the full ones kept in the prefix cache like any other).
"""

from __future__ import annotations

from dataclasses import dataclass

from loraplex.errors import RequestError

POOLING_TYPES = ("last", "mean", "cls")


@dataclass(frozen=True)
class PoolingParams:
    """What one pooled request returns, from ``h [P, hidden]``: the final hidden states of its ``P`` prompt
    tokens (after the model's final norm, before ``lm_head``; HF's ``AutoModel(...).last_hidden_state``).

    - ``pooling_type``: ``"last"`` ``v = h[P - 1]`` (causal LMs' default), ``"mean"`` ``v = sum_p h[p] / P``,
      ``"cls"`` ``v = h[0]``.
    - ``dimensions``: keep ``v[:dimensions]`` (Matryoshka truncation); None keeps all ``hidden``.
    - ``normalize``: then ``v / max(||v||_2, 1e-12)`` (``torch.nn.functional.normalize``'s).
    - ``classify``: instead return the request's adapter version's classification head applied to the last
      token's state, ``logits = h[P - 1] @ W^T + b`` (``[num_labels]``; ``ScoreHead``: HF's
      ``*ForSequenceClassification`` on an unpadded prompt); needs ``"last"``, no ``normalize``, no
      ``dimensions``, and a version that has a head.

    "last" lets the prefix cache serve every prompt token but the last; "mean" and "cls" compute them all.
    """

    pooling_type: str = "last"
    normalize: bool = True
    dimensions: int | None = None
    classify: bool = False

    @property
    def needs_every_row(self) -> bool:
        """Whether every prompt token's hidden state is read (so none may come from the prefix cache)."""
        return self.pooling_type != "last"

    def validate(self, hidden_size: int | None = None) -> None:
        """``RequestError`` naming the first invalid field; ``dimensions`` is checked against ``hidden_size``
        when it is given (the engine gives it)."""
        if self.pooling_type not in POOLING_TYPES:
            raise RequestError(f"pooling type must be one of {', '.join(POOLING_TYPES)}, got {self.pooling_type!r}",
                               "pooling")
        if not isinstance(self.normalize, bool):
            raise RequestError(f"normalize must be a boolean, got {self.normalize!r}", "normalize")
        if not isinstance(self.classify, bool):
            raise RequestError(f"classify must be a boolean, got {self.classify!r}", "classify")
        if self.classify and (self.pooling_type != "last" or self.normalize or self.dimensions is not None):
            raise RequestError("classification reads the classification head's logits of the last token: "
                               "pooling 'last', no normalize, no dimensions", "pooling")
        dims = self.dimensions
        if dims is None:
            return
        if isinstance(dims, bool) or not isinstance(dims, int) or dims < 1 or (
                hidden_size is not None and dims > hidden_size):
            limit = f"[1, {hidden_size}] (the model's hidden size)" if hidden_size is not None else ">= 1"
            raise RequestError(f"dimensions must be an integer in {limit}, got {dims!r}", "dimensions")


CLASSIFICATION = PoolingParams("last", normalize=False, classify=True)  # what every classifying request pools
