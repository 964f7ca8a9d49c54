"""The action-key digest: canonical JSON and its sha256 (what a key document hashes to).

Pure and standard library only, so that the stores below the lock (tasks/store/remote.py) and the lock's
own key document (tasks/lock/keys.py) share one definition.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any


def canonical_json(doc: Any) -> bytes:
    """``doc`` as JSON with sorted keys and no spaces: the same bytes for the same document, always."""
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def action_key(doc: Mapping[str, Any]) -> str:
    """The sha256 of a key document's canonical JSON."""
    return hashlib.sha256(canonical_json(doc)).hexdigest()
