"""Test frames: one Ethernet/IPv4/UDP template per run, written into pool buffers by C (``vn_gen``)."""
import struct

import numpy as np

# net_vhost's port MAC is 56:48:4f:53:54:<port> ("VHOST"); testpmd's default peer address is 02:00:00:00:00:<port>.
# With --forward-mode=mac testpmd sends a frame back with dst = peer, src = its MAC: exactly our frame with the
# MACs swapped.
DEFAULT_DST = "56:48:4f:53:54:00"
DEFAULT_SRC = "02:00:00:00:00:00"
TS_OFF = 42           # u64 CLOCK_MONOTONIC ns (when stamping) right after the UDP header: macfwd restamps it at
                      # every forward, and here it shares the header's line (pool.HEADROOM)
SEQ_OFF = 50          # u64 sequence number (written once, when the frame is built)
MIN_SIZE = 60


def mac_bytes(s):
    b = bytes(int(x, 16) for x in s.split(":"))
    if len(b) != 6:
        raise ValueError(f"bad MAC address {s!r}")
    return b


def _csum(data):
    if len(data) % 2:
        data += b"\0"
    s = sum(struct.unpack(f"!{len(data) // 2}H", data))
    while s >> 16:
        s = (s & 0xFFFF) + (s >> 16)
    return ~s & 0xFFFF


def template(size=64, dst=DEFAULT_DST, src=DEFAULT_SRC):
    """A frame of ``size`` bytes (no FCS): Ethernet, IPv4 (checksummed), UDP (checksum 0), payload pattern."""
    size = max(size, MIN_SIZE)
    ip_len = size - 14
    ip = struct.pack("!BBHHHBBH4s4s", 0x45, 0, ip_len, 0, 0, 64, 17, 0, bytes([198, 18, 0, 1]),
                     bytes([198, 18, 0, 2]))
    ip = ip[:10] + struct.pack("!H", _csum(ip)) + ip[12:]
    udp = struct.pack("!HHHH", 9, 9, ip_len - 20, 0)
    payload = bytes((i * 7 + 3) & 0xFF for i in range(size - 42))
    frame = mac_bytes(dst) + mac_bytes(src) + b"\x08\x00" + ip + udp + payload
    assert len(frame) == size
    return np.frombuffer(frame, np.uint8).copy()
