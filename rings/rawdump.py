"""Raw ring snapshots: the bytes of a queue's three ring areas, its layout, features and private state,
in one file that decodes later exactly as the live queue did.

File format (version 1), all little-endian::

    line 1   b"VRING-RAW 1\\n"
    line 2   one line of JSON (UTF-8, no newline inside), ending in b"\\n": the header
    rest     the blobs, back to back, in the order the header lists them

Header keys: ``kind`` ('driver' | 'device' | 'memory': memory-only, no private state), ``time`` (Unix
seconds when taken), ``layout`` {fmt, size, desc, driver, device} (guest addresses), ``features`` (int),
``in_order`` (bool), ``broken`` (None | {error, message}), ``state`` (the queue's ``state()`` dict of ints;
{} for memory), ``meta`` (free-form: queue name, pid, ...), ``blobs``: a list of {name, dtype, count}
(numpy dtype string; bytes = count * itemsize). Blob names: ``desc``, ``driver``, ``device`` (the ring
areas, dtype u1, their spec sizes); ``id_inflight``, ``id_ndesc``, ``id_wlen``, and on the driver
``free_next``, ``id_token`` (per-id private arrays). Indirect tables and buffers are not saved.

``capture(q)`` copies a live queue (any object with the interface rings.snapshot reads, or a
MemoryTable + layout through ``capture_memory``); ``save``/``dumps`` write it; ``load``/``loads`` read it.
A ``RawSnapshot`` has that same interface, so ``snapshot()`` decodes it with rings.snapshot's builder.

Broken-queue hook: ``set_snapshot_dir(path)`` (or the VRING_SNAPSHOT_DIR environment variable, read when
a queue breaks) turns on ``on_broken(q, err)``: both ring implementations call it the first time a
RingError breaks a queue; it writes a raw snapshot there, sets ``err.snapshot_path`` and appends
" (ring snapshot: PATH)" to the message. Off by default.
"""
import itertools
import json
import os
import threading
import time

import numpy as np

from . import errors
from .layout import QueueLayout, area_sizes
from .shm import MemoryTable
from .snapshot import device_snapshot, driver_snapshot, memory_snapshot

MAGIC = b"VRING-RAW 1\n"
_ARRAYS = {"driver": (("id_inflight", "u1"), ("id_ndesc", "<u2"), ("id_wlen", "<u4"), ("free_next", "<u2"),
                      ("id_token", "<u8")),
           "device": (("id_inflight", "u1"), ("id_ndesc", "<u2"), ("id_wlen", "<u4")),
           "memory": ()}


class RawSnapshot:
    """A frozen copy of one queue half (or of ring memory alone) with the snapshot interface."""

    def __init__(self, kind, layout, features, in_order, state, areas, arrays, broken=None, when=None,
                 meta=None):
        self.kind = kind
        self.layout = layout
        self.features = int(features)
        self.in_order = bool(in_order)
        self._state = dict(state)
        self.areas = areas            # {'desc'|'driver'|'device': bytes}
        self.arrays = arrays          # {name: numpy array}
        self.broken_info = broken     # None | {'error', 'message'}
        self.broken = _rebuild_error(broken)
        self.time = time.time() if when is None else when
        self.meta = dict(meta or {})
        for name, arr in arrays.items():
            setattr(self, name, arr)
        self.mem = _areas_table(layout, areas)

    def state(self):
        return dict(self._state)

    def snapshot(self):
        """The rings.snapshot dict, exactly as the live queue gave it when this copy was taken."""
        if self.kind == "driver":
            return driver_snapshot(self)
        if self.kind == "device":
            return device_snapshot(self)
        return memory_snapshot(self.mem, self.layout, self.features)

    def header(self):
        lay = self.layout
        return {"kind": self.kind, "time": self.time,
                "layout": {"fmt": lay.fmt, "size": lay.size, "desc": lay.desc, "driver": lay.driver,
                           "device": lay.device},
                "features": self.features, "in_order": self.in_order, "broken": self.broken_info,
                "state": self._state, "meta": self.meta}

    def dumps(self):
        header = self.header()
        blobs, parts = [], []
        for name in ("desc", "driver", "device"):
            blobs.append({"name": name, "dtype": "u1", "count": len(self.areas[name])})
            parts.append(bytes(self.areas[name]))
        for name, dtype in _ARRAYS[self.kind]:
            arr = np.asarray(self.arrays[name], dtype=dtype)
            blobs.append({"name": name, "dtype": dtype, "count": int(arr.size)})
            parts.append(arr.tobytes())
        header["blobs"] = blobs
        return MAGIC + json.dumps(header, separators=(",", ":")).encode() + b"\n" + b"".join(parts)

    def save(self, path):
        """Write the file (atomically: a temporary name, then rename), mode 0600. Returns the path."""
        path = os.fspath(path)
        tmp = f"{path}.tmp{os.getpid()}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(self.dumps())
        os.replace(tmp, path)
        return path


def _rebuild_error(info):
    if info is None:
        return None
    cls = getattr(errors, info["error"], None)
    if not (isinstance(cls, type) and issubclass(cls, errors.VringError)):
        cls = type(info["error"], (errors.RingError,), {})
    err = cls.__new__(cls)
    Exception.__init__(err, info["message"])
    return err


def _areas_table(layout, areas):
    """A MemoryTable holding the three saved areas at their guest addresses (merged where they overlap)."""
    spans = sorted((getattr(layout, name), bytes(areas[name])) for name in ("desc", "driver", "device"))
    merged = []
    for gpa, data in spans:
        if merged and gpa <= merged[-1][0] + len(merged[-1][1]):
            base, buf = merged[-1]
            end = max(base + len(buf), gpa + len(data))
            buf = buf + bytearray(end - base - len(buf))
            buf[gpa - base:gpa - base + len(data)] = data
            merged[-1] = (base, buf)
        else:
            merged.append((gpa, bytearray(data)))
    return MemoryTable([(gpa, len(buf), buf) for gpa, buf in merged])


def _kind(q):
    side = getattr(q, "side", "")
    if side not in ("driver", "device"):
        raise errors.ConfigError(f"cannot snapshot {q!r}: not a driver or device queue half")
    return side


def capture(q, meta=None):
    """Copy a live queue half now. Reads only; safe while another thread runs the data path (the copy may
    then mix values from a few descriptors apart, never crash)."""
    kind = _kind(q)
    st = {k: int(v) for k, v in q.state().items()}
    arrays = {name: np.array(getattr(q, name), dtype=dtype) for name, dtype in _ARRAYS[kind]}
    mem = getattr(q.mem, "table", q.mem)
    areas = _copy_areas(mem, q.layout)
    b = q.broken
    broken = None if b is None else {"error": type(b).__name__, "message": str(b)}
    return RawSnapshot(kind, q.layout, q.features, q.in_order, st, areas, arrays, broken, meta=meta)


def capture_memory(mem, layout, features, meta=None):
    """Copy the ring areas alone (no private state: a region attached by name, a peer's memory)."""
    mem = getattr(mem, "table", mem)
    in_order = bool(int(features) >> 35 & 1)
    return RawSnapshot("memory", layout, features, in_order, {}, _copy_areas(mem, layout), {}, meta=meta)


def _copy_areas(mem, layout):
    sizes = area_sizes(layout.fmt, layout.size)
    return {name: mem.read(getattr(layout, name), nbytes)
            for name, nbytes in zip(("desc", "driver", "device"), sizes)}


def loads(data):
    """A RawSnapshot from the bytes of a file written by dumps/save (ConfigError if they are not one)."""
    data = bytes(data)
    if not data.startswith(MAGIC):
        raise errors.ConfigError("not a vring raw snapshot (bad magic)")
    end = data.find(b"\n", len(MAGIC))
    if end < 0:
        raise errors.ConfigError("vring raw snapshot: header line not terminated")
    try:
        h = json.loads(data[len(MAGIC):end])
        lay = h["layout"]
        layout = QueueLayout(lay["fmt"], lay["size"], lay["desc"], lay["driver"], lay["device"])
        kind = h["kind"]
        if kind not in _ARRAYS:
            raise errors.ConfigError(f"vring raw snapshot: unknown kind {kind!r}")
        pos, blobs = end + 1, {}
        for b in h["blobs"]:
            dt = np.dtype(b["dtype"])
            n = int(b["count"]) * dt.itemsize
            if pos + n > len(data):
                raise errors.ConfigError(f"vring raw snapshot: blob {b['name']} is truncated")
            blobs[b["name"]] = data[pos:pos + n] if dt == np.uint8 and b["name"] in ("desc", "driver", "device") \
                else np.frombuffer(data, dt, int(b["count"]), pos).copy()
            pos += n
        sizes = dict(zip(("desc", "driver", "device"), area_sizes(layout.fmt, layout.size)))
        for name, nbytes in sizes.items():
            if len(blobs.get(name, b"")) != nbytes:
                raise errors.ConfigError(f"vring raw snapshot: area {name} is not {nbytes} bytes")
        arrays = {}
        for name, _ in _ARRAYS[kind]:
            if name not in blobs or len(blobs[name]) != layout.size:
                raise errors.ConfigError(f"vring raw snapshot: array {name} missing or not {layout.size} long")
            arrays[name] = blobs[name]
        areas = {name: blobs[name] for name in sizes}
        return RawSnapshot(kind, layout, h["features"], h["in_order"], h["state"], areas, arrays,
                           h.get("broken"), h.get("time"), h.get("meta"))
    except (KeyError, TypeError, ValueError) as e:
        if isinstance(e, errors.ConfigError):
            raise
        raise errors.ConfigError(f"vring raw snapshot: bad header: {e}") from None


def load(path):
    with open(path, "rb") as f:
        return loads(f.read())


def save(q, path, meta=None):
    """capture(q) and write it to path. Returns the path."""
    return capture(q, meta).save(path)


# --- the broken-queue hook ------------------------------------------------------------------------------

_snapshot_dir = None
_counter = itertools.count(1)
_lock = threading.Lock()
ENV = "VRING_SNAPSHOT_DIR"


def set_snapshot_dir(path):
    """Where broken queues write their raw snapshot (None: off, unless VRING_SNAPSHOT_DIR is set)."""
    global _snapshot_dir
    _snapshot_dir = None if path is None else os.fspath(path)


def snapshot_dir():
    return _snapshot_dir or os.environ.get(ENV) or None


def on_broken(q, err):
    """Called once per queue, when a RingError first breaks it (both implementations). Never raises."""
    directory = snapshot_dir()
    if directory is None or getattr(err, "snapshot_path", None):
        return
    try:
        with _lock:
            n = next(_counter)
        stamp = time.strftime("%Y%m%d-%H%M%S")
        path = os.path.join(directory, f"vring-{q.layout.fmt}-{_kind(q)}-{os.getpid()}-{stamp}-{n}.raw")
        os.makedirs(directory, exist_ok=True)
        save(q, path, meta={"pid": os.getpid(), "error": type(err).__name__})
    except Exception as e:  # a failed dump must not hide the ring error itself
        note = f" (ring snapshot failed: {e})"
    else:
        err.snapshot_path = path
        note = f" (ring snapshot: {path})"
    if err.args:
        err.args = (f"{err.args[0]}{note}",) + tuple(err.args[1:])
    else:
        err.args = (note.strip(),)
