"""What ``LLM.encode`` / ``score`` / ``classify`` answer with the models carpool has, in vLLM's shapes.

vLLM runs these on pooling models (an embedding model, a cross-encoder, a sequence
classifier).  carpool ships one embedding model and one generation model, so:

- ``encode``: the embedding model's pooled vector (``outputs.data``, a tensor), as
  ``embed`` gives it;
- ``score``: the cosine similarity of two texts' embeddings, what vLLM computes when its
  ``score`` runs on an embedding model (there is no cross-encoder to ask);
- ``classify``: a generation model choosing among labels the caller names, each label
  scored by the log-probability the model gives its tokens after the prompt (the label is
  forced with a one-choice grammar; the logprobs are the raw model's, before the mask),
  normalized over the labels.  vLLM classifies with a model's own classification head,
  which carpool's models do not have.

Anything else is refused with what would answer it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from .protocol import GenerateRequest, RequestOutput, SamplingParams, StructuredOutputs

Prompt = str | Sequence[dict]  # text, or a conversation through the chat template


@dataclass
class PoolingOutput:
    data: Any  # torch.Tensor: the pooled vector


@dataclass
class PoolingRequestOutput:
    """vLLM's ``PoolingRequestOutput``: ``outputs.data``."""

    request_id: str
    prompt: str
    prompt_token_ids: list[int]
    outputs: PoolingOutput
    finished: bool = True


@dataclass
class ScoringOutput:
    score: float


@dataclass
class ScoringRequestOutput:
    """vLLM's ``ScoringRequestOutput``: ``outputs.score`` for one (text_1, text_2) pair."""

    request_id: str
    prompt: str  # the pair, as "text_1 / text_2"
    prompt_token_ids: list[int]
    outputs: ScoringOutput
    finished: bool = True


@dataclass
class ClassificationOutput:
    """vLLM's ``ClassificationOutput`` (``probs``, ``num_classes``) and the labels they are of."""

    probs: list[float]
    labels: list[str]
    logprobs: list[float]  # each label's summed token log-probability

    @property
    def num_classes(self) -> int:
        return len(self.probs)

    @property
    def label(self) -> str:
        return self.labels[max(range(len(self.probs)), key=self.probs.__getitem__)]


@dataclass
class ClassificationRequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: ClassificationOutput
    finished: bool = True


def score_pairs(text_1: str | Sequence[str], text_2: str | Sequence[str]) -> list[tuple[str, str]]:
    """vLLM's pairing: one against one, one against each of many, or many against as many."""
    first = [text_1] if isinstance(text_1, str) else list(text_1)
    second = [text_2] if isinstance(text_2, str) else list(text_2)
    if len(first) == 1:
        return [(first[0], t) for t in second]
    if len(first) != len(second):
        raise ValueError(f"score: {len(first)} first texts for {len(second)} second ones; give one first text, "
                         "or as many as second ones")
    return list(zip(first, second, strict=True))


def cosine(a: Any, b: Any) -> float:
    na, nb = float((a * a).sum()) ** 0.5, float((b * b).sum()) ** 0.5
    return float((a * b).sum()) / max(na * nb, 1e-12)


def check_labels(labels: Sequence[str] | None) -> list[str]:
    if not labels:
        raise ValueError("classify: a generation model chooses among labels you name: "
                         "classify(prompts, labels=['positive', 'negative'])")
    out = list(labels)
    if not all(isinstance(x, str) and x for x in out) or len(set(out)) != len(out):
        raise ValueError(f"classify: labels must be distinct non-empty strings, got {out!r}")
    return out


def label_requests(prompt: Prompt, labels: list[str], max_label_tokens: int,
                   next_id: Callable[[], str]) -> list[GenerateRequest]:
    """One greedy request per label, its output forced to be exactly that label, with logprobs."""
    out = []
    for label in labels:
        params = SamplingParams(temperature=0.0, max_tokens=max_label_tokens, logprobs=0,
                                structured_outputs=StructuredOutputs(choice=[label]))
        if isinstance(prompt, str):
            out.append(GenerateRequest(request_id=next_id(), prompt=prompt, params=params))
        else:
            out.append(GenerateRequest(request_id=next_id(), messages=[dict(m) for m in prompt], params=params))
    return out


def label_logprob(output: RequestOutput, label: str) -> float:
    """The summed log-probability of the tokens that spell ``label`` (the end token left out)."""
    if output.error or not output.logprobs:
        raise RuntimeError(f"classify: scoring the label {label!r} failed: {output.error or 'no logprobs'}")
    want, got, total = label.encode(), b"", 0.0
    for entry in output.logprobs:
        if got == want:
            break
        got += bytes(entry.bytes)
        total += entry.logprob
    return total


def softmax(logprobs: list[float]) -> list[float]:
    top = max(logprobs)
    weights = [math.exp(x - top) for x in logprobs]
    total = sum(weights)
    return [w / total for w in weights]
