"""The recording build (recording.py) is made again whenever anything compiled into it changed: its C headers,
and its cdef, which comes from rings/_build.py (a declaration changed there alone, say a return type, would
otherwise leave Python calling the old build)."""
import glob
import os

import recording


def test_recording_build_is_stale_when_the_cdef_changed(monkeypatch):
    import rings._build
    recording.build()
    (so,) = glob.glob(os.path.join(recording.ROOT, "rings", "_virtq_rec*.so"))
    cdef = os.path.realpath(rings._build.__file__)
    real = os.path.getmtime
    # everything as old as the build, except rings/_build.py, edited after it
    times = {os.path.realpath(so): 2.0, cdef: 3.0}
    monkeypatch.setattr(recording.os.path, "getmtime", lambda p: times.get(os.path.realpath(p), 1.0))
    assert not recording._built()
    monkeypatch.setattr(recording.os.path, "getmtime", real)
    assert recording._built()
