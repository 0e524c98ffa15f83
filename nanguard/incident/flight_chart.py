"""The flight recorder of an incident: ``rank<k>/flight.json``, the last steps' scalars before
the stop, drawn because people would rather look than read.

Format (``VERSION`` 1)::

    {"version": 1, "columns": ["step", "loss", "grad_norm", "scale", "lr", "step_time_s"],
     "rows": [[0, 2.31, 0.41, 65536.0, 0.001, 0.12], ...],      oldest first, values may be null
     "top_params": [{"step": 24, "params": {"blocks.1.fc.weight": 812.0, ...}}, ...]}

The recorder writes a NaN or Inf as null (the events say which); a file may also hold JSON's
NaN/Infinity or "nan"/"inf"/"-inf" (how nanguard writes them elsewhere), drawn as non-finite. The file comes from disk: ``parse`` checks every field and says what is
wrong, and nothing here raises on a malformed one beyond ``FlightError``. Its absence is normal
(incidents older than the recorder have none).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .._text import printable

VERSION = 1
DRAWN = ("loss", "grad_norm")
MAX_ROWS = 100_000
MAX_TOP = 1_000
WIDTH = 60  # columns of a sparkline
_SPARKS = "▁▂▃▄▅▆▇█"
_NONFINITE = "!"
_MISSING = "·"
_WORDS = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


class FlightError(ValueError):
    """A flight.json that does not follow the format; the message says where."""


@dataclass(frozen=True, slots=True)
class Flight:
    columns: tuple[str, ...]
    rows: tuple[tuple[float | None, ...], ...]
    top_params: tuple[dict[str, Any], ...]

    def column(self, name: str) -> list[float | None]:
        index = self.columns.index(name)
        return [row[index] for row in self.rows]

    @property
    def steps(self) -> list[int]:
        return [int(s) for s in self.column("step")]


def parse(data: Any) -> Flight:
    """A checked Flight from flight.json's data; FlightError names the first problem."""
    if not isinstance(data, Mapping):
        raise FlightError("it is not a JSON object")
    if data.get("version") != VERSION or isinstance(data.get("version"), bool):
        raise FlightError(f"version {data.get('version')!r} is not {VERSION}")
    columns = data.get("columns")
    if (not isinstance(columns, list) or not all(isinstance(c, str) for c in columns)
            or len(set(columns)) != len(columns) or "step" not in columns):
        raise FlightError("\"columns\" is not a list of distinct names that holds \"step\"")
    rows = data.get("rows")
    if not isinstance(rows, list) or len(rows) > MAX_ROWS:
        raise FlightError(f"\"rows\" is not a list of at most {MAX_ROWS} rows")
    checked = tuple(_row(row, n, columns) for n, row in enumerate(rows))
    step = columns.index("step")
    if any(a[step] > b[step] for a, b in zip(checked, checked[1:])):
        raise FlightError("\"rows\" are not oldest first (their steps go down)")
    return Flight(tuple(columns), checked, _top_params(data.get("top_params", [])))


def _row(row: Any, n: int, columns: list[str]) -> tuple[float | None, ...]:
    if not isinstance(row, list) or len(row) != len(columns):
        raise FlightError(f"row {n} is not a list of {len(columns)} values")
    values = tuple(_number(value, f"row {n}, {column}") for value, column in zip(row, columns))
    step = values[columns.index("step")]
    if step is None or step != int(step) or step < 0:
        raise FlightError(f"row {n} has no step (a whole number, 0 or more)")
    return values


def _number(value: Any, where: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, str) and value in _WORDS:
        return _WORDS[value]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise FlightError(f"{where} is {value!r}, not a number or null")
    return float(value)


def _top_params(top: Any) -> tuple[dict[str, Any], ...]:
    if not isinstance(top, list) or len(top) > MAX_TOP:
        raise FlightError(f"\"top_params\" is not a list of at most {MAX_TOP} entries")
    checked = []
    for n, entry in enumerate(top):
        if (not isinstance(entry, Mapping) or isinstance(entry.get("step"), bool)
                or not isinstance(entry.get("step"), int) or not isinstance(entry.get("params"), Mapping)
                or not all(isinstance(k, str) for k in entry["params"])):
            raise FlightError(f"top_params entry {n} is not {{\"step\": int, \"params\": {{name: norm}}}}")
        params = {k: _number(v, f"top_params entry {n}, {k}") for k, v in entry["params"].items()}
        checked.append({"step": entry["step"], "params": params})
    return tuple(checked)


# ---------------------------------------------------------------------- drawing in a terminal
def sparkline(values: list[float | None], width: int = WIDTH) -> tuple[str, bool]:
    """One character per value (or per bucket of values, largest first, when there are more than
    ``width``): ``!`` non-finite, ``·`` missing. Log scale when the finite values are positive and
    span a factor of 100 or more; returns the line and whether it is in log scale."""
    buckets = _buckets(values, width)
    finite = [v for bucket in buckets for v in bucket if v is not None and math.isfinite(v)]
    log = bool(finite) and min(finite) > 0 and max(finite) / min(finite) >= 100
    scale = (lambda v: math.log10(v)) if log else (lambda v: v)
    low, high = (scale(min(finite)), scale(max(finite))) if finite else (0.0, 0.0)
    chars = []
    for bucket in buckets:
        if any(v is not None and not math.isfinite(v) for v in bucket):
            chars.append(_NONFINITE)
        elif all(v is None for v in bucket):
            chars.append(_MISSING)
        else:
            top = scale(max(v for v in bucket if v is not None))
            level = 0 if high == low else round((top - low) / (high - low) * (len(_SPARKS) - 1))
            chars.append(_SPARKS[level])
    return "".join(chars), log


def _buckets(values: list[Any], width: int) -> list[list[Any]]:
    if len(values) <= width:
        return [[v] for v in values]
    return [values[i * len(values) // width:(i + 1) * len(values) // width] for i in range(width)]


def column_of(steps: list[int], step: int, width: int = WIDTH) -> int:
    """The sparkline column that holds ``step`` (one past the end when it is after the last row)."""
    index = next((i for i, s in enumerate(steps) if s >= step), len(steps))
    if len(steps) <= width:
        return index
    return min(width, index * width // len(steps))


def lines(flight: Flight, incident_step: int, indent: int) -> list[str]:
    """The recorder as a few lines: loss and grad norm sparklines, the incident step marked."""
    steps = flight.steps
    if not steps:
        return ["(no rows)"]
    out = []
    pad = " " * indent
    for name in (c for c in DRAWN if c in flight.columns):
        values = flight.column(name)
        spark, log = sparkline(values)
        out.append(f"{pad}{name:<11}{spark}  {_range(values)}{' (log scale)' if log else ''}")
    mark = column_of(steps, incident_step)
    where = "" if incident_step in steps else (" (after the last row)" if incident_step > steps[-1] else "")
    out.append(f"{pad}{'':<11}{' ' * mark}^ step {incident_step}, the incident{where}")
    for entry in _top_entries(flight.top_params):
        out.append(f"{pad}{'':<11}largest gradient norms, step {entry['step']}: " + ", ".join(
            f"{name} {_norm(norm)}" for name, norm in _largest(entry["params"])))
    return out


def _top_entries(top: tuple[dict[str, Any], ...]) -> list[dict[str, Any]]:
    """The last entry, and the last one with a finite norm when the last has none (the step
    before things went non-finite)."""
    if not top:
        return []
    finite = [e for e in top if any(v is not None and math.isfinite(v) for v in e["params"].values())]
    return [top[-1]] if not finite or finite[-1] is top[-1] else [finite[-1], top[-1]]


def _largest(params: dict[str, float | None], count: int = 3) -> list[tuple[str, float | None]]:
    # None is how the recorder writes a NaN or Inf norm: those first, as it ranks them
    return sorted(params.items(), key=lambda kv: -math.inf if kv[1] is None or not math.isfinite(kv[1])
                  else -abs(kv[1]))[:count]


def _norm(norm: float | None) -> str:
    return "non-finite" if norm is None or not math.isfinite(norm) else f"{norm:.4g}"


def _range(values: list[float | None]) -> str:
    finite = [v for v in values if v is not None and math.isfinite(v)]
    bad = sum(1 for v in values if v is not None and not math.isfinite(v))
    if all(v is None for v in values):
        return "none recorded"
    text = f"{min(finite):.4g} .. {max(finite):.4g}, last finite {finite[-1]:.4g}" if finite else "no finite values"
    return text + (f"; {bad} non-finite (!)" if bad else "")


# ---------------------------------------------------------------------- drawing in a file
def _label(text: str) -> str:
    """A name from the incident as plain text in a figure: escaped, and no mathtext (``$``)."""
    return printable(text).replace("$", r"\$")


def plot(flight: Flight, incident_step: int, title: str, path: str) -> None:
    """Loss and grad norm against the step as an image (its format from ``path``'s extension),
    the incident step marked. Needs matplotlib (``pip install 'nanguard[plot]'``): ImportError
    without it; OSError when ``path`` cannot be written."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # no pyplot: no global state
    from matplotlib.figure import Figure

    names = [c for c in DRAWN if c in flight.columns] or [c for c in flight.columns if c != "step"][:2]
    figure = Figure(figsize=(8, 1.2 + 2.2 * max(1, len(names))), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(max(1, len(names)), 1, sharex=True, squeeze=False)[:, 0]
    steps = flight.steps
    for ax, name in zip(axes, names):
        values = flight.column(name)
        finite = [v for v in values if v is not None and math.isfinite(v)]
        ax.plot(steps, [v if v is not None and math.isfinite(v) else math.nan for v in values],
                marker=".", linewidth=1)
        bad = [s for s, v in zip(steps, values) if v is not None and not math.isfinite(v)]
        if bad:
            ax.plot(bad, [max(finite, default=1.0)] * len(bad), "x", color="red", label="non-finite")
        if finite and min(finite) > 0 and max(finite) / min(finite) >= 100:
            ax.set_yscale("log")
        ax.axvline(incident_step, color="red", linestyle="--", label=f"step {incident_step}, the incident")
        ax.set_ylabel(_label(name))
        ax.legend(loc="upper left", fontsize="small")
    axes[-1].set_xlabel("step")
    figure.suptitle(_label(title))
    figure.savefig(path, dpi=100)
