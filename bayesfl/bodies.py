"""Client network bodies (feature extractors) built from short spec strings.

A body maps inputs (B, *input_shape) to features (B, feature_dim). Every body ends in a linear
layer to ``feature_dim`` followed by a ReLU, so features are non-negative as in FedLog's
bodies. Clients may use different specs (FedLog's flexible-architecture setting) as long as they
agree on ``feature_dim``; `check_feature_dim` verifies that.

Spec forms (`BODY_KINDS`):

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

Your own body
    Any ``torch.nn.Module`` mapping a batch (B, *input_shape) to features (B, feature_dim) can
    be a body. Give it as a *factory*: a zero-argument callable returning a fresh module (a
    class such as ``MyNet``, or ``lambda: MyNet(64)``), called once per client (and once more,
    on PyTorch's ``meta`` device, to count its parameters against
    `bayesfl.config.MAX_PARAMETERS` before anything is allocated). Three ways to name it:

    - ``simulate(body=make_body)``: the callable itself (`body_spec` registers it under
      ``"module:qualified.name"``, the name the run's config, manifest and checkpoint record);
    - ``register_body("mynet", make_body)``, then ``body="mynet"`` anywhere a spec string is
      read: ``simulate``, ``bayesfl run --body mynet``, a TOML config, a Flower run config
      (the process that builds the bodies must have registered it);
    - ``"package.module:attribute"`` (e.g. ``--body mypkg.models:make_body``): imported with
      `bayesfl.user_code.import_object` by whichever process builds a body.

    A factory's module is checked like a built-in body (`build_body`): it must be an
    ``nn.Module`` with float32 parameters that maps a probe batch of two zero inputs to
    ``(2, feature_dim)``, and every call must return the same architecture (parameter names
    and shapes): clients of one spec are trained as one batch, and strategies that average
    bodies need them alike. A factory that raises, returns something else or fails the probe
    is a `ConfigError` naming it. Its features must also be non-negative
    on a probe batch (zeros and eight standard normal inputs), as the built-ins' are: FedLog's
    server rejects uploads with negative feature sums and CoLearn negative pooled features, so
    end the module in a ReLU.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from bayesfl.errors import ConfigError
from bayesfl.user_code import import_object, is_import_spec

BodyFactory = Callable[[], nn.Module]
"""A zero-argument callable returning a fresh body module (module docstring, "Your own body")."""

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
    return "; ".join([*BODY_KINDS.values(), "a name registered with bayesfl.register_body",
                      "package.module:attribute naming a body factory"])


_REGISTRY: dict[str, BodyFactory] = {}
"""Registered name -> factory ([`register_body`][bayesfl.bodies.register_body])."""
_ARCHITECTURES: dict[tuple[str, tuple[int, ...], int], tuple[tuple[str, tuple[int, ...]], ...]] \
    = {}
"""(spec, input_shape, feature_dim) -> the parameter and buffer names and shapes of the first
module a factory built for it: later calls must build the same (`build_body`)."""
_LOCK = threading.Lock()


def register_body(name: str, factory: BodyFactory) -> str:
    """Make ``factory`` nameable as a body spec: ``body=name`` in `bayesfl.simulate`,
    ``--body name`` on the command line, ``body = "name"`` in a TOML or Flower run config.

    Registering a name again replaces its factory (re-running a notebook cell works). The
    registry is per process: a Flower SuperNode or a fresh ``bayesfl run`` must register the
    name too (import the module that does), or name the factory as
    ``package.module:attribute`` instead.

    Args:
        name: the spec string; case-sensitive, no commas (they separate the specs of a run)
            and no whitespace, and not a built-in kind (``mlp``, ``cnn:...``, ...).
        factory: a zero-argument callable returning a fresh ``torch.nn.Module`` that maps
            (B, *input_shape) float32 inputs to (B, feature_dim) features (module docstring).

    Returns:
        ``name``, so that ``body=register_body("mynet", MyNet)`` reads naturally.

    Raises:
        ConfigError: a malformed or reserved name, or a factory that is not callable (a module
            instance is refused: every client needs a fresh one).
    """
    if not isinstance(name, str) or not name or any(c.isspace() or c == "," for c in name):
        raise ConfigError(f"body name must be a non-empty string without commas or whitespace, "
                          f"got {name!r}")
    if name.partition(":")[0].lower() in BODY_KINDS:
        raise ConfigError(f"body name {name!r} would shadow the built-in body kind "
                          f"{name.partition(':')[0].lower()!r}; choose another name")
    _check_factory(factory, name)
    with _LOCK:
        if _REGISTRY.get(name) is not factory:  # a new factory: its architecture is new too
            for key in [k for k in _ARCHITECTURES if k[0] == name]:
                del _ARCHITECTURES[key]
        _REGISTRY[name] = factory
    return name


def unregister_body(name: str) -> None:
    """Forget the body registered as ``name`` (nothing happens if there is none)."""
    with _LOCK:
        _REGISTRY.pop(name, None)
        for key in [k for k in _ARCHITECTURES if k[0] == name]:
            del _ARCHITECTURES[key]


def registered_bodies() -> dict[str, str]:
    """Registered name -> the factory's ``module.qualified_name`` (a copy)."""
    with _LOCK:
        return {name: qualified_name(f) for name, f in _REGISTRY.items()}


def qualified_name(factory: object) -> str:
    """``"module:qualified.name"`` of a callable (what a run records for a callable body);
    ``"module:<lambda>"`` or ``"module:f.<locals>.g"`` for ones that cannot be imported."""
    module = getattr(factory, "__module__", None) or "?"
    name = getattr(factory, "__qualname__", None) or type(factory).__qualname__
    return f"{module}:{name}"


def body_spec(body: str | BodyFactory | Sequence[str | BodyFactory]) -> str:
    """The spec string of ``body``: a string as is; a factory registered under its
    `qualified_name` (which is returned); a list or tuple of these joined by commas
    (assigned to clients in turn). This is how ``simulate(body=callable)`` turns a callable
    into what the run's configuration records.

    A factory that can be imported back by its qualified name (a module-level function or
    class) can be named in a later process too (``resume``, `bayesfl.load_run`); one that
    cannot (a lambda, a local function, anything defined in ``__main__`` run as a script) must
    be registered again there under the same name ([`register_body`][bayesfl.bodies.register_body]).

    Raises:
        ConfigError: something other than a string, a callable or a sequence of them; a module
            instance instead of a factory.
    """
    if isinstance(body, str):
        return body
    if isinstance(body, list | tuple):
        if not body:
            raise ConfigError("body must name at least one body (got an empty list)")
        return ",".join(body_spec(item) for item in body)
    _check_factory(body, "body")
    return register_body(qualified_name(body), body)


def body_provenance(body: str) -> dict[str, dict[str, Any]]:
    """What a run's manifest records about the user bodies of its ``body`` setting (specs
    separated by commas): spec -> ``{"factory": "module:qualified.name", "importable": bool,
    "note": ...}`` for each registered name or ``package.module:attribute`` spec; ``{}`` when
    every spec is built in.

    A callable cannot be serialised: only its name is recorded. ``importable`` says whether
    another process can find the factory by its name alone (a module-level function or class
    outside ``__main__``); if not, resuming the run or `bayesfl.load_run` in a new
    process needs ``register_body(spec, factory)`` first. Either way the checkpoint's tensors
    are checked against the rebuilt bodies (names, shapes, dtypes), so a different
    architecture under the same name is refused, not silently used.
    """
    out: dict[str, dict[str, Any]] = {}
    if not isinstance(body, str):
        return out
    for spec in (s.strip() for s in body.split(",") if s.strip()):
        with _LOCK:
            factory = _REGISTRY.get(spec)
        if factory is None and not (is_import_spec(spec)
                                    and spec.partition(":")[0].lower() not in BODY_KINDS):
            continue
        name = qualified_name(factory) if factory is not None else spec
        importable = factory is None or _importable(factory)
        out[spec] = {
            "factory": name, "importable": importable,
            "note": ("a callable cannot be serialised: the run records its name; resume=True "
                     "and bayesfl.load_run " + (
                         f"import it as {name!r}" if importable else
                         f"need bayesfl.register_body({spec!r}, factory) first in a new "
                         "process") + "; a different architecture under this name is refused "
                     "by the checkpoint's layout check")}
    return out


def _importable(factory: object) -> bool:
    """Whether ``factory`` is what its qualified name imports (outside ``__main__``)."""
    name = qualified_name(factory)
    if name.startswith("__main__:") or not is_import_spec(name):
        return False
    try:
        return import_object(name, "body factory") is factory
    except ConfigError:
        return False


def _check_factory(factory: object, what: str) -> None:
    if isinstance(factory, nn.Module):
        raise ConfigError(
            f"{what}: got a module instance ({type(factory).__name__}); pass a zero-argument "
            f"factory that returns a fresh module instead (e.g. body={type(factory).__name__} "
            f"or body=lambda: {type(factory).__name__}(...)): every client needs its own")
    if not callable(factory):
        raise ConfigError(f"{what}: a body factory must be a zero-argument callable returning "
                          f"a torch.nn.Module, got {type(factory).__name__}")


def body_factory(spec: str) -> BodyFactory | None:
    """The factory ``spec`` names (a registered name, or ``package.module:attribute``), or None
    for a built-in spec.

    Raises:
        ConfigError: an import spec that cannot be imported, or that names no callable.
    """
    if not isinstance(spec, str):
        return None
    name = spec.strip()
    with _LOCK:
        factory = _REGISTRY.get(name)
    if factory is not None:
        return factory
    if name.partition(":")[0].lower() in BODY_KINDS or not is_import_spec(name):
        return None
    try:
        imported = import_object(name, "body factory")
    except ConfigError as err:
        if name.startswith("__main__:"):  # a callable of a script, recorded by a run
            raise ConfigError(
                f"body {name!r} is a factory defined in a script run as __main__ (a run "
                "records a callable body by its name only); register it in this process "
                f"first: bayesfl.register_body({name!r}, {name.partition(':')[2]})") from err
        raise ConfigError(f"{err}; or register the factory in this process with "
                          f"bayesfl.register_body({name!r}, factory)") from err
    if isinstance(imported, nn.Module) or not callable(imported):
        raise ConfigError(f"body factory {name!r} is a {type(imported).__name__}, not a "
                          "zero-argument callable returning a torch.nn.Module (a function or a "
                          "class)")
    return imported  # type: ignore[return-value]


def parse_body_spec(spec: str) -> tuple[str, tuple[int, ...]]:
    """Split ``"mlp:200-200"`` into ``("mlp", (200, 200))``.

    A registered name (`register_body`) or a ``package.module:attribute`` spec parses
    to ``(spec, ())`` (nothing is imported here; `build_body` does that).

    Raises:
        ConfigError: listing the valid forms, for an unknown kind or malformed widths.
    """
    if isinstance(spec, str):
        name = spec.strip()
        with _LOCK:
            registered = name in _REGISTRY
        if registered or (is_import_spec(name)
                          and name.partition(":")[0].lower() not in BODY_KINDS):
            return name, ()
    if not isinstance(spec, str):
        raise ConfigError(f"body spec must be a string, got {type(spec).__name__}; "
                          f"valid forms: {_valid_forms()}")
    kind, _, sizes = spec.strip().partition(":")
    kind = kind.strip().lower()
    if kind not in BODY_KINDS:
        if "<" in spec and ":" in spec:  # a callable's qualified name (body_spec)
            raise ConfigError(
                f"body {spec.strip()!r} names a callable passed as body= in another process "
                "(a lambda or local function cannot be imported): register it here first with "
                f"bayesfl.register_body({spec.strip()!r}, factory), or pass the callable again")
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

    A user's factory (a registered name or ``package.module:attribute``, module docstring) is
    called and its module checked: it must be an ``nn.Module`` with float32 parameters, map a
    probe batch of two zero inputs to ``(2, feature_dim)`` and give non-negative features on
    zeros and eight standard normal inputs (both probes skipped when built on the ``meta``
    device, which computes nothing) and have the parameter names and shapes of the first module
    the factory built for the same input shape and ``feature_dim`` in this process.

    Args:
        spec: e.g. ``"mlp:200-200"``, ``"cnn:16-32"``, a registered name or
            ``"package.module:attribute"`` (module docstring).
        input_shape: shape of one input, without the batch dimension.
        feature_dim: number of output features d.

    Returns:
        A module mapping (B, *input_shape) float tensors to (B, feature_dim) non-negative
        features; its parameters are on the CPU in float32 (move it with ``.to(device)``).

    Raises:
        ConfigError: a bad spec, a non-positive ``feature_dim``, a CNN for an input that is
            not an image; a user factory that raises, returns no module, or whose module fails
            the checks above (the message names the factory).
    """
    kind, widths = parse_body_spec(spec)
    shape = tuple(int(s) for s in input_shape)
    if not shape or any(s < 1 for s in shape):
        raise ConfigError(f"input_shape must be a non-empty tuple of positive sizes, got "
                          f"{input_shape}")
    if not isinstance(feature_dim, int) or feature_dim < 1:
        raise ConfigError(f"feature_dim must be a positive integer, got {feature_dim!r}")
    factory = body_factory(kind) if not widths else None
    if factory is not None:
        return _user_body(kind, factory, shape, feature_dim)
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


def _user_body(
    name: str, factory: BodyFactory, shape: tuple[int, ...], feature_dim: int
) -> nn.Module:
    """Call a user's factory and check its module (`build_body`)."""
    what = f"body factory {name!r}"
    try:
        body = factory()
    except Exception as err:  # whatever the user's code raises, said in one place
        raise ConfigError(f"{what} raised {type(err).__name__}: {err}; it must build a "
                          "torch.nn.Module when called with no arguments") from err
    if not isinstance(body, nn.Module):
        raise ConfigError(f"{what} returned a {type(body).__name__}, not a torch.nn.Module; "
                          "it must return a fresh module mapping (B, *input_shape) to "
                          f"(B, feature_dim={feature_dim})")
    wrong = sorted({str(p.dtype) for p in body.parameters() if p.dtype != torch.float32})
    if wrong:
        raise ConfigError(f"{what} returned a module with {', '.join(wrong)} parameters; "
                          "bodies are trained in float32 (the data are float32): build it in "
                          "float32 (drop .double() / .half())")
    layout = tuple((key, tuple(t.shape)) for key, t in body.state_dict().items())
    with _LOCK:
        first = _ARCHITECTURES.setdefault((name, shape, feature_dim), layout)
    if layout != first:
        differ = sorted(set(layout) ^ set(first))[:3]
        raise ConfigError(
            f"{what} built a different architecture than on its first call for input shape "
            f"{shape} (parameters differing: {differ}); every client of one body spec must "
            "have the same parameter names and shapes (they train as one batch, and "
            "strategies that average bodies need them alike): build the module "
            "deterministically, or register each architecture under its own name")
    on_meta = any(t.is_meta for t in [*body.parameters(), *body.buffers()])
    if not on_meta:
        check_feature_dim(body, shape, feature_dim, name=what)
        _check_non_negative(body, shape, what)
    return body


def _check_non_negative(body: nn.Module, shape: tuple[int, ...], what: str) -> None:
    """Refuse a body whose features go negative on a probe batch (zeros and eight standard
    normal inputs from a fixed seed; the global RNG is not moved). FedLog's server rejects an
    upload with a negative feature sum and CoLearn one with negative pooled features, so such a
    body would have every upload rejected, round after round; a trailing ReLU rules it out."""
    probe = torch.cat([torch.zeros((1, *shape)),
                       torch.randn((8, *shape), generator=torch.Generator().manual_seed(0))])
    first = next(body.parameters(), None)
    if first is not None:
        probe = probe.to(first.device)
    was_training = body.training
    body.eval()
    try:
        with torch.no_grad():
            low = float(body(probe).min())
    except Exception as err:  # the shape probe passed: an error here is about the values
        raise ConfigError(f"{what} fails on a probe batch of shape {tuple(probe.shape)}: "
                          f"{type(err).__name__}: {err}") from err
    finally:
        body.train(was_training)
    if not low >= 0:
        raise ConfigError(
            f"{what} gives negative features (as low as {low:.3g}) on a probe batch; features "
            "must be non-negative, as every built-in body's are (FedLog's server rejects an "
            "upload with negative feature sums, CoLearn negative pooled features): end the "
            "module in a ReLU (nn.ReLU())")


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

    A conv pads by 2 on maps smaller than `_SAME_PADDING_BELOW` (module docstring);
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


def check_feature_dim(body: nn.Module, input_shape: tuple[int, ...], feature_dim: int, *,
                      name: str = "body") -> None:
    """Run a batch of two zero inputs through ``body`` and check it yields (2, feature_dim).

    The probe runs without gradients, in eval mode (the training mode is restored), on the
    device and dtype of the body's first parameter (CPU float32 for a parameter-free body).
    ``name`` is what the messages call the body (e.g. ``"body factory 'mypkg:make'"``).

    Raises:
        ConfigError: the body fails on such inputs (whatever it raises) or returns another
            shape.
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
    except Exception as err:  # a user's body may raise anything on a shape it cannot take
        raise ConfigError(f"{name} fails on inputs of shape {tuple(input_shape)}: "
                          f"{type(err).__name__}: {err}") from err
    finally:
        body.train(was_training)
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != (2, feature_dim):
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ConfigError(f"{name} output for a batch of 2 is {got}, expected "
                          f"(2, {feature_dim}): every client body must end in "
                          f"feature_dim={feature_dim}")
