"""The layer rules, checked on every import of every module (module level and inside functions).

1. The oracle and kernel packages (``reference/``, ``pallas_kernels/``,
   ``triton_kernels/``) import nothing from ``jflashloop``.
2. The library (every module of ``jflashloop/`` except ``jflashloop/apps/``,
   ``jflashloop/models/``, the entry point ``jflashloop/__main__.py`` and the
   deprecated paths of application modules in :data:`APPLICATION_SHIMS`)
   imports neither ``jflashloop.apps`` nor ``jflashloop.models``.
3. The models (``jflashloop/models/``) do not import ``jflashloop.apps``.

An import is an ``import`` or ``from ... import`` statement anywhere in a
module (relative imports resolved), or a call of ``importlib.import_module``
or ``__import__`` with a literal module name. The rules hold for any layout
of the library's own subpackages: every module below ``jflashloop/`` outside
the applications and the models is a library module.
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

REPOSITORY_ROOT = Path(__file__).resolve().parents[1]
# Folder -> the name it installs as (pyproject.toml [tool.setuptools.package-dir]).
PACKAGES = {
    "jflashloop": "jflashloop",
    "reference": "jflashloop_reference",
    "pallas_kernels": "jflashloop_pallas_kernels",
    "triton_kernels": "jflashloop_triton_kernels",
}
ORACLE_AND_KERNEL_FOLDERS = ("reference", "pallas_kernels", "triton_kernels")
APPLICATIONS, MODELS = "jflashloop.apps", "jflashloop.models"
ENTRY_POINT = "jflashloop.__main__"
# Old paths of moved application and model modules, kept for one release: each
# only re-exports names of its new module and warns.
APPLICATION_SHIMS = frozenset({
    "jflashloop.calibration", "jflashloop.cli", "jflashloop.demo", "jflashloop.evaluation",
    "jflashloop.generation", "jflashloop.loops_report", "jflashloop.quality",
})


@dataclasses.dataclass(frozen=True)
class Import:
    module: str  # the importing module, by its installed name
    path: Path
    line: int
    target: str  # a module (or a name of a module) it imports

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.module} imports {self.target}"


def module_name(path: Path, root: Path) -> str:
    """The installed name of the module at ``path`` (below ``root``)."""
    folder, *rest = path.relative_to(root).with_suffix("").parts
    parts = [PACKAGES[folder], *rest]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_package(path: Path) -> bool:
    return path.name == "__init__.py"


def _literal_import_call(node: ast.Call) -> str | None:
    """The module name of ``importlib.import_module("x")`` or ``__import__("x")``."""
    function = node.func
    name = function.attr if isinstance(function, ast.Attribute) else getattr(function, "id", None)
    if name not in ("import_module", "__import__") or not node.args:
        return None
    first = node.args[0]
    return first.value if isinstance(first, ast.Constant) and isinstance(first.value, str) else None


def imports_of(path: Path, root: Path) -> list[Import]:
    """Every import in the module at ``path``: ``from a import b`` gives ``a`` and ``a.b``."""
    module = module_name(path, root)
    package = module if _is_package(path) else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        targets = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, *([node.module] if node.module else [])])
            else:
                base = node.module
            targets = [base, *(f"{base}.{alias.name}" for alias in node.names)]
        elif isinstance(node, ast.Call) and (literal := _literal_import_call(node)):
            targets = [literal]
        found += [Import(module, path, node.lineno, target) for target in targets]
    return found


def _within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def _modules(root: Path, folder: str) -> list[Path]:
    return sorted(path for path in (root / folder).rglob("*.py") if "__pycache__" not in path.parts)


def oracle_and_kernel_violations(root: Path) -> list[Import]:
    """Rule 1: imports of ``jflashloop`` from the oracle and kernel packages."""
    return [found for folder in ORACLE_AND_KERNEL_FOLDERS if (root / folder).is_dir()
            for path in _modules(root, folder) for found in imports_of(path, root)
            if _within(found.target, "jflashloop")]


def library_violations(root: Path) -> list[Import]:
    """Rule 2: imports of the applications or the models from library modules."""
    violations = []
    for path in _modules(root, "jflashloop"):
        module = module_name(path, root)
        if (_within(module, APPLICATIONS) or _within(module, MODELS) or module == ENTRY_POINT
                or module in APPLICATION_SHIMS):
            continue
        violations += [found for found in imports_of(path, root)
                       if _within(found.target, APPLICATIONS) or _within(found.target, MODELS)]
    return violations


def model_violations(root: Path) -> list[Import]:
    """Rule 3: imports of the applications from the models."""
    models = root / "jflashloop" / "models"
    return [found for path in (_modules(root, "jflashloop/models") if models.is_dir() else [])
            for found in imports_of(path, root) if _within(found.target, APPLICATIONS)]


RULES = {
    "oracles and kernels import nothing from jflashloop": oracle_and_kernel_violations,
    "the library imports neither the applications nor the models": library_violations,
    "the models do not import the applications": model_violations,
}


@pytest.mark.parametrize("rule", list(RULES))
def test_layer_rule(rule):
    violations = RULES[rule](REPOSITORY_ROOT)
    assert not violations, "\n".join(map(str, violations))


def test_the_rules_see_every_layer():
    """The scan reads each layer (a rule over no files would pass vacuously)."""
    library = [path for path in _modules(REPOSITORY_ROOT, "jflashloop")
               if not _within(module_name(path, REPOSITORY_ROOT), APPLICATIONS)
               and not _within(module_name(path, REPOSITORY_ROOT), MODELS)]
    assert len(library) >= 10
    assert _modules(REPOSITORY_ROOT, "jflashloop/apps") and _modules(REPOSITORY_ROOT, "jflashloop/models")
    for folder in ORACLE_AND_KERNEL_FOLDERS:
        assert _modules(REPOSITORY_ROOT, folder), folder
    # The applications do import the library and the models: the scan finds those edges.
    app_imports = [found.target for path in _modules(REPOSITORY_ROOT, "jflashloop/apps")
                   for found in imports_of(path, REPOSITORY_ROOT)]
    assert any(_within(target, MODELS) for target in app_imports)
    assert any(_within(target, "jflashloop") and not _within(target, APPLICATIONS)
               and not _within(target, MODELS) for target in app_imports)


def test_application_shims_only_re_export():
    """The exempt old paths hold no code of their own: imports, a warning, ``__main__``."""
    for module in sorted(APPLICATION_SHIMS):
        path = REPOSITORY_ROOT / (module.replace(".", "/") + ".py")
        if not path.exists():  # removed after its release
            continue
        tree = ast.parse(path.read_text())
        for node in tree.body:
            assert isinstance(node, ast.Import | ast.ImportFrom | ast.Expr | ast.Assign | ast.If), (
                f"{path}:{node.lineno}: {type(node).__name__} in a deprecated path")
            if isinstance(node, ast.If):
                assert ast.unparse(node.test) == "__name__ == '__main__'", f"{path}:{node.lineno}"
        assert "warn_moved(__name__" in path.read_text(), path


def _write(root: Path, relative: str, text: str = "") -> None:
    path = root / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_each_rule_catches_a_broken_import(tmp_path):
    """A tree that breaks every rule, at module level, inside a function and through importlib."""
    _write(tmp_path, "jflashloop/__init__.py", "from . import codecs\n")
    _write(tmp_path, "jflashloop/codecs.py", "def encode():\n    from .apps import demo\n")
    _write(tmp_path, "jflashloop/cache/__init__.py")
    _write(tmp_path, "jflashloop/cache/state.py", "from .. import models\nfrom ..codecs import encode\n")
    _write(tmp_path, "jflashloop/cache/pages.py",
           "import importlib\nhooks = importlib.import_module('jflashloop.models.cache_hooks')\n")
    _write(tmp_path, "jflashloop/quality.py", "from .apps.quality import kv_errors\n")  # a shim
    _write(tmp_path, "jflashloop/__main__.py", "from .apps.cli import main\n")
    _write(tmp_path, "jflashloop/apps/__init__.py")
    _write(tmp_path, "jflashloop/apps/demo.py", "from ..models import llama\nfrom .. import codecs\n")
    _write(tmp_path, "jflashloop/models/__init__.py")
    _write(tmp_path, "jflashloop/models/llama.py", "def run():\n    import jflashloop.apps.demo\n")
    _write(tmp_path, "reference/__init__.py", "from . import int4\n")
    _write(tmp_path, "reference/int4.py", "import numpy\n")
    _write(tmp_path, "pallas_kernels/quantize.py",
           "import jflashloop_reference\n\ndef f():\n    from jflashloop.codecs import encode\n")
    _write(tmp_path, "triton_kernels/call.py", "__import__('jflashloop')\n")

    def found(rule):
        return sorted((str(item.path.relative_to(tmp_path)), item.line, item.target)
                      for item in RULES[rule](tmp_path))

    oracle, library, models = list(RULES)
    assert found(oracle) == [
        ("pallas_kernels/quantize.py", 4, "jflashloop.codecs"),
        ("pallas_kernels/quantize.py", 4, "jflashloop.codecs.encode"),
        ("triton_kernels/call.py", 1, "jflashloop"),
    ]
    assert found(library) == [
        ("jflashloop/cache/pages.py", 2, "jflashloop.models.cache_hooks"),
        ("jflashloop/cache/state.py", 1, "jflashloop.models"),
        ("jflashloop/codecs.py", 2, "jflashloop.apps"),
        ("jflashloop/codecs.py", 2, "jflashloop.apps.demo"),
    ]
    assert found(models) == [("jflashloop/models/llama.py", 2, "jflashloop.apps.demo")]
