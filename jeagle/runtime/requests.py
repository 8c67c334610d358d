"""One request's host-side record, and the checks a request passes before anything is queued."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from jeagle.sampling.logprobs import LogprobRows
from jeagle.sampling.penalties import MAX_STOP
from jeagle.runtime.slots import OutOfSlots
from jeagle.sampling import SamplingParams


class PromptTooLong(ValueError):
    """A prompt that does not fit the context window."""


@dataclass(init=False)
class Output:
    prompt_ids: list[int]
    token_ids: list[int]
    finish_reason: str | None  # "stop" | "length" | "abort"
    time_to_first_token_s: float | None
    # With SamplingParams.logprobs set: one packed block per token of token_ids, kept as the chunks
    # that arrived (jeagle/sampling/logprobs.py LogprobRows); `logprobs` reads them as TokenLogprobs.
    logprob_rows: LogprobRows | None
    # With SamplingParams.prompt_logprobs: None for the first prompt token, then one TokenLogprob each.
    prompt_logprobs: list | None

    def __init__(self, prompt_ids: list[int], token_ids: list[int] | None = None, finish_reason: str | None = None,
                 time_to_first_token_s: float | None = None, logprobs: list | None = None,
                 prompt_logprobs: list | None = None, logprob_rows: LogprobRows | None = None):
        self.prompt_ids = prompt_ids
        self.token_ids = [] if token_ids is None else token_ids
        self.finish_reason, self.time_to_first_token_s = finish_reason, time_to_first_token_s
        self.logprob_rows = logprob_rows if logprobs is None else LogprobRows.of(logprobs)
        self.prompt_logprobs = prompt_logprobs

    @property
    def logprobs(self) -> list | None:
        """With SamplingParams.logprobs set: one TokenLogprob per token of token_ids (jeagle/sampling/logprobs.py),
        built from the packed blocks when read (the same list until more tokens arrive); else None."""
        rows = self.logprob_rows
        return None if rows is None else rows.tokens()

    @logprobs.setter
    def logprobs(self, lps: list | None) -> None:
        self.logprob_rows = None if lps is None else LogprobRows.of(lps)


@dataclass
class Request:
    index: int
    prompt: list[int]
    params: SamplingParams
    eos: frozenset[int]
    max_new: int
    row: int = -1
    # KV (jeagle/runtime/kv.py): the slots of positions [0, len(table)) (the first `cached` from the
    # prefix cache, locked through `node`), the tree and draft scratch slots (`extra`).
    table: np.ndarray | None = None
    extra: np.ndarray | None = None
    cached: int = 0
    node: object | None = None
    start: int = 0  # positions the current prefill starts at (a cached prefix's length)
    position_cap: int = 0  # positions the request can ever need (its layout's, within the context)
    cached_tokens: int = 0  # prompt tokens its first prefill took from the prefix cache
    retractions: int = 0  # times it was retracted to make room (it resumes from prompt + tokens so far)
    admit_order: int = 0  # when it was last admitted (the youngest is retracted first)
    length: int = 0  # positions whose KV is written or dispatched to be written
    dispatched: int = 0  # new tokens (speculative: calls) that dispatched work will produce
    processed: int = 0  # dispatched calls whose results the host has read
    out: Output | None = None
    done: bool = False
    on_tokens: Callable[[int, list[int]], None] | None = None  # streaming callback (index, new ids)
    t_submit: float = 0.0  # perf_counter at submit
    compile_mark: float = 0.0  # the engine's compile seconds at submit (compiling is not serving latency)
    matcher: object | None = None  # the grammar's state (`jeagle.sampling.grammar.Matcher`), started when it is queued

    @property
    def seq(self) -> list[int]:
        """The tokens a (re)admission prefills from: the prompt and, after a retraction, every token
        emitted so far (the next one is sampled from the prefill, as a decode step would have)."""
        return self.prompt + self.out.token_ids if self.out.token_ids else self.prompt

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Its prefill scores the prompt (`echo`): the first one only, not a resumption's."""
        return bool(self.params.prompt_logprobs) and not self.out.token_ids

    def finish(self, reason: str) -> None:
        self.done, self.out.finish_reason = True, reason

    def take(self, tokens, compile_seconds: float, logprobs=None) -> list[int]:
        """Append the tokens that arrived for this request, up to its end (a stop token or max_new),
        with their logprobs when the request asked for them (`logprobs`: packed blocks [n,
        LOGPROB_COLUMNS], one per token, or a list of TokenLogprobs; or None); returns the ones taken.
        The taken tokens' blocks are kept as one chunk (`LogprobRows.append`: a slice, no per-token object).
        A stop token ends it before max_new does when both fall on one token. The tokens are cut with
        list slices and one set test, not a Python step per token (a round's every row comes here: 0.63 vs
        1.4 us for 3 tokens on the development machine, bench/RESULTS.md)."""
        if self.done or len(tokens) == 0:
            return []
        new = tokens.tolist() if isinstance(tokens, np.ndarray) else [int(t) for t in tokens]
        ids = self.out.token_ids
        room = max(self.max_new - len(ids), 1)  # not done: at least one token fits
        reason = None
        if len(new) >= room:
            new, reason = new[:room], "length"
        if not self.eos.isdisjoint(new):
            for i, tok in enumerate(new):
                if tok in self.eos:
                    new, reason = new[: i + 1], "stop"
                    break
        ids.extend(new)
        matcher = self.matcher
        if matcher is not None:
            for tok in new:
                if not matcher.stopped:
                    matcher.consume(tok)
        if self.out.time_to_first_token_s is None:
            # Compilation (first use of a shape) is not part of serving latency.
            self.out.time_to_first_token_s = (time.perf_counter() - self.t_submit
                                              - (compile_seconds - self.compile_mark))
        if reason is not None:
            self.finish(reason)
        rows = self.out.logprob_rows
        if rows is not None:
            if logprobs is None:
                raise AssertionError(f"request {self.index} asked for logprobs; its tokens came without them")
            rows.append(logprobs if len(logprobs) == len(new) else logprobs[:len(new)])
        return new


@dataclass(frozen=True)
class RequestLimits:
    """What a request is checked against: the context, the vocabulary, the pool and the positions a
    decoder reserves past the last token."""
    max_ctx: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    context_reserve: int
    pool_slots: int  # usable slots in the pool (slot 0 excluded)


def make_request(index: int, prompt: list[int], params: SamplingParams, limits: RequestLimits,
                 slots_needed: Callable[[int, int], int], position_cap: Callable[[int, int], int]) -> Request:
    """A checked request: a bad one raises (PromptTooLong, OutOfSlots, ValueError) before anything is
    queued. `slots_needed(prompt_len, max_new)` and `position_cap(prompt_len, max_new)` are the decoder's
    slot layout (`SlotLayout.slots_needed`, `.positions`)."""
    n = len(prompt)
    if n == 0:
        raise ValueError(f"prompt {index} is empty")
    if n >= limits.max_ctx:
        raise PromptTooLong(f"prompt {index} has {n} tokens; the context holds {limits.max_ctx} "
                            "(prompt + at least one new token must fit; raise --max-context if the model allows)")
    bad = [t for t in prompt if not 0 <= t < limits.vocab_size]
    if bad:
        raise ValueError(f"prompt {index} has token ids outside the vocabulary: {bad[:5]}")
    max_new = min(params.max_new_tokens, limits.max_ctx - n - limits.context_reserve)
    if max_new < 1:
        raise PromptTooLong(f"prompt {index} has {n} tokens; with {limits.context_reserve} positions reserved for "
                            f"speculation the context of {limits.max_ctx} leaves no room for new tokens")
    need = slots_needed(n, max_new)
    if need > limits.pool_slots:
        raise OutOfSlots(f"request {index} needs {need} KV slots, the pool has {limits.pool_slots}; "
                         "raise --max-total-tokens (or --mem-fraction-static) or lower --max-new-tokens")
    eos = frozenset(() if params.ignore_eos else limits.eos_token_ids) | frozenset(params.stop_token_ids)
    bad = [t for t, _ in params.logit_bias if not 0 <= t < limits.vocab_size]
    if bad:
        raise ValueError(f"request {index}: logit_bias names token ids outside the vocabulary: {bad[:5]}")
    if params.min_tokens and len(eos) > MAX_STOP:
        raise ValueError(f"request {index}: min_tokens holds back at most {MAX_STOP} stop tokens, it has {len(eos)}")
    return Request(index=index, prompt=list(prompt), params=params, eos=eos, max_new=max_new,
                   position_cap=position_cap(n, max_new),
                   out=Output(prompt_ids=list(prompt),
                              logprob_rows=None if params.logprobs is None else LogprobRows()))
