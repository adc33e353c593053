"""``carpool run --estimate``: the tokens and $ a run would cost, before anything is sent.

It reads and validates the input as a run does, leaves out the tasks the output already
holds (read only, never written), and counts every task's prompt with the model's real
tokenizer (``carpool.jobs.cost.tokens``).  Nothing goes over the network, not even ``/models``:
the model is the one the options name.

What is exact and what is not:
- input tokens: exact for the tokenizer named (OpenAI's BPE for OpenAI model names, the
  engine's own tokenizer in-process); images in messages and tool schemas are not counted.
- output tokens: an upper bound, each task's ``max_tokens`` (or ``max_completion_tokens``)
  times ``n``; tasks that set no bound are counted apart and left out of the bound.
- $: those counts at ``carpool.jobs.cost.prices``' prices; the cache is not consulted, so a
  run that hits it costs less.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any

from carpool.jobs.cost.prices import job_prices
from carpool.jobs.cost.tokens import counter_for, output_bound
from carpool.jobs.input.readers import Reader, TaskSource
from carpool.jobs.input.tasks import BadLine, Task
from carpool.jobs.options import LiveParts, RunOptions
from carpool.jobs.parts import job_defaults, make_journal


def job_model(opts: RunOptions, live: LiveParts | None = None) -> tuple[str | None, str | None]:
    """(the model name sent to the endpoints, the embedded engine's model) of ``opts`` (the
    engine ``live`` gives, if any)."""
    if opts.endpoints or opts.echo:
        return opts.defaults.model, None
    engine = live.engine if live is not None else None
    return None, str(getattr(engine, "model_name", None) or opts.engine_model)


async def estimate(opts: RunOptions, source: TaskSource | None = None, live: LiveParts | None = None
                   ) -> dict[str, Any]:
    model, engine_model = job_model(opts, live)
    prices = job_prices(opts)
    messages: list[str] = []
    done: set[str] | Any = set()
    if opts.output:
        try:
            journal = make_journal(dataclasses.replace(opts, dry_run=True), live)
            done, notes = journal.open(opts.input or None, fresh=opts.fresh, argv=opts.argv)
            messages += notes
        except ValueError as e:  # a fingerprint mismatch: say it, estimate every task
            messages.append(f"the output cannot be resumed as it is ({e}); every task is counted")
    if source is None:
        source = Reader(opts.input, opts.fmt, opts.template, job_defaults(opts))
    counter = counter_for(model, engine_model)
    if counter is None:
        messages.append(f"no tokenizer known for model {model!r}: tokens are not counted "
                        "(OpenAI model names and the embedded engine's models are)")
    tasks = bad = already = unbounded = 0
    prompt_tokens = output_tokens = 0
    kinds: Counter[str] = Counter()
    models: Counter[str] = Counter()
    for item in source:
        if len(done) and item.custom_id in done:
            already += 1
            continue
        if isinstance(item, BadLine):
            bad += 1
            continue
        assert isinstance(item, Task)
        tasks += 1
        req = item.request
        kinds[req.kind] += 1
        if isinstance(req.body.get("model"), str):
            models[req.body["model"]] += 1
        if counter is not None:
            prompt_tokens += counter.prompt_tokens(req)
        bound = output_bound(req)
        if bound is None:
            unbounded += 1
        else:
            output_tokens += bound
    others = sorted(m for m in models if m != model)
    if others and not engine_model:
        messages.append(f"tasks naming another model ({', '.join(others[:3])}) are counted with "
                        f"{model!r}'s tokenizer and prices")
    if unbounded:
        messages.append(f"{unbounded:,} tasks set no max_tokens: their output is not in the bound "
                        "(pass --max-tokens to bound it)")
    counted = counter is not None
    cost: dict[str, float | None] = {"input_usd": None, "output_usd_max": None, "total_usd_max": None}
    if prices is not None:
        out_usd = prices.cost(0, output_tokens)
        in_usd = prices.cost(prompt_tokens, 0) if counted else None
        cost = {"input_usd": None if in_usd is None else round(in_usd, 6), "output_usd_max": round(out_usd, 6),
                "total_usd_max": None if in_usd is None else round(in_usd + out_usd, 6)}
    return {
        "estimate": True, "model": model or engine_model, "tokenizer": counter.name if counter else None,
        "tasks": tasks, "kinds": dict(kinds), "bad_lines": bad, "already_done": already,
        "prompt_tokens": prompt_tokens if counted else None,
        "output_tokens_max": output_tokens, "tasks_without_max_tokens": unbounded,
        "prices": prices.doc() if prices is not None else None, **cost, "messages": messages,
    }
