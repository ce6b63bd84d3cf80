"""Analytic training FLOPs: forward everywhere, backward only where autograd goes."""

from torch import nn

from bayesfl.bodies import build_body
from bayesfl.flops import step_flops
from bayesfl.strategies.networks import ClassifierNet


def mlp():
    return ClassifierNet(build_body("mlp:8", (6,), 4), 4, 3)  # 6 -> 8 -> 4 -> 3


def test_mlp_counts_by_hand():
    f1, f2, f3 = 2 * 6 * 8, 2 * 8 * 4, 2 * 4 * 3  # 2 FLOPs per multiply-add, per sample
    full = step_flops(mlp(), (6,), lambda n: True)
    # weight grads of all three; input grads of layers 2 and 3 (the data needs none)
    assert (full.forward, full.backward) == (f1 + f2 + f3, (f1 + f2 + f3) + (f2 + f3))
    head = step_flops(mlp(), (6,), lambda n: n.startswith("head"))
    assert (head.forward, head.backward) == (f1 + f2 + f3, f3)  # backward stops at the head
    first = step_flops(mlp(), (6,), lambda n: n.startswith("body.1."))
    # frozen layers above the trainable one still pass the gradient down (input grads)
    assert first.backward == f1 + (f2 + f3)


def test_conv_counts_by_hand_and_a_frozen_side_branch_gets_no_backward():
    model = ClassifierNet(build_body("resnet8:4-8-8", (64,), 8), 8, 3)
    full = step_flops(model, (64,), lambda n: True)
    stem = 2 * (4 * 4 * 4) * (1 * 7 * 7)  # 8x8 -> 4x4 map, 4 channels, 1x7x7 fan-in
    assert full.forward > stem
    # group 4 (stage-2 conv1 + bn1) trains: its weight grad, input grads of everything
    # downstream of it, and nothing for the stage-2 shortcut, whose input does not depend on it
    active = {"body.layers.1.0.conv1.weight", "body.layers.1.0.bn1.weight",
              "body.layers.1.0.bn1.bias"}
    part = step_flops(model, (64,), active.__contains__)
    per_layer = {}
    for name, module in model.named_modules():
        if isinstance(module, nn.Conv2d | nn.Linear):
            per_layer[name] = module
    # maps on 8x8 digits: stem 4x4, after pool 2x2 (stage 1), 1x1 (stages 2 and 3)
    f = {"conv1_s2": 2 * 8 * 1 * (4 * 9), "conv2_s2": 2 * 8 * (8 * 9),
         "ds_s2": 2 * 8 * 4, "conv1_s3": 2 * 8 * (8 * 9), "conv2_s3": 2 * 8 * (8 * 9),
         "ds_s3": 2 * 8 * 8, "head": 2 * 8 * 3}
    downstream = f["conv2_s2"] + f["conv1_s3"] + f["conv2_s3"] + f["ds_s3"] + f["head"]
    # no f["ds_s2"] anywhere: the stage-2 shortcut reads the stage-1 output
    assert part.backward == f["conv1_s2"] + downstream
    assert part.forward == full.forward
    assert len(per_layer) == 10  # stem, 2 + 2 + 2 convs, two stride-2 shortcuts, head
