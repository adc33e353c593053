"""``RunOptions``: everything a batch job can be told, typed, in one place; ``LiveParts``:
the objects a job is given or builds at its start, beside it.

``RunOptions`` is settings only, and frozen: ``carpool run`` fills it from its flags
(``carpool.commands.run``), the Python API from keyword arguments (``carpool.jobs.python_api.run``),
the Ray driver copies it per shard (``dataclasses.replace``, never an assignment), so
what a job was told stays what it was told.  What is not a setting (an engine already
running, a shared budget, the model identity the endpoints report at start) is a
``LiveParts``, passed beside the options to what builds a job's parts
(``carpool.jobs.parts.build_parts``) and names its model
(``carpool.jobs.fingerprint``).  The pipeline reads only the options' flow settings
(order, windows, bounds, attempts).
"""

from __future__ import annotations

import shlex
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

from carpool.cache import DEFAULT_TTL_S
from carpool.client.pool import Timeouts
from carpool.jobs.input.tasks import TaskDefaults, Template

if TYPE_CHECKING:
    from carpool.client.budget import Budget
    from carpool.client.endpoints import EndpointSpec
    from carpool.client.models import ModelIdentity
    from carpool.engine.protocol import EngineClient

# Builds the embedding batcher on the first embedding task (loading MiniLM costs seconds);
# what it returns is the in-process backend's business (``carpool.client.engine_backend``).
EmbedderFactory = Callable[[], Any]


PROVIDERS = ("openai", "azure", "anthropic")
# The variables each provider's key is read from when no key is given, in order.
KEY_VARIABLES = {"openai": ("CARPOOL_API_KEY", "OPENAI_API_KEY"), "azure": ("AZURE_OPENAI_API_KEY",),
                 "anthropic": ("ANTHROPIC_API_KEY",)}
# The endpoints-file kinds that select a batch API, and the provider each one names.
KINDS = {"openai-batch": "openai", "azure-batch": "azure", "anthropic-batch": "anthropic"}


@dataclass(frozen=True)
class BatchApiOptions:
    """How a job goes through a provider's batch API (``--batch-api``, ``carpool.jobs.provider_batch``)."""

    provider: str  # openai | azure | anthropic
    url: str  # the provider's base URL (https://api.openai.com/v1, https://api.anthropic.com, ...)
    headers: dict[str, str]  # authentication included
    model: str | None = None  # sent in place of (or for tasks without) a model
    api_version: str | None = None  # azure
    max_requests: int | None = None  # None: the provider's documented limit
    max_bytes: int | None = None
    poll_s: float = 10.0  # first wait between two polls of a batch; grows to max_poll_s
    max_poll_s: float = 300.0
    max_attempts: int = 3  # submissions of one task (expired / retryable errors) before its error line
    online_fallback: bool = False  # expired / retryable requests go to the online path instead
    completion_window: str = "24h"
    default_max_tokens: int = 4096  # Anthropic requires max_tokens; tasks that set none get this
    http_attempts: int = 6  # tries of one API call on 429 / 5xx / no connection (--max-attempts)


@dataclass(frozen=True)
class Naming:
    """How the entry point that started a job spells its settings, so that a message names
    what the user wrote: ``carpool run``'s flags (``--max-tokens 64``), or the keyword
    arguments of ``run_batch`` (``max_tokens=64``).  ``name`` is the keyword's; a ``value`` in
    capitals (``N``, ``NAME``) stands for one the user chooses and is shown as it is."""

    keywords: bool = False

    def __call__(self, name: str, value: object = None) -> str:
        if self.keywords:
            placeholder = isinstance(value, str) and value.isalpha() and value.isupper()
            return name if value is None else f"{name}={value if placeholder else repr(value)}"
        flag = _FLAGS.get(name, "--" + name.replace("_", "-"))
        return flag if value is None or value is True else f"{flag} {shlex.quote(str(value))}"


# The settings whose flag is not their keyword with dashes.
_FLAGS = {"fmt": "--format", "output": "-o"}
FLAGS = Naming()
KEYWORDS = Naming(keywords=True)


@dataclass(frozen=True)
class RunOptions:
    input: str
    output: str
    errors: str | None = None
    fmt: str | None = None
    template: Template | None = None
    defaults: TaskDefaults = field(default_factory=TaskDefaults)
    endpoints: list[str] = field(default_factory=list)  # base URLs; empty: the embedded engine
    api_key: str | None = None
    # ``--endpoints FILE`` (carpool.jobs.endpoints_file): each endpoint with its own model, key,
    # headers, weight, RPM/TPM and tier; ``endpoints`` then lists their URLs.
    endpoint_specs: list[EndpointSpec] = field(default_factory=list)
    headers: dict[str, str] = field(default_factory=dict)  # --header, on every endpoint
    api_version: str | None = None  # --api-version: Azure OpenAI's, for --endpoint URLs on Azure
    engine_model: str = "smollm2"
    engine_config: dict[str, Any] = field(default_factory=dict)  # extra EngineConfig fields
    concurrency: int | None = None
    max_concurrency: int | None = None
    rpm: float | None = None
    tpm: float | None = None
    stream: bool = True
    timeouts: Timeouts = field(default_factory=Timeouts)
    max_attempts: int = 6
    # Seconds every endpoint may stay down before the job stops (exit code 4, resumable);
    # until then an outage pauses the job instead of failing its tasks.
    outage_timeout: float = 900.0
    # Seconds the start waits for an endpoint that does not answer yet (a server that is still
    # starting) before it refuses the job (carpool.jobs.start.probe); 0: refuse at once.
    wait_for_endpoint: float = 0.0
    ordered: bool = False
    # None: prefix-aware order decided per job (carpool.jobs.input.prefix_order); True: forced; False: off.
    prefix_order: bool | None = None
    prefix_window: int = 1024
    # Several endpoints: a prefix group stays on the endpoint that had it while that one is
    # not overloaded (carpool.client.affinity); False: by load alone.
    prefix_routing: bool = True
    cache: str | None = None  # None: the default SQLite file; "off"; sqlite:///...; redis://...
    cache_ttl: float | None = DEFAULT_TTL_S  # seconds a stored answer is served; None: for ever
    cache_sampled: bool = False
    semantic_cache: float | None = None  # cosine threshold, opt-in
    semantic_audit: int = 0  # re-ask this many random semantic hits after the job (carpool/cache/audit.py)
    dedup: bool = True
    fresh: bool = False
    progress: bool | None = None  # None: when stderr is a terminal
    report: str | None = None
    max_pending: int = 2048
    dry_run: bool = False  # validate and count (carpool.jobs.dry_run): nothing is sent, the output is not touched
    echo: bool = False  # answer every task with an empty reply, no model (overhead / memory runs, tests)
    force: bool = False  # resume even when the run fingerprint differs (carpool.jobs.fingerprint)
    retry_errors: bool = False  # on resume, run again the tasks whose final line is an error line
    cache_namespace: str | None = None  # a key component of its own: entries of one namespace serve only it
    latency_signal: str = "per_token"
    # $ per million tokens for the summary's $ spent / saved (None: carpool.jobs.cost.prices' table).
    price_in: float | None = None
    price_out: float | None = None
    prices: str | None = None  # --prices FILE: a JSON/YAML price table in LiteLLM's shape, before the built-in one
    argv: list[str] | None = None
    quiet: bool = False
    # --batch-api / an endpoints-file kind *-batch: the job goes through the provider's batch API
    # (carpool.jobs.provider_batch); None: online.
    batch_api: BatchApiOptions | None = None
    naming: Naming = FLAGS  # how messages name a setting: the entry point's flags or keywords


@dataclass(frozen=True)
class LiveParts:
    """What a job is given or learns at its start that is not a setting: objects, not flags.
    A field left None is built from the options (``carpool.jobs.parts.build_parts``)."""

    engine: EngineClient | None = None  # an engine already running (API / tests); not shut down here
    embedder_factory: EmbedderFactory | None = None
    budget: Budget | None = None  # e.g. the shared Redis one; None: local buckets from rpm/tpm
    # What the endpoint says the model is (carpool.jobs.start.model.resolve_target settles it before
    # the parts are built; None: told from the options alone, carpool.jobs.fingerprint.job_identity).
    identity: ModelIdentity | None = None


# The Python API takes both as keyword arguments; these are the ones that go to LiveParts.
LIVE_NAMES = tuple(f.name for f in fields(LiveParts))
