#!/usr/bin/env bash
# Speed at the recipe users run: every JAGG configuration of the speed tables timed against vanilla
# with and without --gradient_checkpointing (upstream's scripts pass it), side by side in ONE process
# per configuration (jagg_patch.tools.bench_update: vanilla, the split and the batched backward, both
# with the rollout's outputs; medians of BENCH_REPS interleaved repetitions), per world and family.
#
#   bash benchmarks/recipe_speed.sh                                  # every world below, both families
#   WORLDS=digits_large MODELS=flux CONFIGS="4:1.0 8:1.0" bash benchmarks/recipe_speed.sh
#
# Settings (besides benchmarks/common.sh): WORLDS ("small digits digits_large"), CONFIGS per world
# (W:jagg_frac; "all" is one group per sample, W = the trained transitions), BENCH_REPS (3), JOBS (2
# benches at once, one thread each). The digits world is timed at S 16 with every transition trained
# (docs/jagg.md's geometry), small and digits_large at their presets' (S 16 / 20, fraction 0.6).
# Outputs: $OUT/recipe_speed/<world>/<model>/<W>_<frac>_<ckpt|plain>.{json,md} and $OUT/recipe_speed/recipe_speed.md.
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"   # CPU benches: one thread each, JOBS at once
WORLDS="${WORLDS:-small digits digits_large}"
BENCH_REPS="${BENCH_REPS:-3}"
JOBS="${JOBS:-2}"
DEST="$OUT/recipe_speed"
mkdir -p "$DEST"

configs_of() {  # world -> "W:frac ..." (CONFIGS overrides)
  [[ -n "${CONFIGS:-}" ]] && { echo "$CONFIGS"; return; }
  case "$1" in
    small) echo "4:0.6" ;;
    digits) echo "4:0.6 4:1.0 8:1.0 all:1.0" ;;
    *) echo "4:0.6 4:1.0 8:1.0 all:1.0" ;;
  esac
}
geometry_of() {  # world model -> trainer flags
  [[ "$1" == digits ]] && { echo "--sampling_steps 16 --timestep_fraction 1.0"; return; }
  [[ "$1" == small ]] && { echo "--sampling_steps $(sampling_steps "$2") --timestep_fraction 0.6"; return; }
  echo ""
}
trained_of() {  # world model -> trained transitions per sample
  local s f
  case "$1" in
    digits) s=16; f=1.0 ;;
    *) s=$(sampling_steps "$2"); f=0.6 ;;
  esac
  "$PY" -c "import sys; print(int((int(sys.argv[1]) - 1) * float(sys.argv[2])))" "$s" "$f"
}
module_of() { [[ "$1" == flux ]] && echo dancegrpo.train_grpo_flux || echo dancegrpo.train_grpo_qwenimage; }

running=()
bench() {  # world model W frac ckpt
  local world="$1" model="$2" window="$3" frac="$4" ckpt="$5" dir="$DEST/$1/$2"
  local name="${3}_${4}_${5}" flags=()
  [[ "$ckpt" == ckpt ]] && flags=(--gradient_checkpointing)
  read -r -a geom <<< "$(geometry_of "$world" "$model")"
  mkdir -p "$dir"
  echo "== $world / $model / W $window, jagg_frac $frac, $ckpt" >&2
  "$PY" -m jagg_patch.tools.bench_update "$(module_of "$model")" --preset "$world" --cache_dir "$CACHE_DIR" \
    --output_dir "$dir/run_$name" "${geom[@]}" "${SIZE[@]}" "${flags[@]}" --jagg_window "$window" --jagg_frac "$frac" \
    --bench_modes vanilla,jagg_split_reuse,jagg_batched_reuse --bench_reps "$BENCH_REPS" \
    --bench_json "$dir/$name.json" --bench_md "$dir/$name.md" > "$dir/$name.log" 2>&1 \
    || { echo "error: bench failed; see $dir/$name.log" >&2; tail -20 "$dir/$name.log" >&2; exit 1; }
}
launch() {
  bench "$@" &
  running+=($!)
  if (( ${#running[@]} >= JOBS )); then wait "${running[0]}" || exit 1; running=("${running[@]:1}"); fi
}

t0=$SECONDS
for world in $WORLDS; do
  for model in $MODELS; do
    for config in $(configs_of "$world"); do
      window="${config%%:*}" frac="${config##*:}"
      [[ "$window" == all ]] && window="$(trained_of "$world" "$model")"
      for ckpt in plain ckpt; do launch "$world" "$model" "$window" "$frac" "$ckpt"; done
    done
  done
done
for pid in "${running[@]}"; do wait "$pid" || exit 1; done

"$PY" - "$DEST" "$(machine_line)" "$((SECONDS - t0))" > "$DEST/recipe_speed.md" <<'PY'
import glob, json, os, sys
dest, machine, seconds = sys.argv[1:4]
print(f"# Speed with and without gradient checkpointing\n\n{machine} | {seconds} s\n")
print("Whole step (rollout + update) and update time as a fraction of vanilla's, measured side by side in one "
      "process per row (medians); B = one backward in units of a forward with grad.\n")
print("| world | model | W | jagg_frac | backward | step / vanilla | with checkpointing | update / vanilla | with "
      "checkpointing | B / F | with checkpointing | measured / predicted update gain, with checkpointing |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|")
rows = {}
for path in sorted(glob.glob(os.path.join(dest, "*", "*", "*.json"))):
    world, model = path.split(os.sep)[-3:-1]
    window, frac, ckpt = os.path.basename(path)[:-5].split("_")
    rows.setdefault((world, model, int(window), float(frac)), {})[ckpt] = json.load(open(path))
for (world, model, window, frac), runs in sorted(rows.items()):
    if set(runs) != {"plain", "ckpt"}:
        continue
    for mode, label in (("jagg_split_reuse", "split"), ("jagg_batched_reuse", "batched")):
        cells = []
        for key in ("step", "update"):
            for ckpt in ("plain", "ckpt"):
                r = runs[ckpt]
                m, v = r["modes"][mode], r["modes"]["vanilla"]
                cells.append(f"{m[key + '_s'] / v[key + '_s']:.2f}")
        for ckpt in ("plain", "ckpt"):
            u = runs[ckpt]["unit_costs_s"]
            cells.append(f"{u['backward'] / u['f_grad']:.2f}")
        c = runs["ckpt"]
        check = (f"{100 * c['measured_vs_predicted']:.0f}%" if label == "split" and "measured_vs_predicted" in c else "-")
        print(f"| {world} | {model} | {window} | {frac:g} | {label} | " + " | ".join(cells) + f" | {check} |")
PY
echo "wrote $DEST/recipe_speed.md" >&2
cat "$DEST/recipe_speed.md"
