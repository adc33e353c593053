"""The ``--batch-*`` flags of ``carpool run`` and the ``BatchApiOptions`` they (or an
endpoints file with a ``*-batch`` kind) make."""

from __future__ import annotations

import argparse
import os

from carpool.errors import StartRefused
from carpool.jobs.options import KEY_VARIABLES, KINDS, PROVIDERS, BatchApiOptions

# Where each provider is when --endpoint does not say.
DEFAULT_URLS = {"openai": "https://api.openai.com/v1", "anthropic": "https://api.anthropic.com"}


def add_batch_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("batch API (half price, results within the completion window)")
    g.add_argument("--batch-api", choices=PROVIDERS,
                   help="submit the job through this provider's batch API at --endpoint (default: the "
                        "provider's own URL); an endpoints file selects it with kind: openai-batch, "
                        "azure-batch or anthropic-batch. Kill it at any time: the same command picks up "
                        "the submitted batches")
    g.add_argument("--batch-poll", type=float, default=10.0, metavar="SECONDS",
                   help="first wait between two polls of a batch; it grows 1.5x while nothing changes, up to "
                        "--batch-max-poll (default 10)")
    g.add_argument("--batch-max-poll", type=float, default=300.0, metavar="SECONDS",
                   help="longest wait between two polls of a batch (default 300)")
    g.add_argument("--batch-max-requests", type=int, metavar="N",
                   help="requests per batch (default and maximum: the provider's, 50,000 OpenAI, 100,000 Anthropic)")
    g.add_argument("--batch-max-bytes", type=int, metavar="N",
                   help="bytes per batch (default and maximum: 200 MB OpenAI, 256 MB Anthropic)")
    g.add_argument("--batch-max-attempts", type=int, default=3, metavar="N",
                   help="submissions of a request that comes back expired or with a transient error before "
                        "its error line is written (default 3)")
    g.add_argument("--batch-online-fallback", action="store_true",
                   help="send requests that come back expired or with a transient error online instead of "
                        "in a new batch (OpenAI and Azure)")


def batch_options(args: argparse.Namespace, specs: list) -> BatchApiOptions | None:
    """The batch options asked for, None for an online job; ``StartRefused`` for a bad mix."""
    batch_specs = [s for s in specs if s.kind in KINDS]
    if batch_specs and len(specs) > 1:
        raise StartRefused(f"--endpoints: an endpoint of kind {batch_specs[0].kind} must be the file's only "
                           "endpoint (a batch goes to one provider)")
    if args.batch_api and specs:
        raise StartRefused("--batch-api and --endpoints: give one; in the file, write kind: "
                           f"{args.batch_api}-batch")
    if not args.batch_api and not batch_specs:
        return None
    if args.ray is not None:
        raise StartRefused("--ray and a batch API: give one; a batch API runs the whole job at the provider")
    if not args.batch_poll > 0 or args.batch_max_attempts < 1:
        raise StartRefused("--batch-poll must be a positive number of seconds and --batch-max-attempts at least 1")
    tuning = dict(max_requests=args.batch_max_requests, max_bytes=args.batch_max_bytes, poll_s=args.batch_poll,
                  max_poll_s=max(args.batch_poll, args.batch_max_poll), max_attempts=args.batch_max_attempts,
                  online_fallback=args.batch_online_fallback,
                  default_max_tokens=args.max_tokens or args.max_completion_tokens or 4096,
                  http_attempts=args.max_attempts)
    if batch_specs:
        s = batch_specs[0]
        model = s.deployment or s.model if s.kind == "azure-batch" else s.model
        return BatchApiOptions(KINDS[s.kind], s.url, dict(s.headers), model, s.api_version, **tuning)
    provider = args.batch_api
    if len(args.endpoint) > 1:
        raise StartRefused("--batch-api: give one --endpoint (a batch goes to one provider)")
    url = args.endpoint[0] if args.endpoint else DEFAULT_URLS.get(provider)
    if url is None:
        raise StartRefused("--batch-api azure: give --endpoint https://NAME.openai.azure.com")
    key = args.api_key or next((os.environ[v] for v in KEY_VARIABLES[provider] if os.environ.get(v)), None)
    auth = {} if not key else {"x-api-key": key} if provider == "anthropic" else \
        {"api-key": key} if provider == "azure" else {"Authorization": f"Bearer {key}"}
    headers = {**auth, **_plain_headers(args.header)}
    return BatchApiOptions(provider, url, headers, args.model, args.api_version, **tuning)


def _plain_headers(values: list[str]) -> dict[str, str]:
    out = {}
    for v in values:
        name, _, value = v.partition(":")
        out[name.strip()] = value.strip()
    return out
