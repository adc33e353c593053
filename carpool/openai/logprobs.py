"""Engine logprobs -> OpenAI's two ``logprobs`` shapes (chat and legacy completions).

The engine gives, per generated token, a ``TokenLogprob`` (token id, text, bytes, logprob and
the k most likely alternatives, most likely first).  OpenAI writes them as:

* chat: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob",
  "bytes"}, ...k]}], "refusal": null}``;
* completions: ``{"tokens": [...], "token_logprobs": [...], "top_logprobs": [{token: logprob}],
  "text_offset": [...]}`` where a position's dict holds the k alternatives and the sampled
  token (so up to k+1 entries, as OpenAI's legacy API and vLLM send it) and ``text_offset``
  is the character offset of each token in the choice's text (a running sum of the token
  texts' lengths, so a stream's pieces concatenate to the whole body's lists).

A logprob of -inf (a token the model gives no chance) is written as -9999.0, as vLLM does:
JSON has no infinity.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from carpool.engine.protocol import TokenLogprob


def _finite(value: float) -> float:
    return -9999.0 if math.isinf(value) or math.isnan(value) else float(value)


def chat_content(entries: Sequence[TokenLogprob]) -> list[dict[str, Any]]:
    """The ``logprobs.content`` items of these tokens."""
    return [
        {"token": e.token, "logprob": _finite(e.logprob), "bytes": list(e.bytes),
         "top_logprobs": [{"token": t.token, "logprob": _finite(t.logprob), "bytes": list(t.bytes)}
                          for t in e.top_logprobs]}
        for e in entries
    ]


def chat_logprobs(entries: Sequence[TokenLogprob]) -> dict[str, Any]:
    return {"content": chat_content(entries), "refusal": None}


class CompletionLogprobs:
    """Builds the legacy ``logprobs`` object of one choice, piece by piece (the offsets run on)."""

    def __init__(self, start_offset: int = 0) -> None:
        self.offset = start_offset

    def piece(self, entries: Sequence[TokenLogprob]) -> dict[str, list]:
        tokens, token_logprobs, top, offsets = [], [], [], []
        for e in entries:
            tokens.append(e.token)
            token_logprobs.append(_finite(e.logprob))
            alternatives = {t.token: _finite(t.logprob) for t in e.top_logprobs}
            alternatives.setdefault(e.token, _finite(e.logprob))
            top.append(alternatives)
            offsets.append(self.offset)
            self.offset += len(e.token)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}
