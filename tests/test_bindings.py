"""The ring primitives that virtio/_build.py declares again for virtio._net keep the C types rings/_build.py gives
them: a stale declaration compiles (every primitive is static inline, included), and Python calling it through
virtio._net silently gets something else (vq_drv_publish declared void there: None instead of the stores made)."""
from rings import _virtq
from virtio import _net


def test_ring_primitives_declared_again_keep_their_c_types():
    shared = sorted(n for n in dir(_net.lib) if n.startswith("vq_") and hasattr(_virtq.lib, n))
    assert "vq_drv_publish" in shared
    for name in shared:
        mine = _net.ffi.getctype(_net.ffi.typeof(getattr(_net.lib, name)))
        rings = _virtq.ffi.getctype(_virtq.ffi.typeof(getattr(_virtq.lib, name)))
        assert mine == rings, f"virtio._net: {name} is declared {mine}, rings/_build.py says {rings}"
