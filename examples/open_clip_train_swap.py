"""open_clip_train's own `main`, with distributed_clip's loss in `create_loss`'s place: the swap as a practitioner
makes it, runnable on a laptop CPU.

    torchrun --standalone --nproc-per-node 2 examples/open_clip_train_swap.py --loss distlab --out OUT
    torchrun --standalone --nproc-per-node 2 examples/open_clip_train_swap.py --loss open_clip --out OUT

Both runs train the same tiny CLIP (a one-layer ViT and text transformer, `TINY` below) for one epoch of `STEPS`
steps on the same seeded random images and captions, through open_clip_train 3.3.0's whole `main`: its argument
parsing, DDP wrapping, optimizer (timm's SGD with momentum), cosine schedule, `train_one_epoch` and its checkpoint
`OUT/<loss>/checkpoints/epoch_1.pt`. The only difference is the loss:

- `--loss open_clip`: open_clip's own `ClipLoss` with `--local-loss --gather-with-grad`, the exact gradient of the
  symmetric InfoNCE over the global batch of N = P C pairs (open_clip's C x N logits per rank);
- `--loss distlab`: `distributed_clip.ClipLoss`, the same gradient streamed in O(N d) memory per rank.

So their final weights must agree, up to float32 rounding (the two sum the same terms in different orders):
`tests/test_open_clip_train_swap.py` runs both and compares every tensor of the two checkpoints.

The swap is one assignment, and where it is made matters. `open_clip_train/main.py` does
`from open_clip import create_loss`, so once it is imported its `create_loss` is a name in *its* namespace:
patching `open_clip.create_loss` then changes nothing. The patch is `open_clip_train.main.create_loss` (or an edit
of main.py's `loss = create_loss(args)`):

    import open_clip_train.main
    from distributed_clip import ClipLoss
    open_clip_train.main.create_loss = lambda args: ClipLoss(rank=args.rank, world_size=args.world_size)

The data: open_clip's `--dataset-type synthetic` is one black image and one caption repeated, whose loss is ln N
with a gradient of about 0: it cannot show a loss working. So `get_data` is replaced (in main's namespace too, for
the same reason) by `random_pairs`: seeded random images and token ids, each rank reading its C pairs of every step.

One more thing only a CPU needs: open_clip_train 3.3.0 wraps the model as `DistributedDataParallel(model,
device_ids=[device])`, which torch refuses for a module on the CPU ("device_ids ... only work with ... GPU modules");
`cpu_ddp` drops `device_ids` there (on GPUs nothing is patched).
"""

from __future__ import annotations

import argparse
import sys

import torch
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

TINY = {  # an open_clip model config: small enough for a CPU, every part of CLIP present
    "embed_dim": 16,
    "vision_cfg": {"image_size": 16, "layers": 1, "width": 32, "head_width": 16, "patch_size": 8},
    "text_cfg": {"context_length": 8, "vocab_size": 64, "width": 32, "heads": 2, "layers": 1},
}
MODEL = "distlab-tiny"
C = 4  # pairs per rank per step (open_clip_train's --batch-size)
STEPS = 3  # steps in the one epoch
SEED = 0


def random_pairs(args, preprocess_fns, epoch=0, tokenizer=None) -> dict:
    """`get_data`'s replacement: {"train": DataInfo} over N = P C STEPS seeded random (image, caption) pairs,
    rank r reading its C pairs of every step (DistributedSampler, in order)."""
    from open_clip_train.data import DataInfo

    gen = torch.Generator().manual_seed(SEED)
    pairs = args.world_size * C * STEPS
    size, context = TINY["vision_cfg"]["image_size"], TINY["text_cfg"]["context_length"]
    images = torch.randn(pairs, 3, size, size, generator=gen)
    texts = torch.randint(1, TINY["text_cfg"]["vocab_size"], (pairs, context), generator=gen)
    dataset = TensorDataset(images, texts)
    sampler = DistributedSampler(dataset, num_replicas=args.world_size, rank=args.rank, shuffle=False)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, drop_last=True)
    loader.num_batches, loader.num_samples = len(loader), len(loader) * args.batch_size * args.world_size
    return {"train": DataInfo(loader, sampler)}


def cpu_ddp() -> None:
    """Let open_clip_train's `DistributedDataParallel(model, device_ids=[device])` run on the CPU: main reads the class
    from `torch.nn.parallel` at the call, so a subclass there that leaves out CPU device_ids is what it gets."""
    from torch.nn.parallel import DistributedDataParallel

    class CpuDistributedDataParallel(DistributedDataParallel):
        def __init__(self, module, device_ids=None, **kwargs):
            if device_ids and all(torch.device(d).type == "cpu" for d in device_ids):
                device_ids = None  # what torch asks of a CPU module
            super().__init__(module, device_ids=device_ids, **kwargs)

    torch.nn.parallel.DistributedDataParallel = CpuDistributedDataParallel


def train_args(loss: str, logs: str) -> list[str]:
    """open_clip_train's flags for the run: fp32 on the CPU, gloo, no warmup, the checkpoint of the last epoch."""
    return [
        f"--model={MODEL}",
        "--dataset-type=synthetic",  # main builds its optimizer only for training data; random_pairs is the data
        f"--batch-size={C}",
        "--epochs=1",
        "--opt=timm/sgd",  # SGD, not AdamW: Adam divides by sqrt(v), so a gradient that is 0 up to rounding
        "--momentum=0.9",  # (the attention key bias's) moves its weight by lr either way, and two losses' runs apart
        "--lr=0.1",
        "--warmup=0",
        "--wd=0.1",
        "--precision=fp32",
        "--device=cpu",
        "--dist-backend=gloo",
        "--workers=0",
        f"--seed={SEED}",
        f"--logs={logs}",
        f"--name={loss}",
        "--save-frequency=1",
        "--log-every-n-steps=1",
        "--local-loss",  # open_clip's exact global gradient (distlab's module reads neither flag)
        "--gather-with-grad",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--loss", choices=("distlab", "open_clip"), required=True, help="whose loss trains")
    parser.add_argument("--out", required=True, metavar="DIR", help="open_clip_train's --logs")
    args = parser.parse_args()

    import open_clip
    import open_clip_train.main as train_main

    open_clip.factory._MODEL_CONFIGS[MODEL] = TINY  # a config open_clip's create_model finds by name
    train_main.get_data = random_pairs  # main's own name: `from open_clip_train.data import get_data`
    if not torch.cuda.is_available():
        cpu_ddp()
    if args.loss == "distlab":
        from distributed_clip import ClipLoss

        # main.py did `from open_clip import create_loss`: only its own name is the one it calls
        train_main.create_loss = lambda a: ClipLoss(rank=a.rank, world_size=a.world_size)
    sys.exit(train_main.main(train_args(args.loss, args.out)))


if __name__ == "__main__":
    main()
