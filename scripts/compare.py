#!/usr/bin/env python3
"""Side-by-side table of `fx-train bench --json` and the PyTorch reference's bench.py.

    python3 scripts/compare.py fx.json torch.json [--markdown]

Both files hold {"meta": ..., "results": [case records]}; records are matched by their
`case` name (e.g. dqn_train_b8192). For training cases the ratio is fx samples/s over
PyTorch samples/s (> 1: fx is faster); for latency cases it is PyTorch p50 over fx p50.
"""
import json
import sys


def load(path):
    with open(path) as f:
        doc = json.load(f)
    return doc.get("meta", {}), [r for r in doc.get("results", []) if r.get("status", "ok") == "ok"]


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    md = "--markdown" in sys.argv
    if len(args) != 2:
        print(__doc__)
        sys.exit(2)
    fx_meta, fx = load(args[0])
    th_meta, th = load(args[1])
    by_case = {}
    for r in th:
        by_case.setdefault(r["case"], {})[r["mode"]] = r
    rows = []
    for r in fx:
        ref = by_case.get(r["case"], {})
        if r.get("kind") == "latency":
            ours = r.get("p50_us")
            for mode, t in sorted(ref.items()):
                theirs = t.get("p50_us")
                ratio = theirs / ours if ours and theirs else None
                rows.append((r["case"], r["mode"], f"{ours:.1f} us p50 / {r.get('p99_us', 0):.1f} p99",
                             mode, f"{theirs:.1f} us p50 / {t.get('p99_us', 0):.1f} p99", ratio))
        else:
            key = "env_steps_per_s" if r.get("kind") == "env" else "samples_per_s"
            ours = r.get(key)
            for mode, t in sorted(ref.items()):
                theirs = t.get(key)
                ratio = ours / theirs if ours and theirs else None
                mem = f", {r.get('peak_mem_mib', float('nan')):.1f} MiB" if "peak_mem_mib" in r else ""
                tmem = f", {t.get('peak_mem_mib', float('nan')):.1f} MiB" if "peak_mem_mib" in t else ""
                rows.append((r["case"], r["mode"], f"{ours:.4g}/s{mem}", mode, f"{theirs:.4g}/s{tmem}", ratio))
    head = ("case", "fx mode", "fx", "torch mode", "torch", "fx speed-up")
    fmt = lambda row: [str(c) if not isinstance(c, float) else f"{c:.2f}x" for c in row]
    if md:
        print(f"fx: {fx_meta.get('gpu', '?')}; torch {th_meta.get('torch', '?')} on {th_meta.get('gpu', '?')}\n")
        print("| " + " | ".join(head) + " |")
        print("|" + "---|" * len(head))
        for row in rows:
            print("| " + " | ".join(fmt(row)) + " |")
    else:
        widths = [max(len(x) for x in col) for col in zip(*([head] + [fmt(r) for r in rows]))]
        for row in [head] + [tuple(fmt(r)) for r in rows]:
            print("  ".join(c.ljust(w) for c, w in zip(row, widths)))


if __name__ == "__main__":
    main()
