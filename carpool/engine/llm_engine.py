"""The synchronous engine core: add requests, step, get token deltas.

``LLMEngine`` owns the model runner, the block manager and the scheduler; one
``step()`` schedules a batch, runs one forward, samples, detokenizes and returns a
``TokenDelta`` for every sequence that produced a token (or finished).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from carpool.errors import EngineError, EngineSettingsError, KernelsDoNotFitModel, ModelLoadError, StepInterrupted

from .block_manager import BlockManager
from .config import EngineConfig, ModelConfig
from .detokenizer import IncrementalDetokenizer
from .guided import GrammarCompiler, TokenVocabulary
from .kv_quant import bytes_per_head_vector, check_kv_cache_dtype
from .loader import resolve_dtype as loader_dtype
from .model import LlamaModel
from .model_runner import PREFILL_MODES, ModelRunner
from .ops.build import ISA_NAMES
from .plan import DEFAULT_BATCH_TOKENS, DEFAULT_MAX_SEQS, SEQ_CHOICES
from .process import configure_process
from .protocol import BACKGROUND_PRIORITY, GenerateRequest, TokenDelta, TokenLogprob, TopLogprob, Usage
from .quant import calibration_ids, check_quantization
from .sampler import RawLogprobs, SampleResult
from .scheduler import SampledToken, Scheduler
from .sequence import Sequence
from .validation import check_sampling_params

log = logging.getLogger("carpool.engine")

# A step of background work alone may be stopped for a foreground request that arrives during it;
# after this many stopped in a row the next one runs to its end, so arrivals faster than a step
# slow the batch but cannot starve it, and at most this many steps of work are thrown away at once.
MAX_INTERRUPTED_IN_ROW = 2

# What a sampled token gives the caller: its text (held back near a stop string) and logprobs.
_Emitted = tuple[str, list[TokenLogprob] | None]

def resolve_dtype(name: str | torch.dtype | None) -> torch.dtype:
    """``EngineConfig.dtype`` as the loader reads it (empty: auto); a name it does not know refuses
    the engine's start."""
    try:
        return loader_dtype(name or "auto")
    except ModelLoadError as e:
        raise EngineSettingsError(f"dtype: unknown value {name!r}; use auto, bfloat16 or float32") from e


def _eos_ids(loaded: Any, cfg: ModelConfig) -> list[int]:
    ids = getattr(loaded, "eos_token_ids", None)
    if ids:
        return list(ids)
    e = cfg.eos_token_id
    if e is None:
        return []
    return list(e) if isinstance(e, (list, tuple)) else [int(e)]


class LLMEngine:
    """Sync core.  ``loaded``: an already loaded model (fields ``config``, ``state_dict``,
    ``tokenizer`` (may be None: token-id prompts only), ``eos_token_ids``, ``name``);
    without it ``config.model`` is loaded with ``carpool.engine.loader.load_model``."""

    def __init__(self, config: EngineConfig | None = None, loaded: Any = None):
        self.config = config = config or EngineConfig()
        configure_process(config.num_threads or os.cpu_count() or 1)
        self.dtype = resolve_dtype(config.dtype)
        try:  # before the weights load: a typo fails at once
            self.quantization = check_quantization(config.quantization)
            self.kv_cache_dtype = check_kv_cache_dtype(config.kv_cache_dtype)
        except ValueError as e:
            raise EngineSettingsError(str(e)) from None
        plan_setting = self._plan_setting(config.extra.get("plan"))
        if loaded is None:
            from .loader import load_model

            loaded = load_model(config.model, dtype=self.dtype)
        self.loaded = loaded
        mcfg: ModelConfig = loaded.config
        self.model_config = mcfg
        self.model_name = getattr(loaded, "name", None) or config.model
        self.tokenizer = getattr(loaded, "tokenizer", None)
        self.tokenizer_lock = threading.Lock()  # HF fast tokenizers are not safe to share across threads
        self.eos_token_ids = _eos_ids(loaded, mcfg)
        self.max_model_len = config.max_model_len or min(mcfg.max_position_embeddings, 8192)
        if self.max_model_len > mcfg.max_position_embeddings:
            raise EngineSettingsError(f"max_model_len ({self.max_model_len}) exceeds the model's "
                              f"max_position_embeddings ({mcfg.max_position_embeddings})")
        self.block_size = config.block_size
        calib = calibration_ids(self.tokenizer, mcfg.vocab_size) if self.quantization else None
        self.model = LlamaModel(mcfg, loaded.state_dict, self.dtype, self.quantization, calib)
        self.num_blocks = self._num_blocks()
        self.block_manager = BlockManager(self.num_blocks, self.block_size, config.enable_prefix_caching)
        # The step's token budget: the one given, else the plan's measured one once the plan is there.
        budget = config.max_num_batched_tokens
        if budget is not None and budget < 1:
            raise EngineSettingsError(f"max_num_batched_tokens must be >= 1, got {budget}")
        self.budget_source = "set" if budget is not None else "default"
        seqs = config.max_num_seqs
        if seqs is not None and seqs < 1:
            raise EngineSettingsError(f"max_num_seqs must be >= 1, got {seqs}")
        self.seqs_source = "set" if seqs is not None else "default"
        self.scheduler = Scheduler(self.block_manager, seqs or DEFAULT_MAX_SEQS, budget or DEFAULT_BATCH_TOKENS,
                                   config.scheduling_policy, config.enable_chunked_prefill)
        # extra["attention"]: "auto" (C++ kernels once built, torch until then), "kernel"
        # (wait for the build), "torch" (never build).  extra["prefill_attention"]: "auto" (flash
        # attention for long chunks, the SIMD kernel for short ones), "flash" or "kernel".
        # extra["isa"]: "avx512", "avx2" or "scalar" to run a narrower kernel copy than the CPU allows.
        mode = config.extra.get("attention", "auto")
        if mode not in ("auto", "kernel", "torch"):
            raise EngineSettingsError(f"extra.attention must be auto, kernel or torch, got {mode!r}")
        prefill_mode = config.extra.get("prefill_attention", "auto")
        if prefill_mode not in PREFILL_MODES:
            raise EngineSettingsError(f"extra.prefill_attention must be one of {', '.join(PREFILL_MODES)}, "
                              f"got {prefill_mode!r}")
        isa_name = config.extra.get("isa")
        isas = {v: k for k, v in ISA_NAMES.items()}
        if isa_name is not None and isa_name not in isas:
            raise EngineSettingsError(f"extra.isa must be one of {', '.join(isas)}, got {isa_name!r}")
        self.runner = ModelRunner(self.model, self.num_blocks, self.block_size, config.seed,
                                  kernels={"auto": "auto", "kernel": "wait", "torch": "off"}[mode],
                                  prefill=prefill_mode, isa=None if isa_name is None else isas[isa_name],
                                  kv_cache_dtype=self.kv_cache_dtype,
                                  limits=(budget or DEFAULT_BATCH_TOKENS, self.max_model_len),
                                  plan=plan_setting)
        kernels = self.runner.kernels
        if mode == "kernel" and kernels is None:  # the runner starts none for a head size not compiled in
            raise KernelsDoNotFitModel(f"extra.attention=kernel: the C++ kernels are unavailable (head_dim "
                                       f"{mcfg.head_dim} has no kernel); use attention=auto or torch", mcfg.head_dim)
        if mode == "kernel" and kernels is not None and not kernels.ready:
            raise EngineSettingsError(f"extra.attention=kernel: the C++ kernels are unavailable ({kernels.error}); "
                                      "use attention=auto or torch")
        self._follow_plan()
        self.runner.sampler.eos_token_ids = list(self.eos_token_ids)  # masked under min_tokens
        # Token bytes/text (logprobs) and grammars (structured outputs), built on first use.
        self.vocab = TokenVocabulary(self.tokenizer, mcfg.vocab_size, self.eos_token_ids)
        self.grammars = GrammarCompiler(self.vocab)
        self.requests: dict[str, Sequence] = {}
        self.listeners: list[Callable[[dict], None]] = []
        self.interrupted_in_row = 0  # background-only steps stopped since the last step that ran
        self.num_interrupted_steps = 0
        self.prompt_tokens = 0
        self.generation_tokens = 0

    @staticmethod
    def _plan_setting(value: Any) -> str | None:
        """extra["plan"] (else $CARPOOL_ENGINE_PLAN): "measure", "default" or forced routes such as
        "gemm=onednn,prefill=flash" (plan.parse_overrides); a bad one fails here, before the build."""
        from .plan import parse_overrides
        from .plan_measure import PLAN_ENV

        text = value if value is not None else os.environ.get(PLAN_ENV)
        if text is None:
            return None
        try:
            parse_overrides(str(text))
        except ValueError as e:
            raise EngineSettingsError(f"{'extra.plan' if value is not None else PLAN_ENV}: {e}") from None
        return str(text)

    def _follow_plan(self) -> None:
        """Take the plan's measured step budget and sequences once the runner runs a plan (at start
        when the kernels are built, else at the first step after they are), unless they were given."""
        plan = self.model.plan
        if not self.runner.planned:
            return
        if self.budget_source == "default" and plan.batch_tokens:
            self.scheduler.max_num_batched_tokens = plan.batch_tokens
            self.budget_source = "measured"
        if self.seqs_source == "default" and plan.max_seqs:
            self.scheduler.max_num_seqs = plan.max_seqs
            self.seqs_source = "measured"

    def _num_blocks(self) -> int:
        c, m = self.config, self.model_config
        if c.num_kv_blocks:
            return int(c.num_kv_blocks)
        per_block = 2 * m.num_hidden_layers * self.block_size * m.num_key_value_heads
        per_block *= bytes_per_head_vector(m.head_dim, self.kv_cache_dtype, self.dtype)
        by_memory = int(c.kv_cache_memory_gb * (1 << 30) // per_block)
        # More than every running sequence at full length can never be used.
        useful = (c.max_num_seqs or SEQ_CHOICES[-1]) * -(-self.max_model_len // self.block_size)
        return max(1, min(by_memory, useful))

    # ------------------------------------------------------------- requests

    def tokenize(self, req: GenerateRequest) -> list[int]:
        given = [x is not None for x in (req.messages, req.prompt, req.prompt_token_ids)]
        if sum(given) != 1:
            raise EngineError(f"request {req.request_id}: give exactly one of messages, prompt, prompt_token_ids")
        if req.tokenized is not None:  # counted before (the server's length check): template once
            return req.tokenized
        if req.prompt_token_ids is not None:
            ids = [int(t) for t in req.prompt_token_ids]
        else:
            if self.tokenizer is None:
                raise EngineError(f"request {req.request_id}: model {self.model_name!r} has no tokenizer; "
                                  "send prompt_token_ids")
            with self.tokenizer_lock:
                if req.messages is not None:
                    try:
                        text = self.tokenizer.apply_chat_template(req.messages, add_generation_prompt=True,
                                                                  tokenize=False)
                    except Exception as e:  # a bad role/content shape is the caller's error
                        raise EngineError(f"request {req.request_id}: messages: {e}") from e
                    ids = self.tokenizer.encode(text, add_special_tokens=False)
                else:
                    ids = self.tokenizer.encode(req.prompt)
        if not ids:
            raise EngineError(f"request {req.request_id}: the prompt is empty")
        return ids

    def count_prompt_tokens(self, req: GenerateRequest) -> int:
        """The prompt's length; its ids are kept on ``req`` (``tokenized``) for ``make_sequence``."""
        ids = self.tokenize(req)
        req.tokenized = ids
        return len(ids)

    def _validate(self, req: GenerateRequest, ids: list[int]) -> None:
        p, rid = req.params, req.request_id
        check_sampling_params(p, self.model_config.vocab_size, rid)
        vocab = self.model_config.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            raise EngineError(f"request {rid}: prompt_token_ids must be in [0, {vocab}), got {min(ids)}..{max(ids)}")
        total = len(ids) + p.max_tokens
        if total > self.max_model_len:
            raise EngineError(
                f"request {rid}: prompt ({len(ids)} tokens) + max_tokens ({p.max_tokens}) = {total} exceeds "
                f"max_model_len ({self.max_model_len}); shorten the prompt or lower max_tokens")
        if -(-total // self.block_size) > self.num_blocks:
            raise EngineError(f"request {rid}: needs {-(-total // self.block_size)} KV blocks but num_kv_blocks "
                              f"is {self.num_blocks}; raise num_kv_blocks or kv_cache_memory_gb")

    def make_sequence(self, req: GenerateRequest) -> Sequence:
        """Tokenize and validate (raises EngineError); safe to call from another thread."""
        ids = self.tokenize(req)
        self._validate(req, ids)
        seq = Sequence(req.request_id, ids, req.params, self.block_size, req.priority, req.arrival_time)
        seq.detokenizer = IncrementalDetokenizer(self.tokenizer, req.params, self.eos_token_ids)
        if req.params.structured_outputs is not None:  # compiled here, in the caller's thread, not in a step
            seq.grammar = self.grammars.matcher(req.params.structured_outputs, req.request_id)
        return seq

    def add_request(self, req: GenerateRequest | Sequence) -> Sequence:
        seq = req if isinstance(req, Sequence) else self.make_sequence(req)
        if seq.request_id in self.requests:
            raise EngineError(f"request_id {seq.request_id!r} is already running; use a unique id")
        self.requests[seq.request_id] = seq
        self.prompt_tokens += seq.num_prompt_tokens
        self.scheduler.add(seq)
        return seq

    def abort_request(self, request_id: str) -> TokenDelta | None:
        """Stop a request and free its blocks; returns its final delta (None if unknown)."""
        seq = self.requests.pop(request_id, None)
        if seq is None:
            return None
        self.scheduler.finish(seq, "abort")
        return self._finish(seq, [], "")

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def reset_prefix_cache(self) -> int:
        """Forget every cached prompt block not in use (benchmarks that run the same prompts
        again; ``BlockManager.reset_prefix_cache``).  Returns how many blocks were forgotten."""
        return self.block_manager.reset_prefix_cache()

    # ----------------------------------------------------------------- step

    def _finish(self, seq: Sequence, token_ids: list[int], text: str,
                logprobs: list[TokenLogprob] | None = None, error: str | None = None) -> TokenDelta:
        """The last delta of a sequence the scheduler has finished."""
        seq.grammar = None
        usage = Usage(seq.num_prompt_tokens, seq.num_output_tokens, seq.num_cached_tokens)
        return TokenDelta(seq.request_id, token_ids, text, seq.finish_reason, usage, seq.metrics(), logprobs, error)

    def _fail(self, seq: Sequence, why: BaseException | str) -> TokenDelta:
        """End one request with finish_reason "error"; the rest of the batch goes on."""
        msg = why if isinstance(why, str) else f"{type(why).__name__}: {why}"
        log.error("request %s failed inside a step and was dropped: %s", seq.request_id, msg,
                  exc_info=why if isinstance(why, BaseException) else None)
        self.requests.pop(seq.request_id, None)
        self.scheduler.finish(seq, "error")
        return self._finish(seq, [], "", None, f"the engine failed on this request: {msg}")

    def _run(self, scheduled: list[tuple[Sequence, int]], deltas: list[TokenDelta],
             interrupt: threading.Event | None = None):
        """The step's forward and sampling.  When it raises, each request is run alone to find the
        ones that fail: they end with an error delta, the others' work is redone (their KV writes
        are the same values to the same slots) and they go on.  A rare path: the parameters are
        checked before a request runs and the sampler cannot overflow."""
        # A seeded request must draw the same tokens on the rerun: keep its generator's state (~1 us).
        states = [(s.generator, s.generator.get_state()) for s, _ in scheduled if s.generator is not None]
        try:
            seqs, result = self.runner.run(scheduled, interrupt)
            return scheduled, seqs, result
        except StepInterrupted:
            raise  # not a failure: the caller drops the step
        except Exception as e:  # noqa: BLE001 -- one request must not end the whole batch
            if len(scheduled) == 1:
                deltas.append(self._fail(scheduled[0][0], e))
                return [], [], None
            log.warning("a step of %d requests failed (%r); running them one by one", len(scheduled), e)
        for gen, state in states:
            gen.set_state(state)
        kept: list[tuple[Sequence, int]] = []
        seqs, tokens, logprobs, errors = [], [], [], {}
        for item in scheduled:
            try:
                s, r = self.runner.run([item])
            except Exception as e:  # noqa: BLE001 -- this request fails alone
                deltas.append(self._fail(item[0], e))
                continue
            kept.append(item)
            if s:
                assert r is not None  # a run that sampled returns what it sampled
                if 0 in r.errors:
                    errors[len(seqs)] = r.errors[0]
                seqs.append(s[0])
                tokens.append(r.tokens[0])
                logprobs.append(r.logprobs[0])
        return kept, seqs, SampleResult(tokens, logprobs, errors)

    def _token_logprob(self, token: int, raw: RawLogprobs) -> TokenLogprob:
        v = self.vocab
        top = [TopLogprob(t, v.token_text(t), list(v.token_bytes(t)), lp)
               for t, lp in zip(raw.top_ids, raw.top_logprobs, strict=True)]
        return TokenLogprob(token, v.token_text(token), list(v.token_bytes(token)), raw.logprob, top)

    def _read_token(self, seq: Sequence, tok: int, raw: RawLogprobs | None) -> tuple[_Emitted, str | None]:
        """What one sampled token of ``seq`` gives the caller (its text and logprobs) and whether
        it ends the sequence (its finish reason); the scheduler appends it afterwards."""
        if seq.grammar is not None and not seq.grammar.accept(tok):
            raise RuntimeError(f"the grammar refused token {tok}: {seq.grammar.error}")
        lps = [self._token_logprob(tok, raw)] if raw is not None else None
        assert seq.detokenizer is not None  # set by make_sequence
        text, reason = seq.detokenizer.add_token(tok, seq.num_output_tokens + 1)
        if seq.grammar is not None and seq.grammar.is_stopped and reason != "stop":
            # The grammar is complete and allows nothing more: done, even if it landed on max_tokens.
            text += seq.detokenizer.flush()
            reason = "stop"
        return (text, lps), reason

    def _interruptible(self, scheduled: list[tuple[Sequence, int]]) -> bool:
        """A step may be stopped when it holds background work only, and fewer than
        ``MAX_INTERRUPTED_IN_ROW`` steps before it were stopped: a steady stream of foreground
        arrivals then slows the batch without stopping it, and the work thrown away stays bounded."""
        return (self.interrupted_in_row < MAX_INTERRUPTED_IN_ROW
                and all(seq.priority >= BACKGROUND_PRIORITY for seq, _ in scheduled))

    def _apply(self, scheduled: list[tuple[Sequence, int]], seqs: list[Sequence], result: SampleResult | None,
               deltas: list[TokenDelta]) -> None:
        """Record a step that ran: the scheduler moves its sequences on (``update_from_output``),
        then each sampled sequence gets its delta and each failed one its error."""
        sampled: list[SampledToken] = []
        emitted: list[_Emitted] = []
        failed: list[tuple[Sequence, BaseException | str]] = []
        if result is not None:
            with self.tokenizer_lock:
                for j, seq in enumerate(seqs):
                    if j in result.errors:
                        failed.append((seq, result.errors[j]))
                        continue
                    tok = result.tokens[j]
                    try:
                        out, reason = self._read_token(seq, tok, result.logprobs[j])
                    except Exception as e:  # noqa: BLE001 -- this request fails alone
                        failed.append((seq, e))
                        continue
                    sampled.append(SampledToken(seq, tok, reason))
                    emitted.append(out)
            self.generation_tokens += len(seqs)
        self.scheduler.update_from_output(scheduled, sampled, time.monotonic())
        for s, (text, lps) in zip(sampled, emitted, strict=True):
            if s.finish_reason is None:
                deltas.append(TokenDelta(s.seq.request_id, [s.token], text, logprobs=lps))
            else:
                self.requests.pop(s.seq.request_id, None)
                deltas.append(self._finish(s.seq, [s.token], text, lps))
        for seq, why in failed:  # after the update: a failed sequence's step still ran
            deltas.append(self._fail(seq, why))

    def step(self, interrupt: threading.Event | None = None) -> list[TokenDelta]:
        """Schedule and run one step; the deltas it produced.

        ``interrupt`` (set by another thread when a foreground request arrives) may stop a step
        that holds background work only (batch lines): the foreground request then waits for one
        layer instead of a whole step, and the stopped step is redone later (``_interruptible``)."""
        t0 = time.perf_counter()
        self._follow_plan()
        out = self.scheduler.schedule()
        deltas: list[TokenDelta] = []
        ran = True
        if out.scheduled:
            stop = interrupt if self._interruptible(out.scheduled) else None
            try:
                scheduled, seqs, result = self._run(out.scheduled, deltas, stop)
            except StepInterrupted:
                ran = False
                self.interrupted_in_row += 1
                self.num_interrupted_steps += 1
            else:
                self.interrupted_in_row = 0
                self._apply(scheduled, seqs, result, deltas)
        info = {
            "num_prefill_tokens": out.num_prefill_tokens if ran else 0,
            "num_decode_tokens": out.num_decode_tokens if ran else 0,
            "num_scheduled_seqs": len(out.scheduled) if ran else 0,
            "interrupted": not ran,
            "num_preempted": len(out.preempted),
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "num_free_kv_blocks": self.block_manager.num_free_blocks,
            "duration_s": time.perf_counter() - t0,
        }
        for fn in self.listeners:
            fn(info)
        return deltas

    def add_step_listener(self, fn: Callable[[dict], None]) -> None:
        self.listeners.append(fn)

    def stats(self) -> dict:
        bm = self.block_manager
        return {
            "num_requests_running": len(self.scheduler.running),
            "num_requests_waiting": len(self.scheduler.waiting),
            "kv_cache_usage_perc": bm.usage(),
            "prefix_cache_queries": bm.prefix_queries,
            "prefix_cache_hits": bm.prefix_hits,
            "num_preemptions": self.scheduler.num_preemptions,
            "prompt_tokens": self.prompt_tokens,
            "generation_tokens": self.generation_tokens,
            "num_kv_blocks": bm.num_blocks,
            "num_free_kv_blocks": bm.num_free_blocks,
            "max_num_seqs": self.scheduler.max_num_seqs,  # what a client may keep in flight usefully
            "max_num_batched_tokens": self.scheduler.max_num_batched_tokens,
            "batch_tokens_source": self.budget_source,  # set | measured | default
            "max_num_seqs_source": self.seqs_source,  # set | measured | default
            "num_interrupted_steps": self.num_interrupted_steps,
        }
