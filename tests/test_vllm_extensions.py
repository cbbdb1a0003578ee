"""vLLM's sampling and request extensions, each against a reference: repetition_penalty and min_p against
transformers' logits processors on the same logits; min_tokens holding EOS back exactly (the tiny V3.2 through the
engine); priority reordering admission and preemption under --scheduling-policy priority; the detokenization and
prompt fields through the HTTP front end (skip_special_tokens against transformers' decode of the real tokenizer,
include_stop_str_in_output, truncate_prompt_tokens, add_special_tokens); continuous_usage_stats' chunks; and
use_beam_search=true and priority without the policy refused by name."""

import json

import pytest
import torch
from transformers import PreTrainedTokenizerFast
from transformers.generation.logits_process import MinPLogitsWarper, RepetitionPenaltyLogitsProcessor

from dsconv.errors import InputError
from dsconv.runner.engine import sampler
from dsconv.runner.engine.request import SamplingParams, SeqResult
from dsconv.runner.engine.config import SchedulerConfig
from dsconv.runner.engine.scheduler import PoolShape, Scheduler
from dsconv.runner.engine.batch import Batch, SampleSpec
from tests.test_scheduler import fake_results, run
from tests.test_serve_api import GOOD, GOOD_CHAT, TOKENIZER, TOKENIZER_PATH, FakeEngine, assert_error, make_client

VOCAB = 300


def _row(seed: int) -> torch.Tensor:
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(seed)) * 4
    logits[0, :20] = logits[0, :20].abs()  # positive and negative logits among the penalized tokens
    return logits


@pytest.mark.parametrize("penalty", [0.5, 1.3, 2.0])
def test_repetition_penalty_equals_transformers_processor(penalty):
    """The prompt and output's tokens (repeated ones among them) penalized as transformers'
    RepetitionPenaltyLogitsProcessor penalizes them, bit for bit in float32; the greedy token follows."""
    history = [3, 7, 7, 12, 0, 19, 3, 250]
    logits = _row(1)
    want = RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor([history]), logits.clone())
    spec = SampleSpec(0.0, 1.0, 0, 0, 0, None, repetition_penalty=penalty, seen=tuple(sorted(set(history))))
    got = logits.clone()
    sampler.adjust(got, 0, spec)
    assert torch.equal(got, want)
    batch = Batch()
    batch.add(0, [1], 1, [0], 4, spec, None)
    assert sampler.step_results(batch, logits.clone())[0].token == int(want.argmax())


@pytest.mark.parametrize("min_p, temperature", [(0.05, 1.0), (0.2, 0.7), (0.5, 1.5)])
def test_min_p_keeps_what_transformers_min_p_warper_keeps(min_p, temperature):
    """The tokens min_p keeps at a temperature are those transformers' MinPLogitsWarper leaves finite on the
    tempered logits; 300 seeded draws never leave them."""
    logits = _row(2)
    warped = MinPLogitsWarper(min_p)(None, logits / temperature)
    allowed = set(torch.nonzero(torch.isfinite(warped[0]))[:, 0].tolist())
    spec = SampleSpec(temperature, 1.0, 0, 0, 0, None, min_p=min_p)
    values = logits.float().sort(dim=-1, descending=True, stable=True).values
    assert int(sampler.kept(torch.softmax(values / temperature, dim=-1), [spec])[0]) == len(allowed)
    specs = [SampleSpec(temperature, 1.0, 0, seed, 0, None, min_p=min_p) for seed in range(300)]
    drawn = set(sampler.sample(logits.expand(300, -1).clone(), specs).tolist())
    assert drawn <= allowed and len(drawn) > 1 or len(allowed) == 1


def test_min_tokens_holds_eos_back_exactly():
    """A scheduler whose model always says EOS (token 1): with min_tokens 3 the request's EOS is held back until it
    has 3 tokens (the spec bans it, and the sampler never draws a banned token), then ends it: 4 tokens, the last
    EOS; stop_token_ids likewise, EOS left alone under ignore_eos."""
    s = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64),
                  PoolShape(dp=1, num_blocks=64, block_size=4), eos_token_id=1)
    s.add("r", [5, 6], SamplingParams(max_tokens=8, min_tokens=3, stop_token_ids=(9,)), None)
    banned = []
    for _ in range(10):
        step = s.schedule()
        if step is None:
            break
        spec = step.batches[0].samples[0]
        banned.append(spec.banned)
        row = torch.zeros(1, 20)
        row[0, 1] = 10.0  # EOS is the model's choice
        row[0, 9] = 9.0  # then the stop token
        token = sampler.step_results(step.batches[0], row)[0].token
        s.update(step, [[SeqResult(token, None)]])
    assert banned == [(1, 9)] * 3 + [()]
    ignoring = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64),
                         PoolShape(dp=1, num_blocks=64, block_size=4), eos_token_id=1)
    ignoring.add("r", [5], SamplingParams(max_tokens=4, min_tokens=2, ignore_eos=True), None)
    assert ignoring.schedule().batches[0].samples[0].banned == ()


def _admitted(policy: str) -> list[str]:
    s = Scheduler(SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=64, scheduling_policy=policy),
                  PoolShape(dp=1, num_blocks=64, block_size=4))
    for name, priority in (("late-low", 5), ("high", 0), ("mid", 2), ("high-later", 0)):  # fcfs refuses priority
        s.add(name, [1, 2, 3], SamplingParams(max_tokens=1, priority=priority if policy == "priority" else 0), None)
    order = []
    while (step := s.schedule()) is not None:
        order += [s.by_seq[seq].request_id for seq in step.batches[0].seq_ids]
        s.update(step, fake_results(step))
    return order


def test_priority_reorders_admission_under_a_full_batch():
    """One sequence slot: fcfs admits by arrival; priority by value, ties by arrival."""
    assert _admitted("fcfs") == ["late-low", "high", "mid", "high-later"]
    assert _admitted("priority") == ["high", "high-later", "mid", "late-low"]


def test_priority_preempts_the_highest_value_first():
    """6 blocks of 4 tokens cannot hold the three requests' 12 tokens each: the first one preempted is the highest
    priority value (b), not the newest (c), and every request still finishes its 8 tokens."""
    s = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, scheduling_policy="priority"),
                  PoolShape(dp=1, num_blocks=6, block_size=4))
    for name, priority in (("a", 0), ("b", 9), ("c", 1)):
        s.add(name, [1, 2, 3, 4], SamplingParams(max_tokens=8, priority=priority), None)
    victims = []
    original = s._preempt

    def watch(request, rank, batch):
        victims.append(request.request_id)
        original(request, rank, batch)

    s._preempt = watch
    outs = run(s)
    assert victims and victims[0] == "b", victims
    assert set(outs) == {"a", "b", "c"} and all(len(tokens) == 8 for tokens in outs.values())


def test_priority_needs_the_priority_policy():
    with pytest.raises(InputError, match="--scheduling-policy priority"):
        Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64), PoolShape(dp=1, num_blocks=64, block_size=4)
                  ).add("r", [1], SamplingParams(max_tokens=1, priority=1), None)
    with pytest.raises(InputError, match="scheduling-policy"):
        SchedulerConfig(scheduling_policy="lifo")


# --- through the HTTP front end (tests/test_serve_api.py's fake engine) -------------------------------------------

def test_fields_reach_the_engine_with_vllms_meanings():
    client, engine = make_client()
    body = {**GOOD, "repetition_penalty": 1.2, "min_p": 0.1, "min_tokens": 1, "use_beam_search": False,
            "spaces_between_special_tokens": False, "skip_special_tokens": True}
    assert client.post("/v1/completions", json=body).status_code == 200
    (prompt, params, _), = engine.submitted.values()
    assert (params.repetition_penalty, params.min_p, params.min_tokens, params.priority) == (1.2, 0.1, 1, 0)
    bos = prompt[0]
    client.post("/v1/completions", json={**GOOD, "add_special_tokens": False})
    assert list(engine.submitted.values())[-1][0] == prompt[1:]  # the text's own tokens, no BOS
    client.post("/v1/completions", json={**GOOD, "prompt": list(range(100, 110)), "truncate_prompt_tokens": 4})
    assert list(engine.submitted.values())[-1][0] == [106, 107, 108, 109]
    chat = client.post("/v1/chat/completions", json=GOOD_CHAT)
    plain = list(engine.submitted.values())[-1][0]
    client.post("/v1/chat/completions", json={**GOOD_CHAT, "add_special_tokens": True})
    assert chat.status_code == 200 and list(engine.submitted.values())[-1][0] == [bos] + plain
    client.post("/v1/chat/completions", json={**GOOD_CHAT, "truncate_prompt_tokens": 3})
    assert list(engine.submitted.values())[-1][0] == plain[-3:]


def test_refused_values_name_their_field():
    client, _ = make_client()
    for body, field in (({**GOOD, "use_beam_search": True}, "use_beam_search"),
                        ({**GOOD, "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
                        ({**GOOD, "repetition_penalty": 0}, "repetition_penalty"),
                        ({**GOOD, "min_p": 1.5}, "min_p"), ({**GOOD, "min_tokens": 3}, "min_tokens")):
        response = client.post("/v1/completions", json=body)
        assert_error(response, 400)
        assert field in json.dumps(response.json()), (field, response.json())


def _stream(client, path, body) -> list[dict]:
    lines = client.post(path, json={**body, "stream": True}).text.splitlines()
    return [json.loads(line[6:]) for line in lines if line.startswith("data: {")]


@pytest.mark.parametrize("path, body", [("/v1/completions", {"prompt": "hello", "max_tokens": 5}),
                                        ("/v1/chat/completions", {**GOOD_CHAT, "max_tokens": 5})])
def test_continuous_usage_stats_chunks_count_up_to_the_final_usage(path, body):
    client, _ = make_client()
    chunks = _stream(client, path, {**body, "stream_options": {"include_usage": True,
                                                               "continuous_usage_stats": True}})
    *with_choices, final = chunks
    counts = [chunk["usage"]["completion_tokens"] for chunk in with_choices]
    assert all("usage" in chunk for chunk in with_choices) and counts == sorted(counts)
    assert final["choices"] == [] and counts[-1] == final["usage"]["completion_tokens"] == 5
    assert all(c["usage"]["prompt_tokens"] == final["usage"]["prompt_tokens"] for c in with_choices)
    plain = _stream(client, path, {**body, "stream_options": {"include_usage": True}})
    assert not any("usage" in chunk for chunk in plain[:-1])


def test_stop_strings_with_include_and_min_tokens():
    """The fake model writes the script's tokens; a stop string in them ends the text before it, or after it with
    include_stop_str_in_output; within the first min_tokens tokens it does not count."""
    words = [TOKENIZER.token_to_id(w) for w in ("Ġa", "Ġb", "Ġc", "Ġd", "Ġe", "Ġf")]
    client, _ = make_client(FakeEngine(script=words))
    body = {"prompt": "x", "max_tokens": 6, "stop": [" b"]}
    assert client.post("/v1/completions", json=body).json()["choices"][0]["text"] == " a"
    kept = client.post("/v1/completions", json={**body, "include_stop_str_in_output": True}).json()
    assert kept["choices"][0]["text"] == " a b"
    late = client.post("/v1/completions", json={**body, "min_tokens": 2, "stop": [" b", " d"]}).json()
    assert late["choices"][0]["text"] == " a b c" and late["choices"][0]["finish_reason"] == "stop"


def test_special_tokens_in_text_follow_transformers_decode():
    """skip_special_tokens false keeps the special tokens' text, as transformers' decode of the real tokenizer
    gives it, whatever spaces_between_special_tokens says (a fast tokenizer's decode has no such option, in
    transformers as in vLLM)."""
    eos = TOKENIZER.token_to_id("<｜end▁of▁sentence｜>")
    words = [TOKENIZER.token_to_id("Ġa"), eos, TOKENIZER.token_to_id("Ġb")]
    client, _ = make_client(FakeEngine(script=words))
    reference = PreTrainedTokenizerFast(tokenizer_file=str(TOKENIZER_PATH))
    for skip in (True, False):
        for spaces in (True, False):
            text = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 3, "ignore_eos": True,
                                                        "skip_special_tokens": skip,
                                                        "spaces_between_special_tokens": spaces}
                               ).json()["choices"][0]["text"]
            assert text == reference.decode(words, skip_special_tokens=skip, spaces_between_special_tokens=spaces)
