"""cffi builder for rings._virtq: the ring primitives of csrc/virtq.h exposed as burst calls."""
import glob
import os
import re

from cffi import FFI

CSRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")


def cdef_of(path):
    """A declarations-only header as cffi cdef text (comments stripped)."""
    with open(path) as f:
        return re.sub(r"/\*.*?\*/", "", f.read(), flags=re.S)


def ring_cdef():
    """The declarations of csrc/virtq_types.h, for other packages' builders to reuse."""
    return cdef_of(os.path.join(CSRC, "virtq_types.h"))


def package_ffi(module, csrc, header, types_header, functions, opt="-O2", extra_compile_args=(),
                extra_link_args=()):
    """The FFI builder of another package's C burst loops: its ``header`` (in ``csrc``) includes the ring
    primitives of csrc/virtq.h; the cdef is the ring structs, then ``types_header``, then ``functions``.
    (``extra_*_args``: for separate builds such as fuzz/'s sanitizer build; the package build uses none.)"""
    ffi = FFI()
    ffi.cdef(ring_cdef() + cdef_of(os.path.join(csrc, types_header)) + functions)
    ffi.set_source(module, f'#include "{header}"', include_dirs=[csrc, CSRC],
                   extra_compile_args=[opt, "-std=gnu11", *extra_compile_args],
                   extra_link_args=list(extra_link_args),
                   depends=sorted(glob.glob(os.path.join(csrc, "*.h")))   # every header it may include
                   + [os.path.join(CSRC, n) for n in ("virtq.h", "virtq_types.h", "guest_fault.h")])
    return ffi


CDEF = ring_cdef() + """
uint32_t vq_drv_add(struct vq_driver *q, const uint64_t *addrs, const uint32_t *lens,
                    const uint16_t *nread, const uint16_t *nwrite, const uint64_t *tokens, uint32_t n);
uint32_t vq_drv_add_simple(struct vq_driver *q, const uint64_t *addrs, const uint32_t *lens, int writable,
                           const uint64_t *tokens, uint32_t n);
int vq_drv_publish(struct vq_driver *q);
int vq_drv_kick_prepare(struct vq_driver *q);
int vq_drv_reclaim(struct vq_driver *q, uint64_t *tokens, uint32_t *lens, uint32_t max);
void vq_drv_enable_calls(struct vq_driver *q, int on);
int vq_dev_set_base(struct vq_device *q, uint32_t base, uint32_t taken);
int vq_dev_poll(struct vq_device *q, struct vq_chains *c, uint32_t max);
int vq_dev_push_used(struct vq_device *q, const uint32_t *ids, const uint32_t *lens, uint32_t n);
void vq_dev_flush(struct vq_device *q);
int vq_dev_call_prepare(struct vq_device *q);
void vq_dev_enable_kicks(struct vq_device *q, int on);
uint8_t *vq_translate(const struct vq_mem *m, uint64_t gpa, uint64_t len);
int gf_watch_add(uintptr_t lo, size_t len, size_t align);
void gf_watch_remove(int slot);
unsigned long gf_watch_faults(int slot, uintptr_t *lowest);
unsigned long gf_watch_total(void);
double probe_line_transfer_ns(int cpu_a, int cpu_b, uint64_t budget_ns);
"""


# what rings._virtq compiles (tests/conformance/recording.py builds the same with VQ_RECORD)
SOURCE = '#include "probe.h"\n#include "virtq.h"\n#include "guest_fault.h"'
HEADERS = ("virtq.h", "virtq_types.h", "guest_fault.h", "probe.h")


def rings_ffi(opt="-O2", extra_compile_args=(), extra_link_args=()):
    """The FFI builder of rings._virtq (``extra_*_args``: for separate builds, e.g. fuzz/'s sanitizer build)."""
    ffi = FFI()
    ffi.cdef(CDEF)
    ffi.set_source(
        "rings._virtq",
        SOURCE,
        include_dirs=[CSRC],
        extra_compile_args=[opt, "-std=gnu11", *extra_compile_args],
        extra_link_args=list(extra_link_args),
        depends=[os.path.join(CSRC, n) for n in HEADERS],
    )
    return ffi


ffibuilder = rings_ffi()

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
