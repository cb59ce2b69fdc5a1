"""The ``jflashloop`` command line."""

from __future__ import annotations

import importlib
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from jflashloop.apps import cli

REPOSITORY_ROOT = Path(__file__).resolve().parents[2]


def test_codecs_command_prints_every_format(capsys):
    assert cli.main(["codecs", "--tokens", "128", "--kv-heads", "2", "--head-dim", "64"]) == 0
    out = capsys.readouterr().out
    for name in ("INT4 per-channel G64", "INT4 per-token G64", "NVFP4"):
        assert name in out


@pytest.mark.parametrize("command", ["eval", "allocate", "loops", "demo"])
def test_subcommands_document_their_options(command, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main([command, "--help"])
    assert exit_info.value.code == 0
    assert "usage:" in capsys.readouterr().out


def test_unknown_command_is_an_error():
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["train-everything"])
    assert exit_info.value.code == 2


def _run(*arguments: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *arguments], capture_output=True, text=True, timeout=300,
                          cwd=REPOSITORY_ROOT, check=False)


def test_python_dash_m_jflashloop_is_the_console_script(capsys):
    codecs = ["codecs", "--tokens", "128", "--kv-heads", "2", "--head-dim", "64"]
    ran = _run("-m", "jflashloop", *codecs)
    assert ran.returncode == 0, ran.stderr
    assert cli.main(codecs) == 0
    expected = capsys.readouterr().out
    # The same table: every row's fields but the timing column (whose width varies with the time).
    assert [line.split()[:-1] for line in ran.stdout.splitlines()] == [
        line.split()[:-1] for line in expected.splitlines()]
    helped = _run("-m", "jflashloop", "--help")
    assert helped.returncode == 0 and helped.stdout.startswith("usage: jflashloop ")
    for command in ("demo", "codecs", "eval", "allocate", "loops"):
        assert command in helped.stdout


def test_the_console_script_is_the_cli():
    scripts = tomllib.loads((REPOSITORY_ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    module, function = scripts["jflashloop"].split(":")
    assert getattr(importlib.import_module(module), function) is cli.main
