"""Offline API: run a list of requests to completion and return the results in order."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from .config import EngineConfig
from .llm_engine import LLMEngine
from .protocol import GenerateRequest, RequestOutput, SamplingParams, TokenLogprob


class LLM:
    def __init__(self, config: EngineConfig | None = None, loaded: Any = None):
        self.engine = LLMEngine(config, loaded)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def reset_prefix_cache(self) -> int:
        """Forget the cached prompt blocks (as vLLM's ``LLM.reset_prefix_cache``)."""
        return self.engine.reset_prefix_cache()

    def generate(self, requests: Sequence[GenerateRequest | str] | str,
                 params: SamplingParams | None = None) -> list[RequestOutput]:
        """Requests (or plain prompt strings sharing ``params``) -> outputs in input order."""
        if isinstance(requests, str):
            requests = [requests]
        reqs: list[GenerateRequest] = []
        for i, r in enumerate(requests):
            if isinstance(r, str):
                r = GenerateRequest(request_id=f"offline-{i}", prompt=r, params=params or SamplingParams())
            reqs.append(r)
        seqs = [self.engine.make_sequence(r) for r in reqs]  # validate everything before running
        for s in seqs:
            self.engine.add_request(s)
        texts: dict[str, list[str]] = {s.request_id: [] for s in seqs}
        logprobs: dict[str, list[TokenLogprob]] = {s.request_id: [] for s in seqs}
        done: dict[str, Any] = {}
        submitted = time.monotonic()
        while self.engine.has_unfinished():
            for d in self.engine.step():
                texts[d.request_id].append(d.text)
                if d.logprobs:
                    logprobs[d.request_id].extend(d.logprobs)
                if d.finished:
                    done[d.request_id] = d
        outs = []
        for s in seqs:
            d = done[s.request_id]
            m = d.metrics or {}
            first, fin = m.get("first_token"), m.get("finished")
            start = min(submitted, s.arrival_time)
            outs.append(RequestOutput(
                request_id=s.request_id, prompt_token_ids=s.prompt_token_ids, token_ids=s.output_token_ids,
                text="".join(texts[s.request_id]), finish_reason=d.finish_reason, usage=d.usage,
                ttft_s=(first - start) if first else None, e2e_s=(fin - start) if fin else None,
                logprobs=logprobs[s.request_id] if s.params.logprobs is not None else None, error=d.error))
        return outs
