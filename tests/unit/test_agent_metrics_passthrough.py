"""vLLM's metrics appended to the agent's: only its own `vllm:` families."""

from rekindle_agent.serving.server import only_vllm_families

VLLM_TEXT = b"""# HELP python_gc_objects_collected_total Objects collected during gc
# TYPE python_gc_objects_collected_total counter
python_gc_objects_collected_total{generation="0"} 1234.0
# HELP process_cpu_seconds_total Total user and system CPU time spent in seconds.
# TYPE process_cpu_seconds_total counter
process_cpu_seconds_total 9.5
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 0.0
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="tiny"} 42.0
"""


def test_keeps_vllm_families_whole() -> None:
    out = only_vllm_families(VLLM_TEXT).decode()
    assert out.splitlines() == [
        "# HELP vllm:num_requests_running Number of requests in model execution batches.",
        "# TYPE vllm:num_requests_running gauge",
        'vllm:num_requests_running{engine="0",model_name="tiny"} 0.0',
        "# HELP vllm:prompt_tokens_total Number of prefill tokens processed.",
        "# TYPE vllm:prompt_tokens_total counter",
        'vllm:prompt_tokens_total{engine="0",model_name="tiny"} 42.0',
    ]


def test_nothing_from_vllm_is_nothing() -> None:
    assert only_vllm_families(b"") == b""
    assert only_vllm_families(b"# just a comment\n") == b""
