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
" (ring snapshot: PATH)" to the message. Off by default; ``set_snapshot_dir(DEFAULT)`` (what the commands
do) means VRING_SNAPSHOT_DIR if set, else ``default_snapshot_dir()``, a directory of this user's.

The directory must be private: created mode 0700 when missing (with its parents); an existing one must be a
directory (not a symlink) owned by this user that nobody else can write, else nothing is written and the
error says why. A snapshot is created with O_EXCL | O_NOFOLLOW (mode 0600) under a fresh name, so a planted
file or symlink is never written through; then only the newest ``keep`` snapshots of that directory are
kept (``set_snapshot_keep``, VRING_SNAPSHOT_KEEP, default 32).
"""
import itertools
import json
import os
import stat
import tempfile
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
        """Write the file (atomically: a fresh temporary name opened O_EXCL | O_NOFOLLOW, so that nothing
        planted there is written through, then rename over ``path``), mode 0600. Returns the path."""
        path = os.fspath(path)
        for n in itertools.count():
            tmp = f"{path}.tmp{os.getpid()}-{n}"
            try:
                fd = os.open(tmp, _EXCL_FLAGS, 0o600)
                break
            except FileExistsError:
                continue
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(self.dumps())
            os.replace(tmp, path)
        except BaseException:
            _unlink_quietly(tmp)
            raise
        return path


_EXCL_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def _unlink_quietly(path, dir_fd=None):
    try:
        os.unlink(path, dir_fd=dir_fd)
    except OSError:
        pass


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
_keep = None
_counter = itertools.count(1)
_lock = threading.Lock()
ENV = "VRING_SNAPSHOT_DIR"
ENV_KEEP = "VRING_SNAPSHOT_KEEP"
DEFAULT = "<default>"   # set_snapshot_dir(DEFAULT): $VRING_SNAPSHOT_DIR, else default_snapshot_dir()
DEFAULT_KEEP = 32
_PREFIX, _SUFFIX = "vring-", ".raw"


def default_snapshot_dir():
    """This user's snapshot directory: $XDG_RUNTIME_DIR/vring-snapshots, else <tmp>/vring-snapshots-<uid>
    (a fixed name in a shared directory is safe because the directory must be ours and private)."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isabs(runtime) and os.path.isdir(runtime):
        return os.path.join(runtime, "vring-snapshots")
    return os.path.join(tempfile.gettempdir(), f"vring-snapshots-{os.geteuid()}")


def set_snapshot_dir(path):
    """Where broken queues write their raw snapshot (None: off, unless VRING_SNAPSHOT_DIR is set; DEFAULT:
    VRING_SNAPSHOT_DIR, else this user's default directory)."""
    global _snapshot_dir
    _snapshot_dir = None if path is None else path if path is DEFAULT else os.fspath(path)


def set_snapshot_keep(n):
    """Keep the newest n snapshots of the directory (None: VRING_SNAPSHOT_KEEP, else 32)."""
    global _keep
    if n is not None and int(n) < 1:
        raise errors.ConfigError(f"snapshots to keep must be >= 1, not {n}")
    _keep = None if n is None else int(n)


def snapshot_dir():
    if _snapshot_dir is not None and _snapshot_dir is not DEFAULT:
        return _snapshot_dir
    env = os.environ.get(ENV)
    if env:
        return env
    return default_snapshot_dir() if _snapshot_dir is DEFAULT else None


def snapshot_keep():
    if _keep is not None:
        return _keep
    try:
        n = int(os.environ.get(ENV_KEEP, DEFAULT_KEEP))
    except ValueError:
        n = DEFAULT_KEEP
    return max(n, 1)


def open_private_dir(path):
    """An O_DIRECTORY fd of ``path``, created 0700 (parents too) when missing. It must be a real directory
    (the last component not a symlink), owned by this user, not writable by group or others."""
    path = os.fspath(path)
    try:
        os.makedirs(path, mode=0o700)
    except FileExistsError:
        pass
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    st = os.fstat(fd)
    if st.st_uid != os.geteuid() or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        os.close(fd)
        raise errors.ConfigError(f"snapshot directory {path} is not private (owner uid {st.st_uid}, mode "
                                 f"{stat.S_IMODE(st.st_mode):o}); use one of yours that only you can write")
    return fd


def write_private(directory, stem, data, keep=None):
    """Write ``data`` as a new file ``<stem>-<n>.raw`` in the private ``directory`` (O_EXCL | O_NOFOLLOW,
    0600), then keep only the newest ``keep`` snapshot files there. Returns the path."""
    dfd = open_private_dir(directory)
    try:
        for _attempt in range(1000):
            with _lock:
                n = next(_counter)
            name = f"{stem}-{n}{_SUFFIX}"
            try:
                fd = os.open(name, _EXCL_FLAGS, 0o600, dir_fd=dfd)
                break
            except FileExistsError:   # taken (or planted): never written through, another name
                continue
        else:
            raise errors.ConfigError(f"no free snapshot name in {directory}")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
        except BaseException:
            _unlink_quietly(name, dfd)
            raise
        _prune(dfd, snapshot_keep() if keep is None else keep)
    finally:
        os.close(dfd)
    return os.path.join(os.fspath(directory), name)


def _prune(dfd, keep):
    """Remove all but the newest ``keep`` regular snapshot files (vring-*.raw) of the directory."""
    files = []
    with os.scandir(dfd) as it:
        for e in it:
            if e.name.startswith(_PREFIX) and e.name.endswith(_SUFFIX) and e.is_file(follow_symlinks=False):
                files.append((e.stat(follow_symlinks=False).st_mtime_ns, e.name))
    files.sort()
    for _mtime, name in files[:max(len(files) - keep, 0)]:
        _unlink_quietly(name, dfd)


def on_broken(q, err):
    """Called once per queue, when a RingError first breaks it (both implementations). Never raises."""
    directory = snapshot_dir()
    if directory is None or getattr(err, "snapshot_path", None):
        return
    try:
        stem = f"{_PREFIX}{q.layout.fmt}-{_kind(q)}-{os.getpid()}-{time.strftime('%Y%m%d-%H%M%S')}"
        data = capture(q, meta={"pid": os.getpid(), "error": type(err).__name__}).dumps()
        path = write_private(directory, stem, data)
    except Exception as e:  # a failed dump must not hide the ring error itself
        note = f" (ring snapshot failed: {e})"
    else:
        err.snapshot_path = path
        note = f" (ring snapshot: {path})"
    if err.args:
        err.args = (f"{err.args[0]}{note}",) + tuple(err.args[1:])
    else:
        err.args = (note.strip(),)
