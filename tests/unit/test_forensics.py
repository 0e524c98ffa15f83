import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nanguard.rank import forensics


def test_describe_counts_and_first_index():
    t = torch.zeros(2, 3, 4)
    t[1, 2, 0] = math.nan
    t[0, 1, 3] = math.inf
    t[1, 0, 0] = 5.0
    d = forensics.describe(t)
    assert (d["nan_count"], d["inf_count"], d["bad_count"], d["numel"]) == (1, 1, 2, 24)
    assert d["first_index"] == (0, 1, 3) and d["first_value"] == math.inf
    assert d["finite_max"] == 5.0 and d["finite_min"] == 0.0 and d["shape"] == (2, 3, 4)


def test_describe_half_and_all_bad():
    t = torch.full((3,), math.nan, dtype=torch.bfloat16)
    d = forensics.describe(t)
    assert d["bad_count"] == 3 and "finite_min" not in d and d["dtype"] == "bfloat16"


def test_is_finite_exact_for_huge_values():
    assert forensics.is_finite(torch.full((1000,), 3e38))
    assert not forensics.is_finite(torch.tensor([1.0, -math.inf]))
    assert forensics.is_finite(torch.tensor([1, 2]))


SPECIALS = [math.nan, math.inf, -math.inf, 0.0, -0.0, 1.0, -2.5, 3e38, -3e38, 65504.0, 1e-40]


def _oracle(values: list[float]) -> dict:
    """What describe() must say, worked out in plain Python on the list of values."""
    bad = [i for i, v in enumerate(values) if not math.isfinite(v)]
    return {"nan_count": sum(math.isnan(v) for v in values), "bad_count": len(bad),
            "inf_count": sum(math.isinf(v) for v in values), "first": bad[0] if bad else None,
            "finite": [v for v in values if math.isfinite(v)]}


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(SPECIALS) | st.floats(width=32), min_size=1, max_size=60),
       st.sampled_from([torch.float32, torch.float64, torch.float16, torch.bfloat16]),
       st.integers(min_value=1, max_value=3))
def test_describe_and_is_finite_agree_with_a_plain_python_oracle(values, dtype, rows):
    tensor = torch.tensor(values * rows, dtype=torch.float64).to(dtype).reshape(rows, -1)
    as_stored = tensor.double().flatten().tolist()  # after rounding to dtype (3e38 is inf in fp16)
    want = _oracle(as_stored)
    got = forensics.describe(tensor)
    assert (got["nan_count"], got["inf_count"], got["bad_count"]) == (
        want["nan_count"], want["inf_count"], want["bad_count"])
    assert forensics.is_finite(tensor) == (want["bad_count"] == 0)
    if want["first"] is not None:
        assert got["first_index"] == divmod(want["first"], len(values))
    if want["finite"] and want["bad_count"]:
        assert got["finite_min"] == min(want["finite"]) and got["finite_max"] == max(want["finite"])


@settings(max_examples=80, deadline=None)
@given(rows=st.lists(st.integers(0, 5), min_size=1, max_size=6),
       values=st.lists(st.sampled_from(SPECIALS), min_size=18, max_size=18))
def test_a_sparse_gradient_is_described_by_the_values_it_stores(rows, values):
    """A sparse embedding gradient (uncoalesced: a row may repeat) reads as its dense self does:
    the same NaN and Inf counts, the same first bad element; is_finite agrees."""
    stored = torch.tensor(values[:len(rows) * 3], dtype=torch.float32).reshape(len(rows), 3)
    sparse = torch.sparse_coo_tensor(torch.tensor([rows]), stored, (6, 3))
    dense = sparse.to_dense()
    got, want = forensics.describe(sparse), forensics.describe(dense)
    assert got["shape"] == (6, 3) and got["dtype"] == "float32"
    assert (got["nan_count"], got["inf_count"]) == (want["nan_count"], want["inf_count"])
    assert got.get("first_index") == want.get("first_index")
    assert forensics.is_finite(sparse) == forensics.is_finite(dense)
