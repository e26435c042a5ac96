#!/usr/bin/env bash
# distlab on one GPU: install, then (a) the library's step at P = 1 on cuda against plain autograd,
# (b) the multi-rank tests on CPU/gloo (GPU hidden) and the step at P = 2, 4, 8 on CPU/gloo against plain
# autograd, lesson 25 at P = 8; (c) every lesson at P = 1 with --device cuda (every one expected to pass),
# (d) time and memory of the streamed loss machinery against ClipLoss's C x N logits, (e) the peers
# (benchmarks/peers_gpu.py: open_clip, memeff, siglip-kernel at P = 1) and the kernels' benchmark
# (lessons 19 and 20 need an even P: step (c) runs them at P = 2 on the CPU, `gpu_check_env.py lesson`)
# (benchmarks/kernels_gpu.py, when the checkout has it).
#
#   bash benchmarks/gpu_check.sh --steps acde --budget 270      # on a lent GPU: one call of under 6 min
#   bash benchmarks/gpu_check.sh --cpu-dry-run                  # here, before a GPU is spent (5-7 min)
#
# --cpu-dry-run  everything on the CPU with small sizes, lessons in strict device mode (cpu:0 stands in for
#                the GPU: a tensor left on the host fails as on a GPU)
# --out DIR      where the results go (default: $OUT, else ./gpu_check_out); 10 files at most
# --repo DIR     the distlab checkout (default: the current directory)
# --python PY    the interpreter (default: python3); a CUDA torch is used as it is, else torch==2.13.0 is installed
# --quick        (d) at N = 8192 and 32768 only
# --steps abcde  which of (a)-(e) to run (default: all five), e.g. --steps d to rerun the timing alone
# --budget S     the whole check's seconds (default 470): each step's timeout is cut so that the steps after
#                it keep their share, and (d), then (e), get what is left
# The peers travel as wheels in the ignored folder .whl/ (`pip download --no-deps open-clip-torch memeff
# siglip-kernel -d .whl` where a registry is reachable; the device call carries it: carry [".whl"]); they
# are installed with `pip install --no-index --no-deps --target /tmp/site` and found on PYTHONPATH.
# What one GPU cannot show: NCCL puts one rank per GPU, so nothing here runs nccl with P >= 2 (no multi-rank
# nccl collectives, batch_isend_irecv, ring overlap, dead-peer naming or checkpoint barriers under nccl).
set -u
MODE=gpu; OUTDIR=${OUT:-./gpu_check_out}; REPO=$PWD; PY=python3; QUICK=0; STEPS=abcde; BUDGET=470
while [ $# -gt 0 ]; do
  case "$1" in
    --cpu-dry-run) MODE=cpu ;;
    --out) OUTDIR=$2; shift ;;
    --repo) REPO=$2; shift ;;
    --python) PY=$2; shift ;;
    --quick) QUICK=1 ;;
    --steps) STEPS=$2; shift ;;
    --budget) BUDGET=$2; shift ;;
    *) echo "unknown argument $1"; exit 2 ;;
  esac
  shift
done
REPO=$(cd "$REPO" && pwd); mkdir -p "$OUTDIR"; OUTDIR=$(cd "$OUTDIR" && pwd)
[ -d "$REPO/src/distlab" ] || { echo "no distlab checkout at $REPO (use --repo)"; exit 2; }
cd "$REPO"
T0=$SECONDS
ENV_LOG=$OUTDIR/env.txt; SUMMARY=$OUTDIR/summary.md
HELP=$(mktemp -d); trap 'rm -rf "$HELP"' EXIT
export PYTHONPATH="$REPO/src:$REPO/tests:$REPO/benchmarks${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 COLUMNS=120
export OMP_NUM_THREADS=1 DISTLAB_TIMEOUT_S=60
say() { echo "[$((SECONDS - T0)) s] $*" | tee -a "$ENV_LOG"; }
: > "$ENV_LOG"
say "mode $MODE, repo $REPO, out $OUTDIR"
{ date -u; uname -a; echo "cores: $(nproc --all)"; nvidia-smi -L 2>&1 | head -4; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | head -3; } >> "$ENV_LOG" 2>&1

# --- install -------------------------------------------------------------------------------------------
probe() { "$PY" "$REPO/benchmarks/gpu_check_env.py" probe 2>/dev/null; }
if [ "$MODE" = gpu ]; then
  read -r TV TCUDA TAVAIL TCOUNT <<< "$(probe)"
  if [ "${TAVAIL:-}" != True ]; then
    say "no CUDA torch in $PY (got: ${TV:-none}); installing torch==2.13.0 from PyPI into a venv (a CUDA 13.0 build: torch 527 MB + nvidia-* wheels, ~5.5 GB installed)"
    "$PY" -m venv "$HELP/venv" && PY=$HELP/venv/bin/python
    start=$SECONDS
    if ! timeout 420 "$PY" -m pip install -q torch==2.13.0 rich==15.0.0 numpy==2.4.6 pytest==9.2.0 pytest-timeout==2.4.0 \
         scikit-learn==1.9.1 matplotlib==3.11.2 pytest-xdist >> "$ENV_LOG" 2>&1; then
      say "FAIL: pip could not install torch==2.13.0 (no route to PyPI?): see env.txt"; exit 3
    fi
    say "pip install took $((SECONDS - start)) s"
    read -r TV TCUDA TAVAIL TCOUNT <<< "$(probe)"
  fi
  [ "${TAVAIL:-}" = True ] || { say "FAIL: torch ${TV:-?} sees no GPU"; exit 3; }
  DEV=cuda
  [ "${TV%%+*}" = 2.13.0 ] || say "NOTE: torch $TV, not the pinned 2.13.0: a failure below may be the version, not the GPU"
else
  read -r TV TCUDA TAVAIL TCOUNT <<< "$(probe)"
  [ -n "${TV:-}" ] || { echo "no torch in $PY"; exit 3; }
  DEV=cpu
fi
say "python $("$PY" -c 'import sys; print(sys.version.split()[0])'), torch $TV (CUDA ${TCUDA}), device $DEV, GPUs $TCOUNT"
MISSING=$("$PY" "$REPO/benchmarks/gpu_check_env.py" missing)
if [ -n "$MISSING" ]; then
  say "missing: $MISSING; trying pip (pinned versions)"
  timeout 240 "$PY" -m pip install -q rich==15.0.0 numpy==2.4.6 pytest==9.2.0 pytest-timeout==2.4.0 scikit-learn==1.9.1 \
    matplotlib==3.11.2 >> "$ENV_LOG" 2>&1 || say "pip could not install them; the steps that need them will fail"
fi
XDIST=""; CORES=$(nproc --all); "$PY" -c "import xdist" 2>/dev/null && [ "$CORES" -ge 8 ] && XDIST="-n $((CORES / 4))"
# The torch.distributed names the project calls: any the installed torch lacks is listed (a torch older than the
# pinned 2.13.0, as on an image that cannot reach PyPI). The gathers torch 2.11 names otherwise
# (all_gather_single, reduce_scatter_single, the functional all_gather_single_autograd) go through
# distlab.comm.compat, which takes whichever name the installed torch has; the list says so.
API=$("$PY" "$REPO/benchmarks/gpu_check_env.py" api)
[ -n "$API" ] && say "NOTE: this torch lacks what the project calls: $API"
COMPAT=""; case "$API" in *distlab.comm.compat*) COMPAT=" (2.11's collective names, through distlab.comm.compat)" ;; esac
# The peers, as wheels carried in .whl/ (no network here): installed into a folder of their own, last on the path.
SITE=/tmp/site; [ "$MODE" = cpu ] && SITE=$HELP/site
PEERS="no .whl/ folder: the peers were not carried"
if ls "$REPO"/.whl/*.whl > /dev/null 2>&1; then
  if "$PY" -m pip install -q --no-index --no-deps --target "$SITE" "$REPO"/.whl/*.whl >> "$ENV_LOG" 2>&1; then
    export PYTHONPATH="$PYTHONPATH:$SITE"; PEERS="installed from .whl/: $(cd "$REPO/.whl" && ls *.whl | tr '\n' ' ')"
  else
    PEERS="pip could not install .whl/ (see env.txt)"
  fi
fi
say "peers: $PEERS"
"$PY" -c "import distlab, distributed_clip" || { say "FAIL: distlab does not import"; exit 3; }


# --- (a) equivalence at P = 1 on the device -------------------------------------------------------------
# Each step's share of --budget (seconds): (a) a sixth, each lesson of (c) two fifths (they run side by side),
# (d) half of what is left after (c), (e) the rest. On the CPU the dry run's fixed sizes set the time.
A_CAP=$((BUDGET / 6)); [ "$A_CAP" -gt 240 ] && A_CAP=240; [ "$MODE" = cpu ] && A_CAP=240
say "(a) the step at P = 1 on $DEV against plain autograd (at most $A_CAP s)"
start=$SECONDS; RC_A=0; : > "$HELP/equiv.log"
if [[ $STEPS == *a* ]]; then timeout -k 10 "$A_CAP" "$PY" "$REPO/benchmarks/gpu_check_equiv.py" "$DEV" "$OUTDIR" > "$HELP/equiv.log" 2>&1; RC_A=$?; fi
cat "$HELP/equiv.log" >> "$ENV_LOG"; grep -E "PASS|FAIL|device|Error" "$HELP/equiv.log" | head -30
T_A=$((SECONDS - start))

# --- (b) multi-rank tests on CPU/gloo, GPU hidden (in the background, beside (c)) ----------------------
TESTS="tests/test_streamed.py tests/test_streamed_step.py tests/test_streamed_wrappers.py tests/test_streamed_guards.py
 tests/test_streamed_ring_wrappers.py tests/test_streamed_sigmoid_ring.py tests/test_streamed_sigmoid_ring_step.py
 tests/test_streamed_accum_freq.py tests/test_streamed_open_clip.py tests/test_streamed_readme.py tests/test_strict_device.py
 tests/test_strict_device_ranks.py tests/test_device_cuda_dry_run.py tests/test_runtime.py tests/test_losses_and_gathers.py
 tests/test_memory_and_rng.py tests/test_grad_cache.py tests/test_context_parallel.py"
[ "$MODE" = cpu ] && TESTS="tests/test_runtime.py tests/test_streamed_readme.py tests/test_strict_device.py"
say "(b) multi-rank tests on CPU/gloo (P = 1-4 ranks per test${XDIST:+, pytest $XDIST}), CUDA_VISIBLE_DEVICES empty"
start_b=$SECONDS
# shellcheck disable=SC2086
[[ $STEPS == *b* ]] || echo 0 > "$HELP/rc_b"
[[ $STEPS == *b* ]] && ( CUDA_VISIBLE_DEVICES= timeout -k 10 330 "$PY" -m pytest -q -p no:cacheprovider $XDIST -o addopts="-ra" $TESTS \
    > "$OUTDIR/pytest_cpu.log" 2>&1; echo $? > "$HELP/rc_b" ) &
PID_B=$!; [[ $STEPS == *b* ]] && touch "$OUTDIR/pytest_cpu.log"
# (b2) beside it: the library's step at P = 2, 4, 8 on CPU/gloo against plain autograd (the cases of (a)),
# then lesson 25 at P = 8 (gloo)
[[ $STEPS == *b* ]] || echo 0 > "$HELP/rc_b2"
[[ $STEPS == *b* ]] && ( export CUDA_VISIBLE_DEVICES=; timeout -k 10 240 "$PY" "$REPO/benchmarks/gpu_check_equiv.py" cpu "$OUTDIR" 2 4 8 > "$HELP/ranks.log" 2>&1
    rc=$?
    timeout -k 10 240 "$PY" -m torch.distributed.run --standalone --nproc-per-node 8 lessons/25_streamed_five_phase.py \
      --device cpu > "$HELP/lesson14_p8.log" 2>&1 || rc=$((rc + 100))
    echo $rc > "$HELP/rc_b2" ) &
PID_B2=$!

# --- (c) every lesson at P = 1 with --device $DEV, side by side; every one is expected to pass ----------------
mkdir -p "$HELP/lessons"
C_CAP=$((BUDGET * 2 / 5)); [ "$C_CAP" -gt 150 ] && C_CAP=150; [ "$MODE" = cpu ] && C_CAP=150
JOBS=3; [ "$CORES" -ge 12 ] && JOBS=6
# On the CPU the lessons run in strict device mode: cpu:0 stands in for cuda:0, and a tensor left on the host
# fails as it would on a GPU (lessons 25 and 26 were caught so before their first GPU run was read).
[ "$MODE" = cpu ] && export DISTLAB_STRICT_DEVICE=1
run_lesson() {  # lesson file -> one line: name rc seconds verdict
  local f=$1 name; name=$(basename "$f" .py); local s=$SECONDS
  # P = 1 on $DEV, except where gpu_check_env.py's LESSON_RUNS says otherwise (a shape for P = 1, lesson 05's
  # shorter emulated tick, and the two lessons that need an even P: P = 2 on the CPU, one GPU holding one rank)
  local lp ldev lflags; read -r lp ldev lflags <<< "$("$PY" "$REPO/benchmarks/gpu_check_env.py" lesson "$f" "$DEV")"
  local shape=(); read -r -a shape <<< "$lflags"
  timeout -k 10 "$C_CAP" "$PY" -m torch.distributed.run --standalone --nproc-per-node "$lp" "$f" --device "$ldev" \
    "${shape[@]}" --json "$HELP/lessons/$name.json" > "$HELP/lessons/$name.log" 2>&1
  local rc=$?
  local verdict; verdict=$(grep -E "PASS: every claim|FAIL: [0-9]+ of|^error:|Error:" "$HELP/lessons/$name.log" | tail -1 | cut -c1-150)
  printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - s))" "$verdict"
}
export -f run_lesson; export HELP DEV PY C_CAP REPO
LESSON_FILES=$(ls lessons/[0-9][0-9]_*.py)
[ "$MODE" = cpu ] && LESSON_FILES="lessons/02_gpipe_checkpoint.py lessons/03_one_f_one_b.py lessons/14_fp8_linear.py
 lessons/19_dualpipe.py lessons/23_contrastive_allgather_fix.py lessons/25_streamed_five_phase.py"
[[ $STEPS == *c* ]] || LESSON_FILES=""
say "(c) lessons at P = 1 with --device $DEV, $JOBS at a time, at most $C_CAP s each"
start=$SECONDS
# shellcheck disable=SC2086
printf '%s\n' $LESSON_FILES | grep . | xargs -r -P "$JOBS" -I{} bash -c 'run_lesson {}' | sort > "$HELP/lessons.tsv"
unset DISTLAB_STRICT_DEVICE
T_C=$((SECONDS - start)); RC_C=$(awk -F'\t' '$2!=0' "$HELP/lessons.tsv" | wc -l)
{ echo "# lessons at P = 1, --device $DEV: name, exit code, seconds, verdict line"; cat "$HELP/lessons.tsv"; echo;
  for f in "$HELP"/lessons/*.log; do echo "=== $(basename "$f")"; grep -E "PASS|FAIL|error|Error|Traceback" "$f" | head -40; done;
  for f in "$HELP"/lessons/*.log; do echo; echo "=== full log: $(basename "$f")"; tail -c 6000 "$f"; done; } > "$OUTDIR/lessons.log"
cat "$HELP/lessons.tsv"

say "waiting for (b)"
wait $PID_B; RC_B=$(cat "$HELP/rc_b" 2>/dev/null || echo 99)
wait $PID_B2; RC_B2=$(cat "$HELP/rc_b2" 2>/dev/null || echo 99); T_B=$((SECONDS - start_b))
tail -3 "$OUTDIR/pytest_cpu.log"; grep -E "^P = |FAIL" "$HELP/ranks.log" 2>/dev/null | head -20
{ echo; echo "=== lesson 25 at P = 8 on CPU/gloo"; grep -E "PASS|FAIL|rror" "$HELP/lesson14_p8.log" 2>/dev/null | head -20
  echo; echo "=== the step at P = 2, 4, 8 on CPU/gloo"; cat "$HELP/ranks.log" 2>/dev/null; } >> "$OUTDIR/lessons.log"

# --- (d) timing: streamed loss machinery vs ClipLoss ----------------------------------------------------
if [ "$MODE" = cpu ]; then SIZES="512 1024"; DIMARGS="--dim 64 --chunks 128 512 --repeats 1"
elif [ "$QUICK" = 1 ]; then SIZES="8192 32768"; DIMARGS="--dim 1024 --chunks 1024 4096 --repeats 3"
else SIZES="8192 32768 65536"; DIMARGS="--dim 1024 --chunks 1024 4096 --repeats 3"; fi
LEFT=$(((BUDGET - (SECONDS - T0)) / 2))   # within the budget: (d) gets half of what is left, (e) the rest
[[ $STEPS == *e* ]] || LEFT=$((BUDGET - (SECONDS - T0)))
if [ "$MODE" = gpu ] && [ "$LEFT" -lt 100 ]; then SIZES="8192 32768"; say "(d) shortened to N = $SIZES: $LEFT s for it"; fi
[ "$LEFT" -lt 45 ] && LEFT=45
[ "$MODE" = cpu ] && LEFT=300
say "(d) timing at N = $SIZES ($DIMARGS)"
start=$SECONDS
# shellcheck disable=SC2086
RC_D=0; : > "$HELP/timing.log"
if [[ $STEPS == *d* ]]; then
  timeout -k 10 "$LEFT" "$PY" "$REPO/benchmarks/gpu_check_timing.py" "$DEV" "$OUTDIR" --sizes $SIZES $DIMARGS --limit-s $((LEFT - 10)) > "$HELP/timing.log" 2>&1; RC_D=$?
fi
T_D=$((SECONDS - start))
cat "$HELP/timing.log" >> "$ENV_LOG"
[ -f "$OUTDIR/timing.md" ] && cat "$OUTDIR/timing.md" || tail -20 "$HELP/timing.log"

# --- (e) the peers, and the kernels' own benchmark when the checkout has it ------------------------------
# peers_gpu.py: distlab's loss machinery against open_clip, memeff and siglip-kernel at P = 1 (missing ones named).
# kernels_gpu.py (written beside the Triton kernels): called as `kernels_gpu.py DIR --budget S` (on the CPU
# `--cpu-dry-run` under TRITON_INTERPRET=1), it writes DIR/kernels_gpu.md and .json; the peers are on its PYTHONPATH too.
RC_E=0; T_E=0; : > "$HELP/peers.log"; : > "$HELP/kernels.log"
if [[ $STEPS == *e* ]]; then
  start=$SECONDS; LEFT=$((BUDGET - (SECONDS - T0))); [ "$LEFT" -lt 60 ] && LEFT=60; [ "$MODE" = cpu ] && LEFT=240
  KERNELS_BENCH=""; [ -f benchmarks/kernels_gpu.py ] && KERNELS_BENCH=benchmarks/kernels_gpu.py
  # The kernels first (three fifths of what is left: the measurement the GPU is lent for), then the peers.
  if [ -n "$KERNELS_BENCH" ]; then
    K_LEFT=$((LEFT * 3 / 5)); [ "$K_LEFT" -lt 60 ] && K_LEFT=60; [ "$MODE" = cpu ] && K_LEFT=180
    KARGS="--budget $((K_LEFT * 2 / 3))"; [ "$MODE" = cpu ] && KARGS="--cpu-dry-run"
    say "(e) $KERNELS_BENCH (at most $K_LEFT s), then the peers"
    # shellcheck disable=SC2086
    ( [ "$MODE" = cpu ] && export TRITON_INTERPRET=1; timeout -k 10 "$K_LEFT" "$PY" "$KERNELS_BENCH" "$OUTDIR" $KARGS ) \
      > "$HELP/kernels.log" 2>&1 || RC_E=2
  fi
  P_LEFT=$((BUDGET - (SECONDS - T0))); [ "$P_LEFT" -lt 60 ] && P_LEFT=60; [ "$MODE" = cpu ] && P_LEFT=120
  if [ "$MODE" = cpu ]; then PSIZES="256 512"; PARGS="--dim 32 --repeats 1"
  elif [ "$P_LEFT" -lt 90 ]; then PSIZES="16384"; PARGS="--dim 1024 --repeats 3"
  else PSIZES="16384 65536"; PARGS="--dim 1024 --repeats 3"; fi
  say "(e) peers at N = $PSIZES (at most $P_LEFT s)"
  # shellcheck disable=SC2086
  timeout -k 10 "$P_LEFT" "$PY" benchmarks/peers_gpu.py --out "$HELP" --device "$DEV" --sizes $PSIZES $PARGS \
    --limit-s $((P_LEFT - 40)) > "$HELP/peers.log" 2>&1 || RC_E=$((RC_E + 1))
  [ -f "$HELP/peers.json" ] && cp "$HELP/peers.json" "$OUTDIR/peers.json"
  T_E=$((SECONDS - start))
  cat "$HELP/peers.log" "$HELP/kernels.log" >> "$ENV_LOG"
  [ -f "$HELP/peers.md" ] && cat "$HELP/peers.md" || tail -20 "$HELP/peers.log"
fi

# --- summary --------------------------------------------------------------------------------------------
DRY_STRICT=""; [ "$MODE" = cpu ] && DRY_STRICT="; CPU: strict device mode"
status() { [[ $STEPS == *$1* ]] || { echo skipped; return; }; [ "$2" = 0 ] && echo PASS || echo "FAIL (exit $2)"; }
{
  echo "# distlab GPU check ($MODE): torch $TV$COMPAT, device $DEV, $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)"
  echo
  echo "| step | result | seconds |"
  echo "|---|---|---:|"
  echo "| (a) step at P = 1 on $DEV = plain autograd (float64, float32, bf16; InfoNCE/sigmoid, gather/ring, recompute with dropout, strict mode) | $(status a $RC_A) | $T_A |"
  echo "| (b) multi-rank tests on CPU/gloo | $(status b "$RC_B"): $(grep -E '[0-9]+ (passed|failed)' "$OUTDIR/pytest_cpu.log" 2>/dev/null | tail -1) | $T_B |"
  echo "| (b2) the step at P = 2, 4, 8 on CPU/gloo = plain autograd; lesson 25 at P = 8 | $(status b "$RC_B2"): $(grep -c PASS "$HELP/ranks.log" 2>/dev/null) PASS, $(grep -c FAIL "$HELP/ranks.log" 2>/dev/null) FAIL; lesson 25: $(grep -E 'PASS: every|FAIL: [0-9]' "$HELP/lesson14_p8.log" 2>/dev/null | tail -1) | $T_B |"
  echo "| (c) lessons at P = 1, --device $DEV (every one expected to pass; 19, 20 at P = 2 on the CPU${DRY_STRICT}) | $(awk -F'\t' '$2==0' "$HELP/lessons.tsv" | wc -l) of $(wc -l < "$HELP/lessons.tsv") exit 0$(awk -F'\t' '$2!=0 {printf "; FAIL %s", $1}' "$HELP/lessons.tsv") | $T_C |"
  echo "| (d) timing | $(status d $RC_D) | $T_D |"
  echo "| (e) peers ($PEERS)${KERNELS_BENCH:+ and $KERNELS_BENCH} | $(status e $RC_E) | $T_E |"
  echo "| total | | $((SECONDS - T0)) |"
  echo
  echo "## (a)"; echo '```'; grep -E "PASS|FAIL|device" "$HELP/equiv.log"; echo '```'
  echo "## (c)"; echo '```'; cat "$HELP/lessons.tsv"; echo '```'
  echo "## (d)"; [ -f "$OUTDIR/timing.md" ] && cat "$OUTDIR/timing.md"
  echo "## (e)"; [ -f "$HELP/peers.md" ] && cat "$HELP/peers.md"; [ -f "$OUTDIR/kernels_gpu.md" ] && cat "$OUTDIR/kernels_gpu.md"
} > "$SUMMARY"
# The device tool brings back at most 8 files: past 7, the JSON records travel as one archive.
if [ "$(find "$OUTDIR" -maxdepth 1 -type f | wc -l)" -gt 7 ]; then
  (cd "$OUTDIR" && tar czf records.tar.gz ./*.json && rm -f ./*.json)
fi
say "done in $((SECONDS - T0)) s; results in $OUTDIR: $(ls "$OUTDIR" | tr '\n' ' ')"
head -12 "$SUMMARY"
[ "$RC_A" = 0 ] && [ "$RC_B" = 0 ] && [ "$RC_B2" = 0 ] && [ "$RC_C" = 0 ] && [ "$RC_D" = 0 ] && [ "$RC_E" = 0 ]
