#!/usr/bin/env bash
# clipkit's GPU check: one command proves clipkit on a CUDA GPU and measures it (docs/benchmarks.md, "GPU").
#
#   bash benchmarks/gpu/run.sh RESULTS_DIR [PART ...]
#
# Run from anywhere; it works in the repository root. PARTs (default: all, in this order):
#
#   step        what runs                                        time limit (s)  writes
#   install     carried wheels (.whl/) + clipkit --no-deps      $BUDGET_INSTALL  -
#   versions    python, torch, CUDA, driver, every package       -               run.log
#   ceilings    bf16/tf32/fp32 matmul, device copy               $BUDGET_CEILINGS
#   tests       pytest tests/gpu -m gpu ($CLIPKIT_GPU_PYTEST_ARGS)  $BUDGET_TESTS    pytest.log, pytest.xml
#   vit_step    ViT-B/16 CLIP bf16 step, clipkit vs open_clip    $BUDGET_VIT_STEP
#   kme         KME fwd+bwd: Triton vs block-wise vs naive       $BUDGET_KME
#   batch_wall  largest contrastive batch, full N×N InfoNCE      $BUDGET_BATCH_WALL
#   loader      loader images/s vs what the step consumes        $BUDGET_LOADER
#   scaleout    DDP vs ZeRO-2/3 vs FSDP2 step time, peak memory  $BUDGET_SCALEOUT
#   summary     results.json (every figure) + table.md           -               results.json, table.md
#
# Not in the default list (name it): kme_tiles, the Triton KME kernels' forward and backward
# timed apart over tile shapes and warp counts ($BUDGET_KME_TILES); fused_loss, InfoNCE and SigLIP
# fwd+bwd at N up to 1 048 576: clipkit's fused kernels vs its generic tiled engine vs the full N×N
# path vs Inf-CL ($BUDGET_FUSED_LOSS; `bash benchmarks/gpu/run.sh OUT ceilings fused_loss summary`);
# fused_tiles, the fused kernels' fwd+bwd over tile shapes against their defaults ($BUDGET_FUSED_TILES).
#
# Every part runs under its own `timeout`, so one hang cannot eat the lease; a part that fails or
# times out is recorded and the next one runs. The whole run also stops starting parts once
# CLIPKIT_GPU_TOTAL_S (default 420) seconds have passed, and cuts a part's limit to what is left.
# RESULTS_DIR ends with at most 6 files: run.log (everything printed), pytest.log, pytest.xml,
# results.json, table.md, and the short table is printed last.
#
# On the GPU machine (no network) the packages the image lacks come from wheels carried in .whl/
# (made here by benchmarks/gpu/fetch_wheels.sh from benchmarks/gpu/wheels.txt); with network,
# `pip install -e .` instead and set CLIPKIT_GPU_WHEELS=none.
#
# CLIPKIT_GPU_REHEARSAL=1 runs the same steps on the CPU at toy sizes (tests/test_gpu_rehearsal.py):
# pure-Python wheels go to a throwaway target (the cp312 ones are listed, not installed), clipkit
# is the environment's own, the gpu tests skip, and every part's plumbing and table writing runs.
set -uo pipefail

repo=$(cd "$(dirname "$0")/../.." && pwd)
cd "$repo"
results=${1:?usage: bash benchmarks/gpu/run.sh RESULTS_DIR [PART ...]}
shift
mkdir -p "$results"
results=$(cd "$results" && pwd)
parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(install versions ceilings tests vit_step kme batch_wall loader scaleout summary)

rehearsal=${CLIPKIT_GPU_REHEARSAL:-0}
[ "$rehearsal" = 0 ] && rehearsal=""
python=${CLIPKIT_GPU_PYTHON:-python3}
wheels=${CLIPKIT_GPU_WHEELS:-$repo/.whl}
total=${CLIPKIT_GPU_TOTAL_S:-420}
: "${BUDGET_INSTALL:=60}" "${BUDGET_CEILINGS:=30}" "${BUDGET_TESTS:=200}" "${BUDGET_VIT_STEP:=110}"
: "${BUDGET_KME:=95}" "${BUDGET_BATCH_WALL:=45}" "${BUDGET_LOADER:=50}" "${BUDGET_KME_TILES:=70}"
# A launch takes about a minute of wall time on a shared CPU: the rehearsal's scaleout gets more.
if [ -n "$rehearsal" ]; then : "${BUDGET_SCALEOUT:=240}"; else : "${BUDGET_SCALEOUT:=120}"; fi
: "${BUDGET_FUSED_LOSS:=300}" "${BUDGET_FUSED_TILES:=170}"
work=$(mktemp -d "${TMPDIR:-/tmp}/clipkit-gpu.XXXXXX")   # the parts' JSON files, merged at the end
site=$work/site                                            # where carried wheels are installed
trap 'rm -rf "$work"' EXIT
export PYTHONUNBUFFERED=1 CLIPKIT_GPU_STATUS=$work/status.tsv
exec > >(tee -a "$results/run.log") 2>&1
started=$(date +%s)

log() { printf '\n== [%4ds] %s\n' "$(($(date +%s) - started))" "$*"; }

# run_step NAME LIMIT CMD...: CMD under `timeout`, its limit cut to what is left of the total;
# records "NAME<TAB>status<TAB>seconds" for the summary.
run_step() {
    local name=$1 limit=$2 left status began
    shift 2
    left=$((total - ($(date +%s) - started)))
    if [ "$left" -lt 10 ]; then
        log "$name: skipped, the total budget of ${total}s is spent"
        printf '%s\tnot run (total budget spent)\t0\n' "$name" >>"$CLIPKIT_GPU_STATUS"
        return
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    log "$name (limit ${limit}s)"
    began=$(date +%s)
    # A part that paces itself (fused_loss) reads its limit and stops starting points in time.
    CLIPKIT_GPU_PART_LIMIT_S=$limit timeout --kill-after=10 "$limit" "$@"
    local code=$?
    case $code in
        0) status=ok ;;
        124 | 137) status="timed out after ${limit}s" ;;
        *) status="failed (exit $code)" ;;
    esac
    printf '%s\t%s\t%s\n' "$name" "$status" "$(($(date +%s) - began))" >>"$CLIPKIT_GPU_STATUS"
    log "$name: $status in $(($(date +%s) - began))s"
}

install_wheels() {
    if [ "$wheels" = none ] || ! ls "$wheels"/*.whl >/dev/null 2>&1; then
        echo "no wheel folder at $wheels: using the environment's packages as they are"
    elif [ -n "$rehearsal" ]; then
        # This CPU's Python may not be 3.12: install the pure-Python wheels into a throwaway target
        # to prove the folder installs, and keep using the environment's own packages.
        echo "rehearsal: pure-Python wheels into a throwaway target; compiled ones listed only"
        ls "$wheels"/*.whl | grep -v -- '-none-any.whl' | sed 's#.*/#  not installed here: #'
        "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
            --target "$work/throwaway" "$wheels"/*-none-any.whl || return 1
    else
        "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target "$site" "$wheels"/*.whl || return 1
    fi
    if [ -z "$rehearsal" ] && ! "$python" -c "import clipkit.plugins" 2>/dev/null; then
        # Editable, as a developer installs it: the repository's own tests/ and benchmarks/ then
        # import this checkout (plugins/ maps to clipkit.plugins through the editable finder).
        "$python" -m pip install -q --no-index --no-deps --no-build-isolation -e "$repo" || return 1
    fi
    PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH} "$python" -c \
        "import clipkit.plugins, webdataset, omegaconf; print('clipkit imports from', clipkit.__file__)"
}

print_versions() {
    "$python" - <<'EOF'
import importlib.metadata as md, platform, sys
import torch
print("python", platform.python_version(), sys.executable)
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("gpu", p.name, f"{p.total_memory / 2**30:.1f} GiB", p.multi_processor_count, "SMs", "capability", p.major, p.minor)
for name in ["clipkit-contrastive", "accelerate", "deepspeed", "triton", "webdataset", "omegaconf", "safetensors",
             "pluggy", "typer", "pydantic", "open_clip_torch", "timm", "torchvision", "simplejpeg", "pytest", "numpy"]:
    try:
        print(f"  {name} {md.version(name)}")
    except md.PackageNotFoundError:
        print(f"  {name} (not installed)")
EOF
    command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm \
        --format=csv || true
    echo "cpus: $(nproc)"
}

run_tests() {
    local env=()
    [ -n "$rehearsal" ] && env=(env -u CLIPKIT_GPU_TESTS_ON_CPU)
    # CLIPKIT_GPU_PYTEST_ARGS: extra pytest arguments, e.g. "-k nuclr" for a second, shorter try
    # (split on spaces); CLIPKIT_GPU_PYTEST_K: a -k expression kept whole ("ema_and_lora or fsdp2").
    local select=()
    [ -n "${CLIPKIT_GPU_PYTEST_K:-}" ] && select=(-k "$CLIPKIT_GPU_PYTEST_K")
    # -o addopts: one process on the one GPU (the suite's addopts start two xdist workers).
    # shellcheck disable=SC2086
    "${env[@]}" "$python" -m pytest tests/gpu -m gpu -o addopts="-ra --strict-markers" -v -p no:cacheprovider -rfEs --durations=15 --timeout=100 \
        --junitxml="$results/pytest.xml" -o junit_family=xunit2 "${select[@]}" ${CLIPKIT_GPU_PYTEST_ARGS:-} 2>&1 |
        tee "$results/pytest.log"
    local status=${PIPESTATUS[0]}
    [ "$status" = 5 ] && [ -n "$rehearsal" ] && return 0   # no CUDA: every gpu test deselected/skipped
    return "$status"
}

log "clipkit GPU check: parts ${parts[*]}; total budget ${total}s${rehearsal:+ (CPU rehearsal, toy sizes)}"
for part in "${parts[@]}"; do
    case $part in
        install)
            run_step install "$BUDGET_INSTALL" bash -c "$(declare -f install_wheels); $(declare -p python wheels rehearsal work site repo); install_wheels"
            [ -d "$site" ] && export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH} ;;
        versions) log versions; print_versions ;;
        tests) run_step tests "$BUDGET_TESTS" bash -c "$(declare -f run_tests); $(declare -p python rehearsal results); run_tests" ;;
        ceilings | vit_step | kme | batch_wall | loader | scaleout | kme_tiles | fused_loss | fused_tiles)
            budget_var=BUDGET_$(echo "$part" | tr a-z A-Z)
            run_step "$part" "${!budget_var}" "$python" "benchmarks/gpu/part_$part.py" --out "$work" ;;
        summary)
            log summary
            "$python" benchmarks/gpu/summarize.py --parts "$work" --status "$CLIPKIT_GPU_STATUS" \
                --junit "$results/pytest.xml" --results "$results" ;;
        *) log "unknown part $part (known: install versions ceilings tests vit_step kme batch_wall loader scaleout kme_tiles fused_loss fused_tiles summary)" ;;
    esac
done
log "done"
