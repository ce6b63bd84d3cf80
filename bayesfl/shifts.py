"""Input shifts at stated severities: rotation, additive Gaussian noise, contrast reduction.

Pure torch (``torch.nn.functional.affine_grid`` / ``grid_sample``; no torchvision). Each
transform takes a batch ``x`` (N, *input_shape) and returns a new float tensor of the same
shape, dtype and device; severity 0 returns the inputs unchanged (bitwise).

**The data's range** ``[low, high]`` is the minimum and maximum over every input of the data
set (`data_range`; for digits [0, 1], for the normalised ``mnist_5k`` [-0.4242, 2.8215]).
Noise and contrast results are clipped to it; rotation fills the corners it uncovers with
``low`` (zero fill for pixels in [0, 1]; the background of normalised MNIST).

Transforms (``s`` the severity):

* ``rotate`` (degrees, any finite real): the image rotated by ``s`` degrees **counter-clockwise
  as displayed** (row 0 at the top), like ``torchvision.transforms.functional.rotate``,
  about the image centre, bilinear, the uncovered corners filled with ``low``. A multiple of
  90 degrees moves pixel centres onto pixel centres, so ``rotate(x, 90)`` equals
  ``torch.rot90(x, 1, dims=(-2, -1))`` on a square image, exactly. Needs the images' shape
  (`image_shape_of`): inputs of 3 dims (C, H, W) are images; the flat ``digits`` rows
  are 8x8 images; other flat rows only with ``image_shape`` given.
* ``noise`` (sigma >= 0): ``clip(x + s * (high - low) * eps, low, high)``, ``eps`` standard
  normal per entry. Sigma is in units of the data's range (for pixels in [0, 1], in pixel
  units). ``eps`` is drawn from ``generator``: `apply_shift`'s callers draw it once per
  client and use the same draws at every severity (common random numbers: a curve over
  severities is not made jagged by fresh noise). Works on any data.
* ``contrast`` (s in [0, 1], the fraction of contrast removed): ``clip(m + (1 - s) * (x - m),
  low, high)`` with ``m`` each image's mean over its pixels and channels; ``s = 1`` leaves a
  uniform grey image. Needs images, as ``rotate`` does.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from bayesfl.errors import ConfigError, DataError

SHIFT_KINDS = ("rotate", "noise", "contrast")
"""The input shifts `apply_shift` knows."""

SEVERITY_BOUNDS: dict[str, tuple[float, float]] = {
    "rotate": (-math.inf, math.inf),
    "noise": (0.0, math.inf),
    "contrast": (0.0, 1.0),
}
"""Valid severities of each shift (closed bounds; finite values only)."""

SEVERITY_UNITS = {"rotate": "degrees", "noise": "sigma (data range)",
                  "contrast": "contrast removed"}
"""What each shift's severity measures (axis labels and tables)."""

IMAGE_DATASETS: dict[str, tuple[int, int, int]] = {"digits": (1, 8, 8)}
"""Data sets with flat inputs that are images, by name: their (C, H, W)."""

_NEEDS_IMAGES = ("rotate", "contrast")


@dataclass(frozen=True)
class Shift:
    """One input shift and its severities, e.g. ``Shift("rotate", (15.0, 30.0))``."""

    kind: str
    severities: tuple[float, ...]

    @property
    def label(self) -> str:
        return f"{self.kind}:{','.join(format_severity(s) for s in self.severities)}"


def format_severity(value: float) -> str:
    """``15`` for 15.0, ``0.1`` for 0.1 (the shortest repr of the float)."""
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def parse_shift(text: str) -> Shift:
    """``"rotate:15,30,60"`` -> ``Shift("rotate", (15.0, 30.0, 60.0))`` (the CLI's spelling).

    Raises:
        ConfigError: an unknown kind, no severities, or a severity that is not a number in
            the kind's bounds.
    """
    if not isinstance(text, str) or ":" not in text:
        raise ConfigError(f"a shift is written KIND:S1,S2,... (e.g. rotate:15,30,60 or "
                          f"noise:0.1,0.2); got {text!r}; kinds: {', '.join(SHIFT_KINDS)}")
    kind, _, values = text.partition(":")
    words = [w.strip() for w in values.split(",")]
    severities = []
    for word in words:
        try:
            severities.append(float(word))
        except ValueError:
            raise ConfigError(f"shift {text!r}: severity {word!r} is not a number; write "
                              f"{kind.strip()}:S1,S2,... with numbers") from None
    return check_shift(kind.strip(), severities)


def check_shift(kind: Any, severities: Any) -> Shift:
    """``Shift(kind, severities)`` checked: a known kind, at least one severity, each a finite
    real number within `SEVERITY_BOUNDS` (duplicates dropped, order kept).

    Raises:
        ConfigError: what was wrong and the valid values.
    """
    if kind not in SHIFT_KINDS:
        import difflib

        near = difflib.get_close_matches(str(kind), SHIFT_KINDS, n=1)
        hint = f" (did you mean {near[0]!r}?)" if near else ""
        raise ConfigError(f"unknown shift {kind!r}{hint}; valid: {', '.join(SHIFT_KINDS)}")
    if isinstance(severities, str | bytes) or not isinstance(severities, Iterable):
        raise ConfigError(f"shift {kind!r}: severities must be a list of numbers "
                          f"(e.g. [15, 30]); got {severities!r}")
    low, high = SEVERITY_BOUNDS[kind]
    checked: list[float] = []
    for value in severities:
        if isinstance(value, bool) or not isinstance(value, numbers.Real) \
                or not math.isfinite(float(value)):
            raise ConfigError(f"shift {kind!r}: severity {value!r} is not a finite number")
        if not low <= float(value) <= high:
            raise ConfigError(f"shift {kind!r}: severity {value!r} is outside "
                              f"[{format_severity(low)}, {format_severity(high)}] "
                              f"({SEVERITY_UNITS[kind]})")
        if float(value) not in checked:
            checked.append(float(value))
    if not checked:
        raise ConfigError(f"shift {kind!r} has no severities; give at least one "
                          f"(e.g. {kind}:{'15,30' if kind == 'rotate' else '0.1,0.2'})")
    return Shift(kind, tuple(checked))


def as_shifts(shifts: Any) -> list[Shift]:
    """Shifts given as `Shift`, ``"kind:s1,s2"`` strings or ``(kind, severities)``
    pairs (a mapping kind -> severities too), checked; one entry per kind."""
    if shifts is None:
        return []
    if isinstance(shifts, dict):
        shifts = list(shifts.items())
    if isinstance(shifts, str | Shift) or (isinstance(shifts, tuple) and len(shifts) == 2
                                           and isinstance(shifts[0], str)
                                           and not isinstance(shifts[1], str)):
        shifts = [shifts]
    out: dict[str, Shift] = {}
    for item in shifts:
        if isinstance(item, Shift):
            shift = check_shift(item.kind, item.severities)
        elif isinstance(item, str):
            shift = parse_shift(item)
        elif isinstance(item, Sequence) and len(item) == 2:
            severities = item[1] if isinstance(item[1], Iterable) \
                and not isinstance(item[1], str) else [item[1]]
            shift = check_shift(item[0], severities)
        else:
            raise ConfigError(f"a shift is a 'kind:s1,s2' string or a (kind, [severities]) "
                              f"pair; got {item!r}")
        if shift.kind in out:
            shift = check_shift(shift.kind, out[shift.kind].severities + shift.severities)
        out[shift.kind] = shift
    return list(out.values())


def image_shape_of(input_shape: Sequence[int], dataset: str | None = None,
                   image_shape: Sequence[int] | None = None) -> tuple[int, int, int] | None:
    """The (C, H, W) of inputs of ``input_shape``, or None when they are not images.

    ``image_shape`` (given) wins: it must hold as many numbers as one input; (H, W) means one
    channel. Else inputs of 3 dims are (C, H, W), of 2 dims (H, W), and flat inputs are images
    only for the data sets of `IMAGE_DATASETS` (``digits``: 8x8).

    Raises:
        ConfigError: ``image_shape`` that does not fit one input.
    """
    size = math.prod(int(s) for s in input_shape)
    if image_shape is not None:
        shape = tuple(int(s) for s in image_shape)
        if len(shape) == 2:
            shape = (1, *shape)
        if len(shape) != 3 or min(shape) < 1 or math.prod(shape) != size:
            raise ConfigError(f"image shape {tuple(image_shape)} does not fit inputs of shape "
                              f"{tuple(input_shape)} ({size} values); give C,H,W or H,W with "
                              f"that many values (e.g. 1,28,28 for 784)")
        return shape  # type: ignore[return-value]
    if len(input_shape) == 3:
        return tuple(int(s) for s in input_shape)  # type: ignore[return-value]
    if len(input_shape) == 2:
        return (1, int(input_shape[0]), int(input_shape[1]))
    known = IMAGE_DATASETS.get(dataset or "")
    if known is not None and math.prod(known) == size:
        return known
    return None


def data_range(x: Tensor) -> tuple[float, float]:
    """``(low, high)``: the minimum and maximum of the inputs ``x`` (the clip range)."""
    if x.numel() == 0:
        raise DataError("no inputs to take the data's range from")
    return float(x.min()), float(x.max())


def _images(x: Tensor, image_shape: tuple[int, int, int] | None, kind: str) -> Tensor:
    if image_shape is None:
        raise ConfigError(
            f"shift {kind!r} needs images and these inputs (shape {tuple(x.shape[1:])}) are not "
            "known to be images; for flat image rows give their shape (image_shape=(1, 28, 28), "
            "--image-shape 1,28,28), else use the noise shift, which works on any data")
    if math.prod(image_shape) != math.prod(x.shape[1:]):
        raise ConfigError(f"image shape {image_shape} does not fit inputs of shape "
                          f"{tuple(x.shape[1:])}")
    return x.reshape(x.shape[0], *image_shape)


def _cos_sin(degrees: float) -> tuple[float, float]:
    """cos and sin of ``degrees``, exact (0, +-1) at multiples of 90."""
    quarter, rest = divmod(float(degrees), 90.0)
    if rest == 0.0:
        return [(1.0, 0.0), (0.0, 1.0), (-1.0, 0.0), (0.0, -1.0)][int(quarter) % 4]
    radians = math.radians(degrees)
    return math.cos(radians), math.sin(radians)


def rotate(x: Tensor, degrees: float, image_shape: tuple[int, int, int] | None, *,
           fill: float = 0.0) -> Tensor:
    """``x`` (N, *input) rotated by ``degrees`` counter-clockwise as displayed (module notes),
    bilinear, uncovered corners filled with ``fill``; computed in float64."""
    if degrees == 0:
        return x.clone()
    images = _images(x, image_shape, "rotate").to(torch.float64) - fill
    _, _, height, width = images.shape
    c, s = _cos_sin(degrees)
    # output pixel p samples the input at R(-degrees) p, in pixel units about the centre;
    # affine_grid's coordinates are scaled by the width (x) and the height (y)
    theta = torch.tensor([[c, -s * height / width, 0.0], [s * width / height, c, 0.0]],
                         dtype=torch.float64, device=x.device)
    grid = F.affine_grid(theta.expand(images.shape[0], 2, 3), list(images.shape),
                         align_corners=False)
    out = F.grid_sample(images, grid, mode="bilinear", padding_mode="zeros",
                        align_corners=False) + fill
    return out.reshape(x.shape).to(x.dtype)


def gaussian_noise(x: Tensor, sigma: float, data_range: tuple[float, float], *,
                   eps: Tensor | None = None, generator: torch.Generator | None = None) -> Tensor:
    """``clip(x + sigma * (high - low) * eps, low, high)`` (module notes); ``eps`` standard
    normal draws shaped like ``x`` (drawn from ``generator`` when not given)."""
    if sigma == 0:
        return x.clone()
    low, high = data_range
    if eps is None:
        eps = torch.randn(x.shape, generator=generator, dtype=torch.float64,
                          device="cpu" if generator is None else generator.device)
    noisy = x.to(torch.float64) + float(sigma) * (high - low) * eps.to(x.device, torch.float64)
    return noisy.clamp(low, high).to(x.dtype)


def reduce_contrast(x: Tensor, severity: float, data_range: tuple[float, float],
                    image_shape: tuple[int, int, int] | None) -> Tensor:
    """``clip(m + (1 - severity) * (x - m), low, high)``, ``m`` each image's mean (module
    notes)."""
    images = _images(x, image_shape, "contrast")
    if severity == 0:
        return x.clone()
    flat = images.reshape(images.shape[0], -1).to(torch.float64)
    mean = flat.mean(dim=1, keepdim=True)
    out = (mean + (1.0 - float(severity)) * (flat - mean)).clamp(*data_range)
    return out.reshape(x.shape).to(x.dtype)


def apply_shift(kind: str, severity: float, x: Tensor, *,
                image_shape: tuple[int, int, int] | None, data_range: tuple[float, float],
                eps: Tensor | None = None, generator: torch.Generator | None = None) -> Tensor:
    """``x`` under shift ``kind`` at ``severity`` (module notes; ``eps``/``generator`` feed
    ``noise``).

    Raises:
        ConfigError: an unknown kind, a severity out of bounds, or ``rotate``/``contrast`` on
            inputs that are not images.
    """
    check_shift(kind, [severity])
    if kind in _NEEDS_IMAGES:
        _images(x, image_shape, kind)  # refused even at severity 0
    if kind == "rotate":
        return rotate(x, severity, image_shape, fill=data_range[0])
    if kind == "noise":
        return gaussian_noise(x, severity, data_range, eps=eps, generator=generator)
    return reduce_contrast(x, severity, data_range, image_shape)


__all__ = ["IMAGE_DATASETS", "SEVERITY_BOUNDS", "SEVERITY_UNITS", "SHIFT_KINDS", "Shift",
           "apply_shift", "as_shifts", "check_shift", "data_range", "format_severity",
           "gaussian_noise", "image_shape_of", "parse_shift", "reduce_contrast", "rotate"]
