"""The image's seed of vLLM's model info cache reaches a new pod's cache root, and
never replaces what vLLM wrote there itself."""

from __future__ import annotations

from pathlib import Path

from rekindle_agent.supervision import modelinfo_seed
from rekindle_agent.supervision.vllm_launch import cache_env


def _seed(tmp_path: Path) -> Path:
    seed = tmp_path / "seed"
    seed.mkdir()
    (seed / "vllm-model_executor-models-llama-LlamaForCausalLM.json").write_text('{"hash": "a"}')
    (seed / "vllm-model_executor-models-qwen2-Qwen2ForCausalLM.json").write_text('{"hash": "b"}')
    (seed / "README").write_text("not a cache file")
    return seed


def test_the_seed_lands_in_the_pods_vllm_cache_root(tmp_path: Path) -> None:
    env = {**cache_env(str(tmp_path / "run")), modelinfo_seed.SEED_ENV: str(_seed(tmp_path))}
    copied = modelinfo_seed.install(env)
    assert copied == [
        "vllm-model_executor-models-llama-LlamaForCausalLM.json",
        "vllm-model_executor-models-qwen2-Qwen2ForCausalLM.json",
    ]
    dest = tmp_path / "run" / "cache" / "vllm" / "modelinfos"
    assert sorted(p.name for p in dest.iterdir()) == copied
    assert (dest / copied[0]).read_text() == '{"hash": "a"}'


def test_what_vllm_already_cached_is_kept(tmp_path: Path) -> None:
    env = {**cache_env(str(tmp_path / "run")), modelinfo_seed.SEED_ENV: str(_seed(tmp_path))}
    dest = tmp_path / "run" / "cache" / "vllm" / "modelinfos"
    dest.mkdir(parents=True)
    own = dest / "vllm-model_executor-models-llama-LlamaForCausalLM.json"
    own.write_text('{"hash": "vllm wrote this"}')
    assert modelinfo_seed.install(env) == ["vllm-model_executor-models-qwen2-Qwen2ForCausalLM.json"]
    assert own.read_text() == '{"hash": "vllm wrote this"}'


def test_no_seed_or_no_cache_root_changes_nothing(tmp_path: Path) -> None:
    run = tmp_path / "run"
    assert (
        modelinfo_seed.install(
            {**cache_env(str(run)), modelinfo_seed.SEED_ENV: str(tmp_path / "none")}
        )
        == []
    )
    assert not run.exists()
    assert modelinfo_seed.install({modelinfo_seed.SEED_ENV: str(_seed(tmp_path))}) == []


def test_an_unwritable_cache_root_costs_only_the_time(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    env = {"VLLM_CACHE_ROOT": str(blocker / "vllm"), modelinfo_seed.SEED_ENV: str(_seed(tmp_path))}
    assert modelinfo_seed.install(env) == []
