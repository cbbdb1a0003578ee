"""What a request asks of the serving engine and what the engine tells back, shared by the scheduler, the step
loop and the HTTP front end (`dsrun serve`) and by `dsrun generate` and `dsrun perplexity`, clients of the same
engine."""

from __future__ import annotations

from dataclasses import dataclass, field

from dsconv.errors import InputError
from dsconv.runner.engine.grammar import GrammarSpec
from dsconv.runner.engine.kv_transfer import Export, Offer, Offers

MAX_TOP_LOGPROBS = 20  # top-logprob entries per token a request may ask for (vLLM's limit for completions)
MAX_N = 128  # parallel samples a request may ask for (OpenAI's limit for n)
MAX_REPETITION_PENALTY = 2.0  # vLLM's protocol bound (repetition_penalty in (0, 2])


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int  # new tokens at most; 0 only with prompt_logprobs (score the prompt, generate nothing)
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0  # keep the smallest set of tokens whose probability reaches top_p
    top_k: int = 0  # keep the k most likely tokens; 0: all
    seed: int | None = None  # sampled tokens depend on (seed, position in the output) only
    stop_token_ids: tuple[int, ...] = ()  # finish (reason "stop") after any of these, which is kept
    ignore_eos: bool = False  # go on past EOS, to max_tokens
    logprobs: int | None = None  # per new token: its logprob and this many top entries (None: none)
    prompt_logprobs: int | None = None  # per prompt token after the first: the same (echo + logprobs)
    grammar: GrammarSpec | None = None  # hold the output to a JSON schema or tool-call format (engine/grammar.py)
    n: int = 1  # parallel samples of one prefill; sample i draws with seed + i (scheduler.py)
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias): added to the logits before the grammar's
    #                                                 mask and sampling (OpenAI's logit_bias)
    cache_salt: str | None = None  # vLLM's request field: only requests with the same salt share cached blocks
    # vLLM's extensions (its SamplingParams' names and meanings)
    repetition_penalty: float = 1.0  # CTRL's rule on every token of the prompt and output: logit / p if > 0, else * p
    min_p: float = 0.0  # keep tokens whose probability is at least min_p x the largest's (after temperature)
    min_tokens: int = 0  # EOS, stop_token_ids and stop strings do not end the output before this many tokens
    priority: int = 0  # --scheduling-policy priority: lower first, ties by arrival
    # P/D disaggregation (engine/kv_transfer.py): Export on a producer (hand the prompt's cache over), the producer's
    # Offer on a consumer (start from its blocks); None: neither
    kv_transfer: Export | Offer | Offers | None = None  # Offers: a batch's, which the front end splits per prompt

    def __post_init__(self) -> None:
        if self.max_tokens < 0 or (self.max_tokens == 0 and self.prompt_logprobs is None):
            raise InputError(f"max_tokens must be at least 1 (0 only when scoring the prompt), got {self.max_tokens}")
        if not 0.0 <= self.temperature <= 100.0:
            raise InputError(f"temperature must be in [0, 100], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise InputError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise InputError(f"top_k must be 0 (off) or positive, got {self.top_k}")
        if not 0.0 < self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise InputError(f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY}], got "
                             f"{self.repetition_penalty}")
        if not 0.0 <= self.min_p <= 1.0:
            raise InputError(f"min_p must be in [0, 1], got {self.min_p}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise InputError(f"min_tokens must be between 0 and max_tokens ({self.max_tokens}), got {self.min_tokens}")
        if not 1 <= self.n <= MAX_N:
            raise InputError(f"n must be between 1 and {MAX_N}, got {self.n}")
        if isinstance(self.kv_transfer, Export) and self.n > 1:
            raise InputError("kv_transfer_params do_remote_decode: a producer prefills one sample (n 1)")
        if self.kv_transfer is not None and self.prompt_logprobs is not None:
            raise InputError("kv_transfer_params: a handed-over prompt is not scored (no echo with logprobs, no "
                             "prompt_logprobs)")
        if self.n > 1 and self.max_tokens == 0:
            raise InputError("n > 1 needs max_tokens of at least 1: the samples differ only in what they generate")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_TOP_LOGPROBS:
                raise InputError(f"{name} must be between 0 and {MAX_TOP_LOGPROBS}, got {value}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float  # log-softmax of the model's logits (before temperature, top-k or top-p)
    top: dict[int, float] = field(default_factory=dict)  # the most likely token ids -> their logprobs


@dataclass(frozen=True)
class SeqResult:
    """One sequence's share of a step, from the worker that ran it to the scheduler on rank 0."""
    token: int | None  # the sampled next token; None when the sequence only fed (part of) its prompt
    logprob: TokenLogprob | None  # the sampled token's, when the request asks for logprobs
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # the step's scored prompt tokens, in order
    siblings: list[tuple[int, TokenLogprob | None]] = field(default_factory=list)  # SampleSpec.siblings' draws
    # speculative decoding: the tokens after `token` the step emits (accepted drafts are `token` and these but the
    # last, which is the target's own), and the drafts the MTP layer proposes for the next step
    extra: list[tuple[int, TokenLogprob | None]] = field(default_factory=list)
    drafts: list[int] = field(default_factory=list)
    error: str | None = None  # this sequence failed alone on the ranks (its grammar): the scheduler fails its request


FINISH_STOP, FINISH_LENGTH, FINISH_ABORT = "stop", "length", "abort"


def failure_text(stage: str, exc: Exception) -> str:
    """What a request that failed inside the engine is told (its HTTP 500's message)."""
    return f"the request failed while it was {FAILURE_STAGES[stage]}: {type(exc).__name__}: {exc}"


# where in the engine a request can fail alone (dsrun:request_failures_total's `stage`), and how its error says it
FAILURE_STAGES = {"add": "admitted", "sample": "sampled", "update": "taking its step's results"}


class NotAccepting(RuntimeError):
    """The engine takes no requests now: the model is still loading, or it is draining (SIGTERM)."""


@dataclass
class RequestOutput:
    """One step's news about one sample of a request, delivered on rank 0 to the callback given at submission
    (called from the engine's thread). The last output of each sample has finished=True."""
    request_id: str
    prompt_tokens: int
    new_token_ids: list[int] = field(default_factory=list)  # tokens generated this step (0 or 1)
    new_logprobs: list[TokenLogprob] | None = None  # one per new token, when params.logprobs is set
    prompt_logprobs: list[TokenLogprob | None] | None = None  # once, when the prompt has been scored: None for
    #                                                           the first token, which nothing predicts
    finished: bool = False
    finish_reason: str | None = None  # FINISH_STOP (EOS or a stop token), FINISH_LENGTH, FINISH_ABORT
    error: str | None = None  # set when the engine gave up on the request (finish_reason FINISH_ABORT)
    unavailable: bool = False  # the request came as the server began to drain: not run (HTTP 503, not 500)
    index: int = 0  # which of the request's n samples
    cached_tokens: int = 0  # prompt tokens found in the prefix cache when it was first scheduled
    connector_params: dict | None = None  # what the KV connector says of a finished request (a P/D producer's
    # Offer.params, its response's kv_transfer_params)


def check_prompt(prompt_ids: list[int], max_tokens: int, vocab_size: int, max_model_len: int) -> None:
    """What a request must satisfy whatever the engine holds: token ids in the vocabulary and room in the model's
    context. The engine client checks it at submit; `dsrun` checks it before it starts any rank."""
    if not prompt_ids:
        raise InputError("the prompt is empty")
    bad = [t for t in prompt_ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size]
    if bad:
        raise InputError(f"token id {bad[0]!r} is outside the vocabulary (0 .. {vocab_size - 1})")
    if len(prompt_ids) + max_tokens > max_model_len:
        raise InputError(f"prompt ({len(prompt_ids)} tokens) + max_tokens ({max_tokens}) exceed the model's "
                         f"context of {max_model_len} tokens")


def resolve_max_model_len(requested: int | None, max_position_embeddings: int, cache_tokens: int | None) -> int:
    """vLLM's --max-model-len: the most tokens (prompt and reply) one request may hold. By default the smaller of
    the model's context and what one attention-DP rank's KV cache holds (`cache_tokens`; None where the command
    sizes its cache to its input), so that a request without max_tokens (which gets max_model_len - prompt) fits
    the cache. A value beyond either is refused: it would let requests in that can never run."""
    fits = max_position_embeddings if cache_tokens is None else min(max_position_embeddings, cache_tokens)
    if requested is None:
        return fits
    if requested < 1:
        raise InputError(f"--max-model-len {requested} must be at least 1")
    if requested > max_position_embeddings:
        raise InputError(f"--max-model-len {requested} exceeds the model's context (max_position_embeddings "
                         f"{max_position_embeddings})")
    if cache_tokens is not None and requested > cache_tokens:
        raise InputError(f"--max-model-len {requested} does not fit one attention-DP rank's KV cache of "
                         f"{cache_tokens} tokens: raise --cache-tokens (or --kv-cache-memory-bytes) or lower "
                         f"--max-model-len")
    return requested
