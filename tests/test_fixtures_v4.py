"""The tiny deepseek_v4 fixtures: what they hold, and that transformers 5.23 loads and runs them.

The FP8+FP4 fixture and the BF16 fixture come from the same seed, and the maker writes in BF16 exactly the
values the quantized one decodes to (FP8 e4m3 and FP4 e2m1 times a power-of-two scale are exact in BF16).
transformers' dequantization therefore has to reproduce the BF16 weights bit for bit, and the same
forward over the same weights gives equal logits: the comparison is exact, not a tolerance.
"""

import json
import math

import pytest
import torch

from dsconv.family.arch import Encoding
from dsconv.family.deepseek_v4 import AttnType, inventory, parse_config
from dsconv.convert.safetensors_io import read_header

transformers = pytest.importorskip("transformers")

FAMILY = "deepseek_v4"
TOKEN_SEED = 0
PROMPT_TOKENS = 400  # crosses 25 sliding windows, 100 CSA windows and 3 HCA windows of the tiny config
FP8_BLOCK = 128
FP4_BLOCK = 32
PLAIN_DTYPES = {Encoding.BF16: torch.bfloat16, Encoding.F32: torch.float32, Encoding.I64: torch.int64}


@pytest.fixture(scope="module")
def fixtures(tiny_source):
    # conftest's session cache: both built with the maker's default seed, shared with other tests
    return {encoding: tiny_source(FAMILY, encoding) for encoding in ("fp8", "bf16")}


def _written(checkpoint) -> dict:
    entries = {}
    for shard in sorted(checkpoint.glob("*.safetensors")):
        entries.update(read_header(shard))
    return entries


def _config(checkpoint):
    return parse_config(json.loads((checkpoint / "config.json").read_text()))


def _expected(spec) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """Stored name -> (dtype, shape) for one spec, its scale included."""
    weight, out, cols = spec.name, spec.shape[0], spec.shape[-1]
    scale = weight.removesuffix(".weight") + ".scale"
    if spec.encoding is Encoding.FP8:
        grid = (math.ceil(out / FP8_BLOCK), math.ceil(cols / FP8_BLOCK))
        return {weight: (torch.float8_e4m3fn, spec.shape), scale: (torch.float8_e8m0fnu, grid)}
    if spec.encoding is Encoding.FP4:  # two e2m1 per byte, one e8m0 scale per 32 inputs
        return {weight: (torch.int8, (out, cols // 2)), scale: (torch.float8_e8m0fnu, (out, cols // FP4_BLOCK))}
    return {weight: (PLAIN_DTYPES[spec.encoding], spec.shape)}


@pytest.mark.parametrize("encoding", ["fp8", "bf16"])
def test_inventory_is_exactly_what_is_written(fixtures, encoding):
    checkpoint = fixtures[encoding]
    cfg = _config(checkpoint)
    assert cfg.quantized == (encoding == "fp8")
    expected = {}
    for spec in inventory(cfg):
        expected.update(_expected(spec))
    written = {name: (entry.dtype, tuple(entry.shape)) for name, entry in _written(checkpoint).items()}
    assert sorted(written) == sorted(expected)
    assert written == expected


def test_quantized_fixture_holds_every_encoding(fixtures):
    encodings = {spec.encoding for spec in inventory(_config(fixtures["fp8"]))}
    assert encodings == {Encoding.FP8, Encoding.FP4, Encoding.BF16, Encoding.F32, Encoding.I64}


def test_tiny_config_exercises_every_attention_path(fixtures):
    cfg = _config(fixtures["fp8"])
    assert set(cfg.attn_types) == set(AttnType)
    assert cfg.num_hash_layers > 0 and cfg.mtp_attn_types
    assert PROMPT_TOKENS // cfg.sliding_window > 2
    assert PROMPT_TOKENS // cfg.hca_compress_rate > 2
    # more compressed entries than the indexer keeps, so the sparse selection drops some
    assert PROMPT_TOKENS // cfg.csa_compress_rate > cfg.index_topk


def _load(checkpoint, quantized: bool):
    kwargs = {"output_loading_info": True}
    if quantized:
        kwargs["quantization_config"] = transformers.FineGrainedFP8Config(dequantize=True)
    model, info = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, **kwargs)
    return model.eval(), info


@pytest.fixture(scope="module")
def loaded(fixtures):
    return {encoding: _load(path, encoding == "fp8") for encoding, path in fixtures.items()}


@pytest.mark.parametrize("encoding", ["fp8", "bf16"])
def test_transformers_loads_every_tensor(fixtures, loaded, encoding):
    model, info = loaded[encoding]
    assert info["missing_keys"] == set()
    assert info["mismatched_keys"] == set()
    assert info["error_msgs"] == []
    # transformers drops the MTP layer on purpose (`_keys_to_ignore_on_load_unexpected`); nothing else
    assert info["unexpected_keys"] == set()
    assert any(name.startswith("mtp.") for name in _written(fixtures[encoding]))
    assert not any(".mtp." in name or name.startswith("mtp.") for name in model.state_dict())


def test_fp8_dequantization_reproduces_the_bf16_fixture(loaded):
    fp8, bf16 = loaded["fp8"][0].state_dict(), loaded["bf16"][0].state_dict()
    assert fp8.keys() == bf16.keys()
    differing = [name for name in bf16 if not torch.equal(fp8[name], bf16[name])]
    assert differing == []


def test_fp8_logits_equal_bf16_logits(loaded):
    vocab = loaded["bf16"][0].config.vocab_size
    tokens = torch.randint(0, vocab, (1, PROMPT_TOKENS), generator=torch.Generator().manual_seed(TOKEN_SEED))
    with torch.no_grad():
        logits = {encoding: model(tokens).logits for encoding, (model, _) in loaded.items()}
    assert logits["fp8"].shape == (1, PROMPT_TOKENS, vocab)
    assert torch.equal(logits["fp8"], logits["bf16"])
    values = logits["bf16"].float()
    assert torch.isfinite(values).all()
    assert values.std() > 0.1
    # positions disagree on the next token: the forward does not collapse to one output
    assert values.argmax(-1).unique().numel() > 10
