"""The host weight cache's files in /dev/shm are this user's alone, checked before they are
mapped, and gone when the process that filled them shuts down (unless kept): never another
process's files."""
from __future__ import annotations

import multiprocessing as mp
import os
import stat
from pathlib import Path

import pytest
import torch

from actors.host_cache import HostWeightCache
from actors.private_files import UntrustedFile
from actors.weight_layout import WeightLayout

from test_weights import SHM, prefix  # noqa: F401  (prefix: a fresh file prefix, its files removed after)


@pytest.fixture(scope="module")
def path(zoo_model):
    return zoo_model("llama-tiny-a")


def _cache(prefix: str, path: Path, **kw) -> HostWeightCache:
    cache = HostWeightCache(prefix=prefix, **kw)
    cache.add("m", WeightLayout.from_dir(path))
    return cache


def _files(prefix: str) -> list[Path]:
    return sorted(SHM.glob(prefix + "-*"))


def test_files_are_private_and_no_temporary_is_left(prefix, path):
    cache = _cache(prefix, path)
    cache.flat("m")
    files = _files(prefix)
    assert {f.name.rsplit(".", 1)[-1] if "." in f.name else "" for f in files} == {"", "ready", "lock"}
    assert all(f.stat().st_uid == os.getuid() and stat.S_IMODE(f.stat().st_mode) == 0o600 for f in files)
    assert str(os.getuid()) in cache.file_for("m").name


def test_a_file_that_does_not_match_its_record_is_refilled(prefix, path):
    first = _cache(prefix, path)
    expected = first.flat("m").clone()
    with open(first.file_for("m"), "r+b") as f:   # corrupt a byte behind the cache's back
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0xFF]))
    second = _cache(prefix, path)
    assert torch.equal(second.flat("m"), expected) and second.num_fills == 1


def test_a_ready_marker_without_its_file_is_not_trusted(prefix, path):
    first = _cache(prefix, path)
    first.flat("m")
    first.file_for("m").unlink()
    second = _cache(prefix, path)
    second.flat("m")
    assert second.num_fills == 1


@pytest.mark.parametrize("plant", ["readable", "symlink"])
def test_a_file_planted_under_our_name_is_refused(prefix, path, tmp_path, plant):
    cache = _cache(prefix, path)
    target = cache.file_for("m")
    lock = target.with_name(target.name + ".lock")
    if plant == "readable":
        lock.write_text("")
        lock.chmod(0o666)
    else:
        lock.symlink_to(tmp_path / "elsewhere")
    with pytest.raises((UntrustedFile, OSError)):
        cache.flat("m")
    assert not (tmp_path / "elsewhere").exists()


def test_shutdown_removes_what_this_process_filled_and_nothing_else(prefix, path):
    filler = _cache(prefix, path)
    filler.flat("m")
    reader = _cache(prefix, path)   # maps the filler's file: not its own
    reader.flat("m")
    assert reader.remove_created() == [] and _files(prefix)
    assert len(filler.remove_created()) == 3 and not _files(prefix)
    assert reader.flat("m").numel() > 0   # its mapping outlives the names


def test_keep_files_leaves_them(prefix, path):
    cache = _cache(prefix, path, keep_files=True)
    cache.flat("m")
    assert cache.remove_created() == [] and len(_files(prefix)) == 3


def _fill_and_exit(prefix: str, path: str) -> None:
    _cache(prefix, Path(path)).flat("m")


def test_a_process_that_exits_removes_its_files(prefix, path):
    proc = mp.get_context("spawn").Process(target=_fill_and_exit, args=(prefix, str(path)))
    proc.start()
    proc.join(120)
    assert proc.exitcode == 0 and not _files(prefix)
