"""`Router`: N engine replicas behind one server (`python -m jeagle.serve --dp N`), data parallelism as
SGLang's `--dp` with its router's cache-aware policy.

Each replica is an `EngineProcess` (its own process, its own devices: `replica_env`). The router is
the link `create_app` takes, with EngineProcess's interface (`start`, `stop`, `submit`, `abort`,
`flush_cache`, `info`, `facts`, `extra`, `is_alive`), and sends each request to one replica:

1. Load: a replica's in-flight requests (submitted, their last event not back yet). When the most
   loaded has more than `BALANCE_ABS` more than the least and more than `BALANCE_REL` times as many,
   the least loaded takes the request, whatever its prefix (SGLang's balance thresholds).
2. Otherwise the prefix: each replica keeps an approximate record of the prompts routed to it
   (`PrefixRecord`: chained hashes of their `BLOCK`-token blocks, least recently used dropped past
   `RECORD_BLOCKS`). The replica whose record matches the most leading blocks of the prompt takes it
   when that match covers more than `CACHE_THRESHOLD` of the prompt: its prefix cache most likely
   holds it.
3. Else the least loaded (ties: the fewest routed so far, then the lowest index), so distinct prompts
   spread evenly.

The prompt's blocks are recorded for the chosen replica as it is routed. The `n` choices of one
request (its jobs share the prompt list and arrival time) all go to the replica the first went to.

A replica whose process exits is down from then on (`EngineProcess` hears it at once): its requests in
flight end with an error event, new ones go to the others, and a submit that finds it gone is routed
again. With none alive, a request is refused with a 503.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor

from jeagle.serve.engine_loop import Job, by_loop
from jeagle.serve.engine_process import EngineFailed, EngineProcess

BLOCK = 16  # tokens per recorded block (a prompt's partial last block is not recorded)
RECORD_BLOCKS = 1 << 16  # blocks each replica's record keeps (~1M tokens of prompts)
CACHE_THRESHOLD = 0.5  # the share of the prompt a replica's record must match to take it
BALANCE_ABS, BALANCE_REL = 32, 1.5  # the in-flight gap past which the least loaded takes every request
SUMMED = ("running_requests", "queued_requests", "kv_slots_free", "kv_slots_total", "prefix_cache_slots",
          "prefix_cache_evictable_slots", "cached_tokens_total", "evicted_slots_total", "retractions",
          "admission_held_steps")  # /server_info's counters summed over the live replicas


def block_hashes(prompt: list[int], block: int = BLOCK) -> list[int]:
    """The chained hashes of the prompt's whole blocks: the k-th names the prompt's first k+1 blocks."""
    out, h = [], 0
    for i in range(0, len(prompt) - block + 1, block):
        h = hash((h, tuple(prompt[i:i + block])))
        out.append(h)
    return out


class PrefixRecord:
    """One replica's approximate record of the prompts routed to it: block hashes, least recently used
    first out (an approximation of its prefix cache, which evicts on its own)."""

    def __init__(self, max_blocks: int = RECORD_BLOCKS):
        self.max_blocks = max_blocks
        self.blocks: OrderedDict[int, None] = OrderedDict()

    def match(self, hashes: list[int]) -> int:
        """How many leading blocks of a prompt (its `block_hashes`) the record holds."""
        n = 0
        for h in hashes:
            if h not in self.blocks:
                break
            n += 1
        return n

    def insert(self, hashes: list[int]) -> None:
        for h in hashes:
            self.blocks[h] = None
            self.blocks.move_to_end(h)
        while len(self.blocks) > self.max_blocks:
            self.blocks.popitem(last=False)

    def clear(self) -> None:
        self.blocks.clear()


def replica_env(i: int, tp: int, environ=os.environ) -> dict:
    """The variables replica i's process starts with: its `tp` GPUs, the i-th group of the host's
    (or of CUDA_VISIBLE_DEVICES' list when set). Nothing on CPU (JAX_PLATFORMS=cpu): a replica is a
    process. Raises ValueError when CUDA_VISIBLE_DEVICES lists too few."""
    if environ.get("JAX_PLATFORMS", "").strip().lower() == "cpu":
        return {}
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    ids = [d.strip() for d in visible.split(",") if d.strip()] if visible is not None else None
    if ids is None:
        return {"CUDA_VISIBLE_DEVICES": ",".join(str(d) for d in range(i * tp, (i + 1) * tp))}
    if len(ids) < (i + 1) * tp:
        raise ValueError(f"replica {i} needs GPUs {i * tp}-{(i + 1) * tp - 1} of CUDA_VISIBLE_DEVICES={visible}, "
                         f"which lists {len(ids)}")
    return {"CUDA_VISIBLE_DEVICES": ",".join(ids[i * tp:(i + 1) * tp])}


def start_replicas(build, args: tuple, n: int, envs: list[dict] | None = None) -> "Router":
    """N EngineProcesses of `build(*args)` started side by side (`envs[i]`: replica i's variables), behind
    a Router. Raises EngineFailed (after stopping the others) when any fails to start."""
    if n < 1:
        raise ValueError(f"the number of replicas must be >= 1, got {n}")
    envs = envs or [{} for _ in range(n)]

    def one(i):
        try:
            return EngineProcess(build, args, env=envs[i], name=f"replica {i}")
        except EngineFailed as e:
            return e

    with ThreadPoolExecutor(n) as pool:
        started = list(pool.map(one, range(n)))
    failed = [(i, e) for i, e in enumerate(started) if isinstance(e, EngineFailed)]
    if failed:
        for r in started:
            if not isinstance(r, EngineFailed):
                r.stop()
        i, e = failed[0]
        raise EngineFailed(f"replica {i}: {e}")
    return Router(started)


class Router:
    """Replicas (started EngineProcesses, or anything with their interface and `try_submit`,
    `in_flight`) behind one link."""

    def __init__(self, replicas: list, cache_threshold: float = CACHE_THRESHOLD):
        if not replicas:
            raise ValueError("a router needs at least one replica")
        self.replicas = list(replicas)
        self.facts, self.extra = replicas[0].facts, replicas[0].extra  # (the same options: the same facts)
        self.cache_threshold = cache_threshold
        self.records = [PrefixRecord() for _ in replicas]
        self.routed = [0] * len(replicas)  # requests each was sent, since start
        self._groups: OrderedDict[tuple, int] = OrderedDict()  # a recent request's (prompt, arrival) → replica
        self._lock = threading.Lock()

    # ---- the link ---------------------------------------------------------------------------------------
    def start(self) -> None:
        for r in self.replicas:
            r.start()

    def stop(self) -> None:
        with ThreadPoolExecutor(len(self.replicas)) as pool:
            list(pool.map(lambda r: r.stop(), self.replicas))

    def is_alive(self) -> bool:
        return any(r.is_alive() for r in self.replicas)

    def down(self) -> list[int]:
        """The replicas whose process is gone."""
        return [i for i, r in enumerate(self.replicas) if not r.is_alive()]

    def submit(self, job: Job) -> None:
        key = (id(job.prompt), job.arrived)  # the n choices of one request share both
        with self._lock:
            first = self._groups.get(key)
            tried: set[int] = set()
            while True:
                i = first if first is not None and first not in tried else self.choose(job.prompt, tried)
                if i is None:
                    break
                if self.replicas[i].try_submit(job):
                    break
                tried.add(i)  # gone since it was chosen: route again
            if i is not None:
                job.replica = i
                self.routed[i] += 1
                self.records[i].insert(block_hashes(job.prompt))
                self._groups[key] = i
                while len(self._groups) > 256:
                    self._groups.popitem(last=False)
        if i is None:
            by_loop([(job, ("rejected", ("no engine replica is alive", 503)))])

    def abort(self, job: Job) -> None:
        if job.replica >= 0:
            self.replicas[job.replica].abort(job)

    def flush_cache(self) -> None:
        for i, r in enumerate(self.replicas):
            if r.is_alive():
                try:
                    r.flush_cache()
                except OSError:  # gone meanwhile
                    pass
            self.records[i].clear()

    def info(self) -> dict:
        """Replica 0's counters (the first live replica's, when it is down), `SUMMED` over the live
        replicas, `internal_states` one per replica (SGLang's, one per scheduler), and `replicas`: each
        one's counters with `replica`, `alive`, `in_flight`, `routed`."""
        infos = [r.info() for r in self.replicas]
        alive = [r.is_alive() for r in self.replicas]
        live = [i for i, a in enumerate(alive) if a] or [0]
        out = dict(infos[live[0]])
        for key in SUMMED:
            if all(key in infos[i] for i in live):
                out[key] = sum(infos[i][key] for i in live)
        counts = [infos[i].get("spec_accept_length_counts") for i in range(len(infos))]
        if all(c is not None for c in counts):  # since start, every replica's rounds (a dead one's too)
            out["spec_accept_length_counts"] = [sum(col) for col in zip(*counts)]
        out["internal_states"] = [s for i in range(len(infos)) for s in infos[i].get("internal_states", [{}])]
        out["dp"] = len(self.replicas)
        out["replicas"] = [infos[i] | {"replica": i, "alive": alive[i], "in_flight": r.in_flight(),
                                       "routed": self.routed[i]} for i, r in enumerate(self.replicas)]
        return out

    # ---- the policy -------------------------------------------------------------------------------------
    def choose(self, prompt: list[int], exclude=()) -> int | None:
        """The replica for a prompt (the module's policy), None when none is alive."""
        alive = [i for i, r in enumerate(self.replicas) if i not in exclude and r.is_alive()]
        if not alive:
            return None
        load = {i: self.replicas[i].in_flight() for i in alive}
        least = min(alive, key=lambda i: (load[i], self.routed[i], i))
        most = max(load.values())
        if most - load[least] > BALANCE_ABS and most > load[least] * BALANCE_REL:
            return least
        hashes = block_hashes(prompt)
        if not hashes:
            return least
        matched = {i: self.records[i].match(hashes) for i in alive}
        best = max(alive, key=lambda i: (matched[i], -load[i], -self.routed[i], -i))
        if matched[best] * BLOCK > self.cache_threshold * len(prompt):
            return best
        return least
