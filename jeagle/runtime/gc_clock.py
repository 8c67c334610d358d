"""Python's garbage collector, watched and frozen for a serving process.

`gc_totals()`: collections per generation and the seconds they took, summed since the first call, for
the whole process (a collection stops every thread; `Engine.info()` reports them in `host_totals`, so
any process that reads an engine's info gets this clock: one `gc.callbacks` entry, a few
microseconds per collection).
`freeze_heap()`: collect, then move every object alive now to the permanent generation, which later
collections skip. After the engine is built its process holds ~300k tracked objects (model state,
tokenizer, traced and compiled executables), and a full collection walks all of them: 180 ms on a
2-core CPU (bench/HISTORY.md, 2026-11-27). A server calls it once its engine is loaded, as vLLM does
after start-up (`vllm/utils/gc_utils.py` `freeze_gc_heap`); a library never does it on its own: objects
frozen are never collected, even once garbage.
"""

from __future__ import annotations

import gc
import threading
import time

_lock = threading.Lock()
_totals = {"gc_collections": 0, "gc_full_collections": 0, "gc_s": 0.0, "gc_frozen": 0}
_started: list[float] = []  # the running collection's start (collections do not nest)
_installed = False


def _callback(phase: str, info: dict) -> None:
    if phase == "start":
        _started.append(time.perf_counter())
        return
    spent = time.perf_counter() - _started.pop() if _started else 0.0
    _totals["gc_collections"] += 1
    _totals["gc_full_collections"] += info.get("generation") == 2
    _totals["gc_s"] += spent


def gc_totals() -> dict:
    """Collections (all generations, and full ones) and their seconds since the first call, and the
    objects the last `freeze_heap` froze (O(1): the engine reads this after every step, and
    `gc.get_freeze_count()` walks the frozen list, ~10 ms for 300k objects)."""
    global _installed
    if not _installed:
        with _lock:
            if not _installed:
                gc.callbacks.append(_callback)
                _installed = True
    return dict(_totals)


def freeze_heap() -> int:
    """Collect everything, then freeze what is alive (`gc.freeze`); returns the objects frozen in all."""
    gc_totals()  # the collection below is counted too
    gc.collect()
    gc.freeze()
    _totals["gc_frozen"] = gc.get_freeze_count()
    return _totals["gc_frozen"]
