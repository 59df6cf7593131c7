"""What a frontend and the engine process say to each other (pickled over one socket pair); both sides
import this module, and nothing else of each other's.

Frontend -> engine: ``Start`` first, then lists of ``AddRequests``, ``Abort``, ``Call`` and ``Shutdown``
(the frontend batches whatever queued up while the previous write was in flight).
Engine -> frontend: ``Ready`` or ``StartFailed`` first, then ``Accepted`` (one per ``AddRequests``),
``StepOutputs`` (one per step), ``StepFailed`` and ``Reply`` (one per ``Call``).

Requests travel as token ids with the adapter *version* the frontend routed them to (``NewRequest``);
outputs as ``EngineOutput`` s (new token ids only), so a step's message grows with the batch, not with
the requests' lengths; text never crosses. ``SamplingParams``, ``EngineStats`` and ``AdapterInfo``
travel as they are (``AdapterInfo`` without its tokenizer object: ``portable_result``). Every reply to a
call that changes the adapter version table carries the table after it (``VersionView``), so the
frontend's copy is current before the call returns.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pickle
import queue
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, Protocol

import torch

from loraplex.adapters.info import AdapterInfo
from loraplex.adapters.reading.safetensors_file import parse_safetensors_bytes, safetensors_bytes
from loraplex.adapters.versions import VersionView
from loraplex.config import EngineConfig
from loraplex.engine.request import NO_TAGS, EngineOutput, NewRequest, RequestTags
from loraplex.errors import LoraplexError


@dataclass(frozen=True)
class EngineInfo:
    """The served model, as a frontend needs it (plain data: it crosses the process boundary)."""

    model_name: str
    model_path: str  # its folder (config, weights, tokenizer)
    max_model_len: int
    vocab_size: int
    dtype: str
    device: str
    has_tokenizer: bool
    pid: int = dataclasses.field(default_factory=os.getpid)  # the process running the step loop


class EngineCalls(Protocol):
    """The engine methods a frontend may call by name (``Call.method``), each off the step loop: the one
    list of them (``CALLABLE``); ``client/base.py`` implements each through its client's ``_call``."""

    def load_adapter(self, name: str, path: str | None = None, *, tensors: Any = None, config: Any = None,
                     new_version: bool = False, roots: list[str] | None = None) -> AdapterInfo: ...
    def unload_adapter(self, name: str) -> None: ...
    def pin_adapter(self, name: str) -> None: ...
    def unpin_adapter(self, name: str) -> None: ...
    def rollback_adapter(self, name: str) -> AdapterInfo: ...
    def split_adapter(self, name: str, weights: dict[int, float]) -> None: ...
    def list_adapters(self) -> list[AdapterInfo]: ...
    def adapter_versions(self) -> list[dict[str, Any]]: ...
    def adapter_snapshot(self) -> dict[str, Any]: ...
    def version_view(self) -> VersionView: ...
    def stats(self) -> Any: ...
    def base_fingerprint(self) -> str: ...


CALLABLE = frozenset(name for name in vars(EngineCalls) if not name.startswith("_"))
CHANGES_VERSIONS = frozenset({"load_adapter", "unload_adapter", "rollback_adapter", "split_adapter"})


@dataclass(frozen=True)
class Start:
    config: EngineConfig
    adapters: tuple[tuple[str, str], ...]  # (name, folder) to load before Ready
    log_level: str


@dataclass(frozen=True)
class Ready:
    info: EngineInfo
    versions: VersionView  # the table after the start-up adapters loaded


@dataclass(frozen=True)
class StartFailed:
    error: BaseException


@dataclass(frozen=True)
class AddRequests:
    """Requests admitted together (the choices and prompts of one API request), or none of them."""

    requests: list[NewRequest]
    tags: RequestTags = NO_TAGS  # tenant and priority: the same for all

    @property
    def key(self) -> str:
        """The id its ``Accepted`` answers to: the first request's."""
        return str(self.requests[0].request_id)


@dataclass(frozen=True)
class Abort:
    request_id: str


@dataclass(frozen=True)
class Call:
    call_id: int
    method: str  # one of CALLABLE
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)  # ``TensorBlob`` s for tensor arguments


SPOOL_BYTES = 1 << 20  # a blob past this crosses as a private file (one copy each way), not through the socket


def _spool_folder() -> str:
    """``/dev/shm`` (memory) where the system has one, the temporary folder otherwise."""
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


@dataclass(frozen=True)
class TensorBlob:
    """Tensors as they cross the socket: one safetensors buffer (a pickled tensor would travel through torch's
    shared-memory reductions), parsed on arrival with the checked parser. A large buffer travels as ``path``, a
    file only this user can read (``spooled``): pickling it through the socket cost 3 copies and ~50 ms for a
    19 MB adapter with the receiver thread holding the GIL. The receiving side removes the file once read, the
    sending side once the call is answered (the engine may have died first)."""

    data: bytes = b""
    path: str | None = None

    @classmethod
    def of(cls, tensors: Mapping[str, torch.Tensor]) -> TensorBlob:
        return cls(safetensors_bytes(tensors))

    def spooled(self) -> TensorBlob:
        """This blob as a private file when it is larger than ``SPOOL_BYTES``, else itself."""
        if self.path is not None or len(self.data) <= SPOOL_BYTES:
            return self
        fd, path = tempfile.mkstemp(prefix="loraplex-tensors-", dir=_spool_folder())  # mode 0600
        with os.fdopen(fd, "wb") as file:
            file.write(self.data)
        return TensorBlob(path=path)

    def tensors(self) -> dict[str, torch.Tensor]:
        if self.path is None:
            return parse_safetensors_bytes(bytearray(self.data), "tensors from the API process")[0]
        with open(self.path, "rb") as file:
            data = bytearray(os.fstat(file.fileno()).st_size)
            file.readinto(data)
        os.unlink(self.path)
        return parse_safetensors_bytes(data, "tensors from the API process")[0]


def packed_kwargs(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """A call's keyword arguments with tensor mappings as ``TensorBlob`` s (the sending side; a blob already,
    e.g. an uploaded file's bytes, travels as it is), large ones spooled (``remove_spooled`` once answered)."""
    return {k: (TensorBlob.of(v) if isinstance(v, Mapping) else v).spooled()
            if k == "tensors" and isinstance(v, Mapping | TensorBlob) else v for k, v in kwargs.items()}


def remove_spooled(kwargs: Mapping[str, Any]) -> None:
    """Remove the files of ``packed_kwargs``' spooled blobs that the engine did not read (it died, or refused)."""
    for value in kwargs.values():
        if isinstance(value, TensorBlob) and value.path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(value.path)


def unpacked_kwargs(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """``packed_kwargs`` undone (the engine's side)."""
    return {k: v.tensors() if isinstance(v, TensorBlob) else v for k, v in kwargs.items()}


@dataclass(frozen=True)
class Shutdown:
    pass


@dataclass(frozen=True)
class Accepted:
    request_id: str  # ``AddRequests.key``
    error: BaseException | None  # None: all queued; else why they were refused (none was queued)


@dataclass(frozen=True)
class StepOutputs:
    seconds: float  # the step's wall time
    outputs: list[EngineOutput]
    step_failures: int = 0  # the engine's steps that raised so far, and why the last one did
    last_step_error: str = ""


@dataclass(frozen=True)
class StepFailed:
    request_ids: list[str]  # every request in flight: each ended in the engine
    error: BaseException


@dataclass(frozen=True)
class Reply:
    call_id: int
    result: Any = None
    error: BaseException | None = None
    versions: VersionView | None = None  # the table after a successful call in CHANGES_VERSIONS


STOP_SENDING = object()  # put into an outbox: ``send_batches`` returns once the messages before it are sent


def send_batches(outbox: queue.SimpleQueue[Any], conn: Connection) -> None:
    """Send what ``outbox`` holds, one list of messages per write (whatever queued up while the
    previous write was in flight), until ``STOP_SENDING`` or the other process is gone."""
    while True:
        batch = [outbox.get()]
        while not outbox.empty():
            batch.append(outbox.get())
        done = STOP_SENDING in batch
        batch = [message for message in batch if message is not STOP_SENDING]
        try:
            if batch:
                conn.send(batch)
        except OSError:  # the other process is gone; its reader reports it
            return
        if done:
            return


def portable_output(out: EngineOutput) -> EngineOutput:
    """``out`` with an error that survives pickling."""
    return out if out.error is None else dataclasses.replace(out, error=portable(out.error))


def portable_result(result: Any) -> Any:
    """An engine call's result as it crosses: ``AdapterInfo`` s without their tokenizer object (the
    frontend reads an adapter's own tokenizer from its folder: ``client/tokenizers.py``)."""
    if isinstance(result, AdapterInfo):
        return dataclasses.replace(result, tokenizer=None)
    if isinstance(result, list):
        return [portable_result(item) for item in result]
    return result


def portable(exc: BaseException) -> BaseException:
    """``exc`` if it survives pickling, else a ``LoraplexError`` with its message and HTTP status."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        error = LoraplexError(f"{type(exc).__name__}: {exc}")
        error.http_status = getattr(exc, "http_status", LoraplexError.http_status)
        error.error_type = getattr(exc, "error_type", LoraplexError.error_type)
        return error
