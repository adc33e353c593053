"""One request's state inside the engine: its tokens, KV blocks and timestamps."""

from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING

from .protocol import SamplingParams

if TYPE_CHECKING:
    import torch

    from .detokenizer import IncrementalDetokenizer
    from .guided import GrammarMatcher


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """Prompt + generated tokens.  ``num_computed_tokens`` of them have K/V in the cache.

    A sequence samples in a step exactly when that step computes its last token;
    after preemption ``num_computed_tokens`` drops to 0 and the prompt *and* the
    generated tokens are recomputed (the prefix cache usually makes that cheap).
    """

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 block_size: int, priority: int = 0, arrival_time: float | None = None,
                 extra_keys: object = None):
        self.request_id = request_id
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.priority = priority
        self.block_size = block_size
        self.extra_keys = extra_keys
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        self.block_table: list[int] = []
        self.num_registered_blocks = 0  # leading full blocks already offered to the prefix cache
        self._block_hashes: list[int] = []  # hash chain of the full blocks, grown lazily
        self.num_cached_tokens = 0  # prompt tokens served by the prefix cache at first admission
        self.admitted_once = False
        self.finish_reason: str | None = None
        self.generator: torch.Generator | None = None
        if params.seed is not None:
            # Imported here: the scheduler and block manager use this class, and the simulator
            # drives them on machines without torch; only a seeded request needs it.
            import torch

            self.generator = torch.Generator().manual_seed(int(params.seed))
        self.detokenizer: IncrementalDetokenizer | None = None
        self.grammar: GrammarMatcher | None = None  # structured outputs: the request's grammar state
        # Timestamps (time.monotonic) for metrics; queue waits accumulate across preemptions (lof).
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.waiting_since = self.arrival_time
        self.wait_accum = 0.0
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.finished_time: float | None = None

    # ----------------------------------------------------------------- tokens

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    # ------------------------------------------------------------- block hashes

    def block_hash(self, i: int) -> int:
        """Hash of full block ``i``: hash(parent hash, its token ids, extra keys)."""
        while len(self._block_hashes) <= i:
            j = len(self._block_hashes)
            parent = self._block_hashes[j - 1] if j else None
            tokens = tuple(self.token_ids[j * self.block_size:(j + 1) * self.block_size])
            assert len(tokens) == self.block_size, "only full blocks are hashed"
            self._block_hashes.append(hash((parent, tokens, self.extra_keys)))
        return self._block_hashes[i]

    # ------------------------------------------------------------------ waits

    def current_wait(self, now: float) -> float:
        """Total time spent waiting in the queue, counting earlier waits before preemptions."""
        if self.status is SequenceStatus.WAITING:
            return self.wait_accum + (now - self.waiting_since)
        return self.wait_accum

    def metrics(self) -> dict:
        first = self.first_scheduled_time
        return {
            "arrival": self.arrival_time,
            "first_scheduled": first,
            "first_token": self.first_token_time,
            "finished": self.finished_time,
            "queue_time_s": (first - self.arrival_time) if first is not None else None,
        }
