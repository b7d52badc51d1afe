"""The report of an evaluation: one row per checkpoint (mean +- standard error of each metric, or
NON-FINITE), table.md and comparison.json, merged with an earlier evaluation of the same metrics
in the same folder."""
import json
import os
import sys

from .errors import ConfigError
from .utils.atomic import write_text


def table_header(metric_names):
    head = "| checkpoint | images | " + " | ".join(f"{n} (mean ± s.e.)" for n in metric_names) + " |"
    return head + "\n|" + "---|" * (len(metric_names) + 2)


def nonfinite_summary(label, path, names, reason):
    """The row of a checkpoint that cannot be scored: flagged, with no metric to rank."""
    return {"label": label, "checkpoint": os.path.abspath(path), "num_images": 0, "nonfinite": reason,
            "metrics": {n: {"mean": None, "std": None, "sem": None} for n in names}}


def table_row(summary):
    if summary.get("nonfinite"):
        return (f"| {summary['label']} (NON-FINITE) | 0 | "
                + " | ".join("n/a" for _ in summary["metrics"]) + " |")
    cells = [f"{m['mean']:.4f} ± {m['sem']:.4f}" for m in summary["metrics"].values()]
    return f"| {summary['label']} | {summary['num_images']} | " + " | ".join(cells) + " |"


def earlier_summaries(output_dir, names):
    """The rows an earlier evaluation wrote to output_dir/comparison.json (none: []); refused when they
    score other metrics, whose columns the table could not hold."""
    path = os.path.join(output_dir, "comparison.json")
    if not os.path.isfile(path):
        return []
    try:
        with open(path) as f:
            earlier = json.load(f)
        theirs = list(earlier[0]["metrics"]) if earlier else names
    except (OSError, ValueError, KeyError, IndexError, TypeError) as e:
        raise ConfigError(f"{path!r} cannot be read ({e}); it is an earlier evaluation's: move it away or choose "
                          "another --output_dir") from None
    if theirs != names:
        raise ConfigError(f"--output_dir {output_dir!r} holds an evaluation of the metrics {theirs}, this one scores "
                          f"{names}: the table would mix columns; choose another --output_dir")
    return earlier


def merged_summaries(earlier, summaries):
    """The earlier rows, a label evaluated again replaced by its new row (said once), then the new ones."""
    labels = {s["label"] for s in summaries}
    replaced = [s["label"] for s in earlier if s["label"] in labels]
    if replaced:
        print(f"notice: {', '.join(replaced)} evaluated again: the earlier row is replaced", file=sys.stderr,
              flush=True)
    return [s for s in earlier if s["label"] not in labels] + summaries


def write_comparison(output_dir, names, summaries):
    write_text(os.path.join(output_dir, "table.md"),
               table_header(names) + "\n" + "\n".join(table_row(s) for s in summaries) + "\n")
    write_text(os.path.join(output_dir, "comparison.json"), json.dumps(summaries, indent=1))
