#!/usr/bin/env bash
# oscar_ppl on a CUDA machine, two ways over the same windows: token by token through OscarCache (INT2 decode steps
# run the fused quantize_pack/decode_int2 kernels) and teacher-forced through the decode-equivalent attention.
# The two must agree to within bf16 noise, and with the CPU reference numbers of the same command.
#
#   benchmarks/eval_gpu.sh MODEL ARTIFACT_DIR STORE OUT_DIR
#
# Runs without the console script (the GPU image has no entry points installed for this checkout).
set -euo pipefail
MODEL=$1 ART=$2 STORE=$3 OUT_DIR=$4
mkdir -p "$OUT_DIR"
oscar() { python3 -c 'import sys; from oscar_cli.cli import main; sys.argv[0] = "oscar"; main()' "$@"; }
common=(--model "$MODEL" --store "$STORE" --tasks oscar_ppl --seq-lengths 512 --limit 2 --sink 16 --recent 64 --json)
methods="bf16,int2-hadamard,oscar@$ART"
if ! python3 -c 'import sys; from pathlib import Path; from oscar_cli.models import load_model
from oscar_cli.artifact import load_artifact
load_artifact(Path(sys.argv[2]), load_model(sys.argv[1], Path(sys.argv[3])).fingerprint)' "$MODEL" "$ART" "$STORE"; then
  echo "carried artifact unusable here; fitting one on this machine" >&2
  oscar collect --model "$MODEL" --store "$STORE" --tokens 16384 --seq-len 512 --batch-size 8 --device cuda
  oscar fit --store "$STORE" --artifacts "$OUT_DIR/artifacts" --method oscar --per-head --sink 16 --recent 64
  methods="bf16,int2-hadamard,oscar@latest"
fi
for mode in decode teacher-forced; do
  start=$(date +%s.%N)
  oscar eval "${common[@]}" --methods "$methods" "--$mode" > "$OUT_DIR/ppl_$mode.json"
  echo "$mode: $(python3 -c "import sys; print(round(float(sys.argv[2]) - float(sys.argv[1]), 1))" "$start" "$(date +%s.%N)") s"
done
python3 - "$OUT_DIR" <<'PY'
import json, sys
d = {m: {r["method"]: r["value"] for r in json.load(open(f"{sys.argv[1]}/ppl_{m}.json"))} for m in ("decode", "teacher-forced")}
print(f"{'method':<40} {'decode (kernels)':>17} {'teacher-forced':>15}")
for k in d["decode"]:
    print(f"{k:<40} {d['decode'][k]:>17.4f} {d['teacher-forced'][k]:>15.4f}")
PY
