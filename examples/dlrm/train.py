"""Train a DLRM whose big tables are dynamic, under torchrun (`make demo` runs it).

Raw categorical ids go straight to the tables: dynamic tables (those of at least
``--dynamic-threshold`` rows) hash them to rows created on first sight; the other
tables stay TorchRec's static ones and see ``id mod rows``. The plan comes from
``DynamicEmbeddingShardingPlanner`` (or ``--plan-file``, a HugeCTR plan file).

Examples::

    # CPU, 2 ranks, synthetic Criteo-like data with a learnable ground truth
    torchrun --standalone --nproc_per_node 2 examples/dlrm/train.py --num-samples 200000
    # MovieLens-100K (the recbole wheel's files), user and item tables dynamic
    torchrun --standalone --nproc_per_node 2 examples/dlrm/train.py --data movielens \
        --dynamic-threshold 900 --batch-size 256 --epochs 3
    # GPUs (NCCL), Criteo day files, upstream's sizes; on each node (NODE_RANK 0, 1)
    torchrun --nnodes 2 --node_rank NODE_RANK --nproc_per_node 8 --master_addr HOST \\
        --master_port 29500 examples/dlrm/train.py \\
        --data tsv --train-files day_0,day_1 --eval-files day_23 --embedding-dim 128 \\
        --dense-arch 512,256,128 --over-arch 1024,1024,512,256,1
"""

import argparse
import itertools
import json
import logging
import os
import sys
import time
from datetime import timedelta
from typing import Dict, List, Optional, Set, Tuple

import torch
import torch.distributed as dist
import torchmetrics
from torchrec.datasets.utils import Batch as TorchRecBatch
from torchrec.distributed.comm import get_local_size
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner import Topology
from torchrec.optim.keyed import KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter

import checkpoint
import serving
from checks import check_eval_labels, check_files, check_rows, in_step
from data import CriteoParquetReader, CriteoTsvReader, DataError, SyntheticCriteo
from dynamicemb import DynamicEmbScoreStrategy
from dynamicemb.planner import DynamicEmbeddingShardingPlanner
from dynamicemb.shard import (
    DynamicEmbeddingBagCollectionSharder,
    DynamicEmbeddingCollectionSharder,
    flush_replicas,
    get_dynamic_tables,
    refresh_replicas,
    replicated_ids,
    threads_per_rank,
)
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from model import (EMBEDDING_DTYPES, build_model, constraints_for, num_dense, row_bytes,
                   table_specs, to_kjt)
from movielens import MovieLens
from partition import RoutedBatches
from dynamicemb.placement import TablePlacement, table_placement

OPTIMIZERS = {"sgd": (EmbOptimType.EXACT_SGD, 0), "adagrad": (EmbOptimType.EXACT_ADAGRAD, 1),
              "rowwise_adagrad": (EmbOptimType.EXACT_ROWWISE_ADAGRAD, 0),
              "adam": (EmbOptimType.ADAM, 2)}  # (type, optimizer state floats per dim)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__.split("Examples::")[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", choices=["synthetic", "tsv", "parquet", "movielens"], default="synthetic",
                   help="movielens: MovieLens-100K, a sample per rating (label: rating >= 4), "
                   "90%% trained on (shuffled by --seed), 10%% held out for eval")
    p.add_argument("--data-dir", help="movielens: a folder of RecBole's ml-100k.inter/.user/.item "
                   "or GroupLens' u.data/u.user/u.item (default: the recbole wheel's)")
    p.add_argument("--train-files", help="comma-separated files (tsv/parquet)")
    p.add_argument("--eval-files", help="comma-separated files (tsv/parquet)")
    p.add_argument("--num-samples", type=int, default=200_000,
                   help="synthetic training samples (movielens: all its training ratings)")
    p.add_argument("--eval-samples", type=int, default=20_000,
                   help="synthetic eval samples (movielens: all its held-out ratings)")
    p.add_argument("--scale", type=float, default=0.05, help="synthetic: Criteo cardinalities x this")
    p.add_argument("--alpha", type=float, default=1.05, help="synthetic: power-law exponent of ids")
    p.add_argument("--signal", type=float, default=1.0,
                   help="synthetic: strength of the hidden model (0: labels are noise)")
    p.add_argument("--seed", type=int, default=0, help="the model's initialization, synthetic "
                   "data, MovieLens' split and training order")
    p.add_argument("--batch-size", type=int, default=1024, help="per rank")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--eval-every", type=int, default=50, help="steps between evaluations")
    p.add_argument("--collection", choices=["ebc", "ec"], default="ebc",
                   help="EmbeddingBagCollection, or EmbeddingCollection + sum pooling")
    p.add_argument("--embedding-dim", type=int, default=16)
    p.add_argument("--embedding-dtype", choices=sorted(EMBEDDING_DTYPES), default="fp32",
                   help="the dynamic tables' rows (TorchRec data_type; 16-bit rows train "
                        "with stochastic rounding, optimizer states stay float32; static "
                        "tables stay fp32)")
    p.add_argument("--rounding", choices=["stochastic", "nearest"], default="stochastic",
                   help="how updates write 16-bit rows back")
    p.add_argument("--amp", action="store_true",
                   help="autocast the model in bfloat16 on a CPU, float16 on a GPU")
    p.add_argument("--dense-arch", default="64,16", help="bottom MLP widths (last = dim)")
    p.add_argument("--over-arch", default="64,32,1", help="top MLP widths (last = 1)")
    p.add_argument("--lr", type=float, default=0.05, help="embedding learning rate")
    p.add_argument("--dense-lr", type=float, default=0.01, help="Adagrad rate of the MLPs")
    p.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="adagrad")
    p.add_argument("--dynamic-threshold", type=int, default=1000,
                   help="tables of at least this many rows are dynamic (MovieLens' user and "
                   "item tables have 943 and 1,682 rows: 900 makes both dynamic)")
    p.add_argument("--cache-fraction", type=float, default=0.5,
                   help="device cache of a dynamic table, as a fraction of its rows (>= 1: no cache)")
    p.add_argument("--score-strategy", choices=["lru", "lfu"], default="lru")
    p.add_argument("--admission-threshold", type=int, default=1,
                   help="occurrences before a new id gets a row (1: admit all)")
    p.add_argument("--placement", help="placement file of examples/dlrm/partition.py: its ids "
                   "live on their rank, and every rank reads the global batches and keeps the "
                   "samples whose ids it owns most (all ranks read all samples)")
    p.add_argument("--replicas", type=_replicas, default=0,
                   help="hot-row replicas of each dynamic table (EC, or EBC where its row-wise "
                   "tables are all dynamic and deduplicated): an int >= 1 "
                   "(ids) or a fraction in (0, 1) of its stored rows; chosen from the owners' "
                   "scores (use --score-strategy lfu for the most frequent ids); 'placement': "
                   "the ids the --placement file lists as replicated (partition.py --replicas), "
                   "from the first step on, never changed (HET-GMP's mirrors); 0: none")
    p.add_argument("--replicas-refresh", type=int, default=20,
                   help="steps between choices of the replicated ids (at steps 1, 1 + N, ...)")
    p.add_argument("--staleness", type=int, default=0,
                   help="steps a replica may lag its owner (replica_staleness; needs --replicas "
                   "and --optimizer sgd, adagrad or rowwise_adagrad): replicated rows are read "
                   "from local copies and their gradients pushed every N steps; 0: synchronous")
    p.add_argument("--plan-file", help="HugeCTR plan file instead of the planner (lookup i = cat_i)")
    p.add_argument("--max-steps", type=int, default=0,
                   help="stop after this many steps in all, resumed ones included (0: run every epoch)")
    p.add_argument("--checkpoint-dir", help="save checkpoints here (two alternating slots)")
    p.add_argument("--checkpoint-every", type=int, default=0,
                   help="steps between checkpoints (0: only when the run ends)")
    p.add_argument("--resume", action="store_true",
                   help="continue from the newest checkpoint in --checkpoint-dir")
    p.add_argument("--serving-artifact", help="after training, write the exported inference "
                   "model here (examples/dlrm/serving.py)")
    p.add_argument("--backend", choices=["gloo", "nccl"], help="default: nccl on CUDA, else gloo")
    p.add_argument("--pg-timeout", type=float, default=300.0,
                   help="seconds a collective waits for the other ranks before the job fails "
                        "(PyTorch's default is 30 minutes)")
    p.add_argument("--out", default="benchmark/out/dlrm", help="summary.json and plot.png go here")
    args = p.parse_args(argv)
    if (args.resume or args.checkpoint_every) and not args.checkpoint_dir:
        p.error("--resume and --checkpoint-every need --checkpoint-dir")
    if args.pg_timeout <= 0:
        p.error("--pg-timeout must be > 0")
    if args.checkpoint_every < 0 or args.max_steps < 0:
        p.error("--checkpoint-every and --max-steps must be >= 0")
    if args.staleness < 0 or (args.staleness and not args.replicas):
        p.error("--staleness must be >= 0 and needs --replicas")
    if args.replicas == "placement" and not args.placement:
        p.error("--replicas placement needs --placement (a file of partition.py --replicas)")
    if args.data in ("tsv", "parquet") and not args.train_files:
        p.error(f"--data {args.data} needs --train-files")
    return args


def _replicas(text: str):
    """``--replicas``: an int count or a float fraction (the table option's two forms),
    or ``placement``."""
    if text == "placement":
        return text
    value = float(text)
    return int(value) if value >= 1 and value == int(value) else value


def datasets(args, rank: int, world: int):
    """The training and eval data of this rank, checked on every rank (``checks.py``):
    a missing, empty or unusable file, or a rank without a row, raises ``DataError``."""
    train, evals = _datasets(args, rank, world)
    check_rows(train, _describe(args, "train"))
    if evals is not None:
        check_rows(evals, _describe(args, "eval"))
    return train, evals


def _describe(args, which: str) -> str:
    """The data set named as on the command line, for messages."""
    if args.data == "synthetic":
        return f"--num-samples {args.num_samples}" if which == "train" else f"--eval-samples {args.eval_samples}"
    if args.data == "movielens":
        return f"--data movielens ({which} split of {args.data_dir or 'the recbole wheel'})"
    return f"--{which}-files {getattr(args, which + '_files')}"


def _datasets(args, rank: int, world: int):
    if args.placement:
        train, evals = _datasets_of(args, 0, 1, args.batch_size * world)
        return RoutedBatches(train, _placements(args, world), rank, world), _datasets_of(
            args, rank, world, args.batch_size)[1]
    return _datasets_of(args, rank, world, args.batch_size)


def _placements(args, world: int) -> Dict[int, TablePlacement]:
    """The dynamic tables' placements, by feature column (``--placement``)."""
    return {f: table_placement(args.placement, f"t_{t.feature}", world)
            for f, t in enumerate(table_specs(args)) if t.dynamic}


def _datasets_of(args, rank: int, world: int, batch_size: int):
    if args.data == "synthetic":
        train = SyntheticCriteo(args.num_samples, batch_size, scale=args.scale, alpha=args.alpha,
                                seed=args.seed, rank=rank, world_size=world, signal=args.signal)
        # held out: the same ids and hidden model, the samples after the training ones
        evals = SyntheticCriteo(args.eval_samples, args.batch_size, scale=args.scale, alpha=args.alpha,
                                seed=args.seed, rank=rank, world_size=world, signal=args.signal,
                                start=args.num_samples)
        return train, evals
    if args.data == "movielens":
        def split(name: str, size: int) -> MovieLens:
            return MovieLens(size, split=name, folder=args.data_dir, seed=args.seed, rank=rank,
                             world_size=world)

        return split("train", batch_size), split("eval", args.batch_size)
    reader = CriteoTsvReader if args.data == "tsv" else CriteoParquetReader
    check_files(args.train_files.split(","), "--train-files")
    if args.eval_files:
        check_files(args.eval_files.split(","), "--eval-files")
    train = reader(args.train_files.split(","), batch_size, rank=rank, world_size=world)
    evals = reader(args.eval_files.split(","), args.batch_size, rank=rank, world_size=world) \
        if args.eval_files else None
    return train, evals


def shard(args, model, tables, device: torch.device, world: int) -> DistributedModelParallel:
    optimizer, _ = OPTIMIZERS[args.optimizer]
    constraints = constraints_for(tables, args.embedding_dim,
                                  row_bytes(args.embedding_dim, _state_floats(args),
                                            EMBEDDING_DTYPES[args.embedding_dtype]),
                                  args.cache_fraction, DynamicEmbScoreStrategy[args.score_strategy.upper()],
                                  args.admission_threshold, args.placement,
                                  # placement: replicas on, the ids come from the file
                                  1 if args.replicas == "placement" else args.replicas,
                                  args.staleness, stochastic=args.rounding == "stochastic")
    sharder = (DynamicEmbeddingCollectionSharder if args.collection == "ec"
               else DynamicEmbeddingBagCollectionSharder)
    sharders = [sharder(fused_params={"optimizer": optimizer, "learning_rate": args.lr, "eps": 1e-8})]
    if args.plan_file:
        from dynamicemb.plan import to_sharding_plan  # noqa: PLC0415

        plan = to_sharding_plan(args.plan_file, model, constraints=constraints, sharders=sharders,
                                device=device.type, local_world_size=get_local_size())
    else:
        topology = Topology(world_size=world, local_world_size=get_local_size(),
                            compute_device=device.type)
        planner = DynamicEmbeddingShardingPlanner(topology, batch_size=args.batch_size,
                                                  constraints=constraints)
        plan = planner.collective_plan(model, sharders, dist.GroupMember.WORLD)
    return DistributedModelParallel(model, plan=plan, sharders=sharders, device=device)


def to_batch(batch, tables, device) -> TorchRecBatch:
    return TorchRecBatch(dense_features=batch.dense.to(device), sparse_features=to_kjt(batch.sparse, tables).to(device),
                         labels=batch.labels.to(device))


def _autocast(args, device: torch.device):
    """``--amp``: the model's forward under autocast (bfloat16 on a CPU, float16 on a GPU);
    else a context that changes nothing."""
    dtype = torch.bfloat16 if device.type == "cpu" else torch.float16
    return torch.autocast(device.type, dtype=dtype, enabled=args.amp)


def evaluate(args, dmp, evals, tables, device) -> float:
    """Eval AUC over every rank's eval samples (torchmetrics syncs the ranks), after
    stale replicas' pending gradients reached their owners (a collective).

    Raises:
        DataError: on every rank, if the eval rows hold one class only.
    """
    flush_replicas(dmp)
    auroc = torchmetrics.AUROC(task="binary").to(device)
    positives, total = 0, 0
    dmp.eval()
    with torch.no_grad():
        for batch in in_step(evals, _describe(args, "eval")):
            with _autocast(args, device):
                _, (_, logits, labels) = dmp(to_batch(batch, tables, device))
            auroc.update(torch.sigmoid(logits), labels.long())
            positives, total = positives + int(labels.sum()), total + labels.numel()
    dmp.train()
    check_eval_labels(positives, total, _describe(args, "eval"))
    return float(auroc.compute())


def table_report(dmp, tables) -> Dict[str, Dict]:
    """Per dynamic table, summed over ranks: rows held, cache lookups/hits, evictions;
    the rows' dtype."""
    local = get_dynamic_tables(dmp)
    report = {}
    for t in tables:
        name = f"t_{t.feature}"
        if not t.dynamic:
            continue
        module = local.get(name)
        m = module.cache_metrics()[name] if module is not None else None
        counts = torch.tensor([module.table_size(name) if module is not None else 0,
                               m.lookups if m else 0, m.hits if m else 0, m.evictions if m else 0],
                              dtype=torch.float64)
        dist.all_reduce(counts)
        rows, lookups, hits, evictions = counts.tolist()
        dtype = (None if module is None
                 else module.table_options[module.table_names.index(name)].row_dtype)
        report[name] = {"rows": int(rows), "max_rows": t.rows,
                        "hit_rate": round(hits / lookups, 4) if lookups else None,
                        "evictions": int(evictions),
                        "dtype": None if dtype is None else str(dtype)[len("torch."):]}
    return report


def plot(history: Dict[str, List], path: str) -> None:
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.plot(*zip(*history["loss"]), lw=0.8)
    a.set(xlabel="step", ylabel="train loss (BCE)", title="loss")
    if history["auc"]:
        b.plot(*zip(*history["auc"]), marker="o")
    b.set(xlabel="step", ylabel="eval AUC", title="eval AUC")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv=None) -> None:
    """Runs the job; a data file it cannot use ends every rank with one line on stderr
    (``error: <file>: <reason>``) and exit status 1."""
    args = parse_args(argv)
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}") if torch.cuda.is_available() \
        else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(args.backend or ("nccl" if device.type == "cuda" else "gloo"),
                            timeout=timedelta(seconds=args.pg_timeout))
    try:
        run(args, device)
    except DataError as error:  # raised on every rank alike (checks.py)
        # one write: with unbuffered stderr, print's text and newline are two writes,
        # and the ranks' lines (one shared stream under torchrun) could interleave
        sys.stderr.write(f"error: {error}\n")
        sys.stderr.flush()
        dist.barrier()  # every rank has printed before torchrun sees the first exit
        sys.exit(1)
    finally:
        dist.destroy_process_group()


def run(args, device: torch.device) -> None:
    """The job on an initialized process group: build, shard, (resume,) train, report."""
    if device.type == "cpu":  # the cores of this machine shared by its ranks, whatever the agents
        torch.set_num_threads(threads_per_rank())
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)
    # TorchRec checks ids against num_embeddings; dynamic tables take raw ids by design.
    logging.getLogger("torchrec.sparse.jagged_tensor_validator").setLevel(logging.ERROR)
    train, evals = datasets(args, rank, world)  # checked first: a bad file fails fast
    tables = table_specs(args)
    model = build_model(tables, args.embedding_dim, [int(x) for x in args.dense_arch.split(",")],
                        [int(x) for x in args.over_arch.split(",")], dense_features=num_dense(args),
                        collection=args.collection,
                        data_type=EMBEDDING_DTYPES[args.embedding_dtype])
    dmp = shard(args, model, tables, device, world)
    dense_opt = KeyedOptimizerWrapper(dict(in_backward_optimizer_filter(dmp.named_parameters())),
                                      lambda params: torch.optim.Adagrad(params, lr=args.dense_lr))
    progress = {"step": 0, "epoch": 0, "batch_in_epoch": 0, "samples": 0, "world_size": world,
                "history": {"loss": [], "auc": []}, "model_args": checkpoint.model_args(args)}
    if args.resume:
        progress = checkpoint.load(args.checkpoint_dir, dmp, dense_opt, args)
        if progress["world_size"] != world:
            raise ValueError(f"--resume: the checkpoint was made by {progress['world_size']} ranks, "
                             f"this run has {world} (each rank's share of the data would change)")
    resumed_samples, start = progress["samples"], time.perf_counter()
    train_loop(args, dmp, dense_opt, train, evals, tables, device, progress)
    elapsed = time.perf_counter() - start
    history, step = progress["history"], progress["step"]
    if evals is not None and (not history["auc"] or history["auc"][-1][0] != step):
        history["auc"].append((step, evaluate(args, dmp, evals, tables, device)))
    if args.checkpoint_dir:
        checkpoint.save(args.checkpoint_dir, dmp, dense_opt, progress)
    if args.serving_artifact:
        sample = to_batch(next(iter(evals if evals is not None else train)), tables, device)
        serving.write(args.serving_artifact, dmp, lambda: build_model(
            tables, args.embedding_dim, [int(x) for x in args.dense_arch.split(",")],
            [int(x) for x in args.over_arch.split(",")], dense_features=num_dense(args),
            collection=args.collection, data_type=EMBEDDING_DTYPES[args.embedding_dtype]),
            tables, sample)
    report = table_report(dmp, tables)
    history["alltoall_ids_per_step"], history["alltoall_dynamic_ids_per_step"] = \
        alltoall_per_step(progress)
    history["traffic_per_step"] = traffic_per_step(args, progress, sum(
        p.numel() for p in dense_opt.params.values()), len(tables))
    if rank == 0:
        summarize(args, history, report, step, progress["samples"],
                  progress["samples"] - resumed_samples, elapsed, train)


def train_loop(args, dmp, dense_opt, train, evals, tables, device, progress) -> None:
    """Trains from ``progress`` (updated in place) to the last epoch or ``--max-steps``,
    evaluating every ``--eval-every`` and saving every ``--checkpoint-every`` steps."""
    bar = None
    if dist.get_rank() == 0:
        from tqdm import tqdm  # noqa: PLC0415

        batches = _batches_per_epoch(train)
        bar = tqdm(total=args.epochs * batches if batches is not None else None,
                   initial=progress["step"], unit="step")
    try:
        _train_epochs(args, dmp, dense_opt, train, evals, tables, device, progress, bar)
    finally:
        if bar is not None:
            bar.close()  # ends its line, also before an error message


def _batches_per_epoch(train) -> Optional[int]:
    """Batches in one pass over ``train``; None for a streaming reader."""
    try:
        return len(train)
    except TypeError:
        return None


def _refresh_replicas(args, dmp, train, tables) -> None:
    """Chooses the replicated ids (a collective): the owners' top scores, or the
    ``--placement`` file's replicated ids with ``--replicas placement``; a routed
    reader treats them as local to every rank from the next batch on."""
    if args.replicas == "placement":
        placed = _placements(args, dist.get_world_size())
        if not any(p.replicated.numel() for p in placed.values()):  # the same on every rank
            raise ValueError(f"--replicas placement: {args.placement} lists no replicated ids; "
                             f"make it with partition.py --replicas (e.g. 0.01)")
        refresh_replicas(dmp, {f"t_{tables[f].feature}": p.replicated for f, p in placed.items()})
    else:
        refresh_replicas(dmp)
    if isinstance(train, RoutedBatches):
        hot = replicated_ids(dmp)
        train.set_replicated({f: hot[f"t_{t.feature}"] for f, t in enumerate(tables)
                              if f"t_{t.feature}" in hot})


def _train_epochs(args, dmp, dense_opt, train, evals, tables, device, progress, bar) -> None:
    world, history = dist.get_world_size(), progress["history"]
    start, samples_at_start = time.perf_counter(), progress["samples"]
    if args.replicas == "placement":  # once, before the first batch is routed (a collective)
        _refresh_replicas(args, dmp, train, tables)
    while progress["epoch"] < args.epochs:
        # A resumed epoch skips the batches it had already trained on.
        for batch in in_step(itertools.islice(train, progress["batch_in_epoch"], None),
                             _describe(args, "train")):
            if args.max_steps and progress["step"] >= args.max_steps:
                break
            for counters in _id_counters(dmp):
                counters.reset()
            if args.replicas not in (0, "placement") and \
                    progress["step"] % args.replicas_refresh == 1 % args.replicas_refresh:
                _refresh_replicas(args, dmp, train, tables)  # a collective, between steps
            with _autocast(args, device):
                loss, _ = dmp(to_batch(batch, tables, device))
            loss.backward()
            dense_opt.step()
            dense_opt.zero_grad()
            count_alltoall(dmp, progress, {f"t_{t.feature}" for t in tables if t.dynamic})
            progress["step"] += 1
            progress["batch_in_epoch"] += 1
            progress["samples"] += batch.labels.numel() * world
            step, value = progress["step"], loss.item()
            history["loss"].append((step, value))
            if bar is not None:
                bar.update(1)
                rate = (progress["samples"] - samples_at_start) / (time.perf_counter() - start)
                bar.set_postfix(loss=f"{value:.4f}", samples_s=f"{rate:,.0f}")
            if evals is not None and step % args.eval_every == 0:
                history["auc"].append((step, evaluate(args, dmp, evals, tables, device)))
                history.setdefault("alltoall_ids", []).append((step, alltoall_per_step(progress)))
                if bar is not None:
                    every, dynamic = history["alltoall_ids"][-1][1]
                    bar.write(f"step {step}: eval AUC {history['auc'][-1][1]:.4f}, all-to-all "
                              f"{every:,.0f} ids/step ({dynamic:,.0f} of dynamic tables)")
            if args.checkpoint_every and step % args.checkpoint_every == 0:
                checkpoint.save(args.checkpoint_dir, dmp, dense_opt, progress)
        else:
            progress["epoch"] += 1
            progress["batch_in_epoch"] = 0
            continue
        break  # --max-steps


def _id_counters(dmp) -> list:
    """The sharded collections' ``id_counters`` (ids sent per table and rank)."""
    return [m.id_counters for m in dmp.modules() if getattr(m, "id_counters", None) is not None]


def count_alltoall(dmp, progress, dynamic: Set[str]) -> None:
    """Adds the ids this rank sent to other ranks in this training step (the
    ``id_counters``: sharded tables, after dedup where it is on; reset before the
    step's forward, so evaluations are not counted) to ``progress["alltoall_ids"]``,
    and those of the ``dynamic`` tables to ``progress["alltoall_dynamic_ids"]``."""
    rank = dist.get_rank()
    sent = {t: int(s.sum()) - int(s[rank]) for c in _id_counters(dmp) for t, s in c.sent.items()}
    progress["alltoall_ids"] = progress.get("alltoall_ids", 0) + sum(sent.values())
    progress["alltoall_dynamic_ids"] = progress.get("alltoall_dynamic_ids", 0) + sum(
        n for t, n in sent.items() if t in dynamic)
    progress["counted_steps"] = progress.get("counted_steps", 0) + 1
    for key in ("replicated", "replica_slots", "replica_rows", "replica_grads"):  # replicas
        progress[key] = progress.get(key, 0) + sum(getattr(c, key) for c in _id_counters(dmp))


def alltoall_per_step(progress) -> Tuple[float, float]:
    """Ids crossing the all-to-all per step, all ranks together (a collective): of
    every sharded table, and of the dynamic ones."""
    total = torch.tensor([progress.get("alltoall_ids", 0), progress.get("alltoall_dynamic_ids", 0),
                          progress.get("counted_steps", 0)], dtype=torch.float64)
    dist.all_reduce(total)
    steps = max(1.0, float(total[2]) / dist.get_world_size())
    return float(total[0]) / steps, float(total[1]) / steps


def _state_floats(args) -> int:
    """Optimizer state floats per row of the embedding optimizer."""
    return OPTIMIZERS[args.optimizer][1] * args.embedding_dim + (args.optimizer == "rowwise_adagrad")


def traffic_per_step(args, progress, dense_params: int, num_features: int) -> Dict[str, float]:
    """Bytes per training step, all ranks together (a collective), estimated from the
    counters: the all-to-all's (with each sample's lengths: an int32 per feature and
    sample to every other rank), the replicas' sync and the dense gradients' all-reduce
    (``dense_params`` floats; a ring all-reduce sends ``2 (W - 1) / W`` of them out of
    each rank). Measured on the namespace cluster (benchmark/RESULTS.md) the link
    carries ~3% more (TCP/IP and gloo framing).

    All-to-all: per id crossing ranks, EC sends 8 B of id and 4 B of count and gets a
    ``dim``-float row back and sends its gradient (12 + 8 dim B); EBC sends the id
    (8 B; its pooled outputs' reduce-scatter has a fixed size). Replicas: the ranks
    all-reduce one int64 count per replicated id (a ring all-reduce of ``n`` bytes
    moves ``2 (W - 1) / W n`` bytes out of each rank), the owners send replicated
    rows to the ``W - 1`` other ranks and get gradient rows back (``dim`` floats
    each): at staleness 0 the rows in use every step, with ``--staleness N`` all
    replicated rows with their optimizer states (and a stored flag) and the gradients of those in use
    once per N steps (amortized: the per-step mean over the run).
    """
    world = dist.get_world_size()
    total = torch.tensor([progress.get(k, 0) for k in (
        "alltoall_ids", "alltoall_dynamic_ids", "replicated", "replica_slots", "replica_rows",
        "replica_grads", "counted_steps")], dtype=torch.float64)
    dist.all_reduce(total)
    ids, dynamic, replicated, slots, rows, grads, steps = (float(x) for x in total)
    steps = max(1.0, steps / world)
    per_id = 12 + 8 * args.embedding_dim if args.collection == "ec" else 8
    slots, rows, grads = slots / world, rows / world, grads / world  # every rank counts the same
    state = _state_floats(args) + 1 if args.staleness else 0  # pulled with each row, + stored
    sync = 2 * (world - 1) * slots * 8 + (world - 1) * (
        rows * (args.embedding_dim + state) + grads * args.embedding_dim) * 4
    dense = 8 * (world - 1) * dense_params  # bytes out of all ranks, per step
    lengths = 4 * num_features * args.batch_size * world * (world - 1)
    return {"alltoall_ids": ids / steps, "alltoall_dynamic_ids": dynamic / steps,
            "dense_allreduce_bytes": float(dense), "lengths_bytes": float(lengths),
            "alltoall_bytes": ids * per_id / steps, "alltoall_dynamic_bytes": dynamic * per_id / steps,
            "replicated_ids": replicated / steps, "replica_rows": rows / steps,
            "replica_grads": grads / steps, "replica_sync_bytes": sync / steps}


def summarize(args, history, report, step, samples, run_samples, elapsed, train) -> None:
    """Writes summary.json and plot.png; ``samples`` counts resumed steps too,
    ``run_samples`` (the throughput's) only this run's."""
    os.makedirs(args.out, exist_ok=True)
    auc = history["auc"][-1][1] if history["auc"] else None
    ceiling = train.bayes_auc() if hasattr(train, "bayes_auc") else None
    summary = {"steps": step, "samples": samples, "seconds": round(elapsed, 2),
               "samples_per_s": round(run_samples / elapsed, 1), "final_loss": history["loss"][-1][1] if history["loss"] else None,
               "eval_auc": auc, "bayes_auc": ceiling, "dynamic_tables": report,
               "history": history, "args": vars(args)}
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    plot(history, os.path.join(args.out, "plot.png"))
    resumed = "" if run_samples == samples else f" ({run_samples:,} in this run)"
    loss = "-" if summary["final_loss"] is None else f"{summary['final_loss']:.4f}"
    print(f"\ntrained {step} steps, {samples:,} samples{resumed} in {elapsed:.1f} s "
          f"({summary['samples_per_s']:,.0f} samples/s); final train loss {loss}")
    if auc is not None:
        print(f"eval AUC {auc:.4f}" + (f" (ground-truth ceiling {ceiling:.4f})" if ceiling else ""))
    print(f"all-to-all: {history['alltoall_ids_per_step']:,.0f} ids/step crossing ranks, "
          f"{history['alltoall_dynamic_ids_per_step']:,.0f} of them of dynamic tables (all ranks, "
          f"ids to other ranks only, after dedup where it is on)")
    t = history["traffic_per_step"]
    print(f"bytes/step (estimated, all ranks): all-to-all {t['alltoall_bytes']:,.0f} "
          f"({t['alltoall_dynamic_bytes']:,.0f} of dynamic tables), replica sync "
          f"{t['replica_sync_bytes']:,.0f}, total {t['alltoall_bytes'] + t['replica_sync_bytes']:,.0f}; "
          f"ids served by replicas {t['replicated_ids']:,.0f}/step, replicated rows sent "
          f"{t['replica_rows']:,.1f}/step, their gradients {t['replica_grads']:,.1f}/step"
          + (f" (staleness {args.staleness}: amortized)" if args.staleness else ""))
    print("\n| dynamic table | rows held | max rows | cache hit rate | cache evictions |")
    print("|---|---|---|---|---|")
    for name, r in report.items():
        rate = "-" if r["hit_rate"] is None else f"{r['hit_rate']:.3f}"
        print(f"| {name} | {r['rows']:,} | {r['max_rows']:,} | {rate} | {r['evictions']:,} |")
    print(f"\nsummary: {os.path.join(args.out, 'summary.json')}; plot: {os.path.join(args.out, 'plot.png')}")


if __name__ == "__main__":
    main()
