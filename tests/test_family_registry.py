"""One module is enough to add a model family: a toy family defined and registered here goes through the
tiny-checkpoint maker, `dsconv quantize`, `dsconv shard` (EP/TP 16 and attention TP by its own rules),
`dsconv verify` and `dsconv plan` without a line of it living in the package."""

import dataclasses
import json
from dataclasses import dataclass
from typing import Iterator

import pytest
import torch
from typer.testing import CliRunner

from dsconv.family.arch import (ArchError, Encoding, Family, Role, TensorSpec, families, family_for, register,
                                 unregister)
from dsconv.cli import app
from dsconv.family.arch import recipe_for
from dsconv.family.recipes import EXPERTS, FUSED_PAIRS, Recipe
from dsconv.convert.safetensors_io import read_header
from dsconv.errors import InputError
from dsconv.manifest.verify import verify
from dsconv.family.layout import Layout
from dsconv.family.placement import CATEGORIES
from dsconv.shard.sizes import entries, footprint
from dsconv.convert.tiny_checkpoint import make_tiny_checkpoint
from tests.helpers import assert_one_line_error

TOY = "toy_moe"
WORLD = 16
ATTN_TP = 4


@dataclass(frozen=True)
class ToyConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int
    n_routed_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    fp8: bool  # linears ship FP8 with 128x128 block scales

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            if f.name != "fp8" and getattr(self, f.name) <= 0:
                raise ArchError(f"{f.name}={getattr(self, f.name)} must be positive")


_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim", "n_routed_experts",
         "num_experts_per_tok", "moe_intermediate_size")


def parse_config(raw: dict) -> ToyConfig:
    if raw.get("model_type") != TOY:
        raise ArchError(f"model_type={raw.get('model_type')!r} is not {TOY!r}")
    missing = [key for key in _KEYS if key not in raw]
    if missing:
        raise ArchError(f"config.json ({TOY}) lacks {', '.join(missing)}")
    return ToyConfig(**{key: raw[key] for key in _KEYS}, fp8=raw.get("quantization_config") is not None)


def inventory(cfg: ToyConfig) -> Iterator[TensorSpec]:
    h, heads = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim
    linear = Encoding.FP8 if cfg.fp8 else Encoding.BF16
    yield TensorSpec("tok_embeddings.weight", (cfg.vocab_size, h), Role.EMBED, Encoding.BF16)
    for layer in range(cfg.num_hidden_layers):
        def spec(name, shape, role, encoding, expert=None):
            return TensorSpec(f"blocks.{layer}.{name}", shape, role, encoding, layer=layer, expert=expert)

        yield spec("attn_norm.weight", (h,), Role.NORM, Encoding.BF16)
        yield spec("attn.wq.weight", (heads, h), Role.ATTN_Q_B, linear)
        yield spec("attn.wo.weight", (h, heads), Role.ATTN_O, linear)
        yield spec("moe.gate.weight", (cfg.n_routed_experts, h), Role.ROUTER, Encoding.BF16)
        yield spec("moe.gate.bias", (cfg.n_routed_experts,), Role.ROUTER_BIAS, Encoding.F32)
        inter = cfg.moe_intermediate_size
        for e in range(cfg.n_routed_experts):
            yield spec(f"moe.experts.{e}.w1.weight", (inter, h), Role.EXPERT_W1, linear, e)
            yield spec(f"moe.experts.{e}.w2.weight", (h, inter), Role.EXPERT_W2, linear, e)
            yield spec(f"moe.experts.{e}.w3.weight", (inter, h), Role.EXPERT_W3, linear, e)
    yield TensorSpec("norm.weight", (h,), Role.NORM, Encoding.BF16)
    yield TensorSpec("output.weight", (cfg.vocab_size, h), Role.HEAD, Encoding.BF16)


def check_attention_tp(cfg: ToyConfig, attn_tp: int) -> None:
    if cfg.num_attention_heads // attn_tp < 2:
        raise ArchError(f"attn-tp={attn_tp} leaves fewer than 2 of num_attention_heads={cfg.num_attention_heads} "
                        f"per rank ({TOY} needs 2)")


def kv_cache_bytes_per_token(cfg: ToyConfig, itemsize: int, kv_cache_dtype: str = "auto") -> dict[str, float]:
    assert kv_cache_dtype == "auto", "the toy family refuses int8 (kv_cache_int8_refusal) before asking"
    return {"K and V": cfg.num_hidden_layers * 2 * cfg.num_attention_heads * cfg.head_dim * itemsize}


def tiny_config(partial_block: bool = False, **overrides) -> dict:
    if partial_block:
        raise ArchError(f"partial_block=True: {TOY} has no partial scale block")
    config = {"model_type": TOY, "vocab_size": 1024, "hidden_size": 256, "num_hidden_layers": 2,
              "num_attention_heads": 8, "head_dim": 128, "n_routed_experts": 16, "num_experts_per_tok": 2,
              "moe_intermediate_size": 128,
              "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]},
              **overrides}
    parse_config(config)
    return config


TOY_RECIPE = Recipe("toy-w8a8", frozenset({Role.ATTN_Q_B, Role.ATTN_O} | EXPERTS), "toy: wq, wo and experts")
TOY_FAMILY = Family(
    name=TOY, parse_config=parse_config, inventory=inventory, scale_suffix="scale", scale_is_e8m0=False,
    hub_name=lambda name: name, hub_config=lambda raw, cfg: raw, ascend_mtp_copies=lambda cfg: {},
    recipes=(TOY_RECIPE,), fused=FUSED_PAIRS, attention_tp={Role.ATTN_Q_B: 0, Role.ATTN_O: 1},
    check_attention_tp=check_attention_tp, kv_cache_bytes_per_token=kv_cache_bytes_per_token,
    kv_cache_bytes_per_sequence=lambda cfg, itemsize, kv_cache_dtype: {}, tiny_config=tiny_config,
    encode_chat=None,  # no chat format: dsrun feeds its prompts as raw text only
    kv_cache_int8_refusal="the toy's caches have no INT8 form",
)


@pytest.fixture(scope="module")
def toy():
    register(TOY_FAMILY)
    try:
        yield TOY_FAMILY
    finally:
        unregister(TOY)


def cli(*args):
    return CliRunner().invoke(app, [str(a) for a in args], env={"COLUMNS": "200"})


@pytest.fixture(scope="module")
def toy_run(toy, tmp_path_factory):
    """The toy checkpoint, its W8A8 output, and its shards at EP/TP 16 (attention DP) and at attention TP 4."""
    root = tmp_path_factory.mktemp("toy")
    src = make_tiny_checkpoint(root / "src", TOY)
    for args in (["quantize", src, root / "w8a8", "--max-file-size", "1MB"],
                 ["shard", root / "w8a8", root / "dp", "--ep", WORLD, "--tp", WORLD],
                 ["shard", root / "w8a8", root / "attn-tp", "--ep", WORLD, "--tp", WORLD, "--attn-tp", ATTN_TP]):
        result = cli(*args)
        assert result.exit_code == 0, (args, result.output)
    return root


def test_tiny_checkpoint_ships_the_hub_encodings(toy_run):
    weight_map = json.loads((toy_run / "src" / "model.safetensors.index.json").read_text())["weight_map"]
    header = {}
    for file in set(weight_map.values()):
        header.update(read_header(toy_run / "src" / file))
    assert header["blocks.0.attn.wq.weight"].dtype == torch.float8_e4m3fn
    assert header["blocks.0.attn.wq.scale"].dtype == torch.float32  # the family's scale naming
    assert header["blocks.1.moe.experts.15.w2.scale"].shape == (2, 1)
    assert header["blocks.0.moe.gate.bias"].dtype == torch.float32
    assert header["output.weight"].dtype == torch.bfloat16


def test_quantize_follows_the_toy_recipe(toy_run):
    description = json.loads((toy_run / "w8a8" / "quant_model_description.json").read_text())
    assert description["blocks.0.attn.wq.weight"] == "W8A8_DYNAMIC"
    assert description["blocks.1.moe.experts.3.w1.weight"] == "W8A8_DYNAMIC"
    assert description["blocks.0.moe.gate.weight"] == "FLOAT"
    assert description["output.weight"] == "FLOAT"


@pytest.mark.parametrize("layout_dir", ["dp", "attn-tp"])
def test_shards_verify_clean(toy_run, layout_dir):
    assert verify(toy_run / layout_dir, full=True) == []


def test_attention_tp_splits_by_the_toy_rules(toy_run):
    manifest = json.loads((toy_run / "attn-tp" / "manifest.json").read_text())
    splits = {(t["name"], t["split"]["dim"]) for t in manifest["tensors"] if t["mode"] == "head_split"}
    assert ("blocks.0.attn.wq.weight", 0) in splits and ("blocks.1.attn.wo.weight", 1) in splits
    assert {name for name, _ in splits} <= {f"blocks.{i}.attn.{w}.{s}" for i in range(2) for w in ("wq", "wo")
                                            for s in ("weight", "weight_scale")}


def actual_rank_bytes(shards) -> dict[int, int]:
    """Per rank, the data bytes of every tensor it maps, as the shard files' headers give them."""
    manifest = json.loads((shards / "manifest.json").read_text())
    headers = {f["path"]: read_header(shards / f["path"]) for f in manifest["files"]}
    per_rank = dict.fromkeys(range(WORLD), 0)
    for t in manifest["tensors"]:
        for rank in t["ranks"]:
            per_rank[rank] += headers[t["file"]][t["name"]].nbytes
    return per_rank


@pytest.mark.parametrize("layout_dir,attn_tp", [("dp", 1), ("attn-tp", ATTN_TP)])
def test_plan_equals_the_shard_files(toy, toy_run, layout_dir, attn_tp):
    raw = json.loads((toy_run / "src" / "config.json").read_text())
    arch = toy.parse_config(raw)
    layout = Layout(WORLD, WORLD, WORLD, attn_tp)
    per_rank, _ = footprint(entries(toy, arch, recipe_for(None, toy)), toy, arch, layout)
    planned = {rank: sum(by_category[c] for c in CATEGORIES) for rank, by_category in per_rank.items()}
    assert planned == actual_rank_bytes(toy_run / layout_dir)

    result = cli("plan", "--config", toy_run / "src", "--attn-tp", attn_tp)
    assert result.exit_code == 0, result.output
    assert f"{TOY} from" in result.output and "recipe toy-w8a8" in result.output
    kv_per_token = 2 * 2 * 8 * 128 * 2  # layers x (K, V) x heads x head_dim x BF16
    assert f"{kv_per_token:,}" in result.output


def test_the_toy_layout_check_and_recipes_are_its_own(toy, toy_run):
    assert_one_line_error(cli("plan", "--config", toy_run / "src", "--attn-tp", 8), "attn-tp=8", TOY)
    assert_one_line_error(cli("quantize", toy_run / "src", toy_run / "x", "--recipe", "v4"), "recipe 'v4'", TOY)
    assert recipe_for("all-linears", toy).name == "all-linears"


def test_build_model_refuses_a_family_without_a_runner(toy_run):
    from dsconv.runner.models.dist import Dist
    from dsconv.runner.models.registry import build_model

    manifest = json.loads((toy_run / "dp" / "manifest.json").read_text())
    with pytest.raises(InputError) as error:
        build_model(toy_run / "dp", manifest, 0, Dist(), torch.float32)
    message = str(error.value)
    assert "\n" not in message and TOY in message and "no model" in message


def test_unknown_model_type_is_one_clear_error():
    with pytest.raises(ArchError) as error:
        family_for({"model_type": "llama"})
    message = str(error.value)
    assert "\n" not in message and "model_type='llama'" in message and "deepseek_v3" in message


def test_registration_refuses_duplicates_and_split_fused_groups(toy):
    families()  # the built-in families too, whose recipe names a new family must not reuse
    assert register(toy) is toy  # the identical object again is a no-op
    with pytest.raises(ValueError, match=f"model_type='{TOY}' is already registered"):
        register(dataclasses.replace(toy))
    half_fused = Recipe("toy-half", frozenset({Role.EXPERT_W1}), "gate without up")
    with pytest.raises(ValueError, match="quantizes some of"):
        register(dataclasses.replace(toy, name="toy_half", recipes=(half_fused,)))
    with pytest.raises(ValueError, match="recipe name 'v3'"):
        register(dataclasses.replace(toy, name="toy_v3", recipes=(Recipe("v3", frozenset(), "clash"),)))
    with pytest.raises(ValueError, match="not registered"):
        unregister("toy_never")
    assert set(family_for({"model_type": TOY}).recipes) == {TOY_RECIPE}
