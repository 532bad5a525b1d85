"""The package's shape, as a reviewer reads it: the import graph, its cycles and upward edges, lines per module.

Run: ``.venv/bin/python bench/layering.py`` (no daemon needed). Every ``import`` in the
source counts, at module level, under ``if TYPE_CHECKING`` (a cycle of types is still a
cycle a reader follows) or inside a function (lazy: it closes no cycle).
An upward edge is client → daemon or protocol → client/daemon: the layers are
protocol → daemon and protocol → client. The one allowed exception is the trainer-side
fallback (``client/local_save.py``), which runs the daemon's write path in the trainer: it
may import daemon modules, and every import of it is lazy, inside the function that
switches to it. ``--check`` exits 1 on any other upward edge, on an eager import of the
fallback, or on a cycle (tests/test_layering.py runs it).
"""

from __future__ import annotations

import ast
import os
import sys

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = {"protocol": "datastates.protocol", "client": "datastates.client", "daemon": "datastates.daemon",
            "datastates": "datastates"}
FALLBACK = "datastates.client.local_save"
"""The one client module allowed to import the daemon; imported only lazily, so the client alone never loads it."""
LAYER = {"datastates.protocol": 0, "datastates.client": 1, "datastates.daemon": 1}


def modules() -> dict[str, str]:
    """Module name → file, for every source file of the package."""
    out = {}
    for folder, package in PACKAGES.items():
        for dirpath, _, files in os.walk(os.path.join(HERE, folder)):
            for name in files:
                if name.endswith(".py"):
                    rel = os.path.relpath(os.path.join(dirpath, name), os.path.join(HERE, folder))[:-3]
                    parts = [p for p in rel.split(os.sep) if p != "__init__"]
                    out[".".join([package, *parts])] = os.path.join(dirpath, name)
    return out


def imports(name: str, path: str, known: set[str]) -> list[tuple[str, bool]]:
    """(imported module, whether inside a function) for each datastates import of ``name``."""
    tree = ast.parse(open(path).read())
    package = name if path.endswith("__init__.py") else name.rsplit(".", 1)[0]
    out: list[tuple[str, bool]] = []

    def visit(node: ast.AST, lazy: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = lazy or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            if isinstance(child, ast.Import):
                out.extend((a.name, inner) for a in child.names if a.name.startswith("datastates"))
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = package.rsplit(".", child.level - 1)[0] if child.level > 1 else package
                    mod = f"{base}.{child.module}" if child.module else base
                else:
                    mod = child.module or ""
                if mod.startswith("datastates"):
                    for a in child.names:  # `from pkg import module` names a module
                        out.append((f"{mod}.{a.name}" if f"{mod}.{a.name}" in known else mod, inner))
            visit(child, inner)

    visit(tree, False)
    return out


def layer(mod: str) -> str:
    return next((p for p in LAYER if mod == p or mod.startswith(p + ".")), "datastates")


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                strong(w)
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

    sys.setrecursionlimit(10000)
    for v in graph:
        if v not in index:
            strong(v)
    return found


def graph() -> tuple[dict[str, set[str]], list[tuple[str, str, bool]]]:
    mods = modules()
    known = set(mods)
    edges = []
    g: dict[str, set[str]] = {m: set() for m in mods}
    for name, path in mods.items():
        for target, lazy in imports(name, path, known):
            target = target if target in known else next((k for k in sorted(known, key=len, reverse=True)
                                                          if target.startswith(k + ".")), target)
            if target in known and target != name:
                edges.append((name, target, lazy))
                if not lazy:  # a function-level import runs later: it cannot close an import-time cycle
                    g[name].add(target)
    return g, edges


def upward(edges: list[tuple[str, str, bool]]) -> list[tuple[str, str, bool]]:
    """Edges that go against protocol → client and protocol → daemon."""
    out = []
    for src, dst, lazy in edges:
        a, b = layer(src), layer(dst)
        if (a == "datastates.protocol" and b != a) or {a, b} == {"datastates.client", "datastates.daemon"}:
            out.append((src, dst, lazy))
    return out


def main() -> int:
    check = "--check" in sys.argv[1:]
    g, edges = graph()
    mods = modules()
    print(f"modules: {len(mods)}   import edges: {len(edges)}")
    up = upward(edges)
    print(f"upward or cross edges (client<->daemon, protocol->above): {len(up)}")
    for src, dst, lazy in up:
        print(f"  {src} -> {dst}{'  (lazy, in a function)' if lazy else ''}")
    cyc = cycles(g)
    print(f"import cycles: {len(cyc)}")
    for comp in cyc:
        print("  " + " <-> ".join(comp))
    print("lines per module (largest first):")
    sizes = sorted(((sum(1 for _ in open(p)), n) for n, p in mods.items()), reverse=True)
    for lines, name in sizes[:15]:
        print(f"  {lines:5d}  {name}")
    total = sum(s for s, _ in sizes)
    print(f"  total {total} lines in {len(sizes)} modules, median {sorted(s for s, _ in sizes)[len(sizes) // 2]}")
    wrong = [e for e in up if e[0] != FALLBACK] + [e for e in edges if e[1] == FALLBACK and not e[2]]
    if check and (wrong or cyc):
        print(f"FAILED: {len(wrong)} upward edge(s) not allowed {wrong}, {len(cyc)} cycle(s)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
