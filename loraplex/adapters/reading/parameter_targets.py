"""LoRA that PEFT put on parameters (``target_parameters``), as PEFT 0.21 saves it on transformers 5: the
stacked expert tensors of a mixture of experts (``mlp.experts.gate_up_proj [E, 2I, H]``) and the router's
``gate.weight``.

PEFT wraps each targeted parameter of a module in a ``lora.ParamWrapper``. Several targeted parameters of one
module nest, the first in the module's registration order innermost, so the file names the outermost wrapper
``<module>`` and each inner one with one more ``.base_layer``: with both expert tensors targeted,
``mlp.experts.base_layer.lora_A.weight`` is ``gate_up_proj``'s and ``mlp.experts.lora_A.weight`` ``down_proj``'s.
PEFT targets a parameter whose full name (``model.layers.3.mlp.experts.gate_up_proj``) equals an entry or ends
with ``"." + entry``; ``rank_pattern`` / ``alpha_pattern`` match that full name; ``layers_to_transform`` and
``exclude_modules`` do not apply. A stacked tensor of E experts is saved as ``lora_A [E * r, in]`` (rows of
expert e: ``e * r .. e * r + r - 1``) and ``lora_B [out, r * E]`` (expert e's rank j: column ``j * E + e``), as
``ParamWrapper.get_delta_weight`` reads them: ``delta_e = scale * B_e A_e``.

Refused with ``UnsupportedAdapter``: an entry naming a parameter loraplex does not adapt this way, and LoRA on
per-expert modules (``mlp.experts.3.gate_proj``: the layout of transformers 4 models, which PEFT 0.21 on
transformers 5 no longer writes).
"""

from __future__ import annotations

import re
import reprlib

import torch

from loraplex.adapters.reading.adapter_config import AdapterConfig
from loraplex.config import ModelConfig, Projection
from loraplex.errors import InvalidAdapter, UnsupportedAdapter

# "<prefix>layers.N.<container>" then zero or more ".base_layer" (one per inner ParamWrapper)
_WRAPPED = re.compile(r"^(?P<base>(?:.*\.)?layers\.(?P<layer>\d+)\.(?P<container>.+?))(?P<wraps>(?:\.base_layer)*)$")
_PER_EXPERT = re.compile(r"(?:^|\.)layers\.\d+\.(?P<container>.+)\.\d+\.\w+$")
_SHOWN = reprlib.Repr()  # a bounded repr of the config's values in messages
_SHOWN.maxstring = _SHOWN.maxother = 120


def _adaptable(model_config: ModelConfig) -> str:
    return ", ".join(f"layers.N.{container}.{param}" for container, params in model_config.parameter_targets().items()
                     for param, _ in params) or "none"


def check_target_parameters(folder: str, config: AdapterConfig, model_config: ModelConfig) -> None:
    """Every ``target_parameters`` entry must name a parameter the model adapts through them."""
    known = [f"model.layers.0.{container}.{param}" for container, params in model_config.parameter_targets().items()
             for param, _ in params]
    for entry in config.target_parameters:
        if not any(key == entry or key.endswith(f".{entry}") for key in known):
            raise UnsupportedAdapter(
                f"{folder}: target_parameters entry {_SHOWN.repr(entry)} names no parameter loraplex adapts in "
                f"{model_config.architecture} (adaptable through target_parameters: {_adaptable(model_config)})")


def locate_parameter_module(folder: str, module: str, config: AdapterConfig,
                            model_config: ModelConfig) -> tuple[int, str, str] | None:
    """``(layer, projection, parameter key)`` of a module PEFT wrapped through ``target_parameters`` (the key is
    the parameter's full name, which ``rank_pattern`` matches); None when ``module`` is a plain LoRA module."""
    targets = model_config.parameter_targets()
    per_expert = _PER_EXPERT.search(module)
    if per_expert is not None and per_expert["container"] in targets:
        raise UnsupportedAdapter(
            f"{folder}: tensors for module {module!r}: LoRA on per-expert modules (the transformers 4 layout) is not "
            f"served; PEFT on transformers 5 saves LoRA on experts as target_parameters on the stacked tensors "
            f"({_adaptable(model_config)}): load the adapter there and save it again")
    match = _WRAPPED.match(module)
    params = targets.get(match["container"]) if match is not None else None
    if params is None:
        return None
    chosen = [(param, proj) for param, proj in params if config.targets_parameter(f"{match['base']}.{param}")]
    depth = match["wraps"].count(".base_layer")
    if not chosen and depth == 0 and not model_config.projections()[params[0][1]].experts:
        return None  # e.g. the router as a plain target_modules LoRA (older PEFT)
    if depth >= len(chosen):
        raise InvalidAdapter(
            f"{folder}: tensors for module {module!r}, but target_parameters="
            f"{_SHOWN.repr(list(config.target_parameters))} "
            f"select {len(chosen)} of its parameters (PEFT nests one wrapper per selected parameter; this one is "
            f"{depth + 1} deep)")
    param, proj = chosen[len(chosen) - 1 - depth]
    return int(match["layer"]), proj, f"{match['base']}.{param}"


def expert_shapes(rank: int, shape: Projection) -> tuple[dict[str, tuple[int, ...]], str]:
    """The shapes PEFT saves a stacked parameter's pair in (``lora_A [E * r, in]``, ``lora_B [out, r * E]``)
    and the text explaining them."""
    e, in_f, out_f = shape.experts, shape.in_features, shape.out_features
    return ({"lora_A": (e * rank, in_f), "lora_B": (out_f, rank * e)},
            f" (rank {rank} x {e} experts; each expert is {in_f} -> {out_f})")


def stack_experts(a: torch.Tensor, b: torch.Tensor, experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """PEFT's stacked pair ``(lora_A [E * r, in], lora_B [out, r * E])`` as one pair per expert,
    ``(A [E, r, in], B [E, out, r])`` (A a view, B a copy)."""
    rank, out_f = a.shape[0] // experts, b.shape[0]
    return a.view(experts, rank, a.shape[1]), b.view(out_f, rank, experts).permute(2, 0, 1).contiguous()
