"""The figures of tools/study/crossquant.py: box plots of KL per prompt, and KL change by distance from the prompt.

Needs matplotlib: pip install -e '.[bench]'.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np


def plot(study: dict, out_dir: Path, baseline: str = "target") -> list[Path]:
    """Box plots of per-prompt mean and p99 KL per target and mode, and per target the change in KL
    against ``baseline`` by distance from the prompt; returns the PNG paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = study["summary"]
    window_tokens = study["config"]["window_tokens"]
    targets = list(summary)
    modes = list(study["results"][targets[0]])
    palette = iter(["tab:green", "tab:olive", "tab:orange", "tab:purple", "tab:brown", "tab:pink", "tab:cyan"])
    colors = {m: {baseline: "tab:red", "handoff": "tab:blue"}.get(m) or next(palette) for m in modes}
    markers = {"short": "o", "medium": "s", "long": "D"}
    sizes = [p["size"] for p in study["prompts"]]
    width = 0.8 / len(modes)
    fig, axes = plt.subplots(2, 1, figsize=(max(8.0, 0.5 * len(targets) * len(modes) + 2), 8))
    for ax, key in zip(axes, ("mean_kl", "p99_kl")):
        for i, mode in enumerate(modes):
            data = [[p[key] for p in study["results"][t][mode]] for t in targets]
            positions = np.arange(len(targets)) + (i - (len(modes) - 1) / 2) * width
            style = {"color": colors[mode]}
            ax.boxplot(
                data,
                positions=positions,
                widths=width * 0.8,
                showfliers=False,
                boxprops=style,
                medianprops=style,
                whiskerprops=style,
                capprops=style,
            )
            for x, values in zip(positions, data):
                for value, size in zip(values, sizes):
                    ax.scatter(x, value, marker=markers[size], s=14, facecolors="none", edgecolors=colors[mode])
        ax.set_xticks(range(len(targets)), targets)
        ax.set(yscale="log", ylabel="KL(ref || ·), nats", title=f"{key.split('_')[0]} KL per prompt")
    handles = [plt.Line2D([], [], color=c, label=m) for m, c in colors.items()]
    handles += [
        plt.Line2D([], [], marker=m, linestyle="", color="gray", markerfacecolor="none", label=s)
        for s, m in markers.items()
    ]
    axes[0].legend(handles=handles, fontsize=8, ncol=2)
    wire = "\nwire-b = that KV through EDKV at budget b" if any(m.startswith("wire-") for m in modes) else ""
    fig.suptitle(f"Cross-quant, {len(sizes)} prompts: {baseline} = own prefill, handoff = fp32 prefill KV{wire}")
    fig.tight_layout()
    box_path = out_dir / "crossquant_kl.png"
    fig.savefig(box_path, dpi=110)
    plt.close(fig)

    columns = min(3, len(targets) + 1)
    rows_n = -(-(len(targets) + 1) // columns)
    fig, axes = plt.subplots(rows_n, columns, figsize=(4.6 * columns, 3.6 * rows_n), squeeze=False)
    panels = list(axes.flat)
    for ax, (target, rows) in zip(panels, summary.items()):
        for mode, row in rows.items():
            if mode != baseline:
                starts = np.arange(len(row["window_change"])) * window_tokens
                ax.plot(
                    starts,
                    100 * np.asarray(row["window_change"]),
                    color=colors[mode],
                    marker="o",
                    markersize=3,
                    label=mode,
                )
        ax.axhline(0, color="gray", linewidth=0.8)
        ax.set(xlabel="generated tokens (window start)", ylabel=f"% KL change vs {baseline}", title=target)
        ax.legend(fontsize=7)
    absolute = panels[len(targets)]
    for target, rows in summary.items():
        starts = np.arange(len(rows[baseline]["window_kl"])) * window_tokens
        absolute.plot(starts, rows[baseline]["window_kl"], marker="o", markersize=3, label=target)
    absolute.set(
        yscale="log",
        xlabel="generated tokens (window start)",
        ylabel="mean KL over prompts, nats",
        title=f"{baseline}: KL by distance from the prompt",
    )
    absolute.legend(fontsize=7)
    for ax in panels[len(targets) + 1 :]:
        ax.set_visible(False)
    fig.suptitle(f"Change in KL per {window_tokens}-token window against {baseline} (own prefill)")
    fig.tight_layout()
    decay_path = out_dir / "crossquant_decay.png"
    fig.savefig(decay_path, dpi=110)
    plt.close(fig)
    return [box_path, decay_path]
