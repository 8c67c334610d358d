"""The import architecture (ARCHITECTURE.md, "Who may import whom"): imports flow one way, no module
imports itself back through others, no module is over 500 lines.

    python -m pytest tests/test_architecture.py

The import graph is grimp's (import-linter's graph library): every `import` in jeagle, checkpoints_conv,
bench and tests, those inside functions included (a lazy import closes a circle as surely as a
top-level one; only `if TYPE_CHECKING:` imports, which never run, are left out). The bench scripts
import their shared helpers as `common` (the script's folder is on sys.path), so `common` is
`bench.common` here.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import pytest
grimp = pytest.importorskip("grimp")  # (a test dependency; the GPU runner need not have it)

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("jeagle", "checkpoints_conv", "bench", "tests")
MAX_LINES = 500

ENTRY_POINTS = ("jeagle.__main__", "jeagle.generate", "jeagle.serve", "jeagle.train_draft", "jeagle.cli")

RUNTIME = tuple(f"jeagle.runtime.{p.stem}" for p in sorted((ROOT / "jeagle" / "runtime").glob("*.py"))
                if p.stem not in ("__init__", "kv_cache"))

# High to low: a module may import from its own layer's modules (where not independent) and lower
# layers only, directly or through modules outside the layers. Entry points do not import one another
# (they share jeagle.cli); `python -m jeagle` is jeagle.generate. jeagle.kernels, the bottom, has its
# own stricter test.
LAYERS = (
    "jeagle.__main__",
    grimp.Layer("jeagle.generate", "jeagle.serve", "jeagle.train_draft", independent=True),
    "jeagle.cli",
    "jeagle.engine",
    grimp.Layer("jeagle.speculative.decoder", "jeagle.speculative.steps", "jeagle.speculative.timing", independent=False),
    # jeagle.runtime but its device KV layout (runtime/kv_cache.py), which the layer below uses
    grimp.Layer(*RUNTIME, independent=False),
    grimp.Layer("jeagle.speculative.round", "jeagle.speculative.tree", "jeagle.speculative.verify", "jeagle.speculative.adaptive", "jeagle.models",
                "jeagle.runtime.kv_cache", "jeagle.sampling", "jeagle.parallel.sharding", "jeagle.config", independent=False),
)


@functools.cache
def import_graph():
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    graph = grimp.build_graph(*PACKAGES, include_external_packages=True, exclude_type_checking_imports=True,
                              cache_dir=None)
    for importer in graph.find_modules_that_directly_import("common"):
        if importer.startswith("bench."):
            for details in graph.get_import_details(importer=importer, imported="common"):
                graph.add_import(importer=importer, imported="bench.common", line_number=details["line_number"],
                                 line_contents=details["line_contents"])
    return graph


def ours(graph) -> set[str]:
    """The graph's modules that are not external packages (grimp squashes those into one node)."""
    return {m for m in graph.modules if not graph.is_module_squashed(m)}


def line(graph, importer: str, imported: str) -> int:
    return min(d["line_number"] for d in graph.get_import_details(importer=importer, imported=imported))


def show_chain(graph, chain) -> str:
    """a (line 12) -> b (line 40) -> c: each import with the line it is on."""
    return " -> ".join(f"{a} (line {line(graph, a, b)})" for a, b in zip(chain, chain[1:])) + f" -> {chain[-1]}"


def find_cycles(graph) -> list[tuple[str, ...]]:
    """Every import a -> b that b leads back from, as the shortest cycle through it, each cycle once."""
    modules, cycles = ours(graph), {}
    for a in sorted(modules):
        for b in sorted(graph.find_modules_directly_imported_by(a) & modules):
            back = graph.find_shortest_chain(importer=b, imported=a)
            if back is not None:
                cycle = (a, *back)
                first = cycle.index(min(cycle[:-1]))
                canonical = cycle[first:-1] + cycle[:first + 1]
                cycles.setdefault(canonical, None)
    return list(cycles)


def chains(graph, importer: str, imported: str) -> list[str]:
    """Import chains from `importer` (a package: any module in it) to `imported` (likewise)."""
    if importer not in graph.modules or imported not in graph.modules:
        return []
    found = graph.find_shortest_chains(importer=importer, imported=imported, as_packages=True)
    return [show_chain(graph, c) for c in sorted(found)]


def test_no_import_cycle():
    graph = import_graph()
    cycles = find_cycles(graph)
    assert not cycles, "import cycles:\n  " + "\n  ".join(show_chain(graph, c) for c in cycles)


def test_find_cycles_sees_a_function_level_import():
    """The check can fail: a lazy import that closes a circle is found and printed."""
    graph = grimp.ImportGraph()
    for m in ("p", "p.a", "p.b"):
        graph.add_module(m)
    graph.add_import(importer="p.a", imported="p.b", line_number=3, line_contents="from p.b import f")
    graph.add_import(importer="p.b", imported="p.a", line_number=9, line_contents="    from p.a import g")
    assert find_cycles(graph) == [("p.a", "p.b", "p.a")]
    assert show_chain(graph, ("p.a", "p.b", "p.a")) == "p.a (line 3) -> p.b (line 9) -> p.a"


def test_layers():
    """entry points -> jeagle.cli -> jeagle.engine -> spec decoder -> jeagle.runtime -> round, models,
    cache, sampling, sharding, config; never upwards."""
    graph = import_graph()
    bad = graph.find_illegal_dependencies_for_layers(layers=LAYERS)
    lines = [f"{d.importer} imports {d.imported}: "
             + "; ".join(f"{sorted(r.heads)} -> {' -> '.join(r.middle) or '(direct)'} -> {sorted(r.tails)}"
                         for r in d.routes)
             for d in sorted(bad, key=lambda d: (d.importer, d.imported))]
    assert not lines, "imports against the layers:\n  " + "\n  ".join(lines)


def test_kernels_import_nothing_else_from_the_project():
    """jeagle.kernels imports only jax, numpy and itself: each kernel sits beside its reference."""
    graph = import_graph()
    assert "jeagle.kernels" in graph.modules, "jeagle/kernels/ not found"
    modules = ours(graph)
    bad = [f"{m} (line {line(graph, m, x)}) imports {x}"
           for m in sorted(graph.find_descendants("jeagle.kernels") | {"jeagle.kernels"})
           for x in sorted(graph.find_modules_directly_imported_by(m) & modules)
           if x != "jeagle.kernels" and not x.startswith("jeagle.kernels.")]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("importer,forbidden", [
    ("jeagle.models", ("jeagle.speculative", "jeagle.runtime", "jeagle.engine", *ENTRY_POINTS)),
    ("jeagle.runtime", ("jeagle.speculative.decoder", "jeagle.speculative.steps", "jeagle.engine", *ENTRY_POINTS)),
    # converters never import what imports them
    ("checkpoints_conv", ("jeagle.loading.fetch", "jeagle.engine", *ENTRY_POINTS)),
    ("jeagle", ("bench", "tests")),
    ("checkpoints_conv", ("bench", "tests")),
])
def test_forbidden_imports(importer, forbidden):
    graph = import_graph()
    found = [c for x in forbidden for c in chains(graph, importer, x)]
    assert not found, f"{importer} reaches what it must not:\n  " + "\n  ".join(found)


def test_no_module_over_500_lines():
    sizes = {p.relative_to(ROOT): len(p.read_text().splitlines())
             for folder in PACKAGES for p in sorted((ROOT / folder).rglob("*.py"))}
    assert len(sizes) > 50
    over = [f"{p}: {n} lines" for p, n in sizes.items() if n > MAX_LINES]
    assert not over, f"modules over {MAX_LINES} lines:\n  " + "\n  ".join(over)
