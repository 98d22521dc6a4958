"""Linear layers over packed weights, inside the flat slot buffer.

At decode batch sizes a linear layer is one pass over its weight, and a kernel that reads
the weight in the order it computes runs ~1.5-2.5x faster than `F.linear` (MKL sgemm) on
the checkpoint's row-major matrix. Two packed forms, chosen per matrix by `packed_format`:

- **blocked** (float32, where the CPU kernels build for AVX-512): our own layout, `[out/32, in, 32]`,
  read by `actors/blocked_linear_cpu.cpp`, which keeps a decode batch's accumulators in
  registers: ~1.3-1.5x oneDNN's packed fp32 kernel at batch 8 on this project's hosts
  (~16-22 GB/s of weights on one core against ~13). It is a plain float tensor, so the
  slot's bytes ARE the kernel's input: a view, no copy. Output features must be a
  multiple of 32 (every projection of the zoo and of common checkpoints is).
- **oneDNN** (bfloat16, and float32 matrices the blocked kernel does not take): the
  blocked layout oneDNN's inner product reads (`torch.ops.mkldnn._reorder_linear_weight`,
  what inductor's freezing pass and vLLM's CPU backend use). torch keeps such a weight as
  an opaque mkldnn tensor that owns its memory, so the packed BYTES live in the slot like
  any other tensor and the kernel reads them through an mkldnn tensor that VIEWS the slot:
  `packed_view` builds it with `aoti_torch_create_tensor_from_blob_v2`, the ABI-stable C
  entry point AOTInductor uses to rebuild packed constants from a blob plus oneDNN's
  serialized memory descriptor.

Either way the host cache holds the packed bytes and a swap-in stays one bulk copy. The
descriptor (`PackedFormat.metadata`) names the format, which depends on the shape, the
dtype and (for oneDNN) the CPU's ISA; it is computed once per (shape, dtype) in this
process, checked again when the host cache packs real weights, and part of the cache
file's fingerprint, so bytes packed for one format are never read as another.
"""
from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from actors import cpu_isa, paged_attention_cpu

# The batch size oneDNN picks its blocked format for: decode batches are small; the
# format stays valid (if not optimal) for any batch, prefill included.
PACK_BATCH_HINT = 8


BLOCK = 32                       # output features per block of the blocked layout
BLOCKED_METADATA = b"tokenmux-blocked-f32-o32"


@dataclass(frozen=True)
class PackedFormat:
    nbytes: int          # bytes of the packed weight (>= numel * itemsize: oneDNN's blocks are padded)
    metadata: bytes      # BLOCKED_METADATA, or oneDNN's serialized memory descriptor of its layout

    @property
    def blocked(self) -> bool:
        return self.metadata == BLOCKED_METADATA


def available() -> bool:
    """oneDNN packing and the C entry point that views external memory both exist here."""
    try:
        return torch.backends.mkldnn.is_available() and _shim() is not None
    except (OSError, AttributeError):
        return False


def blocked_available() -> bool:
    """The blocked float32 kernel (actors/blocked_linear_cpu.cpp) built here: AVX-512 builds
    only, so never where AVX-512 is hidden (actors/cpu_isa.py)."""
    return (not cpu_isa.avx512_hidden() and paged_attention_cpu.available()
            and hasattr(torch.ops.tokenmux, "blocked_linear"))


@functools.lru_cache(maxsize=None)
def packed_format(shape: tuple[int, int], dtype: torch.dtype) -> PackedFormat:
    """The packed layout of an [out, in] weight of `dtype` on this CPU (cached per shape)."""
    if dtype == torch.float32 and shape[0] % BLOCK == 0 and blocked_available():
        return PackedFormat(shape[0] * shape[1] * 4, BLOCKED_METADATA)
    packed = _reorder(torch.zeros(shape, dtype=dtype))
    return PackedFormat(torch.ops.mkldnn._nbytes(packed), _metadata(packed))


def pack_into(dst: torch.Tensor, weight: torch.Tensor, fmt: PackedFormat) -> None:
    """Pack `weight` [out, in] and write its bytes into `dst` (uint8 [fmt.nbytes], contiguous)."""
    if dst.dtype != torch.uint8 or dst.numel() != fmt.nbytes or not dst.is_contiguous():
        raise ValueError(f"packed destination must be {fmt.nbytes} contiguous bytes, got {dst.numel()} {dst.dtype}")
    if fmt.blocked:
        out, inp = weight.shape
        if weight.dtype != torch.float32 or out * inp * 4 != fmt.nbytes:
            raise ValueError(f"weight {tuple(weight.shape)} {weight.dtype} does not fit its blocked layout")
        _blocked(dst, weight.shape).copy_(weight.view(out // BLOCK, BLOCK, inp).transpose(1, 2))
        return
    packed = _reorder(weight.contiguous())
    if torch.ops.mkldnn._nbytes(packed) != fmt.nbytes or _metadata(packed) != fmt.metadata:
        raise ValueError(f"weight {tuple(weight.shape)} {weight.dtype} packs to a different oneDNN format than "
                         "its layout was computed for (another CPU or torch build?)")
    ctypes.memmove(dst.data_ptr(), torch.ops.mkldnn.data_ptr(packed), fmt.nbytes)


def packed_view(buffer: torch.Tensor, shape: tuple[int, int], dtype: torch.dtype, fmt: PackedFormat) -> torch.Tensor:
    """The packed weight in `buffer` (uint8 [fmt.nbytes], CPU) as the tensor its kernel reads,
    no copy: float32 [out/32, in, 32] (blocked) or an mkldnn tensor (oneDNN).

    The view does not own the memory: `buffer` (a slot) must outlive it, and it sees
    whatever bytes the slot holds, so it stays valid across swap-ins of the same model."""
    if buffer.device.type != "cpu" or buffer.numel() != fmt.nbytes or not buffer.is_contiguous():
        raise ValueError(f"packed weights live in {fmt.nbytes} contiguous CPU bytes, got {buffer.numel()} "
                         f"on {buffer.device}")
    if fmt.blocked:
        return _blocked(buffer, shape)
    lib = _shim()
    sizes = (ctypes.c_int64 * 2)(*shape)
    strides = (ctypes.c_int64 * 2)(shape[1], 1)
    md = (ctypes.c_uint8 * len(fmt.metadata)).from_buffer_copy(fmt.metadata)
    handle = ctypes.c_void_p()
    err = lib.aoti_torch_create_tensor_from_blob_v2(
        ctypes.c_void_p(buffer.data_ptr()), 2, sizes, strides, 0, _AOTI_DTYPES[dtype](lib),
        lib.aoti_torch_device_type_cpu(), 0, ctypes.byref(handle), lib.aoti_torch_layout__mkldnn(),
        md, len(fmt.metadata))
    if err != 0 or not handle.value:
        raise RuntimeError(f"could not view packed weights {shape} {dtype} (AOTI error {err})")
    # The new at::Tensor handle becomes a Python tensor that owns (and later frees) the handle.
    return torch._C._aoti.alloc_tensor_by_stealing_from_void_ptr(_capsule(handle.value))


def is_packed(weight: torch.Tensor) -> bool:
    """Whether `weight` is a `packed_view` (either form) rather than a plain [out, in] matrix."""
    return weight.is_mkldnn or weight.dim() == 3


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """# x [T, in] @ packed weight [out, in]^T (+ bias [out]) -> [T, out]."""
    if weight.is_mkldnn:
        return _linear_pointwise(x, weight, bias, "none", [], "")
    return torch.ops.tokenmux.blocked_linear(x, weight, bias)


def _blocked(buffer: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """# uint8 [out * in * 4] -> float32 [out/32, in, 32], the same bytes."""
    return buffer.view(torch.float32).view(shape[0] // BLOCK, shape[1], BLOCK)


def _reorder(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight, PACK_BATCH_HINT)


def _metadata(packed: torch.Tensor) -> bytes:
    return bytes(torch.ops.mkldnn._get_mkldnn_serialized_md(packed).numpy().tobytes())


_AOTI_DTYPES = {
    torch.float32: lambda lib: lib.aoti_torch_dtype_float32(),
    torch.bfloat16: lambda lib: lib.aoti_torch_dtype_bfloat16(),
}


@functools.lru_cache(maxsize=1)
def _shim():
    """libtorch_cpu's AOTI C shim, with the signatures used here (None if absent)."""
    lib = ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"))
    if not hasattr(lib, "aoti_torch_create_tensor_from_blob_v2"):
        return None
    i64p = ctypes.POINTER(ctypes.c_int64)
    lib.aoti_torch_create_tensor_from_blob_v2.restype = ctypes.c_int32
    lib.aoti_torch_create_tensor_from_blob_v2.argtypes = [
        ctypes.c_void_p, ctypes.c_int64, i64p, i64p, ctypes.c_int64, ctypes.c_int32, ctypes.c_int32,
        ctypes.c_int32, ctypes.POINTER(ctypes.c_void_p), ctypes.c_int32, ctypes.POINTER(ctypes.c_uint8),
        ctypes.c_int64]
    for name in ("aoti_torch_dtype_float32", "aoti_torch_dtype_bfloat16", "aoti_torch_device_type_cpu",
                 "aoti_torch_layout__mkldnn"):
        getattr(lib, name).restype = ctypes.c_int32
    return lib


def _capsule(pointer: int):
    new = ctypes.pythonapi.PyCapsule_New
    new.restype, new.argtypes = ctypes.py_object, [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
    return new(pointer, None, None)


_linear_pointwise = torch.ops.mkldnn._linear_pointwise.default if hasattr(torch.ops.mkldnn, "_linear_pointwise") \
    else None
