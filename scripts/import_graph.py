"""Static import graph of the lowbit package: imports inside functions, and import cycles.

  python scripts/import_graph.py [--root lowbit] [--top-only] [--list]

Reads every module with `ast` (nothing is imported). An edge A -> B is an import in A of a
lowbit module B (`from lowbit.x import y` points at lowbit.x.y when that is a module, else
at lowbit.x); importing a module's parent packages implicitly is not an edge. Prints:
  - imports that are not at module top (the count `grep "^\\s\\+\\(import\\|from\\) "` gives),
    per file: those inside functions, and those indented at module level (try / if);
  - every import cycle (strongly connected group of modules), with one path through it.
--top-only builds the graph from module-level imports alone (what runs at import time).
Exit status 1 when there is a cycle.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Import:
    module: str  # the importing module
    target: str  # the lowbit module it names
    line: int
    in_function: bool  # inside a def (else at module level)
    indented: bool  # not at column 0: inside a def, a class, a try or an if


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules(root: Path) -> dict[str, Path]:
    """Module name -> file, for every .py file under the package `root`."""
    return {module_name(p, root): p for p in sorted(root.rglob("*.py"))}


def _resolve(node: ast.ImportFrom, module: str, is_package: bool) -> str | None:
    """The absolute module of a `from X import ...` (relative imports resolved)."""
    if node.level == 0:
        return node.module
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(module: str, path: Path, known: set[str], prefix: str) -> list[Import]:
    tree = ast.parse(path.read_text(), filename=str(path))
    is_package = path.name == "__init__.py"
    out: list[Import] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inside = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                targets = _targets(child, module, is_package, known, prefix) or [""]  # "": another package
                out.extend(Import(module, t, child.lineno, in_function, child.col_offset > 0) for t in targets)
            visit(child, inside)

    visit(tree, False)
    return out


def _targets(node: ast.Import | ast.ImportFrom, module: str, is_package: bool, known: set[str],
             prefix: str) -> list[str]:
    """The lowbit modules one import statement names (empty for other packages)."""
    names: list[str] = []
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        base = _resolve(node, module, is_package)
        if base is None:
            return []
        for a in node.names:
            sub = f"{base}.{a.name}"
            names.append(sub if sub in known else base)
    out = []
    for name in names:
        if name != prefix and not name.startswith(prefix + "."):
            continue
        while name not in known and "." in name:  # `import lowbit.x.y` of a package attribute
            name = name.rsplit(".", 1)[0]
        if name in known and name not in out:
            out.append(name)
    return out


def all_imports(root: Path) -> list[Import]:
    mods = modules(root)
    known, prefix = set(mods), root.name
    return [imp for name, path in mods.items() for imp in imports_of(name, path, known, prefix)]


def statements(imports: list[Import]) -> dict[tuple[str, int], Import]:
    """One entry per import statement (a statement naming two modules counts once)."""
    out: dict[tuple[str, int], Import] = {}
    for imp in imports:
        out.setdefault((imp.module, imp.line), imp)
    return out


def indented_counts(imports: list[Import]) -> Counter:
    """Module -> import statements not at column 0 (inside functions or module-level blocks)."""
    return Counter(imp.module for imp in statements(imports).values() if imp.indented)


def graph(imports: list[Import], top_only: bool = False) -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {}
    for imp in imports:
        edges.setdefault(imp.module, set())
        if imp.target and imp.target != imp.module and not (top_only and imp.in_function):
            edges[imp.module].add(imp.target)
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10 * len(edges) + 100))
    try:
        for v in sorted(edges):
            if v not in index:
                connect(v)
    finally:
        sys.setrecursionlimit(limit)
    return sorted(out)


def cycle_path(group: list[str], edges: dict[str, set[str]]) -> list[str]:
    """One closed path through a strongly connected group, from its first module."""
    members, start = set(group), group[0]
    prev: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(edges.get(v, set()) & members):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(prev[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if w not in prev:
                    prev[w] = v
                    nxt.append(w)
        frontier = nxt
    return group


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", default=str(REPO / "lowbit"), help="package directory")
    ap.add_argument("--top-only", action="store_true", help="module-level imports only")
    ap.add_argument("--list", action="store_true", help="print every import not at module top")
    args = ap.parse_args(argv)
    root = Path(args.root).resolve()
    imports = all_imports(root)
    stmts = statements(imports)
    in_fn = Counter(i.module for i in stmts.values() if i.in_function)
    block = Counter(i.module for i in stmts.values() if i.indented and not i.in_function)
    print(f"imports not at module top: {sum(in_fn.values()) + sum(block.values())} "
          f"({sum(in_fn.values())} inside functions, {sum(block.values())} in module-level blocks)")
    for mod in sorted(set(in_fn) | set(block)):
        print(f"  {in_fn[mod]:3d} {block[mod]:3d}  {mod}")
    if args.list:
        for (mod, line), imp in sorted(stmts.items()):
            if imp.indented:
                print(f"  {mod}:{line}{'' if imp.in_function else ' (module level)'}")
    edges = graph(imports, args.top_only)
    groups = cycles(edges)
    print(f"import cycles{' (module-level imports)' if args.top_only else ''}: {len(groups)}")
    for g in groups:
        print(f"  {len(g)} modules: " + " -> ".join(cycle_path(g, edges)))
    return 1 if groups else 0


if __name__ == "__main__":
    sys.exit(main())
