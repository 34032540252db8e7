"""The generated tiny vision-language model: what vLLM and the agent read from it.

The agent keeps the shm multimodal cache only for a model whose config.json
says it takes images (keep_mm_cache under the operator's auto setting), so the
generated config must be recognised as one; vLLM needs the processor files to
turn an image into placeholder tokens; a second generation must not rewrite
anything (the model digest is part of a checkpoint's fingerprint).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from rekindle_agent.supervision.vllm_launch import keep_mm_cache
from rekindle_contract.vllm_argv import MM_AUTO_ENV, takes_images
from rekindle_dev.models import model_digest
from rekindle_dev.vlm import IMAGE_TOKEN, TinyVlmSpec, generate_tiny_vlm


@pytest.fixture(scope="module")
def vlm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return generate_tiny_vlm(tmp_path_factory.mktemp("vlm") / "tiny-vlm")


def test_config_is_a_vision_model_for_the_agent(vlm: Path) -> None:
    config = json.loads((vlm / "config.json").read_text())
    assert config["architectures"] == ["LlavaForConditionalGeneration"]
    assert config["vision_config"]["model_type"] == "clip_vision_model"
    assert takes_images(config)
    assert keep_mm_cache(str(vlm), {MM_AUTO_ENV: "1"})


def test_files_vllm_reads_are_present(vlm: Path) -> None:
    for name in (
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "processor_config.json",
        "chat_template.jinja",
    ):
        assert (vlm / name).is_file(), name


def test_vision_weights_use_the_published_llava_layout(vlm: Path) -> None:
    """vLLM's LLaVA loader expects `vision_tower.vision_model.*` (else it refuses to load)."""
    from safetensors import safe_open

    with safe_open(str(vlm / "model.safetensors"), "pt") as f:
        keys = list(f.keys())
    vision = [k for k in keys if k.startswith("vision_tower.")]
    assert vision and all(k.startswith("vision_tower.vision_model.") for k in vision)
    assert any(k.startswith("language_model.") for k in keys)
    assert any(k.startswith("multi_modal_projector.") for k in keys)


def test_processor_expands_an_image_to_its_patch_tokens(vlm: Path) -> None:
    from PIL import Image
    from transformers import AutoProcessor

    spec = TinyVlmSpec()
    proc = AutoProcessor.from_pretrained(str(vlm))
    config = json.loads((vlm / "config.json").read_text())
    messages = [
        {
            "role": "user",
            "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}],
        }
    ]
    prompt = proc.apply_chat_template(messages, add_generation_prompt=True)
    assert prompt.count(IMAGE_TOKEN) == 1 and prompt.endswith("<|assistant|>\n")
    out = proc(text=prompt, images=Image.new("RGB", (40, 30), (200, 10, 10)), return_tensors="pt")
    assert tuple(out["pixel_values"].shape) == (1, 3, spec.image_size, spec.image_size)
    image_id = config["image_token_index"]
    assert int((out["input_ids"] == image_id).sum()) == spec.image_tokens == 64


def test_generation_is_idempotent(vlm: Path) -> None:
    before = model_digest(vlm)
    mtimes = {p.name: p.stat().st_mtime_ns for p in vlm.iterdir()}
    assert generate_tiny_vlm(vlm) == vlm
    assert model_digest(vlm) == before
    assert {p.name: p.stat().st_mtime_ns for p in vlm.iterdir()} == mtimes


def test_bad_shapes_are_refused_with_what_to_change(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not a multiple of patch_size"):
        generate_tiny_vlm(tmp_path / "m", TinyVlmSpec(image_size=100, patch_size=14))
    assert not (tmp_path / "m").exists()
