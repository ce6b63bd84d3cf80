"""Run manifests: what produced a run's numbers (config, seed, package versions, git commit)."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from collections.abc import Mapping
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any

PACKAGES = ("torch", "numpy", "scipy", "safetensors", "scikit-learn", "matplotlib", "seaborn",
            "tqdm", "mnist1d", "bayesfl")


def package_versions(names: tuple[str, ...] = PACKAGES) -> dict[str, str | None]:
    """Installed distribution versions (None for a package that is not installed)."""
    versions: dict[str, str | None] = {}
    for name in names:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def git_commit(directory: Path | None = None) -> str | None:
    """The git HEAD commit of the source tree (with ``-dirty`` for local changes), or None."""
    where = directory or Path(__file__).resolve().parent
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=where, capture_output=True,
                              text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=where, capture_output=True, text=True, timeout=10,
                               check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("-dirty" if dirty else "") if head else None


def build_manifest(config: Mapping[str, Any], **extra: Any) -> dict[str, Any]:
    """Config (with its seed), versions of Python and packages, platform, git commit, time,
    and the ``extra`` entries (e.g. the data's identity, the thread count).

    A run whose ``body`` names the user's own factories (a callable passed as ``body=``, a
    registered name, ``package.module:attribute``) also gets ``body_factories``
    (`bayesfl.bodies.body_provenance`: each factory's qualified name, whether a new
    process can import it, and what resuming or loading the run needs, since a callable cannot
    be serialised)."""
    from bayesfl.bodies import body_provenance

    factories = body_provenance(config.get("body"))
    return {
        "config": dict(config),
        "seed": config.get("seed"),
        **({"body_factories": factories} if factories else {}),
        **extra,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpu_cores": os.cpu_count(),
        "packages": package_versions(),
        "git_commit": git_commit(),
        "command": sys.argv,
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
    }


def write_manifest(path: str | Path, config: Mapping[str, Any], **extra: Any) -> dict[str, Any]:
    """Write `build_manifest` as JSON to ``path`` and return it."""
    manifest = build_manifest(config, **extra)
    Path(path).write_text(json.dumps(manifest, indent=2, default=str) + "\n")
    return manifest
