#!/usr/bin/env bash
# The next GPU run, in one call (issues 35 and 45): run it first whenever a device is lent.
#   1. benchmarks/gpu_next.py: the kernel paths exact on the card (S in memory, KERNELS "triton-s", among them),
#      then timed against the H200 record's rows and this card's baselines (ring fold tiles, the in-place column
#      product, rows of W, the sigmoid epilogue, P = 1 ring against the cuBLAS floors, group S: S in memory), each
#      path's row beside its modelled floor (`kernels.path_model`), and the tile search once per kind and d,
#      printed as rows to commit (WINNERS; the S rows feed `tuning.S_IN_MEMORY_MEASURED`);
#   2. benchmarks/clip_batch.py --n-max 3840: open_clip's ViT-B-32 at its largest batch, then 4x and 16x it, time
#      per pair against the recipe's and peak memory; then the ring at fixed N for P = 1, 2, 4, 8 on the card;
#   3. lessons 05 and 13 at P = 1 on the device (05 with --emulate-ms 2.5: at P = 1 its emulated device sleeps
#      for all 16 layers a pass, 4x what run_all's P = 4 sleeps: 3 passes x 8 micro-batches x 16 layers x
#      10 ms x 3 steps x 5 schedules = 58 s of sleeps at the default 10 ms;
#      2.5 ms keeps P = 4's 40 ms a tick and the lesson's claims, which are about gradients, not the sleeps).
#
#   bash benchmarks/gpu_next.sh OUT                  # one H100 / H200, carry [".whl"] for siglip-kernel
#   bash benchmarks/gpu_next.sh OUT --cpu-dry-run    # here: the same steps, tiny, on the CPU
#
# --budget S  seconds for step 1's timed rows (default 150; the search gets half again). Writes OUT/next/,
# OUT/clip_batch/, OUT/lessons/*.log and OUT/summary.md; the tile cache of step 1 goes to OUT/tile_cache.json.
set -u
[ $# -ge 1 ] || { echo "usage: bash benchmarks/gpu_next.sh OUT [--cpu-dry-run] [--budget S]"; exit 2; }
OUTDIR=$1; shift; MODE=gpu; BUDGET=150; PY=${PY:-python3}
while [ $# -gt 0 ]; do
  case "$1" in
    --cpu-dry-run) MODE=cpu ;;
    --budget) BUDGET=$2; shift ;;
    *) echo "unknown argument $1"; exit 2 ;;
  esac
  shift
done
REPO=$(cd "$(dirname "$0")/.." && pwd); mkdir -p "$OUTDIR/lessons"; OUTDIR=$(cd "$OUTDIR" && pwd); cd "$REPO"
[ -d .whl ] && [ "$MODE" = gpu ] && "$PY" -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
export PYTHONPATH="$REPO/src:$REPO/benchmarks:/tmp/site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 COLUMNS=120
export OMP_NUM_THREADS=1 DISTLAB_KERNEL_CACHE=$OUTDIR/tile_cache.json
DEV=cuda; NEXT=(--budget "$BUDGET"); CLIP=(--n-max 3840); EMU=2.5
if [ "$MODE" = cpu ]; then DEV=cpu; NEXT=(--cpu-dry-run); CLIP=(--cpu-dry-run); export TRITON_INTERPRET=1; fi
T0=$SECONDS; RC=()
step() {  # name, then the command: its log in OUT, its exit code and seconds in the summary
  local name=$1 s=$SECONDS; shift
  "$@" > "$OUTDIR/$name.log" 2>&1; local rc=$?
  RC+=("| $name | $rc | $((SECONDS - s)) s |"); echo "[$((SECONDS - T0)) s] $name: exit $rc"
}
step next "$PY" benchmarks/gpu_next.py "$OUTDIR/next" "${NEXT[@]}"
step clip_batch "$PY" -m torch.distributed.run --standalone --nproc-per-node 1 benchmarks/clip_batch.py \
  "$OUTDIR/clip_batch" "${CLIP[@]}"
step lessons/05 "$PY" -m torch.distributed.run --standalone --nproc-per-node 1 lessons/05_interleaved_zero_bubble.py \
  --device "$DEV" --emulate-ms "$EMU"
step lessons/13 "$PY" -m torch.distributed.run --standalone --nproc-per-node 1 lessons/13_cost.py --device "$DEV"
{ echo "# gpu_next ($MODE), $(date -u)"; nvidia-smi -L 2>/dev/null | head -2; echo
  echo "| step | exit | seconds |"; echo "|---|---:|---:|"; printf '%s\n' "${RC[@]}"; echo
  for f in lessons/05 lessons/13; do echo "## $f"; grep -E "PASS|FAIL|rror" "$OUTDIR/$f.log" | head -30; echo; done
  [ -f "$OUTDIR/next/gpu_next.md" ] && cat "$OUTDIR/next/gpu_next.md"; } > "$OUTDIR/summary.md"
cat "$OUTDIR/summary.md"
! printf '%s\n' "${RC[@]}" | grep -qv '| 0 |'
