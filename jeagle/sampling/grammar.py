"""Structured outputs: grammars (JSON schema, any JSON object, regex, EBNF) through llguidance, as
token masks the device applies to the target's logits.

Why llguidance (not xgrammar, SGLang's default): it is a self-contained Rust library with no Python
dependencies, where xgrammar's wheel requires torch, transformers and triton at import — jeagle's
runtime has no torch. Both compute a mask for a 49k vocabulary in tens of microseconds.

A `Grammar` (compiled once per schema: `GrammarBackend.compile` keeps the last ones) makes a
`Matcher` per request; the host keeps it in step with the emitted tokens and hands the device one
bitmask per position to decode from ([W] int32, bit v % 32 of word v // 32 allows token v):

    prefill         the mask of the grammar's start
    decode step     the mask after the request's tokens so far (`next_masks`: the batch's at once)
    speculative     one executable drafts and runs the verify's forward; the tree's tokens and the
                    forward's best tokens come to the host: each tree node gets the mask after its
                    path (root excluded: emitted already: `tree_masks`), or for a greedy row the
                    mask of the one path the accept walks (`grammar_walk.walk_nodes`), so the accept
                    takes only tokens the grammar allows and emits what constrained target-only
                    decoding emits

A target-only grammar step needs the previous step's tokens first (the scheduler drains what is in
flight before it); a speculative one reads them while its draft and forward run
(`runtime/scheduler.py`, `speculative/decoder.py`). Masks are computed on llguidance's thread pool.
"""

from __future__ import annotations

import collections
import json
import threading
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np


class GrammarError(ValueError):
    """A grammar (schema, regex, EBNF) that does not compile."""


def _one_line(message: str) -> str:
    """llguidance's messages span lines (a caret under the error): one line, for a 400 or the CLI."""
    return " ".join(message.split())


def mask_words(vocab: int) -> int:
    return (vocab + 31) // 32


def apply_token_mask(logits, mask):
    """logits [..., V] with the tokens `mask` [..., W] (int32 bitmask) disallows at -inf."""
    v = logits.shape[-1]
    ids = jnp.arange(v)
    words = jnp.take(mask, ids // 32, axis=-1)  # [..., V]
    allowed = (jnp.right_shift(words, (ids % 32).astype(jnp.int32)) & 1) != 0
    return jnp.where(allowed, logits, -jnp.inf)


def masks_from_ids(ids, words: int):
    """[..., C] int32 token ids (-1 padded) → [..., W] int32 bitmasks allowing just them; a row of -1s
    allows every token (the compact form of a walked row's masks, `grammar_walk.walk_nodes`: C ids a
    node instead of W words)."""
    valid = ids >= 0
    word = jnp.where(valid, ids >> 5, -1)
    bit = jnp.where(valid, jnp.left_shift(jnp.uint32(1), (ids & 31).astype(jnp.uint32)), jnp.uint32(0))
    cols = jnp.arange(words)
    out = jnp.zeros(ids.shape[:-1] + (words,), jnp.uint32)
    for c in range(ids.shape[-1]):
        out = out | jnp.where(cols == word[..., c, None], bit[..., c, None], jnp.uint32(0))
    out = jnp.where(valid[..., :1], out, jnp.uint32(0xFFFFFFFF))
    return jax.lax.bitcast_convert_type(out, jnp.int32)


def allow_all(rows: int, vocab: int) -> np.ndarray:
    return np.full((rows, mask_words(vocab)), -1, np.int32)


class _Vocabulary:
    """What llguidance's TokenizerWrapper reads: every token's bytes, EOS, the special tokens, and
    the tokenizer itself."""

    def __init__(self, tokenizer, vocab_size: int, eos: int):
        self._tok = tokenizer
        self.tokens = [tokenizer.token_bytes(i) for i in range(vocab_size)]
        self.eos_token_id = eos
        self.bos_token_id = tokenizer.bos_token_id
        special = tokenizer.backend.get_added_tokens_decoder()
        self.special_token_ids = [i for i, t in special.items() if t.special and i < vocab_size]

    def __call__(self, text):
        return self._tok.encode(text.decode() if isinstance(text, bytes) else text, add_special_tokens=False)


class GrammarBackend:
    """llguidance's view of one tokenizer (built once per server: ~0.1-1 s for a 49k vocabulary)."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_id: int):
        import llguidance

        self.vocab_size, self.eos_token_id = vocab_size, eos_token_id
        self._compiled: collections.OrderedDict = collections.OrderedDict()  # (kind, source text) -> Grammar
        self._lock = threading.Lock()
        self.tokenizer = llguidance.LLTokenizer(llguidance.TokenizerWrapper(
            _Vocabulary(tokenizer, vocab_size, eos_token_id)), n_vocab=vocab_size, eos_token=eos_token_id)

    COMPILED_KEPT = 64  # grammars kept compiled (least recently used dropped)

    def compile(self, kind: str, source) -> "Grammar":
        """kind: "json_schema" (source: a schema dict or JSON text), "json_object" (any JSON object),
        "regex" or "ebnf" (GBNF, as SGLang's `ebnf` field and llama.cpp take it). Raises GrammarError.
        The last `COMPILED_KEPT` grammars stay compiled: a server's clients send the same schema again
        and again (llguidance's compile and validation take ~1-10 ms a schema)."""
        key = (kind, source if isinstance(source, str) else json.dumps(source, sort_keys=True))
        with self._lock:
            hit = self._compiled.get(key)
            if hit is not None:
                self._compiled.move_to_end(key)
                return hit
        return self._keep(key, self._compile(kind, source))

    def rebuild(self, kind: str, source: str) -> "Grammar":
        """A grammar compiled and checked elsewhere (by the server's process), from its llguidance
        text `source`; kept like `compile`'s, so a schema's requests share one `Grammar` (and its
        template matcher, `Grammar.matcher`)."""
        key = ("llguidance", kind, source)
        with self._lock:
            hit = self._compiled.get(key)
            if hit is not None:
                self._compiled.move_to_end(key)
                return hit
        return self._keep(key, Grammar(kind, source, self))

    def _keep(self, key, grammar: "Grammar") -> "Grammar":
        with self._lock:
            grammar = self._compiled.setdefault(key, grammar)
            self._compiled.move_to_end(key)
            while len(self._compiled) > self.COMPILED_KEPT:
                self._compiled.popitem(last=False)
        return grammar

    def _compile(self, kind: str, source) -> "Grammar":
        import llguidance
        from llguidance.gbnf_to_lark import gbnf_to_lark

        try:
            if kind == "json_object":
                grammar = llguidance.LLMatcher.grammar_from_json_schema({"type": "object"},
                                                                        defaults={"whitespace_flexible": False})
            elif kind == "json_schema":
                schema = json.loads(source) if isinstance(source, str) else source
                if not isinstance(schema, dict):
                    raise GrammarError("a JSON schema must be an object")
                grammar = llguidance.LLMatcher.grammar_from_json_schema(schema,
                                                                        defaults={"whitespace_flexible": False})
            elif kind == "regex":
                grammar = llguidance.LLMatcher.grammar_from_regex(source)
            elif kind == "ebnf":
                grammar = llguidance.LLMatcher.grammar_from_lark(gbnf_to_lark(source))
            else:
                raise GrammarError(f"unknown grammar kind {kind!r}")
        except GrammarError:
            raise
        except Exception as e:  # llguidance raises ValueError/RuntimeError on malformed input
            raise GrammarError(_one_line(f"{kind}: {e}")) from None
        err = llguidance.LLMatcher.validate_grammar(grammar, self.tokenizer)
        if err and not err.startswith("WARNING"):
            raise GrammarError(_one_line(f"{kind}: {err}"))
        compiled = Grammar(kind, grammar, self)
        compiled.template()  # one matcher built here: its requests' matchers, built in the background, then build too
        return compiled


@dataclass(frozen=True, eq=False)
class Grammar:
    """A compiled grammar; `matcher()` starts a request's matcher."""
    kind: str
    source: str  # llguidance's grammar text
    backend: GrammarBackend
    _template: list = field(default_factory=list, repr=False)  # [the template matcher], once built

    def matcher(self, background: bool = False, shared: bool = False) -> "Matcher":
        """A request's matcher at the grammar's start. `background`: built on a worker thread (its
        `ready` says when), so the thread that queues requests does not pay for it. `shared`: a copy
        of the grammar's template instead (`Matcher` says when that is faster)."""
        return Matcher(self, background, shared)

    def template(self):
        """The grammar's template llguidance matcher (built once; never moved): copies of it share its
        lexer automaton."""
        if not self._template:
            built = _build(self)
            with _TEMPLATE_LOCK:
                if not self._template:
                    self._template.append(built)
        return self._template[0]


_TEMPLATE_LOCK = threading.Lock()


class Matcher:
    """One request's grammar state, in step with the tokens the request has emitted.

    A request's matcher is its own llguidance matcher, or (`shared`) a copy of the grammar's template
    (`deep_copy`, ~6 µs). Copies share the template's lazily built lexer automaton, warm after the
    first requests: a request's first 30 masks cost 0.8 ms from a copy against 3.2 ms from a matcher
    of its own (CI machine, the serve benchmark's schema). But they share it behind a lock: on the
    H100 host's 16 cores, 48 requests' tree masks took 23.6 ms batched on llguidance's threads from
    copies against 8.0 ms from matchers of their own (bench/probes/grammar_masks.py, removed after commit
    `b436043`; bench/HISTORY.md, 2026-11-25).
    So copies serve the rows whose masks the engine's thread computes one request at a time (the
    greedy rows of a speculative engine, `grammar_walk.walk_nodes`), own matchers the rows whose masks come in
    parallel batches (`next_masks`, `tree_masks`).

    Building one's own parses the grammar's text (~1 ms for a small JSON schema), with the GIL
    released: `background=True` builds it on a worker thread (`_build_soon`), and `ready` says whether
    it is built; `ll` waits for it (a build that failed raises its GrammarError there)."""

    def __init__(self, grammar: Grammar, background: bool = False, shared: bool = False):
        self.words = mask_words(grammar.backend.vocab_size)
        self.eos = grammar.backend.eos_token_id
        self._built, self._future = None, None
        if shared:
            self._built = grammar.template().deep_copy()
        elif background:
            self._future = _build_soon(grammar)
        else:
            self._built = _build(grammar)

    @property
    def ll(self):
        """The llguidance matcher (waits for its build)."""
        if self._built is None:
            self._built, self._future = self._future.result(), None
        return self._built

    @property
    def ready(self) -> bool:
        """Built (or its build failed: `ll` raises)."""
        return self._built is not None or self._future.done()

    def consume(self, token: int) -> None:
        if not self.ll.consume_token(int(token)):
            raise AssertionError(f"the grammar refused token {token} that the masks allowed: {self.ll.get_error()}")

    def mask(self) -> np.ndarray:
        """[W] int32: the tokens allowed next."""
        out = np.zeros(self.words, np.int32)
        self.ll.unsafe_compute_mask_ptr(out.ctypes.data, out.nbytes)
        return out

    def tree_masks(self, tokens: np.ndarray, parents: np.ndarray) -> np.ndarray:
        """(The one-request reference of `tree_masks`, node by node on this thread.)
        [N, W]: node n's mask is what the grammar allows after the path root → n (the root's token
        emitted already: not consumed again). A node whose path the grammar refuses can never be
        accepted (its parent's mask rules it out): its mask allows everything."""
        n = tokens.shape[0]
        out = np.full((n, self.words), -1, np.int32)
        paths: list[list[int] | None] = [[]] + [None] * (n - 1)
        for i in range(1, n):  # parents come before their children in the tree's node order
            p = int(parents[i])
            paths[i] = None if p < 0 or paths[p] is None else paths[p] + [int(tokens[i])]
        for i, path in enumerate(paths):
            if path is None:
                continue
            took = self.ll.try_consume_tokens(path) if path else 0
            if took == len(path):
                self.ll.unsafe_compute_mask_ptr(out[i].ctypes.data, out[i].nbytes)
            if took:
                self.ll.rollback(took)
        return out

    def copy(self) -> "Matcher":
        """A matcher in this one's state, sharing its lexer cache (behind a lock: the class docstring)."""
        twin = object.__new__(Matcher)
        twin._built, twin._future, twin.words, twin.eos = self.ll.deep_copy(), None, self.words, self.eos
        return twin

    @property
    def stopped(self) -> bool:
        return self.ll.is_stopped()


def _build(grammar: Grammar):
    import llguidance

    ll = llguidance.LLMatcher(grammar.backend.tokenizer, grammar.source, log_level=0)
    if ll.is_error():
        raise GrammarError(ll.get_error())
    return ll


_BUILDERS = None
_BUILDERS_LOCK = threading.Lock()


def _build_soon(grammar: Grammar):
    """A future of `_build(grammar)` on the process's builder threads (two: llguidance releases the
    GIL while it parses, so a serving engine's thread keeps stepping)."""
    global _BUILDERS
    with _BUILDERS_LOCK:
        if _BUILDERS is None:
            import concurrent.futures

            _BUILDERS = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="jeagle-grammar")
    return _BUILDERS.submit(_build, grammar)


# ---- batches: masks for many requests at once, on llguidance's worker threads -------------------------
_EXECUTOR = None


def _executor():
    """llguidance's thread pool (one per process, a thread per core): it computes masks with the
    GIL released, so a batch's masks take about one mask's time per core."""
    global _EXECUTOR
    if _EXECUTOR is None:
        import llguidance

        _EXECUTOR = llguidance.LLExecutor()
    return _EXECUTOR


def set_threads(n: int) -> None:
    """Size llguidance's thread pool (default: 80% of the cores; bench/probes/grammar_masks.py, removed
    after commit `b436043`)."""
    import llguidance

    global _EXECUTOR
    _EXECUTOR = llguidance.LLExecutor(num_threads=n)


def next_masks(matchers, rows: int, vocab: int) -> np.ndarray:
    """[rows, W]: row i the mask after matchers[i]'s tokens so far (None, and rows past the list:
    every token allowed)."""
    out = allow_all(rows, vocab)
    pairs = [(m.ll, i) for i, m in enumerate(matchers) if m is not None]
    if pairs:
        _executor().unsafe_compute_mask_ptr(pairs, out.ctypes.data, out.shape[1] * 4, rows)
    return out


def _chains(parents: np.ndarray) -> list[tuple[list[int], list[int]]]:
    """A tree's root-to-leaf paths, the longest first, each cut where it leaves the paths before it:
    (the path to its branch node — root first, the branch node last —, the nodes past it). Nodes
    whose path does not reach the root (padding) are left out."""
    n = parents.shape[0]
    depth = [0] + [-1] * (n - 1)
    has_child = [False] * n
    for i in range(1, n):  # parents come before their children in the tree's node order
        p = int(parents[i])
        if p >= 0 and depth[p] >= 0:
            depth[i] = depth[p] + 1
            has_child[p] = True
    leaves = sorted((i for i in range(n) if depth[i] >= 0 and not has_child[i] and i), key=lambda i: -depth[i])
    covered, chains = {0}, []
    for leaf in leaves:
        path = [leaf]
        while path[-1] != 0:
            path.append(int(parents[path[-1]]))
        path.reverse()
        cut = max(i for i, node in enumerate(path) if node in covered)
        chains.append((path[:cut + 1], path[cut + 1:]))
        covered.update(path)
    return chains


def tree_masks(matchers, tokens: np.ndarray, parents: np.ndarray, vocab: int) -> np.ndarray:
    """[B, N, W]: for each request with a matcher, node n's mask after the path root → n (what
    `Matcher.tree_masks` computes for one request), for the whole batch on llguidance's threads.

    Each request's tree is cut into chains (`_chains`): the longest root-to-leaf path, then each
    other leaf's path from where it branches off. llguidance computes a chain's masks in one call
    (a mask, a token consumed, a mask, ..., then rolled back); a branch's matcher first consumes the
    path to its branch node (here, on this thread: a few microseconds a token; a mask costs ~10-30)
    and rolls it back after. A matcher can be in one chain of a parallel call only, so the chains go
    in waves: wave w holds every request's w-th chain (a (5,4,8) tree has 2-4 leaves). A node whose
    path the grammar refuses keeps the all-allowed mask, as in `Matcher.tree_masks` (its parent's
    mask rules it out)."""
    b, n = tokens.shape
    words = mask_words(vocab)
    out = np.full((b, n, words), -1, np.int32)
    chains = [_chains(parents[i]) if m is not None else [] for i, m in enumerate(matchers)]
    for wave in range(max((len(c) for c in chains), default=0)):
        entries, placed, advanced, rows = [], [], [], 0
        for i, c in enumerate(chains):
            if wave >= len(c):
                continue
            (head, new), ll = c[wave], matchers[i].ll
            if len(head) > 1:  # to the branch node (the root's token is emitted already)
                prefix = [int(t) for t in tokens[i, head[1:]]]
                took = ll.try_consume_tokens(prefix)
                if took:
                    advanced.append((ll, took))
                if took < len(prefix):  # the grammar refuses the branch node: nothing past it is reachable
                    continue
            nodes = [head[-1]] + new  # `new` holds at least the chain's leaf, which no earlier chain covers
            entries.append((ll, rows, [int(t) for t in tokens[i, new]]))
            placed.append((i, nodes, rows))
            rows += len(nodes)
        if entries:
            scratch = np.full((rows, words), -1, np.int32)
            _executor().unsafe_compute_mask_ptr_with_draft_token(entries, scratch.ctypes.data, words * 4, rows)
            for i, nodes, r0 in placed:
                out[i, nodes] = scratch[r0:r0 + len(nodes)]
        for ll, took in advanced:
            ll.rollback(took)
    return out
