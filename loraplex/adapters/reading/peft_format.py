"""Read and fully validate a PEFT LoRA adapter folder into CPU float32 tensors, scale folded into B.

A folder holds ``adapter_config.json`` and ``adapter_model.safetensors`` (or, only when explicitly
allowed, the pickled ``adapter_model.bin``). Keys look like
``base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight`` (``.lora_A.default.weight`` too).
For a module with PEFT rank r and alpha a the served delta is ``x @ A^T @ (s * B)^T`` where
``s = a / r`` (``a / sqrt(r)`` with rsLoRA); ``rank_pattern`` / ``alpha_pattern`` override r and a
per module with PEFT's matching rule (the key matches the module name or a dotted suffix of it).
DoRA (``use_dora``) adds ``lora_magnitude_vector`` per module. ``embed_tokens`` / ``lm_head`` tensors
(LoRA, saved matrices, trainable token rows) are resolved by ``vocab_modules``; a ``SEQ_CLS`` adapter's saved
``score`` / ``classifier`` head by ``score_head``.
Every error message starts with the folder (or the caller's ``source``) and names the exact problem.

An adapter folder is untrusted input, read with bounded work: every file through ``safe_files``
(regular, inside ``roots`` when given: ``ForbiddenAdapterPath``), the config as bounded JSON, the
weight file's header checked against its size, then every declared tensor shape checked against
what the config can need (``_check_layout``) before any tensor byte is read; finally no value may be
NaN/inf and the served deltas must stay within ``overflow_bound`` (``AdapterOverflow``). No path found
inside a file (``base_model_name_or_path``...) is ever opened. ``read_peft_adapter_from_tensors`` runs
the same validation on tensors already in memory (e.g. from ``parse_safetensors_bytes``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from types import MappingProxyType

import torch
import xxhash

from loraplex.adapters.reading.adapter_config import AdapterConfig
from loraplex.adapters.reading.bounded_json import parse_json
from loraplex.adapters.reading.overflow_bound import check_norms, check_pairs
from loraplex.adapters.reading.parameter_targets import (
    check_target_parameters,
    expert_shapes,
    locate_parameter_module,
    stack_experts,
)
from loraplex.adapters.reading.safe_files import adapter_folder, present, read_file, resolve_roots
from loraplex.adapters.reading.score_head import check_head_layout, head_labels, read_score_head
from loraplex.adapters.reading.vocab_modules import (
    Shaped,
    check_layout,
    check_tensor,
    check_vocab_layout,
    read_vocab_modules,
)
from loraplex.adapters.reading.weight_file import WeightFile, open_weight_file
from loraplex.adapters.reading.weights import (
    SCORE_HEADS,
    VOCAB_MODULES,
    AdapterWeights,
    ModuleKey,
    Pair,
    ScoreHead,
    VocabModule,
)
from loraplex.config import ModelConfig, Projection
from loraplex.errors import AdapterNotFound, AdapterRankTooLarge, InvalidAdapter, UnsupportedAdapter

CONFIG_FILE = "adapter_config.json"
MAX_CONFIG_BYTES = 1 << 20  # a PEFT config is ~1 KB; a rank_pattern over every module of a large MoE fits

_PREFIX = "base_model.model."
# tensor name (prefix removed) -> (module, kind); the first pattern that matches wins
_KINDS = (
    (re.compile(r"^(?P<module>.+)\.(?P<kind>lora_A|lora_B)(?:\.[^.]+)?\.weight$"), None),
    (re.compile(r"^(?P<module>.+)\.lora_embedding_(?P<kind>A|B)(?:\.[^.]+)?$"), "lora_"),
    (re.compile(r"^(?P<module>.+)\.lora_magnitude_vector(?:\.(?!weight$)[^.]+)?(?:\.weight)?$"), "magnitude"),
    (re.compile(r"^(?P<module>.+?)(?:\.token_adapter)?\.(?:base_layer|original_module)\.weight$"), "base_layer"),
    (re.compile(r"^(?P<module>.+)\.token_adapter\.trainable_tokens_delta(?:\.[^.]+)?$"), "trainable"),
    (re.compile(r"^(?P<module>.+?)(?:\.modules_to_save(?:\.[^.]+)?)?\.weight$"), "saved"),
    (re.compile(r"^(?P<module>.+?)(?:\.modules_to_save(?:\.[^.]+)?)?\.bias$"), "bias"),
)
# module name -> (key, expected shape per kind, the text explaining them, the name rank/alpha patterns match,
# experts stacked in the parameter or 0): ``_check_layout``'s verdict
Layout = dict[str, tuple[ModuleKey, dict[str, tuple[int, ...]], str, str, int]]
_MODULE = re.compile(r"(?:^|\.)layers\.(?P<layer>\d+)\.(?P<parent>\w+)\.(?P<proj>\w+)$")


def read_peft_adapter(path: str | Path, model_config: ModelConfig, max_lora_rank: int, allow_pickle: bool = False,
                      roots: Iterable[str | Path] | None = None) -> AdapterWeights:
    """Read ``path`` and validate it against the base model; raise a typed ``AdapterError`` if bad. With
    ``roots``, every file must resolve inside one of them."""
    resolved_roots = resolve_roots(roots)
    folder = adapter_folder(path, resolved_roots)
    if not present(folder, CONFIG_FILE):
        raise AdapterNotFound(f"{folder}: no {CONFIG_FILE} in the adapter folder")
    raw = _config_object(read_file(folder, CONFIG_FILE, resolved_roots, MAX_CONFIG_BYTES), f"{folder}: {CONFIG_FILE}")
    config = AdapterConfig.from_dict(raw, str(folder))
    with open_weight_file(folder, allow_pickle, resolved_roots) as opened:
        specs = opened.specs  # every declared shape, checked before a byte of data is read (a pickle: after)
        layout = _check_layout(str(folder), config, specs, model_config, max_lora_rank) if specs is not None else None
        weight_file = opened.read()
    if layout is None:
        layout = _check_layout(str(folder), config, weight_file.tensors, model_config, max_lora_rank)
    return _read(str(folder), raw, config, weight_file, layout, model_config, max_lora_rank,
                 head_labels(folder, resolved_roots))


def read_peft_adapter_from_tensors(tensors: Mapping[str, torch.Tensor], config: Mapping | str | bytes,
                                   model_config: ModelConfig, max_lora_rank: int,
                                   source: str = "adapter") -> AdapterWeights:
    """``read_peft_adapter`` for tensors already in memory (PEFT names) and their ``adapter_config`` (an object,
    or its JSON text, bounded like the file); ``source`` starts every error message. ``tensors`` are not
    changed (B is scaled into a copy); A may share their storage."""
    raw = _config_object(config if isinstance(config, Mapping) else
                         config.encode() if isinstance(config, str) else config, f"{source}: adapter_config")
    parsed = AdapterConfig.from_dict(raw, source)
    layout = _check_layout(source, parsed, tensors, model_config, max_lora_rank)
    return _read(source, raw, parsed, WeightFile(dict(tensors), None), layout, model_config, max_lora_rank)


def in_memory_source(name: str) -> str:
    """What an adapter loaded from tensors is called where a folder's path would be (errors, listings)."""
    return f"<tensors of {name}>"


def _config_object(data: Mapping | bytes, what: str) -> dict:
    raw = data if isinstance(data, Mapping) else parse_json(data, what, MAX_CONFIG_BYTES)
    if not isinstance(raw, Mapping):
        raise InvalidAdapter(f"{what} must hold a JSON object")
    return dict(raw)


def _read(source: str, raw: dict, config: AdapterConfig, weight_file: WeightFile, layout: Layout,
          model_config: ModelConfig, max_lora_rank: int, labels: tuple[str, ...] | None = None) -> AdapterWeights:
    """Validate and fold ``weight_file``'s tensors, whose ``layout`` passed ``_check_layout`` (the vocabulary
    modules' and the head's are checked again as they are read); ``labels``: the folder's class names."""
    projection_parts, vocab_parts, head_parts = _classify(source, weight_file.tensors)
    modules, magnitudes, names = _build_modules(source, config, projection_parts, layout,
                                                in_place=weight_file.flat is not None)
    vocab = read_vocab_modules(source, config, vocab_parts, model_config, max_lora_rank)
    score_head = read_score_head(source, head_parts, model_config, labels)
    if not modules and not vocab and score_head is None:
        raise InvalidAdapter(f"{source}: the adapter applies to zero modules (no LoRA tensors); "
                             "refusing to serve it as the base model")
    _check_bounds(source, modules, magnitudes, names, vocab)
    if score_head is not None:
        check_norms(source, {"classification head weight": score_head.weight})
    if config.alora_invocation_tokens is not None and (vocab or magnitudes or score_head is not None or any(
            a.dim() != 2 for a, _ in modules.values())):
        raise UnsupportedAdapter(f"{source}: an aLoRA adapter (alora_invocation_tokens) is served on block projections "
                                 "only: not with embed_tokens / lm_head changes, DoRA or MoE experts")
    ranks = [a.shape[-2] for a, _ in modules.values()] + [v.lora[0].shape[0] for v in vocab.values() if v.lora]
    return AdapterWeights(
        path=source,
        config=config,
        modules=MappingProxyType(modules),
        content_hash=_content_hash(raw, modules, magnitudes, vocab, score_head),
        max_rank=max(ranks, default=0),
        magnitudes=MappingProxyType(magnitudes),
        vocab=MappingProxyType(vocab),
        score_head=score_head,
    )


def _check_layout(source: str, config: AdapterConfig, tensors: Mapping[str, Shaped], model_config: ModelConfig,
                  max_lora_rank: int) -> Layout:
    """Every tensor's name, shape and dtype against what ``config`` and the base can need; reads no value
    (``tensors`` may be a header's declarations). Returns the projections' layout."""
    check_target_parameters(source, config, model_config)
    projection_parts, vocab_parts, head_parts = _classify(source, tensors)
    projections = model_config.projections()
    layout = {module: _module_layout(source, config, module, pair, model_config, projections, max_lora_rank)
              for module, pair in sorted(projection_parts.items())}
    check_vocab_layout(source, config, vocab_parts, model_config, max_lora_rank)
    check_head_layout(source, head_parts, model_config)
    return layout


def _check_bounds(source: str, modules: Mapping[ModuleKey, Pair], magnitudes: Mapping[ModuleKey, torch.Tensor],
                  names: Mapping[ModuleKey, str], vocab: Mapping[str, VocabModule]) -> None:
    """``overflow_bound``: every served (A, scale * B), DoRA magnitude and replaced vocabulary matrix (their norms
    also find the projections' NaN and inf: ``_build_modules`` does not look for them)."""
    check_pairs(source, {**{names[key]: pair for key, pair in modules.items()},
                         **{name: v.lora for name, v in vocab.items() if v.lora is not None}})
    check_norms(source, {**{f"{names[key]}.lora_magnitude_vector": m for key, m in magnitudes.items()},
                         **{f"{name}.lora_magnitude_vector": v.magnitude for name, v in vocab.items()
                            if v.magnitude is not None},
                         **{f"{name} rows": v.rows for name, v in vocab.items() if v.rows is not None}})


def _classify(folder: str, tensors: Mapping[str, Shaped]) -> tuple[dict, dict, dict]:
    """Split tensors (or their declarations) into projection parts ``{module: {kind: tensor}}``,
    vocabulary-module parts ``{embed_tokens|lm_head: {kind: (name, tensor)}}`` and the classification head's
    ``{score|classifier: {saved|bias: (name, tensor)}}``."""
    projections: dict[str, dict[str, Shaped]] = {}
    vocab: dict[str, dict[str, tuple[str, Shaped]]] = {}
    heads: dict[str, dict[str, tuple[str, Shaped]]] = {}
    for key, tensor in tensors.items():
        name = key.removeprefix(_PREFIX)
        module, kind = _kind(folder, key, name)
        leaf = module.rsplit(".", 1)[-1]
        if module in SCORE_HEADS and kind in ("saved", "bias"):
            heads.setdefault(module, {})[kind] = (name, tensor)
        elif leaf in VOCAB_MODULES and kind != "bias":
            kinds = vocab.setdefault(leaf, {})
            if kind in kinds and not _same(kinds[kind][1], tensor):  # PEFT may save a matrix twice
                raise InvalidAdapter(f"{folder}: tensors {kinds[kind][0]!r} and {name!r} should hold the same "
                                     f"{leaf} matrix but differ")
            kinds[kind] = (name, tensor)
        elif kind in ("lora_A", "lora_B", "magnitude"):
            projections.setdefault(module, {})[kind] = tensor
        else:
            raise InvalidAdapter(f"{folder}: tensor {key!r} would replace or retrain module {module!r}; loraplex "
                                 f"serves saved {' and '.join(VOCAB_MODULES)} and a classification head "
                                 f"({' or '.join(SCORE_HEADS)}) only")
    return projections, vocab, heads


def _same(a: Shaped, b: Shaped) -> bool:
    """Equal shapes, and equal values once both are read."""
    if tuple(a.shape) != tuple(b.shape):
        return False
    return not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or torch.equal(a, b)


def _kind(folder: str, key: str, name: str) -> tuple[str, str]:
    """(module, kind) of one tensor name: ``lora_A``/``lora_B`` (also an embedding's), ``magnitude``,
    ``base_layer``, ``trainable`` or ``saved``."""
    for pattern, kind in _KINDS:
        if (match := pattern.match(name)) is not None:
            return match["module"], kind if kind not in (None, "lora_") else f"lora_{match['kind'][-1]}"
    raise InvalidAdapter(f"{folder}: unexpected tensor {key!r} (not a LoRA, DoRA or saved-module tensor)")


def _module_layout(folder: str, config: AdapterConfig, module: str, pair: Mapping[str, Shaped],
                   model_config: ModelConfig, projections: Mapping[str, Projection],
                   max_lora_rank: int) -> tuple[ModuleKey, dict[str, tuple[int, ...]], str, str, int]:
    """Check one projection's tensors (names, presence, targeting, rank, shapes, dtypes; no values); returns
    its key, the expected shape per kind, the text explaining them, the name its rank and alpha patterns
    match, and the experts stacked in it (0: a plain projection)."""
    # a parameter PEFT wrapped (target_parameters: MoE experts, a router) is named by its full name
    located = locate_parameter_module(folder, module, config, model_config)
    layer_idx, proj, pattern_key = located or (*_locate(folder, module, model_config, projections), module)
    for half, other in (("lora_A", "lora_B"), ("lora_B", "lora_A")):
        if half not in pair:
            raise InvalidAdapter(f"{folder}: module {module!r} has {other} but no {half} tensor")
    if located is None and not config.targets(module, layer_idx):
        raise InvalidAdapter(f"{folder}: tensors for module {module!r}, which target_modules="
                             f"{config.target_modules!r} / layers_to_transform do not select")
    r = config.rank_for(pattern_key)
    if r > max_lora_rank:
        raise AdapterRankTooLarge(
            f"{folder}: module {module!r} has rank {r}, over max_lora_rank={max_lora_rank}")
    shape = projections[proj]
    if shape.experts:
        if "magnitude" in pair:
            raise UnsupportedAdapter(f"{folder}: module {module!r}: DoRA on stacked experts is not served")
        shapes, why = expert_shapes(r, shape)
        check_layout(folder, f"{module}.lora_A", pair["lora_A"], shapes["lora_A"], why)
        check_layout(folder, f"{module}.lora_B", pair["lora_B"], shapes["lora_B"], why)
        return (layer_idx, proj), shapes, why, pattern_key, shape.experts
    why = f" (rank {r}; base {proj} is {shape.in_features} -> {shape.out_features})"
    shapes = {"lora_A": (r, shape.in_features), "lora_B": (shape.out_features, r), "magnitude": (shape.out_features,)}
    check_layout(folder, f"{module}.lora_A", pair["lora_A"], shapes["lora_A"], why)
    check_layout(folder, f"{module}.lora_B", pair["lora_B"], shapes["lora_B"], why)
    if "magnitude" in pair:
        if not config.use_dora:
            raise InvalidAdapter(f"{folder}: module {module!r} has a DoRA lora_magnitude_vector but "
                                 "use_dora is false")
        check_layout(folder, f"{module}.lora_magnitude_vector", pair["magnitude"], shapes["magnitude"])
    elif config.use_dora:
        raise InvalidAdapter(f"{folder}: use_dora=true but module {module!r} has no lora_magnitude_vector")
    return (layer_idx, proj), shapes, why, pattern_key, 0


def _build_modules(folder: str, config: AdapterConfig, parts: Mapping[str, Mapping[str, torch.Tensor]],
                   layout: Layout, in_place: bool,
                   ) -> tuple[dict[ModuleKey, Pair], dict[ModuleKey, torch.Tensor], dict[ModuleKey, str]]:
    """Per projection ``(A [r, in], B [out, r])`` float32, B scale-folded, DoRA magnitudes, and each key's
    module name, from tensors whose ``layout`` was checked; values are not looked at (NaN and inf are found
    by ``_check_bounds``' norms, one pass). ``in_place``: the tensors are owned float32 views
    (``weight_file``), so B is folded in place, one op per distinct scale."""
    to_fold: dict[float, list[torch.Tensor]] = {}
    modules: dict[ModuleKey, Pair] = {}
    magnitudes: dict[ModuleKey, torch.Tensor] = {}
    names: dict[ModuleKey, str] = {}
    for module, pair in sorted(parts.items()):
        key, shapes, why, pattern_key, experts = layout[module]
        a = check_tensor(folder, f"{module}.lora_A", pair["lora_A"], shapes["lora_A"], why, finite=True)
        b = check_tensor(folder, f"{module}.lora_B", pair["lora_B"], shapes["lora_B"], why, finite=True)
        if experts:
            a, b = stack_experts(a, b, experts)  # [E, r, in], [E, out, r] (b a copy: scaled below)
        if in_place and b is pair["lora_B"]:
            to_fold.setdefault(config.scale_for(pattern_key), []).append(b)
        else:
            b = (b * config.scale_for(pattern_key)).contiguous()
        modules[key], names[key] = (a, b), module  # [r, in], [out, r]; stacked experts [E, r, in], [E, out, r]
        if "magnitude" in pair:
            magnitudes[key] = check_tensor(folder, f"{module}.lora_magnitude_vector", pair["magnitude"],
                                           shapes["magnitude"], finite=True)
    for scale, bs in to_fold.items():
        torch._foreach_mul_(bs, scale)
    return modules, magnitudes, names


def _locate(folder: str, module: str, model_config: ModelConfig,
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
                  vocab: Mapping[str, VocabModule], score_head: ScoreHead | None) -> str:
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
    if score_head is not None:
        named += [("head:" + "\x00".join(score_head.class_labels), score_head.weight), ("bias", score_head.bias)]
    for label, tensor in named:
        digest.update(label.encode())
        if tensor is not None:
            digest.update(tensor.contiguous().numpy())
    return digest.hexdigest()
