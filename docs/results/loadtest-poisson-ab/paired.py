"""Paired A/B of two trees run by interleave.sh: per seed and rate, goodput of B minus A,
then the mean difference and its 95% Student-t CI over seeds (drift between runs cancels
within a pair, run back to back).

    .venv/bin/python docs/results/loadtest-poisson-ab/paired.py DIR TAG [A B]

reads DIR/TAG-A-sN.json and DIR/TAG-B-sN.json (ab.py's output, one seed each); prints JSON.
"""
import glob, json, re, sys

from load_tests.stats import mean_ci

folder, tag = sys.argv[1], sys.argv[2]
a, b = (sys.argv[3], sys.argv[4]) if len(sys.argv) > 4 else ("a", "b")


def goodput(tree):
    out = {}
    for path in glob.glob(f"{folder}/{tag}-{tree}-s*.json"):
        seed = re.search(r"-s(\d+)\.json$", path).group(1)
        for rate, seeds in json.load(open(path))["rates"].items():
            out[(rate, seed)] = seeds[seed]["attainment_goodput"]
    return out


ga, gb = goodput(a), goodput(b)
result = {}
for rate in sorted({r for r, _ in ga}, key=float):
    seeds = sorted(s for r, s in ga if r == rate and (r, s) in gb)
    diffs = [gb[(rate, s)] - ga[(rate, s)] for s in seeds]
    ci = mean_ci(diffs)
    result[rate] = {"seeds": seeds, a: [ga[(rate, s)] for s in seeds], b: [gb[(rate, s)] for s in seeds],
                    "mean_" + a: sum(ga[(rate, s)] for s in seeds) / len(seeds),
                    "mean_" + b: sum(gb[(rate, s)] for s in seeds) / len(seeds),
                    "diff": ci.mean, "diff_ci": [ci.lo, ci.hi]}
print(json.dumps({"tag": tag, "a": a, "b": b, "goodput_by_rate": result}, indent=1))
