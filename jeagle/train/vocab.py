"""EAGLE-3's reduced draft vocabulary, chosen by token frequency in the training data.

The draft predicts over `draft_vocab_size` target tokens only: the most frequent response tokens (the
loss covers responses), the target's end-of-sequence tokens always among them. Draft id i stands for
target id `d2t[i] + i` (the offset convention of EAGLE-3 checkpoints); `t2d` marks the target ids
that have a draft id. Draft ids are assigned in increasing target-id order.
"""

from __future__ import annotations

import numpy as np


def draft_vocab(data, vocab_size: int, draft_vocab_size: int, *, always=()) -> tuple[np.ndarray, np.ndarray]:
    """(d2t [Vd] int32 offsets, t2d [V] bool) from the response-token counts of `data` (a DraftData)."""
    if not 0 < draft_vocab_size <= vocab_size:
        raise ValueError(f"draft vocabulary size {draft_vocab_size} must be in 1..{vocab_size}")
    counts = np.bincount(data.response_tokens().astype(np.int64), minlength=vocab_size)[:vocab_size]
    forced = [t for t in always if 0 <= t < vocab_size][:draft_vocab_size]
    counts[forced] = counts.max() + 1
    # Most frequent first; ties (unseen tokens included) by id, so the choice is deterministic.
    order = np.lexsort((np.arange(vocab_size), -counts))
    used = np.sort(order[:draft_vocab_size])
    d2t = (used - np.arange(draft_vocab_size)).astype(np.int32)
    return d2t, vocab_mask(d2t, vocab_size)


def vocab_mask(d2t: np.ndarray, vocab_size: int) -> np.ndarray:
    """t2d [V] bool: the target ids that draft vocabulary `d2t` can express."""
    t2d = np.zeros(vocab_size, bool)
    t2d[np.arange(len(d2t)) + np.asarray(d2t)] = True
    return t2d


def coverage(data, t2d: np.ndarray) -> float:
    """Share of response tokens the draft vocabulary can express."""
    ids = data.response_tokens().astype(np.int64)
    return float(t2d[ids].sum()) / max(len(ids), 1)


def fit_row_map(target_rows: np.ndarray, trained_rows: np.ndarray, ridge: float = 1.0) -> np.ndarray:
    """The linear map A [H,H] that best carries the target's output rows of the draft tokens to the
    head's trained rows (least squares, ridge `ridge`): target_rows @ A ≈ trained_rows."""
    t = np.asarray(target_rows, np.float64)
    w = np.asarray(trained_rows, np.float64)
    return np.linalg.solve(t.T @ t + ridge * np.eye(t.shape[1]), t.T @ w).astype(np.float32)


def remap_lm_head(lm_head: np.ndarray, old_d2t: np.ndarray, new_d2t: np.ndarray,
                  target_head: np.ndarray | None = None) -> np.ndarray:
    """A trained EAGLE-3 head's output rows for another draft vocabulary: a token in both keeps its
    trained row. A new one starts, with `target_head` (the target's output rows [V,H]), as its target
    row carried by `fit_row_map` fitted on the tokens in both; else at zero (logit 0).

    Why the map: the head's rows start as the target's and training moves them, but coherently: on the
    shipped SmolLM2 head a map fitted on 90 % of its 8,192 tokens predicts the other 10 %'s trained rows
    at cosine 0.93 (R² 0.76). Its accept length rebuilt to 12,288 tokens before training (CPU fp32, 16
    MT-bench prompts, 128 tokens): 2.857 with mapped new rows, 2.620 with zero rows, 2.783 unwidened;
    rebuilt at 8,192 on 80 prompts × 256 tokens 3.176 vs 3.162 (bench/RESULTS.md, 2026-11-28): a start
    no worse than the head's, which training then takes further (phase 6 of the shipped head: 12,288
    tokens, 57 M loss tokens). The target's raw rows are worse than zero: next to trained rows they win
    the argmax far too often (1,000 of 8,192 tokens swapped: accept length 1.00 with target rows, 1.31 at
    half their norm, 1.74 with zero rows, 2.31 unswapped; bench/probes/vocab_swap.py, removed after commit
    `b436043`; bench/HISTORY.md, 2026-11-25)."""
    old_used = np.arange(len(old_d2t)) + np.asarray(old_d2t)
    new_used = np.arange(len(new_d2t)) + np.asarray(new_d2t)
    out = np.zeros((len(new_used), lm_head.shape[1]), np.float32)
    row_of = {int(t): i for i, t in enumerate(old_used)}
    kept = [(j, row_of[int(t)]) for j, t in enumerate(new_used) if int(t) in row_of]
    for j, i in kept:
        out[j] = lm_head[i]
    new = np.setdiff1d(np.arange(len(new_used)), [j for j, _ in kept])
    if target_head is not None and len(new) and kept:
        target_head = np.asarray(target_head, np.float32)
        shared = np.asarray([i for _, i in kept])
        a = fit_row_map(target_head[old_used[shared]], np.asarray(lm_head, np.float32)[shared])
        out[new] = target_head[new_used[new]] @ a
    return out


def trim_vocab(lm_head: np.ndarray, d2t: np.ndarray, data, size: int, *, always=()) -> tuple[np.ndarray, np.ndarray]:
    """A trained EAGLE-3 head's output rows and d2t for the `size` most frequent (in `data`'s responses)
    of its own draft tokens, `always` (end-of-sequence ids) kept: (lm_head [size,H], d2t [size]). The
    rows kept are the trained ones, so the head's argmax over the tokens it keeps is unchanged; only the
    dropped tokens can no longer be drafted. This fits a larger head (more layers) under a size budget
    without retraining its output layer."""
    d2t = np.asarray(d2t)
    used = np.arange(len(d2t)) + d2t
    if not 0 < size <= len(used):
        raise ValueError(f"trim size {size} must be in 1..{len(used)} (the head's draft vocabulary)")
    counts = np.bincount(data.response_tokens().astype(np.int64), minlength=int(used.max()) + 1)[used]
    always = set(int(t) for t in always)
    counts = np.where(np.isin(used, list(always)), counts.max() + 1, counts) if always else counts
    keep = np.sort(np.lexsort((np.arange(len(used)), -counts))[:size])  # draft ids, increasing target id
    new_used = used[keep]
    return np.asarray(lm_head)[keep], (new_used - np.arange(size)).astype(np.int32)


def trim_head(head_dir, data_path, size: int, out_dir) -> dict:
    """`python -m jeagle.train.vocab trim`: the head in `head_dir` with its draft vocabulary cut to the
    `size` tokens most frequent in the dataset's responses (trim_vocab), written to `out_dir` with its
    card and training record, which say so. Returns the trim's record."""
    import json
    from pathlib import Path

    from jeagle.loading.checkpoint import save_checkpoint
    from jeagle.config import DraftConfig
    from jeagle.train.data import DraftData
    from jeagle.train.model import load_params

    head_dir, out_dir = Path(head_dir), Path(out_dir)
    cfg = DraftConfig.load(head_dir / "config.json")
    if cfg.kind != "eagle3":
        raise ValueError(f"{head_dir} is an {cfg.kind} head: only EAGLE-3 heads have a draft vocabulary")
    if out_dir.resolve() == head_dir.resolve():
        raise ValueError("trim writes a new head: --out must be another directory")
    params, old_d2t = load_params(head_dir)
    data = DraftData.load(data_path)
    # End-of-sequence tokens close every regenerated answer: the counts keep them.
    lm_head, d2t = trim_vocab(np.asarray(params["lm_head"]), old_d2t, data, size)
    tensors = {k: np.asarray(v) for k, v in params.items()} | {"lm_head": lm_head, "d2t": d2t}
    save_checkpoint(out_dir, cfg.replace(draft_vocab_size=size), tensors, metadata={"trimmed_from": str(head_dir)})
    record = {"from_head": str(head_dir), "from_size": len(old_d2t), "size": size, "data": str(data_path),
              "coverage_before": coverage(data, vocab_mask(old_d2t, cfg.vocab_size)),
              "coverage_after": coverage(data, vocab_mask(d2t, cfg.vocab_size))}
    info = json.loads((head_dir / "training.json").read_text()) if (head_dir / "training.json").exists() else {}
    info["vocab_trim"] = record
    (out_dir / "training.json").write_text(json.dumps(info, indent=1, default=str))
    card = (head_dir / "README.md").read_text() if (head_dir / "README.md").exists() else f"# {cfg.name}\n"
    card += (f"\n## Draft vocabulary trimmed\n- cut from {record['from_size']} to {size} tokens (the most frequent "
             f"in `{data_path}`'s responses; the rows kept are the trained ones): coverage of those responses "
             f"{record['coverage_before']:.1%} → {record['coverage_after']:.1%}\n")
    (out_dir / "README.md").write_text(card)
    return record


def main(argv=None) -> int:
    import argparse
    import json

    p = argparse.ArgumentParser(prog="python -m jeagle.train.vocab", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("trim", help="cut a trained EAGLE-3 head's draft vocabulary to its N most frequent tokens")
    t.add_argument("head", help="the head's directory")
    t.add_argument("--data", required=True, help="a dataset of train_draft (data.npz): the token counts")
    t.add_argument("--size", type=int, required=True)
    t.add_argument("--out", required=True)
    args = p.parse_args(argv)
    from jeagle.errors import USER_ERRORS, report

    try:
        print(json.dumps(trim_head(args.head, args.data, args.size, args.out), indent=1))
    except USER_ERRORS as e:
        return report(e)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
