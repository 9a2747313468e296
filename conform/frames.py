"""Frames the harnesses send, and how they recognise them when they come back.

A frame is Ethernet/IPv4/UDP (virtio.packets.template) with a 16-byte stamp right after the UDP header:
``MAGIC`` (4 bytes), a run id (4), a sequence number (4) and a check value (4: CRC-32 of the 12 before it).
The check tells a stamp a peer damaged (any changed bit) from an intact one of another run (a frame an earlier
run left in the peer). A forwarding peer may rewrite the MAC addresses (testpmd mac, macswap), so frames are
compared from byte 12 on. Sizes are frame sizes without the FCS.
"""
from __future__ import annotations

import struct
import zlib

import numpy as np

from vhost.datapath import hdr_len as hdr_size  # noqa: F401 (NET-02/03: one rule for both roles)
from virtio.packets import template

MAGIC = b"VRCF"
STAMP_OFF = 42              # after Ethernet (14), IPv4 (20) and UDP (8)
STAMP = struct.Struct("<4sIII")   # magic, run id, sequence number, check
_STAMPED = struct.Struct("<4sII")  # what the check covers
MIN_FRAME = 60
MAX_FRAME = 1514            # one Ethernet MTU; larger frames only where a peer merges buffers
CMP_FROM = 12               # after the two MAC addresses

NET_HDR = struct.Struct("<BBHHHHH")   # flags, gso_type, hdr_len, gso_size, csum_start, csum_offset, num_buffers
VIRTIO_NET_HDR_F_NEEDS_CSUM = 1
VIRTIO_NET_HDR_F_DATA_VALID = 2
VIRTIO_NET_HDR_F_RSC_INFO = 4

_templates: dict[int, bytes] = {}


def stamp(run_id, seq):
    """The 16 stamp bytes of frame ``seq`` of run ``run_id``."""
    head = _STAMPED.pack(MAGIC, run_id, seq)
    return head + struct.pack("<I", zlib.crc32(head))


def make_frame(size, run_id, seq):
    """A frame of ``size`` bytes carrying (run_id, seq)."""
    size = max(size, MIN_FRAME)
    t = _templates.get(size)
    if t is None:
        t = _templates[size] = template(size).tobytes()
    return t[:STAMP_OFF] + stamp(run_id, seq) + t[STAMP_OFF + STAMP.size:]


def read_stamp(frame, off=STAMP_OFF):
    """(run id, sequence number) of an intact stamp (our magic, the check right) at ``off``, or None."""
    if len(frame) < off + STAMP.size or off < 0:
        return None
    magic, rid, seq, check = STAMP.unpack_from(frame, off)
    if magic != MAGIC or check != zlib.crc32(frame[off:off + _STAMPED.size]):
        return None
    return rid, seq


def stamp_of(frame, run_id):
    """The sequence number of one of our frames of run ``run_id`` (its stamp intact), or None."""
    st = read_stamp(frame)
    return st[1] if st is not None and st[0] == run_id else None


def find_stamp(data, run_id, before, after):
    """An intact stamp of run ``run_id`` from ``before`` bytes before STAMP_OFF to ``after`` bytes after it, not
    at STAMP_OFF: (its offset - STAMP_OFF, sequence number), or None. What a header of another size leaves."""
    key = MAGIC + struct.pack("<I", run_id)
    lo, hi = max(0, STAMP_OFF - before), STAMP_OFF + after + STAMP.size
    i = data.find(key, lo, hi)
    while i >= 0:
        st = read_stamp(data, i)
        if i != STAMP_OFF and st is not None and st[0] == run_id:
            return i - STAMP_OFF, st[1]
        i = data.find(key, i + 1, hi)
    return None


def same_but_stamp(frame, run_id):
    """True when ``frame`` is, outside the MAC addresses and the stamp, the frame this run sends at its length:
    what is left of one of ours whose stamp was changed (every frame of one length differs only there)."""
    end = STAMP_OFF + STAMP.size
    if len(frame) < max(end, MIN_FRAME):
        return False
    t = make_frame(len(frame), run_id, 0)
    return frame[CMP_FROM:STAMP_OFF] == t[CMP_FROM:STAMP_OFF] and frame[end:] == t[end:]


def same_frame(got, sent):
    """True when ``got`` is ``sent`` up to the MAC addresses."""
    return len(got) == len(sent) and got[CMP_FROM:] == sent[CMP_FROM:]


def first_difference(got, sent):
    """A short description of where two frames differ (for evidence)."""
    if len(got) != len(sent):
        return f"length {len(got)}, sent {len(sent)}"
    a = np.frombuffer(got, np.uint8)[CMP_FROM:]
    b = np.frombuffer(sent, np.uint8)[CMP_FROM:]
    diff = np.nonzero(a != b)[0]
    if not len(diff):
        return "identical"
    i = int(diff[0]) + CMP_FROM
    return (f"{len(diff)} bytes differ, first at offset {i}: got {got[i:i + 8].hex()} "
            f"sent {sent[i:i + 8].hex()}")


def net_hdr(num_buffers=0, flags=0, gso_type=0, hdr_len=0, gso_size=0, csum_start=0, csum_offset=0):
    return NET_HDR.pack(flags, gso_type, hdr_len, gso_size, csum_start, csum_offset, num_buffers)


def parse_net_hdr(data):
    """(flags, gso_type, hdr_len, gso_size, csum_start, csum_offset, num_buffers) of a 12-byte header."""
    return NET_HDR.unpack_from(data, 0)
