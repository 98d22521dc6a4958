"""Paired A/B of two trees run by interleave.sh: per seed and rate, goodput of tree b minus
tree a, then the mean difference and its 95% Student-t CI over seeds (drift between runs
cancels within a pair, run back to back).

    .venv/bin/python load_tests/experiments/loadtest_poisson_ab/paired.py DIR TAG

reads DIR/TAG-a-sN.json and DIR/TAG-b-sN.json (ab.py's output, one seed each); prints JSON.
"""
import glob, json, re, sys

from load_tests.stats import mean_ci

folder, tag = sys.argv[1], sys.argv[2]


def goodput(tree):
    out = {}
    for path in glob.glob(f"{folder}/{tag}-{tree}-s*.json"):
        seed = re.search(r"-s(\d+)\.json$", path).group(1)
        for rate, seeds in json.load(open(path))["rates"].items():
            out[(rate, seed)] = seeds[seed]["attainment_goodput"]
    return out


ga, gb = goodput("a"), goodput("b")
result = {}
for rate in sorted({r for r, _ in ga}, key=float):
    seeds = sorted((s for r, s in ga if r == rate and (r, s) in gb), key=int)
    a, b = [ga[(rate, s)] for s in seeds], [gb[(rate, s)] for s in seeds]
    diff = mean_ci([y - x for x, y in zip(a, b)])
    result[rate] = {"seeds": seeds, "a": a, "b": b, "mean_a": mean_ci(a).mean, "mean_b": mean_ci(b).mean,
                    "diff": diff.mean, "diff_ci": [diff.lo, diff.hi]}
print(json.dumps({"tag": tag, "a": "a", "b": "b", "goodput_by_rate": result}, indent=1))
