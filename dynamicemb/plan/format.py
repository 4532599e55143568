"""HugeCTR plan files (ETPS): a typed model, parsing with JSON-path errors, validation, output.

A plan is a JSON list with one entry per GPU, each a list of groups; group ``k`` is the same
group on every GPU, and each GPU's copy lists the lookups it holds. A ``dp`` group
replicates its lookups; an ``mp`` group ("localized" in older files) places each lookup
whole on the GPU listing it, or, with ``N > 1`` shards, row-wise over the ``N`` listing GPUs.
"""

import json
import os
from dataclasses import dataclass, field
from enum import Enum, unique
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

__all__ = ["LookupPlacement", "PlacementKind", "PlanFile", "PlanGroup", "Strategy", "load_plan"]


@unique
class Strategy(str, Enum):
    """A group's ``table_placement_strategy``: model parallel or data parallel."""

    MP = "mp"
    DP = "dp"


@unique
class PlacementKind(str, Enum):
    """How one lookup is placed across GPUs."""

    DATA_PARALLEL = "data_parallel"
    TABLE_WISE = "table_wise"
    ROW_WISE = "row_wise"


# "localized" is what older HugeCTR files call "mp".
_STRATEGY_NAMES = {"mp": Strategy.MP.value, "dp": Strategy.DP.value, "localized": Strategy.MP.value}
# (shard id key, shard count key) per spelling; HugeCTR renamed them once.
_SHARD_KEYS = {"new": ("shard_id", "shards_count"), "old": ("sharding_id", "num_sharding")}
_STRATEGY_KEY = "table_placement_strategy"
_LOCAL_KEY = "local_embedding_list"
_GLOBAL_KEY = "global_embedding_list"

PlanSource = Union[str, "os.PathLike[str]", Sequence[Any]]


def _is_index(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _show(value: Any, limit: int = 60) -> str:
    """A value as JSON, cut short, for error messages."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


@dataclass(frozen=True)
class PlanGroup:
    """One GPU's copy of one group of a plan file (``ValueError`` on a bad field).

    Args:
        strategy (str): ``"mp"`` or ``"dp"`` (``"localized"`` is stored as ``"mp"``).
        lookups (Tuple[int, ...]): distinct lookup indices this GPU holds, in file order.
        shard_id, shard_count (Optional[int]): this GPU's shard, in ``[0, shard_count)``, and
            the group's shard count, if the file gives them.
    """

    strategy: str
    lookups: Tuple[int, ...] = ()
    shard_id: Optional[int] = None
    shard_count: Optional[int] = None

    def __post_init__(self) -> None:
        if not isinstance(self.strategy, str) or self.strategy not in _STRATEGY_NAMES:
            raise ValueError(f"unknown strategy {self.strategy!r}; expected 'mp', 'dp' or 'localized'")
        object.__setattr__(self, "strategy", _STRATEGY_NAMES[self.strategy])
        lookups = tuple(self.lookups)
        seen = set()
        for lookup in lookups:
            if not _is_index(lookup):
                raise ValueError(f"lookup {lookup!r} is not a non-negative integer")
            if lookup in seen:
                raise ValueError(f"lookup {lookup} is listed twice")
            seen.add(lookup)
        object.__setattr__(self, "lookups", lookups)
        if self.shard_id is not None and not _is_index(self.shard_id):
            raise ValueError(f"shard id {self.shard_id!r} is not a non-negative integer")
        if self.shard_count is not None and not (_is_index(self.shard_count) and self.shard_count >= 1):
            raise ValueError(f"shard count {self.shard_count!r} is not a positive integer")
        if self.shard_id is not None and self.shard_count is not None and self.shard_id >= self.shard_count:
            raise ValueError(f"shard id {self.shard_id} is out of range for {self.shard_count} shard(s)")


@dataclass(frozen=True)
class LookupPlacement:
    """Where one lookup lives (``ValueError`` on an unknown kind or ranks that do not fit it).

    Args:
        kind (str): ``"data_parallel"``, ``"table_wise"`` or ``"row_wise"``.
        ranks (Tuple[int, ...]): every GPU ascending (data parallel); the one GPU (table-wise);
            the GPUs holding shards ``0..N-1`` in shard order, ``N >= 2`` (row-wise).
        group (int): the plan group that places it; left out of comparisons and hashing.
    """

    kind: str
    ranks: Tuple[int, ...]
    group: int = field(default=0, compare=False)

    def __post_init__(self) -> None:
        try:
            kind = PlacementKind(self.kind).value
        except ValueError:
            names = ", ".join(repr(k.value) for k in PlacementKind)
            raise ValueError(f"unknown placement kind {self.kind!r}; expected one of {names}") from None
        object.__setattr__(self, "kind", kind)
        ranks = tuple(self.ranks)
        if not ranks or not all(_is_index(rank) for rank in ranks):
            raise ValueError(f"ranks must be non-negative integers, at least one, got {ranks!r}")
        if len(set(ranks)) != len(ranks):
            raise ValueError(f"ranks {ranks} list a GPU twice")
        if kind == PlacementKind.TABLE_WISE.value and len(ranks) != 1:
            raise ValueError(f"a table-wise placement has exactly one rank, got {ranks}")
        if kind == PlacementKind.ROW_WISE.value and len(ranks) < 2:
            raise ValueError(f"a row-wise placement needs at least 2 ranks (one is table-wise), got {ranks}")
        object.__setattr__(self, "ranks", ranks)


@dataclass(frozen=True)
class PlanFile:
    """A whole plan file: ``gpus[g][k]`` is GPU ``g``'s copy of group ``k``.

    Construction checks the structure (as many groups on every GPU, one strategy per group, a
    ``dp`` group unsharded with the same lookups everywhere) and raises ``ValueError`` naming
    the GPU and group; :meth:`placements` checks how lookups are placed.

    Example::

        plan = load_plan("plan.json")
        placements = plan.validate(world_size=8, num_lookups=26)
        text = PlanFile.from_placements(placements, plan.num_gpus).to_json()
    """

    gpus: Tuple[Tuple[PlanGroup, ...], ...]

    def __post_init__(self) -> None:
        gpus = tuple(tuple(groups) for groups in self.gpus)
        if not gpus:
            raise ValueError("a plan needs at least one GPU")
        for g, groups in enumerate(gpus):
            for k, group in enumerate(groups):
                if not isinstance(group, PlanGroup):
                    raise ValueError(f"GPU {g} group {k}: expected a PlanGroup, got {type(group).__name__}")
        object.__setattr__(self, "gpus", gpus)
        for g, groups in enumerate(gpus):
            if len(groups) != len(gpus[0]):
                raise ValueError(f"GPU {g} has {len(groups)} group(s) and GPU 0 has {len(gpus[0])}; "
                                 f"group k must be the same group on every GPU")
        for k in range(self.num_groups):
            self._check_group(k)

    @property
    def num_gpus(self) -> int:
        """Number of GPUs the plan is written for."""
        return len(self.gpus)

    @property
    def num_groups(self) -> int:
        """Number of groups, the same on every GPU."""
        return len(self.gpus[0])

    def groups(self, gpu: int) -> Tuple[PlanGroup, ...]:
        """GPU ``gpu``'s copies of the groups, in file order (``ValueError`` if out of range)."""
        if not _is_index(gpu) or gpu >= self.num_gpus:
            raise ValueError(f"GPU {gpu!r} is out of range for a plan of {self.num_gpus} GPUs")
        return self.gpus[gpu]

    def _check_group(self, k: int) -> None:
        column = [groups[k] for groups in self.gpus]
        first = column[0]
        for g, group in enumerate(column):
            if group.strategy != first.strategy:
                raise ValueError(f"GPU {g} group {k}: strategy {group.strategy!r} differs from "
                                 f"{first.strategy!r} on GPU 0; a group has one strategy on every GPU")
            if group.strategy != Strategy.DP.value:
                continue
            if group.shard_count not in (None, 1) or group.shard_id not in (None, 0):
                raise ValueError(f"GPU {g} group {k}: a dp group cannot be sharded "
                                 f"(shard id {group.shard_id}, shard count {group.shard_count})")
            if set(group.lookups) != set(first.lookups):
                raise ValueError(f"GPU {g} group {k}: dp lookups {sorted(group.lookups)} differ from "
                                 f"{sorted(first.lookups)} on GPU 0; the same everywhere in a dp group")

    def placements(self, num_lookups: Optional[int] = None) -> Dict[int, LookupPlacement]:
        """Lookup index -> placement, ascending; when given ``num_lookups``, exactly
        ``range(num_lookups)`` must be placed, each once.

        Raises:
            ValueError: naming the GPU, group and lookup: a lookup out of range, placed nowhere or
                twice, or a sharded group with inconsistent shards.
        """
        if num_lookups is not None and not _is_index(num_lookups):
            raise ValueError(f"num_lookups must be a non-negative integer, got {num_lookups!r}")
        found: Dict[int, LookupPlacement] = {}
        origin: Dict[int, str] = {}
        for k in range(self.num_groups):
            for lookup, placement, where in self._group_placements(k):
                if num_lookups is not None and lookup >= num_lookups:
                    raise ValueError(f"{where}: lookup {lookup} is out of range for {num_lookups} lookups")
                if lookup in found:
                    raise ValueError(f"lookup {lookup} is placed twice: {origin[lookup]} and {where}")
                found[lookup] = placement
                origin[lookup] = where
        if num_lookups is not None:
            missing = [lookup for lookup in range(num_lookups) if lookup not in found]
            if missing:
                more = f" (nor are {missing[1:9]}{'...' if len(missing) > 9 else ''})" if missing[1:] else ""
                raise ValueError(f"lookup {missing[0]} is placed nowhere{more}; the plan must place all "
                                 f"{num_lookups} lookups")
        return dict(sorted(found.items()))

    def _group_placements(self, k: int) -> List[Tuple[int, LookupPlacement, str]]:
        """(lookup, placement, "GPU g group k") for every lookup group ``k`` places."""
        column = [groups[k] for groups in self.gpus]
        if column[0].strategy == Strategy.DP.value:
            placement = LookupPlacement(PlacementKind.DATA_PARALLEL.value, tuple(range(self.num_gpus)), k)
            return [(lookup, placement, f"GPU 0 group {k}") for lookup in column[0].lookups]
        count = _shard_count(column, k)
        if count is None or count == 1:
            for g, group in enumerate(column):
                if group.shard_id not in (None, 0):
                    raise ValueError(f"GPU {g} group {k}: shard id {group.shard_id} is out of range "
                                     f"for an unsharded group (1 shard)")
            return [(lookup, LookupPlacement(PlacementKind.TABLE_WISE.value, (g,), k), f"GPU {g} group {k}")
                    for g, group in enumerate(column) for lookup in group.lookups]
        ranks = _shard_ranks(column, k, count)
        if not ranks:
            return []
        placement = LookupPlacement(PlacementKind.ROW_WISE.value, ranks, k)
        return [(lookup, placement, f"GPU {ranks[0]} group {k}") for lookup in column[ranks[0]].lookups]

    def validate(self, world_size: Optional[int] = None,
                 num_lookups: Optional[int] = None) -> Dict[int, LookupPlacement]:
        """:meth:`placements`, after checking that the plan has ``world_size`` GPUs (when given).

        Raises:
            ValueError: on the first failed check.
        """
        if world_size is not None and world_size != self.num_gpus:
            raise ValueError(f"plan has {self.num_gpus} GPUs, the world size is {world_size}")
        return self.placements(num_lookups)

    def to_obj(self, spelling: str = "new") -> List[List[Dict[str, Any]]]:
        """The plan as HugeCTR's JSON structure, with ``global_embedding_list`` on every group.

        Shard keys, where a group has them, are ``shard_id``/``shards_count`` (``spelling="new"``)
        or ``sharding_id``/``num_sharding`` (``"old"``); another spelling raises ``ValueError``.
        """
        if spelling not in _SHARD_KEYS:
            raise ValueError(f"unknown spelling {spelling!r}; expected 'new' or 'old'")
        id_key, count_key = _SHARD_KEYS[spelling]
        out = []
        for groups in self.gpus:
            entry = []
            for k, group in enumerate(groups):
                item: Dict[str, Any] = {
                    _LOCAL_KEY: list(group.lookups),
                    _GLOBAL_KEY: [list(other[k].lookups) for other in self.gpus],
                }
                if group.shard_id is not None:
                    item[id_key] = group.shard_id
                if group.shard_count is not None:
                    item[count_key] = group.shard_count
                item[_STRATEGY_KEY] = group.strategy
                entry.append(item)
            out.append(entry)
        return out

    def to_json(self, spelling: str = "new", indent: Optional[int] = 4) -> str:
        """The plan as HugeCTR JSON text; see :meth:`to_obj`."""
        return json.dumps(self.to_obj(spelling), indent=indent)

    @classmethod
    def from_placements(cls, placements: Dict[int, LookupPlacement], num_gpus: int) -> "PlanFile":
        """A canonical plan whose :meth:`placements` equal ``placements`` (``group`` ignored).

        One ``mp`` group holds the table-wise lookups, one ``dp`` group the data-parallel ones, and
        each distinct row-wise rank tuple gets an ``mp`` group of ``len(ranks)`` shards, GPU
        ``ranks[i]`` holding shard ``i``. Groups empty on every GPU are left out. Raises
        ``ValueError`` on a bad lookup index, a rank out of range, or a data-parallel placement that
        does not list every GPU in order.
        """
        if not _is_index(num_gpus) or num_gpus < 1:
            raise ValueError(f"num_gpus must be a positive integer, got {num_gpus!r}")
        table_wise: List[List[int]] = [[] for _ in range(num_gpus)]
        data_parallel: List[int] = []
        row_wise: Dict[Tuple[int, ...], List[int]] = {}
        for lookup, placement in placements.items():
            _check_placement(lookup, placement, num_gpus)
        for lookup, placement in sorted(placements.items()):
            if placement.kind == PlacementKind.TABLE_WISE.value:
                table_wise[placement.ranks[0]].append(lookup)
            elif placement.kind == PlacementKind.DATA_PARALLEL.value:
                data_parallel.append(lookup)
            else:
                row_wise.setdefault(placement.ranks, []).append(lookup)
        columns: List[List[PlanGroup]] = []  # columns[k][g]: GPU g's copy of group k
        if any(table_wise):
            columns.append([PlanGroup(Strategy.MP.value, tuple(mine)) for mine in table_wise])
        if data_parallel:
            columns.append([PlanGroup(Strategy.DP.value, tuple(data_parallel))] * num_gpus)
        for ranks, lookups in row_wise.items():
            columns.append([PlanGroup(Strategy.MP.value, tuple(lookups), ranks.index(g), len(ranks))
                            if g in ranks else PlanGroup(Strategy.MP.value) for g in range(num_gpus)])
        return cls(tuple(tuple(column[g] for column in columns) for g in range(num_gpus)))


def _check_placement(lookup: Any, placement: Any, num_gpus: int) -> None:
    if not _is_index(lookup):
        raise ValueError(f"lookup {lookup!r} is not a non-negative integer")
    if not isinstance(placement, LookupPlacement):
        raise ValueError(f"lookup {lookup}: expected a LookupPlacement, got {type(placement).__name__}")
    for rank in placement.ranks:
        if rank >= num_gpus:
            raise ValueError(f"lookup {lookup}: rank {rank} is out of range for {num_gpus} GPUs")
    if placement.kind == PlacementKind.DATA_PARALLEL.value and placement.ranks != tuple(range(num_gpus)):
        raise ValueError(f"lookup {lookup}: a data-parallel placement lists every GPU "
                         f"{tuple(range(num_gpus))}, got {placement.ranks}")


def _shard_count(column: Sequence[PlanGroup], k: int) -> Optional[int]:
    """The shard count the GPUs' copies of group ``k`` agree on, or None if none gives one."""
    first_gpu: Dict[int, int] = {}
    for g, group in enumerate(column):
        if group.shard_count is not None:
            first_gpu.setdefault(group.shard_count, g)
    if len(first_gpu) > 1:
        (a, ga), (b, gb) = list(first_gpu.items())[:2]
        raise ValueError(f"group {k}: GPU {ga} has shard count {a} and GPU {gb} has {b}; a group has one")
    return next(iter(first_gpu), None)


def _shard_ranks(column: Sequence[PlanGroup], k: int, count: int) -> Tuple[int, ...]:
    """The GPUs holding shards ``0..count-1`` of the sharded group ``k``, in shard order."""
    for g, group in enumerate(column):
        if group.shard_id is not None and group.shard_id >= count:
            raise ValueError(f"GPU {g} group {k}: shard id {group.shard_id} is out of range "
                             f"for {count} shards")
    holders = [g for g, group in enumerate(column) if group.lookups]
    if not holders:
        return ()
    reference = column[holders[0]]
    holder_of: Dict[int, int] = {}
    for g in holders:
        group = column[g]
        if group.shard_id is None:
            raise ValueError(f"GPU {g} group {k}: lists lookups {sorted(group.lookups)} in a group "
                             f"of {count} shards but has no shard id")
        if group.shard_id in holder_of:
            raise ValueError(f"GPU {g} group {k}: shard id {group.shard_id} is repeated "
                             f"(GPU {holder_of[group.shard_id]} holds it too)")
        if set(group.lookups) != set(reference.lookups):
            raise ValueError(f"GPU {g} group {k}: lookups {sorted(group.lookups)} differ from "
                             f"{sorted(reference.lookups)} on GPU {holders[0]}; every shard of a "
                             f"group holds the same lookups")
        holder_of[group.shard_id] = g
    missing = [shard for shard in range(count) if shard not in holder_of]
    if missing:
        raise ValueError(f"group {k}: shard {missing[0]} of {count} is missing "
                         f"(no GPU lists lookups with shard id {missing[0]})")
    return tuple(holder_of[shard] for shard in range(count))


def load_plan(source: PlanSource) -> PlanFile:
    """Reads a HugeCTR plan file (a path, JSON text starting with ``[`` or ``{``, or the parsed
    list) and checks its structure; :meth:`PlanFile.validate` checks the placements.

    Accepts both shard-key spellings, ``"localized"`` for ``"mp"``, GPUs listing no lookups in a
    group and ``dp`` groups carrying shard 0 of 1; ``global_embedding_list`` is optional and
    checked where present; unknown keys are ignored.

    Raises:
        ValueError: text that is not JSON, a wrongly shaped element (the message gives its JSON
            path, ``plan[1][0]["local_embedding_list"][2]: ...``) or a structural error.
        OSError: the file cannot be read.
    """
    obj = _read(source)
    if not isinstance(obj, list) or not obj:
        raise ValueError(f"plan: expected a non-empty list with one list of groups per GPU, got {_show(obj)}")
    gpus = []
    for g, entry in enumerate(obj):
        if not isinstance(entry, list):
            raise ValueError(f"plan[{g}]: expected a list of groups, got {_show(entry)}")
        gpus.append(tuple(_parse_group(item, g, k) for k, item in enumerate(entry)))
    plan = PlanFile(tuple(gpus))
    _check_global_lists(obj, plan)
    return plan


def _read(source: PlanSource) -> Any:
    if isinstance(source, str) and source.lstrip()[:1] in ("[", "{"):
        text, name = source, "plan"
    elif isinstance(source, (str, os.PathLike)):
        name = os.fspath(source)
        with open(name, encoding="utf-8") as file:
            text = file.read()
    else:  # already parsed; the caller reports anything that is not a list
        return list(source) if isinstance(source, tuple) else source
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"{name}: not valid JSON: {error}") from None


def _parse_group(item: Any, g: int, k: int) -> PlanGroup:
    path = f"plan[{g}][{k}]"
    if not isinstance(item, dict):
        raise ValueError(f"{path}: expected a group object, got {_show(item)}")
    for key in (_STRATEGY_KEY, _LOCAL_KEY):
        if key not in item:
            raise ValueError(f'{path}: missing "{key}" (GPU {g} group {k})')
    strategy = item[_STRATEGY_KEY]
    if not isinstance(strategy, str):
        raise ValueError(f'{path}["{_STRATEGY_KEY}"]: expected a string, got {_show(strategy)}')
    lookups = _index_list(item[_LOCAL_KEY], f'{path}["{_LOCAL_KEY}"]')
    shard_id = _shard_field(item, path, [keys[0] for keys in _SHARD_KEYS.values()], minimum=0)
    shard_count = _shard_field(item, path, [keys[1] for keys in _SHARD_KEYS.values()], minimum=1)
    try:
        return PlanGroup(strategy, lookups, shard_id, shard_count)
    except ValueError as error:
        raise ValueError(f"GPU {g} group {k}: {error}") from None


def _index_list(value: Any, path: str) -> Tuple[int, ...]:
    if not isinstance(value, list):
        raise ValueError(f"{path}: expected a list of lookup indices, got {_show(value)}")
    for i, lookup in enumerate(value):
        if not _is_index(lookup):
            raise ValueError(f"{path}[{i}]: expected a non-negative integer, got {_show(lookup)}")
    return tuple(value)


def _shard_field(item: Dict[str, Any], path: str, keys: Sequence[str], minimum: int) -> Optional[int]:
    """The value under whichever spelling of a shard key the group uses, or None."""
    found: Dict[str, int] = {}
    for key in keys:
        if key not in item:
            continue
        value = item[key]
        if not _is_index(value) or value < minimum:
            raise ValueError(f'{path}["{key}"]: expected an integer >= {minimum}, got {_show(value)}')
        found[key] = value
    if len(set(found.values())) > 1:
        spelled = " and ".join(f'"{key}" {value}' for key, value in found.items())
        raise ValueError(f"{path}: {spelled} disagree")
    return next(iter(found.values()), None)


def _check_global_lists(obj: List[Any], plan: PlanFile) -> None:
    """Each ``global_embedding_list`` given must list every GPU's local list of its group."""
    for g, entry in enumerate(obj):
        for k, item in enumerate(entry):
            if _GLOBAL_KEY not in item:
                continue
            path = f'plan[{g}][{k}]["{_GLOBAL_KEY}"]'
            value = item[_GLOBAL_KEY]
            if not isinstance(value, list):
                raise ValueError(f"{path}: expected a list of lookups per GPU, got {_show(value)}")
            given = [sorted(_index_list(inner, f"{path}[{h}]")) for h, inner in enumerate(value)]
            expected = [list(groups[k].lookups) for groups in plan.gpus]
            if given != [sorted(local) for local in expected]:
                raise ValueError(f"{path}: GPU {g} group {k}: does not match the local lists of the "
                                 f"group: expected {_show(expected)}, got {_show(value)}")
