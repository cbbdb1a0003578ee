"""The compressed-tensors output through that library's own config validation and dequantization.

(transformers 5.23 cannot load a compressed-tensors DeepSeek MoE checkpoint on CPU: its packed-expert loader
finds no per-expert tensors. So the checks go through compressed-tensors directly.)
"""

import json

import pytest
import torch
from compressed_tensors.quantization import QuantizationConfig, QuantizationStatus, QuantizationStrategy, dequantize

from tests.helpers import COSINE_MIN, FAMILIES, cosine, quantize, read_all, source_reference


@pytest.mark.parametrize("family", FAMILIES)
def test_compressed_tensors_output(tiny_source, tmp_path, family):
    src = tiny_source(family, "fp8")
    out = tmp_path / "out"
    quantize(src, out, fmt="compressed-tensors")
    config = json.loads((out / "config.json").read_text())
    qconfig = QuantizationConfig.model_validate(config["quantization_config"])
    assert qconfig.quant_method == "compressed-tensors" and qconfig.format == "int-quantized"
    assert qconfig.quantization_status == QuantizationStatus.COMPRESSED
    (scheme,) = qconfig.config_groups.values()
    assert scheme.targets == ["Linear"]
    weights, acts = scheme.weights, scheme.input_activations
    assert (weights.num_bits, weights.type, weights.symmetric, weights.strategy, weights.dynamic) == (
        8, "int", True, QuantizationStrategy.CHANNEL, False)
    assert (acts.num_bits, acts.strategy, acts.dynamic) == (8, QuantizationStrategy.TOKEN, True)

    tensors, _ = read_all(out, "model.safetensors.index.json")
    reference = source_reference(src)
    int8 = [n for n, t in tensors.items() if t.dtype == torch.int8]
    assert int8
    for name in int8:
        scale = tensors[name.removesuffix("weight") + "weight_scale"]
        assert scale.shape == (tensors[name].shape[0], 1)
        assert name.removesuffix("weight") + "weight_offset" not in tensors  # symmetric: no zero point
        restored = dequantize(tensors[name], scale, args=weights).float()
        assert cosine(restored, reference[name]) >= COSINE_MIN, name
        assert name.removesuffix(".weight") not in qconfig.ignore
    # every float linear is listed in `ignore`, by module name, so no engine quantizes it on the fly
    float_linears = {n.removesuffix(".weight") for n, t in tensors.items()
                     if n.endswith(".weight") and t.dim() == 2 and t.dtype != torch.int8}
    lm_head = "head" if family == "deepseek_v4" else "lm_head"
    assert lm_head in qconfig.ignore
    not_ignored = float_linears - set(qconfig.ignore)
    assert all(n.endswith(("embed_tokens", "embed")) for n in not_ignored), not_ignored  # embeddings aren't Linear
