"""The series with a label per rank (or per host and device), kept as plain tables and made into
samples only while ``/metrics`` is read.

prometheus_client keeps each labelled series as a child object with its own lock and value: about
600 bytes each, and a 16,384-rank job has four gauges a rank and counters for every rank that
reported an event, tens of MB beside a rank table that already holds the same numbers. So:

- ``RankGauges`` reads ``nanguard_rank_step``, ``nanguard_rank_last_seen_timestamp_seconds``,
  ``nanguard_rank_step_time_seconds`` and ``nanguard_rank_grad_norm`` from the rank table at each
  scrape (the ranks of the job served; a gauge a rank never reported is absent, as before);
- ``CounterTable`` keeps one counter family with labels as one dict, label values -> count.

A family's samples are made one at a time as the exposition writes them (``_Samples``): a list of
65,536 samples with their label dicts would be ~25 MB made and dropped at every scrape. These
counters have no ``_created`` sample (prometheus_client's own counters do): the alerts that need to
know a series is new read ``nanguard_coordinator_start_time_seconds`` instead.

Both are written by the coordinator's loop and read by the ``/metrics`` thread: each takes what it
serves as one snapshot under a lock, so a scrape never sees a table change size while it reads it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Protocol

from prometheus_client.core import Metric
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString


class RankRow(Protocol):
    """What ``RankGauges`` reads of a rank (``ranks.RankState`` has it)."""

    rank: int
    last_seen: float
    step: int | None
    step_time_s: float | None
    grad_norm: float | None


RANK_GAUGES = (
    ("nanguard_rank_step", "Last optimizer step a rank reported", "step"),
    ("nanguard_rank_last_seen_timestamp_seconds", "When a rank was last heard from", "last_seen"),
    ("nanguard_rank_step_time_seconds", "A rank's last reported step duration", "step_time_s"),
    ("nanguard_rank_grad_norm", "A rank's last reported total gradient norm", "grad_norm"),
)
"""(name, help, the ``RankRow`` attribute it shows)"""


class TableFamily(Metric):
    """One family of these tables, as a registry's ``collect`` yields it: ``samples`` are made as they
    are read (again at each reading, never held as a list), and ``text`` writes the same samples as
    exposition lines without making a Sample object each (``metrics.exposition``: prometheus_client's
    OpenMetrics writer takes ~1 s for the 65,536 per-rank samples of 16,384 ranks, this ~0.1 s).
    ``items`` gives (label values, value) pairs, a label value any object whose ``str`` it is."""

    def __init__(self, name: str, documentation: str, typ: str, labelnames: tuple[str, ...],
                 items: Callable[[], Iterable[tuple[tuple, float]]]):
        super().__init__(name, documentation, typ)
        self.labelnames = labelnames
        self.sample_name = f"{name}_total" if typ == "counter" else name
        self._items = items
        self.samples = _Samples(self._samples)

    def header(self) -> Metric:
        """This family without its samples (its HELP and TYPE lines, as the exposition writes them)."""
        return Metric(self.name, self.documentation, self.type)

    def text(self) -> str:
        """The sample lines, labels in name order (as prometheus_client writes them)."""
        order = sorted(range(len(self.labelnames)), key=self.labelnames.__getitem__)
        starts = [f'{"{" if i == 0 else ","}{self.labelnames[k]}="' for i, k in enumerate(order)]
        name = self.sample_name
        lines = []
        for values, value in self._items():
            labels = "".join([f'{start}{_escape(str(values[k]))}"' for start, k in zip(starts, order)])
            lines.append(f"{name}{labels}}} {floatToGoString(value)}\n")
        return "".join(lines)

    def _samples(self) -> Iterator[Sample]:
        names, name = self.labelnames, self.sample_name
        for values, value in self._items():
            yield Sample(name, {label: str(v) for label, v in zip(names, values)}, value)


class _Samples:
    """Samples made as they are read: iterable again and again, never held as a list."""

    __slots__ = ("_make",)

    def __init__(self, make: Callable[[], Iterator[Sample]]):
        self._make = make

    def __iter__(self) -> Iterator[Sample]:
        return self._make()


def _escape(value: str) -> str:
    """A label value as the exposition formats quote it."""
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


class RankGauges:
    """The per-rank gauges (``RANK_GAUGES``) of the rows ``rows`` returns at each scrape: a snapshot
    (a list) of the rank table's states, taken once per scrape."""

    def __init__(self) -> None:
        self._rows: Callable[[], Sequence[RankRow]] = tuple

    def follow(self, rows: Callable[[], Sequence[RankRow]]) -> None:
        """Read the rows from ``rows`` from now on (the rank table registers itself)."""
        self._rows = rows

    def describe(self) -> Iterable[Metric]:
        for name, documentation, _ in RANK_GAUGES:
            yield TableFamily(name, documentation, "gauge", ("rank",), tuple)

    def collect(self) -> Iterable[Metric]:
        rows = self._rows()
        for name, documentation, attribute in RANK_GAUGES:
            yield TableFamily(name, documentation, "gauge", ("rank",),
                              lambda attribute=attribute: _rank_values(attribute, rows))


def _rank_values(attribute: str, rows: Sequence[RankRow]) -> Iterator[tuple[tuple[int], float]]:
    for row in rows:
        value = getattr(row, attribute)
        if value is not None:
            yield (row.rank,), value


class CounterTable:
    """One counter family with labels ``labelnames``: label values (any objects; ``str`` of each is
    the label value) -> count. ``name`` ends in ``_total``, as the series does."""

    def __init__(self, name: str, documentation: str, labelnames: tuple[str, ...]):
        self.name, self.documentation, self.labelnames = name, documentation, labelnames
        self._counts: dict[tuple, float] = {}
        self._lock = threading.Lock()

    def inc(self, values: tuple, amount: float = 1) -> None:
        if amount < 0:
            raise ValueError(f"{self.name} can only grow, not by {amount}")
        with self._lock:
            self._counts[values] = self._counts.get(values, 0) + amount

    def __contains__(self, values: tuple) -> bool:
        return values in self._counts

    def __len__(self) -> int:
        return len(self._counts)

    def describe(self) -> Iterable[Metric]:
        yield self._family(())

    def collect(self) -> Iterable[Metric]:
        with self._lock:
            counts = list(self._counts.items())
        yield self._family(counts)

    def _family(self, counts: list[tuple[tuple, float]]) -> TableFamily:
        return TableFamily(self.name.removesuffix("_total"), self.documentation, "counter", self.labelnames,
                           lambda: counts)
