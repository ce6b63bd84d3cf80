"""Layer groups: a weight layer plus the normalisation after it, shortcuts apart, head last."""

import pytest

from bayesfl.bodies import build_body
from bayesfl.errors import ConfigError
from bayesfl.layer_groups import describe_groups, group_sizes, is_statistic, layer_groups
from bayesfl.strategies.networks import ClassifierNet

# spec fedpart.md §1.2: ResNet-8 on CIFAR-10, group sizes from Fling's code
PAPER_RESNET8 = [
    ("body.pre_conv", 9_536), ("body.layers.0.0.conv1", 36_992),
    ("body.layers.0.0.conv2", 36_992), ("body.layers.1.0.conv1", 73_984),
    ("body.layers.1.0.conv2", 147_712), ("body.layers.1.0.downsample.0", 8_448),
    ("body.layers.2.0.conv1", 295_424), ("body.layers.2.0.conv2", 590_336),
    ("body.layers.2.0.downsample.0", 33_280), ("head", 2_570)]


def resnet8(widths="", shape=(3, 32, 32), d=256):
    spec = "resnet8" + (f":{widths}" if widths else "")
    return ClassifierNet(build_body(spec, shape, d), d, 10)


def test_resnet8_gives_the_papers_ten_groups_in_order():
    model = resnet8()
    groups = layer_groups(model)
    assert group_sizes(model) == PAPER_RESNET8
    assert [g.kind for g in groups] == ["body"] * 9 + ["head"]
    assert groups[1].parameters == ("body.layers.0.0.conv1.weight", "body.layers.0.0.bn1.weight",
                                    "body.layers.0.0.bn1.bias")
    assert groups[1].buffers == ("body.layers.0.0.bn1.running_mean",
                                 "body.layers.0.0.bn1.running_var")
    assert groups[-1].buffers == ()
    # the groups partition the parameters and the running statistics
    names = [n for g in groups for n in g.parameters]
    assert sorted(names) == sorted(n for n, _ in model.named_parameters())
    stats = [n for g in groups for n in g.buffers]
    assert sorted(stats) == sorted(n for n, _ in model.named_buffers() if is_statistic(n))
    assert "head" in describe_groups(groups) and "47.8%" in describe_groups(groups)


def test_an_mlp_has_one_group_per_linear_layer():
    model = ClassifierNet(build_body("mlp:8", (6,), 4), 4, 3)
    assert group_sizes(model) == [("body.1", 6 * 8 + 8), ("body.3", 8 * 4 + 4),
                                  ("head", 4 * 3 + 3)]


def test_prefixes_override_the_automatic_groups():
    model = resnet8("4-4-4", (64,), 4)
    stages = ["body.pre_conv", "body.pre_bn", "body.layers.0", "body.layers.1", "body.layers.2",
              "head"]
    groups = layer_groups(model, prefixes=stages)
    assert [g.name for g in groups] == stages
    assert groups[1].buffers == ("body.pre_bn.running_mean", "body.pre_bn.running_var")
    assert sum(g.numel for g in groups) == sum(p.numel() for p in model.parameters())
    with pytest.raises(ConfigError, match="missed"):
        layer_groups(model, prefixes=["body.pre_conv", "head"])
    with pytest.raises(ConfigError, match="in several"):
        layer_groups(model, prefixes=["body", "body.pre_conv", "head"])
    with pytest.raises(ConfigError, match="non-empty list"):
        layer_groups(model, prefixes="body")


def test_small_groups_merge_into_the_next_one():
    sizes = [n for _, n in PAPER_RESNET8]
    merged = layer_groups(resnet8(), min_group_size=30_000)
    # 9,536 joins the first 36,992; 8,448 joins conv1 of stage 3; the 2,570 head joins the
    # group before it (nothing follows it)
    assert [g.numel for g in merged] == [sizes[0] + sizes[1], sizes[2], sizes[3], sizes[4],
                                         sizes[5] + sizes[6], sizes[7], sizes[8] + sizes[9]]
    assert merged[0].name == "body.pre_conv+body.layers.0.0.conv1"
    with pytest.raises(ConfigError, match="min_group_size"):
        layer_groups(resnet8("4-4-4", (64,), 4), min_group_size=-1)
