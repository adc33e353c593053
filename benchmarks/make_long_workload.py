"""A long, mixed workload: the shape of real batch work, for engine_throughput.py.

    python benchmarks/make_long_workload.py [--n 128] [--seed 1] [--min 20] [--max 2000] > long-mixed.jsonl

Each line is ``{"custom_id", "messages", "max_tokens"}`` (as ../shared/workloads/make_workload.py):
- one of four system prompts of ~150 tokens (the shared prefix the prefix cache can hit),
  each belonging to one of three task families (classify, extract, summarize);
- a user document whose length in SmolLM2 tokens is drawn log-uniform in [--min, --max]
  (cut to that count with the model's tokenizer, so the spread is in tokens, not words);
- max_tokens uniform in the family's range, 16-128 overall (classify 16-32, extract 32-96,
  summarize 64-128).
The text is sentences drawn from a small vocabulary: throughput depends on token counts and
prefix sharing, not on meaning.  Deterministic for a seed; try several seeds (the issue's
author measures on a held-out file of this shape).
"""

from __future__ import annotations

from carpool.engine.process import configure_process

configure_process()  # as the carpool command does: before anything imports torch (OMP_WAIT_POLICY)

import argparse
import json
import math
import random
import sys


def words(text: str) -> list[str]:
    return text.split()


NOUNS = words("battery screen delivery price quality service phone shoes fabric size color refund order invoice "
              "contract tenant landlord warranty shipment supplier meeting budget report engine server release "
              "customer manager account payment schedule policy patient doctor clinic school teacher student")
VERBS = words("broke works arrived failed improved increased dropped changed stopped started returned charged "
              "delayed replaced approved rejected signed cancelled reviewed shipped fixed updated")
ADJS = words("great terrible slow fast cheap expensive late early broken perfect confusing clear noisy quiet "
             "friendly rude small large heavy light new old reliable fragile")
LINKS = words("because although after before while and but so then however meanwhile")

SYSTEMS = {
    "classify": [
        "You are a strict classifier for customer feedback. Read the whole message the user sends and answer "
        "with exactly one label from this list: positive, negative, neutral, mixed. Positive means the writer "
        "is satisfied overall; negative means the writer reports a problem, a complaint or a wish to return "
        "the product; neutral means the message asks a question or states facts without an opinion; mixed "
        "means both praise and complaints of similar weight. Do not explain the label, do not repeat the "
        "message, do not add punctuation. If the message is empty or not feedback, answer neutral. Answer in "
        "lower case only. The label must be one of the four words above, spelled exactly as written, because "
        "a program reads your answer and rejects anything else.",
        "You are a routing assistant for a support desk. Decide which team must handle the ticket the user "
        "sends: billing (charges, refunds, invoices), shipping (delivery, tracking, damaged parcels), "
        "technical (the product does not work, setup, errors), account (login, password, personal data) or "
        "other. Answer with the team name and a priority from one to three, where one is urgent, in the form "
        "team/priority, nothing else. A ticket that mentions a safety risk is always priority one. A ticket "
        "that only thanks the team is other/3. When two teams could handle it, pick the team that can solve "
        "the first problem the writer mentions, since the other team will be told by the first.",
    ],
    "extract": [
        "You extract structured data from business documents. From the document the user sends, return one "
        "JSON object with the keys: parties (list of names), dates (list of ISO dates mentioned), amounts "
        "(list of numbers with currency), obligations (list of short phrases, each starting with a verb) and "
        "risks (list of short phrases). Use null for a key when the document says nothing about it. Do not "
        "invent values that are not written in the document, do not add keys, and do not wrap the JSON in "
        "markdown fences. Keep each phrase under twelve words and keep the order of appearance. Amounts keep "
        "the number as written, with the currency code after it, and dates that give no year keep the year of "
        "the document.",
    ],
    "summarize": [
        "You are an assistant that writes short, faithful summaries for busy managers. Summarize the text the "
        "user sends in three to five bullet points. Each bullet states one fact or decision from the text, in "
        "plain words, in the past tense, without opinions of your own. Start with the most important point. "
        "Mention numbers, dates and names exactly as written. If the text contains a request or a deadline, "
        "the last bullet says who must do what by when. Do not add an introduction or a conclusion, and do "
        "not mention that you are summarizing. Write in English even when the text mixes languages. Keep "
        "every bullet under twenty words and never quote more than five words of the text in a row.",
    ],
}
OUTPUT_RANGE = {"classify": (16, 32), "extract": (32, 96), "summarize": (64, 128)}


def sentence(rng: random.Random) -> str:
    parts = [f"the {rng.choice(ADJS)} {rng.choice(NOUNS)} {rng.choice(VERBS)}"]
    for _ in range(rng.randint(0, 2)):
        parts.append(f"{rng.choice(LINKS)} the {rng.choice(NOUNS)} {rng.choice(VERBS)} {rng.choice(ADJS)}")
    s = " ".join(parts)
    if rng.random() < 0.3:
        s += f" on {rng.randint(1, 28)} March for {rng.randint(5, 9000)} euros"
    return s[0].upper() + s[1:] + "."


def document(rng: random.Random, tokenizer, n_tokens: int) -> str:
    """Sentences until the text holds at least ``n_tokens`` tokens, then cut to exactly that many."""
    text = ""
    while len(tokenizer.encode(text, add_special_tokens=False)) < n_tokens:
        text += (" " if text else "") + " ".join(sentence(rng) for _ in range(max(1, n_tokens // 40)))
    ids = tokenizer.encode(text, add_special_tokens=False)[:n_tokens]
    return tokenizer.decode(ids)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=128)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--min", type=int, default=20, help="shortest user document, in tokens")
    ap.add_argument("--max", type=int, default=2000, help="longest user document, in tokens")
    ap.add_argument("--name", default="long-mixed")
    args = ap.parse_args()

    from carpool.engine.loader import smollm2_tokenizer

    tok = smollm2_tokenizer()
    rng = random.Random(args.seed)
    systems = [(family, text) for family, texts in SYSTEMS.items() for text in texts]
    lo, hi = math.log(args.min), math.log(args.max)
    for i in range(args.n):
        family, system = rng.choice(systems)
        n_tokens = round(math.exp(rng.uniform(lo, hi)))
        out_lo, out_hi = OUTPUT_RANGE[family]
        print(json.dumps({
            "custom_id": f"{args.name}-{i}",
            "messages": [{"role": "system", "content": system},
                         {"role": "user", "content": document(rng, tok, n_tokens)}],
            "max_tokens": rng.randint(out_lo, out_hi),
        }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
