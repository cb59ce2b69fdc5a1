"""Shared test fixtures: fresh random inputs each run, with the seed reported."""

from __future__ import annotations

import os
import secrets

import numpy as np
import pytest
from hypothesis import HealthCheck, settings

# Property-based tests: "ci" (the default) keeps every property module fast on
# 2 cores; HYPOTHESIS_PROFILE=long runs many more examples. Examples are
# generated freshly each run unless HYPOTHESIS_SEED pins them (--hypothesis-seed).
_SLOW_EXAMPLES = [HealthCheck.too_slow, HealthCheck.data_too_large]
settings.register_profile(
    "ci", max_examples=25, deadline=None, suppress_health_check=_SLOW_EXAMPLES, print_blob=True
)
settings.register_profile(
    "long", max_examples=1000, deadline=None, suppress_health_check=_SLOW_EXAMPLES, print_blob=True
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture
def rng(request):
    """A numpy Generator seeded freshly each run (or from JFLASHLOOP_TEST_SEED).

    The seed is printed, so a failing test shows it in its captured output.
    """
    seed = int(os.environ.get("JFLASHLOOP_TEST_SEED", secrets.randbits(32)))
    print(f"{request.node.nodeid}: JFLASHLOOP_TEST_SEED={seed}")
    return np.random.default_rng(seed)


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_code():
    """Drop jax's compiled executables after each test module.

    Every executable XLA compiles for the CPU keeps memory mappings of its
    code; a test process that compiles a few thousand of them passes the
    kernel's limit of mappings per process (``vm.max_map_count``, 65530 by
    default), and the next compilation crashes. Clearing the caches per
    module keeps each worker far below it (at the cost of compiling a shared
    function again in the next module).
    """
    yield
    import jax

    jax.clear_caches()
