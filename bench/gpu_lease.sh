#!/usr/bin/env bash
# One GPU lease (docs/gpu.md, "The next lease"): everything the next GPU session measures, in one
# run of about 8 minutes, each figure set in its own results file under $OUT, the earlier code as
# the baseline in the same run (the same tree with the new paths switched off: bench/gpu.py
# `decode_switch`), a failed phase logged and passed.
#
# The GPU machine reaches no package index and takes at most 64 MiB a call: the working tree
# (tracked files on disk and untracked files git does not ignore) plus the call's carried paths.
# So onnxruntime-gpu (a 255 MB wheel) travels in parts, the service's pure-Python dependencies as
# wheels, and the shipped models' ONNX graphs (179 MB tracked under models/; the lease exports its
# own) wait outside the checkout while the calls are made. The steps (docs/gpu.md, "The next lease"):
#
#   bash bench/gpu_lease.sh prepare   # here, once (needs PyPI): .ortgpu/partN and .whl/ (both in
#                                     # .gitignore); prints the calls to make
#   bash bench/gpu_lease.sh aside     # here: models/*/*.onnx (tracked) to the sibling folder
#                                     # ../<checkout>.models-aside (refused if it exists), then `size`
#   bash bench/gpu_lease.sh size      # here: what each call sends; exit 1 if one is over 64 MiB
#   bash bench/gpu_lease.sh part N    # there, one call per part, carrying .ortgpu/partN; the call
#                                     # of part 0 also carries .whl: it installs longdoc and the
#                                     # wheels and starts the exports in the background while the
#                                     # other parts travel
#   bash bench/gpu_lease.sh main      # there, right after the last part: the measurements
#   bash bench/gpu_lease.sh back      # here, after the last call: the graphs back (refused if that
#                                     # would overwrite a file); exit 1 unless `git status` is clean
#   bash bench/gpu_lease.sh dry-run   # here: `size`, then main's sequence on tiny models on the CPU
#                                     # (tests/test_bench_gpu.py); OUT=/tmp/gpu-dry and
#                                     # WORK=/tmp/gpu (the exports) unless set
#
# Results ($OUT, at most 8 files come back): lease.log, pytest.log, verify.json, encoder.json,
# qa_service.json, steps.json, summarize.json, host_path.json.
set -uo pipefail
# $OUT: the results (main: the device tool's, else /tmp/gpu-out); $WORK: checkpoints and exports
WORK=${WORK:-/tmp/gpu}
ORT_VERSION=1.31.1
ORT_WHEEL=onnxruntime_gpu-$ORT_VERSION-cp312-cp312-manylinux_2_28_x86_64.whl  # what prepare downloads
PART_MIB=${PART_MIB:-48}
LIMIT_SCALE=1  # dry-run: the phases' time limits times 10 (a shared 2-core CPU, not a GPU)
# the serve extra's packages the GPU machine's image lacks (pinned to what this project's venv
# runs), and FastAPI's optional opentelemetry import
WHEELS="fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0 pydantic==2.14.4 pydantic-core==2.50.5
pydantic-settings==2.16.3 python-dotenv==1.2.4 fastapi-offline==1.7.7 annotated-types==0.8.0
typing-inspection==0.4.5 typing-extensions==4.16.0 opentelemetry-api importlib-metadata"
LIMIT_MIB=64  # what one device call may send (the working tree and its carried paths)
log() { echo "[$(date +%H:%M:%S)] $*"; }
top() { git rev-parse --show-toplevel; }
aside_dir() { local t; t=$(top) && echo "$(dirname "$t")/$(basename "$t").models-aside"; }

# size: what each lease call sends once the graphs are aside (the tracked files on disk, less
# models/*/*.onnx, the untracked files git does not ignore, shared/ if the checkout has one, and
# the call's carried paths); exit 1 if a call is over LIMIT_MIB
size() {
  python3 - "$(top)" "$LIMIT_MIB" <<'PY'
import os, subprocess, sys
top, limit_mib = sys.argv[1], int(sys.argv[2])
def ls(*args):
    out = subprocess.run(["git", "-C", top, "ls-files", "-z", *args], capture_output=True, text=True, check=True)
    return [f for f in out.stdout.split("\0") if f]
def files_under(rel):  # every file (a link as a link) under the path `rel`
    path = os.path.join(top, rel)
    if not os.path.isdir(path) or os.path.islink(path):
        return [rel] if os.path.lexists(path) else []
    return [os.path.relpath(os.path.join(d, f), top) for d, ds, fs in os.walk(path) for f in fs + [x for x in ds if os.path.islink(os.path.join(d, x))]]
def mib(files):
    return sum(os.lstat(os.path.join(top, f)).st_size for f in files if os.path.lexists(os.path.join(top, f))) / 2**20
aside = set(ls("models/*.onnx"))
tree = set(ls()) | set(ls("--others", "--exclude-standard")) | set(files_under("shared"))
here = [f for f in aside if os.path.lexists(os.path.join(top, f))]
state = f"{mib(here):.1f} MiB of models/*/*.onnx still here: run `aside` before the calls" if here else "the graphs are aside"
lease_tree = mib(tree - aside)
print(f"the working tree sends {lease_tree:.1f} MiB once the graphs are aside ({state})")
parts = sorted((p for p in os.listdir(os.path.join(top, ".ortgpu")) if p.startswith("part")), key=lambda p: int(p[4:])) \
    if os.path.isdir(os.path.join(top, ".ortgpu")) else []
calls = [(f"part {p[4:]}", [f".ortgpu/{p}"] + ([".whl"] if p == "part0" else [])) for p in parts] + [("main", [])]
if not parts:
    print("  (no .ortgpu/partN here: `prepare` makes them; only the tree is checked)")
over = []
for name, carry in calls:
    total = lease_tree + mib([f for c in carry for f in files_under(c)])
    print(f"  call `{name}`{' carrying ' + ', '.join(carry) if carry else ''}: {total:.1f} MiB of {limit_mib}")
    if total > limit_mib:
        over.append(name)
if over:
    sys.exit(f"over the device tool's {limit_mib} MiB a call: {', '.join(over)} (leave files out of the tree or carry less)")
print(f"every lease call fits in {limit_mib} MiB")
PY
}

# run NAME SECONDS CMD...: one phase under a time limit; its output goes to the lease log, a
# failure is logged and the lease goes on
run() {
  local name=$1 limit=$(($2 * LIMIT_SCALE)) start=$SECONDS
  shift 2
  log "$name"
  timeout "$limit" "$@"
  local rc=$?
  [ $rc -eq 0 ] || log "$name FAILED (exit $rc; 124 = over its ${limit} s)"
  log "$name done in $((SECONDS - start)) s"
}

# the measurements; $1 = bench/gpu.py's device, $2 = its other flags (--tiny, the QA service's
# --requests), $3 = the host path's cores and durations
measure() {
  local device=$1 tiny=$2 host=$3
  local tests=
  if [ "$device" != cpu ]; then  # the GPU tests; here the test suite is the CPU's
    (timeout 150 python3 -m pytest -q -p no:cacheprovider tests/service/test_gpu.py \
      tests/service/test_device_decoder.py > "$OUT/pytest.log" 2>&1; echo "pytest exit $?" >> "$OUT/pytest.log") &
    tests=$!
  fi
  # exactness of each new --sparse-gather export (verify against transformers; the default's is
  # the GPU tests'): beside the GPU tests, before anything is timed
  run "verify --device $device of each --sparse-gather export" 90 \
    python3 bench/gpu.py --work "$WORK" --out "$OUT" --name verify --device "$device" $tiny --phases verify \
    --gathers all-heads,onehot,window
  if [ -n "$tests" ]; then wait "$tests"; tail -2 "$OUT/pytest.log"; fi
  # encoder: the default at batch 1/8/32, each export at 32, the MatMul peak, kernels, the gather probe
  run "encoder" 120 python3 bench/gpu.py --work "$WORK" --out "$OUT" --name encoder --device "$device" $tiny \
    --phases ours,variants,peak,kernels,gathers
  # QA service at 32 clients (share of the offline rate: encoder.json's ours) and answers under load
  run "QA service" 70 python3 bench/gpu.py --work "$WORK" --out "$OUT" --name qa_service --device "$device" $tiny \
    --phases service
  # decode: per-token step at batch 1 and 8, then summaries alone, 8 and 32 clients, answers under
  # load; each as served and with the new paths switched off
  run "decode steps" 70 python3 bench/gpu.py --work "$WORK" --out "$OUT" --name steps --device "$device" $tiny \
    --phases steps
  run "summaries" 130 python3 bench/gpu.py --work "$WORK" --out "$OUT" --name summarize --device "$device" $tiny \
    --phases summarize
  # the host path with a null engine, the serving design that main has, 15 server cores and the
  # client on the 16th (issue 37's goal: 450 docs/s)
  run "host path" 60 python3 bench/host_path.py --model-dir models/qa $host --out "$OUT/host_path.json"
}

case "${1:-}" in
prepare)
  top=$(git rev-parse --show-toplevel) && cd "$top" || exit 1
  rm -rf .ortgpu .whl && mkdir -p .ortgpu/dl .whl
  platform="--python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64"
  python3 -m pip download -q --no-deps --only-binary=:all: $platform -d .ortgpu/dl "onnxruntime-gpu==$ORT_VERSION" || exit 1
  python3 -m pip download -q --no-deps --only-binary=:all: $platform -d .whl $WHEELS || exit 1
  wheel=$(ls .ortgpu/dl/*.whl) && basename "$wheel" > .ortgpu/wheel-name
  (cd .ortgpu/dl && split -b "${PART_MIB}M" -d -a 1 "$(basename "$wheel")" chunk. && rm "$(basename "$wheel")")
  n=0
  for chunk in .ortgpu/dl/chunk.*; do  # each part names the wheel (only the carried folder travels)
    mkdir -p .ortgpu/part$n && mv "$chunk" .ortgpu/part$n/ && cp .ortgpu/wheel-name .ortgpu/part$n/ && n=$((n + 1))
  done
  echo "prepared $n parts of at most $PART_MIB MiB in .ortgpu/ and $(ls .whl | wc -l) wheels in .whl/."
  echo "Here: bash bench/gpu_lease.sh aside. Then the calls, back to back:"
  echo "  carry [.ortgpu/part0, .whl]: bash bench/gpu_lease.sh part 0"
  for i in $(seq 1 $((n - 1))); do echo "  carry [.ortgpu/part$i]: bash bench/gpu_lease.sh part $i"; done
  echo "  bash bench/gpu_lease.sh main      (timeout_s 600)"
  echo "Here, after the last call: bash bench/gpu_lease.sh back"
  ;;
aside)
  top=$(top) && cd "$top" && dest=$(aside_dir) || exit 1
  [ ! -e "$dest" ] || { echo "refused: $dest exists (graphs from an earlier aside? bash bench/gpu_lease.sh back)" >&2; exit 1; }
  graphs=$(git ls-files 'models/*.onnx')
  [ -n "$graphs" ] || { echo "refused: no tracked models/*/*.onnx here" >&2; exit 1; }
  [ -z "$(git status --porcelain -- $graphs)" ] || { echo "refused: models/ has changes (git status -- models): commit or restore them first" >&2; exit 1; }
  for f in $graphs; do mkdir -p "$dest/$(dirname "$f")" && mv "$f" "$dest/$f" || exit 1; done
  echo "moved $(echo "$graphs" | wc -l) graphs ($(du -sh "$dest" | cut -f1)) to $dest; bash bench/gpu_lease.sh back restores them"
  size
  ;;
back)
  top=$(top) && cd "$top" && src=$(aside_dir) || exit 1
  [ -d "$src" ] || { echo "nothing to bring back: $src does not exist" >&2; exit 1; }
  moved=$(cd "$src" && find . -type f | sed 's|^\./||' | sort)
  clash=$(for f in $moved; do [ ! -e "$f" ] || echo "$f"; done)
  [ -z "$clash" ] || { echo "refused: these are in the checkout already (left as they are, and $src too):" $clash >&2; exit 1; }
  for f in $moved; do mkdir -p "$(dirname "$f")" && mv "$src/$f" "$f" || exit 1; done
  find "$src" -depth -type d -empty -delete
  [ ! -e "$src" ] || { echo "$src still holds files that were not moved back" >&2; exit 1; }
  left=$(git status --porcelain -- models)
  [ -z "$left" ] || { echo "models/ differs from git after back:"; echo "$left"; exit 1; } >&2
  echo "$(echo "$moved" | wc -l) graphs back in models/; git status -- models is clean"
  ;;
size)
  size
  ;;
part)
  mkdir -p /tmp/ortgpu "$WORK" && cp .ortgpu/part"$2"/chunk.* /tmp/ortgpu/ && ls -la /tmp/ortgpu
  cp .ortgpu/part"$2"/wheel-name /tmp/ortgpu/
  if [ -d .whl ] && [ ! -f "$WORK/make.started" ]; then
    touch "$WORK/make.started"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl || exit 1
    PYTHONPATH=/tmp/site python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null || exit 1
    # the exports need torch, transformers and onnx (all on that machine), not onnxruntime-gpu
    PYTHONPATH=/tmp/site setsid nohup bash -c "python3 bench/gpu.py --work $WORK --phases make \
      > $WORK/make.log 2>&1; echo \$? > $WORK/make.done" >/dev/null 2>&1 < /dev/null &
    log "exports started in the background"
  fi
  ;;
main)
  OUT=${OUT:-/tmp/gpu-out}
  mkdir -p "$OUT"
  exec > >(tee -a "$OUT/lease.log") 2>&1
  name=$(cat /tmp/ortgpu/wheel-name 2>/dev/null || echo $ORT_WHEEL)
  cat /tmp/ortgpu/chunk.* > "/tmp/$name" && python3 -m pip install -q --no-deps --target /tmp/ortsite "/tmp/$name" \
    || { log "onnxruntime-gpu did not install"; exit 1; }
  export PYTHONPATH=/tmp/ortsite:/tmp/site:$PWD PYTHONUNBUFFERED=1
  nv=$(python3 -c 'import glob, site; print(":".join(sorted(glob.glob(site.getsitepackages()[0] + "/nvidia/**/lib", recursive=True))))')
  export LD_LIBRARY_PATH=$nv:${LD_LIBRARY_PATH:-}
  python3 -c 'import onnxruntime as o; print(o.__version__, o.get_available_providers())'
  while [ ! -f "$WORK/make.done" ]; do sleep 2; done  # the exports the call of part 0 started
  log "exports: exit $(cat "$WORK/make.done")"; tail -4 "$WORK/make.log"
  measure cuda "--requests 1024" "--cores 15 --client-cpus 15 --duration 6 --warmup 2"
  log "lease done"
  ;;
dry-run)
  OUT=${OUT:-/tmp/gpu-dry} LIMIT_SCALE=10
  mkdir -p "$OUT"
  exec > >(tee -a "$OUT/lease.log") 2>&1
  size || { log "the lease calls do not fit: FAILED"; exit 1; }
  run "exports (tiny)" 90 python3 bench/gpu.py --work "$WORK" --tiny --device cpu --phases make
  measure cpu "--tiny --requests 16" "--cores 1 --duration 1 --warmup 0.5"
  log "lease done"
  ;;
*)
  echo "usage: $0 prepare | aside | size | part N | main | back | dry-run" >&2
  exit 2
  ;;
esac
