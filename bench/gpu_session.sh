#!/usr/bin/env bash
# One device call's worth of GPU checks and benchmarks, each step bounded, all output under $OUT
# (at most 8 files come back from a device call: keep STEPS to what you need).
#
#   STEPS="tests_a demo memory" bash bench/gpu_session.sh      # on the device machine, from the repo root
#
# Steps: tests (the GPU suite, junit XML; past one call's limit since c9916b3), tests_a / tests_b (the suite in two calls:
# test_gpu_[a-n]*.py, 523 tests, about 300 s on one H200; the rest, 387 tests), threads (the threaded and capture GPU
# tests, then bench/thread_stress.py on the C and the Python call path: threads on their own streams, plans dropped;
# its --pool-side-stream brings back the fault of a side stream from torch's pool, for an A/B), crashab (bench/crash_hunt.sh's A/B:
# thread_stress --memo-churn on the C path built without bf5b711's fix, then with it; AB_REPS, SECS), tests2 (the same over two GPUs), demo, memory, memory_at (autotuned),
# memory2 (memory and memory_at at once, one per GPU), bwdprobe (backward_probe: each backward piece), convprobe
# (conv_host_probe: where the conv step's host time goes), sdpasweep (knob_sweep --attention per SDPA_SHAPES), gpt2probe, gpt2probe_train (GPT-2: cf, captured,
# cf under torch.compile, torch.compile), host (host_overhead +
# host_breakdown), cold (cold_start, COLD_ARGS its options, e.g. --jit-probe), prewarm (prewarm_scaling, 2 GPUs), peers:<part>, and
# peers2:<partA>,<partB>: two parts at once, one per GPU (nvidia-h200-x2: twice the suite per
# device-second; each workload's variants still share one process and one GPU).
# graphstack (the batch-1 rows three times with launch graphs on, the default since 29135eb: their records hold each
# variant's launch-graph captures and replays), tuneprobe (tune_timing_probe: does the tuner time kernels or the host), graphprobe (graph_device_probe: batch-1 convs' device and wall time with launch graphs on and off), queueprobe (graph_queue_probe: launches queued behind a busy GPU, by kind), kernelprobe (kernel_replay_probe: a captured launch replayed as its kernel), eagerprobe (eager_host_probe: the eager call piece by piece), gapprobe (host_gap_probe: the eager row's host time after each of host_overhead's steps), runoffprobe (runoff_probe: large GEMMs tuned with and without the runoff against torch), sustainprobe (sustained_probe: those GEMMs timed as a burst and sustained, with nvidia-smi clocks), modeprobe (replay_mode_probe: wall, queued and device time of the eager conv and linear in each launch mode), modeab (the same, kernel and graph replays alternating in one process), capnodes (capture_nodes_probe: what long kernels' declined captures hold, with node sequences off and on), seqtests (the launch-graph, fastpath and backward GPU tests with CUDNN_FUSE_NODE_SEQUENCES=1), seqab (memory.py's conv row with node sequences on, long kernels' replays on and off interleaved), pdlab (memory.py's conv row with the programmatic chains' launch sets, the split-K wgrad's, replayed and raw, interleaved), chainab (memory.py's conv row with its layers chained, cf.nn.ConvChain, and not, interleaved), hostbd (host_breakdown by default, with graph replays only, with no launch graphs). lgeluprobe (cuBLASLt's GELU_AUX_BIAS / DGELU epilogues: tests/test_gpu_cublaslt_gelu.py, then bench/cublaslt_gelu_probe.py), tgemmdiag (bench/triton_gemm_diag.py: why the Triton GEMM epilogues lose), tgemmprobe (the MLP's GEMMs with their elementwise pass in a Triton epilogue: tests/test_gpu_triton_gemm.py, then bench/triton_gemm_probe.py, TGEMM_ARGS its options). tritonprobe (the Triton elementwise pass: its GPU tests, bench/elementwise_probe.py, then memory.py's MLP rows with CUDNN_FUSE_MLP_ELEMENTWISE=triton and the probe's fastest launch, under $OUT/triton). pytest:<file>,<file> runs those GPU test files (report in the log). TESTS_TIMEOUT: the tests steps' limit (default 480).
# The tests step leaves out the optimize() fuzz (step optfuzz, 111 s): the rest took 297 s on one H200 at 46bb6fb and
# reached 690 of its 728 tests in 400 s at 67b9039 (the eng8 bar's 48 grouped-gradient tests and the conv GEMM's
# nested tuning came in between), so give it a call of its own, or split it with tests2 on nvidia-h200-x2. MEMORY_ARGS: options of the memory steps. SKIP_INSTALL=1: the wheels are
# already in /tmp/site (a second instance beside a first). PEERS_ARGS adds options to every peers run (e.g. "--no-max-autotune").
# Expects the recipe of ../shared/device/README.md: wheels in .whl/, this checkout on PYTHONPATH.
set -u
OUT=${OUT:?set OUT}
STEPS=${STEPS-"tests_a demo"}  # set but empty: no steps (install and build only); tests_b in a second call
[ -n "${SKIP_INSTALL:-}" ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/inductor
log=$OUT/log.txt
bash bench/build_native.sh >> "$log" 2>&1 || echo "cudnn_fuse._native not built: the Python path runs" >> "$log"
step() {  # step NAME TIMEOUT_S CMD...: a fresh plan cache per step
    local name=$1 t=$2; shift 2
    local s=$SECONDS
    export CUDNN_FUSE_CACHE_DIR=$(mktemp -d)
    timeout "$t" "$@" >> "$log" 2>&1
    echo "== $name rc=$? $((SECONDS - s))s" >> "$log"
}
for s in $STEPS; do
    case $s in
        tests) step tests "${TESTS_TIMEOUT:-480}" python3 -m pytest -m gpu -q -p no:cacheprovider tests \
                   --ignore=tests/test_gpu_optimize_fuzz.py --junit-xml="$OUT/gpu_junit.xml" ;;
        tests_a|tests_b)  # the suite in two calls (it outgrew one: 870 of 910 tests in 545 s at c9916b3)
            if [ "$s" = tests_a ]; then files=(tests/test_gpu_[a-n]*.py); else
                files=($(ls tests/test_gpu_*.py | grep -v -E 'test_gpu_[a-n]|optimize_fuzz') tests/test_hf.py); fi
            step "$s" "${TESTS_TIMEOUT:-480}" python3 -m pytest -m gpu -q -p no:cacheprovider -rfE "${files[@]}" \
                --junit-xml="$OUT/gpu_junit_${s#tests_}.xml" ;;
        pick) step "pick" "${TESTS_TIMEOUT:-300}" python3 -m pytest -m gpu -q -p no:cacheprovider -rfE $PICK \
                --junit-xml="$OUT/gpu_junit_pick.xml" ;;  # PICK="tests/test_x.py tests/test_y.py::test_z": chosen tests (split on spaces: name tests by node id, not -k "a or b")
        threads) step thread_tests 200 python3 -m pytest -m gpu -q -p no:cacheprovider -rfE tests/test_gpu_native.py \
                tests/test_gpu_fastpath.py tests/test_gpu_launch_graphs.py  # the threaded and capture tests
            step thread_stress_c_path 70 python3 bench/thread_stress.py --seconds 45 --native 1 --out "$OUT/thread_stress_c_path.json"
            step thread_stress_python_path 50 python3 bench/thread_stress.py --seconds 30 --native 0 \
                --out "$OUT/thread_stress_python_path.json" ;;
        crashab) SKIP_INSTALL=1 AB_REPS=${AB_REPS:-"1 2 3"} REPS_DEFAULT= REPS_NO_KERNEL= REPS_NO_GRAPHS= REPS_TEST= \
                bash bench/crash_hunt.sh >> "$log" 2>&1 ;;  # the C path's borrowed-entry crash: without and with bf5b711's fix
        optfuzz) step optimize_fuzz 200 python3 -m pytest -m gpu -q -p no:cacheprovider -rfE tests/test_gpu_optimize_fuzz.py ;;
        tests2) t0=$SECONDS  # the GPU suite split over two GPUs (nvidia-h200-x2), by file
            files=(tests/test_gpu_*.py); half=(); other=()
            for i in "${!files[@]}"; do if (( i % 2 )); then other+=("${files[$i]}"); else half+=("${files[$i]}"); fi; done
            ( CUDA_VISIBLE_DEVICES=0 CUDNN_FUSE_CACHE_DIR=$(mktemp -d) timeout "${TESTS_TIMEOUT:-300}" python3 -m pytest -m gpu -q \
                -p no:cacheprovider "${half[@]}" -rfE > "$OUT/gpu_tests_0.txt" 2>&1
              echo "== tests (GPU 0) rc=$? $((SECONDS - t0))s" >> "$log" ) &
            ( CUDA_VISIBLE_DEVICES=1 CUDNN_FUSE_CACHE_DIR=$(mktemp -d) timeout "${TESTS_TIMEOUT:-300}" python3 -m pytest -m gpu -q \
                -p no:cacheprovider "${other[@]}" -rfE > "$OUT/gpu_tests_1.txt" 2>&1
              echo "== tests (GPU 1) rc=$? $((SECONDS - t0))s" >> "$log" ) &
            wait; tail -n 3 "$OUT"/gpu_tests_[01].txt >> "$log" ;;
        demo) step demo 90 python3 -c "import sys; from cudnn_fuse.cli import main; sys.exit(main(['demo']))" ;;
        memory) step memory 120 python3 bench/memory.py --out "$OUT" ${MEMORY_ARGS:-} ;;
        memory_at) CUDNN_FUSE_TUNE_BUDGET_S=${BUDGET:-3} step memory_autotune 300 python3 bench/memory.py --out "$OUT" --autotune ${MEMORY_ARGS:-} ;;
        memory2) t0=$SECONDS  # memory (heuristic plans) on GPU 0 and memory_at (autotuned) on GPU 1, at once
            ( CUDA_VISIBLE_DEVICES=0 CUDNN_FUSE_CACHE_DIR=$(mktemp -d) timeout 120 python3 bench/memory.py --out "$OUT" >> "$OUT/memory.log" 2>&1
              echo "== memory (GPU 0) rc=$? $((SECONDS - t0))s" >> "$log" ) &
            ( CUDA_VISIBLE_DEVICES=1 CUDNN_FUSE_CACHE_DIR=$(mktemp -d) CUDNN_FUSE_TUNE_BUDGET_S=${BUDGET:-3} timeout 180 \
                python3 bench/memory.py --out "$OUT" --autotune >> "$log" 2>&1
              echo "== memory_autotune (GPU 1) rc=$? $((SECONDS - t0))s" >> "$log" ) &
            wait; cat "$OUT/memory.log" >> "$log"; rm -f "$OUT/memory.log" ;;
        bwdprobe) step backward_probe 200 python3 bench/backward_probe.py --out "$OUT" ;;
        sdpasweep) for shp in ${SDPA_SHAPES:-"2,32,8192,64,1" "2,16,8192,128,1" "8,16,2048,128,0" "16,32,1024,64,1"}; do
                step "sdpa_sweep $shp" $(( ${SWEEP_BUDGET:-60} + 60 )) python3 bench/knob_sweep.py --out "$OUT" \
                    --attention "$shp" --budget-s "${SWEEP_BUDGET:-60}"; done ;;
        convprobe) step conv_host_probe 120 python3 bench/conv_host_probe.py --out "$OUT" ;;
        graphstack) for r in a b c; do  # launch graphs on the batch-1 rows, 3 runs
                step "graphstack $r" 90 env CUDNN_FUSE_LAUNCH_GRAPHS=1 python3 bench/peers.py --only 'small_(mlp|linear)' \
                    --no-max-autotune --no-extras --out "$OUT/peers_graphstack_$r.json"; done ;;
        tuneprobe) step tune_timing_probe 200 python3 bench/tune_timing_probe.py --out "$OUT" --trials "${TRIALS:-2}" ;;
        graphprobe) step graph_device_probe 120 python3 bench/graph_device_probe.py --out "$OUT" ;;
        queueprobe) step graph_queue_probe 120 python3 bench/graph_queue_probe.py --out "$OUT" ;;
        kernelprobe) step kernel_replay_probe 150 python3 bench/kernel_replay_probe.py --out "$OUT" ;;
        capnodes) step capture_nodes_probe 150 python3 bench/capture_nodes_probe.py --out "$OUT"
            CUDNN_FUSE_NODE_SEQUENCES=1 step capture_nodes_probe_sequences 150 python3 bench/capture_nodes_probe.py --out "$OUT/seq" ;;
        seqtests) CUDNN_FUSE_NODE_SEQUENCES=1 step launch_graph_tests_sequences 300 python3 -m pytest -m gpu -q -p no:cacheprovider -rfE \
                tests/test_gpu_launch_graphs.py tests/test_gpu_fastpath.py tests/test_gpu_backward.py ;;
        pdlab) step memory_programmatic_ab 200 python3 bench/memory.py --out "$OUT/pdl" --programmatic-ab --only conv ${MEMORY_ARGS:-} ;;
        chainab) step memory_conv_chain_ab 200 python3 bench/memory.py --out "$OUT/chain" --conv-chain-ab --only conv ${MEMORY_ARGS:-} ;;
        seqab) CUDNN_FUSE_NODE_SEQUENCES=1 step memory_sequences_ab 200 python3 bench/memory.py --out "$OUT/seq" --kernel-replay-ab --only conv ${MEMORY_ARGS:-} ;;
        eagerprobe) step eager_host_probe 150 python3 bench/eager_host_probe.py --out "$OUT" --rounds "${ROUNDS:-3}" ;;
        gapprobe) step host_gap_probe 150 python3 bench/host_gap_probe.py --out "$OUT" ;;
        runoffprobe) step runoff_probe 200 python3 bench/runoff_probe.py --out "$OUT" ;;
        modeprobe) for m in "default" "graph CUDNN_FUSE_KERNEL_REPLAY=0" "raw CUDNN_FUSE_LAUNCH_GRAPHS=0"; do  # replay_mode_probe per launch mode
                set -- $m; tag=$1; shift; env "$@" bash -c "$(declare -f step); log=$log; step replay_mode_probe_$tag 90 python3 bench/replay_mode_probe.py --out $OUT --tag $tag"; done ;;
        modeab) step replay_mode_probe_interleaved 120 python3 bench/replay_mode_probe.py --out "$OUT" --interleave --rounds 6 ;;
        sustainprobe) step sustained_probe 240 python3 bench/sustained_probe.py --out "$OUT" ;;
        hostbd) mkdir -p "$OUT/noreplay"  # host_breakdown with kernel replays, then without (CUDNN_FUSE_KERNEL_REPLAY=0)
              step host_breakdown 60 python3 bench/host_breakdown.py --out "$OUT"
              CUDNN_FUSE_KERNEL_REPLAY=0 step host_breakdown_noreplay 60 python3 bench/host_breakdown.py --out "$OUT/noreplay"
              mkdir -p "$OUT/nographs"; CUDNN_FUSE_LAUNCH_GRAPHS=0 step host_breakdown_nographs 60 python3 bench/host_breakdown.py --out "$OUT/nographs" ;;
        host) step host_overhead 60 python3 bench/host_overhead.py --out "$OUT" --rounds 3
              step host_breakdown 60 python3 bench/host_breakdown.py --out "$OUT" ;;
        tritonprobe) step triton_act_tests 90 python3 -m pytest -m gpu -q -p no:cacheprovider -rfE tests/test_gpu_triton_act.py
            step elementwise_probe 200 python3 bench/elementwise_probe.py --out "$OUT" --rounds "${ROUNDS:-8}"
            cfg=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['pieces_ms']['picked']['backward'].strip('()').replace(' ', ''))" \
                  "$OUT/elementwise_probe.json" 2>/dev/null) || cfg=""
            CUDNN_FUSE_MLP_ELEMENTWISE=triton CUDNN_FUSE_MLP_ELEMENTWISE_CONFIG=$cfg step "memory mlp, triton pass $cfg" 120 \
                python3 bench/memory.py --out "$OUT/triton" --only mlp ${MEMORY_ARGS:-} ;;
        tgemmprobe) step triton_gemm_tests 200 python3 -m pytest -m gpu -q -p no:cacheprovider -rfE tests/test_gpu_triton_gemm.py
            step triton_gemm_probe "${TGEMM_TIMEOUT:-420}" python3 bench/triton_gemm_probe.py --out "$OUT" --rounds "${ROUNDS:-8}" ${TGEMM_ARGS:-} ;;
        lgeluprobe) step cublaslt_gelu_tests 200 python3 -m pytest -m gpu -q -p no:cacheprovider -rfE tests/test_gpu_cublaslt_gelu.py
            step cublaslt_gelu_probe "${LGELU_TIMEOUT:-360}" python3 bench/cublaslt_gelu_probe.py --out "$OUT" --rounds "${ROUNDS:-8}" ;;
        cutlassprobe) step cutlass_mlp_tests 200 python3 -m pytest -m gpu -q -p no:cacheprovider -rfE tests/test_gpu_cutlass_mlp.py
            step cutlass_mlp_probe 300 python3 bench/cutlass_mlp_probe.py --out "$OUT" --rounds "${ROUNDS:-16}" ;;  # carry cudnn_fuse/_cutlass_mlp.so (cudnn-fuse build-kernels / bench/build_cutlass.sh)
        tgemmdiag) step triton_gemm_diag "${TGEMM_TIMEOUT:-420}" python3 bench/triton_gemm_diag.py --out "$OUT" ;;
        pytest:*) files=${s#pytest:}; step "$s" "${TESTS_TIMEOUT:-260}" python3 -m pytest -m gpu -q -p no:cacheprovider -rfE ${files//,/ } ;;
        gpt2probe) step gpt2_probe 240 python3 bench/gpt2_probe.py --out "$OUT" ;;
        gpt2probe_train) step gpt2_probe_train 300 python3 bench/gpt2_probe.py --out "$OUT" --train ;;
        cold) step cold_start "${COLD_TIMEOUT:-240}" python3 bench/cold_start.py --out "$OUT" ${COLD_ARGS:-} ;;
        prewarm) step prewarm 240 python3 bench/prewarm_scaling.py --out "$OUT" --budget-s "${BUDGET:-3}" ;;
        peers:*) step "$s" "${PEERS_TIMEOUT:-420}" python3 bench/peers.py --part "${s#peers:}" \
                     --budget-s "${PEERS_BUDGET:-320}" --deadline-s "${PEERS_DEADLINE:-370}" --out "$OUT/peers_${s#peers:}.json" ${PEERS_ARGS:-} ;;
        peers2:*) parts=${s#peers2:}; a=${parts%%,*}; b=${parts#*,}; t0=$SECONDS
            for pair in "0 $a" "1 $b"; do
                set -- $pair
                ( export CUDA_VISIBLE_DEVICES=$1 CUDNN_FUSE_CACHE_DIR=$(mktemp -d) TORCHINDUCTOR_CACHE_DIR=/tmp/inductor$1
                  timeout "${PEERS_TIMEOUT:-420}" python3 bench/peers.py --part "$2" --budget-s "${PEERS_BUDGET:-320}" \
                      --deadline-s "${PEERS_DEADLINE:-370}" --out "$OUT/peers_$2.json" ${PEERS_ARGS:-} > "$OUT/peers_$2.log" 2>&1
                  echo "== peers:$2 (GPU $1) rc=$? $((SECONDS - t0))s" >> "$log" ) &
            done
            wait ;;
        *) echo "unknown step $s" >> "$log" ;;
    esac
done
grep -a "^== \|passed\|failed\| peak \|^[a-z_]* *[0-9.]* us$" "$log" | tail -60
