#!/usr/bin/env python3
"""Mutation testing of the conformance suite: each named mutant (mutants.py) breaks one spec rule in both
implementations at once; the conformance tests (tests/conformance) must kill it with a test aimed at that rule.

    python3 mutants/run.py [-j N] [--json] [--only NAME[,NAME...]] [--list]

The working tree is never touched: the tracked and untracked (not ignored) files are copied to a temporary
directory; there the unmutated suite must pass first (the baseline), then every mutant gets its own copy, its
edits (each snippet must occur exactly once, or the run stops before testing anything), a rebuild of
rings._virtq and of the recording build, and one pytest run of tests/conformance. virtio/ and vhost/ keep the
baseline's C modules: the mutants are of the ring engines. Prints a table of the tests that killed each mutant
(``--json``: the same as JSON) and exits 1 if a mutant survived or was killed only by tests not aimed at its
rule (whose names carry none of its IDs).
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from concurrent.futures import ThreadPoolExecutor

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "tests", "conformance"))
from mutants import MUTANTS  # noqa: E402
from idmap import ids_in_name  # noqa: E402

SUITE = "tests/conformance"
TIMEOUT = 600        # a build
SUITE_TIMEOUT = 180  # one run of the suite (about 10 s unmutated): longer means a mutant made it hang


class SnippetError(Exception):
    pass


def tree_files(root):
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=root,
                         capture_output=True, check=True).stdout
    return [f for f in out.decode().split("\0") if f and os.path.isfile(os.path.join(root, f))]


def copy_tree(src, dst, files):
    for f in files:
        os.makedirs(os.path.dirname(os.path.join(dst, f)) or dst, exist_ok=True)
        shutil.copy2(os.path.join(src, f), os.path.join(dst, f))


def apply(mutant, root):
    """Apply every edit of a mutant under root; SnippetError unless each snippet occurs exactly once."""
    texts = {}
    for path, old, new in mutant.edits:
        full = os.path.join(root, path)
        text = texts.get(path) or open(full).read()
        n = text.count(old)
        if n != 1:
            raise SnippetError(f"{mutant.name}: {path}: snippet found {n} times (must be exactly once):\n{old}")
        texts[path] = text.replace(old, new)
    for path, text in texts.items():
        with open(os.path.join(root, path), "w") as f:
            f.write(text)


def env_for(root):
    env = dict(os.environ, PYTHONPATH=root, PYTHONDONTWRITEBYTECODE="1")
    env.pop("PYTEST_ADDOPTS", None)
    return env


def build_rings(root):
    """rings._virtq (the normal build) and rings._virtq_rec (the recording build) under root."""
    code = ("import glob, os, shutil, sys, tempfile\n"
            "sys.path.insert(0, 'tests/conformance')\n"
            "for so in glob.glob('rings/_virtq*.so'): os.unlink(so)\n"
            "from rings._build import ffibuilder\n"
            "with tempfile.TemporaryDirectory() as t:\n"
            "    so = ffibuilder.compile(tmpdir=t)\n"
            "    shutil.copy(so, 'rings/' + os.path.basename(so))\n"
            "import recording; recording.build()\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=root, env=env_for(root), capture_output=True, text=True,
                       timeout=TIMEOUT)
    return r.returncode == 0, r.stdout + r.stderr


def build_all(root):
    r = subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"], cwd=root, env=env_for(root),
                       capture_output=True, text=True, timeout=TIMEOUT)
    if r.returncode:
        return False, r.stdout + r.stderr
    return build_rings(root)


def run_suite(root):
    """(failed test names, summary line) of one pytest run of the conformance suite under root."""
    xml = os.path.join(root, "junit.xml")
    try:
        r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
                            f"--junitxml={xml}", SUITE], cwd=root, env=env_for(root), capture_output=True,
                           text=True, timeout=SUITE_TIMEOUT)
    except subprocess.TimeoutExpired:
        return [], f"timed out after {SUITE_TIMEOUT} s", None
    failed = set()
    if os.path.exists(xml):
        for case in ET.parse(xml).getroot().iter("testcase"):
            if case.find("failure") is not None or case.find("error") is not None:
                failed.add(case.get("name").split("[")[0])
    lines = (r.stdout.strip().splitlines() or [""])
    return sorted(failed), lines[-1], r.returncode


def run_mutant(mutant, base, workdir):
    t0 = time.monotonic()
    root = os.path.join(workdir, mutant.name)
    shutil.copytree(base, root, symlinks=True)
    apply(mutant, root)
    ok, log = build_rings(root)
    if not ok:
        return dict(name=mutant.name, ids=list(mutant.ids), what=mutant.what, killed_by=[], aimed=[],
                    status="build failed", detail=log[-2000:], seconds=round(time.monotonic() - t0, 1))
    failed, summary, rc = run_suite(root)
    aimed = [t for t in failed if set(ids_in_name(t)) & set(mutant.ids)]
    status = "killed" if aimed else ("killed, not by an aimed test" if failed else "SURVIVED")
    if rc is None:
        status = "hung (not a deterministic kill)"
    shutil.rmtree(root, ignore_errors=True)
    return dict(name=mutant.name, ids=list(mutant.ids), what=mutant.what, killed_by=failed, aimed=aimed,
                status=status, summary=summary, seconds=round(time.monotonic() - t0, 1))


def table(results):
    lines = ["| mutant | rule | killed by (aimed tests first) | status |", "|---|---|---|---|"]
    for r in results:
        others = [t for t in r["killed_by"] if t not in r["aimed"]]
        shown = r["aimed"] + (["+ %d more" % len(others)] if others else [])
        lines.append(f"| {r['name']} | {', '.join(r['ids'])} | {'<br>'.join(shown) or '-'} | {r['status']} |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-j", "--jobs", type=int, default=max(1, min(2, len(os.sched_getaffinity(0)))),
                    help="mutants built and tested at once (default: 2, or 1 on one CPU)")
    ap.add_argument("--json", action="store_true", help="print the results as JSON")
    ap.add_argument("--only", help="comma-separated mutant names")
    ap.add_argument("--list", action="store_true", help="list the mutants and exit")
    args = ap.parse_args(argv)
    mutants = MUTANTS
    if args.only:
        want = set(args.only.split(","))
        unknown = want - {m.name for m in MUTANTS}
        if unknown:
            ap.error(f"unknown mutants: {', '.join(sorted(unknown))}")
        mutants = [m for m in MUTANTS if m.name in want]
    if args.list:
        for m in mutants:
            print(f"{m.name:48} {', '.join(m.ids):28} {m.what}")
        return 0
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="vring-mutants-") as workdir:
        base = os.path.join(workdir, "_base")
        copy_tree(ROOT, base, tree_files(ROOT))
        for m in mutants:   # every snippet must be there before anything runs
            scratch = os.path.join(workdir, "_check")
            copy_tree(ROOT, scratch, sorted({p for p, _, _ in m.edits}))
            try:
                apply(m, scratch)
            except SnippetError as e:
                print(f"error: {e}", file=sys.stderr)
                return 2
            finally:
                shutil.rmtree(scratch)
        ok, log = build_all(base)
        if not ok:
            print(f"error: the unmutated tree does not build:\n{log}", file=sys.stderr)
            return 2
        failed, summary, rc = run_suite(base)
        if rc or failed:
            print(f"error: the unmutated conformance suite fails ({summary}): {failed}", file=sys.stderr)
            return 2
        print(f"baseline: {summary}", file=sys.stderr)
        with ThreadPoolExecutor(args.jobs) as pool:
            futures = [pool.submit(run_mutant, m, base, workdir) for m in mutants]
            results = []
            for f in futures:
                results.append(f.result())
                r = results[-1]
                print(f"  {r['name']}: {r['status']} ({len(r['killed_by'])} tests, {r['seconds']} s)", file=sys.stderr)
    elapsed = round(time.monotonic() - t0, 1)
    bad = [r for r in results if r["status"] != "killed"]
    if args.json:
        print(json.dumps({"seconds": elapsed, "jobs": args.jobs, "baseline": summary, "mutants": results},
                         indent=2))
    else:
        print(table(results))
        print(f"\n{len(results) - len(bad)}/{len(results)} mutants killed by a test aimed at their rule; "
              f"{elapsed} s with {args.jobs} job(s)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
