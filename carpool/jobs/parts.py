"""The parts a job is made of, and the default ones ``RunOptions`` asks for.

``JobParts`` is what ``carpool.jobs.pipeline.Pipeline`` runs: where the tasks come from
(``source``), where their lines go (``journal``), what answers them (``backend``, with
an optional admission ``check``), how many may be in flight (``limiter``), the RPM/TPM
``budget`` and the result ``caches``.  ``build_parts(opts, live)`` makes the
single-process ones from the settings and the job's ``LiveParts`` (an engine given, the
identity settled at start); a caller that needs another part passes it in (the Ray
worker: its shard's reader, the shared Redis budget in its ``LiveParts``, a balancer with
shared cooldowns) and keeps the rest.

Seams for what comes next: another kind of endpoint is ``make_backend`` (the endpoints
of a job, with their keys, headers and dialects: ``carpool.jobs.endpoints_file``);
another kind of input (a list of dicts, a DataFrame) is a ``TaskSource``.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from carpool.client import limiter
from carpool.client.base import Backend, CallResult, Request
from carpool.client.budget import Budget, make_budget
from carpool.client.engine_backend import EMBED_QUEUE_SIZE
from carpool.client.limiter import AdaptiveLimiter, FixedLimiter
from carpool.client.start_limit import (
    remember_limit,
    server_capacity,
    store_key,
    stored_limit,
    tokens_per_request,
)
from carpool.engine.plan import DEFAULT_MAX_SEQS
from carpool.jobs.cost.tokens import CountedSource, openai_counter, openai_encoding_name
from carpool.jobs.fingerprint import engine_model_name, job_identity, make_fingerprint
from carpool.jobs.input.prefix_order import PlannedSource
from carpool.jobs.input.readers import Reader, RecordSource, TaskSource
from carpool.jobs.input.tasks import Task, TaskDefaults
from carpool.jobs.options import LiveParts, RunOptions
from carpool.jobs.output.table import output_target
from carpool.jobs.reuse.caches import JobCaches, open_job_caches
from carpool.journal.journal import Journal

if TYPE_CHECKING:
    from carpool.client.balancer import Balancer

# An admission check: why the backend would refuse a request, else what it prepared of it
# for its first call (None: nothing).
# (``carpool.client.base.Refused``: the pipeline writes the task's error line at once).
Check = Callable[[Request], object]


class EchoBackend:
    """``--echo-backend``: answers at once with a fixed empty body, the pipeline without any
    model or network (carpool's own overhead, memory on huge files, tests).  Its output
    lines are real lines of the journal: the fingerprint (kind ``echo``) keeps a later real
    run from resuming them as answers."""

    name = "echo"
    engine_start_s: float | None = None  # no engine runs in this process
    engine_start_overlap_s: float | None = None
    engine_max_num_seqs: int | None = None

    async def call(self, req: Request, *, prepared: object = None,
                   on_first_token: Callable[[], None] | None = None) -> CallResult:
        body = {"id": "echo", "object": "chat.completion", "model": "echo",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": ""}, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}}
        return CallResult(ok=True, status_code=200, body=body, request_id="echo", ttft_s=0.0)

    async def close(self) -> None:
        return None


@dataclass
class JobParts:
    source: TaskSource
    journal: Journal
    backend: Backend
    limiter: FixedLimiter
    budget: Budget
    caches: JobCaches
    check: Check | None = None
    label: str = ""  # the backend as the summary names it
    # Closed in order after the backend (the engine this job started, shared Redis state).
    closers: list[Callable[[], Awaitable[None]]] = field(default_factory=list)
    messages: list[str] = field(default_factory=list)  # said to the user after the run
    # Begins starting the job's engine in the background; the pipeline calls it first thing,
    # so the model loads while the job opens its journal and reads its first tasks.
    start_engine: Callable[[], None] | None = None
    # Started as the job begins, cancelled when it ends (the limiter asking the servers where to start).
    primers: list[Callable[[], Awaitable[None]]] = field(default_factory=list)


def job_defaults(opts: RunOptions) -> TaskDefaults:
    """The task defaults of ``opts``; a task sent to an endpoint must name its model (unless
    every endpoint has its own: an endpoints file)."""
    if opts.endpoints and not opts.echo and not opts.defaults.require_model and not opts.endpoint_specs:
        return dataclasses.replace(opts.defaults, require_model=True)
    return opts.defaults


def _engine_seqs(opts: RunOptions, live: LiveParts) -> int | None:
    """The sequences the job's engine runs at once: the given engine's (the API's warm one: what
    it was given or what its plan chose), else the one given in the settings; None: the engine's
    plan chooses as the engine starts.  Asking never starts an engine."""
    if live.engine is not None:
        return live.engine.max_num_seqs
    given = opts.engine_config.get("max_num_seqs")
    return None if given is None else int(given)


def job_limiter(opts: RunOptions, live: LiveParts | None = None) -> FixedLimiter:
    if opts.echo and not opts.concurrency:
        return FixedLimiter(256, why="the echo backend's default (no --concurrency)")
    if not opts.endpoints and not opts.concurrency:
        return engine_limiter(opts, live or LiveParts())
    return limiter.make_limiter(opts.concurrency, opts.max_concurrency)


def engine_limiter(opts: RunOptions, live: LiveParts) -> FixedLimiter:
    """How many tasks the in-process engine holds at once when no --concurrency is given.

    Every task read, as ``LLM.generate`` hands it every prompt: a task waiting in the engine
    holds no KV block (blocks are taken when the scheduler admits it, ``max_num_seqs`` at
    a time) and its queue costs a step O(max_num_seqs), not O(waiting), so a deep queue is
    free there, while a shallow one leaves the scheduler fewer prompts to pack into each
    step.  The bound is memory: the tasks the job holds read (``--max-pending``), which it
    holds whatever the limit.  A first Ctrl-C takes back the tasks the engine has not begun
    (``EngineBackend.withdraw_queued``), so a deep queue does not make the stop wait.

    With a semantic cache the tasks wait outside the engine until it can begin them (its
    batch and as many again to admit as the batch frees): a task asks the cache when it
    takes its slot, and only then finds the near-duplicates answered meanwhile."""
    seqs = _engine_seqs(opts, live)
    said = "max_num_seqs (the plan's for this machine)" if seqs is None else f"max_num_seqs ({seqs})"
    if opts.semantic_cache is not None:
        # Before the engine has read its plan, the number it runs until then: fewer tasks asked
        # the cache before any is answered, at the cost of seats the plan may add.
        said = f"max_num_seqs ({DEFAULT_MAX_SEQS} until its plan is read)" if seqs is None else said
        limit = 2 * (seqs or DEFAULT_MAX_SEQS)
        why = (f"2 x the engine's {said}: the semantic cache is asked as a task "
               "enters the engine, no --concurrency given")
    else:
        limit = min(opts.max_pending, EMBED_QUEUE_SIZE)  # the embedder's queue turns away more
        read = (f"every task read (--max-pending {limit})" if limit == opts.max_pending else
                f"{limit:,} of the tasks read (the in-process queue's size; --max-pending {opts.max_pending})")
        why = f"{read}: the engine queues them and runs {said} at once, no --concurrency given"
    if opts.max_concurrency and opts.max_concurrency < limit:
        return FixedLimiter(opts.max_concurrency, why=f"{why}, capped by --max-concurrency")
    return FixedLimiter(limit, why=why)


Hook = Callable[[], Awaitable[None]]
SAMPLE = 64  # tasks whose size stands for the job's requests when the servers are asked


def _sample_estimates(source: TaskSource) -> list[int]:
    # A copy: a source that counts what it yields (a Ray shard checks every task it handed out
    # got a line) must count the job's own pass only.
    it = iter(copy.copy(source))
    try:
        return [t.request.est_tokens for t in itertools.islice(it, SAMPLE) if isinstance(t, Task)]
    finally:
        close = getattr(it, "close", None)
        if close is not None:
            close()


def limiter_start(opts: RunOptions, lim: FixedLimiter, source: TaskSource) -> tuple[list[Hook], list[Hook]]:
    """(primers, closers) that begin an adaptive limiter where the endpoints can take it
    (``carpool.client.start_limit``): the limit the last job against the same endpoints
    settled at, at once (a file read); without one, a primer asks the servers' ``/metrics``
    in the background while the first requests go out.  A closer keeps where this job
    settled.  Nothing for a fixed limit, the engine or a dry run."""
    if not isinstance(lim, AdaptiveLimiter) or not opts.endpoints or opts.echo or opts.dry_run:
        return [], []
    key = store_key(opts.endpoints, opts.defaults.model)

    async def remember() -> None:
        remember_limit(key, lim)

    last = stored_limit(key)
    if last is not None:
        lim.start_at(last, "last job")
        return [], [remember]

    async def ask_servers() -> None:
        import asyncio

        from carpool.jobs.endpoints_file import job_endpoints

        estimates = await asyncio.to_thread(_sample_estimates, source)
        cap = await server_capacity(job_endpoints(opts), tokens_per_request(estimates))
        if cap is not None:
            lim.start_at(cap, "server capacity")

    return [ask_servers], [remember]


@dataclass
class _Target:
    backend: Backend
    label: str
    model: str  # the model of tasks that name none (cache keys)
    check: Check | None = None
    closers: list[Callable[[], Awaitable[None]]] = field(default_factory=list)
    start_engine: Callable[[], None] | None = None  # the engine this job owns, started in the background


def make_backend(opts: RunOptions, live: LiveParts, balancer: Balancer | None = None) -> _Target:
    """HTTP to ``opts.endpoints`` (through ``balancer`` when given), else the in-process
    engine (``live.engine``, or one started here and shut down with the job), or the echo backend."""
    if opts.echo:
        return _Target(EchoBackend(), "echo", "echo")
    if opts.endpoints:
        from carpool.client.http_backend import HttpBackend
        from carpool.jobs.endpoints_file import job_endpoints

        specs = job_endpoints(opts)
        http = HttpBackend(specs, model=opts.defaults.model, stream=opts.stream, timeouts=opts.timeouts,
                           max_connections=opts.max_concurrency or 0, balancer=balancer,
                           prefix_routing=opts.prefix_routing)
        label = f"http {', '.join(s.name for s in specs)}"
        model = opts.engine_model
        if opts.endpoint_specs:  # the models the endpoints are sent, for cache keys of tasks naming none
            model = job_identity(opts, live).name
        return _Target(http, label, model)
    from carpool.client.engine_backend import EngineBackend, default_embedder_factory

    closers: list[Callable[[], Awaitable[None]]] = []
    engine = live.engine
    owned = None
    if engine is None:
        from carpool.engine import AsyncEngine, EngineConfig

        # Built on the first generation task, or from the job's start when its first task is
        # one (build_parts): a job of embeddings only never loads the generation model.
        owned = AsyncEngine(EngineConfig(model=opts.engine_model, **opts.engine_config))
        closers.append(owned.shutdown)
        engine = owned
    backend = EngineBackend(engine, live.embedder_factory or default_embedder_factory)
    model = engine_model_name(str(backend.model_name), opts, live.engine)
    return _Target(backend, f"engine {model}", model, backend.check, closers,
                   backend.begin_start if owned is not None else None)


def _starts_with_generation(source: TaskSource) -> bool:
    """Whether the first record of ``source`` is a chat or completion task (a bad line counts:
    the ones after it likely are).  Only sources that can be read again are looked at (the
    input file, records in memory); any other answers False, and its engine starts on first use."""
    if not isinstance(source, (Reader, RecordSource)):
        return False
    it = iter(source)
    try:
        first = next(it, None)
    finally:
        close = getattr(it, "close", None)  # a generator: its file is closed now, not when collected
        if close is not None:
            close()
    if first is None:
        return False
    return not (isinstance(first, Task) and first.request.kind == "embedding")


def endpoint_identity(opts: RunOptions, live: LiveParts | None = None) -> str:
    """What the cache keys name as the endpoint: the model identity it reports, never its URL,
    so a replica of the same model shares the cache (``--cache-namespace`` is a key part of its own)."""
    return job_identity(opts, live).cache_identity()


def make_journal(opts: RunOptions, live: LiveParts | None = None) -> Journal:
    return Journal(output_target(opts.output).journal, opts.errors, fingerprint=make_fingerprint(opts, live),
                   force=opts.force, retry_errors=opts.retry_errors, read_only=opts.dry_run, spell=opts.naming)


def wants_plan(opts: RunOptions) -> bool:
    """Whether the job's input file is to be planned: by default (``None``) for endpoints and
    the in-process engine alike (its prefix cache thrashes the same way: docs/run.md), forced
    by ``--prefix-order``, never with ``--no-prefix-order`` nor ``--ordered``, nor for the echo
    backend (no cache to feed)."""
    if opts.prefix_order is False or opts.ordered:
        return False
    return opts.prefix_order is True or not opts.echo


def build_parts(opts: RunOptions, live: LiveParts | None = None, *, source: TaskSource | None = None,
                balancer: Balancer | None = None) -> JobParts:
    """The parts ``opts`` asks for, with what ``live`` gives (an engine, a shared budget, the
    settled identity); ``source`` and ``balancer`` replace the default ones (the input
    file's reader, the local balancer)."""
    live = live if live is not None else LiveParts()
    messages: list[str] = []
    reader: Reader | None = None
    if source is None:
        reader = Reader(opts.input, opts.fmt, opts.template, job_defaults(opts))
        source = PlannedSource(reader, force=opts.prefix_order is True) \
            if wants_plan(opts) and PlannedSource.usable(reader) else reader
    encoding = openai_encoding_name(opts.defaults.model or "") if opts.tpm and opts.endpoints else None
    if encoding is not None:
        # A TPM budget for an OpenAI model: its real BPE is cheap next to a request, and a
        # budget from real counts neither overshoots the provider's limit nor idles.
        source = CountedSource(source, openai_counter(encoding))
    journal = make_journal(opts, live)
    target = make_backend(opts, live, balancer)
    start_engine = target.start_engine if target.start_engine is not None and \
        _starts_with_generation(reader if reader is not None else source) else None
    budget = live.budget if live.budget is not None else make_budget(opts.rpm, opts.tpm)
    caches = open_job_caches(opts, target.model, endpoint_identity(opts, live), messages)
    lim = job_limiter(opts, live)
    primers, remember = limiter_start(opts, lim, reader if reader is not None else source)
    return JobParts(source=source, journal=journal, backend=target.backend, limiter=lim,
                    budget=budget, caches=caches, check=target.check, label=target.label,
                    closers=[*target.closers, *remember], messages=messages, start_engine=start_engine,
                    primers=primers)
