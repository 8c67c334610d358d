"""Where a decode step's (or a speculative round's) time goes: a `jax.profiler` trace of warm decode,
summarised by device op.

Random weights of a named shape (no checkpoint needed), so the layout of the step, not the values,
is measured. Prints per batch size: device ops per decode step, device-busy time per step against
the wall time per step (the difference: the device idle, waiting on the host), and the top ops by
total time; then one JSON line. `--spec S,K,N` profiles EAGLE-3 rounds instead (a random head shaped
for the target, acceptance forced to `--simulate-accept` τ), normalised per round. Every figure is of the
steady state at a full batch: `batch` requests long enough that none finishes while measured, driven
step by step after a warm-up, `--steps` calls timed untraced and then `--steps` traced (so only the
full bucket's executables are compiled and run, and no prefill is timed). When the trace names each
op's HLO module (GPU traces do), the prefill executables are left out of the per-step figures and the
device's idle time between the decode executables' ops (the host gaps) is reported with the largest gaps.

`--phases` (on with `--spec`) splits the device-busy time of a round by phase, the named scopes of
`jeagle/speculative/round.py` (draft_step, draft_topk, tree_build, verify_forward, accept, finish, draft_extend,
commit; "other": ops outside them, e.g. the rows' gather; "unattributed": ops no executable's HLO names):
each GPU op's `hlo_op` arg is looked up in the optimized HLO of the engine's executables, whose
instructions carry the scope path in their op_name (`bench/common.PhaseMap`). Printed per batch size as
ms and ops per round and share of busy time, and in the JSON row as `busy_ms_by_phase` (ms per round).
A CPU run's trace has no GPU ops: no phase table then.

    python bench/profile_decode.py --shape smollm2 --batch-sizes 1,16
    python bench/profile_decode.py --shape llama8b --batch-sizes 1,48 --spec 5,4,8 --simulate-accept 4.68
"""

from __future__ import annotations

import argparse
import collections
import json
import tempfile
import time

from common import (DRAFT_VOCAB, SHAPES, PhaseMap, device_events_by_device, device_kind, emit, idle_gaps,
                    random_eagle3_head)


def decode_phase(events: list[tuple]) -> tuple[list[tuple], bool]:
    """The events of the decode executables (rounds or decode steps), without the prefill's, when the
    trace names each op's HLO module; else all events and False (the prefill is then included)."""
    if not events or not any(e[3] for e in events):
        return events, False
    return [e for e in events if e[3] and "prefill" not in e[3]], True


def phase_busy(events: list[tuple], hlo_texts: list[str]) -> tuple[dict[str, tuple[int, float]], list]:
    """({phase: (device ops, busy us)} of `events` (with their args), by the named scopes of a round;
    the unattributed ops by busy time: [(name, count, us, one event's args)], the largest 8)."""
    from jeagle.speculative.round import ALL_PHASES as PHASES

    if not events:
        return {}, []
    pm = PhaseMap(hlo_texts, PHASES)
    lost: dict[str, list] = {}
    for name, dur, *_, args in events:
        if pm(name, args) == "unattributed":
            row = lost.setdefault(name, [0, 0.0, args])
            row[0] += 1
            row[1] += dur
    top = sorted(((n, c, t, a) for n, (c, t, a) in lost.items()), key=lambda x: -x[2])[:8]
    return pm.busy_us(events), top


def print_phases(by_phase: dict, n: int, unit: str, busy_us: float) -> None:
    """The phase table: device ms and ops per unit, share of the busy time."""
    if not by_phase:
        print("phases: no GPU ops in the trace (a CPU run?): no phase table")
        return
    print(f"{'phase':<16} {'ms/' + unit:>9} {'ops/' + unit:>9} {'share':>7}")
    for ph, (c, t) in by_phase.items():
        print(f"{ph:<16} {t / 1e3 / n:>9.3f} {c / n:>9.1f} {t / busy_us:>7.1%}")


def unroll_arg(v: str):
    if v in ("auto", "all"):
        return v
    try:
        return int(v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"auto, all or an integer, got {v!r}") from None


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="smollm2", choices=sorted(SHAPES))
    p.add_argument("--batch-sizes", default="1,16")
    p.add_argument("--steps", type=int, default=64, help="decode steps traced")
    p.add_argument("--decode-steps", type=int, default=1)
    p.add_argument("--unroll", default="auto", type=unroll_arg,
                   help="layer loop: auto (the engine's default), 0 (a loop), k (k layers per iteration) or all")
    p.add_argument("--context", type=int, default=256, help="prompt length")
    p.add_argument("--top", type=int, default=20)
    p.add_argument("--spec", default=None, metavar="S,K,N", help="profile EAGLE-3 rounds of this tier")
    p.add_argument("--simulate-accept", type=float, default=4.68, help="τ of the --spec rounds")
    p.add_argument("--phases", action=argparse.BooleanOptionalAction, default=None,
                   help="device time per phase of the round (named scopes); default: on with --spec")
    p.add_argument("--sampling", default=None, metavar="JSON",
                   help='more SamplingParams fields for every request, e.g. {"logprobs": 5}')
    p.add_argument("--dump", default=None, metavar="DIR",
                   help="write every device op of one traced step (name, count, us per step) and the optimized "
                        "HLO of the decode executables there, to read what each fusion computes")
    p.add_argument("--deterministic", action="store_true",
                   help="profile the deterministic mode (its batch-invariant kernels and compile options)")
    args = p.parse_args(argv)
    phases = bool(args.spec) if args.phases is None else args.phases
    extra = json.loads(args.sampling) if args.sampling else {}

    import dataclasses

    import jax

    from jeagle.config import ModelConfig
    from jeagle.engine import EngineConfig, speculative, target_only
    from jeagle.kernels.settings import KernelSettings
    from jeagle.models.llama import random_model
    from jeagle.sampling import SamplingParams

    cfg = ModelConfig(**SHAPES[args.shape])
    model = random_model(cfg)
    head = None
    if args.spec:
        from jeagle.speculative.round import SpecConfig

        head = random_eagle3_head(cfg, draft_vocab=DRAFT_VOCAB.get(args.shape))
        tier = SpecConfig(*(int(x) for x in args.spec.split(",")))
    # (A bare --unroll once meant "all"; False, the old default, overrode the engine's own choice.)
    unroll = {"auto": None, "all": True}.get(args.unroll, args.unroll)
    prompt = list(range(100, 100 + args.context))
    unit = "round" if args.spec else "step"
    out = {"bench": "profile_decode", "shape": args.shape, "device": device_kind(),
           "spec": args.spec, "unroll": args.unroll, "simulate_accept": args.simulate_accept if args.spec else None, "rows": []}
    warm_steps = 8
    for batch in [int(b) for b in args.batch_sizes.split(",")]:
        # Steady state at a full batch: `batch` requests long enough that none finishes while measured,
        # driven step by step (each step() dispatches one decode step or round for the whole batch), so
        # the batch never shrinks into a smaller bucket and only the full bucket's executables run.
        per_call = (tier.num_steps + 1) if args.spec else args.decode_steps  # most tokens one call emits
        max_new = per_call * (warm_steps + 2 * args.steps + 8)
        ec = EngineConfig(max_batch_size=batch, max_context=args.context + max_new + 64,
                          decode_steps=args.decode_steps, unroll_layers=unroll, kernels=dataclasses.replace(KernelSettings.from_env(), deterministic=args.deterministic))
        engine = (speculative(model, head, ec, tier, simulate_accept=args.simulate_accept) if args.spec
                  else target_only(model, ec))
        sp = SamplingParams(max_new_tokens=max_new, ignore_eos=True, **extra)
        modes = dict(greedy=(True,), logprobs=(sp.logprobs is not None,), penalties=(sp.penalized,))
        plan = engine.warmup_plan(batch_sizes=[batch], prefill_lengths=[args.context], **modes)
        engine.warmup(batch_sizes=[batch], prefill_lengths=[args.context], progress=False, **modes)
        reqs = [engine.submit(prompt, sp) for _ in range(batch)]
        for _ in range(batch + 4):  # admission (prefill groups), normally one step
            if not engine.num_waiting and engine.num_running == batch:
                break
            engine.step()
        if engine.num_waiting or engine.num_running < batch or any(r.done for r in reqs):
            raise RuntimeError(f"batch {batch}: could not get every request running")
        for _ in range(warm_steps):
            engine.step()
        dec = engine.decoder  # its device state (donated through every step) and, speculative, its accept lengths
        compiled0, window = engine.compile_seconds, dec.stats_window() if dec.speculative else None
        jax.block_until_ready(dec.state)
        t0 = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        jax.block_until_ready(dec.state)
        wall = time.perf_counter() - t0
        with tempfile.TemporaryDirectory() as d:
            t0 = time.perf_counter()
            with jax.profiler.trace(d, create_perfetto_trace=True):
                for _ in range(args.steps):
                    engine.step()
                jax.block_until_ready(dec.state)
            traced_wall = time.perf_counter() - t0
            ev_all = [e for evs in device_events_by_device(d, with_args=True).values() for e in evs]
        if engine.compile_seconds > compiled0:
            print(f"batch {batch}: the measured steps compiled ({engine.compile_seconds - compiled0:.1f} s): the "
                  "figures include compilation", flush=True)
        if any(r.done for r in reqs):
            raise RuntimeError(f"batch {batch}: a request finished while measured (max_new {max_new})")
        accept = dec.stats(window).accept_length if window is not None else 1.0  # both windows' request-rounds
        # The optimized HLO of what ran: the warm-up plan's decode executables, all in memory by now.
        want_hlo = phases or args.dump
        hlo = [engine.executables.get(k).as_text() for k in plan if "prefill" not in k.label] if want_hlo else []
        for r in reqs:
            engine.abort(r)
        while engine.has_work:
            engine.step()
        ev, prefill_excluded = decode_phase(ev_all)
        n = args.steps  # decode calls (rounds) traced, each for the whole batch
        by_name = collections.defaultdict(lambda: [0, 0.0])
        for name, dur, *_ in ev:
            by_name[name][0] += 1
            by_name[name][1] += dur
        busy_us = sum(e[1] for e in ev)
        idle_us, gaps = idle_gaps(ev)
        modules = collections.Counter()
        for e in ev_all:
            modules[e[3] or "?"] += e[1]
        row = {"batch": batch, "unit": unit, "traced": n, "wall_ms_per_step": 1e3 * wall / n,
               "device_ops_per_step": len(ev) / n, "device_busy_ms_per_step": busy_us / 1e3 / n,
               "prefill_excluded": prefill_excluded,
               "traced_wall_ms_per_step": 1e3 * traced_wall / n, "device_idle_ms_per_step": idle_us / 1e3 / n, "largest_gaps_us": [round(g, 1) for g in gaps],
               "busy_ms_by_module": {m: round(t / 1e3, 3) for m, t in modules.most_common(8)},
               "accept_length": accept,
               "top": sorted(((name, c / n, t / n) for name, (c, t) in by_name.items()),
                             key=lambda x: -x[2])[: args.top]}
        if phases:
            by_phase, lost = phase_busy(ev, hlo)
            row["busy_ms_by_phase"] = {ph: round(t / 1e3 / n, 4) for ph, (_, t) in by_phase.items()}
            row["unattributed_top"] = [(name, c / n, round(t / n, 1), {k: str(v)[:160] for k, v in a.items()})
                                       for name, c, t, a in lost]
        out["rows"].append(row)
        if args.dump:
            import os

            os.makedirs(args.dump, exist_ok=True)
            stem = f"{args.shape}_{'spec' if args.spec else 'target'}_b{batch}"
            with open(os.path.join(args.dump, stem + "_ops.json"), "w") as f:
                json.dump(sorted(([name, c / n, t / n] for name, (c, t) in by_name.items()), key=lambda x: -x[2]), f,
                          indent=0)
            for i, text in enumerate(hlo):
                with open(os.path.join(args.dump, f"{stem}_hlo{i}.txt"), "w") as f:
                    f.write(text)
        scope = "decode executables only" if prefill_excluded else "prefill included"
        print(f"\nbatch {batch}: wall {row['wall_ms_per_step']:.3f} ms/{unit} (untraced, steady state), device busy "
              f"{row['device_busy_ms_per_step']:.3f} ms/{unit}; traced run (tracing slows the host): wall "
              f"{row['traced_wall_ms_per_step']:.3f}, idle between ops {row['device_idle_ms_per_step']:.3f} "
              f"ms/{unit} (largest gaps {row['largest_gaps_us']} us), {row['device_ops_per_step']:.0f} device ops/{unit} "
              f"({n} {unit}s at a full batch, accept {row['accept_length']:.2f}; {scope})")
        print("busy ms by executable:", row["busy_ms_by_module"])
        print(f"{'op':<70} {'per ' + unit:>9} {'us/' + unit:>9}")
        for name, c, t in row["top"]:
            print(f"{name[:70]:<70} {c:>9.1f} {t:>9.1f}")
        if phases:
            print_phases(by_phase, n, unit, busy_us)
            for name, c, t, a in row["unattributed_top"]:
                print(f"  unattributed: {name[:60]} x{c:.0f}/{unit} {t} us; args {json.dumps(a)[:400]}")
    emit(out)


if __name__ == "__main__":
    main()
