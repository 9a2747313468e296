"""Raw snapshots of broken queues on disk (issue 8): a private directory, files that are never written through
a planted symlink, and only the newest N kept."""
import itertools
import os
import stat

import numpy as np
import pytest

from rings import errors, rawdump
from rings.layout import QueueLayout, avail_dtype
from rings.shm import MemoryTable
from rings.virtq import DeviceQueue

BASE = 0x10000


@pytest.fixture(autouse=True)
def hook_off(monkeypatch):
    monkeypatch.delenv(rawdump.ENV, raising=False)
    monkeypatch.delenv(rawdump.ENV_KEEP, raising=False)
    rawdump.set_snapshot_dir(None)
    rawdump.set_snapshot_keep(None)
    yield
    rawdump.set_snapshot_dir(None)
    rawdump.set_snapshot_keep(None)


def break_a_queue():
    """A split device queue whose driver's avail idx jumps: AvailIdxJump, with its snapshot note."""
    buf = bytearray(0x4000)
    layout = QueueLayout.contiguous("split", 8, BASE)
    dev = DeviceQueue(MemoryTable([(BASE, len(buf), buf)]), layout, 0)
    np.frombuffer(buf, avail_dtype(8), 1, layout.driver - BASE)[0]["idx"] = 100
    with pytest.raises(errors.AvailIdxJump) as info:
        dev.poll()
    return info.value


def test_snapshot_dir_is_created_private(tmp_path):
    d = tmp_path / "a" / "snaps"
    rawdump.set_snapshot_dir(d)
    err = break_a_queue()
    assert os.path.dirname(err.snapshot_path) == str(d)
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(err.snapshot_path).st_mode) == 0o600
    assert rawdump.load(err.snapshot_path).broken_info["error"] == "AvailIdxJump"


def test_planted_symlinks_are_never_written_through(tmp_path, monkeypatch):
    """Whatever name the next snapshot would take (and its temporary name) points to a victim file: the victim
    stays as it was, the snapshot lands under a fresh name in the directory."""
    d = tmp_path / "snaps"
    d.mkdir(mode=0o700)
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    monkeypatch.setattr(rawdump.time, "strftime", lambda fmt, *a: "20990101-000000")
    monkeypatch.setattr(rawdump, "_counter", itertools.count(1))
    stem = f"vring-split-device-{os.getpid()}-20990101-000000"
    for n in range(1, 40):
        os.symlink(victim, d / f"{stem}-{n}.raw")
        os.symlink(victim, d / f"{stem}-{n}.raw.tmp{os.getpid()}")
    rawdump.set_snapshot_dir(d)
    err = break_a_queue()
    assert victim.read_bytes() == b"precious"
    assert err.snapshot_path == str(d / f"{stem}-40.raw")
    assert not os.path.islink(err.snapshot_path) and rawdump.load(err.snapshot_path).kind == "device"


def test_save_does_not_follow_a_planted_temporary_name(tmp_path):
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    target = tmp_path / "out.raw"
    os.symlink(victim, f"{target}.tmp{os.getpid()}-0")
    buf = bytearray(0x4000)
    dev = DeviceQueue(MemoryTable([(BASE, len(buf), buf)]), QueueLayout.contiguous("split", 8, BASE), 0)
    rawdump.save(dev, target)
    assert victim.read_bytes() == b"precious" and rawdump.load(target).kind == "device"


@pytest.mark.parametrize("mode", [0o777, 0o1777, 0o720])
def test_a_directory_others_can_write_is_refused(tmp_path, mode):
    """A directory like /tmp (anybody may plant names there) is not used; the ring error says why."""
    d = tmp_path / "shared"
    d.mkdir()
    os.chmod(d, mode)
    rawdump.set_snapshot_dir(d)
    err = break_a_queue()
    assert err.snapshot_path is None and os.listdir(d) == []
    assert "(ring snapshot failed: snapshot directory" in str(err) and "is not private" in str(err)


def test_a_symlinked_directory_is_refused(tmp_path):
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    os.symlink(real, tmp_path / "link")
    rawdump.set_snapshot_dir(tmp_path / "link")
    err = break_a_queue()
    assert err.snapshot_path is None and os.listdir(real) == []


@pytest.mark.parametrize("how", ["env", "call", "default"])
def test_only_the_newest_snapshots_are_kept(tmp_path, monkeypatch, how):
    d = tmp_path / "snaps"
    rawdump.set_snapshot_dir(d)
    keep = 32 if how == "default" else 5
    if how == "env":
        monkeypatch.setenv(rawdump.ENV_KEEP, "5")
    elif how == "call":
        rawdump.set_snapshot_keep(5)
    d.mkdir(mode=0o700)
    (d / "notes.txt").write_text("not a snapshot: left alone")
    paths = []
    for i in range(keep + 3):
        paths.append(break_a_queue().snapshot_path)
        os.utime(paths[-1], ns=(i * 10**9, i * 10**9))   # distinct ages, whatever the clock's resolution
    left = sorted(p for p in os.listdir(d) if p.endswith(".raw"))
    assert left == sorted(os.path.basename(p) for p in paths[-keep:])
    assert (d / "notes.txt").exists()


def test_default_directory_is_per_user_and_not_tmp_itself(monkeypatch, tmp_path):
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.setattr(rawdump.tempfile, "gettempdir", lambda: str(tmp_path))
    assert rawdump.default_snapshot_dir() == str(tmp_path / f"vring-snapshots-{os.geteuid()}")
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    assert rawdump.default_snapshot_dir() == str(tmp_path / "vring-snapshots")
    rawdump.set_snapshot_dir(rawdump.DEFAULT)
    assert rawdump.snapshot_dir() == str(tmp_path / "vring-snapshots")
    monkeypatch.setenv(rawdump.ENV, str(tmp_path / "env"))
    assert rawdump.snapshot_dir() == str(tmp_path / "env")
    err = break_a_queue()
    assert os.path.dirname(err.snapshot_path) == str(tmp_path / "env")
    with pytest.raises(errors.ConfigError):
        rawdump.set_snapshot_keep(0)
