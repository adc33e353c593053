"""Incremental detokenization and stop conditions for one sequence.

Text is decoded over a short window of recent tokens: the window's text minus the
text of its first part is the new text, so byte-level BPE pieces that form one
UTF-8 character are emitted together (never a broken "\\ufffd" delta).  Text that
might be the start of a stop string is held back until it is not (or is cut).
"""

from __future__ import annotations

from .protocol import SamplingParams


class IncrementalDetokenizer:
    def __init__(self, tokenizer, params: SamplingParams, eos_token_ids: list[int]):
        self.tokenizer = tokenizer
        self.params = params
        self.eos = set() if params.ignore_eos else set(eos_token_ids)
        self.stop_ids = set(params.stop_token_ids)
        self.stops = [s for s in params.stop if s]
        self.max_stop = max((len(s) for s in self.stops), default=0)
        self.ids: list[int] = []  # output tokens that are decoded as text
        self.prefix_offset = 0
        self.read_offset = 0
        self.text = ""  # all output text decoded so far (cut at a stop string)
        self.emitted = 0  # len of self.text already handed out

    def _decode_new(self) -> str:
        if self.tokenizer is None:
            return ""
        dec = self.tokenizer.decode
        prefix = dec(self.ids[self.prefix_offset:self.read_offset], skip_special_tokens=True)
        full = dec(self.ids[self.prefix_offset:], skip_special_tokens=True)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            return full[len(prefix):]
        return ""

    def add_token(self, token: int, num_output_tokens: int) -> tuple[str, str | None]:
        """Feed one generated token; returns (text to emit now, finish_reason or None)."""
        if token in self.eos or token in self.stop_ids:
            return self.flush(), "stop"
        self.ids.append(token)
        new = self._decode_new()
        if new and self.stops:
            start = max(0, len(self.text) - self.max_stop + 1)
            self.text += new
            cut = min((i for i in (self.text.find(s, start) for s in self.stops) if i >= 0), default=-1)
            if cut >= 0:
                self.text = self.text[:cut]
                return self.flush(), "stop"
        else:
            self.text += new
        if num_output_tokens >= self.params.max_tokens:
            return self.flush(), "length"
        end = len(self.text) - self._held_back()
        delta = self.text[self.emitted:end] if end > self.emitted else ""
        self.emitted = max(self.emitted, end)
        return delta, None

    def _held_back(self) -> int:
        """Length of the longest text suffix that is a proper prefix of a stop string."""
        for n in range(min(self.max_stop - 1, len(self.text)), 0, -1):
            tail = self.text[-n:]
            if any(s.startswith(tail) for s in self.stops):
                return n
        return 0

    def flush(self) -> str:
        """Everything not handed out yet (the request ends here)."""
        delta = self.text[self.emitted:]
        self.emitted = len(self.text)
        return delta
