"""Classification with a confidence: the label's probability, read from the answer's logprobs.

Each task constrains the answer to one of the labels (``response_format`` with an ``enum``
schema, so every answer is a valid label) and asks for ``logprobs`` + ``top_logprobs``.  At
the token where the label starts, the probabilities of the alternatives say how sure the
model was between the labels, so low-confidence rows can go to a person or a larger model
instead of being trusted blindly.

    python examples/classify_confidence.py tasks examples/product-reviews.csv > classify-tasks.jsonl
    carpool run classify-tasks.jsonl -o classified.jsonl          # add --endpoint URL --model NAME for a server
    python examples/classify_confidence.py report classified.jsonl --threshold 0.7

``tasks`` writes one chat task per CSV row (``examples/classify-confidence.jsonl`` is its
output for ``examples/product-reviews.csv``).  ``report`` writes one JSON line per row:
``answer`` (the label the model wrote), ``label`` (the most probable label at that token,
summed over the ways to spell it: "neg" and "negative" both count for negative, so it can
differ from a greedy answer that was close), ``confidence`` (its share of the probability given to the
labels), ``label_mass`` (how much of the model's distribution went to any label: the
logprobs are the model's own, before the schema masked the other tokens) and ``review``
(true below ``--threshold``).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import sys

LABELS = ("positive", "negative", "neutral")
SYSTEM = "Classify the sentiment of the customer review as positive, negative or neutral. Reply in JSON."
SCHEMA = {"type": "object", "properties": {"sentiment": {"type": "string", "enum": list(LABELS)}},
          "required": ["sentiment"], "additionalProperties": False}


def task_of(row_id: str, review: str) -> dict:
    return {
        "custom_id": row_id,
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": review}],
        "response_format": {"type": "json_schema",
                            "json_schema": {"name": "sentiment", "schema": SCHEMA, "strict": True}},
        "temperature": 0,
        "max_tokens": 16,
        "logprobs": True,
        "top_logprobs": 10,
    }


def label_of(token: str) -> str | None:
    """The label a token starts, when exactly one label starts with it ("neg" -> negative; "ne" -> None)."""
    t = token.strip().strip('"').lower()
    if not t:
        return None
    matches = [label for label in LABELS if label.startswith(t)]
    return matches[0] if len(matches) == 1 else None


def label_position(tokens: list[dict]) -> int | None:
    """Index of the answer token where the label starts (the JSON before it names no label)."""
    for i, t in enumerate(tokens):
        if label_of(t["token"]) is not None:
            return i
    return None


def confidence(top_logprobs: list[dict]) -> dict:
    """{label, confidence, label_mass, probabilities} from the alternatives at the label's token."""
    mass = dict.fromkeys(LABELS, 0.0)
    for alt in top_logprobs:
        label = label_of(alt["token"])
        if label is not None:
            mass[label] += math.exp(alt["logprob"])
    total = sum(mass.values())
    if total == 0.0:
        return {"label": None, "confidence": 0.0, "label_mass": 0.0, "probabilities": mass}
    best = max(mass, key=lambda k: mass[k])
    return {"label": best, "confidence": mass[best] / total, "label_mass": total,
            "probabilities": {k: v / total for k, v in mass.items()}}


def write_tasks(csv_path: str, out) -> int:
    with open(csv_path, newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    for row in rows:
        out.write(json.dumps(task_of(row["id"], row["review"]), ensure_ascii=False) + "\n")
    return len(rows)


def report(results_path: str, threshold: float, out) -> tuple[int, int]:
    """(rows reported, rows without logprobs); one JSON line per row to ``out``."""
    done = missing = 0
    with open(results_path, encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            body = (row.get("response") or {}).get("body") or {}
            choices = body.get("choices") or []
            content = ((choices[0].get("logprobs") or {}).get("content") or []) if choices else []
            if not content:
                missing += 1
                print(f"{row['custom_id']}: no logprobs in the answer ({row.get('error')})", file=sys.stderr)
                continue
            at = label_position(content)
            if at is None:
                missing += 1
                answer = choices[0]["message"]["content"]
                print(f"{row['custom_id']}: no label in the answer {answer!r}", file=sys.stderr)
                continue
            result = confidence(content[at]["top_logprobs"])
            result["review"] = result["confidence"] < threshold
            answer = json.loads(choices[0]["message"]["content"])["sentiment"]
            out.write(json.dumps({"id": row["custom_id"], "answer": answer, **result}) + "\n")
            done += 1
    return done, missing


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="step", required=True)
    t = sub.add_parser("tasks", help="CSV (id, review) -> carpool tasks on stdout")
    t.add_argument("csv")
    r = sub.add_parser("report", help="carpool results -> label, confidence and review flag per row")
    r.add_argument("results")
    r.add_argument("--threshold", type=float, default=0.7, help="confidence below this is flagged for review")
    a = p.parse_args(argv)
    if a.step == "tasks":
        write_tasks(a.csv, sys.stdout)
        return 0
    done, missing = report(a.results, a.threshold, sys.stdout)
    return 0 if done and not missing else 1


if __name__ == "__main__":
    sys.exit(main())
