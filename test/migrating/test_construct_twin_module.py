"""Upstream's test helper ``dynamicemb.construct_twin_module.ConstructTwinModule``: a
model of dynamic tables and its TorchRec twin that train alike (2 gloo ranks)."""

import pytest
from torchrec.distributed.fbgemm_qcomm_codec import CommType

from dynamicemb.construct_twin_module import ConstructTwinModule
from dynamicemb_testing import twin_workers
from dynamicemb_testing.dist_utils import run_distributed


@pytest.mark.parametrize("pooled,optimizer", [(True, "exact_row_wise_adagrad"), (False, "sgd")])
def test_twins_train_alike_on_two_ranks(pooled, optimizer):
    run_distributed(twin_workers.twins_train_alike, 2, pooled, optimizer)


@pytest.mark.parametrize("kw,match", [
    (dict(dims=[8]), "dims must hold table_num=2"),
    (dict(optimizer_kwargs={"optimizer": "lamb"}), "optimizer"),
    (dict(fwd_a2a_precision=CommType.FP16), "quantized"),
    (dict(scale_factor=0), "scale_factor"),
])
def test_bad_arguments_are_refused_by_name(kw, match):
    args = {**dict(table_num=2, dims=[8, 8], num_embeddings=[10, 10], pooling_mode=None,
                   is_pooled=False, multi_hot_sizes=[1, 1]), **kw}
    with pytest.raises(ValueError, match=match):
        ConstructTwinModule(**args)
