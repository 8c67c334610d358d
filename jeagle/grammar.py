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
    speculative     the draft tree's tokens come to the host while the device runs the verify's
                    forward; each tree node gets the mask after its path (root excluded: emitted
                    already: `tree_masks`), or for a greedy row the mask of the one path the accept
                    walks (`walk_masks`, from the forward's best tokens), so the accept takes only
                    tokens the grammar allows and emits what constrained target-only decoding emits

A target-only grammar step needs the previous step's tokens first (the scheduler drains what is in
flight before it); a speculative one reads them while its draft and forward run
(`runtime/scheduler.py`, `spec/decoder.py`). Masks are computed on llguidance's thread pool.
"""

from __future__ import annotations

import collections
import json
import threading
from dataclasses import dataclass

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
        grammar = self._compile(kind, source)
        with self._lock:
            self._compiled[key] = grammar
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
        _build(compiled)  # one matcher built here: its requests' matchers, built in the background, then build too
        return compiled


@dataclass(frozen=True, eq=False)
class Grammar:
    """A compiled grammar; `matcher()` starts a request's matcher."""
    kind: str
    source: str  # llguidance's grammar text
    backend: GrammarBackend

    def matcher(self, background: bool = False) -> "Matcher":
        """A request's matcher at the grammar's start; `background`: built on a worker thread (its
        `ready` says when), so the thread that queues requests does not pay for it."""
        return Matcher(self, background)


class Matcher:
    """One request's grammar state, in step with the tokens the request has emitted.

    Each request builds its own llguidance matcher. Copies of one template matcher (`deep_copy`)
    would share its lazily built lexer automaton — a request's first masks then cost 13 ms instead of
    87 ms per 400 requests on the CI machine — but they share it behind a lock: on the H100 host's 16
    cores, 48 requests' tree masks took 23.6 ms batched from copies against 8.0 ms from matchers of
    their own (bench/probes/grammar_masks.py, bench/RESULTS.md).

    Building one parses the grammar's text (~1 ms for a small JSON schema), with the GIL released:
    `background=True` builds it on a worker thread (`_build_soon`), and `ready` says whether it is
    built; `_ll` waits for it (a build that failed raises its GrammarError there)."""

    def __init__(self, grammar: Grammar, background: bool = False):
        self.words = mask_words(grammar.backend.vocab_size)
        self.eos = grammar.backend.eos_token_id
        self._built, self._future = None, None
        if background:
            self._future = _build_soon(grammar)
        else:
            self._built = _build(grammar)

    @property
    def _ll(self):
        if self._built is None:
            self._built, self._future = self._future.result(), None
        return self._built

    @property
    def ready(self) -> bool:
        """Built (or its build failed: `_ll` raises)."""
        return self._built is not None or self._future.done()

    def consume(self, token: int) -> None:
        if not self._ll.consume_token(int(token)):
            raise AssertionError(f"the grammar refused token {token} that the masks allowed: {self._ll.get_error()}")

    def mask(self) -> np.ndarray:
        """[W] int32: the tokens allowed next."""
        out = np.zeros(self.words, np.int32)
        self._ll.unsafe_compute_mask_ptr(out.ctypes.data, out.nbytes)
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
            took = self._ll.try_consume_tokens(path) if path else 0
            if took == len(path):
                self._ll.unsafe_compute_mask_ptr(out[i].ctypes.data, out[i].nbytes)
            if took:
                self._ll.rollback(took)
        return out

    def copy(self) -> "Matcher":
        """A matcher in this one's state, sharing its lexer cache (behind a lock: the class docstring)."""
        twin = object.__new__(Matcher)
        twin._built, twin._future, twin.words, twin.eos = self._ll.deep_copy(), None, self.words, self.eos
        return twin

    @property
    def stopped(self) -> bool:
        return self._ll.is_stopped()


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
    """Size llguidance's thread pool (default: 80% of the cores; bench/probes/grammar_masks.py)."""
    import llguidance

    global _EXECUTOR
    _EXECUTOR = llguidance.LLExecutor(num_threads=n)


def next_masks(matchers, rows: int, vocab: int) -> np.ndarray:
    """[rows, W]: row i the mask after matchers[i]'s tokens so far (None, and rows past the list:
    every token allowed)."""
    out = allow_all(rows, vocab)
    pairs = [(m._ll, i) for i, m in enumerate(matchers) if m is not None]
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
            (head, new), ll = c[wave], matchers[i]._ll
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


# ---- greedy rows: check the target's choices instead of computing masks ---------------------------------
CANDIDATES = 8  # the verify's top tokens per tree node the host checks (`walk_masks`)


def walk_masks(matcher: Matcher, tokens: np.ndarray, parents: np.ndarray, top_ids: np.ndarray,
               top_vals: np.ndarray, out: np.ndarray) -> bool:
    """A greedy row's masks [N, W] in `out`, from the target's top CANDIDATES tokens at every tree node
    (ids and logits, [N, C], best first) instead of a mask per node: what a node's masked argmax is,
    a few token checks say (~4 µs each where a mask costs 20-150 µs).

    The accept walk visits one node per depth: at node n it emits the grammar's best token c* (the
    masked argmax) and moves to the child whose token is c*, if any. So the host walks the same path:
    at each node the first candidate the grammar allows is c* — provided its logit is above the last
    candidate's (a token outside the candidates may tie it otherwise) — and the node's mask allows c*
    and any allowed candidate tied with it (the device's argmax then picks among them as it would
    under the full mask: the lowest id, `jnp.argmax`'s first maximum, so the walk goes on from that
    one). Nodes off the path keep every token allowed: the walk never reaches them.

    Where EOS comes before any allowed candidate, or no candidate is allowed, the node's full mask
    decides (one mask, not a tree of them): it says whether EOS and the candidates are allowed, and a
    grammar that allows a single token there (a closing quote, a comma) has chosen it, whatever the
    logits; where it allows several, none of them a candidate, the walk ends there if no child's token
    is among them (the device's choice, whichever it is, leaves the tree). A grammar that is complete
    allows EOS alone. Returns False where that cannot decide a node on the path (several tokens
    allowed, none of them a candidate, a child's among them; a tie at the last candidate; a tie with
    EOS): the row then needs `tree_masks` (`UNDECIDED` counts why).

    The matcher moves along the walked path (a token consumed per step: each check is then one
    token's) and is rolled back before this returns."""
    ll, eos, last = matcher._ll, matcher.eos, top_vals.shape[1] - 1
    if matcher.stopped:  # the grammar is complete: EOS alone may follow (the row ends at the root)
        if ll.is_error():
            return _undecided("error")
        out[:] = -1
        out[0] = 0
        out[0, eos >> 5] = np.int32(np.uint32(1 << (eos & 31)).view(np.int32))
        return True
    toks, pars = tokens.tolist(), parents.tolist()  # Python scalars: the walk reads them one by one
    children: dict[tuple[int, int], int] = {}
    for j in range(1, len(toks)):
        if pars[j] >= 0:
            key = (pars[j], toks[j])
            if key in children:  # siblings with one token (top-K gives none): which one the walk takes is the device's
                return _undecided("siblings")
            children[key] = j
    out[:] = -1
    moved = 0
    try:
        node = 0
        while True:
            ids, vals = top_ids[node].tolist(), top_vals[node].tolist()
            row = out[node].view(np.uint32)
            best, ok = None, None
            for k in range(last + 1):
                if ids[k] == eos:  # EOS is the grammar's to judge (its end): the full mask
                    break
                if ll.validate_tokens([ids[k]]) == 1:
                    best = k
                    break
            if best is None:
                full = _node_mask(ll, out.shape[1])
                ok = [(int(full[t >> 5]) >> (t & 31)) & 1 for t in ids]
                best = next((k for k in range(last + 1) if ok[k]), None)
                if best is None:  # no candidate allowed: decided only if the grammar allows one token
                    c = _single(full)
                    row[:] = full
                    if c is None:  # the device's choice is not known here: decided if no child can be it
                        if any((int(full[t >> 5]) >> (t & 31)) & 1 for p, t in children if p == node):
                            return _undecided("none_of_the_candidates")
                        return True
                    if c == eos or (node, c) not in children:  # the row ends at EOS: what follows is cut
                        return True
                    node = children[node, c]
                    moved += _advance(ll, c)
                    continue
            if not vals[best] > vals[last]:
                return _undecided("tie_at_the_last_candidate")
            tied = [k for k in range(best + 1, last + 1) if vals[k] == vals[best]]
            if ok is None and any(ids[k] == eos for k in tied):
                return _undecided("tie_with_eos")
            allowed = [ids[best]] + [ids[k] for k in tied
                                     if (ok[k] if ok is not None else ll.validate_tokens([ids[k]]) == 1)]
            row[:] = 0
            for t in allowed:
                row[t >> 5] |= np.uint32(1 << (t & 31))
            # The device's argmax takes the first of tied maxima (jnp.argmax): the lowest allowed id.
            c = min(allowed)
            if c == eos:
                return True  # the row ends at EOS: what follows it is cut
            nxt = children.get((node, c))
            if nxt is None:
                return True
            node = nxt
            moved += _advance(ll, c)
    finally:
        if moved:
            ll.rollback(moved)


# Why `walk_masks` left rows to full tree masks (counts in this process; the engines' info reports them).
UNDECIDED: collections.Counter = collections.Counter()


def _undecided(reason: str) -> bool:
    UNDECIDED[reason] += 1
    return False


def _advance(ll, token: int) -> int:
    """Consume one token the walk found allowed; 1."""
    if ll.try_consume_tokens([token]) != 1:
        raise AssertionError(f"the grammar refused token {token} that it had allowed")
    return 1


def _single(mask: np.ndarray) -> int | None:
    """The one token a [W] uint32 mask allows, or None (none, or several)."""
    words = np.flatnonzero(mask)
    if words.size != 1:
        return None
    w = int(mask[words[0]])
    return int(words[0]) * 32 + w.bit_length() - 1 if w & (w - 1) == 0 else None


def _node_mask(ll, words: int) -> np.ndarray:
    """[W] uint32: the mask in the matcher's current state."""
    out = np.zeros(words, np.uint32)
    ll.unsafe_compute_mask_ptr(out.ctypes.data, out.nbytes)
    return out
