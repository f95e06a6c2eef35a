#!/usr/bin/env bash
# Everything GPU-specific, on a machine with one CUDA GPU and no network; logs and JSON go to OUT.
#
#   scripts/gpu_check.sh OUT [PHASE...]     phases (default all, in this order):
#     env        nvidia-smi, versions                          -> OUT/env.txt
#     tests      pytest tests/gpu (= -m gpu) + the kernel / backend / graph suites on cuda
#     e2e        the lifecycle and fault suites with real services on cuda (--device cuda)
#     roofline   a Llama-3.1-8B-shaped bf16 target: decode step vs bytes / bandwidth, and a
#                torch.profiler table of its decode steps per backend, with the fused decoder
#                kernels and without (--no-fused-kernels) -> OUT/profile-*.txt; variants
#                fused-dot / fused-fma pick the Triton attention kernel's tiles
#     attention  the Triton paged-attention kernel per tile variant, decode and verify shapes
#                (bench/attention_speed.py; more flags in SPECMESH_ATTENTION_ARGS, e.g.
#                "--num-splits 0,4,8,16") -> OUT/attention.log
#     speed      plain vs EAGLE-3 per backend, eager / CUDA graphs, and transformers, at batch
#                1 / 8 / 32: the 8B-shaped pair (forced acceptance) and the demo pair
#     cluster    the same through a gRPC cluster (target, draft and router processes sharing
#                the GPU), with 1 and 2 router micro-batches and with pre-drafting, to set
#                against speed's in-process triton + CUDA graphs
#     timeline   (not in the default list) where a speculative round's time goes, per stage:
#                the 8B-shaped pair in process and through the cluster at batch 1 and 8
#                (bench/round_timeline.py: host spans, kernels, graph launches, syncs) ->
#                OUT/timeline.md, OUT/timeline.json, OUT/timeline-traces.tgz (profiler traces)
#     v3         (not in the default list) DeepSeek-V3 shapes at speed: a V3-shaped slice
#                (bench/synthetic_deepseek.py; SPECMESH_V3_LAYERS main layers, default 2, and
#                SPECMESH_V3_EXPERTS experts, default 128: about 31 GB of disk), its decode step
#                against the bytes it must move in CUDA graphs and eagerly (profiled at b1 ->
#                OUT/profile-v3.txt), then plain against the NextN MTP draft in top-4 trees
#     ngram      (not in the default list) the cycling target's n-gram drafting, bf16, triton
#                against flashinfer (scripts/gpu_ngram_diag.py)
#     train      (not in the default list) a larger demo pair trained on the GPU (`make-demo
#                --preset gpu`), compared with models/demo by `specmesh.demo.compare`; the
#                pair comes back as OUT/demo-pair.tar.part-* (cat them | tar x)
# JSON results are merged into OUT/gpu_results.json. Runs are chosen by SPECMESH_SPEED_RUNS and
# SPECMESH_CLUSTER_RUNS (model:config lists, defaults below), SPECMESH_ROOFLINE_BACKENDS /
# _VARIANTS, SPECMESH_ROOFLINE_PROFILE_BATCH (default 1) and SPECMESH_BATCH_SIZES (default 1,8,32).
#
# What the machine lacks is installed from wheels in $SPECMESH_WHEELS (default .whl/; the list
# is in bench/README.md, "On a GPU"); torch, triton and grpcio are usually there. Each phase has
# a time limit ($SPECMESH_<PHASE>_TIMEOUT seconds) so one hang cannot eat the others.
set -uo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 1 ] || { awk 'NR > 1 && !/^#/ { exit } NR > 1' "$0"; exit 2; }
mkdir -p "$1" && OUT=$(cd "$1" && pwd) && shift
PHASES=" ${*:-env tests e2e roofline speed cluster} "
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
SYNTH=${SPECMESH_SYNTHETIC_DIR:-/tmp/specmesh-llama8b}
BATCHES=${SPECMESH_BATCH_SIZES:-1,8,32}  # of the speed and cluster phases
WHEELS=${SPECMESH_WHEELS:-.whl}
STATUS=0

if compgen -G "$WHEELS/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/specmesh-site "$WHEELS"/*.whl || exit 1
  export PYTHONPATH=/tmp/specmesh-site${PYTHONPATH:+:$PYTHONPATH}
fi
"$PY" -c "import specmesh.cli.main" 2>/dev/null \
  || "$PY" -m pip install -q --no-index --no-deps --no-build-isolation -e . || exit 1

phase() {  # phase NAME DEFAULT_TIMEOUT COMMAND: run it if asked, log to OUT/NAME.log
  local name=$1 limit=$2 cmd=$3 var rc
  [[ $PHASES == *" $name "* ]] || return 0
  var="SPECMESH_${name^^}_TIMEOUT"
  echo "=== $name (limit ${!var:-$limit} s): $cmd"
  local t0=$SECONDS
  timeout "${!var:-$limit}" bash -c "$cmd" 2>&1 | tee "$OUT/$name.log"
  rc=${PIPESTATUS[0]}
  echo "=== $name: exit $rc after $((SECONDS - t0)) s"
  [ "$rc" -eq 0 ] || STATUS=1
}

env_report() {
  nvidia-smi
  "$PY" - <<'EOF'
import importlib.metadata as md, platform, torch
print("python", platform.python_version(), "| torch", torch.__version__, "| cuda", torch.version.cuda,
      "| device", torch.cuda.get_device_name(0))
for name in ("triton", "transformers", "grpcio", "protobuf", "flashinfer-python", "fastapi"):
    try:
        print(name, md.version(name))
    except md.PackageNotFoundError:
        print(name, "missing")
EOF
}

KERNEL_SUITES=(tests/unit/test_kernels_*.py tests/unit/test_flashinfer_backend.py
               tests/unit/test_graph_runner.py tests/unit/test_backends.py)
E2E_SUITES=(tests/e2e/test_lifecycle_e2e.py tests/e2e/test_grpc_faults.py
            tests/e2e/test_hung_draft_e2e.py)

JSON=${SPECMESH_JSON_DIR:-/tmp/specmesh-gpu-json}  # merged into OUT/gpu_results.json at the end
mkdir -p "$JSON"

make_synthetic() {
  [ -f "$SYNTH/target/config.json" ] || "$PY" -m specmesh.bench.synthetic "$SYNTH"
}

roofline() {  # decode step of the 8B-shaped target vs bytes / bandwidth, per backend, with the
  # fused decoder kernels (the default) and without them (--no-fused-kernels), each profiled
  local backend variant flags name
  make_synthetic || return 1
  for backend in ${SPECMESH_ROOFLINE_BACKENDS:-triton flashinfer}; do
    for variant in ${SPECMESH_ROOFLINE_VARIANTS:-fused unfused}; do
      flags=() name=$backend
      [ "$variant" = unfused ] && flags=(--no-fused-kernels) name=$backend-unfused
      # fused-dot / fused-fma: the Triton attention kernel's tiles (kernels/attention.py)
      [[ $variant == fused-* ]] && flags=(--attention-tiles "${variant#fused-}") name=$backend-$variant
      "$PY" -m specmesh.bench.roofline --target-model "$SYNTH/target" --attention-backend \
        "$backend" "${flags[@]}" --profile "$OUT/profile-$name.txt" \
        --profile-batch "${SPECMESH_ROOFLINE_PROFILE_BATCH:-1}" \
        --out "$JSON/roofline-$name.json" || return 1
    done
  done
}

# model:configuration pairs of the speed phase. The demo pair has head_dim 32, which FlashInfer's
# kernels do not take, so it runs triton and torch only.
SPEED_RUNS="llama8b:triton-graphs llama8b:flashinfer-graphs llama8b:triton-eager
  llama8b:flashinfer-eager llama8b:torch-eager llama8b:transformers demo:triton-graphs
  demo:triton-eager demo:torch-eager demo:transformers"

model_dirs() {  # model_dirs NAME: set target / draft for llama8b (synthetic) or demo
  if [ "$1" = llama8b ]; then
    make_synthetic || return 1
    target=$SYNTH/target draft=$SYNTH/draft
  else
    target=models/demo/target draft=models/demo/draft
  fi
}

tiles_of() {  # tiles_of CFG: a configuration's last word -dot / -rows / -fma names the Triton
  # attention kernel's tiles (SPECMESH_ATTENTION_TILES for that run); sets cfg without it
  tiles=
  case $cfg in *-dot|*-rows|*-fma) tiles=${cfg##*-} cfg=${cfg%-*} ;; esac
}

speed() {  # plain vs EAGLE-3 tokens/s per engine configuration (bench/gpu_speed.py)
  local run model cfg target draft flags tiles name failed=0
  for run in ${SPECMESH_SPEED_RUNS:-$SPEED_RUNS}; do
    model=${run%%:*} cfg=${run#*:} name=${run#*:}
    tiles_of
    model_dirs "$model" || return 1
    case $cfg in
      transformers) flags=(--transformers) ;;
      *-eager) flags=(--attention-backend "${cfg%-eager}" --disable-cuda-graph) ;;
      *-graphs) flags=(--attention-backend "${cfg%-graphs}") ;;
    esac
    echo "--- speed $model $name"
    SPECMESH_ATTENTION_TILES=${tiles:-${SPECMESH_ATTENTION_TILES:-dot}} "$PY" -m \
      specmesh.bench.gpu_speed --target-model "$target" --draft-model "$draft" "${flags[@]}" \
      --batch-sizes "$BATCHES" --out "$JSON/speed-$model-$name.json" >/dev/null || failed=1
  done
  return $failed
}

cluster() {  # the same runs through a gRPC cluster (target, draft, router processes on the GPU);
  # the in-process counterpart is speed's <model>:triton-graphs, where every request of a run
  # lands in one micro-batch: mb1 is the like-for-like hop, mb2 the router's default over gRPC;
  # -predraft[N] adds the draft's --predraft N (4 by default; full-depth trees), -noahead the target's
  # --no-run-ahead, -inline runs both services' steps on their event loops (--inline-step-ms
  # 30: no thread hand-off; not with -predraft / -noahead), -shm sends the feature rows through
  # shared memory (the router's --shared-memory), -mps runs the services under CUDA MPS (one GPU
  # context shared by them); a last -dot / -rows / -fma picks the attention tiles (tiles_of)
  local run model cfg target draft mb extra mps tiles name failed=0
  for run in ${SPECMESH_CLUSTER_RUNS:-llama8b:mb1 llama8b:mb1-predraft llama8b:mb2 demo:mb1}; do
    model=${run%%:*} cfg=${run#*:} name=${run#*:} extra=()
    tiles_of
    model_dirs "$model" || return 1
    mb=${cfg%%-*} mb=${mb#mb}
    [[ $cfg =~ -predraft([0-9]*) ]] &&
      extra+=("--draft-args=--predraft ${BASH_REMATCH[1]:-4} --predraft-steps 5")
    [[ $cfg == *-noahead* ]] && extra+=("--target-args=--no-run-ahead")
    [[ $cfg == *-inline* ]] && extra+=("--target-args=--inline-step-ms 30"
                                       "--draft-args=--inline-step-ms 30")
    [[ $cfg == *-shm* ]] && extra+=("--router-args=--shared-memory")
    mps=0
    if [[ $cfg == *-mps* ]]; then
      command -v nvidia-cuda-mps-control >/dev/null || { echo "no MPS here: $run"; failed=1; continue; }
      nvidia-cuda-mps-control -d && mps=1
    fi
    echo "--- cluster $model $name"
    SPECMESH_ATTENTION_TILES=${tiles:-${SPECMESH_ATTENTION_TILES:-dot}} "$PY" -m \
      specmesh.bench.gpu_speed --cluster --attention-backend triton --target-model "$target" \
      --draft-model "$draft" --num-micro-batches "$mb" "${extra[@]}" \
      --batch-sizes "$BATCHES" --out "$JSON/cluster-$model-$name.json" >/dev/null || failed=1
    [ $mps -eq 0 ] || echo quit | nvidia-cuda-mps-control
  done
  return $failed
}

train() {  # step 5: the GPU preset of the demo pair, then both pairs on the same held-out text
  local - dir=${SPECMESH_TRAIN_DIR:-/tmp/specmesh-demo-gpu}
  set -o pipefail
  # The tokenizer encodes in parallel: undo the export above for this phase.
  TOKENIZERS_PARALLELISM=true "$PY" -m specmesh.cli.main make-demo "$dir" --preset gpu \
    --device cuda --time-budget "${SPECMESH_TRAIN_BUDGET:-450}" | tr '\r' '\n' || return 1
  "$PY" -m specmesh.demo.compare models/demo "$dir" --device cuda \
    --out "$JSON/demo-compare.json" || return 1
  cp "$dir/README.md" "$OUT/demo-card.md"
  tar -C "$dir" -cf - . | split -b 15m - "$OUT/demo-pair.tar.part-"  # files back: <= 16 MiB
}

timeline() {  # the round's stages, in process and through the cluster (bench/round_timeline.py);
  # with SPECMESH_BASELINE_SITE (another install of specmesh, `pip install --target`), that
  # install's in-process timeline first, side by side (scripts/run_site.py)
  local dir=/tmp/specmesh-timeline rc base=/tmp/specmesh-timeline-baseline
  local args=(--target-model "$SYNTH/target" --draft-model "$SYNTH/draft" --max-new-tokens 96
              --batch-sizes "${SPECMESH_TIMELINE_BATCHES:-1,8}")
  make_synthetic || return 1
  if [ -n "${SPECMESH_BASELINE_SITE:-}" ]; then
    "$PY" scripts/run_site.py "$SPECMESH_BASELINE_SITE" specmesh.bench.round_timeline \
      "${args[@]}" --out "$base" >/dev/null
    cp "$base/timeline.md" "$OUT/timeline-baseline.md"
  fi
  # shellcheck disable=SC2086  # SPECMESH_TIMELINE_ARGS: more flags, e.g. --no-in-process
  "$PY" -m specmesh.bench.round_timeline "${args[@]}" --cluster ${SPECMESH_TIMELINE_ARGS:-} \
    --out "$dir"
  rc=$?
  cp "$dir"/timeline.md "$dir"/timeline.json "$OUT"/ 2>/dev/null
  (cd "$dir/traces" && shopt -s nullglob && files=(./*.spans.json ./*b1*) \
    && tar -czf "$OUT/timeline-traces.tgz" "${files[@]}")
  [ "$(stat -c %s "$OUT/timeline-traces.tgz")" -lt 16000000 ] || rm "$OUT/timeline-traces.tgz"
  return $rc
}

v3() {  # DeepSeek-V3 shapes at speed (the v3 phase above)
  local dir=${SPECMESH_V3_DIR:-/tmp/specmesh-v3}
  local args=(--target-model "$dir" --attention-backend triton --batch-sizes "$BATCHES")
  [ -f "$dir/model.safetensors.index.json" ] || "$PY" -m specmesh.bench.synthetic_deepseek \
    "$dir" --layers "${SPECMESH_V3_LAYERS:-2}" --experts "${SPECMESH_V3_EXPERTS:-128}" || return 1
  "$PY" -m specmesh.bench.roofline "${args[@]}" --profile "$OUT/profile-v3.txt" \
    --out "$JSON/roofline-v3-graphs.json" || return 1
  "$PY" -m specmesh.bench.roofline "${args[@]}" --disable-cuda-graph \
    --out "$JSON/roofline-v3-eager.json" || return 1
  "$PY" -m specmesh.bench.gpu_speed "${args[@]}" --draft-model "$dir" --draft-kind mtp \
    --spec 3,4,8 --out "$JSON/speed-v3-mtp.json" >/dev/null
}

merge_json() {
  "$PY" - "$JSON" "$OUT/gpu_results.json" <<'EOF'
import json, pathlib, sys
src, dst = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
merged = {p.stem: json.loads(p.read_text()) for p in sorted(src.glob("*.json"))}
dst.write_text(json.dumps(merged, indent=1))
print(f"{len(merged)} results -> {dst}")
for name, result in merged.items():  # one line per row: the figures to read first
    for row in result.get("rows", []):
        if "step_ms_median" in row:
            launch = row.get("graph_launch_ms")
            print(f"{name} b{row['batch_size']}: step {row['step_ms_median']:.2f} ms, "
                  f"{row['pct_of_bound_measured_bw']:.1f}% of the bandwidth bound"
                  + (f", graph launch {launch:.3f} ms on the host" if launch else ""))
        elif "tokens_per_s" in row:
            t = row["tokens_per_s"]
            print(f"{name} b{row['batch_size']} {row['mode']}: {t['median']:.1f} tok/s "
                  f"({t['min']:.1f} - {t['max']:.1f}), accept {row['accept_len']:.2f}")
EOF
}

export PY OUT SYNTH JSON SPEED_RUNS BATCHES
export -f env_report make_synthetic model_dirs roofline tiles_of speed cluster train timeline v3
phase env 60 env_report
phase tests 900 "\"$PY\" -m pytest -q -p no:cacheprovider -rfE ${SPECMESH_TEST_PATHS:-tests/gpu ${KERNEL_SUITES[*]}}"
phase e2e 600 "\"$PY\" -m pytest -q -p no:cacheprovider -rfE --device cuda ${E2E_SUITES[*]}"
phase attention 240 "\"$PY\" -m specmesh.bench.attention_speed --out \"$JSON/attention.json\" ${SPECMESH_ATTENTION_ARGS:-}"
phase roofline 600 roofline
phase speed 3600 speed
phase cluster 1800 cluster
phase timeline 330 timeline
phase v3 480 v3
phase ngram 150 "\"$PY\" scripts/gpu_ngram_diag.py"
phase train 540 train
merge_json
echo "gpu_check: $([ $STATUS -eq 0 ] && echo passed || echo FAILED); logs in $OUT"
exit $STATUS
