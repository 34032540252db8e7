"""All talking to pods: their agents' admin API, and the OpenAI API behind a Service.

The operator asks each pod's agent how its vLLM came up (GET /v1/status) and
asks one agent to checkpoint (POST /v1/checkpoint). That POST answers only once
the agent has drained, dumped and verified by restoring, which takes minutes,
so it runs in a background thread of its own: the caller starts it and looks
at it again in short steps, and no kopf worker ever waits on it.

A pod started with spec.adminTLS (its annotation and volume say so) is
reached over HTTPS, its certificate verified against ca.crt of the Secret it
mounts and the name in its annotation, though the connection goes to its IP.

`kubectl rekindle bench` sends its completions through the apiserver's
service proxy rather than to pod IPs, so it works wherever kubectl does.
"""

from __future__ import annotations

import base64
import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import urllib3
from rekindle_contract.api import ADMIN_PORT, SERVE_PORT, AgentClient, AgentError, StatusReply
from rekindle_contract.manifest import Manifest
from rekindle_contract.pod import TOKEN_KEY

from rekindle_operator import admin_tls
from rekindle_operator.builders import deployment_name, secret_name, selector_string
from rekindle_operator.kube import Kube, KubeError, service_proxy_path

log = logging.getLogger(__name__)

Body = Mapping[str, Any]

# A status request is answered at once, even while the agent checkpoints.
STATUS_TIMEOUT_S = 3.0
# States in which an agent is working on a checkpoint (or the restore that verifies it).
BUSY_STATES = ("Draining", "Checkpointing", "Restoring")


class Agent(Protocol):
    """What the operator calls on one agent (AgentClient; a fake in tests)."""

    def status(self) -> StatusReply: ...

    def checkpoint(self, directory: str, timeout: float = ...) -> Manifest: ...

    def prewarm(self, directory: str) -> dict[str, Any]: ...


@dataclass(frozen=True)
class AgentTLS:
    """What verifies one agent's certificate: the issuer's PEM and the name it must carry."""

    ca: bytes
    server_name: str


class AgentFactory(Protocol):
    """(admin base URL, bearer token, TLS or None for plain HTTP) -> Agent."""

    def __call__(self, url: str, token: str, tls: AgentTLS | None = None) -> Agent: ...


class Secrets(Protocol):
    """Where the CA comes from: Kube, or a fake in tests."""

    def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None: ...


def _client(url: str, token: str, tls: AgentTLS | None = None) -> Agent:
    if tls is None:
        return AgentClient(url, token, timeout=STATUS_TIMEOUT_S)
    return AgentClient(url, token, timeout=STATUS_TIMEOUT_S, ca=tls.ca, server_name=tls.server_name)


def agent_url(pod: Body, https: bool = False) -> str:
    return f"{'https' if https else 'http'}://{pod['status']['podIP']}:{ADMIN_PORT}"


POD_TEMPLATE_HASH = "pod-template-hash"  # the Deployment controller's label on RS and pods


def controller_uid(obj: Body) -> str:
    """The UID of obj's controlling owner ("" if none)."""
    for ref in (obj.get("metadata") or {}).get("ownerReferences") or []:
        if ref.get("controller"):
            return str(ref.get("uid") or "")
    return ""


def service_pods(kube: Kube, namespace: str, isvc: str) -> list[dict[str, Any]]:
    """isvc's pods that its own Deployment made: the only ones trusted with its token.

    A label is not proof: anyone who can create a pod in the namespace can
    label it `rekindle.dev/inferenceservice: NAME`, and the operator would
    send that pod the admin token, copy its answers into status and maybe
    checkpoint it. A pod is the service's only if it is controlled by a
    ReplicaSet that the service's Deployment controls (matching UIDs) and
    carries that ReplicaSet's pod-template-hash.
    """
    deployment = kube.get("Deployment", namespace, deployment_name(isvc))
    if deployment is None:
        return []
    dep_uid = deployment["metadata"].get("uid") or ""
    hashes = {
        rs["metadata"].get("uid"): (rs["metadata"].get("labels") or {}).get(POD_TEMPLATE_HASH)
        for rs in kube.list("ReplicaSet", namespace, selector_string(isvc))
        if dep_uid and controller_uid(rs) == dep_uid
    }
    out = []
    for pod in kube.list("Pod", namespace, selector_string(isvc)):
        want = hashes.get(controller_uid(pod))
        if want and (pod["metadata"].get("labels") or {}).get(POD_TEMPLATE_HASH) == want:
            out.append(pod)
    return out


def read_token(kube: Kube, namespace: str, isvc: str) -> str:
    """The bearer token of isvc's agents, from the Secret the operator created."""
    sec = kube.get("Secret", namespace, secret_name(isvc))
    if not sec:
        raise RuntimeError(f"Secret {secret_name(isvc)} is missing; the operator recreates it")
    return base64.b64decode(sec["data"][TOKEN_KEY]).decode()


@dataclass
class CheckpointCall:
    """One POST /v1/checkpoint in flight (or finished) in a background thread."""

    pod: str
    path: str
    finished: threading.Event = field(default_factory=threading.Event)
    manifest: Manifest | None = None
    error: str | None = None
    published: str | None = None  # where the node agent published it, in the agent's words

    def done(self) -> bool:
        return self.finished.is_set()


class Agents:
    """The pods' agents, and the checkpoint calls this operator process has running."""

    def __init__(
        self, client_for: AgentFactory | None = None, secrets: Secrets | None = None
    ) -> None:
        self._client_for = client_for or _client
        self._secrets = secrets  # None: a Kube of its own, made when a pod needs a CA
        self._calls: dict[str, CheckpointCall] = {}
        self._lock = threading.Lock()
        # (pod UID, checkpoint path) already asked to pre-warm: each pod is asked once.
        self._prewarmed: set[tuple[str, str]] = set()

    def client(self, pod: Body, token: str, tls_required: bool = False) -> Agent:
        """A client of pod's agent: HTTPS verified with its Secret's ca.crt when the pod was
        started with admin TLS; raises ValueError when that Secret is missing or lacks it.

        tls_required (the service's spec.adminTLS is set): a pod started without TLS
        (from the template before it) is not sent the token in clear; it is reported
        unreachable until the rollout replaces it. The spec decides that TLS is due,
        the pod's own immutable volume only how to reach it.
        """
        tls = admin_tls.pod_tls(pod)
        if tls is None and tls_required:
            raise ValueError(
                f"pod {pod['metadata']['name']} was started without admin TLS, and "
                "spec.adminTLS is set: the token is not sent to it in clear (its "
                "replacement from the current template will have TLS)"
            )
        if tls is None:
            return self._client_for(agent_url(pod), token)
        if self._secrets is None:
            self._secrets = Kube()
        namespace = pod["metadata"]["namespace"]
        secret = self._secrets.get("Secret", namespace, tls.secret_name)
        ca = admin_tls.ca_bundle(secret, namespace, tls.secret_name)
        return self._client_for(agent_url(pod, https=True), token, AgentTLS(ca, tls.server_name))

    def status(self, pod: Body, token: str, tls_required: bool = False) -> StatusReply:
        """GET /v1/status of pod's agent; raises if it does not answer."""
        return self.client(pod, token, tls_required).status()

    def prewarm_once(self, pod: Body, token: str, path: str, tls_required: bool = False) -> bool:
        """Ask pod's agent to have its node cache path, unless that pod was asked already;
        whether it was asked now (a refusal or no answer is logged: pre-warming only
        saves a later pull, never decides anything)."""
        key = (str(pod["metadata"].get("uid", "")), path)
        with self._lock:
            if key in self._prewarmed:
                return False
            self._prewarmed.add(key)
        try:
            answer = self.client(pod, token, tls_required).prewarm(path)
        except AgentError as e:  # it answered no (an agent without the route: 404)
            log.info("pod %s: pre-warm of %s refused: %s", pod["metadata"]["name"], path, e)
            return False
        except Exception as e:  # not reached: ask again at the next reconcile
            log.info("pod %s: pre-warm of %s not asked: %s", pod["metadata"]["name"], path, e)
            with self._lock:
                self._prewarmed.discard(key)
            return False
        if not answer.get("started") and answer.get("checkpoint") != path:
            with self._lock:  # busy with another checkpoint's pull: ask again next time
                self._prewarmed.discard(key)
            return False
        log.info("pod %s pre-warms %s on its node: %s", pod["metadata"]["name"], path, answer)
        return True

    def ask_status(
        self, pod: Body, token: str, tls_required: bool = False
    ) -> tuple[StatusReply | None, str | None]:
        """(reply, None), or (None, why not): for status reports, which never raise."""
        try:
            return self.status(pod, token, tls_required), None
        except Exception as e:
            return None, f"agent status unavailable: {e}"

    def start_checkpoint(
        self,
        key: str,
        pod: Body,
        token: str,
        path: str,
        timeout: float,
        then: Callable[[], None],
        tls_required: bool = False,
    ) -> CheckpointCall:
        """POST /v1/checkpoint in a background thread; then() runs when it has answered.

        The client is made in that thread too, so a Secret gone since the status
        call fails the call (call.error) rather than the caller.
        """
        call = CheckpointCall(pod["metadata"]["name"], path)
        with self._lock:
            self._calls[key] = call
        threading.Thread(
            target=_run_checkpoint,
            args=(lambda: self.client(pod, token, tls_required), call, timeout, then),
            name=f"checkpoint-{call.pod}",
            daemon=True,
        ).start()
        return call

    def checkpoint_call(self, key: str) -> CheckpointCall | None:
        """The call started for key in this process; None after an operator restart."""
        with self._lock:
            return self._calls.get(key)

    def forget(self, key: str) -> None:
        with self._lock:
            self._calls.pop(key, None)


def _run_checkpoint(
    agent: Callable[[], Agent], call: CheckpointCall, timeout: float, then: Callable[[], None]
) -> None:
    try:
        client = agent()
        call.manifest = client.checkpoint(call.path, timeout=timeout)
        call.published = publication(client, call.path)
    except Exception as e:  # the agent's own message: the Checkpoint's status shows it
        call.error = str(e) or repr(e)
    finally:
        try:
            then()
        except Exception:
            log.exception("after the checkpoint of pod %s", call.pod)
        call.finished.set()


def publication(agent: Agent, path: str) -> str | None:
    """Where the node agent published the checkpoint at path, or why it did not, as the
    agent's status says (storage node with publishing only). The checkpoint itself is
    done: an agent that cannot say now costs only this line of the status."""
    try:
        last = agent.status().last_checkpoint or {}
    except Exception as e:
        log.info("no publication result from the agent for %s: %s", path, e)
        return None
    return str(last["published"]) if last.get("dir") == path and last.get("published") else None


def pod_completion(kube: Kube, namespace: str, pod: str, model: str, timeout: float = 5.0) -> bool:
    """One greedy token from that pod itself, through the apiserver's pod proxy."""
    body = {"model": model, "prompt": "Hello", "max_tokens": 1, "temperature": 0}
    url_path = f"/api/v1/namespaces/{namespace}/pods/{pod}:{SERVE_PORT}/proxy/v1/completions"
    try:
        reply = kube.request("POST", url_path, body, timeout=timeout)
    except (KubeError, urllib3.exceptions.HTTPError, OSError, ValueError):
        return False  # not serving yet, or a timeout
    return bool(isinstance(reply, dict) and reply.get("choices"))


def service_completion(
    kube: Kube, namespace: str, service: str, model: str, timeout: float = 5.0
) -> bool:
    """One greedy token through the apiserver's service proxy; True once it is generated."""
    body = {"model": model, "prompt": "Hello", "max_tokens": 1, "temperature": 0}
    url_path = service_proxy_path(namespace, service, SERVE_PORT, "v1/completions")
    try:
        reply = kube.request("POST", url_path, body, timeout=timeout)
    except (KubeError, urllib3.exceptions.HTTPError, OSError, ValueError):
        return False  # no ready endpoint yet (503), the pod still restoring, a timeout
    return bool(isinstance(reply, dict) and reply.get("choices"))
