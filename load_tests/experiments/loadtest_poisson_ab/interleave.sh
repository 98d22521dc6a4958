#!/bin/bash
# Interleaved A/B of two code trees (git worktrees) on the Poisson trace, token contender,
# one fixed SLO (SLO_TTFT, SLO_TBT in s; default the published run's 0.0641, 0.0057): per
# seed both trees run back to back, the order alternating between seeds, so the host's drift
# between runs falls on both sides of each pair (paired.py scores it).
#
#   load_tests/experiments/loadtest_poisson_ab/interleave.sh OUT_DIR TAG TREE_A TREE_B RATES [SEEDS]
#
# writes OUT_DIR/TAG-a-sN.json and OUT_DIR/TAG-b-sN.json (+ .records.jsonl.gz) for each seed N.
set -u
out=$1 tag=$2 tree_a=$3 tree_b=$4 rates=$5 seeds=${6:-"0 1 2 3 4 5"}
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../../.." && pwd)
data=${TOKENMUX_DATA_DIR:-$(cd "$root/../shared/data" && pwd)}
mkdir -p "$out"
for seed in $seeds; do
  if (( seed % 2 == 0 )); then order="a b"; else order="b a"; fi
  for side in $order; do
    if [ "$side" = a ]; then tree=$tree_a; else tree=$tree_b; fi
    echo "$(date +%T) seed $seed tree $side ($tree)"
    (cd "$tree" && TOKENMUX_DATA_DIR=$data PYTHONPATH=$tree timeout 900 "$root/.venv/bin/python" \
      "$root/load_tests/experiments/loadtest_bursty_ab/ab.py" "$out/$tag-$side-s$seed.json" "$rates" token \
      --trace poisson --slo-ttft "${SLO_TTFT:-0.0641}" --slo-tbt "${SLO_TBT:-0.0057}" --seeds "$seed")
    "$root/.venv/bin/ray" stop --force >/dev/null 2>&1
  done
done
