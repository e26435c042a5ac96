"""Contrastive (CLIP) learning under data parallelism (lessons 21-24, 27): losses, gathers, the DDP step,
GradCache, costs and the CLIP on digits. The streamed step is its own package, `distlab.streamed`.

- `losses`, `gather`, `variants`, `step`: the symmetric InfoNCE, the gathers and what each does to the
  gradient, the variants of lessons 21-23 and one DDP step; `reference`: the single-process references;
- `grad_cache`, `measured_step`: GradCache (lesson 24) and one step's peak memory, rows forwarded and time;
- `batch`, `training`, `cost`, `report`: each rank's share, the training runs, a step's cost, the printouts;
- lesson 27's CLIP: `digits`, `digits_data`, `optim` (AdamW groups, warm-up + cosine), `checkpointing`
  (crash-resume checkpoints a killed rank cannot corrupt); `siglip_recipe`: open_clip's sigmoid recipe.

What may not live here: the streamed step (`distlab.streamed`) or anything another package needs (the ground
floor). It imports the ground floor only.
"""
