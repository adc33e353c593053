"""Answers a job does not pay for twice.

``task_cache.TaskCache`` is the one place that asks "was this task answered already?":
the result caches as a job sees them (``caches``: the exact store and the semantic
cache) and an identical task already in flight (``dedup``).
"""
