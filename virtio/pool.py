"""The buffer pool: fixed-size buffers with headroom in guest memory (like DPDK mbufs).

A packet is the index of its first buffer (numpy ``uint32``); its bytes start at ``data_off[i]`` and, for a
multi-buffer (mergeable) packet, continue in ``next[i]``'s buffer. Allocation and freeing happen in C
(``vn_pool_alloc``/``vn_pool_free``), a burst at a time; nothing is allocated per packet.
"""
import numpy as np

from rings.errors import ConfigError
from rings.layout import odd_line_stride

from ._net import ffi, lib

NONE = 0xFFFFFFFF


#: Pool buffers' headroom: the Tx header's room on the fast path, where the Rx header lands. 128 + 12 starts the
#: 12-byte header on a cache line, followed by the frame's first 52 bytes: macfwd rewrites the header (NET-06:
#: num_buffers back to 0) and the MACs and stamp in ONE line, not two, which halves the lines that cross to the
#: device's core and back per forwarded packet.
HEADROOM = 128 + 12


#: Data bytes a buffer holds at least after its headroom: the data path reads and writes a frame's MACs (macfwd
#: swaps them in place) and its timestamp (packets.TS_OFF, 8 bytes) in its first buffer only. 52 is what the
#: smallest buffer (192) leaves after the default headroom.
MIN_ROOM = 52
MAX_HEADROOM = 0xFFFF   # data_off is 16 bits


def check_geometry(buf_size, headroom):
    """Buffers the pool can be made of (ConfigError otherwise)."""
    if not 12 <= headroom <= MAX_HEADROOM or buf_size - headroom < MIN_ROOM or buf_size % 64:
        raise ConfigError(f"pool: need 12 <= headroom <= {MAX_HEADROOM}, buf_size - headroom >= {MIN_ROOM} (a "
                          f"frame's MACs and timestamp in its first buffer) and buf_size a multiple of 64 "
                          f"(headroom={headroom}, buf_size={buf_size})")


def _ptr(ctype, arr):
    return ffi.cast(ctype, ffi.from_buffer(arr))


def pool_stride(buf_size):
    """Bytes from one pool buffer to the next (``rings.layout.odd_line_stride``): ``buf_size`` when it is an odd
    number of cache lines, else 64 more. Measured: our driver in front of net_vhost, packed, one burst in flight,
    +7% (--buf-size 2048 against 2112, which is what the stride does)."""
    return odd_line_stride(buf_size)


class BufferPool:
    """``nbufs`` buffers of ``buf_size`` bytes, ``pool_stride(buf_size)`` apart, at guest address ``gpa``, mapped
    at ``view`` (a writable buffer of at least ``nbufs * pool_stride(buf_size)`` bytes) in this process. Packet
    data starts ``headroom`` bytes in, which leaves room for the virtio-net header (Tx fast path, Rx header
    landing)."""

    def __init__(self, view, gpa, nbufs, buf_size=2048, headroom=HEADROOM):
        check_geometry(buf_size, headroom)
        self.gpa, self.nbufs, self.buf_size, self.headroom = gpa, nbufs, buf_size, headroom
        self.stride = pool_stride(buf_size)
        self.mem = np.frombuffer(view, np.uint8, count=nbufs * self.stride)
        self.stack = np.arange(nbufs - 1, -1, -1, dtype=np.uint32)  # pops 0, 1, 2, ... first
        self.owned = np.zeros(nbufs, np.uint8)
        self.data_off = np.full(nbufs, headroom, np.uint16)
        self.data_len = np.zeros(nbufs, np.uint32)
        self.next = np.full(nbufs, NONE, np.uint32)
        c = self.c = ffi.new("struct vn_pool *")
        c.host = ffi.cast("uint8_t *", ffi.from_buffer(self.mem))
        c.gpa, c.buf_size, c.stride, c.headroom, c.nbufs, c.top = gpa, buf_size, self.stride, headroom, nbufs, nbufs
        c.stack = _ptr("uint32_t *", self.stack)
        c.owned = _ptr("uint8_t *", self.owned)
        c.data_off = _ptr("uint16_t *", self.data_off)
        c.data_len = _ptr("uint32_t *", self.data_len)
        c.next = _ptr("uint32_t *", self.next)
        self._scratch = np.zeros(max(nbufs, 1), np.uint32)

    @property
    def available(self):
        return int(self.c.top)

    @property
    def bad_frees(self):
        return int(self.c.bad_frees)

    def alloc(self, n):
        """Up to n fresh buffers (a view into a scratch array, valid until the next alloc)."""
        k = lib.vn_pool_alloc(self.c, _ptr("uint32_t *", self._scratch), n)
        return self._scratch[:k].copy()

    def free(self, idx):
        idx = np.ascontiguousarray(idx, np.uint32)
        lib.vn_pool_free(self.c, _ptr("uint32_t *", idx), len(idx))

    # -- per-packet helpers for tests and tools (not the hot path) -----------------------------------------

    def gpa_of(self, b):
        return self.gpa + int(b) * self.stride

    def data(self, b):
        """The bytes of packet b (all its segments)."""
        out = bytearray()
        b = int(b)
        while b != NONE:
            start = b * self.stride + int(self.data_off[b])
            out += self.mem[start:start + int(self.data_len[b])].tobytes()
            b = int(self.next[b])
        return bytes(out)

    def write(self, b, data, data_off=None):
        """Put data into buffer b (one segment) at data_off (default: after the headroom)."""
        b = int(b)
        off = self.headroom if data_off is None else data_off
        if off + len(data) > self.buf_size:
            raise ConfigError(f"{len(data)} bytes at offset {off} do not fit a {self.buf_size}-byte buffer")
        self.data_off[b] = off
        self.data_len[b] = len(data)
        start = b * self.stride + off
        self.mem[start:start + len(data)] = np.frombuffer(bytes(data), np.uint8)

    def chain(self, bufs):
        """Link buffers into one multi-segment packet (first buffer's index is the packet)."""
        for a, b in zip(bufs, bufs[1:]):
            self.next[int(a)] = int(b)
        self.next[int(bufs[-1])] = NONE
        return int(bufs[0])
