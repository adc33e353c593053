"""Offline API, shaped as vLLM's ``LLM``: run a list of requests to completion, in order.

::

    from carpool.engine import LLM, SamplingParams

    llm = LLM(model="smollm2")
    outs = llm.chat([{"role": "user", "content": "Say hi"}], SamplingParams(max_tokens=16))
    outs[0].outputs[0].text

- ``LLM(model=..., **engine_args)``: the engine arguments are ``EngineConfig``'s, which
  carry vLLM's names (``dtype``, ``max_model_len``, ``max_num_seqs``, ``seed``,
  ``quantization``, ``kv_cache_dtype``, ``enable_prefix_caching``...).  An
  ``EngineConfig`` may be given instead, as the first argument.
- ``generate(prompts, sampling_params)`` and ``chat(messages, sampling_params)`` return one
  ``GenerationOutput`` per prompt / conversation: vLLM's ``RequestOutput`` fields
  (``request_id``, ``prompt``, ``prompt_token_ids``, ``outputs[0].text`` / ``.token_ids`` /
  ``.finish_reason``, ``finished``) plus carpool's own (``usage``, ``ttft_s``, ``e2e_s``).
  ``sampling_params``: a ``SamplingParams``, a dict of its fields, or a list of either (one
  per prompt).
  ``structured_outputs`` takes a ``StructuredOutputs`` (also exported as vLLM's name,
  ``StructuredOutputsParams``), a dict of its fields, or vLLM's own object.
- ``embed(prompts)``: for an embedding model (``LLM(model="all-MiniLM-L6-v2")``, the one
  ``carpool serve`` answers ``/v1/embeddings`` with), one ``EmbeddingRequestOutput`` per
  prompt with ``outputs.embedding``; a generation model refuses it, as vLLM's does.
- ``encode(prompts)`` (the embedding model's pooled vectors), ``score(text_1, text_2)``
  (cosine similarity of embeddings) and ``classify(prompts, labels=[...])`` (a generation
  model choosing among named labels, by the log-probability of each): ``llm_tasks``.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from . import llm_tasks
from .config import EngineConfig
from .protocol import GenerateRequest, RequestOutput, SamplingParams, StructuredOutputs, TokenLogprob

_ENGINE_ARGS = {f.name for f in fields(EngineConfig)}
# Names of the packaged embedding model (carpool.embed.embedder.MINILM_NAMES, lower case).
_EMBEDDING_MODELS = {"all-minilm-l6-v2", "sentence-transformers/all-minilm-l6-v2", "minilm"}
Params = SamplingParams | dict | None


@dataclass
class CompletionOutput:
    """One generated sequence (vLLM's ``CompletionOutput``).  ``logprobs``: carpool's
    ``TokenLogprob`` per token when asked for (``SamplingParams(logprobs=k)``)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[TokenLogprob] | None = None
    stop_reason: str | int | None = None

    @property
    def cumulative_logprob(self) -> float | None:
        return sum(t.logprob for t in self.logprobs) if self.logprobs else None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class GenerationOutput(RequestOutput):
    """vLLM's ``RequestOutput`` shape (``prompt``, ``outputs``, ``finished``) over carpool's
    (``text``, ``token_ids``, ``usage``... of the one sequence)."""

    prompt: str | None = None
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = True


@dataclass
class EmbeddingOutput:
    embedding: list[float]


@dataclass
class EmbeddingRequestOutput:
    """vLLM's ``EmbeddingRequestOutput``: ``outputs.embedding`` (a unit vector)."""

    request_id: str
    prompt: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True


def _params(sampling_params: Params | Sequence[Params], n: int) -> list[SamplingParams]:
    """One SamplingParams per prompt, from one (shared) or a list."""
    if isinstance(sampling_params, list | tuple):
        if len(sampling_params) != n:
            raise ValueError(f"sampling_params: {len(sampling_params)} given for {n} prompts; give one, "
                             "or one per prompt")
        return [_one(p) for p in sampling_params]
    one = _one(sampling_params)  # type: ignore[arg-type]  # not a list: one params for all
    return [one] * n


def _one(p: Params) -> SamplingParams:
    if p is None:
        return SamplingParams()
    if isinstance(p, SamplingParams):
        so = p.structured_outputs
        return p if so is None or isinstance(so, StructuredOutputs) else \
            dataclasses.replace(p, structured_outputs=_structured_outputs(so))
    if isinstance(p, dict):
        p = dict(p)
        if "guided_decoding" in p and "structured_outputs" not in p:  # vLLM's name before 0.11
            p["structured_outputs"] = p.pop("guided_decoding")
        known = {f.name for f in fields(SamplingParams)}
        unknown = sorted(set(p) - known)
        if unknown:
            raise TypeError(f"sampling_params: unknown field {unknown[0]!r}; fields: {', '.join(sorted(known))}")
        if p.get("structured_outputs") is not None:
            p["structured_outputs"] = _structured_outputs(p["structured_outputs"])
        return SamplingParams(**p)
    raise TypeError(f"sampling_params: a SamplingParams or a dict of its fields, got {type(p).__name__}")


_GRAMMAR_FIELDS = ("json", "json_object", "regex", "choice", "grammar")
# vLLM's StructuredOutputsParams options that mean nothing with one grammar backend.
_IGNORED = {"disable_fallback", "_backend", "_backend_was_auto"}


def _structured_outputs(value: Any) -> StructuredOutputs:
    """A grammar as vLLM's users pass it: a dict of fields or vLLM's ``StructuredOutputsParams``."""
    if isinstance(value, StructuredOutputs):
        return value
    if isinstance(value, dict):
        given = dict(value)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        given = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    else:
        raise TypeError(f"structured_outputs: a StructuredOutputs, a dict of its fields or vLLM's "
                        f"StructuredOutputsParams; got {type(value).__name__}")
    set_ = {k: v for k, v in given.items() if v not in (None, False) and k not in _IGNORED}
    unserved = sorted(set(set_) - set(_GRAMMAR_FIELDS))
    if unserved:
        raise ValueError(f"structured_outputs: {unserved[0]!r} is not served by carpool's engine; give one of "
                         f"{', '.join(_GRAMMAR_FIELDS)}")
    return StructuredOutputs(**set_)


class LLM:
    """carpool's engine for offline batches (see the module docstring)."""

    def __init__(self, model: str | EngineConfig | None = None, *, config: EngineConfig | None = None,
                 loaded: Any = None, **engine_args: Any):
        if isinstance(model, EngineConfig):
            config, model = model, None
        unknown = sorted(set(engine_args) - _ENGINE_ARGS)
        if unknown:
            raise TypeError(f"LLM: unknown engine argument {unknown[0]!r}; carpool's engine takes "
                            f"{', '.join(sorted(_ENGINE_ARGS - {'extra'}))}")
        if config is None:
            if model is not None:
                engine_args["model"] = model
            config = EngineConfig(**engine_args)
        elif model is not None or engine_args:
            raise TypeError("LLM: give the EngineConfig or the model and engine arguments, not both")
        self.config = config
        self.embedder: Any = None
        self.engine: Any = None
        if config.model.lower() in _EMBEDDING_MODELS:
            from carpool.embed.embedder import Embedder

            self.embedder = Embedder(config.model)
        else:
            from .llm_engine import LLMEngine

            self.engine = LLMEngine(config, loaded)
        self._counter = 0

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer if self.engine is not None else self.embedder.tokenizer

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def reset_prefix_cache(self) -> int:
        """Forget the cached prompt blocks (as vLLM's ``LLM.reset_prefix_cache``)."""
        return self._generator().reset_prefix_cache()

    def _generator(self) -> Any:
        if self.engine is None:
            raise ValueError(f"LLM(model={self.config.model!r}) is an embedding model: it has embed(), not "
                             "generate() or chat(); load a generation model, e.g. LLM(model='smollm2')")
        return self.engine

    def _next_id(self) -> str:
        self._counter += 1
        return f"offline-{self._counter}"

    def generate(self, prompts: str | Sequence[str | dict | GenerateRequest],
                 sampling_params: Params | Sequence[Params] = None, *, use_tqdm: bool = False,
                 params: Params = None) -> list[GenerationOutput]:
        """Prompts (text, ``{"prompt_token_ids": [...]}``, ``{"prompt": ...}`` or a
        ``GenerateRequest``) -> outputs in input order.  ``params`` is the older name of
        ``sampling_params``; ``use_tqdm`` is accepted for vLLM's signature (no bar is drawn)."""
        self._generator()
        if isinstance(prompts, str | dict):
            prompts = [prompts]
        chosen = _params(sampling_params if sampling_params is not None else params, len(prompts))
        reqs = []
        for p, sp in zip(prompts, chosen, strict=True):
            if isinstance(p, GenerateRequest):
                reqs.append(p)
            elif isinstance(p, str):
                reqs.append(GenerateRequest(request_id=self._next_id(), prompt=p, params=sp))
            elif isinstance(p, dict) and ("prompt" in p or "prompt_token_ids" in p):
                reqs.append(GenerateRequest(request_id=self._next_id(), prompt=p.get("prompt"),
                                            prompt_token_ids=p.get("prompt_token_ids"), params=sp))
            else:
                raise TypeError(f"generate: a prompt is a string, {{'prompt_token_ids': [...]}} or a "
                                f"GenerateRequest; got {type(p).__name__}")
        return self._run(reqs)

    def chat(self, messages: Sequence[dict] | Sequence[Sequence[dict]],
             sampling_params: Params | Sequence[Params] = None, *, use_tqdm: bool = False) -> list[GenerationOutput]:
        """One conversation (a list of ``{"role", "content"}``) or a list of them, through the
        model's chat template -> one output per conversation, in order."""
        self._generator()
        convs: list[Any] = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        chosen = _params(sampling_params, len(convs))
        for i, conv in enumerate(convs):
            if not isinstance(conv, list | tuple) or not all(isinstance(m, dict) for m in conv):
                raise TypeError(f"chat: conversation {i} must be a list of {{'role', 'content'}} dicts")
        reqs = [GenerateRequest(request_id=self._next_id(), messages=[dict(m) for m in conv], params=sp)
                for conv, sp in zip(convs, chosen, strict=True)]
        return self._run(reqs)

    def _pooler(self, what: str) -> Any:
        if self.embedder is None:
            raise ValueError(f"LLM(model={self.config.model!r}) is a generation model; {what} comes from an "
                             "embedding model: LLM(model='all-MiniLM-L6-v2')")
        return self.embedder

    def _vectors(self, prompts: str | Sequence[str], what: str) -> tuple[list[str], list[list[int]], Any]:
        embedder = self._pooler(what)
        texts = [prompts] if isinstance(prompts, str) else list(prompts)
        return texts, embedder._token_ids(texts) if texts else [], embedder.embed(texts)

    def embed(self, prompts: str | Sequence[str], *, use_tqdm: bool = False) -> list[EmbeddingRequestOutput]:
        """Texts -> one unit vector each (an embedding model only, as in vLLM)."""
        texts, ids, vectors = self._vectors(prompts, "embed()")
        return [EmbeddingRequestOutput(self._next_id(), t, list(i), EmbeddingOutput(v.tolist()))
                for t, i, v in zip(texts, ids, vectors, strict=True)]

    def encode(self, prompts: str | Sequence[str], pooling_params: Any = None, *, use_tqdm: bool = False,
               pooling_task: str = "embed") -> list[llm_tasks.PoolingRequestOutput]:
        """Texts -> the embedding model's pooled vector each (``outputs.data``, a tensor)."""
        if pooling_task != "embed":
            raise ValueError(f"encode: pooling_task={pooling_task!r} needs a model carpool does not have; its "
                             "embedding model pools one vector per text (pooling_task='embed')")
        import torch

        texts, ids, vectors = self._vectors(prompts, "encode()")
        pooled = [llm_tasks.PoolingOutput(torch.from_numpy(v)) for v in vectors]
        return [llm_tasks.PoolingRequestOutput(self._next_id(), t, list(i), o)
                for t, i, o in zip(texts, ids, pooled, strict=True)]

    def score(self, text_1: str | Sequence[str], text_2: str | Sequence[str], /, *,
              use_tqdm: bool = False) -> list[llm_tasks.ScoringRequestOutput]:
        """The similarity of text pairs (one against many, or pairwise): the cosine of their
        embeddings, as vLLM scores with an embedding model."""
        pairs = llm_tasks.score_pairs(text_1, text_2)
        texts = sorted({t for pair in pairs for t in pair})
        _, ids, vectors = self._vectors(texts, "score()")
        at = {t: i for i, t in enumerate(texts)}
        return [llm_tasks.ScoringRequestOutput(
                    self._next_id(), f"{a} / {b}", list(ids[at[a]]) + list(ids[at[b]]),
                    llm_tasks.ScoringOutput(llm_tasks.cosine(vectors[at[a]], vectors[at[b]])))
                for a, b in pairs]

    def classify(self, prompts: llm_tasks.Prompt | Sequence[llm_tasks.Prompt], labels: Sequence[str] | None = None,
                 *, use_tqdm: bool = False) -> list[llm_tasks.ClassificationRequestOutput]:
        """Each prompt (text, or a conversation) -> probabilities over ``labels``: how likely
        the generation model is to answer each label, normalized over them."""
        if self.engine is None:
            raise ValueError(f"LLM(model={self.config.model!r}) is an embedding model; classify() asks a generation "
                             "model to choose among labels: LLM(model='smollm2')")
        names = llm_tasks.check_labels(labels)
        if not isinstance(prompts, str) and not prompts:
            return []
        many = not isinstance(prompts, str) and bool(prompts) and not isinstance(prompts[0], dict)
        items: list[Any] = list(prompts) if many else [prompts]
        longest = max(len(self.engine.tokenizer.encode(x, add_special_tokens=False)) for x in names)
        reqs = [r for item in items for r in llm_tasks.label_requests(item, names, longest + 2, self._next_id)]
        outs = self._run(reqs)
        results = []
        for i, item in enumerate(items):
            mine = outs[i * len(names):(i + 1) * len(names)]
            lps = [llm_tasks.label_logprob(o, x) for o, x in zip(mine, names, strict=True)]
            results.append(llm_tasks.ClassificationRequestOutput(
                self._next_id(), item if isinstance(item, str) else mine[0].prompt, mine[0].prompt_token_ids,
                llm_tasks.ClassificationOutput(llm_tasks.softmax(lps), names, lps)))
        return results

    def _run(self, reqs: list[GenerateRequest]) -> list[GenerationOutput]:
        engine = self.engine
        seqs = [engine.make_sequence(r) for r in reqs]  # validate everything before running
        for s in seqs:
            engine.add_request(s)
        texts: dict[str, list[str]] = {s.request_id: [] for s in seqs}
        logprobs: dict[str, list[TokenLogprob]] = {s.request_id: [] for s in seqs}
        done: dict[str, Any] = {}
        submitted = time.monotonic()
        while engine.has_unfinished():
            for d in engine.step():
                texts[d.request_id].append(d.text)
                if d.logprobs:
                    logprobs[d.request_id].extend(d.logprobs)
                if d.finished:
                    done[d.request_id] = d
        return [self._output(s, r, done[s.request_id], "".join(texts[s.request_id]),
                             logprobs[s.request_id] if s.params.logprobs is not None else None, submitted)
                for s, r in zip(seqs, reqs, strict=True)]

    def _output(self, s: Any, req: GenerateRequest, d: Any, text: str, lps: list[TokenLogprob] | None,
                submitted: float) -> GenerationOutput:
        m = d.metrics or {}
        first, fin = m.get("first_token"), m.get("finished")
        start = min(submitted, s.arrival_time)
        prompt = req.prompt
        if prompt is None and self.engine.tokenizer is not None:  # chat: the templated prompt, as vLLM's
            prompt = self.engine.tokenizer.decode(s.prompt_token_ids)
        token_ids = list(s.output_token_ids)
        return GenerationOutput(
            request_id=s.request_id, prompt_token_ids=s.prompt_token_ids, token_ids=token_ids, text=text,
            finish_reason=d.finish_reason, usage=d.usage, ttft_s=(first - start) if first else None,
            e2e_s=(fin - start) if fin else None, logprobs=lps, error=d.error, prompt=prompt,
            outputs=[CompletionOutput(0, text, token_ids, d.finish_reason, lps)])
