"""Hot-row replicas with bounded staleness (``replica_staleness`` s > 0) under DMP on 2
and 4 gloo ranks, EC and EBC: SGD equals a float64 replay in which the replicated
rows' gradients of each window are applied at its end (``stale_workers``),
checkpoints and state dicts flush pending gradients first, loads drop the copies;
the option's and the optimizers' refusals; ``read_rows`` and ``read_optimizer_states``
read without changing; the copies' local update is the kernels' (``step_rows``)."""

import pytest
import torch

from dynamicemb import BatchedDynamicEmbeddingTables, DynamicEmbTableOptions
from dynamicemb.shard.stale_replicas import DELAYED_OPTIMIZERS
from dynamicemb.types import DynamicEmbScoreStrategy
from dynamicemb_testing import stale_workers
from dynamicemb_testing.dist_utils import SharedSpawns

# (staleness, collection)
TWO_RANKS = [(3, "ec"), (2, "ebc"), (1, "ec")]


@pytest.fixture(scope="module")
def spawns(tmp_path_factory):
    spawns = SharedSpawns(str(tmp_path_factory.mktemp("stale")))
    spawns.run(2, [(f"sgd-{s}-{c}", stale_workers.stale_sgd_matches_window_reference,
                    (s, c, str(tmp_path_factory.mktemp(f"ckpt-{s}-{c}")))) for s, c in TWO_RANKS]
               + [("state-dict", stale_workers.stale_state_dict_and_flush, ()),
                  ("eval-unseen", stale_workers.stale_eval_of_unseen_ids, ()),
                  ("refusals", stale_workers.stale_refusals, ())])
    spawns.run(4, [("sgd-4-ranks", stale_workers.stale_sgd_matches_window_reference,
                    (3, "ec", str(tmp_path_factory.mktemp("ckpt-4"))))])
    return spawns


@pytest.mark.parametrize("staleness, collection", TWO_RANKS)
def test_stale_sgd_equals_windowed_reference_on_two_ranks(spawns, staleness, collection):
    spawns.check(f"sgd-{staleness}-{collection}")


def test_stale_sgd_equals_windowed_reference_on_four_ranks(spawns):
    spawns.check("sgd-4-ranks")


def test_state_dict_and_flush_replicas_apply_pending_once(spawns):
    spawns.check("state-dict")


def test_eval_of_unseen_replicated_ids_reads_the_eval_initializer(spawns):
    spawns.check("eval-unseen")


def test_adam_weight_decay_and_mixed_staleness_are_refused(spawns):
    spawns.check("refusals")


@pytest.mark.parametrize("staleness, says", [(-1, "int >= 0"), (1.0, "int >= 0"), (True, "int >= 0"),
                                             ("3", "int >= 0"), (None, "int >= 0")])
def test_bad_staleness_is_refused(staleness, says):
    with pytest.raises(ValueError, match=says):
        DynamicEmbTableOptions(dim=8, replicas=4, replica_staleness=staleness)


def test_staleness_needs_replicas_and_no_admission():
    with pytest.raises(ValueError, match="needs replicas > 0"):
        DynamicEmbTableOptions(dim=8, replica_staleness=10)
    from dynamicemb import FrequencyAdmissionStrategy  # noqa: PLC0415

    with pytest.raises(ValueError, match="admit_strategy"):
        DynamicEmbTableOptions(dim=8, replicas=4, replica_staleness=10,
                               admit_strategy=FrequencyAdmissionStrategy(threshold=2))
    assert DynamicEmbTableOptions(dim=8, replicas=0.01, replica_staleness=100).replica_staleness == 100
    assert DynamicEmbTableOptions(dim=8).replica_staleness == 0


def test_read_rows_reads_without_changing_anything():
    options = DynamicEmbTableOptions(dim=4, max_capacity=1024,
                                     score_strategy=DynamicEmbScoreStrategy.LFU)
    module = BatchedDynamicEmbeddingTables([options], table_names=["t"], feature_table_map=[0])
    ids = torch.tensor([3, 5, 3, 9])
    module(ids, torch.tensor([0, 4]))
    before = module.export_keys_values("t")
    got = module.read_rows("t", torch.tensor([9, 42, 3]))
    after = module.export_keys_values("t")
    for field in before._fields:
        assert torch.equal(getattr(before, field), getattr(after, field)), field
    stored = dict(zip(before.keys.tolist(), before.embeddings))
    assert torch.equal(got[0], stored[9]) and torch.equal(got[2], stored[3])
    module(torch.tensor([42]), torch.tensor([0, 1]))  # the row an insert stores
    inserted = module.export_keys_values("t")
    assert torch.equal(got[1], dict(zip(inserted.keys.tolist(), inserted.embeddings))[42])


@pytest.mark.parametrize("optimizer", list(DELAYED_OPTIMIZERS))
@pytest.mark.parametrize("layout", ["one tier", "host only", "cache"])
def test_copies_take_the_kernels_update_and_read_states_without_changing(optimizer, layout):
    # a table's own step on two rows (stored in its tiers) and the copies' update
    # (``step_rows``) from the states read_optimizer_states gives agree
    # every tier a row's state can be read from: the one tier, the host store behind
    # an empty device tier, a device cache over the host store
    options = DynamicEmbTableOptions(dim=4, max_capacity=1024, caching=layout == "cache",
                                     local_hbm_for_values={"one tier": None, "host only": 0,
                                                           "cache": 512}[layout])
    module = BatchedDynamicEmbeddingTables([options], table_names=["t"], feature_table_map=[0],
                                           optimizer=optimizer, learning_rate=0.1)
    ids, offsets = torch.tensor([3, 5, 3, 9]), torch.tensor([0, 4])
    for _ in range(2):  # rows with a non-trivial state
        out = module(ids, offsets)
        out.backward(torch.linspace(-1, 1, out.numel()).reshape(out.shape))
    keys = torch.tensor([3, 9, 42])  # 42: not stored
    before = module.export_keys_values("t")
    rows, states = module.read_rows("t", keys), module.read_optimizer_states("t", keys)
    after = module.export_keys_values("t")
    for field in before._fields:
        assert torch.equal(getattr(before, field), getattr(after, field)), field
    stored = dict(zip(before.keys.tolist(), before.optimizer_states))
    assert torch.equal(states[0], stored[3]) and torch.equal(states[1], stored[9])
    assert torch.equal(states[2], torch.zeros_like(states[2]))  # the initial state
    grad = torch.tensor([[0.5, -1.0, 0.25, 2.0], [-0.75, 0.5, 1.5, -0.25]])
    copies = torch.cat([rows[:2], states[:2]], 1)
    module.step_rows("t", copies, grad)  # what a copy's write-back step runs
    out = module(torch.tensor([3, 9]), torch.tensor([0, 1, 2]))  # one id per bag
    out.backward(grad)
    trained = module.export_keys_values("t")
    got = dict(zip(trained.keys.tolist(), zip(trained.embeddings, trained.optimizer_states)))
    for i, key in enumerate([3, 9]):  # the same kernel: the same bits
        assert torch.equal(copies[i, :4], got[key][0]), key
        assert torch.equal(copies[i, 4:], got[key][1]), key


def test_step_rows_refuses_adam():
    module = BatchedDynamicEmbeddingTables([DynamicEmbTableOptions(dim=4, max_capacity=64)],
                                           table_names=["t"], optimizer="adam")
    with pytest.raises(ValueError, match="not ADAM"):
        module.step_rows("t", torch.zeros(1, 12), torch.zeros(1, 4))


@pytest.mark.parametrize("optimizer", DELAYED_OPTIMIZERS, ids=lambda o: o.name)
def test_step_rows_is_the_same_on_the_cuda_backend(optimizer):
    """The copies' update runs the backward's kernels: the CUDA backend's (emulated
    here) gives the CPU's bits."""
    from dynamicemb_testing.cuda_emulation import emulated_cuda  # noqa: PLC0415

    def stepped():
        module = BatchedDynamicEmbeddingTables([DynamicEmbTableOptions(dim=4, max_capacity=64)],
                                               table_names=["t"], optimizer=optimizer,
                                               learning_rate=0.1)
        width = 4 + module.optimizer_state_dim("t")
        values = torch.linspace(0.1, 1.0, 3 * width).reshape(3, width)
        module.step_rows("t", values, torch.linspace(-1, 1, 12).reshape(3, 4))
        return values
    cpu = stepped()
    with emulated_cuda():
        assert torch.equal(stepped(), cpu)
