"""kopf handlers: thin wrappers that call the plain functions and report back.

Load with `python -m rekindle_operator` (or `kopf run -m rekindle_operator.handlers`).
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any

import kopf

from rekindle_operator import checkpointing, reconcile
from rekindle_operator.constants import CKPT_PLURAL, GROUP, ISVC_PLURAL, VERSION
from rekindle_operator.kube import Kube
from rekindle_operator.pods import Agents

STATUS_INTERVAL_S = float(os.environ.get("REKINDLE_STATUS_INTERVAL", "5"))
# How often an unfinished Checkpoint takes its next step (each one is short).
CHECKPOINT_STEP_S = 2.0


@functools.cache
def kube() -> Kube:
    return Kube()


@functools.cache
def agents() -> Agents:
    """One per process: it holds the checkpoint calls this process has running."""
    return Agents()


def _emitter(body: kopf.Body) -> reconcile.Emit:
    def emit(kind: str, reason: str, message: str) -> None:
        kopf.event(body, type=kind, reason=reason, message=message)

    return emit


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    settings.peering.standalone = True
    settings.peering.mandatory = False
    # Progress and diff-base in annotations under our own prefix: the CRDs'
    # status schemas stay strict (no status.kopf) and nothing collides with
    # another kopf operator in the cluster.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=f"kopf.{GROUP}")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=f"kopf.{GROUP}", key="last-handled-configuration"
    )
    settings.persistence.finalizer = f"{GROUP}/finalizer"
    settings.posting.level = logging.WARNING
    settings.watching.server_timeout = 300
    settings.execution.max_workers = 8


def _reconcile(body: kopf.Body, patch: kopf.Patch) -> None:
    patch.status.update(reconcile.reconcile(kube(), body, _emitter(body), agents()))


@kopf.on.resume(GROUP, VERSION, ISVC_PLURAL)
@kopf.on.create(GROUP, VERSION, ISVC_PLURAL)
@kopf.on.update(GROUP, VERSION, ISVC_PLURAL)
def isvc_changed(body: kopf.Body, patch: kopf.Patch, **_: Any) -> None:
    _reconcile(body, patch)


@kopf.timer(GROUP, VERSION, ISVC_PLURAL, interval=STATUS_INTERVAL_S, initial_delay=1)
def isvc_refresh(body: kopf.Body, patch: kopf.Patch, **_: Any) -> None:
    """Level-based catch-up: pod readiness, agent boot reports, new checkpoints."""
    _reconcile(body, patch)


def _checkpoint_unfinished(status: kopf.Status, **_: Any) -> bool:
    return checkpointing.unfinished(status)


@kopf.timer(GROUP, VERSION, CKPT_PLURAL, interval=CHECKPOINT_STEP_S, when=_checkpoint_unfinished)
def checkpoint_step(body: kopf.Body, **_: Any) -> None:
    """One short step of the Checkpoint's state machine; stops once it is Ready or Failed."""
    checkpointing.step(kube(), body, _emitter(body), agents())


@kopf.on.delete(GROUP, VERSION, CKPT_PLURAL)
def checkpoint_deleted(body: kopf.Body, logger: kopf.Logger, **_: Any) -> None:
    try:
        logger.info(checkpointing.delete_data(kube(), body, _emitter(body), agents()))
    except checkpointing.Retry as e:
        raise kopf.TemporaryError(str(e), delay=e.delay) from e
