"""The size ladder: real architectures at 0.5B, 1.5B and 3B parameters with random weights.

A restore's cost grows with the model (weight reload, image size, page cache),
so the project measures it at the sizes users run, without downloading
anything: the shapes are those of Qwen2.5-0.5B, Qwen2.5-1.5B (Qwen2ForCausalLM)
and Llama-3.2-3B (LlamaForCausalLM), written here from their published configs;
the weights are seeded random bf16 values and the tokenizer is the tiny model's
locally trained one (rekindle_dev.models).

Generation is streaming: the safetensors headers are computed from the shapes
first, then each tensor is drawn from its own seeded generator and written
straight to its shard, so memory holds one tensor at a time and the files are
byte-identical for a given spec. The values are bf16 bit patterns with a random
sign and mantissa and a magnitude between 2**-8 and 2**-6 (about the scale of a
trained layer's weights), drawn as random 16-bit integers, which is twice as fast
as a normal distribution here. Norm weights are ones and biases zeros, as at
initialisation. The vocabulary keeps the published size (so the parameter count
is the real one); the embedding rows past the small tokenizer's vocabulary are
zero, so their logits are 0 and greedy decoding never picks an id the tokenizer
cannot decode.

Cached by content under $REKINDLE_CACHE/models/ (ladder-SIZE-KEY, KEY a hash of
the spec and GENERATOR_VERSION), like the SmolLM2 conversion.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import struct
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rekindle_dev.smollm2 import Progress, default_cache_root, print_progress

# Bump when the bytes written for the same spec change: part of the cache key.
GENERATOR_VERSION = 1
STAMP = "rekindle-ladder.json"
SHARD_BYTES = 2 << 30  # at most this much tensor data per safetensors file
TOKENIZER_VOCAB = 2048  # the locally trained BPE's target size (models.py's trainer)
_BLOCK = 32 << 20  # elements drawn per step: bounds the generator's temporary memory


@dataclass(frozen=True)
class LadderSpec:
    """One rung: a published architecture's shape (config.json values) and a seed."""

    name: str
    nominal_params: float  # the size it is known by, in parameters
    architecture: str  # HF class name in config.json
    model_type: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    tie_word_embeddings: bool
    attention_bias: bool  # Qwen2 has q/k/v biases; Llama has none
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False)
    seed: int = 0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


# Shapes from the models' published config.json files (Qwen2.5: Qwen/Qwen2.5-0.5B
# and -1.5B; Llama 3.2: meta-llama/Llama-3.2-3B), values only.
SIZES: dict[str, LadderSpec] = {
    "0.5b": LadderSpec(
        name="qwen2.5-0.5b-shape",
        nominal_params=0.5e9,
        architecture="Qwen2ForCausalLM",
        model_type="qwen2",
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        vocab_size=151936,
        tie_word_embeddings=True,
        attention_bias=True,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        max_position_embeddings=32768,
    ),
    "1.5b": LadderSpec(
        name="qwen2.5-1.5b-shape",
        nominal_params=1.5e9,
        architecture="Qwen2ForCausalLM",
        model_type="qwen2",
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        vocab_size=151936,
        tie_word_embeddings=True,
        attention_bias=True,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        max_position_embeddings=32768,
    ),
    "3b": LadderSpec(
        name="llama3.2-3b-shape",
        nominal_params=3.0e9,
        architecture="LlamaForCausalLM",
        model_type="llama",
        hidden_size=3072,
        intermediate_size=8192,
        num_hidden_layers=28,
        num_attention_heads=24,
        num_key_value_heads=8,
        vocab_size=128256,
        tie_word_embeddings=True,
        attention_bias=False,
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
        max_position_embeddings=131072,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    ),
}


def spec_for(size: str) -> LadderSpec:
    """The rung named size ('0.5b', '1.5b', '3b'); a clear error otherwise."""
    try:
        return SIZES[size.lower()]
    except KeyError:
        raise ValueError(
            f"unknown ladder size {size!r}: choose one of {', '.join(SIZES)}"
        ) from None


def tensor_shapes(spec: LadderSpec) -> dict[str, tuple[int, ...]]:
    """Every tensor the HF checkpoint of this architecture holds, with its shape, in order."""
    h, kv = spec.hidden_size, spec.num_key_value_heads * spec.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (spec.vocab_size, h)}
    for i in range(spec.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        for proj, rows in (("q_proj", h), ("k_proj", kv), ("v_proj", kv)):
            shapes[p + f"self_attn.{proj}.weight"] = (rows, h)
            if spec.attention_bias:
                shapes[p + f"self_attn.{proj}.bias"] = (rows,)
        shapes[p + "self_attn.o_proj.weight"] = (h, h)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        shapes[p + "mlp.gate_proj.weight"] = (spec.intermediate_size, h)
        shapes[p + "mlp.up_proj.weight"] = (spec.intermediate_size, h)
        shapes[p + "mlp.down_proj.weight"] = (h, spec.intermediate_size)
    shapes["model.norm.weight"] = (h,)
    if not spec.tie_word_embeddings:
        shapes["lm_head.weight"] = (spec.vocab_size, h)
    return shapes


def param_count(spec: LadderSpec) -> int:
    """Parameters of the model (a tied output head counted once, as published sizes do)."""
    total = 0
    for shape in tensor_shapes(spec).values():
        n = 1
        for d in shape:
            n *= d
        total += n
    return total


def cache_key(spec: LadderSpec) -> str:
    """The cache directory's name: the size and a hash of everything that decides the bytes."""
    doc = json.dumps(
        {"spec": asdict(spec), "generator": GENERATOR_VERSION, "tok": TOKENIZER_VOCAB},
        sort_keys=True,
    )
    digest = hashlib.sha256(doc.encode()).hexdigest()[:16]
    size = next((k for k, v in SIZES.items() if v == spec), spec.name)
    return f"ladder-{size}-{digest}"


def plan_shards(
    shapes: dict[str, tuple[int, ...]], max_bytes: int = SHARD_BYTES
) -> list[list[str]]:
    """Tensor names per shard, in order, each shard at most max_bytes (one tensor at least)."""
    shards: list[list[str]] = [[]]
    used = 0
    for name, shape in shapes.items():
        nbytes = 2 * _numel(shape)
        if shards[-1] and used + nbytes > max_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += nbytes
    return shards


def safetensors_header(names: list[str], shapes: dict[str, tuple[int, ...]]) -> bytes:
    """The safetensors header (length prefix + JSON) for bf16 tensors laid out in order.

    Format: 8-byte little-endian header length, then the JSON header padded with
    spaces to a multiple of 8, then the tensors' bytes back to back.
    """
    meta: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name in names:
        nbytes = 2 * _numel(shapes[name])
        meta[name] = {
            "dtype": "BF16",
            "shape": list(shapes[name]),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    text = json.dumps(meta, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _tensor_seed(spec: LadderSpec, name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{spec.seed}:{name}".encode()).digest()[:8], "little")


def _random_bf16_blocks(seed: int, numel: int) -> Iterator[bytes]:
    """numel bf16 values (random sign and mantissa, magnitude in [2**-8, 2**-6)), in blocks."""
    import numpy as np

    rng = np.random.Generator(np.random.PCG64(seed))
    left = numel
    while left:
        n = min(left, _BLOCK)
        bits = rng.integers(0, 1 << 16, size=n, dtype=np.uint16)
        exponent = ((bits >> 7) & 1) + 119  # 2**-8 or 2**-7 times 1.mantissa
        yield ((bits & 0x807F) | (exponent.astype(np.uint16) << 7)).astype("<u2").tobytes()
        left -= n


def _tensor_bytes(
    spec: LadderSpec, name: str, shape: tuple[int, ...], vocab: int
) -> Iterator[bytes]:
    """The bytes of one tensor: ones for norms, zeros for biases, seeded random otherwise."""
    numel = _numel(shape)
    if name.endswith("norm.weight"):
        yield struct.pack("<H", 0x3F80) * numel  # bf16 1.0
    elif name.endswith(".bias"):
        yield bytes(2 * numel)
    elif name in ("model.embed_tokens.weight", "lm_head.weight"):
        used = min(vocab, shape[0]) * shape[1]  # rows the tokenizer can produce
        yield from _random_bf16_blocks(_tensor_seed(spec, name), used)
        rest = numel - used
        while rest:
            n = min(rest, _BLOCK)
            yield bytes(2 * n)
            rest -= n
    else:
        yield from _random_bf16_blocks(_tensor_seed(spec, name), numel)


def hf_config(spec: LadderSpec, bos: int, eos: int) -> dict[str, Any]:
    """config.json for vLLM and transformers."""
    cfg: dict[str, Any] = {
        "architectures": [spec.architecture],
        "model_type": spec.model_type,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_hidden_layers,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_key_value_heads,
        "head_dim": spec.head_dim,
        "vocab_size": spec.vocab_size,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "rope_theta": spec.rope_theta,
        "rms_norm_eps": spec.rms_norm_eps,
        "max_position_embeddings": spec.max_position_embeddings,
        "hidden_act": "silu",
        "initializer_range": 0.02,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "dtype": "bfloat16",
        "use_cache": True,
    }
    if spec.model_type == "llama":
        cfg["attention_bias"] = spec.attention_bias
        cfg["mlp_bias"] = False
    else:
        cfg["use_sliding_window"] = False
        cfg["max_window_layers"] = spec.num_hidden_layers
    if spec.rope_scaling:
        cfg["rope_scaling"] = dict(spec.rope_scaling)
    return cfg


def _write_tokenizer(out: Path) -> tuple[int, int, int]:
    """The tiny model's tokenizer (trained here, no download); (bos, eos, its vocabulary size)."""
    from transformers import PreTrainedTokenizerFast

    from rekindle_dev.models import CHAT_TEMPLATE, TinyModelSpec, _train_tokenizer

    raw = _train_tokenizer(TinyModelSpec(vocab_size=TOKENIZER_VOCAB))
    tok = PreTrainedTokenizerFast(
        tokenizer_object=raw, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="</s>"
    )
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(out)
    return int(tok.bos_token_id), int(tok.eos_token_id), len(tok)


def write_shards(
    spec: LadderSpec, out: Path, vocab: int, progress: Progress, max_bytes: int = SHARD_BYTES
) -> dict[str, str]:
    """The safetensors files (and their index when there are several); tensor name -> file."""
    shapes = tensor_shapes(spec)
    shards = plan_shards(shapes, max_bytes)
    weight_map: dict[str, str] = {}
    t0 = time.monotonic()
    written = 0
    for i, names in enumerate(shards, 1):
        fname = (
            "model.safetensors"
            if len(shards) == 1
            else f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        )
        with (out / fname).open("wb") as f:
            f.write(safetensors_header(names, shapes))
            for name in names:
                for chunk in _tensor_bytes(spec, name, shapes[name], vocab):
                    f.write(chunk)
                written += 2 * _numel(shapes[name])
                weight_map[name] = fname
        progress(f"{fname}: {written / 1e9:.2f} GB written, {time.monotonic() - t0:.0f} s")
    if len(shards) > 1:
        index = {"metadata": {"total_size": written}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return weight_map


def write_model(spec: LadderSpec, out: Path, progress: Progress) -> None:
    """Write the model's files into the (empty) directory out."""
    bos, eos, vocab = _write_tokenizer(out)
    write_shards(spec, out, vocab, progress)
    (out / "config.json").write_text(
        json.dumps(hf_config(spec, bos, eos), indent=2, sort_keys=True) + "\n"
    )
    gen = {"bos_token_id": bos, "eos_token_id": eos, "do_sample": False, "temperature": 0.0}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2, sort_keys=True) + "\n")


def _stamp(spec: LadderSpec) -> dict[str, Any]:
    return {"spec": asdict(spec), "generator": GENERATOR_VERSION, "params": param_count(spec)}


def _is_built(path: Path, spec: LadderSpec) -> bool:
    stamp = path / STAMP
    return stamp.is_file() and bool(json.loads(stamp.read_text()) == _stamp(spec))


def generate_ladder_model(
    size: str, cache_root: Path | None = None, progress: Progress | None = None
) -> Path:
    """The ladder model of this size in the cache (written once per cache_key()); its directory.

    Written in a private directory and renamed into place, so a concurrent run
    never sees half a model.
    """
    say = progress or print_progress
    spec = spec_for(size)
    root = (cache_root or default_cache_root()) / "models"
    final = root / cache_key(spec)
    if _is_built(final, spec):
        return final
    root.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(dir=root, prefix=f".{final.name}-"))
    try:
        say(f"writing {spec.name} ({param_count(spec) / 1e9:.2f}B parameters, bf16) in {final}")
        write_model(spec, work, say)
        work.chmod(0o755)  # mkdtemp made it private; the model is not secret
        (work / STAMP).write_text(json.dumps(_stamp(spec), indent=2, sort_keys=True) + "\n")
        if not _is_built(final, spec):  # another run may have finished first: keep its files
            shutil.rmtree(final, ignore_errors=True)
            work.rename(final)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return final
