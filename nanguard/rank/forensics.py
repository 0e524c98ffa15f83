"""The slow, exact inspection of one tensor, used once something is known to be bad.

Never called on a clean step: each function here syncs with the device.
"""

from __future__ import annotations

from typing import Any

import torch


def plain(tensor: torch.Tensor) -> torch.Tensor:
    """The local, real, detached view of a tensor (a DTensor's shard, a complex's real view).

    Cheap (no copy, no sync): the detector's hot path uses it too.
    """
    if type(tensor) is not torch.Tensor:
        to_local = getattr(tensor, "to_local", None)  # DTensor shards (FSDP2, tensor parallel)
        if to_local is not None:
            tensor = to_local()
    if tensor.is_complex():
        tensor = torch.view_as_real(tensor)
    return tensor.detach() if tensor.requires_grad else tensor


def is_finite(tensor: torch.Tensor) -> bool:
    """Exact: True when every element is finite."""
    tensor = plain(tensor)
    if not (tensor.is_floating_point() and tensor.numel()):
        return True
    return bool(torch.isfinite(tensor).all())


def describe(tensor: torch.Tensor, shape: tuple[int, ...] | None = None) -> dict[str, Any]:
    """Counts, first bad element and finite-value range, as ``Event`` field values.

    ``shape`` overrides the reported shape (a complex tensor is inspected through its real view).
    """
    original = tensor
    tensor = plain(tensor)
    fields: dict[str, Any] = {
        "shape": tuple(shape if shape is not None else original.shape),
        "dtype": str(original.dtype).removeprefix("torch."),
        "numel": tensor.numel(),
    }
    if not tensor.is_floating_point() or tensor.numel() == 0:
        return fields | {"bad_count": 0, "nan_count": 0, "inf_count": 0,
                         "has_nan": False, "has_inf": False}
    nan = torch.isnan(tensor)
    inf = torch.isinf(tensor)
    nan_count = int(nan.sum())
    inf_count = int(inf.sum())
    bad = nan | inf
    fields.update(
        nan_count=nan_count,
        inf_count=inf_count,
        bad_count=int(bad.sum()),
        has_nan=nan_count > 0,
        has_inf=inf_count > 0,
    )
    if fields["bad_count"]:
        flat = int(bad.flatten().nonzero()[0, 0])
        index = torch.unravel_index(torch.tensor(flat), tensor.shape)
        fields["first_index"] = tuple(int(i) for i in index)
        fields["first_value"] = float(tensor.flatten()[flat])
    finite = tensor[~bad]
    if finite.numel():
        fields.update(
            finite_min=float(finite.min()),
            finite_max=float(finite.max()),
            finite_mean=float(finite.double().mean()),
        )
    return fields
