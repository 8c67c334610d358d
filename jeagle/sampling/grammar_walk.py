"""Greedy grammar rows of a speculative round (jeagle/sampling/grammar.py): the host checks the target's best
tokens along the path the accept walks instead of computing a mask per tree node (`walk_nodes`)."""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from jeagle.sampling.grammar import Matcher

CANDIDATES = 8  # the verify's top tokens per tree node the host checks (`walk_nodes`)


def walk_nodes(matcher: "Matcher", tokens: np.ndarray, parents: np.ndarray, top_ids: np.ndarray,
               top_vals: np.ndarray, words: int) -> dict | None:
    """A greedy row's masks from the target's top CANDIDATES tokens at every tree node (ids and logits,
    [N, C], best first) instead of a mask per node: what a node's masked argmax is, a few token checks
    say (~4 µs each where a mask costs 20-150 µs). Returns {node: what its mask allows} for the nodes
    the walk constrains — a list of token ids (at most C), or a [W] uint32 mask where the grammar allows
    several tokens, none of them a candidate —, every other node allowing every token; None where the
    walk cannot decide.

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
    allows EOS alone. Undecided where that cannot decide a node on the path (several tokens allowed,
    none of them a candidate, a child's among them; a tie at the last candidate; a tie with EOS): the
    row then needs `tree_masks` (`UNDECIDED` counts why).

    The matcher moves along the walked path (a token consumed per step: each check is then one
    token's) and is rolled back before this returns."""
    ll, eos, last = matcher.ll, matcher.eos, top_vals.shape[1] - 1
    if matcher.stopped:  # the grammar is complete: EOS alone may follow (the row ends at the root)
        return _undecided("error") if ll.is_error() else {0: [eos]}
    toks, pars = tokens.tolist(), parents.tolist()  # Python scalars: the walk reads them one by one
    children: dict[tuple[int, int], int] = {}
    for j in range(1, len(toks)):
        if pars[j] >= 0:
            key = (pars[j], toks[j])
            if key in children:  # siblings with one token (top-K gives none): which one the walk takes is the device's
                return _undecided("siblings")
            children[key] = j
    nodes: dict = {}
    moved = 0
    try:
        node = 0
        while True:
            ids, vals = top_ids[node].tolist(), top_vals[node].tolist()
            best, ok = None, None
            for k in range(last + 1):
                if ids[k] == eos:  # EOS is the grammar's to judge (its end): the full mask
                    break
                if ll.validate_tokens([ids[k]]) == 1:
                    best = k
                    break
            if best is None:
                full = _node_mask(ll, words)
                ok = [(int(full[t >> 5]) >> (t & 31)) & 1 for t in ids]
                best = next((k for k in range(last + 1) if ok[k]), None)
                if best is None:  # no candidate allowed: decided only if the grammar allows one token
                    c = _single(full)
                    if c is None:  # the device's choice is not known here: decided if no child can be it
                        if any((int(full[t >> 5]) >> (t & 31)) & 1 for p, t in children if p == node):
                            return _undecided("none_of_the_candidates")
                        nodes[node] = full
                        return nodes
                    nodes[node] = [c]
                    if c == eos or (node, c) not in children:  # the row ends at EOS: what follows is cut
                        return nodes
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
            nodes[node] = allowed
            # The device's argmax takes the first of tied maxima (jnp.argmax): the lowest allowed id.
            c = min(allowed)
            if c == eos:
                return nodes  # the row ends at EOS: what follows it is cut
            nxt = children.get((node, c))
            if nxt is None:
                return nodes
            node = nxt
            moved += _advance(ll, c)
    finally:
        if moved:
            ll.rollback(moved)


def walk_masks(matcher: "Matcher", tokens: np.ndarray, parents: np.ndarray, top_ids: np.ndarray,
               top_vals: np.ndarray, out: np.ndarray) -> bool:
    """`walk_nodes` as bitmasks, one row (the engine assembles a batch's from `walk_nodes` itself): the
    row's masks [N, W] in `out`; False where the walk cannot decide."""
    nodes = walk_nodes(matcher, tokens, parents, top_ids, top_vals, out.shape[1])
    if nodes is None:
        return False
    out[:] = -1
    write_nodes(nodes, out)
    return True


def write_nodes(nodes: dict, out: np.ndarray) -> None:
    """A walked row's nodes (`walk_nodes`) into its bitmask rows `out` [N, W] (the others left as they are)."""
    for node, allowed in nodes.items():
        row = out[node].view(np.uint32)
        if isinstance(allowed, np.ndarray):
            row[:] = allowed
            continue
        row[:] = 0
        for t in allowed:
            row[t >> 5] |= np.uint32(1 << (t & 31))


def compact(nodes: dict) -> bool:
    """Whether a walked row's masks are token lists only (`walk_nodes`): the accept can take them as ids."""
    return all(not isinstance(a, np.ndarray) for a in nodes.values())


# Why `walk_nodes` left rows to full tree masks (counts in this process; the engines' info reports them).
UNDECIDED: collections.Counter = collections.Counter()


def _undecided(reason: str) -> None:
    UNDECIDED[reason] += 1


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
