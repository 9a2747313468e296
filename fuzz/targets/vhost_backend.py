"""Fuzz target vhost_backend: the backend's vhost-user message handling over arbitrary message sequences
with fds, and its data path over whatever guest memory the messages point it at.

A vhost.server.Server serves one end of a socketpair (Server.attach); the harness is the frontend on the
other end. The input is a sequence of: requests (any code; flags with and without NEED_REPLY; payloads built
for the request: features, vring states and bases, ring addresses inside and outside the memory table,
kick/call/err fds or NOFD, memory tables of memfd regions of arbitrary geometry; or raw payload bytes; fds
attached where none belong), writes into the guest memory the memory table maps (descriptors, rings, event
fields, packet bytes), data path slices, and finally raw bytes (a torn or oversize message) before the
frontend shuts its end.

A finding: an exception out of the server's loop, an internal error the server caught and logged, a reply
that is not a well-formed vhost-user reply, a sanitizer report from the C data path, or an input over 1 s.
"""
import logging
import mmap
import os
import select
import socket
import struct

from common import Reader, Writer, open_fds
from rings import vhost_user as vu
from rings.errors import ProtocolError
from rings.layout import (VHOST_USER_F_PROTOCOL_FEATURES, VIRTIO_F_EVENT_IDX, VIRTIO_F_IN_ORDER,
                          VIRTIO_F_INDIRECT_DESC, VIRTIO_F_RING_PACKED, VIRTIO_F_VERSION_1, VIRTIO_NET_F_MRG_RXBUF,
                          bit)
from vhost.datapath import Options
from vhost.server import Server

R = vu.VhostUserRequest
GPA, UADDR, REGION = 0x40000000, 0x7F0000000000, 0x10000
RING = 0x4000        # vring i at GPA + i * RING
COMMON = (R.GET_FEATURES, R.SET_FEATURES, R.SET_OWNER, R.GET_PROTOCOL_FEATURES, R.SET_PROTOCOL_FEATURES,
          R.SET_MEM_TABLE, R.SET_VRING_NUM, R.SET_VRING_ADDR, R.SET_VRING_BASE, R.GET_VRING_BASE,
          R.SET_VRING_KICK, R.SET_VRING_CALL, R.SET_VRING_ENABLE, R.SET_STATUS, R.GET_STATUS,
          R.SET_VRING_ERR, R.RESET_OWNER, R.GET_QUEUE_NUM)
FEATURE_BITS = (VIRTIO_F_VERSION_1, VIRTIO_F_RING_PACKED, VIRTIO_F_IN_ORDER, VIRTIO_NET_F_MRG_RXBUF,
                VIRTIO_F_EVENT_IDX, VIRTIO_F_INDIRECT_DESC, VHOST_USER_F_PROTOCOL_FEATURES)
SIZES = (1, 2, 4, 8, 16, 32, 256, 3, 0, 0x8000, 0x10000)
MAX_OPS = 120


class InternalErrors(logging.Handler):
    """Collects what the server logged with a traceback (an exception of ours it caught)."""

    def __init__(self):
        super().__init__(logging.ERROR)
        self.records = []

    def emit(self, record):
        if record.exc_info:
            self.records.append(self.format(record))


class ServerLog:
    """While one input runs, the server's log goes only to an InternalErrors handler (quiet; a traceback in it is
    a finding); afterwards the logger is as it was."""

    def __enter__(self):
        self.log = logging.getLogger("vhost")
        self.saved = self.log.propagate, self.log.level
        self.handler = InternalErrors()
        self.log.propagate = False
        self.log.setLevel(logging.ERROR)
        self.log.addHandler(self.handler)
        return self.handler

    def __exit__(self, *exc):
        self.log.removeHandler(self.handler)
        self.log.propagate, level = self.saved
        self.log.setLevel(level)


def features(r):
    k = r.u8()
    if k == 0xFF:
        return r.u64()
    return sum(bit(b) for i, b in enumerate(FEATURE_BITS) if k >> i & 1) | bit(VIRTIO_F_VERSION_1) * (k >> 7)


class Backend:
    def __init__(self, r):
        cfg = r.u8()
        opts = Options(burst=(1, 4, 32, 64)[cfg & 3], retries=cfg >> 2 & 3,
                       used_batch=("per-burst", "per-buffer")[cfg >> 4 & 1], in_order_batch=bool(cfg >> 5 & 1),
                       fwd=("macswap", "io", "rxonly", "macswap")[cfg >> 6], txq_threshold=(1, 8, 32, 64)[r.u8() & 3],
                       **self.staging(r.u8()))
        self.srv = Server("/nonexistent/vring-fuzz.sock", opts, budget_us=30, handshake_timeout=3600)
        self.a, self.b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.srv.attach(vu.Connection(self.a))
        self.fe = vu.Connection(self.b)
        self.memfd = os.memfd_create("vring-fuzz", os.MFD_CLOEXEC)
        os.ftruncate(self.memfd, REGION + 0x2000)
        self.mm = mmap.mmap(self.memfd, REGION + 0x2000)
        self.fds = []   # eventfds and memfd duplicates the harness made (closed at the end)

    @staticmethod
    def staging(k):
        """The intermediate queue: slot size (frames longer than a slot go to the long-frame area) and flush."""
        return {"pkt_size": (64, 256, 2048)[k % 3],
                "txq_flush": ("rx-batch", "none", "threshold", "timer:0")[k >> 2 & 3]}

    def eventfd(self):
        fd = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
        self.fds.append(fd)
        return fd

    # -- building requests -------------------------------------------------------------------------

    def vring_index(self, r):
        k = r.u8()
        return k & 1 if k < 0xF0 else k

    def payload(self, r, req):
        """(payload, fds) for req, mostly well-formed."""
        if req in (R.SET_FEATURES,):
            return vu.pack_u64(features(r)), []
        if req in (R.SET_PROTOCOL_FEATURES, R.SET_STATUS):
            return vu.pack_u64(r.pick(0x10008, 0x8, 0x10000, 0xB, 0xF, 0x0, 0x1FF, r.u64)), []
        if req in (R.SET_VRING_NUM, R.SET_VRING_BASE, R.GET_VRING_BASE, R.SET_VRING_ENABLE):
            idx = self.vring_index(r)
            num = r.pick(lambda: r.choice(SIZES), lambda: 0x8000 | r.u16() % 300, lambda: r.u16() % 300, 0, 1,
                         r.u32, r.u16)
            return vu.VringState(idx, num).pack(), []
        if req == R.SET_VRING_ADDR:
            idx = self.vring_index(r)
            good = [UADDR + (idx & 1) * RING + off for off in (0, 0x1000, 0x2000, 0x3000)]
            def addr():
                return r.pick(*good, lambda: UADDR + r.u16(), r.u64)
            flags = 0 if r.u8() % 8 else r.u32()
            return vu.VringAddr(idx, flags, addr(), addr(), addr()).pack(), []
        if req in (R.SET_VRING_KICK, R.SET_VRING_CALL, R.SET_VRING_ERR):
            idx = self.vring_index(r)
            nofd = r.u8() % 4 == 0
            return vu.VringFile(idx, nofd).pack(), ([] if nofd else [self.eventfd()])
        if req == R.SET_MEM_TABLE:
            regions, fds = [], []
            for i in range(r.u8() % 3 + 1):
                k = r.u8()
                gpa = GPA + i * 0x100000 if k & 1 else r.u64() & ~0xFFF
                size = REGION if k & 2 else r.u32() % (REGION + 0x4000) + (0 if k & 4 else 1)
                uaddr = UADDR + i * 0x100000 if k & 8 else r.u64()
                off = 0 if k & 16 else r.u16() % 0x3000
                regions.append(vu.MemRegion(gpa, size, uaddr, off))
                fd = os.dup(self.memfd)
                self.fds.append(fd)
                fds.append(fd)
            return vu.pack_mem_table(regions), fds
        return b"", []

    def request(self, r):
        k = r.u8()
        req = COMMON[r.below(len(COMMON))] if k & 0xF0 else (r.u8() if k & 1 else r.u32())
        flags = (0x1, 0x9, 0x1, 0x9, 0x5, None, 0x1, 0x9)[k >> 1 & 7]
        if flags is None:
            flags = r.u32()
        if k & 0x0C == 0x0C:   # raw payload, any fds
            payload, fds = r.bytes(r.u8() % 64), [self.eventfd() for _ in range(r.u8() % 3)]
        else:
            payload, fds = self.payload(r, req)
        self.fe.send(vu.Message(req, flags, payload, fds), timeout=1.0)

    # -- the frontend's memory, the data path ------------------------------------------------------

    def write_memory(self, r):
        k = r.u8()
        if k & 1:   # a descriptor in vring 0 or 1: addr in the packet area, len, flags, next/id
            ring, slot = k >> 1 & 1, r.u8()
            addr = GPA + 0x8000 + r.u16() % 0x8000
            body = struct.pack("<QIHH", addr, r.pick(64, 1514, 12, r.u16, r.u32), r.u16(), r.u16())
            off = ring * RING + 16 * slot
        elif k & 2:   # an avail/used idx or event field somewhere in the ring areas
            off, body = (k >> 2 & 1) * RING + r.u16() % RING, struct.pack("<H", r.u16())
        else:
            off, body = r.u16() % REGION, r.bytes(r.u8() % 32)
        body = body[:max(0, REGION - off)]
        self.mm[off:off + len(body)] = body

    def step(self):
        """Serve what is pending and give the data path a slice; collect the replies."""
        for _ in range(8):
            if self.srv.conn is None:
                return
            self.srv.poll_once(idle_timeout=0)
            if self.srv.conn is None or not select.select([self.a], [], [], 0)[0]:
                break
        self.replies()

    def replies(self):
        while select.select([self.b], [], [], 0)[0]:
            try:
                rep = self.fe.recv(timeout=0)
            except ProtocolError:   # the server closed its end
                return
            try:
                vu.decode(rep, reply=True)   # every reply the server sends must be a well-formed one
            finally:
                rep.close_fds()

    def run(self, r):
        try:
            for _ in range(MAX_OPS):
                if not r.left or self.srv.conn is None:
                    break
                op = r.u8() % 8
                if op < 5:
                    self.request(r)
                elif op < 7:
                    self.write_memory(r)
                self.step()
            if self.srv.conn is not None and r.left:   # a torn or oversize message, then the end
                self.b.sendall(r.bytes(r.left))
            if self.srv.conn is not None:
                self.b.shutdown(socket.SHUT_WR)
                for _ in range(4):
                    self.step()
        except (BrokenPipeError, ConnectionResetError, ProtocolError):
            pass   # the server closed the connection: its right
        finally:
            self.close()

    def close(self):
        self.srv.close()
        self.fe.close()
        self.a.close()
        self.mm.close()
        for fd in [self.memfd] + self.fds:
            try:
                os.close(fd)
            except OSError:
                pass


def TestOneInput(data):
    before = open_fds()
    r = Reader(data)
    with ServerLog() as internal:
        b = Backend(r)
        b.run(r)
    assert not internal.records, "the server caught an internal error:\n" + "\n".join(internal.records)
    assert open_fds() == before, f"fds leaked: {before} before, {open_fds()} after"
    return b


# ---- seeds: the DPDK 22.11 virtio_user sequence, then traffic (the same encoding, written) ------------------

def _req(w, req, need_reply=False):
    w.u8(0)                                              # op: a request
    w.u8(0x10 | need_reply << 1).u8(COMMON.index(req))   # a common request, flags 0x1 / 0x9


def _state(w, req, index, pick, *extra):
    _req(w, req)
    w.u8(index).u8(pick)
    for v, size in extra:
        w.u16(v) if size == 2 else w.u8(v)


def _memory(w, off, data):
    for k in range(0, len(data), 31):                     # op: a memory write, up to 31 raw bytes at off
        chunk = data[k:k + 31]
        w.u8(6).u8(0).u16(off + k).u8(len(chunk)).raw(chunk)


def seeds():
    out = []
    for packed in (0, 1):
        for mrg in (0, 1):
            w = Writer().u8(0x40).u8(2).u8(2)            # burst 1, io forwarding, threshold 32, 2048-byte packets
            _req(w, R.SET_OWNER)
            _req(w, R.GET_FEATURES)
            _req(w, R.GET_PROTOCOL_FEATURES)
            _req(w, R.SET_PROTOCOL_FEATURES)
            w.u8(0)                                      # 0x10008: REPLY_ACK | STATUS
            for i in range(2):
                _req(w, R.SET_VRING_CALL, True)
                w.u8(i).u8(1)                            # with an eventfd
            _req(w, R.SET_FEATURES, True)
            w.u8(1 | packed << 1 | 1 << 2 | mrg << 3 | 1 << 6)   # VERSION_1, IN_ORDER, PROTOCOL_FEATURES
            _req(w, R.SET_STATUS, True)
            w.u8(3)                                      # 0xB
            _req(w, R.GET_STATUS)
            _req(w, R.SET_MEM_TABLE, True)
            w.u8(0).u8(27)                               # one region: GPA, REGION bytes, UADDR, offset 0
            for i in range(2):
                _state(w, R.SET_VRING_NUM, i, 0, (SIZES.index(8), 1))
                if packed:
                    _state(w, R.SET_VRING_BASE, i, 1, (0, 2))             # 0x8000: slot 0, wrap 1
                else:
                    _state(w, R.SET_VRING_BASE, i, 3)                     # 0
                _req(w, R.SET_VRING_ADDR)
                w.u8(i).u8(1).u8(0).u8(2).u8(1)          # flags 0; desc, used (device area), avail (driver area)
                _req(w, R.SET_VRING_KICK)
                w.u8(i).u8(1)
            for i in range(2):
                _state(w, R.SET_VRING_ENABLE, i, 4)                       # 1
            _req(w, R.SET_STATUS, True)
            w.u8(4)                                      # 0xF: DRIVER_OK, the data path starts
            # traffic: an Rx buffer (vring 0) and a 60-byte frame behind a 12-byte header (vring 1)
            avail_flags = 0x80                           # packed: AVAIL = wrap 1, USED = 0
            rx = struct.pack("<QIHH", GPA + 0x8000, 2048, 0, avail_flags | 2) if packed else \
                struct.pack("<QIHH", GPA + 0x8000, 2048, 2, 0)
            tx = struct.pack("<QIHH", GPA + 0x9000, 72, 0, avail_flags) if packed else \
                struct.pack("<QIHH", GPA + 0x9000, 72, 0, 0)
            _memory(w, 0x9000 + 12, bytes.fromhex("020000000001020000000002"))   # then zeros
            _memory(w, 0, rx)
            _memory(w, RING, tx)
            if not packed:                               # avail.idx = 1 (ring[0] = head 0 already)
                _memory(w, 0x1000 + 2, b"\x01\x00")
                _memory(w, RING + 0x1000 + 2, b"\x01\x00")
            for _ in range(3):
                w.u8(7)                                  # op: a data path slice
            _state(w, R.GET_VRING_BASE, 0, 3)
            _state(w, R.GET_VRING_BASE, 1, 3)
            out.append(w.bytes())
    return out
