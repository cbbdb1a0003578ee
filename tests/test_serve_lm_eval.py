"""lm-evaluation-harness (`lm_eval --model local-completions`) against a live `dsrun serve`: the log-likelihoods
of a multiple-choice task equal transformers' on the same tokens, and a generate_until task's outputs equal
transformers' greedy continuations cut at the stop sequences (tiny DeepSeek-V3.2, real vocabulary, float32).

lm_eval tokenizes with the shards' tokenizer files (tokenizer_backend=huggingface) and sends token ids
(tokenized_requests=True), so its context lengths and the server's tokens agree: a text prompt would get the
BOS the server adds for text, which lm_eval's count does not know of."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM

from dsconv.family.layout import Layout
from tests.helpers import Server, shard

pytestmark = pytest.mark.slow

FAMILY = "deepseek_v32"
TASKS = Path(__file__).parent / "data" / "lm_eval"  # the task YAMLs and their JSONL documents
LOGPROB_TOLERANCE = 1e-3  # absolute, on a continuation's summed log-probability (float32 on both sides)
LM_EVAL_TIMEOUT_S = 300


@pytest.fixture(scope="module")
def shards(tiny_source, tmp_path_factory):
    out = tmp_path_factory.mktemp("lm-eval") / "shards"
    shard(tiny_source(FAMILY, real_vocab=True), out, Layout(1, 1, 1, 1))
    return out


@pytest.fixture(scope="module")
def server(shards, tmp_path_factory):
    server = Server(shards, tmp_path_factory.mktemp("lm-eval-server") / "serve.log", "--dtype", "float32")
    yield server
    assert server.stop() == 0, server.log()


@pytest.fixture(scope="module")
def reference(tiny_source):
    source = tiny_source(FAMILY, "bf16", real_vocab=True)  # the same weights as the FP8 fixture, for transformers
    return AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def samples(server, shards, tmp_path_factory) -> dict[str, list[dict]]:
    """lm_eval's per-sample log of both tasks, by task name."""
    out = tmp_path_factory.mktemp("lm-eval-out")
    model_args = ",".join([f"model={shards.name}", f"base_url={server.url}/v1/completions",
                           f"tokenizer={shards}", "tokenizer_backend=huggingface", "tokenized_requests=True",
                           "num_concurrent=4", "max_retries=1", "timeout=120"])
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_DATASETS_CACHE": str(out / "datasets-cache"), "TOKENIZERS_PARALLELISM": "false"}
    run = subprocess.run(
        [sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args", model_args,
         "--tasks", "dsrun_choice,dsrun_generate", "--include_path", str(TASKS), "--output_path", str(out / "results"),
         "--log_samples", "--batch_size", "1"],
        cwd=TASKS, env=env, capture_output=True, text=True, timeout=LM_EVAL_TIMEOUT_S)  # data_files are relative
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    by_task = {}
    for path in (out / "results").rglob("samples_*.jsonl"):
        task = path.name.removeprefix("samples_").rsplit("_", 1)[0]
        by_task[task] = [json.loads(line) for line in path.read_text().splitlines()]
    assert set(by_task) == {"dsrun_choice", "dsrun_generate"}, (sorted(by_task), run.stderr[-3000:])
    return by_task


def documents(name: str) -> list[dict]:
    return [json.loads(line) for line in (TASKS / name).read_text().splitlines()]


def encode_pair(tokenizer: Tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """The context's and the continuation's tokens as lm_eval splits them: trailing spaces of the context move to
    the continuation, and the continuation is what tokenizing the whole adds after the context's tokens."""
    spaces = len(context) - len(context.rstrip(" "))
    context, continuation = context[:len(context) - spaces], context[len(context) - spaces:] + continuation
    whole = tokenizer.encode(context + continuation, add_special_tokens=False).ids
    context_ids = tokenizer.encode(context, add_special_tokens=False).ids
    return context_ids, whole[len(context_ids):]


def transformers_loglikelihood(model, context: list[int], continuation: list[int]) -> float:
    with torch.no_grad():
        logits = model(torch.tensor([context + continuation])).logits[0, len(context) - 1:-1]
    return F.log_softmax(logits.double(), dim=-1).gather(1, torch.tensor(continuation)[:, None]).sum().item()


def transformers_greedy(model, prompt: list[int], max_new_tokens: int, eos_token_id: int) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(max_new_tokens):
            token = model(torch.tensor([ids])).logits[0, -1].argmax().item()
            if token == eos_token_id:
                break
            ids.append(token)
    return ids[len(prompt):]


def cut_at_stops(text: str, stops: list[str]) -> str:
    return text[:min((text.find(s) for s in stops if s in text), default=len(text))]


def test_loglikelihoods_equal_transformers(samples, shards, reference):
    tokenizer = Tokenizer.from_file(str(shards / "tokenizer.json"))
    logged = sorted(samples["dsrun_choice"], key=lambda s: s["doc_id"])
    assert [s["doc"] for s in logged] == documents("choice.jsonl")
    for sample in logged:
        assert len(sample["resps"]) == len(sample["doc"]["choices"])
        for arguments, response in zip(sample["arguments"].values(), sample["resps"]):
            context, continuation = arguments["arg_0"], arguments["arg_1"]
            ours = float(response[0][0])
            expected = transformers_loglikelihood(reference, *encode_pair(tokenizer, context, continuation))
            assert abs(ours - expected) <= LOGPROB_TOLERANCE, (context, continuation, ours, expected)


def test_generations_equal_transformers_greedy(samples, shards, reference):
    tokenizer = Tokenizer.from_file(str(shards / "tokenizer.json"))
    logged = sorted(samples["dsrun_generate"], key=lambda s: s["doc_id"])
    assert [s["doc"] for s in logged] == documents("generate.jsonl")
    cut = 0
    for sample in logged:
        context, gen_kwargs = sample["arguments"]["gen_args_0"]["arg_0"], sample["arguments"]["gen_args_0"]["arg_1"]
        prompt = tokenizer.encode(context, add_special_tokens=False).ids
        generated = transformers_greedy(reference, prompt, gen_kwargs["max_gen_toks"], reference.config.eos_token_id)
        text = tokenizer.decode(generated, skip_special_tokens=True)
        expected = cut_at_stops(text, gen_kwargs["until"])
        cut += expected != text
        assert sample["resps"][0][0] == expected, (context, text)
    assert cut, "no stop sequence ended a generation: the documents no longer test stop handling"
