"""An on-disk cache of stage profiles: plain JSON files, written atomically.

Entries live under ``$JAXREMAT_CACHE_DIR`` (default ``~/.cache/jaxremat``), one file per key.
A corrupt, truncated or foreign entry is ignored with a warning (the stage is profiled again);
a write goes to a temporary file in the same folder and is renamed into place, so two processes
writing at once never leave a half-written entry.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import warnings
from pathlib import Path
from typing import Any

FORMAT = "jaxremat-stage-profile-v1"


def cache_dir() -> Path:
    return Path(os.environ.get("JAXREMAT_CACHE_DIR", Path.home() / ".cache" / "jaxremat"))


def enabled(requested: bool | None) -> bool:
    """``requested`` wins; otherwise on unless ``JAXREMAT_CACHE=0``."""
    if requested is not None:
        return requested
    return os.environ.get("JAXREMAT_CACHE", "1") not in ("0", "false", "no", "off")


def make_key(*parts: Any) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:32]


def load(key: str) -> dict | None:
    path = cache_dir() / f"{key}.json"
    if not path.exists():
        return None
    try:
        entry = json.loads(path.read_text())
        if not isinstance(entry, dict) or entry.get("format") != FORMAT or entry.get("key") != key:
            raise ValueError("not a jaxremat stage profile for this key")
        return entry["value"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        warnings.warn(f"jaxremat: ignoring cache entry {path} ({e}); profiling again", stacklevel=3)
        return None


def store(key: str, value: dict) -> None:
    folder = cache_dir()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump({"format": FORMAT, "key": key, "value": value}, f)
        os.replace(tmp, folder / f"{key}.json")
    except OSError as e:
        warnings.warn(f"jaxremat: could not write the profile cache in {folder} ({e})", stacklevel=3)
