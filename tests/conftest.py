"""Shared test fixtures: fresh random inputs each run, with the seed reported."""

from __future__ import annotations

import os
import secrets

import numpy as np
import pytest


@pytest.fixture
def rng(request):
    """A numpy Generator seeded freshly each run (or from JFLASHLOOP_TEST_SEED).

    The seed is printed, so a failing test shows it in its captured output.
    """
    seed = int(os.environ.get("JFLASHLOOP_TEST_SEED", secrets.randbits(32)))
    print(f"{request.node.nodeid}: JFLASHLOOP_TEST_SEED={seed}")
    return np.random.default_rng(seed)
