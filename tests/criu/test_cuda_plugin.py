"""CRIU's CUDA plugin, wired the way the agent wires it, run for real on a machine without a GPU.

The plugin is the one scripts/build-criu builds (patched/plugins/cuda_plugin.so),
loaded with -L as the agent passes it. Two things stand in for a GPU, both
shipped by CRIU for its own tests: the mock `cuda-checkpoint` (test/cuda-checkpoint,
built by `scripts/build-criu --cuda-mock`), wrapped here so every call it gets
is logged, and fault injection 138 (CRIU_FAULT=138), which turns the plugin on
although /proc/driver/nvidia/gpus does not exist. What this proves: the plugin
loads from the directory given, finds cuda-checkpoint through CRIU's PATH, and
calls lock and checkpoint for the dumped process and restore and unlock for the
restored one, while the process's memory survives the round trip. What it
cannot prove: anything about real device memory (docs/gpu.md).
"""

import os
import subprocess
import time
from pathlib import Path

import pytest
from rekindle_contract.gpu_map import device_map

from .criu_helpers import CRIU_TIMEOUT, Flavor, Probe, cmdline_has, criu, log_tail, wait_gone

pytestmark = pytest.mark.criu

REPO = Path(__file__).resolve().parents[2]
FORCE_ENABLE = "138"  # FI_PLUGIN_CUDA_FORCE_ENABLE in CRIU 4.2.1's fault-injection.h
LATE_RESUME_FAILED = "cuda_plugin: compel_wait_task failed after interrupt"
DUMPED_ON = "GPU-b87c6cdd-84d9-f52b-9eec-9be13420493a"  # UUIDs of the form the driver gives
POD_GPU = "GPU-e47a65c8-db51-ea8e-01ba-0568c2634db2"


@pytest.fixture(scope="module")
def mock_dir() -> Path:
    """Directory of CRIU's mock cuda-checkpoint (built once, cached)."""
    res = subprocess.run(
        [str(REPO / "scripts" / "build-criu"), "--cuda-mock"],
        stdout=subprocess.PIPE,
        text=True,
        timeout=600,
        check=False,
    )
    assert res.returncode == 0, "scripts/build-criu --cuda-mock failed (see stderr)"
    d = Path(res.stdout.strip().splitlines()[-1])
    assert os.access(d / "cuda-checkpoint", os.X_OK), d
    return d


def wrap_mock(
    mock_dir: Path, bindir: Path, calls: Path, device_map: bool = True, fail_restore: bool = False
) -> None:
    """bindir/cuda-checkpoint: logs its argv, then runs the mock. device_map: it says it
    takes --device-map (in -h, as NVIDIA's r580 tool does) and drops the option and its
    value before the mock, which knows neither. fail_restore: the restore action fails as
    the driver's did on an H100 (a map naming a GPU the process never used), after which
    --get-state answers 'checkpointed', as the driver did."""
    bindir.mkdir(exist_ok=True)
    failed = bindir / "restore-failed"
    fails = (
        f'case " $* " in *" --action restore "*) echo "restore: CUDA_ERROR_INVALID_VALUE (1)"; '
        f"touch {failed}; exit 1;; esac\n"
        f'case " $* " in *" --get-state "*) if [ -e {failed} ]; then echo checkpointed; '
        "exit 0; fi;; esac\n"
        if fail_restore
        else ""
    )
    takes_map = 'if [ "$1" = -h ]; then echo " --device-map <uuids>"; fi\n' if device_map else ""
    drop_map = (
        "skip=0\nfor a do\n\tshift\n\tif [ $skip = 1 ]; then skip=0; continue; fi\n"
        '\tif [ "$a" = --device-map ]; then skip=1; continue; fi\n\tset -- "$@" "$a"\ndone\n'
    )
    wrapper = bindir / "cuda-checkpoint"
    wrapper.write_text(
        f'#!/bin/sh\necho "$*" >>{calls}\n{fails}{takes_map}{drop_map}'
        f'exec {mock_dir / "cuda-checkpoint"} "$@"\n'
    )
    wrapper.chmod(0o755)


@pytest.fixture
def logged_bin(mock_dir: Path, tmp_path: Path) -> tuple[Path, Path]:
    """(a bin dir whose cuda-checkpoint logs its argv then runs the mock, the call log)."""
    bindir, calls = tmp_path / "bin", tmp_path / "calls.log"
    wrap_mock(mock_dir, bindir, calls)
    return bindir, calls


def run_criu(
    flavor: Flavor,
    args: list[str],
    path_first: Path | None,
    fault: bool,
    extra_env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """CRIU with the plugin dir, cuda-checkpoint's dir first on its PATH (path_first None:
    no cuda-checkpoint on its PATH at all, though this machine may have one), maybe fault 138."""
    env = {k: v for k, v in os.environ.items() if k not in ("CRIU_FAULT", "CRIU_CUDA_DEVICE_MAP")}
    env.update(extra_env or {})
    path = env.get("PATH", "/usr/bin:/bin")
    if path_first is not None:
        env["PATH"] = f"{path_first}:{path}"
    else:
        dirs = [d for d in path.split(":") if d and not (Path(d) / "cuda-checkpoint").exists()]
        env["PATH"] = ":".join(dirs)
    if fault:
        env["CRIU_FAULT"] = FORCE_ENABLE
    return criu(flavor, *args, "-L", str(flavor.criu.parent / "plugins"), "-v4", env=env)


def calls_of(calls: Path) -> list[str]:
    return calls.read_text().splitlines() if calls.exists() else []


def test_plugin_checkpoint_and_restore_with_mock(
    patched: Flavor, probe: Probe, logged_bin: tuple[Path, Path], tmp_path: Path
) -> None:
    bindir, calls = logged_bin
    images = tmp_path / "images"
    images.mkdir()
    probe.start()
    probe.verify_all()
    root = probe.root

    res = run_criu(
        patched, ["dump", "-t", str(root), "-D", str(images), "-o", "dump.log"], bindir, True
    )
    dump_log = (images / "dump.log").read_text()
    assert res.returncode == 0, log_tail(images / "dump.log")
    assert "cuda_plugin: initialized: cuda_plugin stage 0" in dump_log
    assert f"cuda_plugin: pausing devices on pid {root}" in dump_log
    assert f"cuda_plugin: Checkpointing CUDA devices on pid {root}" in dump_log
    assert "cuda_plugin: finished cuda_plugin stage 0 err 0" in dump_log
    dumped = calls_of(calls)
    assert f"--action lock --pid {root} --timeout 10000" in dumped, dumped
    assert f"--action checkpoint --pid {root}" in dumped, dumped
    assert not any("--action restore" in c or "--action unlock" in c for c in dumped), dumped
    if probe.popen is not None:
        probe.popen.wait(timeout=30)
    wait_gone(root)

    calls.unlink()
    res = run_criu(
        patched,
        [
            "restore",
            "-D",
            str(images),
            "-d",
            "--pidfile",
            str(images / "restore.pid"),
            "-o",
            "restore.log",
            *patched.restore_args,
        ],
        bindir,
        True,
    )
    restore_log = (images / "restore.log").read_text()
    assert res.returncode == 0, log_tail(images / "restore.log")
    assert int((images / "restore.pid").read_text()) == root
    assert cmdline_has(root, Probe.NAME)
    assert "cuda_plugin: initialized: cuda_plugin stage 2" in restore_log
    assert f"cuda_plugin: resuming devices on pid {root}" in restore_log
    restored = calls_of(calls)
    i_restore = restored.index(f"--action restore --pid {root}")
    i_unlock = restored.index(f"--action unlock --pid {root}")
    assert i_restore < i_unlock, restored
    probe.verify_all()  # the process's memory came back as it was


def test_plugin_disables_itself_without_gpu_or_cuda_checkpoint(
    patched: Flavor, probe: Probe, logged_bin: tuple[Path, Path], tmp_path: Path
) -> None:
    """The silent failures the agent's preflight exists for: the plugin loads, says why it is
    off in CRIU's log, and never calls cuda-checkpoint; the dump still succeeds."""
    bindir, calls = logged_bin
    probe.start()
    cases = {
        "no-gpu": (bindir, False, "No GPU device found; CUDA plugin is disabled"),
        "no-cuda-checkpoint": (None, True, "check that cuda-checkpoint is present in $PATH"),
    }
    for name, (path_first, fault, said) in cases.items():
        images = tmp_path / name
        images.mkdir()
        dump = ["dump", "-t", str(probe.root), "-D", str(images), "-o", "dump.log"]
        res = run_criu(patched, [*dump, "--leave-running"], path_first, fault)
        text = (images / "dump.log").read_text()
        assert res.returncode == 0, log_tail(images / "dump.log")
        assert said in text, name
        assert "cuda_plugin: initialized" not in text, name
        assert calls_of(calls) == [], calls_of(calls)
    probe.verify_all()


def test_the_agents_own_criu_command_lines_drive_the_plugin(
    patched: Flavor, probe: Probe, logged_bin: tuple[Path, Path], tmp_path: Path
) -> None:
    """The exact argv the agent runs for a GPU checkpoint and restore (criu.dump_argv and
    restore_argv with the plugin dir, wrapped by gpu_preflight.criu_env_argv), run for real.
    A GPU restore does not leave the tree stopped (see the next test)."""
    from rekindle_agent.checkpointing import criu as agent_criu
    from rekindle_agent.checkpointing import gpu_preflight

    bindir, calls = logged_bin
    plugins = str(patched.criu.parent / "plugins")
    images = tmp_path / "images"
    images.mkdir()
    run = tmp_path / "agent-run"
    run.mkdir()
    env = {**{k: v for k, v in os.environ.items() if k != "CRIU_FAULT"}, "CRIU_FAULT": FORCE_ENABLE}
    cc = str(bindir / "cuda-checkpoint")
    probe.start()
    root = probe.root

    dump = agent_criu.dump_argv(
        str(patched.criu), root, str(images), str(images / "dump.log"), plugins=plugins
    )
    dump = gpu_preflight.criu_env_argv(dump, cc, env.get("PATH"))
    res = subprocess.run(dump, env=env, capture_output=True, text=True, timeout=CRIU_TIMEOUT)
    assert res.returncode == 0, log_tail(images / "dump.log")
    assert f"--action checkpoint --pid {root}" in calls_of(calls)
    if probe.popen is not None:
        probe.popen.wait(timeout=30)
    wait_gone(root)

    restore = agent_criu.restore_argv(
        str(patched.criu),
        str(images),
        str(run / "restore.log"),
        str(run / "restore.pid"),
        mmap=True,
        plugins=plugins,
        stopped=False,
    )
    assert "--leave-stopped" not in restore
    # Restored onto another GPU than the one it was dumped on: the map reaches the restore.
    gpu_map = device_map(DUMPED_ON, [POD_GPU])
    restore = gpu_preflight.criu_env_argv(restore, cc, env.get("PATH"), gpu_map)
    res = subprocess.run(restore, env=env, capture_output=True, text=True, timeout=CRIU_TIMEOUT)
    assert res.returncode == 0, log_tail(run / "restore.log")
    assert int((run / "restore.pid").read_text()) == root
    text = (run / "restore.log").read_text()
    assert f"cuda_plugin: resuming devices on pid {root}" in text
    assert f"restoring pid {root} with device map {DUMPED_ON}={POD_GPU}" in text
    assert "cuda_plugin: finished cuda_plugin stage 2 err 0" in text
    assert f"--action restore --pid {root} --device-map {DUMPED_ON}={POD_GPU}" in calls_of(calls)
    assert f"--action unlock --pid {root}" in calls_of(calls)
    probe.verify_all()


def dumped(patched: Flavor, probe: Probe, bindir: Path, images: Path) -> int:
    """Start the probe, dump it into images with the plugin (bindir's cuda-checkpoint,
    fault 138) and wait until it is gone; its PID, which the restore brings back."""
    images.mkdir()
    probe.start()
    root = probe.root
    res = run_criu(
        patched, ["dump", "-t", str(root), "-D", str(images), "-o", "dump.log"], bindir, True
    )
    assert res.returncode == 0, log_tail(images / "dump.log")
    if probe.popen is not None:
        probe.popen.wait(timeout=30)
    wait_gone(root)
    return root


def test_a_device_map_without_a_cuda_checkpoint_that_takes_it_refuses_the_restore(
    patched: Flavor, probe: Probe, mock_dir: Path, tmp_path: Path
) -> None:
    """A cuda-checkpoint older than r580 has no --device-map: restoring onto the dump-time
    GPU instead of the pod's would be silently wrong, so the plugin refuses the restore
    before any action; the same images then restore without a map (nothing lost)."""
    bindir, calls = tmp_path / "bin", tmp_path / "calls.log"
    wrap_mock(mock_dir, bindir, calls, device_map=False)
    images = tmp_path / "images"
    root = dumped(patched, probe, bindir, images)
    calls.unlink()
    restore = ["restore", "-D", str(images), "-d", "--pidfile", str(images / "pid")]
    with_map = {"CRIU_CUDA_DEVICE_MAP": f"{DUMPED_ON}={POD_GPU}"}
    res = run_criu(patched, [*restore, "-o", "refused.log"], bindir, True, with_map)
    assert res.returncode != 0
    text = (images / "refused.log").read_text()
    assert "CRIU_CUDA_DEVICE_MAP is set but cuda-checkpoint has no --device-map" in text
    assert not any("--action" in c for c in calls_of(calls)), calls_of(calls)
    assert not cmdline_has(root, Probe.NAME)
    res = run_criu(patched, [*restore, "-o", "restore.log"], bindir, True)
    assert res.returncode == 0, log_tail(images / "restore.log")
    assert f"--action restore --pid {root}" in calls_of(calls)
    probe.verify_all()


def _children(pid: int) -> list[int]:
    kids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    kids.append(int(d.name))
            except (OSError, IndexError, ValueError):
                continue  # gone meanwhile
    return kids


def _deadlocked(criu_pid: int, root: int) -> str | None:
    """None when CRIU is stuck for good: its only thread blocks in wait4() for a ptrace stop
    of the restored task, its only child, which it traces and which runs its own code (out
    of any stop), and nothing else signals it; else what is not so yet."""
    try:
        if os.listdir(f"/proc/{criu_pid}/task") != [str(criu_pid)]:
            return "CRIU runs several threads"
        if Path(f"/proc/{criu_pid}/syscall").read_text().split()[0] != "61":  # wait4, x86_64
            return "CRIU is not in wait4()"
        if _children(criu_pid) != [root]:
            return f"CRIU's children are {_children(criu_pid)}, not just {root}"
        for t in os.listdir(f"/proc/{root}/task"):
            status = Path(f"/proc/{root}/task/{t}/status").read_text()
            state = status.split("State:", 1)[1].split()[0]
            tracer = int(status.split("TracerPid:", 1)[1].split()[0])
            if tracer != criu_pid or state in ("t", "T"):
                return f"task {t}: state {state}, traced by {tracer}"
    except OSError as e:
        return str(e)
    return None


def test_leave_stopped_hangs_the_plugins_late_resume(
    patched: Flavor, probe: Probe, logged_bin: tuple[Path, Path], tmp_path: Path
) -> None:
    """Why the agent restores a GPU tree without --leave-stopped: with it, CRIU 4.2.1 has
    sent every task SIGSTOP before the CUDA plugin's late hook resumes a thread of the task
    and interrupts it again, and the plugin's wait for that interrupt goes wrong, one way
    or the other by a race: CRIU waits for the thread for ever (shown by the state, not a
    timeout: CRIU blocked in wait4() for a stop of the one task it traces, which runs
    free, with no one left to stop it), or the wait fails and the plugin logs so. If a
    CRIU update fixes this, the restore ends without that error and this test fails, and
    the agent can leave GPU trees stopped again."""
    bindir, calls = logged_bin
    images = tmp_path / "images"
    images.mkdir()
    probe.start()
    root = probe.root
    dump = ["dump", "-t", str(root), "-D", str(images), "-o", "dump.log"]
    assert run_criu(patched, dump, bindir, True).returncode == 0, log_tail(images / "dump.log")
    if probe.popen is not None:
        probe.popen.wait(timeout=30)
    wait_gone(root)
    restore = ["restore", "-D", str(images), "-d", "-o", "restore.log", "--leave-stopped"]
    proc = subprocess.Popen(
        [str(patched.criu), *restore, "-L", str(patched.criu.parent / "plugins"), "-v4"],
        env={**os.environ, "PATH": f"{bindir}:{os.environ['PATH']}", "CRIU_FAULT": "138"},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    log = images / "restore.log"
    try:
        deadline = time.monotonic() + CRIU_TIMEOUT
        while True:
            if proc.poll() is not None:
                assert LATE_RESUME_FAILED in log.read_text(), (
                    f"criu restore --leave-stopped exited {proc.returncode} without the "
                    f"plugin's error: fixed? {log_tail(log)}"
                )
                break
            text = log.read_text() if log.exists() else ""
            # The plugin's actions ran (unlock last); then the wait that does not end.
            done = text.rstrip().endswith(
                f"Restore thread pid {root} found for real pid {root}"
            ) and f"--action unlock --pid {root}" in calls_of(calls)
            why = _deadlocked(proc.pid, root) if done else "the restore is still running"
            if why is None:
                break
            assert time.monotonic() < deadline, f"{why}: {text[-300:]}"
            time.sleep(0.05)
    finally:
        proc.kill()
        proc.wait()


def test_a_failed_cuda_resume_is_found_right_after_criu_which_exits_0(
    patched: Flavor, probe: Probe, mock_dir: Path, tmp_path: Path
) -> None:
    """CRIU 4.2.1 exits 0 although the plugin's restore action failed (on an H100 the
    process then stayed 'checkpointed' and never answered). The agent asks cuda-checkpoint
    for the restored tree's state right after CRIU (restoring/cuda_resume.py) and finds
    the failure there, instead of waiting for vLLM's health to time out."""
    from rekindle_agent.process_tree import proctree
    from rekindle_agent.restoring import cuda_resume

    bindir, calls = tmp_path / "bin", tmp_path / "calls.log"
    wrap_mock(mock_dir, bindir, calls, fail_restore=True)
    images = tmp_path / "images"
    root = dumped(patched, probe, bindir, images)
    cc = str(bindir / "cuda-checkpoint")
    restore = ["restore", "-D", str(images), "-d", "--pidfile", str(images / "pid")]
    res = run_criu(patched, [*restore, "-o", "restore.log"], bindir, True)
    text = (images / "restore.log").read_text()
    assert res.returncode == 0, "CRIU now fails a failed CUDA resume itself: see the docstring"
    assert "RESUME_DEVICES RESTORE failed with restore: CUDA_ERROR_INVALID_VALUE" in text
    assert cuda_resume.states(cc, [root]) == {root: "checkpointed"}
    assert f"pid {root} is checkpointed" in cuda_resume.not_resumed(
        cuda_resume.states(cc, proctree.tree(root))
    )
