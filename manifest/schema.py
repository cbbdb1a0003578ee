"""`manifest.json`: the contract between `dsconv shard` and whatever maps the shards (dsrun, verify).

Schema "dsconv-manifest", version 3 (documented in docs/shard.md; version 2, without `experts`, still reads):
  model      {family, config}: the model_type and the whole config.json
  precision  "w8a8" (INT8 weights + per-channel scales) or "bf16"
  layout     world_size, ep, tp, attn_tp, oproj_tp, embed_tp, dp and the rank membership of every process group
  files      [{path, bytes, sha256}]: every weight file, paths relative to the manifest's directory
  side_files [{path, bytes, sha256}]: config.json and tokenizer files, copied once
  tensors    [{name, file, dtype, shape, role, mode, ranks, source {name, shape}, split {dim, start, stop} | null,
               layer, expert, mtp, scale, scale_of}]: one entry per stored tensor; `ranks` are every rank that
               maps it; `scale` names the per-channel scale of an INT8 weight, `scale_of` the weight of a scale.
  experts    {redundant, nodes, layers {experts prefix: [logical expert of each physical slot]}} | null: where the
             routed experts' replicas are (family/expert_map.py); null: EP rank k holds the k-th block of experts.
"""

from __future__ import annotations

import hashlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from dsconv.convert.safetensors_io import DTYPE_NAMES, write_json_atomic

MANIFEST_NAME = "manifest.json"
SCHEMA = "dsconv-manifest"
VERSION = 3  # 2: the layout's oproj_tp and embed_tp; 3: the expert map
READABLE_VERSIONS = (2, 3)
HASH_CHUNK_BYTES = 16 << 20

TOP_LEVEL_KEYS = {"schema": str, "version": int, "model": dict, "precision": str, "layout": dict, "files": list,
                  "side_files": list, "tensors": list}
FILE_KEYS = {"path": str, "bytes": int, "sha256": str}
TENSOR_KEYS = {"name": str, "file": str, "dtype": str, "shape": list, "role": str, "mode": str, "ranks": list,
               "source": dict, "split": (dict, type(None)), "layer": (int, type(None)),
               "expert": (int, type(None)), "mtp": bool, "scale": (str, type(None)), "scale_of": (str, type(None))}
LAYOUT_KEYS = {"world_size": int, "ep": int, "tp": int, "attn_tp": int, "oproj_tp": int, "embed_tp": int, "dp": int,
               "groups": dict}


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def _file_records(out: Path, paths: list[str]) -> list[dict]:
    with ThreadPoolExecutor() as pool:  # hashlib releases the GIL on large updates
        digests = list(pool.map(lambda p: sha256_of(out / p), paths))
    return [{"path": p, "bytes": (out / p).stat().st_size, "sha256": d} for p, d in zip(paths, digests)]


def build_manifest(plan, out: Path) -> dict:
    """plan: a shard.shard.ShardPlan whose files are all written under `out`."""
    from dsconv.convert.formats import DESCRIPTION_NAME, is_side_file

    checkpoint = plan.checkpoint
    side = sorted(p.name for p in checkpoint.root.iterdir()
                  if p.is_file() and p.name != DESCRIPTION_NAME and (is_side_file(p.name) or p.name == "config.json"))
    tensors = []
    for shard_file in plan.files:
        for shard in shard_file.tensors:
            out_tensor = shard.item.outputs[0]
            spec, placement = shard.item.weight.spec, shard.placement
            tensors.append({
                "name": out_tensor.name,
                "file": shard_file.part.name,
                "dtype": DTYPE_NAMES[out_tensor.dtype],
                "shape": list(out_tensor.shape),
                "role": spec.role.value,
                "mode": placement.mode.value,
                "ranks": list(placement.ranks),
                "source": {"name": shard.source.name, "shape": list(shard.source.shape)},
                "split": (None if placement.split is None else
                          dict(zip(("dim", "start", "stop"), placement.split))),
                "layer": spec.layer,
                "expert": spec.expert,
                "mtp": spec.mtp,
                "scale": shard.scale,
                "scale_of": shard.companion_of,
            })
    return {
        "schema": SCHEMA,
        "version": VERSION,
        "model": {"family": checkpoint.family.name, "config": plan.config},
        "precision": plan.precision,
        "layout": plan.layout.to_json(),
        "files": _file_records(out, [f.part.name for f in plan.files]),
        "side_files": _file_records(out, side),
        "tensors": tensors,
        "experts": plan.experts.to_json() if plan.experts else None,
    }


def write_manifest(path: Path, manifest: dict) -> None:
    write_json_atomic(path, manifest)
