"""The ``qkv bench`` command line.

    qkv bench                                   # the default run: T = 256, 512, 1024
    qkv bench --lengths 1024,4096 --dtypes float32 --passes forward --levels functional
    qkv bench --quick                           # a small subset in about a minute
    qkv bench --json out.json --plot out.png    # record the results
    qkv bench --decode                          # decoding's GB/s vs memory's; KV cache vs recompute
    qkv bench --decode-wall                     # decoding's GB/s vs memory's only
    qkv bench --memory-check                    # peak memory of a T = 32768 causal step
    qkv bench --auto                            # the calls that decide what "auto" picks
    qkv bench --arguments 4096                  # sinks, softcap, ALiBi, windows, documents
    qkv bench --isa avx2                        # flash's AVX2 build, torch held to AVX2 too
    qkv bench --compile                         # a GPT-style training step under torch.compile
    qkv bench --continuous                      # transformers' generate_batch: qkv vs sdpa
    qkv bench --generate                        # transformers' generate per token: qkv vs sdpa
    qkv bench --varlen                          # a packed varlen batch vs padding it
    qkv bench --paged                           # decoding against a paged vs a contiguous cache
    qkv bench --mods 4096                       # score_mod / mask_mod: skipping, compile, memory

The table goes to stdout; one progress line per case goes to stderr as the run goes on.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import Any

import torch

from qkv.backends.flash import kernel
from qkv.bench import arguments, auto, cases, continuous, decode, isa, memory, report, runs, timing
from qkv.bench import compile as compiled
from qkv.bench import generate as generate_bench
from qkv.bench import mods as mods_bench
from qkv.bench import paged as paged_bench
from qkv.bench import varlen as varlen_bench
from qkv.bench import wall as wall_bench

MATMUL_BUDGET_S = 1.0  # the whole matrix-multiply probe, all dtypes together

# The options that need an optional dependency: (option, what it is for, module, qkv's extra).
OPTIONAL = (
    ("plot", "--plot", "matplotlib", "explain"),
    ("continuous", "--continuous", "transformers", "hf"),
)


def configure(parser: argparse.ArgumentParser) -> None:
    """Add ``qkv bench``'s arguments to ``parser``."""
    parser.description = "qkv's attention backends against PyTorch's, measured in one run."
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = __doc__.split("\n\n")[1] + (
        "\n\nRatios are medians of interleaved repetitions in one run; run on an otherwise idle "
        "machine for stable numbers."
    )
    add = parser.add_argument
    add("--lengths", type=int_list, default=cases.DEFAULT_LENGTHS, help="T values (256,512,1024)")
    add(
        "--dtypes", type=choices(cases.DTYPES), default=tuple(cases.DTYPES), help="float32,bfloat16"
    )
    add(
        "--passes",
        type=choices(cases.PASSES),
        default=cases.PASSES,
        help="forward,forward+backward",
    )
    add(
        "--levels",
        type=choices(cases.LEVELS),
        default=cases.LEVELS,
        help="functional (attention vs SDPA), module (SelfAttention vs MultiheadAttention)",
    )
    add("--causal", choices=("both", "yes", "no"), default="both", help="causal cases (both)")
    add(
        "--backends",
        type=choices(cases.IMPLEMENTATIONS),
        default=("flash", "reference"),
        help="qkv backends to measure, comma-separated (default: flash,reference)",
    )
    add("--batch", type=positive, default=1, help="B (default 1)")
    add("--heads", type=positive, default=8, help="H (default 8)")
    add("--dim", type=positive, default=64, help="D per head (default 64)")
    add("--repeats", type=positive, default=5, help="timed repetitions (5)")
    add("--threads", type=positive, default=None, help="torch threads (default: torch's)")
    add(
        "--reference-max-length",
        type=int,
        default=1024,
        help="skip the reference backend above this T: it holds T×T scores (default 1024)",
    )
    add(
        "--max-case-seconds",
        type=float,
        default=10.0,
        help="fewer repetitions (at least 3) for cases that would take longer (default 10)",
    )
    add("--no-memory", action="store_true", help="skip the memory measurement")
    add("--quick", action="store_true", help="T = 256 and 1024, 3 repetitions, no memory")
    isa.add_arguments(parser)
    add("--json", metavar="PATH", help="write the results into this JSON file")
    add("--plot", metavar="PATH", help="write a PNG: time and memory vs T")
    configure_only_modes(parser)


def configure_only_modes(parser: argparse.ArgumentParser) -> None:
    """The modes that run one other benchmark instead of the table."""
    add = parser.add_argument
    add(
        "--decode",
        action="store_true",
        help="only: decoding's K+V bytes per second against the read bandwidth, then KV-cache "
        "decoding vs recomputing the prefix",
    )
    add(
        "--decode-wall",
        action="store_true",
        help="only: decoding's K+V bytes per second against the read bandwidth (no layer stack)",
    )
    add("--decode-tokens", type=positive, default=512, help="tokens to decode (512)")
    add("--auto", action="store_true", help='only: every backend on what decides backend="auto"')
    add(
        "--memory-check",
        type=positive,
        nargs="?",
        const=32768,
        default=None,
        metavar="T",
        help="only: peak memory of a fresh process running one causal float32 forward+backward "
        "of backend flash at length T (default 32768); then with a window of T/8 keys, and "
        "with 64 packed documents",
    )
    add(
        "--arguments",
        type=positive,
        nargs="?",
        const=4096,
        default=None,
        metavar="T",
        help="only: what sinks, softcap, alibi_slopes, window and segments cost on flash, "
        "against the plain causal call at length T (default 4096)",
    )
    add("--worker", help=argparse.SUPPRESS)
    configure_newer_modes(parser)


def configure_newer_modes(parser: argparse.ArgumentParser) -> None:
    """The modes of ``newer_modes``: compile, serving, your own attention rule."""
    add = parser.add_argument
    add(
        "--compile",
        type=positive,
        nargs="?",
        const=1024,
        default=None,
        metavar="T",
        help="only: training steps of a 4-layer GPT-style model (d_model = heads x dim) at "
        "length T (default 1024), compiled with torch.compile and eager, with qkv's attention "
        "and with torch's scaled_dot_product_attention",
    )
    add(
        "--continuous",
        type=positive,
        nargs="?",
        const=32,
        default=None,
        metavar="N",
        help="only: transformers' generate_batch of N requests (default 32, prompts of 16 to "
        '512 tokens, 32 new tokens each) on attn_implementation="qkv" against "sdpa"',
    )
    add(
        "--generate",
        type=positive,
        nargs="?",
        const=8192,
        default=None,
        metavar="PROMPT",
        help="only: greedy generate after a PROMPT-token prompt (default 8192), ms per token, "
        'attn_implementation="qkv" against "sdpa", with the dynamic and the static cache '
        f"(at least {generate_bench.ROUNDS} rounds)",
    )
    add(
        "--varlen",
        action="store_true",
        help="only: 16 sequences of 64 to 4,096 tokens (causal, float32) in one qkv.varlen_attn "
        "call against the batch padded to the longest through qkv.attention with a padding mask",
    )
    add(
        "--paged",
        action="store_true",
        help="only: one decoding step of 64 sequences of 1,024 tokens against a PagedKVCache "
        "(pages of 16) against the same step against a contiguous cache",
    )
    add(
        "--mods",
        type=positive,
        nargs="?",
        const=4096,
        default=None,
        metavar="T",
        help="only: score_mod / mask_mod on flash at length T (default 4096): block skipping, "
        "the compiled tile step, the gap to qkv's own arguments, and (unless --no-memory) the "
        "peak memory of a T = 16384 causal training step with a learned relative-bias score_mod",
    )


def run(args: argparse.Namespace) -> int:
    """Run what ``args`` asks for, print it, and record it with --json/--plot."""
    missing = missing_dependency(args)
    if missing is not None:
        print(f"qkv bench: {missing}", file=sys.stderr)
        return 2
    if args.settings is not None:  # the fresh process of an --isa run
        args = isa.settings(args.settings)
    if isa.needs_fresh_process(args.isa):
        return isa.rerun(args)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    shape = cases.Shape(args.batch, args.heads, args.dim)
    if args.worker is not None:
        print(json.dumps(memory.peak_memory_worker(json.loads(args.worker))))
        return 0
    record: dict[str, Any] = {"machine": report.machine(), "shape": asdict(shape)}
    record["build"] = {
        **kernel.build_info(),
        "torch_capability": torch.backends.cpu.get_cpu_capability(),
    }
    print(isa.describe(record["build"]), flush=True)
    if args.memory_check is not None:
        checks = [
            memory.memory_check(args.memory_check, shape, args.threads, variant)
            for variant in memory.VARIANTS
        ]
        record["memory_check"], record["memory_check_arguments"] = checks[0], checks[1:]
        for check in checks:
            print(memory.format_memory_check(check), flush=True)
    elif args.decode or args.decode_wall:
        record["decode_wall"] = wall_bench.wall_benchmark(max(args.repeats, wall_bench.ROUNDS))
        print(wall_bench.format_wall(record["decode_wall"]), flush=True)
        if args.decode:
            record["decode"] = decode.decode_benchmark(args.decode_tokens, repeats=args.repeats)
            print(decode.format_decode(record["decode"]))
    elif args.auto:
        record["auto"] = auto.auto_benchmark(args.repeats)
        print(auto.format_auto(record["auto"]))
    elif args.arguments is not None:
        rows = arguments.arguments_benchmark(args.arguments, shape, args.repeats, args.passes)
        record["arguments"] = rows
        print(arguments.format_arguments(rows, args.arguments, shape))
    elif not newer_modes(args, shape, record):
        table(args, shape, record)
    if args.json:
        report.write_json(args.json, record)
    return 0


def missing_dependency(args: argparse.Namespace) -> str | None:
    """What an option of ``args`` needs and cannot import (None if nothing), checked before
    anything is measured so that no run is lost to it."""
    for option, flag, module, extra in OPTIONAL:
        if getattr(args, option, None) in (None, False):
            continue
        try:
            importlib.import_module(module)
        except ImportError:
            return f'{flag} needs {module}, which is not installed: pip install "qkv[{extra}]"'
    return None


def newer_modes(args: argparse.Namespace, shape: cases.Shape, record: dict[str, Any]) -> bool:
    """Run the serving, compile and mods benchmarks if ``args`` asks for one (True if so)."""
    if args.continuous is not None:
        record["continuous"] = continuous.continuous_benchmark(
            args.continuous, repeats=args.repeats
        )
        print(continuous.format_continuous(record["continuous"]))
    elif args.generate is not None:
        record["generate"] = generate_bench.generate_benchmark(
            args.generate, repeats=max(args.repeats, generate_bench.ROUNDS)
        )
        record["generate"]["machine"] = record["machine"]
        print(generate_bench.format_generate(record["generate"]))
    elif args.varlen:
        record["varlen"] = varlen_bench.varlen_benchmark(repeats=args.repeats)
        print(varlen_bench.format_varlen(record["varlen"]))
    elif args.paged:
        record["paged"] = paged_bench.paged_benchmark(repeats=max(args.repeats, 7))
        print(paged_bench.format_paged(record["paged"]))
    elif args.compile is not None:
        model = compiled.ModelShape(
            d_model=shape.d_model, heads=shape.heads, length=args.compile, batch=shape.batch
        )
        record["compile"] = compiled.compile_benchmark(model, args.repeats)
        print(compiled.format_compile(record["compile"], record["machine"]))
    elif args.mods is not None:
        record["mods"] = mods_bench.mods_benchmark(args.mods, shape, args.repeats)
        record["mods"]["machine"] = record["machine"]
        if not args.no_memory:
            record["mods"]["memory"] = mods_bench.memory_check(16384, shape, args.threads)
        print(mods_bench.format_mods(record["mods"]))
    else:
        return False
    return True


def table(args: argparse.Namespace, shape: cases.Shape, record: dict[str, Any]) -> None:
    """The default mode: every case against PyTorch, printed as a table (and plotted), its
    results added to ``record``."""
    if args.quick:
        args.lengths, args.repeats, args.no_memory = (256, 1024), 3, True
    causal = {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]
    chosen = cases.make_cases(args.levels, args.passes, args.dtypes, causal, args.lengths)
    rates = matmul_rates(args.dtypes)
    settings = runs.Settings(
        args.repeats, args.max_case_seconds, args.reference_max_length, not args.no_memory
    )
    results = runs.measure(chosen, args.backends, shape, settings, rates)
    record.update(matmul_gflops=rates, results=[r.as_json() for r in results])
    print(report.format_table(results, record))
    if args.plot:
        report.plot(results, args.plot)


def matmul_rates(dtypes: Sequence[str], budget_s: float = MATMUL_BUDGET_S) -> dict[str, float]:
    """GFLOP/s of the matrix-multiply probe per dtype, all of them within ``budget_s``."""
    share = budget_s / max(1, len(dtypes))
    return {name: timing.matmul_rate(cases.DTYPES[name], share) for name in dtypes}


def int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None
    if any(value <= 0 for value in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def positive(text: str) -> int:
    (value,) = int_list(text)
    return value


def choices(options: Sequence[str] | dict[str, Any]) -> Callable[[str], tuple[str, ...]]:
    allowed = tuple(options)

    def parse(text: str) -> tuple[str, ...]:
        values = tuple(part.strip() for part in text.split(","))
        for value in values:
            if value not in allowed:
                raise argparse.ArgumentTypeError(
                    f"expected a comma-separated subset of {','.join(allowed)}, got {value!r}"
                )
        return values

    return parse
