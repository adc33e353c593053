"""Iteration-level scheduler: which sequences run this step, and how many tokens each.

Every step, within ``max_num_seqs`` running sequences and ``max_num_batched_tokens``
tokens: running decodes first (one token each), then running prefills continue with
a chunk, then waiting sequences are admitted with a chunk of what is left of the
budget.  When the KV cache runs out, the lowest-ranked running sequence is preempted
by recompute: its blocks are freed and it goes back to waiting with all its tokens.
Foreground work ranks before background work (the server's batch lines) under every
policy, and a foreground request that finds no seat or no block free preempts the
last-ranked background sequence, so a batch never holds an online request back.

The waiting queue is a heap keyed by the policy, so a step costs O(admitted x log waiting),
not O(waiting): a job may hand the engine 100k requests at once
(benchmarks/scheduler_scale.py measures a step at 100 and 100k waiting).
"""

from __future__ import annotations

import heapq
import itertools
import time
from dataclasses import dataclass, field
from typing import NamedTuple

from .block_manager import BlockManager
from .protocol import BACKGROUND_PRIORITY
from .sequence import Sequence, SequenceStatus

POLICIES = ("fcfs", "priority", "lof")


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)  # decodes first
    num_decode_tokens: int = 0
    num_prefill_tokens: int = 0
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return self.num_decode_tokens + self.num_prefill_tokens

    def sampling(self) -> list[Sequence]:
        """The scheduled sequences that sample a token this step: those whose chunk reaches their
        last token (a prefill chunk short of the prompt's end samples nothing).  Asked before
        ``update_from_output``, which moves their computed tokens on."""
        return [seq for seq, n in self.scheduled if seq.num_computed_tokens + n == seq.num_tokens]


class SampledToken(NamedTuple):
    """A token a step sampled for ``seq``, and whether it ends the sequence.

    The stop decision is the caller's: the engine reads it from the request's stop rules
    (EOS, stop strings, max_tokens, a finished grammar), a simulator from the output length
    it was given; the scheduler only records it.  A tuple: the simulators make one per
    sampled token, hundreds of thousands a run, and a tuple is made in half the time."""

    seq: Sequence
    token: int
    finish_reason: str | None = None


class WaitingQueue:
    """Waiting sequences in policy order: a heap with lazy removal.

    Every policy's order is fixed when a sequence is queued: fcfs (arrival, queue order),
    priority (priority, arrival, queue order) and lof by the moment its total wait began,
    ``waiting_since - wait_accum`` (longest total wait first: ``current_wait(now)`` is
    ``now`` minus that for every waiting sequence, so the order does not change while
    they wait).  A removed sequence's entry stays in the heap, marked dead, until popped.
    """

    def __init__(self, policy: str):
        self.policy = policy
        self._heap: list[list] = []
        self._entries: dict[int, list] = {}  # id(seq) -> its live heap entry
        self._count = itertools.count()

    def _key(self, seq: Sequence) -> tuple:
        # Foreground before background under every policy (the first field): a batch line that
        # waited longer still comes after an online request.
        background = seq.priority >= BACKGROUND_PRIORITY
        if self.policy == "priority":
            return (background, seq.priority, seq.arrival_time)
        if self.policy == "lof":
            return (background, seq.waiting_since - seq.wait_accum, seq.arrival_time)
        return (background, seq.arrival_time)

    def push(self, seq: Sequence, order: int) -> None:
        """``order``: the scheduler's arrival counter, the tie-break after the policy's key."""
        entry = [*self._key(seq), order, next(self._count), seq]
        self._entries[id(seq)] = entry
        heapq.heappush(self._heap, entry)

    def _drop_dead(self) -> None:
        while self._heap and self._heap[0][-1] is None:
            heapq.heappop(self._heap)

    def peek(self) -> Sequence:
        """The first in order; like ``pop``, only on a queue that is not empty."""
        self._drop_dead()
        return self._heap[0][-1]

    def pop(self) -> Sequence:
        self._drop_dead()
        seq = heapq.heappop(self._heap)[-1]
        del self._entries[id(seq)]
        return seq

    def remove(self, seq: Sequence) -> bool:
        """Take ``seq`` out (O(1)); False when it was not waiting."""
        entry = self._entries.pop(id(seq), None)
        if entry is None:
            return False
        entry[-1] = None
        return True

    def __contains__(self, seq: Sequence) -> bool:
        return id(seq) in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def __bool__(self) -> bool:
        return bool(self._entries)

    def __iter__(self):
        """The waiting sequences in policy order (sorts: for tests and inspection, not per step)."""
        return iter([e[-1] for e in sorted(self._entries.values())])


# Prompt tokens of background work (batch lines) computed per step at most.  An online request
# that arrives mid-step waits for that step to end; a step holding a long background prefill
# chunk would add its whole cost to the online request's time to first token.  Small chunks
# keep that wait short while the batch still moves every step.  This bounds a latency, it
# picks no kernel route: the cost of a token differs by machine, the order of magnitude of a
# 128-token chunk next to a decode step does not.
BACKGROUND_CHUNK = 128


def _is_decode(seq: Sequence, n: int) -> bool:
    return n == 1 and seq.num_output_tokens > 0 and seq.num_computed_tokens + 1 == seq.num_tokens


def _yield_background(out: SchedulerOutput) -> None:
    """Take background sequences (priority >= BACKGROUND_PRIORITY) out of a step that computes
    a foreground prompt: that step then costs what it would on an idle engine, which is what
    the foreground request's time to first token is made of.  They stay running with their
    blocks (``allocate`` only grows a table to the tokens computed, so the next step allocates
    nothing again) and go on in the next step.  A step that could not fit the foreground
    prefill keeps them, so they never wait on a request that cannot run."""
    if not any(seq.priority < BACKGROUND_PRIORITY and not _is_decode(seq, n) for seq, n in out.scheduled):
        return
    kept = []
    for seq, n in out.scheduled:
        if seq.priority < BACKGROUND_PRIORITY:
            kept.append((seq, n))
        elif _is_decode(seq, n):
            out.num_decode_tokens -= 1
        else:
            out.num_prefill_tokens -= n
    out.scheduled = kept


def _finished(out: SchedulerOutput) -> SchedulerOutput:
    _yield_background(out)
    # The model runner wants single-token queries first.
    out.scheduled.sort(key=lambda sn: sn[1] != 1)
    return out


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 policy: str = "fcfs", enable_chunked_prefill: bool = True,
                 background_chunk: int = BACKGROUND_CHUNK):
        if policy not in POLICIES:
            raise ValueError(f"scheduling_policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.policy = policy
        self.chunked = enable_chunked_prefill
        self.background_chunk = background_chunk
        self.waiting = WaitingQueue(policy)
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self._counter = 0  # arrival order, to break ties deterministically
        self._order: dict[int, int] = {}

    # ------------------------------------------------------------- queue ops

    def add(self, seq: Sequence) -> None:
        self._order[id(seq)] = self._counter
        self._counter += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.push(seq, self._order[id(seq)])

    def _key(self, now: float):
        """The running sequences' rank (the waiting queue's order): foreground before background,
        then the policy's order; the last ranked is the first to give its blocks back."""
        order = self._order
        bg = BACKGROUND_PRIORITY
        if self.policy == "priority":
            return lambda s: (s.priority >= bg, s.priority, s.arrival_time, order[id(s)])
        if self.policy == "lof":
            return lambda s: (s.priority >= bg, -s.current_wait(now), s.arrival_time, order[id(s)])
        return lambda s: (s.priority >= bg, s.arrival_time, order[id(s)])

    def finish(self, seq: Sequence, reason: str, now: float | None = None) -> None:
        """End a sequence (``reason``: "stop", "length", "abort", "error"): out of the queues,
        its blocks freed.  ``now``: the time it ended (default the monotonic clock)."""
        if seq.status is SequenceStatus.RUNNING and seq in self.running:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        self.bm.free_seq(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.finished_time = time.monotonic() if now is None else now
        self._order.pop(id(seq), None)

    def update_from_output(self, scheduled: list[tuple[Sequence, int]], sampled: list[SampledToken],
                           now: float | None = None) -> list[Sequence]:
        """Record a step that ran: each scheduled (sequence, n) has ``n`` more tokens computed and
        its newly full blocks join the prefix cache; each sampled token is appended to its
        sequence, and a sequence it ends leaves.  The sequences that finished, in ``sampled``
        order.  The engine and the simulators all move a step on through here, so what a step
        leaves behind is the same whether a model ran it or a cost model timed it.

        ``now``: when the step ended (default the monotonic clock; a simulator passes its own),
        the time of a first token and of a finish."""
        now = time.monotonic() if now is None else now
        for seq, n in scheduled:
            seq.num_computed_tokens += n
            self.bm.cache_full_blocks(seq)
        finished = []
        for s in sampled:
            seq = s.seq
            # Sampling reads the logits of the last token: only a chunk that reached it samples.
            assert seq.num_computed_tokens == seq.num_tokens, f"{seq.request_id} sampled before its last token"
            seq.token_ids.append(s.token)
            if seq.first_token_time is None:
                seq.first_token_time = now
            if s.finish_reason is not None:
                self.finish(seq, s.finish_reason, now)
                finished.append(seq)
        return finished

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _evict_background(self, out: SchedulerOutput, now: float) -> int | None:
        """Preempt the last-ranked running background sequence for a foreground one that has no
        seat or no blocks: a batch line's sequences hold the engine for minutes, an online
        request must not wait that long.  The victim leaves this step too; the tokens of the
        step's budget it held (None: no background sequence runs).  Its full blocks stay in the
        prefix cache, so taking it up again mostly hits."""
        victims = [seq for seq in self.running if seq.priority >= BACKGROUND_PRIORITY]
        if not victims:
            return None
        victim = max(victims, key=self._key(now))
        self.running.remove(victim)
        freed = 0
        for i, (seq, n) in enumerate(out.scheduled):
            if seq is victim:
                del out.scheduled[i]
                if _is_decode(seq, n):
                    out.num_decode_tokens -= 1
                else:
                    out.num_prefill_tokens -= n
                freed = n
                break
        self._preempt(victim, now)
        out.preempted.append(victim)
        return freed

    def _preempt(self, seq: Sequence, now: float) -> None:
        self.bm.free_seq(seq)
        seq.status = SequenceStatus.WAITING
        seq.waiting_since = now
        self.waiting.push(seq, self._order[id(seq)])
        self.num_preemptions += 1

    # -------------------------------------------------------------- schedule

    def _pending_blocks(self, scheduled: list[tuple[Sequence, int]]) -> set[int]:
        """Hashes of the blocks that become full and computed when ``scheduled`` runs."""
        if not self.bm.enable_prefix_caching:
            return set()
        bs = self.bm.block_size
        return {seq.block_hash(i) for seq, n in scheduled if n > 1
                for i in range(seq.num_computed_tokens // bs, (seq.num_computed_tokens + n) // bs)}

    def _next_block_pending(self, seq: Sequence, num_cached_blocks: int, pending: set[int]) -> bool:
        full = (seq.num_tokens - 1) // self.bm.block_size  # blocks that could hit (see match_prefix)
        return num_cached_blocks < full and seq.block_hash(num_cached_blocks) in pending

    def schedule(self, now: float | None = None) -> SchedulerOutput:
        """One step's batch.  ``now``: the time of the step (default the monotonic clock); the
        simulator passes its simulated time, so queue waits are counted on its clock."""
        now = time.monotonic() if now is None else now
        out = SchedulerOutput()
        budget, background_left = self._schedule_running(out, now)
        # Admit waiting sequences (not in a step that had to preempt: memory is tight).
        if not out.preempted:
            self._admit_waiting(out, budget, background_left, now)
        return _finished(out)

    def _schedule_running(self, out: SchedulerOutput, now: float) -> tuple[int, int]:
        """The running sequences' share of the step; the token budget and background prefill
        tokens left for waiting ones."""
        budget = self.max_num_batched_tokens
        key = self._key(now)
        self.running.sort(key=key)
        # Decodes first, then unfinished prefills; both in policy order. Victims come off the end.
        queue = [s for s in self.running if s.num_uncomputed == 1] + \
                [s for s in self.running if s.num_uncomputed != 1]
        kept: list[Sequence] = []
        background_left = self.background_chunk if self.chunked else budget
        while queue:
            seq = queue.pop(0)
            n = min(seq.num_uncomputed, budget)
            if n > 1 and seq.priority >= BACKGROUND_PRIORITY:
                n = min(n, background_left)
            if n <= 0 or (not self.chunked and n < seq.num_uncomputed):
                kept.append(seq)  # no budget left this step; it stays running
                continue
            while self.bm.blocks_needed(seq, n) > self.bm.num_free_blocks:
                if queue:
                    victim = queue.pop()
                    self._preempt(victim, now)
                    out.preempted.append(victim)
                else:
                    break
            if self.bm.blocks_needed(seq, n) > self.bm.num_free_blocks:
                self._preempt(seq, now)
                out.preempted.append(seq)
                continue
            self.bm.allocate(seq, n)
            kept.append(seq)
            out.scheduled.append((seq, n))
            budget -= n
            if n == 1 and seq.num_output_tokens > 0 and seq.num_computed_tokens + 1 == seq.num_tokens:
                out.num_decode_tokens += 1
            else:
                out.num_prefill_tokens += n
                if seq.priority >= BACKGROUND_PRIORITY:
                    background_left -= n
        self.running = kept
        return budget, background_left

    def _admit_waiting(self, out: SchedulerOutput, budget: int, background_left: int, now: float) -> None:
        # Full blocks this step's prefills compute: a waiting sequence whose next block is one
        # of them (n choices of one prompt, a shared system prompt) waits a step and then hits
        # the prefix cache instead of computing the same block twice in one forward.
        pending = self._pending_blocks(out.scheduled)
        deferred: list[Sequence] = []
        while self.waiting and budget > 0:
            seq = self.waiting.peek()
            foreground = seq.priority < BACKGROUND_PRIORITY
            if len(self.running) >= self.max_num_seqs:
                freed = self._evict_background(out, now) if foreground else None
                if freed is None:
                    break
                budget += freed
                continue
            cached = self.bm.match_prefix(seq)
            if pending and self._next_block_pending(seq, len(cached), pending):
                deferred.append(self.waiting.pop())
                if len(deferred) >= self.max_num_seqs:
                    break  # a step looks at O(max_num_seqs) waiting sequences, not the whole queue
                continue
            num_cached = len(cached) * self.bm.block_size
            remaining = seq.num_tokens - num_cached
            n = min(remaining, budget)
            if seq.priority >= BACKGROUND_PRIORITY:
                n = min(n, background_left)
                if n <= 0:  # this step's background prefill is spent: foreground ones may still join
                    deferred.append(self.waiting.pop())
                    if len(deferred) >= self.max_num_seqs:
                        break
                    continue
            if not self.chunked and n < remaining:
                break
            if self.bm.blocks_needed(seq, n, cached) > self.bm.num_free_blocks:
                freed = self._evict_background(out, now) if foreground else None
                if freed is None:
                    break
                budget += freed
                continue
            self.waiting.pop()
            self.bm.prefix_queries += seq.num_tokens
            self.bm.prefix_hits += num_cached
            if not seq.admitted_once:
                seq.num_cached_tokens = min(num_cached, seq.num_prompt_tokens)
                seq.first_scheduled_time = now
                seq.admitted_once = True
            seq.wait_accum += now - seq.waiting_since
            self.bm.attach_cached(seq, cached)
            self.bm.allocate(seq, n)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append((seq, n))
            out.num_prefill_tokens += n
            budget -= n
            if seq.priority >= BACKGROUND_PRIORITY:
                background_left -= n
            if self.bm.enable_prefix_caching:
                pending |= self._pending_blocks([(seq, n)])
        for seq in deferred:
            self.waiting.push(seq, self._order[id(seq)])
