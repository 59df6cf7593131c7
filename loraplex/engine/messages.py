"""What the API process and the engine process say to each other (pickled over one socket pair).

API -> engine: ``Start`` first, then lists of ``AddRequests``, ``Abort``, ``Call`` and ``Shutdown``
(the API side batches whatever queued up while the previous write was in flight).
Engine -> API: ``Ready`` or ``StartFailed`` first, then ``Accepted`` (one per ``AddRequests``),
``StepOutputs`` (one per step), ``StepFailed`` and ``Reply`` (one per ``Call``).

``SamplingParams``, ``RequestOutput``, ``EngineStats`` and ``AdapterInfo`` travel as they are, so
fields added to them flow through unchanged (``AdapterInfo`` without its tokenizer object:
``portable_result``). Outputs are made compact with ``compact``: the same
``RequestOutput`` minus what the API process already holds (the prompt's token ids and the token
ids sent before), so a step's message grows with the batch, not with the requests' lengths.
"""

from __future__ import annotations

import dataclasses
import pickle
import queue
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from loraplex.adapters.info import AdapterInfo
from loraplex.config import EngineConfig
from loraplex.engine.client import EngineInfo
from loraplex.engine.request import NO_TAGS, RequestOutput, RequestTags, SamplingParams
from loraplex.errors import LoraplexError

# Engine methods the API process may call (``Call.method``); anything else is refused.
CALLABLE = frozenset({"load_adapter", "unload_adapter", "list_adapters", "stats", "adapter_snapshot",
                      "tokenizer_table", "route_adapter", "rollback_adapter", "split_adapter", "adapter_versions",
                      "base_fingerprint"})


@dataclass(frozen=True)
class Start:
    config: EngineConfig
    adapters: tuple[tuple[str, str], ...]  # (name, folder) to load before Ready
    log_level: str


@dataclass(frozen=True)
class Ready:
    info: EngineInfo


@dataclass(frozen=True)
class StartFailed:
    error: BaseException


@dataclass(frozen=True)
class AddRequests:
    """Requests admitted together (the choices and prompts of one API request), or none of them."""

    requests: list[tuple[str, list[int], SamplingParams, str | None]]  # (id, prompt token ids, params, adapter)
    tags: RequestTags = NO_TAGS  # tenant, priority, pinned adapter version: the same for all

    @property
    def key(self) -> str:
        """The id its ``Accepted`` answers to: the first request's."""
        return self.requests[0][0]


@dataclass(frozen=True)
class Abort:
    request_id: str


@dataclass(frozen=True)
class Call:
    call_id: int
    method: str  # one of CALLABLE
    args: tuple[Any, ...] = ()


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
    outputs: list[RequestOutput]  # compact (see ``compact``)
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


def compact(out: RequestOutput, already_sent: int | None) -> RequestOutput:
    """``out`` without its prompt token ids and the token ids (and their logprobs) of the outputs sent
    before (``already_sent`` tokens; None: this is the request's first output). Prompt logprobs are
    complete by a request's first output (they are computed by its prefill) and sent only with it."""
    sent = already_sent or 0
    return dataclasses.replace(
        out, prompt_token_ids=[], token_ids=out.token_ids[sent:],
        logprobs=None if out.logprobs is None else out.logprobs[sent:],
        prompt_logprobs=out.prompt_logprobs if already_sent is None else None,
        error=None if out.error is None else portable(out.error))


def portable_result(result: Any) -> Any:
    """An engine call's result as it crosses: ``AdapterInfo`` s without their tokenizer object (the API
    side reads an adapter's own tokenizer from its folder: ``engine/tokenizers.py``)."""
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
