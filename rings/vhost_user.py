"""The vhost-user wire protocol, as DPDK 22.11 speaks it (shared/spec/vhost-user.md).

Both sides use this module: the frontend (``virtio/``, a driver like DPDK's virtio_user) and the backend
(``vhost/``, a device like DPDK's net_vhost). It knows the message codes, the packed payload layouts, the
framing (12-byte header, payload, SCM_RIGHTS fds in one ``sendmsg``) and what each request must carry. It does
not know what a request *means*; that is the job of the two sides.

Layers, bottom up:

* ``pack_*``/``unpack_*`` and the payload dataclasses (``VringState``, ``VringAddr``, ...): bytes <-> values,
  little-endian, no padding except where the spec table has it (memory-table header, inflight tail).
* ``Message`` and ``Connection``: framing over a connected AF_UNIX stream socket. ``Connection.recv`` checks only
  the framing (version bits, size limit, fd limit); it returns messages with unknown request codes too, so that a
  backend can NACK them as DPDK does.
* ``REQUEST_SPECS``/``REPLY_SPECS``, ``validate`` and ``decode``: per-request checks of payload size, fd count and
  contents, and typed decoding.
* ``reply``/``ack`` (backend) and ``client_call`` (frontend).

File descriptors: a received ``Message`` owns its ``fds``. Every function here that rejects a received message
(``Connection.recv``, ``validate``, ``decode``, ``client_call``) closes its fds before raising, so nothing leaks.
A message that passes belongs to the caller, who closes or keeps each fd (``Message.take_fds``/``close_fds``).
``Connection.send`` only borrows the fds of the message it sends; it never closes them.

A backend's loop, in the shape DPDK's ``vhost_user_msg_handler`` has::

    msg = conn.recv()                       # PeerGone: the frontend left
    try:
        value = decode(msg)                 # ProtocolError: bad size / fds / contents, fds already closed
    except ProtocolError:
        if msg.need_reply:
            conn.send(ack(msg, ok=False))   # NACK, keep the connection
            continue
        raise                               # no NEED_REPLY: close the connection
    ...handle...
    if has_reply(msg.request):
        conn.send(reply(msg, payload))
    elif wants_ack(msg):
        conn.send(ack(msg, ok))
"""
from __future__ import annotations

import errno
import fcntl
import os
import socket
import stat
import struct
import sys
import time
from array import array
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Callable, NamedTuple, Sequence

from .errors import BackendBusy, ConfigError, PeerGone, ProtocolError, ProtocolNack, ProtocolTimeout, UsageError

# --------------------------------------------------------------------------------------------------
# Constants
# --------------------------------------------------------------------------------------------------

VERSION = 0x1           # header flags bits 0-1: protocol version, always 1
VERSION_MASK = 0x3
REPLY = 0x4             # header flags bit 2: this message is a reply
NEED_REPLY = 0x8        # header flags bit 3: the frontend wants a REPLY_ACK u64
REPLY_FLAGS = VERSION | REPLY   # every reply carries exactly 0x5; virtio_user rejects anything else

HEADER = struct.Struct("<III")  # request, flags, size
HEADER_SIZE = HEADER.size       # 12

MAX_FDS = 8             # DPDK 22.11's control buffer holds CMSG_SPACE(8 * sizeof(int))
MAX_REGIONS = 8         # regions in one SET_MEM_TABLE
MAX_VRINGS = 0x100      # DPDK's VHOST_MAX_VRING: vring indices are 0..255
MAX_CONFIG_SIZE = 256   # VHOST_USER_MAX_CONFIG_SIZE (GET_CONFIG/SET_CONFIG)
MAX_PAYLOAD = 4096      # sanity limit on a received payload (the largest DPDK payload is ~300 bytes)

VRING_IDX_MASK = 0xFF       # vring file u64: bits 0-7 = vring index
VRING_NOFD_MASK = 0x100     # vring file u64: bit 8 = no fd attached ("invalid fd")

VHOST_USER_F_PROTOCOL_FEATURES = 30   # virtio feature bit that enables GET/SET_PROTOCOL_FEATURES

VHOST_VRING_F_LOG = 0x1     # VringAddr.flags bit 0: log writes to the used ring


class VhostUserRequest(IntEnum):
    """Frontend -> backend request ids, DPDK 22.11 ``lib/vhost/vhost_user.h`` (23 and 33-38 do not exist there)."""

    GET_FEATURES = 1
    SET_FEATURES = 2
    SET_OWNER = 3
    RESET_OWNER = 4
    SET_MEM_TABLE = 5
    SET_LOG_BASE = 6
    SET_LOG_FD = 7
    SET_VRING_NUM = 8
    SET_VRING_ADDR = 9
    SET_VRING_BASE = 10
    GET_VRING_BASE = 11
    SET_VRING_KICK = 12
    SET_VRING_CALL = 13
    SET_VRING_ERR = 14
    GET_PROTOCOL_FEATURES = 15
    SET_PROTOCOL_FEATURES = 16
    GET_QUEUE_NUM = 17
    SET_VRING_ENABLE = 18
    SEND_RARP = 19
    NET_SET_MTU = 20
    SET_SLAVE_REQ_FD = 21
    IOTLB_MSG = 22
    GET_CONFIG = 24
    SET_CONFIG = 25
    CRYPTO_CREATE_SESS = 26
    CRYPTO_CLOSE_SESS = 27
    POSTCOPY_ADVISE = 28
    POSTCOPY_LISTEN = 29
    POSTCOPY_END = 30
    GET_INFLIGHT_FD = 31
    SET_INFLIGHT_FD = 32
    SET_STATUS = 39
    GET_STATUS = 40


class VhostUserProtocolFeature(IntEnum):
    """Protocol-feature *bit numbers* (GET/SET_PROTOCOL_FEATURES); the mask is ``1 << bit``."""

    MQ = 0
    LOG_SHMFD = 1
    RARP = 2
    REPLY_ACK = 3
    NET_MTU = 4
    SLAVE_REQ = 5
    BACKEND_REQ = 5         # newer name, same bit
    CROSS_ENDIAN = 6
    CRYPTO_SESSION = 7
    PAGEFAULT = 8
    CONFIG = 9
    SLAVE_SEND_FD = 10
    BACKEND_SEND_FD = 10
    HOST_NOTIFIER = 11
    INFLIGHT_SHMFD = 12
    RESET_DEVICE = 13
    INBAND_NOTIFICATIONS = 14
    CONFIGURE_MEM_SLOTS = 15
    STATUS = 16


def request_name(request: int) -> str:
    """``"SET_VRING_NUM"`` for a known id, ``"UNKNOWN(99)"`` otherwise."""
    try:
        return VhostUserRequest(request).name
    except ValueError:
        return f"UNKNOWN({request})"


# --------------------------------------------------------------------------------------------------
# Payloads
# --------------------------------------------------------------------------------------------------

_U64 = struct.Struct("<Q")
_STATE = struct.Struct("<II")
_ADDR = struct.Struct("<IIQQQQ")          # index, flags, desc, used, avail, log  (40 bytes)
_MEM_HDR = struct.Struct("<II")           # nregions, padding
_REGION = struct.Struct("<QQQQ")          # gpa, size, uaddr, mmap_offset      (32 bytes)
_LOG = struct.Struct("<QQ")               # mmap_size, mmap_offset             (16 bytes)
_INFLIGHT = struct.Struct("<QQHH4x")      # mmap_size, mmap_offset, num_queues, queue_size (24 bytes)
_CONFIG_HDR = struct.Struct("<III")       # offset, size, flags                (12 bytes + data)
_IOTLB = struct.Struct("<QQQBB")          # iova, size, uaddr, perm, type      (26 bytes; 32 with C padding)

MEM_TABLE_HEADER_SIZE = _MEM_HDR.size
MEM_REGION_SIZE = _REGION.size
CONFIG_HEADER_SIZE = _CONFIG_HDR.size
INFLIGHT_SIZE = _INFLIGHT.size


def _pack(st: struct.Struct, what: str, *values) -> bytes:
    try:
        return st.pack(*values)
    except struct.error as e:
        raise ConfigError(f"cannot encode {what} {values}: {e}") from None


def _need(data, size: int, what: str) -> bytes:
    data = bytes(data)
    if len(data) != size:
        raise ProtocolError(f"{what}: payload is {len(data)} bytes, expected {size}")
    return data


def pack_u64(value: int) -> bytes:
    return _pack(_U64, "u64", value)


def unpack_u64(data) -> int:
    return _U64.unpack(_need(data, 8, "u64"))[0]


@dataclass(frozen=True)
class VringState:
    """SET_VRING_NUM / SET_VRING_BASE / GET_VRING_BASE / SET_VRING_ENABLE: ``u32 index; u32 num``."""

    index: int
    num: int

    SIZE = _STATE.size

    def pack(self) -> bytes:
        return _pack(_STATE, "vring state", self.index, self.num)

    @classmethod
    def unpack(cls, data) -> "VringState":
        return cls(*_STATE.unpack(_need(data, cls.SIZE, "vring state")))


@dataclass(frozen=True)
class VringAddr:
    """SET_VRING_ADDR, 40 bytes. Note the wire order: desc, **used**, avail, log.

    The three ring addresses are in the frontend's userspace-address space (``MemRegion.uaddr``)."""

    index: int
    flags: int
    desc: int
    used: int
    avail: int
    log: int = 0

    SIZE = _ADDR.size

    def pack(self) -> bytes:
        return _pack(_ADDR, "vring addr", self.index, self.flags, self.desc, self.used, self.avail, self.log)

    @classmethod
    def unpack(cls, data) -> "VringAddr":
        return cls(*_ADDR.unpack(_need(data, cls.SIZE, "vring addr")))


@dataclass(frozen=True)
class VringFile:
    """SET_VRING_KICK / CALL / ERR: a u64 with the vring index in bits 0-7 and NOFD in bit 8.

    With ``nofd`` the message carries no fd; otherwise exactly one."""

    index: int
    nofd: bool = False

    SIZE = 8

    def pack(self) -> bytes:
        if not 0 <= self.index <= VRING_IDX_MASK:
            raise ConfigError(f"vring file index {self.index} does not fit in 8 bits")
        return pack_u64(self.index | (VRING_NOFD_MASK if self.nofd else 0))

    @classmethod
    def unpack(cls, data) -> "VringFile":
        value = unpack_u64(_need(data, cls.SIZE, "vring file"))
        if value & ~(VRING_IDX_MASK | VRING_NOFD_MASK):
            raise ProtocolError(f"vring file u64 {value:#x} has reserved bits set (only bits 0-8 are defined)")
        return cls(value & VRING_IDX_MASK, bool(value & VRING_NOFD_MASK))


def fd_kind(fd) -> str:
    """What an fd a peer sent is ('anon_inode:[eventfd]' for an eventfd; '?' if it cannot be told). A kick or call
    fd must be an eventfd: reads of anything else may block (eventfd_take), writes to a pipe nobody drains do."""
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return "?"


EVENTFD = "anon_inode:[eventfd]"


def eventfd_take(fd) -> int:
    """Read (and so reset) the counter of a kick or call eventfd that a peer shares, never blocking: 0 when it was
    0. The peer holds the same file description, so it can clear O_NONBLOCK and read the counter itself between
    our select and our read; a plain read would then wait for good. preadv2 with RWF_NOWAIT does not depend on
    O_NONBLOCK (eventfds accept it since Linux 5.x); where it is refused (an older kernel) the plain read is left."""
    buf = bytearray(8)
    try:   # (a Python built without RWF_NOWAIT, or an old kernel: the plain read)
        n = os.preadv(fd, [buf], -1, os.RWF_NOWAIT)
    except BlockingIOError:
        return 0
    except (AttributeError, OSError) as e:
        if isinstance(e, OSError) and e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise
        try:
            return os.eventfd_read(fd)
        except BlockingIOError:
            return 0
    return int.from_bytes(buf, sys.byteorder) if n == 8 else 0



@dataclass(frozen=True)
class MemRegion:
    """One SET_MEM_TABLE region (32 bytes). Buffers are looked up by ``gpa``, rings by ``uaddr``; the region's
    bytes start at ``mmap_offset`` inside the fd sent with it."""

    gpa: int
    size: int
    uaddr: int
    mmap_offset: int = 0

    SIZE = _REGION.size

    def pack(self) -> bytes:
        return _pack(_REGION, "memory region", self.gpa, self.size, self.uaddr, self.mmap_offset)

    @classmethod
    def unpack(cls, data) -> "MemRegion":
        return cls(*_REGION.unpack(_need(data, cls.SIZE, "memory region")))


def pack_mem_table(regions: Sequence[MemRegion]) -> bytes:
    """``u32 nregions; u32 padding (0); region[n]``. 1 to 8 regions."""
    regions = list(regions)
    if not 1 <= len(regions) <= MAX_REGIONS:
        raise ConfigError(f"a memory table has 1 to {MAX_REGIONS} regions, not {len(regions)}")
    return _MEM_HDR.pack(len(regions), 0) + b"".join(r.pack() for r in regions)


def unpack_mem_table(data) -> list[MemRegion]:
    """Parse a SET_MEM_TABLE payload. The padding word is ignored (virtio_user leaves it 0)."""
    data = bytes(data)
    if len(data) < _MEM_HDR.size:
        raise ProtocolError(f"SET_MEM_TABLE: payload is {len(data)} bytes, expected at least {_MEM_HDR.size}")
    nregions, _padding = _MEM_HDR.unpack_from(data)
    if not 1 <= nregions <= MAX_REGIONS:
        raise ProtocolError(f"SET_MEM_TABLE: nregions is {nregions}, expected 1 to {MAX_REGIONS}")
    want = _MEM_HDR.size + _REGION.size * nregions
    if len(data) != want:
        raise ProtocolError(f"SET_MEM_TABLE: payload is {len(data)} bytes, expected {want} "
                            f"(8 + 32 * {nregions} regions)")
    return [MemRegion(*_REGION.unpack_from(data, _MEM_HDR.size + _REGION.size * i)) for i in range(nregions)]


@dataclass(frozen=True)
class LogBase:
    """SET_LOG_BASE: ``u64 mmap_size; u64 mmap_offset`` (16 bytes), with one fd."""

    mmap_size: int
    mmap_offset: int

    SIZE = _LOG.size

    def pack(self) -> bytes:
        return _pack(_LOG, "log", self.mmap_size, self.mmap_offset)

    @classmethod
    def unpack(cls, data) -> "LogBase":
        return cls(*_LOG.unpack(_need(data, cls.SIZE, "log")))


@dataclass(frozen=True)
class Inflight:
    """GET/SET_INFLIGHT_FD: ``u64 mmap_size; u64 mmap_offset; u16 num_queues; u16 queue_size`` + 4 pad = 24 bytes."""

    mmap_size: int
    mmap_offset: int
    num_queues: int
    queue_size: int

    SIZE = _INFLIGHT.size

    def pack(self) -> bytes:
        return _pack(_INFLIGHT, "inflight", self.mmap_size, self.mmap_offset, self.num_queues, self.queue_size)

    @classmethod
    def unpack(cls, data) -> "Inflight":
        return cls(*_INFLIGHT.unpack(_need(data, cls.SIZE, "inflight")))


@dataclass(frozen=True)
class ConfigSpace:
    """GET/SET_CONFIG: ``u32 offset; u32 size; u32 flags; u8 data[size]`` with size <= 256."""

    offset: int
    size: int
    flags: int
    data: bytes = b""

    def pack(self) -> bytes:
        if len(self.data) != self.size or self.size > MAX_CONFIG_SIZE:
            raise ConfigError(f"config size {self.size} must equal len(data) {len(self.data)} "
                              f"and be at most {MAX_CONFIG_SIZE}")
        return _pack(_CONFIG_HDR, "config", self.offset, self.size, self.flags) + bytes(self.data)

    @classmethod
    def unpack(cls, data) -> "ConfigSpace":
        data = bytes(data)
        if len(data) < _CONFIG_HDR.size:
            raise ProtocolError(f"config: payload is {len(data)} bytes, expected at least {_CONFIG_HDR.size}")
        offset, size, flags = _CONFIG_HDR.unpack_from(data)
        if size > MAX_CONFIG_SIZE:
            raise ProtocolError(f"config: size field is {size}, at most {MAX_CONFIG_SIZE} allowed")
        if len(data) != _CONFIG_HDR.size + size:
            raise ProtocolError(f"config: payload is {len(data)} bytes, expected {_CONFIG_HDR.size + size} "
                                f"(12 + size field {size})")
        return cls(offset, size, flags, data[_CONFIG_HDR.size:])


@dataclass(frozen=True)
class IotlbMsg:
    """IOTLB_MSG: ``u64 iova; u64 size; u64 uaddr; u8 perm; u8 type`` (26 bytes packed; QEMU sends 32 with the
    C struct's tail padding, both are accepted)."""

    iova: int
    size: int
    uaddr: int
    perm: int
    type: int

    def pack(self) -> bytes:
        return _pack(_IOTLB, "iotlb", self.iova, self.size, self.uaddr, self.perm, self.type) + bytes(6)

    @classmethod
    def unpack(cls, data) -> "IotlbMsg":
        data = bytes(data)
        if not _IOTLB.size <= len(data) <= 32:
            raise ProtocolError(f"iotlb: payload is {len(data)} bytes, expected {_IOTLB.size} to 32")
        return cls(*_IOTLB.unpack_from(data))


def _no_payload(data) -> None:
    return None


def _mac(data) -> bytes:
    """SEND_RARP: the MAC is the first 6 bytes of the u64."""
    return _need(data, 8, "SEND_RARP")[:6]


def _opt_u64(data):
    data = bytes(data)
    return unpack_u64(data) if data else None


# --------------------------------------------------------------------------------------------------
# Per-request expectations
# --------------------------------------------------------------------------------------------------

FDS_VRING = "vring"       # 1 fd, or 0 when the NOFD bit is set in the u64
FDS_REGIONS = "regions"   # one fd per memory region


class PayloadSpec(NamedTuple):
    """What one message must carry. ``fds`` is a count, ``FDS_VRING`` or ``FDS_REGIONS``;
    ``decode(payload)`` turns checked bytes into a value."""

    min_size: int
    max_size: int
    fds: int | str
    decode: Callable


_R = VhostUserRequest
_NONE = PayloadSpec(0, 0, 0, _no_payload)
_U64_SPEC = PayloadSpec(8, 8, 0, unpack_u64)
_STATE_SPEC = PayloadSpec(8, 8, 0, VringState.unpack)
_FILE_SPEC = PayloadSpec(8, 8, FDS_VRING, VringFile.unpack)
_CONFIG_SPEC = PayloadSpec(_CONFIG_HDR.size, _CONFIG_HDR.size + MAX_CONFIG_SIZE, 0, ConfigSpace.unpack)

#: Requests (frontend -> backend).
REQUEST_SPECS: dict[VhostUserRequest, PayloadSpec] = {
    _R.GET_FEATURES: _NONE,
    _R.SET_FEATURES: _U64_SPEC,
    _R.SET_OWNER: _NONE,
    _R.RESET_OWNER: _NONE,
    _R.SET_MEM_TABLE: PayloadSpec(_MEM_HDR.size, _MEM_HDR.size + _REGION.size * MAX_REGIONS,   # exact: 8 + 32 * n
                                  FDS_REGIONS, unpack_mem_table),
    _R.SET_LOG_BASE: PayloadSpec(16, 16, 1, LogBase.unpack),
    _R.SET_LOG_FD: PayloadSpec(0, 0, 1, _no_payload),
    _R.SET_VRING_NUM: _STATE_SPEC,
    _R.SET_VRING_ADDR: PayloadSpec(40, 40, 0, VringAddr.unpack),
    _R.SET_VRING_BASE: _STATE_SPEC,
    _R.GET_VRING_BASE: _STATE_SPEC,           # num is uninitialised garbage from virtio_user: ignore it
    _R.SET_VRING_KICK: _FILE_SPEC,
    _R.SET_VRING_CALL: _FILE_SPEC,
    _R.SET_VRING_ERR: _FILE_SPEC,
    _R.GET_PROTOCOL_FEATURES: _NONE,
    _R.SET_PROTOCOL_FEATURES: _U64_SPEC,
    _R.GET_QUEUE_NUM: _NONE,
    _R.SET_VRING_ENABLE: _STATE_SPEC,
    _R.SEND_RARP: PayloadSpec(8, 8, 0, _mac),
    _R.NET_SET_MTU: _U64_SPEC,
    _R.SET_SLAVE_REQ_FD: PayloadSpec(0, 0, 1, _no_payload),
    _R.IOTLB_MSG: PayloadSpec(_IOTLB.size, 32, 0, IotlbMsg.unpack),
    _R.GET_CONFIG: _CONFIG_SPEC,
    _R.SET_CONFIG: _CONFIG_SPEC,
    _R.CRYPTO_CREATE_SESS: PayloadSpec(8, MAX_PAYLOAD, 0, bytes),
    _R.CRYPTO_CLOSE_SESS: _U64_SPEC,
    _R.POSTCOPY_ADVISE: _NONE,
    _R.POSTCOPY_LISTEN: _NONE,
    _R.POSTCOPY_END: _NONE,
    _R.GET_INFLIGHT_FD: PayloadSpec(24, 24, 0, Inflight.unpack),
    _R.SET_INFLIGHT_FD: PayloadSpec(24, 24, 1, Inflight.unpack),
    _R.SET_STATUS: _U64_SPEC,
    _R.GET_STATUS: _NONE,
}

#: Requests that always get a reply (backend -> frontend), whatever REPLY_ACK says, and what it carries.
#: Every other request gets a reply only with NEED_REPLY, and that reply is ``ACK_SPEC``.
REPLY_SPECS: dict[VhostUserRequest, PayloadSpec] = {
    _R.GET_FEATURES: _U64_SPEC,
    _R.GET_PROTOCOL_FEATURES: _U64_SPEC,
    _R.GET_QUEUE_NUM: _U64_SPEC,
    _R.GET_STATUS: _U64_SPEC,
    _R.GET_VRING_BASE: _STATE_SPEC,
    _R.GET_INFLIGHT_FD: PayloadSpec(24, 24, 1, Inflight.unpack),
    _R.GET_CONFIG: _CONFIG_SPEC,
    _R.SET_LOG_BASE: PayloadSpec(0, 8, 0, _opt_u64),      # DPDK replies with size 0, the QEMU doc says u64
    _R.POSTCOPY_ADVISE: PayloadSpec(0, 8, 1, _opt_u64),   # carries the userfaultfd
    _R.POSTCOPY_END: _U64_SPEC,
}

#: The REPLY_ACK reply: u64 0 = success, anything else = failure (NACK).
ACK_SPEC = _U64_SPEC

_VRING_INDEXED = {_R.SET_VRING_NUM, _R.SET_VRING_ADDR, _R.SET_VRING_BASE, _R.GET_VRING_BASE, _R.SET_VRING_ENABLE}


def has_reply(request: int) -> bool:
    """True if ``request`` is always answered (GET_*, SET_LOG_BASE, POSTCOPY_ADVISE/END)."""
    return request in REPLY_SPECS


# --------------------------------------------------------------------------------------------------
# Messages
# --------------------------------------------------------------------------------------------------


def _close_fds(fds) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


@dataclass
class Message:
    """One vhost-user message. ``request`` becomes a ``VhostUserRequest`` when the id is known and stays a
    plain int otherwise. A received message owns ``fds``."""

    request: int
    flags: int = VERSION
    payload: bytes = b""
    fds: list[int] = field(default_factory=list)

    def __post_init__(self):
        try:
            self.request = VhostUserRequest(self.request)
        except ValueError:
            self.request = int(self.request)
        self.payload = bytes(self.payload)
        self.fds = list(self.fds)

    @property
    def name(self) -> str:
        return request_name(self.request)

    @property
    def size(self) -> int:
        return len(self.payload)

    @property
    def is_reply(self) -> bool:
        return bool(self.flags & REPLY)

    @property
    def need_reply(self) -> bool:
        return bool(self.flags & NEED_REPLY)

    def take_fds(self) -> list[int]:
        """Hand the fds over to the caller; the message no longer refers to them."""
        fds, self.fds = self.fds, []
        return fds

    def close_fds(self) -> None:
        _close_fds(self.take_fds())

    def __repr__(self):
        return (f"Message({self.name}, flags={self.flags:#x}, size={len(self.payload)}, "
                f"payload={self.payload.hex()}, fds={self.fds})")


def wants_ack(msg: Message) -> bool:
    """True if the backend must answer ``msg`` with ``ack()``: NEED_REPLY set on a request that has no reply of
    its own (for GET_* the reply serves as the ack)."""
    return msg.need_reply and not has_reply(msg.request)


def reply(msg: Message, payload=b"", fds: Sequence[int] = ()) -> Message:
    """The reply to request ``msg``: same request id, flags exactly 0x5. ``fds`` are borrowed, not closed."""
    if msg.is_reply:
        raise UsageError(f"{msg.name}: cannot reply to a reply")
    return Message(msg.request, REPLY_FLAGS, payload, list(fds))


def ack(msg: Message, ok: bool = True) -> Message:
    """The REPLY_ACK answer to ``msg``: u64 0 on success, 1 on failure (NACK)."""
    return reply(msg, pack_u64(0 if ok else 1))


# A backend that serves one frontend at a time answers a second connection with this one message, then closes
# it. vhost-user has no such message: request 0 (VHOST_USER_NONE, never a real request) with the reply flags
# and a text payload. Another frontend sees an unexpected reply and gives up; ours raises BackendBusy.
BUSY_REQUEST = 0
BUSY_MAGIC = b"vring-busy: "


def busy_notice(text: str) -> Message:
    return Message(BUSY_REQUEST, REPLY_FLAGS, BUSY_MAGIC + text.encode("utf-8", "replace")[:1000])


def busy_text(msg: Message) -> str | None:
    """The text of a busy notice, or None if ``msg`` is not one."""
    if msg.request == BUSY_REQUEST and msg.flags == REPLY_FLAGS and msg.payload.startswith(BUSY_MAGIC):
        return msg.payload[len(BUSY_MAGIC):].decode("utf-8", "replace")
    return None


def _left_busy_notice(conn: "Connection") -> str | None:
    """After a send failed because the peer closed: the busy notice it may have left in our receive queue."""
    try:
        msg = conn.recv(timeout=0)
    except (ProtocolError, OSError):
        return None
    msg.close_fds()
    return busy_text(msg)


# --------------------------------------------------------------------------------------------------
# Validation and decoding
# --------------------------------------------------------------------------------------------------


def _expected_fds(spec: PayloadSpec, value) -> int:
    if spec.fds == FDS_VRING:
        return 0 if value.nofd else 1
    if spec.fds == FDS_REGIONS:
        return len(value)
    return spec.fds


def _check_regions(name: str, regions: list[MemRegion]) -> None:
    for i, r in enumerate(regions):
        if r.size == 0:
            raise ProtocolError(f"{name}: region {i} has memory_size 0")
        for what, start in (("guest_phys_addr", r.gpa), ("userspace_addr", r.uaddr), ("mmap_offset", r.mmap_offset)):
            if start + r.size > 1 << 64:
                raise ProtocolError(f"{name}: region {i} {what} {start:#x} + size {r.size:#x} wraps past 2^64")
    for attr in ("gpa", "uaddr"):
        spans = sorted((getattr(r, attr), r.size, i) for i, r in enumerate(regions))
        for (a, asz, ai), (b, _bsz, bi) in zip(spans, spans[1:]):
            if b < a + asz:
                raise ProtocolError(f"{name}: regions {ai} and {bi} overlap in {attr} space "
                                    f"({a:#x}+{asz:#x} and {b:#x})")


def _decode(msg: Message, reply: bool):
    name = msg.name
    if msg.is_reply != reply:
        if reply:
            raise ProtocolError(f"{name}: expected a reply, the REPLY flag is clear (flags {msg.flags:#x})")
        raise ProtocolError(f"{name}: expected a request, got a reply (flags {msg.flags:#x})")
    if reply:
        if msg.flags != REPLY_FLAGS:
            raise ProtocolError(f"{name}: reply flags are {msg.flags:#x}, expected exactly {REPLY_FLAGS:#x}")
        spec = REPLY_SPECS.get(msg.request, ACK_SPEC)
        kind = f"{name} reply"
    else:
        spec = REQUEST_SPECS.get(msg.request)
        if spec is None:
            raise ProtocolError(f"unknown request {msg.request} (flags {msg.flags:#x}, size {msg.size})")
        if (msg.flags & VERSION_MASK) != VERSION:
            raise ProtocolError(f"{name}: version bits are {msg.flags & VERSION_MASK}, expected {VERSION}")
        kind = name
    n = len(msg.payload)
    # SET_MEM_TABLE's decoder reports its own size errors, in terms of nregions
    if spec.fds != FDS_REGIONS and not spec.min_size <= n <= spec.max_size:
        if spec.min_size == spec.max_size:
            expected = str(spec.min_size)
        else:
            expected = f"{spec.min_size} to {spec.max_size}"
        raise ProtocolError(f"{kind}: payload is {n} bytes, expected {expected}")
    value = spec.decode(msg.payload)
    want = _expected_fds(spec, value)
    if len(msg.fds) != want:
        raise ProtocolError(f"{kind}: carries {len(msg.fds)} fds, expected {want}")
    if not reply:
        if msg.request in _VRING_INDEXED and value.index >= MAX_VRINGS:
            raise ProtocolError(f"{name}: vring index {value.index} out of range (max {MAX_VRINGS - 1})")
        if msg.request == _R.SET_MEM_TABLE:
            _check_regions(name, value)
    return value


def decode(msg: Message, *, reply: bool = False):
    """Validate ``msg`` as a request (default; the backend's side) or, with ``reply=True``, as a reply to
    ``msg.request`` (the frontend's side), and return its payload as a value:

    * no payload: ``None``; u64 requests and acks: ``int``; SEND_RARP: the 6-byte MAC;
    * vring state: ``VringState``; SET_VRING_ADDR: ``VringAddr``; KICK/CALL/ERR: ``VringFile``;
    * SET_MEM_TABLE: ``list[MemRegion]``; SET_LOG_BASE: ``LogBase``; GET/SET_INFLIGHT_FD: ``Inflight``;
    * GET/SET_CONFIG: ``ConfigSpace``; IOTLB_MSG: ``IotlbMsg``; CRYPTO_CREATE_SESS: raw bytes.

    Replies: the value per ``REPLY_SPECS`` (e.g. ``int`` for GET_FEATURES, ``VringState`` for GET_VRING_BASE),
    or the ack ``int`` for every other request.

    Checks: REPLY bit as expected; requests: id known, version bits == 1; replies: flags exactly 0x5; payload size;
    fd count (0 for every message that takes none); vring index < 256; memory regions non-empty, not wrapping
    and not overlapping (in gpa or uaddr space). On failure raises ProtocolError *after closing the message's
    fds*. It does not check values against negotiated state (feature subsets, ring sizes): that is the caller's.
    """
    try:
        return _decode(msg, reply)
    except ProtocolError:
        msg.close_fds()
        raise


def validate(msg: Message, *, reply: bool = False) -> None:
    """``decode`` without the value: raises ProtocolError (fds closed) if ``msg`` breaks the protocol."""
    decode(msg, reply=reply)


# --------------------------------------------------------------------------------------------------
# Connection
# --------------------------------------------------------------------------------------------------

_FD_ITEMSIZE = array("i").itemsize
_CMSG_BUFSIZE = socket.CMSG_SPACE(MAX_FDS * _FD_ITEMSIZE)


def _remaining(deadline):
    return None if deadline is None else max(deadline - time.monotonic(), 0.0)


class Connection:
    """Framing over a connected AF_UNIX SOCK_STREAM socket (owned: ``close`` closes it).

    ``timeout`` arguments are seconds; ``None`` blocks. A timeout before the first byte of a message leaves the
    connection usable. Anything that leaves the byte stream out of step (timeout or error in the middle of a
    message, an oversize header, a reply that does not match) marks it ``broken``, and every later send/recv
    raises ProtocolError.
    """

    def __init__(self, sock: socket.socket):
        if sock.family != socket.AF_UNIX or sock.type != socket.SOCK_STREAM:
            raise ConfigError(f"vhost-user needs an AF_UNIX SOCK_STREAM socket, not {sock.family!r}/{sock.type!r}")
        self._sock = sock
        self.broken: str | None = None

    # -- plumbing ------------------------------------------------------------------------------------

    @property
    def sock(self) -> socket.socket:
        return self._sock

    @property
    def closed(self) -> bool:
        return self._sock is None

    def fileno(self) -> int:
        return -1 if self._sock is None else self._sock.fileno()

    def close(self) -> None:
        if self._sock is not None:
            sock, self._sock = self._sock, None
            sock.close()

    def mark_broken(self, reason: str) -> None:
        """Declare the stream out of step; later send/recv raise ProtocolError."""
        if self.broken is None:
            self.broken = reason

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        state = "closed" if self.closed else (f"broken: {self.broken}" if self.broken else "open")
        return f"<Connection fd={self.fileno()} {state}>"

    def _check(self) -> socket.socket:
        if self._sock is None:
            raise ProtocolError("vhost-user connection is closed")
        if self.broken is not None:
            raise ProtocolError(f"vhost-user connection is unusable after an earlier error: {self.broken}")
        return self._sock

    # -- send ----------------------------------------------------------------------------------------

    def send(self, msg: Message, timeout: float | None = None) -> None:
        """Send header + payload in one ``sendmsg``, with the fds as one SCM_RIGHTS message (borrowed, not
        closed). Raises ConfigError for a message this side must not send (more than 8 fds, a bad fd, payload
        over MAX_PAYLOAD), PeerGone, ProtocolTimeout."""
        sock = self._check()
        fds = list(msg.fds)
        if len(fds) > MAX_FDS:
            raise ConfigError(f"{msg.name}: {len(fds)} fds, at most {MAX_FDS} per message")
        if any(not isinstance(fd, int) or fd < 0 for fd in fds):
            raise ConfigError(f"{msg.name}: invalid fd in {fds}")
        payload = bytes(msg.payload)
        if len(payload) > MAX_PAYLOAD:
            raise ConfigError(f"{msg.name}: payload of {len(payload)} bytes exceeds {MAX_PAYLOAD}")
        data = _pack(HEADER, "header", int(msg.request), msg.flags, len(payload)) + payload
        anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array("i", fds).tobytes())] if fds else []
        deadline = None if timeout is None else time.monotonic() + timeout
        sent = 0
        try:
            sock.settimeout(_remaining(deadline))
            sent = sock.sendmsg([data], anc, socket.MSG_NOSIGNAL)
            while sent < len(data):   # only a tiny or full socket buffer splits a message; fds went with byte 0
                sock.settimeout(_remaining(deadline))
                sent += sock.send(data[sent:], socket.MSG_NOSIGNAL)
        except (TimeoutError, BlockingIOError):
            if sent:
                self.mark_broken(f"timed out sending {msg.name} after {sent} of {len(data)} bytes")
            raise ProtocolTimeout(f"{msg.name}: send timed out after {timeout}s") from None
        except (BrokenPipeError, ConnectionResetError) as e:
            raise PeerGone(f"{msg.name}: peer closed the connection ({e.strerror})") from e
        except OSError as e:
            if e.errno == errno.EBADF and sent == 0:
                raise ConfigError(f"{msg.name}: cannot send fds {fds}: {e.strerror}") from e
            self.mark_broken(f"sendmsg failed: {e}")
            raise ProtocolError(f"{msg.name}: sendmsg failed: {e}") from e

    # -- recv ----------------------------------------------------------------------------------------

    def _recv_chunk(self, sock, nbytes, deadline, fds):
        sock.settimeout(_remaining(deadline))
        data, anc, mflags, _addr = sock.recvmsg(nbytes, _CMSG_BUFSIZE, socket.MSG_CMSG_CLOEXEC)
        for level, ctype, cdata in anc:
            if level == socket.SOL_SOCKET and ctype == socket.SCM_RIGHTS:
                got = array("i")
                got.frombytes(cdata[:len(cdata) - len(cdata) % _FD_ITEMSIZE])
                fds.extend(got)
        return data, bool(mflags & socket.MSG_CTRUNC)

    def recv(self, timeout: float | None = None, strict: bool = True) -> Message:
        """Read one message: the 12-byte header with ``recvmsg`` (collecting fds), then the payload, looping on
        short reads. ``timeout`` covers the whole message.

        Checks the framing only: version bits == 1, size <= MAX_PAYLOAD, at most 8 fds (MSG_CTRUNC). It does not
        check the request id or per-request rules (see ``decode``); ``strict=False`` skips the version check too
        (a transparent proxy passes such a message on for the peer to judge). Raises PeerGone on EOF or reset,
        ProtocolTimeout, ProtocolError; the fds of a rejected message are closed."""
        sock = self._check()
        deadline = None if timeout is None else time.monotonic() + timeout
        fds: list[int] = []
        header = bytearray()
        payload = bytearray()
        truncated = False
        name = "message"
        try:
            try:
                while len(header) < HEADER_SIZE:
                    data, trunc = self._recv_chunk(sock, HEADER_SIZE - len(header), deadline, fds)
                    truncated |= trunc
                    if not data:
                        if header:
                            raise PeerGone(f"peer closed the connection inside a message header "
                                           f"({len(header)} of {HEADER_SIZE} bytes)")
                        raise PeerGone("peer closed the connection")
                    header += data
                request, flags, size = HEADER.unpack(header)
                name = request_name(request)
                if size > MAX_PAYLOAD:
                    self.mark_broken(f"{name} announced a {size}-byte payload")
                    raise ProtocolError(f"{name}: header announces a {size}-byte payload, "
                                        f"more than the limit of {MAX_PAYLOAD}")
                while len(payload) < size:
                    data, trunc = self._recv_chunk(sock, size - len(payload), deadline, fds)
                    truncated |= trunc
                    if not data:
                        raise PeerGone(f"peer closed the connection inside {name} "
                                       f"({len(payload)} of {size} payload bytes)")
                    payload += data
            except (TimeoutError, BlockingIOError):
                if header:
                    self.mark_broken(f"timed out inside {name}")
                    raise ProtocolTimeout(f"{name}: timed out after {len(header) + len(payload)} bytes "
                                          f"of the message ({timeout}s)") from None
                raise ProtocolTimeout(f"no message within {timeout}s") from None
            except ConnectionResetError as e:
                raise PeerGone(f"peer reset the connection ({e.strerror})") from e
            except OSError as e:
                self.mark_broken(f"recvmsg failed: {e}")
                raise ProtocolError(f"recvmsg failed: {e}") from e
            if truncated:
                raise ProtocolError(f"{name}: control data truncated (more than {MAX_FDS} fds); "
                                    f"received fds closed")
            if strict and (flags & VERSION_MASK) != VERSION:
                raise ProtocolError(f"{name}: version bits are {flags & VERSION_MASK}, expected {VERSION} "
                                    f"(flags {flags:#x})")
        except BaseException:
            _close_fds(fds)
            raise
        return Message(request, flags, bytes(payload), fds)


# --------------------------------------------------------------------------------------------------
# Frontend helper
# --------------------------------------------------------------------------------------------------


def client_call(conn: Connection, request: int, payload=b"", fds: Sequence[int] = (), need_reply: bool = False,
                timeout: float | None = 5.0) -> Message | None:
    """Send one request (flags 0x1, or 0x9 with ``need_reply``) and, when a reply is due (``has_reply(request)``
    or ``need_reply``), wait for it up to ``timeout`` seconds and check it as virtio_user does: flags exactly
    0x5, the same request id, the expected size and fd count, for GET_VRING_BASE the same vring index.

    Returns the reply Message (its fds are the caller's; ``decode(rep, reply=True)`` gives the value), or None when no
    reply is due. Raises ProtocolNack for an ack with a non-zero u64 (the connection stays usable); any other
    failure to get a good reply marks the connection broken and raises ProtocolTimeout / PeerGone /
    ProtocolError. ``fds`` are borrowed, not closed."""
    msg = Message(request, VERSION | (NEED_REPLY if need_reply else 0), payload, list(fds))
    name = msg.name
    try:
        conn.send(msg, timeout)
    except PeerGone as e:
        text = _left_busy_notice(conn)
        if text is not None:
            raise BackendBusy(f"{name}: the backend refused the connection: {text}") from e
        raise
    if not (has_reply(msg.request) or need_reply):
        return None
    try:
        rep = conn.recv(timeout)
    except ProtocolTimeout:
        conn.mark_broken(f"no reply to {name}")
        raise ProtocolTimeout(f"{name}: no reply within {timeout}s") from None
    except PeerGone:
        raise
    except ProtocolError as e:
        conn.mark_broken(f"bad reply to {name}: {e}")
        raise
    try:
        text = busy_text(rep)
        if text is not None:
            conn.mark_broken(f"backend busy: {text}")
            raise BackendBusy(f"{name}: the backend refused the connection: {text}")
        if rep.flags != REPLY_FLAGS:
            raise ProtocolError(f"{name}: reply flags are {rep.flags:#x}, expected exactly {REPLY_FLAGS:#x}")
        if rep.request != msg.request:
            raise ProtocolError(f"{name}: got a reply to {rep.name} instead")
        value = decode(rep, reply=True)
        if msg.request == _R.GET_VRING_BASE:
            sent_index = VringState.unpack(msg.payload).index
            if value.index != sent_index:
                raise ProtocolError(f"{name}: reply is for vring {value.index}, asked for vring {sent_index}")
        if not has_reply(msg.request) and value != 0:
            raise ProtocolNack(f"{name}: peer replied NACK ({value:#x})", int(msg.request), value)
    except ProtocolNack:
        rep.close_fds()
        raise
    except ProtocolError as e:
        rep.close_fds()
        conn.mark_broken(f"bad reply to {name}: {e}")
        raise
    return rep


# --------------------------------------------------------------------------------------------------
# Sockets
# --------------------------------------------------------------------------------------------------


def socket_is_live(path, timeout: float = 1.0) -> bool:
    """Does a server listen on the Unix socket at ``path``? (connect; refused or missing: no). A socket we may
    not connect to, or whose backlog stays full, counts as live: it is not ours to replace."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)
        sock.connect(os.fspath(path))
    except (ConnectionRefusedError, FileNotFoundError):
        return False
    except OSError:
        return True
    finally:
        sock.close()
    return True


LISTEN_LOCK_WAIT = 1.0   # seconds listen_unix waits for the directory's lock (a peer holds it for its check and
#                          bind: microseconds, unless the check's connect to a stale-looking socket waits)


def listen_unix(path, backlog: int = 1, stop=None) -> socket.socket | None:
    """A listening AF_UNIX stream socket at ``path`` with mode 0600 (set before ``listen``, so nobody can connect
    earlier). A live server at ``path`` is never taken over (ConfigError); a stale socket file is replaced;
    any other file there is a ConfigError. Check, replace and bind hold an flock on the socket's directory:
    two of us starting on one stale path at once could otherwise both find it stale, and the second unlink the
    first one's fresh socket (which then listens where nobody can reach it). The lock is only asked for, for a
    second at most: a directory someone else keeps locked (``flock DIR cmd``, our own parent), or one that cannot
    be locked (NFS), goes without it. ``stop()`` turning true during that wait (a stop signal's handler ran) ends
    it with None: nothing bound."""
    path = os.fspath(path)
    try:
        dfd = os.open(os.path.dirname(path) or ".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        dfd = None   # a directory we may not read: bind reports what is wrong with it
    try:
        deadline = time.monotonic() + LISTEN_LOCK_WAIT
        while dfd is not None:
            try:
                fcntl.flock(dfd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if stop is not None and stop():
                    return None
                if time.monotonic() > deadline:
                    break
                time.sleep(0.005)
            except OSError:
                break
        return _listen_unix_locked(path, backlog)
    finally:
        if dfd is not None:
            os.close(dfd)   # (releases the lock)


#: the longest unix socket path Python binds or connects: sun_path is 108 bytes on Linux, its NUL included
SUN_PATH_MAX = 107


def check_unix_path(path):
    """ConfigError when ``path`` cannot name a unix socket at all (bind and connect would say "AF_UNIX path too
    long" only once the run is under way)."""
    n = len(os.fsencode(path))
    if n == 0:   # bind and connect say only "Invalid argument" or "No such file"
        raise ConfigError("an empty path names no unix socket")
    if n > SUN_PATH_MAX:
        raise ConfigError(f"{path}: {n} bytes, longer than a unix socket path can be ({SUN_PATH_MAX}); "
                          f"choose a shorter one")


def check_listen_path(path):
    """ConfigError when ``path`` could not be listened on: too long, a file there that is not a socket, or a socket
    somebody listens on. Returns whether a stale socket file is there (listen_unix replaces it)."""
    check_unix_path(path)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    except (OSError, ValueError) as e:   # a plain file on the way (ENOTDIR), a loop, a NUL in the path
        raise ConfigError(f"{path}: {getattr(e, 'strerror', None) or e}") from None
    if not stat.S_ISSOCK(st.st_mode):
        raise ConfigError(f"{path} exists and is not a socket; not removing it")
    if socket_is_live(path):
        raise ConfigError(f"{path}: a server is listening on this socket already; not taking it over "
                          f"(stop it, or choose another path)")
    return True


def _listen_unix_locked(path, backlog):
    if check_listen_path(path):
        os.unlink(path)   # stale: nobody listens there any more
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    bound = False
    try:
        sock.bind(path)
        bound = True
        os.chmod(path, 0o600)
        sock.listen(backlog)
    except BaseException as e:
        sock.close()
        if bound:
            try:
                if stat.S_ISSOCK(os.lstat(path).st_mode):
                    os.unlink(path)
            except OSError:
                pass
        if isinstance(e, OSError):
            raise ConfigError(f"cannot listen on {path}: {e}") from e
        raise
    return sock


def close_listener(listener: socket.socket, path, ino) -> None:
    """Close a socket made by ``listen_unix`` and remove its file, if the file there is still that socket (inode
    ``ino``, ``os.lstat(path).st_ino`` right after listening), not one somebody else has bound since."""
    listener.close()
    try:
        st = os.lstat(path)
        if stat.S_ISSOCK(st.st_mode) and st.st_ino == ino:
            os.unlink(path)
    except OSError:
        pass


def accept_unix(listener: socket.socket, timeout: float | None = None) -> Connection:
    """Accept one connection from ``listen_unix``'s socket; ProtocolTimeout if nobody connects in time."""
    listener.settimeout(timeout)
    try:
        sock, _addr = listener.accept()
    except (TimeoutError, BlockingIOError):
        raise ProtocolTimeout(f"nobody connected within {timeout}s") from None
    return Connection(sock)


def connect_unix(path, timeout: float | None = 5.0) -> Connection:
    """Connect to a vhost-user socket. PeerGone if nobody listens there (missing file or refused),
    ProtocolTimeout if the listener's backlog stays full."""
    path = os.fspath(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)
        sock.connect(path)
    except (FileNotFoundError, ConnectionRefusedError) as e:
        sock.close()
        raise PeerGone(f"nobody listens on {path} ({e.strerror})") from e
    except (TimeoutError, BlockingIOError):
        sock.close()
        raise ProtocolTimeout(f"connect to {path} timed out after {timeout}s") from None
    except OSError as e:
        sock.close()
        raise ProtocolError(f"cannot connect to {path}: {e}") from e
    except BaseException:
        sock.close()
        raise
    sock.settimeout(None)
    return Connection(sock)


__all__ = [
    "VERSION", "VERSION_MASK", "REPLY", "NEED_REPLY", "REPLY_FLAGS", "HEADER", "HEADER_SIZE",
    "MAX_FDS", "MAX_REGIONS", "MAX_VRINGS", "MAX_CONFIG_SIZE", "MAX_PAYLOAD",
    "VRING_IDX_MASK", "VRING_NOFD_MASK", "VHOST_USER_F_PROTOCOL_FEATURES", "VHOST_VRING_F_LOG",
    "MEM_TABLE_HEADER_SIZE", "MEM_REGION_SIZE", "CONFIG_HEADER_SIZE", "INFLIGHT_SIZE",
    "VhostUserRequest", "VhostUserProtocolFeature", "request_name",
    "pack_u64", "unpack_u64", "pack_mem_table", "unpack_mem_table",
    "VringState", "VringAddr", "VringFile", "MemRegion", "LogBase", "Inflight", "ConfigSpace", "IotlbMsg",
    "FDS_VRING", "FDS_REGIONS", "PayloadSpec", "REQUEST_SPECS", "REPLY_SPECS", "ACK_SPEC", "has_reply",
    "Message", "wants_ack", "reply", "ack", "decode", "validate",
    "Connection", "client_call", "listen_unix", "accept_unix", "connect_unix", "socket_is_live",
    "BUSY_REQUEST", "busy_notice", "busy_text",
]
