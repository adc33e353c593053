"""The prompt tokens the servers said they took from their prefix cache, per endpoint.

Every OpenAI-style answer may carry ``usage.prompt_tokens_details.cached_tokens``: the
prompt tokens the server did not compute again.  It is the one figure that tells a user
whether the order of the job (``carpool.jobs.input.prefix_order``) and the routing of its
groups (``carpool.client.affinity``) paid, so the progress line and the summary show it,
with the share of all prompt tokens, for each endpoint.  A server that does not report it
(vLLM before ``--enable-prompt-tokens-details``) is told apart from one that cached nothing.

Only chat and completion answers count: an embedding has no prefix cache to take tokens
from, and no server reports one for it, so counting it would shrink the share and make a
job of embeddings read as a server that keeps its figure back.  The summary names what
cached for the backend that ran: the server's prefix cache, or the embedded engine's.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class EndpointReuse:
    prompt_tokens: int = 0
    cached_tokens: int = 0
    answers: int = 0
    reported: int = 0  # answers that carried cached_tokens at all

    @property
    def share(self) -> float | None:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens and self.reported else None

    def to_dict(self) -> dict:
        share = self.share
        return {"prompt_tokens": self.prompt_tokens, "cached_prompt_tokens": self.cached_tokens,
                "cached_share": None if share is None else round(share, 4),
                "answers": self.answers, "answers_reporting_cached": self.reported}


@dataclass
class PromptReuse:
    """Per endpoint (its URL; "engine" for the in-process engine) and in all."""

    endpoints: dict[str, EndpointReuse] = field(default_factory=dict)

    def add(self, endpoint: str, prompt_tokens: int, cached_tokens: int, reported: bool, kind: str = "chat") -> None:
        """One answer the backend gave; ``kind``: its task's (embeddings are not counted)."""
        if kind == "embedding":
            return
        e = self.endpoints.get(endpoint)
        if e is None:
            e = self.endpoints[endpoint] = EndpointReuse()
        e.prompt_tokens += prompt_tokens
        e.cached_tokens += cached_tokens
        e.answers += 1
        e.reported += bool(reported)

    def total(self) -> EndpointReuse:
        t = EndpointReuse()
        for e in self.endpoints.values():
            t.prompt_tokens += e.prompt_tokens
            t.cached_tokens += e.cached_tokens
            t.answers += e.answers
            t.reported += e.reported
        return t

    def progress_text(self) -> str:
        """``, prefix cache 61%`` for the progress line (each endpoint's share after it when
        there are several: ``(e1 70% e2 52%)``), or "" while no server reported it."""
        share = self.total().share
        if share is None:
            return ""
        text = f", prefix cache {share:.0%}"
        if len(self.endpoints) > 1:
            each = [f"e{i} {e.share:.0%}" if e.share is not None else f"e{i} -"
                    for i, e in enumerate(self.endpoints.values(), 1)]
            text += f" ({' '.join(each)})"
        return text

    def summary_row(self, backend: str) -> tuple[str, str]:
        """The summary's row, named for the ``backend`` that ran (``JobStats.backend``): in all,
        then per endpoint when there are several."""
        if backend.startswith("engine"):
            return "prompt tokens from the engine's prefix cache", self._text("not reported by the engine")
        if backend == "echo":  # no model, no cache
            return "prompt tokens from a prefix cache", "-"
        return "prompt tokens cached by the server", \
            self._text("not reported by the server (vLLM: --enable-prompt-tokens-details)")

    def _text(self, unreported: str) -> str:
        t = self.total()
        if not t.answers:
            return "-"
        if not t.reported:
            return unreported
        text = f"{t.cached_tokens:,} of {t.prompt_tokens:,} ({t.share:.0%})"
        if len(self.endpoints) > 1:
            text += "; " + ", ".join(f"{url or 'engine'} {e.share:.0%}" if e.share is not None
                                     else f"{url or 'engine'} -" for url, e in self.endpoints.items())
        return text

    def to_dict(self) -> dict:
        return {**self.total().to_dict(), "endpoints": {url: e.to_dict() for url, e in self.endpoints.items()}}
