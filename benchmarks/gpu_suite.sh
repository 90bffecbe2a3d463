#!/usr/bin/env bash
# The GPU gate and the GPU measurements that need no serving engine, in one command on a CUDA machine with a plain
# checkout:
#
#   benchmarks/gpu_suite.sh [STEP ...]        (default: every step; `make gpu-test` runs the `tests` step)
#
#   tests      every test of the GPU suite (`pytest -m gpu`: tests/kernels and tests/test_cache_kernels.py, whose kernels
#              run compiled at their GPU sizes, and any test marked gpu elsewhere), over 8 xdist workers when
#              pytest-xdist is importable
#   writes     bench_quantize_pack.py --decode     (a decode step's K/V writes)
#   decode     bench_decode.py                     (DecodePlan vs cuDNN / flash BF16)
#   variants   bench_decode.py --variants          (a decode step per layer under each DecodePlan variant)
#   metadata   bench_decode.py --metadata          (the attention per layer storage: 2-/4-bit codes, fp16/FP8 scales)
#   variants:SET  bench_decode.py --variants --set SET  (one named variant set, e.g. variants:lean)
#   lean       the split kernel's lean_tiles / movmatrix / fused_update: their GPU tests, then variants:lean
#   extend     bench_extend.py --sweep             (chunked prefill vs SDPA BF16)
#   cache      bench_cache.py                      (OscarCache vs DynamicCache; --random-weights without weights)
#   calib      bench_calibration.py                (collect + fit at Qwen3-8B shapes; needs duckdb)
#   ppl        eval_gpu.sh                         (perplexity through the kernels vs the torch reference; needs the
#              weights and duckdb)
#
# Every step runs under a timeout with its log in $OUT/STEP.log. The last line printed is the one summary, e.g.
#   GPU suite: PASS 254 passed, 0 failed, 3 skipped in 212 s (NVIDIA H100 80GB HBM3, commit abc1234)
# naming every step that failed; it is also appended to benchmarks/RESULTS.md under "GPU suite runs" (the benchmark
# steps append their own sections). The script exits 1 when any step failed (a test failed or errored, nothing was
# collected, a step timed out or exited non-zero, no CUDA device for `tests`), 2 on a usage or setup error.
#
# Environment: SHUFFLE a seed (or `random`) for `pytest --shuffle` (the tests in a random order: exposes state that
# leaks between tests), WORKERS xdist workers (default 8; 0 runs in one process), TESTS_TIMEOUT seconds for `tests`
# (default 480), STEP_TIMEOUT seconds per other step (default 240), MODEL_DIR a converted model folder
# (oscar_model.json, config, tokenizer; weights optional: without model.safetensors `cache` runs on random weights and
# `ppl` is skipped), ARTIFACT an artifact folder fitted for it, GGUF a .gguf checkpoint converted first (into
# $OUT/store; needs the gguf package) to become MODEL_DIR, WHEELS a folder of wheels installed first into a private
# --target (pytest-xdist and execnet for the parallel tests; duckdb, gguf, ... for a machine without them), OUT where
# logs and RESULTS.md go back (default /tmp/oscar-gpu-suite), COMMIT the commit recorded (default: git describe of
# the checkout; give it where the machine's copy of the git metadata is not the tree's, as with a copied working tree).
# The checkout's oscar_cli and kernels (as oscar_kernels) are put on the path without installing anything.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/oscar-gpu-suite}
STEP_TIMEOUT=${STEP_TIMEOUT:-240}
TESTS_TIMEOUT=${TESTS_TIMEOUT:-480}
WORKERS=${WORKERS:-8}
steps=${*:-tests writes decode extend cache calib ppl}
for s in $steps; do
  case $s in
    tests|writes|decode|variants|variants:?*|metadata|lean|extend|cache|calib|ppl) ;;
    *) echo "unknown step $s (tests writes decode variants variants:SET metadata lean extend cache calib ppl)" >&2; exit 2 ;;
  esac
done
SEED=${SHUFFLE:-}
[ "$SEED" = random ] && SEED=$(( RANDOM * 32768 + RANDOM ))
if [ -n "$SEED" ] && ! [[ $SEED =~ ^[0-9]+$ ]]; then echo "SHUFFLE takes an integer seed or 'random', not $SEED" >&2; exit 2; fi
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
C=(); [ -n "${COMMIT:-}" ] && C=(--commit "$COMMIT")
SUITE_COMMIT=${COMMIT:-$(git describe --always --dirty --abbrev=7 --exclude='*' 2>/dev/null || echo unknown)}
CARD=$(python3 -c 'import torch; assert torch.cuda.is_available(); print(torch.cuda.get_device_name(0))' 2>/dev/null)
has() { python3 -c "import $1" 2>/dev/null; }
T0=$(date +%s)
passed=() failed=() skipped=() counts=""
run() {  # NAME LIMIT CMD...: one step under its timeout (SIGINT first: pytest still reports), its log in $OUT
  local name=$1 limit=$2; shift 2
  local t0 rc
  t0=$(date +%s)
  timeout -s INT -k 30 "$limit" "$@" > "$OUT/$name.log" 2>&1
  rc=$?
  echo "== $name: rc=$rc in $(( $(date +%s) - t0 ))s"
  tail -n 6 "$OUT/$name.log"
  if [ $rc -eq 0 ]; then passed+=("$name")
  elif [ $rc -eq 124 ] || [ $rc -eq 137 ]; then failed+=("$name (timed out after $limit s)")
  else failed+=("$name (rc $rc)"); fi
}
tests_step() {
  if [ -z "$CARD" ]; then failed+=("tests (no CUDA device: the GPU suite runs on one)"); return; fi
  local paths=(tests/kernels tests/test_cache_kernels.py) f
  for f in $(grep -rlE --include='test_*.py' 'mark\.gpu\b' tests | sort); do  # gpu-marked tests elsewhere
    case $f in tests/kernels/*|tests/test_cache_kernels.py) ;; *) paths+=("$f") ;; esac
  done
  local args=(-q -p no:cacheprovider -rfE -m gpu)
  if [ "$WORKERS" != 0 ]; then
    if has xdist; then args+=(-n "$WORKERS"); else echo "pytest-xdist is not importable: the tests run in one process"; fi
  fi
  [ -n "$SEED" ] && args+=(--shuffle "$SEED")
  run tests "$TESTS_TIMEOUT" python3 -m pytest "${args[@]}" "${paths[@]}"
  counts=$(python3 - "$OUT/tests.log" <<'PY'
import re, sys
for line in reversed(open(sys.argv[1], errors="replace").read().splitlines()):  # pytest's last line: counts in N s
    if re.search(r"\d+ (passed|failed|errors?|skipped|deselected)\b.* in [\d.]+s", line) or "no tests ran" in line:
        n = {w: 0 for w in ("passed", "failed", "error", "skipped")}
        for k, w in re.findall(r"(\d+) (passed|failed|errors?|skipped)\b", line):
            n[w.rstrip("s") if w.startswith("error") else w] += int(k)
        print(f"{n['passed']} passed, {n['failed'] + n['error']} failed, {n['skipped']} skipped")
        break
else:
    print("no pytest summary")
PY
)
}
trap 'cp benchmarks/RESULTS.md "$OUT/RESULTS.md"' EXIT
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true
for s in $steps; do
  case $s in
    tests) tests_step ;;
    writes) run writes "$STEP_TIMEOUT" python3 benchmarks/bench_quantize_pack.py --decode "${C[@]}" ;;
    decode) run decode "$STEP_TIMEOUT" python3 benchmarks/bench_decode.py "${C[@]}" ;;
    variants) run variants "$STEP_TIMEOUT" python3 benchmarks/bench_decode.py --variants "${C[@]}" ;;
    metadata) run metadata "$STEP_TIMEOUT" python3 benchmarks/bench_decode.py --metadata "${C[@]}" ;;
    variants:*) run "variants-${s#variants:}" "$STEP_TIMEOUT" python3 benchmarks/bench_decode.py --variants \
                  --set "${s#variants:}" "${C[@]}" ;;
    lean) run lean-tests "$STEP_TIMEOUT" python3 -m pytest -q -p no:cacheprovider -rfE \
            tests/kernels/test_decode_int2.py -k "async_tiles or movmatrix or options"
          run variants-lean "$STEP_TIMEOUT" python3 benchmarks/bench_decode.py --variants --set lean "${C[@]}" ;;
    extend) run extend "$STEP_TIMEOUT" python3 benchmarks/bench_extend.py --sweep "${C[@]}" ;;
    cache)
      if [ -z "${MODEL_DIR:-}" ]; then echo "== cache: skipped (no MODEL_DIR)"; skipped+=(cache); continue; fi
      w=""; [ -f "$MODEL_DIR/model.safetensors" ] || w="--random-weights"
      run cache "$STEP_TIMEOUT" python3 benchmarks/bench_cache.py $w --model "$MODEL_DIR" \
        ${ARTIFACT:+--artifact "$ARTIFACT"} "${C[@]}" ;;
    calib)
      if ! has duckdb || [ -z "${MODEL_DIR:-}" ]; then
        echo "== calib: skipped (needs duckdb and MODEL_DIR's tokenizer)"; skipped+=(calib)
      else run calib "$STEP_TIMEOUT" python3 benchmarks/bench_calibration.py --tokenizer "$MODEL_DIR" --per-head "${C[@]}"; fi ;;
    ppl)
      if ! has duckdb || [ -z "${MODEL_DIR:-}" ] || [ ! -f "$MODEL_DIR/model.safetensors" ] || [ -z "${ARTIFACT:-}" ]; then
        echo "== ppl: skipped (needs duckdb, MODEL_DIR with its weights and ARTIFACT)"; skipped+=(ppl)
      else run ppl "$STEP_TIMEOUT" bash benchmarks/eval_gpu.sh "$MODEL_DIR" "$ARTIFACT" "$OUT/store" "$OUT/ppl"; fi ;;
  esac
done
join() { local out=$1 x; shift; for x in "$@"; do out+=", $x"; done; echo "$out"; }
verdict=PASS; [ ${#failed[@]} -gt 0 ] && verdict=FAIL
line="GPU suite: $verdict"
[ -n "$counts" ] && line+=" $counts"
[ ${#failed[@]} -gt 0 ] && line+="; failed: $(join "${failed[@]}")"
[ "$steps" != tests ] && [ ${#passed[@]} -gt 0 ] && line+="; passed: $(join "${passed[@]}")"
[ ${#skipped[@]} -gt 0 ] && line+="; skipped: $(join "${skipped[@]}")"
line+=" in $(( $(date +%s) - T0 )) s (${CARD:-no CUDA device}, commit $SUITE_COMMIT${SEED:+, --shuffle $SEED})"
if [ -n "$CARD" ] && [[ " $steps " == *" tests "* ]]; then  # only a run of the tests (on a GPU) is a suite run
  python3 - benchmarks/RESULTS.md "$line" <<'PY'
import datetime, sys
from pathlib import Path

path, line, title = Path(sys.argv[1]), sys.argv[2], "## GPU suite runs"
entry = f"- {datetime.date.today()}: {line}"
lines = path.read_text().splitlines() if path.exists() else []
if title in lines:  # the entry goes after the section's last line
    start = lines.index(title) + 1
    end = next((i for i in range(start, len(lines)) if lines[i].startswith("## ")), len(lines))
    while end > start and not lines[end - 1].strip():
        end -= 1
    lines.insert(end, entry)
else:
    lines += ["", title, "", "`make gpu-test` (`benchmarks/gpu_suite.sh tests`, `pytest -m gpu`) on a CUDA machine: "
              "the summary line of each run,", "the newest last.", "", entry]
path.write_text("\n".join(lines) + "\n")
PY
fi
echo "$line" | tee "$OUT/summary.txt"
[ "$verdict" = PASS ]
