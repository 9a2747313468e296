"""What the tap knows of the device between the two peers, learned only from the messages it relays.

The frontend's memory regions (SET_MEM_TABLE) are mapped here read-only, as the backend maps them; the
vrings' size, addresses, base and state come from SET_VRING_NUM/ADDR/BASE/KICK/ENABLE, the ring format
from SET_FEATURES, the backend's position at a stop from the GET_VRING_BASE reply. The picture stays
current across GET_VRING_BASE (the vring is marked stopped, its base kept) and reconnects (a new session
numbers its vrings anew; the last session's memory stays mapped, so the rings a peer left behind can still
be dumped, until the next SET_MEM_TABLE replaces it).

``Picture.view(index)`` gives a read-only observer of one vring for ``rings.ctl`` / ``rings.rawdump``
(side 'memory': ring memory decoded without either peer's private state) with what the tap knows
besides in ``meta`` (and as text lines in ``meta['notes']``). Every method takes the picture's lock: the
relay thread writes, the control socket, the notification relay and the capture read.
"""
import dataclasses
import mmap
import os
import threading
import time
from dataclasses import dataclass, field

from rings import vhost_user as vu
from rings.errors import VringError
from rings.layout import (VIRTIO_F_IN_ORDER, VIRTIO_F_RING_PACKED, QueueLayout, align_up, area_sizes, feature_names,
                          has)
from rings.shm import MemoryTable, WatchedMemoryTable, seal_shrink

R = vu.VhostUserRequest
STATUS_NAMES = {1: "ACKNOWLEDGE", 2: "DRIVER", 4: "DRIVER_OK", 8: "FEATURES_OK", 0x40: "NEEDS_RESET",
                0x80: "FAILED"}


def queue_name(index):
    """virtio-net: vring 2k is receiveq k+1 (the device writes it), 2k+1 transmitq k+1 (NET-04)."""
    pair, tx = divmod(index, 2)
    return ("tx" if tx else "rx") + (str(pair) if pair else "")


def decode_base(num, packed):
    """SET/GET_VRING_BASE ``num`` in words: split, the avail index; packed, bits 0-14 the avail index and
    bit 15 its wrap counter (bits 16-31: used index and wrap, newer QEMU only)."""
    if not packed:
        return f"{num & 0xFFFF}"
    text = f"{num:#x} (avail {num & 0x7FFF} wrap {num >> 15 & 1}"
    if num >> 16:
        text += f", used {num >> 16 & 0x7FFF} wrap {num >> 31 & 1}"
    return text + ")"


class MappedRegion:
    """One SET_MEM_TABLE region mapped read-only from its fd (mapped from file offset 0 up to mmap_offset +
    size, as DPDK maps it, so mmap_offset need not be page-aligned). The capture and the dumps read it through
    views; a region the frontend did not let us seal (POSIX shm) and then truncates reads as zeros from then on
    (the buffer table is a WatchedMemoryTable), and both stop reading it and say so. Known limit: a truncation
    inside a page makes that page's tail read zeros with no fault, and the tap (which keeps no fd to compare
    sizes with) captures such bytes as they read; `vring conform driver` compares its regions' file sizes."""

    def __init__(self, region, fd):
        self.region = region
        self.sealed = seal_shrink(fd, f"region gpa {region.gpa:#x}")   # before the size is checked
        st = os.fstat(fd)
        need = region.mmap_offset + region.size
        if st.st_size and need > st.st_size:
            raise VringError(f"region {region.gpa:#x}+{region.size:#x} at offset {region.mmap_offset:#x} "
                             f"does not fit its file ({st.st_size:#x} bytes)")
        length = need
        if st.st_blksize and st.st_size >= align_up(need, st.st_blksize):
            length = align_up(need, st.st_blksize)  # hugetlbfs maps whole huge pages
        self.mm = mmap.mmap(fd, length, mmap.MAP_SHARED, mmap.PROT_READ)
        # what the region shows: the same file at the same place is the same memory, whatever mapping reads it
        self.ident = (region.gpa, region.size, region.uaddr, region.mmap_offset, st.st_dev, st.st_ino)


@dataclass
class Vring:
    index: int
    conn: int
    num: int | None = None
    addr: vu.VringAddr | None = None
    base: int | None = None              # SET_VRING_BASE num
    stopped_base: int | None = None      # GET_VRING_BASE reply num (the backend's position when stopped)
    kick: str | None = None              # 'fd' | 'nofd' (None: not sent)
    call: str | None = None
    enabled: bool | None = None
    state: str = "configuring"           # configuring | started | stopped | disconnected
    kicks: int = 0                       # --notify-tap: eventfd writes counted, and reads of them
    kick_reads: int = 0
    kick_t: float | None = None
    calls: int = 0
    call_reads: int = 0
    call_t: float | None = None
    capture: dict = field(default_factory=dict)


class Picture:
    def __init__(self, notify_tap=False, on_vring=None):
        self.lock = threading.RLock()
        self.notify_tap = notify_tap
        self.on_vring = on_vring       # called with a vring index the first time it is set up
        self.conn = 0
        self.connected = False
        self.features = None           # acked (SET_FEATURES)
        self.offered = None            # GET_FEATURES reply
        self.protocol = None           # SET_PROTOCOL_FEATURES
        self.protocol_offered = None
        self.status = None
        self.regions = []              # MappedRegion
        self.ring_mem = None           # MemoryTable in userspace-address space (ring addresses)
        self.buf_mem = None            # WatchedMemoryTable in guest-physical space (descriptor addresses): its
        #                                watches cover the same mappings as ring_mem's
        self.mem_conn = 0
        self.vrings = {}
        self.notes = []                # what went wrong while learning (a region that would not map, ...)
        self.generation = 0            # bumped whenever memory or a vring's layout changes

    # -- sessions ----------------------------------------------------------------------------------------

    def session_start(self):
        with self.lock:
            self.conn += 1
            self.connected = True
            self.features = self.offered = self.protocol = self.protocol_offered = self.status = None
            self.generation += 1
            return self.conn

    def session_end(self):
        with self.lock:
            self.connected = False
            for v in self.vrings.values():
                v.state = "disconnected"
            self.generation += 1

    # -- learning ----------------------------------------------------------------------------------------

    def _vring(self, index):
        v = self.vrings.get(index)
        if v is None or v.conn != self.conn:
            if v is None and self.on_vring is not None:
                self.on_vring(index)
            v = self.vrings[index] = Vring(index, self.conn)
            self.generation += 1
        return v

    def learn_request(self, msg, value):
        """A request the frontend sent (already decoded; fds untouched: they still go to the backend)."""
        req = msg.request
        with self.lock:
            if req == R.SET_FEATURES:
                self.features = value
                self.generation += 1
            elif req == R.SET_PROTOCOL_FEATURES:
                self.protocol = value
            elif req == R.SET_STATUS:
                self.status = value
            elif req == R.SET_MEM_TABLE:
                self._map(value, msg.fds)
            elif req == R.RESET_OWNER:
                self.features = None
                self.vrings = {i: v for i, v in self.vrings.items() if v.conn != self.conn}
                self.generation += 1
            elif req in (R.SET_VRING_NUM, R.SET_VRING_ADDR, R.SET_VRING_BASE, R.SET_VRING_ENABLE,
                         R.SET_VRING_KICK, R.SET_VRING_CALL):
                v = self._vring(value.index)
                if req == R.SET_VRING_NUM:
                    v.num = value.num
                    self.generation += 1
                elif req == R.SET_VRING_ADDR:
                    v.addr = value
                    self.generation += 1
                elif req == R.SET_VRING_BASE:
                    v.base, v.stopped_base = value.num, None
                elif req == R.SET_VRING_ENABLE:
                    v.enabled = bool(value.num)
                elif req == R.SET_VRING_KICK:
                    v.kick = "nofd" if value.nofd else "fd"
                    if v.state in ("configuring", "stopped") and v.num and v.addr:
                        v.state = "started"   # KICK comes last: "vhost depends on this msg to judge if ready"
                        v.capture = {}
                        self.generation += 1
                else:
                    v.call = "nofd" if value.nofd else "fd"

    def learn_reply(self, msg, value):
        """A reply the backend sent."""
        req = msg.request
        with self.lock:
            if req == R.GET_FEATURES:
                self.offered = value
            elif req == R.GET_PROTOCOL_FEATURES:
                self.protocol_offered = value
            elif req == R.GET_STATUS:
                self.status = value
            elif req == R.GET_VRING_BASE:
                v = self.vrings.get(value.index)
                if v is not None and v.conn == self.conn:
                    v.stopped_base, v.state = value.num, "stopped"  # DPDK drops kick/call and the ring here
                    self.generation += 1

    def _map(self, regions, fds):
        new, notes = [], []
        for r, fd in zip(regions, fds):
            try:
                new.append(MappedRegion(r, fd))
            except (OSError, ValueError, VringError) as e:
                notes.append(f"region gpa {r.gpa:#x} size {r.size:#x} not mapped: {e}")
        try:
            ring = MemoryTable([(m.region.uaddr, m.region.size, m.mm, m.region.mmap_offset) for m in new])
            buf = WatchedMemoryTable([(m.region.gpa, m.region.size, m.mm, m.region.mmap_offset) for m in new],
                                     whose="the frontend")
            buf.ident = tuple(m.ident for m in new)   # a table sent again is no new memory (tap/capture.py)
        except VringError as e:
            notes.append(f"memory table not usable: {e}")
            ring = buf = None
        self.regions, self.ring_mem, self.buf_mem, self.mem_conn = new, ring, buf, self.conn
        self.notes = notes
        # vrings of an earlier session point into memory that is gone now
        self.vrings = {i: v for i, v in self.vrings.items() if v.conn == self.conn}
        self.generation += 1

    def count_notify(self, kind, index, value, when):
        with self.lock:
            v = self.vrings.get(index)
            if v is None:
                return
            if kind == "kick":
                v.kicks += value
                v.kick_reads += 1
                v.kick_t = when
            else:
                v.calls += value
                v.call_reads += 1
                v.call_t = when

    # -- reading -------------------------------------------------------------------------------------------

    @property
    def packed(self):
        return self.features is not None and has(self.features, VIRTIO_F_RING_PACKED)

    def ring(self, index):
        """(QueueLayout in userspace-address space, ring MemoryTable, buffer MemoryTable, features) of a vring
        whose rings can be read, or raise VringError saying why not."""
        with self.lock:
            v = self.vrings.get(index)
            if v is None:
                raise VringError(f"vring {index} was never set up")
            if v.num is None or v.addr is None:
                raise VringError(f"vring {index}: size or addresses not sent yet")
            if self.ring_mem is None or self.mem_conn != v.conn:
                raise VringError(f"vring {index}: no memory table for it (SET_MEM_TABLE not seen)")
            features = self.features or 0
            layout = QueueLayout("packed" if has(features, VIRTIO_F_RING_PACKED) else "split", v.num,
                                 v.addr.desc, v.addr.avail, v.addr.used)
            return layout, self.ring_mem, self.buf_mem, features

    def view(self, index):
        """A read-only observer of vring ``index`` for rings.ctl (None while it cannot be read)."""
        try:
            layout, mem, buf_mem, features = self.ring(index)
        except VringError:
            return None
        return VringView(layout, mem, features, self.meta(index), buf_mem, self._ring_gpas(layout))

    def _ring_gpas(self, layout):
        """The ring areas of ``layout`` (userspace addresses) as guest-physical ranges [(gpa, length)]."""
        out = []
        with self.lock:
            regions = [m.region for m in self.regions]
        for addr, n in zip((layout.desc, layout.driver, layout.device), area_sizes(layout.fmt, layout.size)):
            for r in regions:
                if r.uaddr <= addr < r.uaddr + r.size:
                    out.append((r.gpa + addr - r.uaddr, n))
        return out

    def meta(self, index):
        with self.lock:
            v = self.vrings[index]
            packed = self.packed
            notes = [f"tap: vring {index} ({queue_name(index)}), connection {v.conn}"
                     f"{'' if self.connected and v.conn == self.conn else ' (gone)'}, {v.state}"
                     f"{'' if v.enabled is None else ', enabled' if v.enabled else ', disabled'}"]
            if v.base is not None:
                notes.append(f"tap: SET_VRING_BASE {decode_base(v.base, packed)}")
            if v.stopped_base is not None:
                notes.append(f"tap: GET_VRING_BASE reply {decode_base(v.stopped_base, packed)}: where the "
                             f"backend stopped")
            now = time.time()
            if self.notify_tap:
                for what, count, reads, t in (("kicks", v.kicks, v.kick_reads, v.kick_t),
                                              ("calls", v.calls, v.call_reads, v.call_t)):
                    notes.append(f"tap: {what} {count} ({reads} eventfd reads)"
                                 + (f", last {now - t:.3f} s ago" if t else ""))
            else:
                notes.append("tap: kicks and calls pass straight through between the peers (not counted; "
                             "--notify-tap counts them)")
            if v.capture:
                notes.append("tap: capture " + " ".join(f"{k}={x}" for k, x in v.capture.items()))
            notes += [f"tap: {n}" for n in self.notes]
            return {"vring": index, "connection": v.conn, "state": v.state, "enabled": v.enabled, "base": v.base,
                    "stopped_base": v.stopped_base, "kicks": v.kicks if self.notify_tap else None,
                    "calls": v.calls if self.notify_tap else None, "capture": dict(v.capture), "notes": notes}

    def summary(self):
        """One dict of everything (for --log and the end of a session)."""
        with self.lock:
            return {"connection": self.conn, "connected": self.connected,
                    "features": self.features, "feature_names": feature_names(self.features or 0),
                    "in_order": has(self.features or 0, VIRTIO_F_IN_ORDER),
                    "regions": [dataclasses.asdict(m.region) for m in self.regions],
                    "vrings": {i: {"num": v.num, "state": v.state, "base": v.base, "stopped_base": v.stopped_base,
                                   "kicks": v.kicks, "calls": v.calls, "capture": dict(v.capture)}
                               for i, v in sorted(self.vrings.items())}}


class VringView:
    """What rings.rawdump.capture reads: ring memory only (side 'memory'), plus the tap's meta."""

    side = "memory"

    def __init__(self, layout, mem, features, meta, watched=None, ring_gpas=()):
        self.layout, self.mem, self.features, self.meta = layout, mem, features, meta
        self.watched, self.ring_gpas = watched, list(ring_gpas)

    def memory_fault(self):
        """rings.ctl asks after a dump: did the frontend truncate memory the rings lie in (read as zeros)?"""
        return self.watched.vanished(self.ring_gpas) if self.watched is not None else None
