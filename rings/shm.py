"""POSIX shared-memory regions and the guest memory table.

A region is created by one process (mode 0600, unique name) and attached by others, by name or by file
descriptor (the descriptor is what travels over the vhost-user socket). The creator unlinks the name when it
closes, at interpreter exit, or when the object is collected, so no segment is left behind.

Memory handed to a peer is a size-sealed memfd (``create_sealed``): a peer that shrinks the file under our
mapping would kill us with SIGBUS. A receiver seals what the peer lets it seal (``seal_shrink``); what it could
not seal it reads through guarded copies (vhost.datapath.GuardedMemoryTable) or, where views are needed, through a
``WatchedMemoryTable``.
"""
import atexit
import errno
import fcntl
import logging
import mmap
import os
import secrets
import weakref
from dataclasses import dataclass

import posix_ipc

from .errors import AddressOutOfBounds, GuestMemoryFault, MemoryTableError, ShmError

MAX_REGIONS = 8  # what DPDK 22.11 accepts in one SET_MEM_TABLE

_live_names = set()

log = logging.getLogger(__name__)

# memfd seals (fcntl has them on Linux since Python 3.9; the numbers are the kernel's, for other builds)
F_ADD_SEALS = getattr(fcntl, "F_ADD_SEALS", 1033)
F_GET_SEALS = getattr(fcntl, "F_GET_SEALS", 1034)
F_SEAL_SEAL = getattr(fcntl, "F_SEAL_SEAL", 1)
F_SEAL_SHRINK = getattr(fcntl, "F_SEAL_SHRINK", 2)
F_SEAL_GROW = getattr(fcntl, "F_SEAL_GROW", 4)
#: what create_sealed fixes before the fd leaves the process: the size, for good (the peer may still write)
SEALS_FIXED_SIZE = F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL


def seal_shrink(fd, what="region"):
    """A receiver's protection: forbid shrinking the file behind ``fd`` (F_SEAL_SHRINK), so that nobody can
    take pages away from under our mapping. True if the file cannot shrink now (sealed by us or already by its
    creator); False if the creator did not allow sealing (DPDK's and QEMU's hugepage or /dev/shm files: EPERM
    for a file without MFD_ALLOW_SEALING or already F_SEAL_SEAL'ed, EINVAL for a file system without seals)."""
    try:
        fcntl.fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK)
        sealed = True
    except OSError as e:
        if e.errno not in (errno.EPERM, errno.EBUSY, errno.EINVAL):
            raise
        try:
            sealed = bool(fcntl.fcntl(fd, F_GET_SEALS) & F_SEAL_SHRINK)
        except OSError:
            sealed = False
    log.debug("%s: %s", what, "sealed against shrinking" if sealed
              else "the peer did not allow sealing: a shrink is caught as a guest memory fault")
    return sealed


@atexit.register
def _unlink_leftovers():
    for name in list(_live_names):
        _unlink(name)


def _unlink(name):
    _live_names.discard(name)
    try:
        posix_ipc.unlink_shared_memory(name)
    except posix_ipc.ExistentialError:
        pass


class ShmRegion:
    """One mmap of a POSIX shared-memory object. ``buf`` is the writable mmap."""

    def __init__(self, fd, size, name=None, owner=False, offset=0):
        self.name = name
        self.size = size
        self.owner = owner
        self._fd = fd
        try:
            self.buf = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE,
                                 offset=offset)
        except (OSError, ValueError) as e:
            raise ShmError(f"cannot map {size} bytes of {name or f'fd {fd}'}: {e}") from e
        self._finalizer = weakref.finalize(self, ShmRegion._cleanup, fd, name if owner else None)

    @staticmethod
    def _cleanup(fd, unlink_name):
        try:
            os.close(fd)
        except OSError:
            pass
        if unlink_name:
            _unlink(unlink_name)

    @classmethod
    def create(cls, size, prefix="vring"):
        if size <= 0:
            raise ShmError(f"region size must be positive, got {size}")
        name = f"/{prefix}-{os.getpid()}-{secrets.token_hex(4)}"
        try:
            shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600, size=size)
        except posix_ipc.Error as e:
            raise ShmError(f"cannot create shared memory {name}: {e}") from e
        _live_names.add(name)
        try:
            return cls(shm.fd, size, name=name, owner=True)
        except ShmError:
            os.close(shm.fd)
            _unlink(name)
            raise

    @classmethod
    def create_sealed(cls, size, name="vring"):
        """Anonymous memory (memfd) of ``size`` bytes whose size is sealed (SEALS_FIXED_SIZE) before the fd can
        reach anyone: a peer that gets the fd may read and write it, but not shrink it under our mapping (no
        SIGBUS for us), grow it, or lift the seals. It has no name, so nothing can be left in /dev/shm."""
        if size <= 0:
            raise ShmError(f"region size must be positive, got {size}")
        try:
            fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        except OSError as e:
            raise ShmError(f"cannot create memfd {name}: {e}") from e
        try:
            os.ftruncate(fd, size)
            fcntl.fcntl(fd, F_ADD_SEALS, SEALS_FIXED_SIZE)
            return cls(fd, size, name=None, owner=True)
        except (OSError, ShmError) as e:
            os.close(fd)
            if isinstance(e, ShmError):
                raise
            raise ShmError(f"cannot size and seal memfd {name} ({size:#x} bytes): {e}") from e

    @classmethod
    def attach(cls, name, size=None):
        try:
            shm = posix_ipc.SharedMemory(name)
        except posix_ipc.Error as e:
            raise ShmError(f"cannot open shared memory {name}: {e}") from e
        size = shm.size if size is None else size
        try:
            return cls(shm.fd, size, name=name)
        except ShmError:
            os.close(shm.fd)
            raise

    @classmethod
    def from_fd(cls, fd, size=None, offset=0):
        """Map a descriptor received from a peer (the region takes ownership of ``fd``, also when it fails)."""
        try:
            try:
                st = os.fstat(fd)
            except OSError as e:
                raise ShmError(f"bad fd {fd}: {e}") from e
            if size is None:
                size = st.st_size - offset
            if offset < 0 or size <= 0 or offset + size > st.st_size:
                raise ShmError(f"mapping {size:#x} bytes at offset {offset:#x} does not fit the file "
                               f"({st.st_size:#x} bytes)")
            return cls(fd, size, offset=offset)
        except ShmError:   # owned on every path: a peer's fd that cannot be mapped is closed, never leaked
            try:
                os.close(fd)
            except OSError:
                pass
            raise

    def fileno(self):
        return self._fd

    def unlink(self):
        """Remove the name now (the creator only). The memory lives on while it is mapped or its fd is
        open, so a peer that got the fd keeps working, and a killed process leaves nothing in /dev/shm."""
        if self.owner and self.name:
            _unlink(self.name)

    def close(self):
        """Unmap, close the fd and (for the creator) unlink the name. Safe to call twice."""
        try:
            self.buf.close()
        except BufferError:
            pass  # numpy/cffi views still alive: the mapping goes when they do
        self._finalizer()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


@dataclass(frozen=True)
class Region:
    gpa: int
    size: int
    buf: object      # anything with the buffer protocol, writable (mmap, bytearray, numpy)
    offset: int = 0  # where gpa maps inside buf


class MemoryTable:
    """Guest addresses -> (region, offset), with bounds checks that cannot overflow."""

    def __init__(self, regions=()):
        self.regions = []
        for r in regions:
            self.add(*r) if isinstance(r, tuple) else self.add(r.gpa, r.size, r.buf, r.offset)

    def add(self, gpa, size, buf, offset=0, file=None):
        """``file``: (fd, size it must keep) of the file behind ``buf``, for tables that watch it (WatchedMemoryTable);
        ignored here."""
        if len(self.regions) >= MAX_REGIONS:
            raise MemoryTableError(f"at most {MAX_REGIONS} regions")
        if size <= 0 or gpa < 0 or gpa + size > 1 << 64:
            raise MemoryTableError(f"region gpa={gpa:#x} size={size:#x} is empty or wraps 2^64")
        if offset < 0 or offset + size > len(memoryview(buf).cast("B")):
            raise MemoryTableError(f"region gpa={gpa:#x} size={size:#x} offset={offset:#x} "
                                   f"does not fit its buffer")
        for r in self.regions:
            if gpa < r.gpa + r.size and r.gpa < gpa + size:
                raise MemoryTableError(f"region gpa={gpa:#x} size={size:#x} overlaps "
                                       f"gpa={r.gpa:#x} size={r.size:#x}")
        self.regions.append(Region(gpa, size, buf, offset))
        return self

    def lookup(self, gpa, length):
        """(region, offset in region.buf) for [gpa, gpa+length), or raise AddressOutOfBounds."""
        for r in self.regions:
            if r.gpa <= gpa and gpa - r.gpa <= r.size and length <= r.size - (gpa - r.gpa):
                return r, r.offset + gpa - r.gpa
        raise AddressOutOfBounds(f"guest range {gpa:#x}+{length:#x} is outside the memory table",
                                 gpa, length)

    def view(self, gpa, length):
        """A writable memoryview of guest memory [gpa, gpa+length)."""
        r, off = self.lookup(gpa, length)
        return memoryview(r.buf).cast("B")[off:off + length]

    def read(self, gpa, length):
        return bytes(self.view(gpa, length))

    def write(self, gpa, data):
        self.view(gpa, len(data))[:] = data

    def release(self):
        """Called before the regions' mappings go (nothing to do here; see WatchedMemoryTable)."""

    def vanished(self):
        """None: this table does not watch its mappings (see WatchedMemoryTable)."""
        return None


_gf_watch_total = None


def _watch_faults():
    """Faults met in every zero-fill watch of this process so far (one C call; the C module loaded on first use)."""
    global _gf_watch_total
    if _gf_watch_total is None:
        from ._virtq import lib
        _gf_watch_total = lib.gf_watch_total
    return _gf_watch_total()


class WatchedMemoryTable(MemoryTable):
    """Someone else's memory read through views, where a guarded copy does not fit (the conformance harness reads
    the rings through numpy views and polls them with the C ring code; the tap's captures). A region whose owner
    truncates its file (POSIX shm cannot be sealed) does not kill us with SIGBUS: the pages that vanished read as
    zeros from then on (guest_fault.h's zero-fill watch maps anonymous pages over them, from the first page that
    faulted to the end of the mapping). Whoever reads through the views asks ``vanished()`` before believing what
    it read. ``whose``: the memory's owner, for the error. Hugetlbfs regions are replaced 2 MiB or 1 GiB at a time
    (the handler tries the page sizes in turn).

    A truncation inside a page leaves that page's tail reading zeros with no SIGBUS at all: a region added with
    ``file=(fd, end)`` (its file, and the size the file must keep: where the region ends in it, buf mapping the
    file from offset 0) is also compared with the file's size (an fstat per region and call)."""

    def __init__(self, regions=(), whose="the peer"):
        self.whose = whose
        self._watches = []     # (slot, gpa, size, offset of gpa in the mapping, mapping address)
        self._files = []       # (fd, end, gpa, size, offset of gpa in the file)
        self._release = weakref.finalize(self, WatchedMemoryTable._unwatch, self._watches)
        super().__init__(regions)

    def add(self, gpa, size, buf, offset=0, file=None):
        from ._virtq import ffi, lib
        super().add(gpa, size, buf, offset)
        base = int(ffi.cast("uintptr_t", ffi.from_buffer(buf)))
        slot = lib.gf_watch_add(base, memoryview(buf).nbytes, mmap.PAGESIZE)
        if slot < 0:
            self.regions.pop()
            raise MemoryTableError(f"region gpa={gpa:#x}: cannot watch its mapping at {base:#x} (at most 64 "
                                   f"watched mappings per process, and the mapping must be page aligned)")
        self._watches.append((slot, gpa, size, offset, base))
        if file is not None:
            self._files.append((file[0], file[1], gpa, size, offset))
        return self

    def _lost(self):
        """(region gpa, region end, the guest address from which it is gone) for each region that lost its end."""
        from ._virtq import ffi, lib
        out = []
        if self._watches and _watch_faults():
            lowest = ffi.new("uintptr_t *")
            for slot, gpa, size, offset, base in self._watches:
                if lib.gf_watch_faults(slot, lowest):
                    out.append((gpa, gpa + size, max(gpa, gpa + int(lowest[0]) - base - offset)))
        for fd, end, gpa, size, offset in self._files:
            try:
                st_size = os.fstat(fd).st_size
            except OSError:
                continue
            if st_size < end:
                out.append((gpa, gpa + size, max(gpa, gpa + st_size - offset)))
        return out

    def vanished(self, ranges=None):
        """GuestMemoryFault naming the first region that lost its end under us (it reads as zeros), or None.
        ``ranges``: [(gpa, length)]: only a loss that overlaps one of them counts (a dump of rings whose pages
        are all still there is still a good dump)."""
        if not self._files and not _watch_faults():   # nothing vanished anywhere (the tap asks per frame)
            return None
        for gpa, end, gone in sorted(self._lost(), key=lambda x: x[2]):
            if ranges is None or any(a < end and gone < a + n for a, n in ranges):
                return GuestMemoryFault(f"{self.whose} shrank the memory it shared: region gpa {gpa:#x} has lost "
                                        f"what lay from gpa {gone:#x} on (truncated under our mapping; it reads as "
                                        f"zeros since)", a=gpa, b=gone)
        return None

    def release(self):
        self._release()

    @staticmethod
    def _unwatch(watches):
        from ._virtq import lib
        for slot, *_ in watches:
            lib.gf_watch_remove(slot)
        watches.clear()
