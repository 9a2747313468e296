"""What the fuzz targets share: a reader that turns the fuzzer's bytes into values (front to back, zeros once
they run out, so a mutation changes a value without shifting everything after it much), its writer twin for
seeds, and guest memory whose every area is its own heap block, so AddressSanitizer sees any access past one.
"""
import os
import struct

import numpy as np

from rings.shm import MemoryTable


class Reader:
    def __init__(self, data):
        self.data = bytes(data)
        self.pos = 0

    @property
    def left(self):
        return len(self.data) - self.pos

    def bytes(self, n):
        out = self.data[self.pos:self.pos + n]
        self.pos += len(out)
        return out

    def _int(self, fmt, n):
        raw = self.bytes(n)
        return struct.unpack(fmt, raw + bytes(n - len(raw)))[0]

    def u8(self):
        return self._int("<B", 1)

    def u16(self):
        return self._int("<H", 2)

    def u32(self):
        return self._int("<I", 4)

    def u64(self):
        return self._int("<Q", 8)

    def below(self, n):
        """A value in 0..n-1 (n <= 65536)."""
        return (self.u8() if n <= 256 else self.u16()) % n

    def choice(self, seq):
        return seq[self.below(len(seq))]

    def pick(self, *options):
        """One of the options (a byte chooses); a callable option is called, so it reads only when chosen."""
        o = options[self.below(len(options))]
        return o() if callable(o) else o


class Writer:
    """Builds seed inputs with the same encoding Reader reads."""

    def __init__(self):
        self.parts = []

    def raw(self, data):
        self.parts.append(bytes(data))
        return self

    def u8(self, v):
        return self.raw(struct.pack("<B", v & 0xFF))

    def u16(self, v):
        return self.raw(struct.pack("<H", v & 0xFFFF))

    def u32(self, v):
        return self.raw(struct.pack("<I", v & 0xFFFFFFFF))

    def u64(self, v):
        return self.raw(struct.pack("<Q", v & 0xFFFFFFFFFFFFFFFF))

    def bytes(self):
        return b"".join(self.parts)


class GuestMemory:
    """Named areas at guest addresses, each its own numpy allocation of exactly its size (malloc'ed: with
    PYTHONMALLOC=malloc and ASan, one byte past an area is a report)."""

    def __init__(self, areas):
        """``areas``: [(name, gpa, size)]."""
        self.arrays, self.gpa = {}, {}
        regions = []
        for name, gpa, size in areas:
            arr = np.zeros(size, np.uint8)
            self.arrays[name], self.gpa[name] = arr, gpa
            regions.append((gpa, size, arr))
        self.table = MemoryTable(regions)

    def write(self, name, offset, data):
        """Write data into area `name` at offset (wrapped into the area, clipped at its end)."""
        arr = self.arrays[name]
        if not len(arr) or not data:
            return
        offset %= len(arr)
        data = data[:len(arr) - offset]
        arr[offset:offset + len(data)] = np.frombuffer(data, np.uint8)


def open_fds():
    """This process's open file descriptors (a target that leaks one per input would run out)."""
    return len(os.listdir("/proc/self/fd"))


class SnapshotOnce:
    """A harness's snapshot(): the queue's decoded snapshot, at most once per input (a decode lists every chain
    with its slots; one per input keeps the exec rate while still reaching the decoder on every ring state)."""
    snapshotted = False

    def snapshot(self):
        if not self.snapshotted:
            self.snapshotted = True
            self.q.snapshot()
