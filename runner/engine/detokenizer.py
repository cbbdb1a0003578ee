"""The one incremental detokenizer: the engine's token ids -> text as they arrive, for `dsrun generate`'s stream
and the OpenAI server's choices alike. Each id is decoded once (with the few before it that had not completed a
character), so a sequence of n tokens costs O(n) decoding, never a re-decode of the whole text per token."""

from __future__ import annotations

REPLACEMENT = "\ufffd"  # what decoding gives for bytes that do not (yet) form a whole UTF-8 character


class Detokenizer:
    """Token ids -> text, a whole character at a time. DeepSeek's tokenizers decode byte-level, so the text of a
    run of ids is the concatenation of the texts of its pieces whenever each piece ends on a character boundary;
    ids are held until they complete a character."""

    def __init__(self, tokenizer, skip_special_tokens: bool):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.text = ""
        self._pending: list[int] = []  # ids whose bytes do not end on a character boundary yet

    def add(self, ids: list[int]) -> list[int]:
        """Decodes `ids`; returns where each starts in `text` (a token inside a character: where it starts)."""
        offsets = []
        for token_id in ids:
            offsets.append(len(self.text))
            self._pending.append(token_id)
            piece = self.tokenizer.decode(self._pending, skip_special_tokens=self.skip_special_tokens)
            if not piece.endswith(REPLACEMENT):
                self.text += piece
                self._pending = []
        return offsets

    def flush(self) -> None:
        # At the end, bytes that never completed a character are shown as they decode: with replacement marks.
        if self._pending:
            self.text += self.tokenizer.decode(self._pending, skip_special_tokens=self.skip_special_tokens)
            self._pending = []
