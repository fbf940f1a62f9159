"""Policy weights through the run prefix: the trainer publishes, env workers load.

``weights/policy_<version:08d>.pt`` holds a ``torch.save`` state dict (exclusive put);
``weights/latest.json`` (``{"version": v}``, replaced atomically) names the newest.
Version 0 is the warm-started initial policy; the trainer publishes version
``s + 1`` after its optimizer step of step ``s``. A version names one set of weights in every
life of the run: a later life that publishes a version again (from its checkpoint on) checks
that it has the earlier life's weights (``check_same_weights``), since samples taken with them
are in the step files it trains again; only after a skipped step do they differ
(``trainer.resume.ResumePlan.diverged_from``).
"""

from __future__ import annotations

import io
import json

import torch

from refpipe.storage.errors import KeyNotFoundError, ReplayMismatchError
from refpipe.storage.layout import LATEST_WEIGHTS_KEY, weights_key
from refpipe.storage.store import Store


def publish_weights(store: Store, model: torch.nn.Module, version: int, *, replace: bool = False) -> None:
    """Write version ``version`` of the weights, then point ``latest`` at it.

    ``replace``: a later life of the run republishes versions an earlier life wrote (from its checkpoint
    on); else the version must be new (``KeyExistsError``).
    """
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    store.put(weights_key(version), buf.getvalue(), exclusive=not replace)
    point_latest(store, version)


def point_latest(store: Store, version: int) -> None:
    """Point ``latest`` at an already published version (a resumed run: the checkpoint's weights)."""
    store.put(LATEST_WEIGHTS_KEY, json.dumps({"version": version}).encode())


def latest_version(store: Store) -> int:
    """Newest published version, or -1 when none is."""
    try:
        return int(json.loads(store.get(LATEST_WEIGHTS_KEY))["version"])
    except KeyNotFoundError:
        return -1


def load_weights(store: Store, model: torch.nn.Module, version: int) -> None:
    """Load version ``version`` into ``model``.

    Raises:
        KeyNotFoundError: that version was never published.
    """
    state = torch.load(io.BytesIO(store.get(weights_key(version))), weights_only=True)
    model.load_state_dict(state)


def check_same_weights(store: Store, model: torch.nn.Module, version: int) -> None:
    """Every trainer rank of a later life, before version ``version`` is published again: if an earlier life
    published it, its tensors must equal ``model``'s exactly (one GET; nothing to compare when it never was).

    Raises:
        ReplayMismatchError: they differ (names the version and the differing tensors); the run stops.
    """
    try:
        earlier = torch.load(io.BytesIO(store.get(weights_key(version))), weights_only=True)
    except KeyNotFoundError:
        return
    state = model.state_dict()
    differing = [name for name, tensor in state.items()
                 if name not in earlier or not torch.equal(tensor, earlier[name])]
    if differing:
        names = ", ".join(differing[:3]) + (", ..." if len(differing) > 3 else "")
        raise ReplayMismatchError(f"weights version {version}: {len(differing)} of {len(state)} tensors ({names}) "
                                  "differ from the ones an earlier life published at "
                                  f"{store.uri(weights_key(version))}, with which its samples were taken; stopping")
