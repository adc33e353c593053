"""Structured extraction: every review becomes a JSON object that follows a schema.

The schema is a Pydantic model; each task asks for ``response_format`` ``json_schema``, so
the engine constrains its decoding to the schema (every answer parses and validates, even
from a 135M model).  Three steps, each a command you can run on its own:

    python examples/extract_reviews.py tasks examples/product-reviews.csv > extract-tasks.jsonl
    carpool run extract-tasks.jsonl -o extracted.jsonl            # add --endpoint URL --model NAME for a server
    python examples/extract_reviews.py check extracted.jsonl -o reviews.jsonl

``tasks`` writes one chat task per CSV row (``examples/extract-reviews.jsonl`` is its output
for ``examples/product-reviews.csv``); ``check`` validates every answer against the model,
writes the objects (one JSON line per review, with its id) and prints the valid rate; it
exits 1 if any answer is missing or invalid.  Needs pydantic (the openai SDK brings it).
To extract other fields, change ``Review`` below: the schema sent follows it.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError


class Review(BaseModel):
    """What to pull out of one product review."""

    model_config = ConfigDict(extra="forbid")  # additionalProperties: false, as OpenAI's strict mode requires
    product: str = Field(max_length=40, description="the product reviewed, in a few words")
    sentiment: Literal["positive", "negative", "mixed", "neutral"]
    stars: int = Field(ge=1, le=5, description="the star rating the reviewer would give")
    issues: list[Literal["quality", "delivery", "size", "price", "support", "other"]] = Field(
        max_length=3, description="what went wrong, if anything")
    would_recommend: bool


SYSTEM = ("Extract facts from the customer review. Reply with JSON only, following the schema: "
          + json.dumps(Review.model_json_schema()))


def task_of(row_id: str, review: str) -> dict:
    return {
        "custom_id": row_id,
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": review}],
        "response_format": {"type": "json_schema",
                            "json_schema": {"name": "review", "schema": Review.model_json_schema(), "strict": True}},
        "temperature": 0,
        "max_tokens": 200,
    }


def write_tasks(csv_path: str, out) -> int:
    with open(csv_path, newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    for row in rows:
        out.write(json.dumps(task_of(row["id"], row["review"]), ensure_ascii=False) + "\n")
    return len(rows)


def check(results_path: str, out) -> tuple[int, int]:
    """(valid, total) over the result lines; writes each valid object with its id."""
    valid = total = 0
    with open(results_path, encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            total += 1
            body = (row.get("response") or {}).get("body") or {}
            if row.get("error") or not body.get("choices"):
                print(f"{row['custom_id']}: no answer: {row.get('error')}", file=sys.stderr)
                continue
            content = body["choices"][0]["message"]["content"]
            try:
                review = Review.model_validate_json(content)
            except ValidationError as e:
                print(f"{row['custom_id']}: invalid: {e.errors()[0]['msg']} in {content[:80]!r}", file=sys.stderr)
                continue
            valid += 1
            out.write(json.dumps({"id": row["custom_id"], **review.model_dump()}, ensure_ascii=False) + "\n")
    return valid, total


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="step", required=True)
    t = sub.add_parser("tasks", help="CSV (id, review) -> carpool tasks on stdout")
    t.add_argument("csv")
    c = sub.add_parser("check", help="carpool results -> validated objects, valid rate")
    c.add_argument("results")
    c.add_argument("-o", "--output", default="-", help="where the objects go (default stdout)")
    a = p.parse_args(argv)
    if a.step == "tasks":
        write_tasks(a.csv, sys.stdout)
        return 0
    out = sys.stdout if a.output == "-" else open(a.output, "w", encoding="utf-8")  # noqa: SIM115
    try:
        valid, total = check(a.results, out)
    finally:
        if out is not sys.stdout:
            out.close()
    print(json.dumps({"valid": valid, "total": total, "valid_rate": valid / total if total else 0.0}),
          file=sys.stderr)
    return 0 if total and valid == total else 1


if __name__ == "__main__":
    sys.exit(main())
