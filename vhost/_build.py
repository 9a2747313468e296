"""cffi builder for vhost._net: the backend's burst loops (csrc/vhost_net.h) over the ring primitives of
rings/csrc/virtq.h (included, not linked: every primitive is static inline)."""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
from rings._build import package_ffi  # noqa: E402

FUNCTIONS = """
int vh_run(struct vh_net *n, uint32_t max_iters, uint64_t budget_ns);
int vh_dequeue_guarded(struct vh_net *n);
int vh_txq_flush_guarded(struct vh_net *n);
int gf_install(void);
int vh_copy_guarded(void *dst, const void *src, size_t len);
int vh_enable_kicks_guarded(struct vq_device *q, int on);
uint32_t vh_discard(struct vh_net *n);
int vhi_poll(struct vq_device *q, struct vq_chains *c, uint32_t max, struct vh_inflight *f);
void vhi_flush(struct vq_device *q, struct vh_inflight *f);
extern "Python" void vh_test_hook(void *, uint32_t, uint32_t, uint32_t);
"""


def build_ffi(opt="-O3", **kw):
    """The FFI builder (``kw``: package_ffi's build options; the package build passes none)."""
    return package_ffi("vhost._net", os.path.join(HERE, "csrc"), "vhost_net.h", "vhost_net_types.h", FUNCTIONS,
                       opt=opt, **kw)


ffibuilder = build_ffi()

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
