"""A rank's weights stay views of its memory-mapped shards, stacks included, so that the ranks on one machine share
the pages of every replicated weight (16 local ranks at the real dimensions fit 24 GB only so).

The sharder writes what dsrun stacks at load (family.placement.stack_of: a layer's routed experts, fused groups such
as gate/up and V3's q_a/kv_a/indexer inputs) back to back; the model built from a rank's shards must then hold each
stack as one tensor starting at its first member's mapped bytes, with no copy."""

import pytest
import torch

from dsconv.convert.source import open_checkpoint
from dsconv.family.arch import family_for
from dsconv.family.layout import Layout
from dsconv.family.placement import stack_of
from dsconv.runner.models.dist import Dist
from dsconv.runner.models.registry import model_for
from dsconv.runner.models.weights import load_manifest, load_rank
from tests.helpers import shard

WORLD = 4
SCALE_SUFFIX = ".weight_scale"  # an INT8 weight's per-channel scale: `<name>.weight_scale` beside `<name>.weight`


def model_tensors(root) -> dict[int, int]:
    """data_ptr -> bytes of every tensor reachable from a model's attributes."""
    found, seen, todo = {}, set(), [root]
    while todo:
        obj = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            found[obj.data_ptr()] = max(found.get(obj.data_ptr(), 0), obj.numel() * obj.element_size())
        elif isinstance(obj, (list, tuple)):
            todo.extend(obj)
        elif isinstance(obj, dict):
            todo.extend(obj.values())
        elif hasattr(obj, "__dict__") and not isinstance(obj, type):
            todo.extend(vars(obj).values())
    return found


def rank_stacks(weights, specs, family) -> list[list[str]]:
    """The stacks this rank's shards hold, each a list of tensor names in position order (scales apart)."""
    stacks: dict[tuple, list[tuple]] = {}
    for name in weights.tensors:
        is_scale = name.endswith(SCALE_SUFFIX)
        spec = specs[name.removesuffix(SCALE_SUFFIX) + ".weight" if is_scale else name]
        stack = stack_of(spec, family)
        if stack is not None and not spec.mtp:  # the runner drops MTP layers
            stacks.setdefault((*stack[0], is_scale, weights.splits[name] is None), []).append((stack[1], name))
    return [[name for _, name in sorted(members)] for members in stacks.values()]


@pytest.mark.parametrize("precision", ["bf16", "w8a8"])
@pytest.mark.parametrize("family_name", ["deepseek_v32", "deepseek_v4"])
def test_stacks_are_views_of_the_shards(family_name, precision, tiny_source, w8a8_source, tmp_path):
    src = tiny_source(family_name) if precision == "bf16" else w8a8_source(family_name)
    shards = tmp_path / "shards"
    shard(src, shards, Layout(WORLD, ep=WORLD, tp=WORLD))  # small shard files: stacks must not straddle them
    manifest = load_manifest(shards)
    config = manifest["model"]["config"]
    family = family_for(config)
    specs = {weight.spec.name: weight.spec for weight in open_checkpoint(src).weights}
    for rank in (0, WORLD - 1):
        weights = load_rank(shards, manifest, rank)
        mapped = {name: (t.data_ptr(), t.numel() * t.element_size()) for name, t in weights.tensors.items()}
        stacks = rank_stacks(weights, specs, family)
        assert any(len(names) > 2 for names in stacks)  # experts and V3.2's four attention inputs among them
        dist = Dist(rank=rank, ep=WORLD, ep_rank=rank, tp=WORLD)
        model = model_for(family.name).new_model(family.parse_config(config), weights, dist, torch.bfloat16)
        held = model_tensors(model)
        for names in stacks:
            start, size = mapped[names[0]][0], sum(mapped[name][1] for name in names)
            assert all(mapped[a][0] + mapped[a][1] == mapped[b][0] for a, b in zip(names, names[1:])), \
                f"rank {rank}: {names} are not back to back in the shards"
            assert held.get(start, 0) >= size, f"rank {rank}: the model holds {names} as a copy, not a view"
