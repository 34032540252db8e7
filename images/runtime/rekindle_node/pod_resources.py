"""Which devices the kubelet gave a pod, read from the kubelet's PodResources gRPC API.

Why the kubelet: the node agent checkpoints and restores a pod's GPUs, so it must know
exactly which GPUs are the pod's. The pod's environment cannot tell it:
NVIDIA_VISIBLE_DEVICES is `all` when devices come through CDI, and a tenant sets its
own environment anyway. The kubelet allocated the devices and serves that record,
per pod and container, on a unix socket only node-local processes can reach
(k8s.io/kubelet/pkg/apis/podresources/v1, service `v1.PodResourcesLister`).

Design: the protobuf wire format by hand, not generated stubs nor message classes
built from a descriptor at import time. The client needs to encode one message of
two strings (GetPodResourcesRequest) and to decode five small ones, field numbers
fixed by the kubelet's API.proto; by hand that is ~60 lines with no protoc, no
generated code to keep in step, no registration of a package named plain `v1` in a
process-wide descriptor pool, and no dependency on the protobuf runtime at all
(grpcio alone carries bytes). The decoder skips fields it does not know, whatever
their wire type, as protobuf requires, so a newer kubelet that adds fields still
parses. The field numbers, from api.proto:

    ListPodResourcesResponse  { repeated PodResources pod_resources = 1; }
    GetPodResourcesRequest    { string pod_name = 1; string pod_namespace = 2; }
    GetPodResourcesResponse   { PodResources pod_resources = 1; }
    PodResources              { string name = 1; string namespace = 2;
                                repeated ContainerResources containers = 3; }
    ContainerResources        { string name = 1; repeated ContainerDevices devices = 2;
                                repeated int64 cpu_ids = 3; repeated ContainerMemory memory = 4;
                                repeated DynamicResource dynamic_resources = 5; }
    ContainerDevices          { string resource_name = 1; repeated string device_ids = 2;
                                TopologyInfo topology = 3; }
    DynamicResource           { string claim_name = 2; string claim_namespace = 3;
                                repeated ClaimResource claim_resources = 4; }
    ClaimResource             { repeated CDIDevice cdi_devices = 1; string driver_name = 2;
                                string pool_name = 3; string device_name = 4; }
    CDIDevice                 { string name = 1; }

(cpu_ids, memory and topology are read past: the node agent moves GPUs, not CPUs.)
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass

import grpc  # type: ignore[import-untyped]

DEFAULT_SOCKET = "/var/lib/kubelet/pod-resources/kubelet.sock"
SERVICE = "v1.PodResourcesLister"
# Device-plugin resource and DRA driver names that mean "a GPU".
GPU_RESOURCE = "nvidia.com/gpu"
GPU_DRA_DRIVER = "gpu.nvidia.com"
# The kubelet's own client allows 16 MiB answers; grpc's default (4 MiB) is too
# small for List on a node with many pods.
MAX_MESSAGE_BYTES = 16 * 2**20


class PodResourcesError(ValueError):
    """The kubelet's record could not be read; the message says what to change."""


class PodNotFoundError(PodResourcesError):
    """The kubelet of this node runs no such pod."""


# ------------------------------------------------------------------ the records


@dataclass(frozen=True)
class Device:
    """Device-plugin devices of one resource, ids as the plugin reported them."""

    resource: str
    ids: tuple[str, ...]

    @property
    def is_gpu(self) -> bool:
        return self.resource == GPU_RESOURCE or self.resource.endswith("/gpu")


@dataclass(frozen=True)
class ClaimDevice:
    """One device a DRA ResourceClaim gave a container; driver/pool/device name it
    uniquely, cdi_devices are what the runtime injected for it."""

    claim: str
    claim_namespace: str
    driver: str
    pool: str
    device: str
    cdi_devices: tuple[str, ...]

    @property
    def is_gpu(self) -> bool:
        return self.driver == GPU_DRA_DRIVER


@dataclass(frozen=True)
class ContainerDevices:
    """What one container got: device-plugin devices and DRA devices.

    cdi_devices lists the CDI names of all its DRA devices, in the kubelet's order;
    claims keeps which claim and driver each came from (a GPU is told by its driver).
    """

    container: str
    devices: tuple[Device, ...]
    cdi_devices: tuple[str, ...]
    claims: tuple[ClaimDevice, ...] = ()

    @property
    def gpus(self) -> tuple[str, ...]:
        """GPU device ids, then CDI names of DRA GPUs, in the kubelet's order."""
        plugin = [i for d in self.devices if d.is_gpu for i in d.ids]
        dra = [n for c in self.claims if c.is_gpu for n in c.cdi_devices]
        return _unique(plugin + dra)


@dataclass(frozen=True)
class PodDevices:
    """One pod's devices, per container (restartable init containers included)."""

    namespace: str
    name: str
    containers: tuple[ContainerDevices, ...]

    @property
    def gpus(self) -> tuple[str, ...]:
        """The pod's GPUs in the kubelet's order, each once: containers of a pod may
        share a DRA claim, and so list the same device."""
        return _unique([g for c in self.containers for g in c.gpus])


def _unique(items: list[str]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(items))


# ------------------------------------------------------------------ wire format

_VARINT, _FIXED64, _LEN, _FIXED32 = 0, 1, 2, 5


class _Malformed(Exception):
    pass


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    """The unsigned varint at pos, and the position after it."""
    value = shift = 0
    while shift < 64:
        if pos >= len(buf):
            raise _Malformed("truncated varint")
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7
    raise _Malformed("varint longer than 10 bytes")


def _fields(buf: bytes) -> Iterator[tuple[int, int, int | bytes]]:
    """(field number, wire type, value) of each field of one message, in order."""
    pos = 0
    while pos < len(buf):
        key, pos = _varint(buf, pos)
        number, wire = key >> 3, key & 7
        if number == 0:
            raise _Malformed("field number 0")
        value: int | bytes
        if wire == _VARINT:
            value, pos = _varint(buf, pos)
        elif wire in (_FIXED64, _FIXED32, _LEN):
            if wire == _LEN:
                size, pos = _varint(buf, pos)
            else:
                size = 8 if wire == _FIXED64 else 4
            if pos + size > len(buf):
                raise _Malformed(f"field {number} runs past the end of its message")
            value, pos = buf[pos : pos + size], pos + size
        else:  # groups (3, 4) are proto2-only; 6 and 7 do not exist
            raise _Malformed(f"field {number} has wire type {wire}")
        yield number, wire, value


def _len(number: int, wire: int, value: int | bytes) -> bytes:
    """A length-delimited field's bytes; any other wire type for it is malformed."""
    if wire != _LEN or not isinstance(value, bytes):
        raise _Malformed(f"field {number} has wire type {wire}, expected {_LEN}")
    return value


def _str(number: int, wire: int, value: int | bytes) -> str:
    try:
        return _len(number, wire, value).decode()
    except UnicodeDecodeError as e:
        raise _Malformed(f"field {number} is not UTF-8") from e


def _key(number: int, wire: int) -> bytes:
    return _encode_varint(number << 3 | wire)


def _encode_varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _encode_str(number: int, value: str) -> bytes:
    """A string field; proto3 leaves out the empty string."""
    data = value.encode()
    return _key(number, _LEN) + _encode_varint(len(data)) + data if data else b""


def encode_get_request(namespace: str, name: str) -> bytes:
    """GetPodResourcesRequest{pod_name = 1, pod_namespace = 2}."""
    return _encode_str(1, name) + _encode_str(2, namespace)


def _decode_device(buf: bytes) -> Device:
    resource, ids = "", []
    for number, wire, value in _fields(buf):
        if number == 1:
            resource = _str(number, wire, value)
        elif number == 2:
            ids.append(_str(number, wire, value))
    return Device(resource, tuple(ids))


def _decode_claim_resource(buf: bytes, claim: str, claim_namespace: str) -> ClaimDevice:
    cdi: list[str] = []
    driver = pool = device = ""
    for number, wire, value in _fields(buf):
        if number == 1:
            cdi.extend(_str(n, w, v) for n, w, v in _fields(_len(number, wire, value)) if n == 1)
        elif number == 2:
            driver = _str(number, wire, value)
        elif number == 3:
            pool = _str(number, wire, value)
        elif number == 4:
            device = _str(number, wire, value)
    return ClaimDevice(claim, claim_namespace, driver, pool, device, tuple(cdi))


def _decode_dynamic_resource(buf: bytes) -> list[ClaimDevice]:
    claim, claim_namespace, resources = "", "", []
    for number, wire, value in _fields(buf):
        if number == 2:
            claim = _str(number, wire, value)
        elif number == 3:
            claim_namespace = _str(number, wire, value)
        elif number == 4:
            resources.append(_len(number, wire, value))
    # The claim's name may follow its resources on the wire: decode them last.
    return [_decode_claim_resource(r, claim, claim_namespace) for r in resources]


def _decode_container(buf: bytes) -> ContainerDevices:
    name, devices, claims = "", [], []
    for number, wire, value in _fields(buf):
        if number == 1:
            name = _str(number, wire, value)
        elif number == 2:
            devices.append(_decode_device(_len(number, wire, value)))
        elif number == 5:
            claims.extend(_decode_dynamic_resource(_len(number, wire, value)))
    cdi = tuple(n for c in claims for n in c.cdi_devices)
    return ContainerDevices(name, tuple(devices), cdi, tuple(claims))


def _decode_pod(buf: bytes) -> PodDevices:
    name, namespace, containers = "", "", []
    for number, wire, value in _fields(buf):
        if number == 1:
            name = _str(number, wire, value)
        elif number == 2:
            namespace = _str(number, wire, value)
        elif number == 3:
            containers.append(_decode_container(_len(number, wire, value)))
    return PodDevices(namespace, name, tuple(containers))


def decode_list_response(buf: bytes) -> list[PodDevices]:
    """ListPodResourcesResponse{repeated PodResources pod_resources = 1}."""
    try:
        return [_decode_pod(_len(n, w, v)) for n, w, v in _fields(buf) if n == 1]
    except _Malformed as e:
        raise _not_v1("List", e) from e


def decode_get_response(buf: bytes) -> PodDevices | None:
    """GetPodResourcesResponse{PodResources pod_resources = 1}; None when absent.

    A singular message field seen more than once merges, which for its bytes is
    concatenation (protobuf's rule); the kubelet sends it once.
    """
    try:
        parts = [_len(n, w, v) for n, w, v in _fields(buf) if n == 1]
        return _decode_pod(b"".join(parts)) if parts else None
    except _Malformed as e:
        raise _not_v1("Get", e) from e


def _not_v1(method: str, e: _Malformed) -> PodResourcesError:
    return PodResourcesError(
        f"the kubelet's {method} answer is not the v1 PodResources message this client "
        f"decodes ({e}): is the socket the kubelet's pod-resources socket?"
    )


# ------------------------------------------------------------------ the client


class PodResourcesClient:
    """Reads the kubelet's device allocations over its pod-resources socket.

    One channel per call: calls are rare (one per checkpoint or restore), and the
    kubelet recreates its socket when it restarts, which a long-lived channel would
    outlive.
    """

    def __init__(self, socket_path: str = DEFAULT_SOCKET, timeout: float = 5.0) -> None:
        self.socket_path = os.path.abspath(socket_path)
        self.timeout = timeout
        # Set once Get turned out unavailable: then every get() goes through List.
        self._get_unavailable = False

    def get(self, namespace: str, name: str) -> PodDevices:
        """The pod's devices. Uses Get; falls back to List when this kubelet has no Get
        (older than 1.27, or the KubeletPodResourcesGet feature gate off)."""
        if not namespace or not name:
            raise PodResourcesError(
                f"a pod needs a namespace and a name, got {namespace!r}/{name!r}"
            )
        if not self._get_unavailable:
            try:
                answer = self._call("Get", encode_get_request(namespace, name))
            except _GetUnavailable:
                self._get_unavailable = True
            except PodNotFoundError as e:
                raise _not_found(namespace, name) from e
            else:
                pod = decode_get_response(answer)
                if pod is None:
                    raise _not_found(namespace, name)
                if (pod.namespace, pod.name) != (namespace, name):
                    raise PodResourcesError(
                        f"the kubelet answered Get for {namespace}/{name} with pod "
                        f"{pod.namespace}/{pod.name}: is the socket the kubelet's?"
                    )
                return pod
        for pod in self.list():
            if (pod.namespace, pod.name) == (namespace, name):
                return pod
        raise _not_found(namespace, name)

    def list(self) -> list[PodDevices]:
        """Every active pod of the node with its devices, in the kubelet's order."""
        return decode_list_response(self._call("List", b""))

    def _call(self, method: str, request: bytes) -> bytes:
        """One unary call, raw bytes each way: decoding happens after the call, so a
        malformed answer raises this module's error and not grpc's generic one."""
        self._check_socket()
        options = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]
        with grpc.insecure_channel("unix://" + self.socket_path, options=options) as channel:
            call = channel.unary_unary(f"/{SERVICE}/{method}")
            try:
                answer: bytes = call(request, timeout=self.timeout)
            except grpc.RpcError as e:
                raise self._error(method, e) from e
        return answer

    def _check_socket(self) -> None:
        """Fail before grpc does, saying what to mount or change: grpc would only say
        "unavailable"."""
        path = self.socket_path
        try:
            st = os.stat(path)
        except FileNotFoundError:
            raise PodResourcesError(
                f"no kubelet pod-resources socket at {path}: mount the kubelet's "
                "pod-resources directory (hostPath <kubelet --root-dir>/pod-resources, "
                f"{os.path.dirname(DEFAULT_SOCKET)} by default) into the node agent, the "
                "directory and not the socket file (the kubelet recreates the socket when "
                "it restarts), or set the socket path to where it is mounted"
            ) from None
        except PermissionError:
            raise PodResourcesError(
                f"the node agent (uid {os.geteuid()}) may not look up {path}: the kubelet's "
                "pod-resources directory is root-only; run the node agent as root"
            ) from None
        if not stat.S_ISSOCK(st.st_mode):
            raise PodResourcesError(
                f"{path} is not a socket: mount the kubelet's pod-resources directory "
                "(hostPath type Directory) and point the node agent at kubelet.sock in it"
            )
        if not os.access(path, os.R_OK | os.W_OK):
            raise PodResourcesError(_permission_message(path, st))

    def _error(self, method: str, e: grpc.RpcError) -> PodResourcesError:
        code, details = e.code(), e.details() or ""
        path = self.socket_path
        if method == "Get" and _get_unavailable(code, details):
            return _GetUnavailable(details)
        if method == "Get" and code in _NOT_FOUND_CODES and "not found" in details:
            # The kubelet's Get answers an unknown pod with a plain error (UNKNOWN).
            return PodNotFoundError(details)
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return PodResourcesError(
                f"the kubelet did not answer {method} on {path} within {self.timeout:g}s: "
                "it may be overloaded or stuck; raise the client's timeout if it is only slow"
            )
        if code == grpc.StatusCode.UNAVAILABLE and "ermission denied" in details:
            return PodResourcesError(_permission_message(path, None))
        if code == grpc.StatusCode.UNAVAILABLE:
            return PodResourcesError(
                f"nothing serves on {path} ({details}): is the kubelet running? A socket "
                "file mounted by itself goes stale when the kubelet restarts: mount the "
                "pod-resources directory instead"
            )
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            return PodResourcesError(
                f"the kubelet rate-limited {method} ({details}): it allows about 100 calls "
                "a second to the pod-resources API, shared by every client on the node; "
                "call it less often"
            )
        if code == grpc.StatusCode.UNIMPLEMENTED:
            return PodResourcesError(
                f"the kubelet does not serve /{SERVICE}/{method} ({details}): the v1 "
                "pod-resources API needs Kubernetes 1.20 or newer"
            )
        return PodResourcesError(f"the kubelet's {method} failed: {code.name}: {details}")


_NOT_FOUND_CODES = (grpc.StatusCode.UNKNOWN, grpc.StatusCode.NOT_FOUND)


class _GetUnavailable(PodResourcesError):
    """Internal: this kubelet has no Get; the caller falls back to List."""


def _get_unavailable(code: grpc.StatusCode, details: str) -> bool:
    """Get is missing (kubelet < 1.27: UNIMPLEMENTED) or gated off (the kubelet answers
    UNKNOWN "PodResources API Get method disabled")."""
    return code == grpc.StatusCode.UNIMPLEMENTED or "Get method disabled" in details


def _not_found(namespace: str, name: str) -> PodNotFoundError:
    return PodNotFoundError(
        f"the kubelet of this node runs no pod {namespace}/{name}: it is on another node, "
        "not admitted yet, or gone; ask the node agent of the pod's node (spec.nodeName)"
    )


def _permission_message(path: str, st: os.stat_result | None) -> str:
    owner = f" (owner uid {st.st_uid}, mode {stat.filemode(st.st_mode)})" if st else ""
    return (
        f"the node agent (uid {os.geteuid()}) may not connect to {path}{owner}: connecting "
        "needs write permission on the socket, which the kubelet gives root only; run the "
        "node agent as root"
    )
