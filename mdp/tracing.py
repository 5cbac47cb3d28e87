"""OpenTelemetry spans for requests that carry a W3C trace context (docs/mdp.md, "Deadlines,
cancellation and trace context"), made only where ``opentelemetry-api`` is installed (the
``otel`` extra): the client's call, the broker's queue wait and the worker's handler, linked
into one trace.  Without it a request still carries the trace context it came with."""

from __future__ import annotations

from time import monotonic
from typing import Any, Optional

from twisted.python.failure import Failure

_UNSET: Any = object()
_api: Any = _UNSET  # opentelemetry.trace, or None where it is not installed
_cached: tuple[Any, Any] = (None, None)  # (the tracer provider, its "mdp" tracer or None)
_lookedAt = -1e18  # (time.monotonic)

Trace = Optional[tuple[bytes, Optional[bytes]]]  # (traceparent, tracestate)


def available() -> bool:
    """opentelemetry-api is installed (looked up once)."""
    global _api
    if _api is _UNSET:
        try:
            from opentelemetry import trace
        except ImportError:
            _api = None
        except OSError:  # (out of descriptors, say: looked up again next time)
            return False
        else:
            _api = trace
    return _api is not None


def tracer() -> Any:
    """The ``mdp`` tracer of the tracer provider an application configured; None without
    opentelemetry or before a provider is set (spans would go nowhere; looked again at most
    once a second, as a request's path asks it)."""
    global _cached, _lookedAt
    now = monotonic()
    if now - _lookedAt < 1.0:
        return _cached[1]
    _lookedAt = now
    if not available():
        return None
    provider = _api.get_tracer_provider()
    if provider is not _cached[0]:
        found = None if isinstance(provider, _api.ProxyTracerProvider) else provider.get_tracer("mdp")
        _cached = (provider, found)
    return _cached[1]


def reset() -> None:
    """Look for the tracer provider again at the next request (an application that sets one
    after its first requests may call this; else it is found within a second)."""
    global _lookedAt
    _lookedAt = -1e18


def _named(what: str, service: bytes) -> tuple[str, dict[str, str]]:
    """A span's name and attributes, for *what* is done for *service*."""
    name = service.decode("ascii", "replace")
    return f"mdp.{what} {name}", {"rpc.system": "mdp", "rpc.service": name}


def _carrier(trace: Trace) -> dict[str, str]:
    if trace is None:
        return {}
    carrier = {"traceparent": trace[0].decode("ascii")}
    if trace[1] is not None:
        carrier["tracestate"] = trace[1].decode("ascii")
    return carrier


def parent_context(trace: Trace) -> Any:
    """The OpenTelemetry context whose parent span *trace* names."""
    from opentelemetry.propagate import extract

    return extract(_carrier(trace))


def injected(span: Any) -> Trace:
    """*span*'s trace context, as a request carries it."""
    from opentelemetry import trace as api
    from opentelemetry.propagate import inject

    carrier: dict[str, str] = {}
    inject(carrier, context=api.set_span_in_context(span))
    parent = carrier.get("traceparent")
    if parent is None:
        return None
    state = carrier.get("tracestate")
    return parent.encode("ascii"), None if state is None else state.encode("ascii")


def start_client_span(service: bytes) -> tuple[Any, Trace]:
    """A span for a call to *service*, child of the current one, and its trace context; or
    (None, the trace context of the request a handler serves) without opentelemetry."""
    found = tracer()
    if found is None:
        from mdp.handlers import serving_trace

        return None, serving_trace()
    from opentelemetry.trace import SpanKind

    name, attributes = _named("request", service)
    span = found.start_span(name, kind=SpanKind.CLIENT, attributes=attributes)
    return span, injected(span)


def ended(result: Any, span: Any) -> Any:
    """A Deferred's callback: end *span* (failed, with a failure), pass the result on."""
    end_span(span, getattr(result, "value", None) if isinstance(result, Failure) else None)
    return result


def end_span(span: Any, error: Optional[BaseException] = None) -> None:
    """End *span*, marked failed with *error* if given."""
    if error is not None:
        from opentelemetry.trace import Status, StatusCode

        span.record_exception(error)
        span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"))
    span.end()


def record_queue_span(service: bytes, trace: Trace, arrivedAt: float, assignedAt: float) -> None:
    """A finished span for the time a request of *service* waited in the broker's queue."""
    found = tracer()
    if found is None or trace is None:
        return
    name, attributes = _named("queue", service)
    span = found.start_span(name, context=parent_context(trace), start_time=int(arrivedAt * 1e9),
                            attributes=attributes)
    span.end(end_time=int(assignedAt * 1e9))


def start_handler_span(service: bytes, trace: Trace) -> tuple[Any, Any]:
    """A span for a handler serving a request of *service* that came with *trace*, made the
    current one: (span, token to detach), or (None, None) without opentelemetry or a trace."""
    found = None if trace is None else tracer()
    if found is None:
        return None, None
    from opentelemetry import context as api
    from opentelemetry import trace as traces
    from opentelemetry.trace import SpanKind

    name, attributes = _named("handle", service)
    span = found.start_span(name, kind=SpanKind.SERVER, context=parent_context(trace),
                            attributes=attributes)
    return span, api.attach(traces.set_span_in_context(span))


def detach(token: Any) -> None:
    from opentelemetry import context as api

    api.detach(token)
