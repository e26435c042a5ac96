"""One shape of a parallel run: how many ranks each dimension has, (dp, pp, tp, cp, ep), checked once, with
the names of its sub-meshes (torchtitan's `ParallelDims`). Lesson 12 builds its device mesh from it, lesson 13
and the cost model price it (`distlab.cost.inputs.Parallel` holds one beside the strategy: ZeRO stage,
schedule, recomputation), the planner parses `--layout dp=64,tp=8,pp=16` into it.

P = dp pp tp cp ranks. Expert parallelism adds no ranks: its ep ranks are taken from data parallelism (ep
divides dp, as torchtitan and DeepSeek-V3 lay it out), so an expert's weights live on dp / ep ranks of each
dp group, every other dense weight on all dp. The mesh lays the dimensions out outermost first (`LAYOUT`):
pipeline stages outermost, tensor parallelism innermost, so that the ranks of a tp group are neighbours (on a
GPU node: one NVLink island) and the pp group, which sends least, spans the farthest ranks. It is the one rank
order of the repository: lesson 12 builds its mesh in it, and the cost model picks each collective's link by
the ranks its group spans in it (`spans`: NVLink when they fit in a node). Rank r sits at

    r = ((i_pp dp + i_dp) cp + i_cp) tp + i_tp,

and the group of a dimension is every rank that differs from r in that coordinate alone. Its sub-meshes are
named by the dimension ("dp", "pp", "tp", "cp"), and "dp_cp" for FSDP2's (the ranks that hold the same
parameters and split the batch, W = dp cp).

What a shape must divide of a model and a batch is written here once (`check`), for whoever asks: lesson 12's
flags, the cost model's `distlab.cost.rules.check` (lesson 13, the planner's `--layout`) and the planner's
search. Each broken rule is one line that begins with what it blames ("tp: ..."); a caller that names flags
maps that word to its own flag. What a caller adds is its own and says why (lesson 12: an even cut into
stages, torch's 1F1B; the planner: the layouts it chooses to try).

    dp   the N sequences of a step; and N / dp into the M micro-batches ("micro_batches")
    pp   pp v stages of at least a layer each (v stages per rank; pipeline.partition cuts them as even as can be)
    tp   the h heads (the key/value heads under grouped-query attention), d_ff, an expert's width, the
         vocabulary V (embedding and head rows); under sequence parallelism also the seq / cp positions of a
         cp rank
    cp   seq into 2 cp pieces (the zig-zag split of lesson 09)
    ep   the experts (a mixture of experts: ep > 1 needs one), and dp (at construction)
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from distlab.proof.sizes import Transformer

DIMS = ("dp", "pp", "tp", "cp")  # how a shape is written: dp x pp x tp x cp
LAYOUT = ("pp", "dp", "cp", "tp")  # the mesh's dimensions, outermost first: the one rank order (lesson 12's mesh,
# the cost model's links, the planner's), torchtitan's and Megatron-LM's default (tp-cp-ep-dp-pp, innermost first)
SUBMESHES = (*LAYOUT, "dp_cp")


@dataclass(frozen=True)
class ParallelDims:
    """Degrees of data, pipeline, tensor, context and expert parallelism; P = dp pp tp cp (ep inside dp)."""

    dp: int = 1
    pp: int = 1
    tp: int = 1
    cp: int = 1
    ep: int = 1

    def __post_init__(self):
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{f.name}: must be a positive integer, got {value!r}")
        if self.dp % self.ep:
            raise ValueError(
                f"ep: expert parallelism takes its ranks from dp; ep = {self.ep} does not divide dp = {self.dp}"
            )

    def check(
        self,
        model: Transformer,
        global_batch: int,
        seq: int,
        micro_batches: int = 1,
        sequence_parallel: bool = True,
        stages_per_rank: int = 1,
    ) -> None:
        """Every rule of the module docstring for this shape on `model` (a layered MLP: only dp's and pp's) and
        N = `global_batch` sequences of `seq` tokens in M = `micro_batches`: the first one broken is raised as
        one ValueError that begins with the word it blames (dp, micro_batches, pp, tp, cp, ep)."""
        rows = global_batch // self.dp
        rules = [
            (global_batch % self.dp == 0, "dp", f"N = {global_batch} sequences do not split over dp = {self.dp}"),
            (
                rows % micro_batches == 0,
                "micro_batches",
                f"N / dp = {rows} sequences per data-parallel rank do not split into M = {micro_batches} micro-batches",
            ),
            (
                self.pp * stages_per_rank <= model.layers,
                "pp",
                f"pp x v = {self.pp * stages_per_rank} stages, but only {model.layers} layers",
            ),
        ]
        if isinstance(model, Transformer):
            rules += self._layer_rules(model, seq, sequence_parallel)
        for ok, blamed, message in rules:
            if not ok:
                raise ValueError(f"{blamed}: {message}")

    def _layer_rules(self, model: Transformer, seq: int, sequence_parallel: bool) -> list[tuple[bool, str, str]]:
        """tp's, cp's and ep's rules on a transformer's sizes (module docstring)."""
        heads = ("kv_heads", model.kv_heads) if model.kv_heads else ("heads", model.heads)
        widths = [heads, ("ffn", model.ffn), ("vocab", model.vocab)]
        widths += [("expert_ffn", model.expert_ffn)] if model.experts else []
        rules = [
            (value % self.tp == 0, "tp", f"tp = {self.tp} does not divide {name} = {value}") for name, value in widths
        ]
        rules.append(
            (
                self.cp == 1 or seq % (2 * self.cp) == 0,
                "cp",
                f"the zig-zag ring cuts seq = {seq} into 2 cp = {2 * self.cp} pieces: it does not",
            )
        )
        local = seq // self.cp
        rules.append(
            (
                not sequence_parallel or local % self.tp == 0,
                "tp",
                f"sequence parallelism cuts seq / cp = {local} positions over tp = {self.tp}: it does not",
            )
        )
        rules.append(
            (
                self.ep == 1 or model.experts > 0,
                "ep",
                "expert parallelism needs a mixture-of-experts model (experts > 0)",
            )
        )
        rules.append((model.experts % self.ep == 0, "ep", f"ep = {self.ep} does not divide {model.experts} experts"))
        return rules

    @property
    def size(self) -> int:
        """P, the ranks of the run."""
        return self.dp * self.pp * self.tp * self.cp

    @property
    def shards(self) -> int:
        """W = dp cp: the ranks that hold the same parameters and split the batch (rows or positions),
        over which FSDP2 shards the model states and averages the gradients."""
        return self.dp * self.cp

    def __str__(self) -> str:
        return "x".join(str(getattr(self, d)) for d in DIMS) + (f" ep{self.ep}" if self.ep > 1 else "")

    @classmethod
    def parse(cls, text: str, flag: str = "--shapes") -> ParallelDims:
        """'2x2x2x1' (dp x pp x tp x cp; a missing trailing degree is 1)."""
        parts = text.lower().split("x")
        if not 1 <= len(parts) <= 4 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise ValueError(f"{flag}: {text!r} is not a shape dp x pp x tp x cp of positive degrees, e.g. 2x2x2x1")
        return cls(*map(int, parts))

    @classmethod
    def parse_layout(cls, text: str, flag: str = "--layout") -> ParallelDims:
        """'dp=64,tp=8,pp=16' (any of dp, pp, tp, cp, ep, each once; a missing one is 1)."""
        degrees: dict[str, int] = {}
        for part in (p.strip() for p in text.split(",")):
            name, _, value = part.partition("=")
            name = name.strip().lower()
            if name not in (*DIMS, "ep") or not value.strip().isdigit() or int(value) < 1 or name in degrees:
                raise ValueError(
                    f"{flag}: {part!r} is not one of dp=, pp=, tp=, cp=, ep= with a positive degree, once each"
                )
            degrees[name] = int(value)
        try:
            return cls(**degrees)
        except ValueError as err:
            raise ValueError(f"{flag}: {err}") from None

    def spans(self) -> dict[str, int]:
        """How many consecutive ranks each dimension's group reaches across (`LAYOUT`): tp's tp, cp's tp cp,
        dp's tp cp dp, pp's all P; ep, the innermost ep of dp's ranks, tp cp ep. A group fits in a node of g
        ranks when its span is at most g (the members of rank 0's group are ranks below its span)."""
        out, stride = {}, 1
        for dim in reversed(LAYOUT):
            stride *= getattr(self, dim)
            out[dim] = stride
        out["ep"] = out["cp"] * self.ep
        return out

    def coordinates(self, rank: int) -> dict[str, int]:
        """Rank r's place on the mesh, by dimension name (the formula of the module docstring)."""
        out = {}
        for dim in reversed(LAYOUT):
            rank, out[dim] = divmod(rank, getattr(self, dim))
        return out

    def members(self, rank: int, dim: str) -> str:
        """'0,2': the ranks of `rank`'s group along sub-mesh `dim` (`SUBMESHES`), from the layout alone."""
        if dim not in SUBMESHES:
            raise ValueError(f"{dim!r} is not a sub-mesh; one of {', '.join(SUBMESHES)}")
        varies = ("dp", "cp") if dim == "dp_cp" else (dim,)
        at = self.coordinates(rank)
        same = [r for r in range(self.size) if all(self.coordinates(r)[d] == at[d] for d in LAYOUT if d not in varies)]
        return ",".join(map(str, same))
