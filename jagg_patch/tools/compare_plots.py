"""The pictures of jagg_patch.tools.compare: reward curves, the step time split into rollout and
update, and cos(JAGG, exact) per group position over the steps of monitored runs."""
import math
import os

from dancegrpo.utils.plots import plot_reward_curves


def fidelity_curves(records):
    """{position: {"steps": [...], "cos": [...]}} of the monitor's jagg_cos/gP (--jagg_monitor_every)."""
    found = {}
    for r in records:
        for name, value in r.items():
            if name.startswith("jagg_cos/g") and isinstance(value, (int, float)):
                curve = found.setdefault(int(name[len("jagg_cos/g"):]), {"steps": [], "cos": []})
                curve["steps"].append(r["step"])
                curve["cos"].append(value)
    return dict(sorted(found.items()))


def plot_fidelity(path, curves):
    """cos(JAGG, exact) per group position over the steps, one line per (run, position)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    styles = ["-", "--", ":", "-."]
    for i, (label, c) in enumerate((k, v) for k, v in curves.items() if "jagg_cos" in v):
        for position, curve in c["jagg_cos"].items():
            ax.plot(curve["steps"], curve["cos"], styles[i % len(styles)], color=f"C{position}", marker="o",
                    markersize=3, label=f"{label} g{position}")
    ax.set_xlabel("training step")
    ax.set_ylabel("cos(JAGG, exact)")
    ax.set_title("Monitored fidelity per group position (g0: highest noise)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write_plots(out_dir, rows, curves):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    labelled = {f"{label} (MA {rows[i]['ma_window']})": c for i, (label, c) in enumerate(curves.items())}
    paths = [plot_reward_curves(os.path.join(out_dir, "reward_curves.png"), labelled)]

    fig, ax = plt.subplots(figsize=(1.6 * len(rows) + 3, 4))
    labels = [r["label"] for r in rows]
    rollout = [0.0 if math.isnan(r["rollout_time_s"]) else r["rollout_time_s"] for r in rows]
    update = [0.0 if math.isnan(r["update_time_s"]) else r["update_time_s"] for r in rows]
    ax.bar(labels, rollout, label="rollout", color="C7")
    ax.bar(labels, update, bottom=rollout, label="update", color="C0")
    for i, r in enumerate(rows):
        total = r["step_time_s"]
        if not math.isnan(total):
            note = "" if i == 0 else f"\n{100 * r['step_speedup']:+.1f}%"
            ax.text(i, max(total, rollout[i] + update[i]), f"{total:.2f} s{note}", ha="center", va="bottom")
    ax.set_ylabel("median seconds per training step")
    ax.set_title("Step time: rollout + policy update")
    ax.legend()
    ax.margins(y=0.2)
    fig.tight_layout()
    paths.append(os.path.join(out_dir, "step_times.png"))
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)
    if any("jagg_cos" in c for c in curves.values()):
        paths.append(plot_fidelity(os.path.join(out_dir, "jagg_cos.png"), curves))
    return paths
