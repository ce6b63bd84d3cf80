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
}


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
    if any(w < 1 for w in widths) or (kind == "cnn" and not widths):
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
    return _cnn(_image_shape(shape, spec), widths, feature_dim)


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
