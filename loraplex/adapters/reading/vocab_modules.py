"""An adapter's ``embed_tokens`` and ``lm_head``: PEFT's layouts resolved into one ``VocabModule`` each.

Tensors (names inside the base model, e.g. ``model.embed_tokens`` / ``lm_head``):
- LoRA: ``embed_tokens.lora_embedding_{A,B}`` (A [r, V], B [hidden, r]); ``lm_head.lora_{A,B}.weight``.
- DoRA: ``<module>.lora_magnitude_vector``.
- ``<module>.base_layer.weight``: PEFT saves the targeted base matrix itself (``save_embedding_layers``,
  e.g. after resizing the vocabulary). It replaces the base *parameter*, which a tied lm_head shares.
- ``<module>.weight``: ``modules_to_save``, a private copy of that one module (a tied lm_head keeps the
  base matrix unless it is saved too).
- ``<module>.token_adapter.trainable_tokens_delta``: ``trainable_token_indices`` rows (new values, not
  deltas). On a tied base PEFT ties lm_head to the embedding's rows (list form, or the dict form with
  equal indices or ``ensure_weight_tying``).
Every vocabulary dimension must equal the adapter's vocabulary V_a (>= the base's V, and at most
``MAX_ADDED_TOKENS`` more); ids in [V, V_a) need rows in both modules. ``check_vocab_layout`` checks every
tensor's declared shape (``_expected_shape``) before any value is read.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch

from loraplex.adapters.reading.adapter_config import AdapterConfig
from loraplex.adapters.reading.safetensors_file import TensorSpec
from loraplex.adapters.reading.weights import VOCAB_MODULES, VocabModule
from loraplex.config import ModelConfig
from loraplex.errors import AdapterRankTooLarge, AdapterShapeMismatch, InvalidAdapter

EMBED, HEAD = VOCAB_MODULES
MAX_ADDED_TOKENS = 65536  # tokens an adapter's vocabulary may add to the base's (bounds what a file may declare)
Shaped = torch.Tensor | TensorSpec  # a tensor, or its declaration in a file header (shape and dtype only)
Parts = Mapping[str, Mapping[str, tuple[str, Shaped]]]  # module -> kind -> (tensor name, tensor)


def check_vocab_layout(folder: str | Path, config: AdapterConfig, parts: Parts, model_config: ModelConfig,
                       max_lora_rank: int) -> None:
    """Every vocabulary-module tensor's shape and dtype (declared or read) against what the config and the
    base can need: ``_expected_shape`` with V_a bounded by ``MAX_ADDED_TOKENS``, LoRA ranks by
    ``max_lora_rank``, trainable rows by the listed token ids. No value is read."""
    v, hidden, tied = model_config.vocab_size, model_config.hidden_size, model_config.tie_word_embeddings
    head_tied = _head_tied(config, parts, tied)
    paths = {module: _lora_path(folder, config, parts, module, head_tied) for module in parts}
    vocab = _vocab_size(folder, config, parts, v)
    _check_listed(folder, config, parts, head_tied, tied)
    listed = _listed_tokens(config, tied)
    for module, kinds in parts.items():
        r = _rank(folder, config, paths[module], max_lora_rank) if paths[module] is not None else 0
        for kind, (name, tensor) in kinds.items():
            check_layout(folder, name, tensor, _expected_shape(module, kind, r, vocab, hidden,
                                                               len(listed.get(module, ()))))


def read_vocab_modules(folder: str | Path, config: AdapterConfig, parts: Parts, model_config: ModelConfig,
                       max_lora_rank: int) -> dict[str, VocabModule]:
    """``parts[module][kind]``, kinds ``lora_A``, ``lora_B``, ``magnitude``, ``base_layer``, ``saved``,
    ``trainable``; validated and resolved into what each module serves."""
    v, hidden, tied = model_config.vocab_size, model_config.hidden_size, model_config.tie_word_embeddings
    parts, head_tied = _tie_head(folder, config, parts, tied)
    paths = {m: _lora_path(folder, config, parts, m, head_tied) for m in VOCAB_MODULES}
    vocab = _vocab_size(folder, config, parts, v)
    _check_listed(folder, config, parts, head_tied, tied)
    lora = {m: _lora(folder, config, parts, m, paths[m], model_config, vocab, max_lora_rank) for m in VOCAB_MODULES}
    shared = _shared_matrix(folder, parts, tied, vocab, hidden)
    trainable = _trainable_rows(folder, config, parts, tied, vocab, hidden)
    out: dict[str, VocabModule] = {}
    for module in VOCAB_MODULES:
        own = parts.get(module, {})
        matrix = _matrix(folder, own["saved"], vocab, hidden) if "saved" in own else shared.get(module)
        rows = trainable.get(module)
        if matrix is not None and rows is not None:  # trainable rows over a replaced base parameter
            matrix = matrix.index_copy(0, *rows)
        row_ids, values = (torch.arange(vocab), matrix) if matrix is not None else rows or (None, None)
        magnitude = _magnitude(folder, config, own, module, lora[module], vocab, hidden)
        if vocab > v:
            covered = set() if row_ids is None else set(row_ids.tolist())
            missing = [i for i in range(v, vocab) if i not in covered]
            if missing:
                raise InvalidAdapter(
                    f"{folder}: the adapter's vocabulary has {vocab} tokens (the base model's {v}) but it gives "
                    f"no {module} rows for token ids {missing[:5]}{' ...' if len(missing) > 5 else ''}; save "
                    f"{module} (modules_to_save) or list those ids in trainable_token_indices")
        if values is not None or lora[module] is not None or vocab > v:
            out[module] = VocabModule(vocab, row_ids, values, lora[module], magnitude)
    return out


# (module, kind) -> the axis of that tensor that runs over the vocabulary
_VOCAB_AXIS = {(EMBED, "base_layer"): 0, (EMBED, "saved"): 0, (EMBED, "lora_A"): 1, (HEAD, "base_layer"): 0,
               (HEAD, "saved"): 0, (HEAD, "lora_B"): 0, (HEAD, "magnitude"): 0}


def _vocab_size(folder: str | Path, config: AdapterConfig, parts: Parts, v: int) -> int:
    """V_a: every tensor's vocabulary dimension must agree; trainable ids only need to fit in it; at most
    ``MAX_ADDED_TOKENS`` over the base's V."""
    dims = {name: tensor.shape[axis] for module, kinds in parts.items() for kind, (name, tensor) in kinds.items()
            if (axis := _VOCAB_AXIS.get((module, kind))) is not None and len(tensor.shape) > axis}
    sizes = set(dims.values())
    if len(sizes) > 1:
        raise AdapterShapeMismatch(f"{folder}: vocabulary dimensions disagree: " + ", ".join(
            f"{name} {size}" for name, size in sorted(dims.items())))
    vocab = sizes.pop() if sizes else v
    if vocab < v:
        raise AdapterShapeMismatch(f"{folder}: {', '.join(sorted(dims))}: {vocab} vocabulary rows, fewer than "
                                   f"the base model's {v}")
    top = max((max(ids) for _, ids in config.trainable_tokens), default=-1)
    if dims and top >= vocab:
        raise InvalidAdapter(f"{folder}: trainable_token_indices has id {top}, outside the adapter's "
                             f"vocabulary of {vocab}")
    size = max(vocab, top + 1)
    if size > v + MAX_ADDED_TOKENS:
        why = ", ".join(f"{name} {n}" for name, n in sorted(dims.items())) or f"trainable token id {top}"
        raise InvalidAdapter(f"{folder}: the adapter's vocabulary of {size} tokens ({why}) adds more than "
                             f"{MAX_ADDED_TOKENS} tokens to the base model's {v}")
    return size


def _tie_head(folder: str | Path, config: AdapterConfig, parts: Parts, tied: bool) -> tuple[Parts, bool]:
    """``ensure_weight_tying`` on a tied base: PEFT keeps lm_head's LoRA and saved copy in the embedding's
    storage (lm_head A = embed B^T, lm_head B = embed A^T), so both must agree; lm_head's are derived
    from the embedding's when the file lacks them. Returns the parts and whether lm_head is tied so."""
    embed = parts.get(EMBED, {})
    if not _head_tied(config, parts, tied):
        return parts, False
    head = dict(parts.get(HEAD, {}))
    derived = {"saved": embed.get("saved")}
    if "lora_A" in embed and "lora_B" in embed:
        derived |= {"lora_A": (f"{embed['lora_B'][0]}^T", embed["lora_B"][1].t()),
                    "lora_B": (f"{embed['lora_A'][0]}^T", embed["lora_A"][1].t())}
    for kind, named in derived.items():
        if named is None:
            continue
        if kind in head and not (head[kind][1].shape == named[1].shape and torch.equal(head[kind][1], named[1])):
            raise InvalidAdapter(f"{folder}: ensure_weight_tying=true on a tied base, but {head[kind][0]} is not "
                                 f"tied to {named[0]}")
        head[kind] = named
    return {**parts, HEAD: head}, True


def _head_tied(config: AdapterConfig, parts: Parts, tied: bool) -> bool:
    """Whether lm_head is tied to the embedding's LoRA / saved matrix (``_tie_head``)."""
    return tied and config.ensure_weight_tying and bool({"lora_A", "saved"} & set(parts.get(EMBED, {})))


def _listed_tokens(config: AdapterConfig, tied: bool) -> dict[str, tuple[int, ...]]:
    """``trainable_token_indices`` per module, with a tied lm_head's rows being the embedding's."""
    listed = dict(config.trainable_tokens)
    if _tokens_tie_head(config, tied):
        listed.setdefault(HEAD, listed[EMBED])  # PEFT saves the tied lm_head's rows too (checked equal later)
    return listed


def _check_listed(folder: str | Path, config: AdapterConfig, parts: Parts, head_tied: bool, tied: bool) -> None:
    """``modules_to_save`` and ``trainable_token_indices`` must match the tensors present."""
    for module in VOCAB_MODULES:
        kinds = parts.get(module, {})
        if "saved" in kinds and module not in config.modules_to_save and not (module == HEAD and head_tied):
            raise InvalidAdapter(f"{folder}: tensor {kinds['saved'][0]!r} replaces {module}, which "
                                 f"modules_to_save={list(config.modules_to_save)!r} does not list")
        if module in config.modules_to_save and "saved" not in kinds:
            raise InvalidAdapter(f"{folder}: modules_to_save lists {module} but the adapter has no "
                                 f"{module}.weight tensor")
    listed = _listed_tokens(config, tied)
    for module in VOCAB_MODULES:
        if module in listed and module in config.modules_to_save:
            raise InvalidAdapter(f"{folder}: {module} is both in modules_to_save and in trainable_token_indices")
        if "trainable" in parts.get(module, {}) and module not in listed:
            raise InvalidAdapter(f"{folder}: tensor {parts[module]['trainable'][0]!r} holds trainable tokens "
                                 f"for {module}, which trainable_token_indices does not list")


def _lora_path(folder: str | Path, config: AdapterConfig, parts: Parts, module: str, head_tied: bool) -> str | None:
    """The module's name in the base model if the adapter puts LoRA on it (checked against
    ``target_modules``), else None."""
    kinds = parts.get(module, {})
    if "lora_A" not in kinds and "lora_B" not in kinds:
        return None
    for half, other in (("lora_A", "lora_B"), ("lora_B", "lora_A")):
        if half not in kinds:
            raise InvalidAdapter(f"{folder}: {module} has {other} but no {half} tensor")
    tied = module == HEAD and head_tied  # targeted through the embedding
    path = HEAD if tied else module_path(kinds["lora_A"][0], module)
    if not (tied or config.targets_vocab(path)):
        raise InvalidAdapter(f"{folder}: LoRA tensors for {path!r}, which target_modules="
                             f"{config.target_modules!r} does not select")
    return path


def _lora(folder: str | Path, config: AdapterConfig, parts: Parts, module: str, path: str | None,
          model_config: ModelConfig, vocab: int, max_lora_rank: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    if path is None:
        return None
    kinds = parts[module]
    r = _rank(folder, config, path, max_lora_rank)
    a, b = (check_tensor(folder, *kinds[half], _expected_shape(module, half, r, vocab, model_config.hidden_size, 0))
            for half in ("lora_A", "lora_B"))
    return a, (b * config.scale_for(path)).contiguous()


def _rank(folder: str | Path, config: AdapterConfig, path: str, max_lora_rank: int) -> int:
    r = config.rank_for(path)
    if r > max_lora_rank:
        raise AdapterRankTooLarge(f"{folder}: module {path!r} has rank {r}, over max_lora_rank={max_lora_rank}")
    return r


def _expected_shape(module: str, kind: str, r: int, vocab: int, hidden: int, tokens: int) -> tuple[int, ...]:
    """The shape of ``module``'s tensor of ``kind`` (rank r, adapter vocabulary V_a = ``vocab``, ``tokens``
    trainable token rows): embed_tokens' LoRA is A [r, V_a], B [hidden, r]; lm_head's A [r, hidden],
    B [V_a, r]; a DoRA magnitude runs over the output features; matrices are [V_a, hidden]."""
    embed = module == EMBED
    return {"lora_A": (r, vocab) if embed else (r, hidden), "lora_B": (hidden, r) if embed else (vocab, r),
            "magnitude": (hidden,) if embed else (vocab,), "base_layer": (vocab, hidden), "saved": (vocab, hidden),
            "trainable": (tokens, hidden)}[kind]


def _magnitude(folder: str | Path, config: AdapterConfig, kinds: Mapping[str, tuple[str, torch.Tensor]], module: str,
               lora: tuple[torch.Tensor, torch.Tensor] | None, vocab: int, hidden: int) -> torch.Tensor | None:
    if "magnitude" not in kinds:
        if config.use_dora and lora is not None:
            raise InvalidAdapter(f"{folder}: use_dora=true but {module} has no lora_magnitude_vector")
        return None
    name, tensor = kinds["magnitude"]
    if not config.use_dora or lora is None:
        raise InvalidAdapter(f"{folder}: tensor {name!r} is a DoRA magnitude, but "
                             + ("use_dora is false" if not config.use_dora else f"{module} has no LoRA"))
    return check_tensor(folder, name, tensor, _expected_shape(module, "magnitude", 0, vocab, hidden, 0))


def _matrix(folder: str | Path, named: tuple[str, torch.Tensor], vocab: int, hidden: int) -> torch.Tensor:
    return check_tensor(folder, *named, (vocab, hidden))


def _shared_matrix(folder: str | Path, parts: Parts, tied: bool, vocab: int, hidden: int) -> dict[str, torch.Tensor]:
    """``base_layer.weight`` replaces the base parameter: on a tied base, both modules read it."""
    found = {m: _matrix(folder, parts[m]["base_layer"], vocab, hidden) for m in VOCAB_MODULES
             if "base_layer" in parts.get(m, {})}
    if not tied or not found:
        return found
    first, *rest = found.values()
    if rest and not torch.equal(first, rest[0]):
        raise InvalidAdapter(f"{folder}: the base model ties embed_tokens and lm_head, but the adapter's "
                             "embed_tokens.base_layer.weight and lm_head.base_layer.weight differ")
    return dict.fromkeys(VOCAB_MODULES, first)


def _trainable_rows(folder: str | Path, config: AdapterConfig, parts: Parts, tied: bool, vocab: int,
                    hidden: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """module -> (ids [n] ascending, rows [n, hidden]), following PEFT's tying rule for a tied base."""
    listed = dict(config.trainable_tokens)
    head_tied = _tokens_tie_head(config, tied)
    out = {}
    for module, ids in listed.items():
        if module == HEAD and head_tied:  # PEFT ties it to the embedding's rows (and may save them twice)
            own, embed = parts.get(HEAD, {}).get("trainable"), parts.get(EMBED, {}).get("trainable")
            if own is not None and embed is not None and not torch.equal(own[1], embed[1]):
                raise InvalidAdapter(f"{folder}: tensor {own[0]!r} should equal {embed[0]!r}: on this tied base "
                                     "PEFT ties lm_head's trainable tokens to embed_tokens' rows")
            continue
        if "trainable" not in parts.get(module, {}):
            raise InvalidAdapter(f"{folder}: trainable_token_indices lists {module} but the adapter has no "
                                 f"{module}.token_adapter.trainable_tokens_delta tensor")
        delta = check_tensor(folder, *parts[module]["trainable"], (len(ids), hidden))
        order = torch.tensor(ids, dtype=torch.int64).sort()
        out[module] = (order.values, delta.index_select(0, order.indices).contiguous())
    if head_tied:
        out[HEAD] = out[EMBED]
    return out


def _tokens_tie_head(config: AdapterConfig, tied: bool) -> bool:
    """PEFT's rule: on a tied base, lm_head serves the embedding's trainable token rows unless the dict form
    gives lm_head other indices (and ``ensure_weight_tying`` is off)."""
    listed = dict(config.trainable_tokens)
    return tied and EMBED in listed and (
        config.ensure_weight_tying or HEAD not in listed or listed[HEAD] == listed[EMBED])


def module_path(tensor_name: str, module: str) -> str:
    """``model.embed_tokens.lora_embedding_A`` -> ``model.embed_tokens`` (the module's name in the base model)."""
    return tensor_name[: tensor_name.rindex(f"{module}.") + len(module)]


def check_layout(folder: str | Path, name: str, tensor: Shaped, shape: tuple[int, ...], why: str = "") -> None:
    """``tensor``'s shape (``why`` explains the expected one) and dtype, from its declaration or the tensor."""
    if tuple(tensor.shape) != shape:
        raise AdapterShapeMismatch(f"{folder}: {name} has shape {list(tensor.shape)}, expected {list(shape)}{why}")
    if not tensor.dtype.is_floating_point:
        raise InvalidAdapter(f"{folder}: {name} has non-float dtype {tensor.dtype}")


def check_tensor(folder: str | Path, name: str, tensor: torch.Tensor, shape: tuple[int, ...], why: str = "",
                 finite: bool = False) -> torch.Tensor:
    """``tensor`` as contiguous float32 (the same tensor when it already is) after checking its shape
    (``why`` explains the expected one), dtype and values (``finite``: already known finite, e.g. from one
    check over the whole file)."""
    check_layout(folder, name, tensor, shape, why)
    if not finite and not bool(torch.isfinite(tensor).all()):
        raise InvalidAdapter(f"{folder}: {name} contains NaN or inf values")
    return tensor.to(torch.float32).contiguous()
