"""Pallas-Triton GPU kernels of jflashloop (installed as ``jflashloop_pallas_kernels``).

Every kernel also runs on CPU with ``interpret=True``, which is how the tests
check kernel logic without a GPU.
"""

from .exact_division import divide_correctly_rounded, divide_rn

__all__ = ["divide_correctly_rounded", "divide_rn"]
