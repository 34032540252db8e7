"""The front: one small always-on HTTP front shared by every autoscaled
InferenceService, the piece that makes scale-from-zero answer instead of refuse.

Clients send `/<namespace>/<service>/v1/...` to it. With a Ready replica the
request goes straight to one (the one the front has the fewest requests in
flight to), through the agent's own relay; with none it is held until a
replica is Ready (KEDA saw the held request on /load and scaled the service
from zero), or answered 503 with Retry-After at --hold-timeout.

`GET /load/<namespace>/<service>` is the autoscaler's metric source: vLLM's
own queue (running and waiting requests, read from each Ready replica's serve
port GET /get_load, which needs no API key) plus the requests the front holds. The front reads only
EndpointSlices and InferenceServices from the Kubernetes API, and holds no
secret: the API key, where a service has one, is checked by its agent.

Modules, top down: cli (entry point), server (aiohttp app: hold, forward,
load), kube (the two reads from the API), load (the replicas' queues to /load).
"""
