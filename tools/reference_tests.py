"""Run NeMo AutoModel's own unit tests of its public API against automodel, through name aliasing only.

This is how `docs/migrating.md`'s promise ("code written for NeMo AutoModel runs on ours") is measured.
The reference's tests import ``nemo_automodel.<module>``; here every such import is answered by an alias
module built from `tools/compat/mapping.toml`: each name resolves to the automodel object the mapping
names (or, for a module mapped as a whole, to the same name in our module). No logic is added: a name
the mapping does not provide resolves to a placeholder that raises when the test uses it.

Which tests count as *public-API tests*: the test functions of `TEST_FILES` that use only public names
of the reference's mapped modules. A test is left out, with its reason printed by ``--explain``, when it
uses a private name (``_module_filter_fn``), patches or monkeypatches a reference module's internals
(a string naming ``nemo_automodel``), uses a reference module outside the snapshot of public modules
(``tools/compat/reference_api.json``), or needs CUDA. The rule is applied to the test sources with
`ast` and does not depend on the mapping, so two mappings (or two versions of automodel) are measured on
the same tests.

The reference's tests are not in its wheel or sdist; they are in its repository
(github.com/NVIDIA-NeMo/Automodel, ``tests/unit_tests``). Nothing here downloads them::

    python tools/reference_tests.py --reference-repo /path/to/Automodel [--explain] [--mapping FILE]

Prints one line per test (pass / fail and the first line of the failure) and the totals.
Not part of any nox session: it needs the reference's repository, which CI does not have.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from xml.etree import ElementTree

sys.path.insert(0, str(Path(__file__).resolve().parent))

from compat_mapping import MAPPING, load_mapping, load_snapshot

__all__ = ["TEST_FILES", "select_tests"]

#: The reference's unit-test files for the modules docs/migrating.md maps (paths under tests/unit_tests).
TEST_FILES = (
    "distributed/test_mesh.py",
    "distributed/pipelining/test_pipeline_config.py",
    "distributed/pipelining/test_autopipeline.py",
    "distributed/test_activation_checkpointing.py",
    "distributed/test_parallel_styles.py",
    "distributed/test_get_parallel_plan.py",
    "quantization/test_fp8.py",
    "quantization/test_qat.py",
    "utils/test_compile_utils.py",
    "_peft/test_lora.py",
    "loss/test_masked_ce.py",
)

_PLUGIN = '''
"""pytest plugin: answer ``import nemo_automodel...`` with alias modules (written by reference_tests.py)."""
import importlib, importlib.abc, importlib.machinery, json, os, sys, types

_MAP = json.loads(open(os.environ["AUTOMODEL_ALIAS_MAP"], encoding="utf-8").read())

# Test-environment helpers of the reference (not API): what they answer on a machine without
# Transformer Engine, so that a test file that asks at import time can be collected.
_SHIMS = {"shared.import_utils": {"safe_import_te": lambda: (False, None)}}


class _Missing:
    """A reference name automodel does not provide: any use raises."""

    def __init__(self, where):
        self._where = where

    def _fail(self, *args, **kwargs):
        raise NotImplementedError(f"{self._where}: not provided by automodel (tools/compat/mapping.toml)")

    __call__ = _fail

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        self._fail()


def _resolve(target):
    module, _, attr = target.rpartition(".")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError):
        return importlib.import_module(target)


class _AliasModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        short = self.__name__[len("nemo_automodel.") :]
        if f"{short}.{name}".lstrip(".") in _MAP or f"{short}.{name}".lstrip(".") in _SHIMS:
            return importlib.import_module(f"{self.__name__}.{name}")
        if short in _SHIMS:
            return _SHIMS[short][name]
        entry = _MAP.get(short, {})
        target = entry.get("names", {}).get(name)
        if target is not None:
            return _resolve(target)
        ours = entry.get("ours")
        if ours is not None:
            try:
                return getattr(importlib.import_module(ours), name)
            except AttributeError:
                pass
        return _Missing(f"{self.__name__}.{name}")


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname == "nemo_automodel" or fullname.startswith("nemo_automodel."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _AliasModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        return None


sys.meta_path.insert(0, _Finder())
'''


def _imports(tree: ast.Module, covered: set[str]) -> tuple[dict[str, tuple[str, str]], dict[str, str]]:
    names: dict[str, tuple[str, str]] = {}
    modules: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("nemo_automodel"):
            for alias in node.names:
                names[alias.asname or alias.name] = (node.module, alias.name)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("nemo_automodel"):
                    modules[alias.asname or alias.name.split(".")[0]] = alias.name
    for local, (module, name) in list(names.items()):  # ``from package import submodule as x``
        if f"{module}.{name}".removeprefix("nemo_automodel.") in covered:
            del names[local]
            modules[local] = f"{module}.{name}"
    return names, modules


def _reasons(
    function: ast.FunctionDef | ast.AsyncFunctionDef,
    source: str,
    names: dict[str, tuple[str, str]],
    modules: dict[str, str],
    covered: set[str],
    decorators: list[ast.expr],
) -> list[str]:
    """Why a test is not a public-API test (empty: it is one)."""
    reasons: set[str] = set()
    for node in ast.walk(function):
        if isinstance(node, ast.Name) and node.id in names:
            module, name = names[node.id]
            if name.startswith("_"):
                reasons.add(f"uses the private {name}")
            if module.removeprefix("nemo_automodel.") not in covered:
                reasons.add(f"uses {module}, outside the public modules of the snapshot")
        elif (
            isinstance(node, ast.Constant) and isinstance(node.value, str) and "nemo_automodel" in node.value
        ):
            reasons.add("patches reference internals")
        elif isinstance(node, ast.Import | ast.ImportFrom):
            module_name = node.module if isinstance(node, ast.ImportFrom) else node.names[0].name
            if module_name and module_name.startswith("nemo_automodel"):
                reasons.add("imports a reference module inside the test (to patch it)")
        elif (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and (node.value.id in modules or node.value.id in names)
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
        ):
            reasons.add(f"uses the private {node.attr}")
    text = "\n".join(ast.get_source_segment(source, d) or "" for d in decorators)
    text += ast.get_source_segment(source, function) or ""
    if "nemo_automodel" in text and "patch" in text:
        reasons.add("patches reference internals")
    if "cuda" in text.lower() and ("skipif" in text or ".cuda(" in text or 'device("cuda' in text):
        reasons.add("needs CUDA")
    return sorted(reasons)


def select_tests(test_root: Path, covered: set[str]) -> tuple[list[str], dict[str, list[str]]]:
    """Node ids of the public-API tests under ``test_root`` and, for the others, why they are left out."""
    selected: list[str] = []
    left_out: dict[str, list[str]] = {}
    for relative in TEST_FILES:
        path = test_root / relative
        source = path.read_text(encoding="utf-8")
        tree = ast.parse(source)
        names, modules = _imports(tree, covered)
        candidates: list[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef, list[ast.expr]]] = []
        for node in tree.body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name.startswith("test"):
                candidates.append((node.name, node, list(node.decorator_list)))
            elif isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
                for item in node.body:
                    if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef) and item.name.startswith(
                        "test"
                    ):
                        decorators = [*node.decorator_list, *item.decorator_list]
                        candidates.append((f"{node.name}::{item.name}", item, decorators))
        for name, function, decorators in candidates:
            node_id = f"{relative}::{name}"
            why = _reasons(function, source, names, modules, covered, decorators)
            if why:
                left_out[node_id] = why
            else:
                selected.append(node_id)
    return selected, left_out


def _alias_map(mapping_file: Path) -> dict[str, dict[str, object]]:
    """{reference module: {"ours": module or None, "names": {name: dotted target}}} for the plugin."""
    mapping = load_mapping(mapping_file)
    result: dict[str, dict[str, object]] = {}
    for module, entry in mapping.modules.items():
        targets = {name: row.target for name, row in entry.names.items() if row.target is not None}
        result[module] = {"ours": entry.ours, "names": targets}
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--reference-repo", type=Path, required=True, help="a checkout of NVIDIA-NeMo/Automodel"
    )
    parser.add_argument("--mapping", type=Path, default=MAPPING)
    parser.add_argument("--explain", action="store_true", help="also list the tests left out, and why")
    args = parser.parse_args(argv)
    test_root = args.reference_repo.resolve() / "tests" / "unit_tests"
    alias = _alias_map(args.mapping)
    selected, left_out = select_tests(test_root, set(load_snapshot()["modules"]))
    if args.explain:
        for node_id, why in sorted(left_out.items()):
            print(f"left out  {node_id}: {'; '.join(why)}")
    work = Path(tempfile.mkdtemp(prefix="automodel-reference-tests-"))
    try:
        for relative in TEST_FILES:  # copied without the reference's conftest.py and sources
            (work / relative).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(test_root / relative, work / relative)
        (work / "automodel_reference_alias.py").write_text(_PLUGIN, encoding="utf-8")
        (work / "alias.json").write_text(json.dumps(alias), encoding="utf-8")
        junit = work / "junit.xml"
        env = {
            **os.environ,
            "AUTOMODEL_ALIAS_MAP": str(work / "alias.json"),
            "PYTHONPATH": os.pathsep.join([str(work), os.environ.get("PYTHONPATH", "")]),
        }
        command = [
            sys.executable, "-m", "pytest", "-p", "automodel_reference_alias", "-q", "-p", "no:cacheprovider",
            "--rootdir", str(work), "-o", "addopts=", "--continue-on-collection-errors",
            f"--junit-xml={junit}", *selected,
        ]  # fmt: skip
        subprocess.run(command, cwd=work, env=env, capture_output=True, text=True, check=False)
        cases = list(ElementTree.parse(junit).getroot().iter("testcase"))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    passed = failed = skipped = 0
    for case in cases:
        node = f"{case.get('classname', '').replace('.', '/')}::{case.get('name')}"
        problem = case.find("failure")
        if problem is None:
            problem = case.find("error")
        if case.find("skipped") is not None:
            skipped += 1
            print(f"skipped   {node}")
        elif problem is not None:
            failed += 1
            first = (problem.get("message") or "").strip().splitlines()
            print(f"FAILED    {node}: {first[0][:160] if first else ''}")
        else:
            passed += 1
            print(f"passed    {node}")
    print(
        f"\n{len(selected)} public-API test functions selected from {len(TEST_FILES)} reference files "
        f"({len(left_out)} left out); {len(cases)} test cases: {passed} passed, {failed} failed, "
        f"{skipped} skipped"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
