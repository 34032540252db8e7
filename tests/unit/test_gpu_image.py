"""The GPU runtime image's structure (images/runtime-gpu): pinned bases, CRIU through the same
build script and patches as the CPU image, the CUDA plugin where the operator points the agent,
cuda-checkpoint and vmtouch installed, the agent as entrypoint, and who runs as root and why.

No registry or GPU is reachable here, so the image is never built by the tests; these read the
Dockerfile (and the local root-filesystem build) as the instructions a builder would follow.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from rekindle_agent.checkpointing import gpu_preflight
from rekindle_contract.agent_args import AGENT_COMMAND, CUDA_PLUGIN_DIR, defaults
from rekindle_contract.pod import CRIU_ENV

REPO = Path(__file__).resolve().parents[2]
GPU = REPO / "images" / "runtime-gpu"
DIGEST = re.compile(r"@sha256:[0-9a-f]{64}$")


@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def all(self, op: str) -> list[str]:
        return [arg for o, arg in self.instructions if o == op]

    def runs(self) -> str:
        return "\n".join(self.all("RUN"))


def parse(text: str) -> tuple[dict[str, str], list[Stage]]:
    """(global ARG defaults, stages) of a Dockerfile: continuations joined, comments dropped."""
    lines: list[str] = []
    cur = ""
    for raw in text.splitlines():
        s = raw.strip()
        if not s or (s.startswith("#") and not cur):
            continue
        if s.startswith("#"):
            continue
        if s.endswith("\\"):
            cur += s[:-1] + " "
            continue
        lines.append(cur + s)
        cur = ""
    args: dict[str, str] = {}
    stages: list[Stage] = []
    for line in lines:
        op, _, rest = line.partition(" ")
        op = op.upper()
        if op == "FROM":
            parts = rest.split()
            name = parts[2] if len(parts) == 3 and parts[1].upper() == "AS" else None
            stages.append(Stage(parts[0], name))
        elif op == "ARG" and not stages:
            k, _, v = rest.partition("=")
            args[k] = v
        else:
            stages[-1].instructions.append((op, rest))
    return args, stages


@pytest.fixture(scope="module")
def dockerfile() -> tuple[dict[str, str], list[Stage]]:
    return parse((GPU / "Dockerfile").read_text())


def resolve(base: str, args: dict[str, str]) -> str:
    return re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], base)


def test_every_base_is_the_official_vllm_image_pinned_by_digest(
    dockerfile: tuple[dict[str, str], list[Stage]],
) -> None:
    args, stages = dockerfile
    names = {s.name for s in stages if s.name}
    assert re.fullmatch(r"vllm/vllm-openai:v\d+\.\d+\.\d+@sha256:[0-9a-f]{64}", args["VLLM_IMAGE"])
    for s in stages:
        if s.base in names:
            continue
        assert DIGEST.search(resolve(s.base, args)), f"unpinned base {s.base}"
    assert stages[-1].name is None  # the last stage is the image


def test_rootfs_build_uses_the_dockerfiles_vllm_version(
    dockerfile: tuple[dict[str, str], list[Stage]],
) -> None:
    args, _ = dockerfile
    version = re.search(r":v([\d.]+)@", args["VLLM_IMAGE"])
    assert version
    script = (GPU / "build-rootfs").read_text()
    # the script reads the version back out of the Dockerfile's ARG line
    pattern = re.search(r"sed -n 's\|(.*)\|\\1\|p'", script)
    assert pattern, "build-rootfs no longer reads VLLM_IMAGE's version"
    sed_re = pattern.group(1).replace(r"\(", "(").replace(r"\)", ")")
    line = next(
        ln for ln in (GPU / "Dockerfile").read_text().splitlines() if "ARG VLLM_IMAGE=" in ln
    )
    m = re.match(sed_re, line)
    assert m and m.group(1) == version.group(1)
    assert "vllm==$VLLM_GPU_VERSION" in script


def test_criu_is_built_by_the_same_script_with_the_patches(
    dockerfile: tuple[dict[str, str], list[Stage]],
) -> None:
    _, stages = dockerfile
    (builder,) = [s for s in stages if s.name == "criu-builder"]
    copies = builder.all("COPY")
    assert "scripts/build-criu /src/scripts/build-criu" in copies
    assert "criu-patches/ /src/criu-patches/" in copies
    assert "scripts/lib/ /src/scripts/lib/" in copies
    assert "/src/scripts/build-criu" in builder.runs()
    # the CPU image gets its CRIU from the same script
    assert 'scripts/build-criu"' in (REPO / "images/runtime/build").read_text()
    assert "scripts/build-criu" in (GPU / "build-rootfs").read_text()
    # the script applies every criu-patches/*.patch and checks the tarball's sha256
    build = (REPO / "scripts/build-criu").read_text()
    assert 'PATCHES=("$PATCH_DIR"/*.patch)' in build and "CRIU_SHA256=" in build
    assert list((REPO / "criu-patches").glob("*.patch")), "no patches to apply"


def test_the_cuda_plugin_is_where_the_operator_points_the_agent(
    dockerfile: tuple[dict[str, str], list[Stage]],
) -> None:
    _, stages = dockerfile
    final = stages[-1]
    assert "--from=criu-builder /opt/criu/ /opt/criu/" in final.all("COPY")
    assert f"test -f {CUDA_PLUGIN_DIR}/cuda_plugin.so" in final.runs()
    assert f"test -f {CUDA_PLUGIN_DIR}/cuda_plugin.so" in stages[0].runs()
    # build-criu promises the plugin in every prefix it hands out
    assert (
        '[ -f "$PREFIX/patched/plugins/cuda_plugin.so" ]'
        in (REPO / "scripts/build-criu").read_text()
    )
    env = " ".join(final.all("ENV"))
    assert f"{CRIU_ENV}=/opt/criu/patched/criu" in env


def test_cuda_checkpoint_is_pinned_checked_and_on_path(
    dockerfile: tuple[dict[str, str], list[Stage]],
) -> None:
    args, stages = dockerfile
    assert re.fullmatch(r"[0-9a-f]{40}", args["CUDA_CHECKPOINT_COMMIT"])
    (cc,) = [s for s in stages if s.name == "cuda-checkpoint"]
    run = cc.runs()
    assert "github" in run and "NVIDIA/cuda-checkpoint/${CUDA_CHECKPOINT_COMMIT}/" in run
    assert "sha256sum -c" in run
    assert 'test "$CUDA_CHECKPOINT_SHA256" != UNSET' in run  # no unchecked download
    final = stages[-1]
    assert "--from=cuda-checkpoint /cuda-checkpoint /usr/local/bin/cuda-checkpoint" in final.all(
        "COPY"
    )
    # Checked as a file (its sha256 above, then executable and ELF), never run: a build
    # host has no libcuda, and `cuda-checkpoint --help` needs one.
    assert "cuda-checkpoint --help" not in final.runs()
    assert "test -x /usr/local/bin/cuda-checkpoint" in final.runs()
    assert "b'\\x7fELF'" in final.runs()
    assert defaults()["cuda_checkpoint"] == "cuda-checkpoint"  # found on PATH


def test_vmtouch_and_criu_libraries_are_installed(
    dockerfile: tuple[dict[str, str], list[Stage]],
) -> None:
    final = dockerfile[1][-1].runs()
    for pkg in ("vmtouch", "libprotobuf-c1", "libnl-3-200", "libnet1", "libnftables1"):
        assert re.search(rf"\b{re.escape(pkg)}\b", final), pkg
    assert "command -v vmtouch" in final
    assert "vmtouch" in (GPU / "build-rootfs").read_text()


def test_entrypoint_is_the_installed_agent(
    dockerfile: tuple[dict[str, str], list[Stage]],
) -> None:
    final = dockerfile[1][-1]
    (entry,) = final.all("ENTRYPOINT")
    argv = json.loads(entry)
    assert Path(argv[0]).name == AGENT_COMMAND[0] and argv[1:] == list(AGENT_COMMAND[1:])
    run = final.runs()
    assert "pip install --no-cache-dir /tmp/wheels/rekindle_vllm-*.whl" in run
    assert "import rekindle_agent.agent" in run
    assert "rm -rf" in run and "rekindle_operator" in run  # the operator does not ship here


def test_root_only_where_criu_needs_it(dockerfile: tuple[dict[str, str], list[Stage]]) -> None:
    _, stages = dockerfile
    (wheel,) = [s for s in stages if s.name == "wheel"]
    assert wheel.all("USER")[-1] == "65532:65532"
    final = stages[-1]
    assert final.all("USER")[-1] == "0:0"
    text = (GPU / "Dockerfile").read_text()
    why = text[text.index("# Root, and the pod must be privileged") : text.index("USER 0:0")]
    for reason in ("CAP_SYS_ADMIN", "ptrace", "ns_last_pid", "/dev/nvidia"):
        assert reason in why


def test_rootfs_target_is_outside_ci() -> None:
    make = (REPO / "Makefile").read_text()
    assert re.search(r"^image-gpu-rootfs:.*\n\timages/runtime-gpu/build-rootfs$", make, re.M)
    test_line = next(ln for ln in make.splitlines() if ln.startswith("test:"))
    assert "image-gpu-rootfs" not in test_line
    script = GPU / "build-rootfs"
    assert script.stat().st_mode & 0o111
    cfg = re.search(r'"Entrypoint": (\[.*?\])', script.read_text())
    assert cfg and json.loads(cfg.group(1)) == ["/usr/local/bin/rekindle", "agent"]


def test_parser_sees_continuations() -> None:
    args, stages = parse("ARG A=x@sha256:" + "0" * 64 + "\nFROM ${A} AS b\nRUN a \\\n  && b\n")
    assert stages[0].runs().split() == ["a", "&&", "b"] and stages[0].name == "b"
    assert DIGEST.search(resolve(stages[0].base, args))


def test_a_built_root_filesystem_has_every_part() -> None:
    """What `make image-gpu-rootfs` produced.

    The one documented skip of the unit suite: the root filesystem is GBs of CUDA
    wheels that only `make image-gpu-rootfs` builds (never `make test`), and that
    target runs this test right after the build with REKINDLE_GPU_ROOTFS_BUILT=1,
    where a missing build fails.
    """
    import os

    cache = Path(os.environ.get("REKINDLE_CACHE", Path.home() / ".cache" / "rekindle"))
    built = sorted(
        (p for p in (cache / "runtime-gpu-image").glob("rootfs-*") if (p / ".complete").exists()),
        key=lambda p: p.stat().st_mtime,
    )
    if not built:
        assert os.environ.get("REKINDLE_GPU_ROOTFS_BUILT") != "1", f"no complete rootfs in {cache}"
        pytest.skip(
            "the GPU root filesystem is not built here (make image-gpu-rootfs builds it "
            "and runs this test)"
        )
    out = built[-1]
    root = out / "rootfs"
    assert (root / CUDA_PLUGIN_DIR.lstrip("/") / "cuda_plugin.so").is_file()
    assert os.access(root / "opt/criu/patched/criu", os.X_OK)
    assert os.access(root / "usr/bin/vmtouch", os.X_OK)
    assert os.readlink(root / "usr/local/bin/rekindle") == "/opt/rekindle/venv/bin/rekindle"
    site = next((root / "opt/rekindle/venv/lib").glob("python3*/site-packages"))
    version = re.search(r":v([\d.]+)@", parse((GPU / "Dockerfile").read_text())[0]["VLLM_IMAGE"])
    assert version and (site / f"vllm-{version.group(1)}.dist-info").is_dir()
    assert list(site.glob("nvidia_cuda_runtime*.dist-info")), "not vLLM's CUDA build"
    assert (site / "rekindle_agent" / "checkpointing" / "gpu_preflight.py").is_file()
    assert not (site / "rekindle_operator").exists()
    cfg = json.loads((out / "image-config.json").read_text())
    assert cfg["Entrypoint"] == ["/usr/local/bin/rekindle", "agent"] and cfg["User"] == "0:0"


def test_the_image_states_the_driver_its_cuda_needs(
    dockerfile: tuple[dict[str, str], list[Stage]],
) -> None:
    """The preflight refuses below the image's own floor (CUDA 13: r580), not only the
    CUDA plugin's (r555): the image says which, beside the CUDA version it names."""
    env = " ".join(dockerfile[1][-1].all("ENV"))
    assert f"{gpu_preflight.DRIVER_FLOOR_ENV}=580" in env
    assert "CUDA 13.0 (NVIDIA driver 580 or newer)" in (GPU / "Dockerfile").read_text()
    assert gpu_preflight.driver_floor({gpu_preflight.DRIVER_FLOOR_ENV: "580"})[0] == 580
    assert gpu_preflight.driver_floor({})[0] == gpu_preflight.MIN_DRIVER_MAJOR
