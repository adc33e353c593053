"""int8 weights vs bf16 in one run: decode throughput, greedy agreement, perplexity.

    python benchmarks/quantization.py [--requests 64] [--max-tokens 256] [--rounds 3] [--agreement-prompts 256]
        [--kv-int8] [--float-head] [--fp32-reference] [--skip throughput|agreement|perplexity]

- throughput: a decode-heavy workload (the first --requests prompts of --workload, cycled;
  reviews-128 by default, ~200-token prompts; classify-512's are ~75;
  --max-tokens output tokens each, EOS ignored, greedy, max_num_seqs 64), run on a bf16 engine
  and on an int8 one built from the same loaded weights, alternately for --rounds rounds (bf16,
  int8, bf16, int8, ...: a slow minute of a shared machine falls on both engines, not on whichever
  ran in it); output tok/s of each round, each round's ratio and their median.
- agreement: --agreement-prompts prompts (reviews-128 then classify-512), greedy, up to
  --agreement-tokens tokens (EOS stops): the fraction whose int8 output equals the bf16 one token
  for token, and the mean fraction of matching leading tokens (common prefix / longer output).
- perplexity: of a fixed text (Python's own reference text for a few statements, from the
  stdlib's pydoc_data, first --ppl-tokens tokens) under each engine, teacher-forced in one pass.
- --kv-int8: two more engines with an int8 KV cache (kv_cache_dtype="int8"), one with model-dtype
  weights and one with int8 weights;
- --float-head: a third engine, int8 with the lm_head left in the model dtype (the default
  quantizes it, with its top candidates rescored in the model dtype: quant.QUANTIZE_LM_HEAD);
  --fp32-reference: fp32 vs bf16 greedy agreement, the disagreement two float precisions already have.

Prints one JSON object.  The machine may be shared: compare the two engines of one run.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

from carpool.engine import configure_process

configure_process()  # before torch loads OpenMP

import torch

from carpool.engine import LLM, EngineConfig, GenerateRequest, SamplingParams, quant
from carpool.engine.cpu import describe as cpu
from carpool.engine.sequence import Sequence

REPO = Path(__file__).resolve().parents[1]
SHARED = next((p / "shared" for p in REPO.parents[:2] if (p / "shared").is_dir()), REPO.parent / "shared")
PPL_TOPICS = ("if", "while", "for", "try", "with", "assert", "import", "lambda", "class", "function")


def read_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def requests(rows: list[dict], tag: str, max_tokens: int, ignore_eos: bool) -> list[GenerateRequest]:
    return [GenerateRequest(request_id=f"{tag}{i}", messages=r["messages"],
                            params=SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=ignore_eos))
            for i, r in enumerate(rows)]


def throughput(llm: LLM, rows: list[dict], max_tokens: int, tag: str) -> dict:
    llm.reset_prefix_cache()  # every round computes its prompts (a later round would find them cached)
    llm.generate(requests(rows[:4], f"warm{tag}", 8, True))
    start = time.perf_counter()
    outs = llm.generate(requests(rows, tag, max_tokens, True))
    wall = time.perf_counter() - start
    g = sum(len(o.token_ids) for o in outs)
    return {"requests": len(rows), "output_tokens": g, "wall_s": round(wall, 3), "output_tok_s": round(g / wall, 1)}


def greedy(llm: LLM, rows: list[dict], max_tokens: int, tag: str) -> list[list[int]]:
    return [list(o.token_ids) for o in llm.generate(requests(rows, tag, max_tokens, False))]


def ppl_text() -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[t] for t in PPL_TOPICS if t in topics)


@torch.inference_mode()
def perplexity(llm: LLM, ids: list[int]) -> float:
    """exp(mean NLL of ids[1:]) with one teacher-forced prefill over blocks taken from the engine."""
    eng = llm.engine
    seq = Sequence("ppl", ids, SamplingParams(temperature=0, max_tokens=1), eng.block_size)
    nblocks = -(-len(ids) // eng.block_size)
    seq.block_table = list(range(nblocks))  # the engine is idle: nothing else holds these blocks
    input_ids, positions, meta, _ = eng.runner.prepare([(seq, len(ids))])
    meta.logits_index = torch.arange(len(ids))
    logits = eng.model.forward(input_ids, positions, meta, eng.runner.kv_caches).float()
    nll = torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(ids[1:]))
    return math.exp(float(nll))


def agreement(ref: list[list[int]], got: list[list[int]]) -> dict:
    same = sum(a == b for a, b in zip(ref, got, strict=True))
    fractions = []
    for a, b in zip(ref, got, strict=True):
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        fractions.append(n / max(1, len(a), len(b)))
    return {"prompts": len(ref), "identical_fraction": round(same / len(ref), 4),
            "mean_prefix_match_fraction": round(sum(fractions) / len(fractions), 4)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads-dir", type=Path, default=SHARED / "workloads")
    ap.add_argument("--workload", default="reviews-128.jsonl", help="throughput prompts: a file in --workloads-dir")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3, help="alternating throughput rounds of every engine")
    ap.add_argument("--agreement-prompts", type=int, default=256)
    ap.add_argument("--agreement-tokens", type=int, default=48)
    ap.add_argument("--ppl-tokens", type=int, default=1024)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--skip", action="append", default=[], choices=["throughput", "agreement", "perplexity"])
    ap.add_argument("--float-head", action="store_true",
                    help="also int8 with the lm_head in the model dtype (what the rescored int8 head buys)")
    ap.add_argument("--kv-int8", action="store_true",
                    help="also the int8 KV cache (kv_cache_dtype=int8) with bf16 weights and with int8 weights")
    ap.add_argument("--fp32-reference", action="store_true",
                    help="also fp32 vs bf16 greedy agreement: how much two float precisions already disagree")
    args = ap.parse_args()
    configure_process(args.threads)

    from carpool.engine.loader import load_model

    loaded = load_model("smollm2", dtype=args.dtype)
    reviews = read_rows(args.workloads_dir / "reviews-128.jsonl")
    classify = read_rows(args.workloads_dir / "classify-512.jsonl")
    prompts = read_rows(args.workloads_dir / args.workload)
    work = [prompts[i % len(prompts)] for i in range(args.requests)]
    agree_rows = (reviews + classify)[: args.agreement_prompts]
    ppl_ids = loaded.tokenizer.encode(ppl_text())[: args.ppl_tokens]

    result: dict = {"benchmark": "quantization", "cpu": cpu(), "model": "smollm2", "dtype": args.dtype,
                    "threads": torch.get_num_threads(), "max_num_seqs": 64,
                    "workload": f"{Path(args.workload).stem} x{args.requests}, {args.max_tokens} tokens out, "
                                "EOS ignored"}
    variants = [(args.dtype, None, "auto"), ("int8", "int8", "auto")]
    if args.float_head:
        variants.append(("int8-float-head", "int8", "auto"))
    if args.kv_int8:
        variants += [(f"{args.dtype}+kv-int8", None, "int8"), ("int8+kv-int8", "int8", "int8")]
    engines: dict[str, dict] = {}
    llms: dict[str, LLM] = {}
    for name, q, kv in variants:
        cfg = EngineConfig(model="smollm2", dtype=args.dtype, quantization=q, kv_cache_dtype=kv, max_num_seqs=64,
                           max_num_batched_tokens=2048, num_threads=args.threads, extra={"attention": "kernel"})
        t = time.perf_counter()
        default_head = quant.QUANTIZE_LM_HEAD
        quant.QUANTIZE_LM_HEAD = default_head and name != "int8-float-head"  # read when the model is built
        llms[name] = LLM(cfg, loaded=loaded)
        quant.QUANTIZE_LM_HEAD = default_head
        engines[name] = {"engine_build_s": round(time.perf_counter() - t, 2), "throughput": []}
    if "throughput" not in args.skip:
        for i in range(args.rounds):
            for name, llm in llms.items():
                engines[name]["throughput"].append(throughput(llm, work, args.max_tokens, f"{name}-{i}-"))
                print(json.dumps({name: {"round": i, **engines[name]["throughput"][-1]}}), file=sys.stderr)
    for name, llm in llms.items():
        r = engines[name]
        if "agreement" not in args.skip:
            r["greedy"] = greedy(llm, agree_rows, args.agreement_tokens, f"g{name}")
        if "perplexity" not in args.skip:
            r["perplexity"] = round(perplexity(llm, ppl_ids), 4)
    llms.clear()
    base = engines[args.dtype]
    if "throughput" not in args.skip:
        def tok_s(name: str) -> list[float]:
            return [t["output_tok_s"] for t in engines[name]["throughput"]]

        result["output_tok_s"] = {n: tok_s(n) for n in engines}
        result["over_bf16_by_round"] = {n: [round(a / b, 3) for a, b in zip(tok_s(n), tok_s(args.dtype), strict=True)]
                                        for n in engines if n != args.dtype}
        result["over_bf16"] = {n: statistics.median(r) for n, r in result["over_bf16_by_round"].items()}
        result["throughput"] = {n: e["throughput"] for n, e in engines.items()}
    if "agreement" not in args.skip:
        result["agreement"] = {n: {"max_tokens": args.agreement_tokens, **agreement(base["greedy"], e["greedy"])}
                               for n, e in engines.items() if n != args.dtype}
    if "perplexity" not in args.skip:
        result["perplexity"] = {"text": f"pydoc_data topics {', '.join(PPL_TOPICS)} "
                                        f"(Python {sys.version_info.major}.{sys.version_info.minor}), "
                                        f"{len(ppl_ids)} tokens",
                                **{n: e["perplexity"] for n, e in engines.items()},
                                "delta": {n: round(e["perplexity"] - base["perplexity"], 4)
                                          for n, e in engines.items() if n != args.dtype}}
    if args.fp32_reference and "agreement" not in args.skip:
        ref = load_model("smollm2", dtype="float32")
        llm = LLM(EngineConfig(model="smollm2", dtype="float32", max_num_seqs=64, max_num_batched_tokens=2048,
                               num_threads=args.threads, extra={"attention": "kernel"}), loaded=ref)
        fp32 = greedy(llm, agree_rows, args.agreement_tokens, "f")
        result["agreement"]["float32"] = {"max_tokens": args.agreement_tokens, **agreement(base["greedy"], fp32)}
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
