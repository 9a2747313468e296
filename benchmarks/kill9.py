"""kill -9 of `vring vhost` during a macfwd loop, on the four ring paths (issue 10).

`vring driver --reconnect --verify --mode macfwd --count 256` loops 256 frames through `vring vhost`; the
backend is killed -9 at random moments (0.3-0.8 s apart; with --mid-burst every other one dies by itself
inside a burst instead: `vring vhost --crash-after N`) and relaunched at once. Per kill: the time from
relaunch to the first frame the driver receives (resume_s), how long the driver had no backend (down_s),
frames lost (absent at the end, put on the restart after which they were never seen), duplicates (copies a
restart made: a chain the killed backend had delivered and not completed, taken again by its successor;
counted and dropped by the driver, which tracks each frame's lap in its sequence field) and the chains the
successor took again from the inflight area (re-taken, Rx buffers included). At the end every injected frame
must be present exactly once, in flight, or dropped under a named counter; the driver must see no ring error.

    python3 benchmarks/kill9.py [--kills 20] [--paths split/normal,packed/in-order,...] [--json out.json]
    python3 benchmarks/kill9.py --vhost-arg=--txq-flush=none --mid-burst   # direct mode (no staging copy)

Exit status 1 if a path lost a frame, did not resume within 1 s, or saw a ring error.
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rings.errors import ConfigError  # noqa: E402
from vring.restarts import check_vhost_args, kill_loop, print_kill_table  # noqa: E402

PATHS = {"split/normal": (0, 0), "split/in-order": (0, 1), "packed/normal": (1, 0), "packed/in-order": (1, 1)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kills", type=int, default=20)
    ap.add_argument("--count", type=int, default=256)
    ap.add_argument("--paths", default=",".join(PATHS))
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--mid-burst", action="store_true",
                    help="every other backend dies by itself inside a burst (vring vhost --crash-after 20..300): "
                         "the window inflight tracking is for (a random kill mostly finds the backend idle)")
    ap.add_argument("--no-inflight", action="store_true",
                    help="the driver does not negotiate INFLIGHT_SHMFD (packed rings are then reset on reconnect); a "
                         "backend killed while it holds frames whose Tx chains it completed loses them (--txq-flush "
                         "none: between a burst's Tx completion and its Rx publish), by design: counted as lost")
    ap.add_argument("--vhost-arg", action="append", default=[],
                    help="extra `vring vhost` argument for every backend (repeat), e.g. --vhost-arg=--txq-flush=none")
    ap.add_argument("--json", metavar="FILE")
    a = ap.parse_args()
    # all checked before the first path runs: a bad one would otherwise end the run midway, its figures lost
    bad = [p for p in a.paths.split(",") if p not in PATHS]
    if bad:
        ap.error(f"--paths: {', '.join(bad)} not one of {', '.join(PATHS)}")
    if a.kills < 1:
        ap.error(f"--kills must be >= 1, not {a.kills}")
    if a.json:   # tried, not guessed from its mode (root passes every mode check); removed if it was not there
        existed = os.path.exists(a.json)
        try:
            open(a.json, "a").close()
        except OSError as e:
            ap.error(f"--json {a.json}: {e.strerror}")
        if not existed:
            os.unlink(a.json)
    try:
        check_vhost_args(a.vhost_arg)
    except ConfigError as e:
        ap.error(f"--vhost-arg {' '.join(a.vhost_arg)}: {e}")
    results, ok = [], True
    for name in a.paths.split(","):
        packed, in_order = PATHS[name]
        r = kill_loop(packed, in_order, kills=a.kills, count=a.count, seed=a.seed,
                      driver_args=["--no-inflight"] if a.no_inflight else [], mid_burst=a.mid_burst,
                      vhost_args=a.vhost_arg)
        print_kill_table(r)
        results.append(r)
        ok &= (r["lost"] == 0 and r["all_resumed"] and r["max_resume_s"] is not None and r["max_resume_s"] < 1.0
               and r["ring_errors_driver"] == 0 and r["bad_frames"] == 0
               and r["present_at_end"] + r["in_flight_at_end"] + r["held_at_end"] + sum(r["dropped"].values())
               >= r["injected"])
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)
    print("\nverdict:", "OK" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
