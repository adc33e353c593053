"""Which settings serve fastest under an SLO: a discrete-event simulator, cost models, the tuner.

``simulator`` with ``cost`` (roofline or profiled on this machine: ``profile``) runs what-ifs
(``carpool simulate``); ``tuner`` searches settings against evaluators (the simulator, the
in-process engine: ``engine_load``, ``carpool serve``: ``serve_eval``, an endpoint: ``http_eval``).
"""
