"""Which 4.5-bit code would cut SmolLM2's attention error? (bench/QUALITY.md, "Codes at 4.5 bits")

An offline probe (numpy, no cache) of three levers the per-layer allocation cannot reach with today's codecs:

* **keys before RoPE**: each key group quantized before its rotary rotation and rotated after decoding (the
  rotation mixes channel pairs at a frequency that varies with position, so a channel's values over a
  64-token group spread; before it they keep each channel's own offset and range);
* **non-uniform levels**: the 16 NormalFloat levels (QLoRA's NF4, denser near the centre) in place of 16
  evenly spaced ones, either on a group's [min, max] (the affine metadata, 4.5 bits at groups of 64) or on
  ``[-absmax, absmax]`` (one scale, 4.5 bits at groups of 32);
* **8-bit metadata**: the affine code at groups of 32 with a byte for the scale (a log grid of 16 steps an octave,
  from 16x the largest step of its tile down: a tile is a layer and KV head for keys, a layer and token for values)
  and a byte for an integer zero point: 4.5 bits, as INT4 G64's float16 scale and minimum over twice the values.

A second table measures two codes fitted on the calibration text (statistics only, no gradient) and reported on
both texts:

* **key channel widths**: per (layer, KV head) each key channel gets its own code width (2-6 bits, the same
  affine rule and float16 metadata per channel over 64 tokens), chosen to minimize the summed score error
  ``sum_c E[q_c^2] E[range_c^2] / (2^b_c - 1)^2`` (``q`` the model's queries of the head's GQA group, ``range``
  the channel's span over a 64-token group) under a mean width per head (4: INT4's bytes; less: fewer bytes):
  :func:`jflashloop.fitting.key_channel_weights` and :func:`~jflashloop.fitting.fit_key_widths`;
* **value channel scales**: each value channel divided by ``(rms_c / g) ** 0.75`` (its RMS over the calibration
  text's tokens after the sinks, per layer and KV head, ``g`` the head's geometric mean; 9 significant bits:
  :func:`jflashloop.fitting.fit_value_scales`) before INT4 per token and multiplied back after decoding (the
  exponent: the best of 0.25, 0.5, 0.75 and 1 on the calibration text), so one large channel no longer sets every
  token's step. Exact in the attention output's algebra: ``sum_t p_t (s * v_t) = s * sum_t p_t v_t``.

Every code here quantizes K per channel over 64 tokens (32 for the absmax and 8-bit-metadata codes) and V per
token over 64 (32) channels, with float16 metadata (but the 8-bit code), sink tokens 4 and a recent window of 64 tokens exact (the library's default
windows); the uniform affine row is the library's INT4 G64 rule, and its library reconstruction is printed
beside it as a check. Attention-output error as ``bench/token_rows_probe.py`` and ``jflashloop.apps.quality``:
float64, the model's own queries at the last 32 of 512 positions, mean over query heads, then the mean and the
worst of the 30 layers, on the allocation study's calibration and held-out texts.

Usage: ``python bench/codec_probe.py`` (about a minute on 2 CPU cores).
"""

from __future__ import annotations

import numpy as np
from token_rows_probe import attention_errors, reconstructed

from jflashloop import Policy, fitting
from jflashloop.codecs import INT4_KEYS, INT4_VALUES
from jflashloop.models import gguf_loader, llama

TOKENS, SINKS, RECENT = 512, 4, 64
WIDTHS = (2, 3, 4, 5, 6)  # key channel widths the fitted code may choose
NF4 = np.array([-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
                -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
                0.24611230194568634, 0.33791524171829224, 0.44070982098579407, 0.5626170039176941,
                0.7229568362236023, 1.0])
UNIFORM = np.linspace(-1.0, 1.0, 16)


def nearest(x: np.ndarray, levels: np.ndarray) -> np.ndarray:
    """Each element of ``x`` (in [-1, 1]) replaced by the nearest of ``levels`` (sorted)."""
    cut = (levels[1:] + levels[:-1]) / 2
    return levels[np.searchsorted(cut, x)]


def grouped(x: np.ndarray, axis: int, size: int, code) -> np.ndarray:
    """``code`` applied to groups of ``size`` along ``axis`` of ``x`` ``[layers, T, heads, D]`` (T and D
    multiples of ``size``); ``code`` takes and returns ``[..., size]``."""
    moved = np.moveaxis(x, axis, -1)
    shape = moved.shape
    out = code(moved.reshape(*shape[:-1], shape[-1] // size, size))
    return np.moveaxis(out.reshape(shape), -1, axis)


def affine(levels):
    """A group's [min, max] (float16) mapped onto ``levels`` in [-1, 1]."""
    def code(g):
        low = g.min(-1, keepdims=True).astype(np.float16).astype(np.float32)
        high = g.max(-1, keepdims=True).astype(np.float16).astype(np.float32)
        half = np.maximum((high - low) / 2, 1e-30)
        return low + (nearest(np.clip((g - low) / half - 1, -1, 1), levels) + 1) * half
    return code


HEADROOM = 4  # octaves of the scale grid above a tile's largest step (byte_metadata)


def byte_metadata(tile_axes: tuple[int, int], steps: float = 16.0, levels: int = 15):
    """The affine code with 8-bit metadata: ``(q - z) * s`` for codes ``q`` in 0..``levels``, ``s`` the tile's
    largest step (over ``tile_axes`` of the grouped array) times ``2 ** (HEADROOM - k / steps)`` for a byte ``k``,
    ``z`` an int8 zero point; each group takes the smallest ``s`` on the grid whose levels cover its [min, max]."""
    def code(g):
        low = g.min(-1, keepdims=True).astype(np.float64)
        high = g.max(-1, keepdims=True).astype(np.float64)
        need = np.maximum(high - low, 1e-30) / levels
        top = need.max(axis=tile_axes, keepdims=True) * 2.0 ** HEADROOM  # zero points past int8 take larger steps
        k = np.floor(-np.log2(need / top) * steps + 1e-9).clip(0, 255)
        for _ in range(256):
            s = top * 2.0 ** (-k / steps)
            z = np.clip(np.ceil(-low / s), -128, 127)
            covered = (-z * s <= low) & ((levels - z) * s >= high)
            if covered.all():
                break
            k = np.where(covered, k, np.maximum(k - 1, 0))
        assert covered.all(), "no step on the grid covers a group"
        return ((np.clip(np.rint(g / s + z), 0, levels) - z) * s).astype(np.float32)
    return code


def absmax(levels):
    """``[-absmax, absmax]`` (float16) of a group mapped onto ``levels``."""
    def code(g):
        scale = np.maximum(np.abs(g).max(-1, keepdims=True).astype(np.float16).astype(np.float32), 1e-30)
        return nearest(g / scale, levels) * scale
    return code


def rope(x: np.ndarray, sign: float, theta: float) -> np.ndarray:
    """``x`` ``[layers, T, heads, D]`` rotated by its positions' rotary angles (``sign`` -1: undone)."""
    cos, sin = (np.asarray(a, np.float64) for a in llama.rope_cos_sin(np.arange(x.shape[1]), x.shape[-1], theta))
    first, second = np.split(x, 2, axis=-1)
    rotated = np.concatenate([-second, first], axis=-1)
    return (x * cos[None, :, None] + sign * rotated * sin[None, :, None]).astype(np.float32)


def with_windows(exact: np.ndarray, approx: np.ndarray) -> np.ndarray:
    out = approx.copy()
    out[:, :SINKS] = exact[:, :SINKS]
    out[:, -RECENT:] = exact[:, -RECENT:]
    return out


def variants(keys, values, theta):
    """``(label, bits per element of the pages, keys_hat, values_hat)``."""
    pre = rope(keys, -1.0, theta)  # the keys before their rotation
    out = []
    for label, bits, group, code in (("uniform, affine G64 (INT4 G64)", 4.5, 64, affine(UNIFORM)),
                                     ("NF levels, affine G64", 4.5, 64, affine(NF4)),
                                     ("NF4, absmax G32", 4.5, 32, absmax(NF4)),
                                     ("uniform, affine G32 (INT4 G32)", 5.0, 32, affine(UNIFORM)),
                                     ("uniform, affine G32, 8-bit metadata", 4.5, 32, byte_metadata((-3, -2)))):
        values_hat = grouped(values, 3, group, code)
        out.append((label, bits, grouped(keys, 1, group, code), values_hat))
        out.append((label + ", keys before RoPE", bits, rope(grouped(pre, 1, group, code), 1.0, theta), values_hat))
    return [(label, bits, with_windows(keys, k), with_windows(values, v)) for label, bits, k, v in out]


def with_key_widths(keys: np.ndarray, widths: np.ndarray) -> np.ndarray:
    """``keys`` ``[layers, T, kv_heads, D]`` coded per channel over 64 tokens, channel ``c`` of a layer and head
    at ``widths[layer, head, c]`` bits (the affine rule with ``2^b`` uniform levels)."""
    out = np.empty_like(keys)
    for width in np.unique(widths):
        coded = grouped(keys, 1, 64, affine(np.linspace(-1.0, 1.0, 2 ** width)))
        out = np.where((widths == width)[:, None], coded, out)
    return out


def calibrated_variants(calibration, keys, values):
    """``(label, bits per element of the pages, keys_hat, values_hat)`` of the codes fitted on ``calibration``
    (the calibration text's ``(keys, values, queries)``)."""
    keys_c, values_c, queries_c = calibration
    weights = np.stack([fitting.key_channel_weights(k, q, sink_tokens=SINKS) for k, q in zip(keys_c, queries_c,
                                                                                             strict=True)])
    scale = np.stack([fitting.fit_value_scales(v, sink_tokens=SINKS) for v in values_c])[:, None]
    values_int4 = grouped(values, 3, 64, affine(UNIFORM))
    values_scaled = (grouped(values / scale, 3, 64, affine(UNIFORM)) * scale).astype(np.float32)
    out = [("INT4 G64 (the reference row)", 4.5, grouped(keys, 1, 64, affine(UNIFORM)), values_int4),
           ("value channel scales", 4.5, grouped(keys, 1, 64, affine(UNIFORM)), values_scaled)]
    for mean in (4.0, 3.5, 3.25, 3.0):
        keys_hat = with_key_widths(keys, fitting.fit_key_widths(weights, mean, widths=WIDTHS))
        bits = (mean + 0.5 + 4.5) / 2
        if mean == 4.0:
            out.append((f"key channel widths (mean {mean})", bits, keys_hat, values_int4))
        out.append((f"key channel widths (mean {mean}) + value channel scales", bits, keys_hat, values_scaled))
    return [(label, bits, with_windows(keys, k), with_windows(values, v)) for label, bits, k, v in out]


def main() -> None:
    params, config, tokenizer = gguf_loader.load_smollm2()
    library = Policy("INT4 G64", INT4_KEYS, INT4_VALUES, SINKS, RECENT)
    texts = {}
    for name in ("calibration_text.txt", "eval_text.txt"):
        ids = tokenizer.encode(gguf_loader.read_data_text(name)).ids[:TOKENS]
        texts[name] = [np.asarray(x, np.float32) for x in llama.prefill(params, config, np.asarray(ids, np.int32))[1:]]
    header = ("| text | code (K per channel over tokens, V per token over channels) | bits/elem (pages) "
              "| mean attn-out err | worst layer |\n|---|---|---|---|---|")
    print(header)
    for name, (keys, values, queries) in texts.items():
        rows = [("the library's INT4 G64 (check)", 4.5, *reconstructed(library, keys, values))]
        for label, bits, k_hat, v_hat in rows + variants(keys, values, config.rope_theta):
            errors = attention_errors(queries, keys, values, k_hat, v_hat)
            print(f"| {name} | {label} | {bits} | {errors.mean():.4f} | {errors.max():.4f} |", flush=True)
    print("\nFitted on calibration_text.txt:\n" + header)
    for name, (keys, values, queries) in texts.items():
        for label, bits, k_hat, v_hat in calibrated_variants(texts["calibration_text.txt"], keys, values):
            errors = attention_errors(queries, keys, values, k_hat, v_hat)
            print(f"| {name} | {label} | {bits:g} | {errors.mean():.4f} | {errors.max():.4f} |", flush=True)


if __name__ == "__main__":
    main()
