"""A replay report (``replay.json``) as readable lines: printed at the end of a replay, and by
``nanguard inspect``.

A report read back from disk may come from another nanguard version: callers that read one
(``nanguard inspect``) catch the KeyError, TypeError, ValueError or AttributeError of a report
that does not have the shape these functions expect.
"""

from __future__ import annotations

import os
from typing import Any

from ..events import Event, within


def render(report: dict[str, Any], path: str | None) -> str:
    """The report as a few readable lines."""
    lines = [f"nanguard replay of {report['incident']} (step {report['step']}): {report['verdict']}",
             f"  {report['message']}",
             f"  original: {Event.from_dict(report['original_event'])}"]
    if report["first_event"] is not None:
        lines.append(f"  replayed: {Event.from_dict(report['first_event'])}")
    lines += ["  " + line for line in trace_lines(report)]
    lines += [f"  {label}: {text}" for label, text in detail_lines(report)]
    lines += [f"  note: {note}" for note in report["notes"]]
    if path is not None:
        lines.append(f"  saved to {path}; `nanguard inspect {os.path.dirname(path)}` shows it")
    return "\n".join(lines)


def trace_lines(report: dict[str, Any], per_rank: int = 3) -> list[str]:
    """The first bad values the replay's synchronous trace met, per rank, forward then backward."""
    lines = []
    for rank, trace in sorted(report.get("trace", {}).items(), key=lambda kv: int(kv[0])):
        for entry in trace["forward"][:per_rank]:
            role = "producer" if entry["inputs_finite"] else "passed on"
            lines.append(f"rank {rank} forward: {entry['module'] or 'the model'} ({entry['module_type']},"
                         f" {role}, micro-batch {entry['micro_batch']}): {_stats(entry['output'])}")
        for entry in trace["gradients"][:per_rank]:
            lines.append(f"rank {rank} backward: gradient of {entry['gradient_of']}: {_stats(entry)}")
    return lines


def _stats(d: dict[str, Any]) -> str:
    return (f"{d.get('bad_count')} bad of shape {d.get('shape')}, first at {d.get('first_index')}"
            f" = {d.get('first_value')}")


def detail_lines(report: dict[str, Any]) -> list[tuple[str, str]]:
    """(label, text) lines for the operations, the bad samples, the devices and the layout; none
    for what a report (of an older nanguard) does not have."""
    lines: list[tuple[str, str]] = []
    event = report.get("first_event") or report.get("original_event") or {}
    for rank, ops in _by_rank(report.get("operations")):
        if ops is None:
            continue
        for phase in ("forward", "backward"):
            lead = _lead(ops[phase], event)
            if lead is not None:
                others = len(ops[phase]) - 1
                more = f" ({others} other(s) in replay.json)" if others else ""
                lines.append(("operation", f"rank {rank} {phase}: {operation(lead)}{more}"))
        if not ops["forward"] and not ops["backward"]:
            lines.append(("operation", f"rank {rank}: none of the {ops['operations_checked']} operations"
                                       " checked made a non-finite value from finite inputs"))
    for rank, samples in _by_rank(report.get("samples")):
        lines += [("samples", f"rank {rank}, {text}") for text in sample_lines(samples)]
    if report.get("skip_file"):
        lines.append(("skip file", f"{report['skip_file']} (nanguard.skip_list reads it)"))
    found = report.get("devices")
    if isinstance(found, dict) and found.get("message"):
        lines.append(("device", found["message"]))
    return lines


def _lead(ops: list[dict[str, Any]], event: dict[str, Any]) -> dict[str, Any] | None:
    """The operation to show first, of those that made a non-finite value from finite inputs: the
    first in the module of the replay's first event (or a module around it or inside it) before
    others, and of those the first that made a NaN where the event holds one. An infinity made
    elsewhere (T5's log of a zero distance, which its code discards) is not where the event's value
    came from."""
    if not ops:
        return None
    layer = event.get("layer") or ""

    def near(module: str | None) -> bool:
        return bool(module and layer) and (within(layer, module) or within(module, layer))

    def made_nan(op: dict[str, Any]) -> bool:
        return bool(event.get("has_nan")) and bool((op.get("output") or {}).get("nan_count"))

    ranked = sorted(ops, key=lambda op: (not near(op.get("module")), not made_nan(op)))  # (stable: in order)
    return ranked[0]


def _by_rank(section: Any) -> list[tuple[str, Any]]:
    if not isinstance(section, dict):
        return []
    return sorted(section.items(), key=lambda kv: int(kv[0]))


def operation(op: dict[str, Any]) -> str:
    """``aten::log in module 2 (LogM) at model.py:10 in forward: return torch.log(h); input min -0.5``."""
    module = "code outside the model's modules" if not op.get("module_type") else \
        f"module {op['module']} ({op['module_type']})" if op["module"] else f"the model ({op['module_type']})"
    text = f"{op['op']} in {module}, micro-batch {op['micro_batch']}"
    if op["phase"] == "backward":
        text += f", backward node {op['node']}"
        if op.get("custom_backward"):
            text += f" (custom backward at {where(op.get('source'))})"
        if op.get("forward_source"):
            text += f", made in the forward at {where(op['forward_source'])}"
    else:
        text += f", at {where(op.get('source'))}"
    out = op["output"]
    return f"{text}; {op['why']}; output {out.get('bad_count')} non-finite of {out.get('numel')}"


def where(frame: dict[str, Any] | None) -> str:
    """``file.py:12 in forward: return torch.log(x)``, or ``?``."""
    if not frame:
        return "?"
    text = f"{frame['file']}:{frame['line']} in {frame['function']}"
    return f"{text}: {frame['code']}" if frame.get("code") else text


def sample_lines(samples: dict[str, Any]) -> list[str]:
    """What the sample search found on one rank."""
    if not samples.get("searched"):
        return [f"not searched: {samples.get('why_not')}"]
    lines = []
    for entry in samples["micro_batches"]:
        lines.append(f"micro-batch {entry['micro_batch']}: {_micro_batch(entry)}")
        lines += [f"micro-batch {entry['micro_batch']}, {_samples(g['from'], g['to'])} unresolved: {g['why']}"
                  for g in entry["unresolved"]]
    lines += [f"caveat: {note}" for note in samples.get("mixing", [])]
    lines.append(f"search: {samples['runs']} run(s) of the model (at most {samples['max_runs']})"
                 + (f", under the script's autocast ({', '.join(samples['autocast'])})" if samples.get("autocast") else "")
                 + (": that limit was reached, the search is incomplete" if samples["capped"] else ""))
    return lines


def _samples(start: int, stop: int) -> str:
    return f"sample {start}" if stop - start == 1 else f"samples {start}-{stop - 1}"


def _micro_batch(entry: dict[str, Any]) -> str:
    outcome = entry["outcome"]
    if outcome in ("clean", "capped", "error", None):
        return {"clean": "clean under the search's own check when run again alone (every module's output, and"
                         " the parameters' gradients of a backward of ones into the model's outputs, not of the"
                         " step's loss: a NaN born in the loss's gradient, or in the script's code outside the"
                         " model, is not made again there; the replay's verdict above is the step's own)",
                "capped": "not run: the cap of runs was reached"}.get(outcome, entry.get("note") or "not run")
    bad = entry["bad"]
    text = f"bad in {outcome} when run again alone (checked: {entry['checked']})"
    if bad:
        shown = ", ".join(map(str, bad[:16])) + (" ..." if len(bad) > 16 else "")
        text += f"; {len(bad)} of {entry['size']} samples are bad alone: {shown}"
        if entry.get("ids"):
            text += f" (ids {', '.join(map(str, entry['ids'][:16]))})"
        if len(bad) == entry["size"]:
            text += " (every sample: the fault is not in particular samples)"
    suspects = entry.get("suspects") or []
    if suspects:
        shown = ", ".join(map(str, suspects[:16])) + (" ..." if len(suspects) > 16 else "")
        ids = entry.get("suspect_ids")
        text += (f"; {len(suspects)} sample(s) bad alone only in a backward into every output, which the script's"
                 f" loss may not all use: {shown}" + (f" (ids {', '.join(map(str, ids[:16]))})" if ids else "")
                 + ", suspects, not named bad nor written to the skip file")
    if entry.get("rest_clean") is not None:
        text += "; the rest runs clean" if entry["rest_clean"] else "; the rest is still bad together"
    if entry.get("note"):
        text += f"; {entry['note']}"
    return text
