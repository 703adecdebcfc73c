"""The figures. Each takes the parsed JSON and returns a matplotlib Figure."""
import json
import math
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

DPI = 100


def _moving_average(values, window):
    values = np.asarray(values, dtype=float)
    if window <= 1 or len(values) < 2:
        return values
    out = np.empty_like(values)
    for i in range(len(values)):  # trailing window, shorter at the start
        out[i] = values[max(0, i - window + 1): i + 1].mean()
    return out


def curves(data):
    """Curves of a logged metric (moving average), one line per run: training loss (DAR Fig. 2),
    or an MoE run's router balance with its reference at 1.0 (DAR Fig. A.2)."""
    fig, ax = plt.subplots(figsize=(8, 5), dpi=DPI)
    window = int(data.get("window", 1))
    for s in data["series"]:
        ax.plot(s["steps"], _moving_average(s["loss"], window), label=s["label"], linewidth=1.4)
    ref = data.get("reference")  # a horizontal reference line, e.g. 1.0 = uniform expert use
    if ref:
        ax.axhline(ref["y"], color="black", linestyle="--", linewidth=1, label=ref.get("label"))
    ylabel = data.get("ylabel", "training loss")
    ax.set_xlabel(data.get("xlabel", "step"))
    ax.set_ylabel(f"{ylabel} ({window}-point moving average)" if window > 1 else ylabel)
    ax.set_title(data.get("title", "training loss"))
    lo = [min(_moving_average(s["loss"], window)[len(s["loss"]) // 4:], default=None) for s in data["series"]]
    hi = [np.percentile(s["loss"], 90) for s in data["series"] if s["loss"]]
    lo = [v for v in lo if v is not None]
    if ref:
        lo.append(ref["y"])
        hi.append(ref["y"])
    if lo and hi:  # the interesting part: from the best loss to the early plateau
        span = max(hi) - min(lo)
        ax.set_ylim(min(lo) - 0.05 * span, max(hi) + 0.05 * span)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def _masked(matrix):
    return np.ma.masked_invalid(np.array([[math.nan if v is None else v for v in row] for row in matrix], dtype=float))


def maps(data):
    """Retrieval maps: token-averaged depth-attention weights, target × source, per stream and
    read (pre-attention, pre-MLP); blank cells are unavailable (DAR Fig. 3, A.3; MSAR Fig. 4)."""
    streams = data["streams"]
    reads = [("pre_attention", "pre-attention"), ("pre_mlp", "pre-MLP")]
    fig, axes = plt.subplots(len(streams), 2, figsize=(10, 3.6 * len(streams) + 0.6), dpi=DPI, squeeze=False)
    labels = data["source_labels"]
    for i, s in enumerate(streams):
        for k, (key, name) in enumerate(reads):
            ax = axes[i][k]
            m = _masked(s[key])
            cmap = matplotlib.colormaps["viridis"].copy()
            cmap.set_bad("white")
            im = ax.imshow(m, cmap=cmap, vmin=0.0, vmax=1.0, aspect="auto", interpolation="nearest")
            rows = len(s[key])
            ax.set_yticks(range(rows), [str(r + 1) for r in range(rows)])
            ax.set_xticks(range(len(labels)), labels, rotation=45 if len(labels) > 8 else 0, fontsize=8)
            ax.set_xlabel("source (emb = embedding; block b)")
            ax.set_ylabel("target layer")
            ax.set_title(f"stream {s['stream']}, {name} reads")
            for (r, c), v in np.ndenumerate(m.filled(np.nan)):
                if not math.isnan(v) and m.shape[0] * m.shape[1] <= 160:
                    ax.text(c, r, f"{v:.2f}", ha="center", va="center", fontsize=7,
                            color="white" if v < 0.6 else "black")
            fig.colorbar(im, ax=ax, label="retrieval weight")
    fig.suptitle(data.get("title", "retrieval maps"))
    fig.tight_layout()
    return fig


def cka(data):
    """Cross-stream, cross-depth linear CKA of the post-MLP stream states (DAR Fig. 5)."""
    pairs = data["pairs"]
    cols = min(3, len(pairs))
    rows = (len(pairs) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(4.8 * cols, 4.2 * rows + 0.5), dpi=DPI, squeeze=False)
    for ax in axes.flat[len(pairs):]:
        ax.axis("off")
    for ax, p in zip(axes.flat, pairs):
        m = np.asarray(p["matrix"], dtype=float)
        im = ax.imshow(m, cmap="magma", vmin=0.0, vmax=1.0, origin="lower", interpolation="nearest")
        n = m.shape[0]
        ax.set_xticks(range(n), [str(i + 1) for i in range(n)], fontsize=8)
        ax.set_yticks(range(n), [str(i + 1) for i in range(n)], fontsize=8)
        ax.set_xlabel(f"stream {p['b']} layer")
        ax.set_ylabel(f"stream {p['a']} layer")
        ax.set_title(f"CKA, stream {p['a']} × stream {p['b']}")
        fig.colorbar(im, ax=ax, label="linear CKA")
    fig.suptitle(data.get("title", "cross-stream CKA"))
    fig.tight_layout()
    return fig


def rescue(data):
    """Post-MLP rescue gain R_l,j by layer, one panel per retained stream (DAR Fig. 6)."""
    streams = data["streams"]
    fig, axes = plt.subplots(1, len(streams), figsize=(4.2 * len(streams), 4), dpi=DPI, squeeze=False, sharey=True)
    layers = data["layers"]
    for ax, s in zip(axes[0], streams):
        gain = np.asarray(s["gain"], dtype=float)
        ax.bar(layers, gain, color=["tab:blue" if g >= 0 else "tab:red" for g in gain])
        ax.axhline(0, color="black", linewidth=0.8)
        ax.axhline(1, color="grey", linewidth=0.8, linestyle="--")
        ax.set_xlabel("layer")
        ax.set_xticks(layers)
        ax.set_title(f"keep stream {s['stream']}")
        ax.grid(axis="y", alpha=0.3)
    axes[0][0].set_ylabel("rescue gain R (1: full recovery)")
    fig.suptitle(data.get("title", "rescue gain"))
    fig.tight_layout()
    return fig


def gates(data):
    """Write-gate gap g_l against rescue gap d_l per MLP layer, coloured by depth (DAR Fig. A.4)."""
    g = np.asarray(data["g"], dtype=float)
    d = np.asarray(data["d"], dtype=float)
    layers = np.asarray(data["layers"], dtype=float)
    fig, ax = plt.subplots(figsize=(6, 5), dpi=DPI)
    sc = ax.scatter(g, d, c=layers, cmap="viridis", s=60, edgecolors="black", linewidths=0.5)
    if len(g) >= 2 and np.ptp(g) > 0:
        slope, icpt = np.polyfit(g, d, 1)
        xs = np.linspace(g.min(), g.max(), 20)
        ax.plot(xs, slope * xs + icpt, color="tab:red", linewidth=1.2, label="least-squares fit")
        ax.legend(fontsize=8)
    ax.axhline(0, color="grey", linewidth=0.6)
    ax.axvline(0, color="grey", linewidth=0.6)
    ax.set_xlabel("write-gate gap g = E[β¹ − β⁰]")
    ax.set_ylabel("rescue gap d = R₁ − R₀")
    r = data.get("pearson")
    ax.set_title(f"{data.get('title', 'gate asymmetry')}\nr = {r:.2f}, mean |g| = {data['mean_abs_g']:.3f}"
                 if r is not None else data.get("title", "gate asymmetry"))
    fig.colorbar(sc, ax=ax, label="layer")
    fig.tight_layout()
    return fig


def scaling(data):
    """Shifted power-law fits L(C) = A·C^(−β) + E per method (MSAR Fig. 3)."""
    fig, ax = plt.subplots(figsize=(7, 5), dpi=DPI)
    E = data["irreducible"]
    for i, f in enumerate(data["fits"]):
        color = f"C{i}"
        c = np.asarray([p["compute"] for p in f["observed"]], dtype=float)
        l = np.asarray([p["loss"] for p in f["observed"]], dtype=float)
        ax.scatter(c, l, color=color, s=30)
        xs = np.geomspace(c.min() / 1.5, c.max() * 1.5, 100)
        ax.plot(xs, f["A"] * xs ** (-f["beta"]) + E, color=color,
                label=f"{f['method']}: β={f['beta']:.3f}, speedup {f['speedup']:.2f}×")
    ax.set_xscale("log")
    ax.set_xlabel("training compute (FLOPs)")
    ax.set_ylabel("loss")
    ax.set_title(data.get("title", f"scaling fits, E = {E}"))
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def streams(data):
    """MSAR's streams at each read: key RMS before normalisation, H_pre gate, share of the fused input."""
    panels = [("key_rms", "key RMS before normalisation", True), ("gates", "H_pre gate", False),
              ("shares", "share of the fused input", False)]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4), dpi=DPI)
    reads = data["reads"]
    for ax, (key, label, log) in zip(axes, panels):
        values = np.asarray(data[key], dtype=float)  # [read, stream]
        for r in range(values.shape[1]):
            ax.plot(reads, values[:, r], marker="o", label=f"stream {r}")
        if log:
            ax.set_yscale("log")
            ax.axhline(math.sqrt(data["key_norm_eps"]), color="grey", linestyle="--", linewidth=0.8, label="√ε")
        ax.set_xlabel("read ℓ (branch)")
        ax.set_title(label)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(data.get("title", "MSAR streams"))
    fig.tight_layout()
    return fig


FIGURES = {f.__name__: f for f in (curves, maps, streams, cka, rescue, gates, scaling)}


def render(figure, data_path, png_path):
    with open(data_path) as fh:
        data = json.load(fh)
    fig = FIGURES[figure](data)
    tmp = f"{png_path}.tmp-{os.getpid()}.png"
    try:
        fig.savefig(tmp, dpi=DPI)
        os.replace(tmp, png_path)  # never a half-written PNG
    finally:
        plt.close(fig)
        if os.path.exists(tmp):
            os.remove(tmp)
