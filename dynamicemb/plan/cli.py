"""``python -m dynamicemb.plan``: show, validate, generate and translate HugeCTR plan files."""

import argparse
import sys
from typing import Dict, List, Optional, Sequence

from dynamicemb.plan import generators
from dynamicemb.plan.format import LookupPlacement, PlacementKind, PlanGroup, load_plan

__all__ = ["build_parser", "main"]

_EPILOG = """\
examples:
  python -m dynamicemb.plan generate dp_and_localized --table-sizes 203931,4,18598,49 \\
      --num-gpus 2 -o plan.json
  python -m dynamicemb.plan generate greedy --table-sizes 203931,4,18598,49 --num-gpus 2 \\
      --dim 128 --memory-per-gpu 16000000000 -o plan.json
  python -m dynamicemb.plan validate plan.json --world-size 2 --num-lookups 4
  python -m dynamicemb.plan show plan.json --table-sizes 203931,4,18598,49 --dim 128
  python -m dynamicemb.plan translate plan.json --lookups user,item,item_hist,age \
      --tables users,items,items,ages --table-sizes 1000000,50000,50000,100 --dynamic users
"""

#: bytes of an embedding value of each ``--embedding-dtype``
_BYTES_PER_VALUE = {"fp32": 4, "fp16": 2, "bf16": 2}


def _positive_ints(text: str, option: str) -> List[int]:
    try:
        values = [int(part) for part in text.split(",")]
    except ValueError:
        values = []
    if not values or any(value < 1 for value in values):
        raise ValueError(f"{option}: expected comma-separated positive integers, got {text!r}")
    return values


def _table_bytes(args: argparse.Namespace) -> Optional[List[int]]:
    """size * dim * (bytes of an --embedding-dtype value) per table, or None when neither
    --table-sizes nor --dim is given."""
    if args.table_sizes is None and args.dim is None:
        return None
    if args.table_sizes is None or args.dim is None:
        raise ValueError("--table-sizes and --dim go together")
    if args.dim < 1:
        raise ValueError(f"--dim must be positive, got {args.dim}")
    value = _BYTES_PER_VALUE[args.embedding_dtype]
    return [size * args.dim * value for size in _positive_ints(args.table_sizes, "--table-sizes")]


def _gpu_bytes(placements: Dict[int, LookupPlacement], table_bytes: Sequence[int],
               num_gpus: int) -> List[float]:
    """Estimated table bytes per GPU: row-wise tables split evenly over their shards."""
    per_gpu = [0.0] * num_gpus
    for lookup, placement in placements.items():
        if lookup >= len(table_bytes):
            raise ValueError(f"lookup {lookup} has no table size (--table-sizes gives {len(table_bytes)})")
        share = table_bytes[lookup]
        if placement.kind == PlacementKind.ROW_WISE.value:
            share /= len(placement.ranks)
        for rank in placement.ranks:
            per_gpu[rank] += share
    return per_gpu


def _describe(k: int, group: PlanGroup) -> str:
    """One line of ``show``: ``group 0  mp  shard 1/8  lookups [0, 1]``."""
    shard = ""
    if group.shard_id is not None or group.shard_count is not None:
        shard_id = "-" if group.shard_id is None else group.shard_id
        count = "-" if group.shard_count is None else group.shard_count
        shard = f"  shard {shard_id}/{count}"
    return f"  group {k}  {group.strategy}{shard}  lookups {list(group.lookups)}"


def _show(args: argparse.Namespace) -> int:
    plan = load_plan(args.plan)
    table_bytes = _table_bytes(args)
    gpu_bytes = None
    if table_bytes is not None:
        gpu_bytes = _gpu_bytes(plan.placements(), table_bytes, plan.num_gpus)
    print(f"{args.plan}: {plan.num_gpus} GPUs, {plan.num_groups} groups")
    for gpu in range(plan.num_gpus):
        estimate = ""
        if gpu_bytes is not None:
            estimate = f"  ~{round(gpu_bytes[gpu]):,} bytes ({gpu_bytes[gpu] / 2 ** 20:.1f} MiB)"
        print(f"GPU {gpu}{estimate}")
        for k, group in enumerate(plan.groups(gpu)):
            print(_describe(k, group))
    return 0


def _validate(args: argparse.Namespace) -> int:
    plan = load_plan(args.plan)
    placements = plan.validate(world_size=args.world_size, num_lookups=args.num_lookups)
    print(f"ok: {plan.num_gpus} GPUs, {len(placements)} lookups placed")
    return 0


def _generate(args: argparse.Namespace) -> int:
    sizes = _positive_ints(args.table_sizes, "--table-sizes")
    if args.strategy == "dp_and_localized":
        plan = generators.dp_and_localized(sizes, args.num_gpus, args.dp_threshold)
    elif args.strategy == "distributed":
        plan = generators.distributed(sizes, args.num_gpus)
    else:
        if args.dim is None or args.memory_per_gpu is None:
            raise ValueError("greedy needs --dim and --memory-per-gpu")
        table_bytes = _table_bytes(args)
        plan = generators.greedy(table_bytes, args.num_gpus, args.memory_per_gpu)
    text = plan.to_json(spelling=args.spelling) + "\n"
    if args.output == "-":
        sys.stdout.write(text)
        return 0
    with open(args.output, "w", encoding="utf-8") as file:
        file.write(text)
    print(f"wrote {args.output}: {plan.num_gpus} GPUs, {len(plan.placements())} lookups placed")
    return 0


def _names(text: Optional[str], option: str) -> Optional[List[str]]:
    if text is None:
        return None
    names = [part.strip() for part in text.split(",")]
    if not all(names):
        raise ValueError(f"{option}: expected comma-separated names, got {text!r}")
    return names


def _translate(args: argparse.Namespace) -> int:
    """The TorchRec ShardingPlan of the plan file for an EmbeddingBagCollection from the flags."""
    import torch  # noqa: PLC0415
    from torch import nn  # noqa: PLC0415
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig  # noqa: PLC0415

    from dynamicemb.options import DynamicEmbTableOptions  # noqa: PLC0415
    from dynamicemb.plan.translate import to_sharding_plan  # noqa: PLC0415
    from dynamicemb.planner.types import DynamicEmbParameterConstraints  # noqa: PLC0415

    plan = load_plan(args.plan)
    count = len(plan.placements())
    lookups = _names(args.lookups, "--lookups") or [f"f{i}" for i in range(count)]
    tables = _names(args.tables, "--tables") or [f"t_{name}" for name in lookups]
    sizes = (_positive_ints(args.table_sizes, "--table-sizes") if args.table_sizes
             else [args.default_rows] * len(lookups))
    if not len(lookups) == len(tables) == len(sizes):
        raise ValueError(f"--lookups, --tables and --table-sizes must have one entry per "
                         f"lookup ({len(lookups)}, {len(tables)}, {len(sizes)})")
    features: Dict[str, List[str]] = {}
    rows: Dict[str, int] = {}
    for lookup, table, size in zip(lookups, tables, sizes):
        features.setdefault(table, []).append(lookup)
        rows[table] = max(rows.get(table, 0), size)
    model = nn.Module()
    model.ebc = EmbeddingBagCollection(tables=[
        EmbeddingBagConfig(name=t, num_embeddings=rows[t], embedding_dim=args.dim, feature_names=f)
        for t, f in features.items()], device=torch.device("meta"))
    dynamic = _names(args.dynamic, "--dynamic") or []
    unknown = sorted(set(dynamic) - set(features))
    if unknown:
        raise ValueError(f"--dynamic names tables that are not in --tables: {unknown}")
    constraints = {t: DynamicEmbParameterConstraints(
        use_dynamicemb=True, dynamicemb_options=DynamicEmbTableOptions(dim=args.dim, max_capacity=rows[t]))
        for t in dynamic}
    sharding_plan = to_sharding_plan(plan, model, lookups=lookups, constraints=constraints,
                                     device=args.device)
    print(sharding_plan)
    return 0


def _add_translate(commands: argparse._SubParsersAction) -> None:
    translate = commands.add_parser(
        "translate", help="print the TorchRec ShardingPlan of a plan file (needs TorchRec)")
    translate.add_argument("plan", help="plan file (JSON)")
    translate.add_argument("--lookups", help="feature name of each lookup, comma separated "
                           "(default f0, f1, ...)")
    translate.add_argument("--tables", help="table of each lookup, comma separated (default: one "
                           "table per lookup); lookups naming one table share it")
    translate.add_argument("--table-sizes", help="rows of each lookup's table, comma separated")
    translate.add_argument("--default-rows", type=int, default=1000,
                           help="rows per table without --table-sizes")
    translate.add_argument("--dim", type=int, default=128, help="embedding dimension")
    translate.add_argument("--dynamic", help="tables that are dynamic, comma separated")
    translate.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    translate.set_defaults(run=_translate)


def _add_embedding_dtype(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--embedding-dtype", choices=sorted(_BYTES_PER_VALUE), default="fp32",
                        help="the rows' dtype, for table bytes")


def _add_show(commands: argparse._SubParsersAction) -> None:
    show = commands.add_parser("show", help="list each GPU's groups and lookups")
    show.add_argument("plan", help="plan file (JSON)")
    show.add_argument("--table-sizes", help="rows per table, comma separated (lookup i is table i)")
    show.add_argument("--dim", type=int, help="embedding dimension, for the per-GPU byte estimate")
    _add_embedding_dtype(show)
    show.set_defaults(run=_show)


def _add_validate(commands: argparse._SubParsersAction) -> None:
    validate = commands.add_parser("validate", help="check a plan file; prints 'ok: ...' when valid")
    validate.add_argument("plan", help="plan file (JSON)")
    validate.add_argument("--world-size", type=int, help="the number of GPUs the plan must have")
    validate.add_argument("--num-lookups", type=int, help="the plan must place lookups 0..M-1 exactly")
    validate.set_defaults(run=_validate)


def _add_generate(commands: argparse._SubParsersAction) -> None:
    generate = commands.add_parser("generate", help="write a plan file from table sizes")
    generate.add_argument("strategy", choices=["dp_and_localized", "distributed", "greedy"])
    generate.add_argument("--table-sizes", required=True, help="rows per table, comma separated")
    generate.add_argument("--num-gpus", type=int, required=True)
    generate.add_argument("--dp-threshold", type=int, default=6000,
                          help="dp_and_localized: tables of at most this many rows are data parallel")
    generate.add_argument("--dim", type=int, help="greedy: embedding dimension (table bytes: rows * "
                          "dim * 4, or 2 with --embedding-dtype fp16/bf16)")
    _add_embedding_dtype(generate)
    generate.add_argument("--memory-per-gpu", type=int, help="greedy: bytes per GPU for tables")
    generate.add_argument("-o", "--output", default="-", help="output file ('-', the default: stdout)")
    generate.add_argument("--spelling", choices=["new", "old"], default="new",
                          help="shard keys shard_id/shards_count (new) or sharding_id/num_sharding (old)")
    generate.set_defaults(run=_generate)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser, one subcommand per ``_add_*`` function."""
    parser = argparse.ArgumentParser(
        prog="python -m dynamicemb.plan",
        description="Show, validate, generate and translate HugeCTR plan files (embedding "
                    "table placement).",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_show(commands)
    _add_validate(commands)
    _add_generate(commands)
    _add_translate(commands)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Runs the command line on ``argv`` (default ``sys.argv[1:]``). Returns 0, or 2 after one
    ``error: ...`` line on stderr for a bad file or bad arguments (argparse's errors exit 2 too)."""
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except (ValueError, OSError) as error:
        message = " ".join(str(error).splitlines())
        print(f"error: {message}", file=sys.stderr)
        return 2
