#!/usr/bin/env bash
# One GPU lease, as the device tool runs it (docs/gpu.md). That machine reaches no package index:
# onnxruntime-gpu travels in parts (../shared/tools/device-ortgpu.sh prepare -> .ortgpu/partN), the
# service's pure-Python dependencies as wheels in .whl/ (docs/gpu.md lists the pip download line).
#
#   bash bench/gpu_lease.sh part N      # carry .ortgpu/partN (N = 0 ... last, any order); the first
#                                       # call also carries .whl (with the smallest part): it installs
#                                       # longdoc and the wheels and starts the exports
#                                       # (bench/gpu.py --phases make) in the background while the
#                                       # other parts travel
#   bash bench/gpu_lease.sh main PHASES [QA_DIR]
#                                       # onnxruntime-gpu put together, the GPU tests, then
#                                       # bench/gpu.py --phases PHASES, then (with QA_DIR: a QA
#                                       # model's manifest.json + tokenizer.json) bench/host_path.py
#                                       # on 1-15 cores; everything lands in $OUT
set -uo pipefail
OUT=${OUT:-/tmp/gpu-out}
WORK=/tmp/gpu
mkdir -p "$OUT" "$WORK" /tmp/ortgpu
log() { echo "[$(date +%H:%M:%S)] $*"; }

case "${1:-}" in
part)
  cp .ortgpu/part"$2"/chunk.* /tmp/ortgpu/ && ls -la /tmp/ortgpu
  if [ -d .whl ] && [ ! -f $WORK/make.started ]; then
    touch $WORK/make.started
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl || exit 1
    python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null || exit 1
    # the exports need torch, transformers and onnx (all on that machine), not onnxruntime-gpu
    setsid nohup bash -c "python3 bench/gpu.py --work $WORK --out $WORK/make-out --phases make \
      > $WORK/make.log 2>&1; echo \$? > $WORK/make.done" >/dev/null 2>&1 < /dev/null &
    log "exports started in the background"
  fi
  ;;
main)
  phases=${2:-ours,gathers,encoder_opts,kernels,service,summarize,pegasus,verify,hf}
  wheel=onnxruntime_gpu-1.31.1-cp312-cp312-manylinux_2_28_x86_64.whl
  cat /tmp/ortgpu/chunk.* > /tmp/$wheel && python3 -m pip install -q --no-deps --target /tmp/ortsite /tmp/$wheel \
    || { log "onnxruntime-gpu did not install"; exit 1; }
  export PYTHONPATH=/tmp/ortsite:/tmp/site:$PWD
  nv=$(python3 -c 'import glob, site; print(":".join(sorted(glob.glob(site.getsitepackages()[0] + "/nvidia/**/lib", recursive=True))))')
  export LD_LIBRARY_PATH=$nv:${LD_LIBRARY_PATH:-}
  python3 -c 'import onnxruntime as o; print(o.__version__, o.get_available_providers())'
  while [ ! -f $WORK/make.done ]; do sleep 2; done  # the exports the first `part` started
  log "exports: exit $(cat $WORK/make.done)"; tail -3 $WORK/make.log; cp $WORK/make.log "$OUT/"
  log "GPU tests"
  timeout 240 python3 -m pytest -q -p no:cacheprovider tests/service/test_gpu.py tests/service/test_device_decoder.py \
    > "$OUT/pytest.log" 2>&1; tail -3 "$OUT/pytest.log"
  log "bench/gpu.py --phases $phases"
  PYTHONUNBUFFERED=1 python3 bench/gpu.py --work $WORK --out "$OUT" --phases "$phases" --requests 1024 \
    2> "$OUT/gpu.log"
  tail -40 "$OUT/gpu.log"
  if [ -n "${3:-}" ]; then
    log "bench/host_path.py (the host path with a null engine: one process, and --front-ends N on N of 1-15 server cores)"
    python3 bench/host_path.py --model-dir "$3" --cores 1,4,8,15 --client-cpus 15 --duration 6 --warmup 2 \
      --out "$OUT/host_path_gpu.json" --plot "$OUT/host_path_gpu.png" > "$OUT/host_path.log" 2>&1
    tail -12 "$OUT/host_path.log"
  fi
  ;;
*)
  echo "usage: $0 part N | main [PHASES]" >&2
  exit 2
  ;;
esac
