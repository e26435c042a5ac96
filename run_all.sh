#!/usr/bin/env bash
# Every lesson in order, each under torchrun with its world size, then a summary table.
# A lesson exits non-zero when its claim does not hold; so does this script if any lesson did.
set -u
cd "$(dirname "$0")"
export OMP_NUM_THREADS=1  # one thread per rank, as torchrun would set (and without its banner)
# The lessons write into `tee`, not the terminal: tell them the terminal's width, so their tables fit it.
if [ -t 1 ] && [ -z "${COLUMNS:-}" ]; then COLUMNS=$(tput cols 2>/dev/null || echo 80); export COLUMNS; fi

# lesson file | world size | claim | extra arguments
LESSONS=(
  "01_model_parallel.py|4|split gradients and parameters equal the unsplit model's; one rank computes at a time|"
  "02_gpipe_checkpoint.py|2|GPipe with and without checkpointing equals the unsplit model; bubble (P-1)/(M+P-1); checkpointing's saved activations measured|"
  "03_one_f_one_b.py|4|1F1B equals the unsplit model; same bubble as GPipe; at most min(M, P-r) micro-batches in flight|--micro-batches 7"
  "04_torch_pipelining.py|4|PyTorch's ScheduleGPipe and Schedule1F1B equal ours and the unsplit model and run our order|"
  "05_interleaved_zero_bubble.py|4|interleaved 1F1B and zero bubble equal the unsplit model; bubbles match their formulas; torch's schedules of the same names agree and run our order|"
  "06_data_parallel.py|4|collectives = one process, ring bytes = formula; by hand, buckets, DDP, no_sync = one process; DDP's average: exact for a mean, 1/P for a global loss|"
  "07_sharding.py|4|model states per item = formulas; ZeRO-1/2/3 by hand and FSDP2 = one process; bytes and memory per rank = formulas; DCP resume at P bit-identical, at P/2 to 1e-12|"
  "08_tensor_parallel.py|4|f, g (by hand), f-bar, g-bar exact; MLP, attention by heads, block with sequence parallelism = unsplit; bytes and activations = formulas; parallelize_module = ours; 2 x 2 mesh step = one process|"
  "09_context_parallel.py|4|ring attention (zig-zag, causal and not) = SDPA on the whole sequence, forward and backward; zig-zag work equal per rank; bytes and memory per rank = formulas|"
  "10_contrastive_global.py|4|plain gather = exactly 1/P of the full-batch gradient; backward of P*L exact|"
  "11_contrastive_local_naive.py|4|plain gather's gradient is wrong (= detached blocks); its training, three seeds, against one process|"
  "12_contrastive_allgather_fix.py|4|all_reduce, reduce_scatter and torch's gather exact; largest tensor C x N, not N x N|"
  "13_grad_cache.py|2|GradCache equals the full batch in one process and the global batch under DDP (one reducing backward per tower); memory set by B; every sample forward twice|"
  "14_streamed_five_phase.py|2|streamed step's gradients equal the full batch's; no temporary beyond O(N d) + tiles|"
  "15_sigmoid_and_ring.py|4|sigmoid loss closed form = autograd; {InfoNCE, sigmoid} x {gather, ring} = the whole batch; bytes = formula; ring memory within a bound that does not grow with P, at 1.2-2x the gather's bytes|"
  "16_train_clip.py|2|step 1 of a CLIP trained with distributed_backward equals one process; held-out zero-shot top-1 >= 80% (8x chance)|"
  "16_train_clip.py|2|the same with the sigmoid loss (a learned bias) and the ring exchange|--loss sigmoid --exchange ring"
  "17_expert_parallel.py|4|expert parallelism (two all-to-alls, uneven splits) = one process, top-1/2, with drops; bytes = formula; L_aux from local counts and per-rank capacity shown wrong, the exchanged counts exact|"
  "18_ulysses.py|4|Ulysses (sequence split to head split and back by all-to-all) = SDPA on the whole sequence, causal and not, forward and backward; bytes 4(P-1)/P blocks each way, no more than ring attention's|"
  "19_composed_mesh.py|8|one transformer on a dp x pp x tp x cp mesh = one process at every P = 8 shape (2x2x2x1, cp with the others); bytes and memory per rank = formulas; DCP resume across shapes|"
  "20_cost.py|2|FLOPs, bytes held and bytes sent of four splits predicted from sizes = measured; time predicted beside measured; MFU the right way|"
)

mkdir -p runs
summary=runs/summary.tsv
: > "$summary"
failed=0
for entry in "${LESSONS[@]}"; do
  IFS='|' read -r file nproc claim extra <<< "$entry"
  echo
  echo "=== torchrun --nproc-per-node $nproc lessons/$file $extra"
  log="runs/${file%.py}${extra:+_${extra//[^a-z0-9]/}}.log"   # a second run of a lesson keeps its own log
  start=$SECONDS
  # --standalone: a private rendezvous on a free port, so two runs on one machine never collide.
  # shellcheck disable=SC2086
  torchrun --standalone --nproc-per-node "$nproc" "lessons/$file" $extra 2>&1 | tee "$log"
  status=${PIPESTATUS[0]}
  [ "$status" -eq 0 ] && result=PASS || { result="FAIL (exit $status)"; failed=1; }
  printf '%s\t%s\t%s\t%s\t%s\n' "${file%.py}" "$nproc" "$claim" "$result" "$((SECONDS - start))" >> "$summary"
done

python - "$summary" <<'PY'
import sys
from rich.table import Table
from distlab.console import console
table = Table(title="distlab: every lesson, every claim", title_justify="left")
for col in ("lesson", "P", "claim", "result", "s"):
    table.add_column(col, justify="right" if col in ("P", "s") else "left", no_wrap=col != "claim")
for line in open(sys.argv[1]):
    lesson, nproc, claim, result, secs = line.rstrip("\n").split("\t")
    table.add_row(lesson, nproc, claim, f"[green]{result}[/]" if result == "PASS" else f"[red]{result}[/]", secs)
console.print(table)
PY
exit $failed
