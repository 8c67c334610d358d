"""The prefix cache: a radix tree over token keys whose values are KV slots (SGLang's RadixAttention,
page size 1).

A key is one int per cached position. Target-only decoding keys position i by its token t_i (the KV
there depends on t_0..t_i). Speculative decoding keys it by the pair (t_i, t_{i+1}) (`bigram_keys`):
the draft's KV at position i is computed from token t_{i+1} and the target's feature at i, so a
position is reusable only when the next token agrees too (SGLang's EAGLE radix cache does the same).

Each node holds a run of keys and the slots of those positions; `ref` counts the requests using the
node (a request locks the whole path from its deepest node to the root). Unreferenced leaves are
evictable, least recently used first; eviction hands their slots back to the caller. The tree only
ever owns slots whose KV is written (or dispatched to be written before anything that reads it).
"""

from __future__ import annotations

import heapq
import itertools

import numpy as np


def token_keys(tokens, n: int) -> list[int]:
    """Keys of positions 0..n-1 for target-only decoding: the tokens themselves."""
    return np.asarray(tokens[:n], np.int64).tolist()


def bigram_keys(tokens, n: int, vocab: int) -> list[int]:
    """Keys of positions 0..n-1 for speculative decoding: (t_i, t_{i+1}) as one int (needs n + 1 tokens)."""
    if n >= len(tokens):
        raise ValueError("bigram keys of n positions need n + 1 tokens")
    t = np.asarray(tokens[:n + 1], np.int64)  # a request finishing computes ~its whole sequence's: no Python loop
    return (t[:-1] * vocab + t[1:]).tolist()


class Node:
    __slots__ = ("key", "slots", "children", "parent", "ref", "last_use", "__weakref__")

    def __init__(self, key: list[int], slots: np.ndarray, parent: "Node | None"):
        self.key, self.slots, self.parent = key, slots, parent
        self.children: dict[int, Node] = {}
        self.ref = 0
        self.last_use = 0


class RadixCache:
    def __init__(self):
        self.root = Node([], np.zeros((0,), np.int32), None)
        self.root.ref = 1  # never evicted
        self._clock = itertools.count(1)
        self.cached_slots = 0  # slots the tree owns
        self.locked_slots = 0  # of them, in nodes some request uses

    # ---- lookups ----------------------------------------------------------------------------------
    def match(self, key: list[int]) -> tuple[np.ndarray, Node]:
        """The slots of the longest cached prefix of `key` and the node it ends in (a node that ends
        mid-way is split so that the match ends on a node boundary). Touches the path (LRU)."""
        node, pos, parts = self.root, 0, []
        now = next(self._clock)
        while pos < len(key):
            child = node.children.get(key[pos])
            if child is None:
                break
            n = _common(child.key, key, pos)
            if n < len(child.key):
                child = self._split(child, n)
            parts.append(child.slots)
            child.last_use = now
            node, pos = child, pos + n
        return (np.concatenate(parts) if parts else np.zeros((0,), np.int32)), node

    def insert(self, key: list[int], slots: np.ndarray) -> tuple[int, Node]:
        """Cache `slots` [len(key)] under `key`. Positions already cached keep their slots; returns
        (how many positions were cached already — the caller's slots for those are not taken —, the
        node the key ends in). The new part's slots belong to the tree from now on."""
        if len(slots) != len(key):
            raise ValueError("one slot per key")
        node, pos = self.root, 0
        now = next(self._clock)
        while pos < len(key):
            child = node.children.get(key[pos])
            if child is None:
                new = Node(list(key[pos:]), np.asarray(slots[pos:], np.int32).copy(), node)
                new.last_use = now
                node.children[key[pos]] = new
                self.cached_slots += len(new.key)
                return pos, new
            n = _common(child.key, key, pos)
            if n < len(child.key):
                child = self._split(child, n)
            child.last_use = now
            node, pos = child, pos + n
        return pos, node

    def _split(self, child: Node, n: int) -> Node:
        """Cut `child` after n keys: a new parent holding the first n, `child` keeping the rest."""
        top = Node(child.key[:n], child.slots[:n], child.parent)
        top.ref, top.last_use = child.ref, child.last_use
        top.parent.children[top.key[0]] = top
        child.key, child.slots, child.parent = child.key[n:], child.slots[n:], top
        top.children[child.key[0]] = child
        return top

    # ---- references ----------------------------------------------------------------------------------
    def lock(self, node: Node) -> None:
        """A request uses the path root..node: none of it may be evicted."""
        while node is not self.root:
            if node.ref == 0:
                self.locked_slots += len(node.key)
            node.ref += 1
            node = node.parent

    def unlock(self, node: Node) -> None:
        while node is not self.root:
            if node.ref <= 0:
                raise AssertionError("radix cache: unlocking a node nobody locked")
            node.ref -= 1
            if node.ref == 0:
                self.locked_slots -= len(node.key)
            node = node.parent

    @property
    def evictable_slots(self) -> int:
        return self.cached_slots - self.locked_slots

    # ---- eviction ------------------------------------------------------------------------------------
    def evict(self, want: int) -> list[np.ndarray]:
        """Evict unreferenced leaves, least recently used first, until `want` slots are freed or
        nothing more is evictable; returns the freed slot arrays."""
        heap = [(n.last_use, id(n), n) for n in self._leaves() if n.ref == 0]
        heapq.heapify(heap)
        freed, got = [], 0
        while heap and got < want:
            _, _, node = heapq.heappop(heap)
            if node.ref or node.children or node.parent is None:
                continue
            del node.parent.children[node.key[0]]
            freed.append(node.slots)
            got += len(node.slots)
            self.cached_slots -= len(node.key)
            parent = node.parent
            node.parent = None
            if parent is not self.root and not parent.children and parent.ref == 0:
                heapq.heappush(heap, (parent.last_use, id(parent), parent))
        return freed

    def clear(self) -> list[np.ndarray]:
        """Evict everything unreferenced (`/flush_cache`)."""
        return self.evict(self.cached_slots)

    def _leaves(self):
        stack = [self.root]
        while stack:
            n = stack.pop()
            if n.children:
                stack.extend(n.children.values())
            elif n is not self.root:
                yield n

    def nodes(self):
        """Every node but the root (for invariant checks)."""
        stack = list(self.root.children.values())
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())


def _common(a: list[int], key: list[int], pos: int) -> int:
    """How many leading keys of `a` equal key[pos:]. A match usually runs a node's whole key (a shared
    system prompt: ~1,000 positions), which one list comparison settles in C; a mismatch in a long run
    is found with NumPy."""
    n = min(len(a), len(key) - pos)
    if a[:n] == key[pos:pos + n]:
        return n
    if n > 32:
        return int(np.flatnonzero(np.asarray(a[:n]) != np.asarray(key[pos:pos + n]))[0])
    i = 0
    while a[i] == key[pos + i]:
        i += 1
    return i
