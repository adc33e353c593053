"""``carpool run --semantic-audit N``: re-ask N random semantic hits for real, count disagreements.

A semantic hit serves another task's stored answer.  The verification stage keeps that
from happening across different questions, but a user who saves money with the semantic
cache should be able to check it on their own data: the runner offers every semantic hit
here, a uniform sample of N is kept (reservoir sampling, so memory stays N however many
hits there are), and after the job those N are sent to the backend again, bypassing both
caches.  The report says how many fresh answers differ from the borrowed ones.

Answers are compared on their text with whitespace collapsed, case folded and trailing
punctuation dropped ("Positive." = "positive"): a label task's answer, not its formatting.
The output file is not changed by the audit.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from carpool.client.base import Request
from carpool.errors import StartRefused

_SHOWN = 20  # disagreements listed in the report


def answer_text(body: dict | None) -> str:
    """The answer of a chat/completion body: the first choice's text (tool calls as written)."""
    if not isinstance(body, dict):
        return ""
    choices = body.get("choices") or [{}]
    first = choices[0] if isinstance(choices[0], dict) else {}
    message = first.get("message") or {}
    text = message.get("content") if isinstance(message, dict) else None
    if text is None:
        text = first.get("text")
    if text is None and isinstance(message, dict) and message.get("tool_calls"):
        text = str(message["tool_calls"])
    return text if isinstance(text, str) else ""


def same_answer(borrowed: dict | None, fresh: dict | None) -> bool:
    def canon(body):
        return " ".join(answer_text(body).split()).rstrip(".!").casefold()

    return canon(borrowed) == canon(fresh)


@dataclass
class AuditItem:
    custom_id: str
    request: Request  # the task's request, sent again as it was
    borrowed: dict  # the body the semantic cache served
    similarity: float
    matched_id: int


class SemanticAudit:
    """A uniform sample of ``n`` semantic hits of one run, and what re-asking them found."""

    def __init__(self, n: int, seed: int | None = None) -> None:
        if n < 0:
            raise StartRefused(f"--semantic-audit {n}: the number of hits to re-ask must be >= 0")
        self.n = n
        self.seen = 0
        self.sample: list[AuditItem] = []
        self._rng = random.Random(seed)
        self.asked = self.agreed = self.failed = 0
        self.disagreements: list[dict] = []

    def offer(self, item: AuditItem) -> None:
        self.seen += 1
        if len(self.sample) < self.n:
            self.sample.append(item)
        else:
            j = self._rng.randrange(self.seen)
            if j < self.n:
                self.sample[j] = item

    def record(self, item: AuditItem, fresh: dict | None, error: str | None = None) -> None:
        """The fresh answer of one sampled hit (or why the backend gave none)."""
        self.asked += 1
        if error is not None or fresh is None:
            self.failed += 1
            return
        if same_answer(item.borrowed, fresh):
            self.agreed += 1
            return
        if len(self.disagreements) < _SHOWN:
            self.disagreements.append({"custom_id": item.custom_id, "similarity": round(item.similarity, 4),
                                       "matched_id": item.matched_id, "borrowed": answer_text(item.borrowed),
                                       "fresh": answer_text(fresh)})

    @property
    def disagreed(self) -> int:
        return self.asked - self.agreed - self.failed

    def report(self) -> dict:
        return {"requested": self.n, "semantic_hits": self.seen, "asked": self.asked, "agreed": self.agreed,
                "disagreed": self.disagreed, "failed": self.failed,
                "disagreement_rate": round(self.disagreed / (self.asked - self.failed), 4)
                if self.asked > self.failed else None,
                "disagreements": self.disagreements}
