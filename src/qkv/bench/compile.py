"""``qkv bench --compile``: a training step of a small GPT-style model, compiled and eager, with
qkv's attention against torch's.

The model (legend: B batch, T sequence length, E = d_model, H heads, D = E / H, V vocabulary):
token and position embeddings (B, T) -> (B, T, E); ``layers`` pre-norm blocks, each LayerNorm,
one (E, 3E) projection to q, k, v (B, H, T, D), causal attention, the (E, E) output projection
and a residual, then LayerNorm, an MLP E -> 4E -> E with GELU and a residual; a final LayerNorm
and a (E, V) head; the loss is next-token cross-entropy on random tokens. Only the attention call
differs between variants: torch's ``scaled_dot_product_attention(is_causal=True)`` ("sdpa") and
``qkv.attention(causal=True)`` with backend "auto" and "flash". Every variant starts from the
same weights (same seed) and tokens, so their first losses agree (the check that all compute the
same model).

A step is forward, backward and an AdamW step. "compiled" wraps the model in ``torch.compile``
(inductor unless told otherwise), which compiles its forward and backward passes; the optimizer
step runs eagerly, the same for every variant. ``fullgraph=True`` is tried first; where it fails,
its reason is recorded and the model compiled without it, and the graph breaks of that
compilation are counted (``torch._dynamo.utils.counters["graph_break"]``). A variant that fails
altogether is reported with its reason, and the other rows still run.

The first steps of each row (compilation included) are not timed: their time is reported as
"first steps". Then every row's step takes turns (``timing.interleaved``) and medians are
compared: qkv's time over sdpa's in the same mode (below 1: qkv is faster).
"""

from __future__ import annotations

import functools
import math
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn
from torch._dynamo.utils import counters

import qkv
from qkv.bench.timing import interleaved, progress

Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
MODES = ("eager", "compiled")
SDPA = "sdpa"  # the baseline's name in the rows
LEARNING_RATE = 1e-4
WARM_UP_STEPS = 2  # untimed steps per row: compilation of the forward and backward, then one more
RECOMPILE_LIMIT = 64  # every variant and each fullgraph attempt compiles the same forward


def sdpa_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """torch's attention: q, k, v (B, H, T, D) -> (B, H, T, D)."""
    return nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


def qkv_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backend: str) -> torch.Tensor:
    """qkv's attention on ``backend``: q, k, v (B, H, T, D) -> (B, H, T, D)."""
    return qkv.attention(q, k, v, causal=True, backend=backend)


ATTENTIONS: dict[str, Attention] = {
    SDPA: sdpa_causal,
    "qkv auto": functools.partial(qkv_causal, backend="auto"),
    "qkv flash": functools.partial(qkv_causal, backend="flash"),
}


@dataclass(frozen=True)
class ModelShape:
    """The model and its batch."""

    layers: int = 4
    d_model: int = 512  # E
    heads: int = 8  # H
    vocab: int = 4096  # V
    length: int = 1024  # T
    batch: int = 1  # B

    def describe(self) -> str:
        return (
            f"{self.layers} layers, d_model {self.d_model}, {self.heads} heads, vocabulary "
            f"{self.vocab}, B={self.batch}, T={self.length}, float32"
        )


class Block(nn.Module):
    """A pre-norm transformer block: (B, T, E) -> (B, T, E)."""

    def __init__(self, d_model: int, heads: int, attention: Attention) -> None:
        super().__init__()
        self.heads, self.attention = heads, attention
        self.norm_attention, self.norm_mlp = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.out = nn.Linear(d_model, d_model)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, e = x.shape
        projected = self.qkv(self.norm_attention(x)).view(b, t, 3, self.heads, e // self.heads)
        q, k, v = projected.permute(2, 0, 3, 1, 4)  # each (B, H, T, D)
        attended = self.attention(q, k, v).transpose(1, 2).reshape(b, t, e)
        x = x + self.out(attended)
        out: torch.Tensor = x + self.mlp(self.norm_mlp(x))
        return out


class GPT(nn.Module):
    """Tokens (B, T) and targets (B, T) -> the mean next-token cross-entropy (a scalar)."""

    def __init__(self, shape: ModelShape, attention: Attention) -> None:
        super().__init__()
        e = shape.d_model
        self.embed, self.position = nn.Embedding(shape.vocab, e), nn.Embedding(shape.length, e)
        self.blocks = nn.ModuleList(Block(e, shape.heads, attention) for _ in range(shape.layers))
        self.norm, self.head = nn.LayerNorm(e), nn.Linear(e, shape.vocab, bias=False)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.embed(tokens) + self.position(positions)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))  # (B, T, V)
        return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


@dataclass
class Row:
    """One variant in one mode: its first loss, untimed first steps and timed steps."""

    attention: str
    mode: str  # "eager" or "compiled"
    first_loss: float = math.nan  # the loss of the first step, before any update
    first_steps_seconds: float = math.nan  # the untimed steps, compilation included
    seconds: list[float] = field(default_factory=list)
    vs_sdpa: float = math.nan  # median time over sdpa's in the same mode (below 1: faster)
    fullgraph: str | None = None  # compiled: "ok", or why fullgraph=True failed
    graph_breaks: int | None = None  # compiled: graph breaks of the compilation timed
    graphs: int | None = None  # compiled: graphs of the compilation timed
    failed: str | None = None  # why the row could not run at all

    @property
    def key(self) -> str:
        return f"{self.mode} {self.attention}"

    @property
    def median_ms(self) -> float:
        return statistics.median(self.seconds) * 1e3 if self.seconds else math.nan

    def as_json(self) -> dict[str, Any]:
        return {**asdict(self), "median_ms": self.median_ms}


Step = Callable[[], torch.Tensor]  # one training step; returns its loss


def training_step(
    model: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    optimizer: torch.optim.Optimizer,
    tokens: torch.Tensor,
    targets: torch.Tensor,
) -> Step:
    """Forward, backward and the optimizer's step of ``model`` on fixed tokens (B, T)."""

    def step() -> torch.Tensor:
        optimizer.zero_grad(set_to_none=True)
        loss = model(tokens, targets)
        torch.autograd.backward(loss)
        optimizer.step()
        return loss.detach()

    return step


def graph_counts() -> tuple[int, int]:
    """Graph breaks and graphs dynamo has counted so far in this process."""
    return sum(counters["graph_break"].values()), counters["stats"]["unique_graphs"]


def describe(error: BaseException, limit: int = 300) -> str:
    """``Type: first line of the message``, at most ``limit`` characters."""
    lines = str(error).strip().splitlines()
    text = f"{type(error).__name__}: {lines[0] if lines else ''}"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def build(
    shape: ModelShape, attention: Attention, seed: int, compiler: str | None, fullgraph: bool
) -> tuple[Callable[[torch.Tensor, torch.Tensor], torch.Tensor], torch.optim.Optimizer]:
    """The model with the weights of ``seed`` (compiled unless ``compiler`` is None) and its
    optimizer."""
    torch.manual_seed(seed)
    model = GPT(shape, attention)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE)
    if compiler is None:
        return model, optimizer
    return torch.compile(model, backend=compiler, fullgraph=fullgraph), optimizer


def warm_up(row: Row, step: Step) -> None:
    """The untimed first steps (compilation happens in the first): the first loss, their time."""
    started = time.perf_counter()
    row.first_loss = float(step())
    for _ in range(WARM_UP_STEPS - 1):
        step()
    row.first_steps_seconds = time.perf_counter() - started


def prepare(
    row: Row,
    attention: Attention,
    shape: ModelShape,
    data: tuple[torch.Tensor, torch.Tensor],
    compiler: str,
    seed: int,
) -> Step:
    """``row``'s training step, warmed up. Compiled: with ``fullgraph=True`` where that works,
    else (the reason recorded) without it; the graph breaks of the compilation kept counted."""
    if row.mode == "eager":
        step = training_step(*build(shape, attention, seed, None, False), *data)
        warm_up(row, step)
        return step
    breaks, graphs = graph_counts()
    try:
        step = training_step(*build(shape, attention, seed, compiler, True), *data)
        warm_up(row, step)
        row.fullgraph = "ok"
    except Exception as error:  # its reason is the result
        row.fullgraph = describe(error)
        torch._dynamo.reset()  # nothing kept from the failed attempt
        breaks, graphs = graph_counts()
        step = training_step(*build(shape, attention, seed, compiler, False), *data)
        warm_up(row, step)
    now_breaks, now_graphs = graph_counts()
    row.graph_breaks, row.graphs = now_breaks - breaks, now_graphs - graphs
    return step


def compile_benchmark(
    shape: ModelShape = ModelShape(),
    repeats: int = 5,
    *,
    attentions: Mapping[str, Attention] = ATTENTIONS,
    modes: Sequence[str] = MODES,
    compiler: str = "inductor",
    seed: int = 0,
) -> dict[str, Any]:
    """Every attention in every mode: first loss, untimed first steps, then ``repeats`` timed
    training steps per row, the rows taking turns; each row's median over sdpa's in its mode. A
    row that fails records why and is left out of the timing. A progress line per row."""
    generator = torch.Generator().manual_seed(seed)
    tokens, targets = (
        torch.randint(shape.vocab, (shape.batch, shape.length), generator=generator)
        for _ in range(2)
    )
    rows = [Row(name, mode) for mode in modes for name in attentions]
    with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):
        steps = prepare_rows(rows, attentions, shape, (tokens, targets), compiler, seed)
        for key, times in interleaved(steps, repeats).items():
            next(row for row in rows if row.key == key).seconds = times
    compare(rows)
    return {
        "model": asdict(shape),
        "optimizer": f"AdamW, lr {LEARNING_RATE}",
        "compiler": compiler,
        "threads": torch.get_num_threads(),
        "repeats": repeats,
        "rows": [row.as_json() for row in rows],
    }


def prepare_rows(
    rows: Sequence[Row],
    attentions: Mapping[str, Attention],
    shape: ModelShape,
    data: tuple[torch.Tensor, torch.Tensor],
    compiler: str,
    seed: int,
) -> dict[str, Step]:
    """The warmed-up step of every row that runs, by its key; the others' ``failed`` set.

    Each compiled row is compiled from a clean slate (``torch._dynamo.reset()``): otherwise a
    model would run code compiled for an earlier one (the same ``GPT.forward``, whose guards may
    pass), and its fullgraph result, graph breaks and compilation time would be the earlier
    model's. The resets drop the earlier rows' compiled code, so every row then takes one more
    untimed step, which compiles it again where needed (inductor's cache makes that quick).
    """
    steps: dict[str, Step] = {}
    for row in rows:
        if row.mode == "compiled":
            torch._dynamo.reset()
        try:
            steps[row.key] = prepare(row, attentions[row.attention], shape, data, compiler, seed)
        except Exception as error:  # reported; the other rows still run
            row.failed = describe(error)
        progress(f"{row.key}: " + (row.failed or f"first steps {row.first_steps_seconds:.1f} s"))
    for row in rows:
        if row.key in steps:
            try:
                steps[row.key]()
            except Exception as error:  # reported; the other rows still run
                row.failed = describe(error)
                del steps[row.key]
    return steps


def compare(rows: Sequence[Row]) -> None:
    """Each row's median time over sdpa's in the same mode (NaN without an sdpa row)."""
    for row in rows:
        baseline = next((r for r in rows if r.attention == SDPA and r.mode == row.mode), None)
        if baseline is not None and row.seconds and baseline.seconds:
            row.vs_sdpa = row.median_ms / baseline.median_ms


HEADER = (
    f"{'mode':<9} {'attention':<10} {'ms/step':>9} {'qkv/sdpa':>8} {'first steps':>11} "
    f"{'first loss':>10} {'graph breaks':>12} {'graphs':>6}  fullgraph=True"
)


def format_row(row: dict[str, Any]) -> str:
    """One row of the table: a failed row gives its reason instead of figures."""
    start = f"{row['mode']:<9} {row['attention']:<10} "
    if row["failed"] is not None:
        return start + f"failed: {row['failed']}"
    ratio = "" if row["attention"] == SDPA else f"{row['vs_sdpa']:.2f}x"
    compiled = row["mode"] == "compiled"
    breaks = str(row["graph_breaks"]) if compiled else ""
    graphs = str(row["graphs"]) if compiled else ""
    fullgraph = row["fullgraph"] if compiled else ""
    return start + (
        f"{row['median_ms']:>9.1f} {ratio:>8} {row['first_steps_seconds']:>9.1f} s "
        f"{row['first_loss']:>10.5f} {breaks:>12} {graphs:>6}  {fullgraph}"
    )


def format_compile(result: dict[str, Any], machine: Mapping[str, Any]) -> str:
    """The heading (model, CPU, threads, torch) and one line per row."""
    shape = ModelShape(**result["model"])
    heading = (
        f"qkv bench --compile: training steps (forward, backward, {result['optimizer']}) of a "
        f"GPT-style model, {shape.describe()}; {machine['processor']}, {result['threads']} "
        f"threads, torch {machine['torch']}, torch.compile backend {result['compiler']!r}; "
        f"medians of {result['repeats']} interleaved steps; qkv/sdpa: time over sdpa's in the "
        "same mode (below 1: qkv is faster); first steps (untimed): compilation included"
    )
    lines = [heading, "", HEADER, "-" * len(HEADER)]
    return "\n".join(lines + [format_row(row) for row in result["rows"]])
