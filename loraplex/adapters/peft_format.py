"""Read and fully validate a PEFT LoRA adapter folder into CPU float32 tensors, scale folded into B.

A folder holds ``adapter_config.json`` and ``adapter_model.safetensors`` (or, only when explicitly
allowed, the pickled ``adapter_model.bin``). Keys look like
``base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight`` (``.lora_A.default.weight`` too).
For a module with PEFT rank r and alpha a the served delta is ``x @ A^T @ (s * B)^T`` where
``s = a / r`` (``a / sqrt(r)`` with rsLoRA); ``rank_pattern`` / ``alpha_pattern`` override r and a
per module with PEFT's matching rule (the key matches the module name or a dotted suffix of it).
DoRA (``use_dora``) adds ``lora_magnitude_vector`` per module. ``embed_tokens`` / ``lm_head`` tensors
(LoRA, saved matrices, trainable token rows) are resolved by ``vocab_modules``.
Every error message starts with the folder and names the exact problem.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType

import torch
import xxhash

from loraplex.adapters.adapter_config import AdapterConfig
from loraplex.adapters.parameter_targets import check_target_parameters, expert_pair, locate_parameter_module
from loraplex.adapters.vocab_modules import check_tensor, read_vocab_modules
from loraplex.adapters.weight_file import read_weight_file
from loraplex.adapters.weights import VOCAB_MODULES, AdapterWeights, ModuleKey, Pair, VocabModule
from loraplex.config import ModelConfig, Projection
from loraplex.errors import AdapterNotFound, AdapterRankTooLarge, InvalidAdapter, UnsupportedAdapter

CONFIG_FILE = "adapter_config.json"

_PREFIX = "base_model.model."
# tensor name (prefix removed) -> (module, kind); the first pattern that matches wins
_KINDS = (
    (re.compile(r"^(?P<module>.+)\.(?P<kind>lora_A|lora_B)(?:\.[^.]+)?\.weight$"), None),
    (re.compile(r"^(?P<module>.+)\.lora_embedding_(?P<kind>A|B)(?:\.[^.]+)?$"), "lora_"),
    (re.compile(r"^(?P<module>.+)\.lora_magnitude_vector(?:\.(?!weight$)[^.]+)?(?:\.weight)?$"), "magnitude"),
    (re.compile(r"^(?P<module>.+?)(?:\.token_adapter)?\.(?:base_layer|original_module)\.weight$"), "base_layer"),
    (re.compile(r"^(?P<module>.+)\.token_adapter\.trainable_tokens_delta(?:\.[^.]+)?$"), "trainable"),
    (re.compile(r"^(?P<module>.+?)(?:\.modules_to_save(?:\.[^.]+)?)?\.weight$"), "saved"),
)
_MODULE = re.compile(r"(?:^|\.)layers\.(?P<layer>\d+)\.(?P<parent>\w+)\.(?P<proj>\w+)$")


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
    check_target_parameters(folder, config, model_config)
    weight_file = read_weight_file(folder, allow_pickle)
    # one reduction over the whole file: a finite sum means no NaN/inf anywhere (else each tensor is checked)
    finite = weight_file.flat is not None and bool(torch.isfinite(weight_file.flat.sum()))
    projection_parts, vocab_parts = _classify(folder, weight_file.tensors)
    modules, magnitudes = _build_modules(folder, config, projection_parts, model_config, max_lora_rank, finite,
                                         in_place=weight_file.flat is not None)
    vocab = read_vocab_modules(folder, config, vocab_parts, model_config, max_lora_rank)
    if not modules and not vocab:
        raise InvalidAdapter(f"{folder}: the adapter applies to zero modules (no LoRA tensors); "
                             "refusing to serve it as the base model")
    ranks = [a.shape[-2] for a, _ in modules.values()] + [v.lora[0].shape[0] for v in vocab.values() if v.lora]
    return AdapterWeights(
        path=str(folder),
        config=config,
        modules=MappingProxyType(modules),
        content_hash=_content_hash(raw, modules, magnitudes, vocab),
        max_rank=max(ranks, default=0),
        magnitudes=MappingProxyType(magnitudes),
        vocab=MappingProxyType(vocab),
    )


def _classify(folder: Path, tensors: Mapping[str, torch.Tensor]) -> tuple[dict, dict]:
    """Split tensors into projection parts ``{module: {kind: tensor}}`` and vocabulary-module parts
    ``{embed_tokens|lm_head: {kind: (name, tensor)}}``."""
    projections: dict[str, dict[str, torch.Tensor]] = {}
    vocab: dict[str, dict[str, tuple[str, torch.Tensor]]] = {}
    for key, tensor in tensors.items():
        name = key.removeprefix(_PREFIX)
        module, kind = _kind(folder, key, name)
        leaf = module.rsplit(".", 1)[-1]
        if leaf in VOCAB_MODULES:
            kinds = vocab.setdefault(leaf, {})
            if kind in kinds and not torch.equal(kinds[kind][1], tensor):  # PEFT may save a matrix twice
                raise InvalidAdapter(f"{folder}: tensors {kinds[kind][0]!r} and {name!r} should hold the same "
                                     f"{leaf} matrix but differ")
            kinds[kind] = (name, tensor)
        elif kind in ("lora_A", "lora_B", "magnitude"):
            projections.setdefault(module, {})[kind] = tensor
        else:
            raise InvalidAdapter(f"{folder}: tensor {key!r} would replace or retrain module {module!r}; loraplex "
                                 f"serves saved {' and '.join(VOCAB_MODULES)} only")
    return projections, vocab


def _kind(folder: Path, key: str, name: str) -> tuple[str, str]:
    """(module, kind) of one tensor name: ``lora_A``/``lora_B`` (also an embedding's), ``magnitude``,
    ``base_layer``, ``trainable`` or ``saved``."""
    for pattern, kind in _KINDS:
        if (match := pattern.match(name)) is not None:
            return match["module"], kind if kind not in (None, "lora_") else f"lora_{match['kind'][-1]}"
    raise InvalidAdapter(f"{folder}: unexpected tensor {key!r} (not a LoRA, DoRA or saved-module tensor)")


def _build_modules(folder: Path, config: AdapterConfig, parts: Mapping[str, Mapping[str, torch.Tensor]],
                   model_config: ModelConfig, max_lora_rank: int, finite: bool, in_place: bool,
                   ) -> tuple[dict[ModuleKey, Pair], dict[ModuleKey, torch.Tensor]]:
    """Per projection ``(A [r, in], B [out, r])`` float32, B scale-folded, and DoRA magnitudes. ``finite``:
    every value is known finite; ``in_place``: the tensors are owned float32 views (``weight_file``), so B
    is folded in place, one op per distinct scale."""
    projections = model_config.projections()
    to_fold: dict[float, list[torch.Tensor]] = {}
    modules: dict[ModuleKey, Pair] = {}
    magnitudes: dict[ModuleKey, torch.Tensor] = {}
    for module, pair in sorted(parts.items()):
        # a parameter PEFT wrapped (target_parameters: MoE experts, a router) is keyed by its full name
        located = locate_parameter_module(folder, module, config, model_config)
        layer_idx, proj, key = located or (*_locate(folder, module, model_config, projections), module)
        for half, other in (("lora_A", "lora_B"), ("lora_B", "lora_A")):
            if half not in pair:
                raise InvalidAdapter(f"{folder}: module {module!r} has {other} but no {half} tensor")
        if located is None and not config.targets(module, layer_idx):
            raise InvalidAdapter(f"{folder}: tensors for module {module!r}, which target_modules="
                                 f"{config.target_modules!r} / layers_to_transform do not select")
        r = config.rank_for(key)
        if r > max_lora_rank:
            raise AdapterRankTooLarge(
                f"{folder}: module {module!r} has rank {r}, over max_lora_rank={max_lora_rank}")
        shape = projections[proj]
        if shape.experts:
            if "magnitude" in pair:
                raise UnsupportedAdapter(f"{folder}: module {module!r}: DoRA on stacked experts is not served")
            a, b = expert_pair(folder, module, pair["lora_A"], pair["lora_B"], r, shape, finite)
        else:
            why = f" (rank {r}; base {proj} is {shape.in_features} -> {shape.out_features})"
            a = check_tensor(folder, f"{module}.lora_A", pair["lora_A"], (r, shape.in_features), why, finite)
            b = check_tensor(folder, f"{module}.lora_B", pair["lora_B"], (shape.out_features, r), why, finite)
        if in_place and b is pair["lora_B"]:
            to_fold.setdefault(config.scale_for(key), []).append(b)
        else:
            b = (b * config.scale_for(key)).contiguous()
        modules[(layer_idx, proj)] = (a, b)  # [r, in], [out, r]; stacked experts [E, r, in], [E, out, r]
        if "magnitude" in pair:
            if not config.use_dora:
                raise InvalidAdapter(f"{folder}: module {module!r} has a DoRA lora_magnitude_vector but "
                                     "use_dora is false")
            magnitudes[(layer_idx, proj)] = check_tensor(folder, f"{module}.lora_magnitude_vector",
                                                         pair["magnitude"], (shape.out_features,), finite=finite)
        elif config.use_dora:
            raise InvalidAdapter(f"{folder}: use_dora=true but module {module!r} has no lora_magnitude_vector")
    for scale, bs in to_fold.items():
        torch._foreach_mul_(bs, scale)
    return modules, magnitudes


def _locate(folder: Path, module: str, model_config: ModelConfig,
            projections: Mapping[str, Projection]) -> ModuleKey:
    """``...layers.N.self_attn.q_proj`` -> (N, "q_proj"); anything else is not adaptable.
    ``projections`` is ``model_config.projections()`` (built once per adapter, not per module)."""
    match = _MODULE.search(module)
    projection = projections.get(match["proj"]) if match is not None else None
    if projection is None or projection.parent != match["parent"]:
        adaptable = ", ".join([*(f"layers.N.{p.parent}.{name}" for name, p in projections.items()), *VOCAB_MODULES])
        raise InvalidAdapter(
            f"{folder}: tensors for module {module!r}, which the base model "
            f"({model_config.architecture}) does not have or loraplex does not adapt (adaptable: {adaptable})")
    layer_idx = int(match["layer"])
    if layer_idx >= model_config.num_layers:
        raise InvalidAdapter(f"{folder}: tensors for module {module!r}: layer {layer_idx} is out of "
                             f"range (the base model has {model_config.num_layers} layers)")
    return layer_idx, match["proj"]


def _content_hash(raw: Mapping, modules: Mapping[ModuleKey, Pair], magnitudes: Mapping[ModuleKey, torch.Tensor],
                  vocab: Mapping[str, VocabModule]) -> str:
    """xxh3-128 of the normalised config and every served tensor, in a fixed order: change detection, not a
    security boundary (it reads ~16 GB/s; sha256 ~1.5, and it is on a cold load's critical path)."""
    digest = xxhash.xxh3_128(json.dumps(raw, sort_keys=True).encode())
    named: list[tuple[str, torch.Tensor | None]] = []
    for key in sorted(modules):
        named += [(repr(key), modules[key][0]), ("", modules[key][1]), ("m", magnitudes.get(key))]
    for name in sorted(vocab):
        v = vocab[name]
        named += [(f"{name}:{v.vocab_size}", v.row_ids), ("", v.rows), ("m", v.magnitude),
                  *(("lora", t) for t in v.lora or ())]
    for label, tensor in named:
        digest.update(label.encode())
        if tensor is not None:
            digest.update(tensor.contiguous().numpy())
    return digest.hexdigest()
