"""`python -m jeagle.serve --nnodes N --node-rank I` for I > 0: a process that serves nothing and follows.

Every process of a multi-node server holds its share of one engine (`--tp` spans all their devices) and
must run the same steps (multi-controller: docs/multi-gpu.md, jeagle/parallel/distributed.py). Rank 0
serves HTTP and its engine loop decides; each pass it sends the commands it took (`PassChannel`). Here
the engine is built and warmed up as rank 0 builds it, then each pass's commands are applied as rank 0's
`EngineLoop` applies them and the engine steps when it has work: the same requests, admitted, batched,
retracted and finished alike. The tokens are rank 0's to hand out; here they are dropped.
"""

from __future__ import annotations

import dataclasses
import os
import sys


def follow(engine, tokenizer, channel) -> int:
    """Apply rank 0's passes until its "stop"; the passes followed. A failed step raises (this process is then
    out of step with rank 0, whose engine stops as well)."""
    from jeagle.serve.engine_process import rebuild_grammar

    requests: dict = {}  # rank 0's name for a request (its `follow_id`) → this engine's request
    grammars: dict = {}
    passes = 0
    while True:
        passes += 1
        for cmd in channel.receive():
            kind = cmd[0]
            if kind == "stop":
                return passes
            if kind == "submit":
                _, fid, prompt, params = cmd
                if params.grammar is not None:
                    params = dataclasses.replace(params, grammar=rebuild_grammar(grammars, tokenizer, engine,
                                                                                 *params.grammar))
                try:
                    requests[fid] = engine.submit(prompt, params)
                except Exception:  # refused by the engine's checks, on rank 0 alike
                    pass
            elif kind == "abort":
                r = requests.get(cmd[1])
                if r is not None and not r.done:
                    engine.abort(r)
            elif kind == "flush":
                engine.flush_cache()
        if engine.has_work:
            engine.step()  # a failure ends this process, as it ends rank 0's engine
        for fid in [fid for fid, r in requests.items() if r.done]:
            del requests[fid]


def follow_main(argv: list[str]) -> int:
    """Build the engine (joining the distributed runtime first), then follow rank 0 until it stops."""
    from jeagle.errors import USER_ERRORS, report
    from jeagle.parallel.distributed import PassChannel, shutdown
    from jeagle.runtime.gc_clock import freeze_heap
    from jeagle.serve.options import load, parse_args, warmup_line

    args = parse_args(argv, join=True)
    try:
        try:
            engine, tokenizer, facts = load(args)
        except USER_ERRORS as e:
            return report(e)
        freeze_heap()
        if (line := warmup_line(facts.get("warmup"))) is not None:
            print(line, file=sys.stderr)
        print(f"[jeagle.serve] node rank {args.node_rank} of {args.engine.nnodes}: {facts['name']} loaded in "
              f"{facts['load_s']:.1f} s; following rank 0's engine (rank 0 serves HTTP)", file=sys.stderr, flush=True)
        try:
            passes = follow(engine, tokenizer, PassChannel())
        except Exception as e:  # a step failed, or rank 0 (the coordinator) is gone: out of step for good
            print(f"[jeagle.serve] node rank {args.node_rank}: stopped, out of step with rank 0: {e!r}",
                  file=sys.stderr, flush=True)
            os._exit(1)  # without the runtime's shutdown barrier, which would wait for the lost node
        print(f"[jeagle.serve] node rank {args.node_rank}: rank 0 stopped after {passes} passes", file=sys.stderr)
        shutdown()
        return 0
    except KeyboardInterrupt:
        return 130
