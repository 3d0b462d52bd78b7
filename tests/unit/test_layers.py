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

#: The wings of ``src/mrtpo``, lowest first: a module may import its own wing and the wings
#: below it, never one above (lazy and ``TYPE_CHECKING`` imports included). Loose modules at
#: the top of the package sit at the bottom (``safe_files``, ``distributed``, ``live``: they
#: import nothing of the project) or at the very top (the entry points a user imports).
WINGS = (
    ("base", ("mrtpo.safe_files", "mrtpo.distributed", "mrtpo.live", "mrtpo.fetch")),
    ("tasks", ("mrtpo.tasks",)),
    ("core", ("mrtpo.core",)),
    ("rollout", ("mrtpo.rollout",)),
    ("step", ("mrtpo.step",)),
    ("run", ("mrtpo.run",)),
    ("evaluate", ("mrtpo.evaluate",)),
    ("lightning", ("mrtpo.lightning",)),
    ("entry", ("mrtpo.api", "mrtpo.trainer", "mrtpo.data", "mrtpo")),
)
#: At most this many modules loose at the top of the package (``__init__`` included).
MAX_LOOSE = 12


def wing_of(module: str) -> int:
    """The rank of ``module``'s wing (its longest matching prefix)."""
    best, rank = "", None
    for i, (_, prefixes) in enumerate(WINGS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > len(best):
                best, rank = p, i
    if rank is None:
        raise AssertionError(f"{module} belongs to no wing: add it to WINGS in {__file__}")
    return rank


def _modules(base: Path, package: str) -> dict[str, Path]:
    out = {}
    for p in (base / package).rglob("*.py"):
        parts = p.relative_to(base).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = p
    return out


def _absolute(node: ast.ImportFrom, name: str, path: Path) -> str:
    """The absolute module an ``ImportFrom`` names (``from .x import y`` inside a package too)."""
    if node.level == 0:
        return node.module or ""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for _ in range(node.level - 1):
        package = package.rpartition(".")[0]
    return f"{package}.{node.module}" if node.module else package


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
            elif isinstance(node, ast.ImportFrom) and _absolute(node, name, path).startswith(
                prefixes
            ):
                node.module = _absolute(node, name, path)
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


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    return sorted(
        f"{m} -> {d}" for m, deps in graph.items() for d in deps if wing_of(d) > wing_of(m)
    )


def test_no_import_runs_up_the_wings():
    assert upward_imports(_package_graph()) == []


def test_the_rule_finds_an_upward_import():
    graph = {"mrtpo.core.replay": {"mrtpo.lightning.module"}, "mrtpo.run.cli": {"mrtpo.core"}}
    assert upward_imports(graph) == ["mrtpo.core.replay -> mrtpo.lightning.module"]


def test_few_modules_are_loose_at_the_top_of_the_package():
    loose = sorted(p.stem for p in (ROOT / "src" / "mrtpo").glob("*.py"))
    assert len(loose) <= MAX_LOOSE, loose
    for stem in loose:  # each has its place in WINGS
        wing_of("mrtpo" if stem == "__init__" else f"mrtpo.{stem}")


#: Hydra imports below the run layer that are optional, each with why.
OPTIONAL_HYDRA = {
    "mrtpo.core.errors -> hydra.errors": "Hydra's one-line error base; a stand-in without Hydra",
    "mrtpo.tasks.custom.callables -> hydra.core.hydra_config": "the job folder, only in a job",
}


def test_the_framework_free_step_imports_no_lightning():
    """The step and everything below it run without Lightning or Hydra (torchtune-style
    recipes), but for the optional imports listed above."""
    graph = _package_graph()
    low = [m for m in graph if wing_of(m) <= wing_of("mrtpo.step")]
    bad = []
    for m in low:
        tree = ast.parse(_modules(ROOT / "src", "mrtpo")[m].read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom) and node.level == 0
                else []
            )
            bad += [f"{m} -> {n}" for n in names if n.split(".")[0] in ("lightning", "hydra")]
    assert sorted(set(bad) - set(OPTIONAL_HYDRA)) == []


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
