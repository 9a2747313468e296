"""Spec-exact ring layouts: constants, sizes, alignments, numpy dtypes (virtio 1.2-1.4, little-endian).

The C structs of the same layouts are in csrc/virtq.h; tests check that both agree.
"""
from dataclasses import dataclass

import numpy as np

from .errors import ConfigError

# Feature bits (FEAT table, NET-39)
VIRTIO_NET_F_CSUM = 0
VIRTIO_NET_F_GUEST_CSUM = 1
VIRTIO_NET_F_MTU = 3
VIRTIO_NET_F_MAC = 5
VIRTIO_NET_F_MRG_RXBUF = 15
VIRTIO_NET_F_STATUS = 16
VIRTIO_NET_F_CTRL_VQ = 17
VIRTIO_NET_F_MQ = 22
VIRTIO_F_NOTIFY_ON_EMPTY = 24
VIRTIO_F_ANY_LAYOUT = 27
VIRTIO_F_INDIRECT_DESC = 28
VIRTIO_F_EVENT_IDX = 29
VHOST_USER_F_PROTOCOL_FEATURES = 30
VIRTIO_F_VERSION_1 = 32
VIRTIO_F_ACCESS_PLATFORM = 33
VIRTIO_F_RING_PACKED = 34
VIRTIO_F_IN_ORDER = 35
VIRTIO_F_ORDER_PLATFORM = 36
VIRTIO_F_NOTIFICATION_DATA = 38

FEATURE_NAMES = {
    VIRTIO_NET_F_CSUM: "CSUM", VIRTIO_NET_F_GUEST_CSUM: "GUEST_CSUM", VIRTIO_NET_F_MTU: "MTU",
    VIRTIO_NET_F_MAC: "MAC", VIRTIO_NET_F_MRG_RXBUF: "MRG_RXBUF", VIRTIO_NET_F_STATUS: "STATUS",
    VIRTIO_NET_F_CTRL_VQ: "CTRL_VQ", VIRTIO_NET_F_MQ: "MQ", VIRTIO_F_NOTIFY_ON_EMPTY: "NOTIFY_ON_EMPTY",
    VIRTIO_F_ANY_LAYOUT: "ANY_LAYOUT", VIRTIO_F_INDIRECT_DESC: "INDIRECT_DESC",
    VIRTIO_F_EVENT_IDX: "EVENT_IDX", VHOST_USER_F_PROTOCOL_FEATURES: "PROTOCOL_FEATURES",
    VIRTIO_F_VERSION_1: "VERSION_1", VIRTIO_F_ACCESS_PLATFORM: "ACCESS_PLATFORM",
    VIRTIO_F_RING_PACKED: "RING_PACKED", VIRTIO_F_IN_ORDER: "IN_ORDER",
    VIRTIO_F_ORDER_PLATFORM: "ORDER_PLATFORM", VIRTIO_F_NOTIFICATION_DATA: "NOTIFICATION_DATA",
}


def bit(n):
    return 1 << n


def has(features, n):
    return bool(features >> n & 1)


def feature_names(features):
    return [FEATURE_NAMES.get(b, f"bit{b}") for b in range(64) if features >> b & 1]


def virtio_net_hdr_size(features):
    """NET-02/NET-03: the virtio-net header is 12 bytes with VERSION_1, MRG_RXBUF or RING_PACKED, else 10."""
    return 12 if (has(features, VIRTIO_F_VERSION_1) or has(features, VIRTIO_NET_F_MRG_RXBUF)
                  or has(features, VIRTIO_F_RING_PACKED)) else 10


# Descriptor flags (SPLIT-L-03, PACKED-L-02)
VIRTQ_DESC_F_NEXT = 1
VIRTQ_DESC_F_WRITE = 2
VIRTQ_DESC_F_INDIRECT = 4
VIRTQ_DESC_F_AVAIL = 1 << 7
VIRTQ_DESC_F_USED = 1 << 15
# Split suppression flags (SPLIT-L-04/05)
VIRTQ_AVAIL_F_NO_INTERRUPT = 1
VIRTQ_USED_F_NO_NOTIFY = 1
# Packed event suppression (EVT-21)
RING_EVENT_FLAGS_ENABLE = 0
RING_EVENT_FLAGS_DISABLE = 1
RING_EVENT_FLAGS_DESC = 2

DESC_FLAG_NAMES = [(VIRTQ_DESC_F_NEXT, "NEXT"), (VIRTQ_DESC_F_WRITE, "WRITE"),
                   (VIRTQ_DESC_F_INDIRECT, "INDIRECT"), (VIRTQ_DESC_F_AVAIL, "AVAIL"),
                   (VIRTQ_DESC_F_USED, "USED")]


def desc_flag_names(flags):
    names = [n for v, n in DESC_FLAG_NAMES if flags & v]
    rest = flags & ~sum(v for v, _ in DESC_FLAG_NAMES)
    if rest:
        names.append(hex(rest))
    return "|".join(names) or "-"


MAX_QUEUE_SIZE = 32768
DESC_SIZE = 16

# numpy dtypes, little-endian, exactly the spec structs
split_desc_dtype = np.dtype([("addr", "<u8"), ("len", "<u4"), ("flags", "<u2"), ("next", "<u2")])
packed_desc_dtype = np.dtype([("addr", "<u8"), ("len", "<u4"), ("id", "<u2"), ("flags", "<u2")])
used_elem_dtype = np.dtype([("id", "<u4"), ("len", "<u4")])
event_suppress_dtype = np.dtype([("off_wrap", "<u2"), ("flags", "<u2")])


def avail_dtype(size):
    return np.dtype([("flags", "<u2"), ("idx", "<u2"), ("ring", "<u2", (size,)), ("used_event", "<u2")])


def used_dtype(size):
    return np.dtype([("flags", "<u2"), ("idx", "<u2"), ("ring", used_elem_dtype, (size,)),
                     ("avail_event", "<u2")])


def check_size(fmt, size):
    """Split: a power of 2 up to 32768 (SPLIT-L-06). Packed: any 1..32768 (PACKED-L-04)."""
    if fmt not in ("split", "packed"):
        raise ConfigError(f"ring format must be 'split' or 'packed', not {fmt!r}")
    if not isinstance(size, int) or not 1 <= size <= MAX_QUEUE_SIZE:
        raise ConfigError(f"queue size must be 1..{MAX_QUEUE_SIZE}, got {size!r}")
    if fmt == "split" and size & (size - 1):
        raise ConfigError(f"split queue size must be a power of 2, got {size}")


def area_sizes(fmt, size):
    """(descriptor area, driver area, device area) sizes in bytes, event fields included."""
    check_size(fmt, size)
    if fmt == "split":
        return DESC_SIZE * size, 6 + 2 * size, 6 + 8 * size
    return DESC_SIZE * size, 4, 4


ALIGN = {"split": (16, 2, 4), "packed": (16, 4, 4)}  # SPLIT-L-02, PACKED-L-03


def check_host_alignment(what, gpa, host, align):
    """A ring area must be aligned where this process maps it too: its fields are read and published with
    atomic accesses (a misaligned one is undefined behaviour, and a split lock where it crosses a cache line).
    A memory region whose mmap offset is not congruent to its guest address breaks that."""
    if host % align:
        raise ConfigError(f"{what} at guest address {gpa:#x} is mapped at a host address that is not "
                          f"{align}-byte aligned (the region's mmap offset and guest address disagree modulo "
                          f"{align})")


def align_up(x, a):
    return (x + a - 1) & ~(a - 1)


def odd_line_stride(size):
    """``size`` rounded up to an odd number of 64-byte cache lines: the distance to give buffers that are used side
    by side (the driver's pool, the backend's staging slots). A power-of-two distance puts the same bytes of every
    buffer (header, first frame lines) into the same few cache sets, where a ring's worth evict each other; an odd
    number of lines spreads them over every set, as DPDK's mempool pads its objects."""
    lines = -(-size // 64)
    return 64 * (lines | 1)


@dataclass(frozen=True)
class QueueLayout:
    """Where the three areas of one virtqueue live, as guest addresses."""

    fmt: str
    size: int
    desc: int
    driver: int  # split: avail ring; packed: driver event suppression
    device: int  # split: used ring; packed: device event suppression

    def __post_init__(self):
        check_size(self.fmt, self.size)
        for name, addr, a in zip(("desc", "driver", "device"), (self.desc, self.driver, self.device),
                                 ALIGN[self.fmt]):
            if addr % a:
                raise ConfigError(f"{self.fmt} {name} area at {addr:#x} is not {a}-byte aligned")

    @property
    def packed(self):
        return self.fmt == "packed"

    @classmethod
    def contiguous(cls, fmt, size, base, device_align=4096):
        """The layout DPDK's virtio_user uses: desc, then driver area, device area on the next page."""
        d, drv, _ = area_sizes(fmt, size)
        driver = base + d
        device = align_up(driver + drv, device_align)
        return cls(fmt, size, base, driver, device)

    def nbytes(self):
        """Bytes from desc to the end of the device area (for contiguous layouts)."""
        return self.device + area_sizes(self.fmt, self.size)[2] - self.desc

    @staticmethod
    def bytes_needed(fmt, size, device_align=4096):
        d, drv, dev = area_sizes(fmt, size)
        return align_up(d + drv, device_align) + dev


def need_event(event_idx, new_idx, old_idx):
    """virtq_need_event (EVT-18): notify iff event_idx lies in [old, new) modulo 2^16."""
    return ((new_idx - event_idx - 1) & 0xFFFF) < ((new_idx - old_idx) & 0xFFFF)


def packed_need_event(off_wrap, new, old, wrap_at_new, size):
    """EVT-23: the event offset is in the lap given by its wrap bit."""
    off, wrap = off_wrap & 0x7FFF, off_wrap >> 15
    if wrap != wrap_at_new:
        off -= size
    return need_event(off & 0xFFFF, new & 0xFFFF, old & 0xFFFF)
