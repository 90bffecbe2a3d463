#!/usr/bin/env bash
# RULER through transformers with OscarCache (benchmarks/ruler_hf.py) on a GPU machine, for a model whose GGUF does
# not fit one 64 MiB transfer (gemma-3-270m's is 253 MB): the parts travel over several calls of the same machine,
# which keeps /tmp while it is held.
#
#   CPU, once:  python benchmarks/ruler_server.py prepare --model gemma3-270m --store S --out .whl/gemma/ruler.json.gz
#               split -b 51m -d -a 2 MODEL.gguf .whl/gemma/gguf. && sha256sum MODEL.gguf | cut -c1-64 > .whl/gemma/gguf.sha256
#               cp -r ARTIFACT .whl/gemma/art-NAME                    (one folder per artifact configuration)
#               pip download gguf (and pytest-xdist, execnet) into .whl/gpu
#   GPU, calls: bash benchmarks/ruler_hf_gpu.sh stage                 carry: one part (and a small file or two)
#               bash benchmarks/ruler_hf_gpu.sh run NAME=METHOD[@art-NAME] ...   carry: the last part, .whl/gpu
#   CPU, after: python benchmarks/ruler_server.py score --requests .whl/gemma/ruler.json.gz --answers DIR --plot PNG
#
# Every call copies what travelled under .whl/gemma into the staging folder; `run` joins the parts (checked against
# the sha256), converts the GGUF once, and answers every request per configuration, skipping configurations whose
# answers a cut-short call already left; each ruler-NAME.json goes back through $OUT as soon as it exists.
# Environment: COMMIT (recorded), SINK / RECENT (data-free methods' exact rows; default 16 / 64, the gemma recipe's).
set -euo pipefail
cd "$(dirname "$0")/.."
ST=/tmp/oscar-ruler-hf
OUT=${OUT:-/tmp/oscar-ruler-hf-out}
mkdir -p "$ST/work" "$OUT"
mode=${1:?usage: benchmarks/ruler_hf_gpu.sh stage | run NAME=METHOD[@art-NAME] ...}
shift
if [ -d .whl/gemma ]; then cp -r .whl/gemma/. "$ST/"; fi
ls "$ST"
[ "$mode" = stage ] && exit 0
[ "$mode" = run ] || { echo "unknown mode $mode (stage | run)" >&2; exit 2; }
GGUF=$ST/gemma-3-270m-q4_k_m.gguf
if [ ! -f "$GGUF" ]; then
  cat "$ST"/gguf.0* > "$GGUF.part"
  [ "$(sha256sum "$GGUF.part" | cut -c1-64)" = "$(cat "$ST/gguf.sha256")" ] || { echo "the GGUF parts do not add up (sha256)" >&2; rm -f "$GGUF.part"; exit 1; }
  mv "$GGUF.part" "$GGUF"
fi
if [ -d .whl/gpu ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/gpu/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD:$PWD/kernels${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
for cfg in "$@"; do
  name=${cfg%%=*} rest=${cfg#*=}
  method=${rest%%@*} art=()
  [[ $rest == *@* ]] && art=(--artifact "$ST/${rest#*@}")
  if [ ! -f "$ST/work/ruler-$name.json" ]; then
    python3 benchmarks/ruler_hf.py --requests "$ST/ruler.json.gz" --model "$GGUF" --store "$ST/store" --config "$name" \
      --method "$method" "${art[@]}" --sink "${SINK:-16}" --recent "${RECENT:-64}" --commit "${COMMIT:-unknown}" \
      --out "$ST/work" 2>&1 | tee "$OUT/ruler-$name.log" | grep -v "^batch" || true
  fi
  [ -f "$ST/work/ruler-$name.json" ] && cp "$ST/work/ruler-$name.json" "$OUT/"
done
ls -la "$OUT"
