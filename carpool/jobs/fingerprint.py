"""The run fingerprint: what produced the answers in an output file.

It is stored in the sidecar ``<output>.carpool.json`` when a run starts, and a resume
into the same output is refused (exit 2, by the journal: ``carpool.journal.journal``)
when it would produce answers another way:
another model (the name sent, or what the endpoint reports under it: ``carpool.client.
models.ModelIdentity``), another backend kind (an endpoint, the embedded engine, the echo
backend), another default parameter (``--max-tokens``, ``--temperature``, extra defaults)
or another ``--template`` / ``--system`` / ``--kind`` / ``--id-column``.  Mixed answers in
one file cannot be told apart afterwards; ``--force`` resumes anyway and records the new
fingerprint.

With an endpoints file (``--endpoints``) it also names every endpoint's model
(``endpoint_models``).

Not in it, on purpose: endpoint URLs (a replica or a moved server serves the same model),
keys and headers, concurrency, timeouts, retries, cache settings, the input file (the
sidecar's ``input`` warns about that separately: tasks are matched by custom_id).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from carpool.client.models import ModelIdentity
from carpool.engine.model_names import canonical

if TYPE_CHECKING:
    from carpool.engine.protocol import EngineClient
    from carpool.jobs.options import LiveParts, RunOptions

VERSION = 1


def job_identity(opts: RunOptions, live: LiveParts | None = None) -> ModelIdentity:
    """The identity the job's start settled (``carpool.jobs.start.model``, kept in ``live``), or the
    one that can be told without asking anything (a job composed without resolution: Ray Data
    batches, tests)."""
    if live is not None and live.identity is not None:
        return live.identity
    if opts.echo:
        return ModelIdentity("echo", kind="echo")
    if opts.endpoint_specs:
        models = sorted({s.model for s in opts.endpoint_specs if s.model})
        return ModelIdentity(" | ".join(models))
    if opts.endpoints:
        return ModelIdentity(opts.defaults.model or "")
    engine = live.engine if live is not None else None
    name = str(getattr(engine, "model_name", None) or opts.engine_model)
    return ModelIdentity(engine_model_name(name, opts, engine), kind="engine")


def engine_model_name(name: str, opts: RunOptions, engine: EngineClient | None = None) -> str:
    """The in-process engine's model as jobs name it: by its canonical name (``--model
    HuggingFaceTB/SmolLM2-135M-Instruct`` and ``--model smollm2`` are one model, one cache,
    one resume), and int8 weights (or an int8 KV cache) answer differently from bf16 ones, so
    "smollm2+int8" ("smollm2+kv-int8") keeps their cache entries and resumes apart.  ``engine``:
    the one the job was given, whose settings win; the name it was asked for, not the one a
    loaded folder reports (its directory's name, which two folders may share)."""
    config = getattr(engine, "config", None)
    name = canonical(str(getattr(config, "model", None) or name))
    quantization = getattr(config, "quantization", None) or opts.engine_config.get("quantization")
    kv = getattr(config, "kv_cache_dtype", None) or opts.engine_config.get("kv_cache_dtype") or "auto"
    name = f"{name}+{quantization}" if quantization else name
    return f"{name}+kv-{kv}" if kv != "auto" else name


def make_fingerprint(opts: RunOptions, live: LiveParts | None = None) -> dict:
    d = opts.defaults
    template = dataclasses.asdict(opts.template) if opts.template is not None else None
    if template is not None:
        template.pop("columns", None)
    defaults: dict = {"max_tokens": d.max_tokens, "temperature": d.temperature,
                      "extra": dict(sorted(d.extra.items()))}
    if d.max_completion_tokens is not None:
        defaults["max_completion_tokens"] = d.max_completion_tokens
    doc: dict = {"version": VERSION, "model": job_identity(opts, live).doc(), "defaults": defaults,
                 "template": template}
    if opts.endpoint_specs:
        # The models the endpoints of an endpoints file are sent (never their URLs or keys):
        # a file that now sends another model to one of them is another setup.
        doc["endpoint_models"] = sorted({s.model for s in opts.endpoint_specs if s.model})
    return doc
