"""`dsconv verify OUT`: the manifest against the files and against itself, one line per problem.

Checks, in order: schema; every path stays inside OUT; every file present with its size (sha256 with
--full); every tensor present in its file with the declared dtype and shape; coverage against the
architecture's inventory and the placement table (each expert on exactly one EP rank per EP group, or where the
expert map puts its replicas, every logical expert at least once; with --full, every replica's bytes equal; vocab and
head slices tiling their dimension exactly within each group, every replicated tensor reachable by every
rank, every INT8 weight's scale reachable wherever the weight is).
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

from dsconv.family.arch import family_for
from dsconv.errors import InputError
from dsconv.convert.safetensors_io import DTYPE_NAMES, read_header
from dsconv.manifest.schema import (FILE_KEYS, LAYOUT_KEYS, MANIFEST_NAME, READABLE_VERSIONS, SCHEMA, TENSOR_KEYS,
                                    TOP_LEVEL_KEYS, sha256_of)
from dsconv.family.expert_map import ExpertMap, ModelKey
from dsconv.family.layout import Layout
from dsconv.family.placement import SPLIT_GROUPS, Mode, check_layout, place, sliced_shape


MAX_PROBLEMS_PER_CHECK = 20  # beyond this a broken shard set just repeats itself


def _typed(record: dict, keys: dict, where: str, problems: list[str]) -> bool:
    ok = True
    for key, kind in keys.items():
        if key not in record:
            problems.append(f"{where}: missing key {key!r}")
            ok = False
        elif not isinstance(record[key], kind) or (kind is int and isinstance(record[key], bool)):
            problems.append(f"{where}: {key!r} has the wrong type ({type(record[key]).__name__})")
            ok = False
    return ok


def _inside(out: Path, rel: str) -> bool:
    path = Path(rel)
    return not path.is_absolute() and ".." not in path.parts and (out / path).resolve().is_relative_to(out.resolve())


def check_schema(manifest: object) -> list[str]:
    problems: list[str] = []
    if not isinstance(manifest, dict):
        return ["manifest: not a JSON object"]
    if manifest.get("schema") != SCHEMA or manifest.get("version") not in READABLE_VERSIONS:
        return [f"manifest: schema {manifest.get('schema')!r} version {manifest.get('version')!r} is not "
                f"{SCHEMA!r} version {' or '.join(map(str, READABLE_VERSIONS))} (shards written by another dsconv: run "
                f"`dsconv shard` again)"]
    if not _typed(manifest, TOP_LEVEL_KEYS, "manifest", problems):
        return problems
    _typed(manifest["layout"], LAYOUT_KEYS, "layout", problems)
    experts = manifest.get("experts")
    if experts is not None and not (isinstance(experts, dict) and _ints([experts.get("redundant"),
                                                                          experts.get("nodes")])
                                    and isinstance(experts.get("layers"), dict)
                                    and all(_ints(physical) for physical in experts["layers"].values())):
        problems.append("experts: needs redundant and nodes (ints) and layers (an object of lists of ints), or null")
    for i, record in enumerate(manifest["files"] + manifest["side_files"]):
        if not isinstance(record, dict):
            problems.append(f"files[{i}]: not an object")
        else:
            _typed(record, FILE_KEYS, f"files[{i}]", problems)
    model = manifest["model"]
    if not (isinstance(model.get("family"), str) and isinstance(model.get("config"), dict)):
        problems.append("model: needs a family (string) and a config (object)")
    for i, record in enumerate(manifest["tensors"]):
        if not isinstance(record, dict):
            problems.append(f"tensors[{i}]: not an object")
        elif _typed(record, TENSOR_KEYS, f"tensors[{i}] ({record.get('name')})", problems):
            problems += _nested(record, f"tensors[{i}] ({record['name']})")
    return problems


def _ints(value: object) -> bool:
    return isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value)


def _nested(t: dict, where: str) -> list[str]:
    problems = []
    source, split = t["source"], t["split"]
    if not (isinstance(source.get("name"), str) and _ints(source.get("shape"))):
        problems.append(f"{where}: source needs a name and a shape of non-negative ints")
    if split is not None and not _ints([split.get("dim"), split.get("start"), split.get("stop")]):
        problems.append(f"{where}: split needs non-negative int dim, start and stop")
    if not (_ints(t["shape"]) and _ints(t["ranks"])):
        problems.append(f"{where}: shape and ranks must be lists of non-negative ints")
    return problems


def check_files(out: Path, manifest: dict, full: bool) -> tuple[list[str], set[str]]:
    """Paths, presence, sizes, hashes; returns the problems and the weight files that can be read."""
    problems, readable = [], set()
    listed = {r["path"] for r in manifest["files"]}
    for t in manifest["tensors"]:
        if t["file"] not in listed:
            problems.append(f"{t['name']}: its file {t['file']} is not listed in files")
    for record in manifest["files"] + manifest["side_files"]:
        rel = record["path"]
        if not _inside(out, rel):
            problems.append(f"{rel}: path escapes {out}")
            continue
        path = out / rel
        if not path.is_file():
            problems.append(f"{rel}: missing")
            continue
        size = path.stat().st_size
        if size != record["bytes"]:
            problems.append(f"{rel}: {size} bytes, manifest says {record['bytes']}"
                            + (" (truncated)" if size < record["bytes"] else ""))
            continue
        if full and sha256_of(path) != record["sha256"]:
            problems.append(f"{rel}: sha256 differs from the manifest (corrupted)")
            continue
        if rel in listed:
            readable.add(rel)
    return problems, readable


def check_headers(out: Path, manifest: dict, readable: set[str]) -> list[str]:
    problems = []
    by_file: dict[str, list[dict]] = defaultdict(list)
    for t in manifest["tensors"]:
        by_file[t["file"]].append(t)
    for rel in sorted(readable):
        try:
            header = read_header(out / rel)
        except InputError as exc:
            problems.append(str(exc))
            continue
        declared = {t["name"] for t in by_file[rel]}
        for t in by_file[rel]:
            entry = header.get(t["name"])
            if entry is None:
                problems.append(f"{t['name']}: not in {rel}")
            elif DTYPE_NAMES[entry.dtype] != t["dtype"] or list(entry.shape) != t["shape"]:
                problems.append(f"{t['name']} in {rel}: file has {DTYPE_NAMES[entry.dtype]} {list(entry.shape)}, "
                                f"manifest says {t['dtype']} {t['shape']}")
        for name in sorted(set(header) - declared):
            problems.append(f"{rel}: holds {name}, which the manifest does not list")
    return problems


def _slices_tile(name: str, size: int, slices: list[tuple[int, int]], group: list[int]) -> list[str]:
    spans = sorted(slices)
    position = 0
    for start, stop in spans:
        if start < position:
            return [f"{name}: slices overlap at [{start}, {min(stop, position)}) within ranks {group}"]
        if start > position:
            return [f"{name}: rows [{position}, {start}) are on no rank of {group}"]
        position = stop
    return [] if position == size else [f"{name}: rows [{position}, {size}) are on no rank of {group}"]


def check_coverage(manifest: dict) -> list[str]:
    problems: list[str] = []
    config = manifest["model"]["config"]
    family = family_for(config)
    arch = family.parse_config(config)
    lay = manifest["layout"]
    layout = Layout.from_json(lay)
    experts = expert_map_of(manifest)
    check_layout(family, arch, layout, experts.redundant if experts else 0)
    if layout.to_json() != lay:
        problems.append("layout: dp or groups do not follow from world_size, ep, tp, attn_tp, oproj_tp, embed_tp")
    world = set(range(layout.world_size))

    entries: dict[str, list[dict]] = defaultdict(list)
    for t in manifest["tensors"]:
        if t["scale_of"] is None:
            entries[t["source"]["name"]].append(t)
    for spec in family.inventory(arch):
        found = entries.pop(spec.name, [])
        before = len(problems)
        if not found:
            problems.append(f"{spec.name}: on no rank (missing from the manifest)")
            continue
        for t in found:
            dim_split = None if t["split"] is None else (t["split"]["dim"], t["split"]["start"], t["split"]["stop"])
            if t["source"]["shape"] != list(spec.shape) or t["shape"] != list(sliced_shape(spec.shape, dim_split)):
                problems.append(f"{spec.name} ({t['file']}): shape {t['shape']} of source {t['source']['shape']} "
                                f"does not match the model's {list(spec.shape)} split as {t['split']}")
        placements = place(spec, family, arch, layout, experts)
        expected = {(tuple(p.ranks), p.split) for p in placements}
        actual = {(tuple(t["ranks"]), None if t["split"] is None else
                   (t["split"]["dim"], t["split"]["start"], t["split"]["stop"])) for t in found}
        mode = found[0]["mode"]
        if mode in SPLIT_GROUPS and all(t["split"] for t in found):
            dim = found[0]["split"]["dim"]
            for group in layout.groups()[SPLIT_GROUPS[mode]]:
                spans = [(t["split"]["start"], t["split"]["stop"]) for t in found if set(t["ranks"]) & set(group)]
                problems += _slices_tile(spec.name, spec.shape[dim], spans, group)
        if mode == Mode.EXPERT.value:
            for group in layout.groups()["ep"]:
                holders = sorted({r for t in found for r in t["ranks"] if r in group})
                if len(holders) != len(placements):
                    source = "the placement table" if experts is None else "the expert map"
                    problems.append(f"{spec.name}: expert held by {len(holders)} ranks of EP group {group}: {holders}"
                                    f"; {source} gives it {len(placements)}")
        if mode == Mode.REPLICATED.value and {r for t in found for r in t["ranks"]} != world:
            problems.append(f"{spec.name}: replicated but not reachable by ranks "
                            f"{sorted(world - {r for t in found for r in t['ranks']})}")
        if actual != expected and len(problems) == before:
            problems.append(f"{spec.name}: placement differs from the placement table")
        if len(problems) >= MAX_PROBLEMS_PER_CHECK:
            return problems + ["... (further coverage problems not listed)"]
    for name in sorted(entries):
        problems.append(f"{name}: not a tensor of {family.name} with this config")
    return problems + _check_scales(manifest)


def expert_map_of(manifest: dict) -> ExpertMap | None:
    """The manifest's expert map, checked against its own model (InputError when it omits an expert, names a layer
    the model lacks or lacks one it has, ...); None without one."""
    data = manifest.get("experts")
    if data is None:
        return None
    config = manifest["model"]["config"]
    experts, ep = family_for(config).parse_config(config).n_routed_experts, manifest["layout"]["ep"]
    key = ModelKey.of(manifest["model"]["family"], experts, (t["name"] for t in manifest["tensors"]))
    if set(data["layers"]) != set(key.layers):
        raise InputError(f"the expert map's layers are not the model's {len(key.layers)} MoE layers")
    experts_map = ExpertMap.from_json(data, experts, ep)
    if data["redundant"] != experts_map.redundant:
        raise InputError(f"the expert map says {data['redundant']} redundant experts; its layers hold "
                         f"{experts_map.redundant}")
    return experts_map


def check_replicas(out: Path, manifest: dict, readable: set[str]) -> list[str]:
    """--full: every replica of a routed expert's tensor holds the same bytes as its first copy."""
    problems = []
    copies: dict[str, list[dict]] = defaultdict(list)
    for t in manifest["tensors"]:
        if t["mode"] == Mode.EXPERT.value and t["file"] in readable:
            copies[t["name"]].append(t)
    headers: dict[str, dict] = {}
    for name, found in copies.items():
        found = [t for t in found if name in _header(out, t["file"], headers)]  # check_headers names the others
        if len(found) < 2:
            continue
        first, *rest = [_tensor_bytes(out, t, headers) for t in found]
        for t, data in zip(found[1:], rest):
            if data != first:
                problems.append(f"{name} ({t['file']}): a replica whose bytes differ from {found[0]['file']}'s")
    return problems


def _header(out: Path, rel: str, headers: dict[str, dict]) -> dict:
    """A file's header, read once; empty when it cannot be read (check_headers reports that)."""
    if rel not in headers:
        try:
            headers[rel] = read_header(out / rel)
        except InputError:
            headers[rel] = {}
    return headers[rel]


def _tensor_bytes(out: Path, t: dict, headers: dict[str, dict]) -> bytes:
    entry = _header(out, t["file"], headers)[t["name"]]
    with open(out / t["file"], "rb") as f:
        f.seek(entry.offset)
        return f.read(entry.nbytes)


def _check_scales(manifest: dict) -> list[str]:
    problems = []
    scales: dict[str, list[dict]] = defaultdict(list)
    for t in manifest["tensors"]:
        if t["scale_of"] is not None:
            scales[t["name"]].append(t)
    for t in manifest["tensors"]:
        if t["dtype"] != "I8" or t["scale_of"] is not None or t["role"] == "router.tid2eid":
            continue
        if t["scale"] is None:
            problems.append(f"{t['name']} ({t['file']}): INT8 weight without a scale")
            continue
        rows = t["split"] if t["split"] and t["split"]["dim"] == 0 else None
        for s in scales.get(t["scale"], []):
            if s["shape"] != [t["shape"][0] if rows else t["source"]["shape"][0], 1] and \
                    ((s["split"] is None and rows is None) or s["split"] == rows):
                problems.append(f"{s['name']} ({s['file']}): shape {s['shape']} is not [rows, 1] of its weight")
        covering = [s for s in scales.get(t["scale"], []) if (s["split"] is None and rows is None) or s["split"] == rows]
        reach = {r for s in covering for r in s["ranks"]}
        if not set(t["ranks"]) <= reach:
            problems.append(f"{t['name']} ({t['file']}): scale {t['scale']} not reachable by ranks "
                            f"{sorted(set(t['ranks']) - reach)}")
    return problems


def verify(out: Path, full: bool = False) -> list[str]:
    out = Path(out)
    try:
        manifest = json.loads((out / MANIFEST_NAME).read_text())
    except FileNotFoundError:
        return [f"{out}: no {MANIFEST_NAME}"]
    except OSError as exc:
        return [f"{out / MANIFEST_NAME}: cannot be read ({exc.strerror or exc})"]
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        return [f"{MANIFEST_NAME}: not valid JSON ({exc})"]
    problems = check_schema(manifest)
    if problems:
        return problems
    file_problems, readable = check_files(out, manifest, full)
    problems += file_problems + check_headers(out, manifest, readable)
    if full:
        problems += check_replicas(out, manifest, readable)
    try:
        problems += check_coverage(manifest)
    except InputError as exc:
        problems.append(f"model/layout: {exc}")
    return problems
