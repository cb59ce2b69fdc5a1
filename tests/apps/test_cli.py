"""The ``jflashloop`` command line."""

from __future__ import annotations

import pytest

from jflashloop.apps import cli


def test_codecs_command_prints_every_format(capsys):
    assert cli.main(["codecs", "--tokens", "128", "--kv-heads", "2", "--head-dim", "64"]) == 0
    out = capsys.readouterr().out
    for name in ("INT4 per-channel G64", "INT4 per-token G64", "NVFP4"):
        assert name in out


@pytest.mark.parametrize("command", ["eval", "loops", "demo"])
def test_subcommands_document_their_options(command, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main([command, "--help"])
    assert exit_info.value.code == 0
    assert "usage:" in capsys.readouterr().out


def test_unknown_command_is_an_error():
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["train-everything"])
    assert exit_info.value.code == 2
