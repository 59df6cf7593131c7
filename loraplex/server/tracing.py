"""OpenTelemetry traces of requests (``loraplex serve --otlp-traces-endpoint URL``), exported over OTLP/HTTP
protobuf by the OpenTelemetry SDK (``pip install loraplex[otel]``); off by default, and then nothing here is
imported.

One span per request (``SpanKind.SERVER``), recorded when the request ends with the instants it passed:
its parent is the caller's W3C ``traceparent`` when one came. Children, in order: ``preparation`` (HTTP
arrival to submission: parsing, template, tokenization), ``queue`` (engine arrival to first admission),
``prefill`` (admission to the first token drawn), ``decode`` (first token to the request's end); events
``first_token`` and ``finish``. Queue, prefill and first-token instants are the engine's own
(``EngineTimes``: ``time.time()`` in the engine's process, carried with the outputs), the others the API's.
Attributes follow the GenAI semantic conventions plus ``loraplex.adapter``, ``loraplex.adapter_version``,
``loraplex.tenant`` and ``loraplex.prefix_cached_tokens``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from loraplex.client.output import RequestOutput


@dataclass(frozen=True)
class TracedRequest:
    """What one ended request's span says (instants in Unix nanoseconds)."""

    operation: str  # "chat" | "text_completion"
    model: str  # the ``model`` the client sent
    adapter: str | None  # the adapter version's name (None: the base model)
    adapter_version: str  # ``v<id>`` or ``base``
    tenant: str | None
    arrived_ns: int
    submitted_ns: int
    ended_ns: int
    max_tokens: int | None
    outputs: tuple[RequestOutput, ...]  # each choice's final output (empty when it did not finish)
    status: str


def _ns(seconds: float | None) -> int | None:
    return None if seconds is None else int(seconds * 1e9)


class RequestTracer:
    """Exports one span tree per request to ``endpoint`` (OTLP/HTTP protobuf, e.g.
    ``http://collector:4318/v1/traces``), batched in the SDK's background thread."""

    def __init__(self, endpoint: str, service_name: str = "loraplex") -> None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self._provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        self._provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint),
                                                             schedule_delay_millis=200))
        self._tracer = self._provider.get_tracer("loraplex")
        self._propagator = TraceContextTextMapPropagator()

    def record(self, headers: Mapping[str, str], req: TracedRequest) -> None:
        from opentelemetry import trace

        parent = self._propagator.extract(dict(headers))
        root = self._tracer.start_span(f"{req.operation} {req.model}", context=parent, kind=trace.SpanKind.SERVER,
                                       start_time=req.arrived_ns, attributes=_attributes(req))
        inside = trace.set_span_in_context(root)
        times = next((o.times for o in req.outputs if o.times is not None), None)
        marks = [("preparation", req.arrived_ns, req.submitted_ns)]
        if times is not None:
            queued, scheduled, first = _ns(times.arrival), _ns(times.scheduled), _ns(times.first_token)
            marks += [("queue", queued, scheduled), ("prefill", scheduled, first), ("decode", first, req.ended_ns)]
            if first is not None:
                root.add_event("first_token", timestamp=first)
        for name, start, end in marks:
            if start is not None and end is not None:
                self._tracer.start_span(name, context=inside, start_time=start).end(end_time=max(start, end))
        root.add_event("finish", {"gen_ai.response.finish_reasons": _reasons(req)}, timestamp=req.ended_ns)
        root.end(end_time=req.ended_ns)

    def shutdown(self) -> None:
        self._provider.shutdown()


def _reasons(req: TracedRequest) -> list[str]:
    return [o.finish_reason or "unknown" for o in req.outputs] or [req.status]


def _attributes(req: TracedRequest) -> dict[str, str | int | list[str]]:
    first = req.outputs[0] if req.outputs else None
    attributes: dict[str, str | int | list[str]] = {
        "gen_ai.operation.name": req.operation, "gen_ai.system": "loraplex", "gen_ai.request.model": req.model,
        "gen_ai.response.finish_reasons": _reasons(req), "loraplex.adapter": req.adapter or "base",
        "loraplex.adapter_version": req.adapter_version, "loraplex.tenant": req.tenant or "none",
        "loraplex.status": req.status}
    if req.max_tokens is not None:
        attributes["gen_ai.request.max_tokens"] = req.max_tokens
    if first is not None:
        attributes["gen_ai.usage.input_tokens"] = sum(len(o.prompt_token_ids) for o in req.outputs)
        attributes["gen_ai.usage.output_tokens"] = sum(len(o.token_ids) for o in req.outputs)
        attributes["loraplex.prefix_cached_tokens"] = first.times.prefix_cached_tokens if first.times else 0
    return attributes
