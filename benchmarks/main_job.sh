#!/usr/bin/env bash
# The main job timed cold and warm on a GPU:
#   benchmarks/main_job.sh OUT BUDGET_S CASE [CASE ...]      CASE = B,L,dtype (e.g. 8,512,bf16)
# For each case: `optimize-layer configs/bert.py` into OUT/<case> with the tuning database OUT/tuning.db
# (cold unless OUT/tuning.db exists), then once more (warm: everything read back from the database),
# timing both.  Every job's output is kept in OUT/<case>-{cold,warm}.log; OUT/times.txt lists the wall
# times.  The artifacts then go to the end-to-end benchmark: benchmarks/layer.py --artifact OUT/bert-*
set -uo pipefail
out=$1; budget=$2; shift 2
mkdir -p "$out"
for case in "$@"; do
  IFS=, read -r b l dtype <<<"$case"
  dir="$out/bert-B$b-L$l-$dtype"
  for run in cold warm; do
    start=$(date +%s%N)
    python3 -m datamove.cli configs/bert.py --dims "B=$b,L=$l" --dtype "$dtype" --budget-s "$budget" \
      --db "$out/tuning.db" --out "$dir" >"$out/$(basename "$dir")-$run.log" 2>&1
    rc=$?
    end=$(date +%s%N)
    printf '%s %s rc=%s wall_s=%d.%d\n' "$(basename "$dir")" "$run" "$rc" $(((end - start) / 1000000000)) \
      $(((end - start) / 100000000 % 10)) | tee -a "$out/times.txt"
    tail -n 8 "$out/$(basename "$dir")-$run.log"
  done
done
