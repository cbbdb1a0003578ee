"""Source encodings decoded to float32, one row range (and, for a column split, one column range) at a time.

Dispatch is on the stored dtypes, never on config strings: a float8_e4m3fn weight needs a block scale
(float32 `weight_scale_inv` in V3/V3.2, e8m0 `scale` in V4); an int8 weight next to an e8m0 scale is
packed FP4 (two e2m1 values per byte, low nibble first); a float weight without a scale is taken as is.
"""

from __future__ import annotations

import torch

from dsconv.errors import InputError

# e2m1 code -> value; bit 3 is the sign
FP4_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
FP4_PER_BYTE = 2
E8M0_BIAS = 127
FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
E8M0_DTYPES = (torch.float8_e8m0fnu, torch.uint8)  # uint8: e8m0 bytes saved without the float8 dtype


def scale_to_float32(scale: torch.Tensor) -> torch.Tensor:
    if scale.dtype == torch.uint8:
        return torch.exp2(scale.to(torch.float32) - E8M0_BIAS)
    if scale.dtype in (torch.float8_e8m0fnu, torch.float32, torch.bfloat16, torch.float16):
        return scale.to(torch.float32)
    raise InputError(f"unsupported scale dtype {scale.dtype}")


def encoding_of(value: torch.dtype, scale: torch.dtype | None) -> str:
    """Name the encoding of a (weight, scale) pair, or raise naming what does not fit."""
    if scale is None:
        if value in FLOAT_DTYPES:
            return "float"
        if value in (torch.int32, torch.int64):
            return "int"
        if value == torch.float8_e4m3fn:
            raise InputError("FP8 weight without a scale")
        if value == torch.int8:
            raise InputError("int8 (packed FP4) weight without a scale")
        raise InputError(f"unsupported weight dtype {value}")
    if value == torch.float8_e4m3fn and scale in (torch.float32, torch.bfloat16, *E8M0_DTYPES):
        return "fp8"
    if value == torch.int8 and scale in E8M0_DTYPES:
        return "fp4"
    raise InputError(f"unsupported weight/scale dtypes {value} / {scale}")


def decoded_shape(value_shape: tuple[int, ...], encoding: str) -> tuple[int, ...]:
    if encoding == "fp4":
        return (*value_shape[:-1], value_shape[-1] * FP4_PER_BYTE)
    return value_shape


def check_scale_shape(value_shape: tuple[int, ...], scale_shape: tuple[int, ...], encoding: str,
                      block: tuple[int, int] | None) -> None:
    if len(value_shape) != 2:
        raise InputError(f"a {encoding.upper()} weight must be 2-D [out, in], found shape {list(value_shape)}")
    rows, cols = decoded_shape(value_shape, encoding)
    if encoding == "fp8":
        if block is None:
            raise InputError("FP8 weight but config.json has no quantization_config.weight_block_size")
        expected = (-(-rows // block[0]), -(-cols // block[1]))
        if tuple(scale_shape) != expected:
            raise InputError(f"scale shape {tuple(scale_shape)} does not match {expected} for a {rows}x{cols} "
                             f"weight in {block[0]}x{block[1]} blocks")
    elif encoding == "fp4":
        if len(scale_shape) != 2 or scale_shape[0] != rows or scale_shape[1] == 0 or cols % scale_shape[1]:
            raise InputError(f"FP4 scale shape {tuple(scale_shape)} does not tile a {rows}x{cols} weight by rows")


# e4m3 (bias 7) shares fp16's layout shifted right by 7 bits: the magnitude bits moved into fp16's exponent
# and mantissa fields read as value * 2^(7 - 15), normals and subnormals alike. This is exact and several
# times faster on CPU than torch's own float8 cast.
E4M3_TO_F16_SHIFT = 7
E4M3_TO_F16_RESCALE = 2.0 ** (15 - 7)
E4M3_NAN_MAGNITUDE = 0x7F  # e4m3fn has no infinities; S.1111.111 is NaN


def fp8_e4m3_to_float32(q: torch.Tensor) -> torch.Tensor:
    u = q.view(torch.uint8)
    bits = u.to(torch.int16)
    sign = (bits & 0x80).bitwise_left_shift_(8)
    magnitude = bits.bitwise_and_(E4M3_NAN_MAGNITUDE)
    has_nan = bool(magnitude.amax() == E4M3_NAN_MAGNITUDE) if magnitude.numel() else False
    magnitude.bitwise_left_shift_(E4M3_TO_F16_SHIFT).bitwise_or_(sign)
    x = magnitude.view(torch.float16).to(torch.float32).mul_(E4M3_TO_F16_RESCALE)
    if has_nan:  # the bit trick reads NaN codes as +-480; restore them so finiteness checks see them
        x[(u & E4M3_NAN_MAGNITUDE) == E4M3_NAN_MAGNITUDE] = float("nan")
    return x


def decode_fp8_rows(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], first_row: int = 0) -> torch.Tensor:
    """q [rows, cols] float8_e4m3fn starting at weight row `first_row`; scale holds the block rows it spans."""
    rows, cols = q.shape
    skip = first_row % block[0]
    s = scale_to_float32(scale).repeat_interleave(block[0], dim=0)[skip:skip + rows]  # [rows, col blocks]
    x = fp8_e4m3_to_float32(q)
    if cols % block[1] == 0:  # broadcast each block's scale over its columns without expanding it
        x.view(rows, -1, block[1]).mul_(s[:, :, None])
        return x
    return x.mul_(s.repeat_interleave(block[1], dim=1)[:, :cols])


_FP4_TABLE = torch.tensor(FP4_E2M1_VALUES, dtype=torch.float32)


def decode_fp4_rows(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """packed [rows, cols/2] int8 (low nibble = even column); scale [rows, cols/group] e8m0."""
    rows, half = packed.shape
    u8 = packed.view(torch.uint8)
    codes = torch.stack((u8 & 0xF, u8 >> 4), dim=-1).reshape(rows, half * FP4_PER_BYTE)
    values = _FP4_TABLE[codes.long()]
    group = values.shape[1] // scale.shape[1]
    return values.view(rows, scale.shape[1], group).mul_(scale_to_float32(scale)[:, :, None]).view(rows, -1)


def scale_rows(encoding: str, block: tuple[int, int] | None, row_start: int, row_stop: int) -> tuple[int, int]:
    """The rows of the scale tensor that weight rows [row_start, row_stop) need."""
    if encoding == "fp8":
        return row_start // block[0], -(-row_stop // block[0])
    return row_start, row_stop


def decode_rows(value_rows: torch.Tensor, scales: torch.Tensor | None, encoding: str,
                block: tuple[int, int] | None, row_start: int) -> torch.Tensor:
    """Weight rows starting at `row_start` as float32; `scales` are the scale rows `scale_rows` named."""
    if encoding == "float":
        return value_rows.to(torch.float32)
    if encoding == "fp8":
        return decode_fp8_rows(value_rows, scales, block, row_start)
    if encoding == "fp4":
        return decode_fp4_rows(value_rows, scales)
    raise InputError(f"cannot decode encoding {encoding}")


def decode_columns(value_rows: torch.Tensor, scales: torch.Tensor | None, encoding: str,
                   block: tuple[int, int] | None, row_start: int, cols: tuple[int, int]) -> torch.Tensor:
    """Columns [cols[0], cols[1]) of `decode_rows(...)`, decoding only those columns when the range starts and
    ends on a scale block (a column split over attention TP does; each of its ranks would otherwise decode
    every column of every row). Decoding is elementwise, so the values are those of decoding whole rows."""
    start, stop = cols
    total = decoded_shape(tuple(value_rows.shape), encoding)[1]
    if encoding == "float":
        return value_rows[:, start:stop].to(torch.float32).contiguous()
    unit = _scale_columns(encoding, block, total, scales)
    if start % unit or (stop % unit and stop != total):  # a block straddles the edge: decode it all
        return decode_rows(value_rows, scales, encoding, block, row_start)[:, start:stop].contiguous()
    scale_slice = scales[:, start // unit:-(-stop // unit)]
    if encoding == "fp4":
        value_slice = value_rows[:, start // FP4_PER_BYTE:stop // FP4_PER_BYTE]
    else:
        value_slice = value_rows[:, start:stop]
    return decode_rows(value_slice, scale_slice, encoding, block, row_start)


def _scale_columns(encoding: str, block: tuple[int, int] | None, total: int, scales: torch.Tensor) -> int:
    """Weight columns per scale column."""
    if encoding == "fp8":
        return block[1]
    if encoding == "fp4":
        return total // scales.shape[1]
    raise InputError(f"cannot decode encoding {encoding}")
