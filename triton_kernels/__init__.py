"""Triton and Gluon kernels of jflashloop, called from JAX (installed as ``jflashloop_triton_kernels``)."""
