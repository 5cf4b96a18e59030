from dataclasses import dataclass

import pytest
import torch
import torchvision

from optkit.core.errors import PassError
from optkit.core.contract import Pass, PassResult
from optkit.passes.prune.passes import L1Unstructured, StructuredPrune
from optkit.core.pipeline import Pipeline


@dataclass(frozen=True)
class Explode(Pass):
    """A pass that always fails (test double)."""

    name = "explode"

    def apply(self, model):
        raise RuntimeError("boom")


def test_records_per_pass_time_params_macs_and_sparsity():
    model = torchvision.models.resnet18(num_classes=10)
    run = Pipeline([StructuredPrune(ratio=0.5), L1Unstructured(ratio=0.2)], input_shape=(1, 3, 64, 64)).run(model)
    prune_record, sparse_record = run.records
    assert [r.name for r in run.records] == ["structured_prune", "l1_unstructured"]
    assert all(r.seconds > 0 for r in run.records)
    assert prune_record.stats.params < run.before.params * 0.4
    assert prune_record.stats.macs < run.before.macs * 0.4
    assert sparse_record.stats.params == prune_record.stats.params
    assert sparse_record.stats.sparsity == pytest.approx(0.2, abs=0.005)
    assert run.after == sparse_record.stats
    assert prune_record.details["skipped_layers"] == {}
    assert prune_record.details["pruned_layers"] == 21


def test_failing_pass_is_named_with_the_passes_before_it():
    model = torchvision.models.resnet18(num_classes=10)
    pipeline = Pipeline([L1Unstructured(ratio=0.1), Explode()], input_shape=(1, 3, 32, 32))
    with pytest.raises(PassError, match=r"pass 'explode' failed \(passes completed before it: l1_unstructured\): boom") as info:
        pipeline.run(model)
    assert info.value.pass_name == "explode" and info.value.completed == ["l1_unstructured"]
    assert isinstance(info.value.__cause__, RuntimeError)


def test_shared_input_shape_is_filled_only_where_unset():
    own = StructuredPrune(ratio=0.3, input_shape=(2, 3, 32, 32))
    pipeline = Pipeline([StructuredPrune(ratio=0.3), own, L1Unstructured()], input_shape=(1, 3, 64, 64))
    filled, kept, unstructured = pipeline.resolved_passes()
    assert filled.input_shape == (1, 3, 64, 64)
    assert kept.input_shape == (2, 3, 32, 32)
    assert unstructured == L1Unstructured()
    assert pipeline.passes[0].input_shape is None


def test_progress_callback_sees_every_pass():
    seen = []
    Pipeline([L1Unstructured(ratio=0.1)], input_shape=(1, 3, 32, 32)).run(
        torchvision.models.resnet18(), measure_stats=False, on_pass=lambda i, n, name: seen.append((i, n, name)))
    assert seen == [(0, 1, "l1_unstructured")]


def test_pass_result_details_default_empty():
    assert PassResult(torch.nn.Identity()).details == {}
