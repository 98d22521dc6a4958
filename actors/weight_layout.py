"""Where each weight tensor of a checkpoint lives inside one flat byte buffer.

A model's weights travel as ONE buffer (host cache -> device slot is one bulk copy), so
each tensor gets a fixed byte offset in it. The layout is computed from the safetensors
headers alone (no tensor is read), in file order so the cold fill reads each file front
to back. Every entry starts on a 64-byte boundary, which keeps typed views aligned for
vectorised kernels whatever the dtype.

Tied embeddings: when config.json says `tie_word_embeddings`, a stored `lm_head.weight`
is dropped (the runner uses `model.embed_tokens.weight` for both).
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from actors.model_spec import CheckpointError, _safetensors_files, read_safetensors_header

ALIGN = 64

SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}


def align_up(n: int, align: int = ALIGN) -> int:
    return (n + align - 1) // align * align


@dataclass(frozen=True)
class WeightEntry:
    name: str
    offset: int                  # byte offset in the flat buffer (multiple of ALIGN)
    shape: tuple[int, ...]
    dtype: torch.dtype           # dtype in the flat buffer (after any conversion)
    nbytes: int                  # bytes in the flat buffer
    file: str                    # safetensors file the tensor comes from
    file_offset: int             # absolute byte offset of its data in that file
    file_dtype: torch.dtype      # dtype as stored in the file

    def __post_init__(self) -> None:
        if self.offset % ALIGN:
            raise ValueError(f"{self.name}: offset {self.offset} is not {ALIGN}-byte aligned")
        numel = 1
        for d in self.shape:
            numel *= d
        if self.nbytes != numel * self.dtype.itemsize:
            raise ValueError(f"{self.name}: nbytes {self.nbytes} != numel {numel} x {self.dtype}")


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
    def from_dir(cls, path: str | Path, dtype: torch.dtype | None = None) -> WeightLayout:
        """Layout of the checkpoint at `path`; `dtype` converts floating tensors (None keeps them)."""
        root = Path(path).expanduser().resolve()
        if not root.is_dir():
            raise CheckpointError(f"not a model checkpoint: {root} (no such directory)")
        if dtype is not None and not dtype.is_floating_point:
            raise ValueError(f"target dtype must be floating point, got {dtype}")
        tied = _tie_word_embeddings(root)
        entries, offset = [], 0
        for file in _safetensors_files(root):
            header = read_safetensors_header(file)
            data_start = 8 + _header_len(file)
            for name, info in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
                if tied and name == "lm_head.weight":
                    continue
                if info["dtype"] not in SAFETENSORS_DTYPES:
                    raise CheckpointError(f"bad model checkpoint: {file} ({name} has dtype {info['dtype']})")
                file_dtype = SAFETENSORS_DTYPES[info["dtype"]]
                out_dtype = dtype if dtype is not None and file_dtype.is_floating_point else file_dtype
                shape = tuple(int(d) for d in info["shape"])
                begin, end = info["data_offsets"]
                numel = 1
                for d in shape:
                    numel *= d
                if end - begin != numel * file_dtype.itemsize:
                    raise CheckpointError(f"bad model checkpoint: {file} ({name} size does not match its shape)")
                nbytes = numel * out_dtype.itemsize
                entries.append(WeightEntry(name, offset, shape, out_dtype, nbytes, str(file),
                                           data_start + begin, file_dtype))
                offset = align_up(offset + nbytes)
        return cls(str(root), tuple(entries), max(offset, ALIGN))

    def names(self) -> list[str]:
        return [e.name for e in self.entries]

    def fingerprint(self) -> str:
        """Changes when the files (path, size, mtime) or the layout change: names a cache entry."""
        h = hashlib.sha256(self.path.encode())
        for file in sorted({e.file for e in self.entries}):
            st = Path(file).stat()
            h.update(f"{file}:{st.st_size}:{st.st_mtime_ns}".encode())
        for e in self.entries:
            h.update(f"{e.name}:{e.offset}:{e.shape}:{e.dtype}:{e.file_dtype}".encode())
        return h.hexdigest()[:24]


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
