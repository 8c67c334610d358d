"""The evaluation of a draft head: its accept length per evaluation category, with the real engine.

One evaluation, run by `bench/accept_length.py` (MT-bench, GSM8K, the code set) and by
`jeagle.train_draft` after each training chunk (rows of its train_log.jsonl, drawn by `curve` and
`plot_curve`). Accept length τ = tokens the speculative rounds emit per request-round, bonus
included (the engine's own count, `jeagle.runtime.stats.SpecStats`); greedy at temperature 0, else
sampled (the same lossless sampling the server runs), with a seed per request.

The engine runs once per category (and turn), so each category's τ is those runs'; categories pool into the
overall τ and the issue's groups (`GROUPS`) as total emitted tokens ÷ total request-rounds, never a
mean of means: each result keeps its per-category `counts` so that any pooling (over sets too,
`pooled_groups`) can be redone from them.

Prompts (`Record.prompt_ids`): a raw record (code completion) is text the target continues without
the chat template; any other goes through the chat template, turn k with the target's own earlier answers as
history. `turns="all"` asks every turn of a conversation in turn (MT-bench's second turns), counting
every turn's rounds; `"first"` asks first turns only.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path

from jeagle.train.data import DataError
from jeagle.train.records import Record, read_records

# The issue's groups over record categories (MT-bench's eight, the code set's, the training sources').
# A category in no group counts in the overall figure only.
GROUPS: dict[str, frozenset[str]] = {
    "code": frozenset({"coding", "code"}),
    "math": frozenset({"math"}),
    "writing": frozenset({"writing"}),
    "chat": frozenset({"roleplay", "reasoning", "extraction", "stem", "humanities", "chat", "multiturn", ""}),
}

TURNS = ("first", "all")


def group_of(category: str) -> str | None:
    return next((g for g, cats in GROUPS.items() if category in cats), None)


def read_eval_set(spec: str) -> tuple[str, list[Record]]:
    """NAME=FILE.jsonl[:N] -> (NAME, N records of FILE spread over its categories and sources, `spread`;
    all without :N). N = 0 or a missing file raise DataError."""
    name, eq, rest = spec.partition("=")
    path, colon, n = rest.rpartition(":")
    if not colon or not n.isdigit():
        path, n = rest, ""
    if not eq or not name or not path:
        raise DataError(f"{spec!r}: expected NAME=FILE.jsonl[:N]")
    if n and int(n) == 0:
        raise DataError(f"{spec!r}: N is 0")
    records = read_records(path)
    return name, spread(records, int(n)) if n else records


def spread(records: list[Record], n: int) -> list[Record]:
    """n records taken in turn from each (category, source) of the file, in file order within each: a
    small set still covers every category (MT-bench's first 24 lines are its writing, roleplay and
    reasoning questions only). Returned in file order."""
    by_key: dict[tuple, list[int]] = {}
    for i, r in enumerate(records):
        by_key.setdefault((r.category, r.source), []).append(i)
    queues, picked = [list(v) for v in by_key.values()], []
    while len(picked) < n and any(queues):
        for q in queues:
            if q and len(picked) < n:
                picked.append(q.pop(0))
    return [records[i] for i in sorted(picked)]


def ratio(counts: Iterable[dict]) -> float | None:
    """Pooled τ of category counts: their emitted tokens ÷ their request-rounds (None: no rounds)."""
    counts = list(counts)
    rounds = sum(c["rounds"] for c in counts)
    return round(sum(c["round_tokens"] for c in counts) / rounds, 4) if rounds else None


def pooled_groups(results: Iterable[dict]) -> dict[str, float | None]:
    """{group: τ} over the categories of one or several `accept_lengths` results (the groups present)."""
    by_group: dict[str, list[dict]] = {}
    for res in results:
        for cat, c in res["counts"].items():
            if group_of(cat) is not None:
                by_group.setdefault(group_of(cat), []).append(c)
    return {g: ratio(by_group[g]) for g in GROUPS if g in by_group}


def _sampling(temperature: float, max_new_tokens: int, seed: int):
    from jeagle.sampling import SamplingParams

    if temperature > 0:
        return SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_p=1.0, seed=seed)
    return SamplingParams(max_new_tokens=max_new_tokens)


def default_buckets(batch_size: int) -> tuple[int, ...]:
    """Few batch buckets (each one more set of executables to compile): powers of 4 below the batch,
    and the batch."""
    return tuple(sorted({b for b in (1, 4, 16, 64) if b < batch_size} | {batch_size}))


def _engine(engines: dict, model, head, spec, batch_size: int, buckets, kernels, context: int):
    """The cached engine of this tier and batch if its context holds `context` positions, else a new
    one (replacing it: one engine's KV pool at a time) with the context rounded up to a power of 2."""
    from jeagle.engine import EngineConfig, SpecConfig, speculative

    key = (id(model), id(head), tuple(spec), batch_size, buckets, kernels)
    engine = engines.get(key)
    if engine is None or engine.max_context < context:
        engines.pop(key, None)
        ctx = max(256, 1 << (context - 1).bit_length())
        if ctx > model.cfg.max_position_embeddings:  # don't size past the model's positions without need
            ctx = max(context, model.cfg.max_position_embeddings)
        config = EngineConfig(max_batch_size=batch_size, max_context=ctx, batch_buckets=buckets,
                              **({} if kernels is None else {"kernels": kernels}))
        s, k, n = spec
        engines[key] = engine = speculative(model, head, config, SpecConfig(num_steps=s, topk=k, num_draft_tokens=n))
    return engine


def accept_lengths(model, head, tokenizer, records: Sequence[Record], *, spec=(5, 4, 8), temperature: float = 0.0,
                   max_new_tokens: int = 256, batch_size: int = 48, seed: int = 0, turns: str = "first",
                   kernels=None, buckets: tuple[int, ...] | None = None, engines: dict | None = None) -> dict:
    """τ of the draft `head` on `records`, per category (one engine run each), pooled into the overall
    figure and `GROUPS`. Sampled when temperature > 0 (top-p 1, the seed of turn t of record i:
    seed + t·len(records) + i). `turns`: "first", or "all" (each later turn asked with the target's
    earlier answers as history; every turn's rounds count). `engines`: a dict to reuse engines in
    across calls (keyed by model, head, tier, batch; an engine holds the head's weights as they were
    when built, so a changed head needs a new dict). Returns

        {"spec", "temperature", "turns", "accept_length" (overall), "categories": {category: τ},
         "groups": {group: τ}, "counts": {category: {"prompts", "rounds", "round_tokens", "new_tokens"}},
         "histogram": {accept length: rounds}, "prompts", "new_tokens", "rounds", "wall_s"}
    """
    if turns not in TURNS:
        raise ValueError(f"turns must be one of {TURNS}, got {turns!r}")
    if not records:
        raise ValueError("no records to evaluate")
    t0 = time.perf_counter()
    engines = {} if engines is None else engines
    buckets = tuple(buckets) if buckets else default_buckets(batch_size)
    reserve = spec[0] + 1  # a round writes up to S + 1 positions past the last token
    n_turns = [len(r.turns) if turns == "all" else 1 for r in records]
    # The context for the longest conversation, answers as long as max_new_tokens (re-encoded answers
    # may run a few tokens longer: a context too short for a later turn builds a bigger engine then).
    context = max(len(r.prompt_ids(tokenizer, [""] * (t - 1))) + t * (max_new_tokens + 8)
                  for r, t in zip(records, n_turns)) + reserve
    by_category: dict[str, list[int]] = {}
    for i, r in enumerate(records):
        by_category.setdefault(r.category, []).append(i)

    counts, histogram = {}, Counter()
    for category, members in by_category.items():
        answers: dict[int, list[str]] = {i: [] for i in members}
        c = {"prompts": len(members), "rounds": 0, "round_tokens": 0, "new_tokens": 0}
        for t in range(max(n_turns[i] for i in members)):
            asked = [i for i in members if n_turns[i] > t]
            ids = [records[i].prompt_ids(tokenizer, answers[i]) for i in asked]
            params = [_sampling(temperature, max_new_tokens, seed + t * len(records) + i) for i in asked]
            need = max(context, max(map(len, ids)) + max_new_tokens + reserve)
            engine = _engine(engines, model, head, spec, batch_size, buckets, kernels, need)
            outs = engine.generate(ids, params)
            st = engine.last_stats.speculative
            hist = {int(k): v for k, v in st.accept_length_histogram.items()}
            histogram.update(hist)
            c["rounds"] += st.rounds
            c["round_tokens"] += sum(k * v for k, v in hist.items())
            c["new_tokens"] += sum(len(o.token_ids) for o in outs)
            for i, o in zip(asked, outs):
                answers[i].append(tokenizer.decode(o.token_ids))
        counts[category] = c
    result = {"spec": list(spec), "temperature": temperature, "turns": turns,
              "accept_length": ratio(counts.values()),
              "categories": {cat: ratio([c]) for cat, c in counts.items()}, "counts": counts}
    return result | {"groups": pooled_groups([result]),
                     "histogram": {str(k): histogram[k] for k in sorted(histogram)},
                     "prompts": len(records), "new_tokens": sum(c["new_tokens"] for c in counts.values()),
                     "rounds": sum(c["rounds"] for c in counts.values()),
                     "wall_s": round(time.perf_counter() - t0, 2)}


# ---- the curve over training --------------------------------------------------------------------------
def eval_rows(log_rows: Iterable[dict], spec=None, temperature: float | None = None) -> list[dict]:
    """The evaluation rows ({"kind": "eval", ...}) of a training log, of one tier and temperature (None:
    the first evaluation row's), by training tokens."""
    rows = [r for r in log_rows if isinstance(r, dict) and r.get("kind") == "eval"]
    if rows and spec is None:
        spec = rows[0]["spec"]
    if rows and temperature is None:
        temperature = rows[0]["temperature"]
    rows = [r for r in rows if list(r["spec"]) == list(spec) and float(r["temperature"]) == float(temperature)]
    return sorted(rows, key=lambda r: r["tokens_seen"])


Series = dict[str, list[tuple[int, float]]]  # name -> [(training tokens, accept length)]


def curve(log_rows: Iterable[dict], *, spec=None, temperature: float | None = None) -> Series:
    """Series of τ against training tokens from a training log's evaluation rows (`eval_rows`; the
    training-metric rows are ignored): "SET" (a set's overall τ), "SET/CATEGORY", and "group/GROUP"
    (pooled over the sets of each evaluation). Each series is [(tokens_seen, τ)] by tokens."""
    series: dict[str, list[tuple[int, float]]] = {}

    def add(name, x, y):
        if y is not None:
            series.setdefault(name, []).append((int(x), float(y)))

    for row in eval_rows(log_rows, spec, temperature):
        x, sets = row["tokens_seen"], row["sets"]
        for name, res in sets.items():
            add(name, x, res["accept_length"])
            for cat, tau in res["categories"].items():
                add(f"{name}/{cat or '-'}", x, tau)
        for g, tau in pooled_groups(sets.values()).items():
            add(f"group/{g}", x, tau)
    return series


def plot_curve(series: Series, path, *, spec=None, temperature: float | None = None) -> Path:
    """A PNG of `curve`'s series: τ against training tokens (log scale when they span over 10×), the
    sets' overall τ on the left, the groups on the right (per-category series are left out: too many
    lines to read). Needs matplotlib (the `bench` extra)."""
    from matplotlib.figure import Figure

    panels = [("sets", {k: v for k, v in series.items() if "/" not in k}),
              ("groups (pooled over the sets)", {k[len("group/"):]: v for k, v in series.items()
                                                 if k.startswith("group/")})]
    panels = [(title, lines) for title, lines in panels if lines]
    if not panels:
        raise ValueError("no series to plot (no evaluation rows in the log?)")
    fig = Figure(figsize=(6 * len(panels), 4.2), layout="constrained")
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    xs = [x for pts in series.values() for x, _ in pts]
    log_x = min(xs) > 0 and max(xs) > 10 * min(xs)
    for ax, (title, lines) in zip(axes, panels):
        for name, pts in lines.items():
            ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", markersize=3, label=name)
        if log_x:
            ax.set_xscale("log")
        ax.set_xlabel("training tokens")
        ax.set_ylabel("accept length (tokens / round)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    what = []
    if spec is not None:
        what.append("tree (S,K,N) = (" + ",".join(str(v) for v in spec) + ")")
    if temperature is not None:
        what.append(f"T = {temperature:g}")
    fig.suptitle("accept length over training" + (": " + ", ".join(what) if what else ""))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path
