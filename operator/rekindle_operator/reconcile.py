"""Level-based reconcile of one InferenceService: owned objects, pointer, status.

Called on create/update/resume and from a timer, so every step is idempotent:
server-side apply for what the operator fully owns, create-if-absent for
one-time values (the token, the PVC).
"""

from __future__ import annotations

import base64
import logging
from collections.abc import Callable, Mapping
from typing import Any

from rekindle_contract import restore_pointer
from rekindle_contract.api import SERVE_PORT
from rekindle_contract.pod import SIGNING_KEY_KEY

from rekindle_operator import admin_tls, auto_checkpoint, placement
from rekindle_operator import builders as b
from rekindle_operator.adoption import foreign_object, owned_by
from rekindle_operator.checkpoint_storage import rwo_spread_warning
from rekindle_operator.constants import (
    ANN_AGENT_READY,
    ANN_BOOT_PATH,
    ANN_BOOT_REASON,
    ANN_RESTORED_FROM,
    CKPT_KIND,
    NAME_LABEL,
)
from rekindle_operator.kube import Kube, KubeError
from rekindle_operator.pods import Agents, read_token, service_pods
from rekindle_operator.selection import (
    current_spec_pods,
    newest_usable,
    ready_pods,
    stale_changes,
)
from rekindle_operator.settings import Settings, from_env, image_allowed
from rekindle_operator.shm_sizing import effective_shm_bytes, shm_need, shm_shortfall
from rekindle_operator.spec import IsvcSpec, SpecError, parse_spec
from rekindle_operator.spec_fingerprint import spec_fingerprint
from rekindle_operator.status import Observed, PodBoot, compute_status, pod_boot, transitions

Emit = Callable[[str, str, str], None]  # (Normal|Warning, reason, message)
Body = Mapping[str, Any]
log = logging.getLogger("rekindle.operator")


def spec_of(body: Body) -> IsvcSpec:
    meta = body["metadata"]
    return parse_spec(
        meta["name"], meta["namespace"], body.get("spec") or {}, meta.get("annotations")
    )


def _key_of(secret: Mapping[str, Any] | None) -> bytes | None:
    """The signing key in its Secret, as the agents read it (whitespace stripped)."""
    value = ((secret or {}).get("data") or {}).get(SIGNING_KEY_KEY)
    return base64.b64decode(value).strip() if value else None


def signing_key(kube: Kube, spec: IsvcSpec) -> bytes | None:
    """The service's signing key, read from its Secret."""
    return _key_of(kube.get("Secret", spec.namespace, b.signing_secret_name(spec.name)))


def update_pointer(
    kube: Kube,
    body: Body,
    spec: IsvcSpec,
    checkpoints: list[dict[str, Any]],
    key: bytes | None = None,
) -> str | None:
    """Point new replicas at the newest usable checkpoint, signed for this service
    (rekindle_contract.restore_pointer); returns its name if they will use it.

    key: the signing key when the caller has it (reconcile: ensure_secrets), else read."""
    best = newest_usable(checkpoints, spec.name, spec_fingerprint(spec))
    path, signature = "", ""
    if best is not None and key is None:
        key = signing_key(kube, spec)
    if best is not None and key is not None:
        path = str(best["status"]["path"])
        service_uid = str(body["metadata"].get("uid") or "")
        signature = restore_pointer.sign(key, path, service_uid, best["metadata"]["uid"])
    elif best is not None:
        best = None  # no key yet (ensure_secrets runs first): nothing to sign with
    kube.apply(b.build_configmap(spec, path, owner=body, signature=signature))
    if best is None or spec.restore_policy == "Never":
        return None
    return str(best["metadata"]["name"])


def mark_stale(kube: Kube, spec: IsvcSpec, checkpoints: list[dict[str, Any]], emit: Emit) -> None:
    for name, stale in stale_changes(checkpoints, spec.name, spec_fingerprint(spec)).items():
        kube.merge_patch("Checkpoint", spec.namespace, name, {"status": {"stale": stale}}, "status")
        if stale:
            emit(
                "Warning",
                "CheckpointStale",
                f"Checkpoint {name} no longer matches the spec (fingerprint changed); not used",
            )


def check_autoscaling(spec: IsvcSpec, settings: Settings) -> None:
    """spec.autoscaling needs the front: its /load is the metric, and it holds requests at
    zero. (An API key is no obstacle: the front reads each replica's GET /get_load, which
    the agent answers without one.)"""
    if spec.autoscaling is None:
        return
    if not settings.front_url:
        raise SpecError(
            "spec.autoscaling needs the front, and this operator has none (REKINDLE_FRONT_URL "
            "is unset): install the chart with front.enabled=true, or remove spec.autoscaling"
        )


def check_image(spec: IsvcSpec, settings: Settings) -> None:
    """The operator's own check of the allowed images (the chart's policy refuses at apply)."""
    if not image_allowed(spec.image, settings.allowed_images):
        raise SpecError(
            f"spec.runtime.image {spec.image!r} is not an allowed runtime image "
            f"({', '.join(settings.allowed_images)}): use one of them, or ask the cluster's "
            "admin to add it to the chart's allowedRuntimeImages"
        )


def admin_tls_problem(kube: Kube, spec: IsvcSpec) -> str | None:
    """Why spec.adminTLS's Secret cannot be used yet (missing, or lacking a key), or None.

    The Deployment is then left as it is: its new pods could not mount the
    Secret (stuck in ContainerCreating, a rollout that never ends) and the
    operator could not verify them. cert-manager may still be issuing: the
    next reconcile looks again.
    """
    if spec.admin_tls is None:
        return None
    name = spec.admin_tls.secret_name
    problem = admin_tls.secret_problem(
        kube.get("Secret", spec.namespace, name), spec.namespace, name
    )
    return None if problem is None else f"{problem}; the Deployment is not updated until then"


def ensure_secrets(kube: Kube, body: Body, spec: IsvcSpec) -> bytes | None:
    """The agents' tokens and the signing key, generated once; returns the key (the
    restore pointer is signed with it), read once per reconcile."""
    kube.create_if_absent(b.build_secret(spec, owner=body))
    kube.create_if_absent(b.build_metrics_secret(spec, owner=body))
    signing = kube.get("Secret", spec.namespace, b.signing_secret_name(spec.name))
    if signing is None:
        signing = b.build_signing_secret(spec, owner=body)
        if not kube.create_if_absent(signing):  # made meanwhile: that one counts
            signing = kube.get("Secret", spec.namespace, b.signing_secret_name(spec.name))
    return _key_of(signing)


def ensure_objects(
    kube: Kube,
    body: Body,
    spec: IsvcSpec,
    shm_bytes: int,
    settings: Settings | None = None,
    deployment: bool = True,
    surge: int = 0,
) -> None:
    """Everything else the InferenceService owns; the Deployment only when deployment is True."""
    settings = settings or Settings()
    if settings.network_policy:
        kube.apply(
            b.build_network_policy(
                spec, settings.operator_namespace, settings.operator_labels, owner=body
            )
        )
    pvc = b.build_pvc(spec, owner=body)
    if pvc is not None:
        kube.create_if_absent(pvc)
    kube.apply(b.build_service(spec, owner=body))
    ensure_disruption_budget(kube, body, spec)
    ensure_scaled_object(kube, body, spec, settings.front_url)
    if deployment:
        kube.apply(
            b.build_deployment(
                spec,
                shm_bytes,
                spec_fingerprint(spec),
                owner=body,
                surge=surge,
                warm_placement=settings.warm_placement,
            )
        )


def ensure_disruption_budget(kube: Kube, body: Body, spec: IsvcSpec) -> None:
    """The PodDisruptionBudget as spec.disruptionBudget says: applied, or (unset) our own
    removed. One somebody else made under that name is never touched (adoption.py)."""
    _apply_or_remove_own(
        kube, body, spec, b.build_disruption_budget(spec, owner=body),
        "PodDisruptionBudget", b.disruption_budget_name(spec.name),
    )  # fmt: skip


def ensure_scaled_object(kube: Kube, body: Body, spec: IsvcSpec, front_url: str) -> None:
    """The KEDA ScaledObject as spec.autoscaling says: applied, or (unset) our own removed.
    Without spec.autoscaling no KEDA is needed: a missing CRD reads as no object."""
    _apply_or_remove_own(
        kube, body, spec,
        b.build_scaled_object(spec, front_url, owner=body) if front_url else None,
        "ScaledObject", b.scaled_object_name(spec.name),
    )  # fmt: skip


def _apply_or_remove_own(
    kube: Kube, body: Body, spec: IsvcSpec, want: Mapping[str, Any] | None, kind: str, name: str
) -> None:
    """An optional owned object: applied when wanted; otherwise removed if it is ours
    (a controller owner reference to this InferenceService), else left alone."""
    if want is not None:
        kube.apply(want)
        return
    existing = kube.get(kind, spec.namespace, name)
    uid = str((body.get("metadata") or {}).get("uid") or "")
    if existing is not None and owned_by(existing, uid):
        kube.delete(kind, spec.namespace, name)


def keep_checkpoints_current(
    kube: Kube, spec: IsvcSpec, checkpoints: list[dict[str, Any]], emit: Emit
) -> None:
    """spec.coldStart.checkpoint: retire automatic checkpoints past `keep`, and create the
    current spec's once one of its replicas is Ready (auto_checkpoint says when)."""
    if not spec.auto_checkpoint or spec.restore_policy == "Never":
        return
    fingerprint = spec_fingerprint(spec)
    usable = newest_usable(checkpoints, spec.name, fingerprint)
    in_use = str(usable["metadata"]["name"]) if usable else None
    for name in auto_checkpoint.to_delete(
        checkpoints, spec.name, fingerprint, spec.auto_keep, in_use
    ):
        if kube.delete(CKPT_KIND, spec.namespace, name):
            emit(
                "Normal",
                "CheckpointRetired",
                f"deleted automatic Checkpoint {name} (spec.coldStart.checkpoint.keep "
                f"{spec.auto_keep}); its data goes once no replica maps it",
            )
    if usable is not None or auto_checkpoint.unfinished(checkpoints, spec.name):
        return  # the cheap checks first: only then look at the pods
    ready, _ = current_spec_pods(
        ready_pods(service_pods(kube, spec.namespace, spec.name)), fingerprint
    )
    if auto_checkpoint.due(spec.name, fingerprint, checkpoints, usable, len(ready)):
        ckpt = auto_checkpoint.build(spec.name, spec.namespace, fingerprint)
        if kube.create_if_absent(ckpt):
            emit(
                "Normal",
                "AutoCheckpoint",
                f"checkpointing the current spec ({fingerprint}) as Checkpoint "
                f"{ckpt['metadata']['name']}, with one replica more while it runs",
            )


def storage_warning(
    kube: Kube, spec: IsvcSpec, nodes: set[str], old: Body, new: dict[str, Any], emit: Emit
) -> None:
    """A Warning Event (once per change) when a ReadWriteOnce checkpoint claim meets
    replicas on several nodes; status.storageWarning keeps it until that ends."""
    warning = None
    if spec.storage.uses_claim() and len(nodes) > 1:
        claim = b.pvc_name(spec)
        modes: list[str] = [spec.storage.access_mode]
        if spec.storage.existing_claim:  # the user's claim says what it is
            pvc = kube.get("PersistentVolumeClaim", spec.namespace, claim) or {}
            modes = list((pvc.get("spec") or {}).get("accessModes") or [])
        warning = rwo_spread_warning(spec, claim, modes, nodes)
    if warning:
        new["storageWarning"] = warning
        if old.get("storageWarning") != warning:
            emit("Warning", "ReadWriteOnceMultiNode", warning)
    elif old.get("storageWarning"):
        new["storageWarning"] = None  # the status is merge-patched: None removes the field


def observe_pods(
    kube: Kube, spec: IsvcSpec, agents: Agents, nodes: set[str] | None = None
) -> tuple[PodBoot, ...]:
    """Each live pod's boot report; nodes (when given) collects the nodes they are on.
    Only the Deployment's own pods are asked (service_pods): the token goes to no other."""
    pods = service_pods(kube, spec.namespace, spec.name)
    token: str | None = None
    out = []
    for pod in sorted(pods, key=lambda p: p["metadata"]["name"]):
        if (pod.get("metadata") or {}).get("deletionTimestamp"):
            continue
        if nodes is not None and (pod.get("spec") or {}).get("nodeName"):
            nodes.add(pod["spec"]["nodeName"])
        boot = pod_boot(pod, None, "pod has no IP yet")
        if (pod.get("status") or {}).get("podIP"):
            if token is None:
                token = read_token(kube, spec.namespace, spec.name)
            boot = pod_boot(pod, *agents.ask_status(pod, token, spec.admin_tls is not None))
        mirror_boot_annotations(kube, pod, boot)
        out.append(boot)
    return tuple(out)


def mapped_checkpoints(pod: Body) -> list[str]:
    """Checkpoint directories whose files this pod's processes may map (restored from them)."""
    ann = (pod.get("metadata") or {}).get("annotations") or {}
    return [p for p in (ann.get(ANN_RESTORED_FROM) or "").split(",") if p]


def with_mapped(annotations: Mapping[str, str], path: str) -> str:
    """The annotation's value with path added: a pod restored, checkpointed and restored
    again may still map pages of each checkpoint it came from."""
    paths = [p for p in (annotations.get(ANN_RESTORED_FROM) or "").split(",") if p]
    return ",".join(paths if path in paths else [*paths, path])


def mirror_boot_annotations(kube: Kube, pod: Body, boot: PodBoot) -> None:
    """Pods say how they came up (kubectl get pod -o yaml shows it without the agent)."""
    if boot.origin not in ("booted", "restored"):
        return
    ann = (pod.get("metadata") or {}).get("annotations") or {}
    want = {ANN_BOOT_PATH: boot.origin, ANN_BOOT_REASON: boot.reason[:500]}
    if boot.origin == "restored" and boot.checkpoint:
        want[ANN_RESTORED_FROM] = with_mapped(ann, boot.checkpoint)
    if boot.agent_ready_seconds is not None and not ann.get(ANN_AGENT_READY):
        want[ANN_AGENT_READY] = f"{boot.agent_ready_seconds:.3f}"  # recorded once per pod
    if all(ann.get(k) == v for k, v in want.items()):
        return
    kube.merge_patch(
        "Pod",
        pod["metadata"]["namespace"],
        pod["metadata"]["name"],
        {"metadata": {"annotations": want}},
    )


def reconcile(
    kube: Kube, body: Body, emit: Emit, agents: Agents, settings: Settings | None = None
) -> dict[str, Any]:
    """Bring owned objects in line with body's spec and return the new status."""
    settings = settings or from_env()
    old: Body = body.get("status") or {}
    meta = body["metadata"]
    try:
        spec = spec_of(body)
        check_image(spec, settings)
        check_autoscaling(spec, settings)
    except (SpecError, ValueError) as e:
        new = {**old, "phase": "Failed", "message": str(e)}
        if old.get("message") != str(e):
            emit("Warning", "InvalidSpec", str(e))
        return new

    # Nothing is written while an object with one of our names belongs to someone else.
    squatted = foreign_object(kube, spec, str(meta.get("uid") or ""), settings.network_policy)
    if squatted:
        if old.get("message") != squatted:
            emit("Warning", "ObjectNotOurs", squatted)
        return {**old, "phase": "Failed", "message": squatted}

    need = shm_need(spec)
    shm_error = shm_shortfall(spec, need)
    shm_bytes = effective_shm_bytes(spec, need)
    checkpoints = kube.list("Checkpoint", spec.namespace)
    mark_stale(kube, spec, checkpoints, emit)
    in_use = None
    tls_error = admin_tls_problem(kube, spec)
    if shm_error is None:
        # The pointer before the Deployment: a pod the Deployment change starts must see it.
        key = ensure_secrets(kube, body, spec)
        in_use = update_pointer(kube, body, spec, checkpoints, key)
        ensure_objects(
            kube,
            body,
            spec,
            shm_bytes,
            settings,
            deployment=tls_error is None,
            surge=auto_checkpoint.surge(checkpoints, spec.name),
        )
        keep_checkpoints_current(kube, spec, checkpoints, emit)
    deployment = kube.get("Deployment", spec.namespace, b.deployment_name(spec.name))
    if deployment and placement.uses_gate(spec.storage.type):
        release_gated(kube, spec)
    nodes: set[str] = set()
    pods = observe_pods(kube, spec, agents, nodes) if deployment else ()
    record_cached_nodes(kube, spec, checkpoints, in_use, pods)
    if settings.prewarm:
        prewarm_nodes(kube, spec, checkpoints, in_use, pods, agents)
    obs = Observed(
        spec_replicas=spec.replicas,
        deployment=deployment,
        pods=pods,
        checkpoint=in_use,
        shm_bytes=shm_bytes,
        shm_need=need.as_status(),
        shm_error=shm_error,
        selector=b.selector_string(spec.name),
        endpoint=f"http://{b.service_name(spec.name)}.{meta['namespace']}.svc:{SERVE_PORT}/v1",
        checkpoint_path=_path_of(checkpoints, in_use),
    )
    new = compute_status(old, obs)
    new["observedGeneration"] = meta.get("generation", 0)
    new["fingerprint"] = spec_fingerprint(spec)
    if tls_error:
        new["message"] = tls_error
        if old.get("message") != tls_error:
            emit("Warning", "AdminTLSSecretInvalid", tls_error)
    elif str(old.get("message") or "").startswith("spec.adminTLS"):
        new["message"] = ""  # the Secret is there now, or adminTLS is gone
    storage_warning(kube, spec, nodes, old, new, emit)
    for kind, reason, message in transitions(old, new):
        emit(kind, reason, message)
    return new


def record_cached_nodes(
    kube: Kube,
    spec: IsvcSpec,
    checkpoints: list[dict[str, Any]],
    in_use: str | None,
    pods: tuple[PodBoot, ...],
) -> None:
    """Add to the checkpoint in use the nodes where a replica restored from it (their node
    agent verified it into its cache): where new replicas are placed (placement.py)."""
    if not in_use or not placement.uses_gate(spec.storage.type):
        return
    ckpt = next((c for c in checkpoints if c["metadata"]["name"] == in_use), None)
    path = (ckpt or {}).get("status", {}).get("path")
    if ckpt is None or not path:
        return
    restored_on = [p.node for p in pods if p.origin == "restored" and p.checkpoint == path]
    nodes = placement.cached_nodes(ckpt, restored_on)
    if nodes is not None:
        try:
            kube.merge_patch(
                "Checkpoint",
                spec.namespace,
                in_use,
                {"status": {"cachedNodes": nodes}},
                sub="status",
            )
        except KubeError as e:  # placement only: the next pass retries
            log.warning("Checkpoint %s: cachedNodes not recorded: %s", in_use, e)


def prewarm_nodes(
    kube: Kube,
    spec: IsvcSpec,
    checkpoints: list[dict[str, Any]],
    in_use: str | None,
    pods: tuple[PodBoot, ...],
    agents: Agents,
) -> None:
    """Ask one Ready replica on each node that does not hold the checkpoint in use (not
    made there, no replica there restored from it) to have its node agent pull it, so
    the next replica there restores from the node's cache. Each pod is asked once per
    checkpoint (Agents.prewarm_once); the pull runs in the background on that node."""
    published = spec.storage.publish in ("objectStore", "pvc")
    if not in_use or spec.storage.type != "node" or not published:
        return
    ckpt = next((c for c in checkpoints if c["metadata"]["name"] == in_use), None)
    st = (ckpt or {}).get("status") or {}
    path = st.get("path")
    if not path:
        return
    holding = {st.get("node")} | {
        p.node for p in pods if p.origin == "restored" and p.checkpoint == path
    }
    asked: dict[str, str] = {}  # node -> the pod asked there
    for p in pods:
        if p.ready and p.node and p.node not in holding:
            asked.setdefault(p.node, p.name)
    if not asked:
        return
    token = read_token(kube, spec.namespace, spec.name)
    bodies = {x["metadata"]["name"]: x for x in service_pods(kube, spec.namespace, spec.name)}
    for name in asked.values():
        if name in bodies:
            agents.prewarm_once(bodies[name], token, path, spec.admin_tls is not None)


def release_gated(kube: Kube, spec: IsvcSpec) -> None:
    """Release any pod of the service still gated: the pod watch releases each one as it
    is created, but an event handler is not retried, and pods created while the operator
    was down wait for it."""
    for pod in kube.list("Pod", spec.namespace, b.selector_string(spec.name)):
        if placement.gated(pod) and not (pod.get("metadata") or {}).get("deletionTimestamp"):
            try:
                log.info("pod %s: %s", pod["metadata"]["name"], release_pod(kube, pod))
            except KubeError as e:  # gone meanwhile, or the apiserver: the next pass retries
                log.warning("pod %s still gated: %s", pod["metadata"]["name"], e)


def release_pod(kube: Kube, pod: Body) -> str:
    """Release a pod created gated (placement.GATE) toward the warm nodes of its service's
    checkpoint in use; returns them in words. A pod whose service or checkpoint cannot be
    read is released all the same: a gate is never left on because of an error here."""
    meta = pod["metadata"]
    ns, isvc_name = meta["namespace"], (meta.get("labels") or {}).get(NAME_LABEL, "")
    warm: list[str] = []
    resident: list[str] = []
    try:
        isvc = kube.get("InferenceService", ns, isvc_name) or {}
        status = isvc.get("status") or {}
        in_use = status.get("checkpoint") or ""
        ckpt = kube.get("Checkpoint", ns, in_use) if in_use else None
        warm = placement.warm_nodes(ckpt)
        resident = placement.resident_nodes(status)
    except KubeError as e:
        log.warning("placing pod %s/%s without warm nodes: %s", ns, meta["name"], e)
    try:
        kube.merge_patch("Pod", ns, meta["name"], placement.release_patch(pod, warm, resident))
    except KubeError as e:
        if e.status != 422:
            raise
        # The apiserver refused the terms (a rule this code does not know): the pod must
        # not stay gated for it; released without them, and said so.
        log.warning(
            "pod %s/%s: placement terms refused (%s); released without", ns, meta["name"], e
        )
        kube.merge_patch("Pod", ns, meta["name"], placement.release_patch(pod, [], []))
        return f"released without placement terms ({e.message[:200]})"
    if not warm:
        return "no node holds its checkpoint yet"
    hot = [n for n in resident if n in warm]
    return f"prefers {', '.join(warm)}" + (f" ({', '.join(hot)} resident)" if hot else "")


def _path_of(checkpoints: list[dict[str, Any]], name: str | None) -> str | None:
    """The directory of Checkpoint name, as its agents report it."""
    for c in checkpoints:
        if name and c["metadata"]["name"] == name:
            return (c.get("status") or {}).get("path")
    return None
