"""Reward curves, shared by the trainer (its own run, at the end) and jagg_patch.tools.compare (several
runs side by side)."""
import os

from .atomic import write_atomically


def moving_average(values, window):
    """Trailing mean; position i averages values[max(0, i - window + 1) : i + 1]."""
    window = max(1, int(window))
    out = []
    for i in range(len(values)):
        chunk = values[max(0, i - window + 1):i + 1]
        out.append(sum(chunk) / len(chunk))
    return out


def plot_reward_curves(path, curves):
    """curves: {legend label: {"steps": [...], "reward": [...], "ma": [...]}} -> PNG at `path`:
    each reward per step faint, its moving average bold."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    for i, (label, c) in enumerate(curves.items()):
        color = f"C{i}"
        ax.plot(c["steps"], c["reward"], color=color, alpha=0.3, linewidth=1)
        ax.plot(c["steps"], c["ma"], color=color, linewidth=2, label=label)
    ax.set_xlabel("training step")
    ax.set_ylabel("mean reward")
    ax.set_title("Reward per step (faint) and moving average (bold)")
    ax.legend()
    ax.grid(alpha=0.3)
    return save_figure(fig, path)


def plot_mean_spread(path, panels, title=None):
    """panels: [(panel title, y label, {legend label: {"steps", "mean", "low", "high"}})] -> one PNG,
    panels side by side: each curve's mean as a line over a shaded low..high band (the spread over seeds)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4), squeeze=False)
    for ax, (panel_title, ylabel, curves) in zip(axes[0], panels):
        for i, (label, c) in enumerate(curves.items()):
            ax.fill_between(c["steps"], c["low"], c["high"], color=f"C{i}", alpha=0.18, linewidth=0)
            ax.plot(c["steps"], c["mean"], color=f"C{i}", linewidth=2, marker="o" if len(c["steps"]) < 15 else None,
                    markersize=3, label=label)
        ax.set_title(panel_title, fontsize=10)
        ax.set_xlabel("training step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    axes[0][0].legend()
    return save_figure(fig, path, title)


def save_figure(fig, path, title=None):
    """Title, tight layout, the PNG at `path` (its folder made), the figure closed; returns path."""
    import matplotlib.pyplot as plt
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    try:
        write_atomically(path, lambda tmp: fig.savefig(tmp, dpi=100))   # a full disk leaves no half PNG
    finally:
        plt.close(fig)
    return path
