"""``adapter_config.json`` normalised once into a frozen ``AdapterConfig``, with PEFT's matching rules.

PEFT options that change the forward pass in ways loraplex does not serve raise ``UnsupportedAdapter``
naming the option; ``modules_to_save`` is served for ``embed_tokens``, ``lm_head`` and a ``SEQ_CLS``
adapter's head (``score`` / ``classifier``), ``trainable_token_indices`` for ``embed_tokens`` and ``lm_head``
(any other module would replace a whole base layer); ``target_parameters`` for the
parameters a family lists in ``ModelConfig.parameter_targets`` (MoE experts; ``reading.parameter_targets``).

The config is untrusted input: every field is type-checked here (``InvalidAdapter`` naming it), and its
regexes (``target_modules`` / ``exclude_modules`` strings, ``rank_pattern`` / ``alpha_pattern`` keys) are
compiled at load and matched with RE2 (``google-re2``), in time linear in the module name whatever
the pattern (Python's ``re`` takes exponential time on ``m([\\w.]+)+!``). RE2 has no lookaround or
backreferences: a pattern using them is refused, naming it.
"""

from __future__ import annotations

import functools
import math
import reprlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import re2

from loraplex.adapters.reading.weights import SCORE_HEADS, VOCAB_MODULES
from loraplex.errors import InvalidAdapter, UnsupportedAdapter

# PEFT options that change the forward pass beyond what loraplex serves: refused when set.
_UNSUPPORTED_FEATURES = ("layer_replication", "use_qalora",
                         "use_bdlora", "arrow_config", "velora_config", "kasa_config", "monteclora_config")
_RE2 = re2.Options()
_RE2.log_errors = False
_RE2.max_mem = 1 << 20  # bytes per compiled pattern (a module-name pattern needs a few KiB)
_SHOWN = reprlib.Repr()  # a bounded repr of a refused value
_SHOWN.maxstring = _SHOWN.maxother = 120


@dataclass(frozen=True)
class AdapterConfig:
    """``adapter_config.json`` normalised once; patterns keep PEFT's order (first match wins)."""

    r: int
    lora_alpha: float
    use_rslora: bool
    target_modules: tuple[str, ...] | str | None  # list of names, or one regex matched in full
    rank_pattern: tuple[tuple[str, int], ...]
    alpha_pattern: tuple[tuple[str, float], ...]
    layers_to_transform: tuple[int, ...] | None
    exclude_modules: tuple[str, ...] | str | None
    base_model_name_or_path: str | None
    use_dora: bool = False
    modules_to_save: tuple[str, ...] = ()  # "embed_tokens" / "lm_head" / "score" / "classifier"
    trainable_tokens: tuple[tuple[str, tuple[int, ...]], ...] = ()  # (vocab module, token ids)
    trainable_tokens_per_module: bool = False  # PEFT's dict form (else a list: the input embedding's)
    ensure_weight_tying: bool = False
    target_parameters: tuple[str, ...] = ()  # PEFT's parameter names (checked against the model by the reader)
    # aLoRA (PEFT's activated LoRA): the delta applies from the last occurrence of these token ids in a prompt on
    alora_invocation_tokens: tuple[int, ...] | None = None

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], folder: str) -> AdapterConfig:
        """Validate a parsed config; unsupported PEFT features raise ``UnsupportedAdapter``."""
        peft_type = raw.get("peft_type", "LORA")
        if str(peft_type).upper() != "LORA":
            raise UnsupportedAdapter(f"{folder}: peft_type {peft_type!r} is not supported (only LORA)")
        if raw.get("bias", "none") != "none":
            raise UnsupportedAdapter(f"{folder}: bias={raw['bias']!r} is not supported (only \"none\")")
        if raw.get("lora_bias"):
            raise UnsupportedAdapter(f"{folder}: lora_bias=true is not supported")
        for feature in _UNSUPPORTED_FEATURES:
            if raw.get(feature):
                raise UnsupportedAdapter(f"{folder}: {feature}={raw[feature]!r} is not supported")
        r = _positive_int(raw.get("r", 8), "r", folder)
        alpha = _finite(raw.get("lora_alpha", 8), "lora_alpha", folder)
        tokens = raw.get("trainable_token_indices")
        return cls(
            r=r,
            lora_alpha=alpha,
            use_rslora=bool(raw.get("use_rslora", False)),
            target_modules=_names_or_regex(raw.get("target_modules"), "target_modules", folder),
            rank_pattern=tuple((k, _positive_int(v, f"rank_pattern[{k!r}]", folder))
                               for k, v in _patterns(raw.get("rank_pattern"), "rank_pattern", folder)),
            alpha_pattern=tuple((k, _finite(v, f"alpha_pattern[{k!r}]", folder))
                                for k, v in _patterns(raw.get("alpha_pattern"), "alpha_pattern", folder)),
            layers_to_transform=_layers(raw.get("layers_to_transform"), folder),
            exclude_modules=_names_or_regex(raw.get("exclude_modules"), "exclude_modules", folder),
            base_model_name_or_path=raw.get("base_model_name_or_path"),
            use_dora=bool(raw.get("use_dora", False)),
            modules_to_save=_modules_to_save(raw.get("modules_to_save"), folder),
            trainable_tokens=_trainable_tokens(tokens, folder),
            trainable_tokens_per_module=isinstance(tokens, dict),
            ensure_weight_tying=bool(raw.get("ensure_weight_tying", False)),
            target_parameters=_parameter_names(raw.get("target_parameters"), folder),
            alora_invocation_tokens=_invocation_tokens(raw.get("alora_invocation_tokens"), folder),
        )

    def rank_for(self, module: str) -> int:
        return _pattern_value(self.rank_pattern, module, self.r)

    def scale_for(self, module: str) -> float:
        """PEFT's ``scaling``: alpha / r, or alpha / sqrt(r) with rsLoRA (per-module r and alpha)."""
        r = self.rank_for(module)
        alpha = _pattern_value(self.alpha_pattern, module, self.lora_alpha)
        return alpha / math.sqrt(r) if self.use_rslora else alpha / r

    def targets(self, module: str, layer_idx: int) -> bool:
        """Whether PEFT would have put a LoRA layer on ``module`` (full name inside the base model)."""
        if self.exclude_modules is not None and _matches(self.exclude_modules, module):
            return False
        if self.target_modules is None or self.target_modules == "all-linear":
            selected = True
        else:
            selected = _matches(self.target_modules, module)
        return selected and (self.layers_to_transform is None or layer_idx in self.layers_to_transform)

    def targets_parameter(self, key: str) -> bool:
        """PEFT's ``target_parameters`` rule for the parameter ``key`` (full name): an entry equal to it or a
        dotted suffix of it."""
        return any(key == name or key.endswith(f".{name}") for name in self.target_parameters)

    def targets_vocab(self, module: str) -> bool:
        """Whether PEFT would have put LoRA on ``embed_tokens`` / ``lm_head`` (never by "all-linear")."""
        if self.exclude_modules is not None and _matches(self.exclude_modules, module):
            return False
        return self.target_modules not in (None, "all-linear") and _matches(self.target_modules, module)


MAX_INVOCATION_TOKENS = 1024


def _invocation_tokens(value: Any, folder: str) -> tuple[int, ...] | None:
    """aLoRA's ``alora_invocation_tokens``: None (a plain LoRA), or a non-empty list of token ids."""
    if value is None:
        return None
    if (not isinstance(value, list) or not 0 < len(value) <= MAX_INVOCATION_TOKENS
            or any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in value)):
        raise InvalidAdapter(f"{folder}: alora_invocation_tokens={_SHOWN.repr(value)} must be a list of 1 to "
                             f"{MAX_INVOCATION_TOKENS} token ids")
    return tuple(value)


def _modules_to_save(value: Any, folder: str) -> tuple[str, ...]:
    names = _names_or_regex(value, "modules_to_save", folder) or ()
    if isinstance(names, str):
        names = (names,)
    for name in names:
        if name.rsplit(".", 1)[-1] not in VOCAB_MODULES and name not in SCORE_HEADS:
            raise UnsupportedAdapter(
                f"{folder}: modules_to_save={list(names)!r}: {name!r} is not supported (it replaces a whole "
                f"base module; loraplex serves saved {' and '.join(VOCAB_MODULES)} and a classification head "
                f"({' or '.join(SCORE_HEADS)}) only)")
    return tuple(dict.fromkeys(n.rsplit(".", 1)[-1] for n in names))


def _trainable_tokens(value: Any, folder: str) -> tuple[tuple[str, tuple[int, ...]], ...]:
    if value is None:
        return ()
    per_module = value if isinstance(value, dict) else {"embed_tokens": value}
    out = []
    for module, ids in per_module.items():
        name = str(module).rsplit(".", 1)[-1]
        if name not in VOCAB_MODULES:
            raise UnsupportedAdapter(f"{folder}: trainable_token_indices for {module!r} are not supported "
                                     f"(only {' and '.join(VOCAB_MODULES)})")
        if (not isinstance(ids, (list, tuple)) or not ids
                or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in ids)):
            raise InvalidAdapter(f"{folder}: trainable_token_indices[{module!r}] must be a non-empty list of "
                                 f"token ids >= 0, got {ids!r}")
        if len(set(ids)) != len(ids):
            raise InvalidAdapter(f"{folder}: trainable_token_indices[{module!r}] repeats a token id")
        out.append((name, tuple(ids)))
    return tuple(out)


def _parameter_names(value: Any, folder: str) -> tuple[str, ...]:
    if not value:
        return ()
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) and v for v in value):
        return tuple(value)
    raise InvalidAdapter(f"{folder}: target_parameters must be a list of parameter names, got {_SHOWN.repr(value)}")


def _positive_int(value: Any, field: str, folder: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidAdapter(f"{folder}: {field} must be a positive integer, got {value!r}")
    return value


def _finite(value: Any, field: str, folder: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InvalidAdapter(f"{folder}: {field} must be a finite number, got {_SHOWN.repr(value)}")
    return float(value)


def _layers(value: Any, folder: str) -> tuple[int, ...] | None:
    """``layers_to_transform``: a layer index or a list of them (PEFT's int-or-list); None/empty: every layer."""
    layers = [value] if isinstance(value, int) and not isinstance(value, bool) else value
    if layers is None or layers == []:
        return None
    if not isinstance(layers, list) or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0
                                               for i in layers):
        raise InvalidAdapter(f"{folder}: layers_to_transform must be a layer index or a list of layer indices "
                             f"(integers >= 0), got {_SHOWN.repr(value)}")
    return tuple(layers)


def _patterns(value: Any, field: str, folder: str) -> list[tuple[str, Any]]:
    """``rank_pattern`` / ``alpha_pattern``: an object whose keys are module-name regexes (checked here)."""
    if value is None:
        return []
    if not isinstance(value, dict):
        raise InvalidAdapter(f"{folder}: {field} must be an object of module pattern -> value, got "
                             f"{_SHOWN.repr(value)}")
    for key in value:
        _compiled(_key_pattern(key), f"{field} key {key!r}", folder)
    return list(value.items())


def _names_or_regex(value: Any, field: str, folder: str) -> tuple[str, ...] | str | None:
    if value is None:
        return value
    if isinstance(value, str):
        if value != "all-linear":
            _compiled(value, f"{field} regex", folder)
        return value
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        return tuple(value)
    raise InvalidAdapter(f"{folder}: {field} must be a list of names or a regex string, got {_SHOWN.repr(value)}")


@functools.lru_cache(maxsize=128)
def _compile(pattern: str) -> Any:
    return re2.compile(pattern, _RE2)


def _compiled(pattern: str, what: str, folder: str = "adapter") -> Any:
    """``pattern`` compiled by RE2; ``InvalidAdapter`` naming ``what`` if RE2 refuses it."""
    try:
        return _compile(pattern)
    except re2.error as e:
        reason = e.args[0].decode(errors="replace") if e.args and isinstance(e.args[0], bytes) else str(e)
        raise InvalidAdapter(f"{folder}: {what} is not a valid RE2 regex ({reason}); loraplex matches config "
                             "regexes with RE2 (linear time), which has no lookaround or backreferences") from e


def _key_pattern(key: str) -> str:
    """PEFT's ``get_pattern_key`` regex for a ``rank_pattern`` / ``alpha_pattern`` key."""
    return rf"(.*\.)?({key})$"


def _matches(names_or_regex: tuple[str, ...] | str, module: str) -> bool:
    """PEFT's target rule: a string is a regex matched in full; a name matches itself or a suffix."""
    if isinstance(names_or_regex, str):
        return _compiled(names_or_regex, "regex").fullmatch(module) is not None
    return any(module == name or module.endswith(f".{name}") for name in names_or_regex)


def _pattern_value(patterns: tuple[tuple[str, Any], ...], module: str, default: Any) -> Any:
    """PEFT's ``get_pattern_key``: the first key ``k`` with ``re.match(rf"(.*\\.)?({k})$", module)``."""
    for key, value in patterns:
        if _compiled(_key_pattern(key), "pattern").match(module):
            return value
    return default
