"""Speculative decoding with DeepSeek's MTP layer (vLLM's `--speculative-config '{"method": "mtp",
"num_speculative_tokens": k}'`): what to run, and the greedy acceptance rule.

Each step a decoding request feeds its last token and the k drafts proposed for it in the step before; the target
model's rows over those k + 1 positions verify them (sampler.verify). Greedy: the drafts are accepted while each
equals the target's argmax at the position before it, and the target's own token at the first mismatch (or after
the last draft, a bonus) follows them, so the output is the target's greedy output, token for token. Sampled:
speculative sampling, which keeps every emitted token distributed as the target's distribution at its position
(temperature, top-k, top-p), with the request's seeded numbers. After the target forward the
MTP layer (runner/models/deepseek_v3.py, MultiTokenPredictor) proposes the next k drafts: once over the step's rows
(its own cache entries for every position, the first draft from the last accepted one), then k - 1 times chained
on its own states, one row per drafting request (the one shipped layer applied again, as vLLM and DeepSeek chain
it).

A request with a grammar (structured outputs, tool calls) drafts and verifies under it: each draft is the MTP
layer's argmax among the tokens the grammar allows after the request's output and the drafts before it, and each
verification row is masked as the grammar stands after the drafts it follows (sampler.constrain). A request with a
logit_bias, or whose n > 1 samples are not forked yet, decodes one token a step beside them; the start-up line
says so.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from dsconv.errors import InputError

METHODS = ("mtp",)
MAX_SPECULATIVE_TOKENS = 3  # the and vllm-ascend's range; beyond one shipped layer the layer is chained


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int

    @classmethod
    def parse(cls, text: str | None) -> SpeculativeConfig | None:
        """--speculative-config's JSON (vLLM's keys) -> the config, or None when not given; bad input is one
        line."""
        if text is None:
            return None
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as e:
            raise InputError(f"--speculative-config is not JSON ({e.msg}): {text!r}") from None
        if not isinstance(raw, dict):
            raise InputError(f"--speculative-config must be a JSON object, got {text!r}")
        unknown = set(raw) - {"method", "num_speculative_tokens"}
        if unknown:
            raise InputError(f"--speculative-config has keys dsrun does not take: {', '.join(sorted(unknown))} "
                             f"(it takes method and num_speculative_tokens)")
        method, k = raw.get("method"), raw.get("num_speculative_tokens")
        if method not in METHODS:
            raise InputError(f"--speculative-config method {method!r} is not one of {', '.join(METHODS)}")
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise InputError(f"--speculative-config num_speculative_tokens {k!r} must be an integer from 1 to "
                             f"{MAX_SPECULATIVE_TOKENS}")
        return cls(method, k)

    @property
    def summary(self) -> str:
        return (f"speculative decoding: MTP, {self.num_speculative_tokens} draft token"
                f"{'s' if self.num_speculative_tokens > 1 else ''} a step (greedy: the same tokens; sampled: the same "
                f"distribution; grammars constrain the drafts); requests with a logit_bias decode one token a step")


def accept_greedy(targets: list[int], drafts: tuple[int, ...] | list[int]) -> list[int]:
    """The target's argmax at each of the k + 1 verified positions, the k drafts -> the tokens the step emits: the
    drafts up to the first that differs from the target's token before it, then the target's token there."""
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == targets[accepted]:
        accepted += 1
    return list(drafts[:accepted]) + [targets[accepted]]


@dataclass
class SpecCounts:
    """vLLM's spec-decode counters: verification steps with drafts, draft tokens, accepted ones, and per draft
    position the accepted ones."""
    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_pos: list[int] | None = None

    def add(self, proposed: int, accepted: int, k: int) -> None:
        if self.accepted_per_pos is None:
            self.accepted_per_pos = [0] * k
        self.drafts += 1
        self.draft_tokens += proposed
        self.accepted_tokens += accepted
        for position in range(accepted):
            self.accepted_per_pos[position] += 1

    def copy(self) -> SpecCounts:
        return SpecCounts(self.drafts, self.draft_tokens, self.accepted_tokens,
                          None if self.accepted_per_pos is None else list(self.accepted_per_pos))

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per verification step: the accepted drafts and the target's own token."""
        return 1 + self.accepted_tokens / self.drafts if self.drafts else 0.0
