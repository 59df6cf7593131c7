"""A ``SEQ_CLS`` adapter's classification head: PEFT saves ``modules_to_save`` ``score`` (or ``classifier``) as
``base_model.model.score.weight [num_labels, hidden]`` (and ``.bias [num_labels]`` where the head has one).

The head is read and checked like every other adapter tensor (declared shape and dtype before a byte is read,
then finite values), once per adapter version. Its class names are ``id2label`` from a ``config.json`` in the
adapter folder (what ``AutoModelForSequenceClassification.save_pretrained`` writes; read bounded, untrusted) when
it names exactly ``num_labels`` classes, else ``LABEL_0`` ... (transformers' default names).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch

from loraplex.adapters.reading.bounded_json import parse_json
from loraplex.adapters.reading.safe_files import Roots, present, read_file
from loraplex.adapters.reading.vocab_modules import Shaped, check_layout, check_tensor
from loraplex.adapters.reading.weights import ScoreHead
from loraplex.config import ModelConfig
from loraplex.errors import InvalidAdapter

MAX_LABELS = 65536  # classes a head may declare (bounds what a file may make us read)
MAX_LABEL_CHARS = 256
LABELS_FILE = "config.json"
MAX_LABELS_FILE_BYTES = 4 << 20
HeadParts = Mapping[str, Mapping[str, tuple[str, Shaped]]]  # head module -> "saved" / "bias" -> (name, tensor)


def check_head_layout(source: str, parts: HeadParts, model_config: ModelConfig) -> None:
    """At most one head; its weight ``[L, hidden]`` with ``1 <= L <= MAX_LABELS``, its bias ``[L]``; float
    dtypes. Reads no value (``parts`` may hold a header's declarations)."""
    if len(parts) > 1:
        raise InvalidAdapter(f"{source}: the adapter saves two classification heads ({', '.join(sorted(parts))}); "
                             "a sequence-classification adapter has one")
    for module, kinds in parts.items():
        if "saved" not in kinds:
            raise InvalidAdapter(f"{source}: {kinds['bias'][0]!r} is a bias without the {module} head's weight")
        name, weight = kinds["saved"]
        num_labels = weight.shape[0] if len(weight.shape) == 2 else 0
        if not 1 <= num_labels <= MAX_LABELS:
            raise InvalidAdapter(f"{source}: {name} has shape {list(weight.shape)}: a classification head is "
                                 f"[num_labels, hidden] with 1 to {MAX_LABELS} labels")
        why = f" (the {module} head over the base model's hidden size {model_config.hidden_size})"
        check_layout(source, name, weight, (num_labels, model_config.hidden_size), why)
        if "bias" in kinds:
            check_layout(source, kinds["bias"][0], kinds["bias"][1], (num_labels,), why)


def read_score_head(source: str, parts: HeadParts, model_config: ModelConfig,
                    labels: tuple[str, ...] | None) -> ScoreHead | None:
    """The head ``parts`` hold (None without one), checked, float32; ``labels`` the folder's (``head_labels``),
    used when they name every class."""
    check_head_layout(source, parts, model_config)
    if not parts:
        return None
    ((module, kinds),) = parts.items()
    name, weight = kinds["saved"]
    assert isinstance(weight, torch.Tensor)
    weight = check_tensor(source, name, weight, tuple(weight.shape))
    bias = None
    if "bias" in kinds:
        bias_name, raw_bias = kinds["bias"]
        assert isinstance(raw_bias, torch.Tensor)
        bias = check_tensor(source, bias_name, raw_bias, tuple(raw_bias.shape))
    num_labels = weight.shape[0]
    if labels is None or len(labels) != num_labels:
        labels = tuple(f"LABEL_{i}" for i in range(num_labels))
    return ScoreHead(weight, bias, labels)


def head_labels(folder: Path, roots: Roots) -> tuple[str, ...] | None:
    """``id2label`` of the folder's ``config.json``, as names by index; None when the folder has no such file
    or it holds no ``id2label``. A malformed one is an ``InvalidAdapter`` naming it."""
    if not present(folder, LABELS_FILE):
        return None
    what = f"{folder}: {LABELS_FILE}"
    raw = parse_json(read_file(folder, LABELS_FILE, roots, MAX_LABELS_FILE_BYTES), what, MAX_LABELS_FILE_BYTES)
    id2label = raw.get("id2label") if isinstance(raw, dict) else None
    if id2label is None:
        return None
    if not isinstance(id2label, dict) or not 0 < len(id2label) <= MAX_LABELS:
        raise InvalidAdapter(f"{what}: id2label must be an object of 1 to {MAX_LABELS} class names")
    names: dict[int, str] = {}
    for key, label in id2label.items():
        if not (isinstance(key, str) and key.isdigit()) or not isinstance(label, str) or len(label) > MAX_LABEL_CHARS:
            raise InvalidAdapter(f"{what}: id2label maps class ids (\"0\", \"1\", ...) to names of at most "
                                 f"{MAX_LABEL_CHARS} characters; got {str(key)[:40]!r}")
        names[int(key)] = label
    if sorted(names) != list(range(len(names))):
        raise InvalidAdapter(f"{what}: id2label must name classes 0 to {len(names) - 1}, each once")
    return tuple(names[i] for i in range(len(names)))
