"""The per-row norm kernel (surgeon.audit.norms): exact float32 sums of squares for half-precision
rows of any layout, NaN and Inf wherever they sit, and the same figures through every path of the
value pass."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from surgeon.audit.norms import row_norms
from surgeon.audit.values import file_values

HALVES = (torch.bfloat16, torch.float16)


def _exact(x):
    return torch.linalg.vector_norm(x.double(), dim=-1)


def _tol(H: int) -> float:
    # a float32 sum of H positive terms, then a square root: within H float32 roundings of the exact
    return (H + 2) * 2.0**-24


@settings(max_examples=120, deadline=None)
@given(st.sampled_from(HALVES), st.integers(1, 40), st.integers(1, 3), st.integers(1, 300), st.integers(0, 3),
       st.integers(0, 2**31 - 1))
def test_half_rows_of_any_layout_get_their_exact_norm_in_float32(dtype, T, k, H, skip, seed):
    """Rows of a [T, k, H] tensor and of a column slice of a wider row (what a SpecForge
    ``aux_hidden_state`` split gives), against float64: within float32's rounding of the sum, where
    torch's own bf16 norm, rounded to bf16, is ~0.3% off."""
    g = torch.Generator().manual_seed(seed)
    wide = (torch.randn(T, k, H + skip, generator=g) * 10 ** torch.empty(T, k, 1).uniform_(-3, 3, generator=g)).to(dtype)
    for x in (wide, wide[..., skip:], wide[:, k - 1], wide.transpose(0, 1)):
        got = row_norms(x)
        assert got.dtype == torch.float32 and got.shape == x.shape[:-1]
        exact = _exact(x)
        assert torch.all((got.double() - exact).abs() <= _tol(H) * exact), (dtype, x.shape, x.stride())


@pytest.mark.parametrize("dtype", HALVES)
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_a_nan_or_inf_anywhere_in_a_row_makes_its_norm_nonfinite(dtype, bad):
    """Every position of a row (the kernel's vector body and its tail alike) and only that row."""
    H = 67  # not a multiple of any vector width
    for j in range(H):
        x = torch.ones(3, H, dtype=dtype)
        x[1, j] = bad
        got = row_norms(x)
        assert math.isfinite(got[0]) and math.isfinite(got[2]) and got[0] == math.sqrt(H)
        assert math.isnan(got[1]) if math.isnan(bad) else got[1] == math.inf, (j, got[1])


def test_overflow_and_underflow_are_float32s_as_the_value_pass_expects():
    """Squares past float32's range give Inf (the value pass recomputes such a row in float64); squares
    below it vanish (it reads such a row again); a row of zeros is 0."""
    big = torch.full((1, 8), 3e38).to(torch.bfloat16)
    tiny = torch.full((1, 8), 1e-30).to(torch.bfloat16)
    zero = torch.zeros(1, 8, dtype=torch.bfloat16)
    assert row_norms(big)[0] == math.inf and row_norms(tiny)[0] == 0 and row_norms(zero)[0] == 0
    assert row_norms(-torch.ones(2, 9, dtype=torch.float16)).tolist() == [3.0, 3.0]


def test_wider_dtypes_and_empty_slots_go_through_torch():
    x = torch.randn(5, 33, dtype=torch.float64)
    assert torch.equal(row_norms(x), torch.linalg.vector_norm(x, dim=1).float())
    assert row_norms(torch.empty(0, 16, dtype=torch.bfloat16)).shape == (0,)
    assert row_norms(torch.empty(4, 0, dtype=torch.bfloat16)).tolist() == [0.0] * 4


def test_a_bf16_slots_norm_statistics_are_its_exact_norms():
    """The value pass's mean and extremes of a bf16 slot are those of its exact norms (torch's bf16
    norm, rounded to bf16, moved them by up to 0.4%)."""
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(256, 96, generator=g) * torch.linspace(0.5, 40, 256)[:, None]).to(torch.bfloat16)
    (sv,), _, _ = file_values(["s"], [None], [x])
    exact = _exact(x)
    assert sv.norm_mean == pytest.approx(exact.mean().item(), rel=1e-6)
    assert sv.norm_max == pytest.approx(exact.max().item(), rel=1e-6)
    assert sv.norm_min == pytest.approx(exact.min().item(), rel=1e-6)


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(HALVES), st.integers(1, 4), st.integers(1, 70), st.integers(1, 130), st.integers(0, 2**31 - 1))
def test_the_moments_of_half_samples_leave_the_bad_rows_out_exactly(dtype, S, P, H, seed):
    """sample_moments over half rows (the kernel's pass) against float64 sums of the good rows: the
    rows left out hold NaN and Inf, and nothing of them reaches the sums."""
    import numpy as np

    from surgeon.audit.values import sample_moments

    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(S, P, H, generator=g) * 50).to(dtype)
    good = torch.rand(S, P, generator=g) > 0.3
    x[~good] = torch.where(torch.rand_like(x[~good].float()) > 0.5, math.nan, math.inf).to(dtype)
    m = sample_moments(x, good.numpy())
    ref = torch.where(good[..., None], x.double(), 0)
    assert (m.count == good.sum(1).numpy()).all()
    scale = ref.abs().sum(1).numpy() + 1e-30
    assert np.all(np.abs(m.sum - ref.sum(1).numpy()) <= (P + 2) * 2.0**-24 * scale)
    assert np.all(np.abs(m.sumsq - (ref**2).sum(1).numpy()) <= (P + 2) * 2.0**-24 * (ref**2).sum(1).numpy() + 1e-30)
