"""The shipped head's accept length across its training phases, from bench/accept_length.py JSONs.

Each --point names a head, the loss tokens it had trained on (millions, counted from one phase's start) and
the accept-length JSON(s) measured for it; a point's value per dataset is read from the JSON's results at
--tier and --temperature. One PNG (one line per dataset; points with a --branch label drawn apart) and a
table. The phases' loss tokens come from each phase's `tokens_seen` (the head's training.json).

    python bench/probes/head_curve.py --tier 5,4,8 --out curve.png \
      --point "phase 4=7.4:results/…/accept_length_phase4_548_t0_h200.json" \
      --point "two layers=119.9:results/…/accept_2layer_step2045_h100.json:branch" ...
"""
from __future__ import annotations

import argparse
import json


def point(spec: str) -> dict:
    """'LABEL=TOKENS_M:FILE[,FILE...][:branch]' -> {label, tokens_m, files, branch}."""
    label, _, rest = spec.partition("=")
    parts = rest.split(":")
    if not label or len(parts) < 2:
        raise SystemExit(f"--point {spec!r}: expected LABEL=TOKENS_M:FILE[,FILE...][:branch]")
    return {"label": label, "tokens_m": float(parts[0]), "files": parts[1].split(","),
            "branch": len(parts) > 2 and parts[2] == "branch"}


def values(files: list[str], tier: tuple[int, ...], temperature: float) -> dict[str, tuple[float, str]]:
    """dataset -> (accept length, device) at the tier and temperature, from the files (later files win)."""
    out = {}
    for f in files:
        d = json.load(open(f, encoding="utf-8"))
        for r in d["results"]:
            spec = tuple(r.get("spec") or r.get("tier"))
            if spec == tier and float(r.get("temperature", 0.0)) == temperature:
                out[r["dataset"]] = (float(r["accept_length"]), d.get("device", "?"))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--point", action="append", required=True, type=point)
    p.add_argument("--tier", default="5,4,8")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--datasets", default="mtbench,gsm8k,code")
    p.add_argument("--goal", type=float, default=None, help="a horizontal line (the issue's MT-bench goal)")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    tier = tuple(int(x) for x in args.tier.split(","))
    names = args.datasets.split(",")
    rows = [(pt, values(pt["files"], tier, args.temperature)) for pt in args.point]
    print(f"accept length at {args.tier}, T = {args.temperature:g}, against loss tokens (M)")
    print(f"{'head':32s} {'tokens M':>8s} " + " ".join(f"{n:>8s}" for n in names) + "  device")
    for pt, v in rows:
        cells = " ".join(f"{v[n][0]:8.3f}" if n in v else f"{'-':>8s}" for n in names)
        devs = sorted({dev for _, dev in v.values()})
        print(f"{pt['label']:32s} {pt['tokens_m']:8.1f} {cells}  {', '.join(devs)}")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for i, n in enumerate(names):
        main_pts = [(pt["tokens_m"], v[n][0]) for pt, v in rows if n in v and not pt["branch"]]
        ax.plot(*zip(*main_pts), marker="o", color=f"C{i}", label=n)
        for pt, v in rows:
            if n in v and pt["branch"]:
                ax.plot(pt["tokens_m"], v[n][0], marker="x", color=f"C{i}", markersize=9)
                ax.annotate(pt["label"], (pt["tokens_m"], v[n][0]), fontsize=7, xytext=(4, -10),
                            textcoords="offset points")
    if args.goal:
        ax.axhline(args.goal, color="grey", linestyle="--", linewidth=1, label=f"goal {args.goal:g}")
    ax.set_xlabel("loss tokens trained since phase 4 began (millions)")
    ax.set_ylabel(f"accept length at ({args.tier}), T = {args.temperature:g}")
    ax.set_title("the shipped SmolLM2 head by phase (x: variants not shipped)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"written {args.out}")


if __name__ == "__main__":
    main()
