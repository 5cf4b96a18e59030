"""optkit.model.batchnorm and optkit.model.dataflow: BatchNorm folded only where the data flow shows a single conv or
linear layer feeding it, the model's eval output kept; torch.fx and the autograd graph agree on the flow."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from optkit.model import dataflow
from optkit.model.batchnorm import fold_batchnorm
from tests.support.batchnorm_nets import BNS, DataDependent, build, eval_out, randomize_bn, rel

SHAPE = (1, 3, 64, 64)


@pytest.fixture
def no_fx(monkeypatch):
    """Force the autograd-graph fallback, as for a model torch.fx cannot trace."""
    def refuse(model):
        raise RuntimeError("tracing disabled by the test")
    monkeypatch.setattr(dataflow, "_fx_flow", refuse)


@pytest.mark.parametrize("name", ["resnet18", "resnet50", "mobilenet_v2", "efficientnet_b0", "regnet_y_400mf"])
def test_fold_preserves_output_and_removes_batchnorms(name):
    model = build(name)
    randomize_bn(model)
    x = torch.randn(2, *SHAPE[1:])
    before = eval_out(model, x)
    bns = sum(isinstance(m, BNS) for m in model.modules())

    details = fold_batchnorm(model, input_shape=SHAPE)

    assert rel(eval_out(model, x), before) <= 1e-4
    assert len(details["folded"]) == bns and details["not_folded"] == {}
    assert not any(isinstance(m, BNS) for m in model.modules())


@pytest.mark.slow
def test_fold_leaves_densenet_bn_before_conv_and_reports_it():
    model = build("densenet121")
    randomize_bn(model)
    x = torch.randn(2, *SHAPE[1:])
    before = eval_out(model, x)
    details = fold_batchnorm(model, input_shape=SHAPE)
    assert rel(eval_out(model, x), before) <= 1e-4
    assert "features.norm0" in details["folded"]
    assert "op:cat" in details["not_folded"]["features.denseblock1.denselayer1.norm1"]
    left = {name for name, m in model.named_modules() if isinstance(m, BNS)}
    assert left == set(details["not_folded"])


@pytest.mark.parametrize("fx", [True, False], ids=["fx", "autograd"])
def test_fold_leaves_bn_that_comes_before_the_conv(fx, request):
    if not fx:
        request.getfixturevalue("no_fx")
    model = nn.Sequential(nn.BatchNorm2d(3), nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU())
    randomize_bn(model)
    x = torch.randn(2, 3, 16, 16)
    before = eval_out(model, x)
    details = fold_batchnorm(model, input_shape=(1, 3, 16, 16))
    assert details["dataflow"] == ("fx" if fx else "autograd")
    assert details["folded"] == {"2": "1"}
    assert "input" in details["not_folded"]["0"]
    assert isinstance(model[0], nn.BatchNorm2d) and isinstance(model[2], nn.Identity)
    assert rel(eval_out(model, x), before) <= 1e-5


def test_fold_leaves_bn_whose_conv_also_feeds_an_add_without_fx():
    model = DataDependent()
    randomize_bn(model)
    x = torch.randn(2, 3, 16, 16)
    before = eval_out(model, x)
    details = fold_batchnorm(model, input_shape=(1, 3, 16, 16))
    assert details["dataflow"] == "autograd"
    assert details["folded"] == {"bn1": "conv1"}
    assert "conv2's output also goes to" in details["not_folded"]["bn2"]
    assert rel(eval_out(model, x), before) <= 1e-5


def test_fold_linear_into_batchnorm1d_only_for_2d_outputs():
    model = nn.Sequential(nn.Flatten(), nn.Linear(12, 6), nn.BatchNorm1d(6), nn.Unflatten(1, (6, 1)),
                          nn.Linear(1, 6), nn.BatchNorm1d(6))
    randomize_bn(model)
    x = torch.randn(4, 3, 2, 2)
    before = eval_out(model, x)
    details = fold_batchnorm(model, input_shape=(1, 3, 2, 2))
    assert details["folded"] == {"2": "1"}
    assert "not 2-D" in details["not_folded"]["5"]
    assert rel(eval_out(model, x), before) <= 1e-5


def testdataflow_fallback_agrees_with_fx_on_module_edges():
    model = build("resnet18")

    def modules_only(labels):
        return {label for label in labels if not label.startswith("op:")}

    fx = dataflow._fx_flow(model)
    graph = dataflow._autograd_flow(model, torch.randn(SHAPE))
    assert dict(graph.calls) == dict(fx.calls)
    for name in fx.calls:
        assert modules_only(graph.users[name]) == modules_only(fx.users[name]), name
        assert modules_only(graph.producers[name]) == modules_only(fx.producers[name]), name
