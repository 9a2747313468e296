"""Write order made observable: the recording test build of the C engines and the reference model's hook.

``rings._virtq_rec`` is csrc/virtq.h compiled with -DVQ_RECORD (csrc/virtq_record.h): every access the
engines make to ring memory is logged in program order. It is built here on demand (never by setup.py, so the
normal build is untouched) and ``rings/virtq.py`` is loaded a second time over it as ``rings.virtq_rec``. The
reference model logs the same through ``rings.reference.record``. Both logs come back as ``Access`` tuples
in guest addresses, so one test asserts an ordering rule against both implementations.
"""
import contextlib
import ctypes
import fcntl
import glob
import importlib
import importlib.util
import os
import shutil
import sys
import tempfile
from typing import NamedTuple

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CSRC = os.path.join(ROOT, "rings", "csrc")
# what is compiled into the build: the headers, and the cdef (rings/_build.py's CDEF, then this file's)
SOURCES = [os.path.join(CSRC, n) for n in ("virtq.h", "virtq_types.h", "virtq_record.h", "guest_fault.h", "probe.h")] + [
    os.path.join(ROOT, "rings", "_build.py"), __file__]
MODULE = "rings._virtq_rec"

STORES = "SWR"   # plain, relaxed, release
LOADS = "LA"


class Access(NamedTuple):
    kind: str      # 'S' store, 'W' relaxed store, 'R' release store, 'L' load, 'A' acquire load, 'F' fence
    gpa: int       # guest address (None for a fence or an address outside the memory table)
    size: int
    value: int

    @property
    def store(self):
        return self.kind in STORES

    @property
    def load(self):
        return self.kind in LOADS

    @property
    def fence(self):
        return self.kind == "F"

    def within(self, start, length):
        return self.gpa is not None and start <= self.gpa and self.gpa + self.size <= start + length


def _ffibuilder():
    from cffi import FFI

    from rings._build import CDEF, SOURCE
    ffi = FFI()
    ffi.cdef(CDEF + """
struct vq_rec_entry { uint64_t addr; uint64_t value; uint32_t size; uint32_t kind; };
void vq_rec_start(struct vq_rec_entry *buf, uint32_t cap, void (*hook)(const struct vq_rec_entry *));
uint32_t vq_rec_stop(uint32_t *lost);
""")
    ffi.set_source(MODULE, SOURCE, include_dirs=[CSRC], define_macros=[("VQ_RECORD", None)],
                   extra_compile_args=["-O2", "-std=gnu11"])
    return ffi


def _built():
    found = glob.glob(os.path.join(ROOT, "rings", "_virtq_rec*.so"))
    if not found:
        return False
    return os.path.getmtime(found[0]) >= max(os.path.getmtime(p) for p in SOURCES)


def build():
    """Compile rings._virtq_rec into rings/ unless it is up to date (one builder at a time)."""
    with open(os.path.join(ROOT, "rings", ".virtq_rec.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _built():
            return
        for old in glob.glob(os.path.join(ROOT, "rings", "_virtq_rec*.so")):
            os.unlink(old)
        with tempfile.TemporaryDirectory(prefix="virtq-rec-") as tmp:
            so = _ffibuilder().compile(tmpdir=tmp)
            shutil.copy(so, os.path.join(ROOT, "rings", os.path.basename(so)))


_engine = None


def c_engine():
    """rings/virtq.py loaded over the recording build, as the module ``rings.virtq_rec``."""
    global _engine
    if _engine is None:
        build()
        path = os.path.join(ROOT, "rings", "virtq.py")
        with open(path) as f:
            src = f.read()
        binding = "from ._virtq import ffi, lib"
        if src.count(binding) != 1:
            raise RuntimeError(f"rings/virtq.py no longer imports its C module as {binding!r}")
        spec = importlib.util.spec_from_loader("rings.virtq_rec", loader=None)
        mod = importlib.util.module_from_spec(spec)
        mod.__file__, mod.__package__ = path, "rings"
        sys.modules[spec.name] = mod
        exec(compile(src.replace(binding, "from ._virtq_rec import ffi, lib"), path, "exec"), mod.__dict__)
        _engine = mod
    return _engine


def host_address(buf, offset=0):
    return ctypes.addressof(ctypes.c_char.from_buffer(buf)) + offset


class Recorder:
    """One implementation ('c' or 'reference') with its log. ``mod`` has DriverQueue and DeviceQueue.

    ``with rec.capture(mem, hook=None) as log:`` logs every ring access made inside the block into ``log``
    (a list of Access, guest addresses through ``mem``). ``hook(access)`` runs right after each access, so it
    sees memory as a peer would at that instant (for example at the publishing store)."""

    CAPACITY = 1 << 16

    def __init__(self, name):
        self.name = name
        self.mod = c_engine() if name == "c" else importlib.import_module("rings.reference")

    @contextlib.contextmanager
    def capture(self, mem, hook=None):
        bases = [(host_address(r.buf, r.offset), r.gpa, r.size) for r in mem.regions]

        def access(kind, addr, size, value):
            gpa = None
            for host, g, n in bases:
                if kind != "F" and host <= addr < host + n:
                    gpa = g + addr - host
            a = Access(kind, gpa, size, value)
            log.append(a)
            if hook is not None:
                hook(a)

        log = []
        if self.name == "reference":
            self.mod.record(access)
            try:
                yield log
            finally:
                self.mod.record(None)
            return
        ffi, lib = self.mod.ffi, self.mod.lib
        buf = ffi.new("struct vq_rec_entry[]", self.CAPACITY)
        def on_access(e):
            access(chr(e.kind), e.addr, e.size, e.value)
        c_hook = ffi.NULL if hook is None else ffi.callback("void(*)(const struct vq_rec_entry *)", on_access)
        lib.vq_rec_start(buf, self.CAPACITY, c_hook)
        try:
            yield log
        finally:
            lost = ffi.new("uint32_t *")
            n = lib.vq_rec_stop(lost)
            assert lost[0] == 0, f"the recording build dropped {lost[0]} accesses (capacity {self.CAPACITY})"
            if hook is None:   # with a hook the entries were turned into Access as they came
                for i in range(n):
                    e = buf[i]
                    access(chr(e.kind), e.addr, e.size, e.value)
