"""Where each weight tensor of a checkpoint lives inside one flat byte buffer.

A model's weights travel as ONE buffer (host cache -> device slot is one bulk copy), so
each tensor gets a fixed byte offset in it. The layout is computed from the safetensors
headers alone (no tensor is read), in file order so the cold fill reads each file front
to back. Every entry starts on a 64-byte boundary, which keeps typed views aligned for
vectorised kernels whatever the dtype.

Tied embeddings: when config.json says `tie_word_embeddings`, a stored `lm_head.weight`
is dropped (the runner uses `model.embed_tokens.weight` for both).

The runner's fast path asks for a different set of tensors (a plan: q/k/v and gate/up
fused, large linear weights packed for oneDNN); the layout then holds THOSE bytes, the
host cache builds them once when it fills, and a swap-in is still one bulk copy. A plan
may name one row of a stacked tensor as `name[i]` (one expert of a MoE checkpoint that
stores its experts as [E, ...] tensors): its bytes are a slice of the file like any other.

A rank of a tensor-parallel group (actors/tensor_parallel.py) holds a part of some tensors:
its plan gives those a `TensorCut`, applied to each source before they are concatenated,
and the layout holds the rank's bytes only (its own host-cache file, its own fingerprint).
"""
from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from actors.model_spec import CheckpointError, _safetensors_files, read_safetensors_header
from actors.packed_linear import PackedFormat, packed_format

ALIGN = 64

SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}


def align_up(n: int, align: int = ALIGN) -> int:
    return (n + align - 1) // align * align


@dataclass(frozen=True)
class TensorSource:
    """One tensor's bytes in a safetensors file."""

    name: str
    file: str                    # safetensors file
    file_offset: int             # absolute byte offset of its data in that file
    file_dtype: torch.dtype      # dtype as stored in the file
    shape: tuple[int, ...]


@dataclass(frozen=True)
class TensorCut:
    """The part of a tensor one rank of `parts` holds: along `dim`, equal piece `index`.
    dim None: the whole tensor on rank 0 and zeros on the others (a row-split layer's bias,
    which the all-reduce then adds once)."""

    index: int
    parts: int
    dim: int | None

    def __post_init__(self) -> None:
        if not 0 <= self.index < self.parts:
            raise ValueError(f"cut index {self.index} outside [0, {self.parts})")
        if self.dim not in (None, 0, 1):
            raise ValueError(f"cut dim must be 0, 1 or None, got {self.dim}")

    def shape(self, shape: tuple[int, ...], name: str) -> tuple[int, ...]:
        if self.dim is None:
            return shape
        if len(shape) <= self.dim or shape[self.dim] % self.parts:
            raise ValueError(f"{name}: shape {shape} does not split in {self.parts} along dim {self.dim}")
        return shape[:self.dim] + (shape[self.dim] // self.parts,) + shape[self.dim + 1:]

    def apply(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.dim is None:
            return tensor if self.index == 0 else torch.zeros_like(tensor)
        return tensor.chunk(self.parts, dim=self.dim)[self.index]


@dataclass(frozen=True)
class PlannedTensor:
    """A tensor the runner wants in the flat buffer, made of checkpoint tensors."""

    name: str
    sources: tuple[str, ...]     # checkpoint tensor names, concatenated along dim 0
    pack: bool = False           # packed linear weight (actors/packed_linear.py)
    cut: TensorCut | None = None  # a tensor-parallel rank's part of each source (None: whole)


@dataclass(frozen=True)
class WeightEntry:
    name: str
    offset: int                  # byte offset in the flat buffer (multiple of ALIGN)
    shape: tuple[int, ...]
    dtype: torch.dtype           # dtype in the flat buffer (after any conversion)
    nbytes: int                  # bytes in the flat buffer
    sources: tuple[TensorSource, ...]       # one for a checkpoint tensor as it is; several when fused
    packed: PackedFormat | None = None      # None: row-major; else a packed form (actors/packed_linear.py)
    cut: TensorCut | None = None            # the part of each source this rank holds (None: whole)

    def __post_init__(self) -> None:
        if self.offset % ALIGN:
            raise ValueError(f"{self.name}: offset {self.offset} is not {ALIGN}-byte aligned")
        n = numel(self.shape)
        expected = self.packed.nbytes if self.packed is not None else n * self.dtype.itemsize
        if self.nbytes != expected:
            raise ValueError(f"{self.name}: nbytes {self.nbytes} != {expected} ({n} x {self.dtype}"
                             f"{', packed' if self.packed else ''})")

    @property
    def file(self) -> str:
        return self.sources[0].file


@dataclass(frozen=True)
class WeightLayout:
    path: str                          # the checkpoint directory
    entries: tuple[WeightEntry, ...]   # in flat-buffer order
    total_bytes: int

    def __post_init__(self) -> None:
        if not self.entries:
            raise ValueError(f"weight layout of {self.path} has no tensors")
        end = 0
        for e in self.entries:
            if e.offset < end:
                raise ValueError(f"{e.name} overlaps the tensor before it")
            end = e.offset + e.nbytes
        if end > self.total_bytes:
            raise ValueError(f"entries end at {end} beyond total_bytes {self.total_bytes}")

    @classmethod
    def from_dir(cls, path: str | Path, dtype: torch.dtype | None = None,
                 plan: tuple[PlannedTensor, ...] | None = None) -> WeightLayout:
        """Layout of the checkpoint at `path`; `dtype` converts floating tensors (None keeps them).

        Without a plan every checkpoint tensor is an entry as it is. A plan names every
        entry and what it is made of (fused, packed): the runner's fast path; tensors it
        does not name are left out."""
        root = Path(path).expanduser().resolve()
        if not root.is_dir():
            raise CheckpointError(f"not a model checkpoint: {root} (no such directory)")
        if dtype is not None and not dtype.is_floating_point:
            raise ValueError(f"target dtype must be floating point, got {dtype}")
        tensors = _checkpoint_tensors(root)   # in file order
        if plan is None:
            plan = _checkpoint_plan(root, tensors)
        files = {file: i for i, file in enumerate(dict.fromkeys(s.file for s in tensors.values()))}
        resolved = {}
        for t in plan:
            for name in t.sources:
                resolved[name] = _source(tensors, name)
                if resolved[name] is None:
                    raise CheckpointError(f"bad model checkpoint: {root} (no tensor {name})")

        def file_order(t: PlannedTensor) -> tuple[int, int]:   # the cold fill reads files front to back
            first = resolved[t.sources[0]]
            return files[first.file], first.file_offset

        entries, offset = [], 0
        for t in sorted(plan, key=file_order):
            sources = tuple(resolved[s] for s in t.sources)
            entry = _entry(root, t, sources, offset, dtype)
            entries.append(entry)
            offset = align_up(offset + entry.nbytes)
        return cls(str(root), tuple(entries), max(offset, ALIGN))

    def names(self) -> list[str]:
        return [e.name for e in self.entries]

    def fingerprint(self) -> str:
        """Changes when the files (path, size, mtime) or the layout change: names a cache entry."""
        h = hashlib.sha256(self.path.encode())
        for file in sorted({s.file for e in self.entries for s in e.sources}):
            st = Path(file).stat()
            h.update(f"{file}:{st.st_size}:{st.st_mtime_ns}".encode())
        for e in self.entries:
            parts = ",".join(f"{s.name}:{s.file_dtype}" for s in e.sources)
            h.update(f"{e.name}:{e.offset}:{e.shape}:{e.dtype}:{parts}:{e.cut}".encode())
            if e.packed is not None:   # the packed format (ours, or oneDNN: CPU ISA, version) names the bytes too
                h.update(hashlib.sha256(e.packed.metadata).digest())
        return h.hexdigest()[:24]


def checkpoint_plan(path: str | Path) -> tuple[PlannedTensor, ...]:
    """The plan of a layout without one: every checkpoint tensor as it is (a tied lm_head left out)."""
    root = Path(path).expanduser().resolve()
    return _checkpoint_plan(root, _checkpoint_tensors(root))


def _checkpoint_plan(root: Path, tensors: dict[str, TensorSource]) -> tuple[PlannedTensor, ...]:
    return tuple(PlannedTensor(name, (name,)) for name in tensors
                 if not (name == "lm_head.weight" and _tie_word_embeddings(root)))


def _checkpoint_tensors(root: Path) -> dict[str, TensorSource]:
    tensors: dict[str, TensorSource] = {}
    for file in _safetensors_files(root):
        header = read_safetensors_header(file)
        data_start = 8 + _header_len(file)
        for name, info in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
            if info["dtype"] not in SAFETENSORS_DTYPES:
                raise CheckpointError(f"bad model checkpoint: {file} ({name} has dtype {info['dtype']})")
            file_dtype = SAFETENSORS_DTYPES[info["dtype"]]
            shape = tuple(int(d) for d in info["shape"])
            begin, end = info["data_offsets"]
            if end - begin != numel(shape) * file_dtype.itemsize:
                raise CheckpointError(f"bad model checkpoint: {file} ({name} size does not match its shape)")
            tensors[name] = TensorSource(name, str(file), data_start + begin, file_dtype, shape)
    return tensors


def _source(tensors: dict[str, TensorSource], name: str) -> TensorSource | None:
    """The checkpoint tensor `name`, or row i of a stacked one for `name[i]`; None if neither."""
    if name in tensors:
        return tensors[name]
    match = _ROW.fullmatch(name)
    stacked = tensors.get(match[1]) if match else None
    if stacked is None or len(stacked.shape) < 2 or int(match[2]) >= stacked.shape[0]:
        return None
    row_bytes = numel(stacked.shape[1:]) * stacked.file_dtype.itemsize
    return TensorSource(name, stacked.file, stacked.file_offset + int(match[2]) * row_bytes, stacked.file_dtype,
                        stacked.shape[1:])


_ROW = re.compile(r"(.+)\[(\d+)\]")


def _entry(root: Path, t: PlannedTensor, sources: tuple[TensorSource, ...], offset: int,
           dtype: torch.dtype | None) -> WeightEntry:
    first = sources[0]
    shapes = [t.cut.shape(s.shape, s.name) if t.cut else s.shape for s in sources]
    if any(s[1:] != shapes[0][1:] or src.file_dtype != first.file_dtype for s, src in zip(shapes, sources)):
        raise CheckpointError(f"bad model checkpoint: {root} ({t.name}: {', '.join(t.sources)} do not concatenate)")
    out_dtype = dtype if dtype is not None and first.file_dtype.is_floating_point else first.file_dtype
    shape = (sum(s[0] for s in shapes), *shapes[0][1:]) if shapes[0] else ()
    packed = None
    if t.pack:
        if len(shape) != 2:
            raise ValueError(f"{t.name}: only 2-D linear weights can be packed, got shape {shape}")
        packed = packed_format(shape, out_dtype)
    nbytes = packed.nbytes if packed is not None else numel(shape) * out_dtype.itemsize
    return WeightEntry(t.name, offset, shape, out_dtype, nbytes, sources, packed, t.cut)


def numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _header_len(file: Path) -> int:
    with open(file, "rb") as f:
        return int.from_bytes(f.read(8), "little")


def _tie_word_embeddings(root: Path) -> bool:
    config = root / "config.json"
    if not config.is_file():
        return False
    try:
        return bool(json.loads(config.read_text()).get("tie_word_embeddings", False))
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"bad model checkpoint: cannot read {config} ({e})") from None
