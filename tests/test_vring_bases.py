"""vring driver: the vring bases a backend returns at the stop (GET_VRING_BASE), checked."""
from virtio.app import vring_base_warnings


def test_vring_bases_that_are_no_ring_position_are_reported():
    """A backend's GET_VRING_BASE reply at the stop was printed in the report whatever it was (0xffffffff
    included). It is still not fatal (the driver resumes from its own positions) but now warned about."""
    assert vring_base_warnings({0: 0x40, 1: 0xFFFF}, False, 256) == []
    assert vring_base_warnings({0: 0x8070, 1: 0x00FF}, True, 256) == []
    assert vring_base_warnings({0: 0x80708070}, True, 256) == []   # newer QEMU: used index and wrap in 16-31
    w = vring_base_warnings({0: 0x10000, 1: 0xFFFFFFFF}, False, 256)
    assert len(w) == 2 and "vring 1 returned 0xffffffff" in w[1] and "16-bit" in w[1]
    assert len(vring_base_warnings({0: 0x8100, 1: 0xFFFFFFFF}, True, 256)) == 2   # slot 256 of 256
    assert len(vring_base_warnings({0: 0x81008000}, True, 256)) == 1              # used slot 256
