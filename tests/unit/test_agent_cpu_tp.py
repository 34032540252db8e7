"""vLLM's CPU tensor parallel: each rank's OpenMP threads get their own CPUs."""

from __future__ import annotations

import pytest
from rekindle_agent.supervision.vllm_launch import cpu_threads_bind, vllm_env


@pytest.mark.parametrize(
    ("cpus", "ranks", "want"),
    [
        ([0, 1], 2, "0|1"),
        ([3, 2, 1, 0], 2, "0,1|2,3"),
        ([0, 1, 2, 3, 4], 2, "0,1|2,3"),  # the left-over CPU stays free for the engine core
        ([0, 2, 4, 6, 8, 10], 3, "0,2|4,6|8,10"),
        ([0], 2, "nobind"),
    ],
)
def test_allowed_cpus_split_into_equal_groups(cpus: list[int], ranks: int, want: str) -> None:
    assert cpu_threads_bind(cpus, ranks) == want


def test_only_cpu_tensor_parallel_is_bound_and_a_user_value_wins() -> None:
    assert "VLLM_CPU_OMP_THREADS_BIND" not in vllm_env("cpu", base={})
    assert "VLLM_CPU_OMP_THREADS_BIND" not in vllm_env("cuda", base={}, tensor_parallel_size=2)
    bound = vllm_env("cpu", base={}, tensor_parallel_size=2)["VLLM_CPU_OMP_THREADS_BIND"]
    assert bound.count("|") == 1 or bound == "nobind"
    mine = {"VLLM_CPU_OMP_THREADS_BIND": "0-3|4-7"}
    assert (
        vllm_env("cpu", base=mine, tensor_parallel_size=2)["VLLM_CPU_OMP_THREADS_BIND"] == "0-3|4-7"
    )


def test_compile_caches_live_below_the_run_dir_unless_the_pod_says_otherwise() -> None:
    """What vLLM, Inductor, Triton and FlashInfer compile is mapped by the tree for good:
    below the run dir (the same path in every pod) a checkpoint carries it along."""
    env = vllm_env("cuda", base={}, run_dir="/run/rekindle")
    assert env["VLLM_CACHE_ROOT"] == "/run/rekindle/cache/vllm"
    assert env["TORCHINDUCTOR_CACHE_DIR"] == "/run/rekindle/cache/inductor"
    assert env["TRITON_CACHE_DIR"] == "/run/rekindle/cache/triton"
    assert env["FLASHINFER_WORKSPACE_BASE"] == "/run/rekindle/cache/flashinfer"
    shared = vllm_env("cuda", base={"TRITON_CACHE_DIR": "/shared/triton"}, run_dir="/r")
    assert shared["TRITON_CACHE_DIR"] == "/shared/triton"
    assert "VLLM_CACHE_ROOT" not in vllm_env("cuda", base={})  # no run dir: left alone


def test_cpu_runs_eager_unless_asked_to_compile_and_gpu_sleeps_either_way() -> None:
    from rekindle_contract.vllm_argv import VllmOptions, vllm_argv

    eager = vllm_argv(VllmOptions(model="/m", device="cpu"))
    assert "--enforce-eager" in eager and "--enable-sleep-mode" not in eager
    compiled = vllm_argv(VllmOptions(model="/m", device="cpu", cpu_compile=True))
    assert "--enforce-eager" not in compiled and "--enable-sleep-mode" not in compiled
    gpu = vllm_argv(VllmOptions(model="/m", device="cuda", cpu_compile=True))
    assert "--enforce-eager" not in gpu and "--enable-sleep-mode" in gpu


def test_eager_cpu_turns_dynamo_off_and_compiling_cpu_or_gpu_leave_it() -> None:
    """vLLM torch.compiles its sampler's logprob ranks even when eager; Inductor on CPU
    needs a C++ compiler the runtime image lacks, so eager CPU turns dynamo off."""
    assert vllm_env("cpu", base={})["TORCHDYNAMO_DISABLE"] == "1"
    assert "TORCHDYNAMO_DISABLE" not in vllm_env("cpu", base={}, cpu_compile=True)
    assert "TORCHDYNAMO_DISABLE" not in vllm_env("cuda", base={})
