"""The operator's managed-flag check agrees with vLLM's own argument parser.

spec.vllmArgs go after the flags the agent sets, so a later spelling that vLLM
reads as one of them would win: `--hos 0.0.0.0` opens vLLM's control routes on
the pod IP. The operator refuses such arguments (rekindle_contract.vllm_argv.
managed_flag, at `kubectl apply` and at reconcile) by emulating vLLM's rules
(`_` read as `-`, unique prefixes, aliases). This test asks vLLM's parser
itself, on every spelling of every managed flag: whatever changes a managed
setting of the agent's argv must be refused. Parsing only (no server, no model
load); vLLM's parser is too slow to import (about 10 s here) to run in every
pod's start, so it runs here, against the pinned vLLM.
"""

from __future__ import annotations

from argparse import Namespace
from typing import Any

import pytest
from rekindle_contract.vllm_argv import (
    MANAGED_VLLM_ALIASES,
    MANAGED_VLLM_FLAGS,
    VllmOptions,
    managed_flag,
    vllm_argv,
)

pytestmark = [pytest.mark.vllm]

# A value for each managed flag that differs from what the agent's argv sets.
VALUES = {
    "--model": "/elsewhere",
    "--served-model-name": "other",
    "--host": "0.0.0.0",
    "--port": "1",
    "--tensor-parallel-size": "2",
    "--mm-processor-cache-type": "shm",
    "--mm-processor-cache-gb": "7",
    "--mm-shm-cache-max-object-size-mb": "9",
    "--worker-extension-cls": "evil.Extension",
    "--enable-sleep-mode": None,  # a switch
    "--kv-offloading-size": "3",
    "--kv-offloading-backend": "lmcache",
    "--allowed-media-domains": "evil.example",
    "--enable-lora": None,  # a switch
    "--max-loras": "3",
    "--max-lora-rank": "64",
    "--lora-modules": "evil=/elsewhere",
}


@pytest.fixture(scope="module")
def parse() -> Any:
    """vLLM's own parser for its OpenAI server, as `vllm serve` builds it."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser())

    def run(args: list[str]) -> Namespace | None:
        try:
            return parser.parse_args(args)
        except SystemExit:  # vLLM would refuse to start: nothing is changed
            return None

    return run


def agent_args() -> list[str]:
    argv = vllm_argv(
        VllmOptions(
            model="/models/tiny",
            served_name="tiny",
            host="127.0.0.1",
            port=18000,
            device="cuda",  # sets --enable-sleep-mode, the switch a user could turn off
            worker_extension="rekindle_agent.worker.vllm_extension.RekindleWorkerExtension",
        ),
        python="python",
    )
    return argv[argv.index("vllm.entrypoints.openai.api_server") + 1 :]


def dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def spellings(flag: str) -> list[str]:
    """Every way to write flag that vLLM might read as it: prefixes, `_` for `-`, and
    the `--no-` form of a switch."""
    out = set()
    for base in (flag, "--no-" + flag[2:]):
        for end in range(3, len(base) + 1):
            prefix = base[:end]
            out |= {prefix, prefix[:2] + prefix[2:].replace("-", "_")}
    return sorted(out)


def cases() -> list[tuple[str, list[str]]]:
    out = []
    for flag, value in VALUES.items():
        for spelled in spellings(flag):
            out.append((flag, [spelled] if value is None else [spelled, value]))
            if value is not None:
                out.append((flag, [f"{spelled}={value}"]))
    for alias, flag in MANAGED_VLLM_ALIASES.items():
        out += [(flag, [alias, "2"]), (flag, [f"{alias}=2"])]
    return out


def test_every_managed_flag_has_a_value_here() -> None:
    assert set(VALUES) == set(MANAGED_VLLM_FLAGS) - {"--config"}


def test_whatever_vllm_reads_as_a_managed_flag_is_refused(parse: Any) -> None:
    base = agent_args()
    want = parse(base)
    assert want is not None and want.host == "127.0.0.1" and want.enable_sleep_mode is True
    managed = [dest(f) for f in VALUES]
    changing, missed = [], []
    for _flag, extra in cases():
        got = parse(base + extra)
        if got is None:
            continue
        changed = [d for d in managed if getattr(got, d) != getattr(want, d)]
        if changed:
            changing.append(extra)
            if managed_flag(extra[0]) is None:
                missed.append((extra, changed))
    assert not missed, (
        f"vLLM reads these as managed flags, the operator lets them through: {missed}"
    )
    # The test has teeth: many spellings do change a managed setting in vLLM.
    assert len(changing) > 100, changing


def test_a_config_file_is_refused(parse: Any, tmp_path: Any) -> None:
    """vLLM reads flags from --config; the agent's own flags still win over the file,
    but the ones it leaves at vLLM's default would not, so --config is refused."""
    conf = tmp_path / "vllm.yaml"
    conf.write_text("host: 0.0.0.0\nkv-offloading-size: 3\n")
    got = parse([*agent_args(), "--config", str(conf)])
    assert got is not None and got.host == "127.0.0.1"  # the agent's flag wins
    assert got.kv_offloading_size == 3  # a flag it does not set: the file's
    assert managed_flag("--config") == "--config"
    assert managed_flag(f"--config={conf}") == "--config"
