"""One job over many workers and machines (docs/distributed.md).

- ``ray_runner``: ``carpool run --ray`` (``run_on_ray``, ``run_batch_on_ray``; the flags and
  the printing are ``carpool.commands.run``'s); ``shards``: the input plan and the merge;
  ``worker``: the Ray actor running the batch runner on one shard.
- ``ray_data``: ``carpool_map(ds, ...)`` inside an existing Ray Data pipeline.
- ``redis_budget``: ``RedisBudget``, an RPM/TPM budget shared by all workers (the
  ``carpool.client.budget.Budget`` interface); ``redis_cooldown``: ``RedisCooldown`` and
  ``SharedBalancer``, endpoint cooldowns shared by all workers; ``redis_client``: the
  connection both use.

Nothing is imported here, so ``import carpool.distributed.x`` pulls in only what x needs
(Ray only for the Ray modules).
"""
