#!/usr/bin/env bash
# The GPU measurements that need no serving engine, in one command on a CUDA machine with a plain checkout:
#
#   benchmarks/gpu_suite.sh [STEP ...]        (default: every step; each appends to benchmarks/RESULTS.md)
#
#   tests      the kernel tests at their GPU sizes (tests/kernels, tests/test_cache_kernels.py)
#   writes     bench_quantize_pack.py --decode     (a decode step's K/V writes)
#   decode     bench_decode.py                     (DecodePlan vs cuDNN / flash BF16)
#   variants   bench_decode.py --variants          (a decode step per layer under each DecodePlan variant)
#   variants:SET  bench_decode.py --variants --set SET  (one named variant set, e.g. variants:lean)
#   lean       the split kernel's lean_tiles / movmatrix / fused_update: their GPU tests, then variants:lean
#   extend     bench_extend.py --sweep             (chunked prefill vs SDPA BF16)
#   cache      bench_cache.py                      (OscarCache vs DynamicCache; --random-weights without weights)
#   calib      bench_calibration.py                (collect + fit at Qwen3-8B shapes; needs duckdb)
#   ppl        eval_gpu.sh                         (perplexity through the kernels; needs the weights and duckdb)
#
# Environment: MODEL_DIR a converted model folder (oscar_model.json, config, tokenizer; weights optional: without
# model.safetensors `cache` runs on random weights and `ppl` is skipped), ARTIFACT an artifact folder fitted for it,
# GGUF a .gguf checkpoint converted first (into $OUT/store; needs the gguf package) to become MODEL_DIR,
# WHEELS a folder of wheels installed first into a private --target (duckdb, gguf, ... for a machine without them),
# STEP_TIMEOUT seconds per step (default 240), OUT where logs and RESULTS.md go back (default /tmp/oscar-gpu-suite),
# COMMIT the commit recorded in RESULTS.md (default: each script asks git; give it where the machine's copy of the
# git metadata is not the tree's, as with a copied working tree).
# The checkout's oscar_cli and kernels/ (as oscar_kernels) are put on the path without installing anything.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/oscar-gpu-suite}
STEP_TIMEOUT=${STEP_TIMEOUT:-240}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
SITE=$(mktemp -d /tmp/oscar-site.XXXXXX)
python3 -c 'import sys; sys.path.insert(0, "benchmarks"); from bench_e2e import plugin_site; plugin_site(sys.argv[1])' \
  "$SITE" || { echo "cannot build the plugin site in $SITE" >&2; exit 2; }
if [ -n "${WHEELS:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE/wheels" \
    "$WHEELS"/*.whl || echo "installing the wheels in $WHEELS failed; steps that need them are skipped" >&2
  export PYTHONPATH=$SITE/wheels:$SITE${PYTHONPATH:+:$PYTHONPATH}
else
  export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
fi
if [ -n "${GGUF:-}" ]; then
  MODEL_DIR=$(python3 -c 'import sys; from pathlib import Path; from oscar_cli.models import resolve
print(resolve(sys.argv[1], Path(sys.argv[2]))[2])' "$GGUF" "$OUT/store") || { echo "cannot convert $GGUF" >&2; exit 2; }
  echo "converted $GGUF into $MODEL_DIR"
fi
steps=${*:-tests writes decode extend cache calib ppl}
C=(); [ -n "${COMMIT:-}" ] && C=(--commit "$COMMIT")
has() { python3 -c "import $1" 2>/dev/null; }
run() {  # NAME CMD...: one step under its timeout, its log in $OUT, a one-line verdict here
  local name=$1; shift
  local t0=$(date +%s)
  timeout "$STEP_TIMEOUT" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "== $name: rc=$rc in $(( $(date +%s) - t0 ))s"
  tail -n 6 "$OUT/$name.log"
}
trap 'cp benchmarks/RESULTS.md "$OUT/RESULTS.md"' EXIT
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
for s in $steps; do
  case $s in
    tests) run tests python3 -m pytest -q -p no:cacheprovider -rfE -m "not slow" $(has xdist && echo "-n 8") \
             tests/kernels tests/test_cache_kernels.py ;;
    writes) run writes python3 benchmarks/bench_quantize_pack.py --decode "${C[@]}" ;;
    decode) run decode python3 benchmarks/bench_decode.py "${C[@]}" ;;
    variants) run variants python3 benchmarks/bench_decode.py --variants "${C[@]}" ;;
    variants:*) run "variants-${s#variants:}" python3 benchmarks/bench_decode.py --variants --set "${s#variants:}" "${C[@]}" ;;
    lean) run lean-tests python3 -m pytest -q -p no:cacheprovider -rfE tests/kernels/test_decode_int2.py \
            -k "async_tiles or movmatrix"
          run variants-lean python3 benchmarks/bench_decode.py --variants --set lean "${C[@]}" ;;
    extend) run extend python3 benchmarks/bench_extend.py --sweep "${C[@]}" ;;
    cache)
      if [ -z "${MODEL_DIR:-}" ]; then echo "== cache: skipped (no MODEL_DIR)"; continue; fi
      w=""; [ -f "$MODEL_DIR/model.safetensors" ] || w="--random-weights"
      run cache python3 benchmarks/bench_cache.py $w --model "$MODEL_DIR" ${ARTIFACT:+--artifact "$ARTIFACT"} "${C[@]}" ;;
    calib)
      if ! has duckdb || [ -z "${MODEL_DIR:-}" ]; then echo "== calib: skipped (needs duckdb and MODEL_DIR's tokenizer)"
      else run calib python3 benchmarks/bench_calibration.py --tokenizer "$MODEL_DIR" --per-head "${C[@]}"; fi ;;
    ppl)
      if ! has duckdb || [ -z "${MODEL_DIR:-}" ] || [ ! -f "$MODEL_DIR/model.safetensors" ] || [ -z "${ARTIFACT:-}" ]; then
        echo "== ppl: skipped (needs duckdb, MODEL_DIR with its weights and ARTIFACT)"
      else run ppl bash benchmarks/eval_gpu.sh "$MODEL_DIR" "$ARTIFACT" "$OUT/store" "$OUT/ppl"; fi ;;
    *) echo "unknown step $s (tests writes decode variants variants:SET lean extend cache calib ppl)" >&2; exit 2 ;;
  esac
done
