"""`vring dump --from` / `--diff` on mutated snapshot files, in-process: any exception escaping main(), a
return code other than 0/1/2, or output with 'Traceback' is a finding. Usage: python3 attack/dump_damaged.py [N]"""
import io, os, sys, json, random, contextlib, tempfile, glob, traceback, signal
from common import ROOT
from vring.cli import main

N = int(sys.argv[1]) if len(sys.argv) > 1 else 300
seeds = sorted(glob.glob(os.path.join(ROOT, "attack/snaps/*.raw")))
tmp = tempfile.mkdtemp(prefix="review-a-dump-")
path = os.path.join(tmp, "x.raw")

def mutate(rnd, data):
    nl = data.index(b"\n", 12)
    hdr = json.loads(data[12:nl])
    body = data[nl + 1:]
    k = rnd.randrange(12)
    if k == 0:
        return data[:rnd.randrange(len(data))]
    if k == 1:
        b = bytearray(data); i = rnd.randrange(len(b)); b[i] ^= 1 << rnd.randrange(8); return bytes(b)
    # header field edits
    def setrand(d, key):
        d[key] = rnd.choice([None, -1, 0, 1, 2**15, 2**16, 2**31, 2**63, 2**64 + 5, 1e300, "x", [], {}, True, -2**70])
    if k == 2: setrand(hdr["layout"], rnd.choice(list(hdr["layout"])))
    if k == 3: setrand(hdr, rnd.choice(list(hdr)))
    if k == 4 and hdr.get("state"): setrand(hdr["state"], rnd.choice(list(hdr["state"])))
    if k == 5 and hdr["blobs"]: setrand(rnd.choice(hdr["blobs"]), rnd.choice(["name", "dtype", "count"]))
    if k == 6 and hdr["blobs"]: rnd.choice(hdr["blobs"])["dtype"] = rnd.choice(["O", "<f8", "V0", "u1,u1", "S0", "<M8", "(3,)u1", "u8"])
    if k == 7: hdr["blobs"] = hdr["blobs"][:rnd.randrange(len(hdr["blobs"]) + 1)]
    if k == 8: hdr["layout"]["fmt"] = rnd.choice(["split", "packed", "both", ""]); hdr["layout"]["size"] = rnd.choice([0, 1, 3, 32768, 65535, 65536])
    if k == 9: hdr["broken"] = rnd.choice([{"error": "X"}, {"error": None, "message": 3}, "x", {"error": "RingError", "message": "m"}])
    if k == 10: hdr["kind"] = rnd.choice(["driver", "device", "memory", "x", None])
    if k == 11:
        body = bytes(rnd.randrange(256) for _ in range(len(body)))
    return data[:12] + json.dumps(hdr).encode() + b"\n" + body

bad = 0
rc_seen = {}
for i in range(N):
    rnd = random.Random(i)
    seed = open(rnd.choice(seeds), "rb").read()
    data = mutate(rnd, seed)
    if rnd.random() < 0.3:
        try: data = mutate(rnd, data)
        except Exception: pass
    with open(path, "wb") as f:
        f.write(data)
    argv = rnd.choice([["dump", "--from", path], ["dump", "--from", path, "--json"], ["dump", "--diff", path, rnd.choice(seeds)]])
    out, err = io.StringIO(), io.StringIO()
    signal.alarm(20)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = main(argv)
    except SystemExit as e:
        rc = 1 if isinstance(e.code, str) else e.code
    except BaseException as e:
        bad += 1
        print(f"case {i}: {argv[1]} escaped {type(e).__name__}: {e}")
        traceback.print_exc(limit=3)
        open(os.path.join(ROOT, f"attack/crash-{i}.raw"), "wb").write(data)
        continue
    finally:
        signal.alarm(0)
    rc_seen[rc] = rc_seen.get(rc, 0) + 1
    text = out.getvalue() + err.getvalue()
    if rc not in (0, 1, 2) or "Traceback" in text:
        bad += 1
        print(f"case {i}: rc={rc} {text[-500:]}")
        open(os.path.join(ROOT, f"attack/crash-{i}.raw"), "wb").write(data)
print("cases", N, "findings", bad, "rcs", rc_seen)
os.unlink(path) if os.path.exists(path) else None
os.rmdir(tmp)
