"""Incremental detokenization and stop-string matching.

Each request keeps a ``tokenizers`` ``DecodeStream``: one call per new token returns only the new text (or
nothing while a multi-byte character is still incomplete), so a step costs O(1) per request instead of
re-decoding the whole output. The stream is primed with the last prompt tokens so the first generated token
decodes with its proper leading space (SentencePiece tokenizers drop it otherwise).

Stop strings are searched only in the tail that the new text could have completed, so a stop string that spans
two or more tokens is found the step it completes.
"""
from __future__ import annotations

from tokenizers.decoders import DecodeStream

_PRIME_TOKENS = 4


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool,
                 stop: list[str], include_stop_str_in_output: bool) -> None:
        self._backend = tokenizer.backend_tokenizer
        prime = prompt_token_ids[-_PRIME_TOKENS:]
        self._stream = DecodeStream(ids=prime, skip_special_tokens=skip_special_tokens)
        self.stop = stop
        self.include_stop = include_stop_str_in_output
        self._max_stop_len = max((len(s) for s in stop), default=0)
        self.text = ""

    def step(self, token_id: int, check_stop: bool = True) -> str | None:
        """Append one token's text; return the stop string it completed, if any (the text is then cut)."""
        piece = self._stream.step(self._backend, token_id)
        if not piece:
            return None
        start = max(0, len(self.text) - self._max_stop_len + 1)
        self.text += piece
        if not (self.stop and check_stop):
            return None
        hit, hit_at = None, -1
        for s in self.stop:
            at = self.text.find(s, start)
            if at != -1 and (hit_at == -1 or at < hit_at):
                hit, hit_at = s, at
        if hit is not None:
            self.text = self.text[:hit_at + len(hit)] if self.include_stop else self.text[:hit_at]
        return hit
