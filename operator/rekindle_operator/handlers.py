"""kopf handlers: thin wrappers that call the plain functions and report back.

Load with `python -m rekindle_operator` (or `kopf run -m rekindle_operator.handlers`).
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any

import kopf

from rekindle_operator import checkpointing, placement, reconcile
from rekindle_operator.constants import CKPT_PLURAL, GROUP, ISVC_PLURAL, NAME_LABEL, VERSION
from rekindle_operator.kube import Kube
from rekindle_operator.pods import Agents
from rekindle_operator.settings import Settings, from_env

STATUS_INTERVAL_S = float(os.environ.get("REKINDLE_STATUS_INTERVAL", "5"))
# How often an unfinished Checkpoint takes its next step (each one is short).
CHECKPOINT_STEP_S = 2.0


@functools.cache
def kube() -> Kube:
    return Kube()


@functools.cache
def agents() -> Agents:
    """One per process: it holds the checkpoint calls this process has running."""
    return Agents(secrets=kube())


@functools.cache
def settings() -> Settings:
    return from_env()


def _emitter(body: kopf.Body) -> reconcile.Emit:
    def emit(kind: str, reason: str, message: str) -> None:
        kopf.event(body, type=kind, reason=reason, message=message)

    return emit


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    settings.peering.standalone = True
    settings.peering.mandatory = False
    # No watching of namespaces or CRDs: the watched namespaces are the
    # --namespace list (or the whole cluster) and the CRDs exist before the
    # operator starts (the chart installs them first). kopf's namespace
    # observer drops a namespace the moment it starts terminating, before its
    # objects are deleted: the operator would never see their deletion, and
    # its finalizers would hold the namespace forever. This also means the
    # operator needs no cluster-wide read of namespaces or CRDs.
    settings.scanning.disabled = True
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
    # A deleted InferenceService waits for its status timer to stop; kopf polls a
    # stopping timer every 60 s by default, so every delete took up to a minute.
    settings.background.cancellation_polling = 2


def _reconcile(body: kopf.Body, patch: kopf.Patch) -> None:
    patch.status.update(reconcile.reconcile(kube(), body, _emitter(body), agents(), settings()))


@kopf.on.resume(GROUP, VERSION, ISVC_PLURAL)
@kopf.on.create(GROUP, VERSION, ISVC_PLURAL)
@kopf.on.update(GROUP, VERSION, ISVC_PLURAL)
def isvc_changed(body: kopf.Body, patch: kopf.Patch, **_: Any) -> None:
    _reconcile(body, patch)


@kopf.timer(GROUP, VERSION, ISVC_PLURAL, interval=STATUS_INTERVAL_S, initial_delay=1)
def isvc_refresh(body: kopf.Body, patch: kopf.Patch, **_: Any) -> None:
    """Level-based catch-up: pod readiness, agent boot reports, new checkpoints."""
    _reconcile(body, patch)


def _gated(body: kopf.Body, **_: Any) -> bool:
    return placement.gated(body)


@kopf.on.event("", "v1", "pods", labels={NAME_LABEL: kopf.PRESENT}, when=_gated)
def pod_gated(body: kopf.Body, logger: kopf.Logger, **_: Any) -> None:
    """A new replica waits for its place: toward the nodes that hold its checkpoint."""
    logger.info("released: %s", reconcile.release_pod(kube(), body))


def _checkpoint_unfinished(status: kopf.Status, **_: Any) -> bool:
    return checkpointing.unfinished(status)


@kopf.timer(GROUP, VERSION, CKPT_PLURAL, interval=CHECKPOINT_STEP_S, when=_checkpoint_unfinished)
def checkpoint_step(body: kopf.Body, **_: Any) -> None:
    """One short step of the Checkpoint's state machine; stops once it is Ready or Failed."""
    checkpointing.step(kube(), body, _emitter(body), agents())


def _checkpoint_has_data(body: kopf.Body, **_: Any) -> bool:
    return checkpointing.has_data(body)


# kopf keeps its finalizer on a Checkpoint only while a handler needs it: while
# unfinished (the step timer) and while it has data to delete (this handler);
# a Retained or data-less Checkpoint is deleted at once.
@kopf.on.delete(GROUP, VERSION, CKPT_PLURAL, when=_checkpoint_has_data)
def checkpoint_deleted(
    body: kopf.Body, logger: kopf.Logger, runtime: Any, retry: int, **_: Any
) -> None:
    emit = _emitter(body)
    waited = runtime.total_seconds()
    try:
        logger.info(checkpointing.delete_data(kube(), body, emit, agents(), waited, settings()))
    except checkpointing.Retry as e:
        if retry % 30 == 0:  # say why once, then every few minutes
            emit("Normal", "CheckpointDeletionWaiting", str(e))
        raise kopf.TemporaryError(str(e), delay=e.delay) from e
    except Exception as e:  # the apiserver, RBAC: bounded, never forever
        if waited < settings().delete_timeout_s:
            raise kopf.TemporaryError(f"deleting the checkpoint's data: {e}", delay=15) from e
        emit(
            "Warning",
            "CheckpointDataRetained",
            f"gave up deleting the data after {waited:.0f}s: {e}; "
            f"path {(body.get('status') or {}).get('path')} is left in place",
        )
