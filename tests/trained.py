"""Tiny DeepSeek checkpoints with trained weights, shipped with the repository and derived into the hub's layout.

Random weights give logits with margins so thin that W8A8 against BF16 is a coin toss; a model trained for a
couple of minutes has real margins, so accuracy figures mean something. The text is the Python standard
library's own source, which every machine has: `TRAIN_MODULES` train, `HELDOUT_MODULES` evaluate. The tokenizer
is a 1024-token byte-level BPE trained on the training modules (the tiny configs' vocab_size): with the real
129280-token vocabulary the embedding and head would be 95% of the parameters and of the step time, and most
of those rows would never see a gradient in a few minutes. The checkpoint ships its own tokenizer.json.

Training runs transformers' own `DeepseekV32ForCausalLM` / `DeepseekV4ForCausalLM` (float32, CPU, fixed seed,
starting from the random fixture's weights of the same config), so the model is the reference's. It takes 20 to 26
minutes a family on one core, so the trained models ship in `tests/data/trained/` (SHIPPED): one safetensors file
per family holding every tensor as the hub encodes it (FP8 e4m3 with 128x128 block scales, V4's FP4 e2m1 experts
with e8m0 scales per 32 inputs, everything else as shipped), and the tokenizer both share. SHIPPED_SHA256 records
their bytes. `trained_source` derives from them, once into the cache, the hub's layout (`fp8/`: config.json, four
weight files, their index) and the same model decoded (`bf16/`, transformers' reference), with the project's own
writer; TRAINED_SHA256 records those derived files, so the derivation is checked too. `tests/tools/train_tiny.py`
trains again and says whether the bytes are SHIPPED's: training is meant to give the same bytes on every x86-64 CPU
(fixed seed and data order, and PINNED_CPU_ENV, which says why). V3.2 and V4 train their indexers, which the LM
loss cannot reach (tests/indexer_training.py says how); both then train their MTP layer, the main model frozen
(tests/mtp_training.py).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dsconv.family.arch import Encoding, family_for
from dsconv.kernels.device import cpu_model_and_flags
from dsconv.convert.demo import build_once, cache_dir
from dsconv.runner.entrypoints.reference import transformers_config
from tests.indexer_training import capture_attention, indexer_parameters, set_index_topk
from tests.mtp_training import mtp_layer, train_mtp, v4_mtp_layer
from dsconv.convert.tiny_checkpoint import E2M1, E8M0_BIAS, FP4_GROUP, FP8_BLOCK, Stored, TensorMaker, decode_fp4, \
    decode_fp8, make_tiny_checkpoint, write_checkpoint, write_file

FAMILIES = ("deepseek_v32", "deepseek_v4")
ENCODINGS = ("fp8", "bf16")

# Single-file modules in every CPython from 3.10 on (pathlib and zipfile became packages in 3.12 / 3.13)
TRAIN_MODULES = ("argparse.py", "ast.py", "calendar.py", "configparser.py", "csv.py", "dataclasses.py", "enum.py",
                 "functools.py", "inspect.py", "logging/__init__.py", "shutil.py", "subprocess.py", "tarfile.py",
                 "threading.py", "typing.py")
HELDOUT_MODULES = ("fractions.py", "statistics.py", "textwrap.py", "difflib.py", "heapq.py", "shlex.py", "glob.py",
                   "fnmatch.py", "string.py", "pprint.py")

VOCAB_SIZE = 1024  # the tiny configs' vocab_size: divides by 16 for lm_head TP16
BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"  # ids 0 and 1, the tiny configs' bos / eos

SEED = 0
SEQ_LEN = 128
BATCH = 8
STEPS = 150  # about 1.4 s each on one core for either family
LR = 3e-3
WARMUP = 10
MIN_LR_FRACTION = 0.1  # cosine decay to this fraction of LR
GRAD_CLIP = 1.0
# The indexers (tests/indexer_training.py): after STEPS of dense LM training, the indexer's dense warm-up (the
# model frozen) and a short sparse stage at the end of the LM schedule's learning rate
INDEXER_WARMUP_STEPS = 100
INDEXER_LR = 3e-3
SPARSE_STEPS = 30
SPARSE_LR = LR * MIN_LR_FRACTION
# The trained V3.2 keeps 32 keys per query (the random fixtures keep 8, so short test prompts cross the cut): in the
# gate's 128-token windows the indexer selects from the 33rd position on, a quarter of the context at the last,
# where DeepSeek-V3.2's 2048 keys are a quarter of an 8K context. With 8 keys one flipped choice is an eighth of
# what a query attends to; with a trained indexer, INT8 keys still left positions at a mean cosine of 0.9983 there
# (docs/benchmarks.md, "The trained V3.2's indexer").
TRAINED_INDEX_TOPK = 32

# Float32 training rounds differently on different CPUs, and 150 steps of AdamW (with the routers' and indexers'
# top-k choices) grow a last-bit difference at step 1 into a different model, with different accuracy figures.
# Four things pick the rounding: ATen's vectorized kernels (softmax, norms, reductions, the optimizer) are chosen
# by instruction set (AVX-512, AVX2, ...), MKL's GEMM kernels by CPU model, MKL's split of a GEMM by its thread
# count, and glibc's libm (exp, log, sin, ...) by instruction set (FMA or not). Training, and the accuracy gates'
# evaluation (tests/accuracy_gates.py), therefore run ATen's baseline kernels, MKL's code path that MKL documents
# as giving the same results on every Intel-compatible CPU (conditional numerical reproducibility), one thread, and
# glibc's baseline function variants. ATen, MKL and glibc read these settings when the process starts, so pinned
# work runs in a fresh interpreter.
PINNED_CPU_ENV = {"ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "COMPATIBLE", "OMP_NUM_THREADS": "1",
                  "MKL_NUM_THREADS": "1", "GLIBC_TUNABLES": "glibc.cpu.hwcaps=-AVX512F,-AVX2,-FMA,-AVX"}
# One more thing rounds by CPU under all of that: ATen's float sqrt runs oneMKL's vector math (vsSqrt), which is not
# correctly rounded (16% of float32 results on [0.001, 10) differ from IEEE's square root) and starts from the CPU's
# approximate reciprocal square root, whose bits differ between Intel and AMD (and qemu). It was the only op of a
# whole training step whose bits an Intel Xeon and an emulated AMD EPYC disagreed on: every forward and backward op
# agreed, AdamW's sqrt did not (tests/tools/trained_fingerprints.py --ops). Training therefore runs under
# IeeeSquareRoot, and the encoders' power-of-two scales come from float exponents (frexp), not log2 / exp2.

# The shipped trained models (the module's docstring says what they hold) and their sha256, as PINNED_CPU_ENV
# training under IeeeSquareRoot writes them: an Intel Xeon with AVX-512 and AMX trained these bytes (2026-11-28), and
# an AMD EPYC trained the same (docs/benchmarks.md, "Trained tiny models"). A CPU that trains other bytes trains
# another model; tests/tools/trained_fingerprints.py shows where its training parts from the recorded one's.
SHIPPED = Path(__file__).resolve().parent / "data" / "trained"
TOKENIZER_FILE = "tokenizer.json"
SHIPPED_SHA256 = {
    "deepseek_v32.safetensors": "dcf33e82bc0ea247492301b5599a7ee5249230d5a61f315603abecf6733218ef",
    "deepseek_v4.safetensors": "f9f6d3207285b9a43b096e83de5eb0f36d0ba075b61bc615de301407897dee9a",
    TOKENIZER_FILE: "e4a63f2ee399527d89db136a1f49f7c35f8b3d1edbfd095c2e71d6e6e858f30e",
}
TRAINED_CORPUS = "e55d54f23f16"  # corpus_digest() of the standard library they were trained on (CPython 3.11)
# sha256 of the weight files trained_source derives from SHIPPED (the hub's layout, and decoded to BF16). V4's first
# three BF16 files hold +0.0 where the ones written straight from training held -0.0 (an FP4 code of magnitude 0
# decoded with its sign; encoding -0.0 gives the code of +0.0): 573,117 zeros, equal values, so the same model.
TRAINED_SHA256 = {
    "deepseek_v32": {  # with its trained MTP layer
        "bf16/model-00001-of-00004.safetensors": "f1ffd9bf81d352a3d2e0013c067d96f788480ec7e02fb129bf7cc5fbf27672b1",
        "bf16/model-00002-of-00004.safetensors": "d5302b1e3fe4778d977bef8a2959f5c1846070315438e67ec3e3091996ec0f24",
        "bf16/model-00003-of-00004.safetensors": "b44e93eede293688d534fa914d4b18eb2ace06b326f1fd08764d444340f2ba63",
        "bf16/model-00004-of-00004.safetensors": "1fd55f47b1844f132f9aed7358bf2c95799716f8975dac84dfc7b1195c14fe4f",
        "fp8/model-00001-of-00004.safetensors": "963d85b8cf2b51b394eac6373599b8e910e89ee2efe25264edd67e4ed4fd8f1a",
        "fp8/model-00002-of-00004.safetensors": "4e48aca9d67100909fe86a2f1825397f67400ce03db7d7b711b2cca8dbbc31a1",
        "fp8/model-00003-of-00004.safetensors": "cc260aaac90b52c4f732c25364ec893147103bdd49433eeca4eb5fc81d4b6167",
        "fp8/model-00004-of-00004.safetensors": "1fd55f47b1844f132f9aed7358bf2c95799716f8975dac84dfc7b1195c14fe4f",
    },
    "deepseek_v4": {  # with its trained MTP layer (the main model's tensors are version 5's, unchanged)
        "bf16/model-00001-of-00004.safetensors": "4e5c10f52ac8fc2b254bfd50270bdf9ea6c6c188c7215a86627076f2a9e6d1f5",
        "bf16/model-00002-of-00004.safetensors": "2fa16d1928350cb22f61cff55ae36a63ae37a56702dc810e47a415aae4c5853a",
        "bf16/model-00003-of-00004.safetensors": "85b1d2db43183bfb8b621eb63efd2dfe8890680fde364fd1772035b2c6330b14",
        "bf16/model-00004-of-00004.safetensors": "4c9bd06254a5b467f41ce5d5609e23024e7d0a2c9dcefbc1a6a870d81ac75d8c",
        "fp8/model-00001-of-00004.safetensors": "dc40beb668732c24f3ec0a86b60f6537b3365e23ed686890a2ed1c1ee5259c2f",
        "fp8/model-00002-of-00004.safetensors": "a528c9a6313cccd94c376d397c58bf8a2087633fe05b0358324bc160428dbca4",
        "fp8/model-00003-of-00004.safetensors": "ca0d4c8b88b05f8ae722cfb17cbed0d825bf4022b370fc277da0960522c0019b",
        "fp8/model-00004-of-00004.safetensors": "85070f4d5809ecef866d90cf9594e16c7b7eec64233bd047ac85f27487f2041c",
    },
}

# instruction-set flags that pick kernels on x86-64 (named in messages about rounding)
KERNEL_FLAGS = ("fma", "avx2", "avx512f", "avx512_bf16", "avx512_vnni")

FP8_MAX = 448.0
FP4_MAX = 6.0
# e2m1 magnitudes and the midpoints between them: a value rounds to the nearer magnitude
E2M1_MAGNITUDES = torch.tensor(E2M1[:8])
E2M1_MIDPOINTS = (E2M1_MAGNITUDES[1:] + E2M1_MAGNITUDES[:-1]) / 2
FP4_SIGN = 8
SCALE_FLOOR = 2.0 ** -100  # an all-zero block still gets a finite scale that fits e8m0
# IEEE 754 binary32: 23 stored mantissa bits, exponent bias 127, normal exponents -126 to 127
FLOAT32_MANTISSA_BITS = 23
FLOAT32_EXPONENT_BIAS = 127
FLOAT32_MIN_EXPONENT, FLOAT32_MAX_EXPONENT = -126, 127


def stdlib_text(modules: tuple[str, ...]) -> list[str]:
    root = Path(sysconfig.get_paths()["stdlib"])
    return [(root / module).read_text(encoding="utf-8") for module in modules]


def corpus_digest() -> str:
    """Short digest of the training and held-out text: another Python's stdlib is another model."""
    digest = hashlib.sha256()
    for text in stdlib_text(TRAIN_MODULES) + stdlib_text(HELDOUT_MODULES):
        digest.update(hashlib.sha256(text.encode()).digest())
    return digest.hexdigest()[:12]


def train_tokenizer(texts: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=[BOS, EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer)
    if (tokenizer.token_to_id(BOS), tokenizer.token_to_id(EOS), tokenizer.get_vocab_size()) != (0, 1, VOCAB_SIZE):
        raise RuntimeError(f"BPE tokenizer came out with vocab {tokenizer.get_vocab_size()}, BOS/EOS ids "
                           f"{tokenizer.token_to_id(BOS)}/{tokenizer.token_to_id(EOS)}")
    return tokenizer


def training_config(family: str) -> dict:
    """The family's tiny config without MTP layers: transformers trains and saves none."""
    overrides = {"num_nextn_predict_layers": 0}
    if family == "deepseek_v32":
        overrides["index_topk"] = TRAINED_INDEX_TOPK
    if family == "deepseek_v4":
        overrides["compress_ratios"] = family_for({"model_type": family}).tiny_config()["compress_ratios"][:-1]
    return family_for({"model_type": family}).tiny_config(**overrides)


def _learning_rate(step: int) -> float:
    if step < WARMUP:
        return LR * (step + 1) / WARMUP
    progress = (step - WARMUP) / max(1, STEPS - WARMUP)
    return LR * (MIN_LR_FRACTION + (1 - MIN_LR_FRACTION) * 0.5 * (1 + math.cos(math.pi * progress)))


def _lm_step(model, optimizer, batch: torch.Tensor, lr: float, extra_loss=None) -> torch.Tensor:
    for group in optimizer.param_groups:
        group["lr"] = lr
    loss = model(batch, labels=batch).loss
    total = loss if extra_loss is None else loss + extra_loss()
    total.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss


def train_model(family: str, config: dict, tokens: torch.Tensor, work: Path, log: Callable[[str], None],
                on_dense_step: Callable[[int, torch.nn.Module, torch.Tensor | None], None] | None = None):
    """transformers' model of `config`, started from the random fixture's weights, trained on random windows
    of `tokens` -> the trained model (float32). Both train dense, then their indexers (see INDEXER_WARMUP_STEPS).
    on_dense_step(step, model, loss), if given, sees the model as loaded (step -1, no loss) and after each dense step
    (tests/tools/trained_fingerprints.py: where two CPUs' training parts)."""
    from transformers import AutoModelForCausalLM

    init = make_tiny_checkpoint(work / "init", family, encoding="bf16", seed=SEED,
                                config_overrides={k: config[k] for k in ("num_nextn_predict_layers",
                                                                         "compress_ratios") if k in config})
    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_pretrained(init, config=transformers_config(family, config),
                                                 dtype=torch.float32)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.0)
    order = torch.Generator().manual_seed(SEED)

    def batches(steps: int):
        for step in range(steps):
            starts = torch.randint(0, len(tokens) - SEQ_LEN, (BATCH,), generator=order)
            yield step, torch.stack([tokens[s:s + SEQ_LEN] for s in starts.tolist()])  # [BATCH, SEQ_LEN]

    set_index_topk(model, SEQ_LEN)  # dense: every key (V4: every compressed entry) selected
    if on_dense_step:
        on_dense_step(-1, model, None)
    for step, batch in batches(STEPS):
        loss = _lm_step(model, optimizer, batch, _learning_rate(step))
        if on_dense_step:
            on_dense_step(step, model, loss)
        if step % 25 == 0 or step == STEPS - 1:
            log(f"{family} step {step}: loss {loss.item():.3f}")

    # the indexer's dense warm-up: the model frozen, the indexer learning its layers' attention (which only eager
    # attention returns)
    model.set_attn_implementation("eager")
    indexer = torch.optim.AdamW(indexer_parameters(model), lr=INDEXER_LR, betas=(0.9, 0.95), weight_decay=0.0)
    with capture_attention(model) as captured:
        for step, batch in batches(INDEXER_WARMUP_STEPS):
            with torch.no_grad():
                model(batch)
            loss = captured.indexer_loss(model, selected_only=False)
            loss.backward()
            indexer.step()
            indexer.zero_grad(set_to_none=True)
            if step % 25 == 0 or step == INDEXER_WARMUP_STEPS - 1:
                log(f"{family} indexer warm-up {step}: KL {loss.item():.4f}")
        # sparse training: the model on its indexer's top-k (LM loss), the indexer on the selected keys (KL)
        set_index_topk(model, config["index_topk"])
        for step, batch in batches(SPARSE_STEPS):
            loss = _lm_step(model, optimizer, batch, SPARSE_LR,
                            lambda: captured.indexer_loss(model, selected_only=True))
            if step % 25 == 0 or step == SPARSE_STEPS - 1:
                log(f"{family} sparse step {step}: loss {loss.item():.3f}")
    return model.eval()


def train_mtp_layer(family: str, model, config: dict, tokens: torch.Tensor, work: Path,
                    log: Callable[[str], None]) -> dict[str, torch.Tensor]:
    """The trained main model's MTP layer (tests/mtp_training.py), from the random fixture's, trained on random windows
    of `tokens` in an order of its own -> its tensors under the hub's names."""
    from safetensors.torch import load_file

    init = make_tiny_checkpoint(work / "init-mtp", family, encoding="bf16", seed=SEED,
                                config_overrides={"num_nextn_predict_layers": 1})
    start = {}
    for path in sorted(init.glob("*.safetensors")):
        start.update(load_file(path))
    layer = config["num_hidden_layers"]
    init_config = json.loads((init / "config.json").read_text())
    if family == "deepseek_v4":  # the main model's embedding and head, shared
        start.update({"embed.weight": model.model.embed_tokens.weight.detach(),
                      "head.weight": model.lm_head.weight.detach()})
        mtp = v4_mtp_layer(init_config, start, work / "mtp-init")
    else:
        mtp = mtp_layer(model, init_config, start, layer, work / "mtp-init")
    order = torch.Generator().manual_seed(SEED + 1)

    def batches(steps: int):
        for step in range(steps):
            starts = torch.randint(0, len(tokens) - SEQ_LEN, (BATCH,), generator=order)
            yield step, torch.stack([tokens[s:s + SEQ_LEN] for s in starts.tolist()])

    train_mtp(model, mtp, batches, SEQ_LEN, log)
    if family == "deepseek_v4":
        return mtp.hub_weights(work / "mtp-saved")
    return mtp.hub_weights(layer, work / "mtp-saved")


def ceil_log2(x: torch.Tensor) -> torch.Tensor:
    """ceil(log2(x)) of positive floats, exactly (int32), from the float's exponent: log2 rounds (a float just above
    a power of two has a log2 that rounds to the power's), and its last bit is the vector math library's."""
    mantissa, exponent = torch.frexp(x)  # x = mantissa * 2 ** exponent, 0.5 <= mantissa < 1
    return exponent - (mantissa == 0.5).to(exponent.dtype)


def power_of_two(n: torch.Tensor) -> torch.Tensor:
    """2.0 ** n as float32 for int32 n in float32's normal range (-126 to 127), built from its bits."""
    if n.numel() and not (FLOAT32_MIN_EXPONENT <= int(n.min()) and int(n.max()) <= FLOAT32_MAX_EXPONENT):
        raise ValueError(f"power_of_two: exponents {int(n.min())} to {int(n.max())} leave float32's normal range")
    return ((n.to(torch.int32) + FLOAT32_EXPONENT_BIAS) << FLOAT32_MANTISSA_BITS).view(torch.float32)


class IeeeSquareRoot(TorchDispatchMode):
    """aten.sqrt on float tensors computed as IEEE 754 defines it, correctly rounded (numpy's sqrt, the CPU's
    square-root instruction), instead of ATen's vector-math sqrt, whose last bits depend on the CPU (PINNED_CPU_ENV
    says why). Below autograd, so forward and backward alike; sqrt with out= is refused rather than left to ATen."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.overloadpacket in (torch.ops.aten.sqrt, torch.ops.aten.sqrt_) and args[0].is_floating_point():
            if func not in (torch.ops.aten.sqrt.default, torch.ops.aten.sqrt_.default):
                raise NotImplementedError(f"{func} under IeeeSquareRoot: only sqrt(x) and x.sqrt_() are computed")
            x = args[0]
            if x.dtype not in (torch.float32, torch.float64) or x.device.type != "cpu":
                raise NotImplementedError(f"IeeeSquareRoot computes float32 / float64 on CPU, not {x.dtype} on {x.device}")
            root = torch.from_numpy(np.asarray(np.sqrt(x.detach().contiguous().numpy()))).reshape(x.shape)
            return x.copy_(root) if func is torch.ops.aten.sqrt_.default else root
        return func(*args, **kwargs)


def encode_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [out, in] -> (float8_e4m3fn codes, float32 power-of-two scale per 128x128 block) with
    w ~= codes * scale, as DeepSeek's UE8M0 checkpoints store it (each block's amax fits 448)."""
    rows, cols = w.shape
    grid = (-(-rows // FP8_BLOCK), -(-cols // FP8_BLOCK))
    padded = torch.nn.functional.pad(w.float(), (0, grid[1] * FP8_BLOCK - cols, 0, grid[0] * FP8_BLOCK - rows))
    amax = padded.reshape(grid[0], FP8_BLOCK, grid[1], FP8_BLOCK).abs().amax(dim=(1, 3))  # [grid]
    scale = power_of_two(ceil_log2(amax.clamp(min=SCALE_FLOOR) / FP8_MAX))
    full = scale.repeat_interleave(FP8_BLOCK, 0)[:rows].repeat_interleave(FP8_BLOCK, 1)[:, :cols]
    return (w.float() / full).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def encode_fp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [out, in] -> (int8 [out, in / 2], two e2m1 codes per byte, low nibble = even element; float32
    power-of-two scale per 32 inputs [out, in / 32]) with w ~= e2m1[code] * scale."""
    rows, cols = w.shape
    groups = w.float().reshape(rows, cols // FP4_GROUP, FP4_GROUP)
    amax = groups.abs().amax(dim=-1)  # [out, in / 32]
    scale = power_of_two(ceil_log2(amax.clamp(min=SCALE_FLOOR) / FP4_MAX))
    scaled = (groups / scale[..., None]).reshape(rows, cols)
    codes = torch.bucketize(scaled.abs(), E2M1_MIDPOINTS) + FP4_SIGN * (scaled < 0)
    codes = codes.to(torch.uint8).reshape(rows, cols // 2, 2)
    return (codes[..., 0] | (codes[..., 1] << 4)).view(torch.int8), scale


def snap(w: torch.Tensor, encoding: Encoding) -> torch.Tensor:
    """w rounded to what its hub encoding stores (float32): encoding the result again gives the same values,
    and BF16 holds them exactly (3 or 1 mantissa bits times a power of two)."""
    if encoding == Encoding.FP4:
        packed, scale = encode_fp4(w)
        return decode_fp4(packed, scale)
    codes, scale = encode_fp8(w)
    return decode_fp8(codes, scale)


class TrainedMaker(TensorMaker):
    """Produces trained values (hub names -> float tensors) in the hub's encodings instead of random codes: what
    training writes into SHIPPED (ShippedMaker decodes them for the BF16 form)."""

    def __init__(self, family, config: dict, weights: dict[str, torch.Tensor]):
        super().__init__(family, config, SEED)
        specs = {spec.name: spec for spec in family.inventory(self.arch)}
        self.weights = {name: snap(w, specs[name].encoding) if specs[name].encoding in (Encoding.FP8, Encoding.FP4)
                        else w for name, w in weights.items()}

    def produce(self, item: Stored) -> torch.Tensor:
        value = self.weights[item.spec.name]
        if item.part == "value":
            return value.to(item.dtype)
        payload, scale = (encode_fp4 if item.spec.encoding == Encoding.FP4 else encode_fp8)(value)
        if item.part == "payload":
            return payload.view(item.dtype)
        if item.dtype == torch.float8_e8m0fnu:
            return (ceil_log2(scale) + E8M0_BIAS).to(torch.uint8).view(item.dtype)
        return scale


def train_into(out: Path, family: str) -> Path:
    """Train `family`'s tiny model with its MTP layer and write it into the directory `out` as SHIPPED holds it
    (`out/<family>.safetensors`; the tokenizer is `training_tokens()`'s). Runs in a fresh interpreter with
    PINNED_CPU_ENV; 20 to 26 minutes on one core."""
    subprocess.run([sys.executable, "-m", "tests.trained", family, str(out)],
                   env={**os.environ, **PINNED_CPU_ENV}, check=True, cwd=Path(__file__).resolve().parents[1])
    return out / f"{family}.safetensors"


def unpinned_settings() -> dict[str, str | None]:
    """The PINNED_CPU_ENV settings this process's environment lacks, with what it has instead."""
    return {key: os.environ.get(key) for key, value in PINNED_CPU_ENV.items() if os.environ.get(key) != value}


def require_pinned() -> None:
    """Refuses a process that did not start with PINNED_CPU_ENV (ATen, MKL and glibc read it at start-up)."""
    unpinned = unpinned_settings()
    if unpinned or torch.backends.cpu.get_cpu_capability() != "DEFAULT" or torch.get_num_threads() != 1:
        raise RuntimeError(f"training needs {PINNED_CPU_ENV} in the environment before torch loads; this process has "
                           f"{unpinned or 'it'}, {torch.backends.cpu.get_cpu_capability()} kernels and "
                           f"{torch.get_num_threads()} threads")


def training_tokens():
    """(the BPE tokenizer trained on TRAIN_MODULES, their token ids with BOS opening each module)."""
    texts = stdlib_text(TRAIN_MODULES)
    tokenizer = train_tokenizer(texts)
    return tokenizer, torch.tensor([token for text in texts for token in [0] + tokenizer.encode(text).ids])


def checkpoint_config(family: str) -> dict:
    """The trained checkpoint's config: training's, with the MTP layer trained after the main model."""
    config = dict(training_config(family), num_nextn_predict_layers=1)
    if family == "deepseek_v4":  # the MTP layer's ratio after the decoder layers'
        config["compress_ratios"] = family_for(config).tiny_config()["compress_ratios"]
    return config


def hub_items(maker: TensorMaker) -> list[Stored]:
    """Every tensor of maker's inventory as the hub encodes it (encoding fp8), in inventory order."""
    return [item for spec in maker.family.inventory(maker.arch) for item in maker.stored(spec, "fp8")]


def write_shipped(path: Path, maker: TensorMaker) -> None:
    """SHIPPED's form of maker's model: every hub-encoded tensor in one safetensors file."""
    write_file(path, hub_items(maker), maker)


def _train_and_write(family: str, out: Path) -> None:
    require_pinned()
    from dsconv.convert.source import open_checkpoint

    _, ids = training_tokens()
    config = training_config(family)
    torch.use_deterministic_algorithms(True)
    with tempfile.TemporaryDirectory() as scratch, IeeeSquareRoot():
        work = Path(scratch)
        model = train_model(family, config, ids, work, print)
        model.save_pretrained(work / "saved")
        saved = open_checkpoint(work / "saved")  # transformers' tensor names read as the hub's
        weights = {weight.spec.name: weight.value.read() for weight in saved.weights}
        # the MTP layer, after the main model, which it leaves as it was
        config = checkpoint_config(family)
        weights.update(train_mtp_layer(family, model, config, ids, work, print))
    write_shipped(out / f"{family}.safetensors", TrainedMaker(family_for(config), config, weights))


class ShippedMaker(TensorMaker):
    """Produces the tensors of a SHIPPED file: the hub's encodings as stored, and with encoding="bf16" their decoded
    values (the values TrainedMaker snapped the trained weights to; an FP4 zero decodes as +0.0 whatever the sign
    of the weight it encodes, which the e2m1 code does not keep)."""

    def __init__(self, family, config: dict, path: Path):
        from safetensors import safe_open

        super().__init__(family, config, SEED)
        self.path = path
        self.file = safe_open(str(path), framework="pt")
        names = {item.name for item in hub_items(self)}
        missing, extra = sorted(names - set(self.file.keys())), sorted(set(self.file.keys()) - names)
        if missing or extra:
            raise ValueError(f"{path}: not the trained {config['model_type']} checkpoint: "
                             f"{len(missing)} tensors missing (first {missing[:1]}), {len(extra)} unknown "
                             f"(first {extra[:1]})")

    def _read(self, item: Stored) -> torch.Tensor:
        tensor = self.file.get_tensor(item.name)
        if tensor.dtype != item.dtype or tuple(tensor.shape) != item.shape:
            raise ValueError(f"{self.path}: {item.name} is {tensor.dtype} {tuple(tensor.shape)}, the config's "
                             f"inventory says {item.dtype} {item.shape}")
        return tensor

    def produce(self, item: Stored) -> torch.Tensor:
        if item.part != "decoded":
            return self._read(item)
        payload, scale = (self._read(stored) for stored in self.stored(item.spec, "fp8"))
        if scale.dtype == torch.float8_e8m0fnu:
            scale = power_of_two(scale.view(torch.uint8).to(torch.int32) - E8M0_BIAS)
        decode = decode_fp4 if item.spec.encoding == Encoding.FP4 else decode_fp8
        return decode(payload, scale).to(item.dtype)


def sha256_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def unshipped_bytes(root: Path = SHIPPED) -> str | None:
    """None when every SHIPPED file under `root` has its recorded sha256; else one line naming the first that
    differs or is missing."""
    for name, want in SHIPPED_SHA256.items():
        path = root / name
        got = sha256_of(path) if path.is_file() else "missing"
        if got != want:
            return (f"{path}: sha256 {got[:16]}, recorded {want[:16]} (SHIPPED_SHA256 in tests/trained.py); "
                    f"restore it with git, or retrain with `python -m tests.tools.train_tiny` and record the new bytes")
    return None


def derive_trained(out: Path, family: str, root: Path = SHIPPED) -> None:
    """`out/fp8` (the hub's layout: config.json, weight files, their index) and `out/bf16` (the same model decoded)
    from the family's SHIPPED file, each with the tokenizer; refuses SHIPPED files that are not the recorded bytes."""
    message = unshipped_bytes(root)
    if message:
        raise RuntimeError(message)
    config = checkpoint_config(family)
    maker = ShippedMaker(family_for(config), config, root / f"{family}.safetensors")
    for encoding in ENCODINGS:
        (out / encoding).mkdir(parents=True)
        write_checkpoint(out / encoding, config, maker, encoding)
        shutil.copyfile(root / TOKENIZER_FILE, out / encoding / TOKENIZER_FILE)


def trained_source(family: str, encoding: str = "fp8") -> Path:
    """The family's trained tiny checkpoint with its trained MTP layer (fp8: the hub's encodings; bf16: the same
    model decoded), derived from SHIPPED on first use into the cache (a second or two), keyed by SHIPPED's bytes."""
    if family not in FAMILIES:
        raise ValueError(f"family={family!r} has no trained tiny checkpoint; one of {', '.join(FAMILIES)}")
    if encoding not in ENCODINGS:
        raise ValueError(f"encoding={encoding!r} must be one of {', '.join(ENCODINGS)}")
    name = f"trained-{family}-{SHIPPED_SHA256[f'{family}.safetensors'][:12]}"
    return build_once(cache_dir() / name, lambda out: derive_trained(out, family)) / encoding


def cpu_description() -> str:
    """This CPU's model name and the instruction-set flags that pick kernels, for messages about rounding."""
    model, flags = cpu_model_and_flags()
    named = [flag for flag in KERNEL_FLAGS if flag in flags] + sorted(flag for flag in flags if flag.startswith("amx"))
    return f"{model}, flags {' '.join(named) or 'none of ' + ' '.join(KERNEL_FLAGS)}"


def weight_digests(root: Path) -> dict[str, str]:
    """sha256 of every weights file under a trained checkpoint's root, by path relative to it."""
    return {path.relative_to(root).as_posix(): hashlib.sha256(path.read_bytes()).hexdigest()
            for path in sorted(root.glob("*/*.safetensors"))}


def unrecorded_bytes(family: str) -> str | None:
    """None when the family's derived checkpoint is the bytes TRAINED_SHA256 records and the held-out text is the
    one the gates' figures come from; else one line saying which is not."""
    if corpus_digest() != TRAINED_CORPUS:
        return (f"the held-out text is this Python's standard library (digest {corpus_digest()}), not the one the "
                f"trained {family} model and its recorded figures come from ({TRAINED_CORPUS})")
    root = trained_source(family).parent
    got, want = weight_digests(root), TRAINED_SHA256[family]
    differ = sorted(name for name in want.keys() | got.keys() if got.get(name) != want.get(name))
    if not differ:
        return None
    first = differ[0]
    return (f"the trained {family} checkpoint derived from {SHIPPED} differs: {root.name}/{first} has sha256 "
            f"{got.get(first, 'missing')[:16]}, recorded {want.get(first, 'none')[:16]} ({len(differ)} of "
            f"{len(want)} files differ): the writer (convert/tiny_checkpoint.py) or the decoding changed")


def heldout_texts() -> list[str]:
    return stdlib_text(HELDOUT_MODULES)


if __name__ == "__main__":  # train_into's fresh interpreter
    _train_and_write(sys.argv[1], Path(sys.argv[2]))
