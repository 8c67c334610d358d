"""Where a training run's head starts (`python -m jeagle.train_draft`): fresh, or from a trained head
(--init-from) grown by layers (--num-layers) and moved to another draft vocabulary (--rebuild-vocab,
--draft-vocab-size), or the vocabulary of the checkpoints a resumed run continues."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def load_draft_config(path):
    from jeagle.config import DraftConfig

    return DraftConfig.load(Path(path) / "config.json")


def check_start_args(args) -> None:
    """The head options' errors, before minutes of regeneration."""
    init = load_draft_config(args.init_from) if args.init_from else None
    if args.rebuild_vocab and not args.init_from:
        raise ValueError("--rebuild-vocab goes with --init-from an EAGLE-3 head")
    if args.rebuild_vocab and args.kind != "eagle3":
        raise ValueError("--rebuild-vocab is for EAGLE-3 heads (EAGLE-1 predicts over the target's vocabulary)")
    if init is not None and init.kind != args.kind:
        raise ValueError(f"--init-from {args.init_from} is an {init.kind} head, --kind is {args.kind}")
    if args.num_layers is not None and args.num_layers < 1:
        raise ValueError(f"--num-layers {args.num_layers}: at least 1")
    if init is not None and args.num_layers is not None and args.num_layers < init.num_layers:
        raise ValueError(f"--init-from {args.init_from} has {init.num_layers} layers: --num-layers {args.num_layers} "
                         "would drop trained ones")
    if args.draft_vocab_size is not None and args.draft_vocab_size < 1:
        raise ValueError(f"--draft-vocab-size {args.draft_vocab_size}: at least 1")
    if (init is not None and not args.rebuild_vocab and args.draft_vocab_size is not None
            and args.draft_vocab_size != init.draft_vocab_size):
        raise ValueError(f"--init-from {args.init_from} has a draft vocabulary of {init.draft_vocab_size}: another "
                         "--draft-vocab-size needs --rebuild-vocab")


def head_start(args, model, cfg, tc, train_data, vocab_file: Path, resuming: bool, info: dict):
    """(cfg, initial params or None, d2t, used_ids) of the run; tc and info take the head's shape and
    vocabulary; the vocabulary is saved to `vocab_file` (a resumed run reads it back from there)."""
    import jax.numpy as jnp

    from jeagle.train.model import grow_layers, load_params
    from jeagle.train.vocab import coverage, draft_vocab, remap_lm_head, vocab_mask

    init = d2t = init_d2t = used_ids = None
    if args.init_from:
        init, init_d2t = load_params(args.init_from, model.cfg)
        d2t = init_d2t
        init_cfg = load_draft_config(args.init_from)
        cfg = init_cfg.replace(dtype=cfg.dtype, name=cfg.name)  # the head's own shape, wholesale
        if args.num_layers is not None and args.num_layers > init_cfg.num_layers:
            init, cfg = grow_layers(init, cfg, args.num_layers)
            info["grown_from_layers"] = init_cfg.num_layers
            print(f"--init-from head grown from {init_cfg.num_layers} to {args.num_layers} layers", flush=True)
        tc.num_layers = cfg.num_layers
    if args.kind != "eagle3":
        return cfg, init, d2t, used_ids
    if resuming and vocab_file.exists():
        d2t = np.load(vocab_file)  # the checkpoints' vocabulary
    elif init is None or args.rebuild_vocab:
        d2t, _ = draft_vocab(train_data, model.cfg.vocab_size,
                             args.draft_vocab_size or (8192 if init is None else len(init_d2t)),
                             always=model.cfg.eos_token_ids)
    if init is not None and not np.array_equal(d2t, init_d2t):
        # The trained rows follow their tokens into the new vocabulary (its size may differ: --draft-vocab-size).
        rows = model.lm_head if getattr(model, "lm_head", None) is not None else model.embed  # tied: the embedding
        target_rows = np.asarray(rows[...], np.float32) if args.new_rows == "mapped" else None
        init["lm_head"] = jnp.asarray(remap_lm_head(np.asarray(init["lm_head"]), init_d2t, d2t, target_rows))
        cfg = cfg.replace(draft_vocab_size=len(d2t))
    np.save(vocab_file, d2t)
    tc.draft_vocab_size = len(d2t)
    used_ids = np.arange(len(d2t)) + d2t
    info["vocab_coverage"] = coverage(train_data, vocab_mask(d2t, model.cfg.vocab_size))
    print(f"draft vocabulary: {len(d2t)} tokens covering {info['vocab_coverage']:.1%} of response tokens", flush=True)
    return cfg, init, d2t, used_ids
