"""How a checkpoint pools its embeddings (``ModelPooling``), read once from its folder.

- A ``sentence-transformers`` folder (``modules.json``) says it: its ``Pooling`` module's
  ``config.json`` (``pooling_mode_lasttoken`` / ``pooling_mode_mean_tokens`` / ``pooling_mode_cls_token``)
  and whether a ``Normalize`` module follows. Modules loraplex cannot run (``Dense`` projections, max or
  weighted-mean pooling) make it ``unsupported``, with the reason: embedding requests are then refused
  (a 400 naming it) unless the operator chooses a pooling (``loraplex serve --pooling``).
- Any other folder is a causal LM: last-token pooling, normalized (vLLM's default for decoder models).
- ``config.json``'s ``matryoshka_dimensions`` (a list) or ``is_matryoshka: true`` (vLLM's fields) allow
  ``dimensions`` (truncation); without them a request's ``dimensions`` is refused.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, replace
from pathlib import Path

logger = logging.getLogger(__name__)

_MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls"}
_KNOWN_MODULES = ("sentence_transformers.models.Transformer", "sentence_transformers.models.Pooling",
                  "sentence_transformers.models.Normalize")
_MAX_CONFIG_BYTES = 1 << 20


@dataclass(frozen=True)
class ModelPooling:
    """A model's embedding defaults: ``pooling_type`` (``last`` | ``mean`` | ``cls``; None with
    ``unsupported`` saying why), ``normalize``, and the truncations it allows (``matryoshka``: any
    ``dimensions`` up to the hidden size when ``matryoshka_dimensions`` is empty, else only those)."""

    pooling_type: str | None = "last"
    normalize: bool = True
    matryoshka: bool = False
    matryoshka_dimensions: tuple[int, ...] = ()
    unsupported: str = ""
    source: str = "causal LM default"
    hidden_size: int | None = None  # config.json's: the most ``dimensions`` may keep

    def overridden(self, pooling_type: str | None) -> ModelPooling:
        """These defaults with ``pooling_type`` chosen by the operator (None: as read)."""
        if pooling_type is None:
            return self
        return replace(self, pooling_type=pooling_type, unsupported="", source=f"{self.source}, --pooling")


def _json(path: Path) -> object:
    if path.stat().st_size > _MAX_CONFIG_BYTES:
        raise ValueError(f"{path} is larger than {_MAX_CONFIG_BYTES} bytes")
    return json.loads(path.read_text())


def _sentence_transformers(folder: Path, modules: object) -> ModelPooling:
    if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
        return ModelPooling(None, unsupported="modules.json is not a list of modules", source="modules.json")
    types = [str(m.get("type", "")) for m in modules]
    other = [t for t in types if t not in _KNOWN_MODULES]
    if other:
        return ModelPooling(None, unsupported=f"sentence-transformers module {other[0]} is not supported",
                            source="modules.json")
    pooling = next((m for m in modules if m.get("type") == _KNOWN_MODULES[1]), None)
    normalize = _KNOWN_MODULES[2] in types
    if pooling is None:
        return ModelPooling(None, normalize, unsupported="modules.json has no Pooling module", source="modules.json")
    config = _json(folder / str(pooling.get("path", "")) / "config.json")
    chosen = [mode for key, mode in _MODES.items() if isinstance(config, dict) and config.get(key) is True]
    others = [k for k, v in (config.items() if isinstance(config, dict) else ())
              if k.startswith("pooling_mode_") and k not in _MODES and v is True]
    if others or len(chosen) != 1:
        why = (f"pooling mode {others[0]} is not supported" if others
               else "its Pooling config must enable exactly one of " + ", ".join(_MODES))
        return ModelPooling(None, normalize, unsupported=why, source="1_Pooling/config.json")
    return ModelPooling(chosen[0], normalize, source="sentence-transformers config")


def model_pooling(folder: str | Path) -> ModelPooling:
    """The embedding defaults of the checkpoint in ``folder`` (see the module docstring)."""
    folder = Path(folder)
    pooling = ModelPooling()
    try:
        if (folder / "modules.json").is_file():
            pooling = _sentence_transformers(folder, _json(folder / "modules.json"))
        config = _json(folder / "config.json") if (folder / "config.json").is_file() else {}
    except (OSError, ValueError) as exc:
        return ModelPooling(None, unsupported=f"its pooling config could not be read: {exc}", source=str(folder))
    if not isinstance(config, dict):
        config = {}
    hidden = config.get("hidden_size")
    if isinstance(hidden, int) and not isinstance(hidden, bool):
        pooling = replace(pooling, hidden_size=hidden)
    dims = config.get("matryoshka_dimensions")
    if isinstance(dims, list) and dims and all(isinstance(d, int) and not isinstance(d, bool) for d in dims):
        pooling = replace(pooling, matryoshka=True, matryoshka_dimensions=tuple(dims))
    elif config.get("is_matryoshka") is True:
        pooling = replace(pooling, matryoshka=True)
    if pooling.unsupported:
        logger.warning("embeddings of %s need --pooling: %s", folder, pooling.unsupported)
    return pooling
