"""FP8 / FP4 decoders against transformers' own dequantization, and partial blocks against float64."""

import pytest
import torch
from transformers.integrations.finegrained_fp8 import Fp8Dequantize

from dsconv.convert.decode import decode_columns, decode_rows, scale_rows

BLOCK = (128, 128)
FP4_GROUP = 32


def transformers_dequant(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return Fp8Dequantize(None)._dequantize_one(q, scale, output_dtype=torch.float32)


def decode_in_chunks(q, scale, encoding, rows_per_chunk):
    rows = q.shape[0]
    parts = []
    for start in range(0, rows, rows_per_chunk):
        stop = min(rows, start + rows_per_chunk)
        s0, s1 = scale_rows(encoding, BLOCK, start, stop)
        parts.append(decode_rows(q[start:stop], scale[s0:s1], encoding, BLOCK, start))
    return torch.cat(parts)


def random_fp8(rows, cols, gen):
    return (torch.randn(rows, cols, generator=gen) * 100).to(torch.float8_e4m3fn)


@pytest.mark.parametrize("chunk", [1000, 128, 37])
@pytest.mark.parametrize("e8m0", [False, True])
def test_fp8_matches_transformers(chunk, e8m0):
    gen = torch.Generator().manual_seed(1)
    q = random_fp8(384, 256, gen)
    scale = torch.rand(3, 2, generator=gen) + 1e-3
    if e8m0:
        scale = torch.exp2(torch.randint(-20, 5, (3, 2), generator=gen).float()).to(torch.float8_e8m0fnu)
    ours = decode_in_chunks(q, scale, "fp8", chunk)
    assert torch.equal(ours, transformers_dequant(q, scale))


@pytest.mark.parametrize("chunk", [64, 5])
def test_fp4_matches_transformers(chunk):
    gen = torch.Generator().manual_seed(2)
    rows, cols = 64, 256
    packed = torch.randint(-128, 128, (rows, cols // 2), generator=gen, dtype=torch.int8)
    scale = torch.exp2(torch.randint(-10, 3, (rows, cols // FP4_GROUP), generator=gen).float())
    scale = scale.to(torch.float8_e8m0fnu)
    ours = decode_in_chunks(packed, scale, "fp4", chunk)
    assert torch.equal(ours, transformers_dequant(packed, scale))


@pytest.mark.parametrize("cols", [(0, 128), (128, 256), (256, 300), (0, 300), (64, 192), (100, 290)])
def test_fp8_column_slice_equals_slice_of_whole_rows(cols):
    # 300 columns: the last 128-column block is ragged; (64, 192) and (100, 290) do not start on a block
    gen = torch.Generator().manual_seed(3)
    q, scale = random_fp8(384, 300, gen), torch.rand(3, 3, generator=gen) + 1e-3
    start, stop = 37, 300  # a row chunk that starts inside a block row
    s0, s1 = scale_rows("fp8", BLOCK, start, stop)
    whole = decode_rows(q[start:stop], scale[s0:s1], "fp8", BLOCK, start)
    ours = decode_columns(q[start:stop], scale[s0:s1], "fp8", BLOCK, start, cols)
    assert ours.is_contiguous() and torch.equal(ours, whole[:, cols[0]:cols[1]])


@pytest.mark.parametrize("cols", [(0, 64), (64, 256), (96, 160), (16, 48)])
def test_fp4_and_float_column_slices_equal_slice_of_whole_rows(cols):
    gen = torch.Generator().manual_seed(4)
    packed = torch.randint(-128, 128, (8, 128), generator=gen, dtype=torch.int8)
    scale = torch.exp2(torch.randint(-10, 3, (8, 256 // FP4_GROUP), generator=gen).float()).to(torch.float8_e8m0fnu)
    whole = transformers_dequant(packed, scale)
    assert torch.equal(decode_columns(packed, scale, "fp4", None, 0, cols), whole[:, cols[0]:cols[1]])
    bf16 = whole.to(torch.bfloat16)
    assert torch.equal(decode_columns(bf16, None, "float", None, 0, cols), bf16[:, cols[0]:cols[1]].float())


def test_fp4_nibble_order():
    # byte 0x21: low nibble 1 (0.5) is element 0, high nibble 2 (1.0) is element 1; 0x97: 7 (6.0) then 9 (-0.5)
    packed = torch.tensor([[0x21, 0x97 - 256]], dtype=torch.int8)
    scale = torch.tensor([[1.0]]).to(torch.float8_e8m0fnu)
    assert decode_rows(packed, scale, "fp4", None, 0).tolist() == [[0.5, 1.0, 6.0, -0.5]]


def test_partial_blocks_match_float64_formula():
    # Real V3 has kv_a_proj_with_mqa at 576 x 7168: the last block row is partial (transformers' CPU
    # dequantization refuses such shapes). Both dims partial here.
    gen = torch.Generator().manual_seed(3)
    rows, cols = 200, 300
    q = random_fp8(rows, cols, gen)
    scale = torch.rand(2, 3, generator=gen, dtype=torch.float64).float() + 1e-3
    i = torch.arange(rows)[:, None] // BLOCK[0]
    j = torch.arange(cols)[None, :] // BLOCK[1]
    exact = q.double() * scale.double()[i, j]  # e4m3 x float32 is exact in float64
    for chunk in (rows, 128, 33):
        assert torch.equal(decode_in_chunks(q, scale, "fp8", chunk), exact.float())


def test_fast_e4m3_cast_equals_torch_on_every_code():
    from dsconv.convert.decode import fp8_e4m3_to_float32

    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
    ours, theirs = fp8_e4m3_to_float32(codes), codes.to(torch.float32)
    assert torch.equal(torch.isnan(ours), torch.isnan(theirs)) and int(torch.isnan(ours).sum()) == 2
    finite = ~torch.isnan(theirs)
    assert torch.equal(ours[finite], theirs[finite])
    assert torch.equal(torch.signbit(ours[finite]), torch.signbit(theirs[finite]))  # -0 stays -0


@pytest.mark.parametrize("family", ["deepseek_v3", "deepseek_v32", "deepseek_v4"])
def test_decoders_equal_transformers_on_every_fixture_tensor(tiny_source, family):
    from dsconv.convert.source import open_checkpoint

    checkpoint = open_checkpoint(tiny_source(family, "fp8"))
    seen = set()
    for weight in checkpoint.weights:
        if weight.encoding not in ("fp8", "fp4"):
            continue
        q, scale = weight.value.read(), weight.scale.read()
        rows = q.shape[0]
        ours = decode_rows(q, scale, weight.encoding, checkpoint.block, 0) if rows else q.float()
        assert torch.equal(ours, transformers_dequant(q, scale)), weight.spec.name
        seen.add(weight.encoding)
    assert seen == ({"fp8", "fp4"} if family == "deepseek_v4" else {"fp8"})
