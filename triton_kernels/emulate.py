"""Run a Gluon kernel's own Python body on the CPU with numpy (tests).

Gluon kernels have no CPU interpreter. This module executes a kernel's
source program by program, with numpy standing in for the Gluon operations
the kernels of this package use:

* layouts are ignored: they place data on threads, they do not change values;
* ``inline_asm_elementwise`` blocks are replaced by numpy with the same
  results and rounding (each PTX block this package uses is listed in
  ``_ASM``; an unknown block raises);
* ``mma_v2`` is a product of float16 operands accumulated in float32;
* shared memory is a numpy array and ``cp.async`` a plain copy.

What this checks: the kernel's indexing, masks, algebra, channel orders, and
the bookkeeping of pages, splits and windows, exactly as written. What it
cannot check: layouts (compile checks), races and resources (GPU tests).
"""

from __future__ import annotations

import functools
import types
from typing import Any

import ml_dtypes
import numpy as np
from triton.experimental.gluon._runtime import GluonJITFunction
from triton.language import core as tl_core
from triton.runtime.jit import ConstexprFunction

from jflashloop_pallas_kernels import nvfp4_pages

_DTYPES = {
    "fp16": np.float16, "fp32": np.float32, "fp64": np.float64, "bf16": ml_dtypes.bfloat16,
    "int1": np.bool_, "int8": np.int8, "int16": np.int16, "int32": np.int32, "int64": np.int64,
    "uint8": np.uint8, "uint16": np.uint16, "uint32": np.uint32, "uint64": np.uint64,
}


def _np_dtype(dtype) -> np.dtype:
    return np.dtype(_DTYPES[dtype.name] if isinstance(dtype, tl_core.dtype) else dtype)


class Tensor(np.ndarray):
    """A numpy array with the two tensor methods the kernels call (``.to``, ``.type``).

    Results of numpy operations stay Tensors, 0-d ones included.
    """

    def __array_wrap__(self, array, context=None, return_scalar=False):
        return np.asarray(array).view(Tensor)

    def to(self, dtype, bitcast=False):
        if bitcast:
            return np.asarray(self).view(_np_dtype(dtype)).view(Tensor)
        return np.asarray(self).astype(_np_dtype(dtype)).view(Tensor)

    @property
    def type(self):
        return types.SimpleNamespace(layout=None, shape=list(self.shape), element_ty=self.dtype)


def _t(x) -> Tensor:
    return np.asarray(x).view(Tensor)


class Pointer:
    """A pointer (or tensor of pointers): a flat numpy buffer and element offsets."""

    def __init__(self, buffer: np.ndarray, offset=0):
        self.buffer, self.offset = buffer, offset

    def __add__(self, other):
        return Pointer(self.buffer, self.offset + np.asarray(other).astype(np.int64))

    __radd__ = __add__


def _load(pointer: Pointer, mask=None, other=0, **_):
    offset = np.asarray(pointer.offset, np.int64)
    if mask is None:
        return _t(pointer.buffer[offset])
    mask = np.broadcast_to(np.asarray(mask, bool), offset.shape) if offset.ndim else np.asarray(mask, bool)
    safe = np.where(mask, offset, 0)
    return _t(np.where(mask, pointer.buffer[safe], np.asarray(other).astype(pointer.buffer.dtype)))


def _store(pointer: Pointer, value, mask=None, **_):
    offset = np.asarray(pointer.offset, np.int64)
    value = np.broadcast_to(np.asarray(value), offset.shape).astype(pointer.buffer.dtype)
    if mask is not None:
        keep = np.broadcast_to(np.asarray(mask, bool), offset.shape)
        offset, value = offset[keep], value[keep]
    pointer.buffer[offset] = value


class Shared:
    """Shared memory: a numpy array; descriptors are views."""

    def __init__(self, array: np.ndarray):
        self.array = array

    def index(self, i):
        return Shared(self.array[int(i)])

    def slice(self, start, length, dim=0):
        index = [slice(None)] * self.array.ndim
        index[dim] = slice(int(start), int(start) + length)
        return Shared(self.array[tuple(index)])

    def reshape(self, shape):
        return Shared(self.array.reshape(shape))

    def load(self, layout=None):
        return _t(self.array.copy())

    @property
    def shape(self):
        return list(self.array.shape)


def _atomic_add(pointer: Pointer, value, mask=None, **_):
    offset = np.asarray(pointer.offset, np.int64)
    old = pointer.buffer[offset].copy()
    pointer.buffer[offset] = old + np.asarray(value).astype(pointer.buffer.dtype)
    return _t(old)


def _copy_to_shared(shared: Shared, pointer: Pointer, mask=None, **_):
    shared.array[...] = _load(pointer, mask, 0)


def _fp16_fma(a, b, c):
    """float16 ``a * b + c`` with one rounding (``fma.rn.f16x2``)."""
    return (np.asarray(a, np.float64) * np.asarray(b, np.float64) + np.asarray(c, np.float64)).astype(np.float16)


def _nibbles(words) -> list[np.ndarray]:
    words = np.asarray(words).astype(np.uint32)
    return [((words >> np.uint32(4 * i)) & np.uint32(15)).astype(np.float16) for i in range(8)]


def _value_codes(even, odd):  # nibble i of each token, its bits in place: code * 2**-24 (x 16 for odd i)
    out = []
    for i in range(8):
        shift = np.uint32(4 * i - 4 * (i % 2))  # to bits 0-3, or 4-7 for odd nibbles
        mask = np.uint32(0xF << (4 * (i % 2)))
        for words in (even, odd):
            out.append(_t(((np.asarray(words).astype(np.uint32) >> shift) & mask).astype(np.uint16).view(np.float16)))
    return tuple(out)


def _key_codes(words):
    return tuple(_t(c) for c in _nibbles(words))


def _halves(x):  # uint32 -> its (low, high) 16 bits as float16
    x = np.asarray(x).astype(np.uint32)
    low = (x & np.uint32(0xFFFF)).astype(np.uint16)
    high = (x >> np.uint32(16)).astype(np.uint16)
    return _t(low.view(np.float16)), _t(high.view(np.float16))


def _value_pairs(even, odd, s_even, s_odd, m_even, m_odd):
    out = []
    for e, o in zip(_nibbles(even), _nibbles(odd), strict=True):
        out += [_t(_fp16_fma(e, s_even, m_even)), _t(_fp16_fma(o, s_odd, m_odd))]
    return tuple(out)


_E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float64)


def _e2m1(words) -> list[np.ndarray]:  # the words in page order (nvfp4_pages)
    return [_E2M1[n.astype(np.int64)] for n in _nibbles(nvfp4_pages.from_page_order(np.asarray(words).astype(np.uint32)))]


def _e2m1_scaled(values, scale):  # e2m1 * scale / 2**14, one float16 rounding (subnormals kept)
    return (values * 2.0**-14 * np.asarray(scale, np.float64)).astype(np.float16)


def _e2m1_keys(words, scale):
    return tuple(_t(_e2m1_scaled(v, scale)) for v in _e2m1(words))


def _e2m1_value_pairs(even, odd, s_even, s_odd):
    out = []
    for e, o in zip(_e2m1(even), _e2m1(odd), strict=True):
        out += [_t(_e2m1_scaled(e, s_even)), _t(_e2m1_scaled(o, s_odd))]
    return tuple(out)


def _e2m1_sum(first, values, scale):  # first + e2m1 * scale / 2**14, one float16 rounding (fma.rn.f16x2)
    return (np.asarray(first, np.float64) + values * 2.0**-14 * np.asarray(scale, np.float64)).astype(np.float16)


def _e2m1_value_pair_sum(even, odd, even2, odd2, s_even, s_odd, s_even2, s_odd2):
    out = []
    for e, o, e2, o2 in zip(_e2m1(even), _e2m1(odd), _e2m1(even2), _e2m1(odd2), strict=True):
        out += [_t(_e2m1_sum(_e2m1_scaled(e, s_even), e2, s_even2)), _t(_e2m1_sum(_e2m1_scaled(o, s_odd), o2, s_odd2))]
    return tuple(out)


def _e2m1_value_codes(even, odd):  # e2m1 / 2**14 (exact in float16)
    return _e2m1_value_pairs(even, odd, np.float16(1), np.float16(1))


def _e4m3_float16(bits):  # float8_e4m3fn bytes (non-negative, not NaN) -> their float16 values (exact)
    return np.asarray(bits).astype(np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float16)


def _rotated_keys(words, low, high):  # (1024 + zp, -64 - zp): codes - zp
    return tuple(_t(c - (np.asarray(low, np.float64) - 1024).astype(np.float16)) for c in _nibbles(words))


def _rotated_value_pairs(even, odd, low_even, low_odd, high_even, high_odd):
    out = []
    for e, o in zip(_nibbles(even), _nibbles(odd), strict=True):
        out += [_t(e - (np.asarray(low_even) - 1024).astype(np.float16)),
                _t(o - (np.asarray(low_odd) - 1024).astype(np.float16))]
    return tuple(out)


def _row_keys(words, scale, minimum):  # token-axis INT4 rows: code * scale + min, one rounding
    return tuple(_t(_fp16_fma(c, scale, minimum)) for c in _nibbles(words))


def _int2_row_words(halfwords):  # affine INT2 rows: 8 two-bit codes -> an INT4 word of the same codes
    halfwords = np.asarray(halfwords)
    if halfwords.dtype == np.float16:  # a 16-bit register's bits, as the PTX evaluator passes them
        halfwords = halfwords.view(np.uint16)
    halfwords = halfwords.astype(np.uint32)
    words = np.zeros(halfwords.shape, np.uint32)
    for i in range(8):
        words |= ((halfwords >> np.uint32(2 * i)) & np.uint32(3)) << np.uint32(4 * i)
    return _t(words)


def _one_hot_pairs(a, b, true_bits):  # float16 pairs compared half by half: true_bits where equal, else 0
    a, b = (np.asarray(x).astype(np.uint32) for x in (a, b))
    out = []
    for shift in (0, 16):
        equal = (((a >> np.uint32(shift)) & np.uint32(0xFFFF)).astype(np.uint16).view(np.float16)
                 == ((b >> np.uint32(shift)) & np.uint32(0xFFFF)).astype(np.uint16).view(np.float16))
        out.append(_t(np.where(equal, np.uint16(true_bits), np.uint16(0)).view(np.float16)))
    return tuple(out)


def _asm_table():
    from . import gluon_decode

    return {
        gluon_decode._ROW_KEY_ASM.value: _row_keys,
        gluon_decode._INT2_ROW_WORD_ASM.value: _int2_row_words,
        gluon_decode._ROW_KEY_INT2_ASM.value: lambda halfwords, scale, minimum: _row_keys(
            _int2_row_words(halfwords), scale, minimum),
        gluon_decode._INT2_VALUE_CODES_ASM.value: lambda even, odd: _value_codes(
            _int2_row_words(even), _int2_row_words(odd)),
        gluon_decode._ROTATED_KEY_ASM.value: _rotated_keys,
        gluon_decode._ROTATED_VALUE_PAIR_ASM.value: _rotated_value_pairs,
        gluon_decode._KEY_CODES_ASM.value: _key_codes,
        gluon_decode._HALVES_ASM.value: _halves,
        gluon_decode._SCATTER_ONE_HOT_ASM.value: lambda a, b: _one_hot_pairs(a, b, 0x0001),  # KEY_UNIT
        gluon_decode._GATHER_ONE_HOT_ASM.value: lambda a, b: _one_hot_pairs(a, b, 0x3C00),  # 1.0
        gluon_decode._VALUE_PAIR_ASM.value: _value_pairs,
        gluon_decode._VALUE_PAIR_ASM_V2.value: _value_pairs,
        gluon_decode._VALUE_CODES_ASM.value: _value_codes,
        gluon_decode._E2M1_KEY_ASM.value: _e2m1_keys,
        gluon_decode._E4M3_PAIR_ASM.value: lambda bits: _e4m3_float16(bits) / np.float16(256),  # exact
        gluon_decode._E2M1_VALUE_PAIR_ASM.value: _e2m1_value_pairs,
        gluon_decode._E2M1_VALUE_PAIR_SUM_ASM.value: _e2m1_value_pair_sum,
        gluon_decode._E2M1_VALUE_CODES_ASM.value: _e2m1_value_codes,
    }


def _inline_asm(asm, constraints, args, dtype, is_pure, pack):
    table = _asm_table()
    if asm not in table:
        raise NotImplementedError("no numpy equivalent for this inline PTX block")
    args = np.broadcast_arrays(*[np.asarray(a) for a in args])
    return table[asm](*args)


def _mma(a, b, acc, **_):
    product = np.asarray(a, np.float64) @ np.asarray(b, np.float64)
    return _t((np.asarray(acc, np.float64) + product).astype(np.float32))


def _layout(*_, **__):
    return None


class _Program:
    ids = (0, 0, 0)


def _static_assert(condition, message=""):
    if not condition:
        raise AssertionError(message)


def _gluon_namespace():
    g = types.SimpleNamespace()
    for name in ("BlockedLayout", "SliceLayout", "DistributedLinearLayout", "DotOperandLayout",
                 "NVMMADistributedLayout", "SwizzledSharedLayout", "SharedLinearLayout", "PaddedSharedLayout"):
        setattr(g, name, _layout)
    for name in ("float16", "float32", "float64", "bfloat16", "int1", "int8", "int16", "int32", "int64",
                 "uint8", "uint16", "uint32", "uint64"):
        setattr(g, name, np.dtype(_DTYPES[{"float16": "fp16", "float32": "fp32", "float64": "fp64",
                                           "bfloat16": "bf16"}.get(name, name)]))
    g.constexpr = lambda value: value
    g.to_linear_layout = _layout
    g.program_id = lambda axis: _t(np.int32(_Program.ids[axis]))
    g.arange = lambda start, end, layout=None: _t(np.arange(start, end, dtype=np.int32))
    g.zeros = lambda shape, dtype, layout=None: _t(np.zeros(shape, _np_dtype(dtype)))
    g.full = lambda shape, value, dtype, layout=None: _t(np.full(shape, value, _np_dtype(dtype)))
    g.zeros_like = lambda x: _t(np.zeros_like(x))
    g.full_like = lambda x, value, **_: _t(np.full_like(x, value))
    g.expand_dims = lambda x, axis: _t(np.expand_dims(x, axis))
    g.join = lambda a, b: _t(np.stack(np.broadcast_arrays(a, b), axis=-1))
    g.split = lambda x: (_t(x[..., 0]), _t(x[..., 1]))
    g.reshape = lambda x, shape, can_reorder=False: _t(np.reshape(x, shape))
    g.permute = lambda x, dims: _t(np.transpose(x, dims))
    g.convert_layout = lambda x, layout, assert_trivial=False: x
    g.broadcast = lambda a, b: tuple(_t(x) for x in np.broadcast_arrays(a, b))
    g.max = lambda x, axis=None: _t(np.max(x, axis=axis))
    g.min = lambda x, axis=None: _t(np.min(x, axis=axis))
    g.sum = lambda x, axis=None: _t(np.sum(x, axis=axis, dtype=np.asarray(x).dtype))
    g.maximum = lambda a, b: _t(np.maximum(a, b))
    g.minimum = lambda a, b: _t(np.minimum(a, b))
    g.exp2 = lambda x: _t(np.exp2(x))
    g.fma = lambda a, b, c: _t((np.asarray(a, np.float64) * np.asarray(b, np.float64)
                               + np.asarray(c, np.float64)).astype(np.result_type(a, b, c)))
    g.where = lambda c, a, b: _t(np.where(c, a, b).astype(np.result_type(a, b)))
    g.cdiv = lambda a, b: (a + b - 1) // b
    g.static_range = range
    g.static_assert = _static_assert
    g.load = _load
    g.store = _store
    g.atomic_add = _atomic_add
    g.inline_asm_elementwise = lambda asm, constraints, args, dtype, is_pure, pack: _inline_asm(
        asm, constraints, args, dtype, is_pure, pack)
    g.allocate_shared_memory = lambda dtype, shape, layout, value=None: Shared(np.zeros(shape, _np_dtype(dtype)))
    return g


def _emulated(module_globals: dict[str, Any]) -> dict[str, Any]:
    """The module's globals with every Gluon object replaced by its numpy stand-in."""
    shim = {}
    for name, value in module_globals.items():
        if isinstance(value, tl_core.constexpr):
            value = value.value
        shim[name] = value
    shim["gl"] = _gluon_namespace()
    shim["mma_v2"] = _mma
    shim["async_copy"] = types.SimpleNamespace(
        async_copy_global_to_shared=_copy_to_shared, commit_group=lambda: None, wait_group=lambda n=0: None)
    for name, value in list(shim.items()):
        if isinstance(value, GluonJITFunction):
            shim[name] = types.FunctionType(value.fn.__code__, shim, name, value.fn.__defaults__)
        elif isinstance(value, ConstexprFunction):
            shim[name] = types.FunctionType(value.fn.__code__, shim, name, value.fn.__defaults__)
    return shim


@functools.cache
def _kernels():
    from . import gluon_decode

    return _emulated(vars(gluon_decode))


def run(kernel_name: str, grid: tuple[int, int, int], arrays, scalars, outputs, constants: dict[str, Any]):
    """Run kernel ``kernel_name`` of ``gluon_decode`` over ``grid``.

    ``arrays`` and ``outputs`` are numpy arrays (outputs are written in
    place), in the kernel's argument order around ``scalars``.
    """
    function = _kernels()[kernel_name]
    pointers = [Pointer(np.asarray(a).reshape(-1)) for a in arrays]
    output_pointers = [Pointer(o.reshape(-1)) for o in outputs]
    with np.errstate(over="ignore", under="ignore", invalid="ignore"):
        for a in range(grid[0]):
            for b in range(grid[1]):
                for c in range(grid[2]):
                    _Program.ids = (a, b, c)
                    function(*pointers, *[_t(np.int32(s)) for s in scalars], *output_pointers, **constants)
    return outputs
