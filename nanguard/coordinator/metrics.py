"""The coordinator's Prometheus series, and the HTTP endpoint that serves them.

Label values are only ranks (decimal strings), event kinds (``protocol.KINDS``), stop reasons and
bad-message reasons from fixed lists: never a step, a layer or other free text. The one exception,
``nanguard_transient_events_total{host,device}``, names where a re-run of a bad step was clean
(the suspect GPU or host): its values are what the job's own ranks say of themselves (printable, cut at
``MAX_LABEL_LENGTH``), and at most ``4 x world size`` (host, device) pairs are ever kept (``4096``
when no world size is known); the pairs past that are counted under host="other", device="other".

``nanguard_stops_total{reason}`` counts each job's stop once, when the coordinator first learns
of it: from its own policy (``nonfinite`` when the policy is the default stop at the first
non-finite step, ``policy`` for a threshold), an operator (``operator``), or a rank's
``stopped`` report (its reason) when the coordinator had not decided yet. Later reports of the
same stop, from every other rank, are not counted again.

The series with a label per rank (or per host and device) are not prometheus_client children but
tables (``series.py``): at 16,384 ranks children would hold tens of MB that the rank table already
has, and ``/metrics`` writes their lines itself (``exposition``), ten times faster than
prometheus_client's writer would.
"""

from __future__ import annotations

import gzip
import logging
import posixpath
import socket
import threading
import time
from collections.abc import Callable
from http.server import ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlparse

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.exposition import MetricsHandler, choose_encoder
from prometheus_client.metrics_core import Metric

from .._text import printable
from ..protocol import BAD_MESSAGE_REASONS, STOP_KINDS, STOP_REASONS
from .series import CounterTable, RankGauges, TableFamily

_MAX_INCIDENTS = 65536
MAX_LABEL_LENGTH = 128
"""the longest host or device label value of ``nanguard_transient_events_total``"""
TRANSIENT_PAIRS_PER_RANK = 4
"""(host, device) label pairs kept per rank of the world size (restarts move ranks to other devices)"""
TRANSIENT_PAIRS_UNKNOWN_WORLD = 4096
"""the pairs kept when no world size is known"""
OTHER = "other"
IDLE_TIMEOUT_S = 5.0
"""a /metrics connection that sends nothing this long is closed"""
MAX_CONNECTIONS = 32
"""/metrics connections served at once; more are closed when accepted"""
DROP_REASONS = ("full", "gone")
"""why a message to a peer was dropped unsent (``nanguard_replies_dropped_total{reason}``)"""
"""the host and device label values the pairs past the cap are counted under"""

log = logging.getLogger("nanguard.coordinator")


class Metrics:
    """Every series of one coordinator, registered in ``registry``."""

    def __init__(self, registry: CollectorRegistry, version: str = ""):
        def counter(name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
            return Counter(name, doc, labels, registry=registry)

        def gauge(name: str, doc: str, labels: tuple[str, ...] = ()) -> Gauge:
            return Gauge(name, doc, labels, registry=registry)

        def table(name: str, doc: str, labels: tuple[str, ...]) -> CounterTable:
            family = CounterTable(name, doc, labels)
            registry.register(family)
            return family

        self.nonfinite_events = table(
            "nanguard_nonfinite_events_total", "Non-finite events reported by ranks", ("kind", "rank"))
        self.warning_events = table(
            "nanguard_warning_events_total", "Warning events (gradient norm, spike) reported by ranks",
            ("kind", "rank"))
        self.evaluation_events = table(
            "nanguard_evaluation_events_total",
            "Non-finite events of evaluations (forwards with autograd off between training steps); they never stop a job",
            ("kind", "rank"))
        self.transient_events = table(
            "nanguard_transient_events_total",
            "Events that a re-run of the bad step put on the rank's device or host (reproduced false, or "
            "verdict device or transient): suspect that GPU or host", ("host", "device"))
        self.stops = counter("nanguard_stops_total", "Job stops, one per job, by why", ("reason",))
        self.bad_messages = counter("nanguard_bad_messages_total", "Messages dropped as bad")
        self.bad_reasons = counter(
            "nanguard_bad_message_reasons_total", "Messages dropped as bad, by why", ("reason",))
        self.incidents = counter("nanguard_incidents_total", "Distinct incidents captured by ranks")
        self.events_dropped = table(
            "nanguard_events_dropped_total", "Events a rank dropped before sending (queue full)", ("rank",))
        self.ranks_alive = gauge("nanguard_ranks_alive", "Ranks heard from recently and not finished")
        self.ranks_registered = gauge("nanguard_ranks_registered", "Ranks known in the current job")
        self.ranks_finished = gauge("nanguard_ranks_finished",
                                    "Ranks of the current job that said a clean goodbye")
        self.ranks_failed = gauge("nanguard_ranks_failed",
                                  "Ranks of the current job whose process ended by an error (unclean goodbye)")
        self.ranks_stalled = gauge(
            "nanguard_ranks_stalled", "Alive ranks whose step has not advanced for the stall time")
        self.job_stopped = gauge("nanguard_job_stopped", "1 once the current job has stopped")
        self.rank_gauges = RankGauges()
        """nanguard_rank_step{rank} and the other gauges of ``series.RANK_GAUGES``: read from the rank
        table (``RankTable`` has it follow its rows)"""
        registry.register(self.rank_gauges)
        gauge("nanguard_coordinator_start_time_seconds", "When the coordinator started").set(time.time())
        gauge("nanguard_build_info", "nanguard version of the coordinator", ("version",)).labels(version).set(1)
        for reason in STOP_REASONS:
            self.stops.labels(reason)
        for reason in BAD_MESSAGE_REASONS:
            self.bad_reasons.labels(reason)
        self._own_health(counter)
        self._incident_ids: set[str] = set()

    def _own_health(self, counter: Callable[[str, str, tuple[str, ...]], Counter]) -> None:
        """The series of the coordinator's own troubles (what it could not send, log or keep)."""
        self.replies_dropped = counter(
            "nanguard_replies_dropped_total", "Messages to a peer (replies, stop copies) dropped unsent: its "
            "queue was full as it does not read (full), or its connection was gone (gone)", ("reason",))
        for reason in DROP_REASONS:
            self.replies_dropped.labels(reason)
        self._said_full = False
        self.log_errors = counter(
            "nanguard_log_errors_total", "Failed writes, syncs and rotations of the event log and the state "
            "file (the coordinator goes on; the lines of a failed write are not in the log)", ())

    def events(self, counts: dict[tuple[str, int], int], evaluation: bool = False) -> None:
        """Add one batch's events, counted by (kind, rank); ``evaluation``: an evaluation's."""
        for (kind, rank), count in counts.items():
            family = self.evaluation_events if evaluation else (
                self.nonfinite_events if kind in STOP_KINDS else self.warning_events)
            family.inc((kind, rank), count)

    def transient(self, host: str, device: str, count: int = 1, *, world_size: int | None = None) -> None:
        """``count`` events of ``host``'s ``device`` that a re-run did not reproduce. Label values
        are made printable and cut; past ``TRANSIENT_PAIRS_PER_RANK x world_size`` distinct pairs
        (kept across jobs, as the series are) the rest count under ``OTHER``."""
        pair = (_label(host), _label(device))
        if pair not in self.transient_events:
            cap = (TRANSIENT_PAIRS_PER_RANK * world_size if world_size is not None and world_size > 0
                   else TRANSIENT_PAIRS_UNKNOWN_WORLD)
            if len(self.transient_events) - ((OTHER, OTHER) in self.transient_events) >= cap:
                pair = (OTHER, OTHER)
        self.transient_events.inc(pair, count)

    def stop(self, reason: str) -> None:
        if reason not in STOP_REASONS:
            raise ValueError(f"stop reason {reason!r} is not one of {', '.join(STOP_REASONS)}")
        self.stops.labels(reason).inc()
        self.job_stopped.set(1)

    def bad_message(self, reason: str) -> None:
        if reason not in BAD_MESSAGE_REASONS:
            raise ValueError(f"bad-message reason {reason!r} is not one of {', '.join(BAD_MESSAGE_REASONS)}")
        self.bad_messages.inc()
        self.bad_reasons.labels(reason).inc()

    def replies_dropped_now(self, *, full: int, gone: int) -> None:
        """Messages dropped unsent: ``full`` to peers that do not read (said once, in the log too),
        ``gone`` to connections that closed (a dead rank's stop copies: normal)."""
        if full:
            if not self._said_full:  # (said before it is counted: whoever sees the count can read why)
                self._said_full = True
                log.warning("a peer does not read what the coordinator sends it: what is sent past the few "
                            "messages queued per connection is dropped and counted in "
                            "nanguard_replies_dropped_total{reason=\"full\"} (said once)")
            self.replies_dropped.labels("full").inc(full)
        if gone:
            self.replies_dropped.labels("gone").inc(gone)

    def incident(self, path: str) -> None:
        """A rank captured into ``path``; every rank of one incident names the same folder."""
        incident_id = posixpath.basename(posixpath.normpath(path.replace("\\", "/")))
        if incident_id in self._incident_ids:
            return
        if len(self._incident_ids) < _MAX_INCIDENTS:
            self._incident_ids.add(incident_id)
        self.incidents.inc()

    def dropped(self, rank: int, increase: int) -> None:
        """A rank dropped ``increase`` more events before sending them (its heartbeat's running count
        grew: ``RankTable.heartbeat``)."""
        self.events_dropped.inc((rank,), increase)

    def ranks(self, *, registered: int, alive: int, stalled: int, finished: int = 0, failed: int = 0) -> None:
        self.ranks_registered.set(registered)
        self.ranks_alive.set(alive)
        self.ranks_stalled.set(stalled)
        self.ranks_finished.set(finished)
        self.ranks_failed.set(failed)

    def new_job(self) -> None:
        """A new job starts: it has not been stopped. (Its ranks' gauges are the rank table's, emptied
        with it; counters keep counting across jobs.)"""
        self.job_stopped.set(0)


def _label(text: str) -> str:
    """A host or device as a label value: printable, at most MAX_LABEL_LENGTH characters, never
    empty ("unknown": an empty value would read as no label at all)."""
    text = printable(text)[:MAX_LABEL_LENGTH]
    return text or "unknown"


class MetricsServer:
    """``/metrics`` over HTTP on ``host:port`` (port 0: a free one; see ``url``).

    Each connection is served by a thread of its own, so that a slow scrape does not hold up the
    next; a connection that sends nothing for ``idle_timeout_s`` is closed, and past
    ``max_connections`` at once a new one is closed as soon as it is accepted: idle sockets cannot
    take every thread and descriptor of the process (the ZeroMQ side needs them to reach the ranks).
    """

    def __init__(self, registry: CollectorRegistry, host: str = "127.0.0.1", port: int = 0, *,
                 idle_timeout_s: float = IDLE_TIMEOUT_S, max_connections: int = MAX_CONNECTIONS):
        handler = type("NanguardMetricsHandler", (_Handler,), {"registry": registry, "timeout": idle_timeout_s})
        family, address = _listen_address(host, port)
        self._httpd = _BoundedHTTPServer(family, address, handler, max_connections)
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="nanguard-metrics", daemon=True)
        self._thread.start()
        bound_host, self.port = self._httpd.server_address[:2]
        shown = f"[{bound_host}]" if ":" in bound_host else bound_host
        self.url = f"http://{shown}:{self.port}/metrics"

    def close(self, timeout_s: float = 2.0) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.warning("metrics HTTP thread did not stop within %.1f s; leaving it (daemon thread)",
                        timeout_s)


class _Handler(MetricsHandler):
    """prometheus_client's handler, its body written by ``exposition``."""

    def do_GET(self) -> None:
        registry = self.registry
        names = parse_qs(urlparse(self.path).query).get("name[]")
        if names:
            registry = registry.restricted_registry(names)
        encoder, content_type = choose_encoder(self.headers.get("Accept"))
        output = exposition(registry, encoder)
        headers = [("Content-Type", content_type)]
        accepted = (self.headers.get("Accept-Encoding") or "").split(",")
        if any(part.split(";")[0].strip().lower() == "gzip" for part in accepted):
            # level 1: 3.7 MB of text at 16,384 ranks in 265 kB and 10 ms (the default, 9: 218 kB, 84 ms)
            output = gzip.compress(output, compresslevel=1)
            headers.append(("Content-Encoding", "gzip"))
        self.send_response(200)
        for header in headers:
            self.send_header(*header)
        self.end_headers()
        self.wfile.write(output)


def exposition(registry: CollectorRegistry, encoder: Callable[[Any], bytes]) -> bytes:
    """What ``encoder`` (prometheus_client's text or OpenMetrics ``generate_latest``) writes of
    ``registry``, with the sample lines of the per-rank tables (``series.TableFamily``) written by
    themselves: the same text, ten times faster at 16,384 ranks."""
    parts = []
    for metric in registry.collect():
        if isinstance(metric, TableFamily):
            parts.append(encoder(_Only(metric.header())).removesuffix(_END))
            parts.append(metric.text().encode())
        else:
            parts.append(encoder(_Only(metric)).removesuffix(_END))
    parts.append(encoder(_Only()))  # the end mark of the format, if it has one
    return b"".join(parts)


_END = b"# EOF\n"
"""what OpenMetrics writes at the end of a registry; nothing in the text format"""


class _Only:
    """A registry of the metrics given (``exposition`` writes one family at a time)."""

    def __init__(self, *metrics: Metric):
        self._metrics = metrics

    def collect(self) -> tuple[Metric, ...]:
        return self._metrics


def _listen_address(host: str, port: int) -> tuple[socket.AddressFamily, tuple]:
    """The address family and socket address to listen on ``host:port`` (IPv4 or IPv6)."""
    family, _, _, _, address = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                                  flags=socket.AI_PASSIVE)[0]
    return family, address


class _BoundedHTTPServer(ThreadingHTTPServer):
    """A threading HTTP server that serves at most ``max_connections`` connections at once."""

    daemon_threads = True
    block_on_close = False
    request_queue_size = 128

    def __init__(self, family: socket.AddressFamily, address: tuple, handler: type, max_connections: int):
        self.address_family = family
        self._slots = threading.BoundedSemaphore(max_connections)
        self._max_connections = max_connections
        self._said_full = False
        super().__init__(address, handler)

    def process_request(self, request, client_address) -> None:
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)
            if not self._said_full:
                self._said_full = True
                log.warning("/metrics has %d connections open: further ones are closed until some end (idle "
                            "ones are closed after their timeout); said once", self._max_connections)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()  # no thread took the connection
            raise

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()
