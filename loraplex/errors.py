"""Typed errors. Each message names the file, the field and the limit that was violated.

The server maps these to HTTP statuses through ``http_status``; the offline API raises them as is.
"""

from __future__ import annotations


class LoraplexError(Exception):
    """Base of every error loraplex raises on purpose."""

    http_status = 500
    error_type = "internal_error"


class AdapterError(LoraplexError):
    """Base of every adapter problem: bad folder, bad name, bad state."""

    http_status = 400
    error_type = "invalid_request_error"


class AdapterNotFound(AdapterError):
    """No adapter folder, or no ``adapter_config.json`` in it."""

    http_status = 404
    error_type = "not_found_error"


class InvalidAdapter(AdapterError):
    """The folder exists but its config or tensors cannot be served."""


class AdapterRankTooLarge(InvalidAdapter):
    """A module's rank exceeds ``max_lora_rank``."""


class UnsupportedAdapter(InvalidAdapter):
    """A PEFT feature loraplex does not serve (bias, modules_to_save of other modules, pickles, ...)."""


class AdapterShapeMismatch(InvalidAdapter):
    """A tensor's shape does not match the base model's layer."""


class AdapterOverflow(InvalidAdapter):
    """Finite adapter weights large enough that a float32 step could overflow; the message names the module,
    the bound (``adapters/reading/overflow_bound.py``) and the measured value."""


class InvalidAdapterName(AdapterError):
    """An adapter name outside the documented pattern (``adapters/names.py``); ``param`` names the field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param

    def __reduce__(self) -> tuple:  # survives pickling across the engine process's socket
        return type(self), (str(self), self.param)


class ForbiddenAdapterPath(AdapterError):
    """An adapter file that resolves (after symlinks) outside the allowed roots, or is not a regular file
    (a FIFO, a device, a directory): it is never opened."""

    http_status = 403
    error_type = "permission_error"


class AdapterAlreadyLoaded(AdapterError):
    """``load_adapter`` with a name that is already registered."""

    http_status = 409
    error_type = "conflict_error"


class UnknownAdapter(AdapterError):
    """A request or unload named an adapter that is not registered."""

    http_status = 404
    error_type = "not_found_error"


class AdapterContentChanged(AdapterError):
    """An adapter evicted from host memory was re-read and its content hash no longer matches."""

    http_status = 409
    error_type = "conflict_error"


class AdapterVersionConflict(AdapterError):
    """A version operation the name's held versions do not allow (a rollback with no older version)."""

    http_status = 409
    error_type = "conflict_error"


class AdapterPinLimit(AdapterError):
    """Pinning one more adapter would leave no device slot for the others (at most ``max_loras - 1`` pinned)."""

    http_status = 409
    error_type = "conflict_error"


class AdapterMemoryBudgetExceeded(AdapterError):
    """Loading the adapter would pass the memory budget for saved vocabulary rows."""

    http_status = 507
    error_type = "insufficient_storage_error"


class EngineUnavailable(LoraplexError):
    """The engine cannot serve: it is not started, it is shutting down, or its process died."""

    http_status = 503
    error_type = "service_unavailable"


class QueueFull(EngineUnavailable):
    """The engine's waiting queue is full (``EngineConfig.max_waiting_requests``); the server answers 503
    with a ``Retry-After`` of ``retry_after`` seconds."""

    def __init__(self, message: str, retry_after: int = 1) -> None:
        super().__init__(message)
        self.retry_after = retry_after

    def __reduce__(self) -> tuple:  # survives pickling across the engine process's socket
        return type(self), (str(self), self.retry_after)


class RequestTimedOut(LoraplexError):
    """A request ran past the server's ``--request-timeout``; it was aborted in the engine."""

    http_status = 504
    error_type = "timeout_error"


class EngineStepFailed(LoraplexError):
    """An engine step raised while running this request (a fault in the model's forward pass, NaN logits
    from a broken slot write...): the requests of that step fail with it; every other request keeps running."""


class ModelError(LoraplexError):
    """The base model cannot be found, converted or built (e.g. an unsupported architecture)."""


class RequestError(LoraplexError):
    """A malformed generation request; ``param`` names the offending field."""

    http_status = 400
    error_type = "invalid_request_error"

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param
