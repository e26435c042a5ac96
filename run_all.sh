#!/usr/bin/env bash
# Every lesson in order, each under torchrun with its world size, then a summary table.
# A lesson exits non-zero when its claim does not hold; so does this script if any lesson did.
set -u
cd "$(dirname "$0")"
export OMP_NUM_THREADS=1  # one thread per rank, as torchrun would set (and without its banner)
# The lessons write into `tee`, not the terminal: tell them the terminal's width, so their tables fit it.
if [ -t 1 ] && [ -z "${COLUMNS:-}" ]; then COLUMNS=$(tput cols 2>/dev/null || echo 80); export COLUMNS; fi

# Lessons run in the order of lessons/order.txt, each found by its slug (lessons/NN_<slug>.py), so renumbering
# them (scripts/renumber.py) never touches this table. A lesson with no row here fails the run.
# lesson slug | world size | claim | extra arguments
LESSONS=(
  "model_parallel|4|split gradients and parameters equal the unsplit model's; one rank computes at a time|"
  "gpipe_checkpoint|2|GPipe with and without checkpointing equals the unsplit model; bubble (P-1)/(M+P-1); checkpointing's saved activations measured|"
  "one_f_one_b|4|1F1B equals the unsplit model; same bubble as GPipe; at most min(M, P-r) micro-batches in flight|--micro-batches 7"
  "torch_pipelining|4|PyTorch's ScheduleGPipe and Schedule1F1B equal ours and the unsplit model and run our order|"
  "interleaved_zero_bubble|4|interleaved 1F1B and zero bubble equal the unsplit model; bubbles match their formulas; torch's schedules of the same names agree and run our order|"
  "data_parallel|4|collectives = one process, ring bytes = formula; by hand, buckets, DDP, no_sync = one process; DDP's average: exact for a mean, 1/P for a global loss|"
  "sharding|4|model states per item = formulas; ZeRO-1/2/3 by hand and FSDP2 = one process; bytes and memory per rank = formulas; DCP resume at P bit-identical, at P/2 to 1e-12|"
  "tensor_parallel|4|f, g (by hand), f-bar, g-bar exact; MLP, attention by heads, block with sequence parallelism = unsplit; bytes and activations = formulas; parallelize_module = ours; 2 x 2 mesh step = one process|"
  "context_parallel|4|ring attention (zig-zag, causal and not) = SDPA on the whole sequence, forward and backward; zig-zag work equal per rank; bytes and memory per rank = formulas|"
  "activation_offloading|1|saved tensors to a host pool and back, prefetched one group ahead, on the emulated device: gradients = no offloading = save_on_cpu bit for bit; bytes each way = lesson 07's formula; device peaks = formulas; timelines and recomputation beside it|"
  "powersgd|2|PowerSGD by hand as a DDP comm hook = torch's powerSGD_hook (bit for bit at rho <= 2) and = the algebra in one process (bit for bit); differs from plain DDP; bytes (n + m) rho per matrix; loss at rho = 1, 2, 4|"
  "powersgd|4|the same at P = 4 (= one process to 1e-12)|"
  "contrastive_global|4|plain gather = exactly 1/P of the full-batch gradient; backward of P*L exact|"
  "contrastive_local_naive|4|plain gather's gradient is wrong (= detached blocks); its training, three seeds, against one process|"
  "contrastive_allgather_fix|4|all_reduce, reduce_scatter and torch's gather exact; largest tensor C x N, not N x N|"
  "grad_cache|2|GradCache equals the full batch in one process and the global batch under DDP (one reducing backward per tower); memory set by B; every sample forward twice|"
  "streamed_five_phase|2|streamed step's gradients equal the full batch's; no temporary beyond O(N d) + tiles|"
  "sigmoid_and_ring|4|sigmoid loss closed form = autograd; {InfoNCE, sigmoid} x {gather, ring} = the whole batch; bytes = formula; ring memory within a bound that does not grow with P, at 1.2-2x the gather's bytes|"
  "train_clip|2|step 1 of a CLIP trained with distributed_backward equals one process; held-out zero-shot top-1 >= 80% (8x chance)|"
  "train_clip|2|the same with the sigmoid loss (a learned bias) and the ring exchange|--loss sigmoid --exchange ring"
  "expert_parallel|4|expert parallelism (two all-to-alls, uneven splits) = one process, top-1/2, with drops; bytes = formula; L_aux from local counts and per-rank capacity shown wrong, the exchanged counts exact|"
  "expert_parallel|2|the same at P = 2|"
  "expert_parallel|3|the same at P = 3|"
  "ulysses|4|Ulysses (sequence split to head split and back by all-to-all) = SDPA on the whole sequence, causal and not, forward and backward; bytes 4(P-1)/P blocks each way, no more than ring attention's|"
  "ulysses|2|the same at P = 2|"
  "ulysses|3|the same at P = 3|"
  "composed_mesh|8|one transformer on a dp x pp x tp x cp mesh = one process at every P = 8 shape (2x2x2x1, cp with the others); bytes and memory per rank = formulas; DCP resume across shapes|"
  "cost|2|FLOPs, bytes held and bytes sent of four splits predicted from sizes = measured; time predicted beside measured; MFU the right way|"
  "fp8_linear|1|by hand = torchao Float8Linear bit for bit (Y, dX, dW, every training step); every matmul inside its a-priori bound; it splits no work, so P = 1|"
  "mxfp8_sharding|4|MX blocks of 32 (e8m0 scales) by hand = torchao MXFP8Linear (emulated) bit for bit; outliers under three scalings; FP8 all-gather with the amax agreed first = one process casting the whole weight, bit for bit; bytes (P-1)(Psi_P + 4) counted = formula; torchao's FSDP2 float8 pre-all-gather cast matched|"
  "mxfp8_sharding|2|the same at P = 2|"
  "async_tensor_parallel|4|all-gather + matmul as a ring of partial matmuls = all-gather then matmul bit for bit, matmul + reduce-scatter as a travelling sum to 1e-12, torch's symm_mem fallbacks agree; the async MLP = the unsplit MLP; bytes = plain TP's; on the emulated device every message hides under a partial matmul|"
  "async_tensor_parallel|2|the same at P = 2|"
  "dualpipe|4|DualPipeV as data (overlapped forward-backward pairs): ours on our runner and torch's ScheduleDualPipeV = the unsplit model; torch executes our order; bubble (P-1)/(6M+P-1) and 2P+1 in flight = the closed forms, beside ZB-V and 1F1B; DualPipe in both directions (two copies, mirrors summed) = the unsplit model, P+1 in flight|--micro-batches 8"
  "dualpipe|2|the same at P = 2|--micro-batches 4"
  "diloco|2|2 islands of 1: by hand = torchft DiLoCo (init_sync=False) = one-process islands bit for bit; the default's first-round heal reproduced; island 1 killed mid-round and healed = the reference with its round dropped; bytes S per round against DDP's H syncs|"
  "diloco|4|2 islands of 2 (DDP inside), streaming F = 2: the same bit for bit; rank m heals from island m mod 2; the lost island too|--fragments 2"
)

mkdir -p runs
summary=runs/summary.tsv
: > "$summary"
failed=0
while read -r slug; do
  case "$slug" in ''|'#'*) continue ;; esac
  file=$(cd lessons && ls [0-9][0-9]_"$slug".py 2>/dev/null)
  if [ -z "$file" ]; then
    printf '%s\t-\t%s\t%s\t0\n' "$slug" "lessons/order.txt names it" "FAIL (no lessons/NN_$slug.py)" >> "$summary"
    failed=1
    continue
  fi
  ran=0
  for entry in "${LESSONS[@]}"; do
    IFS='|' read -r name nproc claim extra <<< "$entry"
    [ "$name" = "$slug" ] || continue
    ran=1
    echo
    echo "=== torchrun --nproc-per-node $nproc lessons/$file $extra"
    log="runs/${file%.py}_p${nproc}${extra:+_${extra//[^a-z0-9]/}}.log"   # a second run of a lesson keeps its own log
    start=$SECONDS
    # --standalone: a private rendezvous on a free port, so two runs on one machine never collide.
    # shellcheck disable=SC2086
    torchrun --standalone --nproc-per-node "$nproc" "lessons/$file" $extra 2>&1 < /dev/null | tee "$log"
    status=${PIPESTATUS[0]}
    [ "$status" -eq 0 ] && result=PASS || { result="FAIL (exit $status)"; failed=1; }
    printf '%s\t%s\t%s\t%s\t%s\n' "${file%.py}" "$nproc" "$claim" "$result" "$((SECONDS - start))" >> "$summary"
  done
  if [ "$ran" -eq 0 ]; then
    printf '%s\t-\t%s\t%s\t0\n' "${file%.py}" "lessons/order.txt names it" "FAIL (no row in run_all.sh)" >> "$summary"
    failed=1
  fi
done < lessons/order.txt

python - "$summary" <<'PY'
import sys
from rich.table import Table
from distlab.processes.console import console
table = Table(title="distlab: every lesson, every claim", title_justify="left")
for col in ("lesson", "P", "claim", "result", "s"):
    table.add_column(col, justify="right" if col in ("P", "s") else "left", no_wrap=col != "claim")
for line in open(sys.argv[1]):
    lesson, nproc, claim, result, secs = line.rstrip("\n").split("\t")
    table.add_row(lesson, nproc, claim, f"[green]{result}[/]" if result == "PASS" else f"[red]{result}[/]", secs)
console.print(table)
PY
exit $failed
