"""Fuzz target ring_driver: the driver side over arbitrary device-written memory.

Two halves, chosen by the first byte:

* the ring engine's driver half (rings.virtq.DriverQueue, every variant): buffers added and published by the
  harness (with indirect tables when negotiated), then whatever a device may write (used ring entries and idx,
  packed used descriptors with either wrap bit, event suppression fields, raw bytes) between reclaims,
  kick_prepare and enable_calls. Oracle: every buffer reclaimed was added and is returned once, and the
  queue's in-flight count matches the harness's.
* the virtio-net driver (virtio.net RxQueue/TxQueue, csrc/vnet.h): Rx buffers posted, the device's used
  entries and the headers it writes into them (num_buffers for mergeable reassembly), Rx bursts; Tx bursts
  of pool packets (fast path, chained slow path, indirect), used entries, Tx cleanups. Oracle: every packet
  received is a pool buffer the driver owns, and freeing what it returns is never a bad free.

Every ring area, the Tx header and indirect areas and the buffer pool are separate exact-size heap blocks.
Expected: typed RingErrors (then the queue is broken for good) and ConfigErrors for out-of-contract adds.
"""
import numpy as np

from common import GuestMemory, Reader, SnapshotOnce, Writer
from rings import virtq
from rings.errors import ConfigError, RingError
from rings.layout import (VIRTIO_F_EVENT_IDX, VIRTIO_F_IN_ORDER, VIRTIO_F_INDIRECT_DESC, VIRTIO_F_RING_PACKED,
                          VIRTIO_F_VERSION_1, VIRTIO_NET_F_MRG_RXBUF, VIRTQ_DESC_F_AVAIL, VIRTQ_DESC_F_USED,
                          VIRTQ_DESC_F_WRITE, QueueLayout, area_sizes, bit)

SPLIT_SIZES = (1, 2, 4, 8, 16, 64)
PACKED_SIZES = (1, 2, 3, 5, 8, 13, 64)
MAX_OPS = 150


def features_of(cfg, packed):
    return ((bit(VIRTIO_F_RING_PACKED) if packed else 0) | (cfg >> 1 & 1) * bit(VIRTIO_F_IN_ORDER)
            | (cfg >> 2 & 1) * bit(VIRTIO_F_EVENT_IDX) | (cfg >> 3 & 1) * bit(VIRTIO_F_INDIRECT_DESC))


class DeviceWrites:
    """What a (hostile) device may write into one queue's memory."""

    def __init__(self, mem, prefix, packed, size):
        self.mem, self.p, self.packed, self.size = mem, prefix, packed, size
        self.used_idx = 0
        self.wrap = 1

    def used(self, r, ids):
        """One used entry: an id from `ids` (in flight) or any, a length, published."""
        k = r.u8()   # bits 0-1: an id in flight; 3: any slot (packed); 4: the other lap; 5: WRITE; 6-7: step/raw
        id = ids[r.below(len(ids))] if ids and k & 3 else (r.u16() if k & 4 else r.u32())
        ln = r.pick(0, 64, 1500, r.u16, r.u32)
        if self.packed:
            slot = r.below(self.size) if k & 8 else self.used_idx
            wrap = self.wrap ^ (k >> 4 & 1)
            f = ((VIRTQ_DESC_F_AVAIL | VIRTQ_DESC_F_USED) if wrap else 0) | (k >> 5 & 1) * VIRTQ_DESC_F_WRITE
            if k >> 6 == 3:
                f = r.u16()
            self.mem.write(self.p + "desc", 16 * slot + 8, ln.to_bytes(4, "little") + (id & 0xFFFF).to_bytes(2, "little")
                           + f.to_bytes(2, "little"))
            if slot == self.used_idx:
                self.used_idx += 1 + (r.u8() % 4 if k >> 6 == 2 else 0)
                if self.used_idx >= self.size:
                    self.used_idx, self.wrap = self.used_idx % self.size, self.wrap ^ 1
        else:
            slot = self.used_idx % self.size
            self.mem.write(self.p + "device", 4 + 8 * slot, (id & 0xFFFFFFFF).to_bytes(4, "little") + ln.to_bytes(4, "little"))
            step = 1 if k >> 6 == 0 else (r.u8() % (self.size + 2) if k >> 6 == 1 else r.u16())
            self.used_idx = (self.used_idx + step) & 0xFFFF
            self.mem.write(self.p + "device", 2, self.used_idx.to_bytes(2, "little"))

    def event(self, r):
        if self.packed:
            self.mem.write(self.p + "device", 0, r.bytes(4))
        else:   # used flags, or avail_event
            off = 0 if r.u8() & 1 else 4 + 8 * self.size
            self.mem.write(self.p + "device", off, r.bytes(2))

    def raw(self, r):
        area = self.p + r.choice(("desc", "driver", "device"))
        self.mem.write(area, r.u16(), r.bytes(r.u8() % 32))


# ---- the ring engine's driver half -------------------------------------------------------------------

class RingHarness(SnapshotOnce):
    DATA, IND = 0x80000, 0x90000

    def __init__(self, r, cfg):
        self.packed = bool(cfg >> 4 & 1)
        fmt = "packed" if self.packed else "split"
        self.size = size = r.choice(PACKED_SIZES if self.packed else SPLIT_SIZES)
        dsz, drv, dev = area_sizes(fmt, size)
        self.ind_max = max(2, min(4, size))
        areas = [("desc", 0x10000, dsz), ("driver", 0x20000, drv), ("device", 0x30000, dev),
                 ("data", self.DATA, 0x1000)]
        if size >= 2:
            areas.append(("ind", self.IND, size * self.ind_max * 16))
        self.mem = GuestMemory(areas)
        layout = QueueLayout(fmt, size, 0x10000, 0x20000, 0x30000)
        self.q = virtq.DriverQueue(self.mem.table, layout, features_of(cfg, self.packed),
                                   indirect=(self.IND, self.ind_max) if size >= 2 else None)
        self.dev = DeviceWrites(self.mem, "", self.packed, size)
        self.outstanding = {}   # token -> id-less record of buffers added and not reclaimed
        self.token = 0

    def add(self, r):
        nbufs = r.u8() % 4 + 1
        nread, nwrite, addrs, lens = [], [], [], []
        for _ in range(nbufs):
            k = r.u8()   # bits 0-1: readable segments, 2-3: writable ones (0-2 each, at least one)
            rd, wr = (k & 3) % 3, (k >> 2 & 3) % 3
            if rd + wr == 0:
                wr = 1
            nread.append(rd)
            nwrite.append(wr)
            for _ in range(rd + wr):
                addrs.append(self.DATA + r.u8() * 16)
                lens.append(r.pick(64, 0, 1500, r.u16))
        tokens = list(range(self.token, self.token + nbufs))
        try:
            n = self.q.add(addrs, lens, nread, nwrite, tokens) if r.u8() & 1 else \
                self.q.add_simple(addrs[:nbufs], lens[:nbufs], tokens, writable=bool(k & 1))
        except ConfigError:   # a chain longer than the queue: refused up front, nothing added
            return
        for t in tokens[:n]:
            self.outstanding[t] = True
        self.token += nbufs

    def reclaim(self, r):
        tokens, lens = self.q.reclaim(r.u8() % 40 or None)
        for t in tokens.tolist():
            assert self.outstanding.pop(t, None), f"token {t} reclaimed but not in flight"
        assert self.q.inflight == len(self.outstanding), (self.q.inflight, len(self.outstanding))

    def ids(self):
        """The ids the device would see in flight (split: heads; packed: buffer ids)."""
        return np.nonzero(self.q.id_inflight)[0].tolist()

    def run(self, r):
        ops = {"add": self.add, "publish": lambda r: self.q.publish(), "kick": lambda r: self.q.kick_prepare(),
               "calls": lambda r: self.q.enable_calls(r.u8() & 1), "used": lambda r: self.dev.used(r, self.ids()),
               "event": lambda r: self.dev.event(r), "raw": lambda r: self.dev.raw(r), "reclaim": self.reclaim,
               "snapshot": lambda r: self.snapshot()}
        for _ in range(MAX_OPS):
            if not r.left:
                return
            try:
                ops[RING_OPS[r.below(len(RING_OPS))]](r)
            except RingError as e:
                assert self.q.broken is e
                self.snapshot()
                return
            c = self.q.c
            assert c.num_free <= self.size and c.inflight <= self.size, self.q.state()
            if self.packed:
                assert c.last_used < self.size and c.next_avail < self.size, self.q.state()


# ---- the virtio-net driver ----------------------------------------------------------------------------

class NetMemory:
    """What virtio.net's RxQueue/TxQueue read from their GuestMemory, as separate exact-size areas."""
    RX, TX, HDR, POOL = 0x10000, 0x20000, 0x30000, 0x100000

    def __init__(self, fmt, size, nbufs, buf_size, indirect_max=4):
        from virtio.pool import HEADROOM, BufferPool, pool_stride
        dsz, drv, dev = area_sizes(fmt, size)
        areas = []
        for prefix, base in (("rx_", self.RX), ("tx_", self.TX)):
            areas += [(prefix + "desc", base, dsz), (prefix + "driver", base + 0x4000, drv),
                      (prefix + "device", base + 0x8000, dev)]
        # Tx header slots, then the indirect tables (one area: a MemoryTable holds 8 regions)
        areas += [("hdr", self.HDR, size * 16 + size * indirect_max * 16), ("pool", self.POOL, nbufs * pool_stride(buf_size))]
        self.g = GuestMemory(areas)
        self.table = self.g.table
        self.rx_layout = QueueLayout(fmt, size, self.RX, self.RX + 0x4000, self.RX + 0x8000)
        self.tx_layout = QueueLayout(fmt, size, self.TX, self.TX + 0x4000, self.TX + 0x8000)
        self.gpa, self.hdr_off, self.ind_off, self.indirect_max = 0, self.HDR, self.HDR + size * 16, indirect_max
        self.hdr_view = self.g.arrays["hdr"][:size * 16]
        self.pool = BufferPool(self.g.arrays["pool"], self.POOL, nbufs, buf_size, HEADROOM)


class NetHarness:
    def __init__(self, r, cfg):
        from virtio.net import RxQueue, TxQueue
        self.packed = bool(cfg >> 4 & 1)
        fmt = "packed" if self.packed else "split"
        self.size = size = r.choice(PACKED_SIZES[1:] if self.packed else SPLIT_SIZES[1:])
        features = features_of(cfg, self.packed) | bit(VIRTIO_F_VERSION_1) | (cfg >> 5 & 1) * bit(VIRTIO_NET_F_MRG_RXBUF)
        self.nbufs = 4 * size + 16
        self.mem = NetMemory(fmt, size, self.nbufs, 256, indirect_max=min(4, size))
        self.pool = self.mem.pool
        self.rx = RxQueue(self.mem, features, burst=8)
        # bit 7: --tx-hdr indirect (with INDIRECT_DESC negotiated): its own fast path, one-segment packets as
        # two-entry tables (vq_drv_add_hdr_table), over the same device-written memory
        hdr = "indirect" if cfg >> 7 & 1 and features & bit(VIRTIO_F_INDIRECT_DESC) else "headroom"
        self.tx = TxQueue(self.mem, features, force_slow=bool(cfg >> 6 & 1), hdr=hdr)
        self.rxdev = DeviceWrites(self.mem.g, "rx_", self.packed, size)
        self.txdev = DeviceWrites(self.mem.g, "tx_", self.packed, size)
        self.held = set()   # packets (first buffers) the harness owns

    def rx_burst(self, r):
        idx, lens = self.rx.burst(r.u8() % 16 + 1)
        for b in idx.tolist():
            assert self.pool.owned[b], f"Rx returned buffer {b}, which the pool says is free"
            assert b not in self.held, f"Rx returned buffer {b} twice"
        before = self.pool.bad_frees
        self.pool.free(idx)
        assert self.pool.bad_frees == before, "a received packet was freed twice"

    def header(self, r):
        """The device writes a virtio-net header (num_buffers) or data into a posted Rx buffer."""
        b = r.below(self.nbufs)
        at = b * self.mem.pool.stride   # buffers are pool_stride(256) apart, not 256
        off = at + self.mem.pool.headroom - 12 if r.u8() & 1 else at + r.u8()
        self.mem.g.write("pool", off, r.bytes(r.u8() % 16))

    def tx_burst(self, r):
        n = r.u8() % 8 + 1
        bufs = self.pool.alloc(n)
        idx = []
        for b in bufs.tolist():
            k = r.u8()
            if k & 1 and self.pool.available:   # a chained packet of two buffers
                nxt = int(self.pool.alloc(1)[0])
                self.pool.chain([b, nxt])
                self.pool.data_len[nxt] = r.u8()
            self.pool.data_len[b] = 14 + r.u8()
            if k & 2:
                self.pool.data_off[b] = r.u8()   # no headroom: the slow path
            idx.append(b)
        lens = [int(self.pool.data_len[b]) + (r.u8() if r.u8() & 1 else 0) for b in idx]
        sent = self.tx.burst(np.array(idx, np.uint32), np.array(lens, np.uint32), more=bool(r.u8() & 1))
        self.pool.free(np.array(idx[sent:], np.uint32))

    def run(self, r):
        self.rx.fill()
        ops = {"rx_burst": self.rx_burst, "rx_used": lambda r: self.rxdev.used(r, self.rx_ids()),
               "rx_header": self.header, "rx_event": lambda r: self.rxdev.event(r),
               "rx_raw": lambda r: self.rxdev.raw(r), "rx_fill": lambda r: self.rx.fill(),
               "tx_burst": self.tx_burst, "tx_used": lambda r: self.txdev.used(r, self.tx_ids()),
               "tx_cleanup": lambda r: self.tx.cleanup(r.u8() % (self.size + 1)), "tx_flush": lambda r: self.tx.flush(),
               "tx_raw": lambda r: self.txdev.raw(r)}
        for _ in range(MAX_OPS):
            if not r.left:
                return
            try:
                ops[NET_OPS[r.below(len(NET_OPS))]](r)
            except RingError as e:
                assert e in (self.rx.vq.broken, self.tx.vq.broken)
                return
            assert 0 <= self.pool.available <= self.nbufs

    def rx_ids(self):
        return np.nonzero(self.rx.vq.id_inflight)[0].tolist()

    def tx_ids(self):
        return np.nonzero(self.tx.vq.id_inflight)[0].tolist()


RING_OPS = ("add", "add", "publish", "kick", "calls", "used", "used", "event", "raw", "reclaim", "reclaim",
            "snapshot")
NET_OPS = ("rx_burst", "rx_burst", "rx_used", "rx_header", "rx_used", "rx_event", "rx_raw", "tx_burst", "tx_used",
           "tx_cleanup", "tx_flush", "tx_raw", "rx_fill")


def TestOneInput(data):
    r = Reader(data)
    cfg = r.u8()
    h = (NetHarness if cfg & 1 else RingHarness)(r, cfg)
    h.run(r)
    return h


# ---- seeds: a device that behaves, for each variant (the same encoding, written) ------------------------

def _used(w, packed, index, length_sel=1, write=False, advance=1):
    """A used entry for ids[index] (the index-th buffer in flight, by id), of length choice length_sel; the used
    position moves by `advance` (split: buffers, packed: descriptors)."""
    step = 0 if advance == 1 else (1 if not packed else 2)
    w.u8(1 | write << 5 | step << 6).u8(index).u8(length_sel)
    if step:
        w.u8(advance if not packed else advance - 1)


def seeds():
    out = []
    for packed in (0, 1):
        for in_order in (0, 1):
            for event_idx in (0, 1):
                # the ring engine: 4 writable buffers, published; the device uses them (in order: one entry for
                # the last, INORDER-06/11), the driver reclaims; twice, so that positions move on
                cfg = in_order << 1 | event_idx << 2 | 1 << 3 | packed << 4
                w = Writer().u8(cfg).u8((PACKED_SIZES if packed else SPLIT_SIZES).index(8))
                for _ in range(2):
                    w.u8(RING_OPS.index("add")).u8(3)
                    for b in range(4):
                        w.u8(0b0100).u8(b).u8(0)        # no readable, one writable segment, 64 bytes
                    w.u8(1)                             # add (not add_simple)
                    w.u8(RING_OPS.index("publish")).u8(RING_OPS.index("kick"))
                    for b in ((3,) if in_order else range(4)):
                        w.u8(RING_OPS.index("used"))
                        _used(w, packed, b, write=True, advance=4 if in_order else 1)
                    w.u8(RING_OPS.index("reclaim")).u8(0)
                    w.u8(RING_OPS.index("calls")).u8(1)
                out.append(w.bytes())
                # the virtio-net driver: Rx buffers used (mergeable: a 2-buffer packet), Tx packets sent and used
                mrg = event_idx
                cfg = 1 | in_order << 1 | 1 << 3 | packed << 4 | mrg << 5
                w = Writer().u8(cfg).u8((PACKED_SIZES[1:] if packed else SPLIT_SIZES[1:]).index(8))
                if mrg:   # the first Rx buffer's header says num_buffers = 2
                    w.u8(NET_OPS.index("rx_header")).u8(0).u8(1).u8(12).raw(bytes(10) + b"\x02\x00")
                for b in range(2):   # per buffer, also in order (the virtio PMD reads Rx lengths per buffer)
                    w.u8(NET_OPS.index("rx_used"))
                    _used(w, packed, b, write=True)
                w.u8(NET_OPS.index("rx_burst")).u8(7)
                w.u8(NET_OPS.index("tx_burst")).u8(2)                     # 3 packets
                for k in (0, 1, 2):                                       # fast path, chained, no headroom
                    w.u8(k).u8(40 + k)
                    if k == 1:
                        w.u8(20)
                    if k == 2:
                        w.u8(64)
                w.u8(0).u8(0).u8(0).u8(0)                                 # no extra length; kick now
                for b in ((2,) if in_order else range(3)):
                    w.u8(NET_OPS.index("tx_used"))
                    _used(w, packed, b, length_sel=0, advance=3 if in_order else 1)
                w.u8(NET_OPS.index("tx_cleanup")).u8(0)
                w.u8(NET_OPS.index("rx_fill"))
                out.append(w.bytes())
    return out
