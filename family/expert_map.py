"""Where each MoE layer's physical experts live: the map `dsconv shard --num-redundant-experts` writes into the
manifest and dsrun routes by (runner/models/eplb.py), and the two files that feed it, a recorded load and a placement.

- **The map.** Each of the EP ranks holds `slots_per_rank` = (n_routed_experts + R) / ep physical experts (slots);
  per layer, `layers[prefix][p]` is the logical expert that slot p holds, slot p on EP rank p // slots_per_rank.
  A rank's slots hold distinct experts in ascending order (family/eplb.py: replicas apart), so a rank's experts are
  named by their logical ids in its shards, and its stacks keep the order they had without replicas. R = 0 with no
  load is the identity: rank k holds experts [k * E / ep, (k + 1) * E / ep), the placement table's blocks.
- **Round-robin** (no load given): slot p holds expert p mod E, each rank's then sorted.
- **A load record** (`dsrun ... --expert-load-record FILE`, format "dsrun-expert-load"): per layer, the tokens each
  logical expert took over a run, summed over every rank, with the model it came from.
- **A placement** (format "dsrun-expert-placement"): per layer, the physical list itself, as the manifest records
  it (SGLang's --init-expert-location in our terms).

Layers are named by their experts' tensor prefix ("model.layers.3.mlp.experts", "layers.3.ffn.experts"), the MTP
layer's included.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from dsconv.errors import InputError
from dsconv.family.eplb import place

LOAD_FORMAT, PLACEMENT_FORMAT = "dsrun-expert-load", "dsrun-expert-placement"
_EXPERT_NAME = re.compile(r"^(.*\.experts)\.(\d+)\.")


def experts_prefix(name: str) -> str:
    """A routed expert's tensor name -> its layer's experts prefix."""
    match = _EXPERT_NAME.match(name)
    if match is None:
        raise ValueError(f"{name} is not a routed expert's tensor")
    return match.group(1)


@dataclass(frozen=True)
class ModelKey:
    """What a load or placement file must match: the family, its experts per layer, and its MoE layers."""
    family: str
    experts: int
    layers: tuple[str, ...]

    @classmethod
    def of(cls, family: str, experts: int, names) -> "ModelKey":
        """From the model's tensor names (the routed experts' give the MoE layers, in sorted order)."""
        return cls(family, experts, tuple(sorted({experts_prefix(n) for n in names if _EXPERT_NAME.match(n)})))

    def to_json(self) -> dict:
        return {"family": self.family, "n_routed_experts": self.experts, "layers": list(self.layers)}

    def check(self, data: dict, path: Path) -> None:
        theirs = data.get("model")
        if theirs != self.to_json():
            what = "no model" if not isinstance(theirs, dict) else (
                f"{theirs.get('family')} with {theirs.get('n_routed_experts')} experts in "
                f"{len(theirs.get('layers') or ())} MoE layers")
            raise InputError(f"{path} is for another model ({what}; these shards are {self.family} with "
                             f"{self.experts} experts in {len(self.layers)} MoE layers)")


@dataclass(frozen=True)
class ExpertMap:
    experts: int  # logical experts per layer
    ep: int
    nodes: int  # the nodes the EP ranks span (the hierarchical policy's)
    layers: dict[str, tuple[int, ...]]  # experts prefix -> the logical expert of each physical slot

    def __post_init__(self):
        if self.nodes < 1 or self.ep % self.nodes:
            raise InputError(f"{self.ep} EP ranks do not divide over {self.nodes} nodes")
        for prefix, physical in self.layers.items():
            check_physical(prefix, physical, self.experts, self.ep)
        if len({len(physical) for physical in self.layers.values()}) > 1:
            raise InputError(f"the layers' physical experts differ in number "
                             f"({sorted({len(p) for p in self.layers.values()})}): every layer has the same slots")

    @property
    def slots(self) -> int:
        return len(next(iter(self.layers.values()))) if self.layers else self.experts

    @property
    def redundant(self) -> int:
        return self.slots - self.experts

    @property
    def slots_per_rank(self) -> int:
        return self.slots // self.ep

    def held(self, prefix: str, ep_rank: int) -> tuple[int, ...]:
        """The logical experts EP rank `ep_rank` holds in layer `prefix`, in slot order."""
        per_rank = self.slots_per_rank
        return self.layers[prefix][ep_rank * per_rank:(ep_rank + 1) * per_rank]

    def holders(self, prefix: str, expert: int) -> list[int]:
        """The EP ranks holding logical expert `expert` in layer `prefix`."""
        per_rank = self.slots_per_rank
        return [slot // per_rank for slot, e in enumerate(self.layers[prefix]) if e == expert]

    def to_json(self) -> dict:
        return {"redundant": self.redundant, "nodes": self.nodes,
                "layers": {prefix: list(physical) for prefix, physical in self.layers.items()}}

    @classmethod
    def from_json(cls, data: dict, experts: int, ep: int) -> "ExpertMap":
        return cls(experts, ep, int(data.get("nodes", 1)),
                   {prefix: tuple(int(e) for e in physical) for prefix, physical in data["layers"].items()})

    @classmethod
    def round_robin(cls, prefixes: list[str], experts: int, redundant: int, ep: int, nodes: int = 1) -> "ExpertMap":
        slots = _slots(experts, redundant, ep)
        per_rank = slots // ep
        physical = tuple(e for r in range(ep) for e in sorted(p % experts for p in range(r * per_rank,
                                                                                          (r + 1) * per_rank)))
        return cls(experts, ep, nodes, dict.fromkeys(prefixes, physical))

    @classmethod
    def from_loads(cls, loads: dict[str, list[float]], experts: int, redundant: int, ep: int, groups: int,
                   nodes: int) -> "ExpertMap":
        """The hierarchical placement (family/eplb.py) of each layer's loads."""
        slots = _slots(experts, redundant, ep)
        return cls(experts, ep, nodes, {prefix: place(layer, slots, groups, nodes, ep).physical
                                        for prefix, layer in loads.items()})


def _slots(experts: int, redundant: int, ep: int) -> int:
    if redundant < 0:
        raise InputError(f"--num-redundant-experts {redundant} is negative")
    slots = experts + redundant
    if slots % ep:
        raise InputError(f"{experts} experts + {redundant} redundant = {slots} physical experts do not divide over "
                         f"EP {ep}: choose --num-redundant-experts so that the sum is a multiple of the EP size")
    if slots // ep > experts:
        raise InputError(f"{redundant} redundant experts put {slots // ep} slots on each EP rank, more than the "
                         f"{experts} experts: a rank holds at most one replica of each")
    return slots


def check_physical(prefix: str, physical: tuple[int, ...], experts: int, ep: int) -> None:
    """One layer's physical list: every logical expert at least once, ids in range, equal slots per rank, no rank
    holding an expert twice."""
    if len(physical) % ep or len(physical) < experts:
        raise InputError(f"{prefix}: {len(physical)} physical experts do not give {ep} EP ranks equal slots for "
                         f"{experts} experts")
    outside = sorted({e for e in physical if not 0 <= e < experts})
    if outside:
        raise InputError(f"{prefix}: physical experts name {outside[:4]}, outside the {experts} experts")
    missing = sorted(set(range(experts)) - set(physical))
    if missing:
        raise InputError(f"{prefix}: the placement omits experts {missing[:8]}" + (" ..." if len(missing) > 8 else "")
                         + ": every logical expert needs at least one physical slot")
    per_rank = len(physical) // ep
    for rank in range(ep):
        held = physical[rank * per_rank:(rank + 1) * per_rank]
        if list(held) != sorted(set(held)):
            raise InputError(f"{prefix}: EP rank {rank}'s slots {list(held)} are not distinct experts in ascending "
                             f"order")


def _read(path: Path, fmt: str, key: ModelKey) -> dict:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as error:
        raise InputError(f"{path}: not a readable JSON file ({error})") from None
    if not isinstance(data, dict) or data.get("format") != fmt:
        found = data.get("format") if isinstance(data, dict) else None
        raise InputError(f"{path}: not a {fmt} file (its format is {found!r})")
    key.check(data, path)
    return data


def load_record(key: ModelKey, loads: dict[str, list[int]]) -> dict:
    """A load record's contents (its writer writes it whole or not at all)."""
    return {"format": LOAD_FORMAT, "model": key.to_json(), "loads": loads}


def read_loads(path: Path, key: ModelKey) -> dict[str, list[float]]:
    data = _read(path, LOAD_FORMAT, key)
    loads = data.get("loads")
    if not isinstance(loads, dict) or set(loads) != set(key.layers) or any(
            not isinstance(v, list) or len(v) != key.experts or any(not isinstance(x, (int, float)) or x < 0
                                                                    for x in v) for v in loads.values()):
        raise InputError(f"{path}: its loads must give {key.experts} non-negative counts for each of the "
                         f"{len(key.layers)} MoE layers")
    return {prefix: [float(x) for x in loads[prefix]] for prefix in key.layers}


def placement_record(key: ModelKey, experts_map: ExpertMap) -> dict:
    """A placement file's contents."""
    return {"format": PLACEMENT_FORMAT, "model": key.to_json(), "ep": experts_map.ep, **experts_map.to_json()}


def read_placement(path: Path, key: ModelKey, ep: int) -> ExpertMap:
    data = _read(path, PLACEMENT_FORMAT, key)
    if data.get("ep") != ep:
        raise InputError(f"{path}: a placement for EP {data.get('ep')}, not EP {ep}")
    layers = data.get("layers")
    if not isinstance(layers, dict) or set(layers) != set(key.layers):
        raise InputError(f"{path}: its layers must be the {len(key.layers)} MoE layers of these shards")
    return ExpertMap.from_json(data, key.experts, ep)
