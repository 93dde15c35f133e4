#!/usr/bin/env python3
"""Side-by-side table of `fx-train bench --json` and the PyTorch reference's bench.py.

    python3 scripts/compare.py fx.json torch.json [--markdown]

Both files hold {"meta": ..., "results": [case records]}; records are matched by their
`case` name (e.g. dqn_train_b8192). Every PyTorch mode of a case gets one row, paired
with the fx record of the same mode, else the fx record of the same precision (torch's
*_bf16 modes with fx `eager_bf16`, *_fp32 with `eager_fp32`), else the case's first fx
record. fx cases without a PyTorch counterpart (e.g. dqn_train_b2048, h2d_*) are listed
on their own. The ratio is fx over PyTorch throughput (samples/s for training,
env_steps/s for the environment) and PyTorch over fx p50 latency: > 1 means fx is faster.
A second table puts each case's best fx mode against PyTorch's best mode (the bar the
project's targets use).
"""
import json
import sys


def load(path):
    """(meta, records that ran, records that did not: error or skipped)."""
    with open(path) as f:
        doc = json.load(f)
    recs = doc.get("results", [])
    ok = [r for r in recs if r.get("status", "ok") == "ok"]
    bad = [r for r in recs if r.get("status", "ok") != "ok"]
    return doc.get("meta", {}), ok, bad


def precision_of(mode):
    for p in ("bf16", "fp16", "fp32"):
        if mode.endswith(p):
            return p
    return None


def pick_fx(fx_recs, torch_mode):
    """The fx record a torch mode is compared with (see the module doc)."""
    for r in fx_recs:
        if r.get("mode") == torch_mode:
            return r
    p = precision_of(torch_mode)
    if p:
        for r in fx_recs:
            if precision_of(r.get("mode", "")) == p:
                return r
    return fx_recs[0] if fx_recs else None


def num(v, spec):
    return "-" if v is None else format(v, spec)


def describe(r):
    """The value shown for one record, and the number the ratio uses (higher = better
    for throughput; latency is inverted in the ratio)."""
    kind = r.get("kind")
    mem = r.get("peak_mem_mib")
    mem_s = f", {mem:.1f} MiB" if isinstance(mem, (int, float)) else ""
    if kind == "latency":
        return f"{num(r.get('p50_us'), '.1f')} us p50 / {num(r.get('p99_us'), '.1f')} p99", r.get("p50_us")
    if kind == "env":
        v = r.get("env_steps_per_s")
        return f"{num(v, '.4g')} env-steps/s{mem_s}", v
    if kind == "h2d":
        v = r.get("gb_per_s")
        return f"{num(v, '.2f')} GB/s", v
    v = r.get("samples_per_s")
    return f"{num(v, '.4g')}/s{mem_s}", v


def ratio(kind, ours, theirs):
    if not ours or not theirs:
        return None
    return theirs / ours if kind == "latency" else ours / theirs


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    md = "--markdown" in sys.argv
    if len(args) != 2:
        print(__doc__)
        sys.exit(2)
    fx_meta, fx, fx_bad = load(args[0])
    th_meta, th, _ = load(args[1])
    fx_by_case, th_by_case, order = {}, {}, []
    for r in fx:
        if r["case"] not in fx_by_case:
            order.append(r["case"])
        fx_by_case.setdefault(r["case"], []).append(r)
    for r in th:
        th_by_case.setdefault(r["case"], []).append(r)
    rows = []
    for case in order:
        fx_recs = fx_by_case[case]
        refs = th_by_case.get(case, [])
        if not refs:
            for r in fx_recs:
                rows.append((case, r["mode"], describe(r)[0], "-", "-", None))
            continue
        used = set()
        for t in refs:
            r = pick_fx(fx_recs, t["mode"])
            used.add(id(r))
            ours_s, ours = describe(r)
            theirs_s, theirs = describe(t)
            rows.append((case, r["mode"], ours_s, t["mode"], theirs_s, ratio(r.get("kind"), ours, theirs)))
        for r in fx_recs:
            if id(r) not in used:
                rows.append((case, r["mode"], describe(r)[0], "-", "-", None))
    for r in fx_bad:
        msg = f"{r.get('status')}: {str(r.get('error', r.get('reason', '')))[:80]}"
        rows.append((r.get("case", "?"), r.get("mode", "?"), msg, "-", "-", None))
    head = ("case", "fx mode", "fx", "torch mode", "torch", "fx speed-up")

    def fmt(row):
        return [f"{c:.2f}x" if isinstance(c, float) else ("-" if c is None else str(c)) for c in row]

    fx_dev = fx_meta.get("gpu") or fx_meta.get("device", "?")
    th_dev = th_meta.get("gpu") or th_meta.get("device", "?")
    if md:
        print(f"fx {fx_meta.get('fx_version', '?')} on {fx_dev} (timing {fx_meta.get('timing', '?')}, "
              f"memory {fx_meta.get('mem_method') or '-'}, {fx_meta.get('timed_steps', '?')} timed steps); "
              f"torch {th_meta.get('torch', '?')} on {th_dev} ({th_meta.get('timed_steps', '?')} timed steps)\n")
    print_table(head, [fmt(r) for r in rows], md)
    best_rows = best_vs_best(order, fx_by_case, th_by_case)
    if best_rows:
        print("\nBest against best:\n" if md else "")
        bhead = ("case", "fx best mode", "fx", "torch best mode", "torch", "fx best / torch best")
        print_table(bhead, [fmt(r) for r in best_rows], md)


def print_table(head, rows, md):
    """A Markdown table, or columns padded to their widest cell."""
    if md:
        print("| " + " | ".join(head) + " |")
        print("|" + "---|" * len(head))
        for row in rows:
            print("| " + " | ".join(row) + " |")
    else:
        table = [list(head)] + rows
        widths = [max(len(x) for x in col) for col in zip(*table)]
        for row in table:
            print("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())


def best_of(recs):
    """The record with the best number (highest throughput, lowest p50 latency)."""
    scored = [(describe(r)[1], r) for r in recs if describe(r)[1]]
    if not scored:
        return None
    lat = recs[0].get("kind") == "latency"
    return (min if lat else max)(scored, key=lambda x: x[0])[1]


def best_vs_best(order, fx_by_case, th_by_case):
    rows = []
    for case in order:
        f, t = best_of(fx_by_case[case]), best_of(th_by_case.get(case, []))
        if f is None or t is None:
            continue
        (fs, fv), (ts, tv) = describe(f), describe(t)
        rows.append((case, f["mode"], fs, t["mode"], ts, ratio(f.get("kind"), fv, tv)))
    return rows


if __name__ == "__main__":
    main()
