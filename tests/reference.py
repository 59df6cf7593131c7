"""Slow references: HF transformers (+ PEFT) greedy decoding, one token at a time with HF's own KV cache."""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path

import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM


@lru_cache(maxsize=4)
def _base(folder: str) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def hf_model(base_folder: Path, adapter_folder: Path | None) -> torch.nn.Module:
    """The base model, or a fresh PEFT wrapper with exactly one adapter active."""
    base = _base(str(base_folder))
    if adapter_folder is None:
        return base
    return PeftModel.from_pretrained(base, str(adapter_folder)).eval()


@torch.inference_mode()
def hf_greedy(model: torch.nn.Module, prompt: list[int], max_new_tokens: int) -> tuple[list[int], torch.Tensor]:
    """Greedy continuation (EOS ignored) and the logits of each generated position: [n, vocab]."""
    out = model(torch.tensor([prompt]), use_cache=True)
    tokens, steps = [], []
    for _ in range(max_new_tokens):
        logits = out.logits[0, -1].float()
        steps.append(logits)
        tokens.append(int(torch.argmax(logits)))
        out = model(torch.tensor([[tokens[-1]]]), past_key_values=out.past_key_values, use_cache=True)
    return tokens, torch.stack(steps)


def greedy_with_adapter(base_folder: Path, adapter_folder: Path | None, prompts: list[list[int]],
                        n: int) -> list[tuple[list[int], torch.Tensor]]:
    """``hf_greedy`` of each prompt under one adapter (or none), unloading the PEFT wrapper after."""
    model = hf_model(base_folder, adapter_folder)
    outs = [hf_greedy(model, p, n) for p in prompts]
    if adapter_folder is not None:
        model.unload()  # restore the cached base model's modules
    return outs


def with_adapter(base_folder: Path, adapter_folder: Path | None, prompts: list[list[int]], n: int) -> list[list[int]]:
    """Greedy outputs of each prompt under one adapter (or none)."""
    return [tokens for tokens, _ in greedy_with_adapter(base_folder, adapter_folder, prompts, n)]


def with_mix(base_folder: Path, mix: list[tuple[Path, float]], prompts: list[list[int]], n: int) -> list[list[int]]:
    """Greedy outputs of each prompt under PEFT's blend of ``mix`` (adapter folder, weight):
    ``add_weighted_adapter(..., combination_type="cat")``, whose delta is ``sum_k w_k * B_k A_k`` (scaling folded)."""
    model = PeftModel.from_pretrained(_base(str(base_folder)), str(mix[0][0]), adapter_name="m0")
    for i, (folder, _) in enumerate(mix[1:], start=1):
        model.load_adapter(str(folder), adapter_name=f"m{i}")
    model.add_weighted_adapter([f"m{i}" for i in range(len(mix))], [w for _, w in mix], adapter_name="mix",
                               combination_type="cat")
    model.set_adapter("mix")
    model.eval()
    outs = [hf_greedy(model, p, n)[0] for p in prompts]
    model.unload()  # restore the cached base model's modules
    return outs


@lru_cache(maxsize=2)
def _encoder(folder: str) -> torch.nn.Module:
    from transformers import AutoModel

    return AutoModel.from_pretrained(folder, dtype=torch.float32).eval()


def _causal_lm_adapter(adapter_folder: Path) -> bool:
    import json

    return json.loads((adapter_folder / "adapter_config.json").read_text()).get("task_type") == "CAUSAL_LM"


def assert_embedding_close(ours: Sequence[float], ref: torch.Tensor, rel: float = 1e-5) -> None:
    """``ours`` equals the reference vector within ``rel`` of its largest magnitude (shape included)."""
    got = torch.tensor(list(ours), dtype=torch.float32)
    assert got.shape == ref.shape
    torch.testing.assert_close(got, ref, rtol=0.0, atol=rel * float(ref.abs().max()))


@torch.inference_mode()
def hf_embeddings(base_folder: Path, adapter_folder: Path | None, prompts: list[list[int]], pooling_type: str = "last",
                  normalize: bool = True, dimensions: int | None = None) -> list[torch.Tensor]:
    """Sentence-transformers-style embeddings, one prompt at a time: HF ``AutoModel`` (+ PEFT with that one
    adapter; a CAUSAL_LM adapter wraps ``AutoModelForCausalLM``, whose decoder is that ``AutoModel``)
    ``last_hidden_state [P, hidden]``, pooled (``last``: row P-1, ``mean``: the mean of the P rows, ``cls``:
    row 0), truncated to ``dimensions``, L2-normalised if asked. Float32 ``[dims]`` each."""
    if adapter_folder is not None and _causal_lm_adapter(adapter_folder):
        wrapper = hf_model(base_folder, adapter_folder)
        model = wrapper.get_base_model().model
    else:
        wrapper = model = _encoder(str(base_folder))
        if adapter_folder is not None:
            wrapper = model = PeftModel.from_pretrained(model, str(adapter_folder)).eval()
    out = []
    for prompt in prompts:
        h = model(input_ids=torch.tensor([prompt])).last_hidden_state[0].float()  # [P, hidden]
        v = {"last": h[-1], "mean": h.mean(0), "cls": h[0]}[pooling_type][:dimensions]
        out.append(torch.nn.functional.normalize(v, dim=0) if normalize else v)
    if adapter_folder is not None:
        wrapper.unload()  # restore the cached base model's modules
    return out
