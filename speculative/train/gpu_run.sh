#!/usr/bin/env bash
# The default draft head's recipe on one lent H200, in back-to-back device runs (see GPU_RUN.md):
#   bash speculative/train/gpu_run.sh data  SECONDS   build (or continue) the dataset: 4 engine processes share the GPU
#   bash speculative/train/gpu_run.sh train SECONDS   finish the data if needed, then train the ablation heads side by side
#   bash speculative/train/gpu_run.sh eval  [HEAD...]  online acceptance on the held-apart sets, throughput, data export
#   bash speculative/train/gpu_run.sh vocab SECONDS SIZES  a small dataset (MIX), the shipped head restricted to each
#        draft-vocabulary size (e.g. 8192,16384), and every head's online acceptance
#   bash speculative/train/gpu_run.sh eagle3 SECONDS  EAGLE-3 heads (train-draft --format eagle3, E3_SPECS) on the
#        finished dataset, then their online acceptance and a K=1 / K=3 throughput run
# Run from the checkout root after staging the model in /root/model and the wheels in /tmp/site. Writes under $OUT.
set -uo pipefail
MODEL=/root/model/SmolLM2-135M-Instruct.Q4_1.gguf
DATA=/root/mtpdata
HEADS=/root/heads
SHIPPED=speculative/heads/smollm2-135m-mtp.safetensors
OUT=${OUT:-/tmp/mtpserve-out}
MIX=${MIX:-chat=10,steered=3,magpie=3,math=5,code=5,long=3,multi=5,seed=1}
SHARDS=${SHARDS:-4}
SEED=${SEED:-0}  # the dataset's seed (a fresh seed gives new prompts and answers)
LR=${LR:-6e-4}
WARMUP=${WARMUP:-150}
STEPS=${STEPS:-100000}  # training steps at most (the time budget usually ends a run first); equal STEPS compare heads
E3_SPEED=${E3_SPEED:-1}  # 0: the eagle3 step skips its K=1 / K=3 throughput runs
# INIT_HEAD=path: every head starts from that trained head (continued training) instead of the target's layer
# the ablation of the model card; HEAD_SPECS="fused:layers=fused" trains the shipped layout alone
HEAD_SPECS=${HEAD_SPECS:-"base:layers=last fused:layers=fused fused-v16k:layers=fused,vocab=16384 fused-k1:layers=fused,k=1"}
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
export MTPSERVE_CACHE=/root/mtpcache TQDM_MININTERVAL=30
mkdir -p "$OUT" "$HEADS"
start=$(date +%s)
left() { echo $(($1 - ($(date +%s) - start))); }

data() {  # $1: seconds for this step
  python3 -c "from mtpserve.modeling.loader import resolve_model; resolve_model('$MODEL', 'auto').weights()" || return 1
  for w in $(seq 0 $((SHARDS - 1))); do
    python3 -m mtpserve train-draft --stage data --device cuda --target "$MODEL" --data-dir "$DATA" --mix "$MIX" \
      --part-size 2048 --gen-batch-size 256 --seed "$SEED" --shard "$w/$SHARDS" --time-budget "$(left "$1")" \
      > "$OUT/data-$w.log" 2>&1 &
  done
  wait
  python3 - "$DATA" > "$OUT/data-summary.json" <<'PY'
import json, pathlib, sys, torch
root = pathlib.Path(sys.argv[1])
parts = sorted(root.glob("parts/*.pt"))
rows = []
for p in parts:
    d = torch.load(p, weights_only=True)
    rows.append({"part": p.stem, "seqs": len(d["ids"]), "tokens": int(sum(t.numel() for t in d["ids"])), "wall_s": round(d["wall_s"], 1)})
meta = json.loads((root / "meta.json").read_text()) if (root / "meta.json").is_file() else None
print(json.dumps({"parts": rows, "complete": meta is not None, "counts": meta and meta["counts"],
                  "tokens": sum(r["tokens"] for r in rows)}, indent=1))
PY
  tail -c 400 "$OUT"/data-*.log
}

train() {  # $1: seconds for this step
  [ -f "$DATA/meta.json" ] || data $(($1 / 3))
  [ -f "$DATA/meta.json" ] || { echo "dataset unfinished"; return 1; }
  python3 -m mtpserve train-draft --stage train --device cuda --target "$MODEL" --data-dir "$DATA" --seed 0 \
    --holdout-source seed --dev-fraction 0.006 --batch-size 64 --max-batch-tokens 24576 --lr "$LR" \
    --warmup-steps "$WARMUP" ${INIT_HEAD:+--init-head "$INIT_HEAD"} --steps "$STEPS" --time-budget "$(left "$1")" --eval-every 0 --eval-batch-size 16 --ckpt-every 0 \
    $(for s in $HEAD_SPECS; do printf -- '--head-spec %s ' "$s"; done) \
    --export-dtype bfloat16 --out "$HEADS/smollm2-135m-mtp.safetensors" \
    > "$OUT/train.log" 2>&1
  status=$?
  cp "$HEADS"/MODEL_CARD.md "$HEADS"/*.results.json "$OUT"/ 2>/dev/null
  for h in "$HEADS"/*.safetensors; do  # a run returns files of at most 16 MiB: larger heads go in parts
    if [ "$(stat -c %s "$h")" -le 16000000 ]; then cp "$h" "$OUT"/; else split -b 15000000 "$h" "$OUT/$(basename "$h").part-"; fi
  done
  tail -c 1500 "$OUT/train.log"
  return $status
}

SETS=(--prompts bench/prompts/heldout/chat.jsonl --prompts bench/prompts/heldout/code.jsonl
      --prompts bench/prompts/heldout/math.jsonl --prompts bench/prompts/chat_dev.jsonl)

evaluate() {  # heads: the trained ones and any given
  for h in "$HEADS"/*.safetensors "$@"; do
    name=$(basename "$(dirname "$h")")-$(basename "$h" .safetensors)
    python3 -m mtpserve bench acceptance --device cuda --model "$MODEL" --draft "$h" --num-draft-tokens 3 \
      --max-tokens 128 "${SETS[@]}" --quiet --json "$OUT/acc-$name.json" > "$OUT/acc-$name.log" 2>&1
    tail -n 8 "$OUT/acc-$name.log"
  done
}

eagle3() {  # $1: seconds for the training; EAGLE-3 heads on the finished dataset, exported as checkpoint directories
  # under $HEADS (they stay on the warm machine); $OUT gets at most six JSON files (results, acceptance, speed)
  [ -f "$DATA/meta.json" ] || { echo "dataset unfinished: run the data step first"; return 1; }
  specs=${E3_SPECS:-"e3:layers=eagle3 e3-v16k:layers=eagle3,vocab=16384"}
  python3 -m mtpserve train-draft --stage train --format eagle3 --device cuda --target "$MODEL" --data-dir "$DATA" \
    --seed 0 --holdout-source seed --dev-fraction 0.006 --batch-size 64 --max-batch-tokens 24576 --lr "$LR" \
    --warmup-steps "$WARMUP" --steps "$STEPS" --time-budget "$(left "$1")" --eval-every 0 --eval-batch-size 16 \
    --ckpt-every 0 $(for s in $specs; do printf -- '--head-spec %s ' "$s"; done) \
    --export-dtype bfloat16 --out "$HEADS/smollm2-135m-eagle3" > /tmp/train-eagle3.log 2>&1
  status=$?
  tail -c 1500 /tmp/train-eagle3.log
  cp "$HEADS/smollm2-135m-eagle3.results.json" "$HEADS/smollm2-135m-eagle3/config.json" "$OUT"/ 2>/dev/null
  dirs=("$HEADS"/smollm2-135m-eagle3-*/)  # one directory per head of an ablation; a lone head has only the chosen one
  [ -d "${dirs[0]}" ] || dirs=("$HEADS/smollm2-135m-eagle3/")
  for d in "${dirs[@]}"; do
    name=$(basename "$d")
    python3 -m mtpserve bench acceptance --device cuda --model "$MODEL" --spec-method eagle3 --draft "$d" \
      --num-draft-tokens 3 --max-tokens 128 "${SETS[@]}" --quiet --json "$OUT/acc-$name.json" > "/tmp/acc-$name.log" 2>&1
    tail -n 8 "/tmp/acc-$name.log"
  done
  [ "$E3_SPEED" = 0 ] && return $status
  for k in 1 3; do
    python3 -m mtpserve bench throughput --device cuda --model "$MODEL" --spec-method eagle3 \
      --draft "$HEADS/smollm2-135m-eagle3" --num-draft-tokens "$k" --batch-sizes 1,8,64 --output-len 128 \
      --json "$OUT/tput-eagle3-k$k.json" > "/tmp/tput-eagle3-k$k.log" 2>&1
    tail -n 6 "/tmp/tput-eagle3-k$k.log"
  done
  return $status
}

vocab() {  # $1: seconds for the data; $2: comma-separated draft-vocabulary sizes
  [ -f "$DATA/meta.json" ] || data "$1"
  for n in ${2//,/ }; do
    python3 -m mtpserve train-draft --stage vocab --device cuda --target "$MODEL" --data-dir "$DATA" --seed 0 \
      --holdout-source seed --dev-fraction 0.006 --head "$SHIPPED" --draft-vocab "$n" \
      --out "$HEADS/smollm2-135m-mtp-v$n.safetensors" 2>&1 | tail -n 2
  done
  evaluate "$SHIPPED"
}

case "${1:-}" in
  data) data "${2:-540}" ;;
  train) train "${2:-560}" ;;
  eval) shift; evaluate "$@" ;;
  vocab) vocab "${2:-120}" "${3:-16384}" ;;
  eagle3) eagle3 "${2:-480}" ;;
  *) echo "usage: $0 data|train|eagle3 SECONDS | eval [HEAD...] | vocab SECONDS SIZES" >&2; exit 2 ;;
esac
