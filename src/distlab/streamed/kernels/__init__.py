"""Triton kernels for the streamed step's tile work: FlashAttention's idea applied to the contrastive loss.

The torch tiles (`distlab.streamed.torch_tiles`, `distlab.streamed.sigmoid`) make each T x T tile of S in memory and
then walk it with a dozen element-wise ops, each one a kernel launch that reads and writes the whole tile:
about 37 launches per T x T tile and 160 bytes per (i, j) of the C x N grid. Here the S tile lives in
registers: one launch walks every column block of a block of rows, makes each S tile from q and k
(`register_tile.s_tile`), uses it (folds it into the log-sum-exps, or turns it into coefficients and multiplies them
into G) and drops it. Per step the launches no longer grow with N / T, and what reaches memory is the
embeddings, the normalisers and G.

  `lse.row_lse`          phase 2: the rows' (m, l) of the online fold and their positives' logits; with
                         `columns`, the same tiles' column partials too (the ring's pass 1).
  `product.pair_product` phase 3: sum_j (R + Q - 2 delta)_ij k_j, S recomputed (G_x; G_y by swapping roles).
  `product.sigmoid_rows` the sigmoid loss: D k, and the sums of softplus(-eps S) and of D.
  `coefficients`         the same two products with W in memory (KERNELS "triton-mm"): a Triton GEMM whose
                         epilogue makes W, in chunks of rows, then torch's matmul W k (cuBLAS on GPUs).
  `s_in_memory`          S in memory (KERNELS "triton-s"): each chunk of S by one cuBLAS GEMM, then one
                         memory-bound Triton pass that folds it (`lse`'s kernel reading S) or writes W over it
                         in place, then the cuBLAS products; the ring's S kept from pass 1 for pass 2.

  `register_tile`        what every kernel shares: the S tile made in registers, the dot at the step's
                         precision, a log1p accurate for the sigmoid (the torch tiles' S tile lives in memory:
                         `distlab.streamed.torch_tiles`).
  `launch`               launching them: block sizes, the columns split across programs, each launch reported
                         to `distlab.proof.launch_count` (on the meta device counted and not run).
  `path_model`           a bytes-and-FLOPs model of the three paths (fused, W in memory, S in memory): each
                         one's floor at a shape from a card's measured rates.
  `tuning`               which blocks on which card: the winners measured per (card, d, path), committed as a
                         table, else a short timed search on a CUDA device's first use, cached on disk (never
                         on a CPU).

Every kernel takes float32, bf16 or fp16 embeddings (float64 under the interpreter), keeps its sums in float32
(float64), and multiplies as MATMUL_PRECISION says (`register_tile`). `distlab.streamed.kernel_choice` chooses
between these and the torch tiles (config key KERNELS). Triton is imported by these modules only, and only when
the Triton path is chosen: `import distlab` works without it.
"""
