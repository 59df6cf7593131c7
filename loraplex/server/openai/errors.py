"""Every error the server sends uses OpenAI's body: ``{"error": {message, type, param, code}}``.

loraplex errors carry their own ``http_status`` and ``error_type``; FastAPI's validation errors
(wrong types, missing fields, malformed JSON) become 400 with the offending field in ``param``;
an unexpected exception is logged and becomes a 500 that reveals nothing but its class name; a path no
route serves is a 404 saying loraplex does not implement that endpoint (``code``
``"endpoint_not_implemented"``).
"""

from __future__ import annotations

import logging
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from loraplex.errors import LoraplexError

logger = logging.getLogger(__name__)

_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable",
}
RETRY_AFTER_503_S = 1  # every 503 says when to come back (a cause that knows better sets its own)


NOT_IMPLEMENTED = "endpoint_not_implemented"  # the ``code`` of an endpoint loraplex does not serve


def error_body(message: str, error_type: str, param: str | None = None, code: int | str | None = None) -> dict:
    """OpenAI's error body."""
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


class ServerError(Exception):
    """An error raised by the HTTP layer itself (auth, path policy), with its status and param."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.param = param
        self.headers = headers or {}  # e.g. a 429's Retry-After


def error_response(status: int, message: str, param: str | None = None,
                   error_type: str | None = None) -> JSONResponse:
    error_type = error_type or _TYPE_BY_STATUS.get(status, "internal_error" if status >= 500 else "error")
    response = JSONResponse(error_body(message, error_type, param, status), status_code=status)
    if status == 503:
        response.headers["Retry-After"] = str(RETRY_AFTER_503_S)
    return response


def not_implemented(method: str, path: str) -> JSONResponse:
    """The 404 of an endpoint loraplex does not serve (OpenAI's body; ``code`` a string, as OpenAI's)."""
    message = (f"{method} {path} is not implemented by loraplex: it serves no such endpoint "
               "(see /openapi.json for the endpoints it serves)")
    return JSONResponse(error_body(message, "not_found_error", None, NOT_IMPLEMENTED), status_code=404)


def loraplex_error_response(exc: LoraplexError) -> JSONResponse:
    """``exc`` 's status and body; an error that says when to come back (``QueueFull``) adds ``Retry-After``."""
    response = error_response(exc.http_status, str(exc), getattr(exc, "param", None), exc.error_type)
    if getattr(exc, "retry_after", None) is not None:
        response.headers["Retry-After"] = str(exc.retry_after)
    return response


def loraplex_error_event(exc: LoraplexError) -> dict:
    """The body sent as a server-sent event when a streamed request fails after its headers."""
    return error_body(str(exc), exc.error_type, getattr(exc, "param", None), exc.http_status)


def _validation_param(exc: RequestValidationError) -> tuple[str | None, str]:
    """(field, message) of the first validation error; malformed JSON has no field."""
    errors = exc.errors()
    if not errors:
        return None, "invalid request body"
    first = errors[0]
    if first.get("type") == "json_invalid":
        return None, f"the request body is not valid JSON: {first.get('ctx', {}).get('error', first['msg'])}"
    # loc = ("body", field, ...); a body that is a union of models adds the member's class name first
    # (``("body", "TokenizeChatRequest", "messages")``): the field is the first snake_case name.
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    field = next((p for p in loc if not p[:1].isupper()), None)
    if field is None and first.get("type") in ("model_attributes_type", "model_type", "dict_type"):
        return None, "the request body must be a JSON object"
    where = ".".join(loc) or "body"
    return field, f"{where}: {first['msg']}"


_HTTP_METHODS = ("DELETE", "GET", "HEAD", "OPTIONS", "PATCH", "POST", "PUT")


def _allowed_methods(request: Request) -> list[str]:
    """Every method some route fully matches at this path. Starlette's own 405 names only the first
    partly matching route's methods, which is wrong where one path has a route per method."""
    return [method for method in _HTTP_METHODS
            if any(route.matches({**request.scope, "method": method})[0] is Match.FULL
                   for route in request.app.routes)]


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(LoraplexError)
    async def _loraplex(_: Request, exc: LoraplexError) -> JSONResponse:
        return loraplex_error_response(exc)

    @app.exception_handler(ServerError)
    async def _server(_: Request, exc: ServerError) -> JSONResponse:
        response = error_response(exc.status, str(exc), exc.param)
        response.headers.update(exc.headers)
        return response

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        param, message = _validation_param(exc)
        return error_response(400, message, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404 and exc.detail == HTTPStatus.NOT_FOUND.phrase:  # no route matched
            return not_implemented(request.method, request.url.path)
        message = exc.detail if isinstance(exc.detail, str) else HTTPStatus(exc.status_code).phrase
        response = error_response(exc.status_code, message)
        response.headers.update(exc.headers or {})
        if exc.status_code == 405:
            response.headers["Allow"] = ", ".join(_allowed_methods(request))
        return response

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unexpected error serving %s %s", request.method, request.url.path)
        return error_response(500, f"internal server error ({type(exc).__name__})")
