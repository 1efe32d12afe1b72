"""Where traces go: the OpenTelemetry SDK pipeline the standard ``OTEL_*`` variables describe, off unless
they name an exporter.

Tracing is on when ``OTEL_TRACES_EXPORTER`` names ``otlp`` and/or ``console``, or, unset, when an OTLP
endpoint is given (``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``, or ``OTEL_EXPORTER_OTLP_ENDPOINT`` + /v1/traces);
``none`` or ``OTEL_SDK_DISABLED=true`` keep it off. OTLP goes over HTTP/protobuf (the only protocol
installed); the SDK and its exporter read the rest themselves: ``OTEL_EXPORTER_OTLP_*`` headers, timeout,
compression and certificates, ``OTEL_BSP_*`` (the batch span processor's schedule), ``OTEL_SERVICE_NAME``
and ``OTEL_RESOURCE_ATTRIBUTES`` (service.name defaults to ``inferd``). ``OTEL_TRACES_SAMPLER`` (and
``_ARG``) choose the sampler, with one rule added: a batch's span is recorded whenever a request it serves
is (``LinkedSampler``), whatever the sampler would decide for a root span. A value it cannot use stops
start-up (``TracingConfigError``), as an invalid inferd setting does: tracing asked for and silently
absent is worse than a clear refusal.

This module imports the SDK; the server imports it at start-up only (server/__init__.py), so the request
path never touches it, and with tracing off nothing of it is built.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Mapping, Sequence

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter
from opentelemetry.sdk.trace.sampling import (
    ALWAYS_OFF,
    ALWAYS_ON,
    DEFAULT_OFF,
    DEFAULT_ON,
    Decision,
    ParentBasedTraceIdRatio,
    Sampler,
    SamplingResult,
    TraceIdRatioBased,
)
from opentelemetry.trace import Link, SpanKind
from opentelemetry.util.types import Attributes

from inferd import __version__
from inferd.utils import tracing

log = logging.getLogger(__name__)

# Seconds the exit may wait for the last spans to leave (a collector that is down must not hold the
# shutdown, which has to fit in server.drain_timeout_s + 5 s).
FLUSH_AT_EXIT_S = 2.0
_EXPORTERS = ("otlp", "console")
_FIXED_SAMPLERS = {"always_on": ALWAYS_ON, "always_off": ALWAYS_OFF, "parentbased_always_on": DEFAULT_ON,
                   "parentbased_always_off": DEFAULT_OFF}
_RATIO_SAMPLERS = {"traceidratio": TraceIdRatioBased, "parentbased_traceidratio": ParentBasedTraceIdRatio}


class TracingConfigError(Exception):
    """An ``OTEL_*`` value this server cannot use; the message names the variable."""


class LinkedSampler(Sampler):
    """``base``, except that a root span linked to a sampled span is sampled: a batch is recorded whenever
    a request it served is (only then does core/worker.py make its span at all)."""

    def __init__(self, base: Sampler) -> None:
        self.base = base

    def should_sample(self, parent_context: Context | None, trace_id: int, name: str,
                      kind: SpanKind | None = None, attributes: Attributes = None,
                      links: Sequence[Link] | None = None, trace_state: trace.TraceState | None = None,
                      ) -> SamplingResult:
        if links and any(link.context.trace_flags.sampled for link in links) and \
                not trace.get_current_span(parent_context).get_span_context().is_valid:
            return SamplingResult(Decision.RECORD_AND_SAMPLE, attributes)
        return self.base.should_sample(parent_context, trace_id, name, kind, attributes, links, trace_state)

    def get_description(self) -> str:
        return f"LinkedSampler{{{self.base.get_description()}}}"


def exporter_names(environ: Mapping[str, str]) -> list[str]:
    """The exporters ``OTEL_*`` asks for; [] = tracing off."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return []
    listed = environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    names = [n.strip() for n in listed.split(",") if n.strip()]
    if not names:
        # The specification's default is otlp; here an endpoint is the sign that traces are wanted.
        endpoint = environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        return ["otlp"] if endpoint else []
    if "none" in names:
        return []
    unknown = [n for n in names if n not in _EXPORTERS]
    if unknown:
        raise TracingConfigError(f"OTEL_TRACES_EXPORTER: {', '.join(unknown)} is not available here; "
                                 f"use {', '.join(_EXPORTERS)} or none")
    return list(dict.fromkeys(names))


def sampler_from(environ: Mapping[str, str]) -> Sampler:
    name = environ.get("OTEL_TRACES_SAMPLER", "parentbased_always_on").strip().lower()
    if name in _FIXED_SAMPLERS:
        return _FIXED_SAMPLERS[name]
    if name not in _RATIO_SAMPLERS:
        raise TracingConfigError(f"OTEL_TRACES_SAMPLER: {name!r} is not one of "
                                 f"{', '.join([*_FIXED_SAMPLERS, *_RATIO_SAMPLERS])}")
    arg = environ.get("OTEL_TRACES_SAMPLER_ARG", "1.0").strip()
    try:
        ratio = float(arg)
    except ValueError:
        ratio = -1.0
    if not 0.0 <= ratio <= 1.0:
        raise TracingConfigError(f"OTEL_TRACES_SAMPLER_ARG: {arg!r} is not a ratio from 0 to 1")
    return _RATIO_SAMPLERS[name](ratio)


def _protocol(environ: Mapping[str, str]) -> None:
    for name in ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"):
        value = environ.get(name, "").strip().lower()
        if value:
            if value != "http/protobuf":
                raise TracingConfigError(f"{name}: {value!r} is not available here; use http/protobuf")
            return


def resource() -> Resource:
    """OTEL_SERVICE_NAME / OTEL_RESOURCE_ATTRIBUTES as the SDK reads them; service.name ``inferd`` otherwise."""
    detected = Resource({"service.version": __version__}).merge(Resource.create())
    if str(detected.attributes.get("service.name", "")).startswith("unknown_service"):
        detected = detected.merge(Resource({"service.name": "inferd"}))
    return detected


def build_provider(sampler: Sampler = DEFAULT_ON) -> TracerProvider:
    """inferd's provider, with no span processor yet: ``sampler`` with the batch rule, and the resource.

    Not the shutdown the SDK registers at exit (unbounded): ``shutdown_tracing`` bounds it.
    """
    return TracerProvider(sampler=LinkedSampler(sampler), resource=resource(), shutdown_on_exit=False)


def configure_tracing(environ: Mapping[str, str] = os.environ) -> TracerProvider | None:
    """Install the provider ``OTEL_*`` describes (``tracing.install``); None, and nothing built, when off."""
    names = exporter_names(environ)
    if not names:
        return None
    sampler = sampler_from(environ)
    exporters: list[SpanExporter] = []
    if "otlp" in names:
        _protocol(environ)
        # Imported only when used: it brings requests and protobuf.
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        exporters.append(OTLPSpanExporter())  # endpoint, headers, timeout, ... from OTEL_EXPORTER_OTLP_*
    if "console" in names:
        exporters.append(ConsoleSpanExporter())  # stdout; the logs are on stderr
    provider = build_provider(sampler)
    for exporter in exporters:
        provider.add_span_processor(BatchSpanProcessor(exporter))  # OTEL_BSP_* set its schedule
    tracing.install(provider)
    log.info("tracing on: %s, sampler %s, service %s", ", ".join(names), sampler.get_description(),
             provider.resource.attributes.get("service.name"))
    return provider


def shutdown_tracing(timeout_s: float = FLUSH_AT_EXIT_S) -> None:
    """Tracing off; the spans still buffered are exported, for at most ``timeout_s``."""
    provider = tracing.uninstall()
    if provider is None or not hasattr(provider, "shutdown"):
        return
    flush = threading.Thread(target=provider.shutdown, name="inferd-trace-flush", daemon=True)
    flush.start()
    flush.join(timeout_s)
    if flush.is_alive():
        log.warning("spans not exported within %g s of the exit were dropped", timeout_s)
