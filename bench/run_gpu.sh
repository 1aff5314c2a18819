#!/usr/bin/env bash
# One stage per call on a lent GPU machine (the `device` tool: 10 minutes a command, no network,
# python3 there already holds torch, triton, transformers, pytest, scipy): nothing is installed,
# the working tree is imported through PYTHONPATH. Logs, CSV and JSON go to $OUT (fetched back by
# the tool) and the CSV/JSON also to bench/results/<stage>_<gpu>.{csv,json} in the copy.
#
#   bash bench/run_gpu.sh env        # GPU, driver, versions, copy bandwidth
#   bash bench/run_gpu.sh tests      # the whole suite on the GPU (gpu-marked tests included)
#   bash bench/run_gpu.sh verify     # bench_verify: eager, reference, ours (Triton), ours (CUDA)
#   bash bench/run_gpu.sh tree       # bench_verify_tree
#   bash bench/run_gpu.sh attention  # bench_tree_attention (issue targets printed at the end)
#   bash bench/run_gpu.sh e2e        # bench_e2e on the embedded demo pair (real models: carry them)
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT:-bench/results/run}"
mkdir -p "$OUT" bench/results
PY="${PYTHON:-python3}"
GPU="$("$PY" -c 'import torch; print(torch.cuda.get_device_name(0).replace(" ", "_") if torch.cuda.is_available() else "cpu")')"

run() {  # run NAME CMD...: tee the output to $OUT/NAME.log; keep the exit status
    local name="$1"; shift
    echo "### $name: $*" | tee "$OUT/$name.log"
    "$@" 2>&1 | tee -a "$OUT/$name.log"
    return "${PIPESTATUS[0]}"
}

bench() {  # bench STAGE SCRIPT ARGS...: rows to $OUT and bench/results, named by stage and GPU
    local stage="$1" script="$2"; shift 2
    run "$stage" "$PY" "bench/$script" --out "$OUT/${stage}_${GPU}.csv" --json "$OUT/${stage}_${GPU}.json" "$@"
    local rc=$?
    cp "$OUT/${stage}_${GPU}.csv" "$OUT/${stage}_${GPU}.json" bench/results/ 2>/dev/null
    return $rc
}

case "${1:-}" in
    env)
        run env bash -c "nvidia-smi; $PY -c 'import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__, torch.cuda.get_device_name(0))'; git log -1 --format='%H %cd' 2>/dev/null || true"
        ;;
    tests)
        run tests "$PY" -m pytest -q -n 8 -p no:cacheprovider --durations=20 tests
        ;;
    verify)
        bench verify bench_verify.py
        ;;
    tree)
        bench verify_tree bench_verify_tree.py
        ;;
    attention)
        bench tree_attention bench_tree_attention.py --check
        ;;
    e2e)
        bench e2e bench_e2e.py --pair demo --batch-size 1 --temperature 0 0.7
        ;;
    *)
        sed -n '2,14p' "$0"
        exit 2
        ;;
esac
