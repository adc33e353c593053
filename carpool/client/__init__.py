"""The async client: one request to its final outcome, over HTTP or the in-process engine.

``executor`` (budget, concurrency slot, call, retries) over a ``Backend``: ``http_backend``
(aiohttp pool, streaming, endpoint ``balancer``) or ``engine_backend``; ``limiter``
(fixed / adaptive concurrency), ``budget`` (RPM/TPM), ``retry`` (error kinds and what may
be sent again), ``base`` (the request and result types).
"""
