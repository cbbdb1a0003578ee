"""`dsrun compare`: our forward on a shard set against transformers' forward of the source checkpoint, layer by layer.

Our side runs the shards on their ranks through the engine, each prompt scored as a prompt of its own (prompt
logprobs, nothing generated) on attention-DP rank 0; rank 0 saves each layer's output and the logits to a scratch
directory as they are computed (one file per layer and prompt, so nothing holds every layer at once). The reference
(reference.py) then runs each prompt one layer at a time; each of its layers' outputs is compared with ours as it
comes, and our file is deleted.

Per layer: the cosine of the two outputs over every token of every prompt (V4: over the hyper-connection streams,
[tokens, hc_mult, hidden]), and the largest absolute difference. Then the logits: each position's cosine, averaged,
and the share of positions whose top-1 token agrees.
"""

from __future__ import annotations

import dataclasses
import json
import math
import resource
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from dsconv.comm.launch import launch
from dsconv.errors import InputError
from dsconv.family.text import TextTokenizer
from dsconv.runner.engine.config import RunConfig
from dsconv.runner.engine.core import EngineClient, start_engine
from dsconv.runner.engine.request import SamplingParams, check_prompt
from dsconv.runner.entrypoints.options import EngineOptions
from dsconv.runner.entrypoints.reference import LOGITS, Reference

# The default prompt: prose and code, so that every layer sees a varied context
COMPARE_PROMPT = ("The Forbidden City in Beijing was the home of emperors for five centuries. def area(r): return "
                  "3.14159 * r * r  # a circle's area")
# every prompt position's logits in the prefill step: the prompt's scored positions and the last, whose token ends it
SCORE = SamplingParams(max_tokens=1, prompt_logprobs=0)
# The parsed config's fields that say how the weights are stored, not what the model computes: a W8A8 or BF16 shard
# set of an FP8 download is the same model
STORAGE_FIELDS = ("fp8", "scale_fmt", "quantized", "weight_block_size", "expert_dtype")


@dataclass(frozen=True)
class CompareOptions:
    """`dsrun compare`'s options (runner/cli.py says what each means)."""
    shards: Path
    reference: Path
    prompt: list[str] | None
    min_cosine: float
    json_output: bool
    engine: EngineOptions  # the engine flags compare takes (options.COMPARE)


def main(o: CompareOptions) -> int:
    """The command: our side on the shards' ranks, saving every layer's output, then the reference in this process,
    compared layer by layer as it comes -> 0 if every layer holds, 1 if one does not (or the job's exit code)."""
    if not 0 < o.min_cosine <= 1:
        raise InputError(f"--min-cosine {o.min_cosine} must be in (0, 1]")
    run = o.engine.run_config(o.shards, "compare", max_num_seqs=1)
    ref = Reference(o.reference, getattr(torch, run.dtype))
    check_same_model(run, ref)
    prompts = _prompts(run, o.prompt or [COMPARE_PROMPT])
    longest = max(map(len, prompts))
    # one prompt at a time on attention-DP rank 0, each prefilled in one step with a cache of one prompt and the token
    # that ends it (the engine computes the last position's logits to choose one)
    run = replace(run, cache=replace(run.cache, tokens=longest + 1),
                  scheduler=replace(run.scheduler, max_num_batched_tokens=longest))
    with tempfile.TemporaryDirectory(prefix="dsrun-compare-") as scratch:
        code = launch(rank_main, {"run": run, "prompts": prompts, "out": scratch}, world_size=run.layout.world_size,
                      device=run.device, timeout_s=o.engine.timeout)
        if code:
            return code
        report = compare(ref, prompts, Path(scratch)).report(o.min_cosine)
    # this process ran the reference (the ranks are processes of their own, their shards memory-mapped)
    report.update(reference_peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                  reference_largest_part_bytes=ref.largest_part_bytes)
    if o.json_output:
        print(json.dumps(report))
    else:
        print_report(report)
    return 0 if report["first_below"] is None else 1


def _prompts(run: RunConfig, texts: list[str]) -> list[list[int]]:
    """Each --prompt's ids, as is (no chat format); at least two tokens each (a position to compare after the
    first)."""
    text = TextTokenizer.load(run.shards, run.model_config)
    prompts = [text.encode(p) for p in texts]
    for given, ids in zip(texts, prompts):
        if len(ids) < 2 or not given.strip():
            raise InputError(f"--prompt {given!r} is {len(ids)} token(s): give at least two")
        check_prompt(ids, 1, run.vocab_size, run.max_position_embeddings)
    return prompts


def _facts(value, arch):
    """A config field as the model uses it: a rope_scaling dict without the copies transformers' config classes add
    when they read one (rope_theta, the top level's; rope_type, its type)."""
    if not isinstance(value, dict):
        return value
    facts = dict(value)
    if facts.get("rope_theta") == getattr(arch, "rope_theta", None):
        facts.pop("rope_theta")
    if "type" in facts and facts.get("rope_type") == facts["type"]:
        facts.pop("rope_type")
    return facts


def check_same_model(run: RunConfig, reference: Reference) -> None:
    """The shards and the reference are one model: the same family and architecture (config.json's fields, the
    storage aside)."""
    ours, theirs = run.family, reference.checkpoint.family
    if ours.name != theirs.name:
        raise InputError(f"the shards are {ours.name} but the reference is {theirs.name}")
    mine, its = ours.parse_config(run.model_config), reference.checkpoint.arch
    differ = [f.name for f in dataclasses.fields(mine) if f.name not in STORAGE_FIELDS
              and _facts(getattr(mine, f.name), mine) != _facts(getattr(its, f.name), its)]
    if differ:
        name = differ[0]
        raise InputError(f"the shards and the reference differ in {name} ({getattr(mine, name)!r} against "
                         f"{getattr(its, name)!r}): not the same model")


def saved_path(out: Path, prompt: int, name: int | str) -> Path:
    return out / f"prompt{prompt}-{name}.pt"


class Recorder:
    """Rank 0's observer (DeepseekV3/V4.observe): every layer's output and the logits of the step's rows, saved as
    float32 files, prompt by prompt (the prompts run one step each, one after another)."""

    def __init__(self, out: Path):
        self.out, self.prompt = out, 0

    def __call__(self, name: int | str, output: torch.Tensor) -> None:
        if output.shape[0] == 0:  # a step without this rank's rows
            return
        torch.save(output.detach().float().cpu().clone(), saved_path(self.out, self.prompt, name))
        if name == LOGITS:
            self.prompt += 1


def rank_main(run: RunConfig, prompts: list[list[int]], out: str) -> None:
    """Every rank: each prompt through the engine on attention-DP rank 0; rank 0 records."""
    engine = start_engine(run)
    if not engine.leads:
        engine.run()
        return
    engine.worker.model.observe = Recorder(Path(out))
    door = EngineClient()
    door.open(engine)
    for ids in prompts:
        door.submit(ids, SCORE, lambda _output: None, dp_rank=0)
    engine.run(door, until_idle=True)


@dataclass
class LayerFigures:
    """Running sums over every compared token of one layer: the cosine of the whole outputs and the largest
    difference."""
    dot: float = 0.0
    ours_sq: float = 0.0
    theirs_sq: float = 0.0
    max_abs_diff: float = 0.0

    def add(self, ours: torch.Tensor, theirs: torch.Tensor) -> None:
        ours, theirs = ours.double(), theirs.double()
        self.dot += float((ours * theirs).sum())
        self.ours_sq += float((ours * ours).sum())
        self.theirs_sq += float((theirs * theirs).sum())
        self.max_abs_diff = max(self.max_abs_diff, float((ours - theirs).abs().max()))

    @property
    def cosine(self) -> float:
        norms = math.sqrt(self.ours_sq * self.theirs_sq)
        return self.dot / norms if norms else (1.0 if self.ours_sq == self.theirs_sq else 0.0)


@dataclass
class Comparison:
    layers: dict[int, LayerFigures] = field(default_factory=dict)
    position_cosines: list[float] = field(default_factory=list)
    top1_matched: int = 0
    tokens: int = 0

    def report(self, min_cosine: float) -> dict:
        layers = [{"layer": index, "cosine": figures.cosine, "max_abs_diff": figures.max_abs_diff}
                  for index, figures in sorted(self.layers.items())]
        below = [row["layer"] for row in layers if not row["cosine"] >= min_cosine]
        return {"layers": layers,
                "logits_cosine": sum(self.position_cosines) / len(self.position_cosines),
                "top1_agreement": self.top1_matched / self.tokens, "first_below": below[0] if below else None,
                "tokens": self.tokens, "min_cosine": min_cosine}


def compare(reference: Reference, prompts: list[list[int]], ours: Path) -> Comparison:
    """The reference's forward of each prompt against our saved outputs (each deleted once compared)."""
    result = Comparison()
    for prompt, ids in enumerate(prompts):
        def observe(name: int | str, output: torch.Tensor, prompt: int = prompt) -> None:
            path = saved_path(ours, prompt, name)
            if not path.is_file():
                raise RuntimeError(f"our side saved no {name} output for prompt {prompt} ({path.name})")
            mine, theirs = torch.load(path), output[0].float()  # the reference runs a batch of one
            path.unlink()
            if mine.shape != theirs.shape:
                raise RuntimeError(f"{name}: our output {tuple(mine.shape)} against the reference's "
                                   f"{tuple(theirs.shape)}")
            if name == LOGITS:
                cosines = torch.nn.functional.cosine_similarity(mine.double(), theirs.double(), dim=-1)
                result.position_cosines.extend(cosines.tolist())
                result.top1_matched += int((mine.argmax(-1) == theirs.argmax(-1)).sum())
                result.tokens += mine.shape[0]
            else:
                result.layers.setdefault(name, LayerFigures()).add(mine, theirs)

        reference.run(ids, observe)
    return result


def print_report(report: dict) -> None:
    """The comparison as a table, then the logits' line and the verdict."""
    from rich.table import Table

    from dsconv.console import console

    bound = report["min_cosine"]
    table = Table(title=f"dsrun compare: each layer's output against transformers' ({report['tokens']} tokens)",
                  title_justify="left")
    for column in ("layer", "cosine", "max |diff|"):
        table.add_column(column, justify="right")
    for row in report["layers"]:
        style = None if row["cosine"] >= bound else "bold red"
        table.add_row(str(row["layer"]), f"{row['cosine']:.6f}", f"{row['max_abs_diff']:.3g}", style=style)
    console.print(table)
    console.print(f"logits: mean cosine {report['logits_cosine']:.6f}, top-1 agreement "
                  f"{report['top1_agreement']:.4f} over {report['tokens']} positions", highlight=False)
    if "reference_peak_rss_bytes" in report:
        console.print(f"the reference's process peaked at {report['reference_peak_rss_bytes'] / 2**30:.2f} GiB (its "
                      f"largest part: {report['reference_largest_part_bytes'] / 2**30:.2f} GiB)", highlight=False)
    if report["first_below"] is None:
        console.print(f"[green]every layer's cosine is at least {bound}[/]")
    else:
        console.print(f"[bold red]layer {report['first_below']} is the first below {bound}[/]")
