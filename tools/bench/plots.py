"""Plots of tools/bench/decode.py's results: tokens/s against past length, and against model size."""

from __future__ import annotations


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_decode(results: dict, path: str) -> None:
    """Decode (and prefill) tokens/s against past length, one line per engine."""
    plt = _pyplot()
    fig, (decode, prefill) = plt.subplots(1, 2, figsize=(11, 4))
    for name, engine in results["engines"].items():
        pasts = sorted(engine["past"], key=int)
        decode.plot([int(p) for p in pasts], [engine["past"][p]["decode_tok_s"] for p in pasts], marker="o", label=name)
        prefill.plot(
            [int(p) for p in pasts], [engine["past"][p]["prefill_tok_s"] for p in pasts], marker="o", label=name
        )
    where = results.get("gpu") or f"{results['machine']}, {results['threads']} threads"
    decode.set(xscale="log", xlabel="past length (tokens)", ylabel="decode tokens/s", title=f"Decode, {where}")
    prefill.set(xscale="log", xlabel="prompt length (tokens)", ylabel="prefill tokens/s", title="Prompt processing")
    for ax in (decode, prefill):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def plot_shapes(results: list[dict], path) -> None:
    """Decode tokens/s against the GGUF's weight bytes (one line per engine and type, at the shortest
    past), and against past length (one line per engine and file)."""
    plt = _pyplot()
    fig, (by_size, by_past) = plt.subplots(1, 2, figsize=(12, 4.5))
    lines: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for result in results:
        for name, engine in result["engines"].items():
            pasts = sorted(engine["past"], key=int)
            lines.setdefault((name, result["type"]), []).append(
                (result["gguf_weight_bytes"] / 1e9, engine["past"][pasts[0]]["decode_tok_s"])
            )
            by_past.plot(
                [int(p) for p in pasts],
                [engine["past"][p]["decode_tok_s"] for p in pasts],
                marker="o",
                linestyle="-" if name == "edgedecode" else "--",
                label=f"{name} {result['shape']} {result['type']}",
            )
    for (name, weight_type), points in sorted(lines.items()):
        points.sort()
        by_size.plot(
            [x for x, _ in points],
            [y for _, y in points],
            marker="o",
            linestyle="-" if name == "edgedecode" else "--",
            label=f"{name} {weight_type}",
        )
    first = results[0]
    where = first.get("gpu") or f"{first['machine']}, {first['threads']} threads"
    by_size.set(
        xscale="log", yscale="log", xlabel="GGUF weights (GB)", ylabel="decode tokens/s", title=f"Decode, {where}"
    )
    by_past.set(xscale="log", yscale="log", xlabel="past length (tokens)", ylabel="decode tokens/s", title="By past")
    by_size.legend(fontsize=7)
    by_past.legend(fontsize=5, ncol=2)
    for ax in (by_size, by_past):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
