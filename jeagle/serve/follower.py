"""`python -m jeagle.serve --nnodes N --node-rank I` for I > 0: a process that serves nothing and follows.

Every process of a multi-node server holds its share of one engine (`--tp` spans all their devices) and
must run the same steps (multi-controller: docs/multi-gpu.md, jeagle/parallel/distributed.py). Rank 0
serves HTTP and its engine loop decides; each pass it sends the commands it took (`PassChannel`). Here
the engine is built and warmed up as rank 0 builds it, then each pass's commands are applied as rank 0's
`EngineLoop` applies them and the engine steps when it has work: the same requests, admitted, batched,
retracted and finished alike. The tokens are rank 0's to hand out; here they are dropped.
"""

from __future__ import annotations

import os
import sys

from jeagle.serve.engine_loop import EngineLoop, Job
from jeagle.serve.engine_process import params_from_wire


class FollowerLoop(EngineLoop):
    """Rank 0's `EngineLoop` on a follower: each pass's commands come from `channel` (rank 0's `_send_pass`)
    instead of HTTP handlers, are applied by the same `_apply` and stepped by the same `iterate`; the events
    are dropped. Driven on the calling thread (`follow`), never started as one."""

    def __init__(self, engine, tokenizer, channel):
        super().__init__(engine, deliver=lambda events: None)
        self.multi_node = True  # a failed step ends this loop as it ends rank 0's
        self.channel, self.tokenizer, self.grammars = channel, tokenizer, {}
        self.by_follow_id: dict[int, Job] = {}  # rank 0's name for a request → its job here, until it ends
        self.passes = 0

    def _next_pass(self) -> list:
        self.passes += 1
        taken = []
        for cmd in self.channel.receive():
            if cmd[0] == "submit":
                _, fid, prompt, params = cmd
                job = Job(prompt, params_from_wire(params, self.grammars, self.tokenizer, self.engine), None,
                          follow_id=fid)
                self.by_follow_id[fid] = job
                taken.append(("submit", job))
            elif cmd[0] == "abort":
                if (job := self.by_follow_id.get(cmd[1])) is not None:
                    taken.append(("abort", job))
            else:
                taken.append((cmd[0], None))
        return taken

    def after_iteration(self) -> None:
        for fid in [fid for fid, j in self.by_follow_id.items() if j.request is None or j.request.done]:
            del self.by_follow_id[fid]  # finished, or refused by the engine's checks (on rank 0 alike)


def follow(engine, tokenizer, channel) -> int:
    """Apply rank 0's passes until its "stop"; the passes followed. A failed step raises (this process is then
    out of step with rank 0, whose engine stops as well)."""
    loop = FollowerLoop(engine, tokenizer, channel)
    while loop.iterate():
        pass
    if loop.fatal:
        raise RuntimeError("a step failed")
    return loop.passes


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
