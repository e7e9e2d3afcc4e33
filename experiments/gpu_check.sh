#!/usr/bin/env bash
# The GPU check: what a researcher gets on one GPU, in at most about 12 minutes
# on an H200 (the sections' limits add up to 740 s; GPU_CHECK_SECTIONS splits it into
# calls). Prints one table and writes gpu_check.json (plus each section's log and JSON)
# to OUT_DIR (default outputs/gpu_check/<date-time>). gpu_check.json is the run's record
# (card, torch version, date, the command with every GPU_CHECK_* setting): copied to
# docs/gpu/, it feeds the tables of docs/performance.md (experiments/gpu_records.py).
#
#   experiments/gpu_check.sh [OUT_DIR]
#
# Sections, each under its own time limit; one that fails or runs out of time is
# reported in the table's header and the others still run:
#   tests       python -m pytest -m cuda (the cuda-marked tests)
#   steps_4096  each encoder's bf16 training step at 4x4096, eager (the default) and
#               model.compile=true: tokens/s and peak memory relative to `none`
#   flex        FlexAttention (forced) vs the explicit path at 4x4096, relative to `none`
#   decode      greedy generation of 512 tokens after 128, cached and uncached (none,
#               rope, and two FlexAttention schemes: alibi, t5)
#   steps_1024  the eager training steps at 16x1024 (equal tokens per step: memory
#               linear in T keeps the ratio to `none` flat between the two lengths);
#               GPU_CHECK_COMPILED_1024=1 adds the compiled steps there too (11 more
#               compilations: past the 10 minutes)
#   profile     the top operators of one eager training step at 4x4096 of
#               GPU_CHECK_PROFILE (default fire, whose eager step took 3.7 s on an
#               H200 on 2026-11-27): experiments/profile_step.py, in profile.log
#   lm_gpu      (only when GPU_CHECK_SECTIONS names it) experiment=lm_gpu's full training
#               step, data loader included, as run.py trains it, on a synthetic corpus
#               written on the fly: steady-state tokens/s and peak memory against `none`
#               for GPU_CHECK_PRESET_ENCODERS (default none,rope,alibi,t5,xl), columns
#               "preset step" and "preset memory" (experiments/bench_preset.py). Needs
#               hydra (the wheels below); trains a 16k BPE vocabulary first
# GPU_CHECK_SECTIONS=tests,flex (say) runs only those; GPU_CHECK_MODES=eager leaves the
# compiled steps out of steps_4096; GPU_CHECK_ENCODERS=rope,t5 (say) measures those
# (and `none`) in the step sections, =all every registered one; GPU_CHECK_FLEX_TILES=64,128
# (say) gives the flex section's compiled FlexAttention those forward tiles (default: the eleven
# that are not data-dependent). The limits below come from the runs of 2026-11-26/27 on
# an H200 (compiling the kernels is most of the time); a section past its limit keeps
# the rows it measured and the table says so; the tests run with -v, so their results
# survive a pytest that does not exit.
# Every figure is a ratio against `none` measured in the same run (bench.py's sections
# steps, flex and decode with --sizes gpu: experiments/bench_steps.py, bench_decode.py).
#
# Without a CUDA GPU it says so in one line, runs the CPU-runnable parts (the same
# sections at bench.py's quick sizes, about a minute) and exits 0.
#
# Python packages: the sections need torch only (python3, or $PYTHON); the tests also
# need hydra-core and omegaconf (tests/conftest.py), which the lent GPU machines lack.
# Carry them as wheels in .whl/ (see /work/.library/device/README.md; antlr4-python3-
# runtime 4.9.3, omegaconf's dependency, is a source archive: build its wheel here with
# `pip wheel --no-deps -w .whl antlr4-python3-runtime==4.9.3`): this script installs
# .whl/*.whl into /tmp/posenc-site when hydra is missing. Without them the tests section
# fails with the import error and the others run.
set -u
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-python3}
OUT=${1:-outputs/gpu_check/$(date +%Y%m%d-%H%M%S)}
mkdir -p "$OUT"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"

# run_section NAME SECONDS CMD...: the command's output goes to OUT/NAME.log, its exit
# status and duration to OUT/NAME.status; a failure or timeout never stops the script.
run_section() {
    local name=$1 limit=$2
    shift 2
    local start=$SECONDS rc
    echo "[gpu_check] $name (limit ${limit}s) ..." >&2
    timeout --kill-after=15 "$limit" "$@" >"$OUT/$name.log" 2>&1
    rc=$?
    echo "$rc $((SECONDS - start)) $limit" >"$OUT/$name.status"
    if [ "$rc" -ne 0 ]; then
        echo "[gpu_check] $name: exit $rc after $((SECONDS - start))s (124: time limit); see $OUT/$name.log" >&2
    fi
    return 0
}

BENCH=("$PY" experiments/bench.py)  # timeout runs programs, not shell functions
# By default the eleven schemes that are not data-dependent; the data-dependent ones
# (cope, fox, path, selective, stickbreak) take minutes more at 4x4096:
# GPU_CHECK_ENCODERS=all adds them.
ENCODERS=${GPU_CHECK_ENCODERS:-none,learned,sinusoidal,rope,xpos,shaw,xl,xl_fold,deberta,alibi,t5,fire}
if [ "$ENCODERS" = all ]; then
    ENCODERS=$("$PY" -c "from posenc.encoders import available; print(','.join(available()))")
fi

if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    echo "gpu_check: no CUDA GPU here ($("$PY" -c 'import torch; print("torch", torch.__version__)' 2>&1 | tail -1)); ran the CPU-runnable parts only, at the quick sizes, into $OUT"
    run_section steps_quick 120 "${BENCH[@]}" --quick --threads 1 --sections steps,flex --json "$OUT/steps_quick.json"
    run_section decode_quick 90 "${BENCH[@]}" --quick --threads 1 --sections decode --json "$OUT/decode_quick.json"
    "$PY" experiments/gpu_check_report.py "$OUT" --cpu --script-args "$@" || echo "gpu_check: the report failed (see above)"
    exit 0
fi

if ! "$PY" -c "import hydra, omegaconf" 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/posenc-site .whl/*.whl >"$OUT/wheels.log" 2>&1 \
        && export PYTHONPATH="$PYTHONPATH:/tmp/posenc-site"
fi

# want SECTION: whether GPU_CHECK_SECTIONS (comma-separated; default all) names it.
want() { [[ ",${GPU_CHECK_SECTIONS:-tests,steps_4096,flex,decode,steps_1024,profile}," == *",$1,"* ]]; }

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >"$OUT/gpu.txt" 2>&1
# The tests compile a kernel or two each: four workers (pytest-xdist, when installed).
XDIST=()
"$PY" -c "import xdist" 2>/dev/null && XDIST=(-n 4)
# One compile thread: the tests' compile workers once kept pytest from exiting. It still
# hung after the last result on 2026-11-27 (before its summary, so in a worker's
# teardown): -v writes each result to the log as it comes, which the report counts.
want tests && TORCHINDUCTOR_COMPILE_THREADS=1 run_section tests 150 "$PY" -m pytest -m cuda -p no:cacheprovider "${XDIST[@]}" \
    -v --tb=line -rfE --junitxml="$OUT/tests.xml" tests/model
want steps_4096 && run_section steps_4096 260 "${BENCH[@]}" --sizes gpu --sections steps --lengths 4096 --encoders "$ENCODERS" \
    --modes "${GPU_CHECK_MODES:-eager,compiled}" --json "$OUT/steps_4096.json"
want flex && run_section flex 120 "${BENCH[@]}" --sizes gpu --sections flex \
    ${GPU_CHECK_FLEX_TILES:+--flex-tiles "$GPU_CHECK_FLEX_TILES"} --json "$OUT/flex.json"
want decode && run_section decode 90 "${BENCH[@]}" --sizes gpu --sections decode --encoders none,rope,alibi,t5 \
    --json "$OUT/decode.json"
if [ "${GPU_CHECK_COMPILED_1024:-0}" = 1 ]; then
    want steps_1024 && run_section steps_1024 300 "${BENCH[@]}" --sizes gpu --sections steps --lengths 1024 --encoders "$ENCODERS" \
        --json "$OUT/steps_1024.json"
else
    want steps_1024 && run_section steps_1024 60 "${BENCH[@]}" --sizes gpu --sections steps --lengths 1024 --encoders "$ENCODERS" \
        --modes eager --json "$OUT/steps_1024.json"
fi
# Off by default: not in want's default list.
want lm_gpu && run_section lm_gpu 420 "$PY" experiments/bench_preset.py --preset lm_gpu \
    --encoders "${GPU_CHECK_PRESET_ENCODERS:-none,rope,alibi,t5,xl}" --json "$OUT/lm_gpu.json"
want profile && run_section profile 60 "$PY" experiments/profile_step.py "${GPU_CHECK_PROFILE:-fire}"
"$PY" experiments/gpu_check_report.py "$OUT" --script-args "$@" || echo "gpu_check: the report failed (see above)"
exit 0
