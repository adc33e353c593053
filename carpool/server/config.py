"""Server settings (vLLM's names for the engine's, Triton's for the embedding batcher's)."""

from __future__ import annotations

from dataclasses import dataclass, field

from carpool.engine.config import EngineConfig


@dataclass
class ServerConfig:
    engine: EngineConfig = field(default_factory=EngineConfig)
    host: str = "127.0.0.1"
    port: int = 8000  # 0: any free port (the bound one is in the start_server handle)
    served_model_names: list[str] = field(default_factory=list)  # empty: the --model value
    # Bearer keys taken (none: no check).  Each key is a project of its own: it sees only the
    # files and batches created with it (server/owners.py).  ``api_key`` is one more.
    api_key: str | None = None
    api_keys: list[str] = field(default_factory=list)
    # admission control (generation): waiting = admitted, no token out yet
    max_queue_size: int | None = 1024
    max_queued_tokens: int | None = None
    max_n: int = 16  # largest accepted `n`
    # prompts x n one request may ask for (each is an engine sequence); OpenAI caps n at 128
    # and vLLM's default batch is 256 sequences: one request may fill a batch, not a thousand.
    max_choices_per_request: int | None = 256
    # embeddings; embedding_model None disables /v1/embeddings
    embedding_model: str | None = "all-MiniLM-L6-v2"
    max_queue_delay_us: int = 2000
    preferred_batch_sizes: list[int] = field(default_factory=lambda: [8, 16, 32, 64])
    max_batch_tokens: int = 8192
    embedding_queue_timeout_ms: int = 30000
    embedding_max_queue_size: int | None = None  # None: max_queue_size
    client_max_size_mb: int = 32  # largest request body
    # Grammar compiles (server/grammar_gate.py): on their own threads, each bounded in source
    # size and in time; a grammar past either bound is a 400 naming its field.
    grammar_timeout_s: float = 10.0
    max_grammar_bytes: int = 512 * 1024
    grammar_workers: int = 2
    grammar_max_waiting: int = 16
    # Connection hygiene (server/connections.py): a connection with no request for this long
    # (idle between requests, or never sending one whole) is closed; a body must arrive
    # within body_timeout_s; past max_connections open ones a new one gets a 503.
    idle_timeout_s: float = 60.0
    body_timeout_s: float = 60.0
    max_connections: int | None = None  # None: from the file-descriptor limit
    # Files and Batches API (server/batches.py): the store's directory (None: <cache dir>/batches),
    # OpenAI's limits per input file, and how many batch requests may be prepared or running at
    # once (all batches together; online requests always come first).
    batch_dir: str | None = None
    max_batch_file_bytes: int = 200 * 1000 * 1000
    max_batch_requests: int = 50_000
    batch_max_inflight: int = 8
    # Engine sequences batch requests may hold at once (None: batch_budget.BATCH_SHARE of the
    # engine's max_num_seqs); their KV tokens are bounded to that share of the cache too.
    batch_max_seqs: int | None = None

    def keys(self) -> list[str]:
        """Every key the server takes."""
        return [*self.api_keys, *([self.api_key] if self.api_key else [])]

    def model_names(self) -> list[str]:
        return list(self.served_model_names) or [self.engine.model]
