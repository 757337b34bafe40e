"""The NVMe offload file store: round trips, ordering, atomic overwrites, clear errors, cleanup."""

from __future__ import annotations

import errno
import gc
import os
import subprocess
import sys
import tempfile
import textwrap
import threading
from pathlib import Path

import pytest
import torch

from zerocc.errors import OffloadError
from zerocc.runtime import nvme
from zerocc.runtime.nvme import NvmeStore


def sample(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """Values that differ per element and per seed, in any of the tested dtypes."""
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(-(2**40), 2**40, shape, generator=g, dtype=dtype)


def read_back(store: NvmeStore, key: str, like: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(like)
    store.read(key, out).wait()
    return out


@pytest.fixture
def store(tmp_path):
    with NvmeStore(tmp_path, rank=0, chunk_mb=1) as s:
        yield s


# (700, 1000) is 1.4-5.6 MB: several 1 MiB chunks and a partial last one.
@pytest.mark.parametrize("shape", [(), (0,), (7,), (3, 5), (700, 1000)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_round_trip(store, dtype, shape):
    value = sample(dtype, shape)
    store.write("transformer.h.0.exp_avg", value).wait()
    assert torch.equal(read_back(store, "transformer.h.0.exp_avg", value), value)
    header = store.path_of("transformer.h.0.exp_avg").stat().st_size - value.nbytes
    assert 0 < header < 200 and store.nbytes() == header + value.nbytes


def test_concurrent_keys_and_per_key_order(store):
    values = {f"h.{i}.exp_avg": sample(torch.float32, (300_000,), seed=i) for i in range(8)}
    writes = [store.write(key, value) for key, value in values.items()]
    # A read queued right behind the write of its key sees that write.
    outs = {key: torch.empty_like(value) for key, value in values.items()}
    reads = [store.read(key, out) for key, out in outs.items()]
    for transfer in writes + reads:
        transfer.wait()
        assert transfer.done()
    for key, value in values.items():
        assert torch.equal(outs[key], value)


def test_overwrite_keeps_the_newest(store):
    old, new, newest = (sample(torch.float32, (1000,), seed=s) for s in range(3))
    store.write("w", old).wait()
    store.write("w", new)
    store.write("w", newest)  # queued behind the one before; neither waited on
    assert torch.equal(read_back(store, "w", old), newest)
    assert [p.name for p in store.dir.iterdir()] == ["w.zcc"]


def test_write_returns_before_the_bytes_move(store, monkeypatch):
    release = threading.Event()
    real_write_chunk = nvme._write_chunk

    def blocked(f, chunk):
        release.wait(timeout=10)
        real_write_chunk(f, chunk)

    monkeypatch.setattr(nvme, "_write_chunk", blocked)
    value = sample(torch.float32, (100,))
    transfer = store.write("w", value)
    assert not transfer.done()
    release.set()
    transfer.wait()
    assert torch.equal(read_back(store, "w", value), value)


def test_disk_full_midway_keeps_the_previous_file(store, monkeypatch):
    old = sample(torch.float32, (700_000,), seed=1)  # 2.8 MB: header, 3 chunks
    store.write("adam.exp_avg", old).wait()
    held = store.nbytes()
    calls = []
    real_write_chunk = nvme._write_chunk

    def fills_up(f, chunk):
        calls.append(len(chunk))
        if len(calls) == 3:  # after the header and one chunk of data
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_write_chunk(f, chunk)

    monkeypatch.setattr(nvme, "_write_chunk", fills_up)
    failed = store.write("adam.exp_avg", sample(torch.float32, (700_000,), seed=2))
    with pytest.raises(OffloadError, match=r"disk full writing adam\.exp_avg \(2\.7 MiB\)") as err:
        failed.wait()
    assert "MiB free; the previous version of the file is intact" in str(err.value)
    assert [p.name for p in store.dir.iterdir()] == ["adam.exp_avg.zcc"]  # no temporary file
    assert store.nbytes() == held
    monkeypatch.setattr(nvme, "_write_chunk", real_write_chunk)
    assert torch.equal(read_back(store, "adam.exp_avg", old), old)

    # A first write that fails leaves nothing, and reading the key says so.
    calls.clear()
    monkeypatch.setattr(nvme, "_write_chunk", fills_up)
    with pytest.raises(OffloadError, match="disk full.*no earlier version"):
        store.write("other", sample(torch.float32, (700_000,))).wait()
    assert [p.name for p in store.dir.iterdir()] == ["adam.exp_avg.zcc"]
    with pytest.raises(OffloadError, match="no nvme file for other"):
        read_back(store, "other", old)


def damage(path: Path, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


@pytest.mark.parametrize(
    ("spoil", "message"),
    [
        (lambda p, n: damage(p, 0, b"NOTZEROC"), "bad magic"),
        (lambda p, n: damage(p, 8, b"\x07\x00"), "format version 7"),
        (lambda p, n: damage(p, 48, b"\x05"), "damaged header"),  # the key's length
        (lambda p, n: damage(p, 60, b"\xff"), "checksum mismatch"),  # inside the shape
        (lambda p, n: os.truncate(p, 20), "shorter than a header"),
        (lambda p, n: os.truncate(p, p.stat().st_size - 1), "truncated: .* the header says"),
    ],
)
def test_damaged_file_is_an_error(store, spoil, message):
    value = sample(torch.float32, (4, 4))
    store.write("unit.0.master", value).wait()
    spoil(store.path_of("unit.0.master"), value.nbytes)
    with pytest.raises(OffloadError, match=message):
        read_back(store, "unit.0.master", value)


def test_file_that_is_not_the_expected_one(store):
    value = sample(torch.float32, (4, 4))
    store.write("a", value).wait()
    with pytest.raises(OffloadError, match=r"holds float32 \[4, 4\], the read expects bfloat16"):
        read_back(store, "a", value.bfloat16())
    with pytest.raises(OffloadError, match=r"the read expects float32 \[16\]"):
        read_back(store, "a", value.reshape(16))
    stale = store.path_of("a").read_bytes()
    store.write("a", value + 1).wait()
    store.path_of("a").write_bytes(stale)
    with pytest.raises(OffloadError, match="write #1, the newest was #2"):
        read_back(store, "a", value)
    store.write("b", value).wait()
    os.replace(store.path_of("b"), store.path_of("a"))
    with pytest.raises(OffloadError, match="it holds 'b'"):
        read_back(store, "a", value)
    with pytest.raises(OffloadError, match="no nvme file for never.written"):
        read_back(store, "never.written", value)


def test_missing_root_or_file_as_root(tmp_path):
    with pytest.raises(OffloadError, match=r"nope \(offload\.nvme_path\) does not exist"):
        NvmeStore(tmp_path / "nope", 0)
    (tmp_path / "file").write_text("")
    with pytest.raises(OffloadError, match="file .* is not a directory"):
        NvmeStore(tmp_path / "file", 0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


def test_read_only_root(tmp_path):
    root = tmp_path / "ro"
    root.mkdir()
    root.chmod(0o500)
    try:
        if os.access(root, os.W_OK):
            pytest.skip("running as root: chmod 0o500 does not stop root writing to the folder")
        with pytest.raises(OffloadError, match="ro .* is not writable: Permission denied"):
            NvmeStore(root, 0)
        assert list(root.iterdir()) == []
    finally:
        root.chmod(0o700)


def test_unwritable_root_as_root_user(tmp_path, monkeypatch):
    # The same check where chmod cannot simulate it: creating the probe file fails.
    def denied(*args, **kwargs):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))

    monkeypatch.setattr(tempfile, "mkstemp", denied)
    with pytest.raises(OffloadError, match="is not writable: Permission denied"):
        NvmeStore(tmp_path, 0)
    assert list(tmp_path.iterdir()) == []


def test_check_capacity(store, monkeypatch):
    store.check_capacity(1)
    with pytest.raises(
        OffloadError, match=r"not enough disk under .*need 1,000,000,000,000,000,000"
    ):
        store.check_capacity(10**18)
    # The temporary file of the largest write: passed, or the largest written so far.
    usage = nvme.shutil.disk_usage(store.dir)._replace(free=1000)
    monkeypatch.setattr(nvme.shutil, "disk_usage", lambda path: usage)
    store.check_capacity(600, largest=400)
    with pytest.raises(
        OffloadError, match=r"need 1,001 bytes .* = 600 for the state files \+ 401 "
    ):
        store.check_capacity(600, largest=401)
    store.write("big", torch.zeros(101, dtype=torch.int32)).wait()  # 404 bytes
    with pytest.raises(OffloadError, match=r"1,000 bytes \(0\.00 GiB\) free"):
        store.check_capacity(600)


def test_close_removes_the_run_folder(tmp_path):
    store = NvmeStore(tmp_path, rank=3)
    assert store.dir.parent == store.run_dir and store.dir.name == "rank3"
    assert store.run_dir.name.startswith(f"zerocc-{os.getpid()}-")
    pending = store.write("x", torch.ones(10))
    store.close()
    assert pending.done() and not store.run_dir.exists()
    store.close()  # idempotent
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(RuntimeError, match="cannot write: the NvmeStore at .* is closed"):
        store.write("x", torch.ones(10))
    with pytest.raises(RuntimeError, match="cannot read"):
        store.read("x", torch.ones(10))
    with NvmeStore(tmp_path, rank=0) as store:
        store.write("x", torch.ones(10)).wait()
    assert list(tmp_path.iterdir()) == []


def test_store_never_closed_is_removed(tmp_path):
    store = NvmeStore(tmp_path, rank=0)
    store.write("x", torch.ones(10)).wait()
    del store
    gc.collect()
    assert list(tmp_path.iterdir()) == []

    script = textwrap.dedent(f"""
        import torch
        from zerocc.runtime.nvme import NvmeStore
        store = NvmeStore({str(tmp_path)!r}, rank=1)
        store.write("x", torch.ones(1000))  # still pending at exit
        print(store.dir)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert str(tmp_path) in done.stdout and list(tmp_path.iterdir()) == []


def test_keys_become_safe_distinct_file_names(store):
    keys = ["a/b", "a%2Fb", "..", ".hidden", "ключ", "x" * 300, "x" * 299 + "y"]
    paths = [store.path_of(key) for key in keys]
    assert len(set(paths)) == len(keys)
    assert all(p.parent == store.dir and len(p.name) <= 210 for p in paths)
    assert not any(p.name.startswith(".") for p in paths)
    for i, key in enumerate(keys):
        store.write(key, torch.full((3,), float(i))).wait()
    for i, key in enumerate(keys):
        assert read_back(store, key, torch.empty(3)).eq(i).all()


def test_bad_keys_and_tensors(store):
    with pytest.raises(ValueError, match="non-empty strings, got ''"):
        store.write("", torch.ones(1))
    with pytest.raises(ValueError, match="non-empty strings, got 3"):
        store.read(3, torch.ones(1))
    with pytest.raises(ValueError, match="needs a contiguous CPU tensor"):
        store.write("w", torch.ones(4, 4).t())
    with pytest.raises(ValueError, match="needs a tensor, got list"):
        store.write("w", [1.0])
    assert list(store.dir.iterdir()) == []
