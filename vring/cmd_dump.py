"""`vring dump`: decode ring state (indices, notification fields, descriptors grouped into chains with their
owner) and say in words what looks wrong.

Sources (one of):
  --shm NAME --fmt F --size N [--desc A --driver A --device A] [--gpa BASE] [--features HEX]
        attach read-only to a POSIX shared-memory region and decode its ring memory (no private state:
        the fields only the queue's owner knows are listed as unknown). Without --desc/--driver/--device
        the contiguous layout at --gpa is assumed (desc, driver area, device area on the next page).
        If the owner truncates the region meanwhile, that is one error line (exit 1), not a crash.
  --ctl SOCKET [QUEUE]   ask a running process (rings.ctl); without QUEUE, every registered queue
  --from FILE            decode a raw snapshot saved by --raw or by a broken queue
  --diff A B             what changed between two raw snapshots
Output: text (default) or --json; --watch SECONDS refreshes (the diagnoses compare with the sample since
which nothing moved, to say "for T s"); --raw FILE also saves the raw snapshot (FILE-QUEUE for several).
Exit status: 0 done (a reader that closed the pipe included), 1 a source that cannot be read or decoded, 2 usage.
"""
import argparse
import json
import math
import mmap
import os
import time

import posix_ipc

from rings import rawdump
from rings.ctl import ControlClient
from rings.diagnose import diagnose, format_findings
from rings.errors import VringError
from rings.layout import VIRTIO_F_RING_PACKED, QueueLayout
from rings.snapshot import format_snapshot
from vhost.datapath import GuardedMemoryTable
from vring.stdout import StdoutClosed, closed_quietly, out, usage_error


def _int(text):
    return int(text, 0)


def _hex(text):
    return int(text, 16)


def register(sub):
    p = sub.add_parser("dump", help="decode ring state and diagnose stuck or broken queues",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--shm", metavar="NAME", help="POSIX shared-memory name holding the rings")
    src.add_argument("--ctl", metavar="SOCKET", help="control socket of a running vring process")
    src.add_argument("--from", dest="from_file", metavar="FILE", help="decode a saved raw snapshot")
    src.add_argument("--diff", nargs=2, metavar=("A", "B"), help="compare two raw snapshots")
    p.add_argument("queue", nargs="?", help="with --ctl: the queue name (default: all)")
    p.add_argument("--fmt", choices=("split", "packed"), help="with --shm: ring format")
    p.add_argument("--size", type=_int, help="with --shm: queue size")
    p.add_argument("--desc", type=_int, help="with --shm: guest address of the descriptor area")
    p.add_argument("--driver", type=_int, help="with --shm: guest address of the driver area")
    p.add_argument("--device", type=_int, help="with --shm: guest address of the device area")
    p.add_argument("--gpa", type=_int, default=0, help="with --shm: guest address of the region's first byte")
    p.add_argument("--features", type=_hex, default=None, help="with --shm: negotiated features (hex; default: just RING_PACKED for packed)")
    p.add_argument("--json", action="store_true", help="print JSON (one object per sample with --watch)")
    p.add_argument("--watch", type=float, metavar="SECONDS", help="refresh at this interval")
    p.add_argument("--count", type=int, default=0, help="with --watch: stop after this many samples")
    p.add_argument("--raw", metavar="FILE", help="also save the raw snapshot to FILE")
    p.add_argument("--no-descriptors", action="store_true", help="text: leave out the per-slot table")
    p.set_defaults(run=run)


def _check_args(args):
    """Usage errors, before any source is opened (ValueError; exit status 2 as in every other command)."""
    for opt, value in (("--shm", args.shm), ("--ctl", args.ctl), ("--from", args.from_file), ("--raw", args.raw)):
        if value is not None and not value:
            raise ValueError(f"{opt} needs a non-empty value")
    if args.shm is not None:
        if args.fmt is None or args.size is None:
            raise ValueError("--shm needs --fmt and --size")
        for opt, value in (("--gpa", args.gpa), ("--desc", args.desc), ("--driver", args.driver),
                           ("--device", args.device), ("--features", args.features)):
            if value is not None and not 0 <= value < 1 << 64:
                raise ValueError(f"{opt} must be in 0..2^64-1, not {value:#x}")
        _shm_layout(args)   # size, alignment (a ConfigError is a ValueError)
    if args.watch is not None and not (math.isfinite(args.watch) and 0 < args.watch <= 86400):
        raise ValueError(f"--watch must be a number of seconds in (0, 86400], not {args.watch}")
    if args.count < 0:
        raise ValueError(f"--count must be >= 0 (0: no limit), not {args.count}")


def _shm_layout(args):
    addrs = (args.desc, args.driver, args.device)
    if all(a is None for a in addrs):
        return QueueLayout.contiguous(args.fmt, args.size, args.gpa)
    if any(a is None for a in addrs):
        raise ValueError("give all of --desc, --driver, --device, or none (contiguous layout at --gpa)")
    return QueueLayout(args.fmt, args.size, *addrs)


def run(args):
    try:
        _check_args(args)
    except ValueError as e:
        return usage_error("vring dump", e)
    try:
        if args.diff:
            return _diff(args)
        source = _source(args)
        try:
            return _loop(args, source)
        finally:
            source.close()
    except StdoutClosed:   # `vring dump ... | head`: the reader has all it wanted
        return closed_quietly()
    except (VringError, OSError, ValueError) as e:  # runtime: one line, exit status 1 (damaged files included)
        raise SystemExit("vring dump: " + " ".join(str(e).split()))


# --- sources: each gives [(name, RawSnapshot)] per sample ------------------------------------------------

class _FileSource:
    live = False

    def __init__(self, path):
        self.raw = rawdump.load(path)
        self.name = os.path.basename(path)

    def sample(self):
        return [(self.raw.meta.get("name", self.name), self.raw)]

    def close(self):
        pass


class _ShmSource:
    live = True

    def __init__(self, args):
        features = args.features
        if features is None:
            features = 1 << VIRTIO_F_RING_PACKED if args.fmt == "packed" else 0
        self.layout = _shm_layout(args)
        try:
            shm = posix_ipc.SharedMemory(args.shm, read_only=True)
        except posix_ipc.Error as e:
            raise OSError(f"cannot open shared memory {args.shm}: {e}") from None
        try:
            self.map = mmap.mmap(shm.fd, shm.size, mmap.MAP_SHARED, mmap.PROT_READ)
        finally:
            os.close(shm.fd)
        # guarded copies: the owner may truncate its region while we read it (SIGBUS would kill the dump)
        self.mem = GuardedMemoryTable([(args.gpa, len(self.map), self.map)],
                                      whose=(f"shared memory {args.shm}", "its owner truncated it"))
        self.features, self.name = features, args.shm

    def sample(self):
        return [(self.name, rawdump.capture_memory(self.mem, self.layout, self.features,
                                                   meta={"shm": self.name}))]

    def close(self):
        self.mem = None
        try:
            self.map.close()
        except BufferError:
            pass


class _CtlSource:
    live = True

    def __init__(self, path, queue):
        self.client = ControlClient(path)
        no_ring = []
        self.names = [queue] if queue else [q["name"] for q in self.client.list(no_ring)]
        if not self.names:
            self.client.close()
            if no_ring:  # a backend with no frontend yet: its queues are there, their rings are not
                raise ValueError(f"no queue at {path} has a ring now ({', '.join(no_ring)} registered: no peer "
                                 f"connected, or its vring not started)")
            raise ValueError(f"no queues registered at {path}")

    def sample(self):
        return [(name, self.client.raw(name)) for name in self.names]

    def close(self):
        self.client.close()


def _source(args):
    if args.shm:
        return _ShmSource(args)
    if args.ctl:
        return _CtlSource(args.ctl, args.queue)
    return _FileSource(args.from_file)


# --- output -----------------------------------------------------------------------------------------------

def _loop(args, source):
    ref = {}  # name -> (time, snapshot) since which nothing moved
    n = 0
    while True:
        samples = source.sample()
        decoded = []
        for name, raw in samples:
            snap = raw.snapshot()
            prev = ref.get(name)
            if prev is not None and _progress(prev[1]) == _progress(snap):
                base, elapsed = prev[1], raw.time - prev[0]
            else:
                ref[name] = (raw.time, snap)
                base = elapsed = None
            findings = diagnose(snap, base, elapsed)
            if args.raw:
                path = args.raw if len(samples) == 1 else f"{args.raw}-{_file_part(name)}"
                raw.save(path)
            decoded.append((name, raw, snap, findings))
        out(lambda: _print(args, decoded))
        n += 1
        if not args.watch or not source.live or (args.count and n >= args.count):
            return 0
        time.sleep(args.watch)


def _file_part(name):
    """A queue name as part of a file name: the control server (another process) chose it, so it never names a
    directory (no separator, no NUL, nothing outside [A-Za-z0-9._-])."""
    return "".join(c if c.isascii() and (c.isalnum() or c in "._-") else "_" for c in name) or "_"


def _progress(snap):
    """What must stay equal for the queue to count as "not moved"."""
    return (snap["indices"], snap["counts"], snap["broken"],
            [(c["head"], c["state"]) for c in snap["chains"]],
            [r["flags"] for r in snap["descriptors"]] if snap["side"] == "memory" else None)


def _printable(text):
    """Text another process chose (a queue name, a snapshot's notes), as printed on a terminal: control characters
    (an escape sequence could rewrite the screen) shown escaped, as Python writes them."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in str(text))


def _print(args, out):
    if args.json:
        docs = [{"name": name, "time": raw.time, "meta": raw.meta, "snapshot": snap, "diagnosis": findings}
                for name, raw, snap, findings in out]
        print(json.dumps(docs[0] if len(docs) == 1 and not args.ctl else docs,
                         separators=(",", ":") if args.watch else None, indent=None if args.watch else 1))
        return
    for name, raw, snap, findings in out:
        when = time.strftime("%H:%M:%S", time.localtime(raw.time)) + f".{int(raw.time * 1000) % 1000:03d}"
        print(f"== {_printable(name)} at {when}" + (f" (pid {raw.meta['pid']})" if "pid" in raw.meta else ""))
        for note in raw.meta.get("notes", ()):  # what the process that took it knows besides memory (vring tap)
            print(_printable(note))
        text = format_snapshot(snap)
        if args.no_descriptors:
            text = text[:text.rindex("\n" + f"{'slot':>5}")]
        print(text)
        print(format_findings(findings))
        print()


# --- diff -------------------------------------------------------------------------------------------------

def diff_snapshots(a_raw, b_raw):
    """What changed from raw snapshot A to raw snapshot B, as a JSON-able dict."""
    a, b = a_raw.snapshot(), b_raw.snapshot()
    if (a["format"], a["size"], a["side"]) != (b["format"], b["size"], b["side"]):
        raise ValueError(f"not the same queue: {a['format']}/{a['size']}/{a['side']} vs "
                         f"{b['format']}/{b['size']}/{b['side']}")
    out = {"elapsed": b_raw.time - a_raw.time}
    for group in ("indices", "counts", "notify"):
        out[group] = _changed(a[group], b[group])
    out["state"] = _changed(a_raw.state(), b_raw.state())
    out["broken"] = None if a["broken"] == b["broken"] else [a["broken"], b["broken"]]
    rows = []
    for ra, rb in zip(a["descriptors"], b["descriptors"]):
        ch = {k: [ra[k], rb[k]] for k in ra if k != "index" and ra[k] != rb[k]}
        if ch:
            rows.append({"index": ra["index"], "changes": ch})
    out["descriptors"] = rows
    key = lambda c: (c["head"], tuple(c["slots"]))  # noqa: E731
    ca, cb = {key(c): c for c in a["chains"]}, {key(c): c for c in b["chains"]}
    out["chains"] = {"gone": [ca[k] for k in ca if k not in cb],
                     "new": [cb[k] for k in cb if k not in ca],
                     "changed": [{"head": k[0], "slots": list(k[1]), "state": [ca[k]["state"], cb[k]["state"]],
                                  "owner": [ca[k]["owner"], cb[k]["owner"]]}
                                 for k in ca if k in cb and (ca[k]["state"], ca[k]["owner"]) !=
                                 (cb[k]["state"], cb[k]["owner"])]}
    out["diagnosis"] = diagnose(b, a, out["elapsed"]) if _progress(a) == _progress(b) else diagnose(b)
    return out


def _changed(x, y):
    out = {}
    for k in list(x) + [k for k in y if k not in x]:
        vx, vy = x.get(k), y.get(k)
        if isinstance(vx, dict) and isinstance(vy, dict):
            sub = _changed(vx, vy)
            if sub:
                out[k] = sub
        elif vx != vy:
            out[k] = [vx, vy]
    return out


def format_diff(d):
    lines = [f"elapsed {d['elapsed']:.3f} s"]
    for group in ("indices", "counts", "notify", "state"):
        lines.append(f"{group}: " + (_fmt_changes(d[group]) or "unchanged"))
    if d["broken"]:
        lines.append(f"broken: {d['broken'][0]} -> {d['broken'][1]}")
    c = d["chains"]
    for label in ("gone", "new"):
        for ch in c[label]:
            lines.append(f"chain {label}: head {ch['head']} id {ch['id']} slots "
                         f"{'->'.join(map(str, ch['slots']))} ({ch['owner']}, {ch['state']})")
    for ch in c["changed"]:
        lines.append(f"chain changed: head {ch['head']}: {ch['owner'][0]}, {ch['state'][0]} -> "
                     f"{ch['owner'][1]}, {ch['state'][1]}")
    lines.append(f"descriptors changed: {len(d['descriptors'])}")
    for r in d["descriptors"]:
        parts = []
        for k, (x, y) in r["changes"].items():
            if isinstance(x, int) and k in ("addr", "flags"):
                parts.append(f"{k} {x:#x} -> {y:#x}")
            else:
                parts.append(f"{k} {x} -> {y}")
        lines.append(f"  slot {r['index']}: " + ", ".join(parts))
    lines.append(format_findings(d["diagnosis"]))
    return "\n".join(lines)


def _fmt_changes(d, prefix=""):
    return " ".join(f"{_fmt_changes(v, prefix + k + '.')}" if isinstance(v, dict) else
                    f"{prefix}{k} {v[0]} -> {v[1]}" for k, v in d.items())


def _diff(args):
    a, b = rawdump.load(args.diff[0]), rawdump.load(args.diff[1])
    d = diff_snapshots(a, b)
    out(json.dumps(d, indent=1) if args.json else format_diff(d))
    return 0
