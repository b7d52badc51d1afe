"""The report of an evaluation: one row per checkpoint (mean +- standard error of each metric, or
NON-FINITE), table.md and comparison.json, merged with an earlier evaluation of the same metrics
and the same sampling settings in the same folder."""
import hashlib
import json
import os

from .errors import ConfigError, say
from .utils.atomic import write_text


# What makes two rows comparable: a row whose images were drawn otherwise differs by its settings alone.
SETTING_NAMES = ("family", "sampler", "eta", "sampling_steps", "shift", "guidance", "h", "w", "precision", "seed",
                 "num_images_per_prompt", "prompts")


def eval_settings(args, captions, precision):
    """The sampling settings of this evaluation, as its rows record them; `captions` are the prompts
    evaluated, in order (kept as their count and a digest)."""
    digest = hashlib.sha256("\n".join(captions).encode("utf-8")).hexdigest()[:12]
    return {"family": args.family, "sampler": "sde" if args.sde else "ode", "eta": args.eta if args.sde else None,
            "sampling_steps": args.sampling_steps, "shift": args.shift, "guidance": args.guidance, "h": args.h,
            "w": args.w, "precision": precision, "seed": args.seed,
            "num_images_per_prompt": args.num_images_per_prompt, "prompts": f"{len(captions)} (sha256 {digest})"}


def row_settings(row):
    """The sampling settings a row of comparison.json was made with (None: a row of an earlier version,
    which recorded no prompt set)."""
    return {k: row.get(k) for k in SETTING_NAMES} if "prompts" in row else None


def differing_settings(theirs, ours):
    """'name: theirs -> ours' for each setting that differs."""
    return [f"{k} {theirs.get(k)!r} -> {ours[k]!r}" for k in SETTING_NAMES if theirs.get(k) != ours[k]]


def table_header(metric_names):
    head = "| checkpoint | images | " + " | ".join(f"{n} (mean ± s.e.)" for n in metric_names) + " |"
    return head + "\n|" + "---|" * (len(metric_names) + 2)


def nonfinite_summary(label, path, names, reason, settings):
    """The row of a checkpoint that cannot be scored: flagged, with no metric to rank."""
    return {"label": label, "checkpoint": os.path.abspath(path), "num_images": 0, "nonfinite": reason,
            "metrics": {n: {"mean": None, "std": None, "sem": None} for n in names}, **settings}


def table_row(summary):
    if summary.get("nonfinite"):
        return (f"| {summary['label']} (NON-FINITE) | 0 | "
                + " | ".join("n/a" for _ in summary["metrics"]) + " |")
    cells = [f"{m['mean']:.4f} ± {m['sem']:.4f}" for m in summary["metrics"].values()]
    return f"| {summary['label']} | {summary['num_images']} | " + " | ".join(cells) + " |"


def earlier_summaries(output_dir, names, settings):
    """The rows an earlier evaluation wrote to output_dir/comparison.json (none: []); refused when they
    score other metrics, whose columns the table could not hold, or were sampled with other settings
    (the rows would differ by the settings alone)."""
    path = os.path.join(output_dir, "comparison.json")
    if not os.path.isfile(path):
        return []
    try:
        with open(path) as f:
            earlier = json.load(f)
        theirs = list(earlier[0]["metrics"]) if earlier else names
        their_settings = [row_settings(row) for row in earlier]
    except (OSError, ValueError, KeyError, IndexError, TypeError) as e:
        raise ConfigError(f"{path!r} cannot be read ({e}); it is an earlier evaluation's: move it away or choose "
                          "another --output_dir") from None
    if theirs != names:
        raise ConfigError(f"--output_dir {output_dir!r} holds an evaluation of the metrics {theirs}, this one scores "
                          f"{names}: the table would mix columns; choose another --output_dir")
    for row, theirs in zip(earlier, their_settings):
        if theirs is None:
            raise ConfigError(f"--output_dir {output_dir!r} holds a row ({row.get('label')}) that records no sampling "
                              "settings (an earlier version's): its images may have been drawn otherwise; choose "
                              "another --output_dir")
        differ = differing_settings(theirs, settings)
        if differ:
            raise ConfigError(f"--output_dir {output_dir!r} holds rows sampled with other settings ("
                              f"{', '.join(differ)}): one table would compare settings, not checkpoints; choose "
                              "another --output_dir or evaluate with the same settings")
    return earlier


def merged_summaries(earlier, summaries):
    """The earlier rows, a label evaluated again replaced by its new row (said once), then the new ones."""
    labels = {s["label"] for s in summaries}
    replaced = [s["label"] for s in earlier if s["label"] in labels]
    if replaced:
        say(f"notice: {', '.join(replaced)} evaluated again: the earlier row is replaced")
    return [s for s in earlier if s["label"] not in labels] + summaries


def settings_line(settings):
    """The line under the table that says how every row's images were drawn."""
    return "Every row: " + ", ".join(f"{k} {settings[k]}" for k in SETTING_NAMES if settings[k] is not None)


def write_comparison(output_dir, names, summaries):
    write_text(os.path.join(output_dir, "table.md"),
               table_header(names) + "\n" + "\n".join(table_row(s) for s in summaries) + "\n\n"
               + settings_line(row_settings(summaries[-1])) + "\n")
    write_text(os.path.join(output_dir, "comparison.json"), json.dumps(summaries, indent=1))
