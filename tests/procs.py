"""Test helper: `vring` commands run as processes, and waiting for the paths they create. Every process is
ended (SIGTERM, then SIGKILL) when the test is done, whatever happened."""
import os
import signal
import subprocess
import sys
import time

VRING = [sys.executable, "-m", "vring.cli"]


def wait_for(path, proc, timeout=30.0):
    """Wait until ``path`` exists; fail if ``proc`` exits first or it takes longer than ``timeout`` s."""
    t0 = time.monotonic()
    while not os.path.exists(path):
        assert proc.poll() is None, f"process exited early: {proc.communicate()}"
        assert time.monotonic() - t0 < timeout, f"{path} never appeared"
        time.sleep(0.05)


def stop(proc, timeout=20.0):
    """SIGTERM (SIGKILL if it does not go) and collect the output: (returncode, stdout, stderr)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
    return proc.returncode, out, err


def collect(proc, timeout=60.0):
    """Wait for a process that ends by itself; SIGKILL it if it has not within ``timeout`` s or the wait is
    interrupted. (returncode, stdout, stderr)."""
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return proc.returncode, out, err


class Procs:
    """``procs.start("vhost", "--socket", ...)``; ``close()`` stops whatever is still running."""

    def __init__(self):
        self.procs = []

    def start(self, *args):
        p = subprocess.Popen(VRING + list(args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.procs.append(p)
        return p

    def close(self):
        for p in self.procs:
            stop(p)
