"""Shared fixtures: guest memory, queue layouts, and the two implementations of the queue contract."""
import contextlib
import importlib
import os
import shutil
import signal
import tempfile

import pytest

from rings.layout import (VIRTIO_F_IN_ORDER, VIRTIO_F_RING_PACKED, VIRTIO_F_VERSION_1, QueueLayout,
                          bit)
from rings.shm import MemoryTable, ShmRegion

IMPLEMENTATIONS = {"reference": "rings.reference", "c": "rings.virtq"}


@pytest.fixture(autouse=True, scope="session")
def _snapshots_in_the_session():
    """A queue that breaks writes a snapshot into the user's directory ($XDG_RUNTIME_DIR/vring-snapshots, else
    <tmp>/vring-snapshots-<uid>; rings/rawdump.py). The processes the tests start inherit this environment: theirs
    go to a directory of this session, removed at its end, not to the user's (one file a CI run was left there)."""
    d = tempfile.mkdtemp(prefix="vring-test-runtime-")
    old = os.environ.get("XDG_RUNTIME_DIR")
    os.environ["XDG_RUNTIME_DIR"] = d
    try:
        yield d
    finally:
        if old is None:
            os.environ.pop("XDG_RUNTIME_DIR", None)
        else:
            os.environ["XDG_RUNTIME_DIR"] = old
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(autouse=True, scope="session")
def _hangups_reach_the_processes_we_start():
    """A test run under nohup inherits SIGHUP ignored, and so would every process it starts (an ignored signal
    stays ignored across exec); `vring vhost` and the driver then keep it ignored, as nohup asks. The tests that
    send SIGHUP would wait for an exit that never comes. A handler that does nothing keeps the run itself
    immune to the hangup, and exec puts the default back in the children."""
    old = signal.getsignal(signal.SIGHUP)
    if old == signal.SIG_IGN:
        signal.signal(signal.SIGHUP, lambda _signum, _frame: None)
    try:
        yield
    finally:
        if old == signal.SIG_IGN:
            signal.signal(signal.SIGHUP, old)


@pytest.fixture
def sock_path(tmp_path):
    return str(tmp_path / "vhost.sock")


@pytest.fixture
def server(sock_path):
    """A `vring vhost` server (macswap) in a thread of the test; it must remove its socket when closed."""
    from vhost.datapath import Options
    from vhost.testing import ThreadedServer
    srv = ThreadedServer(sock_path, Options(fwd="macswap"))
    yield srv
    srv.close()
    assert not os.path.exists(sock_path), "the server must remove its socket"


@pytest.fixture(params=list(IMPLEMENTATIONS))
def impl(request):
    """The module under test (same class names and semantics, rings/README.md)."""
    return importlib.import_module(IMPLEMENTATIONS[request.param])


@pytest.fixture
def mem_factory():
    """mem_factory(nbytes, gpa, shm=False) -> a MemoryTable of one zeroed region of nbytes at address gpa.

    With shm=True the region is POSIX shared memory; every region is closed and unlinked at teardown,
    whatever the test did."""
    regions = []

    def make(nbytes, gpa, shm=False):
        if shm:
            regions.append(ShmRegion.create(nbytes))
            buf = regions[-1].buf
        else:
            buf = bytearray(nbytes)
        return MemoryTable([(gpa, nbytes, buf)])

    yield make
    with contextlib.ExitStack() as stack:  # closes every region even if one close raises
        for region in regions:
            stack.callback(region.close)


@pytest.fixture
def make_layout():
    """make_layout(fmt, size, base) -> the contiguous QueueLayout (desc, driver, device areas) at base."""
    return QueueLayout.contiguous


V1 = bit(VIRTIO_F_VERSION_1)
NET_VARIANTS = {
    "split": V1,
    "split_in_order": V1 | bit(VIRTIO_F_IN_ORDER),
    "packed": V1 | bit(VIRTIO_F_RING_PACKED),
    "packed_in_order": V1 | bit(VIRTIO_F_RING_PACKED) | bit(VIRTIO_F_IN_ORDER),
}


@pytest.fixture(params=sorted(NET_VARIANTS))
def variant(request):
    """The feature mask of one of the four ring paths (with VERSION_1)."""
    return NET_VARIANTS[request.param]


@pytest.fixture(params=["c", "reference"])
def rec(request):
    """``impl`` with every ring access recorded in order (tests/conformance/recording.py; conformance tests only,
    whose directory is then on sys.path)."""
    from recording import Recorder
    return Recorder(request.param)
