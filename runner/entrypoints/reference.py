"""The reference forward `dsrun compare` measures our shards against: transformers' own DeepSeek model of the source
checkpoint as downloaded, run one decoder layer at a time so that a host with a fraction of the model's size in
memory can run it.

The model is built by transformers on the meta device (no storage). Hooks on its modules load each part's tensors
just before the part runs and free them right after:
  - the embedding, then each decoder layer in turn, then the final norm and the head;
  - a part's tensors are read from the source's safetensors, FP8 and FP4 weights decoded by transformers' own
    dequantization (`Fp8Dequantize`, block scales or V4's e8m0 scales per 32 inputs);
  - they are renamed by transformers' own conversion mapping for the family (the one `from_pretrained` applies:
    hub names to module names), and the tensors it fuses (each expert's weights stacked into one parameter, gate
    and up concatenated) are written one at a time into their slices of the fused parameter, allocated once, where
    `from_pretrained` would hold them all and then their stacked copies.
So the forward is transformers' code end to end, masks, rotary tables and V4's hyper-connections included. What
it holds at a time is one part's weights plus the activations. Rotary tables are buffers computed at construction
(not stored in checkpoints), so the rotary modules are rebuilt on the CPU once.

One change to transformers' arithmetic: inside the indexers (V3.2's over positions, V4's over compressed entries),
`Tensor.topk` breaks exact ties toward the lowest index, the tie rule our indexer follows (kernels/topk.py). Their
relu leaves many scores at exactly 0, and torch.topk orders ties as the call's shape happens to, so the two sides
would otherwise attend to different keys of equal score.

transformers is not a dependency of the runner: `dsrun compare` needs it installed (`pip install 'dsconv[compare]'`).
"""

from __future__ import annotations

import copy
import dataclasses
import math
import re
from pathlib import Path
from typing import Callable

import torch

from dsconv.convert.source import Checkpoint, SourceWeight, open_checkpoint
from dsconv.errors import InputError
from dsconv.family.arch import TensorSpec
from dsconv.kernels.topk import topk_lowest_index

# transformers' config classes take these hub keys as constructor arguments and fold them into their own fields
LEGACY_KEYS = {"deepseek_v3": ("rope_scaling", "rope_theta"), "deepseek_v32": ("rope_scaling", "rope_theta"),
               "deepseek_v4": ("compress_ratios", "num_hash_layers", "qk_rope_head_dim", "rope_scaling")}
CONFIG_CLASSES = {"deepseek_v3": "DeepseekV3Config", "deepseek_v32": "DeepseekV32Config",
                  "deepseek_v4": "DeepseekV4Config"}
LOGITS = "logits"  # what the observer is told for the head's output

# A part of the model and the hub-name test of its tensors
EMBEDDING, TOP, HEAD = "embedding", "top", "head"


def require_transformers():
    try:
        import transformers
    except ImportError:
        raise InputError("dsrun compare runs transformers' DeepSeek model as its reference, and transformers is "
                         "not installed: pip install 'dsconv[compare]'") from None
    return transformers


def transformers_config(family: str, raw: dict):
    """config.json as transformers' config class for the family takes it: only the keys the class knows."""
    transformers = require_transformers()
    if family not in CONFIG_CLASSES:
        raise InputError(f"dsrun compare has no transformers reference for model_type {family!r}; one of "
                         f"{', '.join(CONFIG_CLASSES)}")
    cls = getattr(transformers, CONFIG_CLASSES[family])
    known = {f.name for f in dataclasses.fields(cls)} | set(LEGACY_KEYS[family])
    # a copy: the class writes into what it is given (rope_scaling gains rope_theta and rope_type)
    return cls(**{k: copy.deepcopy(v) for k, v in raw.items() if k in known})


def _part_of(spec: TensorSpec) -> str | None:
    """Which part of the model a tensor belongs to: "layer {i}", the embedding, the head, the rest (the final norm,
    V4's hc_head), or None for an MTP layer's (the reference runs the main layers)."""
    if spec.mtp:
        return None
    if spec.layer is not None:
        return f"layer {spec.layer}"
    if spec.name in ("embed.weight", "model.embed_tokens.weight"):  # V4's hub name, V3's
        return EMBEDDING
    if spec.name in ("head.weight", "lm_head.weight"):
        return HEAD
    return TOP


def decode(weight: SourceWeight, block: tuple[int, int] | None) -> torch.Tensor:
    """A source tensor's values: FP8 / FP4 through transformers' dequantization (float32), the rest as stored.

    block: the checkpoint's FP8 weight block. transformers 5.23's Fp8Dequantize takes the block from the scale
    grid and refuses a weight it does not divide: the real V3 / V3.2 kv_a_proj_with_mqa, [576, 7168] with a [5, 56]
    grid of 128 x 128 blocks, the last block row partial. Such a weight is zero-padded to whole blocks for it and
    cropped after (each value is still its code times its block's scale)."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    value = weight.value.read()
    if weight.encoding in ("fp8", "fp4"):
        scale = weight.scale.read()
        rows, cols = value.shape
        whole = (scale.shape[0] * block[0], scale.shape[1] * block[1]) if weight.encoding == "fp8" and block else None
        if whole is not None and (rows, cols) != whole:
            value = torch.nn.functional.pad(value.view(torch.uint8), (0, whole[1] - cols, 0, whole[0] - rows))
            return Fp8Dequantize(None)._dequantize_one(value.view(weight.value.entry.dtype), scale,
                                                       output_dtype=torch.float32)[:rows, :cols]
        return Fp8Dequantize(None)._dequantize_one(value, scale, output_dtype=torch.float32)
    if weight.encoding in ("int", "float"):
        return value
    raise InputError(f"{weight.spec.name} is stored {weight.encoding}: the reference is the checkpoint as "
                     f"downloaded (BF16, or FP8 / FP4 with block scales), not a converted one")


def _topk_lowest_index(tensor: torch.Tensor, k: int, dim: int = -1, largest: bool = True, sorted: bool = True):
    """Tensor.topk as the indexers call it (the last dim, largest first), ties toward the lowest index."""
    if dim not in (-1, tensor.dim() - 1) or not largest:
        raise NotImplementedError(f"the reference's indexer top-k takes the largest along the last dim, not dim={dim} "
                                  f"largest={largest}")
    indices = topk_lowest_index(tensor, k)
    return torch.return_types.topk((tensor.gather(-1, indices), indices))


class Reference:
    """transformers' model of `source`, run one part at a time. observe(name, output) sees each decoder layer's
    output (name: the layer's index; V4: its hyper-connection streams) and the logits (name LOGITS)."""

    def __init__(self, source: Path, dtype: torch.dtype):
        transformers = require_transformers()
        from transformers.conversion_mapping import get_model_conversion_mapping

        transformers.utils.logging.disable_progress_bar()  # a bar per part loaded is noise
        self.checkpoint: Checkpoint = open_checkpoint(source)
        family = self.checkpoint.family.name
        self.dtype = dtype
        self.config = transformers_config(family, self.checkpoint.config)
        with torch.device("meta"):
            self.model = transformers.AutoModelForCausalLM.from_config(self.config, dtype=dtype).eval()
        self._rebuild_rotary()
        from transformers.core_model_loading import WeightConverter

        mapping = get_model_conversion_mapping(self.model)
        self.converters = [t for t in mapping if isinstance(t, WeightConverter)]
        self.renamings = [t for t in mapping if not isinstance(t, WeightConverter)]
        # every tensor transformers' model loads, by name: what the renamed source tensors must land on
        self.meta_shapes = {name: tuple(t.shape) for name, t in self.model.state_dict().items()}
        self.parts: dict[str, list[SourceWeight]] = {}
        for weight in self.checkpoint.weights:
            part = _part_of(weight.spec)
            if part is not None:
                self.parts.setdefault(part, []).append(weight)
        self.largest_part_bytes = max(self._part_bytes(part) for part in self.parts)
        self._load(TOP)  # the final norm (and V4's hc_head): small, kept

    def _part_bytes(self, part: str) -> int:
        return sum(math.prod(w.spec.shape) for w in self.parts[part]) * self.dtype.itemsize

    def _rebuild_rotary(self, root: torch.nn.Module | None = None) -> None:
        """The rotary modules under root (default: the model) built again on the CPU: their tables are computed at
        construction, never loaded."""
        root = self.model if root is None else root
        for name, module in list(root.named_modules()):
            if type(module).__name__.endswith("RotaryEmbedding"):
                parent, _, child = name.rpartition(".")
                setattr(root.get_submodule(parent) if parent else root, child, type(module)(self.config))

    def _load(self, part: str) -> None:
        """The part's tensors into the model, one decoded tensor at a time: each is renamed by transformers'
        conversion mapping and either set as its parameter or buffer, or, for tensors the mapping fuses (experts
        stacked, gate and up concatenated), written into its slice of the fused parameter, allocated once. So the
        part's own size is all it holds, not its tensors and their fused copies."""
        from transformers.core_model_loading import apply_renamings, rename_source_key

        written: dict[str, int] = {}  # a fused tensor -> the source tensors written into it
        expected: dict[str, int] = {}  # and how many it takes: experts x the patterns it concatenates
        for weight in self.parts[part]:
            target, pattern = rename_source_key(weight.spec.name, self.renamings, self.converters,
                                                self.model.base_model_prefix, self.meta_shapes)
            if target not in self.meta_shapes:
                raise InputError(f"transformers' {type(self.model).__name__} has no tensor for the reference's "
                                 f"{weight.spec.name} (renamed {target})")
            value = decode(weight, self.checkpoint.block)
            if pattern is None:
                self._set(target, value)
                continue
            converter = next(c for c in self.converters if pattern in c.source_patterns)
            expected[target] = self._write_fused(target, converter, pattern,
                                                 apply_renamings(weight.spec.name, self.renamings), value)
            written[target] = written.get(target, 0) + 1
        for target, count in written.items():
            if count != expected[target]:
                raise InputError(f"the reference's {part} gave {count} of the {expected[target]} tensors "
                                 f"transformers fuses into {target}")

    def _target_tensor(self, target: str) -> tuple[torch.nn.Module, str]:
        path, _, leaf = target.rpartition(".")
        return self.model.get_submodule(path), leaf

    def _set(self, target: str, value: torch.Tensor) -> None:
        """A parameter or buffer of the model, in the dtype transformers gave it."""
        module, leaf = self._target_tensor(target)
        meta = getattr(module, leaf)
        if tuple(value.shape) != tuple(meta.shape):
            raise InputError(f"{target}: the reference's tensor is {tuple(value.shape)}, transformers' "
                             f"{tuple(meta.shape)}")
        value = value.to(meta.dtype)
        setattr(module, leaf, torch.nn.Parameter(value, requires_grad=False) if leaf in module._parameters else value)

    def _write_fused(self, target: str, converter, pattern: str, renamed: str, value: torch.Tensor) -> int:
        """One source tensor into its slice of a fused parameter: MergeModulelist(dim=0) stacks the experts in the
        order of their index (the `*` of the pattern), and a following Concatenate(dim=1) puts each source pattern's
        rows (all the same count) after the previous pattern's. -> how many source tensors the parameter takes."""
        from transformers.core_model_loading import Concatenate, MergeModulelist

        ops = [(type(op), op.dim) for op in converter.operations]
        if ops not in ([(MergeModulelist, 0)], [(MergeModulelist, 0), (Concatenate, 1)]):
            raise InputError(f"the reference cannot stream transformers' conversion {converter.operations} into "
                             f"{target}")
        match = re.search(pattern.replace("*.", r"(\d+)\."), renamed)
        if match is None:
            raise InputError(f"{renamed}: no expert index where transformers' pattern {pattern} has one")
        expert = int(match.group(1))
        module, leaf = self._target_tensor(target)
        fused = getattr(module, leaf)
        if fused.is_meta:
            fused = torch.nn.Parameter(torch.empty(fused.shape, dtype=fused.dtype), requires_grad=False)
            setattr(module, leaf, fused)
        concatenated = len(converter.source_patterns) if len(ops) == 2 else 1
        rows = value.shape[0]
        start = converter.source_patterns.index(pattern) * rows if concatenated > 1 else 0
        fused.data[expert, start:start + rows] = value.to(fused.dtype)
        return fused.shape[0] * concatenated

    def _free(self, module: torch.nn.Module) -> None:
        module.to("meta")
        self._rebuild_rotary(module)  # V4's compressors and indexers hold their own

    def _check_loaded(self, module: torch.nn.Module, part: str) -> None:
        missing = [name for name, p in module.named_parameters() if p.is_meta]
        if missing:
            raise InputError(f"the reference checkpoint lacks {part}'s tensor for transformers' {missing[0]} "
                             f"({len(missing)} missing)")

    def run(self, ids: list[int], observe: Callable[[int | str, torch.Tensor], None]) -> None:
        """One forward over `ids`, each part loaded before it runs and freed after."""
        model = self.model
        embed, head = model.get_input_embeddings(), model.get_output_embeddings()
        handles = []

        def loader(part: str):
            def pre_hook(module, _args, _kwargs=None):
                self._load(part)
                self._check_loaded(module, part)
            return pre_hook

        def after(name, free: bool):
            def hook(module, _args, output):
                if name is not None:
                    observe(name, output[0] if isinstance(output, tuple) else output)
                if free:
                    self._free(module)
            return hook

        torch_topk = torch.Tensor.topk

        def stable_ties(_module, _args):
            torch.Tensor.topk = _topk_lowest_index

        def restore(_module, _args, _output):
            torch.Tensor.topk = torch_topk

        for name, module in model.named_modules():
            if type(module).__name__.endswith("Indexer"):  # DeepseekV32Indexer, DeepseekV4Indexer
                handles.append(module.register_forward_pre_hook(stable_ties))
                handles.append(module.register_forward_hook(restore))
        tied = self.config.tie_word_embeddings
        handles.append(embed.register_forward_pre_hook(loader(EMBEDDING)))
        handles.append(embed.register_forward_hook(after(None, free=not tied)))
        for index, layer in enumerate(model.model.layers):
            handles.append(layer.register_forward_pre_hook(loader(f"layer {index}")))
            handles.append(layer.register_forward_hook(after(index, free=True)))
        if not tied:
            handles.append(head.register_forward_pre_hook(loader(HEAD)))
        handles.append(head.register_forward_hook(after(LOGITS, free=not tied)))
        try:
            with torch.no_grad():
                model(input_ids=torch.tensor([ids]), use_cache=False)
        finally:
            torch.Tensor.topk = torch_topk  # also when an indexer raised
            for handle in handles:
                handle.remove()
