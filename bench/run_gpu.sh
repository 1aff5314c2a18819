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
#   bash bench/run_gpu.sh profile    # each kernel's GPU time per verify call, and where a call's host time goes
#   bash bench/run_gpu.sh recheck    # the suite and one shape class per timed stage (~4 min)
#   bash bench/run_gpu.sh compare    # each measured time of $OUT's CSVs beside bench_static's estimate
#   bash bench/run_gpu.sh all        # every stage above in one lease-sized call (<= 530 s): builds and tests
#                                    # overlap, timed stages run alone, each under its own time limit;
#                                    # $OUT/results.tgz (all logs, CSV, JSON) is refreshed after every stage;
#                                    # ends with `compare`
#   bash bench/run_gpu.sh --dry-run  # (= all --dry-run; any stage takes it) on any machine, no GPU: every
#                                    # stage starts - the benches check their arguments and import their
#                                    # modules (--dry-run), the tests are collected, nothing is built or
#                                    # timed; each stage's duration, then "dry-run ok" (CI runs it)
# The copy's git metadata may be another commit's: name the code with SPECDEC_COMMIT=<hash> (bench rows
# record it), e.g. `SPECDEC_COMMIT=$(git rev-parse --short HEAD)` expanded where the command is written.
set -uo pipefail
cd "$(dirname "$0")/.."
# --dry-run anywhere in the arguments (alone: all); the stages `all` starts inherit it through the environment
export SPECDEC_DRY_RUN="${SPECDEC_DRY_RUN:-0}"
stage_args=()
for a in "$@"; do if [ "$a" = --dry-run ]; then SPECDEC_DRY_RUN=1; else stage_args+=("$a"); fi; done
set -- ${stage_args[@]+"${stage_args[@]}"}
DRY=$SPECDEC_DRY_RUN
if [ "$DRY" = 1 ]; then
    [ $# -eq 0 ] && set -- all
    if [ -z "${OUT:-}" ]; then  # dry runs write nothing under bench/results: a scratch $OUT, removed at exit
        OUT="$(mktemp -d /tmp/specdec_dry_run.XXXXXX)" && export OUT && trap 'rm -rf "$OUT"' EXIT
        export STAGE_OUT="$OUT/stages"
    fi
    DRY_FLAG=(--dry-run)
else
    DRY_FLAG=()
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export OUT="${OUT:-bench/results/run}"
mkdir -p "$OUT" bench/results
PY="${PYTHON:-python3}"
# the GPU's name (one torch import per run: the stages `all` starts inherit it)
export SPECDEC_GPU="${SPECDEC_GPU:-$("$PY" -c 'import torch; print(torch.cuda.get_device_name(0).replace(" ", "_") if torch.cuda.is_available() else "cpu")')}"
GPU="$SPECDEC_GPU"

run() {  # run NAME CMD...: tee the output to $OUT/NAME.log; keep the exit status
    local name="$1"; shift
    echo "### $name: $*" | tee -i "$OUT/$name.log"
    "$@" 2>&1 | tee -i -a "$OUT/$name.log"  # -i: a SIGINT time limit stops the command, not the log
    return "${PIPESTATUS[0]}"
}

bench() {  # bench STAGE SCRIPT ARGS...: rows to $OUT and bench/results, named by stage and GPU
    local stage="$1" script="$2"; shift 2
    run "$stage" "$PY" "bench/$script" --out "$OUT/${stage}_${GPU}.csv" --json "$OUT/${stage}_${GPU}.json" "$@" \
        ${DRY_FLAG[@]+"${DRY_FLAG[@]}"}
    local rc=$?
    [ "$DRY" = 1 ] || cp "$OUT/${stage}_${GPU}.csv" "$OUT/${stage}_${GPU}.json" bench/results/ 2>/dev/null
    return $rc
}

case "${1:-}" in
    env)
        if [ "$DRY" = 1 ]; then  # no GPU to name: the versions only
            run env "$PY" -c 'import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)'
        else
            run env bash -c "nvidia-smi; $PY -c 'import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__, torch.cuda.get_device_name(0))'; git log -1 --format='%H %cd' 2>/dev/null || true"
        fi
        ;;
    tests)
        if [ "$DRY" = 1 ]; then  # the same selection, collected (imports every test module), not run
            run tests "$PY" -m pytest -qq --collect-only -p no:cacheprovider -m "not slow or gpu" tests
        else
            run tests "$PY" -m pytest -q -n "${TEST_WORKERS:-12}" -p no:cacheprovider --durations=20 -m "not slow or gpu" --tb=short tests
        fi
        ;;
    verify)
        bench verify bench_verify.py "${@:2}"
        ;;
    tree)
        bench verify_tree bench_verify_tree.py "${@:2}"
        ;;
    attention)
        bench tree_attention bench_tree_attention.py --check
        ;;
    attention_fast)  # without flex_attention (torch.compile per shape is minutes over the full sweep)
        bench tree_attention bench_tree_attention.py --check --providers sdpa_dense_mask sdpa_no_mask ours "${@:2}"
        ;;
    attention_flex)  # flex_attention beside ours at the issue's prefix
        bench tree_attention_flex bench_tree_attention.py --check --prefix 4096 --N 8 64 --B 1 32 "${@:2}"
        ;;
    e2e)
        bench e2e bench_e2e.py --pair demo --batch-size 1 --temperature 0 0.7 "${@:2}"
        ;;
    profile)  # each kernel's time per call (torch.profiler) and the host time of a call (cProfile)
        if [ "$DRY" = 1 ]; then
            run profile "$PY" -c 'import ast, sys; [ast.parse(open(f).read()) for f in sys.argv[1:]]; print("profile scripts parse")' \
                scripts/kernel_profile.py scripts/host_overhead.py
        else
            run profile bash -c "$PY scripts/kernel_profile.py ${*:2}; $PY scripts/host_overhead.py --top 25"
        fi
        ;;
    compare)  # the CSVs of this $OUT (verify, verify_tree, tree_attention) beside bench_static's estimates
        run compare "$PY" bench/static_vs_measured.py ${DRY_FLAG[@]+"${DRY_FLAG[@]}"} "$OUT"/*_"$GPU".csv
        ;;
    all | recheck)
        export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}" MAX_JOBS="${MAX_JOBS:-16}"
        # the tool returns at most 8 files from $OUT: the stages write elsewhere, packed into one archive
        local_out="${STAGE_OUT:-/tmp/specdec_gpu_stages}"
        mkdir -p "$local_out"
        pack() { tar -czf "$OUT/results.tgz" -C "$local_out" . 2>/dev/null; }
        FAILED=()
        stage() {  # stage SECONDS NAME...: one stage under a SIGINT time limit, its duration printed
            local limit="$1"; shift
            local t0=$SECONDS
            OUT="$local_out" timeout -s INT -k 15 "$limit" bash "$PWD/bench/run_gpu.sh" "$@"
            local rc=$?
            echo "### stage $* rc=$rc took $((SECONDS - t0)) s (limit $limit s)"
            [ "$rc" = 0 ] || FAILED+=("$1")
            pack
        }
        finish() {  # the dry run's verdict (a real run's stages report their own errors)
            if [ "$DRY" = 1 ]; then
                if [ ${#FAILED[@]} -eq 0 ]; then echo "### dry-run ok"; else echo "### dry-run FAILED: ${FAILED[*]}"; exit 1; fi
            fi
        }
        [ "$1" = all ] && stage 30 env
        # the csrc builds (CUDA and CPU) compile while the test suite runs; the tests wait on their lock
        if [ "$DRY" = 1 ]; then  # nothing is built: the loaders are there
            BUILD_PY='import specdec_kernels.ops.csrc as e; e.load_cuda_extension, e.load_cpu_core; print("csrc loaders ok")'
        else
            BUILD_PY='import time, specdec_kernels.ops.csrc as e; t=time.time(); e.load_cuda_extension(True); print("cuda ext", time.time()-t); e.load_cpu_core(True); print("both", time.time()-t)'
        fi
        ( timeout "${TESTS_S:-150}" "$PY" -c "$BUILD_PY" ) >"$local_out/build.log" 2>&1 &
        BUILD=$!
        stage "${TESTS_S:-150}" tests
        wait "$BUILD"; rc=$?; echo "### build rc=$rc"; tail -3 "$local_out/build.log"
        [ "$rc" = 0 ] || FAILED+=(build)
        if [ "$1" = recheck ]; then  # ~4 minutes: the suite, then one shape class per timed stage
            stage 45 verify --providers eager ours cuda --B 1 64 --G 4 --V 151936 --warmup 5 --rep 50
            stage 40 tree --providers ours --B 1 64 --K 4 --V 151936 --accept-requests 0 --warmup 5 --rep 50
            stage 35 attention_fast --providers sdpa_dense_mask sdpa_no_mask ours --B 1 32 --prefix 4096 32768 --N 64 --rep 50
            stage 20 compare
            finish
            exit 0
        fi
        # sized from the H200 run of c23d175 (2026-11-27), where the wider sweeps ran past their limits:
        # `vectorized` takes 10-180 ms a call on the GPU (10 + 100 calls a row), the tree bench compiles
        # one walk per method and K, the full attention sweep is ~80 rows, the demo e2e 11 prompts x 2
        # temperatures. A stage stopped at its limit still writes the rows it measured.
        stage "${VERIFY_S:-80}" verify --providers eager ours cuda --B 1 64 256 --G 4 --V 151936 \
            --mode greedy stochastic t0.7_topk_topp --warmup 5 --rep 50
        stage "${TREE_S:-70}" tree --providers ours --B 1 64 --K 4 --V 151936 --methods kseq rrs \
            --accept-requests 0 --warmup 5 --rep 50
        stage "${ATTN_S:-50}" attention_fast --B 1 32 --prefix 512 4096 --N 8 64 --rep 50
        stage "${FLEX_S:-40}" attention_flex
        stage "${PROFILE_S:-30}" profile
        stage "${E2E_S:-60}" e2e --code-prompts 2 --prose-prompts 1 --max-new-tokens 64
        stage 20 compare
        finish
        ;;
    *)
        sed -n '2,24p' "$0"
        exit 2
        ;;
esac
