"""Read and fully validate a PEFT LoRA adapter folder into CPU float32 tensors, scale folded into B.

A folder holds ``adapter_config.json`` and ``adapter_model.safetensors`` (or, only when explicitly
allowed, the pickled ``adapter_model.bin``). Keys look like
``base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight`` (``.lora_A.default.weight`` too).
For a module with PEFT rank r and alpha a the served delta is ``x @ A^T @ (s * B)^T`` where
``s = a / r`` (``a / sqrt(r)`` with rsLoRA); ``rank_pattern`` / ``alpha_pattern`` override r and a
per module with PEFT's matching rule (the key matches the module name or a dotted suffix of it).
Every error message starts with the folder and names the exact problem.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch
import xxhash

from loraplex.adapters.weight_file import read_weight_file
from loraplex.config import ModelConfig, Projection
from loraplex.errors import (
    AdapterNotFound,
    AdapterRankTooLarge,
    AdapterShapeMismatch,
    InvalidAdapter,
    UnsupportedAdapter,
)

CONFIG_FILE = "adapter_config.json"

_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.(?P<half>lora_A|lora_B)(?:\.[^.]+)?\.weight$")
_MODULE = re.compile(r"(?:^|\.)layers\.(?P<layer>\d+)\.(?P<parent>\w+)\.(?P<proj>\w+)$")

# PEFT options that change the forward pass beyond x @ A^T @ B^T * scale: refused when set.
_UNSUPPORTED_FEATURES = ("target_parameters", "layer_replication", "trainable_token_indices",
                         "alora_invocation_tokens", "use_qalora", "use_bdlora", "arrow_config",
                         "velora_config", "kasa_config", "monteclora_config")

ModuleKey = tuple[int, str]  # (layer_idx, projection name)


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

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], folder: str) -> AdapterConfig:
        """Validate a parsed config; unsupported PEFT features raise ``UnsupportedAdapter``."""
        peft_type = raw.get("peft_type", "LORA")
        if str(peft_type).upper() != "LORA":
            raise UnsupportedAdapter(f"{folder}: peft_type {peft_type!r} is not supported (only LORA)")
        if raw.get("use_dora"):
            raise UnsupportedAdapter(f"{folder}: use_dora=true (DoRA adapters are not supported)")
        if raw.get("bias", "none") != "none":
            raise UnsupportedAdapter(f"{folder}: bias={raw['bias']!r} is not supported (only \"none\")")
        if raw.get("lora_bias"):
            raise UnsupportedAdapter(f"{folder}: lora_bias=true is not supported")
        if raw.get("modules_to_save"):
            raise UnsupportedAdapter(
                f"{folder}: modules_to_save={raw['modules_to_save']!r} is not supported "
                "(the adapter replaces whole base modules)")
        for feature in _UNSUPPORTED_FEATURES:
            if raw.get(feature):
                raise UnsupportedAdapter(f"{folder}: {feature}={raw[feature]!r} is not supported")
        r = _positive_int(raw.get("r", 8), "r", folder)
        alpha = raw.get("lora_alpha", 8)
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
            raise InvalidAdapter(f"{folder}: lora_alpha must be a finite number, got {alpha!r}")
        layers = raw.get("layers_to_transform")
        if isinstance(layers, int):
            layers = [layers]
        return cls(
            r=r,
            lora_alpha=float(alpha),
            use_rslora=bool(raw.get("use_rslora", False)),
            target_modules=_names_or_regex(raw.get("target_modules"), "target_modules", folder),
            rank_pattern=tuple((k, _positive_int(v, f"rank_pattern[{k!r}]", folder))
                               for k, v in (raw.get("rank_pattern") or {}).items()),
            alpha_pattern=tuple((k, float(v)) for k, v in (raw.get("alpha_pattern") or {}).items()),
            layers_to_transform=tuple(int(i) for i in layers) if layers else None,
            exclude_modules=_names_or_regex(raw.get("exclude_modules"), "exclude_modules", folder),
            base_model_name_or_path=raw.get("base_model_name_or_path"),
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


@dataclass(frozen=True, eq=False)
class AdapterWeights:
    """One adapter version, validated, on CPU: ``modules[(layer, proj)] = (A [r, in], B [out, r])``."""

    path: str
    config: AdapterConfig
    modules: Mapping[ModuleKey, tuple[torch.Tensor, torch.Tensor]]  # float32, B scale-folded
    content_hash: str  # xxh3-128 of the normalised config and the served tensors (change detection)
    max_rank: int
    nbytes: int


def read_peft_adapter(
    path: str | Path, model_config: ModelConfig, max_lora_rank: int, allow_pickle: bool = False
) -> AdapterWeights:
    """Read ``path`` and validate it against the base model; raise a typed ``AdapterError`` if bad."""
    folder = Path(path)
    if not folder.is_dir():
        raise AdapterNotFound(f"{folder}: no adapter folder at this path")
    config_path = folder / CONFIG_FILE
    if not config_path.is_file():
        raise AdapterNotFound(f"{folder}: no {CONFIG_FILE} in the adapter folder")
    try:
        raw = json.loads(config_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InvalidAdapter(f"{folder}: {CONFIG_FILE} is not valid JSON ({e})") from e
    if not isinstance(raw, dict):
        raise InvalidAdapter(f"{folder}: {CONFIG_FILE} must hold a JSON object")
    config = AdapterConfig.from_dict(raw, str(folder))
    weight_file = read_weight_file(folder, allow_pickle)
    modules = _build_modules(folder, config, weight_file.tensors, weight_file.flat, model_config, max_lora_rank)
    # A content hash, not a security boundary: xxh3-128 reads ~16 GB/s (sha256 ~1.5), and the hash is on a
    # cold load's critical path. It covers the normalised config and the served (scale-folded) tensors.
    digest = xxhash.xxh3_128(json.dumps(raw, sort_keys=True).encode())
    for key in sorted(modules):
        a, b = modules[key]
        digest.update(repr(key).encode())
        digest.update(a.numpy())
        digest.update(b.numpy())
    return AdapterWeights(
        path=str(folder),
        config=config,
        modules=MappingProxyType(modules),
        content_hash=digest.hexdigest(),
        max_rank=max(a.shape[0] for a, _ in modules.values()),
        nbytes=sum(a.nbytes + b.nbytes for a, b in modules.values()),
    )


def _build_modules(
    folder: Path,
    config: AdapterConfig,
    tensors: Mapping[str, torch.Tensor],
    flat: torch.Tensor | None,
    model_config: ModelConfig,
    max_lora_rank: int,
) -> dict[ModuleKey, tuple[torch.Tensor, torch.Tensor]]:
    """Per module, ``(A [r, in], B [out, r])`` in float32, B scale-folded. ``flat``, when given, holds every
    tensor's elements: one reduction then checks all values (a finite sum means no NaN/inf anywhere; else
    each tensor is checked, for the error message), and B is folded in place (``tensors`` are views of it)."""
    all_finite = flat is not None and bool(torch.isfinite(flat.sum()))
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.match(key)
        if match is None:
            if "lora_magnitude_vector" in key:
                raise UnsupportedAdapter(f"{folder}: tensor {key!r} is a DoRA magnitude (not supported)")
            if "lora_embedding" in key:
                raise InvalidAdapter(f"{folder}: tensor {key!r} adapts an embedding, which loraplex "
                                     "does not adapt")
            raise InvalidAdapter(f"{folder}: unexpected tensor {key!r} (not a LoRA A or B weight)")
        halves.setdefault(match["module"], {})[match["half"]] = tensor
    projections = model_config.projections()
    modules: dict[ModuleKey, tuple[torch.Tensor, torch.Tensor]] = {}
    in_place: dict[float, list[torch.Tensor]] = {}  # scale -> the float32 Bs (views of ``flat``) to fold
    for module, pair in sorted(halves.items()):
        layer_idx, proj = _locate(folder, module, model_config, projections)
        for half, other in (("lora_A", "lora_B"), ("lora_B", "lora_A")):
            if half not in pair:
                raise InvalidAdapter(f"{folder}: module {module!r} has {other} but no {half} tensor")
        if not config.targets(module, layer_idx):
            raise InvalidAdapter(f"{folder}: tensors for module {module!r}, which target_modules="
                                 f"{config.target_modules!r} / layers_to_transform do not select")
        r = config.rank_for(module)
        if r > max_lora_rank:
            raise AdapterRankTooLarge(
                f"{folder}: module {module!r} has rank {r}, over max_lora_rank={max_lora_rank}")
        in_features, out_features = projections[proj].in_features, projections[proj].out_features
        a, b = pair["lora_A"], pair["lora_B"]
        for half, tensor, want in (("lora_A", a, (r, in_features)), ("lora_B", b, (out_features, r))):
            if tuple(tensor.shape) != want:
                raise AdapterShapeMismatch(
                    f"{folder}: {module}.{half} has shape {list(tensor.shape)}, expected {list(want)} "
                    f"(rank {r}; base {proj} is {in_features} -> {out_features})")
            if not tensor.is_floating_point():
                raise InvalidAdapter(f"{folder}: {module}.{half} has non-float dtype {tensor.dtype}")
            if not all_finite and not bool(torch.isfinite(tensor).all()):
                raise InvalidAdapter(f"{folder}: {module}.{half} contains NaN or inf values")
        scale = config.scale_for(module)
        if flat is None:
            b = (b.to(torch.float32) * scale).contiguous()
        else:  # folded in place below, one op per distinct scale
            in_place.setdefault(scale, []).append(b)
        modules[(layer_idx, proj)] = (a.to(torch.float32).contiguous(), b)  # A [r, in], B [out, r]
    if not modules:
        raise InvalidAdapter(f"{folder}: the adapter applies to zero modules (no LoRA tensors); "
                             "refusing to serve it as the base model")
    for scale, bs in in_place.items():
        torch._foreach_mul_(bs, scale)
    return modules


def _locate(folder: Path, module: str, model_config: ModelConfig,
            projections: Mapping[str, Projection]) -> ModuleKey:
    """``...layers.N.self_attn.q_proj`` -> (N, "q_proj"); anything else is not adaptable.
    ``projections`` is ``model_config.projections()`` (built once per adapter, not per module)."""
    match = _MODULE.search(module)
    projection = projections.get(match["proj"]) if match is not None else None
    if projection is None or projection.parent != match["parent"]:
        adaptable = ", ".join(f"layers.N.{p.parent}.{name}" for name, p in projections.items())
        raise InvalidAdapter(
            f"{folder}: tensors for module {module!r}, which the base model "
            f"({model_config.architecture}) does not have or loraplex does not adapt (adaptable: {adaptable})")
    layer_idx = int(match["layer"])
    if layer_idx >= model_config.num_layers:
        raise InvalidAdapter(f"{folder}: tensors for module {module!r}: layer {layer_idx} is out of "
                             f"range (the base model has {model_config.num_layers} layers)")
    return layer_idx, match["proj"]


def _positive_int(value: Any, field: str, folder: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidAdapter(f"{folder}: {field} must be a positive integer, got {value!r}")
    return value


def _names_or_regex(value: Any, field: str, folder: str) -> tuple[str, ...] | str | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        return tuple(value)
    raise InvalidAdapter(f"{folder}: {field} must be a list of names or a regex string, got {value!r}")


def _matches(names_or_regex: tuple[str, ...] | str, module: str) -> bool:
    """PEFT's target rule: a string is a regex matched in full; a name matches itself or a suffix."""
    if isinstance(names_or_regex, str):
        return re.fullmatch(names_or_regex, module) is not None
    return any(module == name or module.endswith(f".{name}") for name in names_or_regex)


def _pattern_value(patterns: tuple[tuple[str, Any], ...], module: str, default: Any) -> Any:
    """PEFT's ``get_pattern_key``: the first key ``k`` with ``re.match(rf"(.*\\.)?({k})$", module)``."""
    for key, value in patterns:
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default
