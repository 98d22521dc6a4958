"""Linear layers over weights packed in oneDNN's blocked layout, inside the flat slot buffer.

oneDNN's fp32/bf16 inner product runs ~1.5-2.5x faster than `F.linear` (MKL sgemm) at
decode batch sizes when its weight is pre-packed into the blocked layout the kernel
reads (`torch.ops.mkldnn._reorder_linear_weight`, what inductor's freezing pass and
vLLM's CPU backend use). torch keeps a packed weight as an opaque mkldnn tensor that
owns its memory, which would put the weights outside the slot and make a swap-in a
per-tensor repack. So the packed BYTES live in the flat buffer like any other tensor
(the host cache holds them packed; a swap-in stays one bulk copy) and the kernel reads
them through an mkldnn tensor that VIEWS the slot: `packed_view` builds it with
`aoti_torch_create_tensor_from_blob_v2`, the ABI-stable C entry point AOTInductor uses
to rebuild packed constants from a blob plus oneDNN's serialized memory descriptor.

The descriptor (`PackedFormat.metadata`) names the blocked format, which depends on the
shape, the dtype and the CPU's ISA; it is computed once per (shape, dtype) in this
process and checked again when the host cache packs real weights, so a blob packed for
another format is never read as this one.
"""
from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from pathlib import Path

import torch

# The batch size oneDNN picks its blocked format for: decode batches are small; the
# format stays valid (if not optimal) for any batch, prefill included.
PACK_BATCH_HINT = 8


@dataclass(frozen=True)
class PackedFormat:
    nbytes: int          # bytes of the packed weight (>= numel * itemsize: blocks are padded)
    metadata: bytes      # oneDNN's serialized memory descriptor of the blocked layout


def available() -> bool:
    """oneDNN packing and the C entry point that views external memory both exist here."""
    try:
        return torch.backends.mkldnn.is_available() and _shim() is not None
    except (OSError, AttributeError):
        return False


@functools.lru_cache(maxsize=None)
def packed_format(shape: tuple[int, int], dtype: torch.dtype) -> PackedFormat:
    """The packed layout of an [out, in] weight of `dtype` on this CPU (cached per shape)."""
    packed = _reorder(torch.zeros(shape, dtype=dtype))
    return PackedFormat(torch.ops.mkldnn._nbytes(packed), _metadata(packed))


def pack_into(dst: torch.Tensor, weight: torch.Tensor, fmt: PackedFormat) -> None:
    """Pack `weight` [out, in] and write its bytes into `dst` (uint8 [fmt.nbytes], contiguous)."""
    if dst.dtype != torch.uint8 or dst.numel() != fmt.nbytes or not dst.is_contiguous():
        raise ValueError(f"packed destination must be {fmt.nbytes} contiguous bytes, got {dst.numel()} {dst.dtype}")
    packed = _reorder(weight.contiguous())
    if torch.ops.mkldnn._nbytes(packed) != fmt.nbytes or _metadata(packed) != fmt.metadata:
        raise ValueError(f"weight {tuple(weight.shape)} {weight.dtype} packs to a different oneDNN format than "
                         "its layout was computed for (another CPU or torch build?)")
    ctypes.memmove(dst.data_ptr(), torch.ops.mkldnn.data_ptr(packed), fmt.nbytes)


def packed_view(buffer: torch.Tensor, shape: tuple[int, int], dtype: torch.dtype, fmt: PackedFormat) -> torch.Tensor:
    """An mkldnn tensor reading the packed weight in `buffer` (uint8 [fmt.nbytes], CPU), no copy.

    The view does not own the memory: `buffer` (a slot) must outlive it, and it sees
    whatever bytes the slot holds, so it stays valid across swap-ins of the same model."""
    if buffer.device.type != "cpu" or buffer.numel() != fmt.nbytes or not buffer.is_contiguous():
        raise ValueError(f"packed weights live in {fmt.nbytes} contiguous CPU bytes, got {buffer.numel()} "
                         f"on {buffer.device}")
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


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """# x [T, in] @ packed weight [out, in]^T (+ bias [out]) -> [T, out]."""
    return _linear_pointwise(x, weight, bias, "none", [], "")


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
