"""Before the first request: which model the job talks to, checked against the endpoints.

``resolve_target(opts)`` asks every endpoint's ``GET /models`` once and settles the model:

- ``--model NAME`` that an endpoint which answered does not list: refused (exit 2), with
  the names it does serve;
- no ``--model`` and the endpoints serve exactly one model: that one, said in a message;
  several: refused with their names, unless the first task names its own model;
- an endpoint that cannot be asked (down, no ``/models``: some gateways): a warning, and the
  name is sent as given; with no ``--model`` and no task naming one, refused.

With an endpoints file (``--endpoints``) every endpoint is asked for its own model, and one
that answers without it refuses the start, naming the entry.  Azure OpenAI endpoints are
not asked (their list names base models, not the deployments requests go to).

The result is ``opts`` with the model filled in and the job's ``LiveParts`` with its
``identity`` set (what the endpoint reports about the model: ``carpool.client.models``),
which the run fingerprint and the cache keys use.  The embedded engine and the echo backend are resolved without asking
anything.  Nothing here sends a task.
"""

from __future__ import annotations

import asyncio
import dataclasses

from carpool.client.endpoints import EndpointSpec
from carpool.client.models import ModelIdentity, ModelList, identity_from_card, list_models
from carpool.errors import EndpointsFileError, StartRefused
from carpool.jobs.endpoints_file import job_endpoints
from carpool.jobs.fingerprint import job_identity
from carpool.jobs.input.readers import Reader, TaskSource
from carpool.jobs.input.tasks import Task
from carpool.jobs.options import LiveParts, RunOptions


def _first_task_model(opts: RunOptions, source: TaskSource | None, look: int = 64) -> str | None:
    """The model the first valid task names, if any (a job whose tasks name their models
    needs no ``--model``)."""
    src = source if source is not None else Reader(opts.input, opts.fmt, opts.template, opts.defaults)
    for i, item in enumerate(src):
        if isinstance(item, Task):
            model = item.request.body.get("model")
            return model if isinstance(model, str) and model else None
        if i >= look:
            break
    return None


async def fetch_model_lists(opts: RunOptions, specs: list[EndpointSpec] | None = None) -> list[ModelList]:
    """Each endpoint's ``/models`` (``specs``: those to ask, default every endpoint of the job)."""
    import aiohttp

    specs = job_endpoints(opts) if specs is None else specs
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=opts.timeouts.connect_s, sock_read=opts.timeouts.read_s)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        return list(await asyncio.gather(*(list_models(session, s.models_url().removesuffix("/models"), s.headers,
                                                       s.params or None,
                                                       timeout_s=opts.timeouts.connect_s + opts.timeouts.read_s)
                                           for s in specs)))


def _warn_unlisted(lists: list[ModelList]) -> list[str]:
    return [f"warning: could not list the models of {m.url} ({m.error}); "
            "the model name is sent as given there, unchecked" for m in lists if m.error is not None]


def settle_endpoint_models(opts: RunOptions, specs: list[EndpointSpec], lists: list[ModelList]
                           ) -> tuple[ModelIdentity, list[str]]:
    """Each endpoint of an endpoints file against its own ``/models`` (``lists``: same order as
    ``specs``); raises ``EndpointsFileError`` naming the entry whose model is not served."""
    notes = _warn_unlisted(lists)
    cards: list[dict] = []
    for spec, m in zip(specs, lists, strict=True):
        if m.error is not None or spec.model is None:
            continue
        card = m.card(spec.model)
        if card is None:
            served = ", ".join(m.ids) or "none"
            raise EndpointsFileError(f"--endpoints: endpoint {spec.name}: field 'model': {spec.model!r} is not "
                                     f"served there (it serves: {served}); write one of those names")
        cards.append(card)
    models = sorted({s.model for s in opts.endpoint_specs if s.model})
    if len(models) == 1:
        return identity_from_card(models[0], cards[0] if cards else None), notes
    return job_identity(opts), notes


def settle_model(opts: RunOptions, lists: list[ModelList], source: TaskSource | None = None
                 ) -> tuple[str | None, ModelIdentity, list[str]]:
    """(model name to send by default, its identity, messages); raises ``StartRefused``."""
    notes = _warn_unlisted(lists)
    answered = [m for m in lists if m.error is None]
    model = opts.defaults.model
    if model:
        for m in answered:
            if m.card(model) is None:
                served = ", ".join(m.ids) or "none"
                raise StartRefused(f"{opts.naming('model', model)} is not served by {m.url} (it serves: "
                                   f"{served}); pass one of those names")
    else:
        names = sorted({i for m in answered for i in m.ids})
        if len(names) == 1 and answered:
            model = names[0]
            notes.append(f"{opts.naming('model')} not given: {', '.join(m.url for m in answered)} serves only "
                         f"{model!r}; using it")
        elif _first_task_model(opts, source) is None:
            if answered:
                raise StartRefused(f"no {opts.naming('model')} given and {answered[0].url} serves several models "
                                   f"({', '.join(names) or 'none'}): pass {opts.naming('model', 'NAME')}")
            raise StartRefused(f"no {opts.naming('model')} given and the endpoint's models could not be listed "
                               f"({lists[0].error if lists else 'no endpoint'}): pass {opts.naming('model', 'NAME')}")
    if not model:
        return None, ModelIdentity(""), notes
    cards = [(m.url, m.card(model)) for m in answered if m.card(model) is not None]
    identity = identity_from_card(model, cards[0][1] if cards else None)
    for url, card in cards[1:]:
        other = identity_from_card(model, card)
        if other != identity:
            notes.append(f"warning: {url} and {cards[0][0]} disagree on what {model!r} is "
                         f"({other.doc()} vs {identity.doc()}); the fingerprint and the cache use the first")
    return model, identity, notes


async def resolve_target(opts: RunOptions, source: TaskSource | None = None, live: LiveParts | None = None
                         ) -> tuple[RunOptions, LiveParts, list[str]]:
    """``opts`` with the model settled, ``live`` with the model's ``identity`` set, and what the
    user should know."""
    live = live if live is not None else LiveParts()
    if live.identity is not None:
        return opts, live, []
    # A provider's batch API is not asked: the provider checks the model as it takes a batch,
    # and its /models may speak another dialect (Anthropic's) than the one listed here.
    if opts.echo or not opts.endpoints or opts.batch_api is not None:
        return opts, dataclasses.replace(live, identity=job_identity(opts, live)), []
    # Azure's /openai/models lists base models, not the deployments requests go to: not asked.
    asked = [s for s in job_endpoints(opts) if s.kind != "azure"]
    if opts.endpoint_specs:
        identity, notes = settle_endpoint_models(opts, asked, await fetch_model_lists(opts, asked))
        return opts, dataclasses.replace(live, identity=identity), notes
    if not asked:  # only Azure endpoints: --model (the deployment) is sent as given
        if not opts.defaults.model and _first_task_model(opts, source) is None:
            raise StartRefused(f"no {opts.naming('model')} given: an Azure OpenAI endpoint needs the deployment "
                               f"name ({opts.naming('model', 'DEPLOYMENT')})")
        return opts, dataclasses.replace(live, identity=job_identity(opts, live)), []
    lists = await fetch_model_lists(opts, asked)
    model, identity, notes = settle_model(opts, lists, source)
    defaults = dataclasses.replace(opts.defaults, model=model)
    return dataclasses.replace(opts, defaults=defaults), dataclasses.replace(live, identity=identity), notes

