"""Sharded cache and attention on 8 simulated CPU devices (the cache and attention on meshes 8x1 and 2x4,
codecs on 4x2, forks on 2x4).

The checks run in a subprocess so that the device count flag does not affect
the other test modules (which keep one device).
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import jax
import pytest


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="simulated devices are a CPU feature")
def test_sharded_cache_on_eight_simulated_devices():
    script = pathlib.Path(__file__).with_name("sharding_checks.py")
    environment = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=environment,
                            timeout=900)
    print(result.stdout[-4000:])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "all sharding checks passed" in result.stdout
