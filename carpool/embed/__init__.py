"""Sentence embeddings: the model and the batcher in front of it.

``embedder.Embedder`` runs all-MiniLM-L6-v2 (or a BERT-style folder) with plain
transformers; ``dynamic_batcher.DynamicBatcher`` groups concurrent requests into model
calls, Triton style.  The server's ``/v1/embeddings``, the in-process backend's embedding
tasks and the semantic cache use them; the generation engine does not, which is why they
live beside it rather than inside it.  Nothing is imported here: the embedder pulls in
torch and transformers, which a caller should pay for only when it embeds.
"""
