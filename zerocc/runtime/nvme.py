"""The file store behind NVMe offload: one file per state tensor, written and read by background
I/O threads (the role of DeepSpeed ZeRO-Infinity's swapper).

Layout: ``<root>/zerocc-<pid>-<uuid8>/rank<r>/<key>.zcc``. The run folder belongs to one store of
one process; `NvmeStore.close` removes it, and so does interpreter exit (or garbage collection)
when close is never called. A process killed by a signal leaves it behind; its name says whose.

Durability. The files are scratch for one run: nothing reads them after the process ends
(checkpoints are written elsewhere), so the failure that matters is an error or crash of this
process in the middle of a write, not a power loss. A write goes to a temporary file that
`os.replace` renames over the final name (atomic on POSIX), so the final name always holds a
complete version. There is no ``fsync``: it would add a device flush per tensor per step and buy
only survival of a power loss, after which the run is lost anyway. ENOSPC still surfaces at
``write()`` on local filesystems (they reserve blocks when data enters the page cache).

Header. Each file starts with magic, format version, dtype, shape, byte count, the key, and the
generation of the write (a per-key counter the store keeps in memory), closed by a CRC32 of the
header itself. A read checks all of it and the file's size, which catches a foreign, stale,
damaged or truncated file. There is no payload checksum: zlib's CRC32 runs at a few GB/s at
best, about an NVMe drive's speed, so it would cost as much CPU time per step as the I/O itself
takes; bit rot inside the data is left to the drive's ECC.

Ordering. Transfers of one key run in submission order (each waits for the one before it), so a
read issued right after a write of the same key sees that write, and two queued writes leave
the newest. Transfers of different keys run concurrently on ``io_threads`` threads; file reads
and writes release the GIL, and each moves ``chunk_mb`` of the tensor's own memory (no copy).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import shutil
import stat
import struct
import tempfile
import threading
import uuid
import weakref
import zlib
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_all
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from zerocc.errors import OffloadError
from zerocc.local_ranks import ranks_on_this_machine

if TYPE_CHECKING:
    from zerocc.compiler.plan import Plan
    from zerocc.compiler.state import StateSpec

MAGIC = b"ZCCNVME\x00"
FORMAT_VERSION = 1
# magic, version, ndim, header length, generation, data bytes, dtype name, key length; then the
# shape (int64 each), the key (UTF-8) and a CRC32 of everything before it.
_FIXED = struct.Struct("<8sHHIQQ16sI")
_CRC = struct.Struct("<I")
_MAX_HEADER = 1 << 16
_SAFE_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-.")
# Leaves room for the temporary name (".<name>.<generation>.tmp") under the usual 255-byte limit.
_MAX_NAME = 200


def file_name(key: str) -> str:
    """The file name (without folder) of ``key``: ASCII letters, digits, ``_-.`` kept, other
    bytes of its UTF-8 as ``%XX`` (so distinct keys get distinct names); a leading dot escaped;
    names over 200 characters cut and tagged with a hash of the key (``~`` marks them)."""
    if not isinstance(key, str) or not key:
        raise ValueError(f"nvme store keys are non-empty strings, got {key!r}")
    try:
        raw = key.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"nvme store key {key!r} is not valid UTF-8: {exc.reason}") from None
    name = "".join(chr(b) if chr(b) in _SAFE_CHARS else f"%{b:02X}" for b in raw)
    if name.startswith("."):
        name = "%2E" + name[1:]
    if len(name) > _MAX_NAME:
        name = f"{name[: _MAX_NAME - 17]}~{hashlib.sha256(raw).hexdigest()[:16]}"
    return name + ".zcc"


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:,.1f} MiB"


def _byte_count(nbytes: int) -> str:
    return f"{nbytes:,} bytes ({nbytes / 2**30:,.2f} GiB)"


def _bytes_of(tensor: torch.Tensor, key: str, action: str) -> memoryview:
    """A writable byte view of the tensor's own memory (no copy)."""
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"nvme {action} of {key!r} needs a tensor, got {type(tensor).__name__}")
    if tensor.device.type != "cpu" or tensor.layout != torch.strided or not tensor.is_contiguous():
        raise ValueError(
            f"nvme {action} of {key!r} needs a contiguous CPU tensor, got one on "
            f"{tensor.device} (layout {tensor.layout}, contiguous: {tensor.is_contiguous()})"
        )
    return memoryview(tensor.detach().reshape(-1).view(torch.uint8).numpy())


def _pack_header(
    key: str, generation: int, dtype: torch.dtype, shape: tuple[int, ...], n: int
) -> bytes:
    key_bytes = key.encode("utf-8")
    dtype_name = str(dtype).removeprefix("torch.").encode("ascii")
    length = _FIXED.size + 8 * len(shape) + len(key_bytes) + _CRC.size
    body = _FIXED.pack(
        MAGIC, FORMAT_VERSION, len(shape), length, generation, n, dtype_name, len(key_bytes)
    )
    body += struct.pack(f"<{len(shape)}q", *shape) + key_bytes
    return body + _CRC.pack(zlib.crc32(body))


def _check_header(f, path: Path, key: str, generation: int, out: torch.Tensor) -> int:
    """Read the header of the open file ``f`` and check it against the newest write of ``key``
    (``generation``) and the tensor read into; return the number of data bytes that follow."""

    def bad(problem: str) -> OffloadError:
        return OffloadError(f"nvme file {path} does not hold what was written for {key}: {problem}")

    fixed = f.read(_FIXED.size)
    if len(fixed) < _FIXED.size:
        raise bad(f"truncated: {len(fixed)} bytes, shorter than a header")
    magic, version, ndim, length, got_generation, n, dtype, key_len = _FIXED.unpack(fixed)
    if magic != MAGIC:
        raise bad("not a zerocc nvme file (bad magic)")
    if version != FORMAT_VERSION:
        raise bad(f"format version {version}, this zerocc reads version {FORMAT_VERSION}")
    if length != _FIXED.size + 8 * ndim + key_len + _CRC.size or length > _MAX_HEADER:
        raise bad(f"damaged header (length {length})")
    rest = f.read(length - _FIXED.size)
    body, crc = fixed + rest[: -_CRC.size], rest[-_CRC.size :]
    if len(rest) < length - _FIXED.size or _CRC.unpack(crc)[0] != zlib.crc32(body):
        raise bad("damaged or truncated header (checksum mismatch)")
    shape = list(struct.unpack_from(f"<{ndim}q", body, _FIXED.size))
    got_key = body[_FIXED.size + 8 * ndim :].decode("utf-8", "replace")
    got_dtype = dtype.rstrip(b"\0").decode("ascii", "replace")
    want_dtype = str(out.dtype).removeprefix("torch.")
    if got_key != key:
        raise bad(f"it holds {got_key!r}")
    if (got_dtype, shape, n) != (want_dtype, list(out.shape), out.nbytes):
        raise bad(f"it holds {got_dtype} {shape}, the read expects {want_dtype} {list(out.shape)}")
    if got_generation != generation:
        raise bad(f"it is write #{got_generation}, the newest was #{generation} (a stale file)")
    if (size := os.fstat(f.fileno()).st_size) != length + n:
        raise bad(f"truncated: {size:,} bytes, the header says {length + n:,}")
    return n


def _write_chunk(f, chunk: memoryview) -> None:
    """Write all of ``chunk`` to the unbuffered file ``f`` (a raw write may be partial)."""
    while chunk:
        chunk = chunk[f.write(chunk) :]


def _remove_run(executor: ThreadPoolExecutor, run_dir: Path, owner_pid: int) -> None:
    # Runs from close(), garbage collection or atexit. Without wait: on collection no transfer is
    # pending (each holds the store), and at exit the pool's threads were already joined.
    executor.shutdown(wait=False)
    if os.getpid() == owner_pid:  # a forked child must not delete its parent's files
        shutil.rmtree(run_dir, ignore_errors=True)


class Transfer:
    """One asynchronous write or read of a store; the caller keeps its tensor alive (and, for a
    write, unchanged) until `wait` returns."""

    def __init__(self, key: str, kind: str, future: Future) -> None:
        self.key = key
        self.kind = kind
        self._future = future

    def wait(self) -> None:
        """Block until the transfer is done; an I/O failure is raised as `OffloadError`."""
        self._future.result()

    def done(self) -> bool:
        """Whether the transfer has finished (successfully or not)."""
        return self._future.done()

    def __repr__(self) -> str:
        return f"Transfer({self.kind} {self.key!r}, done={self.done()})"


class NvmeStore:
    """Files holding offloaded state tensors of one rank, under a per-run folder in ``root``.

    ``write``/``read`` return at once with a `Transfer`; ``io_threads`` threads move the bytes in
    chunks of ``chunk_mb`` MiB.
    """

    def __init__(
        self,
        root: str | os.PathLike,
        rank: int,
        *,
        io_threads: int = 2,
        chunk_mb: int = 64,
    ) -> None:
        limits = (("rank", rank, 0), ("io_threads", io_threads, 1), ("chunk_mb", chunk_mb, 1))
        for name, value, least in limits:
            if not isinstance(value, int) or value < least:
                raise ValueError(f"NvmeStore {name} must be an integer >= {least}, got {value!r}")
        self.root = Path(root)
        check_folder(self.root)
        self.run_dir = self.root / f"zerocc-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.dir = self.run_dir / f"rank{rank}"
        self._chunk = chunk_mb << 20
        self._lock = threading.RLock()
        self._closed = False
        self._submitted: dict[str, int] = {}  # key -> generation of its newest write
        self._held: dict[str, tuple[int, int]] = {}  # key -> (generation, file bytes) on disk
        self._tail: dict[str, Future] = {}  # key -> its newest unfinished transfer
        self._largest = 0
        self._executor = ThreadPoolExecutor(io_threads, thread_name_prefix=f"zerocc-nvme-{rank}")
        self._finalizer = weakref.finalize(
            self, _remove_run, self._executor, self.run_dir, os.getpid()
        )
        try:
            self.dir.mkdir(parents=True)
        except OSError as exc:
            self._finalizer()
            raise OffloadError(f"cannot create the nvme folder {self.dir}: {exc.strerror}") from exc

    def check_capacity(self, nbytes: int, *, largest: int | None = None) -> None:
        """Raise `OffloadError` unless the disk under ``root`` has room for ``nbytes`` of new
        files plus the temporary file of the largest single write: ``largest`` bytes, by default
        the largest write submitted so far (pass it when calling before the first write). File
        headers (under 200 bytes each) are not counted."""
        self._check_open("check capacity")
        largest = self._largest if largest is None else largest
        if nbytes < 0 or largest < 0:
            raise ValueError(f"check_capacity needs byte counts >= 0, got {nbytes}, {largest}")
        needed, free = nbytes + largest, shutil.disk_usage(self.dir).free
        if free < needed:
            raise OffloadError(
                f"not enough disk under {self.root} for nvme offload: need {_byte_count(needed)}"
                f" = {nbytes:,} for the state files + {largest:,} for the temporary file of the "
                f"largest write; {_byte_count(free)} free"
            )

    def write(self, key: str, tensor: torch.Tensor) -> Transfer:
        """Write ``tensor`` (contiguous, CPU) as the newest version of ``key``, asynchronously."""
        data = _bytes_of(tensor, key, "write")
        name = file_name(key)
        with self._lock:
            self._check_open("write")
            generation = self._submitted[key] = self._submitted.get(key, 0) + 1
            self._largest = max(self._largest, data.nbytes)
            task = partial(self._write, key, name, generation, data, tensor.dtype, tensor.shape)
            return self._submit(key, "write", task)

    def read(self, key: str, out: torch.Tensor) -> Transfer:
        """Read the newest version of ``key`` into ``out`` (contiguous, CPU, the dtype and shape
        written), asynchronously. After a failed read, ``out`` holds undefined values."""
        data = _bytes_of(out, key, "read")
        file_name(key)  # a bad key fails here, not on the I/O thread
        with self._lock:
            self._check_open("read")
            return self._submit(key, "read", partial(self._read, key, out, data))

    def nbytes(self) -> int:
        """Bytes of the files currently held (headers included)."""
        with self._lock:
            return sum(size for _, size in self._held.values())

    def path_of(self, key: str) -> Path:
        """The file that holds ``key``."""
        return self.dir / file_name(key)

    def close(self) -> None:
        """Wait for pending transfers, then remove the run folder. Idempotent."""
        with self._lock:
            self._closed = True
        self._executor.shutdown(wait=True)
        self._finalizer()

    def __enter__(self) -> NvmeStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self._held)} files, {_mib(self.nbytes())}"
        return f"NvmeStore({self.dir}, {state})"

    def _check_open(self, action: str) -> None:
        if self._closed:
            raise RuntimeError(f"cannot {action}: the NvmeStore at {self.dir} is closed")

    def _submit(self, key: str, kind: str, task: Callable[[], None]) -> Transfer:
        # Called under the lock, so transfers of one key chain in submission order.
        before = self._tail.get(key)
        future = self._executor.submit(self._after, before, task)
        self._tail[key] = future
        future.add_done_callback(partial(self._forget, key))
        return Transfer(key, kind, future)

    @staticmethod
    def _after(before: Future | None, task: Callable[[], None]) -> None:
        # The pool's queue is FIFO, so `before` was already taken by a thread: no deadlock.
        if before is not None:
            wait_all([before])
        task()

    def _forget(self, key: str, future: Future) -> None:
        with self._lock:
            if self._tail.get(key) is future:
                del self._tail[key]

    def _write(
        self,
        key: str,
        name: str,
        generation: int,
        data: memoryview,
        dtype: torch.dtype,
        shape: torch.Size,
    ) -> None:
        final = self.dir / name
        temp = self.dir / f".{name}.{generation}.tmp"
        header = _pack_header(key, generation, dtype, tuple(shape), data.nbytes)
        try:
            with open(temp, "xb", buffering=0) as f:
                _write_chunk(f, memoryview(header))
                for start in range(0, data.nbytes, self._chunk):
                    _write_chunk(f, data[start : start + self._chunk])
            os.replace(temp, final)
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.unlink(temp)
            raise self._write_error(key, data.nbytes, final, exc) from exc
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temp)
            raise
        with self._lock:
            self._held[key] = (generation, len(header) + data.nbytes)

    def _write_error(self, key: str, n: int, final: Path, exc: OSError) -> OffloadError:
        with self._lock:
            before = (
                "the previous version of the file is intact"
                if key in self._held
                else "no earlier version was stored"
            )
        free = _mib(shutil.disk_usage(self.dir).free)
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            full = "disk full" if exc.errno == errno.ENOSPC else "disk quota exceeded"
            return OffloadError(
                f"{full} writing {key} ({_mib(n)}) to {final}: {free} free; {before}"
            )
        reason = exc.strerror or str(exc)
        return OffloadError(f"could not write {key} ({_mib(n)}) to {final}: {reason}; {before}")

    def _read(self, key: str, out: torch.Tensor, data: memoryview) -> None:
        path = self.path_of(key)
        with self._lock:
            generation = self._held.get(key, (0, 0))[0]
        try:
            with open(path, "rb", buffering=0) as f:
                n = _check_header(f, path, key, generation, out)
                for start in range(0, n, self._chunk):
                    view = data[start : start + self._chunk]
                    while view:
                        got = f.readinto(view)
                        if not got:
                            raise OffloadError(f"nvme file {path} of {key} ended early")
                        view = view[got:]
        except FileNotFoundError:
            raise OffloadError(
                f"no nvme file for {key} at {path}: never written, or removed from outside"
            ) from None
        except OSError as exc:
            raise OffloadError(f"could not read {key} from {path}: {exc.strerror}") from exc


def check_folder(root: Path) -> None:
    """Raise `OffloadError` unless ``root`` is an existing, writable folder."""
    where = f"nvme offload folder {root} (offload.nvme_path)"
    try:
        mode = os.stat(root).st_mode
    except FileNotFoundError:
        raise OffloadError(f"{where} does not exist") from None
    except OSError as exc:
        raise OffloadError(f"{where} cannot be accessed: {exc.strerror}") from exc
    if not stat.S_ISDIR(mode):
        raise OffloadError(f"{where} is not a directory")
    try:  # os.access would lie for root and on some network filesystems: try it
        fd, probe = tempfile.mkstemp(prefix=".zerocc-probe-", dir=root)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise OffloadError(f"{where} is not writable: {exc.strerror or exc}") from exc


def open_store(plan: Plan, rank: int, specs: list[StateSpec]) -> NvmeStore | None:
    """The NVMe store of this rank when the plan places states there, checked for room for all
    of them (plus the temporary file of the largest write) before anything is written. Ranks on
    one machine share its disk: the check counts every local rank's states
    (``LOCAL_WORLD_SIZE``, as torchrun sets it)."""
    if not specs:
        return None
    store = NvmeStore(plan.offload.nvme_path, rank)
    local_ranks = ranks_on_this_machine(unknown=1)
    largest = max(s.nbytes for s in specs)
    store.check_capacity(local_ranks * sum(s.nbytes for s in specs), largest=largest)
    return store
