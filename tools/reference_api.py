"""Snapshot the public names of NeMo AutoModel's infrastructure modules, read statically from its sources.

`docs/migrating.md` maps every public name of the reference system's infrastructure modules to ours.
The list of those names must come from the reference itself, not from memory, and CI has no copy of the
reference: this tool reads an installed ``nemo_automodel`` package with `ast` (nothing is imported, so
neither a GPU nor the reference's dependencies are needed) and writes what it finds to
``tools/compat/reference_api.json``, which is committed. `compat_mapping.py` and the compatibility
tests check the mapping against that snapshot.

What counts as public in one module: its ``__all__`` when it declares one; otherwise every top-level
function, class and assignment whose name does not start with ``_`` and that the module defines itself
(imports are not definitions), except a module ``logger``. Private submodules (``_utils.py``) are
skipped. ``_transformers.infrastructure`` also lists
the private functions the documented API names (``reference/infrastructure-api.txt``), and
`OUTSIDE_ALL` adds public classes a module forgot in its ``__all__``.

For each name the snapshot keeps its kind and, for functions and classes, the parameters (a dataclass's
fields, else ``__init__``'s) with their defaults as source text, so a test can compare signatures and
defaults without the reference installed.

Usage (the reference installed into a scratch environment, never into the workspace)::

    python3 -m venv /tmp/nemo-ref && /tmp/nemo-ref/bin/pip install --no-deps nemo-automodel==0.7.0
    python tools/reference_api.py /tmp/nemo-ref/lib/python3.11/site-packages/nemo_automodel
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from pathlib import Path
from typing import Any

__all__ = ["DOCUMENTED_PRIVATE", "OUTSIDE_ALL", "ROOTS", "SNAPSHOT", "module_names", "snapshot"]

SNAPSHOT = Path(__file__).resolve().parent / "compat" / "reference_api.json"

#: The reference's packages and modules that the mapping covers (subpackages included, recursively).
ROOTS = (
    "components.distributed",
    "components.moe",
    "components.quantization",
    "components._peft",
    "components.loss",
    "components.utils.compile_utils",
    "_transformers.infrastructure",
)

#: Private names that the documented API (infrastructure-api.txt) makes part of the contract.
DOCUMENTED_PRIVATE = {
    "_transformers.infrastructure": (
        "_apply_peft_and_lower_precision",
        "_shard_pp",
        "_shard_ep_fsdp",
        "_instantiate_distributed",
        "_instantiate_pipeline",
        "_instantiate_qat",
        "logger",
    ),
}


#: Public names a module leaves out of its ``__all__`` although code written for it imports them.
OUTSIDE_ALL = {
    "components.distributed.parallel_styles": (
        "ColwiseParallelLora",
        "RowwiseParallelLora",
        "SequenceParallelLora",
    ),
}


def _source(node: ast.expr | None) -> str | None:
    return None if node is None else ast.unparse(node)


def _parameters(args: ast.arguments, *, skip_self: bool) -> list[dict[str, Any]]:
    """Name, kind and default source of every parameter, in order."""
    positional = [*args.posonlyargs, *args.args]
    defaults: list[ast.expr | None] = [None] * (len(positional) - len(args.defaults)) + list(args.defaults)
    rows: list[dict[str, Any]] = []
    for arg, default in zip(positional, defaults, strict=True):
        rows.append({"name": arg.arg, "kind": "positional", "default": _source(default)})
    if args.vararg is not None:
        rows.append({"name": args.vararg.arg, "kind": "var_positional", "default": None})
    for arg, kw_default in zip(args.kwonlyargs, args.kw_defaults, strict=True):
        rows.append({"name": arg.arg, "kind": "keyword_only", "default": _source(kw_default)})
    if args.kwarg is not None:
        rows.append({"name": args.kwarg.arg, "kind": "var_keyword", "default": None})
    if skip_self and rows and rows[0]["kind"] == "positional":
        rows = rows[1:]
    return rows


def _is_dataclass(node: ast.ClassDef) -> bool:
    for decorator in node.decorator_list:
        target = decorator.func if isinstance(decorator, ast.Call) else decorator
        if ast.unparse(target).split(".")[-1] == "dataclass":
            return True
    return False


def _field_default(value: ast.expr | None) -> str | None:
    """A dataclass field's default as source text; ``field(default_factory=list)`` reads ``[]``."""
    if isinstance(value, ast.Call) and ast.unparse(value.func).split(".")[-1] == "field":
        for keyword in value.keywords:
            if keyword.arg == "default":
                return _source(keyword.value)
            if keyword.arg == "default_factory":
                if isinstance(keyword.value, ast.Lambda):
                    return ast.unparse(keyword.value.body)
                factory = ast.unparse(keyword.value)
                return {"list": "[]", "dict": "{}", "tuple": "()", "set": "set()"}.get(
                    factory, f"{factory}()"
                )
        return None
    return _source(value)


def _describe(node: ast.stmt) -> dict[str, Any]:
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
        return {"kind": "function", "parameters": _parameters(node.args, skip_self=False)}
    if isinstance(node, ast.ClassDef):
        if _is_dataclass(node):
            fields = [
                {"name": item.target.id, "kind": "field", "default": _field_default(item.value)}
                for item in node.body
                if isinstance(item, ast.AnnAssign)
                and isinstance(item.target, ast.Name)
                and not ast.unparse(item.annotation).startswith(("ClassVar", "typing.ClassVar"))
            ]
            return {"kind": "dataclass", "parameters": fields}
        init = next(
            (i for i in node.body if isinstance(i, ast.FunctionDef) and i.name == "__init__"),
            None,
        )
        parameters = None if init is None else _parameters(init.args, skip_self=True)
        return {"kind": "class", "parameters": parameters}
    return {"kind": "value"}


def module_names(path: Path, module: str) -> dict[str, dict[str, Any]]:
    """The public names of one module file (see the module docstring for the rule)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    defined: dict[str, dict[str, Any]] = {}
    declared: list[str] | None = None
    imported: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.Import | ast.ImportFrom):
            imported.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            defined[node.name] = _describe(node)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if isinstance(target, ast.Name) and target.id == "__all__" and node.value is not None:
                    declared = list(ast.literal_eval(node.value))
                elif isinstance(target, ast.Name):
                    defined.setdefault(target.id, {"kind": "value"})
    if declared is not None:
        names = declared
    else:
        names = [n for n in defined if not n.startswith("_") and n != "logger"]
    names += [n for n in DOCUMENTED_PRIVATE.get(module, ()) + OUTSIDE_ALL.get(module, ()) if n not in names]
    result: dict[str, dict[str, Any]] = {}
    for name in names:  # a name not defined here is re-exported from a sibling (an ``__init__``)
        result[name] = defined.get(name, {"kind": "reexport" if name in imported else "value"})
    return dict(sorted(result.items()))


def snapshot(package: Path) -> dict[str, Any]:
    """Every covered module of the reference package at ``package`` (its ``nemo_automodel`` folder)."""
    version_file = package / "package_info.py"
    version = "unknown"
    if version_file.is_file():
        info = version_file.read_text(encoding="utf-8")
        parts = {}
        for line in info.splitlines():
            key, _, value = line.partition("=")
            if key.strip() in ("MAJOR", "MINOR", "PATCH"):
                parts[key.strip()] = value.strip()
        version = ".".join(parts.get(k, "?") for k in ("MAJOR", "MINOR", "PATCH"))
    modules: dict[str, Any] = {}
    for root in ROOTS:
        base = package / root.replace(".", "/")
        files = [base.with_suffix(".py")] if base.with_suffix(".py").is_file() else sorted(base.rglob("*.py"))
        if not files or not (files[0].is_file()):
            raise SystemExit(f"{root}: not found under {package}")
        for file in files:
            relative = file.relative_to(package).with_suffix("")
            parts_ = list(relative.parts)
            if parts_[-1] == "__init__":
                parts_ = parts_[:-1]
            name = ".".join(parts_)
            if any(part.startswith("_") for part in name[len(root) :].split(".")):
                continue  # a private submodule (``uccl_ep._utils``): not part of anyone's API
            names = module_names(file, name)
            if names:
                modules[name] = names
    return {"distribution": "nemo-automodel", "version": version, "modules": modules}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("package", type=Path, help="the installed reference's nemo_automodel folder")
    parser.add_argument("--output", type=Path, default=SNAPSHOT)
    args = parser.parse_args(argv)
    data = snapshot(args.package.resolve())
    args.output.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    count = sum(len(names) for names in data["modules"].values())
    print(f"{args.output}: {len(data['modules'])} modules, {count} names (nemo-automodel {data['version']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
