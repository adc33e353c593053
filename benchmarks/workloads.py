"""Workload files of the shapes the concurrency benchmarks measure on, from a seed.

Two shapes (every line a ``carpool run`` task: custom_id, messages, max_tokens, temperature 0):

- ``short``: summarise tasks, a prompt of 20-300 words (uniform), 24 output tokens: the
  shape of a user's first report.
- ``long``: long mixed prompts of 20-2000 tokens, log-uniform (most are short, most of the
  tokens are in the long ones), half of them behind one of four shared system prompts
  (so a prefix cache matters), 16-128 output tokens (uniform).

Lengths are counted in words of a vocabulary whose words are one token each in
SmolLM2/Llama-style BPE vocabularies (plus the chat template's few tokens), so no
tokenizer is needed.  ``ignore_eos`` makes every request produce its ``max_tokens``, so
each run of one file does the same work whatever the server answers.  A different
``--seed`` gives a held-out file of the same shape.

    python benchmarks/workloads.py short 300 --seed 1 > short.jsonl
    python benchmarks/workloads.py long 120 --seed 1 > long.jsonl
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys

_WORD_TEXT = (
    "the of and to in is was for on are with as at be by this had not but from or have an they which one you "
    "were her all she there would their we him been has when who will more no if out so said what up its about "
    "into than them can only other new some could time these two may then do first any my now such like our over "
    "man me even most made after also did many before must through back years where much your way well down "
    "should because each just those people how too little state good very make world still own see men work long "
    "get here between both life being under never day same another know while last might us great old year off "
    "come since against go came right used take three"
)
_WORDS = _WORD_TEXT.split()

_SYSTEMS = [
    "You are a careful analyst. Read the document and answer the question that follows it in a few words.",
    "You are a support agent for an online shop. Be polite and brief, and never promise a refund.",
    "You summarise meeting notes for busy managers: decisions first, then owners, then open questions.",
    "You extract facts from text. Reply with the facts only, one per line, without any commentary.",
]


def _text(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(max(1, n)))


def _system(rng: random.Random, k: int) -> str:
    # Each shared system prompt is padded to a fixed length with its own fixed filler, so
    # it is the same text on every line that uses it.
    filler = random.Random(1000 + k)
    return _SYSTEMS[k] + " Context: " + " ".join(filler.choice(_WORDS) for _ in range(60 + 80 * k))


def short_tasks(n: int, seed: int, max_tokens: int = 24, ignore_eos: bool = True) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        body = _text(rng, rng.randint(20, 300))
        out.append({"custom_id": f"short-{seed}-{i}", "temperature": 0, "max_tokens": max_tokens,
                    "messages": [{"role": "user", "content": f"Summarise in one sentence: {body}"}]})
        if ignore_eos:
            out[-1]["ignore_eos"] = True
    return out


def long_tasks(n: int, seed: int, lo: int = 20, hi: int = 2000, out_lo: int = 16, out_hi: int = 128,
               ignore_eos: bool = True) -> list[dict]:
    rng = random.Random(seed)
    systems = [_system(rng, k) for k in range(len(_SYSTEMS))]
    out = []
    for i in range(n):
        target = int(math.exp(rng.uniform(math.log(lo), math.log(hi))))
        messages = []
        k = rng.randrange(2 * len(systems))
        if k < len(systems) and len(systems[k].split()) + 10 <= target:
            messages.append({"role": "system", "content": systems[k]})
            target -= len(systems[k].split())
        messages.append({"role": "user", "content": _text(rng, target - 8) + " Question: what is it about?"})
        task = {"custom_id": f"long-{seed}-{i}", "temperature": 0, "max_tokens": rng.randint(out_lo, out_hi),
                "messages": messages}
        if ignore_eos:
            task["ignore_eos"] = True
        out.append(task)
    return out


SHAPES = {"short": short_tasks, "long": long_tasks}


def write(path: str, tasks: list[dict]) -> None:
    with open(path, "w") as f:
        f.writelines(json.dumps(t) + "\n" for t in tasks)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("shape", choices=sorted(SHAPES))
    ap.add_argument("n", type=int)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-ignore-eos", action="store_true", help="let the model stop at EOS")
    a = ap.parse_args()
    for t in SHAPES[a.shape](a.n, a.seed, ignore_eos=not a.no_ignore_eos):
        sys.stdout.write(json.dumps(t) + "\n")


if __name__ == "__main__":
    main()
