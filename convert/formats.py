"""Output layouts that engines read: msModelSlim's (vllm-ascend, MindIE) and compressed-tensors' (vLLM).

A format names the weight files and the index, says which tensors an INT8 linear becomes, and writes the
side files (config.json, the Ascend quantization description). Tensor names are the hub's, whatever names the
source had: HF names for V3/V3.2, DeepSeek's original names for V4 (which is what transformers reads for V4 too),
and config.json is in the hub's form (the family's `hub_config`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsconv.errors import InputError

SCALE_DTYPE = torch.float32  # per-channel scales; bf16 would cost INT8 accuracy on the dequantized weight


@dataclass(frozen=True)
class IntTensor:
    suffix: str  # replaces the trailing "weight" of the source name
    dtype: torch.dtype
    per_channel: bool  # [out, 1] when True, else the weight's own [out, in]


@dataclass(frozen=True)
class OutputFormat:
    name: str
    part_stem: str  # weight files are f"{part_stem}-{i:05d}-of-{n:05d}.safetensors"
    index_name: str
    int8_tensors: tuple[IntTensor, ...]
    help: str
    mtp_copies: bool = False  # also write the family's `ascend_mtp_copies`, as msModelSlim does

    def part_name(self, i: int, n: int) -> str:
        return f"{self.part_stem}-{i + 1:05d}-of-{n:05d}.safetensors"


_WEIGHT = IntTensor("weight", torch.int8, per_channel=False)
_SCALE = IntTensor("weight_scale", SCALE_DTYPE, per_channel=True)
_OFFSET = IntTensor("weight_offset", SCALE_DTYPE, per_channel=True)  # zeros: symmetric
# An INT8 linear as compressed-tensors writes it, and as shards keep it from either format (the sharder checks
# and drops the Ascend all-zero offset: the runner is symmetric)
WEIGHT_AND_SCALE = (_WEIGHT, _SCALE)

ASCEND = OutputFormat(
    "ascend", "quant_model_weights", "quant_model_weights.safetensors.index.json", (_WEIGHT, _SCALE, _OFFSET),
    "msModelSlim W8A8_DYNAMIC layout read by vllm-ascend (--quantization ascend) and MindIE: "
    "quant_model_weights-*.safetensors + quant_model_description.json",
    mtp_copies=True,
)
COMPRESSED_TENSORS = OutputFormat(
    "compressed-tensors", "model", "model.safetensors.index.json", WEIGHT_AND_SCALE,
    "compressed-tensors int-quantized layout read by vLLM: model-*.safetensors + quantization_config in config.json",
)
FORMATS = {f.name: f for f in (ASCEND, COMPRESSED_TENSORS)}

DESCRIPTION_NAME = "quant_model_description.json"
ASCEND_INT8 = "W8A8_DYNAMIC"
ASCEND_FLOAT = "FLOAT"


def format_for(name: str) -> OutputFormat:
    if name not in FORMATS:
        raise InputError(f"unknown format {name!r}; choose from {', '.join(FORMATS)}")
    return FORMATS[name]


def ascend_description(tensor_types: dict[str, str]) -> dict:
    """Every saved tensor -> W8A8_DYNAMIC or FLOAT, then the file-level keys msModelSlim writes."""
    return {
        **tensor_types,
        "version": "1.0.0",
        "model_quant_type": ASCEND_INT8,
        "metadata": {},
        "group_size": 0,
        "optional": {},
    }


def compressed_tensors_config(ignore: list[str]) -> dict:
    """W8A8: static symmetric per-channel INT8 weights, dynamic symmetric per-token INT8 activations."""
    int8 = {"num_bits": 8, "type": "int", "symmetric": True}
    return {
        "quant_method": "compressed-tensors",
        "format": "int-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {**int8, "strategy": "channel", "dynamic": False},
                "input_activations": {**int8, "strategy": "token", "dynamic": True},
                "output_activations": None,
                "format": "int-quantized",
            }
        },
        "ignore": ignore,
    }


def output_config(hub_config: dict, fmt: OutputFormat, ignore: list[str]) -> dict:
    """config.json for the output, from the source's in the hub's form: the source's FP8 quantization_config
    no longer describes the weights."""
    config = {k: v for k, v in hub_config.items() if k != "quantization_config"}
    if fmt is COMPRESSED_TENSORS:
        config["quantization_config"] = compressed_tensors_config(ignore)
    return config


# Side files copied next to the weights (tokenizer, generation config, remote code), as msModelSlim does.
SIDE_FILE_SUFFIXES = (".json", ".py", ".txt", ".jinja", ".model", ".md")
NOT_SIDE_FILES = ("config.json",)  # rewritten, not copied


def is_side_file(name: str) -> bool:
    return (name.endswith(SIDE_FILE_SUFFIXES) and not name.endswith("index.json")
            and name not in NOT_SIDE_FILES and not name.startswith("."))
