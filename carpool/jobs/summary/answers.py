"""What the answers of a job say, counted as their lines are written: ``AnswerTally``.

Throughput and latency tell how a job ran; these tell whether its answers are of use:

- why each answer stopped (``finish_reason``): ``length`` means it was cut at
  ``max_tokens``, which a classification prompt to a small model hits on every row and no
  other figure shows;
- the distinct short answers and how often each came back, for classification-like jobs:
  ``positive 812, negative 97, Positive. 3`` shows labels the prompt did not ask for;
- how many structured answers (``response_format``) failed their schema, with the first
  few reasons.

Memory stays bounded whatever the job's size: at most ``MAX_LABELS`` distinct answers are
kept (the rest are counted together) and ``MAX_EXAMPLES`` parse errors.  Embeddings have
no text answer and are not counted.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from carpool.jobs.output.structured import answer_text

LABEL_CHARS = 40  # an answer this short, on one line, may be a label
MAX_LABELS = 1000  # distinct short answers kept; the others count as "other"
MAX_EXAMPLES = 20  # parse errors kept with their custom_id
# Answers read as labels when most of them are short and few are distinct.
LABEL_SHARE = 0.8
MAX_LABELS_SHOWN = 30


@dataclass
class AnswerTally:
    answers: int = 0  # chat and completion answers written this run (cache answers included)
    finish_reasons: Counter = field(default_factory=Counter)
    labels: Counter = field(default_factory=Counter)  # short one-line answers, as written (stripped)
    other_labels: int = 0  # short answers past MAX_LABELS distinct ones
    long_answers: int = 0  # longer than LABEL_CHARS, or on several lines
    structured: int = 0  # answers checked against a schema
    parse_errors: int = 0
    parse_error_examples: list[tuple[str, str]] = field(default_factory=list)  # (custom_id, why)

    def add(self, custom_id: str, body: dict | None, structured: dict | None = None) -> None:
        """One success line: its response ``body`` and what the schema check made of it."""
        choices = body.get("choices") if isinstance(body, dict) else None
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            return  # an embedding, or a body without an answer to read
        self.answers += 1
        reason = choices[0].get("finish_reason")
        self.finish_reasons[reason if isinstance(reason, str) else "none"] += 1
        text = (answer_text(body) or "").strip()
        if len(text) > LABEL_CHARS or "\n" in text:
            self.long_answers += 1
        elif text in self.labels or len(self.labels) < MAX_LABELS:
            self.labels[text] += 1
        else:
            self.other_labels += 1
        if structured is not None:
            self.structured += 1
            if "parse_error" in structured:
                self.parse_errors += 1
                if len(self.parse_error_examples) < MAX_EXAMPLES:
                    self.parse_error_examples.append((custom_id, str(structured["parse_error"])))

    @property
    def cut(self) -> int:
        """Answers that stopped at ``max_tokens``."""
        return self.finish_reasons.get("length", 0)

    def label_like(self) -> bool:
        """Whether the answers read as labels: most are short, and few are distinct."""
        short = self.answers - self.long_answers
        return bool(self.answers) and short >= LABEL_SHARE * self.answers and \
            len(self.labels) <= MAX_LABELS_SHOWN and not self.other_labels

    def cut_text(self) -> str | None:
        """``16 of 16 (finish_reason 'length'): raise max_tokens`` when any answer was cut."""
        if not self.cut:
            return None
        return f"{self.cut:,} of {self.answers:,} (finish_reason 'length'): raise max_tokens for whole answers"

    def parse_error_text(self) -> str | None:
        if not self.parse_errors:
            return None
        return f"{self.parse_errors:,} of {self.structured:,} (each line's parse_error says why)"

    def to_dict(self) -> dict:
        return {"answers": self.answers, "finish_reasons": dict(self.finish_reasons), "cut_at_max_tokens": self.cut,
                "labels": dict(self.labels.most_common(MAX_LABELS_SHOWN)) if self.label_like() else None,
                "structured": self.structured, "parse_errors": self.parse_errors}
