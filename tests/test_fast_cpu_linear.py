"""oneDNN-prepacked linears against ``F.linear``, at every row count a step can have."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from specdec.fast.cpu_linear import DENSE_COPY_MAX_ELEMENTS, MIN_ROWS, PACK_MIN_ELEMENTS, PackedLinear, cpu_packing_available, pack_linears

pytestmark = pytest.mark.skipif(not cpu_packing_available(torch.float32), reason="torch built without oneDNN")


@pytest.mark.parametrize("rows", [1, 2, MIN_ROWS - 1, MIN_ROWS, 5, 8, 9, 33])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_matches_f_linear_fp32(rows, bias):
    torch.manual_seed(rows)
    linear = nn.Linear(96, 160, bias=bias)
    x = torch.randn(rows, 96)
    expected = F.linear(x, linear.weight, linear.bias)
    out = PackedLinear(linear)(x)
    assert out.shape == (rows, 160)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rows", [1, 2, 6])
def test_large_weight_is_packed_only_and_pads_short_passes(rows):
    torch.manual_seed(rows)
    linear = nn.Linear(1024, DENSE_COPY_MAX_ELEMENTS // 1024 + 8, bias=False)
    packed = PackedLinear(linear)
    assert packed.dense_weight is None  # no second copy of a large weight
    x = torch.randn(rows, 1024)
    torch.testing.assert_close(packed(x), F.linear(x, linear.weight), atol=1e-4, rtol=1e-5)


def test_small_weight_keeps_a_dense_copy_for_one_row_passes():
    packed = PackedLinear(nn.Linear(64, 64))
    assert packed.dense_weight is not None and packed.dense_weight.shape == (64, 64)


def test_packed_keeps_leading_dims_and_reads_non_contiguous_input():
    torch.manual_seed(0)
    linear = nn.Linear(64, 48)
    x = torch.randn(2, 64, 3).transpose(1, 2)  # [2, 3, 64], not contiguous
    torch.testing.assert_close(PackedLinear(linear)(x), F.linear(x, linear.weight, linear.bias), atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not cpu_packing_available(torch.bfloat16), reason="no bf16 oneDNN linear")
def test_packed_matches_f_linear_bf16():
    torch.manual_seed(0)
    linear = nn.Linear(128, 64, bias=False).to(torch.bfloat16)
    x = torch.randn(5, 128, dtype=torch.bfloat16)
    out = PackedLinear(linear)(x)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), F.linear(x, linear.weight).float(), atol=2e-2, rtol=2e-2)


def test_unpackable_dtype_is_refused_naming_it():
    with pytest.raises(ValueError, match="float16"):
        PackedLinear(nn.Linear(8, 8).to(torch.float16))


def test_pack_linears_replaces_the_large_linears_and_nothing_else():
    wide = PACK_MIN_ELEMENTS // 64
    model = nn.Sequential(nn.Linear(64, wide), nn.ReLU(), nn.Sequential(nn.Linear(wide, 64), nn.LayerNorm(64)),
                          nn.Linear(64, 64))
    x = torch.randn(3, 64)
    expected = model(x)
    assert pack_linears(model) == 2
    assert isinstance(model[0], PackedLinear) and isinstance(model[2][0], PackedLinear)
    assert type(model[3]) is nn.Linear  # too small to gain from packing
    assert isinstance(model[2][1], nn.LayerNorm)
    torch.testing.assert_close(model(x), expected, atol=1e-5, rtol=1e-5)


def test_compiled_packed_linear_matches_f_linear_at_every_row_count():
    """Traced, the multiplication is the opaque ``specdec::onednn_linear``: no branch on rows in the graph."""
    torch.manual_seed(0)
    linear = nn.Linear(96, 160)
    packed = PackedLinear(linear)
    compiled = torch.compile(packed, dynamic=True, fullgraph=True)
    for rows in (1, 2, 3, MIN_ROWS, 9):
        x = torch.randn(2, rows, 96)
        with torch.inference_mode():
            out = compiled(x)
        assert out.shape == (2, rows, 160)
        torch.testing.assert_close(out, F.linear(x, linear.weight, linear.bias), atol=1e-5, rtol=1e-5)


def test_packed_weights_leave_the_table_with_their_module():
    import gc

    from specdec.fast import cpu_linear

    packed = PackedLinear(nn.Linear(64, 64))
    key = int(packed.key)
    assert key in cpu_linear._PACKED
    del packed
    gc.collect()
    assert key not in cpu_linear._PACKED


def test_a_model_too_large_for_two_copies_in_cache_keeps_no_dense_copies(monkeypatch):
    """Dense copies pay only while they and the packed weights share the cache."""
    wide = PACK_MIN_ELEMENTS // 64

    def model():
        return nn.Sequential(nn.Linear(64, wide), nn.Linear(wide, 64))

    small = model()
    assert pack_linears(small) == 2 and all(m.dense_weight is not None for m in small)
    monkeypatch.setattr("specdec.fast.cpu_linear.DENSE_COPIES_MAX_MODEL_BYTES", 2 * PACK_MIN_ELEMENTS * 4 - 1)
    large = model()
    x = torch.randn(1, 64)
    expected = large(x)
    assert pack_linears(large) == 2 and all(m.dense_weight is None for m in large)
    torch.testing.assert_close(large(x), expected, atol=1e-5, rtol=1e-5)  # one row, through the packed path
