"""The slow, exact inspection of one tensor, used once something is known to be bad.

Never called on a clean step: each function here syncs with the device.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from .._torch import functorch_wrapped

transformed = functorch_wrapped
"""whether a tensor is one of torch.func's inside a transform (vmap, grad): it holds no value to read,
and must not outlive the transform"""


def plain(tensor: torch.Tensor) -> torch.Tensor:
    """The local, real, detached view of a tensor (a DTensor's shard, a complex's real view, a
    nested tensor's values).

    Cheap (no copy, no sync): the detector's hot path uses it too.
    """
    if type(tensor) is not torch.Tensor:
        to_local = getattr(tensor, "to_local", None)  # DTensor shards (FSDP2, tensor parallel)
        if to_local is not None:
            tensor = to_local()
    if tensor.is_nested:  # (nn.TransformerEncoder's fast path with a padding mask, autograd off)
        tensor = _nested_values(tensor)
    if tensor.is_complex():
        tensor = torch.view_as_real(tensor)
    return tensor.detach() if tensor.requires_grad else tensor


def _nested_values(tensor: torch.Tensor) -> torch.Tensor:
    """Every element of a nested tensor, flat: its buffer where it has one (no copy), else its
    components padded with zeros, which are finite."""
    try:
        return tensor.values()
    except (RuntimeError, NotImplementedError):
        return torch.nested.to_padded_tensor(tensor, 0.0)


def is_finite(tensor: torch.Tensor) -> bool:
    """Exact, and fast: True when every element is finite. A finite sum proves every element
    finite (a NaN or an Inf makes any sum non-finite); a sum that is not (or overflowed) is
    settled by the extremes, where a NaN or an Inf always shows. ``isfinite().all()`` is 20 to
    100 times slower on a CPU (MEASURED.md)."""
    tensor = stored(plain(tensor))
    if not tensor.is_floating_point() or tensor.numel() == 0 or tensor.layout != torch.strided:
        return True
    if tensor.device.type == "meta":
        return True
    wide = torch.float32 if tensor.dtype in (torch.float16, torch.bfloat16) else None
    if math.isfinite(float(tensor.sum(dtype=wide))):
        return True
    low, high = torch.aminmax(tensor)
    return math.isfinite(float(low)) and math.isfinite(float(high))


def describe(tensor: torch.Tensor, shape: tuple[int, ...] | None = None) -> dict[str, Any]:
    """Counts, first bad element and finite-value range, as ``Event`` field values.

    ``shape`` overrides the reported shape (a complex tensor is inspected through its real view).
    """
    original = tensor
    tensor = plain(tensor)
    if tensor.layout is torch.sparse_coo:
        return _describe_sparse(tensor)
    fields: dict[str, Any] = {
        "shape": tuple(shape if shape is not None else original.shape),
        "dtype": str(original.dtype).removeprefix("torch."),
        "numel": tensor.numel(),
    }
    if not tensor.is_floating_point() or tensor.numel() == 0:
        return fields | {"bad_count": 0, "nan_count": 0, "inf_count": 0,
                         "has_nan": False, "has_inf": False}
    bad = (tensor - tensor) != 0  # NaN and Inf alone give NaN: half the time of isfinite() on a CPU
    bad_count = int(bad.sum())
    nan_count = int(torch.isnan(tensor).sum()) if bad_count else 0
    inf_count = bad_count - nan_count
    fields.update(
        nan_count=nan_count,
        inf_count=inf_count,
        bad_count=bad_count,
        has_nan=nan_count > 0,
        has_inf=inf_count > 0,
    )
    if bad_count:
        flat = int(bad.flatten().to(torch.uint8).argmax())  # the first True (argmax returns the first maximum)
        fields["first_index"] = _unravel(flat, tuple(tensor.shape))
        fields["first_value"] = float(tensor.flatten()[flat])
    if bad_count == tensor.numel():
        return fields  # no finite values
    finite = tensor[~bad]
    if finite.numel():
        fields.update(
            finite_min=float(finite.min()),
            finite_max=float(finite.max()),
            finite_mean=float(finite.double().mean()),
        )
    return fields


def stored(tensor: torch.Tensor) -> torch.Tensor:
    """The values a sparse COO tensor stores (a sparse embedding's gradient), else the tensor."""
    return tensor.coalesce().values() if tensor.layout is torch.sparse_coo else tensor


def _describe_sparse(tensor: torch.Tensor) -> dict[str, Any]:
    """``describe`` of the values a sparse COO tensor stores, its first bad one indexed in the
    whole tensor (the elements it does not store are zeros)."""
    tensor = tensor.coalesce()
    fields = describe(tensor.values()) | {"shape": tuple(tensor.shape), "dtype": str(tensor.dtype).removeprefix("torch.")}
    if "first_index" in fields:
        row, *inner = fields["first_index"]
        fields["first_index"] = (*(int(i) for i in tensor.indices()[:, row]), *inner)
    return fields


def _unravel(flat: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The index of element ``flat`` of a C-contiguous tensor of ``shape``."""
    index = []
    for size in reversed(shape):
        flat, i = divmod(flat, size)
        index.append(i)
    return tuple(reversed(index))
