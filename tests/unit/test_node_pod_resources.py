"""The node agent reads a pod's devices from the kubelet's PodResources gRPC API.

A real grpc server on a unix socket plays the kubelet. Its messages are built by the
protobuf runtime from a descriptor written here from api.proto's field numbers,
independently of the client's hand-written decoder: a wrong field number on either
side fails these tests. Golden bytes, derived by hand, pin both.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc  # type: ignore[import-untyped]
import pytest
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from rekindle_node import pod_resources
from rekindle_node.pod_resources import (
    ClaimDevice,
    ContainerDevices,
    Device,
    PodDevices,
    PodNotFoundError,
    PodResourcesClient,
    PodResourcesError,
    decode_get_response,
    decode_list_response,
    encode_get_request,
)

# ------------------------------------------------------------ api.proto, as a descriptor

_F = descriptor_pb2.FieldDescriptorProto
STRING, INT64, UINT64, MESSAGE = _F.TYPE_STRING, _F.TYPE_INT64, _F.TYPE_UINT64, _F.TYPE_MESSAGE
ONE, MANY = _F.LABEL_OPTIONAL, _F.LABEL_REPEATED

# message name -> [(field name, number, type, label, message type)]
PROTO: dict[str, list[tuple[str, int, int, int, str]]] = {
    "ListPodResourcesRequest": [],
    "ListPodResourcesResponse": [("pod_resources", 1, MESSAGE, MANY, "PodResources")],
    "GetPodResourcesRequest": [
        ("pod_name", 1, STRING, ONE, ""),
        ("pod_namespace", 2, STRING, ONE, ""),
    ],
    "GetPodResourcesResponse": [("pod_resources", 1, MESSAGE, ONE, "PodResources")],
    "PodResources": [
        ("name", 1, STRING, ONE, ""),
        ("namespace", 2, STRING, ONE, ""),
        ("containers", 3, MESSAGE, MANY, "ContainerResources"),
    ],
    "ContainerResources": [
        ("name", 1, STRING, ONE, ""),
        ("devices", 2, MESSAGE, MANY, "ContainerDevices"),
        ("cpu_ids", 3, INT64, MANY, ""),
        ("memory", 4, MESSAGE, MANY, "ContainerMemory"),
        ("dynamic_resources", 5, MESSAGE, MANY, "DynamicResource"),
    ],
    "ContainerMemory": [
        ("memory_type", 1, STRING, ONE, ""),
        ("size", 2, UINT64, ONE, ""),
        ("topology", 3, MESSAGE, ONE, "TopologyInfo"),
    ],
    "ContainerDevices": [
        ("resource_name", 1, STRING, ONE, ""),
        ("device_ids", 2, STRING, MANY, ""),
        ("topology", 3, MESSAGE, ONE, "TopologyInfo"),
    ],
    "TopologyInfo": [("nodes", 1, MESSAGE, MANY, "NUMANode")],
    "NUMANode": [("ID", 1, INT64, ONE, "")],
    "DynamicResource": [
        ("claim_name", 2, STRING, ONE, ""),
        ("claim_namespace", 3, STRING, ONE, ""),
        ("claim_resources", 4, MESSAGE, MANY, "ClaimResource"),
    ],
    "ClaimResource": [
        ("cdi_devices", 1, MESSAGE, MANY, "CDIDevice"),
        ("driver_name", 2, STRING, ONE, ""),
        ("pool_name", 3, STRING, ONE, ""),
        ("device_name", 4, STRING, ONE, ""),
    ],
    "CDIDevice": [("name", 1, STRING, ONE, "")],
}


def _message_classes() -> dict[str, Any]:
    file = descriptor_pb2.FileDescriptorProto(
        name="podresources_v1_test.proto", package="v1", syntax="proto3"
    )
    for message, fields in PROTO.items():
        m = file.message_type.add(name=message)
        for name, number, type_, label, type_name in fields:
            f = m.field.add(name=name, number=number, type=type_, label=label)
            if type_name:
                f.type_name = ".v1." + type_name
    pool = descriptor_pool.DescriptorPool()  # private: no clash with any other "v1"
    pool.Add(file)
    return {
        name: message_factory.GetMessageClass(pool.FindMessageTypeByName("v1." + name))
        for name in PROTO
    }


PB = _message_classes()

# ------------------------------------------------------------ what the fake kubelet runs


def numa(node: int) -> Any:
    return PB["TopologyInfo"](nodes=[PB["NUMANode"](ID=node)])


def gpu_pod() -> Any:
    """Two GPUs through the device plugin, a NIC, exclusive CPUs and NUMA memory."""
    return PB["PodResources"](
        name="vllm-0",
        namespace="serving",
        containers=[
            PB["ContainerResources"](
                name="vllm",
                devices=[
                    PB["ContainerDevices"](
                        resource_name="nvidia.com/gpu",
                        device_ids=["GPU-aaa", "GPU-bbb"],
                        topology=numa(0),
                    ),
                    PB["ContainerDevices"](resource_name="example.com/nic", device_ids=["nic-0"]),
                ],
                cpu_ids=[2, 3, 130],  # 130 takes a two-byte varint
                memory=[PB["ContainerMemory"](memory_type="memory", size=2**33, topology=numa(0))],
            ),
            PB["ContainerResources"](name="sidecar", cpu_ids=[4]),
        ],
    )


DRA_GPU = "k8s.gpu.nvidia.com/device=gpu-0"
DRA_NIC = "dra.example.com/nic=nic-1"


def dra_pod() -> Any:
    """One GPU and one NIC through DRA claims; a CPU-only init-less second container."""
    claim_gpu = PB["ClaimResource"](
        cdi_devices=[PB["CDIDevice"](name=DRA_GPU)],
        driver_name="gpu.nvidia.com",
        pool_name="node-a",
        device_name="gpu-0",
    )
    claim_nic = PB["ClaimResource"](
        cdi_devices=[PB["CDIDevice"](name=DRA_NIC)],
        driver_name="dra.example.com",
        pool_name="node-a",
        device_name="nic-1",
    )
    return PB["PodResources"](
        name="dra-0",
        namespace="ml",
        containers=[
            PB["ContainerResources"](
                name="main",
                cpu_ids=[0, 1],
                dynamic_resources=[
                    PB["DynamicResource"](
                        claim_name="gpu", claim_namespace="ml", claim_resources=[claim_gpu]
                    ),
                    PB["DynamicResource"](
                        claim_name="net", claim_namespace="ml", claim_resources=[claim_nic]
                    ),
                ],
            ),
        ],
    )


GPU_POD = PodDevices(
    namespace="serving",
    name="vllm-0",
    containers=(
        ContainerDevices(
            container="vllm",
            devices=(
                Device("nvidia.com/gpu", ("GPU-aaa", "GPU-bbb")),
                Device("example.com/nic", ("nic-0",)),
            ),
            cdi_devices=(),
        ),
        ContainerDevices(container="sidecar", devices=(), cdi_devices=()),
    ),
)

DRA_POD = PodDevices(
    namespace="ml",
    name="dra-0",
    containers=(
        ContainerDevices(
            container="main",
            devices=(),
            cdi_devices=(DRA_GPU, DRA_NIC),
            claims=(
                ClaimDevice("gpu", "ml", "gpu.nvidia.com", "node-a", "gpu-0", (DRA_GPU,)),
                ClaimDevice("net", "ml", "dra.example.com", "node-a", "nic-1", (DRA_NIC,)),
            ),
        ),
    ),
)


class Kubelet:
    """The PodResourcesLister service over the given pods; records what it was asked."""

    def __init__(self, pods: list[Any]) -> None:
        self.pods = pods
        self.asked: list[tuple[str, Any]] = []

    def list(self, request: Any, context: grpc.ServicerContext) -> Any:
        self.asked.append(("List", request))
        return PB["ListPodResourcesResponse"](pod_resources=self.pods)

    def get(self, request: Any, context: grpc.ServicerContext) -> Any:
        self.asked.append(("Get", request))
        for pod in self.pods:
            if (pod.namespace, pod.name) == (request.pod_namespace, request.pod_name):
                return PB["GetPodResourcesResponse"](pod_resources=pod)
        # What the real kubelet does: a plain Go error, which grpc sends as UNKNOWN.
        context.abort(
            grpc.StatusCode.UNKNOWN,
            f"pod {request.pod_name} in namespace {request.pod_namespace} not found",
        )

    def get_disabled(self, request: Any, context: grpc.ServicerContext) -> Any:
        self.asked.append(("Get", request))
        context.abort(grpc.StatusCode.UNKNOWN, "PodResources API Get method disabled")


def handler(fn: Callable[..., Any], request: str) -> Any:
    return grpc.unary_unary_rpc_method_handler(
        fn,
        request_deserializer=PB[request].FromString,
        response_serializer=lambda m: m.SerializeToString(),
    )


Serve = Callable[..., str]


@pytest.fixture()
def serve(tmp_path: Path) -> Iterator[Serve]:
    """serve(methods) -> the socket path of a grpc server with those methods."""
    servers: list[Any] = []

    def start(methods: dict[str, Any]) -> str:
        path = str(tmp_path / f"kubelet{len(servers)}.sock")
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler("v1.PodResourcesLister", methods),)
        )
        server.add_insecure_port("unix://" + path)
        server.start()
        servers.append(server)
        return path

    yield start
    for s in servers:
        s.stop(0)


def kubelet_methods(kubelet: Kubelet, get: bool = True) -> dict[str, Any]:
    methods = {"List": handler(kubelet.list, "ListPodResourcesRequest")}
    if get:
        methods["Get"] = handler(kubelet.get, "GetPodResourcesRequest")
    return methods


# ------------------------------------------------------------ parsing, over real grpc


def test_get_reads_device_plugin_gpus(serve: Serve) -> None:
    kubelet = Kubelet([gpu_pod(), dra_pod()])
    client = PodResourcesClient(serve(kubelet_methods(kubelet)))

    pod = client.get("serving", "vllm-0")

    assert pod == GPU_POD
    assert pod.gpus == ("GPU-aaa", "GPU-bbb")
    assert pod.containers[0].gpus == ("GPU-aaa", "GPU-bbb")
    assert pod.containers[1].gpus == ()
    # The client's hand-encoded request, read by the protobuf runtime.
    [(method, request)] = kubelet.asked
    assert (method, request.pod_name, request.pod_namespace) == ("Get", "vllm-0", "serving")


def test_get_reads_dra_gpus_by_driver(serve: Serve) -> None:
    client = PodResourcesClient(serve(kubelet_methods(Kubelet([gpu_pod(), dra_pod()]))))

    pod = client.get("ml", "dra-0")

    assert pod == DRA_POD
    assert pod.gpus == (DRA_GPU,)  # the NIC claim's CDI device is not a GPU


def test_list_returns_every_pod_in_the_kubelets_order(serve: Serve) -> None:
    kubelet = Kubelet([gpu_pod(), dra_pod()])
    client = PodResourcesClient(serve(kubelet_methods(kubelet)))

    assert client.list() == [GPU_POD, DRA_POD]
    assert [m for m, _ in kubelet.asked] == ["List"]


def test_get_falls_back_to_list_when_get_is_unimplemented(serve: Serve) -> None:
    kubelet = Kubelet([gpu_pod(), dra_pod()])
    client = PodResourcesClient(serve(kubelet_methods(kubelet, get=False)))

    assert client.get("ml", "dra-0") == DRA_POD
    assert client.get("serving", "vllm-0") == GPU_POD
    with pytest.raises(PodNotFoundError, match="no pod ml/absent"):
        client.get("ml", "absent")
    # The grpc server answered Get UNIMPLEMENTED before any handler ran; once is enough.
    assert [m for m, _ in kubelet.asked] == ["List", "List", "List"]


def test_get_falls_back_to_list_when_the_feature_gate_is_off(serve: Serve) -> None:
    kubelet = Kubelet([gpu_pod()])
    methods = kubelet_methods(kubelet)
    methods["Get"] = handler(kubelet.get_disabled, "GetPodResourcesRequest")
    client = PodResourcesClient(serve(methods))

    assert client.get("serving", "vllm-0") == GPU_POD
    assert client.get("serving", "vllm-0") == GPU_POD
    assert [m for m, _ in kubelet.asked] == ["Get", "List", "List"]


def test_a_pod_the_kubelet_does_not_run_is_not_found(serve: Serve) -> None:
    client = PodResourcesClient(serve(kubelet_methods(Kubelet([gpu_pod()]))))

    with pytest.raises(PodNotFoundError, match="no pod serving/vllm-1: it is on another node"):
        client.get("serving", "vllm-1")
    assert isinstance(PodNotFoundError("x"), PodResourcesError)
    assert isinstance(PodResourcesError("x"), ValueError)


def test_an_empty_name_is_refused_before_any_call(tmp_path: Path) -> None:
    with pytest.raises(PodResourcesError, match="needs a namespace and a name"):
        PodResourcesClient(str(tmp_path / "absent.sock")).get("ns", "")


# ------------------------------------------------------------ errors say what to change


def test_a_missing_socket_says_to_mount_the_pod_resources_dir(tmp_path: Path) -> None:
    path = tmp_path / "kubelet.sock"
    with pytest.raises(PodResourcesError) as e:
        PodResourcesClient(str(path)).list()
    message = str(e.value)
    assert f"no kubelet pod-resources socket at {path}" in message
    assert "mount the kubelet's pod-resources directory" in message
    assert "/var/lib/kubelet/pod-resources" in message


def test_a_path_that_is_not_a_socket_is_refused(tmp_path: Path) -> None:
    with pytest.raises(PodResourcesError, match="is not a socket: mount"):
        PodResourcesClient(str(tmp_path)).get("ns", "pod")


def test_a_socket_nobody_serves_asks_whether_the_kubelet_runs(tmp_path: Path) -> None:
    path = str(tmp_path / "stale.sock")
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(path)  # bound, never listening: what a stopped kubelet leaves behind
        with pytest.raises(PodResourcesError, match="is the kubelet running"):
            PodResourcesClient(path, timeout=2).list()


def test_a_socket_the_agent_may_not_write_says_run_as_root(
    serve: Serve, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = serve(kubelet_methods(Kubelet([])))
    # The suite runs as root, which may write anything: stand in for a non-root agent.
    monkeypatch.setattr(pod_resources.os, "access", lambda p, mode: False)
    with pytest.raises(PodResourcesError, match=r"may not connect to .*run the node agent as root"):
        PodResourcesClient(path).list()


def test_a_slow_kubelet_times_out_naming_the_timeout(serve: Serve) -> None:
    release = threading.Event()

    def stuck(request: Any, context: grpc.ServicerContext) -> Any:
        release.wait(10)
        return PB["ListPodResourcesResponse"]()

    path = serve({"List": handler(stuck, "ListPodResourcesRequest")})
    try:
        with pytest.raises(PodResourcesError, match=r"did not answer List .* within 0\.2s"):
            PodResourcesClient(path, timeout=0.2).list()
    finally:
        release.set()


def test_a_rate_limited_call_says_so(serve: Serve) -> None:
    def limited(request: Any, context: grpc.ServicerContext) -> Any:
        context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "rejected by rate limit")

    path = serve({"List": handler(limited, "ListPodResourcesRequest")})
    with pytest.raises(PodResourcesError, match="rate-limited List"):
        PodResourcesClient(path).list()


def test_an_answer_that_is_not_protobuf_is_refused(serve: Serve) -> None:
    def garbage(request: Any, context: grpc.ServicerContext) -> bytes:
        return b"\x0a\x05ab"  # field 1, 5 bytes long, 2 bytes there

    path = serve({"List": grpc.unary_unary_rpc_method_handler(garbage)})
    with pytest.raises(PodResourcesError, match="not the v1 PodResources message"):
        PodResourcesClient(path).list()


# ------------------------------------------------------------ golden bytes, by hand

# GetPodResourcesRequest{pod_name = 1: "p", pod_namespace = 2: "ns"}:
# key = number << 3 | 2 (length-delimited): 0x0a, 0x12.
GOLDEN_REQUEST = b"\x0a\x01p" + b"\x12\x02ns"

# GetPodResourcesResponse{pod_resources = 1: PodResources{name = 1: "p", namespace = 2: "n",
#   containers = 3: [ContainerResources{name = 1: "c",
#     devices = 2: [ContainerDevices{resource_name = 1: "a/gpu", device_ids = 2: ["g"]}],
#     cpu_ids = 3: [1, 2] (packed)}]}}
DEVICES = b"\x0a\x05a/gpu" + b"\x12\x01g"  # 10 bytes
CONTAINER = b"\x0a\x01c" + b"\x12\x0a" + DEVICES + b"\x1a\x02\x01\x02"  # 19 = 0x13
POD = b"\x0a\x01p" + b"\x12\x01n" + b"\x1a\x13" + CONTAINER  # 27 = 0x1b
GOLDEN_RESPONSE = b"\x0a\x1b" + POD
GOLDEN_POD = PodDevices("n", "p", (ContainerDevices("c", (Device("a/gpu", ("g",)),), ()),))


def test_the_request_encodes_to_the_golden_bytes() -> None:
    assert encode_get_request("ns", "p") == GOLDEN_REQUEST
    # The descriptor the fake kubelet uses agrees.
    request = PB["GetPodResourcesRequest"](pod_name="p", pod_namespace="ns")
    assert request.SerializeToString() == GOLDEN_REQUEST


def test_the_golden_response_decodes() -> None:
    pod = decode_get_response(GOLDEN_RESPONSE)
    assert pod == GOLDEN_POD
    assert pod.gpus == ("g",)
    # The descriptor the fake kubelet uses agrees.
    assert PB["GetPodResourcesResponse"].FromString(GOLDEN_RESPONSE).pod_resources.name == "p"
    assert decode_get_response(b"") is None


def test_unknown_fields_of_every_wire_type_are_skipped() -> None:
    # A newer kubelet may add fields: number 9 as varint, fixed64, length-delimited, fixed32.
    unknown = b"\x48\x96\x01" + b"\x49" + bytes(8) + b"\x4a\x02hi" + b"\x4d" + bytes(4)
    # Unpacked cpu_ids (key 0x18: field 3, varint) are valid on the wire too.
    container = CONTAINER + b"\x18\x07" + unknown
    pod = b"\x0a\x01p" + b"\x12\x01n" + b"\x1a" + bytes([len(container)]) + container + unknown
    assert decode_list_response(b"\x0a" + bytes([len(pod)]) + pod + unknown) == [GOLDEN_POD]


@pytest.mark.parametrize(
    "data",
    [
        b"\x0a",  # a key, then nothing
        b"\x08\x01",  # pod_resources as a varint
        b"\x0b",  # wire type 3 (a proto2 group)
        b"\x0a\x03\x0a\x01\xff",  # a pod name that is not UTF-8
        b"\x0a\x0b" + b"\xff" * 11,  # a varint longer than 10 bytes
    ],
    ids=["truncated", "wrong-wire-type", "group", "not-utf8", "long-varint"],
)
def test_malformed_bytes_raise_the_modules_error(data: bytes) -> None:
    with pytest.raises(PodResourcesError, match="not the v1 PodResources message"):
        decode_list_response(data)
