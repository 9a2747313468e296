"""cffi builder for vhost._net: the backend's burst loops (csrc/vhost_net.h) over the ring primitives.

The ring structs are declared once, in rings/csrc/virtq_types.h; ``rings._build.ring_cdef()`` gives them to
this module's cdef and ``include_dirs`` gives the static inline primitives to its C code. rings/_build.py is
loaded by file path, so building this module never imports the (maybe not yet built) ``rings`` package.
"""
import importlib.util
import os

from cffi import FFI

HERE = os.path.dirname(os.path.abspath(__file__))
VHOST_CSRC = os.path.join(HERE, "csrc")
_spec = importlib.util.spec_from_file_location(
    "_rings_build", os.path.join(os.path.dirname(HERE), "rings", "_build.py"))
_rings_build = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_rings_build)
RINGS_CSRC = _rings_build.CSRC


def _types():
    import re
    with open(os.path.join(VHOST_CSRC, "vhost_net_types.h")) as f:
        return re.sub(r"/\*.*?\*/", "", f.read(), flags=re.S)


CDEF = _rings_build.ring_cdef() + _types() + """
int vh_run(struct vh_net *n, uint32_t max_iters, uint64_t budget_ns);
int vh_dequeue(struct vh_net *n);
int vh_txq_flush(struct vh_net *n);
uint32_t vh_discard(struct vh_net *n);
extern "Python" void vh_test_hook(void *, uint32_t, uint32_t, uint32_t);
"""

ffibuilder = FFI()
ffibuilder.cdef(CDEF)
ffibuilder.set_source(
    "vhost._net",
    '#include "vhost_net.h"',
    include_dirs=[VHOST_CSRC, RINGS_CSRC],
    extra_compile_args=["-O3", "-std=gnu11"],
    depends=[os.path.join(RINGS_CSRC, n) for n in ("virtq.h", "virtq_types.h")]
    + [os.path.join(VHOST_CSRC, n) for n in ("vhost_net.h", "vhost_net_types.h")],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
