"""The node-wide host weight cache: each model's flat weights held once per node.

Every worker process on a node maps the same shared-memory file per model
(`<shm_dir>/<prefix>-<uid>-<fingerprint>`), so N workers serving the same model hold its
weights once. The first process to need a model fills the file from safetensors under
an exclusive `fcntl` lock on `<file>.lock` and then records the file's size and SHA-256
in `<file>.ready`; the others wait on the lock and map the file once it matches that
record (a process that dies mid-fill leaves no file at the name, so the next refills).
Reading the checkpoint from disk is the cold path only; a swap-in copies from this mapping.

The files are this user's alone (actors/private_files.py): created 0600 with O_EXCL under a
temporary name and renamed into place, and used only when owned by us and private. A
process removes the files it filled when it shuts down (`remove_created`, also at exit),
never another's, unless asked to keep them ($TOKENMUX_KEEP_HOST_CACHE=1 or keep_files).

Pinning on GPU hosts: the shared mapping itself is page-locked with `cudaHostRegister`
(per process, no extra copy), so host->device copies run at full DMA speed straight out
of shared memory. Copying into a private pinned buffer instead would hold the weights
once more per worker, defeating the point of a node-wide cache; that copy is only the
fallback when registration is refused. On CPU hosts nothing is pinned.
"""
from __future__ import annotations

import atexit
import ctypes
import fcntl
import json
import logging
import mmap
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from actors.packed_linear import pack_into
from actors.private_files import UntrustedFile, create_private, open_private, read_private, sha256_hex, write_private
from actors.weight_layout import WeightLayout, numel

logger = logging.getLogger(__name__)

DEFAULT_SHM_DIR = "/dev/shm"
DEFAULT_PREFIX = "tokenmux-weights"
KEEP_ENV = "TOKENMUX_KEEP_HOST_CACHE"
# Files this process filled (a weights file, its .ready and .lock), removed at exit unless kept.
_CREATED: set[Path] = set()


@dataclass
class _Mapped:
    layout: WeightLayout
    path: Path
    flat: torch.Tensor          # [total_bytes] uint8 over the shared mapping (or its pinned copy)
    mapping: mmap.mmap
    registered: bool            # cudaHostRegister'ed by this process


class HostWeightCache:
    def __init__(self, shm_dir: str | Path = DEFAULT_SHM_DIR, prefix: str = DEFAULT_PREFIX,
                 pin: bool | None = None, keep_files: bool | None = None):
        """keep_files: leave the files this process fills on the node at shutdown
        (default: $TOKENMUX_KEEP_HOST_CACHE)."""
        self.shm_dir = Path(shm_dir)
        if not self.shm_dir.is_dir():
            raise ValueError(f"shared-memory directory {self.shm_dir} does not exist")
        if not prefix or "/" in prefix:
            raise ValueError(f"prefix must be a non-empty file-name part, got {prefix!r}")
        self.prefix = prefix
        self.pin = torch.cuda.is_available() if pin is None else pin
        self._layouts: dict[str, WeightLayout] = {}
        self._mapped: dict[str, _Mapped] = {}
        self.num_fills = 0            # fills done by THIS process (0 = reused another's)
        self.fill_seconds = 0.0
        self.keep_files = _env_keep() if keep_files is None else keep_files
        self._created: set[Path] = set()

    def add(self, model: str, layout: WeightLayout) -> None:
        """Make `model` known; its weights are read on the first `flat(model)`."""
        known = self._layouts.get(model)
        if known is not None and known != layout:
            raise ValueError(f"model {model!r} is already in the host cache with a different layout")
        self._layouts[model] = layout

    def layout(self, model: str) -> WeightLayout:
        if model not in self._layouts:
            raise KeyError(f"model {model!r} is not in the host weight cache; known: {sorted(self._layouts)}")
        return self._layouts[model]

    def file_for(self, model: str) -> Path:
        return self.shm_dir / f"{self.prefix}-{os.getuid()}-{self.layout(model).fingerprint()}"

    def flat(self, model: str) -> torch.Tensor:
        """The model's weights as one uint8 tensor `[total_bytes]`, filling the cache on first use."""
        m = self._mapped.get(model)
        if m is None:
            m = self._mapped[model] = self._map(model)
        return m.flat

    def models(self) -> set[str]:
        return set(self._mapped)

    def num_bytes(self) -> int:
        """Bytes of weights this process has mapped (each counted once per node)."""
        return sum(m.layout.total_bytes for m in self._mapped.values())

    def stats(self) -> dict:
        return {"models": len(self._mapped), "bytes": self.num_bytes(),
                "fills": self.num_fills, "fill_seconds": self.fill_seconds}

    def evict(self, model: str) -> None:
        """Drop `model` from the node: unmap here and unlink its file (memory returns once
        every process has dropped its mapping)."""
        path = self.file_for(model)
        self._release(model)
        for p in (path.with_name(path.name + ".ready"), path, path.with_name(path.name + ".lock")):
            p.unlink(missing_ok=True)
            self._created.discard(p)
            _CREATED.discard(p)
        self._layouts.pop(model, None)

    def forget(self, model: str) -> None:
        """Drop `model` from this process only: unmap it here; its file stays for the node's other workers."""
        self._release(model)
        self._layouts.pop(model, None)

    def close(self) -> None:
        """Unmap everything in this process; the files stay for the other workers."""
        for model in list(self._mapped):
            self._release(model)

    def remove_created(self) -> list[Path]:
        """At shutdown: remove the files this cache filled (unless keep_files); returns them.
        Processes that mapped them keep their mapping; a later user refills."""
        if self.keep_files:
            return []
        removed = sorted(self._created)
        for p in removed:
            p.unlink(missing_ok=True)
        _CREATED.difference_update(self._created)
        self._created.clear()
        return removed

    def __del__(self) -> None:
        # A registration must end before its mapping does: a later mmap at the same address
        # would otherwise be refused by cudaHostRegister ("already registered").
        try:
            self.close()
        except Exception:  # interpreter shutdown: CUDA may already be gone
            pass

    def _release(self, model: str) -> None:
        m = self._mapped.pop(model, None)
        if m is not None and m.registered:
            torch.cuda.cudart().cudaHostUnregister(m.flat.data_ptr())
        # the mmap closes when the last tensor viewing it is freed

    def _map(self, model: str) -> _Mapped:
        layout = self.layout(model)
        path = self.file_for(model)
        ready = path.with_name(path.name + ".ready")
        lock_path = path.with_name(path.name + ".lock")
        with os.fdopen(open_private(lock_path, os.O_RDWR, create=True), "r+") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)   # held through the fill: others wait, then reuse
            try:
                mapping = _verified_mapping(path, ready, layout.total_bytes)
                if mapping is None:
                    self._fill(layout, path, ready)
                    if not self.keep_files:
                        self._created.update((path, ready, lock_path))
                        _CREATED.update(self._created)
                    mapping = _map_file(path, layout.total_bytes)
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)
        flat = torch.frombuffer(mapping, dtype=torch.uint8)
        registered = False
        if self.pin:
            flat, registered = _pin(flat, model)
        return _Mapped(layout, path, flat, mapping, registered)

    def _fill(self, layout: WeightLayout, path: Path, ready: Path) -> None:
        start = time.perf_counter()
        fd, tmp = create_private(path)   # filled under a private name, then renamed into place
        try:
            os.ftruncate(fd, layout.total_bytes)
            mapping = mmap.mmap(fd, layout.total_bytes, flags=mmap.MAP_SHARED)
            flat = torch.frombuffer(mapping, dtype=torch.uint8)
            _read_checkpoint(layout, flat)
            del flat
            digest = sha256_hex(mapping)
            mapping.close()
            os.rename(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        finally:
            os.close(fd)
        elapsed = time.perf_counter() - start
        write_private(ready, json.dumps({"size": layout.total_bytes, "sha256": digest, "pid": os.getpid(),
                                         "seconds": elapsed, "checkpoint": layout.path}).encode())
        self.num_fills += 1
        self.fill_seconds += elapsed
        logger.info("host cache: filled %s (%.1f MB) from %s in %.2fs",
                    path.name, layout.total_bytes / 1e6, layout.path, elapsed)


def _verified_mapping(path: Path, ready: Path, size: int) -> mmap.mmap | None:
    """A mapping of `path` if it holds what its .ready record says (size and SHA-256) and
    `size` bytes; None when it must be (re)filled. UntrustedFile if either is not ours."""
    record = read_private(ready)
    try:
        expected = json.loads(record) if record is not None else {}
    except ValueError:
        expected = {}
    if expected.get("size") != size:
        return None
    try:
        mapping = _map_file(path, size)
    except UntrustedFile:
        raise
    except (ValueError, FileNotFoundError):   # not there, or not `size` bytes
        return None
    if sha256_hex(mapping) != expected.get("sha256"):
        logger.warning("host cache: %s does not match its recorded hash; refilling", path.name)
        mapping.close()
        return None
    return mapping


def _env_keep() -> bool:
    return os.environ.get(KEEP_ENV, "").lower() in ("1", "true", "yes")


@atexit.register
def _remove_created_at_exit() -> None:
    if not _env_keep():
        for p in _CREATED:
            p.unlink(missing_ok=True)


def _map_file(path: Path, size: int) -> mmap.mmap:
    fd = open_private(path, os.O_RDWR)
    try:
        if os.fstat(fd).st_size != size:
            raise ValueError(f"host cache file {path} has {os.fstat(fd).st_size} bytes, expected {size}")
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)   # populate: no faults on first swap
        return mmap.mmap(fd, size, flags=flags)
    finally:
        os.close(fd)


def _read_checkpoint(layout: WeightLayout, flat: torch.Tensor) -> None:
    """Write every entry's bytes into its place in `flat`: a tensor stored as the layout wants
    it is read straight in; a converted, fused, cut or packed one is read, then built there."""
    handles: dict[str, object] = {}

    def read(src, dtype: torch.dtype) -> torch.Tensor:
        f = handles.get(src.file) or handles.setdefault(src.file, open(src.file, "rb"))
        raw = bytearray(numel(src.shape) * src.file_dtype.itemsize)
        f.seek(src.file_offset)
        if f.readinto(raw) != len(raw):
            raise ValueError(f"{src.file}: short read for {src.name}")
        return torch.frombuffer(raw, dtype=src.file_dtype).view(src.shape).to(dtype) if raw else \
            torch.empty(src.shape, dtype=dtype)

    try:
        for e in layout.entries:
            dst = flat[e.offset:e.offset + e.nbytes]
            src = e.sources[0]
            if len(e.sources) == 1 and e.packed is None and e.cut is None and src.file_dtype == e.dtype:
                f = handles.get(src.file) or handles.setdefault(src.file, open(src.file, "rb"))
                f.seek(src.file_offset)
                n = f.readinto(memoryview(dst.numpy()))
                if n != e.nbytes:
                    raise ValueError(f"{src.file}: short read for {e.name} ({n} of {e.nbytes} bytes)")
                continue
            parts = [read(s, e.dtype) for s in e.sources]
            if e.cut is not None:   # a tensor-parallel rank's part of each source
                parts = [e.cut.apply(p) for p in parts]
            tensor = torch.cat(parts)   # [sum of dim 0, ...]
            if e.packed is not None:
                pack_into(dst, tensor, e.packed)
            else:
                dst.view(e.dtype).view(e.shape).copy_(tensor)
    finally:
        for f in handles.values():
            f.close()


def _pin(flat: torch.Tensor, model: str) -> tuple[torch.Tensor, bool]:
    cudart = torch.cuda.cudart()
    err = cudart.cudaHostRegister(flat.data_ptr(), flat.numel(), 0)
    if int(err) == 0:
        return flat, True
    _clear_cuda_error()
    logger.warning("host cache: cudaHostRegister refused for %s (error %s); using a private pinned copy",
                   model, int(err))
    pinned = torch.empty(flat.numel(), dtype=torch.uint8, pin_memory=True)
    pinned.copy_(flat)
    return pinned, False


def _clear_cuda_error() -> None:
    """Reset the CUDA runtime's last-error after a refused registration; left set, torch would
    report it from its next unrelated CUDA call. torch's cudart bindings lack cudaGetLastError,
    so it is looked up in the libcudart torch already loaded (dlopen by soname reuses it)."""
    try:
        major = torch.version.cuda.split(".")[0]
        ctypes.CDLL(f"libcudart.so.{major}").cudaGetLastError()
    except (OSError, AttributeError) as e:
        logger.warning("host cache: could not reset the CUDA error state (%s)", e)
