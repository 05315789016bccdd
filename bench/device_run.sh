#!/usr/bin/env bash
# The one-H200 benchmark runs behind bench/README.md's GPU tables, one device run per phase:
#   bash bench/device_run.sh 8b       Llama-3-8B shape, random weights: step profiles, replayed acceptance, graph
#                                     launches (DRAFT_VOCAB=32768: the random head scores a 32k draft vocabulary)
#   bash bench/device_run.sh adaptive8b  Llama-3-8B shape: target-only, chains K=1 and K=3 and the adaptive default
#                                     at batch 1, 8, 64 and 256 with acceptance replayed per position
#   bash bench/device_run.sh ray8b    Llama-3-8B shape: Ray TP=1 against in-process
#   bash bench/device_run.sh smollm2  real SmolLM2 + shipped head: tree kernels, trees against chains, adaptive
#   bash bench/device_run.sh ray      SmolLM2: Ray TP=1 against in-process (REPEATS, SETUPS), trees against target-only
#                                     in fp32 (FP32=0 skips them)
#   bash bench/device_run.sh prof     SmolLM2 shape, random weights: where a target, chain and tree step's time goes
#   bash bench/device_run.sh tiles    real SmolLM2 + shipped head: matrix-vector tiles timed in the served step at each
#                                     depth and a 15-node tree (batch 1; tensor-core tiles for the tree's 16 rows),
#                                     the chosen table's b1 rates against the default tiles, then
#                                     adaptive speculation with the chosen table at batch 1, 8, 64
#   bash bench/device_run.sh default  SmolLM2 + shipped head: target-only, fixed chains K=1..3 and the adaptive default
#                                     at batch 1, 8, 64 and 256, 128 tokens (bench/gpu.py decode)
#   bash bench/device_run.sh serveprof  SmolLM2: where each process of `serve` spends its time over `bench serve`'s
#                                     window (py-spy by thread; carry .device/tools; CONFIG, STREAMS, API, WINDOW,
#                                     SERVE_ARGS=--distributed for the Ray path)
#   bash bench/device_run.sh serve    SmolLM2: `bench serve`, served over gRPC and HTTP (FRONTENDS front ends, default
#                                     4) against the engine alone, target-only and K=3, at 1, 64 and 256 streams,
#                                     CLIENTS client processes (default 8)
#   bash bench/device_run.sh serveab  `bench serve` (CONFIGS, default target-only; STREAMS, default 64,256; ALONE=1 adds the
#                                     engine alone) of this checkout against an older one in OLD (default .device/old:
#                                     `git archive REV | tar -x -C .device/old`, carried beside .device/wheels), then of
#                                     this checkout again, and `serve --max-replicas 2` (the replica router over one
#                                     engine), all on one warm machine; RUNS picks some of them ("new:. old:DIR"; a
#                                     third field adds serve flags, commas for spaces: "w0:.:--scheduler.admit-wait-ms=0");
#                                     ALONE_EACH=0 measures the engine alone in the first run only;
#                                     PREFILL=1 adds `bench throughput` of 64 x 128-token prompts in each;
#                                     FRONT_ENDS= (empty) leaves only the engine-alone figures (in the log)
#   bash bench/device_run.sh alonebusy  SmolLM2: the engine alone at 64 streams on a quiet host and beside a served
#                                     load on the CPU (CONFIGS, default target-only)
#   bash bench/device_run.sh gc       SmolLM2: garbage-collector pauses of the step loop at 256 streams, heap as is and frozen
#   bash bench/device_run.sh replicas `bench serve` of `serve --replicas 2` (two engines on the GPU, 4 front ends)
#                                     against plain serve, target-only, 64 and 256 streams
#   bash bench/device_run.sh served   `bench serve` in process and through Ray (--distributed) at 64 streams, the
#                                     prefill of 64 x 128-token prompts, and `bench serve` at Llama-3-8B's shape
#                                     (WHERE, ALONE=0, MORE=0, LIMIT: one part of it)
#   bash bench/device_run.sh e3a      EAGLE-3 against the native layout, part 1: a dataset, then the native head (STEPS)
#   bash bench/device_run.sh e3b      part 2: the native head's online acceptance, the EAGLE-3 head (same STEPS), its own
#   bash bench/device_run.sh e3       both parts in one run (a smaller dataset, DATA_S=110 without the long part; the
#                                     E3_SPECS default: frozen norm and lm_head, raw and normed residual), packed
#                                     after every stage
# Run from the checkout root after staging (../shared/device/README.md): the wheels (and Ray) in /tmp/site, the
# GGUF in /root/model, `.device/llama3-8b/config.json` carried. Every command has a time limit, so one that
# hangs costs only its own figures. Everything lands in $OUT/<phase>.tgz (a run returns at most eight files).
set -uo pipefail
PHASE=${1:?"phase: 8b, adaptive8b, ray8b, smollm2, ray, prof, tiles, default, serveprof, serve, serveab, alonebusy, gc, replicas, served, e3a, e3b or e3"}
M=${M:-/root/model/SmolLM2-135M-Instruct.Q4_1.gguf}
L8B=${L8B:-.device/llama3-8b}
V=${DRAFT_VOCAB:-0}  # 8b: the random head's draft vocabulary (0: the target's)
SUFFIX=$([ "$V" = 0 ] || echo "_v$V")
SETUPS=${SETUPS:-in-process,in-process-ahead2,ray-tp1}  # ray, ray8b (one GPU holds one Ray setup at a time)
OUT=${OUT:-/tmp/mtpserve-out}
R=/tmp/res/$PHASE
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1 RAY_USAGE_STATS_ENABLED=0
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export MTPSERVE_CACHE=/root/mtpcache
mkdir -p "$R" "$OUT"
start=$(date +%s)

step() {  # step NAME SECONDS COMMAND...: run with a time limit, log to $R/NAME.log, keep going on failure
  local name=$1 limit=$2; shift 2
  local t0; t0=$(date +%s)
  echo "== $name (limit ${limit}s, at $(($t0 - start))s)"
  timeout -k 10 "$limit" "$@" > "$R/$name.log" 2>&1
  local rc=$?
  echo "== $name rc=$rc in $(($(date +%s) - t0))s"
  tail -n 25 "$R/$name.log"
}

e3_native() {  # $1: folder, $2 and $3: seconds for the data and the training. The dataset, then the native head
  OUT=$1 bash speculative/train/gpu_run.sh data "$2"
  HEAD_SPECS="native:layers=fused" OUT=$1 bash speculative/train/gpu_run.sh train "$3"
  rm -f "$1"/*.safetensors  # the head stays in /root/heads; only figures come back
}

e3_eagle3() {  # $1: folder, $2: E3_SPECS, $3: seconds for the training. The native head's acceptance, then the
  # EAGLE-3 heads on the same dataset and theirs
  OUT=$1 bash speculative/train/gpu_run.sh eval
  E3_SPECS="$2" E3_SPEED=0 OUT=$1 bash speculative/train/gpu_run.sh eagle3 "$3"
}

case $PHASE in
  8b)
    step profile 150 python3 bench/probes/profile_step.py --device cuda --steps 20 --shape "$L8B" --draft-vocab "$V" \
      --variants target-graph,mtp3-graph,tree4x16-graph --out "$R/profile"
    step replay 260 python3 -m mtpserve bench replay --acceptance bench/results/replay_recording_smollm2.json \
      --model "$L8B" --load-format dummy --device cuda --draft-vocab "$V" --batches 1,8,64 --max-tokens 128 \
      --json "$R/replay_8b$SUFFIX.json"
    step graph_launch 110 python3 bench/probes/graph_launch.py --shape "$L8B" --pdl on \
      --steps target,chain3,tree4x16,tree4x16-torch --repeats 10 --out "$R"
    ;;
  adaptive8b)  # the adaptive default against fixed chains at Llama-3-8B's shape, acceptance replayed per position
    step replay 540 python3 -m mtpserve bench replay --acceptance bench/results/replay_recording_smollm2.json \
      --model "$L8B" --load-format dummy --device cuda --draft random --batches 1,8,64,256 --max-tokens 128 \
      --num-requests 4 --configs "target-only,chain K=1,chain K=3,adaptive K=3" --json "$R/replay_8b_adaptive.json"
    ;;
  ray8b)
    step distributed 400 python3 -m mtpserve bench distributed --device cuda --shape "$L8B" \
      --setups "$SETUPS" --batches 1,16 --ks 0,3 --steps 24 --json "$R/distributed_8b.json"
    ;;
  smollm2)
    step kernels 60 python3 bench/probes/kernel_check.py --groups tree --out "$R"
    step trees 150 python3 -m mtpserve bench trees --model "$M" --batches 1,8 --json "$R/trees.json" \
      --configs "target-only,chain K=1,chain K=3,tree K=3 N=8 w=3,tree K=4 N=16 w=4"
    step adaptive 150 python3 bench/probes/adaptive_depths.py --model "$M" --tree-budget 16 --tree-width 4 \
      --batches 1,8,64 --out "$R"
    ;;
  ray)
    step distributed 400 python3 -m mtpserve bench distributed --device cuda --shape smollm2 --model "$M" \
      --setups "$SETUPS" --batches 1,16 --ks 0,3 --steps 48 --repeats "${REPEATS:-3}" \
      --json "$R/distributed_smollm2.json"
    [ "${FP32:-1}" = 0 ] || step trees_fp32 120 python3 -m mtpserve bench trees --model "$M" --dtype float32 --batches 1,8 \
      --configs "target-only,chain K=3,tree K=4 N=16 w=4" --json "$R/trees_fp32.json"
    ;;
  prof)
    step profile 150 python3 bench/probes/profile_step.py --device cuda --steps 30 \
      --variants target-graph,mtp1-graph,mtp3-graph,tree4x16-graph --out "$R/profile"
    ;;
  tiles)
    step tiles 420 python3 bench/probes/gemv_tiles.py --model "$M" --tree-budget 15 --out "$R"
    table=$(python3 -c "import json; print(json.load(open('$R/gemv_tiles.json')).get('chosen_table', ''))" 2>/dev/null)
    [ -n "$table" ] && step adaptive 150 python3 bench/probes/adaptive_depths.py --model "$M" --gemv-tiles "$table" \
      --tree-budget 15 --tree-width 4 --batches 1,8,64 --out "$R"
    ;;
  default)  # the served default (adaptive speculation) against target-only and fixed chains, engine alone
    step decode 330 python3 bench/gpu.py --model "$M" --groups decode --ks 1,2,3 --batches 1,8,64,256 \
      --variants adaptive --skip-hf --max-tokens 128 --out "$R"
    ;;
  serveprof)  # py-spy over every process of `bench serve` (CONFIG, STREAMS, API, 4 front ends); carry .device/tools
    step serveprof 200 python3 bench/probes/serve_profile.py --model "$M" --streams "${STREAMS:-64}" --api "${API:-http}" \
      --config "${CONFIG:-target-only}" \
      --frontends "${FRONTENDS:-4}" --py-spy .device/tools/py-spy --out "$R" \
      --window-s "${WINDOW:-8}" --serve-args="${SERVE_ARGS:-}"
    rm -f "$R"/serve_prof_raw.txt
    ;;
  serve)
    step serve 560 python3 -m mtpserve bench serve --model "$M" --device cuda --configs target-only,speculative \
      --streams 1,64,256 --frontends "${FRONTENDS:-4}" --warmup-s 3 --window-s 6 --client-procs "${CLIENTS:-8}" \
      --json "$R/serve.json"
    ;;
  serveab)  # this checkout's served path against OLD's, the same closed loop, in turn on one machine
    first=1
    for run in ${RUNS:-new:. old:${OLD:-.device/old} again:. router:.}; do
      name=${run%%:*} rest=${run#*:} tree=${run#*:} more=""
      [[ $rest == *:* ]] && tree=${rest%%:*} more=${rest#*:}  # name:tree:serve-args (commas for spaces)
      extra=$([ "$name" = router ] && echo "--max-replicas=2" || echo "")
      extra="--serve-args=$extra ${more//,/ }"
      alone=$({ [ "${ALONE:-0}" = 1 ] && { [ "$first" = 1 ] || [ "${ALONE_EACH:-1}" = 1 ]; }; } || echo "--no-engine-alone")
      first=0
      step "serve_$name" "${LIMIT:-150}" bash -c "cd '$tree' && PYTHONPATH=/tmp/site:\$PWD python3 -m mtpserve bench serve \
        --model '$M' --device cuda --configs ${CONFIGS:-target-only} --streams ${STREAMS:-64,256} --frontends 4 --warmup-s 3 \
        --window-s 5 --client-procs 8 --front-ends='${FRONT_ENDS-http,grpc}' $alone '$extra' --json '$R/serve_$name.json'"
      if [ "${PREFILL:-0}" = 1 ]; then  # 64 x 128-token prompts at once, target-only and speculative
        for spec in --no-speculation ""; do
          step "prefill_$name${spec:+_t}" 120 bash -c "cd '$tree' && PYTHONPATH=/tmp/site:\$PWD python3 -m mtpserve \
            bench throughput --model '$M' --device cuda $spec --batch-sizes 64,64 --prompt-len 128 --output-len 8 \
            --json '$R/prefill_$name${spec:+_t}.json'"
        done
      fi
    done
    ;;
  alonebusy)  # the engine alone at 64 streams, on a quiet host and beside a served load on the CPU (a tiny `serve`,
    # 4 front ends, 8 client processes): whether host load alone slows the engine's steps as serving does
    alone() { python3 -m mtpserve bench serve --model "$M" --device cuda --configs "${CONFIGS:-target-only}" --streams 64 \
      --front-ends= --warmup-s 3 --window-s 5 --json "$R/alone_$1.json"; }
    step alone_quiet 120 alone quiet
    python3 -m mtpserve bench serve --tiny --device cpu --configs target-only --streams 64 --frontends 4 \
      --client-procs 8 --warmup-s 0 --window-s 90 --no-engine-alone > "$R/load.log" 2>&1 &
    sleep 25  # the load's server and clients running
    step alone_busy 120 alone busy
    kill %1 2>/dev/null; wait
    ;;
  gc)  # garbage-collector pauses in the engine's step loop, start-up heap as it is and frozen
    step gc 240 python3 bench/probes/gc_pauses.py --model "$M" --device cuda --streams 256 --steps 2000 --out "$R"
    ;;
  replicas)  # `serve --replicas 2` (two engines on the one GPU, four front ends routing over both) against plain serve,
    # target-only at 64 and 256 streams over both APIs (the engine-alone rows are the plain engine's)
    step serve_plain 200 python3 -m mtpserve bench serve --model "$M" --device cuda --configs target-only \
      --streams 64,256 --frontends 4 --warmup-s 3 --window-s 5 --client-procs "${CLIENTS:-8}" --json "$R/serve_plain.json"
    step serve_replicas 200 python3 -m mtpserve bench serve --model "$M" --device cuda --configs target-only \
      --streams 64,256 --frontends 4 --warmup-s 3 --window-s 5 --client-procs "${CLIENTS:-8}" --no-engine-alone \
      --serve-args="--replicas 2" --json "$R/serve_replicas.json"
    ;;
  served)  # the Ray path's served figure beside in-process, batched prefill, and the served path at 8B's shape
    # WHERE: which of in-process and distributed (default both); ALONE=0 skips the engine-alone rows; MORE=0 skips
    # the prefill and 8B steps; LIMIT: seconds per serve step
    for where in ${WHERE:-in-process distributed}; do
      extra=$([ "$where" = distributed ] && echo "--distributed" || echo "")
      alone=$({ [ "$where" = distributed ] || [ "${ALONE:-1}" = 0 ]; } && echo "--no-engine-alone" || echo "")
      step "serve_$where" "${LIMIT:-280}" python3 -m mtpserve bench serve --model "$M" --device cuda \
        --configs target-only,speculative --streams 64 --frontends 4 $alone --warmup-s 3 --window-s 6 \
        --client-procs 8 --serve-args="$extra" --json "$OUT/serve_$where.json"
    done
    if [ "${MORE:-1}" != 0 ]; then
    step prefill 120 python3 -m mtpserve bench throughput --model "$M" --device cuda --no-speculation \
      --batch-sizes 64,64 --prompt-len 128 --output-len 8 --json "$OUT/prefill_b64.json"
    step serve_8b 240 python3 -m mtpserve bench serve --model "$L8B" --load-format dummy --device cuda \
      --configs target-only --streams 1,64 --frontends 4 --warmup-s 4 --window-s 6 --client-procs 8 \
      --json "$OUT/serve_8b.json"
    fi
    ;;
  e3a)  # STEPS and MIX as exported; the dataset and heads stay on the warm machine for e3b
    e3_native "$R/out" "${DATA_S:-240}" "${TRAIN_S:-300}"
    ;;
  e3b)
    e3_eagle3 "$R/out" "${E3_SPECS:-e3:layers=eagle3}" "${TRAIN_S:-300}"
    ;;
  e3)
    pack() { echo "== $1 at $(($(date +%s) - start))s"; tar czf "$OUT/.$BASHPID" -C /tmp/res e3 && mv "$OUT/.$BASHPID" "$OUT/e3.tgz"; }
    (while sleep 15; do pack running > /dev/null; done) &  # a run cut short still returns what finished
    export MIX=${MIX:-chat=4,steered=1,magpie=1,math=2,code=2,multi=2,seed=1} STEPS=${STEPS:-800}
    e3_native "$R" "${DATA_S:-110}" 170 > "$R/stage-native.log" 2>&1; tail -c 600 "$R/stage-native.log"; pack native
    e3_eagle3 "$R" "${E3_SPECS:-e3f:layers=eagle3,lm_head=frozen e3fn:layers=eagle3,lm_head=frozen,residual=normed}" 260 \
      > "$R/stage-eagle3.log" 2>&1
    tail -n 30 "$R/stage-eagle3.log"
    kill %1
    ;;
  *) echo "unknown phase $PHASE"; exit 2 ;;
esac
tar czf "$OUT/$PHASE.tgz" -C /tmp/res "$PHASE"
echo "== $PHASE done in $(($(date +%s) - start))s; $(du -h "$OUT/$PHASE.tgz" | cut -f1)"
