"""SEQ_CLS adapters for the classification and scoring tests, and their HF reference: PEFT on
``AutoModelForSequenceClassification`` (a LoRA plus the ``score`` head PEFT saves from ``modules_to_save``)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from peft import LoraConfig, PeftConfig, PeftModel, get_peft_model
from safetensors import safe_open
from transformers import AutoModelForSequenceClassification

from tests.fixtures import ALL_PROJECTIONS, save_with_random_b


def write_classifier_adapter(base_folder: Path, folder: Path, num_labels: int, rank: int = 8, seed: int = 0,
                             class_labels: Sequence[str] | None = None, head_std: float = 0.5) -> Path:
    """A PEFT ``SEQ_CLS`` adapter over ``base_folder``: LoRA on every projection (random non-zero B) and a
    random ``score`` head of ``num_labels`` classes; with ``class_labels`` the model's ``config.json`` (its
    ``id2label``) is saved beside it, as ``AutoModelForSequenceClassification.save_pretrained`` writes it."""
    torch.manual_seed(seed)
    labels = {"id2label": dict(enumerate(class_labels))} if class_labels is not None else {}
    model = AutoModelForSequenceClassification.from_pretrained(base_folder, num_labels=num_labels, dtype=torch.float32,
                                                               **labels)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(ALL_PROJECTIONS), lora_dropout=0.0,
                        bias="none", task_type="SEQ_CLS")
    peft_model = get_peft_model(model, config)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "score" in name and "modules_to_save" in name:
                p.normal_(0.0, head_std)
    save_with_random_b(peft_model, folder, 0.2)
    if class_labels is not None:
        model.config.save_pretrained(folder)
    return folder


@torch.inference_mode()
def hf_classifier_logits(base_folder: Path, adapter_folder: Path, prompts: list[list[int]]) -> list[torch.Tensor]:
    """HF's logits ``[num_labels]`` per prompt, one unpadded prompt at a time: ``AutoModelForSequenceClassification``
    with the PEFT adapter (PEFT's own LoRA forward, and the ``score`` head it saved)."""
    num_labels = _num_labels(adapter_folder)
    model = AutoModelForSequenceClassification.from_pretrained(base_folder, num_labels=num_labels,
                                                               dtype=torch.float32)
    assert PeftConfig.from_pretrained(str(adapter_folder)).task_type == "SEQ_CLS"
    peft_model = PeftModel.from_pretrained(model, str(adapter_folder)).eval()
    return [peft_model(input_ids=torch.tensor([prompt])).logits[0].float() for prompt in prompts]


def _num_labels(adapter_folder: Path) -> int:
    with safe_open(str(adapter_folder / "adapter_model.safetensors"), "pt") as f:
        return f.get_slice("base_model.model.score.weight").get_shape()[0]
