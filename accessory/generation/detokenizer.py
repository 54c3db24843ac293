"""A row's generated text as tokens arrive: incremental detokenization and stop strings, shared by `generate`
and `stream_generate`."""
from __future__ import annotations

from typing import Sequence


class RowText:
    """Text of one row's generated tokens, decoded incrementally, cut at the first stop string.

    Each new token decodes only the tokens since the last emitted boundary (so a long answer costs O(n), not
    O(n^2)), and text that is still an incomplete UTF-8 sequence, or could be the start of a stop string, is held
    back from `visible` until it is settled.
    """

    def __init__(self, tokenizer, stop_strings: Sequence[str] = ()):
        self.tokenizer, self.stop_strings = tokenizer, [s for s in stop_strings if s]
        self.ids: list[int] = []
        self.text = ""  # all settled text
        self._prefix = self._read = 0  # ids[_prefix:_read] are the last settled piece: context for the next
        self._context = ""  # their decoded text
        self.stopped = False
        self.stop_string: str | None = None  # the stop string the text was cut at

    def push(self, token: int) -> None:
        if self.stopped:
            return
        self.ids.append(token)
        self._settle(force=False)

    def finish(self) -> None:
        """No more tokens: settle whatever is pending (even an incomplete character)."""
        if not self.stopped:
            self._settle(force=True)

    def _settle(self, force: bool) -> None:
        # Decode the pending tokens together with the previous piece as context (the tokenizer needs it for
        # leading spaces), and take what they add -- unless that ends in half a character and more may come.
        window = self.tokenizer.decode(self.ids[self._prefix:])
        if force or (len(window) > len(self._context) and not window.endswith("\ufffd")):
            self.text += window[len(self._context):]
            self._prefix, self._read = self._read, len(self.ids)
            self._context = self.tokenizer.decode(self.ids[self._prefix:self._read])
        self._cut_at_stop_string()

    def _cut_at_stop_string(self) -> None:
        if self.stopped:
            return
        found = [(i, s) for i, s in ((self.text.find(s), s) for s in self.stop_strings) if i >= 0]
        if found:
            cut, self.stop_string = min(found, key=lambda f: f[0])
            self.text, self.stopped = self.text[:cut], True

    @property
    def visible(self) -> str:
        """Settled text minus any tail that could still grow into a stop string."""
        if self.stopped:
            return self.text
        held = max((n for s in self.stop_strings for n in range(len(s) - 1, 0, -1) if self.text.endswith(s[:n])),
                   default=0)
        return self.text[:len(self.text) - held]
