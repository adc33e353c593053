"""Throughput cost of grammar-constrained decoding: 512 extraction tasks through ``LLM.generate``.

    python benchmarks/constrained_decoding.py [--tasks 512] [--runs 3] [--json-out FILE]

Each run, each mode on a fresh engine (SmolLM2-135M, packaged, bf16, greedy; the same warm-up,
so the same prefix cache at the start), in an order that rotates from run to run:

1. ``constrained``: every task with ``structured_outputs=StructuredOutputs(json=SCHEMA)``
   (response_format json_schema), ending when the JSON is complete.
2. ``matched``: the same prompts unconstrained, each forced (ignore_eos) to exactly the
   number of tokens its constrained answer had: the same prompts, the same output lengths,
   so the same schedule; the time difference is the grammar's cost (masks, their application,
   feeding tokens back, one compile).  Bar: constrained within 15% of this throughput.
3. ``free``: the same prompts unconstrained, stopping where the model stops (what a user
   gets without response_format; its outputs are not JSON-valid, and their length differs).

Reports, per run: wall time, tasks/s, output and total tok/s of each, the ratios
constrained/matched and constrained/free, and the constrained outputs' schema-valid count.
Prints one JSON object (last stdout line).  Run it under ``cpu bench``; compare ratios of one run.
"""

from __future__ import annotations

from carpool.engine.process import configure_process

configure_process()  # as the carpool command does: before anything imports torch (OMP_WAIT_POLICY)

import argparse
import json
import random
import sys
import time

from carpool.engine import LLM, EngineConfig, GenerateRequest, SamplingParams
from carpool.engine.protocol import StructuredOutputs

SCHEMA = {
    "type": "object",
    "properties": {
        "product": {"type": "string", "maxLength": 40},
        "sentiment": {"enum": ["positive", "negative", "neutral"]},
        "rating": {"type": "integer", "minimum": 1, "maximum": 5},
        "price": {"type": ["number", "null"], "minimum": 0, "maximum": 100000},
        "issues": {"type": "array", "items": {"type": "string", "maxLength": 30}, "maxItems": 3},
    },
    "required": ["product", "sentiment", "rating", "price", "issues"],
    "additionalProperties": False,
}

PRODUCTS = ["Acme X200 blender", "Zen Pro headphones", "Foo desk lamp", "Orbit robot vacuum", "Nova 5 phone",
            "Trail 40L backpack", "Brewmaster kettle", "Pixel frame", "Volt e-bike", "Cloud pillow"]
GOOD = ["works great", "arrived fast", "the sound is rich", "battery lasts for days", "easy to set up",
        "looks beautiful", "support was helpful", "worth every penny"]
BAD = ["broke after a week", "the battery died", "too loud", "arrived scratched", "the app keeps crashing",
       "customer service ignored me", "smells of plastic", "stopped charging"]


def make_tasks(n: int, seed: int = 0) -> list[list[dict]]:
    """n review-extraction chats of mixed length (~80-400 prompt tokens), fixed for a seed."""
    rng = random.Random(seed)
    system = ("Extract from the customer review: the product, the sentiment, a rating from 1 to 5, the price "
              "paid (null if not given) and up to three issues. Answer with JSON matching this schema: "
              + json.dumps(SCHEMA))
    tasks = []
    for i in range(n):
        product = rng.choice(PRODUCTS)
        lines = [f"Review #{i}: I bought the {product}"
                 + (f" for ${rng.randint(9, 900)}." if rng.random() < 0.7 else ".")]
        for _ in range(rng.choice([1, 2, 4, 8, 16])):
            lines.append(rng.choice(GOOD + BAD).capitalize() + ".")
        tasks.append([{"role": "system", "content": system}, {"role": "user", "content": " ".join(lines)}])
    return tasks


def timed(llm: LLM, reqs: list[GenerateRequest]) -> tuple[list, dict]:
    start = time.perf_counter()
    outs = llm.generate(reqs)
    wall = time.perf_counter() - start
    p = sum(len(o.prompt_token_ids) for o in outs)
    g = sum(len(o.token_ids) for o in outs)
    return outs, {"wall_s": round(wall, 2), "tasks_s": round(len(outs) / wall, 2), "prompt_tokens": p,
                  "output_tokens": g, "output_tok_s": round(g / wall, 1), "total_tok_s": round((p + g) / wall, 1)}


def valid(text: str) -> bool:
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), SCHEMA)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def fresh_llm(loaded, args, tasks: list[list[dict]]) -> LLM:
    """A new engine per measurement: each starts with the same (warm-up only) prefix cache, so no
    mode profits from the prompts an earlier one left cached."""
    llm = LLM(EngineConfig(model="smollm2", dtype=args.dtype, max_num_seqs=args.max_num_seqs,
                           max_num_batched_tokens=args.max_num_batched_tokens, kv_cache_memory_gb=2.0),
              loaded=loaded)
    so = StructuredOutputs(json=SCHEMA)
    # Both paths warm (kernels, the tokenizer wrap, the grammar compile), outside the timings.
    llm.generate([GenerateRequest(request_id=f"warm{i}", messages=tasks[i], params=SamplingParams(
        temperature=0, max_tokens=16, structured_outputs=so if i % 2 else None)) for i in range(4)])
    return llm


def measure(mode: str, loaded, args, tasks: list[list[dict]], lengths: list[int] | None, run: int):
    llm = fresh_llm(loaded, args, tasks)

    def req(i, **params):
        return GenerateRequest(request_id=f"{run}-{mode}-{i}", messages=tasks[i],
                               params=SamplingParams(temperature=0, **params))

    if mode == "constrained":
        so = StructuredOutputs(json=SCHEMA)
        reqs = [req(i, max_tokens=args.max_tokens, structured_outputs=so) for i in range(len(tasks))]
    elif mode == "matched":
        reqs = [req(i, max_tokens=lengths[i], ignore_eos=True) for i in range(len(tasks))]
    else:
        reqs = [req(i, max_tokens=args.max_tokens) for i in range(len(tasks))]
    outs, stats = timed(llm, reqs)
    if mode != "matched":
        stats["schema_valid"] = sum(valid(o.text) for o in outs)
        stats["finished_stop"] = sum(o.finish_reason == "stop" for o in outs)
    return outs, stats


def one_run(loaded, args, tasks: list[list[dict]], lengths: list[int] | None, run: int):
    """The three modes, in an order that rotates from run to run (the machine drifts)."""
    order = ["constrained", "matched", "free"]  # the first run: matched needs constrained's lengths
    if lengths is not None:
        order = order[run % 3:] + order[:run % 3]
    res: dict = {"run": run, "order": order}
    for mode in order:
        outs, res[mode] = measure(mode, loaded, args, tasks, lengths, run)
        if mode == "constrained" and lengths is None:
            lengths = [len(o.token_ids) for o in outs]
    c, m, f = res["constrained"], res["matched"], res["free"]
    res["constrained_over_matched_tok_s"] = round(c["output_tok_s"] / m["output_tok_s"], 3)
    res["constrained_over_matched_total_tok_s"] = round(c["total_tok_s"] / m["total_tok_s"], 3)
    res["constrained_over_free_tasks_s"] = round(c["tasks_s"] / f["tasks_s"], 3)
    return res, lengths


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tasks", type=int, default=512)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--json-out", help="also write the result here")
    args = ap.parse_args()
    from carpool.engine.loader import load_model

    loaded = load_model("smollm2", dtype=args.dtype)
    tasks = make_tasks(args.tasks)
    runs = []
    lengths = None
    for r in range(args.runs):
        res, lengths = one_run(loaded, args, tasks, lengths, r)
        runs.append(res)
        print(json.dumps(res), file=sys.stderr)  # progress; the result is the last stdout line
    ratios = [r["constrained_over_matched_tok_s"] for r in runs]
    result = {
        "benchmark": "constrained_decoding", "tasks": args.tasks, "model": "smollm2", "dtype": args.dtype,
        "grammar_backend": "llguidance", "runs": runs,
        "constrained_over_matched_tok_s": ratios,
        "bar": "constrained >= 0.85 x matched unconstrained throughput",
        "meets_bar": all(x >= 0.85 for x in ratios),
    }
    line = json.dumps(result)
    if args.json_out:
        with open(args.json_out, "w") as f:
            f.write(line + "\n")
    print(line)


if __name__ == "__main__":
    main()
