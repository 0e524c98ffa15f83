"""What went into an operation that made a non-finite value: each input's range, and the one
fact about them that explains the result ("input min -1.0" for a log, "divisor has 12 zeros").

Called only for the few operations a replay reports: every function here syncs with the device.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..rank import forensics

# operations by what makes them non-finite from finite inputs (names without "aten::" and "_")
_BELOW_ZERO = {"log", "log2", "log10", "sqrt", "rsqrt", "xlogy", "lgamma", "digamma", "polygamma"}
_BELOW_MINUS_ONE = {"log1p"}
_OUTSIDE_ONE = {"acos", "asin", "atanh", "erfinv"}
_DIVISORS = {"div": "other", "true_divide": "other", "remainder": "other", "fmod": "other",
             "floor_divide": "other", "reciprocal": "self", "rsqrt": "self"}
_EXP = {"exp": 1.0, "exp2": math.log(2.0), "expm1": 1.0, "sinh": 1.0, "cosh": 1.0}


def base_name(op_name: str) -> str:
    """``aten::div_.Tensor`` -> ``div``: the operation family, in-place and overload left out."""
    name = op_name.split("::")[-1].split(".")[0]
    return name[:-1] if name.endswith("_") and not name.endswith("__") else name


def describe_input(name: str, value: Any) -> dict[str, Any] | None:
    """The range of one input (a tensor or a number); None for what is neither."""
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, (int, float)):
        return {"name": name, "value": float(value)}
    if not isinstance(value, torch.Tensor):
        return None
    tensor = forensics.plain(value)  # integer tensors too: a count of 0 is a divisor
    if tensor.is_complex():
        tensor = torch.view_as_real(tensor)
    entry: dict[str, Any] = {"name": name, "shape": list(value.shape),
                             "dtype": str(value.dtype).removeprefix("torch."), "numel": tensor.numel()}
    if tensor.numel() == 0 or tensor.layout != torch.strided:
        return entry
    wide = tensor.detach().double()
    finite = torch.isfinite(wide)
    entry["nonfinite"] = int((~finite).sum())
    values = wide[finite]
    if values.numel():
        entry.update(min=float(values.min()), max=float(values.max()), abs_min=float(values.abs().min()),
                     abs_max=float(values.abs().max()), zeros=int((values == 0).sum()),
                     negatives=int((values < 0).sum()))
    return entry


def why(op_name: str, inputs: list[dict[str, Any]], out_dtype: torch.dtype | None) -> str:
    """One clause that explains the non-finite result from the inputs' ranges."""
    family = base_name(op_name)
    tensors = [i for i in inputs if "numel" in i]
    first = tensors[0] if tensors else None
    if family in _DIVISORS:
        divisor = next((i for i in inputs if i["name"] == _DIVISORS[family]), None)
        if divisor is not None and divisor.get("value") == 0:
            return "the divisor is 0"
        if divisor is not None and divisor.get("zeros"):
            return f"divisor ({divisor['name']}) has {divisor['zeros']} zero{'s' * (divisor['zeros'] > 1)}"
    if first is not None and "min" in first:
        if family in _BELOW_ZERO and (first["min"] < 0 or first["zeros"]):
            return _below(first, 0.0, "zeros give -inf" if family != "rsqrt" else "zeros give inf")
        if family in _BELOW_MINUS_ONE and first["min"] <= -1:
            return _below(first, -1.0, "-1 gives -inf")
        if family in _OUTSIDE_ONE and first["abs_max"] >= 1:
            return f"input abs max {first['abs_max']:.4g}: {family} is defined in (-1, 1)"
        if family in _EXP and out_dtype is not None and out_dtype.is_floating_point:
            limit = math.log(torch.finfo(out_dtype).max) / _EXP[family]
            return (f"input max {first['max']:.4g}: {family} overflows "
                    f"{str(out_dtype).removeprefix('torch.')} above {limit:.4g}")
    return _overflow_or_range(tensors, out_dtype)


def _below(entry: dict[str, Any], bound: float, edge: str) -> str:
    count = entry["negatives"] if bound == 0 else None
    text = f"input min {entry['min']:.4g}"
    if count:
        text += f" ({count} value{'s' * (count > 1)} below 0)"
    if bound == 0 and entry["zeros"]:
        text += f", {entry['zeros']} zero{'s' * (entry['zeros'] > 1)} ({edge})"
    return text


def _overflow_or_range(tensors: list[dict[str, Any]], out_dtype: torch.dtype | None) -> str:
    ranged = [t for t in tensors if "abs_max" in t]
    if not ranged:
        return "its inputs hold no finite values to show"
    biggest = max(ranged, key=lambda t: t["abs_max"])
    if out_dtype is not None and out_dtype.is_floating_point:
        limit = torch.finfo(out_dtype).max
        if biggest["abs_max"] * max(1, biggest["numel"]) >= limit / 1e3 or biggest["abs_max"] >= math.sqrt(limit):
            return (f"input {biggest['name']} abs max {biggest['abs_max']:.4g}: products or sums of values"
                    f" this large overflow {str(out_dtype).removeprefix('torch.')} (max {limit:.4g})")
    return "; ".join(f"{t['name']} in [{t['min']:.4g}, {t['max']:.4g}]" for t in ranged)
