"""`python -m jeagle.serve` (and the `jeagle-serve` script): arguments → `ServeArgs` (`options`) → the
engine in its own process (or a thread: --engine-thread; or --dp N replicas behind a `router.Router`) →
`create_app` → uvicorn. Under --nnodes rank 0 does this (its engine process joins the other nodes') and
every other rank follows its engine (`follower`)."""

from __future__ import annotations

import sys

from jeagle.serve.options import ServeArgs, load, parse_args, parse_options, warmup_line


def serve(args: ServeArgs, link=None) -> int:
    """Serve until interrupted: the engine built here (a thread runs it), or `link`, an EngineProcess
    (or a Router of them) whose `extra` is `load`'s facts dict."""
    import uvicorn

    from jeagle.errors import USER_ERRORS, report
    from jeagle.runtime.gc_clock import freeze_heap
    from jeagle.serve.app import create_app
    from jeagle.loading.tokenizer import Tokenizer

    if link is None:
        try:
            engine, tokenizer, facts = load(args)
        except USER_ERRORS as e:
            return report(e)
    else:
        engine, facts = link, link.extra
        tokenizer = Tokenizer.from_dir(facts["target_dir"])
    # This process serves from here on: later collections skip what start-up built. With the engine in a
    # process of its own this one still holds ~150k objects (JAX's modules among them), and a full collection
    # of them stopped the event loop for 140-320 ms on a 2-core CPU, in the middle of streams.
    freeze_heap()
    n = len(getattr(link, "replicas", [link]))
    where = "a thread" if link is None else "its own process" if n == 1 else f"{n} replicas' processes (--dp {n})"
    if facts.get("nnodes", 1) > 1:
        where += f", node rank 0 of {facts['nnodes']} (the other nodes follow it)"
    if (line := warmup_line(facts.get("warmup"))) is not None:
        print(line, file=sys.stderr)
    print(f"[jeagle.serve] {facts['name']} ({facts['dtype']}) loaded in {facts['load_s']:.1f} s, the engine in {where}; "
          f"serving on http://{args.host}:{args.port}", file=sys.stderr)
    app = create_app(engine, tokenizer, facts["name"], args.api_key, facts["aliases"], metrics=args.metrics,
                     tool_call_parser=args.tool_call_parser)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    a = parse_options(argv)
    if a.nnodes > 1 and a.node_rank > 0:  # rank 0 serves; this process holds its share and follows
        from jeagle.serve.follower import follow_main

        return follow_main(argv)
    if a.engine_thread:
        return serve(parse_args(argv))
    from jeagle.serve.engine_process import EngineFailed, EngineProcess
    from jeagle.serve.options import load_from_argv
    from jeagle.serve.router import replica_env, start_replicas

    try:
        if a.dp == 1:
            link = EngineProcess(load_from_argv, (argv,))
        else:  # each replica on its own --tp GPUs
            link = start_replicas(load_from_argv, (argv,), a.dp, [replica_env(i, a.tp) for i in range(a.dp)])
    except ValueError as e:  # too few GPUs listed for the replicas
        print(f"[jeagle.serve] {e}", file=sys.stderr)
        return 2
    except EngineFailed:  # the engine's process printed why
        return 2
    except KeyboardInterrupt:  # Ctrl-C while it loads (the engine's process stops on the same signal)
        return 130
    args = ServeArgs(None, host=a.host, port=a.port, api_key=a.api_key, served_model_name=a.served_model_name,
                     metrics=not a.disable_metrics, tool_call_parser=a.tool_call_parser)
    return serve(args, link)


if __name__ == "__main__":
    sys.exit(main())
