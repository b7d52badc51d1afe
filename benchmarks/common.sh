# Shared settings of the benchmark scripts (sourced). Every value is an environment variable.
#
#   PRESET=small   CPU: the embedded ~20M-parameter models (no weights needed); empty = real weights
#                  through train_flux.sh / train_qwenimage.sh (MODEL_PATH, DATA_JSON, NPROC, ... as there)
#   MODELS         "flux qwenimage" (default) or one of them
#   VARIANTS       "vanilla jagg endpoints" (default): vanilla DanceGRPO, JAGG, the paper's ablation;
#                  also: control (vanilla with --shuffle_advantages), exact, jagg_split (JAGG with the
#                  split backward), jagg_window (JAGG over trajectory windows, the authors' grouping,
#                  otherwise the paper's text), authors (the authors' code:
#                  window grouping, index alpha, split backward, jagg_frac 1)
#   JAGG_WINDOW    4, JAGG_FRAC 0.6 (as configured for training; see REPRODUCE.md for the choice)
#   S_FLUX=16 S_QWEN=20 TIMESTEP_FRACTION=0.6   upstream's geometry (9 / 11 trained transitions)
#   SIZE_ARGS      extra trainer flags for every run, e.g. to shrink a smoke test
#   OUT            output root (default runs/bench)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PRESET="${PRESET:-}"
MODELS="${MODELS:-flux qwenimage}"
VARIANTS="${VARIANTS:-vanilla jagg endpoints}"
export JAGG_WINDOW="${JAGG_WINDOW:-4}" JAGG_FRAC="${JAGG_FRAC:-0.6}"
S_FLUX="${S_FLUX:-16}"
S_QWEN="${S_QWEN:-20}"
TIMESTEP_FRACTION="${TIMESTEP_FRACTION:-0.6}"
read -r -a SIZE <<< "${SIZE_ARGS:-}"
OUT="${OUT:-runs/bench}"
PY="${PYTHON:-python3}"
export CACHE_DIR="${CACHE_DIR:-$([[ -n "$PRESET" ]] && echo ./cache_dir || echo data/.cache)}"
if [[ -n "$PRESET" ]]; then
  # A shared 2-core CPU: one thread per process keeps timings stable (two threads on a loaded
  # machine were 3-6x slower and erratic). Set OMP_NUM_THREADS to override.
  export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
fi

train_script() {  # model -> launcher script
  case "$1" in
    flux) echo "$ROOT/train_flux.sh" ;;
    qwenimage) echo "$ROOT/train_qwenimage.sh" ;;
    *) echo "error: unknown model '$1' (MODELS takes flux and/or qwenimage)" >&2; exit 2 ;;
  esac
}

sampling_steps() { [[ "$1" == flux ]] && echo "$S_FLUX" || echo "$S_QWEN"; }

# run_variant MODEL VARIANT OUTPUT_DIR [trainer flags...]: one training run through the train script,
# with upstream's S / timestep_fraction unless PASS_GEOMETRY=0 (then the preset's or recipe's own).
run_variant() {
  local model="$1" variant="$2" dir="$3"; shift 3
  local jagg=1 mode="$variant" grouping=trained alpha=timestep backward=auto frac="$JAGG_FRAC" reuse=on_policy extra=()
  case "$variant" in
    vanilla) jagg=0; mode=jagg ;;
    control) jagg=0; mode=jagg; extra=(--shuffle_advantages) ;;   # vanilla with permuted advantages
    jagg|endpoints|exact) ;;
    jagg_split) mode=jagg; backward=split ;;
    jagg_window) mode=jagg; grouping=window ;;
    authors) mode=jagg; grouping=window; alpha=index; backward=split; frac=1.0; reuse=off ;;
    jagg_frac1) mode=jagg; frac=1.0 ;;                                  # every group through JAGG
    jagg_auto) mode=jagg; frac=auto ;;                                  # routed by the monitor's cosines
    jagg_w8) mode=jagg; frac=1.0; extra=(--jagg_window 8) ;;
    jagg_w8_auto) mode=jagg; frac=auto; extra=(--jagg_window 8) ;;
    # one group per sample: a window longer than any sample's trained transitions (W 9 Flux, 11 Qwen-Image)
    jagg_whole) mode=jagg; frac=1.0; extra=(--jagg_window "${WHOLE_WINDOW:-64}") ;;
    # auto with a second threshold, STRICT_MIN_COS (0.99): a position needs a higher cosine to join JAGG
    jagg_auto_strict) mode=jagg; frac=auto; extra=(--jagg_min_cos "${STRICT_MIN_COS:-0.99}") ;;
    jagg_w8_auto_strict) mode=jagg; frac=auto; extra=(--jagg_window 8 --jagg_min_cos "${STRICT_MIN_COS:-0.99}") ;;
    *) echo "error: unknown variant '$variant' (VARIANTS takes vanilla, control, jagg, endpoints, exact," \
            "jagg_split, jagg_window, authors, jagg_frac1, jagg_auto, jagg_w8, jagg_w8_auto, jagg_whole," \
            "jagg_auto_strict, jagg_w8_auto_strict)" >&2; exit 2 ;;
  esac
  [[ "$frac" != auto ]] || extra+=(--jagg_monitor_every "${MONITOR_EVERY:-10}")
  rm -rf "$dir"
  mkdir -p "$(dirname "$dir")"
  echo "== $model / $variant -> $dir" >&2
  local geom=()
  [[ "${PASS_GEOMETRY:-1}" == 1 ]] && geom=(--sampling_steps "$(sampling_steps "$model")" --timestep_fraction "$TIMESTEP_FRACTION")
  JAGG="$jagg" JAGG_MODE="$mode" JAGG_GROUPING="$grouping" JAGG_ALPHA="$alpha" JAGG_BACKWARD="$backward" \
    JAGG_REUSE_ROLLOUT="$reuse" JAGG_FRAC="$frac" OUTPUT_DIR="$dir" bash "$(train_script "$model")" "${geom[@]}" "${SIZE[@]}" "${extra[@]}" "$@" \
    > "$dir.log" 2>&1 || { echo "error: $model / $variant failed; last lines of $dir.log:" >&2; tail -20 "$dir.log" >&2; exit 1; }
}

machine_line() {
  "$PY" - <<'PY'
import os, platform, torch
gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
print(f"machine: {platform.node()} | {os.cpu_count()} CPU cores | "
      f"{gpu + ' x' + str(torch.cuda.device_count()) if gpu else 'no GPU'} | torch {torch.__version__} | "
      f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}")
PY
}
