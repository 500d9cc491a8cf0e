"""Check the workspace against the allowed dependency graph in `dependency_graph.py`.

Two kinds of check:

1. Declarations. The workspace members are exactly the graph's packages; each pyproject's
   ``dependencies`` name only the siblings the graph lets it require, and every one of them; its
   extras name only allowed siblings; sibling requirements are bounded to the shared version
   (``>=0.x,<0.(x+1)``); all members share one version; the declared graph has no cycle.
2. Static imports, from the ``ast`` of every ``.py`` under ``packages/<p>/src``:
   - no two source files import each other, directly or through others (a file-level import cycle),
     counting every import that runs, in a function too; ``if TYPE_CHECKING:`` imports never run;
   - importing a sibling the graph does not allow at all is an error, wherever the import is
     (inside a function or under ``if TYPE_CHECKING:`` too);
   - a module-level import (one that runs on import: not inside a function, not under
     ``if TYPE_CHECKING:``) of a sibling that is only optional is an error: import it lazily;
   - a module-level import of a third-party distribution that the package declares only in an extra
     is an error, and so is a module-level import of a heavy module (`HEAVY_MODULES`) that the
     package does not require directly;
   - importing (anywhere) a third-party distribution that some member declares but that this
     package can reach through neither its requirements nor its extras is an error.

``importlib.import_module("literal")`` and ``__import__("literal")`` count as imports.
Exit status 1 with one line per violation, 0 when clean.

Usage: ``python tools/check_dependency_graph.py``
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from dependency_graph import (
    ALLOWED_GRAPH,
    REPO_ROOT,
    LockGraph,
    PackageMeta,
    Requirement,
    check_sibling_bound,
    import_name,
    is_heavy,
    lock_closure,
    read_lock,
    read_workspace,
)


def check_declarations(workspace: Mapping[str, PackageMeta]) -> list[str]:
    """Check pyproject declarations against `ALLOWED_GRAPH` (part 1 of the module docstring)."""
    errors: list[str] = []
    for missing in sorted(set(ALLOWED_GRAPH) - set(workspace)):
        errors.append(f"{missing}: in ALLOWED_GRAPH but not a workspace member")
    for extra in sorted(set(workspace) - set(ALLOWED_GRAPH)):
        errors.append(f"{extra}: workspace member missing from ALLOWED_GRAPH in tools/dependency_graph.py")
    versions = {meta.version for meta in workspace.values()}
    if len(versions) > 1:
        listing = ", ".join(f"{d}=={m.version}" for d, m in sorted(workspace.items()))
        errors.append(f"packages must share one version, found: {listing}")

    for dist, meta in sorted(workspace.items()):
        node = ALLOWED_GRAPH.get(dist)
        if node is None:
            continue
        where = f"{dist} (pyproject.toml)"
        required = {r.name for r in meta.dependencies if r.name in workspace}
        for name in sorted(required - node.requires):
            kind = "only as an optional extra" if name in node.optional else "not at all"
            errors.append(f"{where}: requires {name}, which the graph allows {kind}")
        for name in sorted(node.requires - required):
            errors.append(f"{where}: the graph says it requires {name}, but `dependencies` does not list it")
        for extra, reqs in sorted(meta.optional_dependencies.items()):
            for req in reqs:
                if req.name == dist or req.name not in workspace:
                    continue
                if req.name not in node.allowed:
                    errors.append(
                        f"{where}: extra [{extra}] names {req.name}, which the graph does not allow"
                    )
        for req in _sibling_requirements(meta, workspace):
            problem = check_sibling_bound(req, meta.version)
            if problem:
                errors.append(f"{where}: unbounded sibling requirement {problem}")
    errors.extend(_find_cycles(workspace))
    return errors


def _sibling_requirements(meta: PackageMeta, workspace: Mapping[str, PackageMeta]) -> Iterator[Requirement]:
    yield from (r for r in meta.dependencies if r.name in workspace)
    for reqs in meta.optional_dependencies.values():
        yield from (r for r in reqs if r.name in workspace and r.name != meta.distribution)


def _find_cycles(workspace: Mapping[str, PackageMeta]) -> list[str]:
    edges: dict[str, set[str]] = {}
    for dist, meta in workspace.items():
        edges[dist] = {r.name for r in _sibling_requirements(meta, workspace)}
    errors: list[str] = []
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                cycle = [*path[path.index(nxt) :], nxt]
                errors.append("dependency cycle: " + " -> ".join(cycle))
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for dist in sorted(edges):
        if dist not in state:
            visit(dist, [dist])
    return errors


# --- static imports ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ImportSite:
    """One imported module name and where it is imported."""

    module: str
    line: int
    module_level: bool  # runs when the containing module is imported
    type_checking: bool  # under `if TYPE_CHECKING:`


class _ImportCollector(ast.NodeVisitor):
    def __init__(self) -> None:
        self.sites: list[ImportSite] = []
        self._function_depth = 0
        self._type_checking_depth = 0

    def _add(self, module: str, node: ast.AST) -> None:
        self.sites.append(
            ImportSite(
                module=module,
                line=getattr(node, "lineno", 0),
                module_level=self._function_depth == 0 and self._type_checking_depth == 0,
                type_checking=self._type_checking_depth > 0,
            )
        )

    def _visit_function(self, node: ast.AST) -> None:
        self._function_depth += 1
        self.generic_visit(node)
        self._function_depth -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _visit_function

    def visit_If(self, node: ast.If) -> None:
        test = node.test
        name = test.id if isinstance(test, ast.Name) else test.attr if isinstance(test, ast.Attribute) else ""
        if name != "TYPE_CHECKING":
            self.generic_visit(node)
            return
        self._type_checking_depth += 1
        for child in node.body:
            self.visit(child)
        self._type_checking_depth -= 1
        for child in node.orelse:
            self.visit(child)

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add(alias.name, node)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level or not node.module:
            return  # relative: inside the package itself
        self._add(node.module, node)
        for alias in node.names:
            if alias.name != "*":
                self._add(f"{node.module}.{alias.name}", node)  # `from transformers import models`

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
        first = node.args[0] if node.args else None
        if (
            name in ("import_module", "__import__")
            and isinstance(first, ast.Constant)
            and isinstance(first.value, str)
            and not first.value.startswith(".")
        ):
            self._add(first.value, node)
        self.generic_visit(node)


def iter_imports(path: Path) -> list[ImportSite]:
    """Return every absolute import in one source file."""
    collector = _ImportCollector()
    collector.visit(ast.parse(path.read_text(encoding="utf-8"), filename=str(path)))
    return collector.sites


def check_imports(workspace: Mapping[str, PackageMeta], lock: LockGraph) -> list[str]:
    """Check the static imports of every package's sources (part 2 of the module docstring)."""
    sibling_of = {import_name(d): d for d in workspace}
    third_party_of: dict[str, str] = {}  # import name -> distribution, for everything a member declares
    for meta in workspace.values():
        for req in [*meta.dependencies, *(r for rs in meta.optional_dependencies.values() for r in rs)]:
            if req.name not in workspace:
                third_party_of[import_name(req.name)] = req.name

    errors: list[str] = []
    for dist, meta in sorted(workspace.items()):
        node = ALLOWED_GRAPH.get(dist)
        if node is None or not meta.src.is_dir():
            continue
        direct = {r.name for r in meta.dependencies}
        reachable_required = lock_closure(lock, [(dist, ())])
        reachable_any = lock_closure(lock, [(dist, list(meta.optional_dependencies))])
        for path in sorted(meta.src.rglob("*.py")):
            rel = path.relative_to(REPO_ROOT)
            for site in iter_imports(path):
                top = site.module.split(".")[0]
                where = f"{rel}:{site.line}: `{site.module}`"
                if top in sibling_of:
                    sibling = sibling_of[top]
                    if sibling == dist:
                        continue
                    if sibling not in node.allowed:
                        errors.append(f"{where}: {dist} may not import {sibling} (not in its allowed graph)")
                    elif site.module_level and sibling not in node.requires:
                        errors.append(
                            f"{where}: {sibling} is an optional sibling of {dist}; import it inside the "
                            "function that needs it"
                        )
                    continue
                third = third_party_of.get(top)
                if third is not None and third not in reachable_any:
                    errors.append(f"{where}: {dist} declares no dependency that provides {third}")
                elif third is not None and site.module_level and third not in reachable_required:
                    errors.append(
                        f"{where}: {third} is only an optional dependency of {dist}; import it lazily"
                    )
                elif site.module_level and is_heavy(site.module) and third not in direct:
                    errors.append(
                        f"{where}: heavy module imported at module level, but {dist} does not require "
                        f"{third or top} directly; import it inside the function that needs it"
                    )
    return sorted(set(errors))


def _module_files(workspace: Mapping[str, PackageMeta]) -> dict[str, Path]:
    """Dotted module name -> source file, for every module of every package (``__init__`` as the package)."""
    files: dict[str, Path] = {}
    for meta in workspace.values():
        if not meta.src.is_dir():
            continue
        for path in meta.src.rglob("*.py"):
            parts = path.relative_to(meta.src.parent).with_suffix("").parts
            files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return files


def _runtime_edges(files: Mapping[str, Path]) -> dict[str, set[str]]:
    """Module -> the modules of ours it imports when it runs (``TYPE_CHECKING`` blocks left out)."""
    return {
        name: {s.module for s in iter_imports(path) if not s.type_checking and s.module in files} - {name}
        for name, path in files.items()
    }


def _strongly_connected(edges: Mapping[str, set[str]]) -> list[list[str]]:
    """Groups of two or more modules that import each other (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[list[str]] = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    group = stack[stack.index(node) :]
                    del stack[stack.index(node) :]
                    if len(group) > 1:
                        groups.append(sorted(group))
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                work.append((child, iter(sorted(edges[child]))))
            elif child in stack:
                low[node] = min(low[node], index[child])
    return groups


def check_file_cycles(workspace: Mapping[str, PackageMeta]) -> list[str]:
    """Every file-level import cycle among the packages' sources, one line each."""
    edges = _runtime_edges(_module_files(workspace))
    return [
        "import cycle between files: "
        + "; ".join(f"{m} imports {', '.join(sorted(edges[m] & set(group)))}" for m in group)
        for group in _strongly_connected(edges)
    ]


def main() -> int:
    """Run every check and print the violations."""
    workspace = read_workspace()
    lock = read_lock()
    errors = check_declarations(workspace) + check_imports(workspace, lock) + check_file_cycles(workspace)
    print("allowed graph (required | optional siblings):")
    for dist, node in ALLOWED_GRAPH.items():
        required = ", ".join(sorted(node.requires)) or "-"
        optional = ", ".join(sorted(node.optional)) or "-"
        print(f"  {dist:<22} {required} | {optional}")
    files = sum(1 for m in workspace.values() if m.src.is_dir() for _ in m.src.rglob("*.py"))
    if errors:
        print(f"\n{len(errors)} dependency-graph violation(s) in {len(workspace)} packages, {files} files:")
        for error in errors:
            print(f"  {error}")
        return 1
    print(f"dependency graph OK: {len(workspace)} packages, {files} source files")
    return 0


if __name__ == "__main__":
    sys.exit(main())
