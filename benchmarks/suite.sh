#!/bin/sh
# The whole loopback benchmark, as quoted in a closing note: the four pairs (256 and one burst in flight), polled
# vs notified, latency against offered load, and every design study. Run it on a quiet machine with at least two
# CPUs; each command writes its table (.txt), its JSON and its plot into OUTDIR. Takes about 3 hours with the
# defaults below (REPEAT=5, BENCH_SECONDS=8, WARMUP=2); REPEAT=3 BENCH_SECONDS=5 takes about 80 minutes.
#
#   sh benchmarks/suite.sh OUTDIR
#
# Every figure is a median over REPEAT runs made side by side (pairs, modes, variants of one point one after the
# other, the order reversed every other repeat); "vs dpdk" and "vs <baseline>" are medians of same-repeat ratios.
# A point marked "noisy" had other work on the pinned CPUs for more than 10% of its window: measure it again.
set -eu
out=${1:?usage: sh benchmarks/suite.sh OUTDIR}
REPEAT=${REPEAT:-5}
BENCH_SECONDS=${BENCH_SECONDS:-8}
WARMUP=${WARMUP:-2}
mkdir -p "$out"
run() {   # run NAME ARGS...: the table to NAME.txt, JSON and plot beside it
    name=$1; shift
    echo "== $name: vring bench $*" >&2
    python3 -m vring.cli bench "$@" --repeat "$REPEAT" --seconds "$BENCH_SECONDS" --warmup "$WARMUP" \
        --json "$out/$name.json" --plot "$out/$name.png" | tee "$out/$name.txt"
}
python3 benchmarks/loop_profile.py --callgrind > "$out/instructions.txt" || echo "(no valgrind: no instruction counts)" >&2
run pairs-256 --pairs ours/ours,dpdk/dpdk,ours/dpdk,dpdk/ours --inject 256
run pairs-32 --pairs ours/ours,dpdk/dpdk,ours/dpdk,dpdk/ours --inject 32
# our driver in front of net_vhost with its header in a descriptor of its own (README.md, Benchmarks): two
# descriptors a packet, so 256 in flight take 512-entry rings (both pairs, to compare like with like)
run pairs-256-chain --pairs ours/dpdk,dpdk/dpdk --tx-hdr chain --inject 256 --ring-size 512
run pairs-32-chain --pairs ours/dpdk,dpdk/dpdk --tx-hdr chain --inject 32
run notify --modes poll,notify --idle 3
run notify-mixed --pairs ours/dpdk,dpdk/ours --modes poll,notify --idle 3
run rate --rate 10k,100k,1M,2M,4M,8M --paths split-in-order,packed-in-order
for study in tx-cleanup hdr-init doorbell retries txq; do
    run "study-$study" --study "$study"
done
run study-hdr-prepend --study hdr-prepend --pairs ours/ours,ours/dpdk \
    --paths split-normal,split-in-order,packed-normal,packed-in-order
echo "tables, JSON and plots in $out" >&2
