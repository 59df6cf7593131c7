"""An adapter's weight file: opened safely, its header checked, then read in one pass into owned tensors.

A cold adapter load sits on the critical path of the requests waiting for it, and its file may be
hostile, so reading is in two steps. ``open_weight_file`` opens ``adapter_model.safetensors``
(``safe_files``: a regular file inside the allowed roots) and checks its header against the file size
(``safetensors_file.parse_header``) without reading any tensor: the caller then checks every declared
shape against what the adapter config can need (``peft_format``) before ``read`` touches a byte of
data. ``read`` fills one owned buffer with the data section (one ``preadv`` pass; a bounded file, so
not a memory map, which a later truncation of the file would turn into a SIGBUS in the host tier) and
every tensor is a zero-copy view of it; when all are float32 the caller can check every value at once
(``flat``) and fold scales in place. ``adapter_model.bin`` (a pickle) is read only when explicitly
allowed, with ``weights_only``; its layout is known only once loaded (``specs`` is None).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import torch

from loraplex.adapters.reading.safe_files import AdapterFile, Roots, open_file, present
from loraplex.adapters.reading.safetensors_file import (
    HEADER_LENGTH_BYTES,
    Header,
    TensorSpec,
    header_length,
    parse_header,
    tensor_views,
)
from loraplex.errors import InvalidAdapter, UnsupportedAdapter

SAFETENSORS_FILE = "adapter_model.safetensors"
PICKLE_FILE = "adapter_model.bin"


@dataclass(frozen=True)
class WeightFile:
    """The tensors of one weight file, by name; owned by the caller (safe to change in place)."""

    tensors: dict[str, torch.Tensor]
    # Every tensor's elements back to back, when they are all float32 views of one buffer (else None):
    # one reduction over it checks every value of the file.
    flat: torch.Tensor | None


class OpenedWeightFile:
    """A weight file opened and its header checked; no tensor data read before ``read``."""

    def __init__(self, file: AdapterFile, header: Header | None) -> None:
        self._file, self._header = file, header

    @property
    def specs(self) -> dict[str, TensorSpec] | None:
        """Each tensor's declared dtype and shape (None for a pickle)."""
        return None if self._header is None else self._header.specs

    def read(self) -> WeightFile:
        if self._header is None:
            return _load_pickle(self._file)
        header = self._header
        buffer = bytearray(header.data_len)
        self._file.readinto(buffer, header.data_start)
        tensors = tensor_views(buffer, 0, header.specs)
        all_f32 = all(spec.dtype is torch.float32 for spec in header.specs.values())
        flat = (torch.frombuffer(buffer, dtype=torch.float32) if header.data_len else torch.empty(0)) if all_f32 \
            else None
        return WeightFile(tensors, flat)

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> OpenedWeightFile:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self.close()


def open_weight_file(folder: Path, allow_pickle: bool, roots: Roots = None) -> OpenedWeightFile:
    """``adapter_model.safetensors`` of ``folder`` (or, only if ``allow_pickle``, ``adapter_model.bin``), opened."""
    if present(folder, SAFETENSORS_FILE):
        file = open_file(folder, SAFETENSORS_FILE, roots)
        try:
            length = header_length(file.read(0, min(HEADER_LENGTH_BYTES, file.size)), file.size, file.what)
            header = parse_header(file.read(HEADER_LENGTH_BYTES, length), file.size, file.what)
        except BaseException:
            file.close()
            raise
        return OpenedWeightFile(file, header)
    if present(folder, PICKLE_FILE):
        if not allow_pickle:
            raise UnsupportedAdapter(
                f"{folder}: only {PICKLE_FILE} (a pickle) is present; pickles are refused unless "
                "explicitly allowed (allow_pickle_adapters); convert it to safetensors")
        return OpenedWeightFile(open_file(folder, PICKLE_FILE, roots), None)
    raise InvalidAdapter(f"{folder}: no {SAFETENSORS_FILE} in the adapter folder")


def read_weight_file(folder: Path, allow_pickle: bool, roots: Roots = None) -> WeightFile:
    """The whole weight file at once (no layout check between the header and the data)."""
    with open_weight_file(folder, allow_pickle, roots) as opened:
        return opened.read()


def _load_pickle(file: AdapterFile) -> WeightFile:
    try:
        with os.fdopen(os.dup(file.fd), "rb") as f:
            state = torch.load(f, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises many unrelated types for a bad pickle
        raise InvalidAdapter(f"{file.what}: cannot read ({e})") from e
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise InvalidAdapter(f"{file.what}: does not hold a name -> tensor dict")
    return WeightFile(dict(state), None)
