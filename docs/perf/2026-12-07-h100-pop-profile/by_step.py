"""Sums each population update's launches by kind, from ncu's raw CSV (ncu-raw.csv.xz).

An update ends at its one fx_pop_adam launch; a case (DQN pop64, DQN pop256, PPO pop64) is
told apart by its launches (fx_ppo_loss for PPO) and the member count in fx_bias_act's grid.
The last update of each case is summed (its graph replays, caches warm). Usage:
python3 by_step.py [ncu-raw.csv.xz]
"""
import collections
import csv
import lzma
import sys

path = sys.argv[1] if len(sys.argv) > 1 else "ncu-raw.csv.xz"
lines = lzma.open(path, "rt").read().splitlines()
start = next(i for i, l in enumerate(lines) if l.startswith('"ID"'))
rows = list(csv.reader(lines[start:]))
head, data = rows[0], rows[2:]  # rows[1] holds the units
col = {k: head.index(k) for k in ("Kernel Name", "Grid Size", "gpu__time_duration.sum")}
launches = [(r[col["Kernel Name"]], r[col["Grid Size"]], float(r[col["gpu__time_duration.sum"]].replace(",", "")))
            for r in data]


def kind(name):
    if any(s in name for s in ("nvjet", "cutlass", "xmma", "gemv", "internal::kernel")):
        return "gemm"
    return name.split("(")[0] if name.startswith("fx_") else "candle-small"


ends = [i for i, (n, _, _) in enumerate(launches) if n.startswith("fx_pop_adam")]
last = {}
for a, b in zip(ends, ends[1:]):
    update = launches[a + 1:b + 1]
    members = next(g for n, g, _ in update if n.startswith("fx_bias_act")).strip("()").split(",")[1].strip()
    model = "PPO" if any(n.startswith("fx_ppo_loss") for n, _, _ in update) else "DQN"
    last[f"{model} pop{members}"] = update
for case, update in last.items():
    us, count = collections.Counter(), collections.Counter()
    for n, _, t in update:
        us[kind(n)] += t / 1000
        count[kind(n)] += 1
    total = sum(us.values())
    print(f"{case}: {len(update)} launches, {total:.1f} us")
    for k, v in us.most_common():
        print(f"   {k:20s} {v:8.1f} us {100 * v / total:5.1f}% n={count[k]}")
