"""Reading a run's records for jagg_patch.tools.compare, tradeoff and quality_report: this trainer's
metrics.jsonl, jagg_patch.upstream's jagg_metrics.jsonl (its last run), a plain upstream run's reward
file(s), and the JSON the tools write; bad input is a CompareError (one line, exit 2)."""
import json
import os

from dancegrpo.errors import ConfigError, say


def warn(message):
    say(f"warning: {message}")


class CompareError(ConfigError):
    """Bad input; the message says what is wrong (one line, exit 2)."""


METRICS_FILES = ("metrics.jsonl", "jagg_metrics.jsonl")   # this trainer's | jagg_patch.upstream's
REWARD_FILES = ("reward.txt", "hps_reward.txt")          # a plain upstream run's
VIDEO_REWARD_FILES = ("vq_reward.txt", "mq_reward.txt")   # a plain upstream HunyuanVideo run's


def load_metrics(run_dir, warn=warn):
    """The run's records, one per step in step order (the last record of a step wins): from a
    metrics file, or a reward file (rewards only)."""
    if os.path.isfile(run_dir) and os.path.basename(run_dir) in VIDEO_REWARD_FILES:
        return load_video_reward_files(os.path.dirname(run_dir) or ".", warn)
    if os.path.isfile(run_dir) and os.path.basename(run_dir).endswith("reward.txt"):
        return load_reward_file(run_dir)
    if not os.path.isdir(run_dir):
        raise CompareError(f"run folder {run_dir!r} does not exist")
    found = [os.path.join(run_dir, name) for name in METRICS_FILES + REWARD_FILES + VIDEO_REWARD_FILES
             if os.path.isfile(os.path.join(run_dir, name))]
    if not found:
        raise CompareError(f"{run_dir!r} holds none of metrics.jsonl (this trainer's --output_dir), "
                           "jagg_metrics.jsonl (jagg_patch.upstream's) or reward.txt (a plain upstream run's)")
    if os.path.basename(found[0]) in VIDEO_REWARD_FILES:
        return load_video_reward_files(run_dir, warn)
    if found[0].endswith("reward.txt"):
        return load_reward_file(found[0])
    records = read_json_lines(found[0], warn)
    if os.path.basename(found[0]) == "jagg_metrics.jsonl":
        records = last_run(records, found[0], warn)
    elif len({(r["step"], r.get("run_id")) for r in records}) > len({r["step"] for r in records}):
        # A resumed run's segments (each its own run id) never share a step: the file is cut back to the
        # checkpoint on resume. A step logged under two run ids is two runs' lines in one file.
        warn(f"{found[0]} holds steps logged by different runs (run ids "
             f"{list(dict.fromkeys(r.get('run_id') for r in records))}): each step is read from its last record, "
             "which may mix the runs")
    by_step = {record["step"]: record for record in records}
    return [by_step[s] for s in sorted(by_step)]


def last_run(records, path, warn=warn):
    """The records of the last run (run_id) written to an adapter's jagg_metrics.jsonl; the file keeps
    every run started in that --output_dir."""
    runs = list(dict.fromkeys(r.get("run_id") for r in records))
    if len(runs) > 1:
        warn(f"{path} holds {len(runs)} runs; comparing the last one (run_id {runs[-1]})")
    return [r for r in records if r.get("run_id") == runs[-1]]


def load_reward_file(path):
    """A plain upstream run's reward file: line k is step k's mean reward (upstream appends to it, so a
    file of several runs reads as one long run)."""
    rewards = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rewards.append(float(line))
            except ValueError:
                raise CompareError(f"{path}:{lineno}: not a reward (upstream writes one number per line)") from None
    if not rewards:
        raise CompareError(f"{path!r} holds no rewards (did the run finish its first step?)")
    return [{"step": k, "reward_mean": r} for k, r in enumerate(rewards, 1)]


def load_video_reward_files(folder, warn=warn):
    """A plain upstream HunyuanVideo run's vq_reward.txt and mq_reward.txt (line k: step k's mean
    VideoAlign reward): vq_reward_mean, mq_reward_mean, and as reward_mean the VQ reward, which
    upstream's recipe trains on (--vq_coef 1 --mq_coef 0; the file does not say the run's weights)."""
    rewards = {}
    for name in VIDEO_REWARD_FILES:
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            rewards[name.split("_")[0]] = [r["reward_mean"] for r in load_reward_file(path)]
    if len({len(r) for r in rewards.values()}) > 1:
        warn(f"{folder}: vq_reward.txt and mq_reward.txt hold {len(rewards['vq'])} and {len(rewards['mq'])} steps; "
             "reading the steps both hold")
    steps = min(len(r) for r in rewards.values())
    main = "vq" if "vq" in rewards else "mq"
    why = "the one upstream's recipe trains on: --vq_coef 1 --mq_coef 0" if main == "vq" else "no vq_reward.txt"
    warn(f"{folder}: a HunyuanVideo run's reward files; its reward here is the {main.upper()} reward ({why}); "
         "both are kept as vq_reward_mean / mq_reward_mean")
    return [{"step": k + 1, "reward_mean": rewards[main][k], **{f"{name}_reward_mean": r[k] for name, r in rewards.items()}}
            for k in range(steps)]


def read_json(path, rerun):
    """The JSON at `path`; an empty, cut-off or unreadable file is one line naming how to remake it."""
    try:
        with open(path) as f:
            return json.load(f)
    except ValueError as e:
        raise CompareError(f"{path!r} is not valid JSON ({e.msg} at line {e.lineno}; empty or cut off?): {rerun}") from None
    except OSError as e:
        raise CompareError(f"cannot read {path!r}: {e.strerror}") from None


def read_json_lines(path, warn=warn):
    """The records of a metrics file, in file order; a torn last line is warned about and left out."""
    records = []
    with open(path) as f:
        lines = f.read().split("\n")
    torn = len(lines) - 1 if lines[-1].strip() else -1  # a last line without its newline: cut off mid-write
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            if lineno - 1 == torn:
                warn(f"{path}:{lineno}: torn last line (the run was stopped while writing it); read as missing")
                continue
            raise CompareError(f"{path}:{lineno}: not a JSON line ({e.msg})") from None
        if not isinstance(record, dict) or "step" not in record:
            raise CompareError(f"{path}:{lineno}: a metrics record needs a 'step' field")
        records.append(record)
    if not records:
        raise CompareError(f"{path!r} holds no steps (did the run finish its first step?)")
    return records
