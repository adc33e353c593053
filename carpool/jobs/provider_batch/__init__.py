"""``carpool run`` through a provider's batch API (OpenAI, Azure OpenAI, Anthropic).

``spread.ProviderBatches`` is the ``Spread`` the job's ``Runner`` runs; its settings are
``carpool.jobs.options.BatchApiOptions``.

The job is cut at the provider's limits (``limits``), each piece is submitted as one
provider batch (``openai_client``, ``anthropic_client``), polled with backoff, and its
results are written into the same output file an online run writes (the journal,
``carpool.journal``).  Which tasks each submitted batch holds is kept beside the
output (``state``), written before and after each create, so a run killed at any moment
is resumed by the same command without submitting any task twice (``job``).
"""
