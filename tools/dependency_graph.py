"""The allowed dependency graph of the automodel workspace, as data, and readers for the real one.

This module is the one place that says which package may depend on which (ARCHITECTURE.md,
section 2). It is imported by `check_dependency_graph.py`, `check_lean_import.py` and the
``wheels`` nox session; it uses the standard library only, so it runs in any Python >= 3.11.

Vocabulary: a *distribution* is what pip installs (``automodel-mesh``); its *import name* is what
Python imports (``automodel_mesh``). A *sibling* is another member of this workspace.
"""

from __future__ import annotations

import re
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

__all__ = [
    "ALLOWED_GRAPH",
    "HEAVY_MODULES",
    "REPO_ROOT",
    "Node",
    "PackageMeta",
    "Requirement",
    "check_sibling_bound",
    "expected_absent",
    "import_name",
    "is_heavy",
    "lock_closure",
    "normalize",
    "parse_requirement",
    "read_lock",
    "read_workspace",
]

REPO_ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Node:
    """What one workspace package may depend on.

    Attributes:
        requires: Siblings it may require (listed in ``dependencies``) and import at module level.
        optional: Siblings it may only reach through an extra, and must import lazily.
        published: False for packages that are never uploaded (the test harness).
    """

    requires: frozenset[str] = field(default_factory=frozenset)
    optional: frozenset[str] = field(default_factory=frozenset)
    published: bool = True

    @property
    def allowed(self) -> frozenset[str]:
        """Every sibling this package may name at all."""
        return self.requires | self.optional


def _node(requires: Iterable[str] = (), optional: Iterable[str] = (), *, published: bool = True) -> Node:
    return Node(frozenset(requires), frozenset(optional), published)


_MESH, _MODS, _CKPT, _CPU = "automodel-mesh", "automodel-modules", "automodel-checkpoint", "automodel-cpu"
_DIST, _PP, _MOE = "automodel-distributed", "automodel-pipelining", "automodel-moe"
_QUANT, _PEFT, _INFRA = "automodel-quant", "automodel-peft", "automodel-infra"
_PLAN = "automodel-planner"

#: The allowed graph. Edges point one way; a sibling not named here may not be depended on or imported.
ALLOWED_GRAPH: Mapping[str, Node] = {
    _MESH: _node(),  # meshes, sizes, axis names (and the ConfigDict its sizes and every config share)
    _MODS: _node(),  # module-tree tools: names across wrappers, lookups, the fake-tensor tracer, devices
    _CPU: _node(),  # opt-in CPU runtime (host buffers, allocator, CPU ring attention); torch only
    _CKPT: _node([_MODS]),  # HF / DCP checkpoints into and out of shards; imports no strategy
    _DIST: _node([_MESH, _MODS, _CKPT]),
    _PP: _node([_MESH, _MODS]),  # gets a parallelize_fn from its caller; never imports automodel_distributed
    _MOE: _node([_MESH, _MODS, _DIST]),
    _QUANT: _node([_MESH, _MODS]),  # torchao (+ optional bitsandbytes); uses ConfigDict, no mesh
    _PEFT: _node([_MESH, _MODS], optional=[_QUANT]),  # QLoRA through the [quant] extra
    _INFRA: _node([_MESH, _CKPT, _DIST], optional=[_PP, _MOE, _QUANT, _PEFT]),
    _PLAN: _node([_MESH, _MODS, _DIST], optional=[_PP, _MOE, _QUANT, _PEFT]),  # each feature's term lazily
    "automodel-all": _node([_MESH, _MODS, _CKPT, _CPU, _DIST, _PP, _MOE, _QUANT, _PEFT, _INFRA, _PLAN]),
    "automodel-testing": _node([_MESH, _MODS], published=False),
}

#: Modules that are slow to import or drag in native libraries: never imported by ``import <package>``,
#: and never imported at module level by a package that does not require them directly.
HEAVY_MODULES: tuple[str, ...] = ("torchao", "peft", "bitsandbytes", "megatron_fsdp", "transformers.models")

# Distributions whose import name is not their normalised name with "-" turned into "_".
_IMPORT_NAME_OVERRIDES: Mapping[str, str] = {}


def normalize(name: str) -> str:
    """Return the PEP 503 normal form of a distribution name."""
    return re.sub(r"[-_.]+", "-", name).lower()


def import_name(distribution: str) -> str:
    """Return the top-level import name of a distribution."""
    dist = normalize(distribution)
    return _IMPORT_NAME_OVERRIDES.get(dist, dist.replace("-", "_"))


def is_heavy(module: str) -> bool:
    """Return whether a dotted module name is, or is inside, one of `HEAVY_MODULES`."""
    return any(module == heavy or module.startswith(heavy + ".") for heavy in HEAVY_MODULES)


@dataclass(frozen=True)
class Requirement:
    """The parts of a PEP 508 requirement string that the checks need."""

    name: str
    extras: frozenset[str]
    specifier: str
    marker: str | None


_REQ_RE = re.compile(
    r"^\s*(?P<name>[A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[(?P<extras>[^\]]*)\])?\s*"
    r"(?P<spec>[^;]*?)\s*(?:;\s*(?P<marker>.+?))?\s*$"
)


def parse_requirement(text: str) -> Requirement:
    """Parse a requirement such as ``"automodel-infra[pp,moe]>=0.1.0,<0.2; python_version>'3'"``.

    Raises:
        ValueError: If the string is not a plain name-and-specifier requirement (URLs are not allowed).
    """
    match = _REQ_RE.match(text)
    if match is None or "@" in match["spec"]:
        raise ValueError(f"cannot parse requirement {text!r}")
    extras = frozenset(normalize(e) for e in (match["extras"] or "").split(",") if e.strip())
    spec = match["spec"].strip().strip("()").replace(" ", "")
    return Requirement(normalize(match["name"]), extras, spec, match["marker"])


@dataclass(frozen=True)
class PackageMeta:
    """One workspace member as its pyproject.toml declares it."""

    distribution: str
    version: str
    path: Path
    dependencies: tuple[Requirement, ...]
    optional_dependencies: Mapping[str, tuple[Requirement, ...]]

    @property
    def import_name(self) -> str:
        """The top-level import name (``src/<import_name>``)."""
        return import_name(self.distribution)

    @property
    def src(self) -> Path:
        """The folder that holds the import package."""
        return self.path / "src" / self.import_name


def read_workspace(root: Path = REPO_ROOT) -> dict[str, PackageMeta]:
    """Read every ``packages/*/pyproject.toml``, keyed by normalised distribution name."""
    members: dict[str, PackageMeta] = {}
    for pyproject in sorted((root / "packages").glob("*/pyproject.toml")):
        project = tomllib.loads(pyproject.read_text(encoding="utf-8"))["project"]
        optional = {
            normalize(extra): tuple(parse_requirement(r) for r in reqs)
            for extra, reqs in project.get("optional-dependencies", {}).items()
        }
        meta = PackageMeta(
            distribution=normalize(project["name"]),
            version=project["version"],
            path=pyproject.parent,
            dependencies=tuple(parse_requirement(r) for r in project.get("dependencies", [])),
            optional_dependencies=optional,
        )
        members[meta.distribution] = meta
    return members


def check_sibling_bound(requirement: Requirement, version: str) -> str | None:
    """Check that a sibling requirement is bounded to the workspace's minor series.

    ``version`` 0.3.1 accepts ``>=0.3.0,<0.4`` (lower bound within 0.3 and not above 0.3.1).

    Returns:
        None when the bound is right, else a sentence saying what is wrong.
    """
    parts = [p for p in requirement.specifier.split(",") if p]
    lower = [p[2:] for p in parts if p.startswith(">=")]
    upper = [p[1:] for p in parts if p.startswith("<") and not p.startswith("<=")]
    want = f">={'.'.join(version.split('.')[:2])}.x,<{_next_minor(version)}"
    if len(parts) != 2 or len(lower) != 1 or len(upper) != 1:
        return f"{requirement.name}{requirement.specifier or ' (unbounded)'}: expected {want}"
    if _release(lower[0])[:2] != _release(version)[:2] or _release(lower[0]) > _release(version):
        return f"{requirement.name}{requirement.specifier}: lower bound must be in {want} and <= {version}"
    if _release(upper[0]) != _release(_next_minor(version)):
        return f"{requirement.name}{requirement.specifier}: upper bound must be <{_next_minor(version)}"
    return None


def _release(version: str) -> tuple[int, ...]:
    numbers = [int(x) for x in re.findall(r"\d+", version.split("+")[0])[:3]]
    while len(numbers) < 3:
        numbers.append(0)
    return tuple(numbers)


def _next_minor(version: str) -> str:
    major, minor, _ = _release(version)
    return f"{major}.{minor + 1}"


# --- uv.lock -------------------------------------------------------------------------------------------

LockGraph = dict[str, dict[str | None, set[tuple[str, frozenset[str]]]]]


def read_lock(root: Path = REPO_ROOT) -> LockGraph:
    """Read uv.lock into ``{distribution: {extra or None: {(dependency, its extras)}}}``.

    A dependency group ``g`` of a workspace member is stored like an extra named ``"@g"``, so
    ``lock_closure(graph, [("automodel-mesh", ["@test"])])`` is what ``uv sync --package
    automodel-mesh --group test`` installs. Markers are ignored, so a closure computed from it may
    over-approximate what gets installed; that only makes "must be absent" checks more lenient,
    never wrong.
    """
    lock = tomllib.loads((root / "uv.lock").read_text(encoding="utf-8"))
    graph: LockGraph = {}
    for package in lock.get("package", []):
        entry = graph.setdefault(normalize(package["name"]), {})
        sections: dict[str | None, list[dict[str, object]]] = {None: package.get("dependencies", [])}
        sections.update(
            {normalize(extra): deps for extra, deps in package.get("optional-dependencies", {}).items()}
        )
        sections.update({"@" + normalize(g): deps for g, deps in package.get("dev-dependencies", {}).items()})
        for extra, deps in sections.items():
            edges = entry.setdefault(extra, set())
            for dep in deps:
                extras = dep.get("extra", [])
                assert isinstance(extras, list)
                edges.add((normalize(str(dep["name"])), frozenset(normalize(str(e)) for e in extras)))
    return graph


def lock_closure(graph: LockGraph, roots: Iterable[tuple[str, Iterable[str]]]) -> set[str]:
    """Return every distribution that installing ``roots`` (name, extras) pulls in, roots included."""
    seen: set[tuple[str, str | None]] = set()
    stack: list[tuple[str, str | None]] = []
    for name, extras in roots:
        stack.append((normalize(name), None))
        stack.extend((normalize(name), e if e.startswith("@") else normalize(e)) for e in extras)
    while stack:
        key = stack.pop()
        if key in seen:
            continue
        seen.add(key)
        name, extra = key
        for dep, dep_extras in graph.get(name, {}).get(extra, ()):
            stack.append((dep, None))
            stack.extend((dep, e) for e in dep_extras)
    return {name for name, _ in seen}


def expected_absent(
    distribution: str, workspace: Mapping[str, PackageMeta], graph: LockGraph
) -> dict[str, str]:
    """Modules that must NOT be importable after installing ``distribution`` alone (no extras).

    The candidates are every sibling and every third-party distribution that any workspace member
    declares (in ``dependencies`` or an extra); a candidate must be absent unless the lock says that
    installing ``distribution`` pulls it in.

    Returns:
        ``{import name: distribution}`` for each module that must be absent.
    """
    installed = lock_closure(graph, [(distribution, ())])
    candidates: set[str] = set(workspace)
    for meta in workspace.values():
        reqs = list(meta.dependencies) + [r for rs in meta.optional_dependencies.values() for r in rs]
        candidates.update(r.name for r in reqs)
    return {import_name(c): c for c in sorted(candidates - installed)}
