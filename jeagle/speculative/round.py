"""One speculative round as one jitted function: draft → tree → verify → accept → finish → commit → extend.

Per-row device state (`SpecRows`, donated between rounds) carries everything the next round needs,
so rounds chain on the device with no host round trip:

    root          [R]      the previous round's bonus token, at position L (no KV yet)
    seq_len       [R]      L: positions 0..L-1 hold target and draft KV
    topk_p/topk_id[R, K]   the draft's top-K at the root (target ids), from the last draft extend
    feature       [R, H]   the draft hidden recycled as the first draft step's feature
    tree_slots    [R, N]   slots the verify writes the N tree tokens' KV into (target and draft pools)
    scratch_slots [R, SK]  slots for the draft's KV of the round's beam tokens, SK = (S-1)·K

Tiers. The rows are laid out for the largest tier an engine runs (`RowLayout`: the largest K, N and
SK of its tiers); a round of a smaller tier uses the first K / N / SK columns and leaves the rest
untouched. Top-K is sorted, so the first K of the stored top-K_max are the top-K: the next round may
run any tier (the adaptive controller switches between rounds, `jeagle/speculative/adaptive.py`).
    n_generated, max_new, stop_ids [R, MAX_STOP] (-1 padded), finished, sampling parameters

Slot ownership. A request owns its position slots, its N tree slots and its scratch slots for its
whole life. Commit swaps, for each accepted node j, the slot at position L+j with the node's tree
slot: the accepted KV (target and draft) becomes the prefix without a copy, and the position slot
becomes a free tree slot for the next round.

Draft pairing: the draft consumes (token at p+1, feature at p) at position p. Step i ≥ 1 of the round
feeds the beam tokens of depth i (position L+i) at position L+i-1 with their parents' draft hidden.

Phases. Each phase runs under a `jax.named_scope` (metadata only: the op_name of every HLO op it
emits), so a profile can split a round's device time by phase (`bench/profile_decode.py --phases`):
`draft_step` (each of the S-1 draft head forwards), `draft_topk` (the draft's softmax/top-K and the
beam bookkeeping), `tree_build`, `verify_forward`, `accept`, `finish`, `draft_extend` (the head over
the tree, its top-K, the next feature), `commit`; `PHASES` lists them, `OPTIONAL_PHASES` the two
that only executables compiled for them run (`penalties`, `logprobs`).
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from jeagle.models.common import AttnInputs
from jeagle.kernels.build_tree import build_tree
from jeagle.kernels.commit_slots import commit_slots
from jeagle.kernels.topk import softmax_topk
from jeagle.kernels.tree_speculative_sampling import tree_speculative_sampling
from jeagle.kernels.verify_tree_greedy import verify_tree_greedy
from jeagle.sampling.grammar import apply_token_mask
from jeagle.sampling.logprobs import LOGPROB_COLUMNS, pack as pack_logprobs, split as split_logprobs, token_logprobs
from jeagle.sampling.penalties import MAX_STOP  # stop token ids per request the device checks
from jeagle.sampling.penalties import (PenaltyRows, add_tokens, apply as apply_penalties, gather as gather_penalties,
                              path_counts)
from jeagle.speculative.tree import select_nodes
from jeagle.speculative.verify import simulated_accept, target_probs

# The named scopes of a round's phases (module docstring), in the order a round runs them.
PHASES = ("draft_step", "draft_topk", "tree_build", "verify_forward", "accept", "finish", "draft_extend", "commit")
# Phases only the executables compiled for them run (penalties: after verify_forward; logprobs: last).
OPTIONAL_PHASES = ("penalties", "logprobs")
ALL_PHASES = PHASES + OPTIONAL_PHASES


@dataclass(frozen=True)
class SpecConfig:
    num_steps: int = 5  # S
    topk: int = 4  # K
    num_draft_tokens: int = 8  # N (the root included)
    threshold_single: float = 1.0
    threshold_acc: float = 1.0

    def __post_init__(self):
        s, k, n = self.num_steps, self.topk, self.num_draft_tokens
        if s < 1 or k < 1 or n < 2:
            raise ValueError(f"speculative steps/topk/draft tokens must be >= 1/1/2, got {s}/{k}/{n}")
        if k == 1 and n != s + 1:
            raise ValueError(f"with topk 1 (a chain) num_draft_tokens must be num_steps + 1 = {s + 1}, got {n}")
        if n - 1 > k + (s - 1) * k * k:
            raise ValueError(f"num_draft_tokens {n}: N-1 = {n - 1} exceeds the {k + (s - 1) * k * k} nodes that "
                             f"{s} steps of top-{k} produce (K + (S-1)K²)")
        if not (0 < self.threshold_acc <= 1 and 0 < self.threshold_single <= 1):
            raise ValueError("accept thresholds must be in (0, 1]")

    @property
    def scratch(self) -> int:
        return max(1, (self.num_steps - 1) * self.topk)

    @property
    def shape(self) -> tuple[int, int, int]:
        """(S, K, N)."""
        return (self.num_steps, self.topk, self.num_draft_tokens)

    def check_simulated_accept(self, tau: float) -> None:
        """A simulated accept length (bench only: `simulated_accept`) this tier can produce."""
        s, k, n = self.shape
        if tau and not 1.0 <= tau <= min(s, n - 1) + 1:
            raise ValueError(f"simulated accept length {tau}: must be in [1, {min(s, n - 1) + 1}] "
                             f"for (S,K,N) = ({s},{k},{n})")


@jax.tree_util.register_dataclass
@dataclass
class SpecRows:
    root: jax.Array
    seq_len: jax.Array
    topk_p: jax.Array
    topk_id: jax.Array
    feature: jax.Array
    tree_slots: jax.Array
    scratch_slots: jax.Array
    n_generated: jax.Array
    max_new: jax.Array
    stop_ids: jax.Array
    finished: jax.Array
    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    seed: jax.Array

    def gather(self, rows):
        return jax.tree.map(lambda x: x[rows], self)

    def scatter(self, rows, new: "SpecRows") -> "SpecRows":
        return jax.tree.map(lambda x, y: x.at[rows].set(y), self, new)


@dataclass(frozen=True)
class RowLayout:
    """Row-state widths covering every tier an engine runs."""
    num_steps: int  # the deepest tier's S (positions reserved past the last token: S + 1)
    topk: int
    num_draft_tokens: int
    scratch: int

    @classmethod
    def covering(cls, tiers) -> "RowLayout":
        return cls(max(t.num_steps for t in tiers), max(t.topk for t in tiers), max(t.num_draft_tokens for t in tiers),
                   max(t.scratch for t in tiers))


def init_rows(num_rows: int, cfg: "SpecConfig | RowLayout", hidden: int, dtype) -> SpecRows:
    r, k = num_rows, cfg.topk
    z = lambda *s, dt=jnp.int32: jnp.zeros(s, dt)  # noqa: E731
    return SpecRows(root=z(r), seq_len=z(r), topk_p=z(r, k, dt=jnp.float32), topk_id=z(r, k), feature=z(r, hidden, dt=dtype),
                    tree_slots=z(r, cfg.num_draft_tokens), scratch_slots=z(r, cfg.scratch), n_generated=z(r),
                    max_new=z(r), stop_ids=jnp.full((r, MAX_STOP), -1, jnp.int32),
                    finished=jnp.ones((r,), bool), temperature=z(r, dt=jnp.float32), top_k=z(r),
                    top_p=jnp.ones((r,), jnp.float32), seed=z(r, dt=jnp.uint32))


def pack_result(emitted, accepted, finished, nested=None):
    """A step's result as one int32 array [B, W + 2 (+ T)], so one device→host copy carries it:

        | emitted tokens (W, -1 padded) | accepted drafts (bonus excluded; -1: no round for the row) | finished |
        | with `nested` [B, T]: the drafts each nested tier would have accepted (`nested_accepts`) |

    `RoundResult.unpack` is the host's view of it."""
    parts = [emitted, accepted[:, None], finished[:, None].astype(jnp.int32)]
    return jnp.concatenate(parts + ([] if nested is None else [nested.astype(jnp.int32)]), 1)


def packed_width(num_steps: int, logprobs: bool = False, nested: int = 0) -> int:
    """Columns of a round's result for a tier of `num_steps` draft steps: `pack_result`'s, then any
    logprob blocks (one per emitted token)."""
    w = num_steps + 1
    return w + 2 + nested + (w * LOGPROB_COLUMNS if logprobs else 0)


def pad_columns(result, width: int):
    """`result` [..., C] widened to `width` columns with -1 (as is when width <= C): an adaptive
    decoder's tiers then all return one shape, so a tier switch leaves the device allocator's
    addresses, and with them XLA's command buffers, as they were (bench/HISTORY.md, 2026-11-27: an
    unpadded switch cost 1.8-3.2 ms of host time in the next dispatch at batch 48, padded ~0.2 ms)."""
    if width <= result.shape[-1]:
        return result
    return jnp.concatenate([result, jnp.full(result.shape[:-1] + (width - result.shape[-1],), -1, result.dtype)], -1)


@jax.tree_util.register_dataclass
@dataclass
class NestedTrees:
    """What a round needs to tell what each nested tier would have accepted (`nested_trees`)."""
    member: jax.Array  # [B, T, M] bool: candidate m is a node of nested tier t's tree
    tokens: jax.Array  # [B, M] the candidates' tokens
    parents: jax.Array  # [B, M] their parents' candidate indices (-1: the root)
    selected: jax.Array  # [B, N-1] the running tree's candidates (node i = selected[i - 1])


def nested_trees(scores, tokens, parents, selected, topk: int, nested: tuple[tuple[int, int], ...]) -> NestedTrees:
    """The trees of the tiers (S', K, N') nested in the running (S, K, N) (S' <= S), over the round's
    candidates `scores` / `tokens` / `parents` [B, M]. Such a tier's S' draft steps are the running
    tier's first S' (the beam at each step is the top-K of the same expansion, whatever S and N), so
    its candidates are the first K + (S'-1)·K² and its tree is their N'-1 best: what `select_nodes`
    takes from that prefix, ties to the lower index (as jax.lax.top_k breaks them), found here by
    ranks (one [B, M, M] compare for every tier, no sort)."""
    m = scores.shape[1]
    idx = jnp.arange(m)
    ahead = (scores[:, None, :] > scores[:, :, None]) | (
        (scores[:, None, :] == scores[:, :, None]) & (idx[None, None, :] < idx[None, :, None]))  # [B, m, m']
    member = []
    for s_j, n_j in nested:
        c = topk + (s_j - 1) * topk * topk
        rank = jnp.sum(ahead & (idx < c)[None, None, :], -1)  # candidates of the prefix ahead of m
        member.append((idx[None, :] < c) & (rank < n_j - 1))
    return NestedTrees(jnp.stack(member, 1), tokens, parents, selected)


def nested_accepts(nt: NestedTrees, path, acc, bonus):
    """The drafts (bonus excluded) each nested tier would have accepted this round, from the accepted
    path [B, S+1] (tree node ids; acc [B] drafts) and the token the target chose after it (bonus [B]).
    A greedy tree walk accepts, at each depth, the one child whose token is the target's choice at its
    parent. The nested tree holds the path's nodes up to some depth: where it lacks one, its walk stops
    there too (no other child carries that token); where it holds them all, it goes one further if it
    holds the child of the path's end carrying `bonus` (a node the running tree lacked). Exact for
    greedy rows, unless that extra child itself has children in the nested tree (then a lower bound:
    the target never saw them); for sampled rows an estimate (the siblings' rejection order differs)."""
    cand = jnp.take_along_axis(nt.selected, jnp.maximum(path[:, 1:] - 1, 0), 1)  # [B, S] path candidates
    on_path = jnp.take_along_axis(nt.member, cand[:, None, :], 2)  # [B, T, S]
    depth = jnp.arange(1, path.shape[1])
    ok = on_path & (depth[None, None, :] <= acc[:, None, None])
    lead = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), -1), -1)  # [B, T]
    end = jnp.where(acc > 0, jnp.take_along_axis(cand, jnp.maximum(acc - 1, 0)[:, None], 1)[:, 0], -1)
    child = (nt.parents == end[:, None]) & (nt.tokens == bonus[:, None])  # [B, M]
    further = jnp.any(nt.member & child[:, None, :], -1) & (lead == acc[:, None])
    return (lead + further).astype(jnp.int32)


@dataclass
class RoundResult:
    """A round's (or a speculative prefill's) result on the host, unpacked from `pack_result`
    (with `logprobs`: followed by the W tokens' packed logprobs, `jeagle.sampling.logprobs.pack`)."""
    tokens: "np.ndarray"  # [B, W] emitted tokens, -1 padded
    accepted: "np.ndarray"  # [B] accepted draft tokens, bonus excluded; -1 where no round ran
    finished: "np.ndarray"  # [B] bool
    logprobs: "np.ndarray | None" = None  # [B, W, LOGPROB_COLUMNS] packed, with `logprobs`
    nested: "np.ndarray | None" = None  # [B, T] what each nested tier would have accepted (-1: no round)

    @classmethod
    def unpack(cls, host, logprobs: bool = False, nested: int = 0) -> "RoundResult":
        blocks = None
        if logprobs:
            width = (host.shape[-1] - 2 - nested) // (1 + LOGPROB_COLUMNS)
            host, blocks = split_logprobs(host, width)
        base = host.shape[-1] - nested  # the columns before the nested tiers'
        return cls(tokens=host[:, : base - 2], accepted=host[:, base - 2], finished=host[:, base - 1].astype(bool),
                   logprobs=blocks, nested=host[:, base:] if nested else None)


def draft_topk(head, logits, k: int):
    """Top-K probabilities and target token ids of draft logits [..., Vd] (jeagle/kernels/topk.py: one
    kernel per row on a GPU, else softmax + jax.lax.top_k)."""
    p, idx = softmax_topk(logits, k)
    return p, head.draft_to_target(idx).astype(jnp.int32)


def round_keys(seed, seq_len, n):
    """Uniform coins [B, N] for the tree walk and [B] for the bonus, from (seed, L)."""
    def one(s, length):
        key = jax.random.fold_in(jax.random.fold_in(jax.random.key(s), length), 0x5EC)
        a, b = jax.random.split(key)
        return jax.random.uniform(a, (n,)), jax.random.uniform(b, ())
    return jax.vmap(one)(seed, seq_len)


def spec_round(target, head, cfg: SpecConfig, cache, dk, dv, rows: SpecRows, row_ids, *, kv_len: int, greedy: bool,
               aux_layers: tuple[int, ...], unroll: bool | int = False, simulate_accept: float = 0.0,
               logprobs: bool = False, penalties: PenaltyRows | None = None, nested: tuple[tuple[int, int], ...] = ()):
    """One round for the rows `row_ids` [B]. Returns (out [B, S+3 (+ T)] int32 (`pack_result`: emitted
    tokens, accept length, finished flag; with `nested` tiers (S', N') what each would have accepted;
    with `logprobs` the emitted tokens' packed logprobs appended); cache, dk, dv, rows, penalties
    (given: applied in the verify, the emitted tokens counted))."""
    tree, dk, dv, nt = draft_tree(target, head, cfg, cache, dk, dv, rows, row_ids, kv_len=kv_len,
                                  penalties=penalties, nested=nested)
    return verify_commit(target, head, cfg, cache, dk, dv, rows, row_ids, tree, kv_len=kv_len, greedy=greedy,
                         aux_layers=aux_layers, unroll=unroll, simulate_accept=simulate_accept, logprobs=logprobs,
                         penalties=penalties, nested=nt)


def _prefix(cache, row_ids, kv_len: int):
    """The prefix slot-table rows [B, kv_len]: positions j < seq_len hold the request's KV."""
    return cache.req_to_token[row_ids, :kv_len]


def _heads(target):
    embed = target.embed[...]
    return embed, (embed if target.lm_head is None else target.lm_head[...])


def draft_vocab_ids(head):
    """The target ids of the draft's vocabulary [Vd] (EAGLE-1: None, the same vocabulary)."""
    return None if head.d2t is None else head.draft_to_target(jnp.arange(head.d2t.shape[0], dtype=jnp.int32))


def draft_tree(target, head, cfg: SpecConfig, cache, dk, dv, rows: SpecRows, row_ids, *, kv_len: int,
               penalties: PenaltyRows | None = None, nested: tuple[tuple[int, int], ...] = ()):
    """Draft S steps of top-K expansion and build the verify tree. Returns (tree, dk, dv, nested):
    the `nested` tiers' (S', N') trees (`NestedTrees`; None without). penalties: the draft's logits
    penalized like the target's (the rows' counts), so it drafts what the verify will accept."""
    S, K, N = cfg.num_steps, cfg.topk, cfg.num_draft_tokens
    r = rows.gather(row_ids)
    b = row_ids.shape[0]
    L = r.seq_len
    prefix_slots = _prefix(cache, row_ids, kv_len)
    embed, lm_head_t = _heads(target)

    # ---- draft: S steps of top-K expansion ------------------------------------------------
    root_p, root_id = r.topk_p[:, :K], r.topk_id[:, :K]  # the rows may hold a larger tier's top-K
    scratch_slots = r.scratch_slots[:, : cfg.scratch]
    scores, tokens, parents = [root_p], [root_id], [jnp.full((b, K), -1, jnp.int32)]
    beam_tok, beam_scores = root_id, root_p
    beam_feat = jnp.broadcast_to(r.feature[:, None, :], (b, K, r.feature.shape[-1]))
    beam_flat = jnp.broadcast_to(jnp.arange(K, dtype=jnp.int32), (b, K))
    sk = cfg.scratch
    anc = jnp.zeros((b, K, sk), bool)
    if penalties is not None:  # the rows' penalties, on the draft's vocabulary
        pen, vocab_ids = gather_penalties(penalties, row_ids), draft_vocab_ids(head)
    for i in range(1, S):
        with jax.named_scope("draft_step"):
            entry = (i - 1) * K + jnp.arange(K)
            anc = anc.at[:, jnp.arange(K), entry].set(True)
            attn = AttnInputs(positions=jnp.broadcast_to((L + i - 1)[:, None], (b, K)),
                              write_slots=scratch_slots[:, entry], kv_slots=prefix_slots, kv_len=L,
                              extra_slots=scratch_slots, extra_mask=anc)
            out = head(beam_tok, beam_feat, attn, dk, dv, embed=embed, embed_split=target.vocab_split,
                       lm_head=lm_head_t)
            dk, dv = out.k, out.v
        with jax.named_scope("draft_topk"):
            logits = out.logits
            if penalties is not None:
                generated = jnp.broadcast_to((L - pen.prompt_len + 1 + i)[:, None], logits.shape[:2])
                logits = apply_penalties(logits, pen, generated, vocab_ids=vocab_ids)
            p, ids = draft_topk(head, logits, K)  # [B, K, K]
            expand = (beam_scores[:, :, None] * p).reshape(b, K * K)
            new_scores, cs = jax.lax.top_k(expand, K)
            parent_beam = cs // K
            scores.append(expand)
            tokens.append(ids.reshape(b, K * K))
            parents.append(jnp.repeat(beam_flat, K, axis=1))
            beam_tok = jnp.take_along_axis(ids.reshape(b, K * K), cs, 1)
            beam_scores = new_scores
            beam_feat = jnp.take_along_axis(out.hidden, parent_beam[:, :, None], 1)
            anc = jnp.take_along_axis(anc, parent_beam[:, :, None], 1)
            beam_flat = (K + (i - 1) * K * K + cs).astype(jnp.int32)

    # ---- organize + build the tree -------------------------------------------------------
    with jax.named_scope("tree_build"):
        all_scores, all_tokens, all_parents = (jnp.concatenate(x, 1) for x in (scores, tokens, parents))
        selected = select_nodes(all_scores, N)
        tree = build_tree(r.root, all_tokens, all_parents, selected, S)  # kernel or reference
        nt = nested_trees(all_scores, all_tokens, all_parents, selected, K, nested) if nested else None
    return tree, dk, dv, nt


def _tree_attn(cfg: SpecConfig, cache, r: SpecRows, row_ids, tree, kv_len: int) -> AttnInputs:
    """The verify's attention inputs: the N tree tokens at L + depth, over the prefix and their ancestors."""
    node_slots = r.tree_slots[:, :cfg.num_draft_tokens]  # the rows may own more (a larger tier's N)
    return AttnInputs(positions=r.seq_len[:, None] + tree.depth, write_slots=node_slots,
                      kv_slots=_prefix(cache, row_ids, kv_len), kv_len=r.seq_len, extra_slots=node_slots,
                      extra_mask=tree.mask)


def verify_forward(target, cfg: SpecConfig, cache, r: SpecRows, row_ids, tree, *, kv_len: int,
                   aux_layers: tuple[int, ...], unroll: bool | int = False):
    """The verify's target forward over the B·N tree tokens of the gathered rows `r` (their KV written
    to the tree slots): the first half of `verify_commit`, an executable of its own where grammar
    masks are computed on the host meanwhile (`speculative/steps.py` `verify_forward_step`). Returns the
    target's ForwardOut."""
    with jax.named_scope("verify_forward"):
        return target(tree.tokens, _tree_attn(cfg, cache, r, row_ids, tree, kv_len), cache.k, cache.v,
                      aux_layers=aux_layers, unroll=unroll)


def verify_commit(target, head, cfg: SpecConfig, cache, dk, dv, rows: SpecRows, row_ids, tree, *, kv_len: int,
                  greedy: bool, aux_layers: tuple[int, ...], unroll: bool | int = False, simulate_accept: float = 0.0,
                  logprobs: bool = False, penalties: PenaltyRows | None = None, token_masks=None, tout=None,
                  nested: "NestedTrees | None" = None):
    """Verify the tree with the target, accept, check finishes, extend the draft, commit.
    nested (`draft_tree`'s): the result also carries what each nested tier would have accepted.
    tout: the verify forward's output computed already (`verify_forward`; else computed here).
    token_masks [B, N, W]: each node's grammar mask (jeagle/sampling/grammar.py), applied to its logits.
    logprobs: append the emitted tokens' logprobs from the target's logits at the accepted nodes.
    penalties: the rows' penalties, applied to every tree node's logits with the node's path counted
    (what target-only decoding applies there had it emitted that path); the emitted tokens are
    counted in the returned rows.
    simulate_accept > 0: timing only, accept this many tokens per round on average (bonus included)
    whatever the draft (`simulated_accept`); the output is then not the target's."""
    S, N = cfg.num_steps, cfg.num_draft_tokens
    r = rows.gather(row_ids)
    b = row_ids.shape[0]
    ar = jnp.arange(b)
    L = r.seq_len
    embed, lm_head_t = _heads(target)
    tree_attn = _tree_attn(cfg, cache, r, row_ids, tree, kv_len)
    node_slots = tree_attn.write_slots

    # ---- verify: one target forward over the B·N tree tokens ------------------------------
    if tout is None:
        tout = verify_forward(target, cfg, cache, r, row_ids, tree, kv_len=kv_len, aux_layers=aux_layers,
                              unroll=unroll)

    logits = tout.logits
    if penalties is not None:
        with jax.named_scope("penalties"):
            pen = gather_penalties(penalties, row_ids)
            generated = L[:, None] + tree.depth - pen.prompt_len[:, None] + 1  # tokens emitted before each node's next
            logits = apply_penalties(logits, pen, generated, path_counts(tree.tokens, tree.mask, logits.shape[-1]))
    if token_masks is not None:
        logits = apply_token_mask(logits, token_masks)

    # ---- accept ----------------------------------------------------------------------------
    with jax.named_scope("accept"):
        walk = (tree.tokens, tree.retrieve_index, tree.retrieve_next_token, tree.retrieve_next_sibling)
        g_predict, g_index, g_len, g_bonus = verify_tree_greedy(  # kernel or reference, per the traced KernelSettings
            *walk, jnp.argmax(logits, -1).astype(jnp.int32), S + 1)
        if greedy:
            predict, accept_index, acc, bonus = g_predict, g_index, g_len, g_bonus
        else:
            probs = target_probs(logits, r.temperature, r.top_k, r.top_p)
            coins, final_coin = round_keys(r.seed, L, N)
            s_out = tree_speculative_sampling(*walk, probs, coins, final_coin, S + 1, cfg.threshold_single,
                                              cfg.threshold_acc)
            use_greedy = r.temperature <= 0
            predict, accept_index, acc, bonus = (jnp.where(use_greedy.reshape((b,) + (1,) * (g.ndim - 1)), g, s)
                                                 for g, s in zip((g_predict, g_index, g_len, g_bonus), s_out))
        if simulate_accept:  # timing only: a forced accept length of mean τ (bench --simulate-accept)
            predict, accept_index, acc, bonus = simulated_accept(tree.tokens, tree.retrieve_index, jnp.argmax(
                tout.logits, -1).astype(jnp.int32), S + 1, simulate_accept, r.seed, L)
        path = jnp.where(accept_index >= 0, accept_index % N, -1)  # [B, S+1] node ids

    # ---- finish checks inside the accepted run ----------------------------------------------
    with jax.named_scope("finish"):
        j = jnp.arange(S + 1)[None, :]
        in_run = j <= acc[:, None]
        emitted = jnp.where(in_run, jnp.take_along_axis(predict, jnp.maximum(path, 0), 1), -1)
        is_stop = jnp.any(emitted[:, :, None] == r.stop_ids[:, None, :], -1) & in_run & (emitted >= 0)
        first_stop = jnp.where(jnp.any(is_stop, 1), jnp.argmax(is_stop, 1), S + 1)
        limit = r.max_new - r.n_generated - 1  # index of the emitted token that reaches max_new_tokens
        cut = jnp.minimum(jnp.minimum(first_stop, limit), acc)
        finishing = (first_stop <= acc) | (limit <= acc)
        n_emit = jnp.where(r.finished, 0, cut + 1)
        emitted = jnp.where(j < n_emit[:, None], emitted, -1)
        finished = r.finished | finishing
        commit = ~finished

    # ---- draft extend over the N tree nodes (static shape) -----------------------------------
    with jax.named_scope("draft_extend"):
        last = jnp.take_along_axis(path, acc[:, None], 1)[:, 0]
        ext_tok = jnp.where(predict >= 0, predict, tree.tokens)  # accepted nodes: the token that follows them
        feature = tout.hidden if head.cfg.kind == "eagle1" else tout.aux_hidden
        dout = head(ext_tok, feature, tree_attn, dk, dv, embed=embed, embed_split=target.vocab_split, lm_head=lm_head_t,
                    logits_index=last)
        dk, dv = dout.k, dout.v
        next_logits = dout.logits
        if penalties is not None:  # the next round's root top-K, drafted under the counts with this round's tokens
            penalties = add_tokens(penalties, row_ids, emitted)
            pen = gather_penalties(penalties, row_ids)
            next_logits = apply_penalties(next_logits, pen, L + acc + 1 - pen.prompt_len + 1,
                                          vocab_ids=draft_vocab_ids(head))
        topk_p, topk_id = draft_topk(head, next_logits, r.topk_p.shape[1])  # as wide as the rows: any tier next
        new_feature = dout.hidden[ar, last]

    # ---- commit: swap position slots and accepted tree slots ---------------------------------
    with jax.named_scope("commit"):
        req_to_token, tree_slots = commit_slots(cache.req_to_token, node_slots, row_ids, L, path, acc, commit)
        tree_slots = jnp.concatenate([tree_slots, r.tree_slots[:, N:]], 1)

        keep = lambda new, old: jnp.where(commit.reshape((b,) + (1,) * (old.ndim - 1)), new, old)  # noqa: E731
        new_rows = SpecRows(root=keep(bonus, r.root), seq_len=keep(L + acc + 1, L), topk_p=keep(topk_p, r.topk_p),
                            topk_id=keep(topk_id, r.topk_id),
                            feature=keep(new_feature.astype(r.feature.dtype), r.feature),
                            tree_slots=tree_slots, scratch_slots=r.scratch_slots, n_generated=r.n_generated + n_emit,
                            max_new=r.max_new, stop_ids=r.stop_ids, finished=finished, temperature=r.temperature,
                            top_k=r.top_k, top_p=r.top_p, seed=r.seed)
        rows = rows.scatter(row_ids, new_rows)
        would = None
        if nested is not None:
            would = jnp.where(r.finished[:, None], -1, nested_accepts(nested, path, acc, bonus))
        out = pack_result(emitted, jnp.where(r.finished, -1, acc), finished, would)
    if logprobs:  # emitted token j came from the target's logits at the accepted node path[j]
        with jax.named_scope("logprobs"):
            at_path = tout.logits[ar[:, None], jnp.maximum(path, 0)]  # [B, S+1, V]
            out = pack_logprobs(out, token_logprobs(at_path, emitted))
    cache = type(cache)(k=tout.k, v=tout.v, req_to_token=req_to_token)
    return out, cache, dk, dv, rows, penalties
