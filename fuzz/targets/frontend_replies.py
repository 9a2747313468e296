"""Fuzz target frontend_replies: the frontend (virtio.frontend.VhostUserFrontend, over rings.vhost_user) handling
whatever a backend answers.

The input is the backend's side of the conversation: a sequence of messages (mostly replies to the requests
of the DPDK virtio_user sequence: feature masks, protocol features, status, vring bases for the right or a
wrong vring, acks and NACKs; sometimes wrong request ids, flags, sizes, fds attached, busy notices, raw bytes)
written to the frontend's socket before the backend closes its end. The frontend then negotiates a feature
set chosen by the input, starts both vrings over a memfd, and stops them.

Expected: typed errors (ProtocolError and its kinds, FeatureRefused, BackendBusy, ConfigError for a feature
set it cannot use). A finding: any other exception, a leaked fd, a sanitizer report, an input over 1 s.
"""
import os
import socket

from common import Reader, Writer, open_fds
from rings import vhost_user as vu
from rings.errors import VringError
from rings.layout import QueueLayout
from virtio.frontend import SELECTABLE, VhostUserFrontend, want_features
from vhost.device import OFFERED_FEATURES, OFFERED_PROTOCOL_FEATURES

R = vu.VhostUserRequest
GPA, SIZE = 0x100000000, 0x20000
SEQUENCE = (R.GET_FEATURES, R.GET_PROTOCOL_FEATURES, R.SET_OWNER, R.SET_PROTOCOL_FEATURES, R.SET_VRING_CALL,
            R.SET_FEATURES, R.SET_STATUS, R.GET_STATUS, R.SET_MEM_TABLE, R.SET_VRING_NUM, R.SET_VRING_BASE,
            R.SET_VRING_ADDR, R.SET_VRING_KICK, R.SET_VRING_ENABLE, R.GET_VRING_BASE)


class Memory:
    """What the frontend's start() reads from the driver's guest memory: gpa, size, fileno()."""

    def __init__(self):
        self.gpa, self.size = GPA, SIZE
        self.fd = os.memfd_create("vring-fuzz-fe", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, SIZE)

    def fileno(self):
        return self.fd


def reply(r, fds):
    k = r.u8()
    req = SEQUENCE[r.below(len(SEQUENCE))] if k & 0xC0 else r.u8()
    flags = 0x5 if k & 0x30 else r.pick(0x1, 0xD, r.u32)
    kind = k & 0x0F
    if kind < 6:     # a u64: feature masks, protocol features, status, ack
        payload = vu.pack_u64(r.pick(OFFERED_FEATURES, OFFERED_PROTOCOL_FEATURES, 0, 1, 0xB, 0xF, r.u64,
                                     lambda: OFFERED_FEATURES & ~(1 << r.u8() % 64)))
    elif kind < 9:   # a vring state (GET_VRING_BASE)
        payload = vu.VringState(r.u8() % 3, r.u32()).pack()
    elif kind == 9:  # a busy notice
        req, flags, payload = vu.BUSY_REQUEST, 0x5, vu.busy_notice("fuzz").payload
    else:
        payload = r.bytes(r.u8() % 48)
    n = r.u8() % 3 if k & 0x40 and not k & 0x80 else 0
    for _ in range(n):
        fds.append(os.eventfd(0, os.EFD_CLOEXEC))
    return vu.Message(req, flags, payload, fds[len(fds) - n:])


def TestOneInput(data):
    before = open_fds()
    fe = run(Reader(data))
    assert open_fds() == before, f"fds leaked: {before} before, {open_fds()} after"
    return fe


def run(r):
    cfg = r.u8()
    want = want_features(**{name: bool(cfg >> i & 1) for i, name in enumerate(sorted(SELECTABLE))})
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    fds, mem, fe = [], Memory(), VhostUserFrontend("fuzz-backend", timeout=0.5)
    try:
        backend = vu.Connection(b)
        try:
            for _ in range(r.u8() % 48):
                backend.send(reply(r, fds), timeout=0.1)
            if r.left:
                b.sendall(r.bytes(r.left))
        except (VringError, OSError):
            pass
        b.shutdown(socket.SHUT_WR)
        fe.conn = vu.Connection(a)
        try:
            fe.negotiate(want)
            fmt = "packed" if fe.features >> 34 & 1 else "split"
            layouts = {i: QueueLayout.contiguous(fmt, 64, GPA + i * 0x4000) for i in range(2)}
            fe.start(mem, layouts)
            fe.stop()
        except VringError:
            pass
        return fe
    finally:
        fe.close()
        b.close()
        for fd in fds + [mem.fd]:
            os.close(fd)


# ---- seeds: a backend that answers like vring vhost / DPDK (the same encoding, written) --------------------

def _reply(w, req, kind, *values):
    w.u8(0x90 | kind).u8(SEQUENCE.index(req))   # a reply to req, flags 0x5, no fds
    for v, size in values:
        {1: w.u8, 4: w.u32}[size](v)


def seeds():
    out = []
    names = sorted(SELECTABLE)
    for packed in (0, 1):
        for event_idx in (0, 1):
            on = {"VERSION_1", "IN_ORDER", "MRG_RXBUF", "INDIRECT_DESC"} | ({"RING_PACKED"} if packed else set()) \
                | ({"EVENT_IDX"} if event_idx else set())
            w = Writer().u8(sum(1 << i for i, n in enumerate(names) if n in on)).u8(23)
            _reply(w, R.GET_FEATURES, 0, (0, 1))                       # OFFERED_FEATURES
            _reply(w, R.GET_PROTOCOL_FEATURES, 0, (1, 1))              # REPLY_ACK | STATUS
            for req in (R.SET_VRING_CALL, R.SET_VRING_CALL, R.SET_FEATURES, R.SET_STATUS):
                _reply(w, req, 0, (2, 1))                              # ack 0
            _reply(w, R.GET_STATUS, 0, (4, 1))                         # 0xB
            _reply(w, R.SET_MEM_TABLE, 0, (2, 1))
            for _ in range(2):
                for req in (R.SET_VRING_NUM, R.SET_VRING_BASE, R.SET_VRING_ADDR, R.SET_VRING_KICK):
                    _reply(w, req, 0, (2, 1))
            for req in (R.SET_VRING_ENABLE, R.SET_VRING_ENABLE, R.SET_STATUS, R.SET_VRING_ENABLE,
                        R.SET_VRING_ENABLE):
                _reply(w, req, 0, (2, 1))
            for i in range(2):
                _reply(w, R.GET_VRING_BASE, 6, (i, 1), (0x8000 | 5 if packed else 5, 4))
            out.append(w.bytes())
    return out
