"""Host cost of grammar masks (issue 24): one request's tree walk (`Matcher.tree_masks`, node by node)
against the batched form (`jeagle.grammar.tree_masks`: chains in waves on llguidance's threads), and
the batch's next-token masks (`next_masks`), for SmolLM2's tokenizer and bench/gpu_session.sh's
JSON schema, at several batch sizes. Each request sits at a random position of a valid document and
gets a random (5,4,8)-like tree of N nodes whose tokens follow the document 70% of the time (random
otherwise). Checks that both forms agree, then prints ms per batch (median of --repeats) and one
JSON line.

    python bench/probes/grammar_masks.py --batch-sizes 1,16,48
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from common import device_kind, git_commit  # noqa: E402

SCHEMA = {"type": "object", "properties": {"title": {"type": "string", "maxLength": 60},
                                           "points": {"type": "array", "items": {"type": "string", "maxLength": 80},
                                                      "minItems": 3, "maxItems": 5}},
          "required": ["title", "points"]}
DOC = {"title": "A short history of the Roman roads",
       "points": ["Roads were built by legions across the provinces", "Trade followed the roads to every town",
                  "Some of the old roads are still in use today"]}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch-sizes", default="1,16,48")
    p.add_argument("--nodes", type=int, default=8)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--threads", type=int, default=None, help="llguidance's pool (default: 80%% of the cores)")
    p.add_argument("--copies", action="store_true",
                   help="each request's matcher a copy of one template's (`deep_copy`), not built anew")
    args = p.parse_args(argv)

    import jeagle.grammar as grammar
    from jeagle.fetch import resolve_target
    from jeagle.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(resolve_target(None, quiet=True))
    vocab = 49152
    backend = grammar.GrammarBackend(tok, vocab, tok.eos_token_ids[0])
    if args.threads:
        grammar.set_threads(args.threads)
    g = backend.compile("json_schema", SCHEMA)
    template = g.matcher()
    ids = tok.encode(json.dumps(DOC, separators=(",", ":")), add_special_tokens=False)
    rng = np.random.default_rng(0)
    import concurrent.futures

    pool = concurrent.futures.ThreadPoolExecutor(args.threads or max(1, (os.cpu_count() or 1) * 4 // 5))
    rows = []
    for b in [int(x) for x in args.batch_sizes.split(",")]:
        matchers, trees = [], []
        for _ in range(b):
            m, pos = g.matcher(), int(rng.integers(1, len(ids) - 6))
            if args.copies:
                m = template.copy()
            for t in ids[:pos]:
                m.consume(t)
            parents, depth, tokens = [-1], [0], [ids[pos - 1]]
            for j in range(1, args.nodes):
                q = int(rng.integers(0, j)) if rng.random() < 0.5 else j - 1
                parents.append(q)
                depth.append(depth[q] + 1)
                d = pos - 1 + depth[-1]
                tokens.append(ids[d] if d < len(ids) and rng.random() < 0.7 else int(rng.integers(0, vocab)))
            matchers.append(m)
            trees.append((tokens, parents))
        tokens = np.array([t for t, _ in trees], np.int32)
        parents = np.array([q for _, q in trees], np.int32)
        got = grammar.tree_masks(matchers, tokens, parents, vocab)
        want = np.stack([m.tree_masks(tokens[i], parents[i]) for i, m in enumerate(matchers)])
        assert np.array_equal(got, want), "batched tree masks differ from the one-request walk"

        def timed(fn):
            ms = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                fn()
                ms.append((time.perf_counter() - t0) * 1e3)
            return float(np.median(ms))

        row = {"batch": b, "nodes": args.nodes,
               "tree_one_by_one_ms": timed(lambda: [m.tree_masks(tokens[i], parents[i]) for i, m in enumerate(matchers)]),
               "tree_batched_ms": timed(lambda: grammar.tree_masks(matchers, tokens, parents, vocab)),
               "tree_python_threads_ms": timed(lambda: list(pool.map(
                   lambda i: matchers[i].tree_masks(tokens[i], parents[i]), range(b)))),
               "next_masks_ms": timed(lambda: grammar.next_masks(matchers, b, vocab))}
        rows.append(row)
        print(f"batch {b:>3}: tree masks one by one {row['tree_one_by_one_ms']:7.2f} ms, batched "
              f"{row['tree_batched_ms']:7.2f} ms, python threads {row['tree_python_threads_ms']:7.2f} ms; next-token masks {row['next_masks_ms']:6.2f} ms", flush=True)
    print(json.dumps({"probe": "grammar_masks", "device": device_kind(), "cpus": os.cpu_count(),
                      "threads": args.threads, "copies": args.copies, "commit": git_commit(), "rows": rows}))


if __name__ == "__main__":
    main()
