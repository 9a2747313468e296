"""EVT-19 / MEM-08: the packed event suppression structure is read flags first, with acquire, then off_wrap.

The peer writes off_wrap, then (release) flags = DESC (Linux virtqueue_enable_cb_prepare_packed); a reader that
loads both relaxed may pair the new DESC flags with a stale off_wrap. x86 hides the missing acquire at run time,
so this test reads the compiled code: clang's LLVM IR of csrc/virtq.h keeps each atomic load's ordering.
"""
import os
import re
import shutil
import subprocess

import pytest

CSRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "rings", "csrc")
PROBE = """#include "virtq.h"
int probe_call(struct vq_device *q) { return vq_dev_call_prepare(q); }
int probe_kick(struct vq_driver *q) { return vq_drv_kick_prepare(q); }
"""


@pytest.fixture(scope="module")
def ir(tmp_path_factory):
    clang = shutil.which("clang")
    if clang is None:
        pytest.skip("clang is not installed (.ci/run installs it)")
    src = tmp_path_factory.mktemp("ir") / "probe.c"
    src.write_text(PROBE)
    out = subprocess.run([clang, "-S", "-emit-llvm", "-O0", "-std=gnu11", f"-I{CSRC}", str(src), "-o", "-"],
                         check=True, capture_output=True, text=True).stdout
    return out


def event_loads(ir, function):
    """The atomic loads of vring_packed_event fields in `function`, in program order: [(field, ordering)]."""
    body = re.search(rf"^define [^\n]*@{function}\(.*?^}}", ir, re.M | re.S).group(0)
    fields, loads = {}, []
    for line in body.splitlines():
        m = re.match(r"\s*(%\S+) = getelementptr inbounds %struct\.vring_packed_event, .*, i32 0, i32 (\d)$", line)
        if m:
            fields[m.group(1)] = ("off_wrap", "flags")[int(m.group(2))]
        m = re.match(r"\s*%\S+ = load atomic i16, (?:i16\*|ptr) (%\S+) (\w+),", line)
        if m and m.group(1) in fields:
            loads.append((fields[m.group(1)], m.group(2)))
    return loads


@pytest.mark.parametrize("function", ["vq_dev_call_prepare", "vq_drv_kick_prepare"])
def test_evt_19_packed_event_flags_acquired_before_off_wrap(ir, function):
    loads = event_loads(ir, function)
    assert [f for f, _ in loads] == ["flags", "off_wrap"], loads
    assert loads[0][1] == "acquire", f"{function}: event flags read {loads[0][1]}, not acquire"
