"""Everything a job checks before its first task is sent, so a mistake stops it at once.

``checks``: the one start-up check every entry point runs (the command line, the Python
API, a Ray driver, a provider's batch API): settings, endpoint URLs, template columns,
misspelt task keys; ``probe``: does anything answer at the endpoints, and under ``/v1``;
``model``: the model the job talks to, settled against the endpoints' ``/models``.
"""
