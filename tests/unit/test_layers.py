"""The package's import graph has no cycles and its layers point one way (issue 38).

Read from the source with ``ast`` (nothing is imported): every ``import`` of a project module,
at module level or inside a function, is an edge. A cycle (``credit.opsd -> teacher ->
credit.distill -> ...``) or a low layer importing a high one (the batch types importing the
rollout engines, the framework-free step importing its Lightning adapter) fails here, naming
the modules.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

#: Modules (prefixes) that the step and what it is built from must never import: the
#: Lightning adapter, callbacks, stages and the job plumbing above them.
ADAPTERS = (
    "mrtpo.module",
    "mrtpo.callbacks",
    "mrtpo.stages",
    "mrtpo.pipeline",
    "mrtpo.cli",
    "mrtpo.sft",
)
#: Low layers: the records and math everything else builds on.
LOW = ("mrtpo.sampling", "mrtpo.batch", "mrtpo.tasks.base", "mrtpo.credit", "mrtpo.step")


def _modules(base: Path, package: str) -> dict[str, Path]:
    out = {}
    for p in (base / package).rglob("*.py"):
        parts = p.relative_to(base).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = p
    return out


def _graph(mods: dict[str, Path], prefixes: tuple[str, ...]) -> dict[str, set[str]]:
    def owner(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        deps: set[str | None] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                deps |= {owner(a.name) for a in node.names if a.name.startswith(prefixes)}
            elif (
                isinstance(node, ast.ImportFrom)
                and node.level == 0
                and (node.module or "").startswith(prefixes)
            ):
                for a in node.names:
                    full = f"{node.module}.{a.name}"
                    deps.add(owner(full) if full in mods else owner(node.module))
        deps -= {None, name}
        graph[name] = {d for d in deps if d is not None}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _package_graph() -> dict[str, set[str]]:
    return _graph(_modules(ROOT / "src", "mrtpo"), ("mrtpo",))


def test_the_package_has_no_import_cycle():
    assert _cycles(_package_graph()) == []


def test_the_harnesses_have_no_import_cycle():
    mods = {**_modules(ROOT / "scripts", "benchmarks"), **_modules(ROOT / "scripts", "replication")}
    assert _cycles(_graph(mods, ("benchmarks", "replication"))) == []


def test_low_layers_import_no_adapter_and_the_batch_types_no_engine():
    graph = _package_graph()
    upward = sorted(
        f"{m} -> {d}"
        for m, deps in graph.items()
        if m.startswith(LOW)
        for d in deps
        if d.startswith(ADAPTERS) or (m in ("mrtpo.batch", "mrtpo.sampling") and "rollout" in d)
    )
    assert upward == []


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
