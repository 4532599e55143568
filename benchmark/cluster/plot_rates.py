"""Step time against link rate, from a measurements file of the namespace cluster.

The file (JSON, e.g. ``benchmark/cluster/movielens_rates.json``) maps each
configuration to {link rate in Mbit/s: seconds of the run}; the plot (log-scaled rate,
one line per configuration, TorchRec static first) goes to ``--out`` (a PNG; plots are
written under ``benchmark/out/``, which git ignores, not committed).

    python benchmark/cluster/plot_rates.py benchmark/cluster/movielens_rates.json \
        --out benchmark/out/cluster_rates.png
"""

import argparse
import json
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("measurements", help="JSON: {configuration: {rate_mbit: seconds}}")
    p.add_argument("--out", required=True, help="the PNG to write")
    args = p.parse_args()
    with open(args.measurements) as f:
        data = json.load(f)
    runs = data["runs"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, points in runs.items():
        rates = sorted(points, key=float)
        ax.plot([float(r) for r in rates], [points[r] for r in rates], marker="o", label=name)
    ax.set_xscale("log")
    ax.set_xlabel("link rate (Mbit/s, each direction)")
    ax.set_ylabel(data.get("unit", "seconds"))
    ax.set_title(data.get("title", "step time against link rate"))
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
