import math

import torch

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
