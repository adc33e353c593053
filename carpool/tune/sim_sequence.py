"""A request inside the simulated server: the engine's ``Sequence`` with counted tokens.

The simulator runs the engine's own scheduler and block manager, which read how many tokens
a sequence has and has computed, and the hashes of its full blocks, never the token values.
So a list of zeros of the right length stands for the tokens, and the block hashes come from
the workload's block keys (equal across requests exactly when their tokens would be): prefix
caching hits as it would on real prompts, without making those prompts and hashing them.
"""

from __future__ import annotations

from carpool.engine.protocol import SamplingParams
from carpool.engine.sequence import Sequence
from carpool.tune.workload import SimRequest

# The engine reads a sequence's sampling parameters only to sample and to stop; the simulator
# does both itself (one token per step until the request's output length), so all share these.
_PARAMS = SamplingParams()


class SimSequence(Sequence):
    """One simulated request: what the engine keeps for it, plus what the client saw.

    ``submit`` is when it reached the server (later than its arrival when the client's
    concurrency cap held it back); it is the sequence's arrival time for the scheduler.
    """

    def __init__(self, req: SimRequest, submit: float, block_size: int, keys: list[tuple]):
        super().__init__(req.request_id, [0] * req.prompt_len, _PARAMS, block_size, req.priority, submit)
        self.req = req
        self.submit = submit
        self.block_hashes = [hash(k) for k in keys]
        self.preemptions = 0
        self.error: str | None = None

    def block_hash(self, i: int) -> int:
        return self.block_hashes[i]
