"""deploy/: the node configs, the scripts, the systemd unit and the DaemonSet are what the daemon accepts.

Every node config (and the one inside the DaemonSet's ConfigMap) passes the daemon's own
config check; the shell scripts pass ``bash -n`` and shellcheck (when installed); the unit
parses (systemd-analyze verify when available); the manifest is a ConfigMap and a DaemonSet
wired the way the daemon needs. deploy/torchrun.sh really runs here: a daemon, torchrun with
two ranks that snapshot and commit, the wait, the shutdown, and nothing left behind. Slurm
is not installed here, so deploy/slurm.sbatch is only checked statically, and for its refusal
to run outside a job.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

import datastates
from datastates.daemon.config import from_mapping

REPO = Path(__file__).resolve().parent.parent
DEPLOY = REPO / "deploy"
BIN = Path(sys.executable).parent
TRAIN = Path(__file__).resolve().parent / "deploy_train.py"
SCRIPTS = sorted([*DEPLOY.glob("*.sh"), *DEPLOY.glob("*.sbatch")])
NODE_CONFIGS = sorted(DEPLOY.glob("node*.yaml"))
PLACEHOLDER = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")
PER_JOB = {"node-slurm.yaml", "node-torchrun.yaml"}


def render(text: str, env: dict[str, str]) -> str:
    """The scripts' substitution: ${NAME} from env, ${NAME:-default} else its default; comments untouched."""
    def value(m: re.Match) -> str:
        v = env.get(m.group(1)) or m.group(2)
        assert v is not None, f"${{{m.group(1)}}} has no test value and no default"
        return v

    return "".join(line if line.lstrip().startswith("#") else PLACEHOLDER.sub(value, line)
                   for line in text.splitlines(keepends=True))


def manifest() -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((DEPLOY / "k8s-daemonset.yaml").read_text()) if d]


def of_kind(kind: str) -> dict[str, Any]:
    (doc,) = [d for d in manifest() if d["kind"] == kind]
    return doc


# -- node configs ----------------------------------------------------------------------------------


def test_the_daemonset_sees_every_gpu_without_taking_one_from_the_trainers() -> None:
    """The daemon opens trainers' CUDA IPC handles on the GPU with the same UUID, so it must see all of them; a
    GPU request would take devices away from the trainers' pods instead."""
    pod = of_kind("DaemonSet")["spec"]["template"]["spec"]
    (daemon,) = [c for c in pod["containers"] if c["name"] == "datastatesd"]
    env = {e["name"]: e["value"] for e in daemon["env"]}
    assert env["NVIDIA_VISIBLE_DEVICES"] == "all" and "compute" in env["NVIDIA_DRIVER_CAPABILITIES"]
    assert pod["runtimeClassName"] == "nvidia"
    assert not any("nvidia.com/gpu" in str(c.get("resources", {})) for c in pod["containers"])


@pytest.mark.parametrize("path", NODE_CONFIGS, ids=lambda p: p.name)
def test_node_config_passes_the_daemons_check(path: Path, tmp_path: Path) -> None:
    """Each node*.yaml, its placeholders filled with test values, is a config the daemon accepts as it is."""
    text = render(path.read_text(), {"DATASTATES_ROOT": str(tmp_path / "ckpt")})
    data = yaml.safe_load(text)
    cfg = from_mapping(data)
    assert cfg.storage.roots and all(os.path.isabs(r) for r in cfg.storage.roots)
    if path.name in PER_JOB:  # the scripts give the endpoint through DATASTATES_ENDPOINT, per job
        assert "endpoint" not in data
        assert cfg.storage.roots == [os.path.realpath(tmp_path / "ckpt")]
    if path.name == "node-systemd.yaml":  # in the unit's RuntimeDirectory
        assert data["endpoint"] == "ipc:///run/datastates/datastatesd.sock"


def test_node_configs_cover_every_key() -> None:
    """deploy/node.yaml documents every plain key; each deploy config sets them all (the endpoint where it is fixed)."""
    keys = ["endpoint", "storage", "host_memory", "chunk_size", "copy_threads", "flush_threads", "direct_io",
            "prefault", "client_timeout", "commit_timeout", "log_level"]
    documented = (DEPLOY / "node.yaml").read_text()
    for key in keys:
        assert re.search(rf"^(# )?{key}:", documented, re.M), f"deploy/node.yaml does not document {key}"
    for path in NODE_CONFIGS:
        if path.name == "node.yaml":
            continue
        data = yaml.safe_load(render(path.read_text(), {"DATASTATES_ROOT": "/ckpt"}))
        expected = set(keys) - ({"endpoint"} if path.name != "node-systemd.yaml" else set())
        assert set(data) == expected, f"{path.name}: {sorted(set(data) ^ expected)}"


def test_configmap_is_node_k8s_yaml() -> None:
    """The ConfigMap's node.yaml is deploy/node-k8s.yaml, byte for byte, and passes the daemon's check."""
    embedded = of_kind("ConfigMap")["data"]["node.yaml"]
    assert embedded == (DEPLOY / "node-k8s.yaml").read_text()
    cfg = from_mapping(yaml.safe_load(embedded))
    assert cfg.storage.roots == ["/checkpoints"]


# -- shell scripts ---------------------------------------------------------------------------------


def test_the_scripts_are_there() -> None:
    assert {p.name for p in SCRIPTS} == {"torchrun.sh", "slurm.sbatch"}
    for p in SCRIPTS:
        assert os.access(p, os.X_OK), f"{p.name} is not executable"


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.name)
def test_script_parses(path: Path) -> None:
    run = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True, timeout=30)
    assert run.returncode == 0, run.stderr


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.name)
def test_script_passes_shellcheck(path: Path) -> None:
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed")
    run = subprocess.run(["shellcheck", "--shell=bash", str(path)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr


def test_sbatch_runs_every_step() -> None:
    """Slurm is not installed here: check that the script has each step, in order, the way it is launched."""
    text = (DEPLOY / "slurm.sbatch").read_text()
    body = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    assert "--ntasks-per-node=1" in body and "srun --overlap" in body
    steps = [
        r'on_every_node --output=.*\n.*\n.*\n\s*exec datastatesd --node-config "\$DATASTATES_RUNDIR/node.yaml"\' &',
        r"on_every_node datastatesctl --connect-timeout \"\$start_timeout\" status",
        r"srun --overlap .*--ntasks-per-node=1 .*\n\s*torchrun --nnodes=\"\$nodes\" --nproc-per-node=\"\$nproc\"",
        r"on_every_node datastatesctl wait --timeout \"\$wait_timeout\"",
        r"on_every_node datastatesctl shutdown",
        r"on_every_node rm -rf -- \"\$DATASTATES_RUNDIR\"",
    ]
    at = 0
    for step in steps:
        match = re.compile(step).search(body, at)
        assert match, f"slurm.sbatch: no {step!r} after offset {at}"
        at = match.end()
    assert re.search(r"^on_every_node\(\) \{\n\s*srun --overlap --nodes=\"\$nodes\" --ntasks=\"\$nodes\" --ntasks-per-node=1",
                     body, re.M)
    assert 'export DATASTATES_ENDPOINT=ipc://$DATASTATES_RUNDIR/datastatesd.sock' in body
    assert "datastates-$SLURM_JOB_ID" in body and "--rdzv-id=\"$SLURM_JOB_ID\"" in body
    assert "trap cleanup EXIT" in body and "#SBATCH --signal=B:USR1@" in text


def test_sbatch_refuses_to_run_outside_slurm(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env["DATASTATES_ROOT"] = str(tmp_path / "ckpt")
    run = subprocess.run(["bash", str(DEPLOY / "slurm.sbatch"), "train.py"], capture_output=True, text=True,
                         env=env, timeout=30)
    assert run.returncode == 2 and "not inside a Slurm job" in run.stderr, run.stderr
    assert not (tmp_path / "ckpt").exists()


# -- systemd ---------------------------------------------------------------------------------------


def unit_sections(text: str) -> dict[str, dict[str, list[str]]]:
    """A systemd unit as {section: {key: [values]}} (keys may repeat), with systemd's comment and continuation rules."""
    sections: dict[str, dict[str, list[str]]] = {}
    current = None
    logical: list[str] = []
    for raw in text.splitlines():
        if logical:
            logical.append(raw)
        elif raw.strip() and raw.lstrip()[0] not in "#;":
            logical = [raw]
        else:
            continue
        if raw.endswith("\\"):
            logical[-1] = raw[:-1]
            continue
        line, logical = " ".join(part.strip() for part in logical), []
        if line.startswith("["):
            assert line.endswith("]"), line
            current = sections.setdefault(line[1:-1], {})
            continue
        assert current is not None and "=" in line, f"not key=value in a section: {line!r}"
        key, value = line.split("=", 1)
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


def test_systemd_unit() -> None:
    unit = unit_sections((DEPLOY / "datastatesd.service").read_text())
    service = unit["Service"]
    (exec_start,) = service["ExecStart"]
    argv = exec_start.split()
    assert Path(argv[0]).name == "datastatesd" and argv[1:] == ["--node-config", "/etc/datastates/node.yaml"]
    assert service["KillSignal"] == ["SIGTERM"]
    assert service["RuntimeDirectory"] == ["datastates"] and service["RuntimeDirectoryMode"] == ["0700"]
    assert service["Restart"] == ["on-failure"] and service["RestartPreventExitStatus"] == ["2"]
    assert service["User"] and service["User"] != ["root"]
    timeout = service["TimeoutStopSec"][0]
    minutes = re.fullmatch(r"(\d+)min", timeout)
    assert minutes and int(minutes.group(1)) >= 5, f"TimeoutStopSec={timeout} leaves too little for a drain"
    assert service.get("RemoveIPC", ["no"]) == ["no"] and service.get("PrivateIPC", ["no"]) == ["no"]
    assert unit["Install"]["WantedBy"] == ["multi-user.target"]
    endpoint = yaml.safe_load((DEPLOY / "node-systemd.yaml").read_text())["endpoint"]
    assert os.path.dirname(endpoint.removeprefix("ipc://")) == "/run/" + service["RuntimeDirectory"][0]


def test_systemd_analyze_verify(tmp_path: Path) -> None:
    """systemd's own parser finds nothing to complain about (with ExecStart pointing at this venv's datastatesd)."""
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed")
    text = (DEPLOY / "datastatesd.service").read_text()
    text = re.sub(r"^ExecStart=\S+", f"ExecStart={BIN / 'datastatesd'}", text, flags=re.M)
    unit = tmp_path / "datastatesd.service"
    unit.write_text(text)
    run = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60)
    about_ours = [ln for ln in (run.stdout + run.stderr).splitlines() if "datastatesd.service" in ln]
    assert run.returncode == 0 and not about_ours, run.stdout + run.stderr


# -- Kubernetes ------------------------------------------------------------------------------------


def test_daemonset() -> None:
    assert sorted(d["kind"] for d in manifest()) == ["ConfigMap", "DaemonSet"]
    ds = of_kind("DaemonSet")
    assert ds["apiVersion"] == "apps/v1"
    spec = ds["spec"]["template"]["spec"]
    assert spec["hostIPC"] is True  # the host's /dev/shm, shared with the trainer pods
    assert spec["terminationGracePeriodSeconds"] >= 300
    assert spec["securityContext"]["runAsUser"] not in (None, 0)
    (container,) = spec["containers"]
    assert container["lifecycle"]["preStop"]["exec"]["command"] == ["datastatesctl", "shutdown"]
    assert container["command"][0] == "datastatesd" and container["command"][1] == "--node-config"
    env = {e["name"]: e["value"] for e in container["env"]}
    socket_dir = os.path.dirname(env["DATASTATES_ENDPOINT"].removeprefix("ipc://"))
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in spec["volumes"]}
    # the config comes from the ConfigMap, at the path the command reads
    (config_vol,) = [n for n, v in volumes.items() if "configMap" in v]
    assert volumes[config_vol]["configMap"]["name"] == of_kind("ConfigMap")["metadata"]["name"]
    assert os.path.join(mounts[config_vol], "node.yaml") == container["command"][2]
    # the socket folder is a hostPath (shared with trainer pods), made the daemon user's by the init container
    (run_vol,) = [n for n, p in mounts.items() if p == socket_dir]
    assert volumes[run_vol]["hostPath"]["path"] == socket_dir
    init = " ".join(spec["initContainers"][0]["command"])
    uid = spec["securityContext"]["runAsUser"]
    assert f"chown {uid}:" in init and "chmod 0700" in init
    # the checkpoint root is mounted where the config says
    roots = yaml.safe_load(of_kind("ConfigMap")["data"]["node.yaml"])["storage"]["roots"]
    assert all(root in mounts.values() for root in roots)
    limit = container["resources"]["limits"]["memory"]
    cfg = from_mapping(yaml.safe_load(of_kind("ConfigMap")["data"]["node.yaml"]))
    assert int(limit.removesuffix("Gi")) << 30 > cfg.host_memory


# -- deploy/torchrun.sh, for real --------------------------------------------------------------------


def run_script(args: list[str], root: Path, rundir: Path, log: Path | None = None, timeout: float = 240,
               **extra: str) -> subprocess.CompletedProcess:
    """deploy/torchrun.sh with this venv on PATH, small memory, short timeouts; on a hang, kill what it started."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DATASTATES_", "TORCHELASTIC_", "SLURM_"))}
    env |= {"PATH": f"{BIN}{os.pathsep}{env.get('PATH', '/usr/bin:/bin')}", "DATASTATES_ROOT": str(root),
            "DATASTATES_RUNDIR": str(rundir), "DATASTATES_HOST_MEMORY": "64MiB", "DATASTATES_CHUNK_SIZE": "4MiB",
            "DATASTATES_COMMIT_TIMEOUT": "5", "DATASTATES_STOP_TIMEOUT": "60", "DATASTATES_WAIT_TIMEOUT": "120"} | extra
    if log is not None:
        env["DATASTATES_LOG"] = str(log)
    proc = subprocess.Popen([str(DEPLOY / "torchrun.sh"), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, cwd=root.parent, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the script, torchrun and its workers
        out, err = proc.communicate()
        match = re.search(r"datastatesd (\d+) ready on ipc://", err)
        if match:  # the daemon runs in a session of its own
            try:
                if str(rundir).encode() in Path(f"/proc/{match.group(1)}/cmdline").read_bytes():
                    os.kill(int(match.group(1)), signal.SIGKILL)
            except (FileNotFoundError, ProcessLookupError):
                pass
        pytest.fail(f"deploy/torchrun.sh still running after {timeout} s:\n{out}\n{err}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def daemon_pid(stderr: str) -> int:
    match = re.search(r"datastatesd (\d+) ready on ipc://", stderr)
    assert match, stderr
    return int(match.group(1))


def assert_gone(pid: int, config: Path) -> None:
    """No process ``pid`` left running datastatesd on ``config`` (a reused pid would run something else)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except FileNotFoundError:
        return
    assert str(config).encode() not in cmdline, f"datastatesd {pid} still running"


@pytest.mark.heavy
def test_torchrun_script_end_to_end(tmp_path: Path, short_tmp: Path) -> None:
    """Two ranks snapshot and commit through the daemon the script started; it exits 0 and leaves nothing behind."""
    root, rundir, log = tmp_path / "ckpt", short_tmp / "run", tmp_path / "datastatesd.log"
    run = run_script(["--standalone", "--nproc-per-node", "2", str(TRAIN), str(root)], root, rundir, log)
    assert run.returncode == 0, run.stdout + run.stderr
    for rank in (0, 1):
        state = datastates.load(root / "step1" / f"rank{rank}.pt")
        assert state["rank"] == rank
        g = torch.Generator().manual_seed(rank)
        assert torch.equal(state["weight"], torch.randn(256, 64, generator=g))
        assert torch.equal(state["bias"], torch.full((64,), float(rank)))
    assert run.stderr.count("step1 committed") == 2
    assert_gone(daemon_pid(run.stderr), rundir / "node.yaml")
    assert not rundir.exists(), f"left behind: {list(rundir.iterdir())}"
    assert not list(short_tmp.rglob("*.sock"))
    text = log.read_text()
    assert "draining" in text and "datastatesd stopped" in text and "ERROR" not in text
    assert "datastatesd stopped (status 0)" in run.stderr


@pytest.mark.heavy
def test_torchrun_script_passes_torchrun_failure_on(tmp_path: Path, short_tmp: Path) -> None:
    """A rank that fails: the script exits with torchrun's status, and still stops its daemon after the drain."""
    root, rundir = tmp_path / "ckpt", short_tmp / "run"
    run = run_script(["--standalone", "--nproc-per-node", "2", str(TRAIN), str(root), "--fail", "3"], root, rundir)
    assert run.returncode == 1, run.stdout + run.stderr  # torchrun's status for a failed worker
    assert "torchrun exited with status 1" in run.stderr
    assert datastates.load(root / "step1" / "rank1.pt")["rank"] == 1  # admitted before the rank failed: written
    assert_gone(daemon_pid(run.stderr), rundir / "node.yaml")
    assert "datastatesd stopped (status 0)" in run.stderr
    assert not rundir.exists()


def test_torchrun_script_stops_when_the_daemon_cannot_start(tmp_path: Path, short_tmp: Path) -> None:
    """A bad config: the daemon exits 2, the script says so with the daemon's log, never runs torchrun, cleans up."""
    root, rundir = tmp_path / "ckpt", short_tmp / "run"
    run = run_script([str(TRAIN), str(root)], root, rundir, timeout=120, DATASTATES_HOST_MEMORY="1KiB")
    assert run.returncode == 2, run.stdout + run.stderr
    assert "datastatesd exited with status 2 before it answered" in run.stderr
    assert "host_memory" in run.stderr  # the daemon's own message, from the log tail
    assert "ready on" not in run.stderr and not (root / "step1").exists()
    assert not rundir.exists()


def test_torchrun_script_needs_a_root(short_tmp: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DATASTATES_")}
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    run = subprocess.run([str(DEPLOY / "torchrun.sh"), "train.py"], capture_output=True, text=True, env=env,
                         timeout=30, cwd=short_tmp)
    assert run.returncode == 2 and "set DATASTATES_ROOT" in run.stderr, run.stderr
    assert list(short_tmp.iterdir()) == []
