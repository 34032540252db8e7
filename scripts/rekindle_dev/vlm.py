"""The embedded tiny vision-language model: a seeded random-weight LLaVA (CLIP + Llama).

Half of why Rekindle sizes /dev/shm is vLLM's shared-memory multimodal
processor cache, and only a model that takes images ever writes to it. Tests
and benchmarks need such a model without a model hub: this one is generated
here, with the tiny model's locally trained tokenizer plus an `<image>` token,
a CLIP vision tower, a Llama text model, and a processor configuration written
locally. Its answers are noise, but greedy decoding of fixed weights is
deterministic, which is the oracle the tests compare.

The image side is sized for tests: `image_size / patch_size` squared patches
become the image's placeholder tokens (64 by default), while the processed
pixel tensor that vLLM puts in the shm cache is 3 x image_size^2 values in
the model's dtype, bf16 (294 KiB at 224 px). Larger images with larger
patches keep the token count and grow the cache's share: a test that must
fill a cache quickly uses TinyVlmSpec(image_size=896, patch_size=112).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from rekindle_dev.models import TinyModelSpec, _train_tokenizer

if TYPE_CHECKING:
    from transformers import LlavaConfig, LlavaProcessor, PreTrainedTokenizerFast

IMAGE_TOKEN = "<image>"
STAMP = "rekindle-tiny-vlm.json"

# Renders string contents as they are and OpenAI-style content lists part by
# part, an image part becoming the `<image>` placeholder where the user put it
# (vLLM then replaces it by the image's patch tokens).
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n"
    "{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for part in m['content'] %}"
    "{% if part['type'] == 'image' or part['type'] == 'image_url' %}" + IMAGE_TOKEN + "\n"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


@dataclass(frozen=True)
class TinyVlmSpec:
    """Shape of the generated model; the defaults load in vLLM CPU in seconds.

    image_size must be a multiple of patch_size; each image becomes
    (image_size // patch_size) ** 2 placeholder tokens.
    """

    hidden_size: int = 256
    intermediate_size: int = 688
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    vocab_size: int = 2048
    max_position_embeddings: int = 2048
    vision_hidden_size: int = 128
    vision_intermediate_size: int = 256
    vision_layers: int = 2
    vision_heads: int = 2
    image_size: int = 224
    patch_size: int = 28
    seed: int = 0

    @property
    def image_tokens(self) -> int:
        """Placeholder tokens per image (the CLS token is dropped: strategy 'default')."""
        return (self.image_size // self.patch_size) ** 2

    def check(self) -> None:
        """Refuse shapes CLIP or vLLM cannot build, saying what to change."""
        if self.image_size % self.patch_size:
            raise ValueError(
                f"image_size {self.image_size} is not a multiple of patch_size "
                f"{self.patch_size}: pick sizes that divide"
            )
        if self.vision_hidden_size % self.vision_heads:
            raise ValueError(
                f"vision_hidden_size {self.vision_hidden_size} is not divisible by "
                f"vision_heads {self.vision_heads}"
            )


def _tokenizer(spec: TinyVlmSpec) -> PreTrainedTokenizerFast:
    """The tiny model's tokenizer (same corpus and seed) with `<image>` as a special token."""
    from transformers import PreTrainedTokenizerFast

    text = TinyModelSpec(vocab_size=spec.vocab_size, seed=spec.seed)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=_train_tokenizer(text),
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="</s>",
    )
    tok.add_tokens([IMAGE_TOKEN], special_tokens=True)
    tok.chat_template = CHAT_TEMPLATE
    return tok


def _config(spec: TinyVlmSpec, tok: PreTrainedTokenizerFast) -> LlavaConfig:
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig

    image_token_id = tok.convert_tokens_to_ids(IMAGE_TOKEN)
    text = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        tie_word_embeddings=False,
    )
    vision = CLIPVisionConfig(
        hidden_size=spec.vision_hidden_size,
        intermediate_size=spec.vision_intermediate_size,
        num_hidden_layers=spec.vision_layers,
        num_attention_heads=spec.vision_heads,
        image_size=spec.image_size,
        patch_size=spec.patch_size,
        projection_dim=spec.vision_hidden_size,
    )
    config = LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=image_token_id,
        vision_feature_select_strategy="default",
        vision_feature_layer=-1,
        projector_hidden_act="gelu",
        image_seq_length=spec.image_tokens,
        tie_word_embeddings=False,
        dtype="bfloat16",
    )
    # As the tiny model: a wider init than HF's 0.02 makes greedy outputs vary
    # with the prompt (and the image), so comparisons are meaningful.
    config.initializer_range = 0.2
    config.text_config.initializer_range = 0.2
    return config


def _processor(spec: TinyVlmSpec, tok: PreTrainedTokenizerFast) -> LlavaProcessor:
    from transformers import CLIPImageProcessor, LlavaProcessor

    images = CLIPImageProcessor(
        size={"shortest_edge": spec.image_size},
        crop_size={"height": spec.image_size, "width": spec.image_size},
        do_resize=True,
        do_center_crop=True,
        do_normalize=True,
        do_convert_rgb=True,
    )
    return LlavaProcessor(
        image_processor=images,
        tokenizer=tok,
        patch_size=spec.patch_size,
        vision_feature_select_strategy="default",
        chat_template=CHAT_TEMPLATE,
        image_token=IMAGE_TOKEN,
        num_additional_image_tokens=1,  # CLIP's CLS token, which "default" drops
    )


def _canonical_vision_keys(weights: Path) -> None:
    """Rename the vision tower's tensors to the layout published LLaVA checkpoints use.

    transformers 5 writes them as `vision_tower.<module>`; vLLM's LLaVA loader
    expects the CLIP model's own prefix, `vision_tower.vision_model.<module>`.
    """
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(weights))
    renamed = {
        (
            "vision_tower.vision_model." + k.removeprefix("vision_tower.")
            if k.startswith("vision_tower.") and not k.startswith("vision_tower.vision_model.")
            else k
        ): v
        for k, v in tensors.items()
    }
    save_file(renamed, str(weights), metadata={"format": "pt"})


def generate_tiny_vlm(out_dir: Path, spec: TinyVlmSpec | None = None) -> Path:
    """Write a loadable HF-format LLaVA (config, safetensors, tokenizer, processor) into out_dir.

    Idempotent: an existing directory generated from the same spec is kept, so
    its content hash (a checkpoint's model fingerprint) stays stable.
    """
    import torch
    from transformers import LlavaForConditionalGeneration

    spec = spec or TinyVlmSpec()
    spec.check()
    out_dir = Path(out_dir)
    stamp = out_dir / STAMP
    if stamp.exists() and json.loads(stamp.read_text()) == asdict(spec):
        return out_dir
    out_dir.mkdir(parents=True, exist_ok=True)

    tok = _tokenizer(spec)
    _processor(spec, tok).save_pretrained(out_dir)
    config = _config(spec, tok)
    torch.manual_seed(spec.seed)
    model = LlavaForConditionalGeneration(config).bfloat16()
    model.save_pretrained(out_dir, safe_serialization=True)
    _canonical_vision_keys(out_dir / "model.safetensors")
    stamp.write_text(json.dumps(asdict(spec), sort_keys=True))
    return out_dir
