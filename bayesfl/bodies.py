"""Client network bodies (feature extractors) built from short spec strings.

A body maps inputs (B, *input_shape) to features (B, feature_dim). Every body ends in a linear
layer to ``feature_dim`` followed by a ReLU, so features are non-negative as in FedLog's
bodies. Clients may use different specs (FedLog's flexible-architecture setting) as long as they
agree on ``feature_dim``; :func:`check_feature_dim` verifies that.

Spec forms (:data:`BODY_KINDS`):

``mlp`` or ``mlp:W1-W2-...``
    Flatten, then Linear+ReLU layers of widths W1, W2, ..., then Linear(feature_dim)+ReLU.
    ``mlp`` alone is a single Linear(feature_dim)+ReLU.
``cnn:C1-C2-...``
    Conv2d(3x3, padding 1)+ReLU+MaxPool(2) blocks with C1, C2, ... channels (pooling is skipped
    once the map is 1 pixel wide), flatten, then Linear(feature_dim)+ReLU. Inputs of shape
    (C, H, W) are used as is, (H, W) gains a channel, and a flat (D,) input with D a perfect
    square is reshaped to (1, sqrt(D), sqrt(D)) (e.g. digits' 64 -> 1x8x8).
``resnet8`` or ``resnet8:W1-W2-W3``
    The ResNet-8 of the FedPart paper (spec fedpart.md §1.2, Fling's version): a 7x7 stride-2
    stem conv + BatchNorm + ReLU + 3x3 stride-2 max-pool, then one BasicBlock per stage of
    widths W1-W2-W3 (default 64-128-256; stages 2 and 3 stride 2 with a 1x1 conv + BN
    shortcut), global average pooling. Parameter names follow Fling (``pre_conv``, ``pre_bn``,
    ``layers.S.0.conv1`` / ``bn1`` / ``conv2`` / ``bn2`` / ``downsample.0`` / ``downsample.1``),
    each block registering its shortcut after conv2. With ``feature_dim == W3`` the pooled
    features (non-negative: they follow a ReLU) are the output, so body + head is exactly the
    paper's network (ten FedPart layer groups with the head); any other ``feature_dim`` adds
    ``proj`` = Linear(W3, feature_dim) + ReLU. Works down to 8x8 inputs (the map is 1x1 from
    stage 2 on there). Its BatchNorm layers keep running statistics (buffers).
``lenet5``
    LeNet5-like (spec colearn.md): Conv(C->6, 5x5)+ReLU+MaxPool(2), Conv(6->16, 5x5)+ReLU+
    MaxPool(2), flatten, Linear(->120)+ReLU, Linear(120->feature_dim)+ReLU (feature_dim 84 in
    the paper). A conv is "valid" (no padding) on maps of at least 12 pixels, so MNIST 28x28
    runs as the classic net (28 -> 24 -> 12 -> 8 -> 4: 256 features into the first Linear,
    43,576 body parameters at feature_dim 84) and CIFAR's 32x32 as LeNet-5 (400 features);
    a smaller map (digits' 8x8) gets "same" padding 2 (8 -> 8 -> 4 -> 4 -> 2: 64 features) so
    two conv + pool stages still leave a map.
``lg-cnn-mnist``, ``lg-cnn-cifar``
    The LG-FedAvg CNNs (spec fedlog.md §6 "Architectures"), without their dropout (a vmapped
    client batch draws no per-client dropout masks, so no body here has dropout).
    ``lg-cnn-mnist``: Conv(C->10, 5x5)+MaxPool(2)+ReLU, Conv(10->20, 5x5)+MaxPool(2)+ReLU,
    flatten (320 on 28x28), Linear(->feature_dim)+ReLU (feature_dim 50 in the paper).
    ``lg-cnn-cifar``: Conv(C->6, 5x5)+ReLU+MaxPool(2), Conv(6->16, 5x5)+ReLU+MaxPool(2),
    flatten (400 on 32x32), Linear(->120)+ReLU, Linear(120->feature_dim)+ReLU (100 in the
    paper). Both use the same padding rule as ``lenet5`` (the originals are valid convs on
    28x28 / 32x32 inputs, which they stay).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

from bayesfl.errors import ConfigError

BODY_KINDS: dict[str, str] = {
    "mlp": "mlp or mlp:W1-W2-... (hidden widths, e.g. mlp:200-200)",
    "cnn": "cnn:C1-C2-... (conv channels, e.g. cnn:16-32)",
    "resnet8": "resnet8 or resnet8:W1-W2-W3 (stage widths, default 64-128-256)",
    "lenet5": "lenet5",
    "lg-cnn-mnist": "lg-cnn-mnist",
    "lg-cnn-cifar": "lg-cnn-cifar",
}
RESNET8_WIDTHS = (64, 128, 256)
_SAME_PADDING_BELOW = 12
"""A 5x5 conv of the LeNet-style bodies pads by 2 on maps smaller than this (else valid)."""


def _valid_forms() -> str:
    return "; ".join(BODY_KINDS.values())


def parse_body_spec(spec: str) -> tuple[str, tuple[int, ...]]:
    """Split ``"mlp:200-200"`` into ``("mlp", (200, 200))``.

    Raises:
        ConfigError: listing the valid forms, for an unknown kind or malformed widths.
    """
    if not isinstance(spec, str):
        raise ConfigError(f"body spec must be a string, got {type(spec).__name__}; "
                          f"valid forms: {_valid_forms()}")
    kind, _, sizes = spec.strip().partition(":")
    kind = kind.strip().lower()
    if kind not in BODY_KINDS:
        raise ConfigError(f"unknown body kind in spec {spec!r}; valid forms: {_valid_forms()}")
    try:
        widths = tuple(int(w) for w in sizes.split("-")) if sizes.strip() else ()
    except ValueError:
        widths = (0,)
    wrong_count = ((kind == "cnn" and not widths)
                   or (kind == "resnet8" and len(widths) not in (0, 3))
                   or (kind in ("lenet5", "lg-cnn-mnist", "lg-cnn-cifar") and bool(widths)))
    if any(w < 1 for w in widths) or wrong_count:
        raise ConfigError(f"malformed body spec {spec!r}: sizes must be positive integers joined "
                          f"by '-'; valid forms: {_valid_forms()}")
    return kind, widths


def build_body(spec: str, input_shape: tuple[int, ...], feature_dim: int) -> nn.Module:
    """Build the body described by ``spec`` for inputs of ``input_shape``.

    Args:
        spec: e.g. ``"mlp:200-200"`` or ``"cnn:16-32"`` (module docstring).
        input_shape: shape of one input, without the batch dimension.
        feature_dim: number of output features d.

    Returns:
        A module mapping (B, *input_shape) float tensors to (B, feature_dim) non-negative
        features; its parameters are on the CPU in float32 (move it with ``.to(device)``).

    Raises:
        ConfigError: a bad spec, a non-positive ``feature_dim``, or a CNN for an input that is
            not an image.
    """
    kind, widths = parse_body_spec(spec)
    shape = tuple(int(s) for s in input_shape)
    if not shape or any(s < 1 for s in shape):
        raise ConfigError(f"input_shape must be a non-empty tuple of positive sizes, got "
                          f"{input_shape}")
    if not isinstance(feature_dim, int) or feature_dim < 1:
        raise ConfigError(f"feature_dim must be a positive integer, got {feature_dim!r}")
    if kind == "mlp":
        return _mlp(math.prod(shape), widths, feature_dim)
    image = _image_shape(shape, spec)
    if kind == "resnet8":
        return ResNet8(image, widths or RESNET8_WIDTHS, feature_dim)
    if kind == "lenet5":
        return _lenet(image, [(6, True), (16, True)], [120, feature_dim])
    if kind == "lg-cnn-mnist":
        return _lenet(image, [(10, False), (20, False)], [feature_dim])
    if kind == "lg-cnn-cifar":
        return _lenet(image, [(6, True), (16, True)], [120, feature_dim])
    return _cnn(image, widths, feature_dim)


def _mlp(in_features: int, widths: Sequence[int], feature_dim: int) -> nn.Module:
    layers: list[nn.Module] = [nn.Flatten()]
    for width in widths:
        layers += [nn.Linear(in_features, width), nn.ReLU()]
        in_features = width
    layers += [nn.Linear(in_features, feature_dim), nn.ReLU()]
    return nn.Sequential(*layers)


def _image_shape(shape: tuple[int, ...], spec: str) -> tuple[int, int, int]:
    if len(shape) == 3:
        return shape  # type: ignore[return-value]
    if len(shape) == 2:
        return (1, *shape)
    side = math.isqrt(shape[0]) if len(shape) == 1 else 0
    if side * side != shape[0] or len(shape) != 1:
        raise ConfigError(f"body {spec!r} needs an image input (C, H, W), (H, W) or a flat "
                          f"square (D = s*s), got input_shape {shape}; use an mlp spec instead")
    return (1, side, side)


class _ToImage(nn.Module):
    """Reshape (B, *anything) to (B, C, H, W)."""

    def __init__(self, image_shape: tuple[int, int, int]) -> None:
        super().__init__()
        self.image_shape = image_shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.reshape(x.shape[0], *self.image_shape)


def _cnn(image_shape: tuple[int, int, int], channels: Sequence[int], feature_dim: int) -> nn.Module:
    in_channels, height, width = image_shape
    layers: list[nn.Module] = [_ToImage(image_shape)]
    for out_channels in channels:
        layers += [nn.Conv2d(in_channels, out_channels, kernel_size=3, padding=1), nn.ReLU()]
        if min(height, width) >= 2:
            layers.append(nn.MaxPool2d(2))
            height, width = height // 2, width // 2
        in_channels = out_channels
    layers += [nn.Flatten(), nn.Linear(in_channels * height * width, feature_dim), nn.ReLU()]
    return nn.Sequential(*layers)


def _lenet(
    image_shape: tuple[int, int, int], convs: Sequence[tuple[int, bool]], widths: Sequence[int]
) -> nn.Module:
    """5x5 conv stages ``(channels, relu_before_pool)`` then Linear+ReLU layers of ``widths``.

    A conv pads by 2 on maps smaller than :data:`_SAME_PADDING_BELOW` (module docstring);
    pooling is skipped once the map is one pixel wide.
    """
    in_channels, height, width = image_shape
    layers: list[nn.Module] = [_ToImage(image_shape)]
    for out_channels, relu_first in convs:
        pad = 2 if min(height, width) < _SAME_PADDING_BELOW else 0
        layers.append(nn.Conv2d(in_channels, out_channels, kernel_size=5, padding=pad))
        height, width = height + 2 * pad - 4, width + 2 * pad - 4
        pool = [nn.MaxPool2d(2)] if min(height, width) >= 2 else []
        layers += [nn.ReLU(), *pool] if relu_first else [*pool, nn.ReLU()]
        if pool:
            height, width = height // 2, width // 2
        in_channels = out_channels
    layers.append(nn.Flatten())
    in_features = in_channels * height * width
    for out_features in widths:
        layers += [nn.Linear(in_features, out_features), nn.ReLU()]
        in_features = out_features
    return nn.Sequential(*layers)


class BasicBlock(nn.Module):
    """ResNet BasicBlock: conv3x3-BN-ReLU-conv3x3-BN plus the identity or a 1x1 conv + BN
    ``downsample`` shortcut (registered after conv2, as Fling does), then ReLU."""

    def __init__(self, in_channels: int, out_channels: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.downsample: nn.Module = nn.Identity()
        if stride != 1 or in_channels != out_channels:
            self.downsample = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride, bias=False),
                nn.BatchNorm2d(out_channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return torch.relu(out + self.downsample(x))


class ResNet8(nn.Module):
    """The FedPart paper's ResNet-8 body (module docstring): (B, *input) -> (B, feature_dim).

    Args:
        image_shape: (C, H, W) of one input; flat or 2-D inputs are reshaped to it.
        widths: the three stage widths (W1, W2, W3).
        feature_dim: output width; equal to W3 means no projection layer.
    """

    def __init__(
        self, image_shape: tuple[int, int, int], widths: Sequence[int], feature_dim: int
    ) -> None:
        super().__init__()
        w1, w2, w3 = widths
        self.to_image = _ToImage(image_shape)
        self.pre_conv = nn.Conv2d(image_shape[0], w1, 7, 2, 3, bias=False)
        self.pre_bn = nn.BatchNorm2d(w1)
        self.pool = nn.MaxPool2d(3, 2, 1)
        self.layers = nn.Sequential(*(nn.Sequential(BasicBlock(i, o, s)) for i, o, s in
                                      [(w1, w1, 1), (w1, w2, 2), (w2, w3, 2)]))
        self.proj: nn.Module = nn.Identity()
        if feature_dim != w3:
            self.proj = nn.Sequential(nn.Linear(w3, feature_dim), nn.ReLU())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(torch.relu(self.pre_bn(self.pre_conv(self.to_image(x)))))
        x = self.layers(x).mean(dim=(2, 3))
        return self.proj(x)


def check_feature_dim(body: nn.Module, input_shape: tuple[int, ...], feature_dim: int) -> None:
    """Run a batch of two zero inputs through ``body`` and check it yields (2, feature_dim).

    The probe runs without gradients, in eval mode (the training mode is restored), on the
    device and dtype of the body's first parameter (CPU float32 for a parameter-free body).

    Raises:
        ConfigError: the body fails on such inputs or returns another shape.
    """
    first = next(body.parameters(), None)
    device = first.device if first is not None else torch.device("cpu")
    dtype = first.dtype if first is not None and first.is_floating_point() else torch.float32
    probe = torch.zeros((2, *input_shape), device=device, dtype=dtype)
    was_training = body.training
    body.eval()
    try:
        with torch.no_grad():
            out = body(probe)
    except (RuntimeError, ValueError) as err:
        raise ConfigError(f"body fails on inputs of shape {tuple(input_shape)}: {err}") from err
    finally:
        body.train(was_training)
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != (2, feature_dim):
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ConfigError(f"body output for a batch of 2 is {got}, expected (2, {feature_dim}): "
                          f"every client body must end in feature_dim={feature_dim}")
