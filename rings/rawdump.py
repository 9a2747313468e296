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
    then mix values from a few descriptors apart, never crash). A ``q`` with side 'memory' (an observer of
    someone else's rings: ``q.mem``, ``q.layout``, ``q.features`` and optional ``q.meta``) is copied as ring
    memory alone."""
    if getattr(q, "side", "") == "memory":
        return capture_memory(q.mem, q.layout, q.features, meta={**getattr(q, "meta", {}), **(meta or {})})
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
    """A RawSnapshot from the bytes of a file written by dumps/save. Every header key, type and range is
    checked before anything is decoded (``_check_header``); a file that is not one, or is damaged, raises
    ConfigError with a one-line message."""
    data = bytes(data)
    if not data.startswith(MAGIC):
        raise errors.ConfigError("not a vring raw snapshot (bad magic)")
    end = data.find(b"\n", len(MAGIC))
    if end < 0:
        raise errors.ConfigError("vring raw snapshot: header line not terminated")
    h = _parse_header(data[len(MAGIC):end])
    kind, layout, blob_list = _check_header(h)
    pos, blobs = end + 1, {}
    for b in blob_list:
        dt = np.dtype(b["dtype"])
        n = b["count"] * dt.itemsize
        if pos + n > len(data):
            raise errors.ConfigError(f"vring raw snapshot: blob {b['name']} is truncated")
        blobs[b["name"]] = data[pos:pos + n] if b["name"] in _AREAS else np.frombuffer(data, dt, b["count"], pos).copy()
        pos += n
    if pos != len(data):
        raise errors.ConfigError(f"vring raw snapshot: {len(data) - pos} bytes after the last blob")
    n = layout.size
    for name, top in _ARRAY_LIMITS[kind].items():
        if top is not None and int(blobs[name].max(initial=0)) > top(n):
            raise errors.ConfigError(f"vring raw snapshot: {name} holds {int(blobs[name].max())}, more than "
                                     f"{top(n)} (queue size {n})")
    arrays = {name: blobs[name] for name, _ in _ARRAYS[kind]}
    areas = {name: blobs[name] for name in _AREAS}
    return RawSnapshot(kind, layout, h["features"], h["in_order"], h["state"], areas, arrays, h["broken"],
                       h["time"], h["meta"])


def _parse_header(line):
    try:
        return json.loads(line.decode("utf-8"))
    except RecursionError:
        raise errors.ConfigError("vring raw snapshot: bad header: JSON nested too deeply") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        raise errors.ConfigError(f"vring raw snapshot: bad header: {_one_line(e)}") from None


_AREAS = ("desc", "driver", "device")
# the longest header line load() reads (a real one is a few hundred bytes; meta notes make it longer)
MAX_HEADER = 1 << 20
_U16, _U64 = 0xFFFF, (1 << 64) - 1
_MAX_TIME = 253402300799  # 9999-12-31: what localtime() can still print
# per kind: the state keys the decoders read, and their largest value (a function of the queue size n and
# the format; None: any u64). Implementations may add keys (ints too).
_STATE = {
    "driver": {"next_avail": lambda n, packed: n - 1 if packed else _U16, "avail_wrap": lambda n, p: 1,
               "last_used": lambda n, packed: n - 1 if packed else _U16, "used_wrap": lambda n, p: 1,
               "num_free": lambda n, p: n, "inflight": lambda n, p: n, "kick_added": None},
    "device": {"last_avail": lambda n, packed: n - 1 if packed else _U16, "avail_wrap": lambda n, p: 1,
               "used_idx": lambda n, packed: n - 1 if packed else _U16, "used_wrap": lambda n, p: 1,
               "call_added": None, "inflight": lambda n, p: n, "shadow_count": lambda n, p: n},
    "memory": {},
}
# the largest value of each per-id array (None: any)
_ARRAY_LIMITS = {
    "driver": {"id_inflight": lambda n: 1, "id_ndesc": lambda n: n, "id_wlen": None,
               "free_next": lambda n: n, "id_token": None},
    "device": {"id_inflight": lambda n: 2, "id_ndesc": lambda n: n, "id_wlen": None},
    "memory": {},
}


def _one_line(e):
    return " ".join(str(e).split())


def _int(v, lo, hi):
    return type(v) is int and lo <= v <= hi


def _bad(what):
    return errors.ConfigError(f"vring raw snapshot: bad header: {what}")


def _check_header(h):
    """Check every key, type and range of a decoded header; returns (kind, QueueLayout, blob list)."""
    if not isinstance(h, dict):
        raise _bad("not a JSON object")
    want = {"kind", "time", "layout", "features", "in_order", "broken", "state", "meta", "blobs"}
    if want - set(h):
        raise _bad(f"missing {', '.join(sorted(want - set(h)))}")
    if set(h) - want:
        raise _bad(f"unknown key {sorted(set(h) - want)[0]!r}")
    kind = h["kind"]
    if not isinstance(kind, str) or kind not in _ARRAYS:
        raise _bad(f"kind must be driver, device or memory, not {_one_line(repr(kind))[:40]}")
    t = h["time"]
    if type(t) not in (int, float) or not 0 <= t <= _MAX_TIME:  # NaN and inf fail the comparison too
        raise _bad(f"time must be Unix seconds (0..{_MAX_TIME}), not {_one_line(repr(t))[:40]}")
    lay = h["layout"]
    if not isinstance(lay, dict) or set(lay) != {"fmt", "size", "desc", "driver", "device"}:
        raise _bad("layout must be an object with fmt, size, desc, driver, device")
    if lay["fmt"] not in ("split", "packed") or not _int(lay["size"], 1, 32768):
        raise _bad(f"layout: fmt {_one_line(repr(lay['fmt']))[:20]} / size {_one_line(repr(lay['size']))[:20]} "
                   f"is not a ring format and queue size")
    sizes = dict(zip(_AREAS, area_sizes(lay["fmt"], lay["size"])))
    for name in _AREAS:
        if not _int(lay[name], 0, _U64 + 1 - sizes[name]):
            raise _bad(f"layout: {name} must be a guest address with its area below 2^64, "
                       f"not {_one_line(repr(lay[name]))[:30]}")
    try:
        layout = QueueLayout(lay["fmt"], lay["size"], lay["desc"], lay["driver"], lay["device"])
    except errors.ConfigError as e:
        raise _bad(f"layout: {e}") from None
    if not _int(h["features"], 0, _U64):
        raise _bad("features must be an integer 0..2^64-1")
    if type(h["in_order"]) is not bool or h["in_order"] != bool(h["features"] >> 35 & 1):
        raise _bad("in_order must be a boolean and agree with feature bit 35 (IN_ORDER)")
    if (lay["fmt"] == "packed") != bool(h["features"] >> 34 & 1):
        raise _bad("the ring format must agree with feature bit 34 (RING_PACKED)")
    b = h["broken"]
    if b is not None and not (isinstance(b, dict) and set(b) == {"error", "message"}
                              and isinstance(b["error"], str) and b["error"].isidentifier()
                              and isinstance(b["message"], str)):
        raise _bad("broken must be null or {error: a class name, message: text}")
    st = h["state"]
    if not isinstance(st, dict):
        raise _bad("state must be an object")
    rules = _STATE[kind]
    if kind == "memory" and st:
        raise _bad("a memory snapshot has no private state")
    missing = set(rules) - set(st)
    if missing:
        raise _bad(f"state: missing {', '.join(sorted(missing))}")
    for k, v in st.items():
        top = rules.get(k)
        top = _U64 if top is None else top(lay["size"], lay["fmt"] == "packed")
        if not isinstance(k, str) or not _int(v, 0, top):
            raise _bad(f"state: {_one_line(repr(k))[:30]} must be an integer 0..{top}, "
                       f"not {_one_line(repr(v))[:30]}")
    meta = h["meta"]
    if not isinstance(meta, dict) or not isinstance(meta.get("name", ""), str) \
            or not _int(meta.get("pid", 0), 0, 1 << 31) \
            or not (isinstance(meta.get("notes", []), list) and all(isinstance(x, str) for x in meta.get("notes", []))):
        raise _bad("meta must be an object (name: text, pid: integer, notes: list of text)")
    blobs = h["blobs"]
    expected = [(name, "u1", sizes[name]) for name in _AREAS] + \
               [(name, dtype, lay["size"]) for name, dtype in _ARRAYS[kind]]
    if not isinstance(blobs, list) or len(blobs) != len(expected):
        raise _bad(f"blobs must list {', '.join(name for name, _, _ in expected)}")
    for b, (name, dtype, count) in zip(blobs, expected):
        if not isinstance(b, dict) or b != {"name": name, "dtype": dtype, "count": count}:
            raise _bad(f"blob {name} must be {{name: {name}, dtype: {dtype}, count: {count}}}, "
                       f"not {_one_line(repr(b))[:60]}")
    return kind, layout, blobs


def load(path):
    """loads() of a file. Only a regular file is read (opened non-blocking, so a FIFO cannot hang us and
    /dev/zero cannot fill memory), and only once its first bytes are the magic."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise errors.ConfigError(f"{path}: not a regular file")
    with open(fd, "rb") as f:
        head = f.read(len(MAGIC))
        if head != MAGIC:
            raise errors.ConfigError("not a vring raw snapshot (bad magic)")
        # never more than the header says the blobs take (a sparse file of any size costs its writer nothing)
        line = f.readline(MAX_HEADER + 1)
        if not line.endswith(b"\n"):
            if len(line) > MAX_HEADER:
                raise errors.ConfigError(f"vring raw snapshot: header line longer than {MAX_HEADER} bytes")
            raise errors.ConfigError("vring raw snapshot: header line not terminated")
        _, _, blobs = _check_header(_parse_header(line[:-1]))
        want = sum(b["count"] * np.dtype(b["dtype"]).itemsize for b in blobs)
        extra = os.fstat(f.fileno()).st_size - f.tell() - want
        if extra > 0:
            raise errors.ConfigError(f"vring raw snapshot: {extra} bytes after the last blob")
        return loads(head + line + f.read(want))


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
