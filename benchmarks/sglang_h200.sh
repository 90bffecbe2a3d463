#!/usr/bin/env bash
# The SGLang plugin on an H200: real SGLang 0.5.17 with --attention-backend oscar (driver: benchmarks/sglang_h200.py).
#
# What has to reach the GPU machine does not fit one 64 MiB transfer (SGLang's site archive is 53 MiB, the embedded
# SmolLM2 GGUF 94 MiB), so the run is staged into /tmp/oscar-h200 over three device calls of the SAME command; the
# machine keeps /tmp while it is held (30 minutes at most):
#
#   CPU, once:   make demo                                  # converted SmolLM2 + per-head artifact (recipe fits --per-head)
#                bash benchmarks/sglang_h200.sh prepare     # .whl/sgl (SGLang archive), .whl/h200/{gguf.00,gguf.01,artifact,
#                                                           # artifact-uniform,artifact-hadamard,ruler.json.gz,commit}
#   GPU call 1:  bash benchmarks/sglang_h200.sh gpu         carry: .whl/sgl
#   GPU call 2:  bash benchmarks/sglang_h200.sh gpu         carry: .whl/h200/gguf.00 .whl/h200/ruler.json.gz
#   GPU call 3:  bash benchmarks/sglang_h200.sh gpu         carry: .whl/h200/gguf.01 .whl/h200/artifact
#                                                                  .whl/h200/artifact-uniform .whl/h200/artifact-hadamard
#                                                                  .whl/h200/commit
#   (call 3 runs the steps in STEPS, default `serve`: it starts SGLang twice, ~1-2 min each once compile caches are
#   warm, and runs the transformers engine twice; STEPS=ruler starts one server per RULER configuration (five) and
#   runs tests/serve/test_sglang_server_live.py: give it most of a 10-minute command, and run call 3 again to finish
#   what a call cut short left: each configuration's answers are kept in $STAGE/work as they come)
#   CPU, after:  python benchmarks/ruler_server.py score --answers <the files that came back> --plot ...
#
# Each `gpu` call stages what it was given and runs the driver (step `serve`) once everything is there; the step
# keeps each result in $STAGE/work/serve.json as it comes, so a call cut short by its limit is finished by the next. The driver
# appends its tables to benchmarks/RESULTS.md; bring that file back from $OUT. KV capacity at Qwen3-8B shapes is
# `oscar bench`'s (benchmarks/bench_e2e.py).
set -euo pipefail
cd "$(dirname "$0")/.."
STAGE=/tmp/oscar-h200
mode=${1:?usage: benchmarks/sglang_h200.sh prepare | gpu}

if [ "$mode" = prepare ]; then
  mkdir -p .git/info .whl/h200
  grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
  [ -f .whl/sgl/sglsite.tar.xz ] || bash ../shared/sglang-h200/build_site.sh .whl/sgl
  cp ../shared/sglang-h200/unpack.sh .whl/sgl/unpack.sh
  gguf=$(.venv/bin/python -c 'from oscar_cli.models import embedded_gguf; print(embedded_gguf("smollm2-135m"))')
  rm -f .whl/h200/gguf.*
  split -b 48m -d -a 2 "$gguf" .whl/h200/gguf.
  [ "$(ls .whl/h200/gguf.* | wc -l)" = 2 ] || { echo "expected the GGUF in 2 parts of 48 MiB" >&2; exit 1; }
  art=$(.venv/bin/python - <<'PY'
from pathlib import Path
from oscar_cli.artifact import load_artifact
arts = [p for p in sorted(Path("artifacts/smollm2-135m").glob("v*"), key=lambda p: int(p.name[1:]))
        if load_artifact(p).manifest.per_head]
print(arts[-1] if arts else "")
PY
)
  [ -n "$art" ] || { echo "no per-head artifact under artifacts/smollm2-135m: run make demo" >&2; exit 1; }
  rm -rf .whl/h200/artifact && cp -r "$art" .whl/h200/artifact
  # the RULER step's other artifacts (their own folder, so that the latest per-head artifact above stays the recipe's):
  # uniform INT2 with fp16 scales at 2.5 bits, and data-free Hadamard INT2 without clip at the same bits
  for kind in uniform hadamard; do
    if [ ! -d .whl/h200/artifact-$kind ]; then
      case $kind in
        uniform) flags=(--per-head) ;;
        hadamard) flags=(--method hadamard --no-clip --per-head) ;;
      esac
      rm -rf .whl/fits-$kind
      .venv/bin/oscar fit --store .oscar --no-recipe --layers all "${flags[@]}" --bits 2 --group 0 --sink 16 --recent 64 \
        --artifacts .whl/fits-$kind > /dev/null
      cp -r "$(ls -d .whl/fits-$kind/*/v* | sort -V | tail -1)" .whl/h200/artifact-$kind
    fi
  done
  [ -f .whl/h200/ruler.json.gz ] || .venv/bin/python benchmarks/ruler_server.py prepare --model smollm2-135m \
    --out .whl/h200/ruler.json.gz
  .venv/bin/python -c 'from oscar_cli import code_version; print(code_version())' > .whl/h200/commit
  du -sh .whl/sgl .whl/h200/*
  exit 0
fi

[ "$mode" = gpu ] || { echo "unknown mode $mode" >&2; exit 2; }
mkdir -p "$STAGE"
if [ -f .whl/sgl/sglsite.tar.xz ]; then
  cp .whl/sgl/unpack.sh "$STAGE/unpack.sh"
  . .whl/sgl/unpack.sh .whl/sgl/sglsite.tar.xz          # unpacks /tmp/sglsite once per machine
fi
for part in 00 01; do
  if [ -f .whl/h200/gguf.$part ]; then cp .whl/h200/gguf.$part "$STAGE/gguf.$part"; fi
done
for a in artifact artifact-uniform artifact-hadamard; do
  if [ -d .whl/h200/$a ]; then rm -rf "$STAGE/$a" && cp -r .whl/h200/$a "$STAGE/$a"; fi
done
if [ -f .whl/h200/ruler.json.gz ]; then cp .whl/h200/ruler.json.gz "$STAGE/ruler.json.gz"; fi
if [ -f .whl/h200/commit ]; then cp .whl/h200/commit "$STAGE/commit"; fi
missing=""
[ -f /tmp/sglsite/.unpacked ] || missing="$missing .whl/sgl"
for part in 00 01; do [ -f "$STAGE/gguf.$part" ] || missing="$missing .whl/h200/gguf.$part"; done
[ -d "$STAGE/artifact" ] || missing="$missing .whl/h200/artifact"
case " ${STEPS:-serve} " in
  *" ruler "*) for need in artifact-uniform artifact-hadamard ruler.json.gz; do
                 [ -e "$STAGE/$need" ] || missing="$missing .whl/h200/$need"
               done ;;
esac
if [ -n "$missing" ]; then
  echo "staged in $STAGE; carry next:$missing"
  exit 0
fi

# the plugin as an installed distribution: oscar_cli + oscar_kernels (kernels/) and its entry point, nothing else of
# the checkout on sys.path (the top-level kernels/ folder would shadow the PyPI package `kernels` SGLang imports)
SITE=$STAGE/site
rm -rf "$SITE"
python3 -c 'import sys; sys.path.insert(0, "benchmarks"); from bench_e2e import plugin_site; plugin_site(sys.argv[1])' \
  "$SITE"

# the converted SmolLM2 folder, with the image's own transformers (as the CPU side converted it: same fingerprint;
# SGLang's site, with transformers 5.12.1 and gguf, when the image cannot)
cat "$STAGE/gguf.00" "$STAGE/gguf.01" > "$STAGE/SmolLM2-135M-Instruct.Q4_1.gguf"
STORE=$STAGE/store
convert='import sys; from pathlib import Path
from oscar_cli.models import resolve
print(resolve(sys.argv[1], Path(sys.argv[2]))[2])'
MODEL=$(env -u PYTHONPATH PYTHONPATH="$SITE" python3 -c "$convert" "$STAGE/SmolLM2-135M-Instruct.Q4_1.gguf" "$STORE" ||
        env -u PYTHONPATH PYTHONPATH="/tmp/sglsite:$SITE" python3 -c "$convert" "$STAGE/SmolLM2-135M-Instruct.Q4_1.gguf" "$STORE")

. "$STAGE/unpack.sh" /nonexistent                        # SGLang's site first on PYTHONPATH (already unpacked)
export PYTHONPATH=$PYTHONPATH:$SITE OSCAR_SITE=$SITE OSCAR_COMMIT=$(cat "$STAGE/commit" 2>/dev/null || echo unknown)
export OSCAR_CODE_VERSION=$OSCAR_COMMIT
# pre-flight: the plugin inside SGLang's own code on this machine (entry point, hooks, parser, radix cache, pool and
# backend classes), when pytest is there and PREFLIGHT is not 0
# (its failure is reported, not fatal: the measurements below say for themselves whether the served path works)
if [ "${PREFLIGHT:-1}" != 0 ] && python3 -c 'import pytest' 2>/dev/null; then
  python3 -m pytest -q -p no:cacheprovider tests/serve/test_sglang_live.py > "$STAGE/sglang_live.log" 2>&1 ||
    echo "test_sglang_live failed (see $STAGE/sglang_live.log); running the measurements anyway" >&2
  tail -n 3 "$STAGE/sglang_live.log"
fi
for step in ${STEPS:-serve}; do
  case $step in
    serve) python3 benchmarks/sglang_h200.py serve --model "$MODEL" --artifact "$STAGE/artifact" --store "$STORE" \
             --work "$STAGE/work" ;;
    ruler) python3 benchmarks/sglang_h200.py ruler --model "$MODEL" --artifact "$STAGE/artifact" --store "$STORE" \
             --work "$STAGE/work" --ruler "$STAGE/ruler.json.gz" \
             --extra-artifact "oscar-uniform=$STAGE/artifact-uniform" \
             --extra-artifact "int2-hadamard=$STAGE/artifact-hadamard" ;;
    *) echo "unknown step $step (serve, ruler)" >&2; exit 2 ;;
  esac
done
mkdir -p "${OUT:-$STAGE/out}" && cp benchmarks/RESULTS.md "${OUT:-$STAGE/out}/RESULTS.md"
cp "$STAGE"/work/*.log "$STAGE"/work/ruler-*.json "$STAGE"/sglang_live.log "${OUT:-$STAGE/out}/" 2>/dev/null || true
