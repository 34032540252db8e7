"""The embedded tiny model is reproducible: it is the oracle of every before/after test."""

from __future__ import annotations

import json
from pathlib import Path

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
