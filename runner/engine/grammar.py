"""Constrained decoding with xgrammar (the grammar engine vLLM and SGLang use): a request's output held to a JSON
schema or to a tool-call block, by masking each step's logits to the tokens the grammar allows.

A request carries a GrammarSpec in its SamplingParams; the scheduler copies it, with the request's output so far,
into each step's SampleSpec, and the rank that samples the request keeps a matcher per sequence: it masks the
logits of every constrained row of the step in one call, samples, and advances each matcher by its token. A
matcher that does not know a sequence's output (a new one, or one recomputed after a preemption) is rebuilt
from it. Grammars are compiled once per spec and process (xgrammar caches them too).

- `json`: a JSON schema, written without optional whitespace (vLLM's `disable-any-whitespace`: xgrammar's
  any_whitespace=False, one space after each `,` and `:` and none elsewhere; a weak model otherwise emits
  spaces until max_tokens); with thinking, free reasoning up to `</think>` first.
- `tag`: an xgrammar structural tag (JSON), e.g. its DeepSeek-V3.2 / V4 tool-call formats for tool_choice
  "required" or a named function.
Once a grammar is complete only the end-of-sentence token is allowed, so the request stops there.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch

from dsconv.errors import InputError

THINK_EXCLUDES = ("<think>", "</think>")  # never inside reasoning or constrained text
END_THINK = "</think>"


@dataclass(frozen=True)
class GrammarSpec:
    kind: str  # "json" or "tag"
    text: str  # the JSON schema, or the structural tag, as JSON text
    thinking: bool = False  # json: the reply opens with reasoning up to </think>, unconstrained


def json_spec(schema: dict, thinking: bool) -> GrammarSpec:
    return GrammarSpec("json", json.dumps(schema, ensure_ascii=False), thinking)  # key order kept: it is the output's


# Compiled grammars kept for reuse: each client schema compiles once while it is in use, and one that sends a new
# schema with every request does not grow the server (a compiled JSON schema grammar is tens of KiB to MiBs)
COMPILED_KEPT = 256

class Grammars:
    """One process's compiler, compiled grammars and per-sequence matchers (built on first use: the tokenizer's
    table takes about a second to build)."""

    def __init__(self, tokenizer_path: str | Path, vocab_size: int, eos_token_id: int | None):
        self.tokenizer_path, self.vocab_size, self.eos_token_id = str(tokenizer_path), vocab_size, eos_token_id
        self._compiler = None
        self._compiled: OrderedDict[GrammarSpec, object] = OrderedDict()  # least recently used first
        self._lock = threading.Lock()  # rank 0 compiles for the HTTP front end (a 400 for a bad schema) and the engine
        self._matchers: dict[int, tuple[object, int]] = {}  # seq_id -> (matcher, tokens it has accepted)
        # seq_id -> why its grammar failed (a matcher that raised): its rows are left unmasked and its result says so,
        # and the scheduler fails that request alone; every rank meets the same failure (the same matchers, tokens)
        self.failed: dict[int, str] = {}

    def _xgr(self):
        import xgrammar

        if self._compiler is None:
            from tokenizers import Tokenizer

            # DeepSeek's tokenizer is byte-level BPE: its tokens as stored, by id (what xgrammar's from_huggingface
            # reads from the same file through transformers); a model whose vocabulary is smaller than its
            # tokenizer's (a test's tiny model) cannot draw the ids past it, and xgrammar refuses a table longer
            # than vocab_size
            tokenizer = Tokenizer.from_file(self.tokenizer_path)
            vocab = [tokenizer.id_to_token(i) or "" for i in range(min(tokenizer.get_vocab_size(), self.vocab_size))]
            stops = [] if self.eos_token_id is None else [self.eos_token_id]
            info = xgrammar.TokenizerInfo(vocab, xgrammar.VocabType.BYTE_LEVEL, vocab_size=self.vocab_size,
                                          stop_token_ids=stops, add_prefix_space=False)
            self._compiler = xgrammar.GrammarCompiler(info, max_threads=1)
        return xgrammar

    def compile(self, spec: GrammarSpec):
        """The compiled grammar; InputError (a 400) for a schema or tag xgrammar cannot compile."""
        with self._lock:
            return self._compile(spec)

    def _compile(self, spec: GrammarSpec):
        if spec not in self._compiled:
            xgr = self._xgr()
            try:
                if spec.kind == "json":
                    grammar = xgr.Grammar.from_json_schema(spec.text, any_whitespace=False)
                    if spec.thinking:
                        grammar = xgr.Grammar.concat(_reasoning(xgr), grammar)
                    compiled = self._compiler.compile_grammar(grammar)
                elif spec.kind == "tag":
                    compiled = self._compiler.compile_structural_tag(spec.text)
                else:
                    raise ValueError(f"unknown grammar kind {spec.kind!r}")
            except (RuntimeError, ValueError) as exc:
                raise InputError(f"the schema cannot be compiled for constrained decoding: "
                                 f"{str(exc).splitlines()[-1] if str(exc) else type(exc).__name__}") from None
            self._compiled[spec] = compiled
            while len(self._compiled) > COMPILED_KEPT:
                self._compiled.popitem(last=False)  # a running sequence's matcher keeps its own grammar
        self._compiled.move_to_end(spec)
        return self._compiled[spec]

    def constrain(self, logits: torch.Tensor,
                  rows: list[tuple[int, int, GrammarSpec, tuple[int, ...], tuple[int, ...]]]) -> None:
        """Masks, in place, the rows of `logits` [N, vocab] given as (row, seq_id, spec, output so far, tokens after
        it): each to what the grammar allows after the output and those tokens (speculative decoding's drafts: the
        matcher takes them, then rolls them back). A sequence whose grammar is complete (and has taken its
        end-of-sentence, yet goes on: ignore_eos) may only repeat it. A row after a token the grammar refuses is left
        as it is: that token's own row refuses it, so nothing reads the rows after it (`sampler.constrain`)."""
        if logits.shape[-1] != self.vocab_size:
            raise ValueError(f"logits have {logits.shape[-1]} columns, the grammar's vocabulary {self.vocab_size}")
        xgr = self._xgr()
        bitmask = xgr.allocate_token_bitmask(len(rows), self.vocab_size)
        masked, done = [], []
        for i, (row, seq_id, spec, output, after) in enumerate(rows):
            if seq_id in self.failed:
                continue
            try:
                complete = self._mask(i, seq_id, spec, output, after, bitmask)
            except Exception as exc:  # noqa: BLE001  (one sequence's grammar fails that request alone)
                self._fail(seq_id, exc)
                continue
            if complete is not None:  # the row is masked (and, complete, held to end-of-sentence below)
                masked.append(i)
                if complete:
                    done.append(row)
        picked_rows = [rows[i][0] for i in masked]
        if picked_rows:
            picked = logits[picked_rows]
            xgr.apply_token_bitmask_inplace(picked, bitmask[masked].to(picked.device))
            logits[picked_rows] = picked
        for row in done:
            eos = logits[row, self.eos_token_id].clone()
            logits[row] = float("-inf")
            logits[row, self.eos_token_id] = eos

    def _mask(self, i: int, seq_id: int, spec: GrammarSpec, output: tuple[int, ...], after: tuple[int, ...],
              bitmask) -> bool | None:
        """Row i of the bitmask filled as the sequence's grammar stands after `output` and `after` -> None when
        `after` leaves the grammar (the row is left as it is), True when the grammar is complete there (only
        end-of-sentence may follow), False when the bitmask row holds what may follow."""
        matcher = self._matcher(seq_id, spec, output)
        taken, follows = 0, True  # tokens the matcher took (to roll back); whether all of `after` fits
        for token in after:
            if matcher.is_terminated():  # done: only end-of-sentence again (ignore_eos), which it does not take
                follows = token == self.eos_token_id
            elif matcher.accept_token(token):
                taken += 1
            else:
                follows = False
            if not follows:
                break
        complete = matcher.is_terminated()
        if follows and not complete:
            matcher.fill_next_token_bitmask(bitmask, i)
        if taken:
            matcher.rollback(taken)
        return complete if follows else None

    def accept(self, seq_id: int, token: int) -> None:
        if seq_id in self.failed:
            return
        try:
            matcher, count = self._matchers[seq_id]
            if not matcher.is_terminated() and not matcher.accept_token(token):
                raise RuntimeError(f"sequence {seq_id}: token {token} is outside the grammar that masked it")
        except Exception as exc:  # noqa: BLE001  (one sequence's grammar fails that request alone)
            self._fail(seq_id, exc)
            return
        self._matchers[seq_id] = (matcher, count + 1)

    def _fail(self, seq_id: int, exc: Exception) -> None:
        self.failed[seq_id] = f"its grammar failed: {type(exc).__name__}: {exc}"
        self._matchers.pop(seq_id, None)

    def release(self, seq_id: int) -> None:
        self._matchers.pop(seq_id, None)
        self.failed.pop(seq_id, None)

    def _matcher(self, seq_id: int, spec: GrammarSpec, output: tuple[int, ...]):
        known = self._matchers.get(seq_id)
        if known is None or known[1] != len(output):  # new, or recomputed after a preemption: replay its output
            matcher = self._xgr().GrammarMatcher(self.compile(spec))
            for token in output:
                if not matcher.is_terminated() and not matcher.accept_token(token):
                    raise RuntimeError(f"sequence {seq_id}: its output does not follow its grammar")
            known = self._matchers[seq_id] = (matcher, len(output))
        return known[0]


def _reasoning(xgr):
    """Free text up to `</think>` (the prompt opened `<think>`), as xgrammar's structural tags write a reasoning
    block."""
    from xgrammar.structural_tag import AnyTextFormat, StructuralTag, TagFormat

    block = TagFormat(begin="", content=AnyTextFormat(excludes=list(THINK_EXCLUDES)), end=END_THINK)
    return xgr.Grammar.from_structural_tag(StructuralTag(format=block))


# OpenAI reads a function without `parameters` as one that takes none; xgrammar would let its arguments be anything
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


def tool_call_spec(model: str, tools: list[dict], tool_choice, thinking: bool) -> GrammarSpec:
    """xgrammar's own structural tag for a DeepSeek model's tool calls (`model`: its key, "deepseek_v3_2" or
    "deepseek_v4"): tool_choice "required" or a named function, one call (the grammar ends after it, so a weak
    model cannot go on calling until max_tokens); "auto" (parallel_tool_calls false), free text and at most one
    call after it. JSON argument values take at most one whitespace character between tokens (xgrammar refuses
    none); a function without `parameters` takes none (its arguments are `{}`)."""
    import xgrammar

    tools = [{**tool, "function": {**tool["function"], "parameters": tool["function"].get("parameters",
                                                                                           NO_PARAMETERS)}}
             for tool in tools]
    tag = xgrammar.get_model_structural_tag(model, tools=tools, tool_choice=tool_choice,
                                            reasoning="enabled" if thinking else "disabled", max_whitespace_cnt=1,
                                            parallel_tool_calls=False)
    return GrammarSpec("tag", tag.model_dump_json())
