"""Before the first task: does anything answer at the endpoints, and at the route tasks go to?

A wrong port or a base URL without ``/v1`` is a mistake in the command, not an outage:
left to the job, the first would pause it for ``--outage-timeout`` (15 minutes by default)
and the second would fail every task with ``HTTP 404``.  ``probe_endpoints`` asks each
endpoint's ``GET /models`` once (waiting up to ``wait_s`` for a server that is still
starting) and raises ``StartRefused`` naming the URL and the fix when

- nothing answers at any endpoint of the job (one answering is enough: the others may be
  fallbacks that are down for now, which the job's outage handling is for);
- an endpoint answers 404 at ``/models`` while ``<url>/v1/models`` answers: the base URL
  lacks ``/v1``.

What else it learns (a 404 with no ``/v1`` alternative, an error status) is returned as
warnings; ``carpool.jobs.start.model`` then asks ``/models`` for the model names as before.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from carpool.client.endpoints import EndpointSpec, has_authorization
from carpool.errors import StartRefused
from carpool.jobs.options import FLAGS, KEY_VARIABLES, Naming


@dataclass
class Probe:
    url: str  # what was asked
    status: int | None = None  # the HTTP status, None when nothing answered
    error: str | None = None  # why nothing answered
    # Something accepted the connection (it answered, or was too slow or odd in answering):
    # a busy server is not a mistake in the command.
    listening: bool = False


async def _get(session, url: str, spec: EndpointSpec, timeout_s: float) -> Probe:
    import aiohttp

    async def ask() -> int:
        async with session.get(url, headers=spec.headers, params=spec.params or None) as resp:
            await resp.read()
            return resp.status

    # The session's connect timeout is ``timeout_s``: a connection that cannot be made fails
    # inside aiohttp (a connector error), before this outer limit on the whole answer.
    try:
        return Probe(url, status=await asyncio.wait_for(ask(), timeout_s + 5.0), listening=True)
    except (TimeoutError, asyncio.TimeoutError):
        return Probe(url, error=f"connected, but no answer within {timeout_s + 5.0:g} s", listening=True)
    except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as e:
        return Probe(url, error=str(e) or type(e).__name__)
    except aiohttp.ClientError as e:
        return Probe(url, error=str(e) or type(e).__name__, listening=True)


async def _ask_all(specs: list[EndpointSpec], timeout_s: float) -> list[Probe]:
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=None, sock_connect=timeout_s, sock_read=timeout_s)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        return list(await asyncio.gather(*(_get(session, s.models_url(), s, timeout_s) for s in specs)))


def _missing_v1(spec: EndpointSpec) -> bool:
    return spec.kind != "azure" and not spec.url.rstrip("/").endswith("/v1")


async def _route_problems(specs: list[EndpointSpec], probes: list[Probe], timeout_s: float,
                          naming: Naming) -> list[str]:
    """Refuses a base URL that lacks ``/v1`` when ``/v1`` answers; warnings for other 404s."""
    import dataclasses

    notes: list[str] = []
    for spec, probe in zip(specs, probes, strict=True):
        if probe.status != 404:
            continue
        if _missing_v1(spec):
            with_v1 = dataclasses.replace(spec, url=spec.url.rstrip("/") + "/v1")
            again = (await _ask_all([with_v1], timeout_s))[0]
            if again.status is not None and again.status < 400:
                raise StartRefused(
                    f"{naming('endpoint', spec.url)}: no route there (GET {probe.url}: HTTP 404) but "
                    f"{again.url} answers: the base URL lacks /v1; pass {naming('endpoint', with_v1.url)}")
            notes.append(f"warning: GET {probe.url}: HTTP 404; OpenAI-compatible servers serve under /v1 "
                         f"(e.g. {with_v1.url}): if every task fails with HTTP 404, add /v1 to the URL")
    return notes


async def probe_endpoints(specs: list[EndpointSpec], wait_s: float = 0.0, timeout_s: float = 5.0,
                          say=None, *, naming: Naming = FLAGS) -> list[str]:
    """Ask each endpoint's ``/models``; refuse (``StartRefused``) when nothing answers after
    ``wait_s`` seconds, or when a base URL lacks ``/v1``.  Returns warnings for the user;
    ``naming``: how the messages name a setting (the job's entry point's flags or keywords)."""
    if not specs:
        return []
    deadline = time.monotonic() + wait_s
    told = False
    while True:
        probes = await _ask_all(specs, timeout_s)
        if any(p.listening for p in probes):
            break
        left = deadline - time.monotonic()
        if left <= 0:
            raise StartRefused(_nothing_answers(specs, probes, wait_s, naming))
        if say is not None and not told:
            say(f"waiting up to {left:.0f} s for {specs[0].url} to answer ({naming('wait_for_endpoint')}) ...")
            told = True
        await asyncio.sleep(min(1.0, left))
    _refuse_a_refused_key(specs, probes, naming)
    notes = [f"warning: {spec.name} does not answer ({probe.error})"
             + ("" if probe.listening else "; the job starts with the endpoints that do")
             for spec, probe in zip(specs, probes, strict=True) if probe.status is None]
    return notes + await _route_problems(specs, probes, timeout_s, naming)


def _refuse_a_refused_key(specs: list[EndpointSpec], probes: list[Probe], naming: Naming) -> None:
    """HTTP 401 at ``/models``: the endpoint refuses the key (or its absence), as OpenAI, vLLM's
    ``--api-key`` and carpool serve do on every route, so every task would fail with 401.
    A 403 is left to the job: a key may be kept off ``/models`` and still allowed to chat."""
    for spec, probe in zip(specs, probes, strict=True):
        if probe.status != 401:
            continue
        names = {k.lower() for k in spec.headers}
        # The provider the key's header belongs to: Anthropic's x-api-key, Azure's api-key, else a bearer key.
        provider = "anthropic" if "x-api-key" in names else "azure" if "api-key" in names else "openai"
        where = ", ".join(f"${v}" for v in KEY_VARIABLES[provider])
        sent = has_authorization(spec.headers) or bool(names & {"api-key", "x-api-key"})
        fix = (f"check {naming('api_key')} or the variable it comes from ({where}, an endpoints file's api_key_env)"
               if sent else f"no key was sent: pass {naming('api_key', 'KEY')} or set $OPENAI_API_KEY")
        raise StartRefused(f"{spec.name} refused the key (GET {probe.url}: HTTP 401): {fix}. Nothing was sent")


def _nothing_answers(specs: list[EndpointSpec], probes: list[Probe], wait_s: float, naming: Naming) -> str:
    urls = ", ".join(s.url for s in specs)
    why = "; ".join(f"GET {p.url}: {p.error}" for p in probes)
    waited = f" after waiting {wait_s:g} s" if wait_s else ""
    wait = naming("wait_for_endpoint", 120 if naming.keywords else "2m")  # seconds in Python, as the field is
    hint = ("is the server running, on that host and port? Start it or fix the URL; for a server that is "
            f"still starting pass {wait}")
    return f"nothing answers at {urls}{waited} ({why}): {hint}. Nothing was sent"
